"""From a GPU count to a mesh (issue 32, item 1): the node-respecting shapes, their links,
and the search that plans each and keeps the fastest.

Independent references: the node of every rank worked from the row-major layout (not the
span/stride rule the code uses), the shapes of 64 GPUs listed by hand, and each shape
solved on its own with ``autoshard solve --mesh``'s own function.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import block_stack, write_mlp

import autoshard
from autoshard.cli.main import main
from autoshard.cost.mesh import (
    DEFAULT_INTER_NODE_BW,
    DEFAULT_INTRA_NODE_BW,
    MeshSpec,
    node_shapes,
)
from autoshard.errors import AutoshardError
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.pipeline.pricing import price_pipeline
from autoshard.pipeline.search import pipeline_rows, stage_file
from autoshard.pipeline.stage_plan import load_stage_plan
from autoshard.solver.lifting import lift_choice
from autoshard.solver.meshes import search_meshes
from autoshard.solver.options import SolverOptions
from autoshard.solver.solve import SolveConfig, plan_model
from autoshard.solver.space import plan_space

INTRA, INTER = DEFAULT_INTRA_NODE_BW, DEFAULT_INTER_NODE_BW


def _groups(shape: tuple[int, ...], dim: int) -> list[list[int]]:
    """The ranks of each group along mesh dim ``dim`` (``init_device_mesh``'s layout)."""
    ranks = torch.arange(math.prod(shape)).reshape(shape).movedim(dim, -1)
    return ranks.reshape(-1, shape[dim]).tolist()


def _respects_nodes(shape: tuple[int, ...], per_node: int) -> bool:
    """Every group of every dim is inside one node or in as many nodes as it has ranks."""
    if len(shape) == 1:
        return True
    for dim in range(len(shape)):
        for group in _groups(shape, dim):
            nodes = {r // per_node for r in group}
            if len(nodes) not in (1, len(group)):
                return False
    return True


def _all_shapes(gpus: int, max_dims: int = 3) -> list[tuple[int, ...]]:
    sizes = [d for d in range(2, gpus + 1) if gpus % d == 0]
    return [
        s
        for k in range(1, max_dims + 1)
        for s in itertools.product(sizes, repeat=k)
        if math.prod(s) == gpus
    ]


def test_64_gpus_of_8_per_node_have_the_shapes_worked_by_hand():
    """64 GPUs, 8 per node: one group over everything, 8x8, and the 3-D meshes whose
    inner dims fill a node; 4x16 (16 split between NVLink and the network) is not one."""
    shapes = node_shapes(64, 8)
    assert set(shapes) == {(64,), (8, 8), (8, 4, 2), (8, 2, 4), (4, 2, 8), (2, 4, 8)}
    assert len(shapes) == len(set(shapes))
    assert (4, 16) not in shapes and (16, 4) not in shapes


@pytest.mark.parametrize(("gpus", "per_node"), [(64, 8), (16, 8), (32, 4), (8, 8), (4, 8)])
def test_the_shapes_are_those_whose_groups_never_straddle_a_node(gpus, per_node):
    """Against the rank layout itself: a shape is kept exactly when no group of any dim
    holds some ranks of one node and some of another node."""
    expected = {s for s in _all_shapes(gpus) if _respects_nodes(s, per_node)}
    assert set(node_shapes(gpus, per_node)) == expected


def test_a_gpu_count_that_is_not_whole_nodes_is_one_line():
    with pytest.raises(AutoshardError, match=r"--gpus \(gpus\) 12 is not a whole number of nodes"):
        node_shapes(12, 8)
    with pytest.raises(AutoshardError, match=r"--gpus \(gpus\) is 0 .* must be at least 1"):
        node_shapes(0, 8)
    assert node_shapes(1, 8) == [(1,)]  # one GPU: the trivial mesh


def test_each_dim_gets_the_links_its_groups_use():
    """A dim inside a node gets NVLink, one across nodes the network (its groups' ranks
    are one node apart or more), and one group over every node the network too."""
    assert MeshSpec.on_nodes((4, 2, 8), 8).bandwidth == (INTER, INTER, INTRA)
    assert MeshSpec.on_nodes((8, 4, 2), 8).bandwidth == (INTER, INTRA, INTRA)
    assert MeshSpec.on_nodes((64,), 8).bandwidth == (INTER,)
    assert MeshSpec.on_nodes((2, 4), 8).bandwidth == (INTRA, INTRA)  # one node
    for shape in node_shapes(64, 8):
        mesh = MeshSpec.on_nodes(shape, 8)
        for dim, bw in enumerate(mesh.bandwidth):
            one_node = all(len({r // 8 for r in g}) == 1 for g in _groups(shape, dim))
            assert (bw == INTRA) == one_node, (shape, dim)


def test_the_search_keeps_the_fastest_of_the_shapes_solved_one_by_one(tmp_path: Path):
    """4 GPUs, 2 per node: the best of the search is no slower than each shape planned on
    its own by ``plan_model`` (what ``solve --mesh`` runs), and every row's step is that
    shape's own."""
    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    assert [m.shape for m in meshes] == [(4,), (2, 2)]
    search = search_meshes(config, meshes)
    alone = {m.shape: plan_model(replace(config, mesh=m)).plan.step_time_s for m in meshes}
    assert search.best.step_time_s == min(alone.values())
    for row in search.rows:
        assert row.step_time_s == alone[row.mesh.shape]
    assert search.best.result.meshes is search
    steps = [r.step_time_s for r in search.rows]
    assert steps == sorted(steps)


def test_a_failure_while_an_ilp_runs_on_another_thread_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The search builds the next shape's strategies while the last shape's ILP runs on
    another thread. Planted: the ILP of the first shape (4) runs until it is stopped
    (its progress checks, as HiGHS's polls make them), and the strategies of the second
    (2x2) fail. The search raises that failure, and only after the ILP has stopped
    (``interrupt.Stopped`` at its check), well before the 60 s it would otherwise run."""
    import threading
    import time

    from autoshard import interrupt
    from autoshard.solver import meshes as meshes_module

    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    running, seen = threading.Event(), []
    real = meshes_module.strategies

    def endless_ilp(config, progress, graph, sg):  # noqa: ANN001
        running.set()
        end = time.monotonic() + 60
        try:
            while time.monotonic() < end:
                interrupt.check()
                time.sleep(0.01)
        except interrupt.Stopped as exc:
            seen.append(exc)
            raise
        raise AssertionError("the ILP was never stopped")

    def failing_strategies(config, graph, progress):  # noqa: ANN001
        if config.mesh.ndim == 2:
            assert running.wait(10), "the first shape's ILP did not start beside this one"
            raise RuntimeError("planted: strategies failed")
        return real(config, graph, progress)

    monkeypatch.setattr(meshes_module, "plan_model", endless_ilp)
    monkeypatch.setattr(meshes_module, "strategies", failing_strategies)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="planted"):
        search_meshes(config, meshes)
    assert len(seen) == 1  # stopped at its check, and before search_meshes returned
    assert time.monotonic() - t < 30


def _cli(*args: str):
    return CliRunner().invoke(main, list(args))


def test_solve_gpus_prints_the_ranked_shapes_and_writes_the_fastest(tmp_path: Path):
    model = write_mlp(tmp_path, 64, 256, 1024)
    out = tmp_path / "out"
    run = _cli("solve", str(model), "--gpus", "4", "--gpus-per-node", "2", "--out", str(out))
    assert run.exit_code == 0, run.output
    assert "mesh shapes of 4 GPUs, 2 per node" in run.output
    best = run.output.split("best: ")[1].split()[0]
    assert best in ("4", "2x2")
    assert (out / f"mlp_{best}.json").exists() and (out / f"mlp_{best}.pkl").exists()
    run = _cli(
        "solve",
        str(model),
        "--gpus",
        "4",
        "--gpus-per-node",
        "2",
        "--json",
        "-q",
        "--out",
        str(tmp_path / "out2"),
    )
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    assert [row["mesh"] for row in doc["meshes"]] in ([[4], [2, 2]], [[2, 2], [4]])
    assert doc["meshes"][0]["step_time_s"] == pytest.approx(doc["time_s"]["step"])
    inside = {tuple(r["mesh"]): r["inside_node"] for r in doc["meshes"]}
    assert inside == {(4,): [False], (2, 2): [False, True]}
    assert doc["seconds"]["trace"] > 0  # the one trace counts in the best mesh's seconds
    assert doc["meshes"][1]["bandwidth_Bps"] == (
        [INTER] if doc["meshes"][1]["mesh"] == [4] else [INTER, INTRA]
    )


def test_mesh_with_gpus_per_node_solves_a_searched_shape_alone_as_the_search_priced_it(
    tmp_path: Path,
):
    """``--mesh 2x2x2 --gpus-per-node 2`` lays the mesh over nodes of 2 as ``--gpus 8
    --gpus-per-node 2`` lays that shape: ranks row-major, so dims 0 and 1 (groups 4 and 2
    ranks apart) cross nodes and dim 2 (neighbours) stays inside one. The plan it writes
    is the search's 2x2x2 row: the same links, the same step to the last digit (one trace,
    one deterministic ILP). Plain ``--mesh 2x2x2`` keeps its convention (dim 0 across
    nodes, the rest inside), a different price, as a user who copies the search's row
    without the flag would find."""
    model = write_mlp(tmp_path, 64, 256, 1024)
    search = _cli(
        "solve", str(model), "--gpus", "8", "--gpus-per-node", "2", "--json", "-q",
        "--out", str(tmp_path / "s"),
    )  # fmt: skip
    assert search.exit_code == 0, search.output
    rows = {tuple(r["mesh"]): r for r in json.loads(search.stdout)["meshes"]}
    row = rows[(2, 2, 2)]
    assert row["inside_node"] == [False, False, True]
    alone = _cli(
        "solve", str(model), "--mesh", "2x2x2", "--gpus-per-node", "2", "--json", "-q",
        "--out", str(tmp_path / "a"),
    )  # fmt: skip
    assert alone.exit_code == 0, alone.output
    doc = json.loads(alone.stdout)
    assert doc["mesh"]["bandwidth_Bps"] == [INTER, INTER, INTRA] == row["bandwidth_Bps"]
    assert doc["mesh"]["latency_s"] == [20e-6, 20e-6, 5e-6]
    assert doc["time_s"]["step"] == row["step_time_s"]
    assert (tmp_path / "a" / "mlp_2x2x2.json").exists()
    plain = _cli(
        "solve", str(model), "--mesh", "2x2x2", "--json", "-q", "--out", str(tmp_path / "p")
    )  # fmt: skip
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["mesh"]["bandwidth_Bps"] == [INTER, INTRA, INTRA]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--gpus", "4", "--mesh", "2x2"],
            "--gpus tries every mesh shape with the ILP; drop --mesh",
        ),
        (["--gpus", "4", "--algo", "ddp"], "drop --algo"),
        ([], "Missing option '--mesh' (or --gpus N: every mesh shape of N GPUs)"),
        (["--gpus", "12", "--gpus-per-node", "8"], "--gpus (gpus) 12 is not a whole number"),
        (
            ["--mesh", "2x3", "--gpus-per-node", "4"],
            "--mesh 2x3 has 6 devices, not a whole number of nodes of --gpus-per-node 4",
        ),
        # dim 1's groups of 3 ranks ({3, 4, 5}) would span two nodes of 4 (review finding)
        (
            ["--mesh", "8x3", "--gpus-per-node", "4"],
            "--mesh 8x3 over nodes of --gpus-per-node 4 splits a mesh dim between a node and",
        ),
        (
            ["--mesh", "4x16", "--gpus-per-node", "8"],
            "--mesh 4x16 over nodes of --gpus-per-node 8 splits a mesh dim between a node and",
        ),
        (["--mesh", "4", "--microbatches", "4"], "--microbatches applies with --gpus N --pp"),
    ],
)
def test_a_mesh_option_that_cannot_work_is_one_line(tmp_path: Path, extra, message):
    model = write_mlp(tmp_path, 64, 256, 1024)
    run = _cli("solve", str(model), "--out", str(tmp_path / "out"), *extra)
    assert run.exit_code != 0
    assert message in run.output, run.output
    assert len(run.output.strip().splitlines()) == 1, run.output
    assert not (tmp_path / "out").exists()


def test_the_python_api_takes_a_gpu_count(tmp_path: Path):
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    result = autoshard.solve(model, torch.randn(64, 256), gpus=4, gpus_per_node=2)
    assert {r.mesh.shape for r in result.meshes.rows} == {(4,), (2, 2)}
    assert result.config.mesh == result.meshes.best.mesh
    with pytest.raises(AutoshardError, match="drop mesh="):
        autoshard.solve(model, torch.randn(64, 256), "2x2", gpus=4)


@pytest.mark.slow
def test_the_python_api_ranks_pipeline_depths_as_stages_plans_them(tmp_path: Path):
    """``gpus=4, gpus_per_node=2, pp=(2,)`` on 4 blocks: a pp=2 row over the 2x2 mesh's
    leading dim, its step the one ``autoshard.stages`` finds on that mesh alone; the
    returned plan is the fastest without stages, as ``solve --gpus --pp`` writes it."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 4, 64, 2048))
    loaded = instantiate(load_model_file(model), device="meta")
    result = autoshard.solve(loaded.module, loaded.inputs, gpus=4, gpus_per_node=2, pp=(2,))
    rows = {(r.mesh.shape, r.pp): r for r in result.meshes.rows}
    assert set(rows) == {((4,), 1), ((2, 2), 1), ((2, 2), 2)}
    alone = autoshard.stages(
        loaded.module, loaded.inputs, MeshSpec.on_nodes((2, 2), 2), pp=2, microbatches=8
    )
    piped = rows[(2, 2), 2]
    assert piped.stages.stage_plan.step_time_s == pytest.approx(
        alone.stage_plan.step_time_s, rel=1e-12
    )
    assert result.meshes.fastest.step_time_s == min(r.step_time_s for r in rows.values())
    assert result.plan.step_time_s == min(r.step_time_s for r in rows.values() if r.pp == 1)
    with pytest.raises(AutoshardError, match="give gpus="):
        autoshard.solve(loaded.module, loaded.inputs, "2x2", pp=(2,))
    with pytest.raises(AutoshardError, match="must be >= 2"):
        autoshard.solve(loaded.module, loaded.inputs, gpus=4, gpus_per_node=2, pp=(1, 2))


def test_the_links_column_says_where_each_dim_lies_whatever_the_bandwidths(tmp_path: Path):
    """With the network given more bandwidth than NVLink, dim 0 of 2x2 still crosses the
    two nodes of 2: the table says where a dim lies, not which link is faster."""
    model = write_mlp(tmp_path, 64, 256, 1024)
    args = ["--gpus", "4", "--gpus-per-node", "2", "--inter-node-bw", "900GB/s"]
    run = _cli("solve", str(model), *args, "--out", str(tmp_path / "out"))
    assert run.exit_code == 0, run.output
    rows = {
        line.split("│")[1].strip(): line.split("│")[3].strip()  # mesh, pp, links
        for line in run.output.splitlines()
        if line.count("│") >= 4
    }
    assert rows["2x2"] == "network x node" and rows["4"] == "network", rows


def test_a_shape_whose_program_is_over_the_cap_is_planned_in_torchtitan_s_space(
    tmp_path: Path, monkeypatch
):
    """4 GPUs on one node: 2x2's program is many times 4's (each edge pairs up to 5^2
    placements per side against 5). With the cap between the two sizes, the search plans
    4 with the ILP, and 2x2 in torchtitan's space: the plan ``--mesh 2x2 --space
    torchtitan`` finds on its own, ranked among the others (4's plan laid onto 2x2 is
    left out here: the next test has it). Its row says why: its column count, which is
    the count of the program ``build_problem`` builds, and the links to plan it with on
    its own."""
    import autoshard.solver.meshes as searched
    import autoshard.solver.options as solver_options
    from autoshard.solver.ilp import build_problem, program_columns
    from autoshard.solver.solve import strategies, trace

    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    graph = trace(config)
    meshes = {s: MeshSpec.on_nodes(s, 4) for s in node_shapes(4, 4)}
    assert set(meshes) == {(4,), (2, 2)}
    sizes = {}
    for shape, mesh in meshes.items():
        sg = strategies(replace(config, mesh=mesh), graph)
        prob = build_problem(sg)
        sizes[shape] = program_columns(sg)
        assert sizes[shape] == prob.n_x + prob.n_y
    assert sizes[(2, 2)] > 2 * sizes[(4,)]
    cap = (sizes[(4,)] + sizes[(2, 2)]) // 2
    monkeypatch.setattr(solver_options, "MESH_SEARCH_COLUMNS", cap)  # the search's default cap
    monkeypatch.setattr(searched, "lift_choice", lambda *a: None)  # no lifted plan
    search = search_meshes(config, list(meshes.values()), gpus_per_node=4)
    rows = {r.mesh.shape: r for r in search.rows}
    assert rows[(4,)].space == "free" and rows[(4,)].note is None
    assert rows[(4,)].result.ilp.num_variables == sizes[(4,)]
    assert rows[(2, 2)].space == "torchtitan" and rows[(2, 2)].error is None
    assert rows[(2, 2)].lifted_from is None
    own = plan_space(replace(config, mesh=meshes[(2, 2)]), "torchtitan", graph=graph)
    assert rows[(2, 2)].step_time_s == own.plan.step_time_s
    assert rows[(2, 2)].result.plan.parameters == own.plan.parameters
    assert [r.step_time_s for r in search.rows] == sorted(r.step_time_s for r in search.rows)
    # the links the search laid 2x2 on: one node, so both dims at NVLink's
    assert meshes[(2, 2)].bandwidth == (INTRA, INTRA)
    assert rows[(2, 2)].note == (
        f"its ILP has {sizes[(2, 2)]:,} columns, over the {cap:,} solved whole "
        f"(--max-columns); to solve it whole anyway: --mesh 2x2 --gpus-per-node 4 "
        f"--max-columns {sizes[(2, 2)]} (the links it has here, per dim "
        + ", ".join(["370 GB/s and 5.00 us"] * 2)
        + ")"
    )
    # the cap is the search's and solve --mesh's: plan_model (no cap) solves it whole
    alone = plan_model(replace(config, mesh=meshes[(2, 2)]), graph=graph)
    assert alone.ilp.num_variables == sizes[(2, 2)] > cap


def test_an_over_the_cap_shape_gets_the_plan_of_a_shape_with_one_dim_fewer_laid_onto_it(
    tmp_path: Path, monkeypatch
):
    """The same search with the lifted plan: 4's ILP plan laid onto 2x2 (dim 0 split in
    two, each placement on both dims) is faster there than torchtitan's space, so 2x2's
    row holds it. Held against 4's own plan, solved apart: the same bytes per device and
    the same compute (each device holds and computes what it held on 4), every
    parameter's layout the same over the 4 devices, and its collectives no slower (the
    same bytes per device over links of the same bandwidth, in fewer latency steps:
    1 + 1 instead of 3 for a collective over both dims)."""
    import autoshard.solver.options as solver_options
    from autoshard.solver.solve import trace

    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    graph = trace(config)
    meshes = [MeshSpec.on_nodes(s, 4) for s in node_shapes(4, 4)]
    monkeypatch.setattr(solver_options, "MESH_SEARCH_COLUMNS", 2_000)
    rows = {r.mesh.shape: r for r in search_meshes(config, meshes).rows}
    four = plan_model(replace(config, mesh=meshes[0]), graph=graph).plan
    lifted = rows[(2, 2)]
    assert lifted.lifted_from == (4,) and lifted.space == "free" and lifted.error is None
    assert lifted.note.startswith("its ILP has ") and "4's ILP plan laid onto it" in lifted.note
    own = plan_space(replace(config, mesh=meshes[1]), "torchtitan", graph=graph)
    assert lifted.step_time_s < own.plan.step_time_s
    plan = lifted.result.plan
    assert plan.memory_bytes == pytest.approx(four.memory_bytes, rel=1e-12)
    assert plan.compute_s == pytest.approx(four.compute_s, rel=1e-12)
    for name, ps in four.parameters.items():
        assert plan.parameters[name] == (ps[0], ps[0]), name
    assert 0 < plan.comm_total_s <= four.comm_total_s
    assert lifted.result.ilp.status == "4's ILP plan, lifted (4's dim 0 split into dims 0 and 1)"
    assert lifted.result.ilp.recompute == rows[(4,)].result.ilp.recompute
    assert plan.extra["lifted"]["from"] == [4] and plan.extra["lifted"]["split_dim"] == 0
    assert lifted.step_time_s == min(r.step_time_s for r in rows.values())


def _table_cells(output: str) -> dict[str, list[str]]:
    """The ``--gpus`` table's rows: mesh -> its cells (a wide terminal: one line a row)."""
    return {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
        for line in output.splitlines()
        if line.count("│") >= 8
    }


def test_the_table_says_which_shape_torchtitan_s_space_planned_and_why(tmp_path: Path, monkeypatch):
    """``solve --gpus 4``, the cap under 2x2's program: its row names the search that
    planned it and a note gives the reason; when torchtitan's space has no plan either
    (planted), the row says both reasons and 4 is still planned."""
    import autoshard.solver.meshes as searched
    import autoshard.solver.options as solver_options

    model = write_mlp(tmp_path, 64, 256, 1024)
    monkeypatch.setattr(solver_options, "MESH_SEARCH_COLUMNS", 2_000)
    args = ["solve", str(model), "--gpus", "4", "--gpus-per-node", "4", "--out", str(tmp_path)]
    run = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    cells = _table_cells(run.output)
    assert cells["4"][-1] == "ILP" and cells["2x2"][-1] == "4 ILP, lifted", cells
    assert "note: 2x2: its ILP has " in run.output
    assert "; 4's ILP plan laid onto it (4's dim 0 split into dims 0 and 1) takes " in run.output
    # the written plan's report says what planned it: no ILP on 2x2, 4's plan laid onto it
    solver = next(line for line in run.output.splitlines() if line.startswith("solver:"))
    assert solver.startswith("solver: no whole ILP on this mesh (its ILP is over the column cap, ")
    assert "4's ILP plan (" in solver and "laid onto it with 4's dim 0 split" in solver
    assert "started from no plan" not in run.output
    monkeypatch.setattr(searched, "lift_choice", lambda *a: None)  # torchtitan's plan stays
    run = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    cells = _table_cells(run.output)
    assert cells["4"][-1] == "ILP" and cells["2x2"][-1] == "torchtitan space", cells
    assert "note: 2x2 is planned in torchtitan's space" in run.output
    assert "its ILP has" in run.output.split("note: 2x2 is planned", 1)[1]

    real = searched.plan_space

    def refused(config, space, *rest):  # noqa: ANN001, ANN202
        if space == "torchtitan":
            raise AutoshardError("planted: no plan in this space")
        return real(config, space, *rest)

    monkeypatch.setattr(searched, "plan_space", refused)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 4) for s in node_shapes(4, 4)]
    rows = {r.mesh.shape: r for r in search_meshes(config, meshes).rows}
    assert rows[(4,)].result is not None
    assert rows[(2, 2)].result is None and rows[(2, 2)].error.startswith("its ILP has ")
    assert rows[(2, 2)].error.endswith("; in torchtitan's space: planted: no plan in this space")
    # with lifting: the shape torchtitan's space has no plan for gets 4's plan laid onto it
    monkeypatch.setattr(searched, "lift_choice", lift_choice)
    rows = {r.mesh.shape: r for r in search_meshes(config, meshes).rows}
    row = rows[(2, 2)]
    assert row.result is not None and row.error is None and row.lifted_from == (4,)
    assert row.note.endswith("torchtitan's space has no plan (planted: no plan in this space)")


_BLOCK = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2048, 2048)

    def forward(self, x):
        return torch.relu(self.fc(x))
"""


@pytest.mark.slow
def test_pipeline_depths_rank_beside_the_shapes_each_as_stages_plans_it(tmp_path: Path):
    """``--gpus 4 --gpus-per-node 2 --pp 2,4`` on 4 blocks: pp=2 splits the 2x2 mesh's
    leading (across-node) dim, 2 blocks a stage on a 1x2 submesh; pp=4 the whole 2x2,
    one GPU a stage. Each pipeline row's step is the one ``autoshard.stages`` finds on
    that mesh alone, the rows are fastest first, and the one-mesh rows are the search's
    own (the best without stages is what solve writes)."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 4, 64, 2048))
    out = tmp_path / "out"
    args = ["solve", str(model), "--gpus", "4", "--gpus-per-node", "2", "--pp", "2,4"]
    run = _cli(*args, "--json", "-q", "--out", str(out))
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    rows = {(tuple(r["mesh"]), r["pp"]): r for r in doc["meshes"]}
    assert set(rows) == {((4,), 1), ((2, 2), 1), ((2, 2), 2), ((2, 2), 4)}
    loaded = instantiate(load_model_file(model), device="meta")
    for pp in (2, 4):
        alone = autoshard.stages(
            loaded.module, loaded.inputs, MeshSpec.on_nodes((2, 2), 2), pp=pp, microbatches=8
        )
        assert rows[((2, 2), pp)]["step_time_s"] == pytest.approx(
            alone.stage_plan.step_time_s, rel=1e-12
        )
    steps = [r["step_time_s"] for r in doc["meshes"]]
    assert steps == sorted(steps)
    best_one_mesh = min(r["step_time_s"] for (_, pp), r in rows.items() if pp == 1)
    assert doc["time_s"]["step"] == pytest.approx(best_one_mesh, rel=1e-12)


@pytest.mark.slow
def test_a_pipeline_row_writes_the_stage_plan_stages_writes(tmp_path: Path):
    """The file a fastest pipeline row writes reads back as ``autoshard stages``' own:
    the same split and step."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 4, 64, 2048))
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    (row,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2)
    assert row.mesh.shape == (2, 2) and row.pp == 2 and row.planned
    path = tmp_path / "stack_2x2_pp2.stages.json"
    stage_file(row, path)
    back = load_stage_plan(path)
    assert list(row.stages.stage_plan.balance) == [2, 2]
    assert [len(st.module_paths) for st in back.stages] == [2, 2]
    assert back.mesh_shape == (2, 2) and back.pp == 2
    assert back.step_time_s == pytest.approx(row.step_time_s, rel=1e-12)


@pytest.mark.slow
def test_a_pipeline_depth_counts_its_candidate_stages_as_it_prices_them(tmp_path: Path):
    """``--pp`` on a deep model prices many candidate stages (one ILP per structurally new
    one): the search reports each, counted against every stage of every split of the
    layers, 2 (L - 1) for two stages (here L = 4: 6), from 0 to the total; and a piped
    run's progress prints the count of a long phase."""
    import io

    from rich.console import Console

    from autoshard.cli.options import Progress

    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 4, 64, 2048))
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    seen: list[tuple[str, int, int]] = []
    (row,) = pipeline_rows(
        config, meshes, [2], 8, gpus_per_node=2, progress=lambda *a: seen.append(a)
    )
    assert row.planned
    counts = [(done, total) for phase, done, total in seen if phase == "stages of pp=2 on 2x2"]
    assert counts == [(k, 6) for k in range(7)]

    text = io.StringIO()
    piped = Progress(Console(file=text, force_terminal=False, width=200))
    piped.EVERY_S = 0.0
    for k in range(4):
        piped("stages of pp=2 on 2x2", k, 3)
    lines = text.getvalue().splitlines()
    assert lines[0] == "stages of pp=2 on 2x2 ..."
    assert lines[1:3] == ["stages of pp=2 on 2x2: 1/3", "stages of pp=2 on 2x2: 2/3"]
    assert lines[3].startswith("stages of pp=2 on 2x2: done in ")


