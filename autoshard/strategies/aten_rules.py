"""ATen ops whose DTensor rule torch 2.13 gets wrong for planning, mended as
:class:`~autoshard.strategies.registry.OpRule` entries.

DTensor itself runs them at launch (no kernel of autoshard's): each rule offers only the
strategies DTensor's dispatch produces for one concrete placement of the inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from autoshard.strategies.registry import DimChoice, register_op_rule

aten = torch.ops.aten

_R = Replicate()


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
