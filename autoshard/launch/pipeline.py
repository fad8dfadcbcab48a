"""Run a pipeline stage plan (``autoshard stages``) under torchrun with
``torch.distributed.pipelining``.

``autoshard launch PLAN.stages.json MODEL.py`` and ``torchrun ... -m autoshard.launch`` read
the plan's ``"format"`` and hand a stage plan (:data:`STAGE_PLAN_FORMAT`) to this module;
sharding maps stay with :mod:`autoshard.launch`. Each rank:

1. reads the plan (:func:`load_stage_plan`) and checks that torchrun started one process
   per device of the plan's mesh (:func:`check_world_size`) and that the stages lie on
   the mesh as ``autoshard stages`` puts them (:func:`check_supported`);
2. materialises the model as :mod:`autoshard.launch` does (same seeded weights and inputs
   on every rank, :mod:`autoshard.model.materialize`);
3. splits the global batch into the plan's micro-batches (:func:`split_microbatches`),
   traces the model with ``torch.distributed.pipelining.pipeline`` (``torch.export``) on
   one micro-batch, split before each stage's first module (``SplitPoint.BEGINNING`` at
   the plan's ``split_points``), and builds its own stage (``Pipe.build_stage``);
4. when a stage holds several devices (pp x intra-stage sharding, torchtitan's way of
   combining PP with TP): every rank builds one ``DeviceMesh`` of shape
   ``(pp, *inner)`` (:func:`stage_mesh_layout`; ``inner`` = the stage submesh's dims of
   size > 1); the stage talks to its neighbours over the ``"pp"`` dim (each rank with
   the ranks of the same intra-stage coordinate), holds its parameters as DTensors on
   the intra-stage dims per the stage's ``parameters`` map
   (:func:`autoshard.launch.steps.distribute_parameters`), and sends and receives plain,
   full tensors (:func:`run_on_mesh`: inputs become ``Replicate`` DTensors, DTensor outputs
   ``full_tensor()``);
5. runs ``--steps`` steps of :func:`schedule_class`'s schedule: forward only, or with
   ``--train`` loss = sum of the output (:func:`autoshard.launch.steps.loss_of`) per
   micro-batch, gradients not scaled (the micro-batch losses add up to the full-batch
   loss), DTensor gradients given their parameter's placements
   (:func:`autoshard.launch.steps.sync_gradients`), gradients of parameters that several stages
   hold summed across them (:func:`sum_shared_gradients`; the tracer gives each stage its
   own copy), AdamW.

``--check``: every rank runs the whole model on its device with the same seed and inputs
and compares what it owns (the last stage its output; each stage its parameters' step-1
gradients and values after step 1, as full tensors) with
:func:`autoshard.launch.check.compare_runs`; rank 0 prints the merged result, and beyond
tolerance every rank exits 1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor.experimental import implicit_replication

from autoshard._torch_private import flatten_mesh_groups, tree_map_only
from autoshard.errors import AutoshardError
from autoshard.launch.check import (
    CheckResult,
    Recorder,
    compare_runs,
    full_tensor,
    relative_error,
    report_check,
    report_time,
    say,
    widen_module,
    widened,
)
from autoshard.launch.dtensor_rules import (
    embedding_reduced_once,
    register_launch_rules,
    view_with_contiguous_local,
)
from autoshard.launch.graph_run import plant_gradient_fault
from autoshard.launch.options import RunOptions
from autoshard.launch.steps import (
    adamw,
    distribute_parameters,
    loss_of,
    output_tensor,
    run_steps,
    sync_device,
    sync_gradients,
)
from autoshard.launch.validate import check_placements, listing
from autoshard.model.materialize import build_skeleton, init_parameters, make_inputs, materialize
from autoshard.model.model_file import (
    LoadedModel,
    ModelFile,
    instantiate,
    load_model_file,
    split_microbatches,
)
from autoshard.pipeline.stage_plan import StagePlanFile, StageSpec, load_stage_plan
from autoshard.placements import placements_from_str, short
from autoshard.trace.tracer import kv_cache_off
from autoshard.units import format_bytes

__all__ = [
    "StageMeshLayout",
    "canonical_names",
    "check_stage_plan",
    "check_supported",
    "check_world_size",
    "pipeline_loss",
    "prepare_launch",
    "run_on_mesh",
    "run_rank",
    "schedule_class",
    "shared_parameters",
    "split_microbatches",
    "stage_mesh_layout",
    "stage_placements",
    "sum_shared_gradients",
]


# ------------------------------------------------------------------------------- plan


def check_world_size(plan: StagePlanFile, world_size: int) -> None:
    """One process per device of the plan's mesh.

    Raises:
        AutoshardError: ``world_size`` differs; names both and the torchrun option.
    """
    need = plan.world_size
    if world_size != need:
        raise AutoshardError(
            f"the stage plan's mesh {plan.mesh_text} needs {need} processes but torchrun "
            f"started {world_size}; pass --nproc-per-node {need}, or plan stages for a mesh "
            f"of {world_size} devices"
        )


@dataclass(frozen=True)
class StageMeshLayout:
    """The device mesh every rank builds for a stage plan: shape ``(pp, *inner)``.

    Stage s owns the s-th block of ``k = prod(submesh)`` ranks in row-major order
    (:func:`autoshard.pipeline.stages.stage_ranks`), so ``ranks[s]`` is stage s's submesh with its
    size-1 dims dropped, and the ranks along dim 0 (``"pp"``) are those with one
    intra-stage coordinate: the peers a stage sends to and receives from.

    Attributes:
        shape: ``(pp, *inner)``; ``inner`` are the submesh's sizes > 1.
        dim_names: ``"pp"`` then the plan's names of the inner dims.
        inner_dims: the plan mesh dims of ``inner`` (indices into a placement list).
        ranks: the global ranks, nested lists of ``shape``.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    inner_dims: tuple[int, ...]
    ranks: list[Any]

    @property
    def devices_per_stage(self) -> int:
        """``prod(inner)``: 1 for a pipeline-only plan."""
        return math.prod(self.shape[1:])

    @property
    def pp_dim(self) -> str:
        """Name of the pipeline dim (dim 0)."""
        return self.dim_names[0]

    @property
    def inner_names(self) -> tuple[str, ...]:
        """Names of the intra-stage dims."""
        return self.dim_names[1:]