@pytest.mark.slow
def test_a_deep_model_s_stages_are_traced_reduced_and_priced_as_the_whole_trace_prices_them(
    tmp_path: Path,
):
    """24 blocks, pp 2 and 4, one trace: torchtitan's splits are 12 + 12 and 6 + 7 + 6 + 5
    (the embedding and head weigh one layer each), so the trace is cut at 0, 6, 12, 13,
    19 and 24 and each segment is traced as its first two blocks, one middle block for the
    rest, and its last (18 traced blocks, not 24). Each depth prices only its own split
    (one ILP per stage, not one per stage of every split), and its step, stage times and
    memory equal those of the same split priced on the model traced block by block (the
    trace the pipeline search used before). Both are solved to optimality: within the
    default 1% gap either ILP may stop on another plan (it did, 4e-5 apart, once the links
    were priced at NCCL's bus bandwidth)."""
    from autoshard.pipeline.pricing import layer_map, plan_pipeline
    from autoshard.solver.solve import trace

    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 24, 64, 2048))
    config = SolveConfig(
        model_path=model, mesh=MeshSpec.from_options("4"), solver=SolverOptions(mip_gap=0.0)
    )
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    two, four = pipeline_rows(config, meshes, [2, 4], 8, gpus_per_node=2)
    graph = two.stages.graph
    assert graph is four.stages.graph  # one trace for both depths
    assert graph.depth.stands_for == (
        (0,), (1,), (2, 3, 4), (5,),  # [0, 6)
        (6,), (7,), (8, 9, 10), (11,),  # [6, 12)
        (12,),  # [12, 13)
        (13,), (14,), (15, 16, 17), (18,),  # [13, 19)
        (19,), (20,), (21, 22), (23,),  # [19, 24)
    )  # fmt: skip
    whole = replace(config, tie=False, activation_checkpointing="none")
    every = trace(whole, microbatches=8)
    assert every.depth is None and every.num_layers == 24
    for row, split, ilps in ((two, [0, 12, 24], 2), (four, [0, 6, 13, 19, 24], 4)):
        plan = row.stages
        assert list(plan.stage_plan.boundaries) == split
        assert plan.result.costs.pricer.ilps == ilps
        balance = ", ".join(str(b - a) for a, b in itertools.pairwise(split))
        assert f"split as torchtitan splits them ({balance})" in row.note
        alone = plan_pipeline(
            replace(whole, mesh=row.mesh), every, layer_map(every), row.pp, 8, split=split
        ).stage_plan
        assert plan.stage_plan.stage_times_s == pytest.approx(alone.stage_times_s, rel=1e-12)
        assert plan.stage_plan.stage_memory_bytes == pytest.approx(
            alone.stage_memory_bytes, rel=1e-12
        )
        assert row.step_time_s == pytest.approx(alone.step_time_s, rel=1e-12)


