"""Improving a plan by the ILP over its neighbourhoods (autoshard.solver.neighbourhood),
held against the whole mesh's ILP solved to optimality on meshes small enough to solve."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard

import autoshard.solver.neighbourhood as neighbourhoods
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.solver.lifting import lift_choice
from autoshard.solver.neighbourhood import improve, neighbourhood, pairs_of_dims
from autoshard.solver.options import SolverOptions
from autoshard.solver.solve import (
    SolveConfig,
    finish_plan,
    plan_model,
    trace,
)
from autoshard.units import format_seconds
from tests.helpers import write_mlp_mse


def _four_and_two_by_two(tmp_path: Path, b: int, d: int, h: int):
    """Alpa's MSE MLP on 4 GPUs in nodes of 2: 4's and 2x2's ILPs solved to optimality
    (dim 0 of 2x2 across nodes, dim 1 inside one; 4 across nodes)."""
    model = write_mlp_mse(tmp_path, b, d, h)
    config = SolveConfig(
        model_path=model, mesh=MeshSpec.on_nodes((4,), 2), solver=SolverOptions(mip_gap=0)
    )
    graph = trace(config)
    four = plan_model(config, graph=graph)
    config22 = replace(config, mesh=MeshSpec.on_nodes((2, 2), 2))
    own = plan_model(config22, graph=graph)
    return config22, four, own


def _improve(config, sg, choice, free=None):  # noqa: ANN001, ANN202
    """With the overlap savings in each neighbourhood's ILP: its exact optimum."""
    return improve(config, sg, choice, free=free, overlap=True)


def _placements(sg, choice, dims):  # noqa: ANN001, ANN202
    """Every representative's output and input placements on mesh dims ``dims``."""
    out = {}
    for rep, i in choice.items():
        s = sg.nodes[rep].strategies[i]
        out[rep] = [
            None if p is None else tuple(p[d] for d in dims) for p in (*s.outputs, *s.inputs)
        ]
    return out


@pytest.mark.parametrize(
    ("b", "d", "h"),
    [
        (64, 256, 1024),  # 4 keeps it whole (replicated); 2x2 is R x Megatron
        (1024, 4096, 16384),  # Megatron over 4 laid onto 2x2: not 2x2's optimum
    ],
)
def test_the_neighbourhoods_of_a_lifted_plan_reach_the_whole_ilp_s_optimum(
    tmp_path: Path, b: int, d: int, h: int
):
    """4's optimal plan laid onto 2x2 (dim 0 split) is slower there than 2x2's own optimum
    (the whole ILP, mip_gap 0). The ILP over the plan's neighbourhood of dim 1 (dim 0's
    placements kept), then of dim 0, reaches that optimum exactly: on the small MLP, from
    replicating everything (what 4's plan is over the network's links) to Megatron on dim
    1, Alpa's hand-known answer for a slow dim 0. Each step keeps the fixed dim's
    placements of the plan it started from. As the search runs it (each neighbourhood's
    ILP but the last without the overlap savings), the plan is no slower than the lifted
    one and no faster than the whole ILP's optimum."""
    config, four, own = _four_and_two_by_two(tmp_path, b, d, h)
    sg = own.sg
    lifted = lift_choice(four.sg, four.plan.choice, sg, 0)
    assert lifted is not None
    plain = replace(sg, checkpointing=None)
    before = evaluate(plain, lifted)
    assert before > own.plan.step_time_s * (1 + 1e-9)
    first = _improve(config, sg, lifted, free=[(1,)])
    assert _placements(sg, first.choice, [0]) == _placements(sg, lifted, [0])
    found = _improve(config, sg, first.choice, free=[(0,)])
    assert _placements(sg, found.choice, [1]) == _placements(sg, first.choice, [1])
    assert found.after_s == pytest.approx(own.plan.step_time_s, rel=1e-9)
    # the plan built from the choice (autoshard.plan) prices what the ILP's objective did
    assert finish_plan(config, sg, found.choice, "x").step_time_s == pytest.approx(
        found.after_s, rel=1e-9
    )
    default = improve(config, sg, lifted)
    assert own.plan.step_time_s * (1 - 1e-9) <= default.after_s < before
    assert sg.overlap and [s["overlap"] for s in default.steps] == [False, True]
    assert [s["overlap"] for s in improve(config, sg, lifted, overlap=False).steps] == [False] * 2
    if b == 64:  # replicated on the slow dim, Megatron's column-then-row pair on the fast one
        params = finish_plan(config, sg, found.choice, "improved").parameters
        assert params["fc1.weight"] == (Replicate(), Shard(0))
        assert params["fc2.weight"] == (Replicate(), Shard(1))
        lifted_params = finish_plan(config, sg, lifted, "lifted").parameters
        assert set(lifted_params.values()) == {(Replicate(), Replicate())}


