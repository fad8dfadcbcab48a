"""From a GPU count to a mesh: every node-respecting mesh shape, each planned by the ILP
(or searched in torchtitan's space, ``--space torchtitan``).

A user starts from "64 H100s, 8 per node", not from "8x8". :func:`search_meshes` traces
the model once (a trace does not depend on the mesh), then for every candidate mesh
(:func:`autoshard.cost.mesh.node_shapes`, links from :meth:`MeshSpec.on_nodes`) generates
the strategies and solves the same ILP ``autoshard solve --mesh`` solves, and ranks the
shapes by predicted step time. A shape whose ILP has more columns than a mesh search
solves (:data:`~autoshard.solver.options.MESH_SEARCH_COLUMNS`; a 3-D mesh of a large
model, often) is searched in torchtitan's space instead (``--space torchtitan``: what
FSDP2 and ``parallelize_module`` express, :mod:`autoshard.solver.space`), so it is still
ranked with a plan that runs; its row says so and why. Such a shape also gets the ILP
plan of each shape with one dim fewer that it splits (8x8's on 4x2x8: dim 0 split in
two, :mod:`autoshard.solver.lifting`), priced on its own links, and keeps the faster of
the two (on the Llama-70B shape of 64 GPUs, 8x8's plan laid onto 4x2x8 is faster than
on 8x8 itself: its collectives over the two inter-node dims take fewer latency steps).
When the fastest row holds such a lifted plan, the ILP over its neighbourhoods improves
it (:mod:`autoshard.solver.neighbourhood`: each pair of mesh dims free, the third kept).
The shapes' ILPs run on a second thread while the next shapes'
strategies are built on this one (:func:`_plan_rows`). Each shape is planned by
:func:`plan_model`, the function ``solve --mesh`` runs, with the links of its place in
the cluster (which can differ from ``--mesh``'s convention, dim 0 across nodes and the
rest inside one: the written files record the links each dim was priced with).
"""

from __future__ import annotations

import contextvars
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from autoshard import interrupt
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError, ProgramTooLargeError
from autoshard.solver.ilp import check_size
from autoshard.solver.lifting import lift_choice, splits
from autoshard.solver.neighbourhood import improve
from autoshard.solver.options import MESH_SEARCH_COLUMNS
from autoshard.solver.solve import (
    SolveConfig,
    SolveResult,
    finish_plan,
    plan_model,
    strategies,
    trace,
    unsolved_result,
)
from autoshard.solver.space import plan_space
from autoshard.units import format_seconds

Progress = Callable[[str, int, int], None]

SWITCH_INTERVAL_S = 1e-4
"""Python's thread switch interval (s) while the search's ILPs run beside its strategies
(:func:`_plan_rows`). HiGHS holds no GIL while it searches, but calls back into Python
(its simplex and MIP interrupt callbacks: Ctrl-C, the work limit, the progress) many
times a second, and each call waits for the GIL: up to Python's default 5 ms behind
the thread building strategies."""


@dataclass
class _OverCap:
    """A row's shape over the column cap, without a plan: its config, strategy graph, the
    seconds spent on it, why its ILP was not solved and why torchtitan's space has no plan
    (``MeshRow.over_cap``)."""

    config: SolveConfig
    sg: Any
    seconds: dict[str, float]
    why: str
    space_error: str  # why torchtitan's space has no plan either


