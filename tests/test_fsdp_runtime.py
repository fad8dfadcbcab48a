"""FSDP's copies around its collectives (``--fsdp-version``, ``Plan.fsdp_s``): the bytes
autoshard prices for a plan FSDP runs are the bytes PyTorch's FSDP2 and FSDP1 move in the
passes they run beside the model's own ops and the collectives, counted here from those
ops in one real training step (one process, a fake process group of 8 ranks), not from
autoshard's formula."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from helpers import autoshard_cli, cli_config
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.cost.devices import DEFAULT_DEVICE, get_device
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.plan.fsdp_runtime import fsdp_version_of, predivide_factor
from autoshard.solver.compare import compare_plans
from autoshard.solver.solve import SolveConfig, strategies, trace
from autoshard.strategies.strategy import local_shape

BATCH, D, H = 48, 48, 192  # each divisible by 6 and by 8

MODEL = f"""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear({D}, {H}, bias=False)
        self.down = nn.Linear({H}, {D}, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones({D}))
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        x = x * self.scale  # the blocks' input needs its gradient, as an embedding's does
        for layer in self.layers:
            x = layer(x)
        return x


def build_model():
    return Stack()


def example_inputs():
    return (torch.randn({BATCH}, {D}),)
"""


def _nbytes(ts) -> int:  # noqa: ANN001 - a tensor or a list of them
    ts = [ts] if isinstance(ts, torch.Tensor) else ts
    return sum(t.numel() * t.element_size() for t in ts)


def _fsdp2_pass(name: str, args, kwargs) -> int | None:  # noqa: ANN001
    """Bytes one of FSDP2's own ops moves (torch 2.13, ``_fsdp_collectives.py``), or None
    for an op of another kind."""
    if name == "fsdp.all_gather_copy_in.default":  # the shards into the buffer's slot
        return 2 * _nbytes(args[0])
    if name == "fsdp.split_with_sizes_copy.default":  # the buffer out into the parameters
        return 2 * _nbytes(kwargs["out"])
    if name == "fsdp.chunk_cat.default":  # the gradients into the reduce-scatter's buffer
        return _nbytes(args[0]) + _nbytes(kwargs["out"])
    if name == "aten._foreach_copy_.default":  # the fp32 shards cast to bf16
        return _nbytes(args[0]) + _nbytes(args[1])
    return None


def _fsdp1_pass(name: str, args, kwargs, xs: tuple[torch.Tensor, ...]) -> int | None:  # noqa: ANN001
    """Bytes one of FSDP1's own ops moves (``_runtime_utils.py``), or None; ``xs``: the
    step's inputs, whose cast to bf16 is the model's (MixedPrecision's), not a pass."""
    if name == "aten.cat.default":  # autograd flattens the gradients into the flat one
        return _nbytes(args[0]) * 2
    if name == "aten._to_copy.default" and all(args[0] is not x for x in xs):  # the gradient
        out = args[0].numel() * kwargs["dtype"].itemsize
        return _nbytes(args[0]) + out
    if name == "aten.div_.Tensor":  # the predivide (unsharded) and postdivide (shard)
        return 2 * _nbytes(args[0])
    if name == "aten.copy_.default":  # the fp32 flat shard cast into the bf16 _mp_shard
        return _nbytes(args[0]) + _nbytes(args[1])
    return None


class _Ops(TorchDispatchMode):
    """Every op one step runs, and the bytes of FSDP's own passes among them."""

    def __init__(self, price) -> None:  # noqa: ANN001 - (name, args, kwargs) -> int | None
        super().__init__()
        self.price, self.ops, self.bytes = price, Counter(), 0
        self.added = 0  # bytes of the in-place adds that accumulate a gradient (a + b -> a)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = str(func)
        self.ops[name] += 1
        moved = self.price(name, args, kwargs)
        self.bytes += moved or 0
        if name == "aten.add_.Tensor":
            self.added += 3 * _nbytes(args[0])
        return func(*args, **kwargs)


# what a step runs besides FSDP's passes, by exact name: the model's own ops (forward and
# backward), views, allocations, and in the namespaces ``c10d`` and ``profiler`` the
# collectives (a fake process group's) and FSDP's profiler ranges
_MODEL_OPS = {
    "aten.mm.default", "aten.t.default", "aten.add.Tensor", "aten.mul.Tensor",
    "aten.relu.default", "aten.threshold_backward.default", "aten.sum.default",
    "aten.sum.dim_IntList", "aten.ones_like.default", "aten.expand.default",
    "aten.view.default", "aten.detach.default", "aten.as_strided.default",
    "aten.empty.memory_format", "aten.empty_like.default", "aten.split.Tensor",
    "aten.split_with_sizes.default", "aten.slice.Tensor",
}  # fmt: skip


def _passes(ops: Counter) -> dict[str, int]:
    """The ops of ``ops`` that are neither the model's, a view, an allocation, a
    collective nor a profiler range: FSDP's passes."""
    return {
        k: v
        for k, v in ops.items()
        if k not in _MODEL_OPS and not k.startswith(("c10d.", "profiler."))
    }


def _step(version: int, model_path, recompute: bool = False, micro_batches: int = 1) -> _Ops:  # noqa: ANN001
    """One forward and backward of the model file's model under FSDP ``version`` in
    bf16-mixed (bf16 compute, fp32 reduction), each block wrapped, as torchtitan wraps
    with FSDP2 and Composer with FSDP1; ``recompute``: each block checkpointed first
    (FSDP2 only), as torchtitan's full activation checkpointing wraps it;
    ``micro_batches``: the batch split into that many, a forward and backward each, the
    gradients accumulating as a training loop accumulates them (FSDP's default: reduced
    after every backward; Composer does no ``no_sync`` under FSDP)."""
    namespace: dict = {}
    exec(compile(model_path.read_text(), str(model_path), "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    model = namespace["build_model"]()
    (x,) = namespace["example_inputs"]()
    chunks = x.tensor_split(micro_batches) if micro_batches > 1 else (x,)
    if version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if recompute:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
                checkpoint_wrapper,
            )

            model.layers = torch.nn.ModuleList(checkpoint_wrapper(b) for b in model.layers)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        mode = _Ops(_fsdp2_pass)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        block_type = type(model.layers[0])
        model = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({block_type}),
            mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32
            ),
            device_id=torch.device("cpu"),
        )
        mode = _Ops(lambda name, args, kwargs: _fsdp1_pass(name, args, kwargs, chunks))
    with mode:
        for chunk in chunks:
            model(chunk).sum().backward()
    return mode


