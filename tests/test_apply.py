"""``autoshard.apply`` and ``autoshard export --format torchtitan`` (issue 15, item 2)."""

from __future__ import annotations

import ast
import json
import runpy
from pathlib import Path

import pytest
import torch
from helpers import GPT2_DEFAULT, LLAMA_SMALL, ROOT, autoshard_cli, ranks, write_mlp, write_model

from autoshard.api import save
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.model.model_file import load_model_file
from autoshard.plan.formats import load_sharding_map
from autoshard.plan.styles import style_plan, torchtitan_code
from autoshard.solver.solve import SolveConfig, plan_baseline

# helpers' small Llama with as many key/value heads as query heads (one per tp rank)
LLAMA = LLAMA_SMALL.replace("num_key_value_heads=2", "num_key_value_heads=4")

# torchtitan's Llama plan (torchtitan/models/llama3/parallelize.py, without sequence
# parallelism) in HF's module names: attention q/k/v and the MLP's gate/up column-
# parallel, o_proj and down_proj row-parallel, one FSDP2 group per block and the root
LLAMA_TP = {
    "model.layers.*.self_attn.q_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.k_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.v_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.o_proj": ("RowwiseParallel", {}),
    "model.layers.*.mlp.gate_proj": ("ColwiseParallel", {}),
    "model.layers.*.mlp.up_proj": ("ColwiseParallel", {}),
    "model.layers.*.mlp.down_proj": ("RowwiseParallel", {}),
}


def _map(tmp_path: Path, model: Path, algo: str, mesh: str = "2x4") -> Path:
    cfg = SolveConfig(model_path=model, mesh=MeshSpec.from_options(mesh), mode="train")
    _, smap = save(plan_baseline(cfg, algo), tmp_path / f"out_{algo}")
    return smap


def _module(path: Path) -> torch.nn.Module:
    with torch.device("meta"):
        return load_model_file(path).module.build_model()


@pytest.mark.parametrize(
    ("algo", "dp_mode"),
    [
        pytest.param("megatron", "ddp", marks=pytest.mark.slow),
        pytest.param("fsdp_tp", "fsdp", marks=pytest.mark.slow),
    ],
)
def test_megatron_plans_of_a_llama_are_torchtitans_styles(tmp_path: Path, algo, dp_mode):
    """The Megatron-shaped plans of a 2-layer Llama, read back as styles: exactly
    torchtitan's tensor-parallel plan, DDP (megatron) or FSDP2 (fsdp_tp) on dp, per block."""
    model = write_model(tmp_path, LLAMA, "llama")
    smap = load_sharding_map(_map(tmp_path, model, algo))
    sp = style_plan(_module(model), smap)
    assert (sp.tp_dim, sp.dp_dims, sp.dp_mode) == (1, (0,), dp_mode)
    # fsdp_tp's LM head is column-parallel, as torchtitan's; its styles gather the logits
    # (torchtitan without loss parallelism), where the plan keeps their vocabulary shards
    head = {"lm_head": ("ColwiseParallel", {"output_layouts": "Replicate()"})}
    assert sp.folded_tp() == LLAMA_TP | (head if algo == "fsdp_tp" else {})
    assert sp.groups == ["model.layers.0", "model.layers.1", ""]
    if algo == "megatron":
        assert sp.differences == []
    code = torchtitan_code(sp, smap.mesh_shape, smap.dim_names)
    compile(code, "export", "exec")
    assert _unused_imports(code) == set()
    # torchtitan's shape: one layer_plan applied in a loop over the blocks
    assert "        'mlp.down_proj': RowwiseParallel(),\n" in code
    assert "for block in model.get_submodule('model.layers').children():" in code
    assert "model.layers.0" not in code and "model.layers.1" not in code