@dataclass
class MeshRow:
    """One candidate mesh: its plan (``result``), or why it has none (``error``: no plan
    fits the memory budget, the ILP found none). A pipeline row (``pp`` > 1) holds a stage
    plan instead (``stages``: an :class:`autoshard.pipeline.pricing.StagesResult`, the
    layers split into ``pp`` stages over the mesh's leading dims), with its own
    ``seconds`` and MFU (``pipeline_mfu``). ``space``: the search that planned it
    (``"free"``, the whole ILP or, with ``lifted_from``, the ILP plan of that shape laid
    onto this one; or ``"torchtitan"``); ``note``: why it is not the one
    asked for (the free ILP over the column cap), else ``None``. ``bound_s``: a row
    skipped because a lower bound on its step (its LP relaxations) is not under the best
    plan found (``error`` says so), else ``None``."""

    mesh: MeshSpec
    result: SolveResult | None = None
    error: str | None = None
    pp: int = 1
    stages: Any = None
    seconds: float = math.nan
    pipeline_mfu: float = 0.0
    space: str = "free"
    note: str | None = None
    bound_s: float | None = None  # skipped: a lower bound on its step, not under the best
    # the shape whose ILP plan this row's plan is, laid onto this shape (one of its dims
    # split in two: autoshard.solver.lifting), or None
    lifted_from: tuple[int, ...] | None = None
    # a shape over the column cap that torchtitan's space has no plan for either: what a
    # plan laid onto it needs (its config and strategies), else None
    over_cap: _OverCap | None = field(default=None, repr=False)

    @property
    def planned(self) -> bool:
        """Whether the row has a plan (intra-op or pipeline)."""
        return self.result is not None or self.stages is not None

    @property
    def step_time_s(self) -> float:
        """The plan's predicted step (s); ``inf`` without a plan."""
        if self.stages is not None:
            return float(self.stages.stage_plan.step_time_s)
        return self.result.plan.step_time_s if self.result is not None else math.inf

    @property
    def memory_bytes(self) -> float:
        """Per device: the plan's, or the fullest stage's."""
        if self.stages is not None:
            return float(max(self.stages.stage_plan.stage_memory_bytes))
        return self.result.plan.memory_bytes if self.result is not None else math.nan

    @property
    def mfu(self) -> float:
        """The plan's model FLOPs utilisation (:attr:`Plan.mfu`)."""
        if self.stages is not None:
            return self.pipeline_mfu
        return self.result.plan.mfu if self.result is not None else 0.0

    @property
    def solve_seconds(self) -> float:
        """Strategies, hand plans and the ILP for this mesh (the shared trace excluded);
        a pipeline row: its strategies and stage ILPs, and the first planned depth the
        pipeline traces it made."""
        if self.stages is not None:
            return self.seconds
        if self.result is None:
            return math.nan
        s = self.result.seconds
        return sum(v for k, v in s.items() if k not in ("trace", "total"))


@dataclass
class MeshSearch:
    """The ranked candidates (fastest first, a skipped row by its bound; meshes without a
    plan last, in the order tried) and the seconds of the one trace the shapes share."""

    rows: list[MeshRow]
    trace_seconds: float
    gpus_per_node: int | None = None  # the node size the meshes were laid over, if given

    @property
    def best(self) -> MeshRow:
        """The fastest mesh planned without pipeline stages, the plan ``solve`` writes
        (:func:`search_meshes` guarantees one has a plan)."""
        return next(r for r in self.rows if r.result is not None)

    @property
    def fastest(self) -> MeshRow:
        """The fastest row with a plan, a pipeline's included."""
        return next(r for r in self.rows if r.planned)

    def with_rows(self, extra: Sequence[MeshRow]) -> MeshSearch:
        """The search with ``extra`` rows (pipeline rows) ranked among its own."""
        search = MeshSearch(_ranked([*self.rows, *extra]), self.trace_seconds, self.gpus_per_node)
        search.best.result.meshes = search
        return search


