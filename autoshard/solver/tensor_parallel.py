"""Tensor parallelism from the graph's structure: Megatron's column/row matmul pairs
(:func:`find_tensor_parallel`, never from module names) and the restriction of the
``megatron``, ``megatron_sp`` and ``fsdp_tp`` families (:func:`megatron_restriction`; the
families are described in :mod:`autoshard.solver.baselines`)."""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Placement

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.restriction import (
    Restriction,
    all_on,
    gathered,
    is_p,
    is_r,
    is_s,
    node_kind,
    pin_placeholder,
    placeholders,
    produced,
    restrict_param_uses,
    shard_dim0,
    used_as_stored,
)
from autoshard.strategies.graph import StrategyGraph
from autoshard.trace.ops import (
    ATTENTION_REGION_OPS,
    LAYOUT_OPS,
    WEIGHT_CHAIN_OPS,
    packet,
)
from autoshard.trace.tracer import TracedGraph

Placements = tuple[Placement, ...]


aten = torch.ops.aten


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


def find_tensor_parallel(sg: StrategyGraph, loss_parallel: bool = False) -> TensorParallel:
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
    _standalone_columns(sg, fx_nodes, tp, _fx_users(sg.graph), loss_parallel)
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


def _chained_param(graph: TracedGraph, n: torch.fx.Node) -> str | None:
    """The parameter ``n`` is, reached through single-input weight-chain ops only, or None."""
    while n.op == "call_function" and packet(n.target) in WEIGHT_CHAIN_OPS:
        if len(n.all_input_nodes) != 1:
            return None
        n = n.all_input_nodes[0]
    info = graph.nodes.get(n.name)
    return n.name if n.op == "placeholder" and info is not None and info.kind == "param" else None


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
        pa, pb = (_chained_param(graph, args[i]) is not None for i in (a_idx, b_idx))
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


LOSS_OPS = frozenset(
    {aten.mean.default, aten.sum.default, aten._log_softmax.default, aten.nll_loss_forward.default}
)
"""The ops a training loss ends with that a vocabulary-sharded head's output may reach
the loss through (loss parallelism): a whole-tensor mean or sum, whose value is the sum
of each rank's partial one, and cross-entropy's ops, whose rules take the logits sharded
by class (:mod:`autoshard.strategies.loss_parallel`)."""


def _fx_users(graph: TracedGraph) -> dict[str, list[torch.fx.Node]]:
    """Node name -> the nodes that read it, in graph order."""
    users: dict[str, list[torch.fx.Node]] = {}
    for n in graph.graph_module.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n)
    return users


def _walk_forward(
    start: torch.fx.Node,
    tp: TensorParallel,
    users: dict[str, list[torch.fx.Node]],
    loss_parallel: bool = False,
    backward: Callable[[torch.fx.Node], bool] | None = None,
) -> set[str] | None:
    """The region after ``start`` if its output reaches the graph's output through
    transparent ops only (with ``loss_parallel``, and the loss's ops: :data:`LOSS_OPS`,
    whose readers in the ``backward`` pass are not the region's), else None."""
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
        if loss_parallel and backward is not None and backward(n):
            continue
        loss = loss_parallel and n.op == "call_function" and n.target in LOSS_OPS
        # past a head, a softmax (an attention region's op) reads the vocabulary whole
        head_softmax = loss_parallel and packet(n.target) in ATTENTION_REGION_OPS
        if not loss and (
            n.op != "call_function"
            or n.name in tp.weight
            or head_softmax
            or not _transparent(n, tp)
        ):
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
    loss_parallel: bool = False,
) -> None:
    """Make each parameter matmul left without a role whose output reaches the graph's output
    a standalone column (with ``loss_parallel``, also through the training loss: an LM
    head); returns None (fills ``tp.roles``, ``tp.pairs`` and ``tp.region``)."""

    def in_backward(n: torch.fx.Node) -> bool:
        return getattr(sg.graph.nodes.get(n.name), "backward", False)

    for name in tp.weight:
        if name in tp.roles:
            continue
        region = _walk_forward(fx_nodes[name], tp, users, loss_parallel, in_backward)
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
            return is_s(a, 1) and is_s(b, 0) and is_p(o)
        if w_right:  # column: shard W's output features (right operand's dim 1)
            return is_r(a) and is_s(b, 1) and is_s(o, 1)
        return is_s(a, 0) and is_r(b) and is_s(o, 0)

    return ok


