"""A mixture-of-experts layer's experts as one op, so expert parallelism can be planned.

HuggingFace's MoE models (Mixtral, Qwen-MoE, OLMoE, DeepSeek, ...) hold their experts in one
module whose parameters are stacked per expert: ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]``, called as ``experts(hidden [T, D], top_k_index [T, k],
top_k_weights [T, k]) -> [T, D]``. Traced as written, they become a data-dependent sort,
index, ``histc`` and a grouped matmul: sharding the experts over devices (expert
parallelism, Lepikhin et al., "GShard", ICLR'21; Fedus et al., "Switch Transformers",
JMLR'22) is then not a placement of any one op.

While tracing, :func:`experts_traced` makes each such module one op,
``autoshard::moe_experts`` (and its gradient ``autoshard::moe_experts_backward``), with
the same inputs and output as the module. For token ``t`` and slot ``j`` routed to expert
``e = top_k_index[t, j]``::

    y[t] = sum_j top_k_weights[t, j] * down_proj[e] @ (act(gate) * up),
    gate, up = (gate_up_proj[e] @ hidden[t]).chunk(2)

which is HuggingFace's eager loop (``MixtralExperts.forward``). The strategies
(:mod:`autoshard.strategies.experts`) place it per mesh dim: replicated, data parallel
(tokens split, experts whole), expert parallel with an all-to-all dispatch and combine
(tokens and experts split), or experts split over replicated tokens (each device adds its
experts' share: a ``Partial`` sum). The launcher runs :func:`experts_local` on each rank's
shards, exchanging tokens with ``all_to_all_single`` (:class:`Exchange`).

The backward op recomputes the experts' forward from its inputs where the experts are (the
op saves only its inputs, as activation checkpointing of the experts would): its FLOPs are
priced as run
(:func:`experts_flops`), while ``FlopCounterMode`` counts the model's FLOPs (forward
``6 T k I D``, backward twice that), as it counts HuggingFace's eager loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from autoshard._torch_private import all_to_all_uneven, autograd_inside_op

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""Expert activations the fused op knows, by HuggingFace's ``hidden_act`` name."""


@dataclass(frozen=True)
class Exchange:
    """The token exchange of expert parallelism: this rank's group of ``size`` ranks along
    one mesh dim, each holding ``num_experts / size`` consecutive experts (rank ``rank``
    the ``rank``-th block) and its own tokens."""

    group: Any  # a torch.distributed ProcessGroup
    size: int
    rank: int


@dataclass
class _Routes:
    """Where this rank's (token, slot) rows go and which rows its experts receive.

    ``order``: the rows (flattened ``[T_l * k]``) sorted by expert, so by destination;
    ``send``/``recv``: rows sent to / received from each rank of the exchange;
    ``experts``: the local expert of each received row; ``exchange``: ``None`` when every
    row stays here (rows of experts this rank does not hold are left out)."""

    order: torch.Tensor
    send: list[int]
    recv: list[int]
    experts: torch.Tensor
    exchange: Exchange | None

    @classmethod
    def of(cls, flat, held: int, first: int, num_experts: int | None, exchange) -> _Routes:
        if exchange is None:
            local = flat - first
            order = ((local >= 0) & (local < held)).nonzero().squeeze(1)
            return cls(order, [], [], local[order], None)
        assert num_experts is not None, "an expert exchange needs num_experts"
        n, per = exchange.size, num_experts // exchange.size
        assert held == per and first == exchange.rank * per, "experts not split by rank"
        # an index outside 0..E-1 (HuggingFace's loop skips index E) goes nowhere, as above
        valid = ((flat >= 0) & (flat < num_experts)).nonzero().squeeze(1)
        order = valid[torch.sort(flat[valid], stable=True).indices]  # by expert, so by rank
        counts = torch.bincount(flat[valid], minlength=num_experts)  # [E] rows per expert
        recv = all_to_all_uneven(counts, [per] * n, [per] * n, exchange.group).view(n, per)
        experts = torch.arange(per, device=flat.device).repeat(n)  # each source's block
        return cls(
            order,
            counts.view(n, per).sum(1).tolist(),
            recv.sum(1).tolist(),
            experts.repeat_interleave(recv.reshape(-1)),
            exchange,
        )

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows [T_l * k, C]`` -> the rows this rank's experts compute."""
        rows = rows[self.order]
        if self.exchange is None:
            return rows
        return all_to_all_uneven(rows, self.recv, self.send, self.exchange.group)

    def combine(self, rows: torch.Tensor, total: int) -> torch.Tensor:
        """The experts' results back to ``[total, C]`` rows in slot order (rows left out
        by a non-exchange are 0)."""
        if self.exchange is not None:
            rows = all_to_all_uneven(rows, self.send, self.recv, self.exchange.group)
        return rows.new_zeros(total, rows.shape[1]).index_copy(0, self.order, rows)


