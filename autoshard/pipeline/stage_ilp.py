"""One intra-op ILP per candidate pipeline stage (Alpa's intra-op pass, run per stage).

A stage holding layers ``i..j-1`` is planned on its own: its nodes are cut out of the
strategy graph of the whole model on the stage submesh (:func:`stage_graph`), the
activations it receives from other stages become sources whose cost is the receive, the
activations it sends carry the cost of the send, and the usual ILP
(:func:`autoshard.solver.ilp.solve`) picks the stage's placements under the stage's memory budget.
So a stage boundary may change the plan: an early stage may keep data parallelism while a
late one shards its weights. In training the joint forward/backward graph is cut the same
way (each backward op lies in the layer of the forward op it differentiates), so the
gradients crossing a boundary backwards are priced like the activations crossing it
forwards. docs/pipeline-stages.md ("Stage time") gives the formulas.

Alpa (Zheng et al., OSDI 2022, Sec. 5.2) compiles and profiles every (layer range, submesh)
pair; autoshard prices each range with the ILP's cost model instead, and solves each
structurally distinct range once (:class:`StagePricer` caches by the layers' structure, so
the middle stages of a model with identical blocks share one ILP per length).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from torch.distributed.tensor import Partial, Replicate

from autoshard.cost.collectives import comm_model
from autoshard.cost.liveness import local_bytes
from autoshard.cost.memory import ilp_row, memory_rows
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.solver.ilp import lp_bound, solve
from autoshard.strategies.graph import Edge, NodeStrategies, StrategyGraph, merge_edges, tie_layers

__all__ = ["StageGraph", "StagePrice", "StagePricer", "node_layers", "stage_graph"]


def _base(name: str, nodes: dict) -> str:
    """Graph node of a strategy-graph node name (``output.3`` -> ``output``)."""
    return name if name in nodes else name.rsplit(".", 1)[0]


def node_layers(sg: StrategyGraph, layer_of: dict[str, int], param_layers, last: int):
    """The layers each strategy-graph node belongs to.

    An op belongs to its own layer; a parameter or buffer to every layer that reads it
    (each stage holding one of them keeps a copy); a gradient sink (``output.k`` whose
    ``grad_of`` names a parameter) to the first layer reading that parameter, where its
    gradient is reduced; the loss to the last layer.

    Returns:
        node name -> tuple of layer indices (ascending).
    """
    graph = sg.graph
    param_node = {i.fqn: n for n, i in graph.nodes.items() if i.kind == "param"}
    out: dict[str, tuple[int, ...]] = {}
    for name in sg.nodes:
        base = _base(name, graph.nodes)
        info = graph.nodes[base]
        if base in param_layers:
            out[name] = tuple(sorted(param_layers[base]))
        elif info.kind == "output" and name != base:
            k = int(name.rsplit(".", 1)[1])
            g = info.grad_of[k] if k < len(info.grad_of) else None
            p = param_node.get(g) if g else None
            out[name] = (min(param_layers[p]),) if p in param_layers else (last,)
        else:
            out[name] = (layer_of[base],)
    return out


def _partial(ps) -> bool:
    return ps is not None and any(isinstance(p, Partial) for p in ps)


@dataclass
class StageGraph:
    """A stage's strategy graph and the pieces of its cost that are transfers.

    Attributes:
        sg: the stage's :class:`~autoshard.strategies.graph.StrategyGraph` (same traced graph).
        sources: boundary nodes made by another stage: their compute cost is the receive.
        send_s: representative -> seconds of the transfers priced on its variable (sends,
            and receives inside a merged group), per its strategies.
    """

    sg: StrategyGraph
    sources: list[str]
    send_s: dict[str, np.ndarray] = field(default_factory=dict)

    def p2p_s(self, choice: dict[str, int]) -> float:
        """Seconds of sends and receives under ``choice``."""
        recv = sum(float(self.sg.nodes[s].compute_s[choice[s]]) for s in self.sources)
        return recv + sum(float(v[choice[r]]) for r, v in self.send_s.items())


def _transfer_s(nbytes: float, mesh: MeshSpec) -> float:
    """One point-to-point transfer over mesh dim 0 (the link a pipeline boundary crosses)."""
    return nbytes / mesh.bandwidth[0] + mesh.latency[0] if nbytes > 0 else 0.0


def _send_s(t, ps, mesh: MeshSpec) -> float:
    """Seconds to send tensor ``t`` held under placements ``ps``: a ``Partial`` value is
    first reduced to ``Replicate`` on its mesh dims, then each device sends its shard."""
    cost = 0.0
    if _partial(ps):
        whole = tuple(Replicate() if isinstance(x, Partial) else x for x in ps)
        cost = comm_model(mesh).redistribute_cost(ps, whole, t.shape, t.itemsize)
        ps = whole
    return cost + _transfer_s(local_bytes(t, ps, mesh.shape), mesh)


def _recv_s(t, ps, mesh: MeshSpec) -> float:
    """Seconds to receive tensor ``t`` wanted under placements ``ps`` (a ``Partial`` one
    arrives reduced, whole)."""
    return _transfer_s(local_bytes(t, None if _partial(ps) else ps, mesh.shape), mesh)


def stage_graph(
    sg: StrategyGraph,
    members: set[str],
    mesh: MeshSpec,
    sync_scale: float = 1.0,
    sync_sinks: Iterable[str] = (),
    tie: bool = True,
) -> StageGraph:
    """Cut the nodes ``members`` of ``sg`` out into a stage's own strategy graph.

    - A member whose representative lies outside the stage takes over the variable:
      the first member of the group (graph order) becomes its representative, with the
      old representative's strategy order.
    - A node outside the stage that a member reads becomes a *source*: its own variable,
      its strategies without ``Partial`` outputs (a stage sends values, not pending
      reductions), and as compute cost the receive of its local bytes over mesh dim 0,
      ``bytes / bandwidth[0] + latency[0]``.
    - A member read outside the stage pays the send of its local bytes the same way (a
      ``Partial`` output first pays its reduction to ``Replicate``), added to its
      representative's cost.
    - Edges into ``sync_sinks`` (the gradient reductions of a training step) are scaled
      by ``sync_scale`` (1/B: once per step, not once per micro-batch).
    - With ``tie``, identical layers of the stage share variables, as ``autoshard solve``
      ties them (:func:`autoshard.strategies.graph.tie_layers`): far fewer variables, the same
      plan for every copy of a block within the stage.

    Raises:
        AutoshardError: when ``members`` holds no node of ``sg``.
    """
    nodes = sg.nodes
    if not any(n in nodes for n in members):
        raise AutoshardError("a pipeline stage holds no node of the model")
    groups: dict[str, list[str]] = {}
    for n, ns in nodes.items():
        if n in members:
            groups.setdefault(ns.rep, []).append(n)
    new_rep = {rep: rep if rep in members else ms[0] for rep, ms in groups.items()}

    incoming: dict[str, list[int]] = {}
    outgoing: dict[str, list[int]] = {}
    for k, e in enumerate(sg.edges):
        p, c = e.producer or e.src, e.consumer or e.dst
        if c in members and p not in members:
            incoming.setdefault(p, []).append(k)
        elif p in members and c not in members:
            outgoing.setdefault(p, []).append(k)

    out_nodes: dict[str, NodeStrategies] = {}
    source_groups: dict[int, np.ndarray] = {}
    for n, ns in nodes.items():
        if n in members:
            r = new_rep[ns.rep]
            if n == r and ns.rep != n:  # promoted: strategies in the old representative's order
                out_nodes[n] = NodeStrategies(
                    n,
                    [ns.strategies[c] for c in ns.choice],
                    ns.compute_s[ns.choice],
                    n,
                    np.arange(len(ns.choice)),
                    ns.fallback,
                )
            else:
                out_nodes[n] = NodeStrategies(
                    n, ns.strategies, ns.compute_s, r, ns.choice, ns.fallback
                )
        elif n in incoming:
            out_nodes[n], kept = _source(sg, n, [sg.edges[k] for k in incoming[n]], mesh)
            # each incoming edge's source groups, over the source's own strategies
            for k in incoming[n]:
                e = sg.edges[k]
                by_strategy: dict[int, int] = {}
                for i, f in enumerate(ns.choice):
                    by_strategy.setdefault(int(f), int(e.src_groups[i]))
                source_groups[k] = np.array([by_strategy[f] for f in kept], dtype=int)

    sinks = set(sync_sinks)
    edges: list[Edge] = []
    for k, e in enumerate(sg.edges):
        p, c = e.producer or e.src, e.consumer or e.dst
        if c not in members:
            continue
        if p in members:
            src, groups_ = new_rep[e.src], e.src_groups
        elif k in source_groups:
            src, groups_ = p, source_groups[k]
        else:
            continue
        cost = e.cost * sync_scale if c in sinks and sync_scale != 1.0 else e.cost
        edges.append(replace(e, src=src, dst=new_rep[e.dst], src_groups=groups_, cost=cost))

    send_s: dict[str, np.ndarray] = {}
    for p, ks in outgoing.items():
        ns = nodes[p]
        rep = new_rep[ns.rep]
        seen: set = set()
        vec = np.zeros(len(out_nodes[rep].strategies))
        for k in ks:
            e = sg.edges[k]
            if e.tensor in seen:
                continue
            seen.add(e.tensor)
            for i in range(len(vec)):
                vec[i] += _send_s(e.tensor, e.src_placements[e.src_groups[i]], mesh)
        send_s[rep] = send_s.get(rep, 0) + vec

    # A follow node shares its producer's variable and no edge joins them; when the two
    # lie in different stages the tensor still crosses the boundary (a view of a gradient
    # made by the next stage): price it on the group's variable, as a send or a receive.
    # Each tensor crosses once per stage: one already sent along an edge or received as
    # a source is not priced again.
    graph = sg.graph
    crossed = set(incoming) | set(outgoing)
    joined: set[tuple[str, str]] = set()
    for u, info in graph.nodes.items():
        if u not in nodes or info.kind != "op":
            continue
        for a in dict.fromkeys(info.arg_nodes):
            if a not in nodes or a in sg.free or nodes[a].rep != nodes[u].rep:
                continue
            if u in members and a in incoming and (a, new_rep[nodes[u].rep]) not in joined:
                # the producer is this stage's source (another member reads it along an
                # edge), so it has its own variable now: join it to the group it fed
                rep = new_rep[nodes[u].rep]
                joined.add((a, rep))
                edges.append(_follow_edge(out_nodes[a], nodes[a], a, u, rep, graph, mesh))
                continue
            if (a in members) == (u in members) or a in crossed:
                continue
            crossed.add(a)
            ns = nodes[a]
            rep = new_rep[ns.rep]
            t = graph.nodes[a].results[0]
            vec = np.zeros(len(out_nodes[rep].strategies))
            for i in range(len(vec)):
                ps = ns.strategies[ns.choice[i]].outputs[0]
                vec[i] += _send_s(t, ps, mesh) if a in members else _recv_s(t, ps, mesh)
            send_s[rep] = send_s.get(rep, 0) + vec

    extra = {new_rep[r]: v for r, v in sg.extra_cost.items() if r in new_rep}
    for r, v in send_s.items():
        extra[r] = extra.get(r, 0) + v
    if tie:
        edges, extra, send_s = _tie(graph, out_nodes, members, edges, extra, send_s)
    sub = StrategyGraph(
        graph=sg.graph,
        mesh_shape=sg.mesh_shape,
        nodes=out_nodes,
        free=sg.free,
        edges=edges,
        fallback_ops=Counter(),
        seconds=0.0,
        extra_cost=extra,
        tied_layers=0,
        bucket_bytes=sg.bucket_bytes,
        overlap=sg.overlap,
        seeded=sg.seeded,
        reduce_itemsize=sg.reduce_itemsize,
        not_compute=frozenset(incoming),
        early_stop=sg.early_stop,
        optimizer=sg.optimizer,
        rerun_ops=sg.rerun_ops,
    )
    return StageGraph(sub, list(incoming), send_s)


def _follow_edge(
    source: NodeStrategies, whole: NodeStrategies, a: str, u: str, rep: str, graph, mesh
) -> Edge:
    """The edge from a stage's source ``a`` to the group ``rep`` whose member ``u`` follows
    ``a`` in the whole graph: the group's strategy ``j`` wants ``a``'s output as ``a``'s
    whole-graph strategy under ``j`` produced it; the source gives its own; the cost is the
    resharding between the two."""
    t = graph.nodes[a].results[0]
    produced = [source.strategies[c].outputs[0] for c in source.choice]
    wanted = [whole.strategies[c].outputs[0] for c in whole.choice]
    p_list, q_list = list(dict.fromkeys(produced)), list(dict.fromkeys(wanted))
    comm = comm_model(mesh)
    cost = np.array(comm.redistribute_costs(p_list, q_list, t.shape, t.itemsize), dtype=float)
    return Edge(
        src=a,
        dst=rep,
        tensor=t,
        src_placements=p_list,
        dst_placements=q_list,
        src_groups=np.array([p_list.index(p) for p in produced], dtype=np.int64),
        dst_groups=np.array([q_list.index(q) for q in wanted], dtype=np.int64),
        cost=cost * graph.mult(u),
        producer=a,
        consumer=u,
        members=[t],
    )


def _tie(graph, out_nodes, members, edges, extra, send_s):
    """Tie the stage's identical layers (:func:`autoshard.strategies.graph.tie_layers`), then
    move edges and linear costs onto the tied variables (:func:`merge_edges`)."""
    tie_layers(graph, {n: ns for n, ns in out_nodes.items() if n in members})

    def final(costs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for r, v in costs.items():
            rep = out_nodes[r].rep
            out[rep] = out.get(rep, 0) + v
        return out

    tied, folded = merge_edges(
        replace(e, src=out_nodes[e.src].rep, dst=out_nodes[e.dst].rep) for e in edges
    )
    new_extra = final(extra)
    for r, v in folded.items():
        new_extra[r] = new_extra.get(r, 0) + v
    return tied, new_extra, final(send_s)


def _source_strategies(ns: NodeStrategies) -> list[int]:
    """Strategies a boundary source may take: those its variable reaches, without Partial
    outputs (all of them if every one has a Partial output)."""
    reach = sorted({int(f) for f in ns.choice})
    ok = [f for f in reach if not any(_partial(o) for o in ns.strategies[f].outputs)]
    return ok or reach


def _source(
    sg: StrategyGraph, name: str, edges: list[Edge], mesh: MeshSpec
) -> tuple[NodeStrategies, list[int]]:
    """A node made by another stage, as its own variable costed by the receive of the
    tensors the stage reads; also the indices of its strategies that it keeps."""
    ns = sg.nodes[name]
    kept = _source_strategies(ns)
    info = sg.graph.nodes[_base(name, sg.graph.nodes)]
    read = {e.tensor for e in edges}
    cost = np.zeros(len(kept))
    for a, f in enumerate(kept):
        nbytes = 0.0
        for r, ps in zip(info.results, ns.strategies[f].outputs, strict=False):
            if r is not None and r in read:
                nbytes += local_bytes(r, None if _partial(ps) else ps, mesh.shape)
        cost[a] = _transfer_s(nbytes, mesh)
    strategies = [ns.strategies[f] for f in kept]
    return NodeStrategies(name, strategies, cost, name, np.arange(len(kept)), ns.fallback), kept


@dataclass
class StagePrice:
    """One stage priced by its own ILP.

    Attributes:
        time_s: seconds per micro-batch (the ILP's objective); inf when the stage has no
            plan (``memory_bytes`` 0), 0 when it has none within the memory budget (then
            ``memory_bytes`` is the least it can reach, above the budget, so
            :func:`autoshard.pipeline.stages.assign_stages` never chooses it).
        p2p_s: of which sends and receives.
        memory_bytes: bytes per device (parameters, gradients, optimizer state and the
            saved activations of the micro-batches in flight) of its plan.
        choice: the ILP's choice, in the stage graph's representative order.
        status: the ILP's status, or why the stage has no plan.
    """

    time_s: float
    p2p_s: float
    memory_bytes: float
    choice: list[int] = field(default_factory=list)
    status: str = "optimal"


class StagePricer:
    """Prices stages ``(i, j)`` of one pipeline degree by per-stage ILPs, with a cache.

    Args:
        config: the :class:`~autoshard.solver.solve.SolveConfig` (its mesh is the stage submesh).
        sg: the strategy graph of the whole model on the submesh (built once per degree).
        layer_of, param_layers, num_layers: the :class:`~autoshard.pipeline.pricing.LayerMap`.
        microbatches: B; gradient reductions cost 1/B per micro-batch.
        in_flight: copies of a micro-batch's saved activations a stage keeps (1F1B: up to
            the pipeline degree at the first stage; this bound is used for every stage).
        tie: identical layers within a stage share one plan (:func:`stage_graph`).
    """

    def __init__(
        self,
        config,
        sg: StrategyGraph,
        layer_of: dict[str, int],
        param_layers: dict[str, set[int]],
        num_layers: int,
        microbatches: int,
        in_flight: int,
        tie: bool = True,
    ) -> None:
        self.config = config
        self.tie = tie
        self.sg = sg
        self.num_layers = num_layers
        self.microbatches = microbatches
        self.in_flight = in_flight
        self.layers = node_layers(sg, layer_of, param_layers, num_layers - 1)
        graph = sg.graph
        out = next((n for n, i in graph.nodes.items() if i.kind == "output"), None)
        self.sync_sinks = {
            f"{out}.{k}" for k, g in enumerate(graph.nodes[out].grad_of if out else []) if g
        }
        self._signature = self._layer_signatures()
        self._cache: dict[Any, StagePrice] = {}
        self._bounds: dict[Any, float | None] = {}
        self._bounded: dict[tuple[int, int], StageGraph] = {}  # cut by bound, for price
        self.ilps = 0

    def _layer_signatures(self) -> list[int]:
        """A hash of each layer's structure: its nodes' ops, tensor shapes, strategy
        counts and multiplicities in graph order. Equal hashes mean interchangeable
        layers."""
        graph = self.sg.graph
        parts: list[list] = [[] for _ in range(self.num_layers)]
        for n, ls in self.layers.items():
            info = graph.nodes[_base(n, graph.nodes)]
            key = (
                info.kind,
                str(info.target),
                tuple(r.shape if r is not None else None for r in info.results),
                len(self.sg.nodes[n].strategies),
                len(ls),
                graph.mult(n),  # a traced block standing for several (reduce_depth)
            )
            for k in ls:
                parts[k].append(key)
        return [hash(tuple(p)) for p in parts]

    def members(self, i: int, j: int) -> set[str]:
        return {n for n, ls in self.layers.items() if any(i <= k < j for k in ls)}

    def graph(self, i: int, j: int) -> StageGraph:
        """The stage graph of layers ``i..j-1``."""
        return stage_graph(
            self.sg,
            self.members(i, j),
            self.config.mesh,
            sync_scale=1.0 / self.microbatches,
            sync_sinks=self.sync_sinks,
            tie=self.tie,
        )

    def price(self, i: int, j: int) -> StagePrice:
        """Solve (or recall) the ILP of the stage holding layers ``i..j-1``."""
        key = (tuple(self._signature[i:j]), i == 0, j == self.num_layers)
        if key not in self._cache:
            stage = self._bounded.pop((i, j), None) or self.graph(i, j)
            self._cache[key] = self._solve(stage)
        return self._cache[key]

    def bound(self, i: int, j: int) -> float | None:
        """A lower bound on :meth:`price`'s ``time_s`` for layers ``i..j-1`` without its
        ILP: the LP relaxation of the stage's program under the stage's memory row
        (:func:`~autoshard.solver.ilp.lp_bound`; ``inf`` when no plan of the stage fits
        the budget, ``None`` when the LP stopped at its limits). Cached as :meth:`price`."""
        key = (tuple(self._signature[i:j]), i == 0, j == self.num_layers)
        if key in self._cache:
            price = self._cache[key]
            return price.time_s if price.memory_bytes <= self.config.budget() else math.inf
        if key not in self._bounds:
            stage = self._bounded[(i, j)] = self.graph(i, j)  # price() cuts it no more
            sub = stage.sg
            rows = memory_rows(sub, self.config.memory_model(), self.in_flight)
            memory = (ilp_row(sub, rows), self.config.budget())
            self._bounds[key] = lp_bound(sub, self.config.solver, memory)
        return self._bounds[key]

    def _solve(self, stage: StageGraph) -> StagePrice:
        sub = stage.sg
        rows = memory_rows(sub, self.config.memory_model(), self.in_flight)
        self.ilps += 1
        try:
            res = solve(sub, self.config.solver, memory=(ilp_row(sub, rows), self.config.budget()))
        except MemoryBudgetError as exc:
            # runnable but over the budget: assign_stages rejects it, and its least memory
            # lets the error name the smallest fullest stage any split reaches
            return StagePrice(0.0, 0.0, exc.least_bytes, status=str(exc))
        except AutoshardError as exc:
            return StagePrice(math.inf, math.inf, 0.0, status=str(exc))
        memory = float(sum(rows[r][c] for r, c in res.choice.items() if r in rows))
        return StagePrice(
            res.objective_s,
            stage.p2p_s(res.choice),
            memory,
            [res.choice[r] for r in sub.reps],
            res.status,
        )

    def choice(self, i: int, j: int) -> tuple[StageGraph, dict[str, int]]:
        """The stage graph of ``(i, j)`` and its plan's choice, mapped by position from the
        cached ILP of a structurally identical stage.

        Raises:
            AutoshardError: the stage has no plan (its ILP was infeasible).
        """
        price = self.price(i, j)
        if not price.choice:
            raise AutoshardError(f"stage of layers {i}..{j - 1} has no plan: {price.status}")
        stage = self.graph(i, j)
        reps = stage.sg.reps
        if len(reps) != len(price.choice) or any(
            c >= len(stage.sg.nodes[r].strategies) for r, c in zip(reps, price.choice, strict=True)
        ):  # not positionally identical after all: solve this one
            again = self._solve(stage)
            if not again.choice:
                raise AutoshardError(f"stage of layers {i}..{j - 1} has no plan: {again.status}")
            return stage, dict(zip(reps, again.choice, strict=True))
        return stage, dict(zip(reps, price.choice, strict=True))