def megatron_restriction(
    sg: StrategyGraph,
    mesh: MeshSpec,
    sequence_parallel: bool,
    pin_outside: bool = True,
    fsdp: bool = False,
) -> tuple[Restriction, dict]:
    r = Restriction()
    ndim = mesh.ndim
    t = ndim - 1
    # the data-parallel dims: every dim but the last, of more than one device (a dim of one
    # holds every tensor whole: whole_strategy)
    dp = [d for d in range(ndim - 1) if mesh.shape[d] > 1]
    tp = find_tensor_parallel(sg, loss_parallel=fsdp)
    # training graphs: the backward's matmuls get no role (they follow the weights'
    # placements); the backward outside the regions is pinned as the forward
    # (_pin_outside_backward) and, with sequence parallelism, the weight gradients too
    # (_pin_tp_weight_gradients); the rest is placed by propagation
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

    for rep in placeholders(sg, "input"):
        shape = sg.graph.nodes[rep].results[0].shape
        pin_placeholder(r, sg, rep, shard_dim0(shape, mesh.shape, dp), "inputs")

    _pin_tp_params(r, sg, roles, dp, t, fsdp)
    if sequence_parallel:  # Megatron's backward already keeps these (the hand counts)
        _pin_tp_weight_gradients(r, sg, _tp_weights(sg, roles), t)
    # torchtitan's FSDP + TP (fsdp): a linear's flatten reads its input gathered, and
    # DTensor's autograd keeps that copy for the backward; Megatron-SP gathers it again
    fx = _Fx(sg.graph) if sequence_parallel else None
    linear_ends = _linear_layouts(sg, tp, roles, backward, fx) if fx and fsdp else {}
    if fx and fsdp:
        _pin_embedding_backward(r, sg, backward, t)
    _pin_outside_ops(
        r, sg, region_reps, head_reps, backward, t, sequence_parallel, pin_outside, linear_ends
    )
    if fx:  # Megatron-LM's g-bar and torchtitan's RowwiseParallel alike
        for rep in sorted(_row_gradient_reads(sg, tp, roles, backward, fx)):
            if not r.allow(sg, rep, all_on(sg, rep, t, is_r), "row_gradient_reads"):
                r.notes.append(
                    f"{rep}: a row's output-gradient reshape left with no replicated strategy "
                    "by the pins before it"
                )
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
        if node_kind(sg, e.src) == "param" and e.dst not in backward:
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
    r: Restriction, sg: StrategyGraph, roles: dict[str, str], dp: list[int], t: int, fsdp: bool
) -> None:
    """Pin the parameters' placements and uses for tensor parallelism; returns None."""
    # parameters: R on the DP dims; on the TP dim R unless they feed a tensor-parallel matmul
    role_reps = {sg.nodes[m].rep for m in roles}
    feeds_role: set[str] = {e.src for e in sg.edges if e.dst in role_reps}
    for rep in placeholders(sg, "param"):

        def param_ok(i: int, rep=rep) -> bool:
            ps = produced(sg, rep, i)
            on_dp = all((is_s(ps[d]) if fsdp else is_r(ps[d])) for d in dp)
            return on_dp and (rep in feeds_role or is_r(ps[t]))

        if not r.allow(sg, rep, param_ok, "parameters") and fsdp:
            r.notes.append(f"parameter {sg.graph.nodes[rep].fqn}: not sharded on the DP dims")
    if fsdp:  # gathered on the DP dims before each use, used as stored on the TP dim

        def use(p: Placements, q: Placements) -> bool:
            return gathered(p[:t], q[:t]) and used_as_stored(p[t:], q[t:])

        restrict_param_uses(r, sg, use)
    else:
        restrict_param_uses(r, sg, used_as_stored)


