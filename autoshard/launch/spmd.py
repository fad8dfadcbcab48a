"""Run a sharding map (``autoshard solve``'s JSON) on each rank: the SPMD launch.

Each rank checks the world size against the map's mesh, starts the process group (NCCL with
CUDA, else gloo), builds the device mesh, materialises the model with seeded weights,
distributes every parameter and input per the map and runs the steps
(:mod:`autoshard.launch.steps`); ``--check`` compares with a single-device run on rank 0.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import resource
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import AutoshardError
from autoshard.launch.check import (
    CHECK_DTYPES,
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
from autoshard.launch.dtensor_rules import register_launch_rules
from autoshard.launch.graph_run import GraphProgram
from autoshard.launch.observed import (
    lowered_report,
    observed_rows,
    prepare_program,
    report_observed,
)
from autoshard.launch.options import RunOptions
from autoshard.launch.plan_steps import PlanStepResult, run_plan_steps
from autoshard.launch.steps import (
    StepObserver,
    StepResult,
    distribute_inputs,
    placed_parameter,
    run_steps,
)
from autoshard.launch.validate import check_plan, check_world_size, listing
from autoshard.model.materialize import build_skeleton, init_parameters, make_inputs, materialize
from autoshard.model.model_file import LoadedModel, ModelFile, load_model_file
from autoshard.placements import whole_on_single
from autoshard.plan.atomic import atomic_write_text
from autoshard.plan.formats import ShardingMap, load_sharding_map
from autoshard.strategies.optimizer import OPTIMIZERS
from autoshard.trace.batchnorm import train_batch_norms
from autoshard.units import format_bytes


def run_rank(plan: Path, model: Path, opts: RunOptions) -> int:
    """The per-rank body of a launch; call under torchrun. Returns the exit code.

    Raises:
        AutoshardError: not under torchrun, world size differs from the mesh, the map does
            not match the model, or the model file is bad. Every rank raises the same
            error for these, before any collective.
    """
    smap = load_sharding_map(plan)
    if "WORLD_SIZE" not in os.environ:
        raise AutoshardError(
            "autoshard.launch runs on each rank under torchrun; use `autoshard launch "
            f"{plan} {model}` (or `torchrun --nproc-per-node {smap.world_size} -m "
            "autoshard.launch ...`)"
        )
    check_world_size(smap, int(os.environ["WORLD_SIZE"]))
    # the AdamW the plan priced (a map written before the option: the fused kernel)
    opts = dataclasses.replace(opts, optimizer=smap.predicted.get("optimizer", OPTIMIZERS[0]))
    if not os.environ.get("AUTOSHARD_VERBOSE"):
        # DTensor warns on every nested-sharding gather, which plans price and --check
        # counts; the rank output stays the report (autoshard -v shows it)
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        # gloo's all-to-all substitution: the report names it once ("note: gloo has no
        # all_to_all"), not once per rank
        logging.getLogger("torch.distributed.tensor._collective_utils").setLevel(logging.ERROR)

    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(device_type, torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        code = _run_in_group(smap, model, opts, device)
        # every rank done with its last exchange before any tears the group down: gloo can
        # abort a rank whose peer closed its sockets mid-exchange (seen once, SIGABRT
        # after a passing --check)
        dist.barrier()
        return code
    finally:
        dist.destroy_process_group()


def _run_in_group(smap: ShardingMap, model: Path, opts: RunOptions, device: torch.device) -> int:
    """:func:`run_rank` once the process group is up."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    mesh = init_device_mesh(
        device.type,
        tuple(smap.mesh_shape),
        mesh_dim_names=tuple(smap.dim_names) if smap.dim_names else None,
    )
    mf = load_model_file(model)
    program = None
    if opts.mode == "plan":
        program = prepare_program(smap, mf, opts, announce=rank == 0)
    else:
        register_launch_rules()  # DTensor places the activations
    skeleton = build_skeleton(mf, opts.seed)
    check_plan(smap, skeleton, mf.path.name)
    cast, weights, held = _dtype_policy(program, opts)
    # bytes per element as the model holds them (--check runs in float64)
    itemsize_by_name = {
        n: (torch.empty((), dtype=weights) if weights is not None else p).element_size()
        for n, p in skeleton.module.named_parameters()
    }
    placed = _whole_on_single(smap)
    fallback = _place_weights(skeleton.module, placed, mesh, opts, device, held)
    loaded = _loaded_model(skeleton, opts, device, cast)
    if rank == 0:
        _announce(smap, mf, world, device, opts, program, fallback)

    d_inputs = distribute_inputs(loaded, mesh, placed.inputs)
    local = sum(
        p.to_local().numel() * itemsize_by_name[n] for n, p in loaded.module.named_parameters()
    )
    per_rank: list[int] = [0] * world
    dist.all_gather_object(per_rank, local)

    setup_peak = peak_memory_bytes(device)  # imports, trace, weights: before any step
    recorder = Recorder(keep=rank == 0)
    observer = recorder if opts.check else None
    step_times, last, outcome = _run_mode(program, loaded, d_inputs, mesh, opts, device, observer)
    slowest, peaks, setup_peaks = _gather_timings(step_times, setup_peak, opts, device, world)
    agree = True
    report: dict[str, Any] = {}
    if rank == 0:
        agree, report = _report_run(
            smap, mf, opts, device, outcome, per_rank, slowest, peaks, setup_peaks
        )
    verdict = [0 if agree else 1]
    dist.broadcast_object_list(verdict, src=0)
    code = 0
    if opts.check:
        master = program is not None and program.reduce_dtype is not None
        code = max(
            verdict[0],
            _check(mf, opts, device, loaded.module, last, recorder, report, cast, master),
        )
    if rank == 0 and opts.json_path:
        write_report(opts.json_path, report)
    return code


