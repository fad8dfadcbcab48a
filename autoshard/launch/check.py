"""``--check``: compare a sharded run with a single-device run, and report it.

Rank 0 runs the same model, seed and inputs on one device and compares the output of the
last step and, with ``--train``, step 1's gradients and every parameter after the steps
(:func:`compare_runs`); it prints local parameter bytes per rank, the collectives
``CommDebugMode`` saw in step 1 beside the plan's prediction, and the step time.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from autoshard._torch_private import TorchDispatchMode, tree_map
from autoshard.launch.options import RunOptions
from autoshard.launch.validate import listing
from autoshard.units import format_seconds


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
    times: Sequence[float],
    predicted: object = None,
    step1: str = "with warm-up and CommDebugMode",
    priced_for: str | None = None,
    run_on: str | None = None,
) -> float | None:
    """Step time (slowest rank): mean of steps 2..N, as step 1 warms up (``step1`` says
    what else it does); beside it the plan's prediction (for the device it was solved for,
    ``priced_for``) and the ratio measured / predicted. When the prediction came from an
    ``autoshard calibrate`` profile (``priced_for`` ``calibrated``) and the ratio is
    outside :data:`PROFILE_RATIO_BAND`, one line says what may explain it (``run_on``:
    this run's backend and device, e.g. ``gloo on cpu``). Returns the ratio (None without
    a single predicted number)."""
    if len(times) == 1:
        measured = times[0]
        text = f"{format_seconds(times[0])} (1 step, {step1})"
    else:
        rest = times[1:]
        measured = sum(rest) / len(rest)
        which = "step 2" if len(times) == 2 else f"mean of steps 2-{len(times)}"
        text = f"{format_seconds(measured)} ({which}; step 1: {format_seconds(times[0])})"
    say(f"step time: {text}")
    model = f"the plan's device model: {priced_for}" if priced_for else "the plan's device model"
    if isinstance(predicted, Mapping) and predicted:
        parts = ", ".join(f"{k} {format_seconds(float(v))}" for k, v in predicted.items())
        say(f"predicted step time: {parts} ({model})")
        return None
    if not isinstance(predicted, (int, float)) or isinstance(predicted, bool):
        return None
    if predicted <= 0:
        say(f"predicted step time: {format_seconds(float(predicted))} ({model})")
        return None
    ratio = measured / float(predicted)
    say(
        f"predicted step time: {format_seconds(float(predicted))} ({model}); "
        f"measured / predicted: {ratio:.3g}x"
    )
    low, high = PROFILE_RATIO_BAND
    if priced_for == CALIBRATED and not low <= ratio <= high:
        on = f" ({run_on})" if run_on else ""
        say(
            f"note: the step took {ratio:.3g}x what the profile predicts; a profile measured "
            f"on other devices or another backend than this run's{on}, overlap the plan "
            "counts on that the backend does not do (gloo runs each collective to its end "
            "before the next op), links taken from the link options (a profile of one "
            "device measures no links), or per-op overhead on small ops may explain it"
        )
    return ratio


PROFILE_RATIO_BAND = (0.5, 2.0)
"""Measured / predicted step time a calibrated plan is expected within (issue 30)."""

CALIBRATED = "calibrated"
"""The device name of a plan priced with an ``autoshard calibrate`` profile
(:meth:`autoshard.calibrate.Profile.device_spec`)."""


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


@dataclass
class CheckResult:
    """The comparison of a sharded run with the single-device run (rank 0), step 1.

    Both runs compute in float64 (:func:`widened`), so rounding cannot decide the
    verdict: a gradient that is 0 in exact arithmetic stays ~1e-17 and AdamW's ``eps``
    (1e-8) keeps its update negligible, where in float32 rounding would decide its sign.
    Nothing is masked. Ops with no float64 kernel (:data:`NO_FLOAT64`) are the exception:
    the reference computes ``_grouped_mm`` group by group in float64, the sharded run (on
    DTensors) in float32, and both say so in a note.

    Every value is a tensor's error relative to its own scale (:func:`relative_error`):
    ``max |a - ref| / max(max |ref|, atol / rtol)``.

    Attributes:
        output_diff: of step 1's output (the loss, in training).
        grad_diff: per parameter, of step 1's gradient (training only).
        param_diff: per parameter, after step 1's optimizer step (training only).
        drift: after the last step when there were 2 or more, the worst relative error of
            the ``"output"`` and of the ``"parameters"``; not part of the verdict.
    """

    output_diff: float
    grad_diff: dict[str, float] = field(default_factory=dict)
    param_diff: dict[str, float] = field(default_factory=dict)
    drift: dict[str, float] = field(default_factory=dict)

    def failures(self, opts: RunOptions) -> list[str]:
        """What is beyond tolerance, e.g. ``["output", "grad fc1.weight"]``."""
        bad = ["output"] if not self.output_diff <= opts.rtol else []
        bad += [f"grad {n}" for n, d in self.grad_diff.items() if not d <= opts.rtol]
        bad += [f"param {n}" for n, d in self.param_diff.items() if not d <= opts.rtol]
        return bad


def relative_error(a: torch.Tensor, ref: torch.Tensor, floor: float) -> float:
    """``max |a - ref| / max(max |ref|, floor)`` in float64; ``inf`` when the shapes differ.

    ``floor`` (``atol / rtol``) keeps a tensor that is 0 in exact arithmetic (~1e-17 in
    float64, in both runs) from dividing by its own rounding."""
    if a.shape != ref.shape:
        return float("inf")
    diff = max_abs_diff(a, ref)
    if not math.isfinite(diff):  # a NaN or inf anywhere fails
        return float("inf")
    scale = float(ref.detach().double().abs().max()) if ref.numel() else 0.0
    return diff / max(scale, floor) if diff > 0 else 0.0


def compare_runs(
    out: torch.Tensor,
    ref_out: torch.Tensor,
    grads: Mapping[str, torch.Tensor],
    ref_grads: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    ref_params: Mapping[str, torch.Tensor],
    opts: RunOptions,
) -> CheckResult:
    """Compare step 1 of a sharded run (full tensors) with step 1 of the reference run:
    the output, and with ``opts.train`` every gradient and every parameter after the
    optimizer step, each by :func:`relative_error`. A tensor missing on one side, or of
    another shape, gets ``inf``."""
    floor = opts.atol / opts.rtol if opts.rtol > 0 else opts.atol
    result = CheckResult(relative_error(out, ref_out, floor))
    if not opts.train:
        return result
    for mine, theirs, into in (
        (grads, ref_grads, result.grad_diff),
        (params, ref_params, result.param_diff),
    ):
        for name in sorted(set(theirs) | set(mine)):
            a, b = mine.get(name), theirs.get(name)
            into[name] = float("inf") if a is None or b is None else relative_error(a, b, floor)
    return result


def report_check(res: CheckResult, opts: RunOptions) -> None:
    """Rank 0's check lines."""
    step1 = " of step 1" if opts.steps > 1 else ""
    what = "loss" if opts.train else "output"
    say(
        f"check: {what}{step1} vs single device (float64), error relative to its scale "
        f"{res.output_diff:.3g} (rtol {opts.rtol:g}) {_verdict(res.output_diff <= opts.rtol)}"
    )
    for label, diffs in (
        ("gradients of step 1", res.grad_diff),
        ("parameters after 1 optimizer step", res.param_diff),
    ):
        if diffs:
            worst = max(diffs, key=lambda n: diffs[n])
            ok = all(d <= opts.rtol for d in diffs.values())
            say(
                f"check: {label}: worst relative error {diffs[worst]:.3g} ({worst}) over "
                f"{len(diffs)} tensors {_verdict(ok)}"
            )
    if res.drift:
        parts = ", ".join(f"{k} {v:.3g}" for k, v in res.drift.items())
        say(f"check: relative drift after {opts.steps} steps (not checked): {parts}")
    bad = res.failures(opts)
    if bad:
        say(f"check: beyond tolerance: {listing(bad)}")


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAILED"