def _unused_imports(code: str) -> set[str]:
    """The names ``code`` imports and never reads (ruff's F401, by Python's own parser)."""
    tree = ast.parse(code)
    imported = {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    return imported - {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def test_an_fsdp_only_export_imports_no_tensor_parallel_styles():
    """A plan with no tensor-parallel dim exports ``fully_shard`` alone: it imported
    ``ColwiseParallel``, ``RowwiseParallel`` and ``parallelize_module`` unused (the
    checker planted here flags exactly those three on that header)."""
    from autoshard.plan.styles import StylePlan

    sp = StylePlan(None, dp_replicate=(), dp_shard=(0,))
    sp.groups = [""]
    code = torchtitan_code(sp, (8,), ("dp",))
    assert "fully_shard(model, mesh=mesh['dp'])" in code
    assert _unused_imports(code) == set()
    assert "parallel import" not in code
    old_header = (
        "from torch.distributed.tensor.parallel import (\n"
        "    ColwiseParallel,\n    RowwiseParallel,\n    parallelize_module,\n)\n"
    )
    assert _unused_imports(old_header + code) == {
        "ColwiseParallel",
        "RowwiseParallel",
        "parallelize_module",
    }


def _applied_placements(model: torch.nn.Module, dim_names: tuple[str, ...]) -> dict:
    """Every parameter's placements on the plan's mesh dims, as torch left them (a dim the
    parameter's mesh lacks is ``Replicate``; FSDP2's strided shard is its tensor dim)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        full = [Replicate()] * len(dim_names)
        if isinstance(p, DTensor):
            for dim, pl in zip(p.device_mesh.mesh_dim_names, p.placements, strict=True):
                if dim in dim_names:
                    full[dim_names.index(dim)] = Shard(pl.dim) if isinstance(pl, Shard) else pl
        out[name] = tuple(full)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["megatron", "fsdp_tp"])
def test_the_exported_loop_places_every_parameter_as_the_styles_say(tmp_path: Path, algo):
    """The exported ``parallelize`` (a loop over the blocks), run by torch itself on a meta
    Llama over a fake process group of 8: ``parallelize_module`` and ``fully_shard`` leave
    every parameter where the style plan says; for the Megatron plan (no differences) that
    is the plan's own placement of every parameter."""
    from autoshard._torch_private import fake_mesh

    model_file = write_model(tmp_path, LLAMA, "llama")
    smap = load_sharding_map(_map(tmp_path, model_file, algo))
    sp = style_plan(_module(model_file), smap)
    code = tmp_path / "parallelize.py"
    code.write_text(torchtitan_code(sp, smap.mesh_shape, smap.dim_names))
    model = _module(model_file)
    with fake_mesh((8,)):
        runpy.run_path(str(code))["parallelize"](model, device_type="cpu")
        applied = _applied_placements(model, smap.dim_names)
    assert applied == sp.placements
    if algo == "megatron":
        assert sp.differences == []
        assert applied == {k: tuple(v) for k, v in smap.parameters.items()}


LLAMA_GQA_TIED = LLAMA.replace(
    "num_key_value_heads=4", "num_key_value_heads=2, tie_word_embeddings=True"
)


@pytest.mark.slow
def test_grouped_query_attention_and_tied_embeddings_keep_torchtitans_styles(tmp_path: Path):
    """A Llama with half as many key/value heads (k/v projections narrower than o_proj's
    input) and its LM head tied to the embedding, Megatron on 2x2: k/v are still column-
    parallel into o_proj (the pair is the attention module, not matching widths), and the
    tied head is read under both names."""
    model = write_model(tmp_path, LLAMA_GQA_TIED, "llama_gqa")
    smap = load_sharding_map(_map(tmp_path, model, "megatron", mesh="2x2"))
    assert "lm_head.weight" in smap.parameters
    sp = style_plan(_module(model), smap)
    assert sp.folded_tp() == LLAMA_TP
    assert sp.differences == []


@pytest.mark.slow
def test_applied_gqa_llama_with_a_tied_head_trains_like_one_device(tmp_path: Path):
    """On 4x2 (two key/value heads, tensor parallel over 2: one head each)."""
    model = write_model(tmp_path, LLAMA_GQA_TIED, "llama_gqa")
    report = _train(tmp_path, _map(tmp_path, model, "megatron", mesh="4x2"), model)
    assert report["loss"] < 1e-12 and report["grads"] < 1e-10 and report["params"] < 1e-10


@pytest.mark.slow
def test_styles_that_would_split_a_head_are_refused(tmp_path: Path):
    """Two key/value heads over 4 tensor-parallel devices: half a head each, which the
    model's own reshape by head_dim cannot take (DTensor's graph-level launch can)."""
    model = write_model(tmp_path, LLAMA_GQA_TIED, "llama_gqa")
    smap = load_sharding_map(_map(tmp_path, model, "megatron", mesh="2x4"))
    sp = style_plan(_module(model), smap)
    assert sp.unrunnable == [
        f"model.layers.{i}.self_attn.{p}: 64 features over 4 devices is not a whole number "
        "of heads of 32"
        for i in (0, 1)
        for p in ("k_proj", "v_proj")
    ]


def test_export_prices_a_mixed_precision_plan(tmp_path: Path):
    """A bf16-mixed solution is read back as it was solved (its precision, not a cast of
    its own) and priced."""
    model = write_mlp(tmp_path, 64, 256, 1024)
    cfg = SolveConfig(model_path=model, mesh=MeshSpec.from_options("2x2"), precision="bf16-mixed")
    _, smap = save(plan_baseline(cfg, "megatron"), tmp_path / "mixed")
    out = autoshard_cli("export", str(smap), str(model))
    assert out.returncode == 0, out.stderr
    assert "(+0.0%:" in out.stderr, out.stderr


@pytest.mark.slow  # over 6 s: the fast tier stays under 2 minutes
def test_export_prices_a_vocab_parallel_head(tmp_path: Path):
    """The Megatron map of the Llama with its LM head sharded by vocabulary on tp: a
    standalone column (its logits gathered for the loss), whose own ops the style shards
    while its readers get the logits whole; the styles are priced (before: infeasible)."""
    model = write_model(tmp_path, LLAMA, "llama")
    path = _map(tmp_path, model, "megatron")
    raw = json.loads(path.read_text())
    raw["parameters"]["lm_head.weight"] = ["R", "S(0)"]
    path.write_text(json.dumps(raw))
    out = autoshard_cli("export", str(path), str(model))
    assert out.returncode == 0, out.stderr
    assert "'lm_head': ColwiseParallel(output_layouts=Replicate())," in out.stdout
    assert "could not be priced" not in out.stderr, out.stderr
    assert "predicted step: the plan" in out.stderr
    assert "note:" not in out.stderr  # the styles place the head as the map does


@pytest.mark.slow
def test_a_placement_the_styles_cannot_express_is_listed(tmp_path: Path):
    """A planted fault: the Megatron map with one norm's weight sharded on tp. No style
    shards a norm: the parameter is listed with both placements."""
    model = write_model(tmp_path, LLAMA, "llama")
    path = _map(tmp_path, model, "megatron")
    raw = json.loads(path.read_text())
    raw["parameters"]["model.norm.weight"] = ["R", "S(0)"]
    path.write_text(json.dumps(raw))
    sp = style_plan(_module(model), load_sharding_map(path))
    assert sp.differences == [("model.norm.weight", "R·S(0)", "R·R")]


def test_a_plan_of_another_model_is_refused(tmp_path: Path):
    smap = load_sharding_map(_map(tmp_path, write_mlp(tmp_path, 8, 16, 32), "megatron"))
    with pytest.raises(AutoshardError, match="differ in parameters"):
        style_plan(_module(write_model(tmp_path, LLAMA, "llama")), smap)


def _train(tmp_path: Path, smap: Path, model: Path, *exported: Path) -> dict:
    out = tmp_path / "report.json"
    args = [str(ROOT / "tests/apply_rank.py"), str(smap), str(model), str(out)]
    run = ranks(8, *args, *[str(p) for p in exported])
    assert run.returncode == 0, "\n".join(x for x in run.stderr.splitlines() if "rank" in x)[-6000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(("algo", "how"), [("megatron", "apply"), ("fsdp_tp", "export")])
def test_applied_llama_trains_like_one_device_on_8_gloo_ranks(tmp_path: Path, algo, how):
    """The styles applied to the user's own model (``autoshard.apply``, or the function
    ``autoshard export`` writes: a loop over the blocks) and AdamW on 2x4: loss, every
    gradient and every parameter after one step equal one device's (float64)."""
    model = write_model(tmp_path, LLAMA, "llama")
    smap = _map(tmp_path, model, algo)
    exported = []
    if how == "export":
        exported = [tmp_path / "parallelize_llama.py"]
        out = autoshard_cli(
            "export", str(smap), str(model), "--out", str(exported[0]), "--no-price"
        )
        assert out.returncode == 0, out.stderr
        assert "for block in model.get_submodule('model.layers')" in exported[0].read_text()
    report = _train(tmp_path, smap, model, *exported)
    assert report["loss"] < 1e-12, report
    assert report["grads"] < 1e-10, report
    assert report["params"] < 1e-10, report
    q = report["placements"]["model.layers.0.self_attn.q_proj.weight"]
    assert q[-1] == "S(0)", q  # column-parallel on tp


@pytest.mark.slow
def test_applied_and_exported_mlp_train_like_one_device_on_8_gloo_ranks(tmp_path: Path):
    """The MLP's Megatron plan, through ``autoshard.apply`` and through the function
    ``autoshard export`` writes, run by the user's own loop: both equal one device."""
    model = write_mlp(tmp_path, 16, 32, 64)
    smap = _map(tmp_path, model, "megatron")
    report = _train(tmp_path, smap, model)
    assert report["loss"] < 1e-12 and report["grads"] < 1e-10 and report["params"] < 1e-10
    assert report["differences"] == []
    exported = tmp_path / "parallelize_mlp.py"
    out = autoshard_cli("export", str(smap), str(model), "--out", str(exported), "--no-price")
    assert out.returncode == 0, out.stderr
    report = _train(tmp_path, smap, model, exported)
    assert report["loss"] < 1e-12 and report["grads"] < 1e-10 and report["params"] < 1e-10
    assert report["placements"]["fc1.weight"][-1] == "S(0)"


def test_export_writes_the_styles_and_prices_them_with_the_plans_cost_model(tmp_path: Path):
    """`autoshard export` on the MLP's Megatron plan: fc1 column-, fc2 row-parallel, DDP on
    dp; every parameter placed as planned, so the styles' price (DTensor's propagation from
    those parameter placements, outside the styled pairs replicated on tp) is the plan's."""
    model = write_mlp(tmp_path, 64, 256, 1024)
    smap = _map(tmp_path, model, "megatron")
    out = autoshard_cli("export", str(smap), str(model), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "        'fc1': ColwiseParallel(),\n        'fc2': RowwiseParallel(),\n" in out.stdout
    assert "fully_shard(model, mesh=mesh['dp', 'dp_shard'])" in out.stdout
    compile(out.stdout, "export", "exec")
    assert "note:" not in out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("predicted step:")]
    assert "(+0.0%:" in line, line


@pytest.mark.slow
def test_styles_on_a_tensor_parallel_dim_with_no_styled_module_compute_replicated_there(
    tmp_path: Path,
):
    """A tensor-parallel dim no style shards anything on (GPT-2's Conv1D has no built-in
    style): the user's modules hand plain tensors on, so every forward op computes
    replicated on that dim, and the styles' price says so (before: propagation sharded the
    batch on tp for free, pricing a quarter of the compute)."""
    from torch.distributed.tensor import Replicate, Shard

    from autoshard.solver.solve import plan_pinned

    model = write_model(tmp_path, GPT2_DEFAULT, "gpt2")
    cfg = SolveConfig(model_path=model, mesh=MeshSpec.from_options("2x2"), mode="train")
    with torch.device("meta"):
        names = [n for n, _ in load_model_file(model).module.build_model().named_parameters()]
    params = {n: (Shard(0), Replicate()) for n in names}
    params = {
        n: (Replicate(), Replicate()) if "wte" in n or "wpe" in n else p for n, p in params.items()
    }
    inputs = {"input_ids": (Shard(0), Replicate())}
    styled = plan_pinned(cfg, params, inputs, frozenset({0}), "styles", {}, 1)
    sg, choice = styled.sg, styled.plan.choice
    forward_ops = [
        rep
        for rep in sg.reps
        if sg.graph.nodes.get(rep) is not None
        and sg.graph.nodes[rep].kind == "op"
        and not sg.graph.nodes[rep].backward
    ]
    assert forward_ops
    for rep in forward_ops:
        out = sg.nodes[rep].strategies[choice[rep]].outputs[0]
        assert out is None or isinstance(out[1], Replicate), (rep, out)


def test_a_listed_export_keeps_fsdp_dims_inside_a_checkpointed_block():
    """Blocks styled unlike each other (the listed form), only block 1 recomputed, its
    weight sharded by FSDP on dim 1: torch, running the export on a fake process group of
    8, wraps block 1 and shards that weight on dim 1 (the names are read before the
    wrapper adds its prefix; read after, the weight fell back to dim 0)."""
    from torch import nn
    from torch.distributed.tensor import DTensor

    from autoshard._torch_private import fake_mesh
    from autoshard.plan.styles import StylePlan

    sp = StylePlan(1, dp_replicate=(), dp_shard=(0,))
    sp.tp = {"layers.0.fc": ("ColwiseParallel", {}), "layers.1.fc": ("RowwiseParallel", {})}
    sp.shard_dims = {"layers.1.fc.weight": 1}
    sp.groups, sp.recompute = ["layers.0", "layers.1", ""], ["layers.1"]
    sp.blocks = ["layers.0", "layers.1"]
    code = torchtitan_code(sp, (2, 4), ("dp", "tp"))
    assert "for block in" not in code  # the listed form
    assert _unused_imports(code) == set()

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

    model = nn.Module()
    with torch.device("meta"):
        model.layers = nn.ModuleList([Block(), Block()])
    namespace: dict = {}
    exec(compile(code, "export", "exec"), namespace)
    with fake_mesh((8,)):
        namespace["parallelize"](model, device_type="cpu")
    assert type(model.layers[1]).__name__.endswith("CheckpointWrapper")
    weight = dict(model.named_parameters())["layers.1._checkpoint_wrapped_module.fc.weight"]
    assert isinstance(weight, DTensor)
    dims = dict(zip(weight.device_mesh.mesh_dim_names, weight.placements, strict=True))
    assert dims["dp"].dim == 1, dims
