"""A recomputed block's parameter gathers are its backward's, as FSDP2 runs them
(autoshard.trace.rerun_reads).

FSDP2 with activation checkpointing inside ``fully_shard`` gathers each block's
parameters twice per step, as without checkpointing: the recomputation runs in the
backward's gather. The reference is FSDP2 itself (``fully_shard`` and
``torch.utils.checkpoint`` of torch 2.13, counted by ``CommDebugMode``), run here on gloo
ranks; autoshard's FSDP plan must price and launch the same number of gathers with and
without checkpointing, and its recomputation must cost the recomputed compute alone.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from helpers import LLAMA_SMALL, ranks
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cost.checkpointing import rerun_refund
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.solver.baselines import plan_for_algo
from autoshard.solver.cvx import compile_program
from autoshard.solver.highs import run
from autoshard.solver.ilp import SCALE, _statement, build_problem
from autoshard.solver.solve import SolveConfig, strategies, trace
from autoshard.trace.rerun_reads import (
    carried,
    chain_dims,
    one_input_chain,
    shared_rerun_reads,
    takes_back,
)


def _graph(tmp_path: Path, checkpointing: str = "full", mesh: str = "4"):  # noqa: ANN202
    path = tmp_path / "llama_small.py"
    path.write_text(LLAMA_SMALL)
    mesh = MeshSpec.from_options(mesh, None)
    config = SolveConfig(
        model_path=path, mesh=mesh, mode="train", activation_checkpointing=checkpointing
    )
    return strategies(config, trace(config)), mesh


@pytest.mark.slow
def test_each_block_parameter_read_pairs_with_its_backward_read(tmp_path):
    """The 2-layer Llama: each block reads 9 parameters in its forward (7 projections
    through ``t(W)``, 2 norm weights as they are), and each pairs with its backward's read
    of the same parameter (``t(t(W))`` for a projection, the weight itself for a norm)."""
    sg, _ = _graph(tmp_path)
    pairs = shared_rerun_reads(sg.graph)
    nodes = sg.graph.nodes
    for layer in (0, 1):
        mine = [p for p in pairs.values() if nodes[p.forward[1]].layer == layer]
        assert len(mine) == 9
        kinds = Counter()
        for p in mine:
            assert nodes[p.backward[1]].backward and nodes[p.backward[1]].layer == layer
            assert nodes[one_input_chain(sg.graph, p.forward[0])[-1]].kind == "param"
            assert p.forward[0] in one_input_chain(sg.graph, p.backward[0])
            kinds[(nodes[p.forward[0]].kind, len(p.chain))] += 1
        assert kinds == {("op", 1): 7, ("param", 0): 2}, kinds
        # a projection's backward reads t(t(W)): its dims are the weight's, swapped
        # twice back to (0, 1) seen from the forward's t(W); a norm weight's are ()
        for p in mine:
            want = (1, 0) if p.chain else ()
            assert chain_dims(sg.graph, p.chain) == p.dims == want, (p, want)
    assert len(sg.rerun_pairs) == 18  # as pairs of edges: 2 blocks, none tied


def test_a_shard_is_carried_to_the_dim_it_is_through_the_chain():
    """Worked by hand: through ``t`` (dims (1, 0)) a Shard(0) is the other tensor's
    Shard(1); Replicate and Partial stay; a viewing chain (None) carries no shard. The
    take-back needs both reads to move and the forward's placements carried to the
    backward's: torchtitan's FSDP+TP weight, S(0)·S(1) gathered to R·S(1) in the forward,
    is S(1)·S(0) gathered to R·S(0) in the backward's t(t(W))."""
    S0, S1, R = Shard(0), Shard(1), Replicate()
    assert carried((S0, S1), (1, 0)) == (S1, S0)
    assert carried((R, Partial()), None) == (R, Partial())
    assert carried((S0,), None) is None
    assert carried((S0, S1), ()) == (S0, S1)
    assert takes_back((S0, S1), (R, S1), (S1, S0), (R, S0), (1, 0))
    assert not takes_back((S0, S1), (R, S1), (S1, S0), (R, S1), (1, 0))  # not carried
    assert not takes_back((R, S1), (R, S1), (R, S0), (R, S0), (1, 0))  # nothing moves
    # all replicated (FSDP): the produced placements need not be carried
    assert takes_back((S0,), (R,), (S0,), (R,), (1, 0))
    assert takes_back((S0,), (R,), (S1,), (R,), None)
    # short of that they must be: the backward's own move is the one the launcher runs
    assert not takes_back((S0, S1), (R, S1), (S0, S0), (R, S0), (1, 0))
    assert not takes_back((S0, S1), (R, S1), (S0, S1), (R, S0), None)


