"""Preloading a stored solution onto a freshly traced graph (autoshard.solver.preload).

One 2-layer GPT-2 is solved on a 2x4 mesh and written with the export functions, as
`autoshard solve` writes it; every test maps that file (or a tampered copy) onto the
same model or onto a 4-layer GPT-2 traced afresh.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import dill
import pytest
from torch.distributed.tensor import Replicate, Shard

from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.plan.export import write_outputs
from autoshard.plan.formats import load_solution
from autoshard.plan.plan import build_plan
from autoshard.solver.preload import MAX_LISTED, choice_from_solution, plan_preloaded
from autoshard.solver.solve import SolveConfig, plan_model, strategies, trace

GPT2 = Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"
MESH = MeshSpec.from_options("2x4")


def _config() -> SolveConfig:
    return SolveConfig(model_path=GPT2, mesh=MESH, mode="infer", tie=False)


@pytest.fixture(scope="module")
def solved(tmp_path_factory):
    """(SolveResult of a 2-layer GPT-2 on 2x4, path of its solution pickle, loaded solution)."""
    out = tmp_path_factory.mktemp("solutions")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSHARD_LAYERS", "2")
        config = _config()
        result = plan_model(config)
    pkl, _ = write_outputs(result.plan, out, "gpt2_2x4", config.cost_model(), result.solver_stats())
    return result, pkl, load_solution(pkl)


@pytest.fixture(scope="module")
def sg4():
    """The strategy graph of a 4-layer GPT-2 on 2x4, traced afresh."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSHARD_LAYERS", "4")
        config = _config()
        return strategies(config, trace(config))


def _layer_nodes(sg, layers) -> int:
    return sum(1 for n in sg.nodes if n in sg.graph.nodes and sg.graph.nodes[n].layer in layers)


def _relative_params(graph, params: dict, layer: int) -> dict:
    """Parameters of block ``layer``, keyed by FQN relative to the block prefix."""
    prefix = next(p for p, i in graph.block_prefixes.items() if i == layer) + "."
    return {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}


def _stored_with_placements(sg, solution, pred):
    """First stored node (graph order) that has placements and satisfies ``pred(name)``."""
    return next(
        n
        for n, e in solution["nodes"].items()
        if (e["args"] or e["results"]) and n in sg.nodes and pred(n)
    )


# -- same model -----------------------------------------------------------------------


@pytest.mark.slow
def test_same_model_gives_the_solved_choice_and_objective(solved):
    result, _, solution = solved
    sg = result.sg
    pre = choice_from_solution(sg, solution, MESH)
    assert pre.choice == result.ilp.choice
    assert pre.filled == 0 and pre.dropped == 0 and pre.sources == {}
    assert pre.matched == len(sg.nodes)
    assert evaluate(sg, pre.choice) == pytest.approx(result.ilp.objective_s, rel=1e-12)
    assert evaluate(sg, pre.choice) == pytest.approx(solution["objective_s"], rel=1e-12)
    plan = build_plan(sg, pre.choice, MESH)
    assert plan.parameters == solution["parameters"]
    assert plan.inputs == solution["inputs"]


@pytest.mark.slow
def test_plan_preloaded_traces_and_reports_the_stored_plan(solved, monkeypatch):
    result, pkl, solution = solved
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    res, pre = plan_preloaded(_config(), pkl)
    assert res.ilp.status == "preloaded"
    assert res.ilp.choice == pre.choice
    # the solve tied its layers, the preload does not: compare the plans, not the variables
    assert res.plan.parameters == result.plan.parameters
    assert res.plan.inputs == result.plan.inputs
    assert res.plan.step_time_s == pytest.approx(solution["objective_s"], rel=1e-9)
    assert res.ilp.objective_s == pytest.approx(solution["objective_s"], rel=1e-12)
    assert set(res.seconds) >= {"trace", "strategies", "preload", "total"}


# -- more and fewer layers --------------------------------------------------------------


