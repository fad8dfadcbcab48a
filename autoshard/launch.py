"""Run a model sharded per a sharding map, under torchrun.

Two entry points share one set of options:

- ``autoshard launch PLAN.json model.py [--steps N] [--train] [--check] [-- TORCHRUN...]``
  (:data:`launch_command`) validates the map against the model up front, then runs
  ``python -m torch.distributed.run`` (one node, ``--standalone``, one process per device
  of the map's mesh unless the torchrun options say otherwise) on this module and returns
  torchrun's exit code.
- ``torchrun ... -m autoshard.launch PLAN.json model.py [...]`` (:data:`rank_command`)
  is what runs on each rank: process group (NCCL with CUDA, else gloo), world size
  checked against the mesh before anything else, ``init_device_mesh``, the model
  materialised with seeded weights (:mod:`autoshard.materialize`), every parameter
  ``distribute_tensor``-ed per the map, inputs placed per the map, then ``--steps``
  forward passes (with ``--train``: loss = sum of the output, backward, AdamW step).

A pipeline stage plan (``autoshard stages``, ``"format": "autoshard.stage_plan/1"``) given
as PLAN goes to :mod:`autoshard.pipeline_launch` instead.

``--check`` makes rank 0 run the same model, seed and inputs on one device and compare:
the output of the last step and, with ``--train``, step 1's gradients and every parameter
after the steps (see :func:`compare_runs`); beyond tolerance every rank exits 1. Rank 0
prints local parameter bytes per rank, the collectives ``CommDebugMode`` saw in step 1
beside the plan's prediction, and the step time. User errors (map, model file, world
size) exit 2 with one line ``error: ...`` from rank 0.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import click
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

from autoshard.errors import AutoshardError
from autoshard.materialize import build_skeleton, init_parameters, make_inputs, materialize
from autoshard.model_file import LoadedModel, ModelFile, instantiate, load_model_file
from autoshard.placements import short
from autoshard.solution_io import ShardingMap, load_sharding_map
from autoshard.units import format_bytes, format_seconds

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_GRAD_RTOL",
    "RunOptions",
    "CheckResult",
    "StepObserver",
    "StepResult",
    "check_plan",
    "check_world_size",
    "collective_counts",
    "compare_runs",
    "distribute_inputs",
    "distribute_parameters",
    "launch_command",
    "loss_of",
    "output_tensor",
    "rank_command",
    "run_rank",
    "run_steps",
    "settle_output",
    "sync_gradients",
    "torchrun_argv",
]

DEFAULT_ATOL = 1e-5
"""Default tolerance of ``--check`` for outputs and parameters: max absolute difference,
right for float32."""

DEFAULT_GRAD_RTOL = 1e-4
"""Default tolerance of ``--check`` for gradients, relative to the largest one of each
tensor. A float32 gradient sums thousands of terms in an order that sharding changes
(measured: up to 7e-6 on a 2-layer GPT-2, 2x4 mesh); a sharding bug errs by O(1)."""

_LIST_AT_MOST = 8  # names listed in one error line before "... and N more"


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True)
class RunOptions:
    """What each rank does after placing the model.

    Attributes:
        steps: number of steps (>= 1); each is a forward pass, and with ``train`` also a
            backward pass and an AdamW step.
        train: run backward and AdamW (``lr``) in each step; loss = sum of the output.
        check: compare with a single-device run on rank 0 (see :func:`run_rank`).
        seed: seeds the weights and the synthetic inputs (same on every rank).
        atol: ``check`` tolerance of outputs and parameters, max absolute difference.
        grad_rtol: ``check`` tolerance of step 1's gradients, max absolute difference
            relative to the largest reference gradient of the tensor (at least 1).
        lr: AdamW learning rate.
    """

    steps: int = 1
    train: bool = False
    check: bool = False
    seed: int = 0
    atol: float = DEFAULT_ATOL
    grad_rtol: float = DEFAULT_GRAD_RTOL
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AutoshardError(f"--steps must be at least 1, got {self.steps}")
        if not self.atol >= 0:
            raise AutoshardError(f"--atol must be a non-negative number, got {self.atol}")
        if not self.grad_rtol >= 0:
            raise AutoshardError(f"--grad-rtol must be a non-negative number, got {self.grad_rtol}")
        if not self.lr > 0:
            raise AutoshardError(f"--lr must be positive, got {self.lr}")

    def to_argv(self) -> list[str]:
        """The options as ``rank_command`` arguments (the inverse of its parsing)."""
        argv = ["--steps", str(self.steps), "--seed", str(self.seed)]
        argv += ["--atol", repr(self.atol), "--grad-rtol", repr(self.grad_rtol)]
        argv += ["--lr", repr(self.lr)]
        if self.train:
            argv.append("--train")
        if self.check:
            argv.append("--check")
        return argv


# -------------------------------------------------------------------- plan validation


def _count(n: int, singular: str, plural: str | None = None) -> str:
    """``1 parameter``, ``3 parameters``."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def _listing(names: Sequence[str]) -> str:
    """``a, b, c`` or ``a, b, ... and 12 more``."""
    head = ", ".join(names[:_LIST_AT_MOST])
    more = len(names) - _LIST_AT_MOST
    return f"{head} ... and {more} more" if more > 0 else head


