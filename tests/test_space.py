"""``autoshard solve --space torchtitan`` (issue 30, items 1-2): the plans FSDP2 and
``parallelize_module`` express, priced as DTensor runs them, exported with no difference.

The references are torch's own: ``parallelize_module`` and ``fully_shard`` run the exported
function on a meta model over a fake process group and must leave every parameter where the
plan says; on 8 gloo ranks the exported function must train like one device; and the free
ILP, which searches a superset, is never slower.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from helpers import (
    GPT2_DEFAULT,
    LLAMA_SMALL,
    MIXTRAL_SMALL,
    ROOT,
    autoshard_cli,
    ranks,
    write_model,
)

from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.model.model_file import load_model_file
from autoshard.plan.formats import ShardingMap, load_sharding_map
from autoshard.plan.styles import style_plan, styles_mesh_groups, torchtitan_code
from autoshard.solver.solve import SolveConfig, strategies, trace
from autoshard.solver.space import layouts, plan_space, search_space

MODELS = {
    "gpt2": GPT2_DEFAULT,
    # 4 key/value heads: whole heads on a tp of 4; the GQA one has 2, which 4 would split
    "llama": LLAMA_SMALL.replace("num_key_value_heads=2", "num_key_value_heads=4"),
    "llama_gqa": LLAMA_SMALL,
    "mixtral": MIXTRAL_SMALL,
}


def test_the_layouts_of_a_mesh_are_torchtitans_mesh_roles():
    """dp_replicate x dp_shard x tp, tp on the last dim of 2+ devices (inside a node)."""
    names = [(lay.name, lay.dp_replicate, lay.dp_shard, lay.tp_dim) for lay in layouts((2, 4))]
    assert names == [
        ("fsdp", (), (0, 1), None),
        ("hsdp", (0,), (1,), None),
        ("ddp", (0, 1), (), None),
        ("fsdp+tp", (), (0,), 1),
        ("ddp+tp", (0,), (), 1),
    ]
    assert [lay.name for lay in layouts((8,))] == ["fsdp", "ddp", "tp"]
    # a dim of one device does nothing; tp only on the last dim (the megatron plan's)
    assert [lay.name for lay in layouts((4, 2, 1))] == ["fsdp", "hsdp", "ddp"]
    assert len(layouts((2, 2, 2))) == 4 + 3


_TRACED: dict[str, object] = {}  # model name -> its traced graph (tests share a trace)


def _config(tmp_path: Path, name: str, mesh: str = "2x4", **kw) -> SolveConfig:
    model = write_model(tmp_path, MODELS[name], name)
    return SolveConfig(model_path=model, mesh=MeshSpec.from_options(mesh), mode="train", **kw)


def _graph(config: SolveConfig):
    """``config``'s model traced, once per test process (a trace depends on neither the
    mesh nor the budget)."""
    name = config.model_path.stem
    if name not in _TRACED:
        _TRACED[name] = trace(config)
    return _TRACED[name]


def _search(config: SolveConfig):
    """The space on ``config``'s strategies."""
    sg = strategies(config, _graph(config))
    return search_space(config, sg)


