"""Pipeline depths beside the mesh shapes of ``autoshard solve --gpus N --pp 2,4``.

:func:`autoshard.solver.meshes.search_meshes` plans every node-respecting mesh shape of
the GPUs without pipeline stages. For each pipeline depth asked, :func:`pipeline_rows`
takes one of those shapes whose leading dims split into the stages (across nodes first,
as Megatron-LM and torchtitan place pipeline stages: only the stages' boundary activations
cross the network), splits the model's layers into that many stages over it and plans each
stage's submesh with the intra-op ILP (:func:`autoshard.pipeline.pricing.plan_pipeline`,
what ``autoshard stages --pp K`` runs), for a 1F1B schedule of ``microbatches``. Each
depth is one :class:`~autoshard.solver.meshes.MeshRow`, ranked with the shapes by its
predicted step.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoshard.cost.mesh import MeshSpec, inside_node
from autoshard.errors import AutoshardError
from autoshard.pipeline.pricing import (
    LayerMap,
    PipelineCosts,
    StagesResult,
    layer_map,
    plan_pipeline,
    price_pipeline,
    stage_plan_dict,
)
from autoshard.pipeline.stage_plan import save_stage_plan
from autoshard.pipeline.stages import (
    even_split,
    even_split_fits,
    pipeline_degrees,
    pipeline_step_time,
)
from autoshard.solver.meshes import MeshRow, MeshSearch, search_meshes
from autoshard.solver.solve import SolveConfig, refuse_pipeline_accumulation, trace
from autoshard.units import format_seconds

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class PipelinePlan:
    """A pipeline row's plan: the chosen stage plan and how it was priced (``result``),
    with the traced graph and layers it was cut from (what its file is written from:
    :func:`stage_file`)."""

    result: StagesResult
    graph: Any
    layers: Any

    @property
    def stage_plan(self) -> Any:
        """The :class:`autoshard.pipeline.stages.StagePlan`."""
        return self.result.stage_plan


def stage_file(row: MeshRow, path: Path) -> None:
    """Write pipeline row ``row``'s stage plan to ``path`` (what ``autoshard stages --pp``
    writes; docs/formats.md).

    Raises:
        AutoshardError: the file cannot be written.
    """
    plan = row.stages
    save_stage_plan(path, stage_plan_dict(plan.graph, plan.layers, plan.result, row.mesh))


def pipeline_mesh(
    meshes: Sequence[MeshSpec], pp: int, gpus_per_node: int | None
) -> MeshSpec | None:
    """The first of ``meshes`` whose leading dims split into ``pp`` stages
    (:func:`~autoshard.pipeline.stages.pipeline_degrees`), one of 2 or more dims whose
    leading dim lies across nodes first (the stages on the network, each stage's plan
    inside); None when none splits."""
    fits = [m for m in meshes if pp in pipeline_degrees(m.shape)]

    def second_choice(m: MeshSpec) -> bool:
        across = gpus_per_node is not None and not inside_node(m.shape, gpus_per_node)[0]
        return not (across and m.ndim >= 2)

    return min(fits, key=second_choice) if fits else None


@dataclass
class PreparedDepth:
    """One pipeline depth before any of its ILPs (:func:`prepare_depths`): the mesh its
    stages split (None: none does), its micro-batch's graph and layers, the split
    torchtitan makes (None: every split searched), the stage costs
    (:func:`~autoshard.pipeline.pricing.price_pipeline`) or why they could not be
    priced (``error``), and the seconds it took."""

    mesh: MeshSpec | None
    graph: Any = None
    layers: Any = None
    split: Any = None
    costs: PipelineCosts | None = None
    error: str | None = None
    seconds: float = 0.0


def _staged(config: SolveConfig) -> SolveConfig:
    """The configuration a stage is planned in: untied (each stage cuts its own layers),
    without activation checkpointing (a stage's budget holds its micro-batches'
    activations, as ``autoshard stages`` prices it) and without context parallelism (a
    stage runs as DTensor places it, and DTensor's attention rule splits no sequence)."""
    return replace(config, tie=False, activation_checkpointing="none", context_parallel=False)


def _check_depths(depths: Sequence[int]) -> None:
    """Raises :class:`AutoshardError` for a depth below 2."""
    if any(pp < 2 for pp in depths):
        raise AutoshardError(f"--pp (depths) {list(depths)}: each pipeline depth must be >= 2")


def prepare_depths(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    depths: Sequence[int],
    microbatches: int,
    gpus_per_node: int | None = None,
    progress: Progress | None = None,
) -> dict[int, PreparedDepth]:
    """Each depth of ``depths``'s traced micro-batch and stage costs, what
    :func:`pipeline_rows` starts from, before it knows the step to beat: the mesh search
    prices them while its ILPs and neighbourhoods run
    (:func:`~autoshard.solver.meshes.search_meshes`'s ``beside``).

    Raises:
        AutoshardError: a depth below 2, a model that cannot be traced, or a batch the
            micro-batches do not divide.
    """
    _check_depths(depths)
    staged = _staged(config)
    placed = {pp: pipeline_mesh(meshes, pp, gpus_per_node) for pp in depths}
    traces = _StagedTraces(staged, [pp for pp, m in placed.items() if m], microbatches, config.tie)
    prepared = {}
    for k, pp in enumerate(depths):
        mesh = placed[pp]
        if progress:
            progress("stage costs of the pipeline depths", k, len(depths))
        if mesh is None:
            prepared[pp] = PreparedDepth(None)
            continue
        t = time.perf_counter()
        graph, layers, split = traces.of(pp)  # a model that cannot be traced: raised
        done = PreparedDepth(mesh, graph, layers, split)
        try:
            done.costs = price_pipeline(replace(staged, mesh=mesh), graph, layers, pp, microbatches)
        except AutoshardError as exc:  # this depth has no plan: its row says why
            done.error = str(exc)
        done.seconds = time.perf_counter() - t
        prepared[pp] = done
    if progress:
        progress("stage costs of the pipeline depths", len(depths), len(depths))
    return prepared


def search_shapes_and_depths(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    depths: Sequence[int] = (),
    microbatches: int = 8,
    gpus_per_node: int | None = None,
    progress: Progress | None = None,
    space: str = "free",
) -> MeshSearch:
    """``solve --gpus``: the mesh shapes searched
    (:func:`~autoshard.solver.meshes.search_meshes`), then each pipeline depth of
    ``depths`` planned or skipped against the fastest of them (:func:`pipeline_rows`),
    all ranked together. The depths' traces and stage costs are priced while the search's
    ILPs and neighbourhoods run (:func:`prepare_depths`).

    Raises:
        AutoshardError: as :func:`~autoshard.solver.meshes.search_meshes` and
            :func:`pipeline_rows`.
    """
    if depths:
        refuse_pipeline_accumulation(config)  # before any search
    prepared: dict[int, PreparedDepth] = {}

    def beside() -> None:
        prepared.update(
            prepare_depths(config, meshes, depths, microbatches, gpus_per_node, progress)
        )

    search = search_meshes(
        config, meshes, progress, gpus_per_node, space, beside if depths else None
    )
    if not depths:
        return search
    best = search.fastest.step_time_s  # a depth that cannot beat it is skipped
    rows = pipeline_rows(
        config, meshes, depths, microbatches, gpus_per_node, progress, beat=best, prepared=prepared
    )
    return search.with_rows(rows)


def pipeline_rows(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    depths: Sequence[int],
    microbatches: int,
    gpus_per_node: int | None = None,
    progress: Progress | None = None,
    beat: float | None = None,
    prepared: dict[int, PreparedDepth] | None = None,
) -> list[MeshRow]:
    """One row per depth in ``depths`` (module docstring): its stage plan, or why it has
    none (no mesh splits into that many stages, more stages than layers, no split within
    the memory budget). The depths share the traces of one micro-batch (the batch split
    into ``microbatches``; :class:`_StagedTraces`: a deep model's layers split as
    torchtitan splits them, reduced between the splits' boundaries; the first depth's
    ``seconds`` count them), without activation checkpointing (a stage's budget holds its
    micro-batches' activations, as ``autoshard stages`` prices it) and without context
    parallelism (a stage runs as DTensor places it, and DTensor's attention rule splits
    no sequence).

    ``beat``: the step (s) of the fastest plan already found (the mesh shapes'). A depth
    whose stages' LP relaxations (:meth:`~autoshard.pipeline.stage_ilp.StagePricer.bound`)
    already give a 1F1B step at or above it cannot win: its stage ILPs are not solved, and
    its row holds that bound (``bound_s``) and says why. ``prepared``: the depths' traces
    and stage costs already priced (:func:`prepare_depths`, with the same arguments);
    a depth it lacks is priced here.

    Raises:
        AutoshardError: a depth below 2, or a batch the micro-batches do not divide.
    """
    _check_depths(depths)
    missing = [pp for pp in depths if pp not in (prepared or {})]
    if missing:
        more = prepare_depths(config, meshes, missing, microbatches, gpus_per_node, progress)
        prepared = {**(prepared or {}), **more}
    staged = _staged(config)
    rows = []
    for k, pp in enumerate(depths):
        ready = prepared[pp]
        mesh = ready.mesh
        if mesh is None:
            text = f"no mesh shape's leading dims split into {pp} stages"
            rows.append(MeshRow(meshes[0], error=text, pp=pp))
            continue
        if ready.error is not None:
            rows.append(MeshRow(mesh, error=ready.error, pp=pp))
            continue
        where = f"pp={pp} on {'x'.join(map(str, mesh.shape))}"
        if progress:
            progress(f"pipeline {where}", k, len(depths))
        t = time.perf_counter()
        graph, layers, split, costs = ready.graph, ready.layers, ready.split, ready.costs
        try:
            if beat is not None and split is not None:

                def bound_progress(done: int, total: int, where: str = where) -> None:
                    progress(f"LP bounds of {where}", done, total)

                bound_s = _step_bound(
                    costs, split, microbatches, beat, bound_progress if progress else None
                )
                if bound_s is not None and bound_s >= beat * (1 + _TIE_RTOL):
                    why = (
                        f"skipped: its stages' LP relaxations give a step of at least "
                        f"{format_seconds(bound_s)}, not under the best plan's "
                        f"{format_seconds(beat)}"
                    )
                    rows.append(MeshRow(mesh, error=why, pp=pp, bound_s=bound_s))
                    continue

            def stage_progress(done: int, total: int, where: str = where) -> None:
                progress(f"stages of {where}", done, total)

            done = plan_pipeline(
                replace(staged, mesh=mesh),
                graph,
                layers,
                pp,
                microbatches,
                progress=stage_progress if progress else None,
                split=split,
                costs=costs,
            )
        except AutoshardError as exc:  # this depth has no plan: its row says why
            rows.append(MeshRow(mesh, error=str(exc), pp=pp))
            continue
        step = done.stage_plan.step_time_s
        if beat is not None:  # a faster depth raises the bar for the depths after it
            beat = min(beat, step)
        flops = graph.step_flops * microbatches  # the graph is one micro-batch's
        peak = config.device.peak(staged.compute_dtype(graph))
        mfu = flops / (step * mesh.num_devices * peak) if step > 0 and peak > 0 else 0.0
        seconds = ready.seconds + time.perf_counter() - t  # its costs priced before
        plan = PipelinePlan(done, graph, layers)
        note = None
        if split is not None:
            balance = ", ".join(str(b - a) for a, b in itertools.pairwise(split))
            note = (
                f"its {layers.num_layers} layers split as torchtitan splits them ({balance}); "
                f"autoshard stages --pp {pp} searches every split"
            )
        rows.append(MeshRow(mesh, pp=pp, stages=plan, seconds=seconds, pipeline_mfu=mfu, note=note))
    if progress:
        progress("pipeline", len(depths), len(depths))
    return rows


_TIE_RTOL = 1e-9
"""A bound skips a depth only above the best step by this much: an integral LP's bound
can exceed its own plan's evaluated price by a rounding ulp."""


def _step_bound(
    costs: PipelineCosts,
    split: Sequence[int],
    microbatches: int,
    beat: float,
    progress: Callable[[int, int], None] | None = None,
) -> float | None:
    """A lower bound on the 1F1B step of ``split`` (s): each stage's LP bound in place of
    its time (the step grows with every stage's time, so it is one), stage by stage until
    it reaches ``beat`` (a stage not yet bounded, or whose LP stopped at its limits, counts
    0). ``None`` when a stage has no plan within the memory budget (an infeasible LP): the
    depth cannot run, and its stage ILPs say why. ``progress(done, total)`` before each
    stage's LP and at the end."""
    stages = list(itertools.pairwise(split))
    lows: list[float] = []
    for i, j in stages:
        if progress:
            progress(len(lows), len(stages))
        low = costs.pricer.bound(i, j)
        if low is not None and not math.isfinite(low):
            return None
        lows.append(0.0 if low is None else low)
        if pipeline_step_time(lows, microbatches) >= beat:
            break
    if progress:
        progress(len(stages), len(stages))
    return pipeline_step_time(lows, microbatches)


class _StagedTraces:
    """One micro-batch's graph for the depths asked, traced once for all of them.

    A depth whose torchtitan split (:func:`~autoshard.pipeline.stages.even_split`) leaves
    no stage empty and has a stage of more than 4 blocks prices that split alone; the
    others search every split, as ``autoshard stages`` does (a model with few blocks). The
    first trace (``reduce``, the user's ``--no-tie`` not given) is reduced within each
    segment between the boundaries of those depths' splits: each segment traced as its
    first two blocks, one middle block standing for the rest, and its last, as a solve
    traces the whole model. An 80-layer model traces 17 blocks for pp 2 and 4 (cut at 0,
    20, 40, 41, 61, 80) instead of 80. A depth that searches every split needs every
    block: the first trace when nothing was reduced, else a second one.
    """

    def __init__(
        self, config: SolveConfig, depths: Sequence[int], microbatches: int, reduce: bool
    ) -> None:
        self.config, self.depths, self.microbatches = config, list(depths), microbatches
        self.reduce = reduce
        self._held: dict[str, tuple[Any, LayerMap]] = {}

    @staticmethod
    def split(num_layers: int, pp: int) -> list[int] | None:
        """Depth ``pp``'s one split to price, or None to search every split."""
        if not even_split_fits(num_layers, pp):
            return None
        cuts = even_split(num_layers, pp)
        return cuts if max(b - a for a, b in itertools.pairwise(cuts)) > 4 else None

    def _trace(self, kind: str, bounds) -> tuple[Any, LayerMap]:  # noqa: ANN001
        if kind not in self._held:
            graph = trace(self.config, microbatches=self.microbatches, stage_bounds=bounds)
            self._held[kind] = (graph, layer_map(graph))
        return self._held[kind]

    def of(self, pp: int) -> tuple[Any, LayerMap, list[int] | None]:
        """Depth ``pp``'s graph, its layers, and the one split to price (None: search
        every split).

        Raises:
            AutoshardError: the model cannot be traced.
        """

        def union(n: int) -> list[int] | None:
            if not self.reduce:
                return None
            cuts = {c for d in self.depths for c in (self.split(n, d) or ())}
            return sorted(cuts) or None

        graph, layers = self._trace("first", union)
        split = self.split(layers.num_layers, pp)
        if split is not None or graph.depth is None:  # a split alone, or every block
            return graph, layers, split
        return (*self._trace("every block", lambda n: None), None)