def check_world_size(smap: ShardingMap, world_size: int) -> None:
    """The mesh must have exactly one device per process.

    Raises:
        AutoshardError: ``world_size`` differs from the mesh size; the message names both
            and the torchrun option that fixes it.
    """
    need = smap.world_size
    if world_size != need:
        raise AutoshardError(
            f"the sharding map's mesh {smap.mesh_text} needs {need} processes but torchrun "
            f"started {world_size}; pass --nproc-per-node {need} (or --nnodes N "
            f"--nproc-per-node {need}/N), or solve for a mesh of {world_size} devices"
        )


def _check_placements(
    kind: str, name: str, placements: Sequence[Placement], shape: Sequence[int], ndim: int
) -> None:
    """One placement per mesh dim; every ``S(d)`` names a dim the tensor has."""
    if len(placements) != ndim:
        raise AutoshardError(
            f"{kind} {name} has {len(placements)} placement(s) ({short(placements)}) but the "
            f"mesh has {ndim} dim(s); write one placement per mesh dim"
        )
    for p in placements:
        if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):
            raise AutoshardError(
                f"{kind} {name} of shape {tuple(shape)} cannot be sharded as {short(placements)}: "
                f"it has no dim {p.dim}"
            )


def check_plan(smap: ShardingMap, loaded: LoadedModel, model_name: str = "the model") -> None:
    """The map must name exactly the model's parameters and inputs, with valid placements.

    Parameters are named as ``named_parameters(remove_duplicate=False)`` names them, so a
    tied weight appears under each of its names, and all its names must carry the same
    placements (one tensor has one placement).

    Raises:
        AutoshardError: parameters missing from the map and map entries the model lacks
            (listed, in one line); the same for inputs; a placement count that differs
            from the mesh's dims; a shard dim the tensor lacks; tied names placed apart.
    """
    module = loaded.module
    params = list(module.named_parameters(remove_duplicate=False))
    names = [n for n, _ in params]
    missing = sorted(set(names) - set(smap.parameters))
    unknown = sorted(set(smap.parameters) - set(names))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(
                f"{_count(len(missing), 'parameter')} missing from the map: {_listing(missing)}"
            )
        if unknown:
            parts.append(
                f"{_count(len(unknown), 'map entry', 'map entries')} that {model_name} lacks: "
                f"{_listing(unknown)}"
            )
        raise AutoshardError(
            f"the sharding map does not match {model_name}: {'; '.join(parts)}; "
            "solve again for this model"
        )
    in_names = list(loaded.input_names)
    missing = [n for n in in_names if n not in smap.inputs]
    unknown = sorted(set(smap.inputs) - set(in_names))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"input(s) missing from the map: {_listing(missing)}")
        if unknown:
            parts.append(f"map input(s) {model_name} does not take: {_listing(unknown)}")
        raise AutoshardError(
            f"the sharding map's inputs do not match {model_name} (its inputs: "
            f"{', '.join(in_names)}): {'; '.join(parts)}"
        )
    ndim = len(smap.mesh_shape)
    first_name: dict[int, str] = {}
    for name, p in params:
        _check_placements("parameter", name, smap.parameters[name], p.shape, ndim)
        other = first_name.setdefault(id(p), name)
        if other != name and tuple(smap.parameters[other]) != tuple(smap.parameters[name]):
            raise AutoshardError(
                f"tied parameters {other} and {name} are one tensor but the map places them "
                f"differently ({short(smap.parameters[other])} vs {short(smap.parameters[name])})"
                "; give both the same placements"
            )
    for name, x in zip(in_names, loaded.inputs, strict=True):
        _check_placements("input", name, smap.inputs[name], x.shape, ndim)


# ----------------------------------------------------------------------- distribution