def test_fsdp_tp_recomputation_gathers_nothing_over_dp(tmp_path):
    """torchtitan's FSDP+TP on a 2x2 mesh (dp x tp) with every block recomputed: as
    FSDP2 under ``torch.utils.checkpoint`` runs it, the recomputation takes the backward's
    dp gathers (none in the recompute phase on mesh dim 0), and the forward's and the
    backward's collectives are the plan without checkpointing's, one for one. The tp
    collectives of the rerun block are the recomputation's own."""
    sg, mesh = _graph(tmp_path, mesh="2x2")
    plan, _ = plan_for_algo(sg, "fsdp_tp", mesh)
    assert plan.recomputed_blocks == [0, 1]
    rerun = {k: v for k, v in plan.collective_steps.items() if k[0] == "recompute"}
    assert rerun and all(k[2] == 1 for k in rerun), rerun
    plain_sg, _ = _graph(tmp_path, "none", mesh="2x2")
    plain, _ = plan_for_algo(plain_sg, "fsdp_tp", mesh)
    assert {k: v for k, v in plan.collective_steps.items() if k[0] != "recompute"} == dict(
        plain.collective_steps
    )


def test_fsdp_recomputation_costs_its_compute_and_gathers_nothing(tmp_path):
    """FSDP with every block recomputed: the recomputation's price is the block forward's
    compute alone (summed here from each op's own cost, not through the checkpointing
    model), and the plan counts no collective in the recompute phase: its collectives are
    the plan without checkpointing's, one for one."""
    sg, mesh = _graph(tmp_path)
    plan, _ = plan_for_algo(sg, "fsdp", mesh)
    blocks = [b for b in sg.checkpointing.blocks if b.policy == "full"]
    compute = 0.0
    for b in blocks:
        for n in b.forward:
            ns = sg.nodes[n]
            compute += float(ns.compute_s[ns.choice[plan.choice[ns.rep]]]) / sg.graph.mult(n)
    assert plan.recomputed_blocks == [0, 1]
    assert plan.recompute_s == pytest.approx(compute, rel=1e-12)
    gathers = sum(rerun_refund(sg, plan.choice, b.layer, False) for b in blocks)
    assert gathers > 0  # what the three-gather price paid, per step
    assert not [k for k in plan.collective_steps if k[0] == "recompute"]
    plain_sg, _ = _graph(tmp_path, "none")
    plain, _ = plan_for_algo(plain_sg, "fsdp", mesh)
    assert plan.collective_steps == plain.collective_steps


