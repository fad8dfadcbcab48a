"""Candidate strategies for every node, shrunk before the ILP sees them.

A *strategy* of a node is one choice of placements (one per mesh dim) for each of
its tensor inputs and outputs. They come from PyTorch's own DTensor sharding
rules (through :mod:`autoshard._torch_private`), from autoshard's op rules where
PyTorch has none or a broken one (:mod:`autoshard.strategies.registry`), and otherwise
from a replicate fallback (everything ``Replicate``) that is counted and
reported, never silent.

Shrinking, as Alpa does (Zheng et al., OSDI'22, section 4.1):

* **free nodes**: factory ops (``arange``, ``full``, ...), buffers and every op
  computed only from them (masks, position ids) cost nothing to produce in any
  placement on every device, so they get no variable and no resharding edge (the
  launcher computes them whole on every rank); the loss's tangent is not free (see
  :meth:`_Builder.leaf`);
* **duplicates** are dropped (same input and output placements);
* **follow nodes**: an op with one tensor input whose rule maps each placement its
  producer can give to exactly one strategy, with no resharding (views,
  transposes, elementwise ops, softmax), is merged into its producer: it gets no
  variable, its strategy is a function of the producer's. Not an op whose output is
  larger than its input (a broadcasting ``expand``): resharding before it is cheaper
  than after, which merging would forbid;
* generation is **cached** by (op, argument shapes and values, input candidates), so
  repeated layers cost one layer of rule calls.

Variables belong to *representative* nodes; every other non-free node maps each
strategy of its representative to one of its own (``choice``).
"""

from __future__ import annotations

import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Replicate, Shard

from autoshard import _torch_private as tp
from autoshard.errors import AutoshardError
from autoshard.placements import whole_on_single
from autoshard.strategies.hiding import GATHER, GRADIENT, schedule
from autoshard.strategies.optimizer import OPTIMIZERS
from autoshard.strategies.registry import roofline
from autoshard.strategies.rules import op_rule
from autoshard.strategies.sharing import build_shares, share_key
from autoshard.strategies.strategy import (
    Placements,
    Strategy,
    all_placements,
    local_shape,
    whole_strategy,
)
from autoshard.trace.ops import is_view
from autoshard.trace.rerun_reads import shared_rerun_reads
from autoshard.trace.selective import recomputed_ops
from autoshard.trace.tracer import TensorInfo, TracedGraph

aten = torch.ops.aten


@dataclass
class NodeStrategies:
    """The strategies of one node and how it is tied to its representative.

    ``rep``: the node whose variable decides this node (itself for a
    representative). ``choice[i]``: index into ``strategies`` when the
    representative picks its strategy ``i``. ``compute_s[j]``: roofline time of
    strategy ``j`` on one device, seconds (for a parameter in training: its AdamW step,
    :func:`adamw_step_time`). What the op communicates itself is :attr:`comm_s`: not
    compute, so no collective hides under it (:mod:`autoshard.cost.overlap`).
    """

    name: str
    strategies: list[Strategy]
    compute_s: np.ndarray
    rep: str
    choice: np.ndarray
    fallback: bool = False

    @property
    def comm_s(self) -> np.ndarray:
        """Seconds per strategy of what the op communicates itself on one device
        (:attr:`Strategy.own_s`: the experts' token exchange), for ONE real node (not times
        the blocks a traced node stands for, unlike ``compute_s``)."""
        return np.array([s.own_s for s in self.strategies])


@dataclass
class Edge:
    """A tensor flowing from representative ``src`` to representative ``dst``.

    ``src_groups[i]``: index of the distinct source placement produced when ``src``
    picks strategy ``i``; ``dst_groups[j]`` likewise for the placement ``dst``'s
    strategy ``j`` wants. ``cost[a, b]``: seconds to reshard source placement
    ``a`` into wanted placement ``b`` (``inf`` when impossible).
    """

    src: str
    dst: str
    tensor: TensorInfo
    src_placements: list[Placements]
    dst_placements: list[Placements]
    src_groups: np.ndarray
    dst_groups: np.ndarray
    cost: np.ndarray
    producer: str = ""  # the node (maybe merged) that produces the tensor
    consumer: str = ""  # the node (maybe merged) that reads it
    members: list[TensorInfo] = field(default_factory=list)  # tensors of merged edges
    overlap: str = ""  # "gradient" / "gather" when the edge can hide (autoshard.cost.overlap)
    # the real tensor reads of ``uses`` that can hide, by (the segment whose compute hides
    # them, the segment whose copies make them): autoshard.strategies.hiding.Schedule.windows;
    # a read with no window stays out
    hide: dict[tuple[int, int], float] = field(default_factory=dict)
    # the real tensor reads ``cost`` counts (each member times its multiplicity), and of
    # them, per layer, the reads by one real copy of that layer's forward pass that full
    # checkpointing recomputes (what a recomputed block reads again, up to its early stop:
    # autoshard.cost.checkpointing, autoshard.trace.selective.recomputed_ops)
    uses: float = 1.0
    full_uses: dict[int, int] = field(default_factory=dict)
    # of ``full_uses``, the reads by ops that selective checkpointing recomputes
    # (autoshard.trace.selective): what a block under that policy reads again
    selective_uses: dict[int, int] = field(default_factory=dict)

    def hide_share(self, key: tuple[int, int]) -> float:
        """The share of ``cost`` that may hide under ``key``'s window (``key``: (window,
        owner), as in :attr:`hide`): its reads there over all its reads (merged members
        share one cost matrix, each times its multiplicity)."""
        return self.hide[key] / self.uses


