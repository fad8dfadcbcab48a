"""One strategy of a node: a placement per mesh dim for each of its tensors."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch.distributed.tensor import Placement, Replicate, Shard

from autoshard.placements import each_whole_on_single

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's tensor outputs and tensor inputs (one tuple per tensor).

    ``collectives``: what the op itself communicates under this strategy, beyond the
    resharding of its inputs: ``(kind, mesh dim, bytes)`` as
    :meth:`autoshard.cost.collectives.CommModel.collective` prices them (an op rule's
    ``collectives``, :mod:`autoshard.strategies.registry`: the experts' token exchange,
    context parallelism's key/value exchange); empty for every other op.
    ``own_s``: their seconds on one device, set when the strategy graph prices them.
    """

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    collectives: tuple[tuple[str, int, float], ...] = ()
    own_s: float = 0.0


def whole_strategy(s: Strategy, mesh_shape: Sequence[int]) -> Strategy:
    """``s`` with ``Replicate`` on every mesh dim of one device.

    On such a dim every placement is the whole tensor
    (:func:`~autoshard.placements.whole_on_single`): the same
    local computation, compute time and memory, and no step to price or run. Strategies
    that differ only there are one strategy: without this, a mesh dim of one device
    multiplied an op's strategies and its edges' pairs (``--mesh 1x4`` took a 2-layer
    Llama's solve from 7 s to 28 s; a pipeline stage's submesh keeps its size-1 dims).
    """
    if all(n > 1 for n in mesh_shape):
        return s
    return replace(
        s,
        outputs=each_whole_on_single(s.outputs, mesh_shape),
        inputs=each_whole_on_single(s.inputs, mesh_shape),
    )


def all_placements(shape: Sequence[int], mesh_shape: Sequence[int]) -> list[Placements]:
    """Every Replicate/Shard placement of a tensor of ``shape`` that shards evenly.

    A tensor dim may be sharded over several mesh dims (its size must divide by
    their product). Partial is excluded: only ops produce partial values. A mesh dim of
    one device holds the tensor whole: ``Replicate`` alone there
    (:func:`~autoshard.placements.whole_on_single`).
    """
    per_dim = [Replicate()] + [Shard(d) for d in range(len(shape))]
    out = []
    for combo in itertools.product(*([Replicate()] if n == 1 else per_dim for n in mesh_shape)):
        div = [1] * len(shape)
        for p, n in zip(combo, mesh_shape, strict=True):
            if isinstance(p, Shard):
                div[p.dim] *= n
        if all(s % d == 0 for s, d in zip(shape, div, strict=True)):
            out.append(combo)
    return out


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple:
    """Shape of the shard one device holds (even sharding; ceil otherwise)."""
    local = list(shape)
    for p, n in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard) and p.dim < len(local):
            local[p.dim] = -(-local[p.dim] // n)
    return tuple(local)
