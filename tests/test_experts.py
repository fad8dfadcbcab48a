"""Mixture of experts: HuggingFace's experts as one fused op, expert parallelism in the plan.

Independent references: HuggingFace's own experts module run eagerly (numbers, gradients),
``FlopCounterMode`` on that eager module (FLOPs), the all-to-all formula worked by hand
per rank (``(n - 1) alpha + (n - 1) / n * bytes / bandwidth``), and a single-device run
of the eager model in float64 against 4 gloo ranks exchanging tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import MIXTRAL_SMALL, assert_checked, ranks, write_model
from torch.distributed.tensor import Shard
from transformers import MixtralConfig, Qwen2MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import SolveConfig, plan_model
from autoshard.strategies.experts import modes_of
from autoshard.trace.experts import EXPERT_OPS, experts_traced, fusable


def _block(kind: str, hidden: int = 32, inter: int = 48, act: str = "silu") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "mixtral":
        cfg = MixtralConfig(
            hidden_size=hidden,
            intermediate_size=inter,
            num_local_experts=4,
            num_experts_per_tok=2,
            hidden_act=act,
        )
        block = MixtralSparseMoeBlock(cfg)
    else:
        cfg = Qwen2MoeConfig(
            hidden_size=hidden,
            moe_intermediate_size=inter,
            shared_expert_intermediate_size=inter,
            num_experts=4,
            num_experts_per_tok=2,
            hidden_act=act,
        )
        block = Qwen2MoeSparseMoeBlock(cfg)
    block = block.double()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return block


def _step(block: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Output and every gradient of one backward pass of a non-linear loss."""
    x = x.clone().requires_grad_()
    block.zero_grad()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    return [out.detach(), x.grad] + [p.grad.clone() for p in block.parameters()]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_fused_experts_compute_what_huggingface_computes(kind: str) -> None:
    """The fused op (and its backward) equals HuggingFace's experts run eagerly, output and
    every gradient, in float64, with uneven routing (random weights send more tokens to
    some experts than to others)."""
    block = _block(kind)
    x = torch.randn(3, 7, 32, dtype=torch.float64)
    eager = _step(block, x)
    with experts_traced(block) as fused_names:
        fused = _step(block, x)
    assert fused_names == ["experts"]
    for a, b in zip(eager, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_experts_the_op_does_not_compute_exactly_are_left_as_written() -> None:
    """An activation the op does not know keeps HuggingFace's module (and its grouped
    matmuls, planned as a replicate fallback the report lists)."""
    assert fusable(_block("mixtral").experts) == "silu"
    assert fusable(_block("mixtral", act="gelu_new").experts) is None
    block = _block("mixtral", act="gelu_new")
    with experts_traced(block) as names:
        assert names == []


def test_fused_experts_flops_are_what_flop_counter_counts_on_the_eager_module() -> None:
    """``FlopCounterMode`` on HuggingFace's eager experts (its per-expert linears) counts
    what the traced fused op counts: ``6 T k I D`` forward and twice that backward, however
    the tokens are routed."""
    from torch.utils.flop_counter import FlopCounterMode

    block = _block("mixtral", hidden=64, inter=96)
    x = torch.randn(5, 9, 64, dtype=torch.float64, requires_grad=True)
    with FlopCounterMode(display=False) as eager:
        block(x).sum().backward()
    with experts_traced(block), FlopCounterMode(display=False) as fused:
        block(x).sum().backward()
    tokens, k, hidden, inter = 45, 2, 64, 96
    router = 2 * tokens * hidden * 4 * 3  # the gate's matmul, forward and its two gradients
    assert eager.get_total_flops() == fused.get_total_flops()
    assert fused.get_total_flops() == router + 3 * 6 * tokens * k * inter * hidden


TWO_MOE = """
import torch
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock


class TwoMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cfg = MixtralConfig(hidden_size={d}, intermediate_size={i}, num_local_experts={e},
                            num_experts_per_tok={k})
        self.layers = torch.nn.ModuleList(MixtralSparseMoeBlock(cfg) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def build_model():
    return TwoMoE()


def example_inputs():
    return (torch.randn({b}, {s}, {d}),)
"""


def _solve_two_moe(tmp_path: Path, overlap: bool = False, **sizes: int):
    """The ILP's training plan of two Mixtral MoE blocks on a 1-D mesh of ``e`` devices,
    by default every collective on the critical path (no overlap: each cost a plain sum)."""
    path = write_model(tmp_path, TWO_MOE.format(**sizes), "two_moe")
    cfg = SolveConfig(
        model_path=path, mesh=MeshSpec.from_options(str(sizes["e"])), mode="train", overlap=overlap
    )
    result = plan_model(cfg)
    fx = {n.name: n.target for n in result.graph.graph_module.graph.nodes}
    modes = {
        n: modes_of(fx[n], s)
        for n, s in result.plan.node_strategy.items()
        if fx.get(n) in EXPERT_OPS
    }
    assert len(modes) == 4  # two layers, forward and backward
    return result, modes


def test_expert_weights_dominate_so_experts_are_sharded_with_all_to_all(tmp_path: Path) -> None:
    """8 experts of 1024 x 2048 (201 MB per layer) on 8 devices, top-1, 32768 tokens:
    replicating the experts would all-reduce 201 MB of gradients per layer, while sending
    each token to its expert moves 4096 rows per device. Every experts op is expert
    parallel, every expert weight is sharded by expert, and the all-to-all time is the
    hand count: per layer and device, forward the counts (8 int64), then 4096 rows of 1024
    floats out and back; backward the counts, 4096 rows of 2049 (token, its gradient, its
    routing weight) out and 4096 of 1025 (their gradients) back."""
    result, modes = _solve_two_moe(tmp_path, d=1024, i=2048, e=8, k=1, b=64, s=512)
    assert set(modes.values()) == {("EP",)}, modes
    plan = result.plan
    for name in ("gate_up_proj", "down_proj"):
        for layer in (0, 1):
            assert plan.parameters[f"layers.{layer}.experts.{name}"] == (Shard(0),)
    n, alpha, bw = 8, 5e-6, 370e9  # the mesh's default link (NCCL on NVLink 4)
    rows = 64 * 512 // n

    def a2a(per_rank_bytes: float) -> float:  # NCCL-style pairwise exchange, by hand
        return (n - 1) * alpha + (n - 1) / n * per_rank_bytes / bw

    counts = a2a(8 * 8)
    forward = counts + 2 * a2a(rows * 1024 * 4)
    backward = counts + a2a(rows * 2049 * 4) + a2a(rows * 1025 * 4)
    assert plan.comm_s["all_to_all"] == pytest.approx(2 * (forward + backward), rel=1e-9)
    assert dict(plan.own_steps) == {
        ("forward", "all_to_all", 0): 6,
        ("backward", "all_to_all", 0): 6,
    }


def test_the_token_exchange_hides_no_collective(tmp_path: Path) -> None:
    """With overlap, a collective hides under compute, at most a second per second
    (``autoshard.cost.overlap``). The token exchange is communication: nothing hides under
    it. In the expert-parallel plan, what hides is no more than the compute, and the step
    is compute + optimizer + every collective - hidden, the exchange included."""
    result, modes = _solve_two_moe(tmp_path, overlap=True, d=1024, i=2048, e=8, k=1, b=64, s=512)
    plan = result.plan
    assert ("EP",) in modes.values(), modes
    assert plan.hidden_total_s <= plan.compute_s * (1 + 1e-9)
    assert plan.step_time_s == pytest.approx(
        plan.compute_s + plan.optimizer_s + plan.comm_total_s - plan.hidden_total_s
    )


def test_tokens_dominate_so_experts_stay_whole(tmp_path: Path) -> None:
    """8 small experts (64 x 64, 393 kB per layer) and 32768 tokens, top-2: moving tokens
    costs more than reducing the experts' gradients, so every experts op is data parallel,
    the experts are replicated and nothing is exchanged."""
    result, modes = _solve_two_moe(tmp_path, d=64, i=64, e=8, k=2, b=64, s=512)
    assert set(modes.values()) == {("DP",)}, modes
    assert not result.plan.own_steps
    assert "all_to_all" not in result.plan.comm_s


@pytest.mark.slow
def test_expert_parallel_plan_trains_like_one_device_on_4_ranks(tmp_path: Path) -> None:
    """The small Mixtral-style model (4 experts, top-2) solved on a 1-D mesh of 4 with no
    latency and no overlap, where moving tokens beats reducing gradients: the experts are
    sharded by expert and tokens exchanged by all-to-all. Launched with ``--check --train``
    on 4 gloo ranks: every all-to-all the plan predicted ran (``all_to_all_single``, which
    gloo has), and loss, gradients and parameters match one device running HuggingFace's
    own experts in float64."""
    from test_launch_plan import assert_runs_the_plan, observed_rows, solve

    model = write_model(tmp_path, MIXTRAL_SMALL, "mixtral_small")
    plan = solve(model, tmp_path, "4", "--intra-node-latency", "0us", "--no-overlap")
    smap = json.loads(plan.read_text())
    assert smap["parameters"]["model.layers.0.mlp.experts.gate_up_proj"] == ["S(0)"]
    own = [r for r in smap["predicted"]["collective_steps"] if r.get("in_op")]
    assert {(r["phase"], r["kind"], r["count"]) for r in own} == {
        ("forward", "all_to_all", 6),
        ("backward", "all_to_all", 6),
    }
    run = ranks(4, str(plan), str(model), "--train", "--check")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    rows = observed_rows(run.stdout)
    assert ("forward", "all_to_all", "d0", 6, 6) in rows, run.stdout
    assert ("backward", "all_to_all", "d0", 6, 6) in rows, run.stdout
    assert_runs_the_plan(run.stdout)
    assert_checked(run.stdout, 1e-9, grads=1e-9, params=1e-6)


@pytest.mark.slow
def test_expert_and_data_parallel_compose_on_a_2x2_mesh(tmp_path: Path) -> None:
    """The kernel the launcher runs, on 4 gloo ranks of a 2x2 mesh (dp, ep), against
    HuggingFace's ``MixtralExperts`` run eagerly on one device (float64): experts split
    over ``ep`` with tokens exchanged there while ``dp`` splits the tokens too (``EP·DP``,
    the Mixtral-8x7B plan's placement), and over ``ep`` for tokens replicated there
    (``EPR·DP``); and ``EP·DP`` with every slot routed to expert 0 or to index ``E`` (which
    HuggingFace skips), so that half the ranks' experts get no row. Every rank's rows, its
    experts' gradients (summed over ``dp``) and the ``Partial`` sums over ``ep`` equal the
    one-device values to 1e-12."""
    from helpers import ROOT, ranks

    out = tmp_path / "worst.json"
    run = ranks(4, str(ROOT / "tests" / "experts_rank.py"), str(out))
    assert run.returncode == 0, run.stderr[-4000:]
    worst = json.loads(out.read_text())
    assert len(worst) == 12, worst
    assert all(v < 1e-12 for v in worst.values()), worst