@dataclass
class StrategyGraph:
    """Everything the ILP needs: per representative a cost vector, edges between them."""

    graph: TracedGraph
    mesh_shape: tuple[int, ...]
    nodes: dict[str, NodeStrategies]
    free: set[str]
    edges: list[Edge]
    fallback_ops: Counter
    seconds: float
    rule_calls: int = 0
    cache_hits: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    extra_cost: dict[str, np.ndarray] = field(default_factory=dict)
    tied_layers: int = 0
    bucket_bytes: float = 0.0  # gradient bucket size the gradient edges were priced with
    overlap: bool = False  # whether gradient reductions and gathers hide (autoshard.cost.overlap)
    # the loss's tangent and what is computed from it (and free nodes) alone
    seeded: set[str] = field(default_factory=set)
    # bytes per element gradients are reduced in, when not their own (mixed precision)
    reduce_itemsize: int | None = None
    # which repeated blocks may recompute (autoshard.cost.checkpointing.Checkpointing)
    checkpointing: Any = None
    # nodes whose cost is not compute, so no communication hides under it (a pipeline
    # stage's sources: their cost is the receive of what another stage made)
    not_compute: frozenset[str] = frozenset()
    # reads of one tensor that want one placement pay one resharding
    # (autoshard.strategies.sharing); False for graphs that price every read (a stage's)
    shares: list = field(default_factory=list)
    share_reads: bool = False
    # a recomputed block's parameter reads that take its backward's gathered copy
    # (autoshard.trace.rerun_reads): per forward read (producer, consumer, k) its pair, and
    # the same as pairs of edges (indices into ``edges``)
    rerun_reads: dict = field(default_factory=dict)
    rerun_pairs: list = field(default_factory=list)
    # a recomputed block stops rerunning its forward after the last op its backward reads
    # (torch.utils.checkpoint's non-reentrant early stop, autoshard.trace.selective);
    # False: it reruns its whole forward (reentrant checkpointing, Megatron-LM's)
    early_stop: bool = True
    # the AdamW implementation each parameter's step is priced as (OPTIMIZERS)
    optimizer: str = "adamw-fused"
    # per policy ("full", "selective"), the forward ops a recomputed block reruns
    # (autoshard.trace.selective.recomputed_ops under early_stop), made once per graph
    rerun_ops: dict = field(default_factory=dict)

    @property
    def reps(self) -> list[str]:
        """Representative node names, topological order."""
        return [n for n, s in self.nodes.items() if s.rep == n]

    def rep_cost(self, rep: str) -> np.ndarray:
        """Compute seconds of ``rep``'s strategies, with every node merged into it."""
        return self._rep_costs()[rep]

    def _rep_costs(self) -> dict[str, np.ndarray]:
        if "_rep_cost_cache" not in self.__dict__:
            costs = {r: np.zeros(len(self.nodes[r].strategies)) for r in self.reps}
            for n, ns in self.nodes.items():
                costs[ns.rep] += ns.compute_s[ns.choice]
                if any(s.own_s for s in ns.strategies):
                    costs[ns.rep] += self.graph.mult(n) * ns.comm_s[ns.choice]
            for rep, extra in self.extra_cost.items():
                costs[rep] += extra
            self.__dict__["_rep_cost_cache"] = costs
        return self.__dict__["_rep_cost_cache"]


UNNESTED_OPS = frozenset({aten.convolution.default, aten.convolution_backward.default})
"""Ops DTensor runs through a handler that reads each tensor's ``dim_map`` (its convolution
handlers, ``torch/distributed/tensor/_tp_conv.py``), which raises for a tensor dim sharded
over two mesh dims (``(Shard(0), Shard(0))``: "DTensor operator implementation does not
support things like hybrid sharding strategies yet"), though the op's strategy function
offers it. Their strategies keep every tensor dim on one mesh dim at most, so a plan that
solves also launches."""


def _replicate_fallback(n_in: int, results: list[TensorInfo | None], ndim: int) -> list[Strategy]:
    rep = (Replicate(),) * ndim
    return [Strategy(tuple(rep if r is not None else None for r in results), (rep,) * n_in)]


# --- generation --------------------------------------------------------------------


def _static_key(value: Any, infos: dict[str, TensorInfo]) -> Any:
    """Hashable form of a node argument: tensors become (shape, dtype)."""
    if isinstance(value, torch.fx.Node):
        t = infos.get(value.name)
        return ("T", t.shape, str(t.dtype)) if t is not None else ("N", value.name)
    if isinstance(value, (list, tuple)):
        return tuple(_static_key(v, infos) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _static_key(v, infos)) for k, v in value.items()))
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return str(value)
    return value