@pytest.fixture
def fake_group(request):
    """A fake process group of ``request.param`` ranks (8 by default) for the test."""
    world = getattr(request, "param", 8)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    yield world
    dist.destroy_process_group()


def _priced(model_path, version: int, world: int, checkpointing: str = "none") -> float:  # noqa: ANN001
    """``autoshard compare --plans fsdp``'s FSDP copies for the model on ``world``
    devices, bytes per device per step."""
    return _plan(model_path, version, world, checkpointing).fsdp_bytes


def _plan(model_path, version: int, world: int, checkpointing: str = "none", *extra: str):  # noqa: ANN001, ANN202
    """``autoshard compare --plans fsdp``'s plan for the model on ``world`` devices."""
    config = cli_config(
        "compare", str(model_path), "--mesh", str(world), "--precision", "bf16-mixed",
        "--activation-checkpointing", checkpointing, "--fsdp-version", str(version),
        "--mode", "train", *extra,
    )  # fmt: skip
    (row,) = compare_plans(config, strategies(config, trace(config)), ("fsdp",))
    assert row.plan is not None and row.plan.name == "fsdp"
    return row.plan


@pytest.mark.parametrize(
    "version, fake_group",
    [(2, 8), (1, 8), (2, 6), (1, 6)],
    indirect=["fake_group"],
    ids=["fsdp2-8", "fsdp1-8", "fsdp2-6", "fsdp1-6"],
)
def test_the_copies_priced_are_the_bytes_fsdp_moves(tmp_path, fake_group, version):
    """Per step on one of 8 (or 6) devices, the copies autoshard prices for the ``fsdp``
    plan equal the bytes of the passes FSDP ``version`` runs besides the model's ops and
    its collectives, for a scale and a stack of two blocks (each of 2 x 9,216 bf16
    parameters): FSDP2 casts each shard to bf16, copies it into the all-gather's buffer
    and the gathered buffer out, twice per block (forward, and backward after
    resharding), and copies the gradients into the reduce-scatter's buffer in fp32; FSDP1
    casts the flat shard per gather, flattens, casts and predivides the unsharded
    gradient and postdivides the shard (on 6 ranks by 1.5, a factor that does not divide
    the group). Every other op the step runs is, by its exact name, the model's, a view, an
    allocation or a collective: a pass PyTorch adds fails here until it is priced."""
    world = fake_group
    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    counted = _step(version, path)
    passes = {  # the root's scale is gathered once: the plan reads it in the forward only
        2: {
            "fsdp.all_gather_copy_in.default": 5,
            "fsdp.split_with_sizes_copy.default": 5,
            "fsdp.chunk_cat.default": 3,
            "aten._foreach_copy_.default": 5,
            "aten._to_copy.default": 1,  # the input to bf16 (MixedPrecisionPolicy)
        },
        1: {
            "aten.cat.default": 3,
            "aten._to_copy.default": 4,  # the input to bf16, and each unit's gradient
            "aten.div_.Tensor": 6,  # each unit's predivide and postdivide
            "aten.copy_.default": 5,
        },
    }[version]
    assert _passes(counted.ops) == passes
    if world == 8:  # by hand, per element: bf16 p = 2, fp32 master m = 4 and reduce r = 4
        blocks, scale = 2 * 2 * D * H, D  # elements: two blocks of two weights; the scale
        gather = {2: (4 + 2) / 8 + 2 * 2 / 8 + 2 * 2, 1: (4 + 2) / 8}[version]
        reduce = {2: 2 + 4, 1: 2 * 2 + (2 + 4) + 2 * 4 + 2 * 4 / 8}[version]
        hand = blocks * (2 * gather + reduce) + scale * (gather + reduce)
        assert counted.bytes == hand
    assert _priced(path, version, world) == counted.bytes


