"""``--check``: compare a sharded run with a single-device run, and report it.

Rank 0 runs the same model, seed and inputs on one device and compares the output of the
last step and, with ``--train``, step 1's gradients and every parameter after the steps
(:func:`compare_runs`); it prints local parameter bytes per rank, the collectives
``CommDebugMode`` saw in step 1 beside the plan's prediction, and the step time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

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