def test_a_neighbourhood_keeps_the_fixed_dims_and_frees_the_others(tmp_path: Path):
    """Free on every dim: every strategy (no dim is fixed, so no own collective is held);
    free on none: only the start's own placements, and on each edge the one (produced,
    wanted) pair the plan uses; free on dim 1: every pair left has the plan's placements
    on dim 0 on both sides."""
    config, four, own = _four_and_two_by_two(tmp_path, 64, 256, 1024)
    sg = own.sg
    choice = own.plan.choice
    everything = neighbourhood(sg, choice, (0, 1))
    assert all(len(everything.allowed[r]) == len(sg.nodes[r].strategies) for r in sg.reps)
    nothing = neighbourhood(sg, choice, ())
    for r in sg.reps:
        kept = [sg.nodes[r].strategies[i] for i in nothing.allowed[r]]
        s0 = sg.nodes[r].strategies[choice[r]]
        assert choice[r] in nothing.allowed[r]
        assert all((s.outputs, s.inputs) == (s0.outputs, s0.inputs) for s in kept)
    one = neighbourhood(sg, choice, (1,))
    for i, e in enumerate(sg.edges):
        plan_pair = (e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]])
        left = np.argwhere(~nothing.forbidden.get(i, np.zeros(e.cost.shape, dtype=bool)))
        assert [tuple(p) for p in left] == [plan_pair]
        p0, q0 = e.src_placements[plan_pair[0]][0], e.dst_placements[plan_pair[1]][0]
        for a, b in np.argwhere(~one.forbidden.get(i, np.zeros(e.cost.shape, dtype=bool))):
            assert (e.src_placements[a][0], e.dst_placements[b][0]) == (p0, q0)
    with pytest.raises(AutoshardError, match=r"mesh dims \[2\] are not all dims of a 2-D mesh"):
        neighbourhood(sg, choice, (2,))


def test_a_plan_that_recomputes_is_left_as_it_is(tmp_path: Path, monkeypatch):
    """The neighbourhoods have no checkpointing decision: a plan recomputing a block is
    returned unchanged, and the result says why (planted: a recompute count of 1)."""
    config, four, own = _four_and_two_by_two(tmp_path, 64, 256, 1024)
    sg = own.sg

    def planted(*args):  # noqa: ANN002, ANN202
        pytest.fail("no ILP may run")

    monkeypatch.setattr(neighbourhoods, "solve_within_memory", planted)
    found = improve(config, sg, own.plan.choice, recompute={(0, "full"): 1})
    assert not found.improved and found.choice == own.plan.choice and found.steps == []
    assert found.skipped.startswith("the plan recomputes blocks")


def test_the_default_neighbourhoods_free_each_pair_of_dims():
    """Two dims free of three (one fixed) on a 3-D mesh, one dim on a 2-D mesh."""
    assert pairs_of_dims(3) == [(1, 2), (0, 2), (0, 1)]
    assert pairs_of_dims(2) == [(1,), (0,)]
    assert pairs_of_dims(1) == [(0,)]