def test_a_recomputed_block_copies_once_per_gather_as_fsdp2_does(tmp_path, fake_group):
    """Each block checkpointed (torchtitan's full activation checkpointing: the block
    wrapped, then ``fully_shard``): FSDP2 gathers a block once for its recomputation and
    its backward together, so its copies are those of the plain step; autoshard's plan
    under ``--activation-checkpointing full`` takes the backward's gather for the
    recomputation's read and prices the same bytes."""
    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    plain, recomputed = _step(2, path), _step(2, path, recompute=True)
    assert recomputed.ops["aten.mm.default"] > plain.ops["aten.mm.default"]  # it reran
    assert recomputed.bytes == plain.bytes
    assert _priced(path, 2, fake_group, "full") == recomputed.bytes


def test_fsdp1_divides_as_torch_does():
    """FSDP1's predivide factor is torch's own for every group size priced; its postdivide
    factor is the group over it, 1.5 on 6 ranks (where the step above counts the division
    torch runs)."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    for n in (1, 2, 3, 4, 6, 8, 12, 16, 64, 128, 512, 1024):
        assert predivide_factor(n) == DefaultState._get_gradient_predivide_factor(n)
    assert {n: n / predivide_factor(n) for n in (2, 6, 8, 512)} == {2: 1, 6: 1.5, 8: 2, 512: 16}


def test_which_plans_fsdp_runs():
    """The fsdp and fsdp_tp plans run the FSDP configured; the torchtitan space's points
    that shard parameters run FSDP2 whatever is configured (torchtitan and ``autoshard
    export`` write ``fully_shard``); the ILP's, DDP's and Megatron's run no FSDP."""
    assert [fsdp_version_of(n, 1) for n in ("fsdp", "fsdp_tp")] == [1, 1]
    points = ("torchtitan fsdp", "torchtitan hsdp+ac", "torchtitan fsdp+tp+ac")
    assert [fsdp_version_of(n, 1) for n in points] == [2, 2, 2]
    others = ("ilp", "ddp", "megatron", "megatron_sp", "torchtitan ddp+tp", "hsdp")
    assert all(fsdp_version_of(n, 2) is None for n in others)