def distribute_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Sequence[Placement]],
    canonical: Mapping[str, str] | None = None,
) -> None:
    """Replace every parameter by a DTensor parameter placed per ``placements``, in place.

    Every rank must hold the same full values (see :mod:`autoshard.materialize`): each
    keeps its own slice without communication (``src_data_rank=None``). Tied parameters
    stay one ``nn.Parameter``. A parameter ``placements`` does not name is looked up under
    any other name of the same tensor (``canonical``: name -> one name per tensor; a
    pipeline stage's tracer may name a tied weight by its other alias).

    Raises:
        AutoshardError: a parameter placed under none of its names (:func:`check_plan`
            catches this for a whole model before any rank starts).
    """
    canonical = canonical or {}
    by_key: dict[str, Sequence[Placement]] = {}
    for name, ps in placements.items():
        by_key.setdefault(canonical.get(name, name), ps)
    done: dict[int, nn.Parameter] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in done:
                fqn = f"{mod_name}.{name}" if mod_name else name
                where = placements.get(fqn, by_key.get(canonical.get(fqn, fqn)))
                if where is None:
                    raise AutoshardError(
                        f"the plan gives no placements for {fqn}, which the model holds; "
                        "plan again for this model"
                    )
                dt = distribute_tensor(p.detach(), mesh, list(where), src_data_rank=None)
                done[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod._parameters[name] = done[id(p)]


def distribute_inputs(
    loaded: LoadedModel, mesh: DeviceMesh, placements: Mapping[str, Sequence[Placement]]
) -> tuple[DTensor, ...]:
    """Each input as a DTensor placed per ``placements`` (by input name), no communication."""
    return tuple(
        distribute_tensor(x, mesh, list(placements[name]), src_data_rank=None)
        for name, x in zip(loaded.input_names, loaded.inputs, strict=True)
    )


# ------------------------------------------------------------------------------ steps


def output_tensor(out: object) -> torch.Tensor:
    """The tensor a step's output stands for: a tensor itself, else ``logits``, else the
    first tensor of a mapping (HF ``ModelOutput``), tuple or list.

    Raises:
        AutoshardError: the output holds no tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        values: Sequence[object] = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = out
    else:
        values = []
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    raise AutoshardError(
        f"the model's forward() returned {type(out).__name__} with no tensor in it; "
        "return a tensor, a tuple of tensors or an object with logits"
    )


def settle_output(out: torch.Tensor) -> torch.Tensor:
    """A ``Partial`` DTensor output reduced to ``Replicate`` on those mesh dims.

    Plans never end on a pending reduction (the solver pays for it), so the launcher
    does it inside the step too, where CommDebugMode counts it. Differentiable.
    """
    if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
        placements = [Replicate() if p.is_partial() else p for p in out.placements]
        return out.redistribute(out.device_mesh, placements)
    return out


def loss_of(out: object) -> torch.Tensor:
    """Training loss: the sum of :func:`output_tensor`, in float32.

    A sum, so the gradient of every output element is exactly 1 in the sharded and the
    single-device run alike (no rounding in the seed of the backward pass).
    """
    return output_tensor(out).float().sum()


def _sync(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock times are step times."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepResult:
    """What :func:`run_steps` saw.

    Attributes:
        output: the last step's output tensor (a DTensor in the sharded run).
        step_times_s: wall-clock seconds of each step, in order.
        comm_counts: collectives issued in step 1 (see :func:`collective_counts`), when
            counted.
    """

    output: torch.Tensor
    step_times_s: list[float]
    comm_counts: dict[str, int] | None


_COLLECTIVE_NAMES = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


def collective_counts(mode: CommDebugMode) -> dict[str, int]:
    """CommDebugMode's counts per collective kind: ``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all`` (the names sharding maps predict with); other ops
    keep their own name."""
    counts: Counter[str] = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(getattr(op, "__name__", op)).split(".")[-1]  # "all_reduce"
        counts[_COLLECTIVE_NAMES.get(name, name)] += int(n)
    return dict(sorted(counts.items()))


def sync_gradients(module: nn.Module) -> None:
    """Give every DTensor gradient its parameter's placements, once, after backward.

    Backward leaves a gradient ``Partial`` where the batch (or a contraction dim) was
    sharded; left so, every optimizer op that reads it would all-reduce it again (AdamW
    reads it twice). This is the gradient all-reduce / reduce-scatter of data
    parallelism, done as one redistribute per parameter.
    """
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
            p.grad = g.redistribute(p.device_mesh, p.placements)


class StepObserver(Protocol):
    """Sees each step between its phases; its time and collectives are not the step's."""

    def gradients(self, step: int, module: nn.Module) -> None:
        """After backward and gradient reduction, before the optimizer (training only)."""

    def finished(self, step: int, module: nn.Module, output: torch.Tensor) -> None:
        """After the step (after the optimizer when training); ``output`` is its output."""


@contextlib.contextmanager
def _counting(modes: list[CommDebugMode] | None) -> Iterator[None]:
    """Run the body under a fresh CommDebugMode appended to ``modes`` (if not None).

    CommDebugMode's module tracker hooks every module's backward and warns when a
    module's inputs need no grad or its output is not a tensor (HF outputs); those two
    warnings are about its bookkeeping, not the run, and are silenced.
    """
    if modes is None:
        yield
        return
    mode = CommDebugMode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message="For backward hooks to be called")
        with mode:
            yield
    modes.append(mode)