@pytest.mark.slow
def test_a_depth_whose_lp_bound_cannot_beat_the_best_is_skipped_and_says_so(tmp_path: Path):
    """12 blocks, pp=2: each stage's LP relaxation (solved with no ILP yet) is at most its
    ILP's time, so the
    1F1B step over them is a lower bound on the row's step; a best plan under that bound
    skips the depth without its stage ILPs (the row holds the bound and says why), and a
    best plan above the row's step does not."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 12, 64, 2048))
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    (row,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2)
    costs = row.stages.result.costs
    fresh = price_pipeline(  # no stage priced yet: each bound is its LP's
        replace(config, mesh=row.mesh, tie=False, activation_checkpointing="none"),
        row.stages.graph,
        row.stages.layers,
        2,
        8,
    )
    for i, j in itertools.pairwise(row.stages.stage_plan.boundaries):
        low = fresh.pricer.bound(i, j)
        assert 0 < low <= costs.pricer.price(i, j).time_s * (1 + 1e-9)
        assert fresh.pricer.ilps == 0
    step = row.step_time_s
    low = 0.5 * step
    (skipped,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2, beat=low)
    assert not skipped.planned and low <= skipped.bound_s <= step * (1 + 1e-9)
    assert skipped.error.startswith("skipped: its stages' LP relaxations give a step of at least")
    (kept,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2, beat=1.01 * step)
    assert kept.planned and kept.bound_s is None
    assert kept.step_time_s == pytest.approx(step, rel=1e-12)


def test_a_depth_whose_stage_cannot_fit_says_so_and_is_not_skipped(tmp_path: Path):
    """24 blocks, pp=2, a 64 MiB budget no stage fits (each holds 12 blocks of 16 MiB of
    weights): the first stage's LP is infeasible, which bounds nothing, so the depth is not
    skipped; its row gives the memory error of its split, with no bound."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 24, 64, 2048))
    mesh = MeshSpec.from_options("4")
    config = SolveConfig(model_path=model, mesh=mesh, memory_budget=64 * 2**20)
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    (row,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2, beat=1e-9)
    assert not row.planned and row.bound_s is None
    assert row.error.startswith("the split [0, 12, 24] of 24 layers into 2 stages does not fit")