def test_an_unknown_fsdp_version_is_one_error(tmp_path):
    with pytest.raises(AutoshardError, match=r"--fsdp-version .* 2, 1, got 3"):
        SolveConfig(model_path=tmp_path / "m.py", mesh=MeshSpec.from_options("2"), fsdp_version=3)


def test_the_python_api_prices_the_fsdp_it_is_given(tmp_path, fake_group):
    """``autoshard.compare(..., fsdp_version=1)`` prices FSDP1's copies, the bytes PyTorch's
    FSDP1 moves for the same model, and by default FSDP2's."""
    import autoshard

    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    namespace: dict = {}
    exec(compile(MODEL, str(path), "exec"), namespace)  # noqa: S102
    model, inputs = namespace["build_model"](), namespace["example_inputs"]()
    counts = {}
    for version in (1, 2):
        counts[version] = _step(version, path).bytes
    for version, counted in ((1, counts[1]), (None, counts[2])):
        extra = {} if version is None else {"fsdp_version": version}
        (row,) = autoshard.compare(
            model, inputs, str(fake_group), plans="fsdp", precision="bf16-mixed", **extra
        )
        assert row.plan.fsdp_bytes == counted


@pytest.mark.parametrize("version", [2, 1], ids=["fsdp2", "fsdp1"])
def test_gradient_accumulation_gathers_copies_and_reduces_per_micro_batch(
    tmp_path, fake_group, version
):
    """``--grad-accumulation 2``: PyTorch's FSDP, run as a training loop runs it (two
    micro-batches of 24 rows, a forward and backward each, one optimizer step), gathers
    and reduces per micro-batch: its collectives are twice one micro-batch's, by kind,
    and so are the bytes of its copies, which autoshard prices. The step's FLOPs are
    those FlopCounterMode counts over both micro-batches; the optimizer steps once, as
    the plan without accumulation prices it; memory is one micro-batch's, with every
    gradient held the whole step (the micro-batches add into them), where one micro-batch
    alone holds at its peak only those made by then (it frees them after its optimizer
    step)."""
    from torch.utils.flop_counter import FlopCounterMode

    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    half = tmp_path / "half.py"
    half.write_text(MODEL.replace(f"torch.randn({BATCH}, {D})", f"torch.randn({BATCH // 2}, {D})"))
    one, two = _step(version, half), _step(version, path, micro_batches=2)
    collectives = {k: v for k, v in one.ops.items() if k.startswith("c10d.")}
    assert collectives and {k: two.ops[k] for k in collectives} == {
        k: 2 * v for k, v in collectives.items()
    }
    assert two.bytes == 2 * one.bytes
    assert one.added == 0 < two.added  # the second micro-batch's gradients added in
    accumulated = _plan(path, version, fake_group, "none", "--grad-accumulation", "2")
    assert accumulated.grad_accumulation == 2
    assert accumulated.fsdp_bytes == two.bytes
    assert accumulated.extra["accumulation_bytes"] == two.added
    namespace: dict = {}
    exec(compile(MODEL, str(path), "exec"), namespace)  # noqa: S102
    model, (x,) = namespace["build_model"](), namespace["example_inputs"]()
    with FlopCounterMode(display=False) as flops:
        for chunk in x.tensor_split(2):
            model(chunk).sum().backward()
    assert accumulated.step_flops == flops.get_total_flops()
    whole, micro = _plan(path, version, fake_group), _plan(half, version, fake_group)
    assert accumulated.optimizer_s == pytest.approx(whole.optimizer_s, rel=1e-12)
    fp32 = 4 * sum(  # every gradient element the plan keeps on a device, fp32
        math.prod(local_shape(info.results[0].shape, micro.parameters[info.fqn], (fake_group,)))
        for info in micro.sg.graph.nodes.values()
        if info.kind == "param"
    )
    assert accumulated.extra["memory"]["gradients"] == fp32
    assert micro.extra["memory"]["gradients"] < fp32  # its peak comes before the last one
    assert micro.memory_bytes < accumulated.memory_bytes <= micro.memory_bytes + fp32
    # the plan's collectives, by kind and by (phase, kind, mesh dim): twice the micro-batch's
    assert accumulated.collectives == Counter({k: 2 * v for k, v in micro.collectives.items()})
    assert accumulated.collective_steps == Counter(
        {k: 2 * v for k, v in micro.collective_steps.items()}
    )
    assert accumulated.comm_s == pytest.approx({k: 2 * v for k, v in micro.comm_s.items()})
    per_micro_batch = micro.step_time_s - micro.optimizer_s
    device = get_device(DEFAULT_DEVICE)  # the command's default
    adds = device.compute_time(0.0, two.added, torch.bfloat16)  # a memory-bound pass
    assert accumulated.step_time_s == pytest.approx(
        2 * per_micro_batch + whole.optimizer_s + adds, rel=1e-9
    )


