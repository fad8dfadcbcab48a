"""Strategies of the fused experts ops (:mod:`autoshard.trace.experts`): expert parallelism.

Per mesh dim, each strategy places the op one of four ways (``T`` tokens, ``k`` slots per
token, ``E`` experts, ``n`` devices on the dim):

=========  =============================  ===============  ======================================
mode       tokens (x, index, weights)     experts (w1, w2)  output; what runs on the dim
=========  =============================  ===============  ======================================
``R``      Replicate                      Replicate        Replicate; every device, every token
``DP``     Shard(0)                       Replicate        Shard(0); ``T/n`` tokens, all experts
``EP``     Shard(0)                       Shard(0)         Shard(0); tokens sent to their experts'
                                                           device and back (all-to-all)
``EPR``    Replicate                      Shard(0)         Partial; each device adds its experts'
                                                           share for every token
=========  =============================  ===============  ======================================

``EP`` is GShard's expert parallelism (Lepikhin et al., ICLR'21) with the dispatch and
combine as all-to-all exchanges (Megatron-Core's "alltoall" token dispatcher); ``EPR`` is
its "allgather" dispatcher, whose gather and reduction are ordinary reshardings the ILP
prices on the op's edges. At most one mesh dim holds experts. The backward op mirrors the
forward: a weight gradient is ``Partial`` on a ``DP`` dim (each device saw its tokens), a
token gradient ``Partial`` on an ``EPR`` dim (each device's experts' share).

Pricing assumes uniform routing, as capacity-factor 1 does: each device's experts receive
``T_l k`` rows under ``EP`` (``T_l`` the device's tokens), ``T_l k / n`` under ``EPR``. An
``EP`` forward exchanges the per-expert counts (``E`` int64 per device) and then the rows
twice (dispatch and combine: ``T_l k D`` elements per device each); its backward exchanges
the counts, then sends each row's token, output gradient and routing weight
(``2D + 1`` elements) and gets back the token's and the weight's gradients (``D + 1``).
Each exchange is priced with :meth:`autoshard.cost.collectives.CommModel.collective`
(``all_to_all`` of the whole group's bytes), as :attr:`Strategy.collectives`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.errors import AutoshardError
from autoshard.strategies.registry import DimChoice, KernelContext, register_op_rule
from autoshard.strategies.strategy import Strategy, local_shape
from autoshard.trace.experts import (
    EXPERTS_BACKWARD,
    EXPERTS_FORWARD,
    Exchange,
    experts_backward_local,
    experts_flops,
    experts_local,
)
from autoshard.trace.tracer import TensorInfo

MODES = ("R", "DP", "EP", "EPR")
"""The ways one mesh dim may place the experts op (module docstring)."""

_R, _S0, _P = Replicate(), Shard(0), Partial()

# per mode: placements of (tokens, experts) inputs, then the forward output, then the
# backward's outputs (token gradient, weights gradient, expert gradients)
_TOKENS = {"R": _R, "DP": _S0, "EP": _S0, "EPR": _R}
_EXPERTS = {"R": _R, "DP": _R, "EP": _S0, "EPR": _S0}
_OUT = {"R": _R, "DP": _S0, "EP": _S0, "EPR": _P}
_GRAD_TOKENS = {"R": _R, "DP": _S0, "EP": _S0, "EPR": _P}
_GRAD_EXPERTS = {"R": _R, "DP": _P, "EP": _S0, "EPR": _S0}


def _shapes(target, args: Sequence[TensorInfo]) -> tuple[TensorInfo, TensorInfo, TensorInfo]:
    """(tokens ``x [T, D]``, ``top_k_index [T, k]``, ``gate_up_proj [E, 2I, D]``)."""
    first = 0 if target is EXPERTS_FORWARD else 1
    return args[first], args[first + 1], args[first + 3]


def modes_of(target, s: Strategy) -> tuple[str, ...]:
    """The mode of each mesh dim in strategy ``s`` of an experts op."""
    first = 0 if target is EXPERTS_FORWARD else 1
    tokens, experts = s.inputs[first], s.inputs[first + 3]
    return tuple(
        {(False, False): "R", (True, False): "DP", (True, True): "EP", (False, True): "EPR"}[
            (isinstance(t, Shard), isinstance(e, Shard))
        ]
        for t, e in zip(tokens, experts, strict=True)
    )


def rows_per_device(target, args: Sequence[TensorInfo], modes: Sequence[str], mesh_shape) -> int:
    """(token, slot) rows one device's experts compute, under uniform routing."""
    x, index, _ = _shapes(target, args)
    split = math.prod(n for m, n in zip(modes, mesh_shape, strict=True) if m in ("DP", "EP"))
    spread = math.prod(n for m, n in zip(modes, mesh_shape, strict=True) if m == "EPR")
    return x.shape[0] // split * index.shape[1] // spread