@pytest.mark.slow
def test_four_layers_fill_blocks_2_and_3_from_an_identical_block(solved, sg4):
    _, _, solution = solved
    pre = choice_from_solution(sg4, solution, MESH)
    assert set(pre.choice) == set(sg4.reps)
    assert pre.filled == _layer_nodes(sg4, {2, 3}) > 0
    assert pre.matched == len(sg4.nodes) - pre.filled
    assert pre.sources == {2: 1, 3: 1}
    assert pre.solved == 0  # every node has its counterpart
    assert any("blocks 1-3 as stored block 1" in n for n in pre.notes), pre.notes
    plan = build_plan(sg4, pre.choice, MESH)
    assert plan.step_time_s == pytest.approx(evaluate(sg4, pre.choice), rel=1e-9)
    assert plan.step_time_s > solution["objective_s"]  # two more blocks cost more
    graph = sg4.graph
    # blocks 0-1 and everything outside the blocks (renamed in the bigger graph) as stored
    for fqn, ps in solution["parameters"].items():
        assert plan.parameters[fqn] == ps, fqn
    assert plan.inputs == solution["inputs"]
    out4 = [n for n in sg4.nodes if n.startswith("output.")]
    assert [plan.node_strategy[n].inputs[0] for n in out4] == [
        solution["nodes"]["output"]["args"][f"data_in_{n.rsplit('.', 1)[1]}"] for n in out4
    ]
    # every filled block's parameters are placed as its source block's
    for layer, src in pre.sources.items():
        got = _relative_params(graph, plan.parameters, layer)
        assert got == _relative_params(graph, plan.parameters, src) and got


def test_fewer_layers_drop_the_blocks_the_model_lacks(solved, sg4):
    """A 4-layer solution (exported from the preloaded plan) maps back onto 2 layers."""
    from autoshard.plan.export import solution_dict

    result, _, solution = solved
    plan4 = build_plan(sg4, choice_from_solution(sg4, solution, MESH).choice, MESH)
    stored4 = solution_dict(plan4, {}, {})
    pre = choice_from_solution(result.sg, stored4, MESH)
    assert pre.choice == result.ilp.choice
    dropped = sum(1 for e in stored4["nodes"].values() if e.get("layer") in (2, 3))
    assert pre.dropped == dropped > 0
    assert pre.filled == 0
    assert any(f"{dropped} stored nodes of blocks the model does not have" in n for n in pre.notes)


# -- what does not fit ------------------------------------------------------------------


def test_mesh_shape_mismatch_names_both_shapes(solved):
    result, _, solution = solved
    tampered = copy.deepcopy(solution)
    tampered["mesh"]["shape"] = [4, 2]
    with pytest.raises(AutoshardError, match=r"made for a 4x2 mesh.*mesh is 2x4"):
        choice_from_solution(result.sg, tampered, MESH)