def _expert_rows(
    x: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: str
) -> torch.Tensor:
    """Rows ``x [R, D]`` through their experts (``experts [R]``, local indices into
    ``w1 [E_l, 2I, D]`` and ``w2 [E_l, D, I]``) -> ``[R, D]``."""
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e in range(w1.shape[0]):
        rows = (experts == e).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        gate, up = (x[rows] @ w1[e].t()).chunk(2, dim=-1)
        out = out.index_add(0, rows, (ACTIVATIONS[act](gate) * up) @ w2[e].t())
    return out


def experts_local(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    act: str,
    first_expert: int = 0,
    num_experts: int | None = None,
    exchange: Exchange | None = None,
) -> torch.Tensor:
    """The experts' output for this rank's tokens.

    Args:
        x: ``[T_l, D]`` this rank's tokens. top_k_index, top_k_weights: ``[T_l, k]`` their
            experts (global indices) and routing weights.
        w1, w2: ``[E_l, 2I, D]``, ``[E_l, D, I]``: the experts this rank holds, global
            indices ``first_expert .. first_expert + E_l - 1``.
        act: a key of :data:`ACTIVATIONS`.
        num_experts: ``E`` (needed with ``exchange``).
        exchange: expert parallelism: each (token, slot) row goes to the rank holding its
            expert and comes back (``all_to_all_single`` of the per-expert counts, then of
            the rows, twice). Without it, rows routed to experts this rank does not hold
            contribute 0.

    Returns:
        ``[T_l, D]``: each token's slots weighted by their routing weights and summed.
    """
    t_l, k = top_k_index.shape
    routes = _Routes.of(top_k_index.reshape(-1), w1.shape[0], first_expert, num_experts, exchange)
    token = torch.arange(t_l, device=x.device).repeat_interleave(k)
    y = _expert_rows(routes.dispatch(x[token]), routes.experts, w1, w2, act)
    rows = routes.combine(y, t_l * k)
    weighted = rows.view(t_l, k, -1) * top_k_weights.unsqueeze(-1).to(rows.dtype)
    return weighted.sum(1)


