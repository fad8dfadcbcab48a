"""`autoshard.solve` on a model built in Python (issue 15, item 1): the example of
docs/python.md runs as written, and plans what the model file of the same model plans."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import autoshard
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.solver.solve import SolveConfig, plan_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # two solves of GPT-2 (8 s): the fast tier keeps under 2 minutes
def test_the_documented_example_runs_and_equals_the_model_file_plan(tmp_path, monkeypatch):
    """docs/python.md's code block, run as written (in a temporary folder), gives the
    plan `autoshard solve examples/gpt2.py` gives for the same 2-layer GPT-2: the same
    objective and the same placements."""
    text = (ROOT / "docs" / "python.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/python.md", "exec"), scope)  # noqa: S102 - our own doc
    result = scope["result"]
    assert (tmp_path / "solutions" / "GPT2LMHeadModel_2x4.pkl").exists()
    assert (tmp_path / "solutions" / "GPT2LMHeadModel_2x4.json").exists()
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    from_file = plan_model(
        SolveConfig(model_path=ROOT / "examples" / "gpt2.py", mesh=MeshSpec.from_options("2x4"))
    )
    assert result.plan.step_time_s == pytest.approx(from_file.plan.step_time_s, rel=1e-9)
    assert result.plan.parameters == from_file.plan.parameters


def test_the_callers_model_is_left_whole():
    """Tracing cuts a model of more than 4 blocks to 4 and casts it for --precision; the
    caller's module keeps its 6 blocks and its dtype, and the plan covers all 6."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=128))
    ids = torch.randint(0, 128, (8, 64), device="meta")
    result = autoshard.solve(model, ids, mesh="2x2", mode="infer", precision="fp32")
    assert len(model.transformer.h) == 6
    assert result.sg.graph.depth is not None  # the traced copy was cut
    assert {f"transformer.h.{i}.attn.c_attn.weight" for i in range(6)} <= set(
        result.plan.parameters
    )


@pytest.mark.slow  # a GPT-2 solve (8 s): the fast tier keeps under 2 minutes
def test_a_meta_model_takes_inputs_made_on_the_cpu():
    """The docstring's advice (build on meta) with inputs made as anyone makes them, on
    the CPU: HuggingFace's GPT-2 traces its meta buffers with them (it failed with "found
    at least two devices, meta and cpu") and plans as with meta inputs."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128))
    ids = torch.randint(0, 128, (8, 64))
    on_cpu = autoshard.solve(model, ids, mesh="2x2", mode="train", precision="fp32")
    on_meta = autoshard.solve(model, ids.to("meta"), mesh="2x2", mode="train", precision="fp32")
    assert on_cpu.plan.step_time_s == pytest.approx(on_meta.plan.step_time_s, rel=1e-9)
    assert on_cpu.plan.parameters == on_meta.plan.parameters

    class Scaled(torch.nn.Module):  # no parameters: its one buffer says it is on meta
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with torch.device("meta"):
        scaled = Scaled()
    autoshard.solve(scaled, torch.randn(8, 64), mesh="2", mode="infer")


def test_bad_inputs_are_one_clear_error():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(AutoshardError, match="example_inputs must be a non-empty tuple"):
        autoshard.solve(model, ())
    with pytest.raises(AutoshardError, match=r"returned 2 tensors but Linear.forward\(\)"):
        autoshard.solve(model, (torch.randn(2, 4), torch.randn(2, 4)))
    with pytest.raises(AutoshardError, match="must be a torch.nn.Module"):
        autoshard.solve("not a model", (torch.randn(2, 4),))


def test_compare_from_python_is_the_command_lines_compare():
    """``autoshard.compare`` on the MLP example built in Python: the same rows, in the same
    order, with the same step times as ``autoshard compare examples/mlp.py --mesh 4``
    (JSON), the ILP's plan the fastest (never above a baseline: the same search space)."""
    import json

    from helpers import autoshard_cli

    from autoshard.model.model_file import load_model_file

    mf = load_model_file(ROOT / "examples" / "mlp.py")
    with torch.device("meta"):
        model = mf.module.build_model()
        inputs = mf.module.example_inputs()
    rows = autoshard.compare(model, inputs, mesh="4", mode="infer")
    out = autoshard_cli("compare", "examples/mlp.py", "--mesh", "4", "--mode", "infer", "--json")
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)["plans"]
    assert [r.name for r in rows] == [p["name"] for p in cli]
    assert "fsdp_tp" not in [r.name for r in rows]  # a 1-D mesh: it is megatron_sp
    for r, p in zip(rows, cli, strict=True):
        assert r.plan.step_time_s == pytest.approx(p["step_time_s"], rel=1e-9), r.name
    ilp = rows[0]
    assert ilp.name == "ilp" and ilp.best
    assert all(ilp.plan.step_time_s <= r.plan.step_time_s * (1 + 1e-9) for r in rows)