def _whole_on_single(smap: ShardingMap) -> ShardingMap:
    """``smap`` as the run places its weights and inputs: ``Replicate`` on the mesh dims of
    one device, as the plan's graph runs them (:func:`autoshard.placements.whole_on_single`:
    the same local tensors)."""
    shape = smap.mesh_shape
    return replace(
        smap,
        parameters={k: whole_on_single(ps, shape) for k, ps in smap.parameters.items()},
        inputs={k: whole_on_single(ps, shape) for k, ps in smap.inputs.items()},
    )


def _dtype_policy(
    program: GraphProgram | None, opts: RunOptions
) -> tuple[torch.dtype | None, torch.dtype | None, torch.dtype | None]:
    """The launch's dtypes: ``cast`` (the solve's ``--dtype``, for the inputs), ``weights``
    (the dtype the model holds its weights in, ``None``: as built) and ``held`` (the
    weights as placed: float64 under ``--check``)."""
    # the solve's --dtype is a cast of the weights; mixed precision keeps fp32 master
    # parameters; --check computes in float64
    cast = program.dtype if program is not None else None
    weights = cast if cast is not None and program.reduce_dtype is None else None
    held = torch.float64 if opts.check else weights
    return cast, weights, held


def _place_weights(
    module: nn.Module,
    smap: ShardingMap,
    mesh: DeviceMesh,
    opts: RunOptions,
    device: torch.device,
    held: torch.dtype | None,
) -> list[str]:
    """``module``'s seeded weights, placed per the map (in ``held`` when set, buffers
    too); returns the parameters the model has no initialiser for."""

    def place(fqn: str, full: nn.Parameter) -> nn.Parameter:
        return placed_parameter(full, mesh, smap.parameters[fqn], held)

    # each rank makes one unit of the model at a time and keeps its shards of it
    fallback = init_parameters(module, opts.seed, device, place)
    if held is not None:
        _cast_buffers(module, held)
    return fallback


def _loaded_model(
    skeleton: LoadedModel, opts: RunOptions, device: torch.device, cast: torch.dtype | None
) -> LoadedModel:
    """The model with its seeded inputs, floating ones in ``cast`` (float64 under
    ``--check``)."""
    inputs = make_inputs(skeleton, opts.seed, device)
    if cast is not None:
        inputs = tuple(x.to(cast) if x.is_floating_point() else x for x in inputs)
    if opts.check:
        inputs = tuple(x.to(torch.float64) if x.is_floating_point() else x for x in inputs)
    return LoadedModel(
        skeleton.module, inputs, skeleton.input_names, skeleton.name, skeleton.loss_fn
    )


def _announce(
    smap: ShardingMap,
    mf: ModelFile,
    world: int,
    device: torch.device,
    opts: RunOptions,
    program: GraphProgram | None,
    fallback: list[str],
) -> None:
    """Rank 0's opening lines: what runs where, activation checkpointing, fallback init."""
    how = "the plan's graph" if program is not None else "DTensor propagation (not the plan)"
    say(
        f"autoshard launch: {mf.path.name} on mesh {smap.mesh_text}"
        f"{_dim_names(smap)}, {world} ranks, {device.type}, "
        f"{'train' if opts.train else 'forward'} x {opts.steps} step(s)"
        + (f" ({opts.optimizer})" if opts.train else "")
        + f", seed {opts.seed}, "
        f"running {how}{', float64 (--check)' if opts.check else ''}"
    )
    if program is not None and program.recompute and opts.train:
        blocks = sorted(program.recompute)
        say(
            f"activation checkpointing: {len(blocks)} block(s) drop their activations "
            f"after the forward and run it again before their backward "
            f"({listing([str(b) for b in blocks])})"
        )
    if fallback:
        say(
            f"note: {len(fallback)} parameter(s) have no initialiser in the model "
            f"(fallback init used): {listing(fallback)}"
        )