def _timed(device: torch.device, call: Callable[..., None], *args: Any) -> float:
    """Run ``call(*args)``; return the seconds it took, device work included."""
    _sync(device)
    t = time.perf_counter()
    call(*args)
    _sync(device)
    return time.perf_counter() - t


def run_steps(
    module: nn.Module,
    inputs: Sequence[torch.Tensor],
    opts: RunOptions,
    device: torch.device,
    count_collectives: bool = False,
    observer: StepObserver | None = None,
) -> StepResult:
    """Run ``opts.steps`` steps of ``module`` on ``inputs``; training steps use AdamW.

    The module stays in ``eval()`` mode (dropout off, so runs compare exactly). Plain
    tensors that meet DTensors inside the model (masks, position ids) are treated as
    replicated (``implicit_replication``). With ``count_collectives``, step 1 runs under
    ``CommDebugMode``. ``observer`` sees every step (see :class:`StepObserver`); its time
    is left out of the step times.
    """
    optimizer = torch.optim.AdamW(module.parameters(), lr=opts.lr) if opts.train else None
    times: list[float] = []
    modes: list[CommDebugMode] = []
    out: torch.Tensor | None = None

    for step in range(opts.steps):
        counted = modes if count_collectives and step == 0 else None
        _sync(device)
        t0 = time.perf_counter()
        with _counting(counted), implicit_replication():
            if optimizer is None:
                with torch.no_grad():
                    out = settle_output(output_tensor(module(*inputs)))
            else:
                full_out = settle_output(output_tensor(module(*inputs)))
                out = full_out.detach()
                loss_of(full_out).backward()
                sync_gradients(module)
        paused = 0.0
        if optimizer is not None:
            if observer is not None:
                paused = _timed(device, observer.gradients, step, module)
            with _counting(counted):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0 - paused)
        if observer is not None:
            _timed(device, observer.finished, step, module, out)
    assert out is not None  # steps >= 1
    counts: dict[str, int] | None = None
    if count_collectives:
        total: Counter[str] = Counter()
        for mode in modes:
            total.update(collective_counts(mode))
        counts = dict(sorted(total.items()))
    return StepResult(output=out, step_times_s=times, comm_counts=counts)


# ---------------------------------------------------------------------- rank entry


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (collective for a DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; ``inf`` when the shapes differ."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def _say(text: str) -> None:
    """Print a report line on rank 0."""
    print(text, flush=True)


def _dim_names(smap: ShardingMap) -> str:
    """`` (dp, tp)`` or nothing when the map names no mesh dims."""
    return f" ({', '.join(smap.dim_names)})" if smap.dim_names else ""


def _report_bytes(per_rank: list[int]) -> None:
    """Local parameter bytes per rank, one line (grouped when ranks agree)."""
    if len(set(per_rank)) == 1:
        _say(
            f"local parameter bytes per rank: {format_bytes(per_rank[0])} "
            f"({per_rank[0]:,} B) on each of {len(per_rank)} ranks"
        )
    else:
        items = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(per_rank))
        _say(f"local parameter bytes per rank: {items}")


def _report_collectives(seen: dict[str, int], predicted: Mapping[str, object]) -> None:
    """Collectives seen in step 1 beside the map's prediction."""
    kinds = sorted(set(seen) | set(predicted))
    if not kinds:
        _say("collectives in step 1 (CommDebugMode): none; predicted: none")
        return
    _say("collectives in step 1 (CommDebugMode)   seen  predicted")
    for k in kinds:
        pred = predicted.get(k, 0 if predicted else "-")
        _say(f"  {k:<38}{seen.get(k, 0):>5}  {pred!s:>9}")


