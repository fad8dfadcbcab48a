"""Tests for ``autoshard show``: both kinds of file, detected by content, shown readably."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import dill
import pytest
from click.testing import CliRunner
from rich.console import Console
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cli.show import show_command
from autoshard.errors import AutoshardError
from autoshard.plan.formats import save_sharding_map, save_solution
from autoshard.plan.show import render


def solution() -> dict:
    return {
        "format": "autoshard.solution/1",
        "autoshard_version": "0.1.0",
        "model": "gpt2",
        "mesh": {
            "shape": [2, 4],
            "dim_names": ["dp", "tp"],
            "bandwidth_Bps": [5e10, 4.5e11],
            "latency_s": [1e-5, 5e-6],
        },
        "cost_model": {"device": "h100", "mode": "infer"},
        "nodes": {
            "mm": {
                "op": "aten.mm.default",
                "args": {
                    "data_in_0": (Shard(0), Replicate()),
                    "data_in_1": (Replicate(), Shard(1)),
                },
                "results": {"data_out_0": (Shard(0), Shard(1))},
            },
            "mm_1": {
                "op": "aten.mm.default",
                "args": {"data_in_0": (Shard(0), Shard(1)), "data_in_1": (Replicate(), Shard(0))},
                "results": {"data_out_0": (Shard(0), Partial("sum"))},
            },
            "gelu": {
                "op": "aten.gelu.default",
                "args": {"data_in_0": (Shard(0), Shard(1))},
                "results": {"data_out_0": (Shard(0), Shard(1))},
            },
        },
        "parameters": {
            "transformer.h.0.mlp.c_fc.weight": (Replicate(), Shard(1)),
            "transformer.h.0.mlp.c_proj.weight": (Replicate(), Shard(0)),
        },
        "inputs": {"input_ids": (Shard(0), Replicate())},
        "objective_s": 0.0123,
        "predicted": {"step_time_s": 0.0123, "collectives": {"all_reduce": 2}},
        "solver": {"status": "optimal", "gap": 0.0, "solve_time_s": 1.2},
    }


def sharding_map() -> dict:
    return {
        "format": "autoshard.sharding_map/1",
        "mesh": {"shape": [2, 4], "dim_names": ["dp", "tp"]},
        "parameters": {
            "transformer.h.0.mlp.c_fc.weight": ["R", "S(1)"],
            "transformer.h.0.mlp.c_proj.weight": ["R", "S(0)"],
        },
        "inputs": {"input_ids": ["S(0)", "R"]},
        "predicted": {"step_time_s": 0.0123, "collectives": {"all_reduce": 2}},
    }


def row(output: str, name: str) -> list[str]:
    """The cells of the table row that starts with ``name``."""
    for line in output.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row for {name!r} in:\n{output}")


def show(*args: str, columns: int = 200) -> str:
    """``autoshard show ARGS`` output, on a terminal ``columns`` wide (so lines do not wrap)."""
    result = CliRunner(env={"COLUMNS": str(columns)}).invoke(show_command, list(args))
    assert result.exception is None, result.output
    assert result.exit_code == 0
    return result.output


def test_show_solution(tmp_path: Path) -> None:
    path = tmp_path / "gpt2_2x4.pkl"
    save_solution(path, solution())
    out = show(str(path), columns=80)
    assert "2x4 (dp=2, tp=4), 8 devices" in out
    assert "50.0 GB/s, latency 10.0 us" in out  # dp
    assert "450 GB/s, latency 5.00 us" in out  # tp
    assert "--device h100, --mode infer" in out  # the options that set them
    assert "12.3 ms per step" in out
    assert "optimal, gap 0.00 %, solved in 1.20 s" in out
    assert "3 (aten.mm.default 2, aten.gelu.default 1)" in out
    assert row(out, "parameter") == ["parameter", "dp (2)", "tp (4)"]
    assert row(out, "transformer.h.0.mlp.c_fc.weight") == [
        "transformer.h.0.mlp.c_fc.weight",
        "R",
        "S(1)",
    ]
    assert row(out, "transformer.h.0.mlp.c_proj.weight")[1:] == ["R", "S(0)"]
    assert row(out, "input_ids")[1:] == ["S(0)", "R"]
    assert "all-reduce x2" in out
    assert "mm_1" not in out  # nodes only with --nodes


def test_show_solution_as_export_writes_it(tmp_path: Path) -> None:
    """The cost model nests the device spec and the mesh; the solver reports solve_seconds."""
    sol = solution()
    sol["cost_model"] = {
        "device": {"name": "h100", "peak_flops": {"float32": 4.945e14}},
        "mode": "train",
        "mesh": sol["mesh"],
    }
    sol["solver"] = {
        "status": "optimal",
        "gap": 0.001,
        "solve_seconds": 0.103,
        "build_seconds": 0.0149,
        "num_variables": 769,
        "bound_s": None,
    }
    path = tmp_path / "s.pkl"
    save_solution(path, sol)
    out = show(str(path))
    assert "--device h100, --mode train" in out
    assert "peak_flops" not in out and "bandwidth_Bps" not in out
    assert "optimal, gap 0.10 %, solved in 103 ms, build 14.9 ms, variables 769" in out
    assert "bound_s" not in out


def test_show_solution_nodes(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    save_solution(path, solution())
    out = show(str(path), "--nodes")
    cells = row(out, "mm_1")
    assert cells[:4] == [
        "mm_1",
        "aten.mm.default",
        "data_in_0  S(0)·S(1)",
        "data_out_0  S(0)·P(sum)",
    ]
    assert "data_in_1  R·S(0)" in out


def test_show_says_the_predictions_in_words_not_python(tmp_path: Path) -> None:
    """The plan's collectives per phase name the mesh dim each runs on (by the mesh's own
    names), an op's own exchange is marked, recomputed blocks are ranges, MFU a share:
    nothing of the file's dicts and lists shows through (issue 30, item 4)."""
    smap = sharding_map()
    smap["predicted"] |= {
        "collective_steps": [
            {"phase": "forward", "kind": "all_gather", "mesh_dim": 0, "count": 4},
            {"phase": "forward", "kind": "all_to_all", "mesh_dim": 1, "count": 2, "in_op": True},
            {"phase": "backward", "kind": "reduce_scatter", "mesh_dim": 0, "count": 4},
        ],
        "recomputed_blocks": [0, 1, 2, 5],
        "mfu": 0.4123,
    }
    path = tmp_path / "gpt2_2x4.json"
    save_sharding_map(path, smap)
    out = show(str(path))
    assert (
        "forward: all-gather on dp x4, all-to-all on tp in op x2; backward: reduce-scatter on dp x4"
    ) in out
    assert "recomputed blocks       0-2, 5" in out
    assert "MFU                     41.2%" in out
    assert not any(c in out.split("Predicted", 1)[1] for c in "{}[]'")