def test_the_mesh_search_improves_its_fastest_lifted_plan_to_the_shape_s_own_optimum(
    tmp_path: Path, monkeypatch
):
    """``--gpus 4 --gpus-per-node 2`` with 2x2's program over the search's column cap
    (planted): 4's plan laid onto 2x2 is the fastest row, and the search improves it in
    its neighbourhoods to 2x2's own optimum, what ``solve --mesh 2x2 --gpus-per-node 2``
    finds on its own (mip_gap 0 both). The row, the table and the plan's report say so."""
    from click.testing import CliRunner

    import autoshard.solver.options as solver_options
    from autoshard.cli.main import main
    from autoshard.cost.mesh import node_shapes
    from autoshard.solver.ilp import program_columns
    from autoshard.solver.meshes import search_meshes

    config, four, own = _four_and_two_by_two(tmp_path, 1024, 4096, 16384)
    cap = (program_columns(four.sg) + program_columns(own.sg)) // 2
    monkeypatch.setattr(solver_options, "MESH_SEARCH_COLUMNS", cap)
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    search = search_meshes(replace(config, mesh=meshes[0]), meshes, gpus_per_node=2)
    row = next(r for r in search.rows if r.mesh.shape == (2, 2))
    assert row.lifted_from == (4,) and search.best is row
    lifted = row.result.plan.extra["lifted"]["improved"]
    assert lifted["after_s"] < lifted["before_s"]
    assert [s["free"] for s in lifted["steps"]] == [[1], [0]]
    assert row.step_time_s == pytest.approx(own.plan.step_time_s, rel=1e-9)
    assert row.result.ilp.status.endswith("improved in its neighbourhoods (2 ILPs)")
    assert row.note.endswith(f"improved in its neighbourhoods to {format_seconds(row.step_time_s)}")
    args = ["solve", str(config.model_path), "--gpus", "4", "--gpus-per-node", "2"]
    args += ["--mip-gap", "0", "--out", str(tmp_path)]
    run = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    assert "4 ILP, lifted, improved" in run.output
    words = " ".join(run.output.split())
    assert "solver: no whole ILP on this mesh (its ILP is over the column cap, " in words
    assert "laid onto it with 4's dim 0 split into dims 0 and 1: " in words
    assert "then the ILP over its neighbourhoods (the other dims' placements kept)" in words
    assert f"dims 1 free: optimal, {format_seconds(row.step_time_s)}" in words


def test_an_own_collective_is_held_on_a_fixed_dim_and_free_on_a_free_one():
    """A strategy's own collectives (context parallelism's key/value all-gather over a
    mesh dim) must be the plan's on the fixed dims: dropping the plan's all-gather over
    dim 1 is in the neighbourhood that frees dim 1, not in the one that fixes it; the same
    placements with an all-gather added over fixed dim 0 are in neither."""
    from autoshard.solver.neighbourhood import _differs_only_on
    from autoshard.strategies.strategy import Strategy

    ps = ((Shard(0), Shard(1)),)
    plan = Strategy(ps, ps, (("all_gather", 1, 1e6),))
    none = Strategy(ps, ps, ())
    over_0 = Strategy(ps, ps, (("all_gather", 1, 1e6), ("all_gather", 0, 2e6)))
    assert _differs_only_on(none, plan, fixed=[0])
    assert not _differs_only_on(none, plan, fixed=[1])
    assert not _differs_only_on(over_0, plan, fixed=[0])
    assert _differs_only_on(over_0, plan, fixed=[])
    moved = Strategy(((Shard(0), Replicate()),), ps, (("all_gather", 1, 1e6),))
    assert _differs_only_on(moved, plan, fixed=[0]) and not _differs_only_on(moved, plan, [1])