def _report_time(
    times: Sequence[float], predicted: object = None, step1: str = "with warm-up and CommDebugMode"
) -> None:
    """Step time (slowest rank): mean of steps 2..N, as step 1 warms up (``step1`` says
    what else it does); beside it the plan's prediction (for the device it was solved for)."""
    if len(times) == 1:
        text = f"{format_seconds(times[0])} (1 step, {step1})"
    else:
        rest = times[1:]
        text = (
            f"{format_seconds(sum(rest) / len(rest))} (mean of steps 2-{len(times)}; "
            f"step 1: {format_seconds(times[0])})"
        )
    _say(f"step time: {text}")
    if isinstance(predicted, (int, float)):
        _say(f"predicted step time: {format_seconds(float(predicted))} (the plan's device model)")
    elif isinstance(predicted, Mapping) and predicted:
        parts = ", ".join(f"{k} {format_seconds(float(v))}" for k, v in predicted.items())
        _say(f"predicted step time: {parts} (the plan's device model)")


def _is_stage_plan(plan: Path) -> bool:
    """A pipeline stage plan (``autoshard stages``), which :mod:`autoshard.pipeline_launch`
    runs, rather than a sharding map."""
    from autoshard.pipeline_launch import is_stage_plan

    return is_stage_plan(plan)


