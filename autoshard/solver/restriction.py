"""A family of plans as a restriction of the strategy graph: allowed strategies per
representative, forbidden resharding pairs (:class:`Restriction`), the restricted graph
(:func:`restrict`) and the way back to the full graph's indices; the placement predicates
the hand-written families pin with (:mod:`autoshard.solver.baselines`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from torch.distributed.tensor import Placement, Replicate, Shard

from autoshard.placements import is_partial, is_replicate, is_shard, short, whole_on_single
from autoshard.strategies.graph import Edge, NodeStrategies, StrategyGraph
from autoshard.strategies.sharing import SharedResharding

Placements = tuple[Placement, ...]


# --- restricting a strategy graph ------------------------------------------------------


@dataclass
class Restriction:
    """A family of plans: allowed strategies per representative, forbidden edge pairs.

    ``allowed[rep]``: sorted strategy indices ``rep`` may take (absent: all).
    ``forbidden[i]``: boolean ``P x Q`` mask over ``sg.edges[i].cost`` of the
    (produced, wanted) placement pairs the family excludes.
    """

    allowed: dict[str, np.ndarray] = field(default_factory=dict)
    forbidden: dict[int, np.ndarray] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    pinned: dict[str, int] = field(default_factory=dict)

    def allow(self, sg: StrategyGraph, rep: str, ok: Callable[[int], bool], kind: str) -> bool:
        """Restrict ``rep`` to the strategies where ``ok(index)``; False (no change) if none."""
        current = self.allowed.get(rep)
        if current is None:
            current = np.arange(len(sg.nodes[rep].strategies))
        keep = np.array([i for i in current if ok(int(i))], dtype=np.int64)
        if len(keep) == 0:
            return False
        if len(keep) < len(current):
            self.allowed[rep] = keep
            self.pinned[kind] = self.pinned.get(kind, 0) + 1
        return True

    def forbid(self, index: int, edge: Edge, bad: Callable[[Placements, Placements], bool]) -> None:
        """Forbid the pairs ``(p, q)`` of edge ``index`` where ``bad(p, q)``."""
        mask = np.array(
            [[bad(p, q) for q in edge.dst_placements] for p in edge.src_placements], dtype=bool
        ).reshape(edge.cost.shape)
        self.forbid_mask(index, mask)

    def forbid_mask(self, index: int, mask: np.ndarray) -> None:
        """Forbid the pairs of edge ``index`` where ``mask`` (shaped as its cost) is true."""
        if mask.any():
            self.forbidden[index] = self.forbidden.get(index, np.zeros_like(mask)) | mask


def restrict(sg: StrategyGraph, r: Restriction) -> StrategyGraph:
    """A copy of ``sg`` whose representatives keep only their allowed strategies.

    Representative ``rep`` keeps ``r.allowed[rep]`` (in that order); every node merged
    into it keeps its own strategy list with ``choice`` re-indexed. Forbidden edge pairs
    cost ``inf`` (the ILP gives them no variable). All other costs are ``sg``'s, so the
    restricted ILP's objective of a choice equals :func:`~autoshard.cost.objective.evaluate` on
    ``sg`` of the same choice mapped back with :func:`unrestrict_choice`.
    """
    keep = {rep: r.allowed.get(rep) for rep in sg.reps}
    nodes: dict[str, NodeStrategies] = {}
    for name, ns in sg.nodes.items():
        k = keep[ns.rep]
        if k is None:
            nodes[name] = ns
        elif name == ns.rep:
            nodes[name] = NodeStrategies(
                name,
                [ns.strategies[ns.choice[i]] for i in k],
                ns.compute_s[ns.choice[k]],
                name,
                np.arange(len(k)),
                ns.fallback,
            )
        else:
            nodes[name] = NodeStrategies(
                name, ns.strategies, ns.compute_s, ns.rep, ns.choice[k], ns.fallback
            )
    edges = []
    for i, e in enumerate(sg.edges):
        ks, kd = keep[e.src], keep[e.dst]
        cost = e.cost
        if i in r.forbidden:
            cost = np.where(r.forbidden[i], np.inf, cost)
        edges.append(
            Edge(
                src=e.src,
                dst=e.dst,
                tensor=e.tensor,
                src_placements=e.src_placements,
                dst_placements=e.dst_placements,
                src_groups=e.src_groups if ks is None else e.src_groups[ks],
                dst_groups=e.dst_groups if kd is None else e.dst_groups[kd],
                cost=cost,
                producer=e.producer,
                consumer=e.consumer,
                members=e.members,
                overlap=e.overlap,
                hide=e.hide,
                uses=e.uses,
                full_uses=e.full_uses,
                selective_uses=e.selective_uses,
            )
        )

    def kept(per_rep: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {rep: v if keep[rep] is None else v[keep[rep]] for rep, v in per_rep.items()}

    return StrategyGraph(
        graph=sg.graph,
        mesh_shape=sg.mesh_shape,
        nodes=nodes,
        free=sg.free,
        edges=edges,
        fallback_ops=sg.fallback_ops,
        seconds=sg.seconds,
        rule_calls=sg.rule_calls,
        cache_hits=sg.cache_hits,
        stats=dict(sg.stats),
        extra_cost=kept(sg.extra_cost),
        tied_layers=sg.tied_layers,
        bucket_bytes=sg.bucket_bytes,
        overlap=sg.overlap,
        seeded=sg.seeded,
        reduce_itemsize=sg.reduce_itemsize,
        shares=[_restrict_share(s, keep) for s in sg.shares],
        share_reads=sg.share_reads,
        rerun_reads=sg.rerun_reads,
        rerun_pairs=sg.rerun_pairs,  # the edges keep their order and placement lists
        early_stop=sg.early_stop,
        optimizer=sg.optimizer,
        rerun_ops=sg.rerun_ops,
    )


def _restrict_share(share: SharedResharding, keep: dict) -> SharedResharding:
    """``share`` over the kept strategies: an indicator on one variable's strategies names
    their new indices (the edges keep their placement lists, so their pairs stay)."""
    indicators = []
    for ind in share.indicators:
        k = keep[ind[1]] if ind[0] == "x" else None
        if k is not None:
            old = set(ind[2])
            ind = ("x", ind[1], tuple(i for i, j in enumerate(k) if j in old))
        indicators.append(ind)
    return SharedResharding(tuple(indicators), share.parts)


def unrestrict_choice(r: Restriction, choice: dict[str, int]) -> dict[str, int]:
    """Map a choice on the restricted graph back to strategy indices of the full graph."""
    out = {}
    for rep, i in choice.items():
        k = r.allowed.get(rep)
        out[rep] = int(k[i]) if k is not None else int(i)
    return out


def restrict_memory(
    sg: StrategyGraph, r: Restriction, memory: tuple[np.ndarray, float] | None
) -> tuple[np.ndarray, float] | None:
    """Restrict a memory row over the full graph's strategies (ILP order) to the family's."""
    if memory is None:
        return None
    m, budget = memory
    parts, pos = [], 0
    for rep in sg.reps:
        n = len(sg.nodes[rep].strategies)
        block = np.asarray(m[pos : pos + n])
        k = r.allowed.get(rep)
        parts.append(block if k is None else block[k])
        pos += n
    return (np.concatenate(parts) if parts else np.zeros(0), budget)


# --- placement helpers -----------------------------------------------------------------


def is_r(p: Placement) -> bool:
    return is_replicate(p)


def is_p(p: Placement) -> bool:
    return is_partial(p)


def kind_table(placements: Sequence[Placements], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """``(partial, replicate)``: boolean arrays ``(len(placements), ndim)``, true where
    placement tuple ``i`` is ``Partial`` (resp. ``Replicate``) on mesh dim ``d``: one
    ``isinstance`` per placement, where a test per pair of tuples repeats them."""
    partial = np.zeros((len(placements), ndim), dtype=bool)
    replicate = np.zeros((len(placements), ndim), dtype=bool)
    for i, pl in enumerate(placements):
        for d, a in enumerate(pl):
            partial[i, d] = is_p(a)
            replicate[i, d] = is_r(a)
    return partial, replicate


def is_s(p: Placement, dim: int | None = None) -> bool:
    return is_shard(p) and (dim is None or p.dim == dim)


def used_as_stored(p: Placements, q: Placements) -> bool:
    """Per mesh dim: the consumer wants what is stored, or reads a replicated value as Partial."""
    return all(a == b or (is_r(a) and is_p(b)) for a, b in zip(p, q, strict=True))


def gathered(p: Placements, q: Placements) -> bool:
    """Per mesh dim: the consumer wants the whole tensor (or a replicated one as Partial)."""
    return all(is_r(b) or (is_r(a) and is_p(b)) for a, b in zip(p, q, strict=True))


def shard_dim0(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims: Iterable[int]
) -> Placements:
    """``S(0)`` on each mesh dim of ``dims`` (in order) while the devices divide ``shape[0]``.

    ``R`` on every other mesh dim, and on all of them for a 0-d tensor.
    """
    out: list[Placement] = [Replicate()] * len(mesh_shape)
    if not shape:
        return tuple(out)
    div = 1
    for d in dims:
        if shape[0] % (div * mesh_shape[d]) == 0:
            div *= mesh_shape[d]
            out[d] = Shard(0)
    return tuple(out)


def node_kind(sg: StrategyGraph, rep: str) -> str:
    info = sg.graph.nodes.get(rep)
    return info.kind if info is not None else "output"


def produced(sg: StrategyGraph, rep: str, i: int) -> Placements:
    return sg.nodes[rep].strategies[i].outputs[0]


def pin_placeholder(
    r: Restriction, sg: StrategyGraph, rep: str, want: Placements, kind: str
) -> None:
    want = whole_on_single(want, sg.mesh_shape)  # as the strategies hold it
    if not r.allow(sg, rep, lambda i: produced(sg, rep, i) == want, kind):
        info = sg.graph.nodes[rep]
        have = ", ".join(
            short_placements(produced(sg, rep, i)) for i in range(len(sg.nodes[rep].strategies))
        )
        r.notes.append(
            f"{info.kind} {info.fqn} {info.results[0].shape}: {short_placements(want)} is not "
            f"among its placements ({have}); left to the ILP"
        )


def short_placements(ps: Placements) -> str:
    return short(ps)


def restrict_param_uses(r: Restriction, sg: StrategyGraph, use: Callable) -> None:
    params = {rep for rep in sg.reps if node_kind(sg, rep) == "param"}
    for i, e in enumerate(sg.edges):
        if e.src in params:
            r.forbid(i, e, lambda p, q: not use(p, q))


def all_on(
    sg: StrategyGraph, rep: str, t: int, test: Callable[[Placement], bool]
) -> Callable[[int], bool]:
    """Whether strategy ``i`` of ``rep`` places every tensor it makes (or, with none, reads)
    so that ``test`` holds on mesh dim ``t``."""
    ns = sg.nodes[rep]

    def ok(i: int) -> bool:
        s = ns.strategies[i]
        tensors = [p for p in s.outputs if p is not None] or list(s.inputs)
        return all(test(p[t]) for p in tensors)

    return ok


def placeholders(sg: StrategyGraph, kind: str) -> list[str]:
    return [rep for rep in sg.reps if node_kind(sg, rep) == kind]
