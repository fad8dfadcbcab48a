"""A plan of a mesh laid onto a mesh with one more dim: one of its dims split in two.

A placement of a tensor over mesh dim ``m`` of size ``a * b`` is the same layout as that
placement on both dims ``m`` and ``m + 1`` of a mesh that splits it into ``a x b``:
``Shard(d)`` on both shards tensor dim ``d`` over dim ``m`` first and then over ``m + 1``
(DTensor's order, :class:`torch.distributed.tensor.Shard`), so device ``(i, j)`` holds
chunk ``i * b + j`` of ``a * b``, the chunk device ``i * b + j`` of the flat dim holds;
``Partial`` on both is a sum over all ``a * b`` devices; ``Replicate`` on both is
replicated over them. So a plan of the 8x8 mesh is, as a layout, a plan of 4x2x8 (dim 0
split) and of 8x2x4 (dim 1 split), with the same bytes on every device and the same
compute; only its collectives change: each runs over two mesh dims, priced there as the
3-D mesh's links price it (:mod:`autoshard.cost.collectives`, one step per dim). Whether
the split mesh's strategy graph offers it is up to its op rules: those that shard over
one mesh dim only (a convolution's unnested rules, context or expert parallelism on the
split dim) have no such strategy, and the plan is then not lifted.

The mesh search (:mod:`autoshard.solver.meshes`) uses it where a 3-D shape's own ILP is
over its column cap: the 2-D shape's ILP plan, laid onto the 3-D shape, is a plan of that
shape that :mod:`autoshard.launch` runs like any other, and (as its ILP prices it) an
upper bound on what the shape's own ILP would find.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Placement

from autoshard.strategies.graph import StrategyGraph

Placements = tuple[Placement, ...]


def splits(shape: Sequence[int], into: Sequence[int]) -> list[int]:
    """The mesh dims ``m`` of ``shape`` that ``into`` splits in two: ``into`` is ``shape``
    with ``shape[m]`` replaced by ``into[m], into[m + 1]`` (their product). ``[]`` when
    none (``into`` must have one more dim)."""
    shape, into = tuple(shape), tuple(into)
    if len(into) != len(shape) + 1:
        return []
    return [
        m for m in range(len(shape)) if into[:m] + (into[m] * into[m + 1],) + into[m + 2 :] == shape
    ]


def split_placements(ps: Placements | None, m: int) -> Placements | None:
    """``ps`` with the placement of mesh dim ``m`` on dims ``m`` and ``m + 1``."""
    if ps is None:
        return None
    return (*ps[:m], ps[m], *ps[m:])


def lift_choice(
    source: StrategyGraph, choice: dict[str, int], target: StrategyGraph, m: int
) -> dict[str, int] | None:
    """``choice`` (a plan of ``source``: a strategy index per representative) as a plan of
    ``target``, whose mesh splits ``source``'s mesh dim ``m`` in two (:func:`splits`),
    both strategy graphs of one traced graph: per representative, the strategy of
    ``target`` whose every output and input placement is ``source``'s with dim ``m``'s
    placement on dims ``m`` and ``m + 1`` (:func:`split_placements`). ``None`` when a
    representative of either graph is not one of the other's, or when ``target`` has no
    such strategy for one (its rules do not offer the layout on the split dims).

    Strategies with the same placements can differ in what the op sends itself
    (:attr:`~autoshard.strategies.strategy.Strategy.collectives`: an attention's
    all-gather or ring context parallelism): the match must send the same kinds of
    collective as the source's (on whichever dims the split mesh puts them)."""
    reps = {ns.rep for ns in target.nodes.values()}
    if reps != set(choice):
        return None
    out: dict[str, int] = {}
    for rep, i in choice.items():
        s = source.nodes[rep].strategies[i]
        want = (
            tuple(split_placements(p, m) for p in s.outputs),
            tuple(split_placements(p, m) for p in s.inputs),
        )
        kinds = {c[0] for c in s.collectives}
        found = next(
            (
                j
                for j, t in enumerate(target.nodes[rep].strategies)
                if (tuple(t.outputs), tuple(t.inputs)) == want
                and {c[0] for c in t.collectives} == kinds
            ),
            None,
        )
        if found is None:
            return None
        out[rep] = found
    return out