def test_an_optimal_plan_is_not_improved_and_the_report_says_so(tmp_path: Path):
    """From 2x2's own optimum (mip_gap 0) no neighbourhood finds a faster plan: the plan
    comes back as it was and the report's line ends "nothing faster"; a skipped plan's
    line says why it was not tried."""
    from autoshard.plan.report import lifted_line

    config, four, own = _four_and_two_by_two(tmp_path, 1024, 4096, 16384)
    sg = own.sg
    found = _improve(config, sg, own.plan.choice)
    assert not found.improved and found.choice == own.plan.choice
    assert found.before_s == found.after_s == pytest.approx(own.plan.step_time_s, rel=1e-9)
    assert [s["free"] for s in found.steps] == [[1], [0]]
    lifted = {
        "from": [4],
        "split_dim": 0,
        "source_status": "optimal",
        "source_gap": 0.0,
        "source_step_s": four.plan.step_time_s,
        "improved": found.to_dict(),
    }
    line = lifted_line(lifted, own.plan.step_time_s)
    assert line.startswith("solver: no whole ILP on this mesh")
    assert "dims 1 free: optimal, " in line and line.endswith("): nothing faster")
    lifted["improved"] = {"before_s": None, "after_s": None, "steps": [], "skipped": "planted"}
    lifted["improved"]["improved"] = False
    line = lifted_line(lifted, own.plan.step_time_s)
    assert line.startswith("solver: none on this mesh") and line.endswith(
        ", not improved (planted)"
    )


def test_every_lifted_row_is_improved_as_its_shape_alone_would_be(tmp_path: Path, monkeypatch):
    """16 GPUs in nodes of 4, the 3-D shapes' programs over the search's column cap
    (planted): 4x2x2 and 2x2x4 each get 4x4's plan laid onto them and improved in its
    neighbourhoods, the fastest row and the others alike. Each row's step equals that
    shape planned alone the same way: 4x4 solved on its own (``plan_model``), its plan
    laid onto the shape and improved. 4x2x2's row is not the fastest and is improved."""
    import autoshard.solver.options as solver_options
    from autoshard.cost.mesh import node_shapes
    from autoshard.solver.lifting import splits
    from autoshard.solver.meshes import search_meshes
    from autoshard.solver.solve import strategies

    model = write_mlp_mse(tmp_path, 1024, 4096, 16384)
    config = SolveConfig(
        model_path=model, mesh=MeshSpec.on_nodes((16,), 4), solver=SolverOptions(mip_gap=0)
    )
    monkeypatch.setattr(solver_options, "MESH_SEARCH_COLUMNS", 10_000)
    meshes = [MeshSpec.on_nodes(s, 4) for s in node_shapes(16, 4)]
    assert [m.shape for m in meshes] == [(16,), (4, 4), (4, 2, 2), (2, 2, 4)]
    search = search_meshes(config, meshes, gpus_per_node=4)
    graph = trace(config)
    source = plan_model(replace(config, mesh=meshes[1]), graph=graph)  # 4x4 alone
    lifted = {r.mesh.shape: r for r in search.rows if r.lifted_from is not None}
    assert set(lifted) == {(4, 2, 2), (2, 2, 4)}
    capped = replace(config.solver, max_columns=10_000)  # as the search solves them
    for mesh in meshes[2:]:
        row = lifted[mesh.shape]
        shaped = replace(config, mesh=mesh, solver=capped)
        sg = strategies(shaped, graph)
        (m,) = splits((4, 4), mesh.shape)
        start = lift_choice(source.sg, source.plan.choice, sg, m)
        alone = improve(shaped, sg, start, source.ilp.recompute)
        assert row.step_time_s == pytest.approx(alone.after_s, rel=1e-12)
    assert search.rows[0].mesh.shape != (4, 2, 2)
    steps = lifted[(4, 2, 2)].result.plan.extra["lifted"]["improved"]
    assert steps["after_s"] < steps["before_s"]