def test_show_sharding_map(tmp_path: Path) -> None:
    path = tmp_path / "gpt2_2x4.json"
    save_sharding_map(path, sharding_map())
    out = show(str(path))
    assert "Sharding map" in out
    assert "2x4 (dp=2, tp=4), 8 devices" in out
    assert row(out, "transformer.h.0.mlp.c_fc.weight")[1:] == ["R", "S(1)"]
    assert row(out, "input_ids")[1:] == ["S(0)", "R"]
    assert "12.3 ms" in out
    assert "all-reduce x2" in out


def test_show_names_a_map_s_solution_in_words_not_a_python_dict(tmp_path: Path) -> None:
    """A new user's ``show x.json`` printed ``solution {'file': ..., 'plan_sha256': ...}``."""
    path = tmp_path / "gpt2_2x4.json"
    digest = "1f73eaf4291ce1e4e48b40ae9cc9ef8b1b73e8b72a9f0dc66990db5d65fcfb50"
    save_sharding_map(
        path, {**sharding_map(), "solution": {"file": "gpt2_2x4.pkl", "plan_sha256": digest}}
    )
    out = show(str(path))
    said = [line.split() for line in out.splitlines() if line.split()[:1] == ["solution"]]
    assert said == [["solution", "gpt2_2x4.pkl,", "plan", "sha256", "1f73eaf4291c..."]], out
    assert "{" not in out


