"""A custom op with its own sharding rule, all in this one file, as a user adds one.

``toy::center(x [T, D]) = x - x.mean(0)``: every column centred over the batch. Its
gradient is the same op on the output's gradient (centering is a linear projection that
is its own transpose), so the backward graph holds it too.

Per mesh dim (:class:`~autoshard.strategies.registry.DimChoice`):

- ``R``: the whole tensor on every device, nothing communicated;
- ``S0``: the batch split: each device sums its rows, and the column sums are
  all-reduced over the dim (``D_l`` numbers, ``D_l`` the columns a device holds) before
  each subtracts the mean: one in-op all-reduce;
- ``S1``: the columns split: each device centres its own columns, nothing communicated.

The kernel runs on each rank's shards; its all-reduce goes through
:meth:`~autoshard.strategies.registry.KernelContext.all_reduce` (torch's functional
collectives), which the launcher counts per mesh dim against the plan.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

from autoshard.strategies.registry import DimChoice, register_op_rule

if not hasattr(torch.ops.toy, "center"):  # a process may import this file twice

    @torch.library.custom_op("toy::center", mutates_args=())
    def _center(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0, keepdim=True)

    @_center.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    _center.register_autograd(lambda ctx, grad: torch.ops.toy.center(grad))

CENTER = torch.ops.toy.center.default


def center(x: torch.Tensor) -> torch.Tensor:
    """``x - x.mean(0)`` for ``x [T, D]``."""
    return torch.ops.toy.center(x)


def _collectives(node, args, modes, mesh_shape) -> tuple[tuple[str, int, float], ...]:
    """One all-reduce of the local column sums per ``S0`` dim: ``(kind, mesh dim, bytes)``."""
    (x,) = args
    split = math.prod(n for m, n in zip(modes, mesh_shape, strict=True) if m == "S1")
    nbytes = float(x.shape[1] // split * x.itemsize)
    return tuple(("all_reduce", d, nbytes) for d, m in enumerate(modes) if m == "S0")


def _kernel(target, args, kwargs, ctx) -> torch.Tensor:
    """This rank's rows and columns, centred with the global column means."""
    (x,) = args
    total, rows = x.sum(0, keepdim=True), x.shape[0]
    for d, m in enumerate(ctx.modes):
        if m == "S0":
            total = ctx.all_reduce(total, d)
            rows *= ctx.size(d)
    return x - total / rows


@register_op_rule(CENTER, collectives=_collectives, kernel=_kernel)
def center_choices(node, args, results) -> list[DimChoice]:
    """``R``, ``S0`` (batch, one all-reduce) or ``S1`` (columns) on each mesh dim."""
    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    return [
        DimChoice("R", (r,), (r,)),
        DimChoice("S0", (s0,), (s0,)),
        DimChoice("S1", (s1,), (s1,)),
    ]
