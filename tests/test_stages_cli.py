"""``autoshard stages``: layers from repeated blocks, per-layer ILP costs, the stage plan file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from torch.distributed.tensor import Replicate

from autoshard.cli.stages import stages_command
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.pipeline.pricing import (
    STAGE_PLAN_FORMAT,
    layer_map,
    plan_pipeline,
    price_pipeline,
    stage_plan_dict,
)
from autoshard.pipeline.stage_ilp import stage_graph
from autoshard.pipeline.stages import pipeline_step_time
from autoshard.solver.options import SolverOptions
from autoshard.solver.solve import SolveConfig, plan_model, trace

BLOCKS = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(64, 256),)
"""

# No repeated blocks: six differently named layers (the clustering path).
PLAIN = """
import torch
from torch import nn

class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(128, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 256)
        self.d = nn.Linear(256, 256)
        self.e = nn.Linear(256, 256)
        self.f = nn.Linear(256, 128)

    def forward(self, x):
        return self.f(self.e(self.d(self.c(self.b(self.a(x))))))

def build_model():
    return Plain()

def example_inputs():
    return (torch.randn(32, 128),)
"""

R = Replicate()

# Links so fast that the boundary transfers are negligible next to the layers.
FAST = ["--inter-node-bw", "1000TB/s", "--inter-node-latency", "0s"]


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "blocks8.py"
    path.write_text(BLOCKS)
    return path


def _run(*args):
    return CliRunner().invoke(stages_command, [str(a) for a in args])


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
@pytest.mark.parametrize("pp, balance", [(2, [4, 4]), (4, [2, 2, 2, 2])])
def test_identical_blocks_split_evenly(blocks_file, tmp_path, pp, balance):
    result = _run(
        blocks_file, "--mesh", "2x2", "--pp", pp, "--microbatches", 8, *FAST, "--out", tmp_path
    )
    assert result.exit_code == 0, result.output
    path = tmp_path / f"blocks8_2x2_pp{pp}.stages.json"
    data = json.loads(path.read_text())
    assert data["format"] == STAGE_PLAN_FORMAT
    assert data["balance"] == balance
    assert data["pp"] == pp and data["microbatches"] == 8
    stages = data["stages"]
    assert len(stages) == pp
    step = balance[0]
    for s, st in enumerate(stages):
        assert st["layers"] == [s * step, (s + 1) * step]
        assert st["module_paths"] == [f"blocks.{k}" for k in range(s * step, (s + 1) * step)]
        want_split = [f"blocks.{(s + 1) * step}"] if s < pp - 1 else []
        assert st["split_points"] == want_split
        assert st["submesh"] == [1, 4 // pp]
        assert len(st["ranks"]) == 4 // pp
        assert set(st["parameters"]) == {
            f"blocks.{k}.{w}" for k in range(s * step, (s + 1) * step) for w in ("weight", "bias")
        }
        assert st["predicted"]["time_s"] > 0 and st["predicted"]["memory_bytes"] > 0
    assert data["tied_weights_across_stages"] == []
    times = [st["predicted"]["time_s"] for st in stages]
    assert data["step_time_s"] == pytest.approx(pipeline_step_time(times, 8))
    # the table shows every stage side by side
    assert all(f"stage {s}" in result.output for s in range(pp))
    assert str(path) in result.output.replace("\n", "")


@pytest.mark.slow  # two stage searches, 22 stage ILPs in one
def test_torchtitan_s_split_is_priced_alone_as_the_search_prices_it(tmp_path):
    """12 identical blocks, pp=2: ``--split torchtitan`` prices 6 + 6 alone (the
    embedding and head weigh one layer each: 14 = 7 + 7) on a trace reduced within each
    stage, and writes every real block's parameters; the search over every split on a
    trace of every block finds the same split at the same step, stage times and memory.
    (12 blocks, not 16: the same paths, and the search 8 s shorter.)"""
    model = tmp_path / "blocks12.py"
    model.write_text(BLOCKS.replace("range(8)", "range(12)"))
    args = [model, "--mesh", "2x2", "--pp", 2, "--microbatches", 8, *FAST]
    titan = _run(*args, "--split", "torchtitan", "--out", tmp_path / "titan")
    assert titan.exit_code == 0, titan.output
    searched = _run(*args, "--out", tmp_path / "search")
    assert searched.exit_code == 0, searched.output
    a = json.loads((tmp_path / "titan" / "blocks12_2x2_pp2.stages.json").read_text())
    b = json.loads((tmp_path / "search" / "blocks12_2x2_pp2.stages.json").read_text())
    assert a["balance"] == b["balance"] == [6, 6]
    assert "pp=2: 2 stage ILPs (2 stages priced)" in " ".join(titan.output.split())
    assert a["step_time_s"] == pytest.approx(b["step_time_s"], rel=1e-9)
    for st_a, st_b in zip(a["stages"], b["stages"], strict=True):
        assert st_a["module_paths"] == st_b["module_paths"]
        # every real block's parameters; where two placements cost the same the two
        # programs may pick either (blocks.0.weight: S(0) or S(1) on dim 1)
        assert set(st_a["parameters"]) == set(st_b["parameters"])
        for key in ("time_s", "memory_bytes"):
            assert st_a["predicted"][key] == pytest.approx(st_b["predicted"][key], rel=1e-9)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "2x2", "--pp", "3"], "pp=3"),
        (["--mesh", "16", "--pp", "16"], "8 layers into 16 pipeline stages"),
        (["--mesh", "2x2", "--pp", "two"], "--pp"),
        (["--mesh", "2x2", "--pp", "2", "--microbatches", "0"], "microbatches"),
    ],
)
def test_bad_degree_is_one_line_error(blocks_file, tmp_path, args, message):
    result = _run(blocks_file, *args, "--out", tmp_path)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], result.output
    assert "Traceback" not in result.output
    assert not list(tmp_path.glob("*.stages.json"))