def _meta_model(config: SolveConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return load_model_file(config.model_path).module.build_model()


def _torch_placements(model: torch.nn.Module, groups, ndim: int) -> dict:
    """Every parameter's placements on the plan's mesh dims as torch left them: a styles
    mesh dim stands for the plan dims of its group (a flattened group's shard is that
    tensor dim on each of them; FSDP2's strided shard is its tensor dim)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dims = {g.name: g.dims for g in groups}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.replace("_checkpoint_wrapped_module.", "")  # a checkpointed block's
        full = [Replicate()] * ndim
        if isinstance(p, DTensor):
            for dim, pl in zip(p.device_mesh.mesh_dim_names, p.placements, strict=True):
                for d in dims[dim]:  # a strided shard has a tensor dim too
                    full[d] = Shard(pl.dim) if isinstance(getattr(pl, "dim", None), int) else pl
        out[name] = tuple(full)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_point_exports_as_planned_and_torch_places_it_so(tmp_path: Path, name: str):
    """Every point of the space with a plan, on 2x4: read back as styles it has no
    difference from the plan, and the exported ``parallelize`` run by torch's own
    ``parallelize_module`` / ``fully_shard`` (fake process group of 8) places every
    parameter as the plan does. GPT-2's Conv1D has no built-in style and Mixtral's
    experts are no ``nn.Linear``: their tensor-parallel points say so."""
    from autoshard._torch_private import fake_mesh

    config = _config(tmp_path, name)
    best, points = _search(config)
    made = [p for p in points if p.plan is not None]
    assert best in made and best.fits
    assert {"fsdp", "hsdp", "ddp"} <= {p.name for p in made}
    tp_points = [p for p in points if p.layout.tp_dim is not None]
    if name == "llama":  # Megatron's pairs of attention and MLP: 7 styled linears a block
        assert all(len(p.styles.tp) == 7 * 2 for p in tp_points)
    else:
        why = {
            "gpt2": "no module has a built-in tensor-parallel style",
            "llama_gqa": "would split attention heads",
            "mixtral": "would split attention heads",
        }[name]
        assert tp_points and all(why in p.error for p in tp_points), [p.error for p in tp_points]
    for point in made:
        plan = point.plan
        smap = ShardingMap(
            tuple(plan.mesh.shape), tuple(plan.mesh.dim_names), plan.parameters, plan.inputs
        )
        sp = style_plan(_meta_model(config), smap)
        assert sp.differences == [] and sp.unrunnable == [], point.name
        code = tmp_path / f"parallelize_{point.name}.py"
        code.write_text(torchtitan_code(sp, smap.mesh_shape, smap.dim_names))
        model = _meta_model(config)
        with fake_mesh((8,)):
            runpy.run_path(str(code))["parallelize"](model, device_type="cpu")
            groups = styles_mesh_groups(sp, smap.mesh_shape, smap.dim_names)
            got = _torch_placements(model, groups, len(smap.mesh_shape))
        assert got == {k: tuple(v) for k, v in plan.parameters.items()}, point.name


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
def test_the_free_ilp_is_never_slower_than_the_space(tmp_path: Path):
    """The space is a subset of the free one: the ILP's plan of the small Llama on 2x4 is at
    most the space's best (within the ILP's gap), and `compare` shows both."""
    from autoshard.solver.compare import compare_plans

    config = _config(tmp_path, "llama")
    sg = strategies(config, _graph(config))
    rows = {r.name: r for r in compare_plans(config, sg, ("ilp", "torchtitan"))}
    space = rows["torchtitan"]
    assert space.plan is not None and space.stats["chosen"] in space.plan.name
    gap = rows["ilp"].stats["gap"] or 0.0
    assert rows["ilp"].plan.step_time_s <= space.plan.step_time_s * (1 + gap) + 1e-12


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
def test_the_budget_picks_the_fastest_point_that_fits(tmp_path: Path):
    """Under a budget below the fastest point's memory the next fastest that fits wins; under
    one below every point's memory the error names the least; `full` checkpoints every
    point, and under `auto` a point that does not fit is tried again with checkpointing."""
    config = _config(tmp_path, "llama")
    best, points = _search(config)
    made = sorted((p for p in points if p.plan is not None), key=lambda p: p.plan.step_time_s)
    assert best is made[0]
    tighter = made[0].plan.memory_bytes * 0.999
    runner_up = next(p for p in made if p.plan.memory_bytes <= tighter)
    best2, points2 = _search(_config(tmp_path, "llama", memory_budget=tighter))
    assert best2.name in (runner_up.name, made[0].name + "+ac")
    assert best2.plan.step_time_s >= made[0].plan.step_time_s
    assert any(p.name == made[0].name + "+ac" for p in points2)  # auto: tried with AC
    least = min(p.plan.memory_bytes for p in made)
    with pytest.raises(MemoryBudgetError, match="least memory is"):
        _search(_config(tmp_path, "llama", memory_budget=least * 0.2))
    full = _config(tmp_path, "llama", activation_checkpointing="full")
    best3, points3 = _search(full)
    assert all(p.name.endswith("+ac") for p in points3)
    assert list(best3.plan.recomputed_blocks) == [0, 1]
    assert best3.plan.step_time_s > made[0].plan.step_time_s  # one more forward per block


@pytest.mark.slow
def test_solve_and_export_on_the_cli(tmp_path: Path):
    """`solve --space torchtitan` writes `<model>_2x4_torchtitan.*`, prints every point, and
    `export` of it prints no note and prices the styles at the plan's own step; `--space`
    refuses `--algo`."""
    from click.testing import CliRunner

    from autoshard.cli.main import main

    model = write_model(tmp_path, MODELS["llama"], "llama")
    args = ["solve", str(model), "--mesh", "2x4", "--space", "torchtitan", "--out", str(tmp_path)]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    assert "torchtitan space's 5 points" in out.stdout and "  * " in out.stdout, out.stdout
    smap = tmp_path / "llama_2x4_torchtitan.json"
    code = str(tmp_path / "p.py")
    exported = CliRunner().invoke(main, ["export", str(smap), str(model), "--out", code])
    assert exported.exit_code == 0, exported.output
    assert "note:" not in exported.stderr
    assert "(+0.0%:" in exported.stderr
    bad = CliRunner().invoke(main, [*args, "--algo", "ddp"])
    assert bad.exit_code != 0 and "drop --algo" in bad.output


@pytest.mark.slow
def test_a_checkpointed_point_exports_its_checkpointing(tmp_path: Path):
    """Under ``--activation-checkpointing full`` the chosen point recomputes every block:
    its map says so, the exported function wraps each block in ``checkpoint_wrapper``
    before FSDP (torchtitan's order), and torch, running it on a fake process group of 8,
    wraps exactly those blocks and places every parameter (named through the wrapper) as
    planned."""
    from autoshard._torch_private import fake_mesh
    from autoshard.plan.export import write_outputs

    config = _config(tmp_path, "llama", activation_checkpointing="full")
    best, _ = _search(config)
    assert best.name.endswith("+ac") and list(best.plan.recomputed_blocks) == [0, 1]
    _, path = write_outputs(best.plan, tmp_path, "llama_ac", config.cost_model(), {})
    smap = load_sharding_map(path)
    sp = style_plan(_meta_model(config), smap)
    assert sp.recompute == ["model.layers.0", "model.layers.1"] and sp.differences == []
    code = torchtitan_code(sp, smap.mesh_shape, smap.dim_names)
    assert code.index("checkpoint_wrapper(block)") < code.index("fully_shard(")
    (tmp_path / "p.py").write_text(code)
    model = _meta_model(config)
    with fake_mesh((8,)):
        runpy.run_path(str(tmp_path / "p.py"))["parallelize"](model, device_type="cpu")
        groups = styles_mesh_groups(sp, smap.mesh_shape, smap.dim_names)
        got = _torch_placements(model, groups, len(smap.mesh_shape))
    # FSDP2 renames a module's class (FSDPCheckpointWrapper): match the end
    wrapped = [
        n for n, m in model.named_modules() if type(m).__name__.endswith("CheckpointWrapper")
    ]
    assert wrapped == ["model.layers.0", "model.layers.1"]
    assert got == {k: tuple(v) for k, v in best.plan.parameters.items()}


@pytest.mark.slow
def test_a_data_parallel_dim_the_batch_does_not_split_over_has_no_point(tmp_path: Path):
    """A batch of 8 on a 4x4 mesh: data parallelism over both dims would split it 16 ways,
    so those layouts have no plan and say why (the styles would read the unsplit dim as
    tensor parallel, which the layout is not); FSDP on dim 0 with tp on dim 1 is made."""
    best, points = _search(_config(tmp_path, "llama", mesh="4x4"))
    by = {p.name: p for p in points}
    for name in ("fsdp", "hsdp", "ddp"):
        assert by[name].plan is None and "do not split their batch" in by[name].error
    assert best.name in ("fsdp+tp", "ddp+tp")


def test_an_unknown_space_is_refused(tmp_path: Path):
    with pytest.raises(AutoshardError, match="unknown space 'megatron'"):
        plan_space(_config(tmp_path, "llama"), "megatron")


def _run_on_8_ranks(
    tmp_path: Path, name: str, model: Path, smap: Path, how: str = "export"
) -> dict:
    """``smap`` in the user's own training step on 8 gloo ranks (``tests/apply_rank.py``):
    through the function ``autoshard export`` writes, or ``autoshard.apply`` (``how``); its
    report."""
    exported = []
    if how == "export":
        exported = [tmp_path / f"parallelize_{name}.py"]
        args = ["export", str(smap), str(model), "--out", str(exported[0]), "--no-price"]
        cli = autoshard_cli(*args)
        assert cli.returncode == 0, cli.stderr
    report_file = tmp_path / "report.json"
    args = [str(ROOT / "tests" / "apply_rank.py"), str(smap), str(model), str(report_file)]
    # HF's grouped_mm experts take no float64: Mixtral runs in float32, to float32's error
    dtype = "float32" if name == "mixtral" else "float64"
    run = ranks(8, *args, *[str(p) for p in exported], APPLY_RANK_DTYPE=dtype)
    assert run.returncode == 0, run.stderr[-6000:]
    report = json.loads(report_file.read_text())
    # float32: AdamW divides by sqrt(v), so a near-zero gradient's rounding moves its step
    # (apply_rank.py bounds that with AdamW's eps; 8e-6 measured on Mixtral against 1e-4)
    tol = {"float64": (1e-12, 1e-10, 1e-10), "float32": (1e-5, 1e-4, 1e-4)}[dtype]
    assert report["loss"] < tol[0] and report["grads"] < tol[1] and report["params"] < tol[2]
    with torch.device("meta"):  # every parameter is a DTensor: FSDP2 took every one
        built = load_model_file(model).module.build_model()
    assert report["dtensors"] == len(list(built.parameters()))
    assert report["differences"] == []
    return report


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_exported_optimum_trains_like_one_device_on_8_gloo_ranks(tmp_path: Path, name):
    """The space's plan on 2x4 (written by `solve --space torchtitan`), exported and run by
    the user's own loop on 8 gloo ranks (float64, one AdamW step, eval mode: no dropout):
    loss, every gradient and every parameter equal one device's. The GQA Llama's goes
    through ``autoshard.apply`` instead (its ``local_inputs`` splits the batch over both
    data-parallel dims of HSDP)."""
    model = write_model(tmp_path, MODELS[name], name)
    out = autoshard_cli(
        "solve", str(model), "--mesh", "2x4", "--space", "torchtitan", "--out", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    smap = tmp_path / f"{name}_2x4_torchtitan.json"
    how = "apply" if name == "llama_gqa" else "export"
    _run_on_8_ranks(tmp_path, name, model, smap, how)


@pytest.mark.slow
def test_the_tensor_parallel_point_trains_like_one_device_on_8_gloo_ranks(tmp_path: Path):
    """The small Llama's ``fsdp+tp`` point (not its optimum: every optimum above is data
    parallel): FSDP2 on dp sharding column weights on their input dim (tensor parallelism
    splits the output dim), Megatron's pairs on tp; exported, it trains like one device."""
    from autoshard.plan.export import write_outputs

    config = _config(tmp_path, "llama")
    _, points = _search(config)
    (point,) = [p for p in points if p.name == "fsdp+tp"]
    q = point.plan.parameters["model.layers.0.self_attn.q_proj.weight"]
    assert [str(x) for x in q] == ["S(1)", "S(0)"]  # FSDP on dim 1, tp on dim 0
    _, smap = write_outputs(point.plan, tmp_path, "llama_fsdp_tp", config.cost_model(), {})
    report = _run_on_8_ranks(tmp_path, "llama", config.model_path, smap)
    q_placed = report["placements"]["model.layers.0.self_attn.q_proj.weight"]
    assert q_placed == ["S(1)", "S(0)"], q_placed


