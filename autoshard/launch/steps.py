"""Place the model per the plan and run its steps: parameters and inputs distributed,
forward (and with ``--train`` backward and AdamW), collectives counted, time measured."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import implicit_replication

from autoshard.cost.collective_table import LAUNCH_OPS
from autoshard.errors import AutoshardError
from autoshard.launch.options import RunOptions
from autoshard.model.loss import loss_function
from autoshard.model.model_file import LoadedModel
from autoshard.trace.tracer import kv_cache_off


def adamw(module: nn.Module, lr: float, optimizer: str = "adamw-fused") -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``module``'s parameters (DTensors or tensors) as the plan
    priced its step (``--optimizer``, :data:`autoshard.strategies.graph.OPTIMIZERS`): the
    fused kernel (``fused=True``) or the ``foreach`` passes (``foreach=True``), on every
    device. Not PyTorch's default, which is ``foreach`` on a GPU and a loop of
    single-tensor ops on the CPU: what runs is what was priced. The fused kernel walks
    a parameter and its gradient as flat memory, so each gradient is laid out as its
    parameter (:func:`autoshard.launch.plan_steps.laid_out_as`)."""
    if optimizer == "adamw-foreach":
        return torch.optim.AdamW(module.parameters(), lr=lr, foreach=True)
    if optimizer != "adamw-fused":
        raise AutoshardError(
            f"the plan's optimizer {optimizer!r} is not one this launch runs "
            "(adamw-fused, adamw-foreach): solve again with autoshard"
        )
    return torch.optim.AdamW(module.parameters(), lr=lr, fused=True)


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
                done[id(p)] = placed_parameter(p, mesh, where)
            mod._parameters[name] = done[id(p)]


def placed_parameter(
    p: torch.Tensor, mesh: DeviceMesh, where: Sequence[Placement], dtype: torch.dtype | None = None
) -> nn.Parameter:
    """This rank's shard of the full ``p`` (the same values on every rank), as a DTensor
    ``nn.Parameter`` placed ``where``, cast to ``dtype`` when given; no communication.

    The shard owns its storage: DTensor's local split of a dim-0 shard is a view of the
    full tensor, which would keep all of it alive on every rank.
    """
    full = p.detach()
    if dtype is not None and full.is_floating_point():
        full = full.to(dtype)
    dt = distribute_tensor(full, mesh, list(where), src_data_rank=None)
    local = dt.to_local()
    if local.untyped_storage().nbytes() > local.numel() * local.element_size():
        dt = DTensor.from_local(
            local.clone(), mesh, dt.placements, run_check=False, shape=dt.shape, stride=dt.stride()
        )
    return nn.Parameter(dt, requires_grad=p.requires_grad)


def distribute_inputs(
    loaded: LoadedModel, mesh: DeviceMesh, placements: Mapping[str, Sequence[Placement]]
) -> tuple[DTensor, ...]:
    """Each input as a DTensor placed per ``placements`` (by input name), no communication."""
    return tuple(
        distribute_tensor(x, mesh, list(placements[name]), src_data_rank=None)
        for name, x in zip(loaded.input_names, loaded.inputs, strict=True)
    )


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


def collective_counts(mode: CommDebugMode) -> dict[str, int]:
    """CommDebugMode's counts per collective kind: ``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all`` (the names sharding maps predict with, as the
    collective log counts them: :data:`autoshard.cost.collective_table.LAUNCH_OPS`,
    DTensor's own ``shard_dim_alltoall`` included); other ops keep their own name."""
    counts: Counter[str] = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(getattr(op, "__name__", op)).split(".")[-1]  # "all_reduce"
        counts[LAUNCH_OPS.get(name, name)] += int(n)
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
def counting(modes: list[CommDebugMode] | None) -> Iterator[None]:
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


def timed(device: torch.device, call: Callable[..., None], *args: Any) -> float:
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
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> StepResult:
    """Run ``opts.steps`` steps of ``module`` on ``inputs``; training steps use AdamW.

    In training the loss is ``loss_fn(output, *inputs)`` (default
    :func:`autoshard.model.loss.default_loss`, as the plan's joint graph) and the step's
    output is the loss.

    The module stays in ``eval()`` mode (dropout off, so runs compare exactly), with a
    HuggingFace model's KV cache off (:func:`autoshard.trace.tracer.kv_cache_off`). Plain
    tensors that meet DTensors inside the model (masks, position ids) are treated as
    replicated (``implicit_replication``). With ``count_collectives``, step 1 runs under
    ``CommDebugMode``. ``observer`` sees every step (see :class:`StepObserver`); its time
    is left out of the step times.
    """
    optimizer = adamw(module, opts.lr, opts.optimizer) if opts.train else None
    compute_loss = loss_function(loss_fn)
    times: list[float] = []
    modes: list[CommDebugMode] = []
    out: torch.Tensor | None = None

    for step in range(opts.steps):
        counted = modes if count_collectives and step == 0 else None
        sync_device(device)
        t0 = time.perf_counter()
        # a step over a whole batch reads no KV cache (the solve traced it off)
        with counting(counted), implicit_replication(), kv_cache_off(module):
            if optimizer is None:
                with torch.no_grad():
                    out = settle_output(output_tensor(module(*inputs)))
            else:
                loss = settle_output(compute_loss(module(*inputs), *inputs))
                out = loss.detach()
                loss.backward()
                sync_gradients(module)
        paused = 0.0
        if optimizer is not None:
            if observer is not None:
                paused = timed(device, observer.gradients, step, module)
            with counting(counted):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        sync_device(device)
        times.append(time.perf_counter() - t0 - paused)
        if observer is not None:
            timed(device, observer.finished, step, module, out)
    assert out is not None  # steps >= 1
    counts: dict[str, int] | None = None
    if count_collectives:
        total: Counter[str] = Counter()
        for mode in modes:
            total.update(collective_counts(mode))
        counts = dict(sorted(total.items()))
    return StepResult(output=out, step_times_s=times, comm_counts=counts)