@pytest.mark.slow
def test_auto_picks_the_fastest_degree(blocks_file, tmp_path):
    result = _run(blocks_file, "--mesh", "2x2", "--pp", "auto", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    (path,) = tmp_path.glob("*.stages.json")
    data = json.loads(path.read_text())
    tried = data["degrees"]
    assert set(tried) == {"1", "2", "4"}
    best = min(tried, key=lambda k: tried[k])
    assert path.name == f"blocks8_2x2_pp{best}.stages.json"
    assert data["step_time_s"] == pytest.approx(tried[best])


@pytest.fixture(scope="module")
def blocks_graph(blocks_file):
    config = SolveConfig(blocks_file, MeshSpec.from_options("2x2"), mode="infer", tie=False)
    return config, trace(config)


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_one_stage_is_the_whole_model_ilp(blocks_file, mode):
    """pp = 1: the only stage holds every node, receives and sends nothing, and with B = 1
    its graph prices any plan as the whole model's does (same objective for the whole
    model's optimum). The stage ILP ties the stage's identical blocks to one plan, so its
    optimum is the whole model's or, where the first or last block gains from a plan of
    its own, above it."""
    config = SolveConfig(blocks_file, MeshSpec.from_options("2x2"), mode=mode, tie=False)
    graph = trace(config)
    costs = price_pipeline(config, graph, layer_map(graph), 1, microbatches=1)
    whole = plan_model(config)
    assert costs.p2p_time(0, 8) == 0
    untied = stage_graph(whole.sg, set(whole.sg.nodes), config.mesh, tie=False)
    assert evaluate(untied.sg, whole.ilp.choice) == pytest.approx(whole.ilp.objective_s, rel=1e-9)
    gap = config.solver.mip_gap
    assert costs.stage_time(0, 8) >= whole.ilp.objective_s * (1 - gap)


@pytest.mark.parametrize("mode, ways", [("infer", 1), ("train", 2)])
def test_stage_times_on_one_device_are_layers_plus_transfers(blocks_file, mode, ways):
    """pp = 4 on a mesh of 4: every stage has one device, so its plan is its layers'
    compute and its boundaries' transfers of the (64, 256) float32 activation, 64 KiB at
    t = 64 KiB / bandwidth + latency each. In training each boundary carries the
    activation forward and its gradient back (``ways`` = 2). Layers 1..7 are identical,
    so a middle stage of k layers costs k c + 2 ways t; cutting anywhere adds 2 ways t."""
    mesh = MeshSpec.from_options("4")
    config = SolveConfig(blocks_file, mesh, mode=mode, tie=False)
    graph = trace(config)
    costs = price_pipeline(config, graph, layer_map(graph), 4, microbatches=1)
    t = 64 * 256 * 4 / mesh.bandwidth[0] + mesh.latency[0]
    assert costs.p2p_time(0, 3) == pytest.approx(ways * t)
    assert costs.p2p_time(3, 5) == pytest.approx(2 * ways * t)
    assert costs.p2p_time(5, 8) == pytest.approx(ways * t)
    c = costs.stage_time(1, 2) - 2 * ways * t
    assert c > 0
    assert costs.stage_time(2, 5) == pytest.approx(3 * c + 2 * ways * t)
    assert costs.stage_time(0, 3) + costs.stage_time(3, 8) == pytest.approx(
        costs.stage_time(0, 8) + 2 * ways * t
    )


def test_chosen_split_is_no_slower_than_the_even_one(blocks_graph):
    """With real (slow, 20 us) inter-node links the transfers dominate these tiny blocks and
    the DP may move layers off the middle stages; it must never lose to the even split."""
    config, graph = blocks_graph
    layers = layer_map(graph)
    result = plan_pipeline(config, graph, layers, 4, 8)
    even = [result.costs.stage_time(2 * s, 2 * s + 2) for s in range(4)]
    assert result.stage_plan.step_time_s <= pipeline_step_time(even, 8) * (1 + 1e-12)
    data = stage_plan_dict(graph, layers, result, config.mesh)
    assert sum(data["balance"]) == 8


@pytest.mark.slow
def test_model_without_blocks_is_clustered(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(PLAIN)
    result = _run(path, "--mesh", "2x2", "--pp", "2", *FAST, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "plain_2x2_pp2.stages.json").read_text())
    assert data["layers"]["source"] == "clustering"
    assert sum(data["balance"]) == data["layers"]["count"] >= 2
    paths = [p for st in data["stages"] for p in st["module_paths"]]
    assert paths[0] == "a" and paths[-1] == "f"
    assert data["stages"][0]["split_points"] and data["stages"][1]["split_points"] == []


# Five blocks of one class; block 2 has a 6x wider hidden layer (about 6x the FLOPs).
HEAVY_MIDDLE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(1024, hidden)
        self.down = nn.Linear(hidden, 1024)

    def forward(self, x):
        return self.down(self.up(x))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(6144 if k == 2 else 1024) for k in range(5))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x

