"""Mixed precision (``--precision bf16-mixed``) against a pure cast (``--dtype``) and fp32.

Hand numbers: bytes per parameter element (ZeRO, Rajbhandari et al. SC'20, section 3.1;
FSDP2's MixedPrecisionPolicy with fp32 reduction, as torchtitan trains), the H100's bf16
peak from its datasheet (989.4 dense TFLOP/s against 494.5 TF32), and gradient reductions
moving the reduce dtype's bytes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import write_mlp
from test_cost_model import MM_TEMPLATE

from autoshard.cost.devices import get_device
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.solver.solve import SolveConfig, plan_baseline, plan_model

D, H = 1024, 4096
PARAMS = D * H + H + H * D + D  # fc1 and fc2 of the 2-layer MLP, weights and biases


def _ddp(tmp_path, **kw):
    path = write_mlp(tmp_path, 64, D, H)
    return plan_baseline(SolveConfig(model_path=path, mesh=MeshSpec.from_options("4"), **kw), "ddp")


@pytest.mark.parametrize(
    ("kw", "per_element"),
    [
        ({}, (4, 4, 8)),  # fp32: parameter, gradient, two fp32 moments
        ({"dtype": torch.bfloat16}, (2, 2, 4)),  # a pure cast: AdamW keeps bf16 moments
        ({"precision": "bf16-mixed"}, (2, 4, 12)),  # + fp32 master, fp32 gradients
        # reduced in bf16, then kept in fp32 beside the master weights (FSDP2)
        ({"precision": "bf16-mixed", "reduce_dtype": torch.bfloat16}, (2, 4, 12)),
    ],
    ids=["fp32", "bf16-cast", "bf16-mixed", "bf16-mixed-reduce-bf16"],
)
def test_bytes_per_parameter(tmp_path, kw, per_element):
    """DDP keeps every parameter whole on each device: its memory kinds are the parameter
    count times the bytes per element of each kind."""
    kinds = _ddp(tmp_path, **kw).plan.memory_by_kind()
    got = (kinds["parameters"], kinds["gradients"], kinds["optimizer_state"])
    assert got == tuple(PARAMS * b for b in per_element)


def test_mixed_precision_computes_at_the_bf16_peak(tmp_path):
    """An 8192^3 matmul is compute-bound: 2 m n k / peak, TF32's in fp32, bf16's mixed."""
    n = 8192
    path = tmp_path / "mm.py"
    path.write_text(MM_TEMPLATE.format(m=n, k=n, n=n))
    h100 = get_device("h100")
    cfg = SolveConfig(model_path=path, mesh=MeshSpec.from_options("2"), mode="infer", device=h100)
    fp32 = plan_model(cfg).plan
    mixed = plan_model(replace(cfg, precision="bf16-mixed")).plan
    assert fp32.compute_s == pytest.approx(2 * n**3 / 2 / h100.peak(torch.float32), rel=1e-3)
    assert mixed.compute_s == pytest.approx(2 * n**3 / 2 / h100.peak(torch.bfloat16), rel=1e-3)
    assert h100.peak(torch.bfloat16) == pytest.approx(989.4e12, rel=1e-3)


def test_gradients_are_reduced_in_the_reduce_dtype(tmp_path):
    """DDP all-reduces every gradient: in fp32 under bf16-mixed (the bytes of an fp32
    model's), in bf16 with --reduce-dtype bfloat16 (the bandwidth term halves)."""
    fp32 = _ddp(tmp_path).plan.comm_s["all_reduce"]
    mixed = _ddp(tmp_path, precision="bf16-mixed").plan.comm_s["all_reduce"]
    half = _ddp(tmp_path, precision="bf16-mixed", reduce_dtype=torch.bfloat16)
    assert mixed == pytest.approx(fp32, rel=1e-12)
    assert half.plan.comm_s["all_reduce"] < 0.6 * fp32


def test_reduce_dtype_without_mixed_precision_is_one_clear_error(tmp_path):
    with pytest.raises(AutoshardError, match="mixed precision only"):
        SolveConfig(
            model_path=write_mlp(tmp_path, 8, 8, 8),
            mesh=MeshSpec.from_options("2"),
            reduce_dtype=torch.bfloat16,
        )


def test_dtype_and_precision_together_are_one_clear_error(tmp_path):
    with pytest.raises(AutoshardError, match="give one of them"):
        SolveConfig(
            model_path=write_mlp(tmp_path, 8, 8, 8),
            mesh=MeshSpec.from_options("2"),
            dtype=torch.bfloat16,
            precision="bf16-mixed",
        )


def test_the_report_adds_up_to_the_ilp_objective_in_mixed_precision(tmp_path):
    """The plan's breakdown re-prices every resharding (gradients in the reduce dtype) and
    sums to what the ILP minimised."""
    from autoshard.cost.objective import evaluate

    path = write_mlp(tmp_path, 64, D, H)
    cfg = SolveConfig(model_path=path, mesh=MeshSpec.from_options("2x2"), precision="bf16-mixed")
    result = plan_model(cfg)
    assert result.plan.step_time_s == pytest.approx(evaluate(result.sg, result.ilp.choice), 1e-9)