@dataclass
class _Begun:
    """A row whose strategies are built and whose plan is still to come: ``future``, its
    ILP running on the search's second thread; else (``future`` None) planned in
    ``space`` by :meth:`finish`, on this thread. ``why``: why its free ILP is not solved
    (over the column cap), else None."""

    config: SolveConfig
    space: str
    sg: Any
    built: float  # seconds its strategies took
    why: str | None = None
    future: Future | None = None

    def finish(self, progress, graph) -> MeshRow:  # noqa: ANN001
        """The row: its ILP's plan (waited for), or its plan in ``space`` found now, or
        why it has none."""
        config, why = self.config, self.why
        try:
            if self.future is not None:
                found = self.future.result()
            else:
                found = plan_space(config, self.space, progress, graph, self.sg)
        except AutoshardError as exc:  # this shape has no plan: its row says why
            if why is None:
                return MeshRow(config.mesh, error=str(exc), space=self.space)
            # over the cap and no plan in torchtitan's space: another shape's plan may
            # still be laid onto it (_lifted), on these strategies
            error = f"{why}; in torchtitan's space: {exc}"
            over_cap = _OverCap(config, self.sg, {"strategies": self.built}, why, str(exc))
            return MeshRow(config.mesh, error=error, space=self.space, over_cap=over_cap)
        found.seconds = {"strategies": self.built, **found.seconds}
        return MeshRow(config.mesh, found, space=self.space, note=why)


def _begin_row(
    config: SolveConfig,
    space: str,
    progress,  # noqa: ANN001
    graph,  # noqa: ANN001
    pool: ThreadPoolExecutor,
    gpus_per_node: int | None = None,
) -> _Begun | MeshRow:
    """``config.mesh``'s strategies (built here), and its plan begun: the free ILP, when
    it is asked for and within the column cap, on ``pool``'s thread; otherwise
    (torchtitan's space, or the free ILP over the cap) left to :meth:`_Begun.finish`.
    A shape without strategies is a row at once, saying why (``gpus_per_node``: the node
    size the mesh was laid over, for the command that plans it alone)."""
    try:
        t = time.perf_counter()
        sg = strategies(config, graph, progress)  # once, whichever space plans the shape
        built = time.perf_counter() - t
    except AutoshardError as exc:
        return MeshRow(config.mesh, error=str(exc), space=space)
    if space != "free":
        return _Begun(config, space, sg, built)
    try:
        check_size(sg, config.solver, config.mesh, gpus_per_node)
    except ProgramTooLargeError as exc:
        return _Begun(config, "torchtitan", sg, built, why=str(exc))
    run = contextvars.copy_context().run  # the listener, the tally, the stop event
    future = pool.submit(run, plan_model, config, progress, graph, sg)
    return _Begun(config, space, sg, built, future=future)


def _on(progress: Progress | None, mesh: MeshSpec) -> Progress | None:
    """``progress`` with each phase named after ``mesh`` ("solve on 8x8")."""
    if progress is None:
        return None
    text = "x".join(map(str, mesh.shape))

    def inner(phase: str, done: int, total: int) -> None:
        progress(f"{phase} on {text}", done, total)

    return inner


def _plan_rows(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    space: str,
    progress: Progress | None,
    graph,  # noqa: ANN001
    gpus_per_node: int | None,
) -> list[MeshRow]:
    """Each of ``meshes``' rows, in order, planned in ``space`` (the free ILP over the
    search's column cap: in torchtitan's space).

    Strategies are built on this thread, shape after shape; each free ILP runs on a
    second thread as soon as its shape's strategies are built (HiGHS holds no GIL while
    it searches: the Llama-70B shape's 8x8 ILP, about 50 s, runs while the 3-D shapes'
    strategies are built); the shapes planned in torchtitan's space follow on this thread
    once the ILPs have ended (one HiGHS run at a time, :func:`autoshard.solver.highs.run`).
    Every plan is what the shapes planned one after another give: each ILP stops at its
    own work limit, never at the clock. If this thread fails, the ILP running stops at
    its next progress check (:func:`autoshard.interrupt.stoppable`).
    """
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoshard-ilp")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, SWITCH_INTERVAL_S))
    try:
        with interrupt.stoppable(stop):
            begun = []
            for k, mesh in enumerate(meshes):
                if progress:
                    progress("meshes", k, len(meshes))
                shaped = replace(config, mesh=mesh)
                on = _on(progress, mesh)
                begun.append(_begin_row(shaped, space, on, graph, pool, gpus_per_node))
            # the ILPs first: a row planned here may run HiGHS too
            for b in begun:
                if isinstance(b, _Begun) and b.future is not None:
                    b.future.exception()
            rows = []
            for b, mesh in zip(begun, meshes, strict=True):
                done = b if isinstance(b, MeshRow) else b.finish(_on(progress, mesh), graph)
                rows.append(done)
            if progress:
                progress("meshes", len(meshes), len(meshes))
            return rows
    except BaseException:
        stop.set()  # the ILP running stops at its next check; those queued never start
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        sys.setswitchinterval(switch)