def _to_meta_args(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        v = value.meta.get("val")
        return tp.tensor_meta(v) if isinstance(v, torch.Tensor) else v
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta_args(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta_args(v) for k, v in value.items()}
    return value


def _out_meta(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return tuple(tp.tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    return tp.tensor_meta(val) if isinstance(val, torch.Tensor) else None


def build_strategy_graph(
    graph: TracedGraph,
    mesh_shape: Sequence[int],
    compute_time: Callable[..., float],
    redistribute_costs: Callable[..., list[list[float]]],
    fixed_inputs: Placements | None = None,
    fixed_outputs: Placements | None = None,
    tie: bool = True,
    progress: Callable[[int, int], None] | None = None,
    bucketed_costs: Callable[..., list[list[float]]] | None = None,
    reduce_itemsize: int | None = None,
    collective_cost: Callable[[str, float, int], float] | None = None,
    share_reads: bool = False,
    features: frozenset[str] = frozenset(),
    early_stop: bool = True,
    optimizer: str = "adamw-fused",
    grad_accumulation: int = 1,
    grad_itemsize: int | None = None,
) -> StrategyGraph:
    """Generate, cost and shrink the strategies of every node of ``graph``.

    Args:
        graph: the traced graph.
        mesh_shape: devices per mesh dim, e.g. ``(2, 4)``.
        compute_time: ``(flops, bytes, dtype, kind) -> seconds`` on one device
            (roofline; :meth:`~autoshard.cost.devices.DeviceSpec.compute_time`).
        redistribute_costs: ``(srcs, dsts, global shape, itemsize) -> seconds``, a row
            per source placement and a column per destination
            (:meth:`~autoshard.cost.collectives.CommModel.redistribute_costs`).
        fixed_inputs: when given, every user input must have these placements
            (e.g. all ``Replicate``); ``None`` lets the ILP choose.
        fixed_outputs: likewise for the model's outputs; ``None`` allows any
            placement but ``Partial`` (outputs are always reduced).
        tie: share one variable per node among identical repeated layers
            (:func:`tie_layers`).
        progress: called with (nodes done, nodes total).
        bucketed_costs: like ``redistribute_costs``, for the collectives that go in
            buckets: a gradient's reduction and a parameter's gather (:func:`bucketed_use`,
            :meth:`~autoshard.cost.collectives.CommModel.bucketed_costs`); ``None`` prices
            them as any resharding.
        reduce_itemsize: bytes per element gradients are reduced in (mixed precision:
            4, fp32), when not their own dtype's.
        collective_cost: ``(kind, bytes, mesh dim) -> seconds``
            (:meth:`~autoshard.cost.collectives.CommModel.collective`) for what an op
            communicates itself (:attr:`Strategy.collectives`), added to its strategy's
            cost; required when the graph has such an op (the fused experts).
        share_reads: reads of one tensor in one phase and block that want one placement
            pay one resharding (:mod:`autoshard.strategies.sharing`); ``False``: each
            read pays its own.
        features: the op rules' optional choices to offer
            (:attr:`autoshard.strategies.registry.DimChoice.feature`:
            ``"context_parallel"``, attention sharded by sequence).
        optimizer: the AdamW implementation each parameter's step is priced as
            (:data:`OPTIMIZERS`, :func:`adamw_step_time`).
        grad_accumulation: ``n``, the micro-batches of a step (gradient accumulation)
            when ``graph`` is one of them: a parameter's cost is its optimizer step and the
            ``n - 1`` passes that add a micro-batch's gradient to the one kept (two reads
            and a write of its local shard, :func:`gradient_add_time`), over ``n``, so that
            the ILP's objective is the step over ``n``.
        grad_itemsize: bytes per element of a kept gradient (mixed precision: 4, fp32);
            ``None``: the parameter's own.
        early_stop: a recomputed block reruns its forward only up to the last op its
            backward reads, as non-reentrant ``torch.utils.checkpoint`` does
            (:func:`autoshard.trace.selective.recomputed_ops`); ``False``: its whole
            forward, as reentrant checkpointing (Megatron-LM's) does.

    Returns:
        The :class:`StrategyGraph`; its ``fallback_ops`` counts ops that got the
        replicate fallback.
    """
    t0 = time.perf_counter()
    if optimizer not in OPTIMIZERS:
        raise AutoshardError(f"optimizer {optimizer!r}: must be one of {', '.join(OPTIMIZERS)}")
    b = _Builder(graph, tuple(mesh_shape), compute_time, fixed_inputs, fixed_outputs)
    b.optimizer = optimizer
    b.grad_accumulation, b.grad_itemsize = grad_accumulation, grad_itemsize
    b.collective_cost = collective_cost
    b.features = frozenset(features)
    with tp.fake_mesh(b.mesh_shape) as mesh:
        b.mesh = mesh
        total = len(graph.nodes)
        for done, (name, info) in enumerate(graph.nodes.items()):
            if progress and done % 50 == 0:
                progress(done, total)
            b.add(name, info)
        if progress:
            progress(total, total)
    nodes, free = b.nodes, b.free
    for name, m in graph.multiplicity.items():
        if name in nodes and m != 1:  # a traced middle block standing for m real ones
            nodes[name].compute_s = nodes[name].compute_s * m
    tied = tie_layers(graph, nodes) if tie else 0
    rerun = {p: recomputed_ops(graph, p, early_stop) for p in ("full", "selective")}
    edges, extra, shares, rerun_pairs = _build_edges(
        graph, nodes, free, redistribute_costs, bucketed_costs, reduce_itemsize, share_reads, rerun
    )
    sg = StrategyGraph(
        graph=graph,
        mesh_shape=b.mesh_shape,
        nodes=nodes,
        free=free,
        edges=edges,
        fallback_ops=b.fallback,
        seconds=time.perf_counter() - t0,
        rule_calls=b.calls,
        cache_hits=b.hits,
        extra_cost=extra,
        tied_layers=tied,
        seeded=b.seeded,
        reduce_itemsize=reduce_itemsize,
        shares=shares,
        share_reads=share_reads,
        rerun_reads=rerun_pairs[0],
        rerun_pairs=rerun_pairs[1],
        early_stop=early_stop,
        optimizer=optimizer,
        rerun_ops=rerun,
    )
    sg.stats = {
        "nodes": len(graph.nodes),
        "free": len(free),
        "merged": b.merged,
        "variables_nodes": len(sg.reps),
        "strategies": sum(len(nodes[r].strategies) for r in sg.reps),
        "edges": len(edges),
        "edge_pairs": int(sum(np.isfinite(e.cost).sum() for e in edges)),
        "tied_layers": tied,
    }
    return sg


class _Builder:
    """The strategies of a graph's nodes, added in topological order, one method per node
    kind: buffers are free; parameters and inputs get every placement (a tied parameter
    its first name's); outputs get one sink per tensor (a gradient follows its parameter);
    ``getitem`` follows its producer; ops get their rule's strategies, merged into their
    producer's variable when they follow it."""

    def __init__(self, graph, mesh_shape, compute_time, fixed_inputs, fixed_outputs) -> None:
        self.graph = graph
        self.mesh_shape = mesh_shape
        self.ndim = len(mesh_shape)
        self.compute_time = compute_time
        self.fixed_inputs = fixed_inputs
        self.fixed_outputs = fixed_outputs
        self.mesh = None  # the fake DeviceMesh, set while building
        self.features: frozenset[str] = frozenset()  # op rules' optional choices offered
        self.optimizer = "adamw-fused"  # the AdamW implementation priced (adamw_step_time)
        self.grad_accumulation = 1  # micro-batches per step (graph is one of them)
        self.grad_itemsize: int | None = None  # bytes per kept gradient element
        self.frozen = graph.frozen_params()  # no gradient: no optimizer step either
        self.collective_cost: Callable[[str, float, int], float] | None = None
        self.fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
        self.infos = {
            name: info.results[0]
            for name, info in graph.nodes.items()
            if info.results and info.results[0] is not None
        }
        self.nodes: dict[str, NodeStrategies] = {}
        self.free: set[str] = set()
        # the loss's tangent and what is computed from it and free nodes alone: the same
        # on every rank, so a consumer may slice it to any placement for free
        self.seeded: set[str] = set()
        self.fallback: Counter = Counter()
        self.cache: dict[Any, tuple[list[Strategy], bool]] = {}
        self.cost_cache: dict[Any, np.ndarray] = {}
        self.calls = self.hits = self.merged = 0
        # every name of a tied parameter -> its canonical name; canonical -> first graph node
        tied = {alias: owner for owner, names in graph.param_names.items() for alias in names}
        # a traced FQN that owns a group is its own tensor, even when a depth-reduced graph's
        # renumbered name (the last block's "h.3") is also a real name of the middle block's
        tied.update({owner: owner for owner in graph.param_names})
        self.tied = tied
        self.param_node: dict[str, str] = {}

    def add(self, name: str, info) -> None:
        if info.kind == "buffer":
            self.free.add(name)
        elif info.kind == "param" and self.tied.get(info.fqn) in self.param_node:
            self.tied_param(name, info)
        elif info.kind in ("param", "input", "tangent"):
            self.leaf(name, info)
            if info.kind == "tangent":
                self.seeded.add(name)
        elif info.kind == "output":
            self.output(name, info)
        elif self.fx_nodes[name].target is operator.getitem:
            self.getitem(name)
        elif all(r is None for r in info.results) or all(a in self.free for a in info.arg_nodes):
            self.free.add(name)  # factory op, assertion, or computed from free nodes only
        else:
            if all(a in self.free or a in self.seeded for a in info.arg_nodes):
                self.seeded.add(name)
            self.op(name, info)

    def out_cands(self, name: str, index: int) -> list[Placements]:
        """The placements producer ``name``'s output ``index`` may have, in order."""
        ns = self.nodes[name]
        seen = dict.fromkeys(ns.strategies[c].outputs[index] for c in ns.choice)
        return [p for p in seen if p is not None]

    def replicated_only(self, name: str) -> bool:
        """Whether producer ``name`` can only give its output ``Replicate`` on every mesh
        dim (then slicing it to any placement is free: no communication)."""
        return all(all(isinstance(p, Replicate) for p in c) for c in self.out_cands(name, 0))

    def tied_param(self, name: str, info) -> None:
        """A tied parameter appears once per name in the graph: one placement for all,
        and one optimizer step (the first name's)."""
        first = self.nodes[self.param_node[self.tied[info.fqn]]]
        self.nodes[name] = NodeStrategies(
            name, first.strategies, np.zeros_like(first.compute_s), first.rep, first.choice
        )

    def leaf(self, name: str, info) -> None:
        """A parameter or an input: every placement (or the fixed inputs'). The loss's
        seed gradient (a tangent of ones) is Replicate: every rank makes it for itself.

        A tangent is not free, although every rank can make it: what is computed from it
        (the mean's backward broadcasts it to the output's shape) is as large as the
        output, so it is placed and priced like any activation; a free node would be
        computed whole on every rank (measured: a 392 MiB gradient of GPT-2's logits at
        batch 8 x 256 on each of 8 ranks, against a plan that had it sharded)."""
        if info.kind == "param":
            self.param_node.setdefault(self.tied.get(info.fqn, info.fqn), name)
        shape = info.results[0].shape
        if info.kind == "input" and self.fixed_inputs is not None:
            cands = [whole_on_single(self.fixed_inputs, self.mesh_shape)]
        elif info.kind == "tangent":
            cands = [(Replicate(),) * self.ndim]
        else:
            cands = all_placements(shape, self.mesh_shape)
        strategies = [Strategy((c,), ()) for c in cands]
        # a parameter's own cost is its optimizer step (training; a frozen one has none:
        # AdamW skips a parameter without a gradient); an input's is 0
        step = np.zeros(len(strategies))
        if info.kind == "param" and self.graph.mode == "train" and name not in self.frozen:
            t = info.results[0]
            step = np.array(
                [
                    adamw_step_time(t, c, self.mesh_shape, self.compute_time, self.optimizer)
                    for c in cands
                ]
            )
            n = self.grad_accumulation
            if n > 1:  # over n micro-batches: one step and n - 1 gradient adds
                adds = [
                    gradient_add_time(t, c, self.mesh_shape, self.compute_time, self.grad_itemsize)
                    for c in cands
                ]
                step = (step + (n - 1) * np.array(adds)) / n
        self.nodes[name] = NodeStrategies(name, strategies, step, name, np.arange(len(strategies)))

    def output(self, name: str, info) -> None:
        """One sink per tensor the graph returns."""
        for k, (arg, t) in enumerate(zip(info.arg_nodes, info.args, strict=True)):
            if arg in self.free or t is None:
                continue
            sink = f"{name}.{k}"
            grad_of = info.grad_of[k] if k < len(info.grad_of) else None
            if grad_of is not None:
                # a gradient must end with its parameter's placement: the sink follows the
                # parameter, and the edge into it prices the gradient reduction
                # (Partial -> Replicate all-reduce, -> Shard reduce-scatter)
                pn = self.nodes[self.param_node[self.tied.get(grad_of, grad_of)]]
                strategies = [Strategy((), (s.outputs[0],)) for s in pn.strategies]
                self.nodes[sink] = NodeStrategies(
                    sink, strategies, np.zeros(len(strategies)), pn.rep, pn.choice.copy()
                )
                continue
            if self.fixed_outputs is not None:
                cands = [whole_on_single(self.fixed_outputs, self.mesh_shape)]
            else:
                cands = all_placements(t.shape, self.mesh_shape)
            strategies = [Strategy((), (c,)) for c in cands]
            self.nodes[sink] = NodeStrategies(
                sink, strategies, np.zeros(len(strategies)), sink, np.arange(len(strategies))
            )

    def getitem(self, name: str) -> None:
        """``getitem`` picks one output of its producer: it follows the producer."""
        node = self.fx_nodes[name]
        src, idx = node.args[0].name, node.args[1]
        if src in self.free:
            self.free.add(name)
            return
        ps = self.nodes[src]
        strategies = [Strategy((s.outputs[idx],), (s.outputs[idx],)) for s in ps.strategies]
        self.nodes[name] = NodeStrategies(
            name, strategies, np.zeros(len(strategies)), ps.rep, ps.choice.copy()
        )

    def op(self, name: str, info) -> None:
        """An op: its rule's strategies (memoised by op, static arguments and the inputs'
        candidates), each priced by the roofline, then merged into its producer's variable
        when it follows it (:meth:`follow`)."""
        node = self.fx_nodes[name]
        cand_lists: list[list[Placements]] = []  # candidate placements of each tensor input
        for a, t in zip(info.arg_nodes, info.args, strict=True):
            if a in self.free or (a in self.seeded and self.replicated_only(a)):
                cand_lists.append(all_placements(t.shape, self.mesh_shape))
            else:
                cand_lists.append(self.out_cands(a, 0))
        target = node.target
        own = op_rule(target)
        key = (
            target,
            _static_key(node.args, self.infos),
            _static_key(dict(node.kwargs), self.infos),
            # rules given per mesh dim enumerate every combination whatever the inputs'
            # candidates, so the candidates only key the other rules
            None if own or tp.is_single_dim(target) else tuple(map(tuple, cand_lists)),
        )
        cached = self.cache.get(key)
        if cached is None:
            self.calls += 1
            strategies = _generate(
                node, info, self.mesh, self.mesh_shape, cand_lists, own, self.features
            )
            used_fallback = strategies is None
            if used_fallback:
                strategies = _replicate_fallback(len(info.args), info.results, self.ndim)
            strategies = [self.priced(s, node, info, own) for s in strategies]
            self.cache[key] = (strategies, used_fallback)
        else:
            self.hits += 1
            strategies, used_fallback = cached
        if used_fallback:
            self.fallback[str(target)] += 1
        ckey = (key[0], key[1], key[2], len(strategies), id(strategies))
        compute = self.cost_cache.get(ckey)
        if compute is None:
            compute = np.array(
                [
                    _compute_cost(node, info, s, self.mesh_shape, self.compute_time, own)
                    for s in strategies
                ]
            )
            self.cost_cache[ckey] = compute
        if not self.follow(name, info, strategies, compute, used_fallback):
            self.nodes[name] = NodeStrategies(
                name, strategies, compute, name, np.arange(len(strategies)), used_fallback
            )

    def priced(self, s: Strategy, node: Any = None, info: Any = None, rule: Any = None) -> Strategy:
        """``s`` with :attr:`Strategy.own_s` set: the seconds of what its op communicates
        itself and does not hide under its own compute (the rule's ``hidden``; build_plan
        counts them as communication, not compute)."""
        if not s.collectives:
            return s
        if self.collective_cost is None:
            raise ValueError("an op communicates itself, so collective_cost is required")
        seconds = [self.collective_cost(kind, nbytes, dim) for kind, dim, nbytes in s.collectives]
        hidden = 0.0
        if rule is not None and rule.hidden is not None:
            hidden = rule.hidden(node, info, s, self.mesh_shape, self.compute_time, seconds)
        return replace(s, own_s=float(sum(seconds) - hidden))

    def follow(self, name, info, strategies, compute, used_fallback) -> bool:
        """A follow node: one tensor input, and each placement its producer may give maps
        to one strategy with no resharding; it shares the producer's variable. Returns
        whether ``name`` was merged."""
        if len(info.arg_nodes) != 1 or info.arg_nodes[0] in self.free:
            return False
        if _grows(info):
            # a broadcast (expand): resharding its input costs less than resharding its
            # output, which merging would force (a BatchNorm backward's per-channel sum,
            # all-reduced at C numbers, not reduce-scattered at N x C x H x W)
            return False
        if info.arg_nodes[0] in self.seeded and self.replicated_only(info.arg_nodes[0]):
            return False  # it may take its input sliced (see op): a choice of its own
        ps = self.nodes[info.arg_nodes[0]]
        by_input: dict[Placements, int] = {}
        ambiguous = set()
        for j, s in enumerate(strategies):
            p = s.inputs[0]
            if p in by_input and strategies[by_input[p]].outputs != s.outputs:
                ambiguous.add(p)
            by_input.setdefault(p, j)
        produced = [ps.strategies[c].outputs[0] for c in ps.choice]
        if not all(p in by_input and p not in ambiguous for p in produced):
            return False
        choice = np.array([by_input[p] for p in produced], dtype=np.int64)
        self.nodes[name] = NodeStrategies(name, strategies, compute, ps.rep, choice, used_fallback)
        self.merged += 1
        return True


def _nested(ps: Placements | None) -> bool:
    """Some tensor dim is sharded over more than one mesh dim in ``ps``."""
    dims = [p.dim for p in ps or () if isinstance(p, Shard)]
    return len(dims) != len(set(dims))


def _grows(info) -> bool:  # noqa: ANN001 - a NodeInfo
    """The op's first output has more elements than its input."""
    if not info.args or not info.results or info.args[0] is None or info.results[0] is None:
        return False
    return math.prod(info.results[0].shape) > math.prod(info.args[0].shape)


def _generate(
    node, info, mesh, mesh_shape, cand_lists, own, features=frozenset()
) -> list[Strategy] | None:
    """Strategies for one op, deduplicated; ``None`` when no rule gives any."""
    if own is not None:
        found = own.generate(node, info.args, info.results, mesh_shape, features)
    elif tp.has_rule(node.target):
        rs = _rule_strategies(node, mesh, cand_lists)
        if rs is None:  # a rule that cannot handle these arguments: fall back
            return None
        found = [Strategy(r.outputs, r.inputs) for r in rs]
        if node.target in UNNESTED_OPS:
            found = [s for s in found if not any(map(_nested, (*s.inputs, *s.outputs)))]
    else:
        return None
    n_in = len(info.args)
    out = []
    seen = set()
    for s in found:
        s = whole_strategy(s, mesh_shape)  # one strategy per whole layout
        if len(s.inputs) != n_in or s in seen:
            continue
        if not _even(s, info, mesh_shape):
            continue
        seen.add(s)
        out.append(s)
    return out or None


def _rule_strategies(node, mesh, cand_lists) -> list | None:
    """DTensor's strategies for ``node`` given its inputs' candidate placements, or None
    when its rule refuses every candidate.

    A rule given several candidates for its first input answers for all of them at once,
    and raises when it refuses any one: ``aten.view``'s strict rule refuses to split a
    dim sharded unevenly into its groups (a key/value projection ``(B, S, 2*64)`` sharded
    ``S(2)`` 8 ways, viewed as ``(B, S, 2, 64)``), which would drop the batch-sharded
    ``S(0)`` candidate with it and replicate the op (issue 28: every grouped-query
    attention's key/value views fell back on meshes of 8 and more). The refused
    candidates are then left out, one at a time, as DTensor itself refuses them when the
    plan runs; a candidate reaches the op through a resharding the edge prices.
    """

    def rule(cands: list[list[Placements]]):
        return tp.rule_strategies(
            node.target,
            _to_meta_args(tuple(node.args)),
            _to_meta_args(dict(node.kwargs)),
            mesh,
            dict(enumerate(cands)),
            _out_meta(node),
        )

    try:
        return rule(cand_lists)
    except Exception:  # DTensor's rules refuse by raising (RuntimeError, AssertionError)
        if not cand_lists or len(cand_lists[0]) < 2:
            return None
    found = []
    for c in cand_lists[0]:
        try:
            found += rule([[c], *cand_lists[1:]])
        except Exception:  # this candidate refused, as above
            continue
    return found or None


def _even(s: Strategy, info, mesh_shape) -> bool:
    """Every sharded tensor dim divides evenly by the devices sharding it."""
    tensors = list(zip(s.inputs, info.args, strict=True)) + [
        (p, r) for p, r in zip(s.outputs, info.results, strict=False) if p is not None and r
    ]
    for ps, t in tensors:
        if t is None:
            continue
        div = [1] * max(len(t.shape), 1)
        for p, n in zip(ps, mesh_shape, strict=True):
            if isinstance(p, Shard):
                if p.dim >= len(t.shape):
                    return False
                div[p.dim] *= n
        if any(sz % d for sz, d in zip(t.shape, div, strict=False)):
            return False
    return True


def _compute_cost(node, info, s: Strategy, mesh_shape, compute_time, rule) -> float:
    """Roofline seconds of strategy ``s`` on one device: its local shard of the op
    (:func:`autoshard.strategies.registry.roofline`, or the op rule's own cost).

    Views (``view``, ``t``, ``permute``, ``expand``, ...) alias their input: 0 s.
    """
    if is_view(node.target):
        return 0.0
    if rule is not None and rule.compute_cost is not None:
        return rule.compute_cost(node, info, s, mesh_shape, compute_time)
    return roofline(node, info, s, mesh_shape, compute_time)


FOREACH_EXTRA_PASSES_BYTES = 52
"""Bytes per fp32 element that ``foreach`` AdamW moves beyond the fused kernel's 28:
``torch.optim.adam._multi_tensor_adam`` (torch 2.13, AdamW's weight decay, no amsgrad)
runs eight passes, ``mul_`` of the parameters (read and write, 8), ``lerp_`` of the first
moment toward the gradient (12), ``mul_`` and ``addcmul_`` of the second (8 + 12), its
``sqrt`` into a new tensor (8), ``div_`` and ``add_`` of that (8 + 8) and ``addcdiv_``
of the parameters (16): 80 bytes where one kernel moves 28
(tests/test_optimizer.py counts them from the ops PyTorch runs)."""


def adamw_step_time(
    t: TensorInfo,
    placements: Placements,
    mesh_shape: Sequence[int],
    compute_time: Callable[..., float],
    optimizer: str = "adamw-fused",
) -> float:
    """Seconds of one AdamW step on the shard of parameter ``t`` one device holds.

    ``torch.optim.AdamW``'s fused kernel (``optimizer`` ``"adamw-fused"``) reads the
    parameter, its gradient and both moments and writes the parameter and both moments:
    ``2 p + g + 16`` bytes per element with fp32 moments (28 for fp32 parameters), plus 8
    (read and write an fp32 master copy) when the parameter is not fp32 (ZeRO,
    Rajbhandari et al., SC'20, section 3.1). About 10 FLOPs per element against 28
    bytes: memory-bound, so the roofline's byte term (``compute_time(0, bytes, dtype)``).
    ``"adamw-foreach"`` adds the passes of PyTorch's ``foreach`` implementation over the
    same fp32 elements (:data:`FOREACH_EXTRA_PASSES_BYTES`, 52 bytes: 80 in all for an
    fp32 parameter).
    """
    p = t.itemsize
    per_element = 2 * p + p + 16 + (8 if t.dtype != torch.float32 else 0)
    if optimizer == "adamw-foreach":
        per_element += FOREACH_EXTRA_PASSES_BYTES
    local = math.prod(local_shape(t.shape, placements, mesh_shape))
    return compute_time(0.0, per_element * local, t.dtype)


def gradient_add_time(
    t: TensorInfo,
    placements: Placements,
    mesh_shape: Sequence[int],
    compute_time: Callable[..., float],
    grad_itemsize: int | None = None,
) -> float:
    """Seconds of adding one micro-batch's gradient of parameter ``t`` to the one kept
    (gradient accumulation: autograd's ``AccumulateGrad``, FSDP's ``add_`` of the sharded
    gradient), on the shard one device holds: two reads and a write of ``grad_itemsize``
    bytes per element (``None``: the parameter's own), memory-bound (the roofline's byte
    term)."""
    item = grad_itemsize if grad_itemsize is not None else t.itemsize
    local = math.prod(local_shape(t.shape, placements, mesh_shape))
    return compute_time(0.0, 3 * item * local, t.dtype)


def tie_layers(graph: TracedGraph, nodes: dict[str, NodeStrategies]) -> int:
    """Share variables among identical repeated layers (Alpa-style layer tying).

    The nodes of each repeated block, in graph order, are matched by position with
    those of an earlier block (the first that matches). When every representative of
    block ``L`` has, at the same position, a representative of that block with the same
    op, shapes and strategy list, block ``L``'s representatives are replaced by that
    block's: its nodes then follow its variables (their ``choice`` arrays stay valid,
    the strategy lists being equal). Costs still count every layer (they are
    summed per representative); edges between layers stay edges, now between the
    reference block's variables (see :func:`_build_edges`). Mutates ``nodes``.

    Returns:
        The number of layers tied to an earlier one.
    """
    by_layer: dict[int, list[str]] = {}
    for name in nodes:
        base = name.split(".")[0] if name not in graph.nodes else name
        info = graph.nodes.get(base)
        if info is not None and info.layer is not None and base == name:
            by_layer.setdefault(info.layer, []).append(name)
    if len(by_layer) < 2:
        return 0

    def sig(n: str) -> tuple:
        i = graph.nodes[n]
        return (i.kind, i.op_name, tuple(i.args), tuple(i.results), i.backward)

    def match(ref: list[str], cur: list[str]) -> dict[str, str] | None:
        if len(cur) != len(ref):
            return None
        local: dict[str, str] = {}
        for a, b in zip(ref, cur, strict=True):
            if sig(a) != sig(b):
                return None
            na, nb = nodes[a], nodes[b]
            if nb.rep == b:
                if na.rep != a or na.strategies != nb.strategies:
                    return None
                local[b] = a
        return local

    # each layer ties to the first earlier layer it matches; one that matches none is a
    # new reference (the first block, holding the embeddings' backward, may differ from
    # the blocks after it, which still share one plan)
    refs: list[list[str]] = []
    mapping: dict[str, str] = {}
    tied = 0
    for layer in sorted(by_layer):
        cur = by_layer[layer]
        for ref in refs:
            local = match(ref, cur)
            if local is not None:
                mapping.update(local)
                tied += 1
                break
        else:
            refs.append(cur)
    for ns in nodes.values():
        ns.rep = mapping.get(ns.rep, ns.rep)
    return tied


def bucketed_use(
    graph: TracedGraph, nodes: dict[str, NodeStrategies], producer: str, consumer: str
) -> str:
    """How a tensor use's collectives run: ``"gradient"`` into a gradient output (DDP's
    bucketed reduction), ``"gather"`` when the producer's variable is a parameter (FSDP's
    grouped all-gather), ``""`` otherwise (an activation, on the critical path). Both
    bucketed kinds can hide under compute (:mod:`autoshard.cost.overlap`)."""
    if is_gradient_sink(graph, consumer):
        return GRADIENT
    info = graph.nodes.get(nodes[producer].rep)
    return GATHER if info is not None and info.kind == "param" else ""


def is_gradient_sink(graph: TracedGraph, name: str) -> bool:
    """Whether ``name`` is an output sink ``output.<k>`` holding a parameter's gradient."""
    base, _, k = name.rpartition(".")
    info = graph.nodes.get(base)
    return (
        info is not None
        and info.kind == "output"
        and k.isdigit()
        and int(k) < len(info.grad_of)
        and info.grad_of[int(k)] is not None
    )


def _build_edges(
    graph,
    nodes,
    free,
    redistribute_costs,
    bucketed_costs=None,
    reduce_itemsize=None,
    share_reads=False,
    rerun=None,  # per policy, the forward ops it reruns (StrategyGraph.rerun_ops)
) -> tuple[list[Edge], dict, list, tuple[dict, list]]:
    """Edges between representatives, linear costs of edges inside one
    (:func:`merge_edges`), the reshardings reads share
    (:func:`autoshard.strategies.sharing.build_shares`), and the recomputed blocks'
    parameter reads that can take their backward's gather (:func:`rerun_pairs`): one
    edge per tensor read, its cost matrix over the distinct produced and wanted
    placements (cached by placements, shape and dtype). Edges into a
    gradient output or out of a parameter are priced by ``bucketed_costs`` when given;
    edges into a gradient output move ``reduce_itemsize`` bytes per element when given
    (mixed precision reduces gradients in fp32)."""
    consumers: list[tuple[str, int, str, TensorInfo]] = []
    for name, info in graph.nodes.items():
        if info.kind == "op" and name in nodes:
            for k, (a, t) in enumerate(zip(info.arg_nodes, info.args, strict=True)):
                consumers.append((name, k, a, t))
        elif info.kind == "output":
            for k, (a, t) in enumerate(zip(info.arg_nodes, info.args, strict=True)):
                if f"{name}.{k}" in nodes:
                    consumers.append((f"{name}.{k}", 0, a, t))
    cost_cache: dict[tuple, np.ndarray] = {}
    windows = schedule(graph).windows

    def edge(dst_name: str, k: int, src_name: str, t: TensorInfo) -> Edge:
        src, dst = nodes[src_name], nodes[dst_name]
        s_rep, d_rep = nodes[src.rep], nodes[dst.rep]
        produced = [src.strategies[src.choice[i]].outputs[0] for i in range(len(s_rep.strategies))]
        wanted = [dst.strategies[dst.choice[j]].inputs[k] for j in range(len(d_rep.strategies))]
        p_list = list(dict.fromkeys(produced))
        q_list = list(dict.fromkeys(wanted))
        kind = bucketed_use(graph, nodes, src_name, dst_name)
        bucketed = bool(kind) and bucketed_costs is not None
        price = bucketed_costs if bucketed else redistribute_costs
        # a gradient is reduced in the reduce dtype (mixed precision: fp32)
        item = reduce_itemsize if kind == GRADIENT and reduce_itemsize else t.itemsize
        ckey = (tuple(p_list), tuple(q_list), t.shape, item, bucketed)
        cost = cost_cache.get(ckey)
        if cost is None:
            cost = np.array(price(p_list, q_list, t.shape, item), dtype=float)
            cost_cache[ckey] = cost
        m = graph.mult(dst_name)
        cost_m = cost * m if m != 1 else cost
        parts = windows(kind, src_name, dst_name) if kind else []
        reader = graph.nodes.get(dst_name)
        forward_layer = (
            reader.layer
            if reader is not None and reader.kind == "op" and not reader.backward
            else None
        )
        p_index = {p: i for i, p in enumerate(p_list)}
        q_index = {q: i for i, q in enumerate(q_list)}
        return Edge(
            src=src.rep,
            dst=dst.rep,
            tensor=t,
            src_placements=p_list,
            dst_placements=q_list,
            src_groups=np.array([p_index[p] for p in produced], dtype=np.int64),
            dst_groups=np.array([q_index[q] for q in wanted], dtype=np.int64),
            cost=cost_m,
            producer=src_name,
            consumer=dst_name,
            members=[t],
            overlap=kind,
            hide={(w, o): m * share for w, o, share in parts},
            uses=float(m),
            full_uses=_rerun_use(forward_layer, dst_name, rerun["full"]),
            selective_uses=_rerun_use(forward_layer, dst_name, rerun["selective"]),
        )

    kept = [c for c in consumers if c[2] not in free]
    raw = [edge(*c) for c in kept]
    merged, extra, where = merge_edges_indexed(raw)
    reads = {(a, name, k): where[j] for j, (name, k, a, _) in enumerate(kept)}
    pairs = rerun_pairs(graph, merged, reads, rerun)
    if not share_reads:
        return merged, extra, [], pairs
    keys = [share_key(graph, e.consumer, e.producer, e.overlap) for e in raw]
    return merged, extra, build_shares(raw, where, keys, graph, rerun), pairs


def _gathers_of_one_variable(f: Edge, g: Edge) -> bool:
    """Whether edges ``f`` and ``g`` both gather one parameter's variable."""
    return f.overlap == GATHER and g.overlap == GATHER and f.src == g.src


@dataclass
class RerunPair:
    """Two edges whose reads pair as :func:`autoshard.trace.rerun_reads.shared_rerun_reads`
    says: ``forward`` (a recomputed block's parameter read) and ``backward`` (the block's
    backward read of the same parameter), with per layer the forward reads of ``forward``
    so paired that full checkpointing reruns (``full``: up to the block's early stop,
    :func:`~autoshard.trace.selective.recomputed_ops`) and those selective checkpointing
    reruns (``selective``); ``dims``: their chain's
    :attr:`~autoshard.trace.rerun_reads.RerunRead.dims`."""

    forward: int
    backward: int
    dims: tuple[int, ...] | None = ()
    full: dict[int, int] = field(default_factory=dict)
    selective: dict[int, int] = field(default_factory=dict)


def _rerun_use(layer: int | None, reader: str, rerun: frozenset[str]) -> dict[int, int]:
    """An edge's reads by one real copy of ``layer``'s forward that a policy rerunning
    ``rerun`` reads again: ``{layer: 1}`` or none (not a block's forward read, or after
    the block's early stop)."""
    return {layer: 1} if layer is not None and reader in rerun else {}


def rerun_pairs(graph, edges: list[Edge], reads: dict, rerun: dict) -> tuple[dict, list]:  # noqa: ANN001
    """The recomputed blocks' reads that can take their backward's gathered copy, per
    forward read (:func:`~autoshard.trace.rerun_reads.shared_rerun_reads`, those whose
    two reads are gathers along edges between variables), and as :class:`RerunPair` s of
    ``edges`` (``reads``: each read ``(producer, consumer, k)`` -> its edge's index, or
    ``None`` for a read inside one variable; ``rerun``: per policy, the ops it reruns)."""
    found = {}
    pairs: dict[tuple, RerunPair] = {}
    for key, pair in shared_rerun_reads(graph).items():
        f, g = reads.get(key), reads.get(pair.backward)
        if f is None or g is None or not _gathers_of_one_variable(edges[f], edges[g]):
            continue
        found[key] = pair
        layer = graph.nodes[key[1]].layer
        p = pairs.setdefault((f, g, pair.dims), RerunPair(f, g, pair.dims))
        for policy, counts in (("full", p.full), ("selective", p.selective)):
            if key[1] in rerun[policy]:
                counts[layer] = counts.get(layer, 0) + 1
    return found, list(pairs.values())


def merge_edges(edges: Iterable[Edge]) -> tuple[list[Edge], dict[str, np.ndarray]]:
    """:func:`merge_edges_indexed` without the index of each given edge."""
    merged, extra, _ = merge_edges_indexed(edges)
    return merged, extra


def merge_edges_indexed(
    edges: Iterable[Edge],
) -> tuple[list[Edge], dict[str, np.ndarray], list[int | None]]:
    """Edges between representatives, and the linear costs of edges inside one.

    An edge whose two ends follow one variable (a follow node, or tied layers) costs a
    fixed amount per strategy of it, zero for follow nodes: that goes into the returned
    linear costs (representative -> seconds per strategy). Edges with the same endpoints,
    placements and grouping of strategies (e.g. the same edge in every tied layer) are
    merged by summing their cost matrices: their transportation variables would be equal
    anyway. The given edges are not modified.
    """
    merged: dict[tuple, Edge] = {}
    extra: dict[str, np.ndarray] = {}
    where: list[int | None] = []
    position: dict[tuple, int] = {}
    for e in edges:
        if e.src == e.dst:
            per = e.cost[e.src_groups, e.dst_groups]
            if np.any(per):
                extra[e.src] = extra.get(e.src, 0) + per
            where.append(None)
            continue
        key = (
            e.src,
            e.dst,
            tuple(e.src_placements),
            tuple(e.dst_placements),
            e.src_groups.tobytes(),
            e.dst_groups.tobytes(),
        )
        kept = merged.get(key)
        where.append(position.setdefault(key, len(position)))
        if kept is None:
            merged[key] = replace(
                e,
                members=list(e.members),
                full_uses=dict(e.full_uses),
                selective_uses=dict(e.selective_uses),
                hide=dict(e.hide),
            )
        else:
            kept.cost = kept.cost + e.cost
            kept.members.extend(e.members)
            for h, m in e.hide.items():
                kept.hide[h] = kept.hide.get(h, 0.0) + m
            kept.uses += e.uses
            for layer, n in e.full_uses.items():
                kept.full_uses[layer] = kept.full_uses.get(layer, 0) + n
            for layer, n in e.selective_uses.items():
                kept.selective_uses[layer] = kept.selective_uses.get(layer, 0) + n
    return list(merged.values()), extra, where
