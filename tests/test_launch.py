"""The launcher: seeded materialisation, plan validation, torchrun command lines, and real
8-process gloo runs on a 2x4 mesh that must match a single-device run.

The multi-process tests start ``torchrun`` (never a hand-made spawner) with the venv's
python from the repo root, ``OMP_NUM_THREADS=1`` (8 processes share 2 cores) and
``--standalone`` (rendezvous on a free port).
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import (
    CHECK_OUTPUT,
    TORCHRUN_TIMEOUT_S,
    assert_checked,
    autoshard_cli,
    number,
    rank_env,
    ranks,
    torchrun,
    write_gpt2_short,
)
from torch import nn

from autoshard.cli.launch import launch_command
from autoshard.errors import AutoshardError
from autoshard.launch.check import compare_runs, relative_error
from autoshard.launch.options import RunOptions
from autoshard.launch.torchrun import MMAP_THRESHOLD, rank_environment, torchrun_argv
from autoshard.launch.validate import check_plan, check_world_size
from autoshard.model.materialize import (
    build_skeleton,
    init_parameters,
    init_units,
    make_inputs,
    materialize,
)
from autoshard.model.model_file import LoadedModel, instantiate, load_model_file
from autoshard.placements import placements_from_str
from autoshard.plan.formats import ShardingMap

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "mlp.py"
GPT2 = ROOT / "examples" / "gpt2.py"
TIMEOUT_S = TORCHRUN_TIMEOUT_S

# Megatron on tp (fc1 by output features, fc2 by input features) times data parallel on
# dp: the batch is split on dp, the weights are replicated there.
MLP_DP_TP = {
    "fc1.weight": ["R", "S(0)"],
    "fc1.bias": ["R", "S(0)"],
    "fc2.weight": ["R", "S(1)"],
    "fc2.bias": ["R", "R"],
}


# ------------------------------------------------------------------------------ helpers


def _write_map(
    path: Path,
    parameters: dict,
    inputs: dict,
    predicted: dict | None = None,
    mesh: tuple[int, int] = (2, 4),
) -> Path:
    data = {
        "format": "autoshard.sharding_map/1",
        "mesh": {"shape": list(mesh), "dim_names": ["dp", "tp"]},
        "parameters": parameters,
        "inputs": inputs,
    }
    if predicted is not None:
        data["predicted"] = predicted
    path.write_text(json.dumps(data, indent=1))
    return path


def _smap(parameters: dict, inputs: dict) -> ShardingMap:
    return ShardingMap(
        mesh_shape=(2, 4),
        dim_names=("dp", "tp"),
        parameters={k: placements_from_str(v) for k, v in parameters.items()},
        inputs={k: placements_from_str(v) for k, v in inputs.items()},
    )


def _gpt2_short(tmp_path: Path) -> Path:
    """examples/gpt2.py's model (AUTOSHARD_LAYERS layers) with input_ids of shape (8, 32)."""
    return write_gpt2_short(tmp_path, 8)


# ----------------------------------------------------------------------- materialise


LLAMA_FILE = '''
"""A small Llama-2 (2 layers) with llama3 rope scaling: inv_freq is computed in __init__."""
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        use_cache=False,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def example_inputs():
    return (torch.randint(0, 256, (2, 16)),)
'''


def test_materialised_llama_has_the_inv_freq_of_a_cpu_build(tmp_path: Path) -> None:
    path = tmp_path / "llama_small.py"
    path.write_text(LLAMA_FILE)
    mf = load_model_file(path)
    on_meta = instantiate(mf, device="meta").module
    assert on_meta.model.rotary_emb.inv_freq.is_meta  # what a plain meta build loses

    mat = materialize(mf, seed=0)
    direct = instantiate(mf, device="cpu").module  # built straight on the CPU
    rot, ref = mat.loaded.module.model.rotary_emb, direct.model.rotary_emb
    assert torch.equal(rot.inv_freq, ref.inv_freq)
    assert torch.equal(rot.original_inv_freq, ref.original_inv_freq)
    assert not torch.allclose(ref.inv_freq, 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16))
    assert mat.fallback_init == ()
    # HF's own init ran: normal(0, initializer_range) weights, RMSNorm weights 1.
    m = mat.loaded.module
    assert abs(float(m.model.layers[0].mlp.up_proj.weight.detach().std()) - 0.02) < 2e-3
    assert torch.equal(m.model.norm.weight, torch.ones(64))
    # Same output as the CPU-built model given the same weights.
    direct.load_state_dict(m.state_dict())
    x = mat.loaded.inputs[0]
    assert torch.equal(m(x).logits, direct(x).logits)