def test_stages_from_python_split_identical_blocks_evenly():
    """Four identical blocks on 2x2 in two pipeline stages: two blocks each (any other
    split puts three blocks' time on one stage of the 1F1B schedule)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()) for _ in range(4)]
        )
    x = torch.empty(64, 512, device="meta")
    result = autoshard.stages(model, x, mesh="2x2", pp=2, microbatches=4)
    sp = result.stage_plan
    assert sp.balance == (2, 2)
    assert sp.microbatches == 4
    assert sp.stage_times_s[0] == pytest.approx(sp.stage_times_s[1], rel=0.25)


def test_a_result_saves_itself_as_the_command_line_names_its_files(tmp_path):
    from autoshard.plan.formats import load_sharding_map

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    result = autoshard.solve(model, torch.empty(32, 64, device="meta"), mesh="4", name="mlp")
    pkl, smap = result.save(tmp_path)
    assert (pkl.name, smap.name) == ("mlp_4.pkl", "mlp_4.json")
    assert load_sharding_map(smap).parameters == result.plan.parameters


@pytest.mark.parametrize(
    ("options", "flag", "field"),
    [
        ({"precision": "fp8"}, "--precision", "precision"),
        ({"mode": "serve"}, "--mode", "mode"),
        ({"memory_budget": 0}, "--memory-budget", "memory_budget"),
        ({"bucket_bytes": -1}, "--bucket-size", "bucket_bytes"),
        (
            {"activation_checkpointing": "some"},
            "--activation-checkpointing",
            "activation_checkpointing",
        ),
        ({"input_placement": "shard"}, "--input-placement", "input_placement"),
    ],
)
def test_a_bad_option_is_named_as_the_command_line_and_the_python_api_spell_it(
    options, flag, field
):
    """SolveConfig is built by the CLI and by the Python API alike: its one-line error names
    the option both ways (issue 31), so neither user has to translate."""
    with pytest.raises(AutoshardError) as err:
        SolveConfig(ROOT / "examples" / "mlp.py", MeshSpec.from_options("2"), **options)
    assert str(err.value).startswith(f"{flag} ({field}) ")
    assert "\n" not in str(err.value)


def test_the_options_are_one_value_the_three_functions_share():
    """``PlanOptions`` is what the keywords of solve, compare and stages stand for: the
    same plan either way, keywords beside ``options=`` replace its fields, and an unknown
    keyword is Python's TypeError naming every option."""
    from autoshard.api import PlanOptions

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    by_keywords = autoshard.solve(model, x, "2x2", mode="infer", device="a100")
    infer = PlanOptions(mode="infer", device="a100")
    by_value = autoshard.solve(model, x, "2x2", options=infer)
    assert by_value.config.mode == "infer" and by_value.config.device.name == "a100"
    assert by_value.plan.parameters == by_keywords.plan.parameters
    assert by_value.plan.step_time_s == by_keywords.plan.step_time_s
    train = autoshard.solve(model, x, "2x2", options=infer, mode="train")
    assert train.config.mode == "train" and train.config.device.name == "a100"
    rows = autoshard.compare(model, x, "2x2", plans="ilp", options=infer)
    assert rows[0].plan.step_time_s == by_value.plan.step_time_s
    with pytest.raises(TypeError, match=r"unknown option\(s\) modes; the options are mode, "):
        autoshard.solve(model, x, "2x2", modes="infer")
    with pytest.raises(TypeError, match="autoshard.stages"):
        autoshard.stages(model, x, pipeline=2)


def test_a_mesh_laid_over_nodes_from_python_is_the_command_lines():
    """``autoshard.solve(..., mesh="2x2x2", gpus_per_node=2)`` lays the ranks over nodes of
    2 as ``solve --mesh 2x2x2 --gpus-per-node 2`` does: dims 0 and 1 across nodes (the
    network's links), dim 2 inside one; the plan is that mesh's, planned from the model
    file. A shape that splits a dim between a node and the network is one error."""
    from autoshard.cost.mesh import DEFAULT_INTER_NODE_BW, DEFAULT_INTRA_NODE_BW
    from autoshard.model.model_file import load_model_file

    mf = load_model_file(ROOT / "examples" / "mlp.py")
    with torch.device("meta"):
        model = mf.module.build_model()
        inputs = mf.module.example_inputs()
    result = autoshard.solve(model, inputs, mesh="2x2x2", gpus_per_node=2)
    inter, intra = DEFAULT_INTER_NODE_BW, DEFAULT_INTRA_NODE_BW
    assert result.config.mesh.bandwidth == (inter, inter, intra)
    on_nodes = MeshSpec.on_nodes((2, 2, 2), 2)
    config = SolveConfig(model_path=ROOT / "examples" / "mlp.py", mesh=on_nodes)
    assert result.plan.step_time_s == pytest.approx(plan_model(config).plan.step_time_s, rel=1e-9)
    with pytest.raises(AutoshardError, match="splits a mesh dim between a node and the network"):
        autoshard.solve(model, inputs, mesh="8x3", gpus_per_node=4)