@pytest.mark.parametrize(("mesh", "algo"), [("4", "fsdp"), ("2x2", "fsdp_tp")])
def test_the_ilp_prices_the_take_back_as_the_plan_does(tmp_path, mesh, algo):
    """The ILP's own objective (HiGHS's, over its columns) at the FSDP (and FSDP+TP) plan
    with every block recomputed equals the plan's predicted step, which takes the gathers
    back; the program has a take-back column for each paired read (18) and placement."""
    sg, mesh = _graph(tmp_path, mesh=mesh)
    plan, _ = plan_for_algo(sg, algo, mesh)
    prob = build_problem(sg)
    assert prob.recompute.n_u >= len(sg.rerun_pairs) == 18
    milp = compile_program(*_statement(prob))
    for r, i in plan.choice.items():  # pin x to the plan
        lo = prob.offsets[r]
        milp.col_lower[lo : lo + len(sg.nodes[r].strategies)] = 0.0
        milp.col_upper[lo : lo + len(sg.nodes[r].strategies)] = 0.0
        milp.col_lower[lo + i] = milp.col_upper[lo + i] = 1.0
    found = run(milp, mip_rel_gap=0.0)
    assert found.status == "optimal"
    price = evaluate(sg, plan.choice, plan.recompute)
    assert price == pytest.approx(plan.step_time_s, rel=1e-12)
    assert found.objective / SCALE == pytest.approx(price, rel=1e-9)


FSDP2 = textwrap.dedent(
    """
    import os

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.utils.checkpoint import checkpoint

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ac = os.environ["AC"] == "1"


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))


    class Wrapped(nn.Module):  # torchtitan: checkpoint inside fully_shard
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            if ac:
                return checkpoint(self.block, x, use_reentrant=False)
            return self.block(x)


    model = nn.Sequential(*[Wrapped(Block()) for _ in range(4)])
    for w in model:
        fully_shard(w)
    fully_shard(model)
    x = torch.randn(8, 64)
    model(x).sum().backward()  # warm-up
    with CommDebugMode() as comm:
        model(x).sum().backward()
    if dist.get_rank() == 0:
        counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
        print("COUNTS", sorted(counts.items()))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_fsdp2_gathers_as_often_with_checkpointing_and_so_does_the_launch(tmp_path):
    """The reference: FSDP2 on 2 gloo ranks, 4 blocks, gathers 2 per block per step with
    and without checkpointing (and reduce-scatters once per block). autoshard's FSDP plan
    of the 2-layer Llama with every block recomputed launches on 4 gloo ranks with the
    collectives it predicts (none in the recompute phase), and trains like one device."""
    script = tmp_path / "fsdp2_ac.py"
    script.write_text(FSDP2)
    seen = {}
    for ac in ("0", "1"):
        out = ranks(2, str(script), AC=ac)
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("COUNTS"))
        seen[ac] = line
    assert seen["0"] == seen["1"], seen
    # c10d's all-gather and reduce-scatter ops, as CommDebugMode names them on gloo
    assert seen["1"] == "COUNTS [('_allgather_base_', 8), ('_reduce_scatter_base_', 4)]", seen

    from test_launch_plan import assert_runs_the_plan, observed_rows, solve

    model = tmp_path / "llama_small.py"
    model.write_text(LLAMA_SMALL)
    plan = solve(model, tmp_path, "4", "--algo", "fsdp", "--activation-checkpointing", "full")
    predicted = json.loads(plan.read_text())["predicted"]
    assert predicted["recomputed_blocks"] == [0, 1]
    phases = Counter(r["phase"] for r in predicted["collective_steps"])
    assert "recompute" not in phases
    out = ranks(4, str(plan), str(model), "--train", "--check", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert not [r for r in observed_rows(out.stdout) if r[0] == "recompute"], out.stdout
    assert_runs_the_plan(out.stdout)
    # FSDP+TP (2x2): the backward replays t on the recomputation's (R, S(1)) copy; what
    # runs over dp (mesh dim 0) in the recompute phase must be nothing, as predicted
    plan = solve(model, tmp_path, "2x2", "--algo", "fsdp_tp", "--activation-checkpointing", "full")
    predicted = json.loads(plan.read_text())["predicted"]
    assert not [
        r for r in predicted["collective_steps"] if r["phase"] == "recompute" and r["mesh_dim"] == 0
    ]
    out = ranks(4, str(plan), str(model), "--train", "--check", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert not [
        r for r in observed_rows(out.stdout) if r[0] == "recompute" and r[2] in ("0", "dp")
    ], out.stdout
    assert_runs_the_plan(out.stdout)