def stage_mesh_layout(plan: StagePlanFile) -> StageMeshLayout:
    """Where the plan's stages lie on a ``(pp, *inner)`` mesh (see :class:`StageMeshLayout`).

    Raises:
        AutoshardError: the stages have different submeshes, or a stage's ranks are not
            the contiguous row-major block ``s*k .. s*k+k-1`` that ``autoshard stages``
            gives it.
    """
    first = plan.stages[0].submesh
    if len(first) != len(plan.mesh_shape):
        raise AutoshardError(
            f"{plan.source}: stage 0's submesh {list(first)} has {len(first)} dim(s) but the "
            f"mesh {plan.mesh_text} has {len(plan.mesh_shape)}; write the plan again with "
            "`autoshard stages`"
        )
    k = math.prod(first)
    for s in plan.stages:
        if s.submesh != first:
            raise AutoshardError(
                f"{plan.source}: stage {s.index} has submesh {list(s.submesh)} but stage 0 has "
                f"{list(first)}; the launch needs one submesh shape for every stage"
            )
        want = tuple(range(s.index * k, (s.index + 1) * k))
        if s.ranks != want:
            raise AutoshardError(
                f"{plan.source}: stage {s.index} has ranks {list(s.ranks)}, not the row-major "
                f"block {list(want)} of its submesh; write the plan again with `autoshard stages`"
            )
    inner_dims = tuple(d for d, n in enumerate(first) if n > 1)
    names = [
        plan.dim_names[d] if d < len(plan.dim_names) and plan.dim_names[d] else f"d{d}"
        for d in inner_dims
    ]
    pp_name = "pp" if "pp" not in names else "pp_stages"
    shape = (plan.pp, *(first[d] for d in inner_dims))
    ranks = torch.arange(plan.world_size).reshape(shape).tolist()
    return StageMeshLayout(shape, (pp_name, *names), inner_dims, ranks)


