"""Which activations are live where, and how many bytes a device holds of each.

The plan-independent half of memory: a graph's order fixes which activations are live
at each point (:class:`Liveness`); a plan's placements fix only their sizes
(:func:`activation_sizes`, :func:`local_bytes`). The budget rows
(:mod:`autoshard.cost.memory`), activation checkpointing
(:mod:`autoshard.cost.checkpointing`), the ILP and a plan's report all read them here.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch
from torch.distributed.tensor import Shard

from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.strategy import Placements, Strategy
from autoshard.trace.ops import is_view
from autoshard.trace.tracer import TensorInfo, TracedGraph


def shard_factor(placements: Placements, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces the placements cut a tensor into (product of sharding mesh dims)."""
    return math.prod(n for p, n in zip(placements, mesh_shape, strict=True) if isinstance(p, Shard))


def chosen_strategies(sg: StrategyGraph, choice: dict[str, int]) -> dict[str, Strategy]:
    """Node -> its strategy when each representative takes ``choice[rep]``."""
    return {n: ns.strategies[ns.choice[choice[ns.rep]]] for n, ns in sg.nodes.items()}


def local_bytes(t: TensorInfo, ps: Placements | None, mesh_shape: tuple[int, ...]) -> float:
    """Bytes one device holds of tensor ``t`` under placements ``ps``."""
    if ps is None:
        return float(t.nbytes)
    return t.nbytes / shard_factor(ps, mesh_shape)


@dataclass(frozen=True)
class Liveness:
    """Which activations are live at each point of a graph's order where the live set
    can peak (right before something is freed), as a 0/1 matrix.

    Each op's outputs are allocated when it runs and freed after their last reader
    runs (:func:`last_uses`: a reader of a view of them counts); ops that only view
    their input allocate nothing; user inputs are live from
    the start; parameters and free nodes (masks, position ids) are not activations.
    Which tensors are live at a point does not depend on the plan (the order is the
    graph's); only their sizes do, so the bytes live at each point are linear in the
    strategies: one budget row per point (:class:`autoshard.cost.memory.LiveMemory`).

    Attributes:
        nodes: the activation nodes, in graph order.
        scale: per node, the real tensors it stands for (a saved activation of a
            depth-reduced graph counts once per block it stands for; else 1).
        points: ``(points, len(nodes))`` sparse 0/1, node ``j`` live at point ``i``.
        positions: per point, its position in the graph order (where something is freed).
    """

    nodes: tuple[str, ...]
    scale: np.ndarray
    points: sp.csr_matrix
    positions: np.ndarray


def last_uses(graph: TracedGraph) -> dict[str, int]:
    """Node -> position (in graph order) of the last op that reads it, directly or through
    views of it: a view aliases its base's storage, so the base lives as long as any
    view of it is read (a saved ``t`` of a weight's gradient input keeps that input).

    The graph's output reading a parameter's gradient does not count: the gradient the
    step keeps is at its parameter's placement, held from the op that makes it by the
    memory model (:class:`autoshard.cost.memory.MemoryModel`), while the op's own output
    (a partial sum, before its reduction) lives until its last reader in the graph."""
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    last: dict[str, int] = {}
    for n, info in graph.nodes.items():
        grad_of = info.grad_of if info.kind == "output" else []
        for k, a in enumerate(info.arg_nodes):
            if k < len(grad_of) and grad_of[k] is not None:
                continue
            last[a] = max(last.get(a, -1), pos[n])
    picked = getitem_sources(graph)
    for n in reversed(order):  # a view's readers extend its base, chains included
        info = graph.nodes[n]
        if info.kind == "op" and is_view(info.target) and n in last:
            base = info.arg_nodes[0] if info.arg_nodes else picked.get(n)
            if base is not None:
                last[base] = max(last.get(base, -1), last[n])
    return last


def getitem_sources(graph: TracedGraph) -> dict[str, str]:
    """``getitem`` node -> the multi-output op it picks an output of (a layer norm's
    output and statistics, an attention's output and log-sum-exp, a ``split``'s pieces):
    its tensor arguments hold none, the producer's value being a tuple, so the fx graph
    names it. The op's outputs live as long as any is read."""
    out = {}
    for node in graph.graph_module.graph.nodes:
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            out[node.name] = node.args[0].name
    return out


