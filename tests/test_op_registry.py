"""A custom op added in one file (``tests/data/custom_op/center_op.py``: the op, its
per-mesh-dim strategies, its in-op all-reduce and its launch kernel) is planned, priced,
reported and launched like autoshard's own ops.

Independent references: the ring all-reduce formula worked by hand (NCCL tests,
PERFORMANCE.md: ``2 (n - 1) (alpha + B / (n bw))``), the counts the launcher sees
(CommDebugMode and the per-mesh-dim log of torch's functional collectives), and a
single-device run in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, autoshard_cli, ranks
from test_launch_plan import LOWERED_OK, STEP2_OK, assert_runs_the_plan
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard.cost.mesh import MeshSpec
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.plan.report import in_op_line, in_op_summary
from autoshard.strategies.registry import DimChoice, register_op_rule
from autoshard.strategies.rules import op_rule, op_rules
from autoshard.strategies.strategy import Strategy
from autoshard.trace.tracer import TensorInfo

MODEL = ROOT / "tests" / "data" / "custom_op" / "centered_mlp.py"
BATCH, D = 8192, 64
ALPHA, BW = 10e-9, 450e9  # --intra-node-latency 10ns, the default NVLink bandwidth
SOLVE = ("--mesh", "4", "--intra-node-latency", "10ns")


@pytest.fixture(scope="module")
def center():
    """The op, registered by importing the model file (which imports its op file)."""
    load_model_file(MODEL)
    return torch.ops.toy.center.default


def _ring_all_reduce(n: int, nbytes: float) -> float:
    return 2 * (n - 1) * (ALPHA + nbytes / (n * BW))


def test_the_op_file_s_choices_are_multiplied_over_the_mesh_dims(center):
    """3 choices per dim on a 2 x 2 mesh: 9 strategies, dim 0 outermost; an all-reduce of
    the local column sums (D / 2 columns where the other dim splits them) per ``S0`` dim."""
    rule = op_rule(center)
    assert rule is not None and rule in op_rules() and rule.kernel is not None
    x = TensorInfo((BATCH, D), torch.float32)
    node = type("Node", (), {"target": center, "args": (), "kwargs": {}})()
    strategies = rule.generate(node, [x], [x], (2, 2))
    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    names = {"R": r, "S0": s0, "S1": s1}
    combos = [(a, b) for a in names for b in names]
    assert len(strategies) == 9
    for (a, b), s in zip(combos, strategies, strict=True):
        want = (names[a], names[b])
        assert s.inputs == (want,) and s.outputs == (want,)
        cols = D // (2 if "S1" in (a, b) else 1)
        assert s.collectives == tuple(
            ("all_reduce", d, float(cols * 4)) for d, m in enumerate((a, b)) if m == "S0"
        )
        assert rule.modes(node, [x], [x], s) == (a, b)
    with pytest.raises(ValueError, match="which none of its rule's choices does"):
        rule.modes(node, [x], [x], Strategy(((s0, s1),), ((s1, s0),)))


def test_a_second_file_cannot_claim_the_op(center):
    def other(node, args, results):
        return [DimChoice("R", (Replicate(),), (Replicate(),))]

    with pytest.raises(ValueError, match="has an op rule already, from .*center_choices"):
        register_op_rule(center)(other)
    assert op_rule(center).per_dim.__name__ == "center_choices"


def test_the_in_op_all_reduce_is_planned_priced_and_reported(center):
    """Data parallel wins (narrow weights, 8192 rows), so the centering runs batch-split on
    the 4 devices in the forward and the backward: one all-reduce of D fp32 column sums
    each, priced by the ring formula by hand, counted as in-op steps of each phase, and
    named in the report."""
    loaded = instantiate(load_model_file(MODEL), device="meta")
    mesh = MeshSpec.from_options("4", intra_node_latency=ALPHA, intra_node_bw=BW)
    plan = autoshard.solve(loaded.module, loaded.inputs, mesh).plan
    one = _ring_all_reduce(4, D * 4)
    assert in_op_summary(plan) == {
        "toy.center.default": {
            "nodes": 2,
            "modes": {"d0: S0": 2},
            "collectives": {"all_reduce": 2},
            "seconds": pytest.approx(2 * one, rel=1e-12),
            "exposed_seconds": pytest.approx(2 * one, rel=1e-12),  # nothing hides it
        }
    }
    assert dict(plan.own_steps) == {
        ("forward", "all_reduce", 0): 1,
        ("backward", "all_reduce", 0): 1,
    }
    assert plan.comm_s["all_reduce"] >= 2 * one
    line = in_op_line(plan)  # the text report's line
    assert line.startswith("collectives inside ops: toy.center.default x2 (d0: S0 x2): 2 all-")


@pytest.mark.slow
def test_the_custom_op_launches_on_4_gloo_ranks_as_planned(tmp_path: Path):
    """Its kernel runs on each rank's rows, all-reduces the column sums over the mesh dim:
    the collectives seen equal the plan's per phase, kind and mesh dim (the in-op ones
    among them), the lowered step records them, and loss, gradients and parameters equal
    one device's."""
    out = autoshard_cli("solve", str(MODEL), *SOLVE, "--out", str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["in_op_collectives"]["toy.center.default"]["nodes"] == 2
    plan = next(tmp_path.glob("*.json"))
    run = ranks(4, str(plan), str(MODEL), "--train", "--check", "--steps", "2")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert_runs_the_plan(run.stdout)
    assert LOWERED_OK in run.stdout and STEP2_OK.search(run.stdout), run.stdout


INLINE_RULE = """
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from autoshard.strategies.registry import DimChoice, register_op_rule

if not hasattr(torch.ops.toy, "double"):
    @torch.library.custom_op("toy::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    @double.register_fake
    def _(x):
        return torch.empty_like(x)


@register_op_rule(torch.ops.toy.double.default)
def double_choices(node, args, results):
    return [DimChoice("R", (Replicate(),), (Replicate(),))]


def build_model():
    return nn.Linear(4, 4)


def example_inputs():
    return (torch.randn(8, 4),)
"""


def test_a_model_file_that_defines_its_own_rule_loads_twice(tmp_path: Path):
    """Each load runs the file under a new module name; the rule is the same file's, so
    the second load replaces it rather than clash with it."""
    path = tmp_path / "inline_rule.py"
    path.write_text(INLINE_RULE)
    load_model_file(path)
    first = op_rule(torch.ops.toy.double.default)
    load_model_file(path)
    second = op_rule(torch.ops.toy.double.default)
    assert first is not second and second.per_dim.__qualname__ == "double_choices"


def test_attention_with_a_batch_of_one_names_its_modes():
    """Batch 1: the batch split places every tensor as replication does, so the builder
    keeps one of the two strategies; the launcher still names each dim's mode."""
    from autoshard.trace.attention import FLASH_FORWARD

    rule = op_rule(FLASH_FORWARD)
    q = TensorInfo((1, 4, 16, 8), torch.float32)
    lse = TensorInfo((1, 4, 16), torch.float32)
    node = type("Node", (), {"target": FLASH_FORWARD, "args": (), "kwargs": {}})()
    strategies = list(dict.fromkeys(rule.generate(node, [q, q, q], [q, lse], (2,))))
    assert [rule.modes(node, [q, q, q], [q, lse], s) for s in strategies] == [("R",), ("S1",)]


def test_an_op_rule_states_its_choices_per_mesh_dim_when_it_has_a_kernel():
    with pytest.raises(ValueError, match="need the choices per mesh dim"):
        register_op_rule(torch.ops.aten.relu.default, whole=True, kernel=lambda *a: None)(
            lambda node, args, results, mesh_shape: []
        )
    assert op_rule(torch.ops.aten.relu.default) is None