def test_a_preload_onto_another_mesh_shape_is_refused_before_tracing(solved, monkeypatch):
    """``plan_preloaded`` reads the mesh from the file before it traces (minutes on a large
    model): the shape error comes first, and the tracer is never called."""
    from dataclasses import replace

    import autoshard.solver.preload as preload

    _, pkl, _ = solved

    def no_trace(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("traced before the mesh shape was checked")

    monkeypatch.setattr(preload, "trace", no_trace)
    with pytest.raises(AutoshardError, match=r"made for a 2x4 mesh.*mesh is 4x2"):
        plan_preloaded(replace(_config(), mesh=MeshSpec.from_options("4x2")), pkl)


def test_other_links_are_a_note_not_an_error(solved):
    result, _, solution = solved
    slow = MeshSpec.from_options("2x4", inter_node_bw=1e9)
    pre = choice_from_solution(result.sg, solution, slow)
    assert pre.choice == result.ilp.choice
    assert any("solving again may find a faster plan" in n for n in pre.notes)


def test_tampered_shape_names_the_node(solved):
    result, _, solution = solved
    tampered = copy.deepcopy(solution)
    name = next(n for n, e in tampered["nodes"].items() if e["op"] == "aten.addmm.default")
    tampered["nodes"][name]["shapes"]["data_out_0"] = [1, 2, 3]
    with pytest.raises(AutoshardError) as err:
        choice_from_solution(result.sg, tampered, MESH)
    msg = str(err.value)
    assert "shapes that differ (1)" in msg
    assert f"'{name}': data_out_0 [1, 2, 3] in the solution" in msg


def test_placements_that_are_no_strategy_are_named(solved):
    result, _, solution = solved
    tampered = copy.deepcopy(solution)
    name = next(
        n
        for n, e in tampered["nodes"].items()
        if e["op"] == "param" and len(e["shapes"]["data_out_0"]) == 1
    )
    tampered["nodes"][name]["results"]["data_out_0"] = (Shard(3), Replicate())
    with pytest.raises(AutoshardError, match=rf"(?s)not a strategy of their node.*'{name}'"):
        choice_from_solution(result.sg, tampered, MESH)


def test_merged_node_that_disagrees_with_its_representative(solved):
    result, _, solution = solved
    sg = result.sg
    name = _stored_with_placements(
        sg,
        solution,
        lambda n: sg.nodes[n].rep != n and len(set(map(str, sg.nodes[n].strategies))) > 1,
    )
    ns = sg.nodes[name]
    current = ns.strategies[ns.choice[result.ilp.choice[ns.rep]]]
    other = next(s for s in ns.strategies if s != current)
    tampered = copy.deepcopy(solution)
    entry = tampered["nodes"][name]
    entry["args"] = {f"data_in_{k}": p for k, p in enumerate(other.inputs)}
    entry["results"] = {f"data_out_{k}": p for k, p in enumerate(other.outputs) if p is not None}
    with pytest.raises(AutoshardError, match=rf"(?s)disagree with their representative.*'{name}'"):
        choice_from_solution(sg, tampered, MESH)


def test_unknown_nodes_are_listed_and_capped(solved):
    result, _, solution = solved
    tampered = copy.deepcopy(solution)
    for i in range(MAX_LISTED + 5):
        tampered["nodes"][f"extra_{i}"] = {"op": "aten.relu.default", "args": {}, "results": {}}
    with pytest.raises(AutoshardError) as err:
        choice_from_solution(result.sg, tampered, MESH)
    msg = str(err.value)
    assert "nodes unknown to the graph (15)" in msg
    assert "'extra_0'" in msg and "'extra_14'" not in msg
    assert re.search(r"\.\.\. and \d+ more", msg)


def test_a_node_missing_outside_the_blocks_is_an_error(solved):
    """At the solution's own depth, nodes outside the blocks cannot be filled."""
    result, _, solution = solved
    tampered = copy.deepcopy(solution)
    out = tampered["nodes"]["output"]
    out["args"], out["results"] = {}, {}  # stored as if free: the output sinks lack placements
    with pytest.raises(AutoshardError, match=r"(?s)nodes the solution lacks.*'output\.0'"):
        choice_from_solution(result.sg, tampered, MESH)


def test_at_another_depth_nodes_the_solution_lacks_are_chosen_by_the_ilp(solved, sg4):
    """Matched by structure, a node with no stored placements (here the outputs) is
    chosen by the ILP with every other node fixed: the same plan as stored, because the
    stored one was optimal with the same neighbours."""
    _, _, solution = solved
    tampered = copy.deepcopy(solution)
    out = tampered["nodes"]["output"]
    out["args"], out["results"] = {}, {}
    pre = choice_from_solution(sg4, tampered, MESH)
    sinks = [n for n in sg4.nodes if n.startswith("output.")]
    assert pre.solved == len(sinks) > 0
    assert any(f"{len(sinks)} nodes the solution has no counterpart for" in n for n in pre.notes)
    assert pre.choice == choice_from_solution(sg4, solution, MESH).choice


# -- bare MASE dicts ----------------------------------------------------------------------


def test_bare_mase_dict_loads_with_a_note(solved, tmp_path):
    result, _, solution = solved
    bare = {n: {"args": e["args"], "results": e["results"]} for n, e in solution["nodes"].items()}
    path = tmp_path / "mase.pkl"
    path.write_bytes(dill.dumps(bare))
    loaded = load_solution(path)
    assert loaded["format"] == "mase"
    pre = choice_from_solution(result.sg, loaded, MESH)
    assert pre.choice == result.ilp.choice
    assert any("no mesh" in n and "2x4" in n for n in pre.notes)


def test_bare_mase_dict_for_another_mesh_rank_is_refused(solved):
    result, _, solution = solved
    bare = {
        n: {
            "args": {k: p[:1] for k, p in e["args"].items()},
            "results": {k: p[:1] for k, p in e["results"].items()},
        }
        for n, e in solution["nodes"].items()
    }
    with pytest.raises(AutoshardError, match=r"1-D meshes.*2x4 has 2 dims"):
        choice_from_solution(result.sg, {"format": "mase", "nodes": bare}, MESH)


# -- any model with repeated blocks ---------------------------------------------------------

STACK = """
import os
import torch
from torch import nn

N = int(os.environ["TEST_BLOCKS"])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(32, 64)
        self.stages = nn.ModuleList([Block() for _ in range(N)])
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.stages:
            x = block(x)
        return self.head(x)


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(16, 32),)
"""


def test_blocks_are_found_without_model_specific_names(tmp_path, monkeypatch):
    """A residual stack under `stages.<i>` on a 1-D mesh: 2 blocks solved, 3 preloaded."""
    path = tmp_path / "stack.py"
    path.write_text(STACK)
    mesh = MeshSpec.from_options("4")
    config = SolveConfig(model_path=path, mesh=mesh, mode="infer", tie=False)
    monkeypatch.setenv("TEST_BLOCKS", "2")
    small = plan_model(config)
    monkeypatch.setenv("TEST_BLOCKS", "3")
    sg3 = strategies(config, trace(config))
    assert set(sg3.graph.block_prefixes) == {"stages.0", "stages.1", "stages.2"}
    from autoshard.plan.export import solution_dict

    stored = solution_dict(small.plan, {}, {})
    pre = choice_from_solution(sg3, stored, mesh)
    assert pre.filled == _layer_nodes(sg3, {2}) > 0
    assert pre.sources == {2: 1}
    plan = build_plan(sg3, pre.choice, mesh)
    assert plan.step_time_s == pytest.approx(evaluate(sg3, pre.choice), rel=1e-9)
    assert _relative_params(sg3.graph, plan.parameters, 2) == _relative_params(
        sg3.graph, small.plan.parameters, 1
    )
    for fqn in ("stem.weight", "head.weight", "head.bias"):
        assert plan.parameters[fqn] == small.plan.parameters[fqn]


# -- across depth, by structure (issue 13, item 1) ------------------------------------------


def _llama_file(tmp_path: Path) -> Path:
    from helpers import LLAMA_SMALL, write_model

    text = LLAMA_SMALL.replace("num_hidden_layers=2", "num_hidden_layers=LAYERS").replace(
        "import torch\n", "import os\nimport torch\n", 1
    )
    text = text.replace("LAYERS", 'int(os.environ.get("AUTOSHARD_LAYERS", "2"))')
    return write_model(tmp_path, text, "llama_small")


def _blocks(params: dict, container: str) -> dict[int | None, dict]:
    """Parameters by block index (None: outside the blocks), keyed within the block."""
    out: dict[int | None, dict] = {}
    for fqn, ps in params.items():
        m = re.match(rf"^{re.escape(container)}\.(\d+)\.(.*)$", fqn)
        layer, key = (int(m.group(1)), m.group(2)) if m else (None, fqn)
        out.setdefault(layer, {})[key] = ps
    return out


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("model, deeper", [("gpt2", 12), ("llama", 8)])
def test_a_two_block_solution_preloads_onto_a_deeper_model(
    tmp_path, monkeypatch, model, deeper, mode
):
    """Solved for 2 blocks, preloaded onto 12 (GPT-2) or 8 (Llama), in both modes, tied as
    `solve` traces by default: block 0 is placed as the stored first block, the last block
    as the stored last block, the middle blocks as the block they were aligned with, the
    embeddings and head as stored; the plan is priced like a solved one (every memory
    kind, the budget)."""
    path = GPT2 if model == "gpt2" else _llama_file(tmp_path)
    container = "transformer.h" if model == "gpt2" else "model.layers"
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    config = SolveConfig(model_path=path, mesh=MESH, mode=mode, tie=False)
    small = plan_model(config)
    pkl, _ = write_outputs(small.plan, tmp_path, "small", config.cost_model(), small.solver_stats())
    monkeypatch.setenv("AUTOSHARD_LAYERS", str(deeper))
    res, pre = plan_preloaded(SolveConfig(model_path=path, mesh=MESH, mode=mode), pkl)
    assert pre.solved <= 0.02 * len(res.sg.nodes), pre.notes
    stored = _blocks(small.plan.parameters, container)
    got = _blocks(res.plan.parameters, container)
    assert got[None] == stored[None]
    assert got[0] == stored[0]
    assert got[deeper - 1] == stored[1]
    for layer in range(1, deeper - 1):
        assert got[layer] in (stored[0], stored[1]), layer
    assert res.plan.inputs == small.plan.inputs
    kinds = res.plan.memory_by_kind()
    if mode == "train":
        # the gradients held at the peak (none, at the turn to the backward), as solved
        assert kinds.keys() == small.plan.memory_by_kind().keys()
        assert kinds["optimizer_state"] > 0
    assert res.plan.extra["budget"] == config.budget()
    assert any("matched by structure" in n for n in pre.notes)


def test_a_solution_of_another_mode_says_which_option_to_pass(solved, monkeypatch):
    """The stored solution is an inference step; preloaded into a training step (another
    graph: a backward and an optimizer) its nodes match none: the error names the option
    and the value the solution was solved with, where it used to name only the
    mismatched ops and shapes, as if the model had changed. (A precision that changes
    the graph, bf16-mixed's casts in a training step, gets the same line; an inference
    step in bf16-mixed has this graph's nodes and preloads.)"""
    from dataclasses import replace

    _, pkl, _ = solved
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    with pytest.raises(AutoshardError) as err:
        plan_preloaded(replace(_config(), mode="train"), pkl)
    assert str(err.value).endswith(
        "the solution was solved with --mode infer and this solve traces --mode train, "
        "another graph: pass --mode infer to preload it"
    ), str(err.value)
    assert "--precision" not in str(err.value)


def test_a_solution_naming_shards_on_a_dim_of_one_device_preloads(tmp_path):
    """A solution written before the strategies held a mesh dim of one device whole may
    name shards and partial sums there; it maps onto the strategies (``Replicate`` on that
    dim) to the same choice and objective. Planted: every tensor of a 2-layer GPT-2's
    solution on 1x4 placed on dim 0 as on dim 1."""
    mesh = MeshSpec.from_options("1x4")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSHARD_LAYERS", "2")
        config = SolveConfig(model_path=GPT2, mesh=mesh, mode="infer", tie=False)
        result = plan_model(config)
    pkl, _ = write_outputs(result.plan, tmp_path, "gpt2_1x4", config.cost_model(), {})
    solution = load_solution(pkl)

    def nested(ps):
        return (ps[1], ps[1]) if ps else ps

    planted = 0
    for entry in solution["nodes"].values():
        for key in ("args", "results"):
            for name, ps in (entry.get(key) or {}).items():
                entry[key][name] = nested(ps)
                planted += ps is not None and not isinstance(ps[1], Replicate)
    assert planted > 10
    pre = choice_from_solution(result.sg, solution, mesh)
    assert pre.choice == result.ilp.choice
    assert evaluate(result.sg, pre.choice) == pytest.approx(result.ilp.objective_s, rel=1e-12)