@pytest.mark.slow
def test_a_depth_prices_the_same_split_whatever_other_depths_are_asked(tmp_path: Path):
    """10 blocks: pp=2 splits them 5 + 5 (a stage over 4 blocks: that split alone, on a
    trace reduced to 8 blocks); pp=4 splits them 2 + 3 + 3 + 2 (no stage over 4: every
    split searched, on a second trace of every block, as ``autoshard stages`` searches
    them). Asked with or without the other, each depth gives the same plan."""
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 10, 64, 2048))
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    two, four = pipeline_rows(config, meshes, [2, 4], 8, gpus_per_node=2)
    (alone,) = pipeline_rows(config, meshes, [2], 8, gpus_per_node=2)
    assert two.stages.graph.depth.stands_for[:4] == ((0,), (1,), (2, 3), (4,))
    assert two.stages.stage_plan.boundaries == alone.stages.stage_plan.boundaries == (0, 5, 10)
    assert two.step_time_s == pytest.approx(alone.step_time_s, rel=1e-12)
    assert four.stages.graph.depth is None and four.note is None
    loaded = instantiate(load_model_file(model), device="meta")
    searched = autoshard.stages(
        loaded.module, loaded.inputs, MeshSpec.on_nodes((2, 2), 2), pp=4, microbatches=8
    )
    assert four.step_time_s == pytest.approx(searched.stage_plan.step_time_s, rel=1e-12)