def _tp_weights(sg: StrategyGraph, roles: dict[str, str]) -> set[str]:
    """The parameters (representatives) that a matmul with a tensor-parallel role reads."""
    role_reps = {sg.nodes[m].rep for m in roles}
    return {e.src for e in sg.edges if e.dst in role_reps and node_kind(sg, e.src) == "param"}


def _pin_tp_weight_gradients(r: Restriction, sg: StrategyGraph, weights: set[str], t: int) -> None:
    """Each rank computes the gradient of its own shard of a tensor-parallel weight
    (Shoeybi et al., 2019, section 3: the weight gradients need no communication over the
    TP group; Megatron-LM's sequence-parallel linear layers gather their input again in
    the backward for it): the gradient of a parameter in ``weights`` is made in a
    placement on mesh dim ``t`` that the parameter may take (a shard or whole, never a
    partial sum to reduce over it). The variable pinned is the producer's, which a view
    between the matmul and the sink follows. Left to propagation, the weight-gradient
    matmuls of a sequence-parallel plan contracted over the token shards and reduce-
    scattered the sums over TP. A gradient's sink follows its parameter's variable, so the
    edges into a parameter are its gradient's; propagation does not look ahead along them,
    so the op that makes the gradient is pinned. Returns None."""
    for e in sg.edges:
        if e.dst not in weights or e.src in weights:
            continue
        allowed = r.allowed.get(e.dst, range(len(sg.nodes[e.dst].strategies)))
        wanted = {e.dst_placements[e.dst_groups[j]][t] for j in allowed}

        def makes(i: int, e=e, wanted=wanted) -> bool:
            return e.src_placements[e.src_groups[i]][t] in wanted

        if not r.allow(sg, e.src, makes, "weight_gradients"):
            fqn = sg.graph.nodes[e.dst].fqn
            r.notes.append(f"{fqn}: no op makes its gradient in its own placement on the TP dim")


def _pin_outside_backward(
    r: Restriction,
    sg: StrategyGraph,
    outside: list[str],
    region_reps: set[str],
    backward: set[str],
    t: int,
    sequence_parallel: bool = False,
) -> None:
    """Megatron's backward outside the tensor-parallel regions (Shoeybi et al. 2019, the
    ``f`` operator): the gradient of a replicated tensor is never sharded on the TP dim. A
    backward op of a module outside the regions (a norm) is replicated there, as its
    forward is, so the partial gradient a region hands back is all-reduced where it enters
    it; every other backward op outside the regions' modules (the residual stream's adds)
    is replicated or partial on the TP dim, so partial gradients add up before their one
    all-reduce. Left to propagation, a reduce-scatter (half an all-reduce's bytes) won each
    choice and the gradient was gathered again later. With ``sequence_parallel``
    (Megatron-SP) the same ops run on the sequence shards instead: a norm's backward is
    sharded on the TP dim (partial only where it sums over the tokens: its weight's
    gradient), the residual stream's ops sharded or partial, so each region's partial input
    gradient is reduce-scattered once. Returns None."""
    nodes = sg.graph.nodes
    module = {r_: nodes[r_].module_path for r_ in sg.reps if r_ in nodes}
    outside_modules = {module.get(r_) for r_ in outside} - {None}
    inside_modules = {module.get(r_) for r_ in region_reps} - {None}
    # the residual stream's shapes: what the ops outside the regions make
    stream = {tuple(nodes[r_].results[0].shape) for r_ in outside if _first_result(sg, r_)}
    # Megatron-SP (Korthikanti et al., 2022): a norm's backward runs on the sequence shards,
    # as its forward, partial only where it sums over the tokens (its weight's gradient);
    # the residual stream's ops may sum partial gradients before their one reduce-scatter
    why = "sequence_parallel" if sequence_parallel else "replicated_on_tp"
    for rep in sorted(backward):
        path = module.get(rep)
        if node_kind(sg, rep) != "op" or path in inside_modules or not _first_result(sg, rep):
            continue
        shaped = tuple(nodes[rep].results[0].shape) in stream
        if path in outside_modules and sequence_parallel:
            test = lambda p, whole=not shaped: is_s(p) or (is_p(p) and whole)  # noqa: E731
        elif path in outside_modules:
            test = is_r
        elif path is None and shaped:
            test = (lambda p: is_s(p) or is_p(p)) if sequence_parallel else (lambda p: not is_s(p))
        else:
            continue
        r.allow(sg, rep, all_on(sg, rep, t, test), why)


