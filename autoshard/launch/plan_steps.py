"""The steps of a launch that runs the plan itself (``--mode plan``, the default).

Each step runs the graph ``autoshard solve`` priced (:mod:`autoshard.launch.graph_run`):
in inference the forward graph, in training the joint forward/backward graph, whose
outputs are the loss and every parameter's gradient, already placed as the parameter
(the plan's gradient reduction). The gradients become the parameters' ``.grad`` and
``torch.optim.AdamW`` steps the DTensor parameters. Step 1 counts collectives per phase
(forward, backward, optimizer) with :class:`~autoshard.launch.collective_log.CollectiveLog`
(by kind and mesh dim) and with ``CommDebugMode`` (by kind, the independent count).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoshard.errors import AutoshardError
from autoshard.launch.check import relative_error
from autoshard.launch.collective_log import CollectiveLog
from autoshard.launch.graph_run import (
    Fault,
    GraphProgram,
    PlanInterpreter,
    RunLog,
    plant_gradient_fault,
)
from autoshard.launch.lowered import (
    LoweredStep,
    drop_collective,
    local_shard,
    lower,
    lowerable,
)
from autoshard.launch.options import RunOptions
from autoshard.launch.steps import (
    StepObserver,
    adamw,
    collective_counts,
    counting,
    sync_device,
    timed,
)


@dataclass
class PlanStepResult:
    """What :func:`run_plan_steps` saw.

    Attributes:
        output: step 1's output (the loss in training), a DTensor.
        last_output: the last step's output.
        step_times_s: wall-clock seconds of each step.
        observed: step 1's collectives, ``(phase, kind, mesh dim) -> count``.
        comm_debug: step 1's collectives by kind, as ``CommDebugMode`` counted them.
        deviations: op -> how often DTensor's output placement differed from the plan.
        substitutions: kernels the device lacks, run another way -> how often (step 1).
        lowered: step 1 recorded as a graph on local tensors (steps 2..N ran it), else
            ``None``; ``not_lowered`` then says why.
        step2_error: with ``--check``, step 2's outputs from the lowered graph against
            the DTensor interpreter's on the same placeholders (:func:`_worst_error`);
            else ``None``.
    """

    output: torch.Tensor
    last_output: torch.Tensor
    step_times_s: list[float]
    observed: Counter = field(default_factory=Counter)
    comm_debug: dict[str, int] = field(default_factory=dict)
    deviations: Counter = field(default_factory=Counter)
    substitutions: Counter = field(default_factory=Counter)
    lowered: LoweredStep | None = None
    not_lowered: str | None = None
    step2_error: float | None = None


def _why_not_lowered(program: GraphProgram, opts: RunOptions) -> str | None:
    """``None`` when this launch records step 1 and runs steps 2..N from it, else why
    not (``--no-lower``; one step, which no later step would reuse; a graph
    :func:`~autoshard.launch.lowered.lowerable` refuses)."""
    if not opts.lower:
        return "--no-lower"
    if opts.steps < 2:
        return "--steps 1: no later step would run a recorded graph"
    return lowerable(program.graph.graph_module.graph)


def _worst_error(lowered: list[Any], reference: list[Any], opts: RunOptions) -> float:
    """Step 2's outputs from the lowered graph against the DTensor interpreter's on the
    same placeholders: the worst relative error
    (:func:`~autoshard.launch.check.relative_error`) over every output and rank (an
    all-reduce outside any count)."""
    floor = opts.atol / opts.rtol
    worst = max(
        (
            relative_error(local_shard(a), local_shard(b), floor)
            for a, b in zip(lowered, reference, strict=True)
            if isinstance(b, torch.Tensor)
        ),
        default=0.0,
    )
    worst_t = torch.tensor([worst], dtype=torch.float64, device=local_shard(reference[0]).device)
    dist.all_reduce(worst_t, op=dist.ReduceOp.MAX)
    return float(worst_t.item())


def placeholder_values(
    program: GraphProgram,
    module: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    device: torch.device,
    dtype_map: Mapping[torch.dtype, torch.dtype],
) -> list[torch.Tensor]:
    """The graph's placeholders in order: the module's (DTensor) parameters and buffers by
    FQN, the inputs by name, and a tangent of ones for the loss.

    Raises:
        AutoshardError: the graph reads a parameter, buffer or input the module lacks.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    # mixed precision: the module keeps fp32 master weights; the step computes with a cast
    cast = program.dtype if program.reduce_dtype is not None else None
    if cast is not None:
        cast = dtype_map.get(cast, cast)

    def computed(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(cast) if cast is not None and t.is_floating_point() else t

    values: list[torch.Tensor] = []
    for node in program.graph.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        info = program.graph.nodes[node.name]
        fqn = info.fqn or node.name
        if info.kind == "param" and fqn in params:
            values.append(computed(params[fqn]))
        elif info.kind == "input" and fqn in inputs:
            values.append(inputs[fqn])
        elif info.kind == "buffer" and fqn in buffers:
            values.append(computed(buffers[fqn].to(device)))
        elif info.kind == "tangent":
            meta = node.meta["val"]
            dtype = dtype_map.get(meta.dtype, meta.dtype)
            values.append(torch.ones(tuple(meta.shape), dtype=dtype, device=device))
        else:
            raise AutoshardError(
                f"the traced graph reads {info.kind} {fqn!r}, which the model built for the "
                "launch does not hold; solve again for this model file"
            )
    return values


def _planted_fault(not_lowered: str | None) -> Fault:
    """The fault tests plant (``AUTOSHARD_FAULT``), refused when it needs a lowered graph
    and this launch has none (``not_lowered`` says why)."""
    planted = Fault.from_env()  # faults planted by tests
    if (planted.lowered_drop is not None or planted.lowered_stale) and not_lowered is not None:
        raise AutoshardError(
            "AUTOSHARD_FAULT=lowered-... needs a lowered graph, and this launch has none "
            f"({not_lowered})"
        )
    return planted


def _interpret(
    program: GraphProgram,
    mesh: DeviceMesh,
    device: torch.device,
    dtype_map: Mapping[torch.dtype, torch.dtype],
    log: RunLog,
    values: list[torch.Tensor],
    record: bool,
) -> tuple[list[Any], LoweredStep | None]:
    """One step of the graph on the DTensor interpreter, logging into ``log``; with
    ``record`` (step 1 of a lowered launch) also recorded as a graph on local tensors,
    which is returned (else ``None``)."""
    interpreter = PlanInterpreter(program, mesh, device, dtype_map, log)
    if record:
        return lower(interpreter.run_values, values, mesh)
    return interpreter.run_program(*values), None


def _step2_error(
    program: GraphProgram,
    mesh: DeviceMesh,
    device: torch.device,
    dtype_map: Mapping[torch.dtype, torch.dtype],
    values: list[torch.Tensor],
    outs: list[Any],
    opts: RunOptions,
) -> tuple[float, float]:
    """``--check`` on step 2: the lowered graph's outputs against the DTensor
    interpreter's on the same placeholders (:func:`_worst_error`), and the seconds the
    comparison took (kept out of the step's time)."""
    t_check = time.perf_counter()
    again = PlanInterpreter(program, mesh, device, dtype_map).run_values(values)
    error = _worst_error(outs, again, opts)
    return error, time.perf_counter() - t_check


def _set_gradients(
    program: GraphProgram, params: Mapping[str, nn.Parameter], outs: list[Any]
) -> None:
    """The graph's gradient outputs become their parameters' ``.grad`` (in its dtype, laid
    out as the parameter: :func:`laid_out_as`).

    Raises:
        AutoshardError: a gradient for a parameter the module lacks.
    """
    for k, grad in enumerate(outs):
        owner = program.grad_of[k]
        if owner is None or grad is None:
            continue
        if owner not in params:
            raise AutoshardError(
                f"the graph returns a gradient for {owner!r}, which the model lacks"
            )
        params[owner].grad = laid_out_as(grad.to(params[owner].dtype), params[owner])


def laid_out_as(grad: Any, param: nn.Parameter) -> Any:
    """``grad`` with the parameter's memory layout on this rank (its local tensor's
    strides), as autograd's ``AccumulateGrad`` lays out every ``.grad`` (its gradient
    layout contract): the graph's gradient of a weight is often the transpose of a
    matmul's output (strides ``(1, n)`` where the weight has ``(n, 1)``). An optimizer
    that walks the parameter and its gradient as flat memory reads them element by
    element only when both are laid out alike: ``torch.optim.AdamW(fused=True)`` on the
    CPU steps a transposed gradient's elements into the wrong parameters (torch 2.13,
    ``tests/test_optimizer.py``), and ``foreach``'s fast CUDA kernels take such a pair
    only on their slow path. A copy when the layouts differ, as ``AccumulateGrad`` makes;
    the DTensor keeps its placements and takes the parameter's global shape and strides.
    A gradient whose local shape is not its parameter's (placed otherwise) is left as it
    is: DTensor redistributes it for each optimizer op, into a fresh dense tensor."""
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    want = param.to_local() if isinstance(param, DTensor) else param
    if local.stride() == want.stride() or local.shape != want.shape:
        return grad
    laid = torch.empty_strided(want.shape, want.stride(), dtype=local.dtype, device=local.device)
    laid.copy_(local)
    if not isinstance(grad, DTensor):
        return laid
    return DTensor.from_local(
        laid,
        grad.device_mesh,
        grad.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _optimizer_step(
    optimizer: torch.optim.Optimizer,
    mesh: DeviceMesh,
    modes: list | None,
    log: RunLog,
) -> None:
    """One optimizer step (and zeroed gradients), its collectives counted into ``log`` as
    the ``optimizer`` phase (and by ``CommDebugMode`` into ``modes`` when counting)."""
    opt_log = CollectiveLog(mesh)
    with counting(modes), opt_log:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for (kind, dim), n in opt_log.take().items():
        log.collectives[("optimizer", kind, dim)] += n


def run_plan_steps(
    program: GraphProgram,
    module: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    mesh: DeviceMesh,
    opts: RunOptions,
    device: torch.device,
    dtype_map: Mapping[torch.dtype, torch.dtype],
    observer: StepObserver | None = None,
) -> PlanStepResult:
    """Run ``opts.steps`` steps of the plan's graph on the placed module and inputs.

    Raises:
        AutoshardError: as :func:`placeholder_values`; a gradient for a parameter the
            module lacks.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    optimizer = adamw(module, opts.lr, opts.optimizer) if opts.train else None
    times: list[float] = []
    first: torch.Tensor | None = None
    out: torch.Tensor | None = None
    observed: Counter = Counter()
    debug: Counter = Counter()
    deviations: Counter = Counter()
    substitutions: Counter = Counter()
    lowered: LoweredStep | None = None
    step2_error: float | None = None
    not_lowered = _why_not_lowered(program, opts)
    planted = _planted_fault(not_lowered)
    fault = planted.lowered_drop
    first_values: list[Any] = []
    for step in range(opts.steps):
        counted = step == 0
        log = RunLog()
        modes: list = [] if counted else None  # type: ignore[assignment]
        values = placeholder_values(program, module, inputs, device, dtype_map)
        sync_device(device)
        t0 = time.perf_counter()
        with counting(modes):
            if lowered is not None:
                outs = lowered(first_values if planted.lowered_stale else values)
            else:
                record = step == 0 and not_lowered is None
                outs, lowered = _interpret(program, mesh, device, dtype_map, log, values, record)
                if record and planted.lowered_stale:
                    first_values = [v.detach().clone() for v in values]
        out = outs[0]
        paused = 0.0
        if step == 0 and lowered is not None and fault is not None:
            if not drop_collective(lowered, fault):
                raise AutoshardError(
                    f"AUTOSHARD_FAULT=lowered-drop:{fault}: the lowered graph has no {fault}"
                )
        if step == 1 and lowered is not None and opts.check:
            # the same placeholders on DTensors: a value the recording froze at step 1
            # (a parameter, an input) or a collective it lost shows here
            step2_error, took = _step2_error(program, mesh, device, dtype_map, values, outs, opts)
            paused += took
        if optimizer is not None:
            _set_gradients(program, params, outs)
            plant_gradient_fault(module)  # AUTOSHARD_FAULT, for tests (graph_run.Fault)
            if observer is not None:
                paused += timed(device, observer.gradients, step, module)
            _optimizer_step(optimizer, mesh, modes, log)
        sync_device(device)
        times.append(time.perf_counter() - t0 - paused)
        if counted:
            observed = log.collectives
            deviations = log.deviations
            substitutions = log.substitutions
            for mode in modes or []:
                debug.update(collective_counts(mode))
            first = out.detach()
        if observer is not None:
            timed(device, observer.finished, step, module, out)
    assert first is not None and out is not None
    return PlanStepResult(
        output=first,
        last_output=out.detach(),
        step_times_s=times,
        observed=observed,
        comm_debug=dict(sorted(debug.items())),
        deviations=deviations,
        substitutions=substitutions,
        lowered=lowered,
        not_lowered=not_lowered,
        step2_error=step2_error,
    )
