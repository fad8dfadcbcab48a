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
    reduce-scattered on the DP dims into the parameter's shards. A linear's flatten of its
    input reads it gathered on the TP dim and the reshape of a row's output keeps the
    partial sums, as torchtitan's ``PrepareModuleInput`` and ``RowwiseParallel`` move them
    (not resharded by all-to-alls: with more than one sequence on a device a ``[B S]`` dim
    cannot hold a sequence shard whole); the backward reads the gathered copy, as DTensor's
    autograd keeps it (``megatron_sp`` gathers again, as Megatron-LM does).
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
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from torch.distributed.tensor import Placement, Replicate

from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.plan.plan import Plan, build_plan
from autoshard.solver.ilp import ILPResult, solve
from autoshard.solver.options import ALGOS, BASELINES, SolverOptions
from autoshard.solver.propagate import propagate
from autoshard.solver.restriction import (
    Restriction,
    all_on,
    gathered,
    is_r,
    kind_table,
    pin_placeholder,
    placeholders,
    restrict,
    restrict_memory,
    restrict_param_uses,
    shard_dim0,
    unrestrict_choice,
    used_as_stored,
)
from autoshard.solver.tensor_parallel import find_tensor_parallel, megatron_restriction
from autoshard.strategies.graph import StrategyGraph

Placements = tuple[Placement, ...]


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
            d = self.ilp.stats()
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


# --- the families ----------------------------------------------------------------------


def _replicate(sg: StrategyGraph, mesh: MeshSpec) -> Restriction:
    r = Restriction()
    missing = 0
    for rep in sg.reps:
        strategies = sg.nodes[rep].strategies

        def all_r(i: int, strategies=strategies) -> bool:
            s = strategies[i]
            tensors = [p for p in s.outputs if p is not None] + list(s.inputs)
            return all(is_r(x) for ps in tensors for x in ps)

        if not r.allow(sg, rep, all_r, "all_replicate"):
            missing += 1
    if missing:
        r.notes.append(f"{missing} nodes have no all-Replicate strategy; left to the ILP")
    return r


def _data_parallel(sg: StrategyGraph, mesh: MeshSpec, fsdp: bool) -> Restriction:
    r = Restriction()
    dims = range(mesh.ndim)
    for rep in placeholders(sg, "input"):
        shape = sg.graph.nodes[rep].results[0].shape
        pin_placeholder(r, sg, rep, shard_dim0(shape, mesh.shape, dims), "inputs")
    for rep in placeholders(sg, "param"):
        shape = sg.graph.nodes[rep].results[0].shape
        want = shard_dim0(shape, mesh.shape, dims) if fsdp else (Replicate(),) * mesh.ndim
        pin_placeholder(r, sg, rep, want, "parameters")
    restrict_param_uses(r, sg, gathered if fsdp else used_as_stored)
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
    ndim = len(sg.mesh_shape)
    for i, e in enumerate(sg.edges):
        info = sg.graph.nodes.get(e.consumer or e.dst)
        if info is None or info.kind == "output":
            continue
        out = info.results[0] if info.results else None
        keeps = out is not None and math.prod(out.shape) <= math.prod(e.tensor.shape)
        # a pair is bad where a mesh dim is Partial in p and q reads it neither replicated
        # nor (when the output is no larger) as Partial
        p_partial, _ = kind_table(e.src_placements, ndim)
        q_partial, q_replicate = kind_table(e.dst_placements, ndim)
        read_ok = q_replicate | (q_partial & keeps)
        bad = (p_partial[:, None, :] & ~read_ok[None, :, :]).any(axis=2)
        r.forbid_mask(i, bad.reshape(e.cost.shape))


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
        return megatron_restriction(sg, mesh, sequence_parallel=False, pin_outside=not relax)
    if name == "megatron_sp":
        return megatron_restriction(sg, mesh, sequence_parallel=True, pin_outside=not relax)
    if name == "fsdp_tp":
        return megatron_restriction(
            sg, mesh, sequence_parallel=True, pin_outside=not relax, fsdp=True
        )
    raise AutoshardError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")


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
    ``tp_dim``, as in ``megatron`` (every forward op, when no module is styled).
    """
    r = Restriction()
    if tp_dim is not None:  # no styles at all: every forward op replicated there
        _replicated_outside_styles(r, sg, tp_styles or {}, tp_dim)
    for rep in placeholders(sg, "input"):
        want = inputs.get(sg.graph.nodes[rep].fqn or "")
        if want is not None:
            pin_placeholder(r, sg, rep, tuple(want), "inputs")
    for rep in placeholders(sg, "param"):
        want = parameters.get(sg.graph.nodes[rep].fqn or "")
        if want is not None:
            pin_placeholder(r, sg, rep, tuple(want), "parameters")

    def use(p: Placements, q: Placements) -> bool:
        return all(
            (gathered if d in gathered_dims else used_as_stored)((a,), (b,))
            for d, (a, b) in enumerate(zip(p, q, strict=True))
        )

    restrict_param_uses(r, sg, use)
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
        if not r.allow(sg, rep, all_on(sg, rep, t, is_r), "replicated_on_tp"):
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
GRADIENT_BUFFER_PLANS: frozenset[str] = frozenset({"ddp", "megatron", "megatron_sp"})
"""Hand plans whose systems keep a buffer of every gradient from one step to the next, so
that the gradients are held the whole step (:class:`~autoshard.cost.memory.MemoryModel`,
``freed_gradients``): PyTorch DDP's reducer allocates its buckets once, at construction
(``torch/csrc/distributed/c10d/reducer.cpp``, ``initialize_buckets``), and Megatron-LM its
contiguous ``main_grad`` buffer (``megatron/core/distributed/param_and_grad_buffer.py``).
FSDP frees its sharded gradients with ``zero_grad(set_to_none=True)``, as autoshard's
launcher frees every plan's."""


def keeps_gradient_buffer(name: str) -> bool:
    """Whether the plan named ``name`` runs on a system that keeps its gradients between
    steps (:data:`GRADIENT_BUFFER_PLANS`; a point of the torchtitan space that replicates
    without sharding runs torchtitan's ``replicate``, DDP's reducer)."""
    return name in GRADIENT_BUFFER_PLANS or name.removeprefix("torchtitan ").startswith("ddp")


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