def _choices(node, args, results) -> list[DimChoice]:
    """The four :data:`MODES` of one mesh dim: where the tokens, the experts and the
    output (the backward's gradients) sit."""
    out = []
    for m in MODES:
        tok, exp = _TOKENS[m], _EXPERTS[m]
        if node.target is EXPERTS_FORWARD:
            ins: tuple = (tok, tok, tok, exp, exp)
            outs: tuple = (_OUT[m],)
        else:
            ins = (_OUT[m] if m != "EPR" else _R, tok, tok, tok, exp, exp)
            gt, ge = _GRAD_TOKENS[m], _GRAD_EXPERTS[m]
            outs = (gt, gt, ge, ge)
        out.append(DimChoice(m, ins, outs))
    return out


def _one_expert_dim(node, args, modes, mesh_shape) -> bool:
    """At most one mesh dim holds experts; on a dim of one device they are whole."""
    expert_dims = [i for i, m in enumerate(modes) if m in ("EP", "EPR")]
    return len(expert_dims) <= 1 and all(mesh_shape[i] > 1 for i in expert_dims)


def _exchanges(node, args, modes, mesh_shape) -> tuple[tuple[str, int, float], ...]:
    """The all-to-all exchanges of the ``EP`` dim: ``(kind, mesh dim, bytes of the whole
    group)`` as :meth:`~autoshard.cost.collectives.CommModel.collective` takes them."""
    target = node.target
    if "EP" not in modes:
        return ()
    dim = modes.index("EP")
    n = mesh_shape[dim]
    x, _, w1 = _shapes(target, args)
    rows = rows_per_device(target, args, modes, mesh_shape)
    d = x.shape[1]
    counts = ("all_to_all", dim, float(n * w1.shape[0] * torch.int64.itemsize))
    if target is EXPERTS_FORWARD:  # the tokens out, the experts' outputs back
        widths = (d, d)
    else:  # token, output gradient and weight out; token and weight gradients back
        widths = (2 * d + 1, d + 1)
    return (counts,) + tuple(("all_to_all", dim, float(n * rows * w * x.itemsize)) for w in widths)


def experts_cost(node, info, s: Strategy, mesh_shape, compute_time: Callable[..., float]) -> float:
    """Roofline seconds of strategy ``s`` on one device: :func:`experts_flops` of its rows;
    bytes: its local inputs and outputs, and per row the dispatched token, the gate and up
    projections, the gated activation and the expert's output (three times over in the
    backward, which recomputes). On a calibrated device the FLOPs run at the rate
    measured for one matmul of that many FLOPs, optimistic for many small experts."""
    target = node.target
    modes = modes_of(target, s)
    rows = rows_per_device(target, info.args, modes, mesh_shape)
    x, _, w1 = _shapes(target, info.args)
    flops = experts_flops(target, rows, w1.shape)
    i, d = w1.shape[1] // 2, w1.shape[2]
    per_row = (2 * d + 3 * i) * x.itemsize * (3 if target is EXPERTS_BACKWARD else 1)
    tensors = list(zip(info.args, s.inputs, strict=True)) + [
        (r, p) for r, p in zip(info.results, s.outputs, strict=True) if r is not None
    ]
    nbytes = sum(math.prod(local_shape(t.shape, p, mesh_shape)) * t.itemsize for t, p in tensors)
    return compute_time(flops, nbytes + rows * per_row, x.dtype)


def _kernel(target, args: list, kwargs: dict, ctx: KernelContext):
    """The fused experts op on this rank's shards, as its modes place it: the experts it
    holds are the block of its coordinate on the mesh dim that shards them; where that dim
    also shards the tokens (``EP``), tokens go to their experts' rank and back by
    all-to-all (:class:`autoshard.trace.experts.Exchange`)."""
    forward = target is EXPERTS_FORWARD
    first = 0 if forward else 1
    dims = [d for d, m in enumerate(ctx.modes) if m in ("EP", "EPR")]
    if len(dims) > 1:
        raise AutoshardError(
            f"{target}: the plan shards the experts over more than one mesh dim "
            f"({ctx.modes}); the experts op takes one (solve again)"
        )
    kw: dict = {}
    for dim in dims:
        size, rank = ctx.size(dim), ctx.rank(dim)
        num_experts = int(args[first + 3].shape[0]) * size
        kw.update(first_expert=rank * (num_experts // size), num_experts=num_experts)
        if ctx.modes[dim] == "EP":
            kw["exchange"] = Exchange(ctx.group(dim), size, rank)
    return (experts_local if forward else experts_backward_local)(*args, **kwargs, **kw)


register_op_rule(
    EXPERTS_FORWARD,
    EXPERTS_BACKWARD,
    allow=_one_expert_dim,
    collectives=_exchanges,
    compute_cost=experts_cost,
    kernel=_kernel,
    lowerable=False,
)(_choices)