def _first_result(sg: StrategyGraph, rep: str) -> bool:
    """Whether ``rep`` is a traced node with a first tensor result."""
    info = sg.graph.nodes.get(rep)
    return info is not None and bool(info.results) and info.results[0] is not None


# the reshapes at a linear's ends: its flatten of a [B, S, H] input and its output's unflatten
_RESHAPES = (aten.view, aten._unsafe_view, aten.reshape)
_TRANSPOSES = (aten.t, aten.transpose, aten.permute)


class _Fx:
    """A traced graph's fx nodes by name and each node's readers (shape checks left out),
    built once for the pins of one restriction."""

    def __init__(self, graph: TracedGraph) -> None:
        self.graph = graph
        self.node = {n.name: n for n in graph.graph_module.graph.nodes}
        self._users = _fx_users(graph)

    def readers(self, n: torch.fx.Node) -> list[torch.fx.Node]:
        """The nodes that read ``n``, in graph order, but ``_assert_tensor_metadata``."""
        meta = aten._assert_tensor_metadata
        return [u for u in self._users.get(n.name, []) if packet(u.target) is not meta]


def _reshape_chain(
    start: torch.fx.Node,
    first_ok: bool,
    readers: Callable[[torch.fx.Node], list[torch.fx.Node]],
    is_reshape: Callable[[torch.fx.Node], bool],
) -> list[torch.fx.Node]:
    """``start`` (when ``first_ok`` and it is a reshape) and the reshapes before it, each
    read by the one after it alone: the layout ops a linear reads its operand through."""
    chain: list[torch.fx.Node] = []
    n, only = start, first_ok
    while only and is_reshape(n):
        chain.append(n)
        n, reader = n.all_input_nodes[0], n
        only = [u.name for u in readers(n)] == [reader.name]
    return chain


