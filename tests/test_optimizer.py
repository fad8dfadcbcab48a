"""The optimizer step's price per implementation (``--optimizer``): the bytes each AdamW
implementation moves per element are the bytes of the ops PyTorch itself runs for it,
counted here from those ops, not from autoshard's formula; the option reaches every
parameter's step, the report and the solution file.

torchtitan builds ``torch.optim.AdamW`` with ``foreach`` (docs/validation.md, "What the
datasheet misses"), as PyTorch does by default for CUDA tensors; an H200 measured its
step at 2.0x the fused kernel's (28.9 against 14.3 ms, 1.07 B parameters in
bf16-mixed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import autoshard_cli, write_mlp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.plan.formats import load_solution
from autoshard.solver.solve import SolveConfig
from autoshard.strategies.graph import adamw_step_time
from autoshard.trace.tracer import TensorInfo


class _Traffic(TorchDispatchMode):
    """Bytes every ATen op reads and writes: each distinct tensor it is given is read once
    (a kernel that takes one tensor twice, ``addcmul_(v, g, g)``, loads it once); the ones
    it returns, and those its schema lets it write in place that it changed, are written
    once (``_fused_adamw_`` may write the gradients, and does only to unscale them under
    a gradient scaler)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}

        def tensors(tree) -> dict[int, torch.Tensor]:  # noqa: ANN001
            flat = tree_flatten(tree)[0]
            return {t.data_ptr(): t for t in flat if isinstance(t, torch.Tensor) and t.numel() > 1}

        read = tensors((args, kwargs))
        mutable = {}  # what the schema lets the op write, as it was before
        for arg, value in zip(func._schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write:
                mutable.update({k: t.clone() for k, t in tensors(value).items()})
        out = func(*args, **kwargs)
        written = tensors(out)
        written.update({k: read[k] for k, before in mutable.items() if not read[k].equal(before)})
        self.bytes += sum(t.numel() * t.element_size() for t in (*read.values(), *written.values()))
        return out


def _bytes_per_element(**implementation: bool) -> float:
    """What one ``torch.optim.AdamW`` step moves per fp32 parameter element (after its
    first step has made the moments), counted from the ops PyTorch runs."""
    n, k = 4096, 3
    params = [torch.nn.Parameter(torch.randn(n)) for _ in range(k)]
    for p in params:
        p.grad = torch.randn(n)
    opt = torch.optim.AdamW(params, lr=1e-3, **implementation)
    opt.step()  # the moments exist from here on, as in every step but the first
    traffic = _Traffic()
    with traffic:
        opt.step()
    return traffic.bytes / (n * k)


def _priced_per_element(optimizer: str) -> float:
    """autoshard's price of one fp32 parameter's AdamW step, in bytes per element (the
    roofline's byte term, ``compute_time(0, bytes, dtype)``, read back as bytes)."""
    n = 1 << 20
    t = TensorInfo(shape=(n,), dtype=torch.float32)

    def bytes_moved(flops: float, nbytes: float, dtype: torch.dtype, kind: str = "") -> float:
        assert flops == 0 and dtype == torch.float32
        return nbytes

    return adamw_step_time(t, (), (), bytes_moved, optimizer) / n


@pytest.mark.parametrize(
    ("optimizer", "implementation", "expected"),
    [("adamw-fused", {"fused": True}, 28), ("adamw-foreach", {"foreach": True}, 80)],
)
def test_adamw_is_priced_at_the_bytes_of_the_ops_pytorch_runs(optimizer, implementation, expected):
    """The fused kernel reads the parameter, its gradient and both moments and writes the
    parameter and both moments (28 bytes per fp32 element); ``foreach`` runs eight passes
    over them (80): both counted from PyTorch's own ops, and priced so."""
    counted = _bytes_per_element(**implementation)
    assert counted == expected
    assert _priced_per_element(optimizer) == counted


def _composer_step(param, grad, moment, second_moment, step: int) -> None:  # noqa: ANN001
    """One parameter's update as Composer's ``DecoupledAdamW.adamw`` makes it at weight
    decay 0, the setting MosaicML's MPT sweeps ran (llm-foundry ``yamls/pretrain/mpt-7b.yaml``
    at b2a43a1: ``decoupled_adamw``, ``weight_decay: 0.0``): the passes its loop runs
    (composer v0.16.4, ``composer/optim/decoupled_weight_decay.py``), one op each, with
    betas (0.9, 0.95) and eps 1e-8; the decay's ``mul_`` is skipped at 0."""
    b1, b2 = 0.9, 0.95
    moment.mul_(b1)
    moment.add_(grad, alpha=1 - b1)
    second_moment.mul_(b2)
    second_moment.addcmul_(grad, grad, value=1 - b2)
    root = second_moment.sqrt()
    scaled = root / math.sqrt(1 - b2**step)
    scaled.add_(1e-8)
    param.addcdiv_(moment, scaled, value=-1e-3 / (1 - b1**step))


def test_composer_s_decoupled_adamw_moves_what_foreach_does():
    """Composer's DecoupledAdamW (MosaicML's MPT rows in docs/validation.md) runs eight
    passes over each fp32 element at weight decay 0, 80 bytes, what ``adamw-foreach``
    prices (counted here from the ops, not from the price): those rows take it."""
    n, k = 4096, 3
    tensors = [[torch.randn(n) for _ in range(4)] for _ in range(k)]
    traffic = _Traffic()
    with traffic:
        for param, grad, moment, second_moment in tensors:
            _composer_step(param, grad, moment, second_moment, step=2)
    assert traffic.bytes / (n * k) == _bytes_per_element(foreach=True) == 80
    assert _priced_per_element("adamw-foreach") == 80


def _ddp_optimizer_s(tmp_path: Path, optimizer: str) -> float:
    model = write_mlp(tmp_path, b=64, d=1024, h=4096)
    out = autoshard_cli(
        "compare", str(model), "--mesh", "4", "--plans", "ddp", "--optimizer", optimizer, "--json"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = json.loads(out.stdout)["plans"]
    return row["optimizer_s"]


def test_the_option_prices_every_parameter_s_step_as_its_implementation(tmp_path: Path):
    """``compare --plans ddp`` (every parameter whole on every device, fp32): the optimizer
    step priced as ``foreach`` is 80 / 28 of the fused one, and the fused one is the MLP's
    parameters at 28 bytes each over the device's copy bandwidth."""
    fused = _ddp_optimizer_s(tmp_path, "adamw-fused")
    foreach = _ddp_optimizer_s(tmp_path, "adamw-foreach")
    assert foreach / fused == pytest.approx(80 / 28, rel=1e-9)
    params = 1024 * 4096 + 4096 + 4096 * 1024 + 1024  # two Linear layers, with biases
    from autoshard.cost.devices import DEFAULT_DEVICE, get_device

    device = get_device(DEFAULT_DEVICE)
    assert fused == pytest.approx(device.compute_time(0.0, 28 * params, torch.float32), rel=1e-9)


def test_the_solution_file_keeps_the_optimizer_and_a_bad_name_is_one_clear_error(tmp_path: Path):
    """The solution's cost model records the option (``show``, ``--preload`` and
    ``launch`` read it back); an unknown implementation fails at once, naming the choices."""
    model = write_mlp(tmp_path, b=8, d=64, h=128)
    out = autoshard_cli(
        "solve", str(model), "--mesh", "2", "--optimizer", "adamw-foreach", "--out", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    solution = load_solution(next(tmp_path.glob("*.pkl")))
    assert solution["cost_model"]["optimizer"] == "adamw-foreach"
    assert "optimizer adamw-foreach" in out.stdout
    mesh = MeshSpec.from_options("2")
    with pytest.raises(
        AutoshardError, match=r"--optimizer .* adamw-fused, adamw-foreach, got 'sgd'"
    ):
        SolveConfig(model_path=model, mesh=mesh, optimizer="sgd")


def test_a_gradient_laid_out_unlike_its_parameter_is_laid_out_as_it_before_adamw():
    """The plan's graph gives a weight's gradient as a matmul's transposed output (strides
    ``(1, n)`` where the weight has ``(n, 1)``). PyTorch's fused AdamW on the CPU steps
    such a gradient's elements into the wrong parameters (torch 2.13: planted here, it
    differs from the single-tensor step); laid out as its parameter first, as autograd's
    ``AccumulateGrad`` lays out every ``.grad``, the fused step equals the single-tensor
    one to rounding."""
    from autoshard.launch.plan_steps import laid_out_as

    torch.manual_seed(0)
    weight = torch.randn(32, 128)
    transposed = torch.randn(128, 32).t()  # as mm's backward gives a weight's gradient
    assert not transposed.is_contiguous()

    def stepped(grad: torch.Tensor, **implementation: bool) -> torch.Tensor:
        p = torch.nn.Parameter(weight.clone())
        p.grad = grad
        torch.optim.AdamW([p], lr=1e-3, **implementation).step()
        return p.detach()

    single = stepped(transposed.clone(), foreach=False)
    fault = (stepped(transposed.clone(), fused=True) - single).abs().max().item()
    assert fault > 1e-4  # about 2 lr: elements stepped by another's gradient
    laid = laid_out_as(transposed, torch.nn.Parameter(weight.clone()))
    assert laid.stride() == weight.stride() and torch.equal(laid, transposed)
    assert (stepped(laid, fused=True) - single).abs().max().item() < 1e-6  # rounding only


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-foreach"])
def test_the_launch_runs_the_adamw_the_plan_was_priced_with(tmp_path: Path, optimizer: str):
    """The map records the plan's ``--optimizer`` (``predicted.optimizer``); the launch
    builds that AdamW, says so, and its step still matches one device's."""
    from helpers import ranks

    model = write_mlp(tmp_path, b=8, d=64, h=128)
    args = ["solve", str(model), "--mesh", "2", "--optimizer", optimizer, "--out", str(tmp_path)]
    out = autoshard_cli(*args, "-q")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = next(tmp_path.glob("*.json"))
    assert json.loads(plan.read_text())["predicted"]["optimizer"] == optimizer
    run = ranks(2, str(plan), str(model), "--train", "--check")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert f"train x 1 step(s) ({optimizer})" in run.stdout, run.stdout
    assert "parameters after 1 optimizer step" in run.stdout and "FAILED" not in run.stdout


def test_a_sharded_gradient_is_laid_out_as_its_parameter_shard_and_keeps_its_placement():
    """The DTensor case (a fake process group of 4, rank 0's shards): a ``Shard(0)``
    gradient whose local shard is transposed gets its parameter's local strides and global
    metadata, the same values and placements; one already laid out alike is returned as
    it is (no copy)."""
    from torch.distributed.tensor import DTensor, Shard

    from autoshard._torch_private import fake_mesh
    from autoshard.launch.plan_steps import laid_out_as

    with fake_mesh((4,)) as mesh:
        param = torch.nn.Parameter(
            DTensor.from_local(torch.randn(8, 16), mesh, [Shard(0)], run_check=False)
        )
        local = torch.randn(16, 8).t()
        grad = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        laid = laid_out_as(grad, param)
        assert laid.to_local().stride() == param.to_local().stride() == (16, 1)
        assert torch.equal(laid.to_local(), local)
        assert laid.placements == grad.placements
        assert (laid.shape, laid.stride()) == (param.shape, param.stride())
        alike = DTensor.from_local(torch.randn(8, 16), mesh, [Shard(0)], run_check=False)
        assert laid_out_as(alike, param) is alike


def _foreach_stage_plan(tmp_path: Path) -> Path:
    """``autoshard stages`` of the bundled blocks on 2 devices, 2 stages, priced with
    ``adamw-foreach``: the stage plan it writes."""
    out = autoshard_cli(
        "stages", "examples/blocks.py", "--mesh", "2", "--pp", "2", "--microbatches", "4",
        "--optimizer", "adamw-foreach", "--out", str(tmp_path), "-q",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return next(tmp_path.glob("*.stages.json"))


def test_the_stage_plan_and_the_map_carry_the_optimizer_and_refuse_an_unknown_one(tmp_path):
    """``stages --optimizer`` writes it into the stage plan, which the pipeline launch
    reads; an unknown name in a stage plan or in a sharding map's ``predicted`` is one
    clear error when the file is loaded, before any rank starts."""
    from autoshard.pipeline.stage_plan import load_stage_plan
    from autoshard.plan.formats import load_sharding_map

    path = _foreach_stage_plan(tmp_path)
    assert load_stage_plan(path).optimizer == "adamw-foreach"
    data = json.loads(path.read_text())
    data["optimizer"] = "sgd"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=r"optimizer is 'sgd'; expected one of adamw-fused"):
        load_stage_plan(path)

    model = write_mlp(tmp_path, b=8, d=64, h=128)
    out = autoshard_cli("solve", str(model), "--mesh", "2", "--out", str(tmp_path), "-q")
    assert out.returncode == 0, out.stderr[-2000:]
    smap = next(p for p in tmp_path.glob("mlp_*.json"))
    assert load_sharding_map(smap).predicted["optimizer"] == "adamw-fused"
    data = json.loads(smap.read_text())
    data["predicted"]["optimizer"] = "sgd"
    smap.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=r"predicted 'optimizer' is 'sgd'; expected one of"):
        load_sharding_map(smap)


@pytest.mark.slow
def test_a_pipeline_launch_runs_the_adamw_its_stages_were_priced_with(tmp_path: Path):
    """A stage plan priced with ``adamw-foreach`` launches that AdamW (rank 0 names it) on
    2 gloo ranks, and its step matches one device's."""
    from helpers import ranks

    plan = _foreach_stage_plan(tmp_path)
    run = ranks(2, str(plan), "examples/blocks.py", "--train", "--check")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "train x 1 step(s) (adamw-foreach)" in run.stdout, run.stdout