def build_model():
    return Net()

def example_inputs():
    return (torch.randn(2048, 1024),)
"""


def test_heavy_block_gets_a_stage_of_its_own(tmp_path):
    """Layer times about [1, 1, 6, 1, 1] on 3 stages: [2, 1, 2] is the only split whose
    bottleneck is the heavy block alone."""
    path = tmp_path / "heavy.py"
    path.write_text(HEAVY_MIDDLE)
    fast = ["--intra-node-bw", "1000TB/s", "--intra-node-latency", "0s"]
    result = _run(path, "--mesh", "3", "--pp", "3", "--microbatches", 4, *fast, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "heavy_3_pp3.stages.json").read_text())
    assert data["balance"] == [2, 1, 2]
    assert data["stages"][1]["module_paths"] == ["blocks.2"]
    assert data["stages"][0]["split_points"] == ["blocks.2"]


@pytest.mark.slow
def test_stage_memory_budget_shards_the_stage(blocks_file, tmp_path):
    """Training on 2x2, pp = 2: a stage of 4 blocks keeps 4 x 16 B per weight element
    (parameter, gradient, two AdamW moments: 4 MiB replicated) plus the activations of
    min(pp, B) = 2 micro-batches. Unconstrained (within the 5% gap), its ILP shards weights
    over the stage's 2 devices (the AdamW step of a shard costs half). A budget between the
    least memory any plan of the stage reaches and that plan's forces a smaller plan, no
    faster; under 1 MiB no stage fits and the error names the least memory of the best
    split."""
    mesh = MeshSpec.from_options("2x2")
    # a budget that binds makes the MIP prove a knapsack-like bound: 5% is plenty here
    base = SolveConfig(
        blocks_file, mesh, mode="train", tie=False, solver=SolverOptions(mip_gap=0.05)
    )
    graph = trace(base)

    def stage(budget):
        config = dataclasses.replace(base, memory_budget=budget)
        return price_pipeline(config, graph, layer_map(graph), 2, microbatches=8)

    free = stage(None)
    free_s, free_bytes = free.stage_time(0, 4), free.stage_memory(0, 4)
    assert any(ps[1] != R for ps in free.stage_parameters(graph, 0, 4).values())
    least = stage(1024).pricer.price(0, 4).memory_bytes  # infeasible: the least memory
    assert 0 < least <= free_bytes * (1 + 1e-9)
    if least < free_bytes:
        budget = (least + free_bytes) / 2
        tight = stage(budget)
        assert tight.stage_memory(0, 4) <= budget
        assert tight.stage_time(0, 4) >= free_s * (1 - 0.05)
        tight.stage_parameters(graph, 0, 4)  # a plan, within the budget

    result = _run(
        blocks_file, "--mesh", "2x2", "--pp", 2, "--memory-budget", "1MiB", "--out", tmp_path
    )
    assert result.exit_code == 2
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert "fits the memory budget of 1.00 MiB" in line and "fullest stage" in line


@pytest.mark.slow  # over 5 s: the fast tier stays under 2 minutes
def test_a_stage_hides_no_more_of_a_scaled_gradient_than_it_costs(blocks_file):
    """A stage's gradient reductions are priced at ``sync_scale`` of a step (one micro-batch
    of several); what may hide of each must be scaled alike, or the stage's ILP would be
    paid for communicating (hiding more than the edge costs)."""
    config = SolveConfig(blocks_file, MeshSpec.from_options("2x2"), mode="train", tie=False)
    whole = plan_model(config)
    sinks = [n for n in whole.sg.nodes if n.startswith("output")]
    stage = stage_graph(
        whole.sg, set(whole.sg.nodes), config.mesh, sync_scale=0.25, sync_sinks=sinks
    )
    scaled = 0
    for e in stage.sg.edges:
        if not e.hide:
            continue
        hideable = e.cost * sum(e.hide_share(w) for w in e.hide)
        finite = np.isfinite(e.cost)
        assert np.all(hideable[finite] <= e.cost[finite] * (1 + 1e-12) + 1e-18)
        scaled += e.consumer in sinks and np.any(e.cost[finite] > 0)
    assert scaled