@pytest.mark.slow
def test_the_table_ranks_a_skipped_depth_by_its_bound_and_says_why(tmp_path: Path, monkeypatch):
    """``solve --gpus 4 --pp 2 --json`` on 24 blocks, each stage's LP bound planted at
    1000 s: the pp=2 row is skipped after its first stage's bound (1F1B over 8
    micro-batches: 8000 s at least), ranked by that bound after the plans, its table row
    and note say so, the summary line counts it, and the JSON row holds the bound without
    a step."""
    from autoshard.pipeline.stage_ilp import StagePricer

    monkeypatch.setattr(StagePricer, "bound", lambda self, i, j: 1000.0)
    model = tmp_path / "stack.py"
    model.write_text(block_stack(_BLOCK, 24, 64, 2048))
    args = ["solve", str(model), "--gpus", "4", "--gpus-per-node", "2", "--pp", "2", "--json"]
    run = CliRunner().invoke(main, [*args, "--out", str(tmp_path)], env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    doc = json.loads(run.stdout)
    assert [(r["mesh"], r["pp"]) for r in doc["meshes"]][-1] == ([2, 2], 2)
    skipped = doc["meshes"][-1]
    assert skipped["step_time_s"] is None and skipped["bound_s"] == pytest.approx(8000.0)
    assert skipped["error"].startswith("skipped: its stages' LP relaxations give a step of")
    table = [line for line in run.stderr.splitlines() if line.count("│") >= 8]
    cells = [c.strip() for c in table[-1].split("│")[1:-1]]
    assert cells[:2] == ["2x2", "2"] and cells[3].startswith(">= ") and cells[-1] == "skipped"
    assert "note: 2x2 with pp=2 is skipped: its stages' LP relaxations" in run.stderr
    assert "; 1 skipped by a lower bound)" in " ".join(run.stderr.split())


def test_stage_bounds_that_do_not_split_the_blocks_are_one_line():
    from autoshard.trace.tracer import reduce_depth

    stack = torch.nn.Module()
    stack.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(6))
    with pytest.raises(AutoshardError, match=r"stage boundaries \[0, 3, 3, 6\] do not split"):
        reduce_depth(stack, bounds=lambda n: [0, 3, 3, n])
    assert reduce_depth(stack, bounds=lambda n: [0, 3, n]) is None  # no stage over 4 blocks
    assert len(stack.layers) == 6
    depth = reduce_depth(stack, bounds=lambda n: [0, 1, n])
    assert depth.stands_for == ((0,), (1,), (2,), (3, 4), (5,))
    assert len(stack.layers) == 5


def test_pp_without_gpus_or_below_2_is_one_line(tmp_path: Path):
    model = write_mlp(tmp_path, 64, 256, 1024)
    run = _cli("solve", str(model), "--mesh", "4", "--pp", "2")
    assert run.exit_code != 0 and "--pp tries pipeline depths beside the mesh shapes" in run.output
    run = _cli("solve", str(model), "--gpus", "4", "--pp", "1,2")
    assert run.exit_code != 0 and "give pipeline depths of 2 or more" in run.output