def _linear_layouts(
    sg: StrategyGraph, tp: TensorParallel, roles: dict[str, str], backward: set[str], fx: _Fx
) -> dict[str, Callable[[Placement], bool]]:
    """The forward reshapes that belong to a tensor-parallel linear layer on the TP dim, as
    representatives -> the placement they take there: a column's flatten of its input
    (``view`` of ``[B, S, H]`` to ``[B S, H]``), read by column matmuls alone (q, k and v
    share one under ``--share-reshardings``), reads the input gathered, replicated; a
    row's reshape of its output back to ``[B, S, H]``, its one reader, keeps the partial
    sums. A reshape two linears would pin apart is left out.

    Megatron-SP gathers a linear's input before the linear and reduce-scatters its output
    after it (Korthikanti et al. 2022, ``g`` and ``g-bar``; torchtitan's
    ``PrepareModuleInput`` redistributes a block's input to ``Replicate`` before
    ``F.linear`` flattens it on local tensors). Pinned to the sequence shards as the ops
    outside the regions are, such a reshape cannot keep them: with more than one sequence
    on a device, a ``[B S]`` dim holds a sequence shard's tokens in ``B`` pieces (a DTensor
    shard is one contiguous range), so the flatten resharded to the hidden dim (an
    all-to-all), the column gathered that, and the row's output was reduce-scattered onto
    the hidden dim and moved to the sequence by another all-to-all: on the 405B published
    row, 2 all-to-alls per block input and output that the system it prices does not
    run (docs/validation.md)."""

    def readers(n: torch.fx.Node) -> list[torch.fx.Node]:
        """``n``'s forward readers (the backward may read what the forward holds)."""
        return [
            u
            for u in fx.readers(n)
            if not (u.name in sg.nodes and sg.nodes[u.name].rep in backward)
        ]

    def reshape(n: torch.fx.Node) -> bool:
        return packet(n.target) in _RESHAPES

    pins: dict[str, Callable[[Placement], bool]] = {}
    clash: set[str] = set()

    def pin(name: str, test: Callable[[Placement], bool]) -> None:
        rep = sg.nodes[name].rep
        if pins.get(rep, test) is not test:
            clash.add(rep)
        pins[rep] = test

    for m, role in roles.items():
        if role == "column":  # back from the activation operand: reshapes that feed columns
            n = fx.node[sg.graph.nodes[m].arg_nodes[tp.weight[m][0]]]
            only = all(  # columns, and the transpose their weight gradients read
                roles.get(u.name) == "column" or packet(u.target) in _TRANSPOSES for u in readers(n)
            )
            for g in _reshape_chain(n, only, readers, reshape):
                pin(g.name, is_r)
        elif role == "row":  # forward from the output while its one reader is a reshape
            after = readers(fx.node[m])
            while len(after) == 1 and reshape(after[0]):
                pin(after[0].name, is_p)
                after = readers(after[0])
    return {rep: test for rep, test in pins.items() if rep not in backward and rep not in clash}


def _pin_embedding_backward(r: Restriction, sg: StrategyGraph, backward: set[str], t: int) -> None:
    """The embedding's backward on the sequence shards: each rank scatters the gradient of
    the tokens it holds into the table's gradient, a partial sum on mesh dim ``t`` reduced
    with the gradient's others (the table is whole on ``t``, as a norm's weight, whose
    gradient sums over the tokens alike). Left to propagation, the gradient was moved to
    the hidden dim by an all-to-all to make a column shard of the table's gradient, a
    collective torchtitan's FSDP + TP does not run. (torchtitan shards the table by
    vocabulary rows on TP, ``RowwiseParallel``, and reduce-scatters the lookup's masked
    partial sums; autoshard's strategies have no vocabulary-sharded lookup, and a lookup
    of the sequence shard's own tokens moves nothing in the forward.) Returns None."""
    for rep in sorted(backward):
        if sg.graph.nodes[rep].target is aten.embedding_dense_backward.default:
            if not r.allow(sg, rep, all_on(sg, rep, t, is_p), "embedding_backward"):
                r.notes.append(f"{rep}: no strategy sums the embedding's gradient over TP")


