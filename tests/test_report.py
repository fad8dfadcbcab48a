"""The report says why a repeated block is planned unlike the others (issue 13, item 6)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.plan.plan import build_plan
from autoshard.plan.report import block_differences
from autoshard.solver.solve import SolveConfig, plan_model

GPT2 = Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"


def test_a_block_planted_unlike_the_others_is_named_with_what_it_costs(monkeypatch):
    """A 4-block GPT-2 solved untied (every block planned alike), then block 2's
    c_attn weight planted at its costliest placement: the report names block 2 and prices the
    usual plan there at exactly what the planted change cost (D, by evaluate)."""
    monkeypatch.setenv("AUTOSHARD_LAYERS", "4")
    cfg = SolveConfig(model_path=GPT2, mesh=MeshSpec.from_options("2x4"), mode="infer", tie=False)
    res = plan_model(cfg)
    sg, plan = res.sg, res.plan
    # the premise: every block solved alike, so nothing to explain
    assert len({v for k, v in plan.parameters.items() if k.endswith("attn.c_attn.weight")}) == 1
    assert block_differences(plan) == []
    node = next(
        n
        for n, i in sg.graph.nodes.items()
        if i.kind == "param" and i.fqn == "transformer.h.2.attn.c_attn.weight"
    )
    ns = sg.nodes[node]
    base = evaluate(sg, res.ilp.choice)

    def planted_cost(i: int) -> float:
        return evaluate(sg, {**res.ilp.choice, node: i}) - base

    worse = max(range(len(ns.strategies)), key=planted_cost)  # the costliest placement
    choice = {**res.ilp.choice, node: worse}
    planted = planted_cost(worse)
    assert planted > 0
    lines = block_differences(build_plan(sg, choice, cfg.mesh))
    assert len(lines) == 1
    assert lines[0].startswith("block 2 planned unlike blocks 0-1, 3:"), lines[0]
    from autoshard.units import format_seconds

    assert f"would be {format_seconds(planted)} faster" in lines[0], lines[0]


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
def test_every_replicate_fallback_is_listed_with_the_time_it_carries(tmp_path):
    """Experts the fused op does not cover (here: an activation it does not know,
    ``gelu_new``) stay HuggingFace's grouped matmuls, which have no sharding rule. Under the
    replicated plan nothing is resharded into them, so each op's time is the roofline of its
    whole tensors on one device (FLOPs and bytes from the graph, the H100's datasheet
    numbers); under the ILP's plan the line lists the same ops, each with at least that
    time."""
    from helpers import MIXTRAL_SMALL, write_model

    from autoshard.plan.report import fallback_costs, fallback_line
    from autoshard.solver.solve import plan_baseline

    unfused = MIXTRAL_SMALL.replace("vocab_size=256,", "vocab_size=256, hidden_act='gelu_new',")
    assert unfused != MIXTRAL_SMALL
    cfg = SolveConfig(
        model_path=write_model(tmp_path, unfused, "moe"),
        mesh=MeshSpec.from_options("2x2"),
        mode="train",
    )
    ilp = plan_model(cfg)
    fell = ilp.sg.fallback_ops
    assert any("grouped_mm" in op for op in fell)
    rep = plan_baseline(cfg, "replicate").plan
    graph = rep.sg.graph
    for op, (n, seconds) in fallback_costs(rep).items():
        nodes = [i for i in graph.nodes.values() if str(i.target) == op]
        assert n == len(nodes) == fell[op]
        roofline = sum(
            cfg.device.compute_time(
                i.flops,
                sum(a.nbytes for a in i.args) + sum(r.nbytes for r in i.results if r),
                i.args[0].dtype,
            )
            for i in nodes
        )
        assert seconds == pytest.approx(roofline, rel=1e-9), op
    costs = fallback_costs(ilp.plan)
    assert set(costs) == set(fell)
    line = fallback_line(ilp.plan)
    assert line is not None and all(op in line for op in fell)
    for op, (_, seconds) in costs.items():
        assert seconds >= fallback_costs(rep)[op][1] * (1 - 1e-9)


def test_a_depth_reduced_model_s_last_block_planned_apart_is_reported_not_a_crash(monkeypatch):
    """Issue 27: a 6-block GPT-2 (an ``nn.ModuleList``) traced depth-reduced (blocks 0, 1,
    2 standing for 2-4, and 5), with its last block's parameters placed unlike the others'
    (planted in the plan's parameter map: tied blocks share their strategies, so a solve
    that stops at its time limit is what makes such a plan). The nearest usual block, 4,
    was never traced (``KeyError: 4`` before): it is compared through block 2, which stands
    for it. The strategies did not change, so the line says the two plans cost the same."""
    import dataclasses

    monkeypatch.setenv("AUTOSHARD_LAYERS", "6")
    cfg = SolveConfig(model_path=GPT2, mesh=MeshSpec.from_options("2x4"), mode="infer")
    res = plan_model(cfg)
    plan = res.plan
    assert plan.sg.graph.depth is not None and plan.sg.graph.depth.stands_for[2] == (2, 3, 4)
    assert block_differences(plan) == []
    name = "transformer.h.5.attn.c_attn.weight"
    from torch.distributed.tensor import Replicate, Shard

    candidates = [(Replicate(), Replicate()), (Shard(0), Replicate()), (Replicate(), Shard(0))]
    other = next(ps for ps in candidates if ps != tuple(plan.parameters[name]))
    planted = dataclasses.replace(plan, parameters={**plan.parameters, name: other})
    lines = block_differences(planted)
    assert lines == [
        "block 5 planned unlike blocks 0-4: the plan of blocks 0-4 there would cost the same "
        "(the two are equally fast here)"
    ], lines

    # a swap that cannot be priced (a Shard into Partial edge costs math.inf) is said so,
    # never "would add inf s" (seen on --mesh 1, where every placement is the whole tensor)
    import math

    import autoshard.cost.objective as objective

    real = objective.evaluate
    calls = iter([real, lambda sg, choice: math.inf])
    monkeypatch.setattr(objective, "evaluate", lambda sg, choice: next(calls)(sg, choice))
    lines = block_differences(planted)
    assert lines == [
        "block 5 planned unlike blocks 0-4: the plan of blocks 0-4 does not join this block's "
        "neighbours here (no priced redistribution between them), so it cannot be compared"
    ], lines


def test_the_activation_table_shows_megatron_s_column_and_row_outputs(monkeypatch):
    """The activations of one block under the Megatron plan, as Shoeybi et al. 2019 (section
    3) define it on a 2x4 mesh (dp, tp): the column-parallel matmuls (c_attn, c_fc) give
    outputs split on their feature dim over tp, the row-parallel ones (c_proj) partial sums
    over tp; the residual stream enters and leaves the block whole on tp; the batch is split
    over dp throughout. Local shapes: GPT-2's batch 8 x 1024 tokens over dp 2, features
    2304 and 3072 over tp 4."""
    from rich.console import Console

    from autoshard.plan.report import activation_table
    from autoshard.solver.solve import plan_baseline

    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    cfg = SolveConfig(model_path=GPT2, mesh=MeshSpec.from_options("2x4"), mode="infer")
    console = Console(width=200, record=True)
    console.print(activation_table(plan_baseline(cfg, "megatron").plan))
    rows = {}
    for line in console.export_text().splitlines():
        cells = [c.strip() for c in line.split("│") if c.strip()]
        if len(cells) == 4:
            rows.setdefault(cells[0], []).append(cells[2:])
    assert rows["attn.c_attn"] == [["S(0)·S(1)", "(4096, 576)"]]
    assert rows["mlp.c_fc"] == [["S(0)·S(1)", "(4096, 768)"]]
    assert rows["attn.c_proj"] == rows["mlp.c_proj"] == [["S(0)·P(sum)", "(4096, 768)"]]
    assert rows["block input"] == rows["block output"] == [["S(0)·R", "(4, 1024, 768)"]]


def test_an_mfu_over_100_percent_says_the_count_has_the_masked_half():
    """FlopCounterMode counts a causal attention's whole ``S x S`` product; at 131k
    tokens a zig-zag ring plan computes about half of it, and the MFU the count implies
    passes 100% (docs/performance.md's flagship: 116%). The line says why; at 83% it
    says nothing more."""
    from types import SimpleNamespace

    from autoshard.plan.report import flops_line

    mesh = SimpleNamespace(num_devices=64)
    over = SimpleNamespace(step_flops=2.99e17, mfu=1.161, peak_flops=989.5e12, mesh=mesh)
    under = SimpleNamespace(step_flops=2.99e17, mfu=0.831, peak_flops=989.5e12, mesh=mesh)
    assert "MFU 116.1%" in flops_line(over) and "masked half" in flops_line(over)
    assert "MFU 83.1%" in flops_line(under) and "masked" not in flops_line(under)


def test_the_time_table_says_what_hidden_means_when_a_plan_hides(monkeypatch):
    """A training plan of a 2-block GPT-2 on 2x4 hides its gradient reductions: the time
    table's caption says that "hidden" is what the overlap saves, with the compute beside a
    collective 18.9% slower (Lee et al.); a plan that hides nothing has no caption."""
    from rich.console import Console

    from autoshard.plan.report import cost_table

    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    cfg = SolveConfig(model_path=GPT2, mesh=MeshSpec.from_options("2x4"), mode="train")
    plan = plan_model(cfg).plan
    assert plan.hidden_total_s > 0
    console = Console(width=200, record=True)
    console.print(cost_table(plan))
    assert "runs 18.9% slower (Lee et al., arXiv 2507.03114)" in console.export_text()
    none = cost_table(dataclasses.replace(plan, hidden_s={}))
    assert none.caption is None