def experts_backward_local(
    grad: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    act: str,
    first_expert: int = 0,
    num_experts: int | None = None,
    exchange: Exchange | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`experts_local` (same arguments, ``grad [T_l, D]`` of its
    output) for ``x``, ``top_k_weights``, ``w1``, ``w2``.

    Each row's token, its output gradient and its routing weight go to the expert's rank
    in one exchange; there the expert's forward is recomputed and differentiated; the
    token's gradient and the routing weight's (the output gradient dotted with the
    expert's output) come back in a second. The per-expert counts are exchanged first, as
    in the forward."""
    t_l, k = top_k_index.shape
    d = x.shape[1]
    routes = _Routes.of(top_k_index.reshape(-1), w1.shape[0], first_expert, num_experts, exchange)
    token = torch.arange(t_l, device=x.device).repeat_interleave(k)
    weight = top_k_weights.reshape(-1, 1).to(x.dtype)
    sent = routes.dispatch(torch.cat([x[token], grad[token].to(x.dtype), weight], dim=1))
    rows_x, rows_g, rows_w = sent[:, :d], sent[:, d : 2 * d], sent[:, 2 * d :]
    leaves = [t.detach().requires_grad_() for t in (rows_x, w1, w2)]
    if rows_x.shape[0] == 0:  # no row reached this rank's experts: zero gradients
        y, gx, g1, g2 = rows_g, rows_x, torch.zeros_like(w1), torch.zeros_like(w2)
    else:
        with torch.enable_grad():
            y = _expert_rows(leaves[0], routes.experts, leaves[1], leaves[2], act)
            gx, g1, g2 = torch.autograd.grad(y, leaves, rows_g * rows_w)
    back = routes.combine(torch.cat([gx, (rows_g * y.detach()).sum(1, keepdim=True)], 1), t_l * k)
    grad_x = torch.zeros_like(x).index_add(0, token, back[:, :d])
    return grad_x, back[:, d].view(t_l, k).to(top_k_weights.dtype), g1, g2


# --- the ops ------------------------------------------------------------------------------


@torch.library.custom_op("autoshard::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
) -> torch.Tensor:
    """Every expert on one device (module docstring)."""
    return experts_local(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)


@moe_experts.register_fake
def _(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for ``x``, ``top_k_weights``, ``gate_up_proj``, ``down_proj``."""
    with autograd_inside_op():
        return experts_backward_local(
            grad, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act
        )


@moe_experts_backward.register_fake
def _(grad, x, top_k_index, top_k_weights, gate_up_proj, down_proj, act):
    return (
        torch.empty_like(x),
        torch.empty_like(top_k_weights),
        torch.empty_like(gate_up_proj),
        torch.empty_like(down_proj),
    )


def _setup(ctx, inputs, output) -> None:
    x, top_k_index, top_k_weights, w1, w2, act = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, w1, w2)
    ctx.act = act


def _backward(ctx, grad):
    x, top_k_index, top_k_weights, w1, w2 = ctx.saved_tensors
    gx, gw, g1, g2 = torch.ops.autoshard.moe_experts_backward(
        grad, x, top_k_index, top_k_weights, w1, w2, ctx.act
    )
    return gx, None, gw, g1, g2, None


moe_experts.register_autograd(_backward, setup_context=_setup)

EXPERTS_FORWARD = torch.ops.autoshard.moe_experts.default
EXPERTS_BACKWARD = torch.ops.autoshard.moe_experts_backward.default
EXPERT_OPS = frozenset({EXPERTS_FORWARD, EXPERTS_BACKWARD})


def _model_flops(x_shape, index_shape, w1_shape) -> int:
    """``6 T k I D``: the two matmuls of every (token, slot), 2 FLOPs per multiply-add."""
    (t, d), k, i = x_shape, index_shape[-1], w1_shape[1] // 2
    return 2 * t * k * (2 * i * d + i * d)


@register_flop_formula(torch.ops.autoshard.moe_experts)
def _forward_flops(x_shape, index_shape, weights_shape, w1_shape, w2_shape, *a, **kw) -> int:
    return _model_flops(x_shape, index_shape, w1_shape)


@register_flop_formula(torch.ops.autoshard.moe_experts_backward)
def _backward_flops(grad_shape, x_shape, index_shape, weights_shape, w1_shape, *a, **kw) -> int:
    return 2 * _model_flops(x_shape, index_shape, w1_shape)  # grad of input and of weight


def experts_flops(target: Any, rows: int, w1_shape: tuple[int, ...]) -> float:
    """FLOPs one device runs for ``rows`` (token, slot) pairs: ``6 rows I D`` forward, and
    ``18 rows I D`` backward (the forward recomputed, then both gradients)."""
    i, d = w1_shape[1] // 2, w1_shape[2]
    per_row = 6 * i * d
    return float(rows * per_row * (3 if target is EXPERTS_BACKWARD else 1))


# --- tracing ------------------------------------------------------------------------------


def fusable(module: torch.nn.Module) -> str | None:
    """``module``'s activation name when it is a HuggingFace experts module the fused op
    computes exactly (stacked ``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``,
    concatenated gate and up, no bias, not transposed, the default gate, a known
    activation), else ``None``."""
    w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(w1, torch.Tensor) or not isinstance(w2, torch.Tensor):
        return None
    if w1.dim() != 3 or w2.dim() != 3 or w1.shape[0] != w2.shape[0]:
        return None
    if w1.shape[1] != 2 * w2.shape[2] or w1.shape[2] != w2.shape[1]:
        return None
    flags = ("has_gate", True), ("has_bias", False), ("is_transposed", False)
    if any(getattr(module, f, None) is not want for f, want in flags):
        return None
    if getattr(module, "has_post_expert_norm", False) or not getattr(
        module, "is_concatenated", True
    ):
        return None
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and getattr(gate, "__name__", "") != "_default_apply_gate":
        return None
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    return act if act in ACTIVATIONS else None


@contextlib.contextmanager
def experts_traced(root: torch.nn.Module) -> Iterator[list[str]]:
    """While tracing: every :func:`fusable` experts module of ``root`` runs as one
    :data:`EXPERTS_FORWARD` op. Yields the fused modules' names."""
    fused: list[tuple[torch.nn.Module, bool, Any]] = []
    names = []
    for name, module in root.named_modules():
        act = fusable(module)
        if act is None:
            continue

        def forward(hidden, top_k_index, top_k_weights, _m=module, _act=act):
            return torch.ops.autoshard.moe_experts(
                hidden, top_k_index, top_k_weights, _m.gate_up_proj, _m.down_proj, _act
            )

        fused.append((module, "forward" in module.__dict__, module.__dict__.get("forward")))
        module.forward = forward
        names.append(name)
    try:
        yield names
    finally:
        for module, had, old in fused:
            if had:
                module.forward = old
            else:
                del module.forward
