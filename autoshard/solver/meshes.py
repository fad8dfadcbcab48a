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
Each such lifted plan is improved by the ILP over its neighbourhoods before the two are
compared (:mod:`autoshard.solver.neighbourhood`: each pair of mesh dims free, the third
kept), every row alike, so that each row holds what its shape planned alone this way
would. The shapes' ILPs and neighbourhoods run on two more threads, each with a HiGHS
process of its own, while this one builds the next shapes' strategies and prices
torchtitan's space (:func:`_plan_rows`). Each
shape is planned by
:func:`plan_model`, the function ``solve --mesh`` runs, with the links of its place in
the cluster (which can differ from ``--mesh``'s convention, dim 0 across nodes and the
rest inside one: the written files record the links each dim was priced with).
"""

from __future__ import annotations

import contextvars
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from autoshard import interrupt
from autoshard.cost.mesh import MeshSpec, default_dim_names, respects_nodes
from autoshard.errors import AutoshardError, ProgramTooLargeError
from autoshard.solver.highs import about, in_processes
from autoshard.solver.ilp import check_size, program_columns
from autoshard.solver.lifting import lift_choice, splits
from autoshard.solver.neighbourhood import improve
from autoshard.solver.solve import (
    SolveConfig,
    SolveResult,
    finish_plan,
    graph_and_strategies,
    peak_rss_bytes,
    plan_model,
    strategies,
    trace,
    unsolved_result,
)
from autoshard.solver.space import plan_space
from autoshard.units import format_seconds

Progress = Callable[[str, int, int], None]

LANES = 2
"""Threads that run the mesh search's ILPs and neighbourhoods beside the one that builds
strategies, each with a HiGHS process of its own: this machine's two cores (the Python
work of the threads shares one interpreter; HiGHS runs in the processes, a third one
for the HiGHS runs of the thread that builds strategies: torchtitan's space, the
pipeline depths' stages)."""


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
        """Strategies, hand plans and the ILP for this mesh (the shared trace excluded),
        wall seconds: in a mesh search, spent beside the other shapes' work on its second
        thread, so the rows' seconds add up to more than the search's;
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
    ILP running on one of the search's lanes (:data:`LANES`); else (``future`` None) planned in
    ``space`` by :meth:`finish`, on this thread. ``why``: why its free ILP is not solved
    (over the column cap), else None; ``error``: why the shape has no strategies (then
    ``sg`` is None); ``space_error``: once finished, why ``space`` has no plan."""

    config: SolveConfig
    space: str
    sg: Any = None
    built: float = 0.0  # seconds its strategies took
    why: str | None = None
    future: Future | None = None
    error: str | None = None
    space_error: str | None = None
    lift: _Lift | None = None  # over the cap: another shape's plan laid onto it

    def finish(self, progress, graph) -> MeshRow:  # noqa: ANN001
        """The row: its ILP's plan (waited for), or its plan in ``space`` found now, or
        why it has none."""
        config, why = self.config, self.why
        if self.error is not None:
            return MeshRow(config.mesh, error=self.error, space=self.space)
        try:
            if self.future is not None:
                found = self.future.result()
            else:
                found = plan_space(config, self.space, progress, graph, self.sg)
        except AutoshardError as exc:  # this shape has no plan: its row says why
            self.space_error = str(exc)
            error = str(exc) if why is None else f"{why}; in torchtitan's space: {exc}"
            return MeshRow(config.mesh, error=error, space=self.space)
        found.seconds = {"strategies": self.built, **found.seconds}
        return MeshRow(config.mesh, found, space=self.space, note=why)


def _submit(
    pool: ThreadPoolExecutor, fn: Callable, *args: Any, subject: str | None = None
) -> Future:
    """``fn(*args)`` on ``pool``'s thread, in a copy of this context (the progress
    listener, the HiGHS tally, the stop event: :func:`autoshard.interrupt.stoppable`);
    ``subject`` labels its MIPs' progress (:func:`autoshard.solver.highs.about`: two lanes
    report to one listener)."""
    if subject is None:
        return pool.submit(contextvars.copy_context().run, fn, *args)
    return pool.submit(contextvars.copy_context().run, _labelled, subject, fn, *args)