def _lifted(row: MeshRow, rows: Sequence[MeshRow]) -> MeshRow:
    """``row``, or, when its free ILP was over the column cap (planned in torchtitan's
    space instead), the ILP plan of a shape with one dim fewer laid onto it
    (:mod:`autoshard.solver.lifting`: a dim of that shape split into two of this one),
    priced on this shape's links, when that is faster and fits the budget. The fastest
    such plan of every free row it can be laid from, with that row's recomputation."""
    if row.result is not None and row.space != "free" and row.note is not None:
        res = row.result
        config, sg, graph, spent, why = res.config, res.sg, res.graph, res.seconds, row.note
    elif row.over_cap is not None:  # no plan in torchtitan's space either
        c = row.over_cap
        config, sg, graph, spent, why = c.config, c.sg, c.sg.graph, c.seconds, c.why
    else:
        return row
    t = time.perf_counter()
    budget = config.budget()
    best: tuple[Any, MeshRow, int] | None = None
    for src in rows:
        if src.space != "free" or src.result is None or src.pp != 1:
            continue
        for m in splits(src.mesh.shape, row.mesh.shape):
            choice = lift_choice(src.result.sg, src.result.plan.choice, sg, m)
            if choice is None:
                continue
            plan = finish_plan(config, sg, choice, "ilp", src.result.ilp.recompute)
            if plan.memory_bytes > budget * (1 + 1e-9):
                continue
            if best is None or plan.step_time_s < best[0].step_time_s:
                best = (plan, src, m)
    if best is None or (row.result is not None and best[0].step_time_s >= row.step_time_s):
        return row
    plan, src, m = best
    source = "x".join(map(str, src.mesh.shape))
    seconds = {k: v for k, v in spent.items() if k != "total"}
    seconds["lift"] = time.perf_counter() - t
    split = f"{source}'s dim {m} split into dims {m} and {m + 1}"
    status = f"{source}'s ILP plan, lifted ({split})"
    ilp = src.result.ilp
    plan.extra["lifted"] = {
        "from": list(src.mesh.shape),
        "split_dim": m,
        "source_status": ilp.status,
        "source_gap": ilp.gap,
        "source_step_s": src.result.plan.step_time_s,
    }
    lifted = unsolved_result(config, graph, sg, plan, seconds, status)
    lifted.ilp = replace(lifted.ilp, recompute=dict(ilp.recompute))
    other = (
        f"{row.space}'s space {format_seconds(row.step_time_s)}"
        if row.result is not None
        else f"{row.space}'s space has no plan ({row.over_cap.space_error})"
    )
    note = f"{why}; {source}'s ILP plan laid onto it ({split}) takes "
    note += f"{format_seconds(plan.step_time_s)}, {other}"
    return replace(
        row,
        result=lifted,
        space="free",
        note=note,
        error=None,
        lifted_from=src.mesh.shape,
        over_cap=None,
    )


