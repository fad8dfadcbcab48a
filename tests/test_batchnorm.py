"""Batch normalisation traced as a training step runs it (issue 13, item 3)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import write_model
from torch import nn

from autoshard.cost.devices import get_device
from autoshard.cost.mesh import MeshSpec
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.plan.plan import phase_of, tensor_uses
from autoshard.solver.solve import SolveConfig, plan_baseline
from autoshard.trace.batchnorm import batch_norm_traced
from autoshard.trace.tracer import trace_model

CNN = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class Net(nn.Module):
    def __init__(self, c=C, n=4, classes=100):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1, bias=False)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(n)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(BATCH, 3, SIDE, SIDE),)
"""


def _cnn(tmp_path, c: int, batch: int, side: int):
    text = CNN.replace("C,", f"{c},").replace("BATCH", str(batch)).replace("SIDE", str(side))
    return write_model(tmp_path, text, "cnn")


@pytest.mark.parametrize("train", [True, False])
def test_traced_batch_norm_computes_what_torch_computes(train: bool) -> None:
    """The plain-op forward against torch's own kernel: batch statistics in training,
    running ones in eval; outputs and the gradients autograd derives."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(6).double()
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    ref = copy.deepcopy(bn).train(train)
    x = (torch.randn(5, 6, 4, 3, dtype=torch.float64) * 3 + 1).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(5, 6, 4, 3, dtype=torch.float64)
    with batch_norm_traced(bn, train):
        y = bn(x)
    y_ref = ref(x_ref)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-12)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    assert torch.allclose(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    assert torch.allclose(bn.weight.grad, ref.weight.grad, rtol=1e-10, atol=1e-12)
    assert "forward" not in bn.__dict__  # the module is as it was


@pytest.mark.slow
def test_a_training_step_normalises_with_the_batch_statistics(tmp_path) -> None:
    """No eval-mode batch-norm op in the joint graph: the step reads the batch's
    statistics (per-channel sums), not the running ones."""
    loaded = instantiate(load_model_file(_cnn(tmp_path, 8, 8, 8)))
    ops = {str(i.target) for i in trace_model(loaded, "train").nodes.values() if i.kind == "op"}
    assert not any("batch_norm" in op for op in ops), ops
    assert "aten.sum.dim_IntList" in ops and "aten.rsqrt.default" in ops


@pytest.mark.slow
def test_data_parallel_cnn_splits_its_compute_and_moves_only_statistics_forward(tmp_path):
    """8 devices, batch 64 of 128 channels at 56 x 56: DDP's compute is an eighth of one
    device's (every op on activations is batch-split); in the forward pass the only
    tensors moved are per-channel statistics (C numbers): no activation is gathered
    around a BatchNorm
    (before: 11.3 ms of all-gathers against 5.2 ms of compute on this model's 8 blocks)."""
    c = 128
    cfg = SolveConfig(  # the datasheet's roofline, linear in the work an op is given
        model_path=_cnn(tmp_path, c, 64, 56),
        mesh=MeshSpec.from_options("8"),
        mode="train",
        device=get_device("h100"),
    )
    one = plan_baseline(cfg, "replicate").plan
    ddp = plan_baseline(cfg, "ddp").plan
    # an eighth, but for the ops on the statistics themselves (C numbers, computed whole
    # on every device): 3.5e-5 of the step here
    assert ddp.compute_s == pytest.approx(one.compute_s / 8, rel=1e-4)
    moved = [
        t.shape
        for producer, consumer, k, t in tensor_uses(ddp.sg)
        if phase_of(ddp.sg, consumer) == "forward"
        and ddp.node_strategy[producer].outputs[0] != ddp.node_strategy[consumer].inputs[k]
    ]
    assert moved  # the statistics' all-reduces
    assert all(math.prod(s) <= c for s in moved), moved
    assert ddp.inputs["x"][0].is_shard(0)


@pytest.mark.slow
def test_data_parallel_cnn_is_priced_as_ddp_with_synchronised_batch_norm(tmp_path):
    """DDP of a CNN, by hand (ring formulas of autoshard.cost.collectives worked here):
    8 devices at 450 GB/s and 5 us per ring step, 4 blocks of two BatchNorms. The only
    collectives are all-reduces: each BatchNorm's two statistics in the forward (the
    batch sum and the sum of squared deviations) and two in the backward (the sums of
    the gradient and of gradient x normalised input), C = 128 fp32 numbers each, as
    SyncBatchNorm all-reduces them; the loss scalar; and every weight gradient in 25 MiB
    buckets. No activation is gathered, scattered or sent all-to-all (before: 2.44 ms of
    reduce-scatters and 0.96 ms of all-to-alls of whole activations in the backward)."""
    c, n, bw, alpha = 128, 8, 450e9, 5e-6
    cfg = SolveConfig(
        model_path=_cnn(tmp_path, c, 64, 56),
        mesh=MeshSpec.from_options("8", intra_node_bw=bw),
        mode="train",
    )
    ddp = plan_baseline(cfg, "ddp").plan

    def all_reduce(nbytes: float, share: float = 1.0) -> float:
        return 2 * (n - 1) * (alpha * share + nbytes / (n * bw))

    params = [3 * c * 9] + [c * c * 9, c, c] * 8 + [100 * c, 100]
    assert sum(params) == sum(p.numel() for p in _net_params(tmp_path, c))
    shares = sum(min(1.0, 4 * k / (25 * 2**20)) for k in params)
    statistics = 4 * 2 * 4 * all_reduce(4 * c)  # 4 blocks x 2 BatchNorms x 4 sums
    loss = all_reduce(4)
    gradients = 2 * (n - 1) * (alpha * shares + 4 * sum(params) / (n * bw))
    assert set(ddp.comm_s) == {"all_reduce"}, ddp.comm_s
    assert ddp.comm_s["all_reduce"] == pytest.approx(statistics + loss + gradients, rel=1e-6)
    assert statistics == pytest.approx(2.240e-3, rel=1e-3)  # 32 latency-bound all-reduces


def _net_params(tmp_path, c: int) -> list[torch.nn.Parameter]:
    (tmp_path / "p").mkdir()
    loaded = load_model_file(_cnn(tmp_path / "p", c, 2, 4))
    return list(loaded.module.build_model().parameters())