def test_show_detects_kind_by_content_not_extension(tmp_path: Path) -> None:
    pickle_named_json = tmp_path / "plan.json"
    save_solution(pickle_named_json, solution())
    assert "Solution" in show(str(pickle_named_json))
    map_named_pkl = tmp_path / "plan.pkl"
    save_sharding_map(map_named_pkl, sharding_map())
    assert "Sharding map" in show(str(map_named_pkl))


def test_show_bare_mase_dict(tmp_path: Path) -> None:
    path = tmp_path / "ilp_solution.pkl"
    nodes = {
        "fc1": {"args": {"data_in_0": (Shard(0), Replicate())}, "results": {}},
        "fc2": {"args": {}, "results": {"data_out_0": (Shard(0), Partial("sum"))}},
    }
    path.write_bytes(dill.dumps(nodes))
    out = show(str(path), "--nodes")
    assert "(a bare MASE node dict)" in out
    assert "2 dims (dim0, dim1), sizes not recorded" in out
    assert "parameters: none recorded" in out
    assert row(out, "fc2") == ["fc2", "data_out_0  S(0)·P(sum)"]


def test_show_lists_first_nodes_then_all(tmp_path: Path) -> None:
    sol = solution()
    sol["nodes"] = {
        f"n{i}": {"op": "aten.relu.default", "args": {"x": (Shard(0), Replicate())}}
        for i in range(45)
    }
    path = tmp_path / "s.pkl"
    save_solution(path, sol)
    out = show(str(path), "--nodes")
    assert "n39" in out and "n40" not in out
    assert "and 5 more nodes" in out
    out = show(str(path), "--all-nodes")
    assert "n44" in out and "more nodes" not in out


def test_render_returns_kind_and_markup_is_not_interpreted(tmp_path: Path) -> None:
    sol = solution()
    sol["parameters"] = {"layers[0].weight": (Replicate(), Shard(0))}
    path = tmp_path / "s.pkl"
    save_solution(path, sol)
    buffer = io.StringIO()
    assert render(path, Console(file=buffer, width=120)) == "solution"
    assert "layers[0].weight" in buffer.getvalue()