def _improved(row: MeshRow, progress: Progress | None) -> MeshRow:
    """``row``'s lifted plan improved by the ILP over its neighbourhoods
    (:func:`autoshard.solver.neighbourhood.improve`: each pair of mesh dims free, the
    others kept as the plan has them), or the row as it was when none is faster, its
    report saying so. Only the search's fastest row gets it: each neighbourhood's ILP is
    a 2-D mesh's."""
    res = row.result
    t = time.perf_counter()

    def inner(phase: str, done: int, total: int) -> None:
        progress(f"{phase} on {row.mesh.shape_str}", done, total)

    found = improve(
        res.config, res.sg, res.plan.choice, res.ilp.recompute, progress=inner if progress else None
    )
    lifted = {**res.plan.extra["lifted"], "improved": found.to_dict()}
    plan = res.plan
    if found.improved:
        plan = finish_plan(res.config, res.sg, found.choice, "ilp", res.ilp.recompute)
    plan.extra["lifted"] = lifted
    seconds = {k: v for k, v in res.seconds.items() if k != "total"}
    seconds["neighbourhoods"] = time.perf_counter() - t
    if not found.improved:
        res.seconds = {**seconds, "total": sum(seconds.values())}  # _lifted built res
        return row
    status = f"{res.ilp.status}, improved in its neighbourhoods ({len(found.steps)} ILPs)"
    better = unsolved_result(res.config, res.graph, res.sg, plan, seconds, status)
    better.ilp = replace(better.ilp, recompute=dict(res.ilp.recompute))
    note = f"{row.note}; improved in its neighbourhoods to {format_seconds(plan.step_time_s)}"
    return replace(row, result=better, note=note)


def _ranked(rows: Sequence[MeshRow]) -> list[MeshRow]:
    """Fastest first (ties: fewer mesh dims, then no pipeline, then the order tried), a
    skipped row by its lower bound (after the plans it ties with); rows without a plan
    last, in the order tried."""

    def key(r: MeshRow) -> tuple:
        step = r.step_time_s if r.planned else r.bound_s
        return (step, not r.planned, len(r.mesh.shape), r.pp)

    ranked = sorted((r for r in rows if r.planned or r.bound_s is not None), key=key)
    return ranked + [r for r in rows if not r.planned and r.bound_s is None]


def search_meshes(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    progress: Progress | None = None,
    gpus_per_node: int | None = None,
    space: str = "free",
) -> MeshSearch:
    """Plan ``config``'s model on each of ``meshes`` (``config.mesh`` is ignored) and rank
    them by predicted step time (``gpus_per_node``: the node size the meshes were laid
    over, kept in the result for its readers; ``space``: the search each mesh gets,
    :func:`~autoshard.solver.space.plan_space`).

    Raises:
        AutoshardError: no mesh is given, the model cannot be traced, or no mesh has a
            plan (the message gives each mesh's reason).
    """
    if not meshes:
        raise AutoshardError("no mesh shape to try: check --gpus and --gpus-per-node")
    t = time.perf_counter()
    graph = trace(config, progress)
    trace_s = time.perf_counter() - t
    solver = config.solver
    if solver.max_columns is None:  # one shape's program must not hold up the others
        solver = replace(solver, max_columns=MESH_SEARCH_COLUMNS)
    shaped = replace(config, solver=solver)
    rows = _plan_rows(shaped, meshes, space, progress, graph, gpus_per_node)
    for row in rows:
        if row.result is not None:
            # the shared trace counts in every shape's seconds, as in a solve of that shape
            seconds = row.result.seconds
            row.result.seconds = {"trace": trace_s, **seconds}
            row.result.seconds["total"] = sum(
                v for k, v in row.result.seconds.items() if k != "total"
            )
    rows = [_lifted(row, rows) for row in rows]
    planned = [r for r in rows if r.result is not None]
    if planned:
        fastest = min(planned, key=lambda r: r.step_time_s)
        if fastest.lifted_from is not None:  # a lifted plan is a start, not an optimum
            rows = [_improved(r, progress) if r is fastest else r for r in rows]
    if all(r.result is None for r in rows):
        reasons = "; ".join(f"{'x'.join(map(str, r.mesh.shape))}: {r.error}" for r in rows)
        raise AutoshardError(f"no mesh shape has a plan ({reasons})")
    # ties (mirror-image shapes) go to the fewer dims, then to the order tried
    search = MeshSearch(_ranked(rows), trace_s, gpus_per_node)
    search.best.result.meshes = search
    return search