def run_rank(plan: Path, model: Path, opts: RunOptions) -> int:
    """The per-rank body of a launch; call under torchrun. Returns the exit code.
    A stage plan goes to :func:`autoshard.pipeline_launch.run_rank`.

    Raises:
        AutoshardError: not under torchrun, world size differs from the mesh, the map does
            not match the model, or the model file is bad. Every rank raises the same
            error for these, before any collective.
    """
    if _is_stage_plan(plan):
        from autoshard import pipeline_launch

        return pipeline_launch.run_rank(plan, model, opts)
    smap = load_sharding_map(plan)
    if "WORLD_SIZE" not in os.environ:
        raise AutoshardError(
            "autoshard.launch runs on each rank under torchrun; use `autoshard launch "
            f"{plan} {model}` (or `torchrun --nproc-per-node {smap.world_size} -m "
            "autoshard.launch ...`)"
        )
    check_world_size(smap, int(os.environ["WORLD_SIZE"]))

    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device(device_type, torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return _run_in_group(smap, model, opts, device)
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
    skeleton = build_skeleton(mf, opts.seed)
    check_plan(smap, skeleton, mf.path.name)
    fallback = init_parameters(skeleton.module, opts.seed, device)
    inputs = make_inputs(skeleton, opts.seed, device)
    loaded = LoadedModel(skeleton.module, inputs, skeleton.input_names, skeleton.name)
    if rank == 0:
        _say(
            f"autoshard launch: {mf.path.name} on mesh {smap.mesh_text}"
            f"{_dim_names(smap)}, {world} ranks, {device.type}, "
            f"{'train' if opts.train else 'forward'} x {opts.steps} step(s), seed {opts.seed}"
        )
        if fallback:
            _say(
                f"note: {len(fallback)} parameter(s) have no initialiser in the model "
                f"(fallback init used): {_listing(fallback)}"
            )

    distribute_parameters(loaded.module, mesh, smap.parameters)
    d_inputs = distribute_inputs(loaded, mesh, smap.inputs)
    local = sum(p.to_local().numel() * p.element_size() for p in loaded.module.parameters())
    per_rank: list[int] = [0] * world
    dist.all_gather_object(per_rank, local)

    recorder = _Recorder(keep=rank == 0)
    result = run_steps(
        loaded.module,
        d_inputs,
        opts,
        device,
        count_collectives=True,
        observer=recorder if opts.check else None,
    )
    times: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(times, result.step_times_s)
    slowest = [max(t[i] for t in times) for i in range(opts.steps)]
    if rank == 0:
        _report_bytes(per_rank)
        predicted = smap.predicted.get("collectives") or {}
        _report_collectives(result.comm_counts or {}, predicted)
        _report_time(slowest, smap.predicted.get("step_time_s"))

    if not opts.check:
        return 0
    return _check(mf, opts, device, loaded.module, result.output, recorder)


class _Recorder:
    """A :class:`StepObserver` that keeps step 1's output, gradients and parameters after
    the step as full tensors on the CPU of rank 0 (``keep``).

    For DTensors ``full_tensor()`` is a collective: every rank records, only rank 0 keeps.
    """

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.output: torch.Tensor | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.params: dict[str, torch.Tensor] = {}

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        full = _full(t.detach())
        return full.to("cpu", copy=True) if self.keep else full

    def gradients(self, step: int, module: nn.Module) -> None:
        if step == 0:
            for name, p in module.named_parameters():
                if p.grad is not None:
                    self.grads[name] = self._gather(p.grad)

    def finished(self, step: int, module: nn.Module, output: torch.Tensor) -> None:
        if step == 0:
            self.output = self._gather(output)
            if self.grads:  # a training step
                self.params = {n: self._gather(p) for n, p in module.named_parameters()}


_ADAM_EPS = 1e-8  # torch.optim.AdamW's default eps, which run_steps uses


@dataclass
class CheckResult:
    """The comparison of a sharded run with the single-device run (rank 0).

    The verdict rests on step 1, where both runs start from identical weights; later
    steps are reported as drift (see :func:`compare_runs`).

    Attributes:
        output_diff: max |output - reference output| of step 1.
        grad_diff: per parameter, max |grad - reference grad| of step 1 divided by
            max(1, max |reference grad|) (training only).
        param_diff: per parameter, max |param - reference param| after step 1, over the
            elements that are not noise-dominated (training only).
        noisy: per parameter, the count of noise-dominated elements left out of
            ``param_diff``: ``lr * |grad - ref grad| > atol * (|ref grad| + eps)``, so
            AdamW's normalisation ``g / (sqrt(g^2) + eps)`` can move them apart by more
            than ``atol`` from rounding alone (e.g. attention key biases, whose exact
            gradient is 0 because softmax ignores a shift of all keys).
        drift: after the last step when there were 2 or more, max |difference| of the
            ``"output"`` and of the ``"parameters"`` (all elements); not part of the
            verdict.
    """

    output_diff: float
    grad_diff: dict[str, float] = field(default_factory=dict)
    param_diff: dict[str, float] = field(default_factory=dict)
    noisy: dict[str, int] = field(default_factory=dict)
    drift: dict[str, float] = field(default_factory=dict)

    def failures(self, opts: RunOptions) -> list[str]:
        """What is beyond tolerance, e.g. ``["output", "grad fc1.weight"]``."""
        bad = ["output"] if not self.output_diff <= opts.atol else []
        bad += [f"grad {n}" for n, d in self.grad_diff.items() if not d <= opts.grad_rtol]
        bad += [f"param {n}" for n, d in self.param_diff.items() if not d <= opts.atol]
        return bad


def compare_runs(
    out: torch.Tensor,
    ref_out: torch.Tensor,
    grads: Mapping[str, torch.Tensor],
    ref_grads: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ref_params: Mapping[str, torch.Tensor],
    opts: RunOptions,
) -> CheckResult:
    """Compare step 1 of a sharded run (full tensors) with step 1 of the reference run.

    Outputs by max absolute difference; with ``opts.train`` the gradients (relative to
    the largest reference gradient of the tensor, at least 1) and the parameters after
    the AdamW step, leaving out elements whose gradient is rounding noise for AdamW (see
    :class:`CheckResult`). A tensor missing on one side, or of another shape, gets
    ``inf``.
    """
    result = CheckResult(_max_abs_diff(out, ref_out))
    if not opts.train:
        return result
    for name in sorted(set(ref_grads) | set(grads)):
        g, r = grads.get(name), ref_grads.get(name)
        if g is None or r is None or g.shape != r.shape:
            result.grad_diff[name] = float("inf")
            continue
        scale = max(1.0, float(r.double().abs().max())) if r.numel() else 1.0
        result.grad_diff[name] = _max_abs_diff(g, r) / scale
    for name in sorted(set(ref_params) | set(params)):
        a, b = params.get(name), ref_params.get(name)
        if a is None or b is None or a.shape != b.shape:
            result.param_diff[name] = float("inf")
            continue
        diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
        g, r = grads.get(name), ref_grads.get(name)
        if g is not None and r is not None and g.shape == r.shape:
            r64 = r.double()
            noisy = opts.lr * (g.double() - r64).abs() > opts.atol * (r64.abs() + _ADAM_EPS)
            if int(noisy.sum()):
                result.noisy[name] = int(noisy.sum())
                diff = diff.masked_fill(noisy, 0.0)
        result.param_diff[name] = float(diff.max()) if diff.numel() else 0.0
    return result


def _report_check(res: CheckResult, opts: RunOptions) -> None:
    """Rank 0's check lines."""
    step1 = " of step 1" if opts.steps > 1 else ""
    ok = res.output_diff <= opts.atol
    _say(
        f"check: output{step1} max abs diff {res.output_diff:.3g} vs single device "
        f"(atol {opts.atol:g}) {'ok' if ok else 'FAILED'}"
    )
    if opts.train:
        if res.grad_diff:
            worst = max(res.grad_diff, key=lambda n: res.grad_diff[n])
            ok = all(d <= opts.grad_rtol for d in res.grad_diff.values())
            _say(
                f"check: gradients of step 1: max abs diff / max(1, max |grad|) "
                f"{res.grad_diff[worst]:.3g} ({worst}; grad-rtol {opts.grad_rtol:g}) "
                f"{'ok' if ok else 'FAILED'}"
            )
        if res.param_diff:
            worst = max(res.param_diff, key=lambda n: res.param_diff[n])
            ok = all(d <= opts.atol for d in res.param_diff.values())
            _say(
                f"check: parameters after 1 AdamW step: max abs diff "
                f"{res.param_diff[worst]:.3g} ({worst}) over {len(res.param_diff)} tensors "
                f"{'ok' if ok else 'FAILED'}"
            )
        if res.noisy:
            n = sum(res.noisy.values())
            where = _listing([f"{k} ({v})" for k, v in sorted(res.noisy.items())])
            _say(
                f"check: {n} element(s) left out of the parameter comparison because their "
                f"gradient is rounding noise (AdamW turns it into an update of up to lr "
                f"{opts.lr:g}): {where}"
            )
    if res.drift:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in res.drift.items())
        _say(
            f"check: drift after {opts.steps} steps (max abs diff, not checked: AdamW "
            f"amplifies rounding differences step by step): {parts}"
        )
    bad = res.failures(opts)
    if bad:
        _say(f"check: beyond tolerance: {_listing(bad)}")