def _run_mode(
    program: GraphProgram | None,
    loaded: LoadedModel,
    d_inputs: tuple[torch.Tensor, ...],
    mesh: DeviceMesh,
    opts: RunOptions,
    device: torch.device,
    observer: StepObserver | None,
) -> tuple[list[float], torch.Tensor, PlanStepResult | StepResult]:
    """The steps, as the plan's graph (``program``) or by DTensor propagation; returns
    each step's seconds, the last step's output and the run's result."""
    if program is not None:
        dtype_map = CHECK_DTYPES if opts.check else {}
        by_name = dict(zip(loaded.input_names, d_inputs, strict=True))
        presult = run_plan_steps(
            program, loaded.module, by_name, mesh, opts, device, dtype_map, observer
        )
        return presult.step_times_s, presult.last_output, presult
    with widened(opts.check):
        result = run_steps(
            loaded.module,
            d_inputs,
            opts,
            device,
            count_collectives=True,
            observer=observer,
            loss_fn=loaded.loss_fn,
        )
    return result.step_times_s, result.output, result


def _gather_timings(
    step_times: list[float],
    setup_peak: int,
    opts: RunOptions,
    device: torch.device,
    world: int,
) -> tuple[list[float], list[int], list[int]]:
    """Every rank's step times and peak memory, gathered on every rank: the slowest
    rank's time per step, each rank's peak and each rank's peak before step 1."""
    times: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(times, step_times)
    slowest = [max(t[i] for t in times) for i in range(opts.steps)]
    both: list[tuple[int, int]] = [(0, 0)] * world
    dist.all_gather_object(both, (peak_memory_bytes(device), setup_peak))
    peaks, setup_peaks = [p for p, _ in both], [b for _, b in both]
    return slowest, peaks, setup_peaks


def _report_run(
    smap: ShardingMap,
    mf: ModelFile,
    opts: RunOptions,
    device: torch.device,
    outcome: PlanStepResult | StepResult,
    per_rank: list[int],
    slowest: list[float],
    peaks: list[int],
    setup_peaks: list[int],
) -> tuple[bool, dict[str, Any]]:
    """Rank 0's report of the run (bytes, memory, collectives, step times); returns
    whether the collectives agree with the plan, and the ``--json`` report."""
    agree = True
    report: dict[str, Any] = {}
    _report_bytes(per_rank)
    say(
        f"peak memory per rank ({'GPU allocated' if device.type == 'cuda' else 'RSS'}): "
        f"max {format_bytes(max(peaks))}, min {format_bytes(min(peaks))}; "
        f"before step 1 (imports, trace, weights) max {format_bytes(max(setup_peaks))}"
    )
    if isinstance(outcome, PlanStepResult):
        agree = report_observed(outcome, smap, device, opts)
        report["collectives"] = observed_rows(outcome, smap, device)
        report["deviations"] = dict(outcome.deviations)
        report["lowered"] = lowered_report(outcome, smap, device)
    else:
        predicted = smap.predicted.get("collectives") or {}
        _report_collectives(outcome.comm_counts or {}, predicted)
        report["collectives_by_kind"] = outcome.comm_counts or {}
    backend = "nccl" if device.type == "cuda" else "gloo"
    ratio = report_time(
        slowest,
        smap.predicted.get("step_time_s"),
        priced_for=smap.predicted.get("device"),
        run_on=f"{backend} on {device.type}",
    )
    report["measured_over_predicted"] = ratio
    report.update(
        {
            "format": "autoshard.launch_report/1",
            "model": mf.path.name,
            "mesh": {"shape": list(smap.mesh_shape), "dim_names": list(smap.dim_names or ())},
            "mode": "plan" if isinstance(outcome, PlanStepResult) else "propagate",
            "train": opts.train,
            "steps": opts.steps,
            "seed": opts.seed,
            "device": device.type,
            "collectives_agree": agree,
            "step_times_s": slowest,
            "predicted_step_time_s": smap.predicted.get("step_time_s"),
            "local_parameter_bytes": per_rank,
            "peak_memory_bytes": peaks,
            "setup_peak_memory_bytes": setup_peaks,
        }
    )
    return agree, report