def view_base(graph: TracedGraph, name: str, picked: dict[str, str] | None = None) -> str:
    """The node whose output ``name`` aliases: itself unless it is a view
    (:func:`~autoshard.trace.ops.is_view`), else its base's, down the chain; a parameter
    ends the chain (a weight read as its transpose is the weight). A ``getitem`` of a
    multi-output op is its own tensor; of a view op (``split``), that op's base.
    ``picked``: :func:`getitem_sources` of ``graph``, computed here when a ``getitem``
    needs it and not given."""
    while True:
        info = graph.nodes.get(name)  # an output sink ("output.<k>") is no node
        if info is None or info.kind != "op" or not is_view(info.target):
            return name
        if info.target is operator.getitem:
            picked = getitem_sources(graph) if picked is None else picked
            source = picked.get(name)
            if source is None or not is_view(graph.nodes[source].target):
                return name
            name = source
        elif info.arg_nodes:
            name = info.arg_nodes[0]
        else:
            return name


def liveness(graph: TracedGraph) -> Liveness:
    """The :class:`Liveness` of ``graph`` (computed once per graph, then cached on it)."""
    if graph.liveness is not None:
        return graph.liveness
    order = list(graph.nodes)
    pos = {n: i for i, n in enumerate(order)}
    last_use = last_uses(graph)
    nodes = [
        n
        for n, info in graph.nodes.items()
        if info.kind in ("op", "input") and not is_view(info.target)
    ]
    begin = np.array([pos[n] for n in nodes], dtype=np.int64)
    end = np.array([max(last_use.get(n, pos[n]), pos[n]) for n in nodes], dtype=np.int64)
    # saved: a forward tensor live into the backward (read there directly or through a
    # view): every block a traced block stands for keeps its own copy until then
    turn = next((pos[n] for n, i in graph.nodes.items() if i.backward), len(order))
    saved = (
        {n for n, e in zip(nodes, end, strict=True) if e >= turn and not graph.nodes[n].backward}
        if graph.multiplicity
        else set()
    )
    at = np.unique(end)  # a live set only shrinks where something is freed
    first = np.searchsorted(at, begin)  # the first point at or after the allocation
    last = np.searchsorted(at, end)  # the point of the free
    rows = [np.arange(a, b + 1) for a, b in zip(first, last, strict=True)]
    rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    cols = np.repeat(np.arange(len(nodes)), last - first + 1)
    points = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(at), len(nodes)))
    scale = np.array([float(graph.mult(n)) if n in saved else 1.0 for n in nodes])
    graph.liveness = Liveness(tuple(nodes), scale, points, at)
    return graph.liveness


def activation_sizes(
    sg: StrategyGraph,
    node_strategy: dict[str, Strategy],
    mesh_shape: tuple[int, ...],
    scaled: bool = True,
) -> np.ndarray:
    """Bytes one device holds of each activation of :func:`liveness` under a plan (0 for
    a node the plan leaves free), times its :attr:`Liveness.scale` when ``scaled``."""
    live = liveness(sg.graph)
    sizes = np.zeros(len(live.nodes))
    for j, n in enumerate(live.nodes):
        strat = node_strategy.get(n)
        if strat is None:
            continue
        info = sg.graph.nodes[n]
        sizes[j] = sum(
            local_bytes(r, ps, mesh_shape)
            for r, ps in zip(info.results, strat.outputs, strict=False)
            if r is not None
        )
    return sizes * live.scale if scaled else sizes


def peak_activation_bytes(
    sg: StrategyGraph,
    node_strategy: dict[str, Strategy],
    mesh_shape: tuple[int, ...],
    recompute: dict[int, int] | None = None,
) -> float:
    """Peak bytes of live activations on one device over the graph order
    (:class:`Liveness`), less what the blocks ``recompute`` names free
    (:meth:`autoshard.cost.checkpointing.Checkpointing.credit`)."""
    points = liveness(sg.graph).points
    if points.shape[0] == 0:
        return 0.0
    live = points @ activation_sizes(sg, node_strategy, mesh_shape)
    if sg.checkpointing is not None and sg.checkpointing.blocks:
        live = live - sg.checkpointing.freed(sg, node_strategy, recompute)
    return float(live.max())
