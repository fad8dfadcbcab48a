"""ATen ops whose DTensor rule torch 2.13 gets wrong for planning, mended as
:class:`~autoshard.strategies.registry.OpRule` entries.

DTensor itself runs them at launch (no kernel of autoshard's): each rule offers only the
strategies DTensor's dispatch produces for one concrete placement of the inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.strategies.registry import DimChoice, register_op_rule

aten = torch.ops.aten

_R, _S0 = Replicate(), Shard(0)


def _reduction(node: Any, at: int) -> int:
    """The loss's reduction argument: 0 none, 1 mean (the default), 2 sum."""
    return node.args[at] if len(node.args) > at else 1


@register_op_rule(aten.nll_loss_forward.default)
def nll_loss_forward(node: Any, args: list, results: list) -> list[DimChoice]:
    """``nll_loss_forward(input[N, C], target[N], weight?, reduction, ignore_index) ->
    (loss, total_weight)``.

    PyTorch's rule indexes the target's strategy by the input's index and breaks with
    several input strategies. Per mesh dim: ``R``, everything replicated; ``S0``, input and
    target sharded on the batch dim ``N``, giving a partial loss placed as DTensor's own
    dispatch places it (the launcher runs it): ``Partial(avg)`` for the mean (the mean of
    local means, exact for equal shards), ``Partial(sum)`` for the sum, batch-sharded with
    no reduction; ``total_weight`` a ``Partial(sum)``. A 1-D input (one sample: ``C``
    classes and a 0-d target) is only replicated."""
    out = [DimChoice("R", (_R,) * len(args), (_R, _R))]
    if len(args[0].shape) >= 2:
        loss = {0: _S0, 1: Partial("avg")}.get(_reduction(node, 3), Partial())
        out.append(DimChoice("S0", (_S0, _S0) + (_R,) * (len(args) - 2), (loss, Partial())))
    return out


@register_op_rule(aten.nll_loss_backward.default)
def nll_loss_backward(node: Any, args: list, results: list) -> list[DimChoice]:
    """``nll_loss_backward(grad_output, input[N, C], target[N], weight?, reduction,
    ignore_index, total_weight)``, the gradient of a cross-entropy loss.

    PyTorch's rule indexes the target's, the gradient's and ``total_weight``'s strategies
    by the input's index, as its forward rule does, and so offers only ``Replicate`` when
    each input has several candidates: the whole ``(N, C)`` gradient of the logits was
    computed on every device (67 GB in float32 for Llama-3.1-8B at 16 x 8192 tokens).
    Per mesh dim, as DTensor's rule places one concrete case (what the launcher runs):
    ``R``; ``S0``, input, target and the gradient sharded alike on ``N``, ``grad_output``
    following the target without reduction and the replicated 0-d seed otherwise,
    ``weight`` replicated, ``total_weight`` replicated for the mean (the all-reduced count:
    each shard of the gradient is then ``-grad_output / total_weight`` at its targets, the
    global mean's gradient) and, as DTensor leaves it, as the forward made it
    (``Partial``) for the sum or no reduction, whose kernel does not read it. A 1-D input
    is only replicated."""
    out = [DimChoice("R", (_R,) * len(args), (_R,))]
    if len(args[1].shape) >= 2:
        reduction = _reduction(node, 4)
        grad_out = _S0 if reduction == 0 else _R
        total_weight = _R if reduction == 1 else Partial()
        weight = (_R,) * (len(args) - 4)  # given or not
        out.append(DimChoice("S0", (grad_out, _S0, _S0, *weight, total_weight), (_S0,)))
    return out


@register_op_rule(aten.new_zeros.default)
def new_zeros(node: Any, args: list, results: list) -> list[DimChoice]:
    """``new_zeros(input, size)``: zeros whatever the input holds, so the input is read in
    whatever placement it has, with no communication. Per mesh dim the output is whole, or
    sharded on a tensor dim where the input is sharded on the same dim of the same size
    (each rank makes the zeros of its own rows, as the launcher does for ``ZEROS_OPS``).
    DTensor's own rule replicates the output whenever its size differs from the input's
    (Mixtral's router backward: ``new_zeros(tokens, experts)`` from ``(tokens, top_k)``),
    which computed a batch-sized tensor whole on every device."""
    t_in, t_out = args[0], results[0]
    aligned = [
        d for d in range(min(len(t_in.shape), len(t_out.shape))) if t_in.shape[d] == t_out.shape[d]
    ]
    rest = (_R,) * (len(args) - 1)
    out = [DimChoice("R", (_R, *rest), (_R,))]
    out += [DimChoice(f"S{d}", (Shard(d), *rest), (Shard(d),)) for d in aligned]
    out += [
        DimChoice(f"S{d}->R", (Shard(d), *rest), (_R,))
        for d in range(len(t_in.shape))
        if d not in aligned
    ]
    return out