def _check(
    mf: ModelFile,
    opts: RunOptions,
    device: torch.device,
    module: nn.Module,
    output: torch.Tensor,
    recorded: _Recorder,
) -> int:
    """Compare with a single-device run on rank 0; every rank returns the verdict (0 pass,
    1 fail). Every rank takes part in gathering the last step's output and parameters."""
    rank = dist.get_rank()
    drifts = opts.train and opts.steps > 1
    last_out = _full(output) if drifts else output
    last_params: dict[str, torch.Tensor] = {}
    if drifts:
        for name, p in module.named_parameters():
            full = _full(p.detach())
            if rank == 0:
                last_params[name] = full.to("cpu", copy=True)
    verdict = [0]
    if rank == 0:
        ref = materialize(mf, opts.seed, device).loaded
        ref_rec = _Recorder(keep=True)
        ref_result = run_steps(ref.module, ref.inputs, opts, device, observer=ref_rec)
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
            res.drift["output"] = _max_abs_diff(last_out, ref_result.output)
            res.drift["parameters"] = max(
                (_max_abs_diff(t, ref_last[n]) if n in ref_last else float("inf"))
                for n, t in last_params.items()
            )
        _report_check(res, opts)
        verdict = [1 if res.failures(opts) else 0]
    dist.broadcast_object_list(verdict, src=0)
    return int(verdict[0])


# --------------------------------------------------------------------- click commands


_RUN_OPTIONS = (
    click.argument("plan", type=click.Path(dir_okay=False, path_type=Path)),
    click.argument("model", type=click.Path(dir_okay=False, path_type=Path)),
    click.option("--steps", type=int, default=1, show_default=True, help="Steps to run (>= 1)."),
    click.option("--train", is_flag=True, help="Backward pass and AdamW step in each step."),
    click.option(
        "--check",
        is_flag=True,
        help="Compare with a single-device run on rank 0: outputs; with --train also step "
        "1's gradients and the parameters after the steps.",
    ),
    click.option(
        "--seed", type=int, default=0, show_default=True, help="Seed of weights and inputs."
    ),
    click.option(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        show_default=True,
        help="--check tolerance of outputs and parameters: max absolute difference.",
    ),
    click.option(
        "--grad-rtol",
        type=float,
        default=DEFAULT_GRAD_RTOL,
        show_default=True,
        help="--check tolerance of gradients: max absolute difference over the largest.",
    ),
    click.option("--lr", type=float, default=1e-3, show_default=True, help="AdamW learning rate."),
)


def _run_options(f: Callable[..., None]) -> Callable[..., None]:
    """The arguments and options both commands take (the rank command gets them forwarded)."""
    for decorate in reversed(_RUN_OPTIONS):
        f = decorate(f)
    return f


