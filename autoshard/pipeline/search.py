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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autoshard.cost.mesh import MeshSpec, inside_node
from autoshard.errors import AutoshardError
from autoshard.pipeline.pricing import StagesResult, layer_map, plan_pipeline, stage_plan_dict
from autoshard.pipeline.stage_plan import save_stage_plan
from autoshard.pipeline.stages import pipeline_degrees
from autoshard.solver.meshes import MeshRow
from autoshard.solver.solve import SolveConfig, trace

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


def pipeline_rows(
    config: SolveConfig,
    meshes: Sequence[MeshSpec],
    depths: Sequence[int],
    microbatches: int,
    gpus_per_node: int | None = None,
    progress: Progress | None = None,
) -> list[MeshRow]:
    """One row per depth in ``depths`` (module docstring): its stage plan, or why it has
    none (no mesh splits into that many stages, more stages than layers, no split within
    the memory budget). The stages are traced once for all depths (every layer its own,
    the batch split into ``microbatches``), without activation checkpointing (a stage's
    budget holds its micro-batches' activations, as ``autoshard stages`` prices it) and
    without context parallelism (a stage runs as DTensor places it, and DTensor's
    attention rule splits no sequence).

    Raises:
        AutoshardError: a depth below 2, or a batch the micro-batches do not divide.
    """
    if any(pp < 2 for pp in depths):
        raise AutoshardError(f"--pp (depths) {list(depths)}: each pipeline depth must be >= 2")
    # a stage runs under DTensor's own placement (--mode propagate), whose attention rule
    # has no sequence split: context parallelism is not offered to the stages' ILPs
    staged = replace(config, tie=False, activation_checkpointing="none", context_parallel=False)
    t = time.perf_counter()
    graph = trace(staged, microbatches=microbatches)
    layers = layer_map(graph)
    trace_s = time.perf_counter() - t
    rows = []
    for k, pp in enumerate(depths):
        mesh = pipeline_mesh(meshes, pp, gpus_per_node)
        if mesh is None:
            text = f"no mesh shape's leading dims split into {pp} stages"
            rows.append(MeshRow(meshes[0], error=text, pp=pp))
            continue
        if progress:
            progress(f"pipeline pp={pp} on {'x'.join(map(str, mesh.shape))}", k, len(depths))
        t = time.perf_counter()
        try:
            where = f"stages of pp={pp} on {'x'.join(map(str, mesh.shape))}"

            def stage_progress(done: int, total: int, where: str = where) -> None:
                progress(where, done, total)

            done = plan_pipeline(
                replace(staged, mesh=mesh),
                graph,
                layers,
                pp,
                microbatches,
                progress=stage_progress if progress else None,
            )
        except AutoshardError as exc:  # this depth has no plan: its row says why
            rows.append(MeshRow(mesh, error=str(exc), pp=pp))
            continue
        step = done.stage_plan.step_time_s
        flops = graph.step_flops * microbatches  # the graph is one micro-batch's
        peak = config.device.peak(staged.compute_dtype(graph))
        mfu = flops / (step * mesh.num_devices * peak) if step > 0 and peak > 0 else 0.0
        seconds = trace_s / len(depths) + time.perf_counter() - t
        plan = PipelinePlan(done, graph, layers)
        rows.append(MeshRow(mesh, pp=pp, stages=plan, seconds=seconds, pipeline_mfu=mfu))
    if progress:
        progress("pipeline", len(depths), len(depths))
    return rows