@pytest.mark.slow
def test_a_gpu_count_searches_the_space_on_every_mesh_shape(tmp_path: Path):
    """`--gpus 8 --gpus-per-node 4 --space torchtitan`: every node-respecting shape gets
    the space's search, the fastest is the minimum of the rows, and each plan lists its
    points."""
    from helpers import write_mlp

    from autoshard.cost.mesh import node_shapes
    from autoshard.solver.meshes import search_meshes

    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("8"), mode="train")
    meshes = [MeshSpec.on_nodes(s, 4) for s in node_shapes(8, 4)]
    search = search_meshes(config, meshes, gpus_per_node=4, space="torchtitan")
    made = [r for r in search.rows if r.result is not None]
    assert len(made) == len(meshes) >= 2
    assert search.best.step_time_s == min(r.step_time_s for r in made)
    for row in made:
        space = row.result.plan.extra["space"]
        assert space["chosen"] in row.result.plan.name
        assert row.result.ilp.status.startswith("space torchtitan")


@pytest.mark.slow
def test_the_checkpointed_optimum_trains_like_one_device_on_8_gloo_ranks(tmp_path: Path):
    """``--activation-checkpointing full``: the exported function wraps both blocks (torch
    recomputes them in the backward) and trains like one device on 8 gloo ranks."""
    model = write_model(tmp_path, MODELS["llama"], "llama")
    out = autoshard_cli(
        "solve",
        str(model),
        "--mesh",
        "2x4",
        "--space",
        "torchtitan",
        "--out",
        str(tmp_path),
        "--activation-checkpointing",
        "full",
    )
    assert out.returncode == 0, out.stderr
    report = _run_on_8_ranks(tmp_path, "llama", model, tmp_path / "llama_2x4_torchtitan.json")
    assert report["checkpointed"] == ["model.layers.0", "model.layers.1"]