def stage_placements(
    stage: StageSpec, inner_dims: Sequence[int]
) -> dict[str, tuple[Placement, ...]]:
    """The stage's ``parameters`` map as DTensor placements on its intra-stage dims
    (``inner_dims``, see :class:`StageMeshLayout`); size-1 dims are dropped, as a
    placement on them changes nothing.

    Raises:
        AutoshardError: a placement that does not parse; a placement list whose length is
            not the mesh's dims; ``Partial`` on a parameter (a parameter holds values, not
            pending sums).
    """
    ndim = len(stage.submesh)
    out: dict[str, tuple[Placement, ...]] = {}
    for name, texts in stage.parameters.items():
        if len(texts) != ndim:
            raise AutoshardError(
                f"stage {stage.index}: parameter {name} has {len(texts)} placement(s) "
                f"({list(texts)}) but the mesh has {ndim} dim(s)"
            )
        placements = tuple(placements_from_str(texts))
        kept = tuple(placements[d] for d in inner_dims)
        if any(p.is_partial() for p in kept):
            raise AutoshardError(
                f"stage {stage.index}: parameter {name} is placed {list(texts)}; Partial "
                "is not a placement a parameter can be launched with"
            )
        out[name] = kept
    return out


def check_supported(plan: StagePlanFile) -> None:
    """The plan can be launched: the stages lie on the mesh as ``autoshard stages`` puts
    them (:func:`stage_mesh_layout`) and their placements parse (:func:`stage_placements`).

    Raises:
        AutoshardError: as those two.
    """
    layout = stage_mesh_layout(plan)
    for s in plan.stages:
        stage_placements(s, layout.inner_dims)


def prepare_launch(plan: Path, model: Path) -> int:
    """What ``autoshard launch`` checks before it starts torchrun: the plan reads, its
    stages lie on the mesh as planned, the plan fits the model (on the meta device).
    Returns the number of processes to start (the mesh's devices).

    Raises:
        AutoshardError: as :func:`load_stage_plan`, :func:`check_supported` and
            :func:`check_stage_plan`, or from the model file.
    """
    spec = load_stage_plan(plan)
    check_supported(spec)
    mf = load_model_file(model)
    check_stage_plan(spec, instantiate(mf, device="meta"), mf.path.name)
    return spec.world_size


def check_stage_plan(plan: StagePlanFile, loaded: LoadedModel, model_name: str) -> None:
    """The plan must fit the model: its split points are submodules, its parameters are
    the model's (``named_parameters(remove_duplicate=False)`` names), sharded only along
    dims they have; every name of one tensor (tied weights, in one stage or in several)
    is placed alike on the intra-stage dims, as the copies' gradients are summed shard
    by shard.

    Raises:
        AutoshardError: a split point that is no submodule; plan parameters the model
            lacks (listed); a shard dim the parameter lacks; a tied parameter placed
            differently under two names or in two stages.
    """
    modules = dict(loaded.module.named_modules())
    for fqn in plan.split_points:
        if fqn not in modules or fqn == "":
            raise AutoshardError(
                f"the stage plan splits at {fqn}, which {model_name} has no submodule named; "
                "plan the stages again for this model"
            )
    names = {n for n, _ in loaded.module.named_parameters(remove_duplicate=False)}
    unknown = sorted({n for s in plan.stages for n in s.parameters} - names)
    if unknown:
        raise AutoshardError(
            f"the stage plan names {len(unknown)} parameter(s) that {model_name} lacks: "
            f"{listing(unknown)}; plan the stages again for this model"
        )
    layout = stage_mesh_layout(plan)
    shapes = {n: p.shape for n, p in loaded.module.named_parameters(remove_duplicate=False)}
    canonical = canonical_names(loaded.module)
    seen: dict[str, tuple[str, int, tuple[Placement, ...]]] = {}
    for s in plan.stages:
        for name, placements in sorted(stage_placements(s, layout.inner_dims).items()):
            check_placements("parameter", name, placements, shapes[name], len(placements))
            key = canonical.get(name, name)
            other = seen.setdefault(key, (name, s.index, placements))
            if other[2] != placements:
                raise AutoshardError(
                    f"tied parameter {name} (stage {s.index}) is placed {short(placements)} "
                    f"but {other[0]} (stage {other[1]}) {short(other[2])} on the intra-stage "
                    "dims; launching a tied weight sharded differently in two places is not "
                    "supported: give all its names the same placements"
                )


