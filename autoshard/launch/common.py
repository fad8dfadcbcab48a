"""What the SPMD and the pipeline launch share: checking a plan against the model,
distributing parameters and inputs, running the steps, comparing with one device, reporting.

``--check`` makes rank 0 run the same model, seed and inputs on one device and compare: the
output of the last step and, with ``--train``, step 1's gradients and every parameter after
the steps (see :func:`compare_runs`). Rank 0 prints local parameter bytes per rank, the
collectives ``CommDebugMode`` saw in step 1 beside the plan's prediction, and the step time.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

from autoshard.errors import AutoshardError
from autoshard.launch.options import RunOptions
from autoshard.model.model_file import LoadedModel
from autoshard.placements import short
from autoshard.plan.formats import ShardingMap
from autoshard.units import format_seconds

__all__ = [
    "CheckResult",
    "StepObserver",
    "StepResult",
    "check_plan",
    "check_world_size",
    "collective_counts",
    "compare_runs",
    "distribute_inputs",
    "distribute_parameters",
    "loss_of",
    "output_tensor",
    "run_steps",
    "settle_output",
    "sync_gradients",
]


_LIST_AT_MOST = 8  # names listed in one error line before "... and N more"


# ----------------------------------------------------------------------------- options


# -------------------------------------------------------------------- plan validation


def _count(n: int, singular: str, plural: str | None = None) -> str:
    """``1 parameter``, ``3 parameters``."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def listing(names: Sequence[str]) -> str:
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


def check_placements(
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
                f"{_count(len(missing), 'parameter')} missing from the map: {listing(missing)}"
            )
        if unknown:
            parts.append(
                f"{_count(len(unknown), 'map entry', 'map entries')} that {model_name} lacks: "
                f"{listing(unknown)}"
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
            parts.append(f"input(s) missing from the map: {listing(missing)}")
        if unknown:
            parts.append(f"map input(s) {model_name} does not take: {listing(unknown)}")
        raise AutoshardError(
            f"the sharding map's inputs do not match {model_name} (its inputs: "
            f"{', '.join(in_names)}): {'; '.join(parts)}"
        )
    ndim = len(smap.mesh_shape)
    first_name: dict[int, str] = {}
    for name, p in params:
        check_placements("parameter", name, smap.parameters[name], p.shape, ndim)
        other = first_name.setdefault(id(p), name)
        if other != name and tuple(smap.parameters[other]) != tuple(smap.parameters[name]):
            raise AutoshardError(
                f"tied parameters {other} and {name} are one tensor but the map places them "
                f"differently ({short(smap.parameters[other])} vs {short(smap.parameters[name])})"
                "; give both the same placements"
            )
    for name, x in zip(in_names, loaded.inputs, strict=True):
        check_placements("input", name, smap.inputs[name], x.shape, ndim)


# ----------------------------------------------------------------------- distribution


def distribute_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Sequence[Placement]],
    canonical: Mapping[str, str] | None = None,
) -> None:
    """Replace every parameter by a DTensor parameter placed per ``placements``, in place.

    Every rank must hold the same full values (see :mod:`autoshard.model.materialize`): each
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


def sync_device(device: torch.device) -> None:
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
    sync_device(device)
    t = time.perf_counter()
    call(*args)
    sync_device(device)
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
        sync_device(device)
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
        sync_device(device)
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


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The global tensor (collective for a DTensor: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; ``inf`` when the shapes differ."""
    if a.shape != b.shape:
        return float("inf")
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def say(text: str) -> None:
    """Print a report line on rank 0."""
    print(text, flush=True)


def report_time(
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
    say(f"step time: {text}")
    if isinstance(predicted, (int, float)):
        say(f"predicted step time: {format_seconds(float(predicted))} (the plan's device model)")
    elif isinstance(predicted, Mapping) and predicted:
        parts = ", ".join(f"{k} {format_seconds(float(v))}" for k, v in predicted.items())
        say(f"predicted step time: {parts} (the plan's device model)")


class Recorder:
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
        full = full_tensor(t.detach())
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
    result = CheckResult(max_abs_diff(out, ref_out))
    if not opts.train:
        return result
    for name in sorted(set(ref_grads) | set(grads)):
        g, r = grads.get(name), ref_grads.get(name)
        if g is None or r is None or g.shape != r.shape:
            result.grad_diff[name] = float("inf")
            continue
        scale = max(1.0, float(r.double().abs().max())) if r.numel() else 1.0
        result.grad_diff[name] = max_abs_diff(g, r) / scale
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


def report_check(res: CheckResult, opts: RunOptions) -> None:
    """Rank 0's check lines."""
    step1 = " of step 1" if opts.steps > 1 else ""
    ok = res.output_diff <= opts.atol
    say(
        f"check: output{step1} max abs diff {res.output_diff:.3g} vs single device "
        f"(atol {opts.atol:g}) {'ok' if ok else 'FAILED'}"
    )
    if opts.train:
        if res.grad_diff:
            worst = max(res.grad_diff, key=lambda n: res.grad_diff[n])
            ok = all(d <= opts.grad_rtol for d in res.grad_diff.values())
            say(
                f"check: gradients of step 1: max abs diff / max(1, max |grad|) "
                f"{res.grad_diff[worst]:.3g} ({worst}; grad-rtol {opts.grad_rtol:g}) "
                f"{'ok' if ok else 'FAILED'}"
            )
        if res.param_diff:
            worst = max(res.param_diff, key=lambda n: res.param_diff[n])
            ok = all(d <= opts.atol for d in res.param_diff.values())
            say(
                f"check: parameters after 1 AdamW step: max abs diff "
                f"{res.param_diff[worst]:.3g} ({worst}) over {len(res.param_diff)} tensors "
                f"{'ok' if ok else 'FAILED'}"
            )
        if res.noisy:
            n = sum(res.noisy.values())
            where = listing([f"{k} ({v})" for k, v in sorted(res.noisy.items())])
            say(
                f"check: {n} element(s) left out of the parameter comparison because their "
                f"gradient is rounding noise (AdamW turns it into an update of up to lr "
                f"{opts.lr:g}): {where}"
            )
    if res.drift:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in res.drift.items())
        say(
            f"check: drift after {opts.steps} steps (max abs diff, not checked: AdamW "
            f"amplifies rounding differences step by step): {parts}"
        )
    bad = res.failures(opts)
    if bad:
        say(f"check: beyond tolerance: {listing(bad)}")


# --------------------------------------------------------------------- click commands