def test_gradient_accumulation_is_refused_where_it_means_nothing(tmp_path):
    """Inference has no gradients to accumulate; a whole number of micro-batches only; a
    pipeline splits the batch into its own micro-batches."""
    mesh = MeshSpec.from_options("2")
    with pytest.raises(AutoshardError, match=r"--grad-accumulation .* --mode infer"):
        SolveConfig(model_path=tmp_path / "m.py", mesh=mesh, mode="infer", grad_accumulation=2)
    with pytest.raises(AutoshardError, match=r"--grad-accumulation .* 1 or more, got 0"):
        SolveConfig(model_path=tmp_path / "m.py", mesh=mesh, grad_accumulation=0)
    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    args = ("solve", str(path), "--gpus", "8", "--pp", "2", "--grad-accumulation", "2")
    for extra in ((), ("--microbatches", "1")):
        run = autoshard_cli(*args, *extra, "-q", "--out", str(tmp_path))
        assert run.returncode == 2 and "drop --grad-accumulation" in run.stderr, run.stderr
    run = autoshard_cli("compare", str(path), "--mesh", "8", "--grad-accumulation", "5")
    assert run.returncode == 2 and "plan with another --grad-accumulation" in run.stderr


def test_the_ilp_s_objective_is_the_accumulating_step_over_its_micro_batches(tmp_path):
    """``solve --grad-accumulation 2``: the ILP prices one micro-batch, each parameter with
    half its optimizer step and half the pass that adds the second micro-batch's gradient,
    so its objective is the plan's step over 2, and the optimizer steps once: the step is
    twice the micro-batch's forward, backward and collectives, the adds of the gradients
    the plan keeps (two reads and a write of each, fp32 in bf16-mixed) and one AdamW step
    per parameter shard."""
    from autoshard.solver.solve import plan_model

    path = tmp_path / "stack.py"
    path.write_text(MODEL)
    args = ("solve", str(path), "--mesh", "4", "--precision", "bf16-mixed", "--mode", "train")
    result = plan_model(cli_config(*args, "--grad-accumulation", "2"))
    plan = result.plan
    assert plan.grad_accumulation == 2
    assert 2 * result.ilp.objective_s == pytest.approx(plan.step_time_s, rel=1e-9)
    stats = result.solver_stats()  # as the solution file and --json hold it: the step's
    assert stats["objective_s"] == pytest.approx(plan.step_time_s, rel=1e-9)
    assert stats["bound_s"] <= stats["objective_s"] <= stats["start_objective_s"]
    pkl, _ = result.save(tmp_path / "out")
    shown = autoshard_cli("show", str(pkl))
    assert shown.returncode == 0 and "--grad-accumulation 2" in shown.stdout, shown.stderr
    fp32 = 4 * sum(  # every gradient element the plan keeps on a device, fp32
        math.prod(local_shape(info.results[0].shape, plan.parameters[fqn], (4,)))
        for fqn, info in ((i.fqn, i) for i in result.graph.nodes.values() if i.kind == "param")
    )
    assert fp32 > 0 and plan.extra["accumulation_bytes"] == 3 * fp32  # two reads, a write