# ---------------------------------------------------------------------- micro-batches


def schedule_class(pp: int, microbatches: int) -> type:
    """``Schedule1F1B`` when ``microbatches >= pp`` (it needs that), else ``ScheduleGPipe``."""
    return Schedule1F1B if microbatches >= pp else ScheduleGPipe


def pipeline_loss(output: object, target: object = None) -> torch.Tensor:
    """The schedules' ``loss_fn``: :func:`autoshard.launch.steps.loss_of` of one micro-batch's
    output (``target`` is ignored). A sum, so the micro-batch losses add up to the
    full-batch loss when gradients are not scaled (``scale_grads=False``)."""
    return loss_of(output)


# -------------------------------------------------------------- parameters and grads


def canonical_names(module: nn.Module) -> dict[str, str]:
    """Every parameter name (``remove_duplicate=False``) -> the first name of its tensor
    (the one ``named_parameters()`` gives), so tied aliases map to one name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def shared_parameters(
    stage_modules: Sequence[nn.Module], canonical: Mapping[str, str]
) -> dict[str, tuple[int, ...]]:
    """Parameters held by more than one stage: canonical name -> the stages, sorted.

    ``torch.distributed.pipelining`` gives each stage that reads a parameter its own copy
    (tied embeddings: the first stage's input embedding and the last stage's head), so
    their gradients must be summed across those stages before the optimizer step.
    """
    holders: dict[str, set[int]] = defaultdict(set)
    for i, mod in enumerate(stage_modules):
        for name, _ in mod.named_parameters(remove_duplicate=False):
            holders[canonical.get(name, name)].add(i)
    return {c: tuple(sorted(s)) for c, s in sorted(holders.items()) if len(s) > 1}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default)


def _prepare_stage_graphs(module: nn.Module) -> None:
    """Make every graph in ``module`` runnable on DTensors: remove the
    ``aten._assert_tensor_metadata`` calls ``torch.export`` puts at each ``Tensor.to``
    (DTensor has no sharding rule for that check, and it returns nothing), and run views
    and reshapes through
    :func:`~autoshard.launch.dtensor_rules.view_with_contiguous_local`, embeddings through
    :func:`~autoshard.launch.dtensor_rules.embedding_reduced_once`."""
    assert_metadata = torch.ops.aten._assert_tensor_metadata.default
    for mod in module.modules():
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        calls = [n for n in graph.nodes if n.op == "call_function"]
        changed = False
        for node in calls:
            if node.target is assert_metadata:
                graph.erase_node(node)
            elif node.target in _VIEWS:
                node.target = view_with_contiguous_local(node.target)
            elif node.target is torch.ops.aten.embedding.default:
                node.target = embedding_reduced_once(node.target)
            else:
                continue
            changed = True
        if changed:
            for gm in (mod, mod.__dict__.get("graph_module")):  # unflatten's InterpreterModule
                if isinstance(gm, torch.fx.GraphModule):
                    gm.recompile()


def run_on_mesh(module: nn.Module, mesh: DeviceMesh) -> None:
    """Make ``module`` (a stage holding DTensor parameters) take and give plain tensors.

    Its forward is wrapped, in place: every input tensor becomes a ``Replicate`` DTensor
    on ``mesh`` (``DTensor.from_local``, no communication: each rank of the stage receives
    the same full tensor), and every DTensor output becomes its full tensor
    (``full_tensor()``: an all-gather of a shard, an all-reduce of a ``Partial``), which
    is what the pipeline sends. Both conversions are differentiable: the gradient that
    comes back for an output is split to the output's placement, and an input's gradient
    is reduced to ``Replicate`` before it is sent back. Run the forward and the backward
    pass under ``implicit_replication()`` (not re-entrant: enter it once, around the
    schedule's step), so that plain tensors made inside (position ids, masks) meet
    DTensors as replicated. The graph is made runnable on DTensors
    (:func:`_prepare_stage_graphs`).
    """
    _prepare_stage_graphs(module)
    forward = module.forward
    replicate = [Replicate()] * mesh.ndim

    def to_dtensor(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t
        return DTensor.from_local(t, mesh, replicate, run_check=False)

    def forward_on_mesh(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = tree_map_only(torch.Tensor, to_dtensor, (args, kwargs))
        out = forward(*args, **kwargs)
        return tree_map_only(DTensor, lambda t: t.full_tensor(), out)

    module.forward = forward_on_mesh  # type: ignore[method-assign]


def _by_canonical(module: nn.Module, canonical: Mapping[str, str]) -> dict[str, list[nn.Parameter]]:
    """The stage module's distinct parameters grouped by canonical name."""
    out: dict[str, list[nn.Parameter]] = defaultdict(list)
    for name, p in module.named_parameters():
        out[canonical.get(name, name)].append(p)
    return out


def sum_shared_gradients(
    module: nn.Module,
    canonical: Mapping[str, str],
    groups: Mapping[str, dist.ProcessGroup | None],
) -> None:
    """Give every copy of a parameter the sum of all copies' gradients, in place.

    Copies in this stage module (a tied weight the tracer split into two tensors) are
    summed locally; ``groups`` maps each parameter held by several stages to the process
    group where the sum is all-reduced: those stages' ranks, or with intra-stage sharding
    those of them with this rank's intra-stage coordinate, as every stage holds the
    parameter with the same placements (:func:`check_stage_plan`) and so the same shard
    on those ranks; DTensor gradients must have their parameter's placements
    (:func:`autoshard.launch.steps.sync_gradients`). Every rank must call this with the same
    ``groups`` keys, in the same order (sorted names). A missing gradient counts as zero.
    """
    mine = _by_canonical(module, canonical)
    for name in sorted(set(mine) | set(groups)):
        copies = mine.get(name, [])
        if not copies or (len(copies) == 1 and name not in groups):
            continue
        grads = [p.grad for p in copies if p.grad is not None]
        total = torch.zeros_like(copies[0]) if not grads else sum(grads[1:], grads[0].clone())
        if name in groups:
            if isinstance(total, DTensor):
                local = total.to_local().clone()
                dist.all_reduce(local, group=groups[name])
                total = DTensor.from_local(
                    local,
                    total.device_mesh,
                    total.placements,
                    run_check=False,
                    shape=total.shape,
                    stride=total.stride(),
                )
            else:
                dist.all_reduce(total, group=groups[name])
        for p in copies:
            p.grad = total.clone()


# ------------------------------------------------------------------------------ steps


@dataclass
class _StageRun:
    """What one rank's stage did: the last stage's outputs, step times, step-1 records."""

    output: torch.Tensor | None = None
    step_times_s: list[float] = field(default_factory=list)
    out1: torch.Tensor | None = None
    grads1: dict[str, torch.Tensor] = field(default_factory=dict)
    params1: dict[str, torch.Tensor] = field(default_factory=dict)


def _named_copies(module: nn.Module, canonical: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """One tensor per canonical name (copies are equal after :func:`sum_shared_gradients`)."""
    return {name: ps[0] for name, ps in _by_canonical(module, canonical).items()}


def _run_schedule(
    stage: Any,
    spec: StagePlanFile,
    inputs: Sequence[torch.Tensor],
    opts: RunOptions,
    device: torch.device,
    canonical: Mapping[str, str],
    groups: Mapping[str, dist.ProcessGroup | None],
    record: bool,
) -> _StageRun:
    """``opts.steps`` steps of the pipeline schedule on this rank's stage."""
    module = stage.submod
    loss_fn = pipeline_loss if opts.train else None
    schedule = schedule_class(spec.pp, spec.microbatches)(
        stage, n_microbatches=spec.microbatches, loss_fn=loss_fn, scale_grads=False
    )
    optimizer = adamw(module, opts.lr, opts.optimizer) if opts.train else None
    args = tuple(inputs) if stage.is_first else ()
    # The schedules split a target for the loss even when the loss ignores it.
    target = torch.zeros(inputs[0].shape[0], device=device) if stage.is_last else None
    run = _StageRun()
    for step in range(opts.steps):
        sync_device(device)
        t0 = time.perf_counter()
        paused = 0.0
        if optimizer is None:
            with torch.no_grad(), implicit_replication():
                out = schedule.step(*args)
        else:
            losses: list[torch.Tensor] = []
            with implicit_replication():  # the backward of plain tensors met in forward
                out = schedule.step(*args, target=target, losses=losses)
            sync_gradients(module)
            sum_shared_gradients(module, canonical, groups)
            plant_gradient_fault(module)
            if record and step == 0:
                t1 = time.perf_counter()
                for name, p in _named_copies(module, canonical).items():
                    if p.grad is not None:  # full_tensor: every rank of the stage calls it
                        run.grads1[name] = full_tensor(p.grad.detach()).to("cpu", copy=True)
                paused = time.perf_counter() - t1
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync_device(device)
        run.step_times_s.append(time.perf_counter() - t0 - paused)
        if stage.is_last:
            # training: the step's loss (the micro-batches' sum), as run_steps reports it
            loss = sum(losses) if optimizer is not None and losses else None
            run.output = (loss if loss is not None else output_tensor(out)).detach()
        if record and step == 0:
            if run.output is not None:
                run.out1 = run.output.to("cpu", copy=True)
            if optimizer is not None:
                run.params1 = {
                    n: full_tensor(p.detach()).to("cpu", copy=True)
                    for n, p in _named_copies(module, canonical).items()
                }
    return run


# -------------------------------------------------------------------------- check


def _merge_checks(parts: Sequence[tuple[bool, CheckResult]]) -> CheckResult:
    """One result from every rank's: the last stage's output difference, the worst
    difference per parameter (a shared parameter is compared on each of its stages)."""
    merged = CheckResult(output_diff=0.0)
    for is_last, res in parts:
        if is_last:
            merged.output_diff = max(merged.output_diff, res.output_diff)
        for mine, theirs in (
            (merged.grad_diff, res.grad_diff),
            (merged.param_diff, res.param_diff),
            (merged.drift, res.drift),
        ):
            for k, v in theirs.items():
                mine[k] = max(mine.get(k, 0.0), v)
    return merged


def _check(
    mf: ModelFile,
    opts: RunOptions,
    device: torch.device,
    stage: Any,
    canonical: Mapping[str, str],
    run: _StageRun,
) -> int:
    """Each rank compares its stage with a whole-model run on its device; rank 0 reports;
    every rank returns the verdict (0 pass, 1 fail)."""
    mine = {n: full_tensor(p.detach()) for n, p in _named_copies(stage.submod, canonical).items()}
    ref = materialize(mf, opts.seed, device).loaded
    ref.inputs = widen_module(ref.module, ref.inputs)
    ref_rec = Recorder(keep=True)
    with widened():
        ref_result = run_steps(
            ref.module, ref.inputs, opts, device, observer=ref_rec, loss_fn=pipeline_loss
        )
    assert ref_rec.output is not None
    keep = set(mine)
    res = compare_runs(
        run.out1 if run.out1 is not None else ref_rec.output,
        ref_rec.output,
        run.grads1,
        {n: g for n, g in ref_rec.grads.items() if n in keep},
        run.params1,
        {n: p for n, p in ref_rec.params.items() if n in keep},
        opts,
    )
    if opts.train and opts.steps > 1:
        ref_last = dict(ref.module.named_parameters())
        floor = opts.atol / opts.rtol
        if run.output is not None:
            res.drift["output"] = relative_error(run.output, ref_result.output, floor)
        res.drift["parameters"] = max(
            (relative_error(p, ref_last[n], floor) if n in ref_last else float("inf"))
            for n, p in mine.items()
        )
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (bool(stage.is_last), res))
    merged = _merge_checks(parts)
    if dist.get_rank() == 0:
        report_check(merged, opts)
    return 1 if merged.failures(opts) else 0


# ------------------------------------------------------------------------- rank entry


def run_rank(plan: Path, model: Path, opts: RunOptions) -> int:
    """The per-rank body of a stage-plan launch; call under torchrun. Returns the exit code.

    Raises:
        AutoshardError: not under torchrun; world size differs from the mesh; stages not
            where ``autoshard stages`` puts them; the plan does not fit the model; a batch
            the micro-batches do not divide. Every rank raises the same error.
    """
    spec = load_stage_plan(plan)
    if "WORLD_SIZE" not in os.environ:
        raise AutoshardError(
            "autoshard.launch runs on each rank under torchrun; use `autoshard launch "
            f"{plan} {model}` (or `torchrun --nproc-per-node {spec.world_size} -m "
            "autoshard.launch ...`)"
        )
    check_world_size(spec, int(os.environ["WORLD_SIZE"]))
    check_supported(spec)
    # the AdamW the stages were priced with, for the stages and --check's one device alike
    opts = dataclasses.replace(opts, optimizer=spec.optimizer)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return _run_in_group(spec, model, opts, device)
    finally:
        dist.destroy_process_group()


def _trace(module: nn.Module, microbatch: tuple[torch.Tensor, ...], split_points: list[str]) -> Any:
    """``pipeline()`` split before each split point; tracer failures become one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        try:
            with kv_cache_off(module):  # a step reads no KV cache (as the solve traced it)
                return pipeline(
                    module,
                    mb_args=microbatch,
                    split_spec={fqn: SplitPoint.BEGINNING for fqn in split_points},
                )
        except Exception as exc:  # noqa: BLE001 - torch.export's failures: report on one line
            cause = exc.__cause__ or exc
            msg = " ".join(str(cause).split())[:300]
            raise AutoshardError(
                f"torch.distributed.pipelining could not trace the model ({type(cause).__name__}"
                f": {msg}); the pipeline launch needs a model torch.export can capture whole"
            ) from exc


def _shared_groups(
    shared: Mapping[str, tuple[int, ...]], spec: StagePlanFile, layout: StageMeshLayout, rank: int
) -> dict[str, dist.ProcessGroup | None]:
    """For each parameter several stages hold, the process group that sums its gradient
    on this rank: the ranks of those stages with this rank's intra-stage coordinate
    (every rank of a stage holds a different shard of it). Every rank creates every group
    in the same order (``new_group`` is collective); ``None`` is the whole world."""
    k = layout.devices_per_stage
    coord = rank - spec.stage_of(rank).index * k
    groups: dict[str, dist.ProcessGroup | None] = {}
    made: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
    for name, stages in shared.items():  # sorted: every rank makes the same groups
        for j in range(k):
            ranks = tuple(s * k + j for s in stages)
            if ranks not in made:
                world = len(ranks) == spec.world_size
                made[ranks] = None if world else dist.new_group(list(ranks))
        groups[name] = made[tuple(s * k + coord for s in stages)]
    return groups


def _run_in_group(spec: StagePlanFile, model: Path, opts: RunOptions, device: torch.device) -> int:
    """:func:`run_rank` once the process group is up."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    mf = load_model_file(model)
    skeleton = build_skeleton(mf, opts.seed)
    check_stage_plan(spec, skeleton, mf.path.name)
    fallback = init_parameters(skeleton.module, opts.seed, device)
    inputs = make_inputs(skeleton, opts.seed, device)
    itemsize = {n: p.element_size() for n, p in skeleton.module.named_parameters()}
    if opts.check:  # both runs in float64 (see autoshard.launch.check.CheckResult)
        inputs = widen_module(skeleton.module, inputs)
    module = skeleton.module.eval()
    canonical = canonical_names(module)
    mbs = split_microbatches(inputs, spec.microbatches, skeleton.input_names)
    kind = schedule_class(spec.pp, spec.microbatches).__name__
    if rank == 0:
        names = f" ({', '.join(spec.dim_names)})" if spec.dim_names else ""
        say(
            f"autoshard launch: {mf.path.name}, stage plan pp={spec.pp} on mesh "
            f"{spec.mesh_text}{names}, {world} ranks, {device.type}, "
            f"{'train' if opts.train else 'forward'} x {opts.steps} step(s)"
            + (f" ({opts.optimizer})" if opts.train else "")
            + f", seed {opts.seed}"
        )
        if fallback:
            say(
                f"note: {len(fallback)} parameter(s) have no initialiser in the model "
                f"(fallback init used): {listing(fallback)}"
            )

    register_launch_rules()  # DTensor places a stage's activations (the model is built)
    pipe = _trace(module, mbs[0], spec.split_points)
    if pipe.num_stages != spec.pp:
        raise AutoshardError(
            f"the model traced into {pipe.num_stages} stage(s) at the split points "
            f"{spec.split_points}, not the plan's {spec.pp}; a split point is never called, "
            "or called more than once"
        )
    shared = shared_parameters(
        [pipe.get_stage_module(i) for i in range(pipe.num_stages)], canonical
    )
    layout = stage_mesh_layout(spec)
    me = spec.stage_of(rank)
    mesh: DeviceMesh | None = None
    pp_group: dist.ProcessGroup | None = None
    if layout.devices_per_stage > 1:  # every rank builds the same mesh (collective)
        mesh = DeviceMesh(device.type, torch.tensor(layout.ranks), mesh_dim_names=layout.dim_names)
        pp_group = mesh[layout.pp_dim].get_group()
    groups = _shared_groups(shared, spec, layout, rank)
    stage = pipe.build_stage(me.index, device, group=pp_group)
    del pipe
    if mesh is not None:
        inner = mesh[layout.inner_names]
        # like collectives over several stage dims run as one, as the stage plans price
        # the large ones (CommModel._merged); DTensor runs the stage's reshardings itself
        flatten_mesh_groups(inner)
        placements = stage_placements(me, layout.inner_dims)
        distribute_parameters(stage.submod, inner, placements, canonical)
        run_on_mesh(stage.submod, inner)
    local = {  # bytes as the model holds them (--check computes in float64)
        id(p): (p.to_local() if isinstance(p, DTensor) else p).numel()
        * itemsize.get(canonical.get(n, n), p.element_size())
        for n, p in stage.submod.named_parameters()
    }
    sizes: list[Any] = [None] * world
    dist.all_gather_object(sizes, (me.index, sum(local.values())))

    with widened(opts.check):
        run = _run_schedule(stage, spec, inputs, opts, device, canonical, groups, opts.check)
    times: list[Any] = [None] * world
    dist.all_gather_object(times, run.step_times_s)
    slowest = [max(t[i] for t in times) for i in range(opts.steps)]
    if rank == 0:
        parts = []
        for s in spec.stages:
            mods = s.module_paths
            span = f"{mods[0]} .. {mods[-1]}" if len(mods) > 1 else (mods[0] if mods else "-")
            held = max(b for i, b in sizes if i == s.index)
            ranks = ",".join(map(str, s.ranks))
            parts.append(f"  stage {s.index}: {span} on rank {ranks}, {format_bytes(held)}")
        say(f"stages ({len(spec.stages)}), modules, rank, parameter bytes per rank:")
        for line in parts:
            say(line)
        batch = inputs[0].shape[0]
        say(
            f"micro-batches: {spec.microbatches} of {batch // spec.microbatches} "
            f"(global batch {batch}), schedule {kind}"
        )
        if shared:
            say(
                "parameters held by several stages (gradients summed across them): "
                f"{listing(list(shared))}"
            )
        report_time(slowest, spec.step_time_s, step1="with warm-up")
    if not opts.check:
        return 0
    return _check(mf, opts, device, stage, canonical, run)