@pytest.mark.slow  # four shapes searched, each solved again on its own (about 20 s)
def test_solve_mesh_over_the_cap_plans_the_shape_as_the_search_does(tmp_path: Path, monkeypatch):
    """16 GPUs in nodes of 4, the 3-D shapes' programs over a column cap of 10,000:
    ``solve --mesh S --gpus-per-node 4`` (``plan_mesh``) plans each shape as the search's
    S row, to the last digit (4x4's ILP plan laid onto 4x2x2 and 2x2x4 and improved, as
    issue 32's one-by-one comparison solves each shape; 16 and 4x4 solved whole, as
    ``plan_model`` solves them, with its seconds), so the search's best is the fastest of
    the shapes solved one by one. Each 3-D shape's whole ILP (the cap raised over its
    columns, ``--max-columns``) is no slower than the row (the lifted plan is one of its
    plans). Plain ``--mesh 4x2x2`` (dim 0 across nodes, the rest inside nodes of 4: the
    same links) gives the same plan. The command line's report says how the plan was
    found and how to solve the whole ILP."""
    from click.testing import CliRunner

    from autoshard.cli.main import main
    from autoshard.cost.mesh import node_shapes
    from autoshard.solver.ilp import program_columns
    from autoshard.solver.meshes import plan_mesh, search_meshes
    from autoshard.solver.solve import strategies

    model = write_mlp_mse(tmp_path, 1024, 4096, 16384)
    cap = SolverOptions(mip_gap=0, max_columns=10_000)
    config = SolveConfig(model_path=model, mesh=MeshSpec.on_nodes((16,), 4), solver=cap)
    meshes = [MeshSpec.on_nodes(s, 4) for s in node_shapes(16, 4)]
    search = search_meshes(config, meshes, gpus_per_node=4)
    rows = {r.mesh.shape: r for r in search.rows}
    graph = trace(config)
    alone, sizes = {}, {}
    for mesh in meshes:
        shaped = replace(config, mesh=mesh)
        found = plan_mesh(shaped, gpus_per_node=4)
        alone[mesh.shape] = found.plan.step_time_s
        assert alone[mesh.shape] == rows[mesh.shape].step_time_s, mesh.shape
        assert found.meshes is None
        if len(mesh.shape) < 3:  # within the cap: the whole ILP, as plan_model plans it
            assert found.plan.step_time_s == plan_model(shaped, graph=graph).plan.step_time_s
            assert list(found.seconds) == [
                "trace", "strategies", "hand_plans", "ilp_build", "solve", "total"
            ]  # fmt: skip
            assert "notes" not in found.plan.extra
            continue
        assert rows[mesh.shape].lifted_from == (4, 4)
        assert found.plan.extra["notes"] == [rows[mesh.shape].note]
        assert {"trace", "strategies", "lift", "neighbourhoods", "sources", "total"} <= set(
            found.seconds
        )
        assert found.seconds["sources"] > 0
        columns = sizes[mesh.shape] = program_columns(strategies(shaped, graph))
        assert columns > cap.max_columns
        whole = replace(shaped, solver=replace(cap, max_columns=columns))
        own = plan_mesh(whole, gpus_per_node=4)
        assert "lifted" not in own.plan.extra and own.ilp.num_variables >= columns
        assert own.plan.step_time_s <= alone[mesh.shape] * (1 + 1e-9)
    assert search.best.step_time_s == min(alone.values())
    plain = replace(config, mesh=MeshSpec.from_options("4x2x2"))  # --mesh's convention
    assert plain.mesh.bandwidth == meshes[2].bandwidth
    assert plan_mesh(plain).plan.step_time_s == alone[(4, 2, 2)]
    args = ["solve", str(model), "--mesh", "4x2x2", "--gpus-per-node", "4", "--mip-gap", "0"]
    args += ["--max-columns", "10000", "--out", str(tmp_path)]
    run = CliRunner().invoke(main, args, env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    words = " ".join(run.output.split())
    assert "solver: no whole ILP on this mesh (its ILP is over the column cap, " in words
    assert "4x4's ILP plan (optimal, gap 0.00%; " in words
    assert "over the 10,000 solved whole (--max-columns); to solve it whole anyway: --mesh " in (
        words
    )
    assert f"--mesh 4x2x2 --gpus-per-node 4 --max-columns {sizes[(4, 2, 2)]} (" in words
    assert f"improved in its neighbourhoods to {format_seconds(alone[(4, 2, 2)])}" in words


def test_a_mesh_is_lifted_from_the_shapes_it_splits_on_its_own_links():
    """The shapes with one dim fewer, worked by hand: 2x4x8 over nodes of 8 (dims 0 and
    1 across nodes) splits 8x8's dim 0 (both across nodes: the network's links), not
    2x32 (a dim of 32 over 4 nodes and their NVLink); plain ``--mesh 2x4x8`` (dim 0
    across nodes, dims 1 and 2 inside nodes of 32) splits 2x32's dim 1, not 8x8 (8
    ranks over 2 nodes of 4 GPUs each). A merged dim takes the slower of its two
    links."""
    from autoshard.cost.mesh import (
        DEFAULT_INTER_NODE_BW,
        DEFAULT_INTER_NODE_LATENCY,
        DEFAULT_INTRA_NODE_BW,
        DEFAULT_INTRA_NODE_LATENCY,
    )
    from autoshard.solver.meshes import lift_sources

    inter = (DEFAULT_INTER_NODE_BW, DEFAULT_INTER_NODE_LATENCY)
    intra = (DEFAULT_INTRA_NODE_BW, DEFAULT_INTRA_NODE_LATENCY)
    (on_nodes,) = lift_sources(MeshSpec.on_nodes((2, 4, 8), 8), 8)
    assert on_nodes == MeshSpec.on_nodes((8, 8), 8)
    assert list(zip(on_nodes.bandwidth, on_nodes.latency, strict=True)) == [inter, intra]
    (plain,) = lift_sources(MeshSpec.from_options("2x4x8"))
    assert plain.shape == (2, 32)
    assert list(zip(plain.bandwidth, plain.latency, strict=True)) == [inter, intra]
    assert lift_sources(MeshSpec.on_nodes((4, 2, 2), 4), 4) == [MeshSpec.on_nodes((4, 4), 4)]
    assert lift_sources(MeshSpec.from_options("8")) == []
    slow = MeshSpec((2, 2, 2), ("a", "b", "c"), (1e9, 2e9, 3e9), (3e-6, 2e-6, 1e-6))
    assert [(m.shape, m.bandwidth, m.latency) for m in lift_sources(slow, 8)] == [
        ((4, 2), (1e9, 3e9), (3e-6, 1e-6)),
        ((2, 4), (1e9, 2e9), (3e-6, 2e-6)),
    ]


def test_an_option_solve_would_not_read_and_a_compare_row_over_the_cap_say_so(tmp_path: Path):
    """``--max-columns`` qualifies the ILP: beside ``--algo``, ``--preload`` or ``--space
    torchtitan`` it is refused in one line. ``compare``'s ``ilp`` row of a program over
    the cap does not start the whole ILP: its row names the count, the cap and the
    ``solve`` command that plans it; the hand plans' rows are priced as before."""
    from click.testing import CliRunner

    from autoshard.cli.main import main
    from autoshard.solver.compare import compare_plans
    from autoshard.solver.solve import strategies

    model = write_mlp_mse(tmp_path, 64, 256, 1024)
    for extra in (["--algo", "ddp"], ["--space", "torchtitan"]):
        run = CliRunner().invoke(
            main, ["solve", str(model), "--mesh", "2x2", "--max-columns", "10", *extra]
        )
        assert run.exit_code != 0
        assert "--max-columns applies with the ILP (not with --algo, --preload or --space" in (
            run.output
        )
    config = SolveConfig(
        model_path=model, mesh=MeshSpec.from_options("2x2"), solver=SolverOptions(max_columns=10)
    )
    sg = strategies(config, trace(config))
    rows = {r.name: r for r in compare_plans(config, sg, ("ilp", "ddp"))}
    assert rows["ilp"].plan is None
    assert rows["ilp"].error.endswith(
        "over the 10 solved whole: autoshard solve --mesh 2x2 plans it (a plan of a shape "
        "with one dim fewer laid onto it and improved)"
    )
    assert rows["ddp"].plan is not None