def _check(
    mf: ModelFile,
    opts: RunOptions,
    device: torch.device,
    module: nn.Module,
    output: torch.Tensor,
    recorded: Recorder,
    report: dict[str, Any] | None = None,
    cast: torch.dtype | None = None,
    master: bool = False,
) -> int:
    """Compare with a single-device run on rank 0; every rank returns the verdict (0 pass,
    1 fail). Every rank takes part in gathering the last step's output and parameters.
    Rank 0 adds the result to ``report`` (``"check"``). ``cast``: the solve's dtype, for
    the inputs and (unless ``master``: mixed precision keeps fp32 master weights) the
    weights, as the sharded run has them."""
    rank = dist.get_rank()
    drifts = opts.train and opts.steps > 1
    last_out = full_tensor(output) if drifts else output
    last_params: dict[str, torch.Tensor] = {}
    if drifts:
        for name, p in module.named_parameters():
            full = full_tensor(p.detach())
            if rank == 0:
                last_params[name] = full.to("cpu", copy=True)
    verdict = [0]
    if rank == 0:
        ref = materialize(mf, opts.seed, device).loaded
        if opts.train:  # batch statistics, as the traced training step normalises
            train_batch_norms(ref.module)
        if cast is not None:  # the solve's --dtype, as the sharded run's weights
            if not master:
                ref.module.to(cast)
            ref.inputs = tuple(x.to(cast) if x.is_floating_point() else x for x in ref.inputs)
        ref.inputs = widen_module(ref.module, ref.inputs)
        ref_rec = Recorder(keep=True)
        widen = widened()
        with widen:
            ref_result = run_steps(
                ref.module, ref.inputs, opts, device, observer=ref_rec, loss_fn=ref.loss_fn
            )
        narrowed = getattr(widen, "narrowed", None)
        if narrowed:
            items = ", ".join(f"{op} ({n})" for op, n in narrowed.items())
            say(f"note: the single-device run ran ops with no float64 kernel another way: {items}")
        assert recorded.output is not None and ref_rec.output is not None
        res = compare_runs(
            recorded.output,
            ref_rec.output,
            recorded.grads,
            ref_rec.grads,
            recorded.params,
            ref_rec.params,
            opts,
        )
        if drifts:
            ref_last = dict(ref.module.named_parameters())
            res.drift["output"] = relative_error(last_out, ref_result.output, opts.atol / opts.rtol)
            res.drift["parameters"] = max(
                (
                    relative_error(t, ref_last[n], opts.atol / opts.rtol)
                    if n in ref_last
                    else float("inf")
                )
                for n, t in last_params.items()
            )
        report_check(res, opts)
        verdict = [1 if res.failures(opts) else 0]
        if report is not None:
            report["check"] = {
                "dtype": "float64",
                "rtol": opts.rtol,
                "atol": opts.atol,
                "output": res.output_diff,
                "gradients": res.grad_diff,
                "parameters": res.param_diff,
                "drift": res.drift,
                "failures": res.failures(opts),
                "passed": not res.failures(opts),
            }
    dist.broadcast_object_list(verdict, src=0)
    return int(verdict[0])


def _cast_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """``module``'s floating buffers cast to ``dtype`` in place (its parameters are placed
    in that dtype already)."""
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.is_floating_point():
                mod._buffers[name] = b.to(dtype)


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated GPU memory on CUDA, else the peak resident set
    (Linux reports KiB)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_report(path: str, report: dict[str, Any]) -> None:
    """``--json``: the launch's report as JSON, atomically (non-finite numbers as null)."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    atomic_write_text(path, json.dumps(clean(report), indent=2, sort_keys=True) + "\n")


def _dim_names(smap: ShardingMap) -> str:
    """`` (dp, tp)`` or nothing when the map names no mesh dims."""
    return f" ({', '.join(smap.dim_names)})" if smap.dim_names else ""


def _report_bytes(per_rank: list[int]) -> None:
    """Local parameter bytes per rank, one line (grouped when ranks agree)."""
    if len(set(per_rank)) == 1:
        say(
            f"local parameter bytes per rank: {format_bytes(per_rank[0])} "
            f"({per_rank[0]:,} B) on each of {len(per_rank)} ranks"
        )
    else:
        items = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(per_rank))
        say(f"local parameter bytes per rank: {items}")


def _report_collectives(seen: dict[str, int], predicted: Mapping[str, object]) -> None:
    """Collectives seen in step 1 beside the map's prediction."""
    kinds = sorted(set(seen) | set(predicted))
    if not kinds:
        say("collectives in step 1 (CommDebugMode): none; predicted: none")
        return
    say("collectives in step 1 (CommDebugMode)   seen  predicted")
    for k in kinds:
        pred = predicted.get(k, 0 if predicted else "-")
        say(f"  {k:<38}{seen.get(k, 0):>5}  {pred!s:>9}")