def _row_gradient_reads(
    sg: StrategyGraph, tp: TensorParallel, roles: dict[str, str], backward: set[str], fx: _Fx
) -> set[str]:
    """The backward reshapes through which a row linear's input-gradient matmul reads its
    output's gradient (``view`` of ``[B, S, H]`` to ``[B S, H]``, and any reshape before it
    that only it reads), as representatives: each reads the gradient gathered, replicated
    on the TP dim. The flatten is pinned when only that matmul, the weight gradient's
    (through a transpose) and a bias gradient's ``sum`` read it.

    The row's backward is a column's forward: its output's gradient arrives on the
    sequence shards and is all-gathered once for the input gradient and the weight
    gradient both (Korthikanti et al. 2022, the backward of ``g-bar``; torchtitan's
    ``RowwiseParallel`` with ``output_layouts=Shard(1)``, whose backward redistributes the
    gradient from ``Shard(1)`` to ``Replicate``). Left to propagation, the flatten of a
    ``[B, S/n, H]`` shard (more than one sequence a device) resharded the gradient to the
    hidden dim by an all-to-all and the matmuls gathered that: up to 2 all-to-alls per
    block that neither torchtitan nor Megatron-LM runs (``fsdp_tp`` and ``megatron_sp``
    both pin it: tests/test_hand_counts.py). A representative is
    pinned when one of the layers it stands for qualifies (tied layers have the same ops
    and shapes); an inference graph (no backward) has none."""
    graph = sg.graph
    row_weights = {
        _chained_param(graph, fx.node[graph.nodes[m].arg_nodes[tp.weight[m][1]]])
        for m, role in roles.items()
        if role == "row"
    } - {None}

    def backward_reshape(n: torch.fx.Node) -> bool:
        return (
            packet(n.target) in _RESHAPES
            and n.name in sg.nodes
            and sg.nodes[n.name].rep in backward
        )

    reads: set[str] = set()
    for n in graph.graph_module.graph.nodes:
        if n.target not in _PARAM_MATMULS or n.name not in sg.nodes:
            continue
        if sg.nodes[n.name].rep not in backward or len(n.all_input_nodes) != 2:
            continue
        a, b = n.all_input_nodes
        for w, g in ((a, b), (b, a)):
            if _chained_param(graph, w) not in row_weights or _chained_param(graph, g):
                continue
            only = all(  # the two matmuls, a transpose for the weight's, a bias's sum
                u.target in _PARAM_MATMULS or packet(u.target) in (*_TRANSPOSES, aten.sum)
                for u in fx.readers(g)
            )
            chain = _reshape_chain(g, only, fx.readers, backward_reshape)
            reads.update(sg.nodes[x.name].rep for x in chain)
    return reads


def _pin_outside_ops(
    r: Restriction,
    sg: StrategyGraph,
    region_reps: set[str],
    head_reps: set[str],
    backward: set[str],
    t: int,
    sequence_parallel: bool,
    pin_outside: bool,
    linear_ends: dict[str, Callable[[Placement], bool]] | None = None,
) -> None:
    """Pin the forward ops outside the tensor-parallel regions on mesh dim ``t``: replicated
    (megatron) or sequence-sharded (sequence parallel), the layout ops of a linear's ends
    in ``linear_ends`` as it gives (:func:`_linear_layouts`); returns None."""
    # every other op: replicated on the TP dim (megatron) or sharded on it (sequence parallel)
    # Graph outputs count as outside ops (what the model returns is replicated, or sequence
    # sharded, on the TP dim) unless a tensor-parallel region feeds them: a vocab-parallel
    # LM head returns its logits sharded, as Megatron's gather_output=False.
    region_reps.update(
        e.dst for e in sg.edges if e.src in head_reps and node_kind(sg, e.dst) == "output"
    )
    outside = [
        rep
        for rep in sg.reps
        if node_kind(sg, rep) in ("op", "output") and rep not in region_reps and rep not in backward
    ]
    if not pin_outside:
        outside = []
        r.notes.append(
            "pinning the ops outside the tensor-parallel regions to the TP dim left no plan; "
            "they were left to the ILP"
        )
    unpinned = 0
    linear_ends = linear_ends or {}
    for rep in outside:
        if rep in linear_ends:
            why = "sequence_parallel_linear_layouts"
            if r.allow(sg, rep, all_on(sg, rep, t, linear_ends[rep]), why):
                continue
            r.notes.append(f"{rep}: a linear's reshape with no strategy as its linear reads it")
        if sequence_parallel and r.allow(sg, rep, all_on(sg, rep, t, is_s), "sequence_parallel"):
            continue
        if not r.allow(sg, rep, all_on(sg, rep, t, is_r), "replicated_on_tp"):
            unpinned += 1
    if unpinned:
        r.notes.append(
            f"{unpinned} ops outside the tensor-parallel regions have no strategy "
            "replicated on the TP dim; left to propagation"
        )
    if pin_outside:
        _pin_outside_backward(r, sg, outside, region_reps, backward, t, sequence_parallel)
