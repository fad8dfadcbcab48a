"""DTensor-style sharding propagation over a (restricted) strategy graph: how a
hand-written plan's unpinned ops are placed when the model runs (:func:`propagate`)."""

from __future__ import annotations

import numpy as np

from autoshard.cost.liveness import local_bytes
from autoshard.errors import AutoshardError
from autoshard.strategies.graph import Edge, StrategyGraph


def propagate(sg: StrategyGraph) -> dict[str, int]:
    """DTensor-style propagation: each representative, in graph order, its cheapest strategy.

    As DTensor's sharding propagation does, a node takes the strategy that needs the least
    resharding (seconds) of the inputs whose producers have already chosen; among equals,
    the least compute; then the earliest. Edges from later nodes (a gradient into its
    parameter) are not looked ahead to. A source (parameter or input) left with several
    strategies by the pins is decided by its first consumer: the pair of their strategies
    with the least resharding. What is computed from the loss's tangent alone (the mean's
    gradient, as large as the output) is decided last, in reverse order: each node the
    strategy of least compute plus resharding to and from the nodes already decided, and
    among equals the one that holds the least of its output on a device, as each rank of a
    data-parallel run makes the gradient of its own shard of the output (a view is free
    either way: without this, a chain of views kept the gradient whole and the division
    before it ran on the whole ``(B, S, V)`` tensor on every device).

    Raises:
        AutoshardError: some node has no strategy its inputs can be resharded into
            (e.g. every allowed strategy wants a ``Partial`` input that is not produced).
    """
    into: dict[str, list[Edge]] = {}
    for e in sg.edges:
        into.setdefault(e.dst, []).append(e)
    order = {r: i for i, r in enumerate(sg.reps)}
    # sources: read nothing earlier (a parameter's only inputs are its gradient, later on)
    seeded = [r for r in sg.reps if r in sg.seeded and len(sg.nodes[r].strategies) > 1]
    lazy = {
        r
        for r in sg.reps
        if len(sg.nodes[r].strategies) > 1
        and r not in sg.seeded
        and all(order[e.src] > order[r] for e in into.get(r, []))
    }
    open_seeded = set(seeded)
    choice: dict[str, int] = {}
    for rep in sg.reps:
        if rep in lazy or rep in open_seeded:
            continue
        compute = sg.rep_cost(rep).astype(float)
        reshard = np.zeros_like(compute)
        open_sources = []
        for e in into.get(rep, []):
            if e.src == rep:  # repeated layers tied to one variable: an edge into itself
                reshard = reshard + e.cost[e.src_groups, e.dst_groups]
            elif e.src in choice:
                reshard = reshard + e.cost[e.src_groups[choice[e.src]], e.dst_groups]
            elif e.src in lazy or e.src in open_seeded:
                # cost[i, j] over the source's strategies i and ours j: best i for each j
                pair = e.cost[e.src_groups][:, e.dst_groups]
                reshard = reshard + pair.min(axis=0)
                if e.src in lazy:
                    open_sources.append((e.src, pair))
        least = reshard.min()
        if not np.isfinite(least):
            raise AutoshardError(f"no strategy of {rep} accepts its inputs' placements")
        near = np.isclose(reshard, least, rtol=1e-9, atol=1e-15)
        j = int(np.argmin(np.where(near, compute, np.inf)))
        choice[rep] = j
        for src, pair in open_sources:
            if src not in choice:  # the first consumer decides
                choice[src] = int(np.argmin(pair[:, j]))
    out_of: dict[str, list[Edge]] = {}
    for e in sg.edges:
        out_of.setdefault(e.src, []).append(e)
    for rep in reversed(seeded):  # consumers first: each takes what its consumers want
        cost = sg.rep_cost(rep).astype(float)
        for e in out_of.get(rep, []):
            if e.dst in choice and e.dst != rep:
                cost = cost + e.cost[e.src_groups, e.dst_groups[choice[e.dst]]]
        for e in into.get(rep, []):
            if e.src in choice and e.src != rep:
                cost = cost + e.cost[e.src_groups[choice[e.src]], e.dst_groups]
        near = np.isclose(cost, cost.min(), rtol=1e-9, atol=1e-15)
        choice[rep] = int(np.argmin(np.where(near, _output_bytes(sg, rep), np.inf)))
    for rep in lazy:
        choice.setdefault(rep, 0)
    return choice


def _output_bytes(sg: StrategyGraph, rep: str) -> np.ndarray:
    """Bytes of ``rep``'s first output one device holds, per strategy (0 without one)."""
    ns, info = sg.nodes[rep], sg.graph.nodes.get(rep)
    t = info.results[0] if info is not None and info.results else None
    if t is None:
        return np.zeros(len(ns.strategies))
    return np.array([local_bytes(t, s.outputs[0], sg.mesh_shape) for s in ns.strategies])
