"""Loss parallelism: cross-entropy over logits sharded by vocabulary
(:mod:`autoshard.strategies.loss_parallel`), priced as counted by hand and launched
against one device."""

from __future__ import annotations

import pytest
from helpers import LLAMA_SMALL, ranks, write_model

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import plan_baseline
from autoshard.strategies.rules import op_rule

# torchtitan's loss (tests/data/published/run_env.py): the float32 logits' cross-entropy
CE = """
def loss_fn(out, input_ids):
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
"""
# LLAMA_SMALL with as many key/value heads as query heads, trained with CE
LLAMA_CE = LLAMA_SMALL.replace("num_key_value_heads=2", "num_key_value_heads=4") + CE
BW = 450e9


def _fsdp_tp(tmp_path, mesh: str):
    from test_hand_counts import _config

    path = write_model(tmp_path, LLAMA_CE, "llama_ce")
    spec = MeshSpec.from_options(mesh, None, intra_node_bw=BW, intra_node_latency=0.0)
    return plan_baseline(_config(path, spec, share_reshardings=True), "fsdp_tp").plan


def _modes(plan, target: str) -> list[tuple[str, ...]]:
    """The rule's choice per mesh dim of each ``target`` op of the plan."""
    fx = {n.name: n for n in plan.sg.graph.graph_module.graph.nodes}
    out = []
    for name, s in plan.node_strategy.items():
        info = plan.sg.graph.nodes.get(name)
        if info is not None and str(info.target) == target:
            out.append(op_rule(info.target).modes(fx[name], info.args, info.results, s))
    return out


@pytest.mark.slow
def test_fsdp_tp_s_cross_entropy_runs_on_the_vocabulary_shards(tmp_path):
    """torchtitan's FSDP + TP with its loss parallelism, on a 2x2 mesh: the LM head is a
    column and its logits stay sharded by vocabulary through the loss (``V`` on the TP
    dim for the four cross-entropy ops, the rows batch-sharded on dp), with no
    all-to-all anywhere. Over TP the forward's log-softmax all-reduces each row's
    maximum and its sum, and the backward's the sum of each row's gradient: one float32
    a row, 8 x 32 tokens over 2 dp ranks, 512 bytes each. The forward's third all-reduce
    over TP is the loss's (a partial sum over the vocabulary blocks)."""
    plan = _fsdp_tp(tmp_path, "2x2")
    ops = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")
    for op in ops:
        assert _modes(plan, f"aten.{op}.default") == [("S0", "V")], op
    own = {
        str(plan.sg.graph.nodes[n].target).split(".")[1]: s.collectives
        for n, s in plan.node_strategy.items()
        if n in plan.sg.graph.nodes and s.collectives
    }
    assert own == {
        "_log_softmax": (("all_reduce", 1, 512.0),) * 2,
        "_log_softmax_backward_data": (("all_reduce", 1, 512.0),),
    }
    steps = plan.collective_steps
    assert not [k for k in steps if k[1] == "all_to_all"], steps
    assert steps[("forward", "all_reduce", 1)] == 2 + 1
    # the backward's: the log-softmax's sum and the five norms' weight gradients
    assert steps[("backward", "all_reduce", 1)] == 1 + 5


@pytest.mark.slow
def test_the_vocabulary_parallel_loss_launches_as_planned_and_trains_like_one_device(tmp_path):
    """The plan above launched on 4 gloo ranks: each cross-entropy op runs its kernel on
    the vocabulary shards, the collectives seen equal the prediction, and two training
    steps match one device (loss, gradients and parameters)."""
    from test_launch_plan import assert_runs_the_plan, solve

    model = write_model(tmp_path, LLAMA_CE, "llama_ce")
    plan = solve(model, tmp_path, "2x2", "--algo", "fsdp_tp")
    out = ranks(4, str(plan), str(model), "--train", "--check", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert_runs_the_plan(out.stdout)