@pytest.mark.slow
def test_materialise_is_deterministic_and_keeps_ties(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOSHARD_LAYERS", "1")
    mf = load_model_file(GPT2)
    a, b = materialize(mf, seed=3), materialize(mf, seed=3)
    c = materialize(mf, seed=4)
    sa, sb = a.loaded.module.state_dict(), b.loaded.module.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    w = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(sa[w], c.loaded.module.state_dict()[w])
    model = a.loaded.module
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2's scaled init of residual projections: std 0.02 / sqrt(2 * n_layer).
    assert (
        abs(float(model.transformer.h[0].mlp.c_proj.weight.detach().std()) - 0.02 / 2**0.5) < 1e-3
    )
    assert all(not p.isnan().any() for p in model.parameters())
    (ids,) = a.loaded.inputs
    assert ids.shape == (8, 1024) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 50257
    assert torch.equal(ids, b.loaded.inputs[0])


@pytest.mark.slow
def test_a_placed_init_holds_one_unit_in_full_and_keeps_the_reference_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 16 item 7: a rank makes the model one unit at a time (embeddings and head,
    then each block) and keeps only its shard; the values are those of the unplaced
    reference (``--check``'s single device)."""
    monkeypatch.setenv("AUTOSHARD_LAYERS", "3")
    mf = load_model_file(GPT2)
    ref = dict(materialize(mf, seed=5).loaded.module.named_parameters())
    units = init_units(build_skeleton(mf).module)
    assert units == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]

    def unit(fqn: str) -> int:
        return max(i for i, u in enumerate(units) if i == 0 or fqn.startswith(u + "."))

    fulls: list[tuple[int, weakref.ref]] = []
    placed: list[str] = []
    stale: list[str] = []

    def place(fqn: str, full: nn.Parameter) -> nn.Parameter:
        k = unit(fqn)
        # no full tensor of an earlier unit is alive when this unit's are placed
        stale.extend(fqn for j, r in fulls if j < k and r() is not None)
        assert torch.equal(full, ref[fqn]), fqn
        fulls.append((k, weakref.ref(full)))
        placed.append(fqn)
        return nn.Parameter(full.detach()[:1].clone())  # the "shard": one row

    skeleton = build_skeleton(mf, seed=5)
    init_parameters(skeleton.module, 5, "cpu", place)
    gc.collect()
    assert not stale, stale
    assert all(r() is None for _, r in fulls)  # nothing kept the full tensors alive
    assert len(placed) == len(set(placed)) == len(ref)  # the tied head placed once
    model = skeleton.module
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight.shape == (1, 768)
    assert [unit(n) for n in placed] == sorted(unit(n) for n in placed)


PLAIN_FILE = """
import torch
from torch import nn
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))  # no module initialises it
        pos = torch.arange(16).float()
        self.register_buffer("table", torch.sin(pos[:, None] / 10000 ** (torch.arange(8) / 8)),
                             persistent=False)

    def forward(self, x, mask):
        return self.proj(x + self.table[: x.shape[1]]) * self.scale


def build_model():
    return Net()


def example_inputs():
    return (torch.randn(4, 16, 8), torch.ones(4, 16, dtype=torch.long))
"""


def test_materialise_plain_module(tmp_path: Path) -> None:
    path = tmp_path / "plain.py"
    path.write_text(PLAIN_FILE)
    mf = load_model_file(path)
    mat = materialize(mf, seed=0)
    net = mat.loaded.module
    pos = torch.arange(16).float()
    assert torch.equal(net.table, torch.sin(pos[:, None] / 10000 ** (torch.arange(8) / 8)))
    assert mat.fallback_init == ("scale",)  # reported, then set to ones (a vector)
    assert torch.equal(net.scale.detach(), torch.ones(8))
    bound = 1 / 8**0.5  # nn.Linear.reset_parameters: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert float(net.proj.weight.detach().abs().max()) <= bound
    x, mask = mat.loaded.inputs
    assert x.dtype == torch.float32 and torch.equal(mask, torch.ones(4, 16, dtype=torch.long))
    again = make_inputs(build_skeleton(mf), seed=0)
    assert torch.equal(again[0], x)


def test_make_inputs_by_name_and_dtype() -> None:
    ids = torch.empty(2, 5, dtype=torch.int64, device="meta")
    loaded = LoadedModel(
        module=torch.nn.Linear(1, 1),  # no config: token ids in [0, 100)
        inputs=(ids, ids, ids, ids, torch.empty(2, 5, device="meta")),
        input_names=("input_ids", "attention_mask", "token_type_ids", "position_ids", "x"),
        name="t",
    )
    tok, mask, types, pos, x = make_inputs(loaded, seed=1)
    assert 0 <= int(tok.min()) and int(tok.max()) < 100 and tok.dtype == torch.int64
    assert torch.equal(mask, torch.ones(2, 5, dtype=torch.int64))
    assert torch.equal(types, torch.zeros(2, 5, dtype=torch.int64))
    assert torch.equal(pos, torch.arange(5).expand(2, 5))
    assert x.dtype == torch.float32 and not x.is_meta
    assert torch.equal(make_inputs(loaded, seed=1)[4], x)
    assert not torch.equal(make_inputs(loaded, seed=2)[4], x)


# -------------------------------------------------------------------- plan validation


def test_check_plan_lists_missing_and_unknown_parameters() -> None:
    loaded = instantiate(load_model_file(MLP))
    params = {k: v for k, v in MLP_DP_TP.items() if k != "fc2.bias"}
    params["fc3.weight"] = ["R", "R"]
    with pytest.raises(AutoshardError) as err:
        check_plan(_smap(params, {"x": ["S(0)", "R"]}), loaded, "mlp.py")
    msg = str(err.value)
    assert "1 parameter missing from the map: fc2.bias" in msg
    assert "1 map entry that mlp.py lacks: fc3.weight" in msg
    assert "\n" not in msg


def test_check_plan_rejects_bad_placements(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = instantiate(load_model_file(MLP))
    with pytest.raises(AutoshardError, match=r"fc2.bias of shape \(1024,\) .* no dim 1"):
        check_plan(_smap({**MLP_DP_TP, "fc2.bias": ["R", "S(1)"]}, {"x": ["R", "R"]}), loaded)
    with pytest.raises(AutoshardError, match="input.*missing from the map: x"):
        check_plan(_smap(MLP_DP_TP, {}), loaded)
    monkeypatch.setenv("AUTOSHARD_LAYERS", "1")
    gpt2 = instantiate(load_model_file(GPT2))
    params = {n: ["R", "R"] for n, _ in gpt2.module.named_parameters(remove_duplicate=False)}
    params["lm_head.weight"] = ["R", "S(0)"]
    with pytest.raises(AutoshardError, match="tied parameters transformer.wte.weight and lm_head"):
        check_plan(_smap(params, {"input_ids": ["S(0)", "R"]}), gpt2)


def test_world_size_message() -> None:
    with pytest.raises(AutoshardError) as err:
        check_world_size(_smap(MLP_DP_TP, {"x": ["R", "R"]}), 4)
    assert str(err.value).startswith(
        "the sharding map's mesh 2x4 needs 8 processes but torchrun started 4; "
        "pass --nproc-per-node 8"
    )


def test_launch_command_validates_before_starting_torchrun(tmp_path: Path) -> None:
    plan = _write_map(
        tmp_path / "m.json",
        {k: v for k, v in MLP_DP_TP.items() if k != "fc1.bias"},
        {"x": ["R", "R"]},
    )
    result = CliRunner().invoke(launch_command, [str(plan), str(MLP)])
    assert isinstance(result.exception, AutoshardError)
    assert "missing from the map: fc1.bias" in str(result.exception)
    assert "running:" not in result.output  # torchrun never started


def test_torchrun_argv_defaults_and_pass_through(tmp_path: Path) -> None:
    plan, model = tmp_path / "p.json", tmp_path / "m.py"
    opts = RunOptions(steps=2, train=True, check=True, seed=7)
    argv = torchrun_argv(plan, model, opts, [], 8)
    assert argv[:3] == [sys.executable, "-m", "autoshard.launch.torchrun"]
    assert argv[3:6] == ["--nproc-per-node", "8", "--standalone"]
    tail = argv[argv.index("autoshard.launch") + 1 :]
    assert tail[:2] == [str(plan.resolve()), str(model.resolve())]
    assert tail[2:] == opts.to_argv()
    assert "--train" in tail and "--check" in tail and tail[tail.index("--seed") + 1] == "7"

    multi = ["--nnodes", "2", "--rdzv-endpoint", "host:29500", "--rdzv-id", "job"]
    argv = torchrun_argv(plan, model, opts, multi, 8)
    assert argv[3:5] == ["--nproc-per-node", "4"] and "--standalone" not in argv
    assert argv[5:11] == multi

    argv = torchrun_argv(plan, model, opts, ["--nproc_per_node=8", "--master-port", "1234"], 8)
    assert argv.count("--nproc-per-node") == 0 and "--nproc_per_node=8" in argv
    assert "--standalone" not in argv
    with pytest.raises(AutoshardError, match="needs 8 processes but --nproc-per-node 4"):
        torchrun_argv(plan, model, opts, ["--nproc-per-node", "4"], 8)
    with pytest.raises(AutoshardError, match="--nnodes 3 does not divide"):
        torchrun_argv(plan, model, opts, ["--nnodes", "3"], 8)


def test_ranks_import_this_autoshard_and_give_freed_buffers_back(tmp_path: Path) -> None:
    """The ranks' environment puts this checkout first on PYTHONPATH and fixes glibc's
    mmap threshold (GPT-2 small at sequence 1024 on 8 ranks was killed for memory
    without it); a threshold the user set is kept."""
    env = rank_environment({"PYTHONPATH": "/elsewhere"}, tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/elsewhere"]
    assert env["MALLOC_MMAP_THRESHOLD_"] == str(MMAP_THRESHOLD)
    mine = rank_environment({"MALLOC_MMAP_THRESHOLD_": "1048576"}, tmp_path)
    assert mine["MALLOC_MMAP_THRESHOLD_"] == "1048576"
    assert mine["PYTHONPATH"] == str(tmp_path)
    # calibration measures the machine as it is
    assert "MALLOC_MMAP_THRESHOLD_" not in rank_environment({}, tmp_path, mmap=False)


def test_relative_error_is_scaled_by_each_tensor_and_floored() -> None:
    """The check's measure: max |a - ref| over the tensor's largest reference value, the
    scale at least atol / rtol (a tensor that is 0 in exact arithmetic), nothing masked."""
    ref = torch.tensor([1e-3, -2e-3, 0.0], dtype=torch.float64)
    assert relative_error(ref * 1.01, ref, 1e-6) == pytest.approx(0.01)  # 1% off: caught
    assert relative_error(-ref, ref, 1e-6) == pytest.approx(2.0)  # a sign flip
    noise = torch.tensor([3e-17, -1e-17], dtype=torch.float64)
    assert relative_error(-noise, noise, 1e-6) == pytest.approx(6e-11)  # rounding: passes
    assert relative_error(ref, ref, 1e-6) == 0.0
    assert relative_error(ref[:2], ref, 1e-6) == float("inf")
    opts = RunOptions(train=True, check=True)
    res = compare_runs(ref, ref, {"w": ref * 2}, {"w": ref}, {"w": ref}, {"w": ref}, opts)
    assert res.failures(opts) == ["grad w"]


# ------------------------------------------------------------------ real torchrun runs


@pytest.mark.slow  # starts torchrun
def test_mlp_train_step_matches_single_device(tmp_path: Path) -> None:
    plan = _write_map(
        tmp_path / "mlp.json",
        MLP_DP_TP,
        {"x": ["S(0)", "R"]},
        {"step_time_s": 1e-4, "collectives": {"all_reduce": 5}},
    )
    run = ranks(8, str(plan), str(MLP), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    # Local shards: fc1 and fc2 weights 1024 x 4096 / 4, fc1.bias 4096 / 4, fc2.bias 1024.
    assert "local parameter bytes per rank: 8.01 MiB (8,396,800 B) on each of 8 ranks" in out
    # A version-1 map (parameters and inputs only): DTensor propagates, and says so. It
    # all-reduces fc2's partial sums on tp and the gradients on dp, and (under the mean
    # loss) gathers once where the hand-written prediction, made for a sum, has none.
    assert "running DTensor propagation (not the plan)" in out
    assert re.search(r"all_reduce\s+4\s+5", out), out
    assert_checked(out, 1e-5, grads=1e-5, params=1e-5)
    assert re.search(r"step time: \S+ (s|ms)", out)


@pytest.mark.slow  # starts torchrun
def test_mlp_forward_through_autoshard_launch(tmp_path: Path) -> None:
    """``autoshard launch`` starts the real torchrun with one process per device of the
    map's mesh (1x2: 2 processes, each importing torch afresh; a mesh whose dims differ,
    so that the count is their product, not their sum or the first dim's power)."""
    plan = _write_map(tmp_path / "mlp.json", MLP_DP_TP, {"x": ["S(0)", "R"]}, mesh=(1, 2))
    cmd = [sys.executable, "-m", "autoshard.cli", "launch", str(plan), str(MLP)]
    cmd += ["--check", "--steps", "2"]
    run = subprocess.run(
        cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "--nproc-per-node 2 --standalone" in run.stderr
    assert re.search(r"all_reduce\s+1\s+-", run.stdout), run.stdout
    assert number(CHECK_OUTPUT, run.stdout) <= 1e-5
    assert "(step 2; step 1: " in run.stdout


@pytest.mark.slow  # starts torchrun
def test_world_size_mismatch_fails_before_any_work(tmp_path: Path) -> None:
    plan = _write_map(tmp_path / "mlp.json", MLP_DP_TP, {"x": ["S(0)", "R"]})
    run = torchrun(2, str(plan), str(MLP))  # two: the error is said by rank 0 only
    assert run.returncode != 0
    line = (
        "error: the sharding map's mesh 2x4 needs 8 processes but torchrun started 2; "
        "pass --nproc-per-node 8"
    )
    assert run.stderr.count(line) == 1, run.stderr[-3000:]  # said once, by rank 0
    assert "exitcode  : 2" in run.stderr  # torchrun reports the rank that exited 2 first


@pytest.mark.slow  # starts torchrun
def test_unknown_parameter_fails_under_torchrun(tmp_path: Path) -> None:
    plan = _write_map(
        tmp_path / "mlp.json", {**MLP_DP_TP, "fc3.weight": ["R", "R"]}, {"x": ["S(0)", "R"]}
    )
    run = ranks(8, str(plan), str(MLP))
    assert run.returncode != 0
    assert "error: the sharding map does not match mlp.py: 1 map entry that mlp.py lacks: " in (
        run.stderr
    )
    assert "fc3.weight" in run.stderr


# ------------------------------------------------- plans from `autoshard solve` run


def _solve_map(model: Path, out: Path, *extra: str, **env: str) -> Path:
    """The sharding map `autoshard solve` writes for ``model`` on 2x4 (training mode)."""
    args = ["solve", str(model), "--mesh", "2x4", "--out", str(out), "-q", *extra]
    run = autoshard_cli(*args, **env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return next(Path(line) for line in run.stdout.split() if line.endswith(".json"))


@pytest.mark.slow  # starts torchrun
def test_solved_mlp_plan_trains_like_one_device(tmp_path: Path) -> None:
    """The ILP's own plan (not a hand-written one) on 8 gloo processes: forward and one
    training step equal the single-device run within 1e-5."""
    plan = _solve_map(MLP, tmp_path)
    run = ranks(8, str(plan), str(MLP), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert_checked(out, 1e-5, params=1e-5)


@pytest.mark.slow  # real torchrun: the subject is its failure report
def test_a_failed_rank_ends_torchrun_with_one_line_not_the_agent_s_traceback(tmp_path: Path):
    """The launcher autoshard starts (``python -m autoshard.launch.torchrun``, torchrun's
    own parser and launcher) ends a run whose rank fails with one line naming the rank
    and its exit code, under the rank's own output, and exits 1 as torchrun does (torchrun
    itself follows it with the agent's ``ChildFailedError`` traceback)."""
    script = tmp_path / "fails.py"
    script.write_text("import sys\nprint('rank says: bad input', file=sys.stderr)\nsys.exit(3)\n")
    run = subprocess.run(
        [sys.executable, "-m", "autoshard.launch.torchrun", "--standalone"]
        + ["--nproc-per-node", "1", str(script)],
        capture_output=True,
        text=True,
        env=rank_environment(os.environ, ROOT),
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == "torchrun: rank 0 failed (exit code 3); its error is above", run.stderr
    assert "rank says: bad input" in run.stderr
    assert "ChildFailedError" not in run.stderr and "Traceback" not in run.stderr, run.stderr