def _tracked_peak(tmp_path, world: int, steps: int = 1, set_to_none: bool = True):  # noqa: ANN001, ANN202
    """The model on a global batch of 4,096 rows (512 a rank: activations dominate), under
    FSDP2 with bf16 parameters reduced in fp32, trained ``steps`` steps (each gradient
    freed after the optimizer step when ``set_to_none``, else zeroed in place): PyTorch's
    own ``FSDPMemTracker``'s bytes by kind at the peak of the last step, and the model
    file."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    batch = 512 * world
    path = tmp_path / "stack.py"
    path.write_text(MODEL.replace(f"torch.randn({BATCH}, {D})", f"torch.randn({batch}, {D})"))
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102
    torch.manual_seed(0)
    model = namespace["build_model"]()
    (x,) = namespace["example_inputs"]()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    local = x[: batch // world]  # one rank's share of the batch

    def step() -> None:
        model(local).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)

    for _ in range(steps - 1):  # the tracker follows one step: the last
        step()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((local,))
    with tracker:
        step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return peak, path


def test_the_unsharded_parameters_at_the_peak_are_what_fsdp2_holds(tmp_path, fake_group):
    """At the peak of an FSDP2 step whose activations dominate (a global batch of 4,096
    rows, 512 a rank), PyTorch's own ``FSDPMemTracker`` finds the root's parameters (the
    scale) and one block unsharded, and the next block's all-gather buffer in flight (the
    backward's prefetch): the bytes autoshard adds to the ``fsdp`` plan's memory as
    ``unsharded_parameters``, the root plus two blocks at their gathered placement."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    world = fake_group
    peak, path = _tracked_peak(tmp_path, world)
    held = peak[_FSDPRefType.UNSHARDED_PARAM] + peak[_FSDPRefType.ALL_GATHER]
    assert peak[_FSDPRefType.ACT] > held  # the activations' peak, at the backward's start
    block, scale = 2 * D * H * 2, D * 2  # bf16 bytes: two weights; the scale
    assert held == scale + 2 * block
    assert _plan(path, 2, world).extra["memory"]["unsharded_parameters"] == held


def test_the_gradients_at_the_peak_are_what_fsdp2_holds(tmp_path, fake_group):
    """Over two FSDP2 steps whose activations peak at the turn to the backward,
    ``FSDPMemTracker`` finds at the peak no gradient where each step frees its gradients
    (``zero_grad(set_to_none=True)``, PyTorch's default, as torchtitan runs it), and every
    sharded fp32 gradient where they are zeroed in place: the ``fsdp`` plan's gradients
    at its peak (within one block's, below) and the gradients a step that keeps them
    holds (a gradient buffer, ``MemoryModel(freed_gradients=False)``: DDP's,
    Megatron-LM's, an accumulating step's). Before 2026-12-07 (sixth sitting) the plan held
    every gradient at its peak."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    from autoshard.cost.memory import MemoryModel, memory_by_kind

    world = fake_group
    kinds = (_FSDPRefType.SHARDED_GRAD, _FSDPRefType.UNSHARDED_GRAD)
    freed, path = _tracked_peak(tmp_path, world, steps=2)
    kept, _ = _tracked_peak(tmp_path, world, steps=2, set_to_none=False)
    fp32 = 4 * (D + 2 * 2 * D * H) // world  # every parameter's shard, fp32
    assert sum(freed[k] for k in kinds) == 0
    assert sum(kept[k] for k in kinds) == kept[_FSDPRefType.SHARDED_GRAD] == fp32
    plan = _plan(path, 2, world)
    # FSDP2 makes a block's sharded gradients at its reduce-scatter, after the block's
    # backward; autoshard holds each from the op that makes it: at most one block early
    assert plan.extra["memory"]["gradients"] <= 4 * 2 * D * H // world < fp32
    keeping = MemoryModel("train", mixed=True, freed_gradients=False)
    assert memory_by_kind(plan.sg, plan.choice, keeping)["gradients"] == fp32