CHECK_DTYPES = {
    torch.float32: torch.float64,
    torch.float16: torch.float64,
    torch.bfloat16: torch.float64,
}
"""``--check`` computes in float64: every floating dtype an op names is widened."""


class _Widen(TorchDispatchMode):
    """Every dtype an op's arguments name (``_to_copy(dtype=float32)``, ``softmax(...,
    dtype=float32)``, factory ops) widened per :data:`CHECK_DTYPES`, so that a model's own
    casts do not bring float32 rounding back into a float64 run."""

    def __init__(self) -> None:
        super().__init__()
        self.narrowed: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        def widen(x: object) -> object:
            return CHECK_DTYPES.get(x, x) if isinstance(x, torch.dtype) else x

        args, kwargs = tree_map(widen, args), tree_map(widen, kwargs or {})
        if func in NO_FLOAT64 and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args
        ):
            return run_narrowed(func, args, kwargs, self.narrowed)
        return func(*args, **kwargs)


NO_FLOAT64 = {torch.ops.aten._grouped_mm.default}
"""Ops with no float64 kernel (``_grouped_mm``, the grouped matmul of MoE experts): a
float64 run computes them in float32 and widens the result, and says how often."""


def grouped_mm_float64(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``aten._grouped_mm(a, b, offs)`` in float64, group by group with ``mm``, for the two
    layouts a mixture of experts and its backward use: ``a`` (tokens, K) by ``b``
    (groups, K, N) -> (tokens, N), rows ``offs[g-1]:offs[g]`` times ``b[g]``; and ``a``
    (K, tokens) by ``b`` (tokens, N) -> (groups, K, N), the weight gradient."""
    ends = [int(e) for e in offs.tolist()]
    starts = [0, *ends[:-1]]
    if a.dim() == 2 and b.dim() == 3:
        out = a.new_zeros((a.shape[0], b.shape[2]))
        for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
            out[s:e] = a[s:e] @ b[g]
        return out
    out = a.new_zeros((len(ends), a.shape[0], b.shape[1]))
    for g, (s, e) in enumerate(zip(starts, ends, strict=True)):
        out[g] = a[:, s:e] @ b[s:e]
    return out


def run_narrowed(func, args, kwargs, counter: Counter):  # noqa: ANN001, ANN201
    """``func`` where it has no float64 kernel: ``_grouped_mm`` without bias in float64,
    group by group (:func:`grouped_mm_float64`); anything else on float32 copies of its
    float64 tensor arguments, the result widened back. ``counter`` counts each way."""
    plain = [x for x in args if isinstance(x, torch.Tensor)]
    if (
        func is torch.ops.aten._grouped_mm.default
        and len(args) >= 3
        and isinstance(args[2], torch.Tensor)
        and (len(args) < 4 or args[3] is None)
        and not kwargs.get("bias")
        and len(plain) == 3
        and not any(type(x) is not torch.Tensor for x in plain)
        and (args[0].dim(), args[1].dim()) in ((2, 3), (2, 2))
    ):
        counter[f"{func} in float64 by groups"] += 1
        return grouped_mm_float64(args[0], args[1], args[2])

    def narrow(x: object) -> object:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float64:
            return x.to(torch.float32)
        return x

    counter[f"{func} in float32"] += 1
    out = func(*tree_map(narrow, args), **tree_map(narrow, kwargs))
    return tree_map(
        lambda x: (
            x.to(torch.float64) if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x
        ),
        out,
    )


def widened(enabled: bool = True) -> contextlib.AbstractContextManager[object]:
    """A context in which eager ops compute in float64 (see :class:`_Widen`); a no-op
    context when not ``enabled``."""
    return _Widen() if enabled else contextlib.nullcontext()


def widen_module(module: nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``module``'s floating parameters and buffers cast to float64 in place; the floating
    ``inputs`` cast too (returned)."""
    module.to(torch.float64)
    return tuple(x.to(torch.float64) if x.is_floating_point() else x for x in inputs)