def test_show_malicious_file_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    sol = solution()
    sol["model"] = Payload()
    path = tmp_path / "s.pkl"
    path.write_bytes(dill.dumps(sol))
    result = CliRunner().invoke(show_command, [str(path)])
    assert isinstance(result.exception, AutoshardError)
    assert "refusing to load" in str(result.exception)
    assert f"{os.system.__module__}.system" in str(result.exception)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "is empty"), (b"\x80\x04\x95garbage", "is truncated or corrupt"), (b"{", "not valid")],
)
def test_show_damaged_files_raise_autoshard_errors(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = tmp_path / "f"
    path.write_bytes(content)
    result = CliRunner().invoke(show_command, [str(path)])
    assert isinstance(result.exception, AutoshardError)
    assert message in str(result.exception)


def test_show_missing_file(tmp_path: Path) -> None:
    result = CliRunner().invoke(show_command, [str(tmp_path / "nope.json")])
    assert isinstance(result.exception, AutoshardError)
    assert "cannot read" in str(result.exception)


def test_cli_group_prints_one_line_error(tmp_path: Path) -> None:
    """Through ``autoshard show``: the group turns the refusal into ``error: ...``, exit 2."""
    from autoshard.cli.main import main

    if "show" not in main.commands:
        pytest.fail("autoshard.cli does not register the show command")
    path = tmp_path / "f.pkl"
    path.write_bytes(b"")
    result = CliRunner().invoke(main, ["show", str(path)])
    assert result.exit_code == 2
    assert "error: " in result.output and "is empty" in result.output


def test_show_folds_identical_layers_and_sorts_naturally():
    """12 blocks of which block 0 differs: two rows, not twelve, and `h.2` before `h.10`."""
    from autoshard.plan.show import fold_layers

    entries = {f"h.{i}.attn.weight": ("R", "S(0)") for i in range(12)}
    entries["h.0.attn.weight"] = ("R", "R")
    entries |= {"h.10.mlp.weight": ("S(1)",), "h.2.mlp.weight": ("S(1)",), "wte.weight": ("R",)}
    assert fold_layers(entries) == [
        ("h.0.attn.weight", ("R", "R")),
        ("h.<1-11>.attn.weight", ("R", "S(0)")),
        ("h.<2, 10>.mlp.weight", ("S(1)",)),
        ("wte.weight", ("R",)),
    ]


def test_fold_layers_takes_only_decimal_layer_indices():
    from autoshard.plan.show import fold_layers

    # "²".isdigit() is True but int("²") fails: such a name is kept as it is
    assert fold_layers({"w.²": ("R",), "w.3": ("R",)}) == [("w.3", ("R",)), ("w.²", ("R",))]


def test_show_reads_a_stage_plan_as_stages_writes_it(tmp_path: Path) -> None:
    """``autoshard show`` on the stage plan ``autoshard stages`` writes (it refused it as a
    sharding map of another format, though ``launch`` runs it): one row per stage with
    its blocks, ranks, submesh and predicted time, send/recv and memory as the file holds
    them, and each stage's parameters with one column per mesh dim."""
    import json

    from autoshard.cli.main import main
    from autoshard.units import format_bytes, format_seconds

    root = Path(__file__).resolve().parents[1]
    args = ["stages", str(root / "examples" / "blocks.py"), "--mesh", "2x2", "--pp", "2"]
    made = CliRunner().invoke(
        main, [*args, "--memory-budget", "8KiB", "--out", str(tmp_path), "-q"]
    )
    assert made.exit_code == 0, made.output
    path = Path(made.stdout.split()[-1])
    raw = json.loads(path.read_text())
    shown = CliRunner().invoke(show_command, [str(path)], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    text = shown.output
    assert f"2 stages, {raw['microbatches']} micro-batches" in text
    assert "2x2 (dp=2, tp=2), 4 devices" in text
    for i, stage in enumerate(raw["stages"]):
        p = stage["predicted"]
        cells = [
            str(i),
            f"{stage['module_paths'][0]} .. {stage['module_paths'][-1]}",
            ",".join(map(str, stage["ranks"])),
            "x".join(map(str, stage["submesh"])),
            format_seconds(p["time_s"]),
            format_seconds(p["p2p_s"]),
            format_bytes(p["memory_bytes"]),
        ]
        row = next(line for line in text.splitlines() if line.startswith(f"│ {i} "))
        assert [c.strip() for c in row.strip("│").split("│")] == cells, row
        assert f"Stage {i} parameters" in text
        for name, ps in stage["parameters"].items():
            assert name.split(".")[-2] in text and all(q in text for q in ps)


def test_a_solution_s_cost_model_reads_as_the_options_that_set_it():
    """``show`` gives the cost model as ``autoshard solve``'s options (it printed the file's
    keys: ``input_placement free``, ``memory_budget_bytes``); an on/off setting appears
    only when it is not the default, as its flag."""
    from autoshard.plan.show import _cost_model_text

    cost = {
        "device": {"name": "a100"},
        "mode": "train",
        "memory_budget_bytes": 2**30,
        "input_placement": "free",
        "overlap": False,
        "share_reshardings": True,
        "context_parallel": "ring",
        "checkpoint_early_stop": False,
        "mesh": {"shape": [2]},
    }
    assert _cost_model_text(cost) == (
        "--device a100, --mode train, --memory-budget 1.00 GiB, --inputs free, --no-overlap, "
        "--share-reshardings, --context-parallel ring, --no-checkpoint-early-stop"
    )
    defaults = {"overlap": True, "share_reshardings": False, "context_parallel": False}
    assert _cost_model_text({**defaults, "checkpoint_early_stop": True}) == ""
    assert _cost_model_text({"context_parallel": True, "future_key": 3}) == (
        "--context-parallel, future_key 3"
    )