def _labelled(subject: str, fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` with its MIPs' progress labelled ``subject``."""
    with about(subject):
        return fn(*args)


def _begin_row(
    config: SolveConfig,
    space: str,
    progress,  # noqa: ANN001
    graph,  # noqa: ANN001
    pool: ThreadPoolExecutor,
    gpus_per_node: int | None = None,
    prebuilt: tuple[Any, float] | None = None,
) -> _Begun:
    """``config.mesh``'s strategies (built here, unless ``prebuilt``: the strategies
    and the seconds they took), and its plan begun: the free ILP, when it is asked for
    and within the column cap, on ``pool``'s thread; otherwise (torchtitan's space, or
    the free ILP over the cap) left to :meth:`_Begun.finish` (``gpus_per_node``: the
    node size the mesh was laid over, for the command that plans it alone)."""
    try:
        if prebuilt is not None:
            sg, built = prebuilt
        else:
            t = time.perf_counter()
            sg = strategies(config, graph, progress)  # once, whichever space plans the shape
            built = time.perf_counter() - t
    except AutoshardError as exc:
        return _Begun(config, space, error=str(exc))
    if space != "free":
        return _Begun(config, space, sg, built)
    try:
        check_size(sg, config.solver, config.mesh, gpus_per_node)
    except ProgramTooLargeError as exc:
        return _Begun(config, "torchtitan", sg, built, why=str(exc))
    future = _submit(pool, plan_model, config, progress, graph, sg, subject=config.mesh.shape_str)
    return _Begun(config, space, sg, built, future=future)


def _on(progress: Progress | None, mesh: MeshSpec) -> Progress | None:
    """``progress`` with each phase named after ``mesh`` ("solve on 8x8")."""
    if progress is None:
        return None

    def inner(phase: str, done: int, total: int) -> None:
        progress(f"{phase} on {mesh.shape_str}", done, total)

    return inner


def _plan_rows(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    space: str,
    progress: Progress | None,
    graph,  # noqa: ANN001
    gpus_per_node: int | None,
    beside: Callable[[], None] | None = None,
    built: tuple[MeshSpec, Any, float] | None = None,
) -> list[MeshRow]:
    """Each of ``meshes``' rows, in order, planned in ``space`` (the free ILP over the
    search's column cap: in torchtitan's space, or the plan of a free row laid onto it
    and improved in its neighbourhoods, the faster).

    Strategies are built on this thread, shape after shape; each free ILP runs on one of
    :data:`LANES` other threads as soon as its shape's strategies are built (the
    Llama-70B shape's 8x8 ILP, about 60 s, runs while the 3-D shapes' strategies are
    built). This one then plans the over-cap shapes in torchtitan's space and runs
    ``beside``, while a thread of its own (:func:`_lift_all`) waits for those ILPs and
    lays the fastest of their plans onto each over-cap shape (:func:`_lift`), each then
    improved in its neighbourhoods on the lanes (:func:`_improve`, two shapes at once).
    Every thread's HiGHS runs in a process of
    its own (:func:`autoshard.solver.highs.in_processes`), so that they run at once on
    the machine's cores. Every plan is what the shapes planned one after another give:
    each ILP stops at its own work limit, never at the clock, and each row's work
    depends on no other's; not so with ``--time-limit`` (wall seconds, now shared with
    the other threads). When this thread fails, the work running on the others stops at
    its next check (HiGHS's polls, each neighbourhood, each memory round:
    :func:`autoshard.interrupt.stoppable`), and their HiGHS processes are killed.
    """
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="autoshard-ilp")
    lifter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoshard-lift")
    with in_processes():  # ends after the lanes (finally): no HiGHS process outlives them
        try:
            with interrupt.stoppable(stop):
                begun = []
                for k, mesh in enumerate(meshes):
                    if progress:
                        progress("meshes", k, len(meshes))
                    shaped = replace(config, mesh=mesh)
                    on = _on(progress, mesh)
                    prebuilt = built[1:] if built is not None and built[0] is mesh else None
                    begun.append(
                        _begin_row(shaped, space, on, graph, pool, gpus_per_node, prebuilt)
                    )
                # every ILP is now queued ahead of the improvements _lift_all will queue
                lifted = _submit(lifter, _lift_all, begun, graph, pool, progress)
                # torchtitan's space of the over-cap shapes and the work beside, while the
                # ILPs and the improvements run: neither waits for their plans
                spaced = [
                    None if b.future else b.finish(_on(progress, b.config.mesh), graph)
                    for b in begun
                ]
                if beside is not None:
                    with about("pipeline stages"):  # their stage ILPs, beside the lanes'
                        beside()
                ilp_rows = lifted.result()
                rows = [ilp_rows[k] if b.future else spaced[k] for k, b in enumerate(begun)]
                rows = [_lifted(r, b) for r, b in zip(rows, begun, strict=True)]
                if progress:
                    progress("meshes", len(meshes), len(meshes))
                return rows
        finally:
            stop.set()  # a failure: the work running stops at its next check (else all ended)
            try:
                pool.shutdown(wait=False, cancel_futures=True)  # nothing queued starts now
                lifter.shutdown(wait=True, cancel_futures=True)
            finally:  # a second Ctrl-C: the lanes still end before their HiGHS processes
                pool.shutdown(wait=True)


def _lift_all(
    begun: Sequence[_Begun],
    graph,  # noqa: ANN001
    pool: ThreadPoolExecutor,
    progress: Progress | None,
) -> dict[int, MeshRow]:
    """The rows of ``begun``'s ILPs (by index in ``begun``), waited for; as soon as they
    have ended, each over-cap shape's lifted plan (:func:`_lift`, the fastest of their
    plans laid onto it), its improvement queued on ``pool`` (:func:`_improve`). Run on a
    thread of its own, so that the improvements start while the search's thread still
    prices torchtitan's space and the work beside."""
    rows = {k: b.finish(None, graph) for k, b in enumerate(begun) if b.future}
    sources = list(rows.values())
    for b in begun:
        b.lift = _lift(b.config, b.sg, sources) if b.why is not None else None
        if b.lift is not None:
            on = _on(progress, b.config.mesh)
            subject = f"{b.config.mesh.shape_str} neighbourhoods"
            b.lift.found = _submit(pool, _improve, b.config, b.sg, b.lift, on, subject=subject)
    return rows


@dataclass
class _Lift:
    """The fastest plan of a free row laid onto an over-cap shape (:func:`_lift`): the
    plan, the row it comes from, the dim of that row's shape split in two, the seconds
    the laying took; ``found``: the search over its neighbourhoods (a future of
    ``(Improvement, its plan, seconds)``), once begun."""

    plan: Any
    src: MeshRow
    split_dim: int
    seconds: float
    found: Future | None = None


def _lift(config: SolveConfig, sg, rows: Sequence[MeshRow]) -> _Lift | None:  # noqa: ANN001
    """The ILP plan of a shape with one dim fewer laid onto ``config.mesh``
    (:mod:`autoshard.solver.lifting`: a dim of that shape split into two of this one),
    priced on this shape's links: the fastest that fits the budget of every free row of
    ``rows`` it can be laid from, with that row's recomputation; None when none can be."""
    t = time.perf_counter()
    budget = config.budget()
    best: _Lift | None = None
    for src in rows:
        if src.space != "free" or src.result is None or src.pp != 1:
            continue
        for m in splits(src.mesh.shape, config.mesh.shape):
            choice = lift_choice(src.result.sg, src.result.plan.choice, sg, m)
            if choice is None:
                continue
            plan = finish_plan(config, sg, choice, "ilp", src.result.ilp.recompute)
            if plan.memory_bytes > budget * (1 + 1e-9):
                continue
            if best is None or plan.step_time_s < best.plan.step_time_s:
                best = _Lift(plan, src, m, 0.0)
    if best is not None:
        best.seconds = time.perf_counter() - t
    return best


def _improve(config: SolveConfig, sg, lift: _Lift, progress) -> tuple:  # noqa: ANN001
    """``lift``'s plan improved by the ILP over its neighbourhoods
    (:func:`autoshard.solver.neighbourhood.improve`: each pair of mesh dims free, the
    others kept as the plan has them): the :class:`Improvement`, the plan it gives
    (``lift``'s own when none is faster) and the seconds it took."""
    t = time.perf_counter()
    recompute = lift.src.result.ilp.recompute
    found = improve(config, sg, lift.plan.choice, recompute, progress=progress)
    plan = lift.plan
    if found.improved:
        plan = finish_plan(config, sg, found.choice, "ilp", recompute)
    return found, plan, time.perf_counter() - t


def _lifted(row: MeshRow, begun: _Begun) -> MeshRow:
    """``row`` (``begun``'s shape, its free ILP over the column cap: planned in
    torchtitan's space, or without a plan), or, when faster, ``begun``'s lifted plan,
    improved in its neighbourhoods."""
    lift = begun.lift
    if lift is None:
        return row
    found, plan, took = lift.found.result()
    if row.result is not None and plan.step_time_s >= row.step_time_s:
        return row
    config, sg, why = begun.config, begun.sg, begun.why
    spent = row.result.seconds if row.result is not None else {"strategies": begun.built}
    src, m = lift.src, lift.split_dim
    source = src.mesh.shape_str
    seconds = {k: v for k, v in spent.items() if k != "total"}
    seconds["lift"] = lift.seconds
    seconds["neighbourhoods"] = took
    split = f"{source}'s dim {m} split into dims {m} and {m + 1}"
    status = f"{source}'s ILP plan, lifted ({split})"
    if found.improved:
        status += f", improved in its neighbourhoods ({len(found.steps)} ILPs)"
    ilp = src.result.ilp
    plan.extra["lifted"] = {
        "from": list(src.mesh.shape),
        "split_dim": m,
        "source_status": ilp.status,
        "source_gap": ilp.gap,
        "source_step_s": src.result.plan.step_time_s,
        "improved": found.to_dict(),
    }
    lifted = unsolved_result(config, sg.graph, sg, plan, seconds, status)
    lifted.ilp = replace(lifted.ilp, recompute=dict(ilp.recompute))
    other = (
        f"{row.space}'s space {format_seconds(row.step_time_s)}"
        if row.result is not None
        else f"{row.space}'s space has no plan ({begun.space_error})"
    )
    note = f"{why}; {source}'s ILP plan laid onto it ({split}) takes "
    note += f"{format_seconds(lift.plan.step_time_s)}, {other}"
    if found.improved:
        note += f"; improved in its neighbourhoods to {format_seconds(plan.step_time_s)}"
    return replace(
        row,
        result=lifted,
        space="free",
        note=note,
        error=None,
        lifted_from=src.mesh.shape,
    )


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
    beside: Callable[[], None] | None = None,
    graph: Any = None,
    built: tuple[MeshSpec, Any, float] | None = None,
) -> MeshSearch:
    """Plan ``config``'s model on each of ``meshes`` (``config.mesh`` is ignored) and rank
    them by predicted step time (``gpus_per_node``: the node size the meshes were laid
    over, kept in the result for its readers; ``space``: the search each mesh gets,
    :func:`~autoshard.solver.space.plan_space`). ``beside``: work for this thread while
    the second one improves the lifted plans (the command line prices the pipeline
    depths' stages there, :func:`autoshard.pipeline.search.prepare_depths`); its errors
    are raised. ``graph``: the model already traced (:func:`trace`), else traced here
    (its seconds are then the caller's to count); ``built``: one of ``meshes``, its
    strategies on ``graph`` already built and the seconds they took.

    Raises:
        AutoshardError: no mesh is given, the model cannot be traced, or no mesh has a
            plan (the message gives each mesh's reason).
    """
    if not meshes:
        raise AutoshardError("no mesh shape to try: check --gpus and --gpus-per-node")
    t = time.perf_counter()
    if graph is None:
        graph = trace(config, progress)
    trace_s = time.perf_counter() - t
    # one shape's program must not hold up the others
    shaped = replace(config, solver=config.solver.capped())
    rows = _plan_rows(shaped, meshes, space, progress, graph, gpus_per_node, beside, built)
    peak = peak_rss_bytes()  # the HiGHS processes, ended with _plan_rows, counted too
    for row in rows:
        if row.result is not None:
            row.result.peak_rss_bytes = max(row.result.peak_rss_bytes, peak)
            # the shared trace counts in every shape's seconds, as in a solve of that shape
            seconds = row.result.seconds
            row.result.seconds = {"trace": trace_s, **seconds}
            row.result.seconds["total"] = sum(
                v for k, v in row.result.seconds.items() if k != "total"
            )
    if all(r.result is None for r in rows):
        reasons = "; ".join(f"{'x'.join(map(str, r.mesh.shape))}: {r.error}" for r in rows)
        raise AutoshardError(f"no mesh shape has a plan ({reasons})")
    # ties (mirror-image shapes) go to the fewer dims, then to the order tried
    search = MeshSearch(_ranked(rows), trace_s, gpus_per_node)
    search.best.result.meshes = search
    return search


def lift_sources(mesh: MeshSpec, gpus_per_node: int | None = None) -> list[MeshSpec]:
    """The shapes with one dim fewer that ``mesh`` splits (two neighbouring dims merged:
    2x4x8 is 8x8 with dim 0 split into 2 and 4), each laid as ``mesh``'s ranks lie over
    nodes of ``gpus_per_node`` devices (None: ``--mesh``'s convention, dim 0 across
    nodes and the rest inside one): only those whose dims each stay inside a node or
    across whole nodes (:func:`~autoshard.cost.mesh.respects_nodes`, as ``--gpus``'s
    shapes). A merged dim's ring crosses both dims' links: it takes the slower
    bandwidth and the longer latency of the two (on a mesh laid over nodes, the links
    :meth:`MeshSpec.on_nodes` gives it); every other dim keeps its own."""
    shape = mesh.shape
    node = gpus_per_node if gpus_per_node is not None else math.prod(shape[1:])

    def merge(values: tuple, m: int, pick: Callable) -> tuple:
        return (*values[:m], pick(values[m], values[m + 1]), *values[m + 2 :])

    found: dict[tuple[int, ...], MeshSpec] = {}  # a dim of 1 merges to one shape twice
    for m in range(len(shape) - 1):
        merged = merge(shape, m, lambda a, b: a * b)
        if respects_nodes(merged, node) and merged not in found:
            bandwidth, latency = merge(mesh.bandwidth, m, min), merge(mesh.latency, m, max)
            found[merged] = MeshSpec(merged, default_dim_names(len(merged)), bandwidth, latency)
    return list(found.values())


def plan_mesh(
    config: SolveConfig, progress: Progress | None = None, gpus_per_node: int | None = None
) -> SolveResult:
    """``autoshard solve --mesh``: ``config.mesh``'s plan by its whole ILP
    (:func:`plan_model`) when the program has at most ``config.solver.max_columns``
    columns (None: :data:`MESH_SEARCH_COLUMNS`, the mesh search's cap). A larger program
    (a 3-D mesh of a large model, often: the Llama-70B shape on 2x4x8 has 2,870,566
    columns, and its whole ILP had not ended after 77 minutes here) is planned as the
    mesh search plans such a shape (:func:`search_meshes` over it and the shapes it
    splits, :func:`lift_sources`): the ILP plan of a shape with one dim fewer laid onto
    it and improved in its neighbourhoods, or torchtitan's space, the faster. The plan
    is then the search's row of this shape, and its report says how it was found.
    ``gpus_per_node``: the node size ``config.mesh`` was laid over (``--gpus-per-node``,
    ``autoshard.solve(mesh=..., gpus_per_node=...)``), else None (``--mesh``'s
    convention, dim 0 across nodes and the rest inside one).

    Over the cap, ``result.seconds`` adds the ILPs of the shapes it was lifted from
    (``sources``, run beside this shape's strategies) and its ``total`` is the wall time.

    Raises:
        AutoshardError: as :func:`plan_model`; over the cap, when no plan fits (the
            message says why for each way it was planned).
    """
    began = time.perf_counter()
    seconds: dict[str, float] = {}
    graph, sg = graph_and_strategies(config, progress, seconds)
    capped = replace(config, solver=config.solver.capped())
    if program_columns(sg) <= capped.solver.max_columns:  # check_size's test, as the search's
        result = plan_model(config, progress, graph, sg)
        seconds.update(result.seconds)
        seconds["total"] = sum(v for k, v in seconds.items() if k != "total")
        result.seconds = seconds
        return result
    sources = lift_sources(config.mesh, gpus_per_node)
    built = (config.mesh, sg, seconds["strategies"])
    try:
        search = search_meshes(
            capped, [*sources, config.mesh], progress, gpus_per_node, graph=graph, built=built
        )
    except AutoshardError as exc:  # no shape has a plan: say so of the one asked for
        raise AutoshardError(f"--mesh {config.mesh.shape_str} has no plan: {exc}") from None
    row = next(r for r in search.rows if r.mesh is config.mesh)
    if row.result is None:
        tried = ", ".join(m.shape_str for m in sources) or "none"
        raise AutoshardError(
            f"--mesh {config.mesh.shape_str} has no plan: {row.error}; nor does the plan of "
            f"a shape with one dim fewer laid onto it (tried: {tried})"
        )
    result = row.result
    result.meshes = None  # one shape asked for: no table of the others
    result.plan.extra.setdefault("notes", []).append(row.note)  # how it was planned, and why
    spent = {k: v for k, v in result.seconds.items() if k not in ("trace", "total")}
    result.seconds = {
        "trace": seconds["trace"],
        **spent,
        "sources": sum(r.solve_seconds for r in search.rows if r is not row and r.planned),
        "total": time.perf_counter() - began,
    }
    return result
