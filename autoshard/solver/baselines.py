"""Hand-written parallelism plans (baselines), each a point of the ILP's search space.

A baseline fixes what a user of that style of parallelism fixes by hand: where each
parameter and input is stored, how each parameter is *used* (as stored, or gathered
first), for tensor parallelism which matmuls are column- and row-parallel and where the
activations between them live. These pins restrict the strategies of the same
:class:`~autoshard.strategies.graph.StrategyGraph` the ILP solves (:func:`restrict`). Every
other op then does what DTensor's sharding propagation does when the model runs with
those placements (:func:`propagate`): in graph order, each op takes its cheapest allowed
strategy given the placements its inputs already have (its compute plus the resharding
of its inputs; no look-ahead). Gradients (training graphs) end in their parameter's
placement, so a data-parallel gradient pays its all-reduce (or reduce-scatter) there.
``run_baseline(..., method="ilp")`` instead solves the ILP restricted to the pins: the
best plan of the family, which may trade a textbook collective for a cleverer one.

Either way the choice is a point of the unrestricted ILP's search space, priced by the
same cost model, so the ILP's objective is never above a baseline's
:func:`~autoshard.cost.objective.evaluate` cost (the invariant ``tests/test_baselines.py`` checks).

Families (mesh dims ``0..n-1``; the *TP dim* is the last one, the *DP dims* the others):

``replicate``
    Every node takes its all-``Replicate`` strategy: each device runs the whole model on
    the whole batch, with no communication.
``ddp``
    Parameters ``R`` on every mesh dim, used as stored; inputs batch-sharded: ``S(0)`` on
    every mesh dim whose size (times the earlier sharding dims) divides the batch. Every
    op then runs on its shard of the batch; each weight gradient comes out ``Partial``
    and is all-reduced into its ``R`` parameter. Any other ``Partial`` (a BatchNorm
    statistic, summed over the batch) is all-reduced before it grows, never scattered
    (:func:`_resolve_partials`; fsdp too).
``fsdp``
    ZeRO-3: parameters stored ``S(0)`` on every mesh dim whose size (cumulatively) divides
    their dim 0, ``R`` elsewhere; before each use (forward and backward) a parameter is
    gathered to ``R`` (the all-gather is the resharding the cost model prices); inputs
    batch-sharded as in ``ddp``; gradients reduce-scattered into the parameter's shards.
``megatron``
    Tensor parallel on the TP dim, data parallel on the DP dims (Shoeybi et al. 2019,
    "Megatron-LM", section 3). Column/row pairs come from the graph's structure (see
    :func:`find_tensor_parallel`), never from module names. On the TP dim a column matmul
    ``X @ W`` takes ``X`` replicated and ``W`` sharded on its output features, giving an
    output sharded on features; a row matmul takes both sharded on the reduction dim and
    gives a ``Partial`` output. The ops between a column and its row (activation
    functions, attention: the ``bmm`` s then run head-parallel where the graph allows)
    are not pinned; every op outside those regions is replicated on the TP dim, so
    each row's ``Partial`` output is all-reduced where the next op reads it. A matmul
    whose output reaches the graph's output through such ops only (an LM head) is a
    standalone column (vocab-parallel), where the shapes divide. Parameters: ``R`` on the
    DP dims; on the TP dim sharded as their matmul role needs, else ``R``; used as stored.
    Inputs: ``S(0)`` on the DP dims, ``R`` on the TP dim. In a training graph only the
    forward pass is pinned: each backward matmul reads a weight whose placement the
    forward role fixed (which makes it row- or column-like), and propagation places the
    activation gradients. Weights read outside every tensor-parallel region (an LM head
    tied to the embedding) stay replicated on the TP dim.
``fsdp_tp``
    torchtitan's 2-D parallelism, FSDP2 on the DP dims and tensor parallelism on the TP
    dim: ``megatron_sp``, except that every parameter is stored sharded on each DP dim
    (any tensor dim the strategies allow, chosen by propagation), gathered on the DP dims
    before each use (forward and backward) and used as stored on the TP dim; its gradient is
    reduce-scattered on the DP dims into the parameter's shards.
``megatron_sp``
    ``megatron`` plus sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models"): ops outside the tensor-parallel regions
    must produce outputs sharded on the TP dim (on whichever tensor dim is cheapest,
    usually the sequence), so each row's ``Partial`` output is reduce-scattered and each
    column's input all-gathered.

"Used as stored" means: on every mesh dim the consumer wants the parameter in the
placement it is stored in, except that a replicated parameter may be read as ``Partial``
(a local rescale, as for a row-parallel bias). So no baseline silently slices a
replicated weight to compute with it. A pin that the graph cannot satisfy (a batch that
does not divide, a matmul without the needed strategy) is dropped and reported in
:attr:`BaselineResult.notes`, never silently.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.placements import short
from autoshard.plan.plan import Plan, build_plan
from autoshard.solver.ilp import ILPResult, solve
from autoshard.solver.options import ALGOS, BASELINES, SolverOptions
from autoshard.strategies.graph import Edge, NodeStrategies, StrategyGraph
from autoshard.trace.ops import (
    ATTENTION_REGION_OPS,
    LAYOUT_OPS,
    WEIGHT_CHAIN_OPS,
    packet,
)
from autoshard.trace.tracer import TracedGraph

Placements = tuple[Placement, ...]


aten = torch.ops.aten


# --- results ---------------------------------------------------------------------------


@dataclass
class BaselineResult:
    """A baseline's choice and how it was found.

    ``choice``: representative -> strategy index of the *unrestricted* graph.
    ``objective_s``: :func:`~autoshard.cost.objective.evaluate` of ``choice`` (s). ``method``:
    ``propagate`` or ``ilp``; ``ilp``: the restricted ILP's result when one was solved
    (its ``choice`` indexes the restricted graph). ``notes``: every
    pin that could not be applied. ``roles``: for tensor parallelism, matmul node ->
    ``"column"`` or ``"row"``. ``pinned``: how many representatives each kind of pin
    restricted.
    """

    name: str
    choice: dict[str, int]
    objective_s: float
    method: str = "propagate"
    ilp: ILPResult | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    roles: dict[str, str] = field(default_factory=dict)
    pinned: dict[str, int] = field(default_factory=dict)

    def solver_stats(self) -> dict[str, Any]:
        """Statistics as plain builtins (for the solution file and reports)."""
        d: dict[str, Any] = {}
        if self.ilp is not None:
            d = asdict(self.ilp)
            d.pop("choice")
        else:
            d = {"status": "propagated", "gap": None, "solve_seconds": self.seconds}
        d.update(
            algo=self.name,
            method=self.method,
            objective_s=float(self.objective_s),
            notes=list(self.notes),
            roles=dict(sorted(self.roles.items())),
            pinned=dict(self.pinned),
        )
        return d


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
                hide_share=e.hide_share,
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
    )


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


def _is_r(p: Placement) -> bool:
    return isinstance(p, Replicate)


def _is_p(p: Placement) -> bool:
    return isinstance(p, Partial)


def _is_s(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def _used_as_stored(p: Placements, q: Placements) -> bool:
    """Per mesh dim: the consumer wants what is stored, or reads a replicated value as Partial."""
    return all(a == b or (_is_r(a) and _is_p(b)) for a, b in zip(p, q, strict=True))


def _gathered(p: Placements, q: Placements) -> bool:
    """Per mesh dim: the consumer wants the whole tensor (or a replicated one as Partial)."""
    return all(_is_r(b) or (_is_r(a) and _is_p(b)) for a, b in zip(p, q, strict=True))


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


def _kind(sg: StrategyGraph, rep: str) -> str:
    info = sg.graph.nodes.get(rep)
    return info.kind if info is not None else "output"


def _out(sg: StrategyGraph, rep: str, i: int) -> Placements:
    return sg.nodes[rep].strategies[i].outputs[0]


def _pin_placeholder(
    r: Restriction, sg: StrategyGraph, rep: str, want: Placements, kind: str
) -> None:
    if not r.allow(sg, rep, lambda i: _out(sg, rep, i) == want, kind):
        info = sg.graph.nodes[rep]
        have = ", ".join(_short(_out(sg, rep, i)) for i in range(len(sg.nodes[rep].strategies)))
        r.notes.append(
            f"{info.kind} {info.fqn} {info.results[0].shape}: {_short(want)} is not among its "
            f"placements ({have}); left to the ILP"
        )


def _short(ps: Placements) -> str:
    return short(ps)


def _restrict_param_uses(r: Restriction, sg: StrategyGraph, use: Callable) -> None:
    params = {rep for rep in sg.reps if _kind(sg, rep) == "param"}
    for i, e in enumerate(sg.edges):
        if e.src in params:
            r.forbid(i, e, lambda p, q: not use(p, q))


def _all_on(
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


def _placeholders(sg: StrategyGraph, kind: str) -> list[str]:
    return [rep for rep in sg.reps if _kind(sg, rep) == kind]


# --- the families ----------------------------------------------------------------------


def _replicate(sg: StrategyGraph, mesh: MeshSpec) -> Restriction:
    r = Restriction()
    missing = 0
    for rep in sg.reps:
        strategies = sg.nodes[rep].strategies

        def all_r(i: int, strategies=strategies) -> bool:
            s = strategies[i]
            tensors = [p for p in s.outputs if p is not None] + list(s.inputs)
            return all(_is_r(x) for ps in tensors for x in ps)

        if not r.allow(sg, rep, all_r, "all_replicate"):
            missing += 1
    if missing:
        r.notes.append(f"{missing} nodes have no all-Replicate strategy; left to the ILP")
    return r


def _data_parallel(sg: StrategyGraph, mesh: MeshSpec, fsdp: bool) -> Restriction:
    r = Restriction()
    dims = range(mesh.ndim)
    for rep in _placeholders(sg, "input"):
        shape = sg.graph.nodes[rep].results[0].shape
        _pin_placeholder(r, sg, rep, shard_dim0(shape, mesh.shape, dims), "inputs")
    for rep in _placeholders(sg, "param"):
        shape = sg.graph.nodes[rep].results[0].shape
        want = shard_dim0(shape, mesh.shape, dims) if fsdp else (Replicate(),) * mesh.ndim
        _pin_placeholder(r, sg, rep, want, "parameters")
    _restrict_param_uses(r, sg, _gathered if fsdp else _used_as_stored)
    _resolve_partials(r, sg)
    return r


def _resolve_partials(r: Restriction, sg: StrategyGraph) -> None:
    """Data parallelism all-reduces a ``Partial`` before it grows, never scatters one.

    A ``Partial`` tensor of a data-parallel step is a sum over the batch: a weight
    gradient (reduced into its parameter at the graph's output, after the local
    accumulation of a tied weight's two gradients) or a per-channel statistic
    (BatchNorm's mean and variance, which ``SyncBatchNorm`` all-reduces). So, but for the
    graph output (the gradient's own reduction into its parameter's placement), a
    consumer reads a ``Partial`` replicated, or as ``Partial`` when its output is no
    larger (a sum, a view, a scaling). Without this, propagation carries a statistic's
    ``Partial`` through its broadcast and reduce-scatters a whole activation in the
    backward, or reduce-scatters a statistic over channels and gathers it back: no
    data-parallel run does either.
    """
    for i, e in enumerate(sg.edges):
        info = sg.graph.nodes.get(e.consumer or e.dst)
        if info is None or info.kind == "output":
            continue
        out = info.results[0] if info.results else None
        keeps = out is not None and math.prod(out.shape) <= math.prod(e.tensor.shape)

        def bad(p: Placements, q: Placements, keeps: bool = keeps) -> bool:
            return any(
                _is_p(a) and not (_is_r(b) or (keeps and _is_p(b)))
                for a, b in zip(p, q, strict=True)
            )

        r.forbid(i, e, bad)


# --- tensor parallelism: roles from the graph's structure ------------------------------

_PARAM_MATMULS = {aten.mm.default: (0, 1), aten.addmm.default: (1, 2)}


def _pointwise(node: torch.fx.Node) -> bool:
    return torch.Tag.pointwise in getattr(node.target, "tags", ())


@dataclass
class TensorParallel:
    """Matmul roles found from the graph.

    ``roles``: matmul node -> ``"column"`` or ``"row"``. ``weight``: matmul node ->
    ``(activation operand index, weight operand index, weight is the right operand)``,
    indices into the node's tensor arguments. ``pairs``: ``(columns, row)`` in graph order;
    a standalone column has row ``None``. ``region``: nodes inside the tensor-parallel
    regions (strictly between a pair's columns and row, or after a standalone column).
    """

    roles: dict[str, str] = field(default_factory=dict)
    weight: dict[str, tuple[int, int, bool]] = field(default_factory=dict)
    pairs: list[tuple[tuple[str, ...], str | None]] = field(default_factory=list)
    region: dict[tuple[tuple[str, ...], str | None], set[str]] = field(default_factory=dict)


def find_tensor_parallel(sg: StrategyGraph) -> TensorParallel:
    """Megatron's column/row pairs, from the graph's structure only.

    A *parameter matmul* is an ``mm``/``addmm`` one of whose operands is a parameter
    reached through layout ops only (``t``, ``view``, ``permute``, ...). Walking back from
    a parameter matmul's activation operand through pointwise ops, layout ops, softmax and
    activation-by-activation matmuls (``bmm``: attention), if every path ends at parameter
    matmuls (the *columns*), or at parameters, buffers and nodes computed from them alone
    (biases, masks, rotary tables), the matmul is the *row* of those columns. Any other op
    on the way (a norm, an embedding, a reduction, a graph input) means it is not. Rows
    are taken in graph order; a matmul already a row cannot be a column (three linears
    in a row give one pair and one unpaired). A parameter matmul left over whose output
    reaches the graph's output through such ops only is a standalone column (an LM head).
    Only forward matmuls get roles: in a training graph each backward matmul reads a
    weight whose placement the forward role fixed, which makes it column- or row-like.
    """
    fx_nodes = {n.name: n for n in sg.graph.graph_module.graph.nodes}
    tp = TensorParallel(weight=_param_matmuls(sg, fx_nodes))
    _pair_rows(sg, fx_nodes, tp, _leaf_test(sg))
    _standalone_columns(sg, fx_nodes, tp, _fx_users(sg.graph))
    return tp


def _leaf_test(sg: StrategyGraph) -> Callable[[torch.fx.Node], bool]:
    """A memoized test: whether a node is a parameter, a buffer, or computed from those and
    factory ops alone."""
    graph = sg.graph
    purely_free: dict[str, bool] = {}

    def is_leaf(n: torch.fx.Node) -> bool:
        """A parameter, a buffer, or a node computed from those and factory ops alone."""
        if n.name in purely_free:
            return purely_free[n.name]
        info = graph.nodes.get(n.name)
        if n.op == "placeholder":
            ok = info is not None and info.kind in ("param", "buffer")
        elif n.op == "call_function":
            ok = n.name in sg.free and all(is_leaf(a) for a in n.all_input_nodes)
        else:
            ok = False
        purely_free[n.name] = ok
        return ok

    return is_leaf


def _param_chain(graph: TracedGraph, n: torch.fx.Node) -> bool:
    """Whether ``n`` is a parameter, reached through single-input weight-chain ops only."""
    while n.op == "call_function" and packet(n.target) in WEIGHT_CHAIN_OPS:
        if len(n.all_input_nodes) != 1:
            return False
        n = n.all_input_nodes[0]
    info = graph.nodes.get(n.name)
    return n.op == "placeholder" and info is not None and info.kind == "param"


def _param_matmuls(
    sg: StrategyGraph, fx_nodes: dict[str, torch.fx.Node]
) -> dict[str, tuple[int, int, bool]]:
    """The forward parameter matmuls, in graph order: node -> :attr:`TensorParallel.weight`."""
    graph = sg.graph
    weight: dict[str, tuple[int, int, bool]] = {}
    for n in graph.graph_module.graph.nodes:
        if n.op != "call_function" or n.target not in _PARAM_MATMULS or n.name not in sg.nodes:
            continue
        if getattr(graph.nodes[n.name], "backward", False):
            continue  # backward matmuls follow from the weights' placements
        a_idx, b_idx = _PARAM_MATMULS[n.target]
        args = [fx_nodes[a] for a in graph.nodes[n.name].arg_nodes]
        if len(args) <= b_idx:
            continue
        pa, pb = _param_chain(graph, args[a_idx]), _param_chain(graph, args[b_idx])
        if pa != pb:
            weight[n.name] = (a_idx, b_idx, True) if pb else (b_idx, a_idx, False)
    return weight


def _transparent(n: torch.fx.Node, tp: TensorParallel) -> bool:
    """Whether ``n`` may lie inside a tensor-parallel region (pointwise, layout, attention)."""
    op = packet(n.target)
    return (
        _pointwise(n)
        or op in LAYOUT_OPS
        or op is operator.getitem
        or (op in ATTENTION_REGION_OPS and n.name not in tp.weight)
    )


def _walk_back(
    start: torch.fx.Node, tp: TensorParallel, is_leaf: Callable[[torch.fx.Node], bool]
) -> tuple[set[str], set[str]] | None:
    """``(columns, region)`` reached walking back from ``start``, or None if it is no row's."""
    columns: set[str] = set()
    region: set[str] = set()
    stack, seen = [start], set()
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if is_leaf(n):
            continue
        if n.op != "call_function":
            return None
        if n.name in tp.weight:
            if tp.roles.get(n.name) == "row":
                return None
            columns.add(n.name)
            continue
        if not _transparent(n, tp):
            return None
        region.add(n.name)
        stack.extend(n.all_input_nodes)
    return (columns, region) if columns else None


def _fx_users(graph: TracedGraph) -> dict[str, list[torch.fx.Node]]:
    """Node name -> the nodes that read it, in graph order."""
    users: dict[str, list[torch.fx.Node]] = {}
    for n in graph.graph_module.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n)
    return users


def _walk_forward(
    start: torch.fx.Node, tp: TensorParallel, users: dict[str, list[torch.fx.Node]]
) -> set[str] | None:
    """The region after ``start`` if its output reaches the graph's output through
    transparent ops only, else None."""
    region: set[str] = set()
    stack, seen = list(users.get(start.name, [])), set()
    reached_output = False
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        if n.op == "output":
            reached_output = True
            continue
        if n.op != "call_function" or n.name in tp.weight or not _transparent(n, tp):
            if packet(n.target) is aten._assert_tensor_metadata:
                continue
            return None
        region.add(n.name)
        stack.extend(users.get(n.name, []))
    return region if reached_output else None


def _pair_rows(
    sg: StrategyGraph,
    fx_nodes: dict[str, torch.fx.Node],
    tp: TensorParallel,
    is_leaf: Callable[[torch.fx.Node], bool],
) -> None:
    """Give the rows and their columns their roles, in graph order; returns None (fills
    ``tp.roles``, ``tp.pairs`` and ``tp.region``)."""
    graph = sg.graph
    for name, (x_idx, _, _) in tp.weight.items():
        if name in tp.roles:
            continue
        found = _walk_back(fx_nodes[graph.nodes[name].arg_nodes[x_idx]], tp, is_leaf)
        if found is None:
            continue
        columns, region = found
        if any(tp.roles.get(c) == "row" for c in columns):
            continue
        for c in sorted(columns):  # a set: its order would vary with the hash seed
            tp.roles[c] = "column"
        tp.roles[name] = "row"
        key = (tuple(sorted(columns)), name)
        tp.pairs.append(key)
        tp.region[key] = region


def _standalone_columns(
    sg: StrategyGraph,
    fx_nodes: dict[str, torch.fx.Node],
    tp: TensorParallel,
    users: dict[str, list[torch.fx.Node]],
) -> None:
    """Make each parameter matmul left without a role whose output reaches the graph's output
    a standalone column; returns None (fills ``tp.roles``, ``tp.pairs`` and ``tp.region``)."""
    for name in tp.weight:
        if name in tp.roles:
            continue
        region = _walk_forward(fx_nodes[name], tp, users)
        if region is not None:
            tp.roles[name] = "column"
            key = ((name,), None)
            tp.pairs.append(key)
            tp.region[key] = region


def _role_ok(role: str, weight: tuple[int, int, bool], tp_dim: int) -> Callable[[Any], bool]:
    """Whether a matmul strategy plays ``role`` on mesh dim ``tp_dim``."""
    x_idx, w_idx, w_right = weight
    # operands of mm as (left, right); the output is (rows of left, cols of right)
    left, right = (x_idx, w_idx) if w_right else (w_idx, x_idx)

    def ok(s) -> bool:
        a, b, o = s.inputs[left][tp_dim], s.inputs[right][tp_dim], s.outputs[0][tp_dim]
        if role == "row":
            return _is_s(a, 1) and _is_s(b, 0) and _is_p(o)
        if w_right:  # column: shard W's output features (right operand's dim 1)
            return _is_r(a) and _is_s(b, 1) and _is_s(o, 1)
        return _is_s(a, 0) and _is_r(b) and _is_s(o, 0)

    return ok


def _megatron(
    sg: StrategyGraph,
    mesh: MeshSpec,
    sequence_parallel: bool,
    pin_outside: bool = True,
    fsdp: bool = False,
) -> tuple[Restriction, dict]:
    r = Restriction()
    ndim = mesh.ndim
    t = ndim - 1
    dp = range(ndim - 1)
    tp = find_tensor_parallel(sg)
    # training graphs: the backward pass is not pinned (its matmuls follow the weights'
    # placements, its activation gradients are placed by propagation)
    backward = _backward_reps(sg)
    param_uses = _forward_param_uses(sg, backward)
    # 1. groups whose matmuls have the role's strategy (the shapes divide)
    groups, undivided = _divisible_groups(sg, tp, t)
    # 2. drop groups whose weights are also read outside every group (e.g. an LM head tied
    # to the embedding: one placement cannot serve both), until none is left to drop
    groups, shared_weights = _drop_shared_groups(sg, tp, groups, param_uses)
    _note_dropped_groups(r, mesh, t, undivided, shared_weights)
    # 3. pin the roles (on the representatives: a repeated layer follows its first)
    roles, region_reps, head_reps = _pin_roles(r, sg, tp, groups, t)

    for rep in _placeholders(sg, "input"):
        shape = sg.graph.nodes[rep].results[0].shape
        _pin_placeholder(r, sg, rep, shard_dim0(shape, mesh.shape, dp), "inputs")

    _pin_tp_params(r, sg, roles, dp, t, fsdp)
    _pin_outside_ops(r, sg, region_reps, head_reps, backward, t, sequence_parallel, pin_outside)
    if not roles:
        r.notes.append(
            "no column/row matmul pairs found: tensor parallel degenerates to "
            "replicated compute on the TP dim"
        )
    return r, roles


_Group = tuple[tuple[str, ...], str | None]


def _backward_reps(sg: StrategyGraph) -> set[str]:
    """The representatives of the backward pass (empty for an inference graph)."""
    return {
        rep
        for rep in sg.reps
        if rep in sg.graph.nodes and getattr(sg.graph.nodes[rep], "backward", False)
    }


def _forward_param_uses(sg: StrategyGraph, backward: set[str]) -> dict[str, set[str]]:
    """Parameter -> the representatives outside ``backward`` that read it."""
    param_uses: dict[str, set[str]] = {}
    for e in sg.edges:
        if _kind(sg, e.src) == "param" and e.dst not in backward:
            param_uses.setdefault(e.src, set()).add(e.dst)
    return param_uses


def _group_members(key: _Group) -> list[str]:
    """A group's matmuls: its columns, then its row (if any)."""
    return list(key[0]) + ([key[1]] if key[1] is not None else [])


def _group_inside(sg: StrategyGraph, tp: TensorParallel, key: _Group) -> set[str]:
    """Representatives of a group's matmuls and region (repeated layers may share them)."""
    nodes = _group_members(key) + [n for n in tp.region[key] if n in sg.nodes]
    return {sg.nodes[n].rep for n in nodes}


def _group_role_ok(sg: StrategyGraph, tp: TensorParallel, m: str, t: int) -> Callable[[int], bool]:
    """Whether ``m`` plays its role when its representative takes strategy ``i``."""
    ns, check = sg.nodes[m], _role_ok(tp.roles[m], tp.weight[m], t)
    return lambda i: check(ns.strategies[ns.choice[i]])


def _divisible_groups(
    sg: StrategyGraph, tp: TensorParallel, t: int
) -> tuple[list[_Group], list[str]]:
    """``(groups, undivided)``: the groups whose matmuls all have their role's strategy on
    mesh dim ``t``, and a description of each other group."""
    groups = []
    undivided: list[str] = []
    for key in tp.pairs:
        members = _group_members(key)
        if all(
            any(
                _group_role_ok(sg, tp, m, t)(i)
                for i in range(len(sg.nodes[sg.nodes[m].rep].strategies))
            )
            for m in members
        ):
            groups.append(key)
            continue
        undivided.append(" ".join(f"{m}{list(sg.graph.nodes[m].args[-1].shape)}" for m in members))
    return groups, undivided


def _drop_shared_groups(
    sg: StrategyGraph,
    tp: TensorParallel,
    groups: list[_Group],
    param_uses: dict[str, set[str]],
) -> tuple[list[_Group], list[str]]:
    """``(groups, shared_weights)``: the groups left once those whose weights are also read
    outside every group are dropped (repeatedly), and the names of those weights."""
    shared_weights: list[str] = []
    while True:
        covered = set().union(*(_group_inside(sg, tp, k) for k in groups))
        bad = []
        for key in groups:
            members = {sg.nodes[m].rep for m in _group_members(key)}
            shared = sorted(
                sg.graph.nodes[p].fqn or p
                for p, uses in param_uses.items()
                if uses & members and not uses <= covered
            )
            if shared:
                bad.append(key)
                shared_weights.extend(shared)
        if not bad:
            break
        groups = [k for k in groups if k not in bad]
    return groups, shared_weights


def _note_dropped_groups(
    r: Restriction, mesh: MeshSpec, t: int, undivided: list[str], shared_weights: list[str]
) -> None:
    """Note in ``r`` the groups left unpinned and why; returns None."""
    if undivided:
        r.notes.append(
            f"{len(undivided)} tensor-parallel matmul groups left to propagation: the shapes "
            f"do not divide by {mesh.shape[t]} on mesh dim {t} (e.g. "
            + "; ".join(undivided[:2])
            + ")"
        )
    if shared_weights:
        r.notes.append(
            f"{len(shared_weights)} weights also read outside the tensor-parallel regions "
            f"(tied?) left replicated on mesh dim {t}: "
            + ", ".join(shared_weights[:3])
            + (", ..." if len(shared_weights) > 3 else "")
        )


def _pin_roles(
    r: Restriction, sg: StrategyGraph, tp: TensorParallel, groups: list[_Group], t: int
) -> tuple[dict[str, str], set[str], set[str]]:
    """Pin each group's matmul roles; returns ``(roles, region_reps, head_reps)``: the pinned
    roles, the representatives inside the groups, and those of the standalone columns."""
    roles: dict[str, str] = {}
    region_reps: set[str] = set()
    head_reps: set[str] = set()  # standalone columns and the ops after them
    for key in groups:
        for m in _group_members(key):
            if not r.allow(sg, sg.nodes[m].rep, _group_role_ok(sg, tp, m, t), "matmuls"):
                r.notes.append(f"{m}: its role conflicts with a repeated layer's; not pinned")
                continue
            roles[m] = tp.roles[m]
        region_reps |= _group_inside(sg, tp, key)
        if key[1] is None:
            head_reps |= _group_inside(sg, tp, key)
    return roles, region_reps, head_reps


def _pin_tp_params(
    r: Restriction, sg: StrategyGraph, roles: dict[str, str], dp: range, t: int, fsdp: bool
) -> None:
    """Pin the parameters' placements and uses for tensor parallelism; returns None."""
    # parameters: R on the DP dims; on the TP dim R unless they feed a tensor-parallel matmul
    role_reps = {sg.nodes[m].rep for m in roles}
    feeds_role: set[str] = {e.src for e in sg.edges if e.dst in role_reps}
    for rep in _placeholders(sg, "param"):

        def param_ok(i: int, rep=rep) -> bool:
            ps = _out(sg, rep, i)
            on_dp = all((_is_s(ps[d]) if fsdp else _is_r(ps[d])) for d in dp)
            return on_dp and (rep in feeds_role or _is_r(ps[t]))

        if not r.allow(sg, rep, param_ok, "parameters") and fsdp:
            r.notes.append(f"parameter {sg.graph.nodes[rep].fqn}: not sharded on the DP dims")
    if fsdp:  # gathered on the DP dims before each use, used as stored on the TP dim

        def use(p: Placements, q: Placements) -> bool:
            return _gathered(p[:t], q[:t]) and _used_as_stored(p[t:], q[t:])

        _restrict_param_uses(r, sg, use)
    else:
        _restrict_param_uses(r, sg, _used_as_stored)


def _pin_outside_ops(
    r: Restriction,
    sg: StrategyGraph,
    region_reps: set[str],
    head_reps: set[str],
    backward: set[str],
    t: int,
    sequence_parallel: bool,
    pin_outside: bool,
) -> None:
    """Pin the forward ops outside the tensor-parallel regions on mesh dim ``t``; returns None."""
    # every other op: replicated on the TP dim (megatron) or sharded on it (sequence parallel)
    # Graph outputs count as outside ops (what the model returns is replicated, or sequence
    # sharded, on the TP dim) unless a tensor-parallel region feeds them: a vocab-parallel
    # LM head returns its logits sharded, as Megatron's gather_output=False.
    region_reps.update(
        e.dst for e in sg.edges if e.src in head_reps and _kind(sg, e.dst) == "output"
    )
    outside = [
        rep
        for rep in sg.reps
        if _kind(sg, rep) in ("op", "output") and rep not in region_reps and rep not in backward
    ]
    if not pin_outside:
        outside = []
        r.notes.append(
            "pinning the ops outside the tensor-parallel regions to the TP dim left no plan; "
            "they were left to the ILP"
        )
    unpinned = 0
    for rep in outside:
        if sequence_parallel and r.allow(sg, rep, _all_on(sg, rep, t, _is_s), "sequence_parallel"):
            continue
        if not r.allow(sg, rep, _all_on(sg, rep, t, _is_r), "replicated_on_tp"):
            unpinned += 1
    if unpinned:
        r.notes.append(
            f"{unpinned} ops outside the tensor-parallel regions have no strategy "
            "replicated on the TP dim; left to propagation"
        )


# --- entry points ----------------------------------------------------------------------


def _restriction(
    sg: StrategyGraph, name: str, mesh: MeshSpec, relax: bool = False
) -> tuple[Restriction, dict]:
    if tuple(sg.mesh_shape) != tuple(mesh.shape):
        raise AutoshardError(
            f"the strategies were built for mesh {'x'.join(map(str, sg.mesh_shape))} but the "
            f"mesh is {mesh.shape_str}"
        )
    if name == "replicate":
        return _replicate(sg, mesh), {}
    if name == "ddp":
        return _data_parallel(sg, mesh, fsdp=False), {}
    if name == "fsdp":
        return _data_parallel(sg, mesh, fsdp=True), {}
    if name == "megatron":
        return _megatron(sg, mesh, sequence_parallel=False, pin_outside=not relax)
    if name == "megatron_sp":
        return _megatron(sg, mesh, sequence_parallel=True, pin_outside=not relax)
    if name == "fsdp_tp":
        return _megatron(sg, mesh, sequence_parallel=True, pin_outside=not relax, fsdp=True)
    raise AutoshardError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")


def propagate(sg: StrategyGraph) -> dict[str, int]:
    """DTensor-style propagation: each representative, in graph order, its cheapest strategy.

    As DTensor's sharding propagation does, a node takes the strategy that needs the least
    resharding (seconds) of the inputs whose producers have already chosen; among equals,
    the least compute; then the earliest. Edges from later nodes (a gradient into its
    parameter) are not looked ahead to. A source (parameter or input) left with several
    strategies by the pins is decided by its first consumer: the pair of their strategies
    with the least resharding. What is computed from the loss's tangent alone (the mean's
    gradient, as large as the output) is decided last, in reverse order: each node the
    strategy of least compute plus resharding to and from the nodes already decided, as
    each rank of a data-parallel run makes the gradient of its own shard of the output.

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
        choice[rep] = int(np.argmin(cost))
    for rep in lazy:
        choice.setdefault(rep, 0)
    return choice


METHODS = ("propagate", "ilp")


def run_baseline(
    sg: StrategyGraph,
    name: str,
    mesh: MeshSpec,
    options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
    method: str = "propagate",
    pins: Restriction | None = None,
) -> BaselineResult:
    """Baseline ``name`` on ``sg``: its pins, then :func:`propagate` (or the restricted ILP).

    Args:
        sg: the strategy graph (the same one the ILP solves).
        name: one of :data:`BASELINES`.
        mesh: the mesh ``sg`` was built for (its last dim is the TP dim).
        options: the ILP's time limit and gap (``method="ilp"``, or the fallback).
        memory: optional ``(bytes per strategy over the full graph's x, budget bytes)``;
            only ``method="ilp"`` honours it.
        method: ``propagate`` (DTensor's rule, the default) or ``ilp`` (the best plan of
            the family). When propagation meets a node its inputs cannot reach, the
            restricted ILP decides instead (and a note says so).
        pins: the family's restriction, in place of ``name``'s (e.g. :func:`pinned`);
            ``name`` then only names it.

    Raises:
        AutoshardError: an unknown name or method, a mesh that is not ``sg``'s, or no plan
            of the family satisfies the constraints (the message names the family).
    """
    if method not in METHODS:
        raise AutoshardError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    t0 = time.perf_counter()
    if pins is not None:
        r, roles = pins, {}
    else:
        r, roles = _restriction(sg, name, mesh)
    sub = restrict(sg, r)
    result = None
    if method == "propagate":
        try:
            sub_choice = propagate(sub)
        except AutoshardError as exc:
            r.notes.append(f"propagation stopped ({exc}); the restricted ILP decided instead")
            method = "ilp"
    if method == "ilp":
        try:
            result = solve(sub, options, restrict_memory(sg, r, memory))
        except AutoshardError as exc:
            if not name.startswith("megatron"):
                raise AutoshardError(f"baseline {name}: {exc}") from exc
            # the TP-dim pins of the ops between regions conflict: relax them
            r, roles = _restriction(sg, name, mesh, relax=True)
            sub = restrict(sg, r)
            try:
                result = solve(sub, options, restrict_memory(sg, r, memory))
            except AutoshardError as exc2:
                raise AutoshardError(f"baseline {name}: {exc2}") from exc2
        sub_choice = result.choice
    choice = unrestrict_choice(r, sub_choice)
    cost = evaluate(sg, choice)
    plain = replace(sg, checkpointing=None)  # the restricted graph has no recomputation
    if not math.isclose(
        evaluate(plain, choice), evaluate(sub, sub_choice), rel_tol=1e-9, abs_tol=1e-15
    ):
        raise AssertionError(f"baseline {name}: restricted and full costs differ")  # a bug
    return BaselineResult(
        name, choice, cost, method, result, time.perf_counter() - t0, r.notes, roles, r.pinned
    )


def pinned(
    sg: StrategyGraph,
    parameters: dict[str, Placements],
    inputs: dict[str, Placements],
    gathered_dims: frozenset[int] = frozenset(),
    tp_styles: dict[str, str] | None = None,
    tp_dim: int | None = None,
) -> Restriction:
    """The family of plans that store each parameter and input as given (by FQN / input
    name): each parameter used as stored, except on ``gathered_dims`` where it is gathered
    before use (FSDP); every ``Partial`` activation resolved as data parallelism does
    (:func:`_resolve_partials`). What ``parallelize_module`` styles and FSDP2 fix by hand,
    with everything else left to DTensor's propagation (:func:`run_baseline` with ``pins``).

    ``tp_styles`` (module FQN -> ``"column"`` / ``"row"``) on mesh dim ``tp_dim``: the
    styles hand plain local tensors between their modules, so every forward op outside a
    column/row pair of styled modules (:func:`find_tensor_parallel`'s regions, matched by
    the ops' module paths) and outside every styled module computes replicated on
    ``tp_dim``, as in ``megatron``.
    """
    r = Restriction()
    if tp_styles and tp_dim is not None:
        _replicated_outside_styles(r, sg, tp_styles, tp_dim)
    for rep in _placeholders(sg, "input"):
        want = inputs.get(sg.graph.nodes[rep].fqn or "")
        if want is not None:
            _pin_placeholder(r, sg, rep, tuple(want), "inputs")
    for rep in _placeholders(sg, "param"):
        want = parameters.get(sg.graph.nodes[rep].fqn or "")
        if want is not None:
            _pin_placeholder(r, sg, rep, tuple(want), "parameters")

    def use(p: Placements, q: Placements) -> bool:
        return all(
            (_gathered if d in gathered_dims else _used_as_stored)((a,), (b,))
            for d, (a, b) in enumerate(zip(p, q, strict=True))
        )

    _restrict_param_uses(r, sg, use)
    _resolve_partials(r, sg)
    return r


def _replicated_outside_styles(
    r: Restriction, sg: StrategyGraph, styles: dict[str, str], t: int
) -> None:
    tp = find_tensor_parallel(sg)

    def module(m: str) -> str | None:
        return sg.graph.nodes[m].module_path

    inside: set[str] = set()
    for columns, row in tp.pairs:
        if row is None or styles.get(module(row) or "") != "row":
            continue
        if all(styles.get(module(c) or "") == "column" for c in columns):
            nodes = [*columns, row, *(n for n in tp.region[(columns, row)] if n in sg.nodes)]
            inside |= {sg.nodes[n].rep for n in nodes}
    stuck = 0
    for rep in sg.reps:
        info = sg.graph.nodes.get(rep)
        if info is None or info.kind != "op" or info.backward or rep in inside:
            continue
        if info.module_path in styles:  # a styled module's own ops (a standalone column,
            continue  # an embedding): the style shards them; its readers get them whole
        if not r.allow(sg, rep, _all_on(sg, rep, t, _is_r), "replicated_on_tp"):
            stuck += 1
    if stuck:
        r.notes.append(
            f"{stuck} ops outside the styled column/row pairs have no strategy replicated on "
            f"mesh dim {t}; left to propagation"
        )


# families that differ from another only on a mesh of 2+ dims (fsdp_tp is megatron_sp
# when there is no DP dim)
TWO_D_ONLY: frozenset[str] = frozenset({"fsdp_tp"})

# the hand-written plans the ILP starts from (replicate is never better than ddp's split)
START_FAMILIES: tuple[str, ...] = ("ddp", "fsdp", "megatron", "megatron_sp", "fsdp_tp")


def hand_plan_starts(
    sg: StrategyGraph, mesh: MeshSpec
) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The choice of every hand-written family in :data:`START_FAMILIES` on ``sg`` (DTensor
    propagation from the family's pins), for :func:`autoshard.solver.ilp.solve`'s ``starts``;
    and one note per family that has no plan on this graph (its error)."""
    starts: dict[str, dict[str, int]] = {}
    notes: list[str] = []
    for name in START_FAMILIES:
        if name in TWO_D_ONLY and mesh.ndim < 2:
            continue  # on one mesh dim it is megatron_sp
        try:
            starts[name] = run_baseline(sg, name, mesh).choice
        except AutoshardError as exc:  # the family cannot place this graph: say why
            notes.append(f"{name}: {exc}")
    return starts, notes


def baseline_choice(sg: StrategyGraph, name: str, mesh: MeshSpec) -> dict[str, int]:
    """A strategy index for every representative of ``sg``: the best plan of baseline ``name``.

    See the module docstring for each family. The result is a point of the ILP's search
    space; price it with :func:`autoshard.cost.objective.evaluate`, expand it with
    :func:`autoshard.plan.plan.build_plan`.

    Raises:
        AutoshardError: an unknown name (the message lists the names), or see
            :func:`run_baseline`.
    """
    return run_baseline(sg, name, mesh).choice


def plan_for_algo(
    sg: StrategyGraph,
    algo: str,
    mesh: MeshSpec,
    solver_options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
    finish: Callable[[StrategyGraph, dict[str, int], str], Plan] | None = None,
) -> tuple[Plan, dict[str, Any]]:
    """The plan of ``algo`` (``ilp`` or a baseline) on ``sg``, and its solver statistics.

    What ``autoshard solve --algo`` exports. ``memory``: the ILP's budget row (the ILP
    honours it; a baseline is what it is, and its plan says whether it fits). ``finish``:
    ``(sg, choice, name) -> Plan`` (e.g. :func:`autoshard.solver.solve.finish_plan` with the
    training memory kinds); default :func:`~autoshard.plan.plan.build_plan`. The statistics are
    plain builtins: the ILP's (status, objective, gap, sizes, seconds), plus for a
    baseline ``method``, ``notes``, ``roles`` and ``pinned``.

    Raises:
        AutoshardError: an unknown ``algo`` (the message lists them), or an infeasible ILP.
    """
    if finish is None:

        def finish(sg: StrategyGraph, choice: dict[str, int], name: str) -> Plan:
            return build_plan(sg, choice, mesh, name=name)

    if algo == "ilp":
        starts, _ = hand_plan_starts(sg, mesh)
        result = solve(sg, solver_options, memory, starts)
        return finish(sg, result.choice, "ilp"), result.stats()
    if algo not in BASELINES:
        raise AutoshardError(f"unknown --algo {algo!r}; choose one of {', '.join(ALGOS)}")
    b = run_baseline(sg, algo, mesh, solver_options)
    return finish(sg, b.choice, algo), b.solver_stats()