_RDZV_OPTIONS = {
    "--standalone",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-id",
    "--rdzv-conf",
    "--master-addr",
    "--master-port",
    "--node-rank",
}


def _option_name(arg: str) -> str:
    """``--nproc_per_node=8`` -> ``--nproc-per-node`` (torchrun takes both spellings)."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg


def _option_value(args: Sequence[str], name: str) -> str | None:
    """The value of torchrun option ``name`` in ``args`` (either spelling, ``=`` or not)."""
    for i, a in enumerate(args):
        if _option_name(a) == name:
            if "=" in a:
                return a.split("=", 1)[1]
            return args[i + 1] if i + 1 < len(args) else None
    return None


def torchrun_argv(
    plan: Path, model: Path, opts: RunOptions, torchrun_args: Sequence[str], n_devices: int
) -> list[str]:
    """The torchrun command line for a launch.

    Defaults: ``--standalone`` (one node, a free local port) unless ``torchrun_args``
    names a rendezvous or node option; ``--nproc-per-node`` = ``n_devices`` divided by
    ``--nnodes`` (when that is a number) unless given. ``torchrun_args`` come after the
    defaults.

    Raises:
        AutoshardError: the processes torchrun would start cannot match the mesh.
    """
    names = {_option_name(a) for a in torchrun_args}
    argv = [sys.executable, "-m", "torch.distributed.run"]
    nnodes_text = _option_value(torchrun_args, "--nnodes")
    nnodes = int(nnodes_text) if nnodes_text and nnodes_text.isdigit() else None
    if "--nproc-per-node" not in names:
        if nnodes is not None and n_devices % nnodes:
            raise AutoshardError(
                f"the mesh has {n_devices} devices, which --nnodes {nnodes} does not divide; "
                "pass --nproc-per-node too, or solve for another mesh"
            )
        argv += ["--nproc-per-node", str(n_devices // (nnodes or 1))]
    else:
        nproc_text = _option_value(torchrun_args, "--nproc-per-node")
        if nproc_text and nproc_text.isdigit() and int(nproc_text) * (nnodes or 1) != n_devices:
            started = int(nproc_text) * (nnodes or 1)
            raise AutoshardError(
                f"the plan's mesh needs {n_devices} processes but --nproc-per-node "
                f"{nproc_text}{f' x --nnodes {nnodes}' if nnodes else ''} starts {started}"
            )
    if not names & _RDZV_OPTIONS:
        argv.append("--standalone")
    argv += list(torchrun_args)
    argv += ["-m", "autoshard.launch", str(plan.resolve()), str(model.resolve())]
    return argv + opts.to_argv()


@click.command(
    "launch",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Anything after -- goes to torchrun, e.g. "
    "-- --nnodes 2 --rdzv-endpoint host:29500 --rdzv-id job1.",
)
@_run_options
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TORCHRUN...]")
def launch_command(plan: Path, model: Path, torchrun_args: tuple[str, ...], **run: Any) -> None:
    """Run MODEL sharded per the sharding map PLAN (JSON) under torchrun. PLAN may also be
    a stage plan from `autoshard stages`, run as a pipeline (pp x intra-stage sharding).

    Checks the map against the model first, then starts one process per device of the
    map's mesh on this node (torchrun --standalone) and exits with torchrun's exit code.
    """
    opts = RunOptions(**run)
    if _is_stage_plan(plan):
        from autoshard.pipeline_launch import prepare_launch

        n_devices = prepare_launch(plan, model)
    else:
        smap = load_sharding_map(plan)
        mf = load_model_file(model)
        check_plan(smap, instantiate(mf, device="meta"), mf.path.name)
        n_devices = smap.world_size
    argv = torchrun_argv(plan, model, opts, torchrun_args, n_devices)

    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)  # so ranks import this autoshard
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    click.echo("running: " + shlex.join(argv), err=True)
    sys.exit(subprocess.run(argv, env=env, check=False).returncode)


@click.command("autoshard.launch", context_settings={"help_option_names": ["-h", "--help"]})
@_run_options
def rank_command(plan: Path, model: Path, **run: Any) -> None:
    """One rank of a launch; run it as: torchrun ... -m autoshard.launch PLAN MODEL [OPTIONS]."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        rc = run_rank(plan, model, RunOptions(**run))
    except AutoshardError as exc:
        # Plan, model and world-size errors are the same on every rank: say it once.
        if rank == 0:
            click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    sys.exit(rc)


if __name__ == "__main__":
    rank_command()
