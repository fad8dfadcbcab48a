"""Launching a pipeline stage plan (``autoshard stages``) with torch.distributed.pipelining:
plan reading, micro-batches, shared-parameter gradients, errors, and real gloo runs under
torchrun that must equal a single-device run.

The stage plans come from the real ``autoshard stages`` command (in process), so the tests
read the format that command writes. The multi-process tests start ``torchrun`` as
tests/test_launch.py does: the venv's python, ``OMP_NUM_THREADS=1``, ``--standalone``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from helpers import (
    GPT2_DEFAULT,
    LLAMA_SMALL,
    MIXTRAL_SMALL,
    TORCHRUN_TIMEOUT_S,
    assert_checked,
    rank_env,
    ranks,
    torchrun,
    write_model,
)
from torch import nn

from autoshard.cli.launch import launch_command
from autoshard.cli.stages import stages_command
from autoshard.errors import AutoshardError
from autoshard.launch.pipeline import (
    canonical_names,
    check_stage_plan,
    check_supported,
    check_world_size,
    pipeline_loss,
    schedule_class,
    shared_parameters,
    split_microbatches,
    stage_mesh_layout,
    stage_placements,
    sum_shared_gradients,
)
from autoshard.model.model_file import LoadedModel, instantiate, load_model_file
from autoshard.pipeline.stage_plan import StagePlanFile, StageSpec, is_stage_plan, load_stage_plan

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = TORCHRUN_TIMEOUT_S

BLOCKS = '''
"""Four Linear+ReLU blocks in an nn.Sequential; x: (8, 16) -> (8, 16)."""
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x))


class Blocks(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.layers = nn.Sequential(*[Block(d) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def build_model():
    return Blocks()


def example_inputs():
    return (torch.randn(8, 16),)
'''


# ------------------------------------------------------------------------------ helpers


def _stages(model: Path, out: Path, mesh: str, pp: int, microbatches: int, *extra: str) -> Path:
    """The stage plan `autoshard stages` writes (run in process)."""
    args = [str(model), "--mesh", mesh, "--pp", str(pp), "--microbatches", str(microbatches)]
    args += list(extra)
    result = CliRunner().invoke(stages_command, [*args, "--out", str(out), "-q"])
    assert result.exit_code == 0, result.output
    return Path(result.output.split()[-1])


@pytest.fixture(scope="module")
def blocks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "blocks.py"
    path.write_text(BLOCKS)
    return path


@pytest.fixture(scope="module")
def plan_pp2(blocks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mesh 2, pp=2, 4 micro-batches of 2 rows: Schedule1F1B."""
    return _stages(blocks, tmp_path_factory.mktemp("plans"), "2", 2, 4)


@pytest.fixture(scope="module")
def plan_2x2(blocks: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Mesh 2x2, pp=2: two stages on submesh 1x2 (ranks 0,1 and 2,3), 4 micro-batches.
    The 6 KiB memory budget makes the stages shard their weights on the tp dim (all
    replicated needs 6.62 KiB on stage 0 and 9.00 KiB on stage 1; 11.8 KiB on stage 0 until
    2026-12-07, when a view the backward reads still counted beside its base)."""
    return _stages(blocks, tmp_path_factory.mktemp("plans"), "2x2", 2, 4, "--memory-budget", "6KiB")


def _edited(plan: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(plan.read_text())
    edit(data)
    path = tmp_path / "edited.stages.json"
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------------- plan reading


def test_reads_the_plan_autoshard_stages_writes(plan_pp2: Path, blocks: Path) -> None:
    plan = load_stage_plan(plan_pp2)
    assert is_stage_plan(plan_pp2)
    assert (plan.pp, plan.microbatches, plan.mesh_shape, plan.world_size) == (2, 4, (2,), 2)
    assert plan.split_points == ["layers.2"]
    assert [s.ranks for s in plan.stages] == [(0,), (1,)]
    assert [s.module_paths for s in plan.stages] == [
        ("layers.0", "layers.1"),
        ("layers.2", "layers.3"),
    ]
    assert set(plan.stages[1].parameters) == {
        f"layers.{i}.fc.{w}" for i in (2, 3) for w in ("weight", "bias")
    }
    assert plan.stage_of(1).index == 1
    check_supported(plan)
    check_world_size(plan, 2)
    mf = load_model_file(blocks)
    check_stage_plan(plan, instantiate(mf, device="meta"), "blocks.py")


def test_other_files_are_not_stage_plans(tmp_path: Path) -> None:
    smap = tmp_path / "map.json"
    smap.write_text(json.dumps({"format": "autoshard.sharding_map/1", "mesh": {"shape": [2]}}))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert not is_stage_plan(smap)
    assert not is_stage_plan(bad)
    assert not is_stage_plan(tmp_path / "missing.json")
    with pytest.raises(AutoshardError, match="format 'autoshard.sharding_map/1', not"):
        load_stage_plan(smap)
    with pytest.raises(AutoshardError, match=r"not valid JSON \(line 1"):
        load_stage_plan(bad)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("stages"), r"not a valid stage plan \(key 'stages'\)"),
        (lambda d: d.update(pp=3), "pp is 3 but the plan lists 2 stage"),
        (lambda d: d.update(microbatches=0), "microbatches is 0"),
        (lambda d: d["stages"][0].update(split_points=[]), "stage 0 has 0 split points"),
        (lambda d: d["stages"][1].update(ranks=[0]), r"ranks \[0, 0\] are not 0..1"),
        (lambda d: d["stages"][0].update(submesh="1"), "submesh must be a list of integers"),
    ],
)
def test_bad_plans_are_one_line_errors(plan_pp2: Path, tmp_path: Path, edit, message) -> None:
    with pytest.raises(AutoshardError, match=message):
        load_stage_plan(_edited(plan_pp2, tmp_path, edit))


def test_world_size_error_names_both_numbers(plan_pp2: Path) -> None:
    with pytest.raises(AutoshardError) as err:
        check_world_size(load_stage_plan(plan_pp2), 3)
    assert str(err.value).startswith(
        "the stage plan's mesh 2 needs 2 processes but torchrun started 3; pass --nproc-per-node 2"
    )


def test_plan_must_fit_the_model(plan_pp2: Path, blocks: Path, tmp_path: Path) -> None:
    loaded = instantiate(load_model_file(blocks), device="meta")
    renamed = _edited(plan_pp2, tmp_path, lambda d: d["stages"][0].update(split_points=["h.2"]))
    with pytest.raises(AutoshardError, match="splits at h.2, which blocks.py has no submodule"):
        check_stage_plan(load_stage_plan(renamed), loaded, "blocks.py")

    def extra(d):
        d["stages"][1]["parameters"]["head.weight"] = ["R"]

    with pytest.raises(AutoshardError, match="1 parameter.s. that blocks.py lacks: head.weight"):
        check_stage_plan(load_stage_plan(_edited(plan_pp2, tmp_path, extra)), loaded, "blocks.py")


def test_stages_of_a_2x2_plan_lie_on_a_pp_by_tp_mesh(plan_2x2: Path, blocks: Path) -> None:
    """pp=2 on 2x2: stage s holds the row-major block s*2 .. s*2+1, i.e. row s of the
    (pp, tp) mesh; the pipeline talks along the columns (ranks 0-2 and 1-3)."""
    plan = load_stage_plan(plan_2x2)
    assert [s.submesh for s in plan.stages] == [(1, 2), (1, 2)]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    layout = stage_mesh_layout(plan)
    assert layout.shape == (2, 2)
    assert layout.dim_names == ("pp", "tp")
    assert layout.inner_dims == (1,)
    assert layout.ranks == [[0, 1], [2, 3]]
    assert layout.devices_per_stage == 2
    # The budget makes both stages shard weights on the size-2 dim (Megatron column /
    # row on this plan; the size-1 dim 0 is always R).
    for s in plan.stages:
        sharded = {n: ps for n, ps in s.parameters.items() if ps[1].startswith("S(")}
        assert sharded, s.parameters
        assert all(ps[0] == "R" for ps in s.parameters.values())
    placed = stage_placements(plan.stages[0], layout.inner_dims)
    assert {len(ps) for ps in placed.values()} == {1}
    check_supported(plan)
    check_stage_plan(plan, instantiate(load_model_file(blocks), device="meta"), "blocks.py")


def test_pp_only_plan_has_no_intra_stage_dims(plan_pp2: Path) -> None:
    layout = stage_mesh_layout(load_stage_plan(plan_pp2))
    assert (layout.shape, layout.inner_dims, layout.devices_per_stage) == ((2,), (), 1)
    assert layout.ranks == [0, 1]


def _swap_ranks(d: dict) -> None:
    d["stages"][0]["ranks"], d["stages"][1]["ranks"] = [0, 2], [1, 3]


def _partial(d: dict) -> None:
    d["stages"][1]["parameters"]["layers.2.fc.weight"] = ["R", "P(sum)"]


def _bad_shard(d: dict) -> None:
    d["stages"][0]["parameters"]["layers.0.fc.bias"] = ["R", "S(1)"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_swap_ranks, r"stage 0 has ranks \[0, 2\], not the row-major block \[0, 1\]"),
        (
            lambda d: d["stages"][1].update(submesh=[2, 1]),
            r"stage 1 has submesh \[2, 1\] but stage 0 has \[1, 2\]",
        ),
        (_partial, r"layers.2.fc.weight is placed \['R', 'P\(sum\)'\]; Partial"),
        (_bad_shard, r"layers.0.fc.bias of shape \(16,\) cannot be sharded as S\(1\)"),
    ],
)
def test_plans_that_cannot_launch_exit_2_before_torchrun(
    plan_2x2: Path, blocks: Path, tmp_path: Path, edit, message
) -> None:
    plan = _edited(plan_2x2, tmp_path, edit)
    result = CliRunner().invoke(launch_command, [str(plan), str(blocks)])
    assert isinstance(result.exception, AutoshardError)  # the CLI prints it, exits 2
    assert re.search(message, str(result.exception)), str(result.exception)
    assert "running:" not in result.output  # torchrun never started


# ----------------------------------------------------------------------- micro-batches


def test_microbatches_are_equal_chunks_of_dim_0() -> None:
    x = torch.arange(24.0).reshape(8, 3)
    ids = torch.arange(16).reshape(8, 2)
    mbs = split_microbatches((x, ids), 4, ("x", "ids"))
    assert len(mbs) == 4
    assert all(m[0].shape == (2, 3) and m[1].shape == (2, 2) for m in mbs)
    assert torch.equal(torch.cat([m[0] for m in mbs]), x)
    assert torch.equal(torch.cat([m[1] for m in mbs]), ids)


def test_microbatches_must_divide_the_batch() -> None:
    with pytest.raises(
        AutoshardError,
        match=r"x of shape \(6, 3\) has batch size 6 \(dim 0\), "
        "which 4 micro-batches do not divide",
    ):
        split_microbatches((torch.zeros(6, 3),), 4, ("x",))
    with pytest.raises(AutoshardError, match="has no dims"):
        split_microbatches((torch.zeros(()),), 2)
    with pytest.raises(AutoshardError, match="at least 1"):
        split_microbatches((torch.zeros(4),), 0)


def test_schedule_is_1f1b_when_micro_batches_fill_the_pipeline() -> None:
    assert schedule_class(2, 4).__name__ == "Schedule1F1B"
    assert schedule_class(2, 2).__name__ == "Schedule1F1B"
    assert schedule_class(3, 2).__name__ == "ScheduleGPipe"


def test_micro_batch_losses_add_up_to_the_full_batch_loss() -> None:
    torch.manual_seed(0)
    out = torch.randn(8, 5)
    parts = [pipeline_loss(c, None) for c in out.chunk(4)]
    assert torch.allclose(sum(parts), pipeline_loss(out), rtol=0, atol=1e-5)
    assert pipeline_loss({"logits": out, "other": torch.ones(1)}) == out.sum()


# ------------------------------------------------------------------ shared parameters


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_tied_parameters_map_to_one_name_and_are_shared() -> None:
    canonical = canonical_names(_Tied())
    assert canonical == {"emb.weight": "emb.weight", "head.weight": "emb.weight"}

    first = nn.Module()
    first.emb = nn.Embedding(10, 4)
    last = nn.Module()
    last.head = nn.Linear(4, 10, bias=False)
    last.other = nn.Linear(2, 2)
    shared = shared_parameters([first, last], canonical)
    assert shared == {"emb.weight": (0, 1)}


def _tied_plan(head: list[str]) -> StagePlanFile:
    """_Tied on mesh 2x2, pp=2: the embedding in stage 0, the head (the same tensor) in
    stage 1, the embedding sharded on rows."""

    def stage(i: int, params: dict) -> StageSpec:
        split = ("head",) if i == 0 else ()
        return StageSpec(i, (), split, (1, 2), (2 * i, 2 * i + 1), params)

    return StagePlanFile(
        source="tied.stages.json",
        model="tied",
        mesh_shape=(2, 2),
        dim_names=("dp", "tp"),
        pp=2,
        microbatches=2,
        stages=(
            stage(0, {"emb.weight": ("R", "S(0)")}),
            stage(1, {"head.weight": tuple(head)}),
        ),
    )


def test_tied_weight_sharded_alike_in_two_stages_launches() -> None:
    loaded = LoadedModel(_Tied(), (), (), "tied")
    check_stage_plan(_tied_plan(["R", "S(0)"]), loaded, "tied.py")


def test_tied_weight_sharded_differently_in_two_stages_is_refused() -> None:
    loaded = LoadedModel(_Tied(), (), (), "tied")
    with pytest.raises(AutoshardError) as err:
        check_stage_plan(_tied_plan(["R", "S(1)"]), loaded, "tied.py")
    assert str(err.value).startswith(
        "tied parameter head.weight (stage 1) is placed S(1) but emb.weight (stage 0) S(0) "
        "on the intra-stage dims; launching a tied weight sharded differently"
    )


def test_copies_of_a_parameter_in_one_stage_get_the_summed_gradient() -> None:
    canonical = {"emb.weight": "emb.weight", "head.weight": "emb.weight"}
    stage = nn.Module()
    stage.emb = nn.Embedding(3, 2)
    stage.head = nn.Linear(2, 3, bias=False)  # a copy the tracer made: another tensor
    stage.emb.weight.grad = torch.ones(3, 2)
    stage.head.weight.grad = torch.full((3, 2), 2.0)
    sum_shared_gradients(stage, canonical, {})
    assert torch.equal(stage.emb.weight.grad, torch.full((3, 2), 3.0))
    assert torch.equal(stage.head.weight.grad, torch.full((3, 2), 3.0))
    assert stage.emb.weight.grad is not stage.head.weight.grad


# ------------------------------------------------------------------ real torchrun runs


@pytest.mark.slow  # starts torchrun
def test_forward_through_autoshard_launch_matches_one_device(plan_pp2: Path, blocks: Path) -> None:
    cmd = [sys.executable, "-m", "autoshard.cli", "launch", str(plan_pp2), str(blocks), "--check"]
    run = subprocess.run(
        cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "--nproc-per-node 2 --standalone" in run.stderr
    assert "stage plan pp=2 on mesh 2" in out
    assert "stage 0: layers.0 .. layers.1 on rank 0" in out
    assert "stage 1: layers.2 .. layers.3 on rank 1" in out
    assert "micro-batches: 4 of 2 (global batch 8), schedule Schedule1F1B" in out
    assert_checked(out, 1e-6)


@pytest.mark.slow  # starts torchrun
def test_training_steps_match_one_device(plan_pp2: Path, blocks: Path) -> None:
    """1F1B over 4 micro-batches, 2 AdamW steps: step 1's output, gradients and parameters
    equal the single-device run up to float32 rounding of the smaller matmuls."""
    run = ranks(2, str(plan_pp2), str(blocks), "--train", "--steps", "2", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert_checked(out, 1e-6, grads=1e-6, params=1e-6)
    assert "over 8 tensors" in out
    assert "drift after 2 steps" in out
    assert "(step 2; step 1: " in out


@pytest.mark.slow  # starts torchrun
def test_three_stages_gpipe_train_matches_one_device(blocks: Path, tmp_path: Path) -> None:
    """pp=3 with 2 micro-batches (fewer than the stages): ScheduleGPipe, a middle stage."""
    plan = _stages(blocks, tmp_path, "3", 3, 2)
    run = ranks(3, str(plan), str(blocks), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "micro-batches: 2 of 4 (global batch 8), schedule ScheduleGPipe" in out
    assert_checked(out, 1e-6, grads=1e-6, params=1e-6)


@pytest.mark.slow  # starts torchrun
def test_pp_by_tp_forward_matches_one_device(plan_2x2: Path, blocks: Path) -> None:
    """4 gloo ranks, mesh 2x2, pp=2: each stage's 2 ranks hold its weights sharded per
    the plan (DTensors on the tp dim), the pipeline sends full activations between
    ranks 0-2 and 1-3."""
    run = ranks(4, str(plan_2x2), str(blocks), "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "stage plan pp=2 on mesh 2x2 (dp, tp), 4 ranks" in out
    # 2 layers of a 16x16 weight and 16 biases, all halved: 2 * (128 + 8) floats (a shard's
    # AdamW step costs half, so the stage ILP shards the biases too)
    assert "stage 0: layers.0 .. layers.1 on rank 0,1, 1.06 KiB" in out
    assert "stage 1: layers.2 .. layers.3 on rank 2,3, 1.06 KiB" in out
    assert_checked(out, 1e-6)


@pytest.mark.slow  # starts torchrun
def test_pp_by_tp_training_matches_one_device(plan_2x2: Path, blocks: Path) -> None:
    """The same plan, 2 AdamW steps of 1F1B over 4 micro-batches: step 1's gradients
    (sharded ones gathered with full_tensor) and parameters equal one device's."""
    run = ranks(4, str(plan_2x2), str(blocks), "--train", "--steps", "2", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert_checked(out, 1e-6, grads=1e-6, params=1e-6)
    assert "over 8 tensors" in out


@pytest.mark.slow  # starts torchrun
def test_check_beyond_tolerance_exits_1_on_every_rank(plan_pp2: Path, blocks: Path) -> None:
    """A planted fault (one gradient x 1.01 on the stage that holds it) fails the check."""
    run = ranks(
        2,
        str(plan_pp2),
        str(blocks),
        "--train",
        "--check",
        AUTOSHARD_FAULT="grad:layers.0.fc.weight:1.01",
    )
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    assert "FAILED" in run.stdout
    assert "check: beyond tolerance: grad layers." in run.stdout


@pytest.mark.slow  # starts torchrun
def test_wrong_process_count_exits_2_with_one_line(plan_pp2: Path, blocks: Path) -> None:
    run = torchrun(1, str(plan_pp2), str(blocks))
    assert run.returncode != 0
    assert (
        "error: the stage plan's mesh 2 needs 2 processes but torchrun started 1; "
        "pass --nproc-per-node 2"
    ) in run.stderr
    assert "exitcode  : 2" in run.stderr


@pytest.mark.slow  # starts torchrun
def test_gpt2_two_layers_trains_like_one_device(tmp_path: Path) -> None:
    """HF GPT-2 from a default-style config, 2 blocks, one per stage, 2 micro-batches.
    The tied embedding / LM head is in both stages (pipelining copies it): its gradient is
    summed across them, so it equals the single-device one. (A vocabulary of 1024: with
    GPT-2's 50,257 each rank's float64 whole-model check and the AdamW states made this
    launch 37 s of the suite.)"""
    model = write_model(tmp_path, GPT2_DEFAULT, "gpt2_default")
    plan = _stages(model, tmp_path, "2", 2, 2)
    assert load_stage_plan(plan).split_points == ["transformer.h.1"]
    run = ranks(2, str(plan), str(model), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "gradients summed across them): transformer.wte.weight" in out
    assert_checked(out, 1e-5, grads=1e-5, params=1e-5)
    assert "over 28 tensors" in out  # every parameter, the tied one once


@pytest.mark.slow
def test_llama_with_grouped_query_attention_trains_on_2x2_like_one_device(
    tmp_path: Path,
) -> None:
    """HF Llama from a default-style config (4 query heads, 2 key/value heads, SDPA), one
    block per stage, each stage on 2 devices (2x2, pp=2). DTensor places the stages'
    activations: it needs a rule for the fused CPU attention (it had none) and a reshape
    of an attention output whose shard is laid out unlike the global tensor (it failed
    with "view size is not compatible"). Loss, gradients and parameters equal one
    device's."""
    model = write_model(tmp_path, LLAMA_SMALL, "llama_small")
    plan = _stages(model, tmp_path, "2x2", 2, 2, "--mode", "train")
    assert load_stage_plan(plan).split_points == ["model.layers.1"]
    run = ranks(4, str(plan), str(model), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert_checked(out, 1e-12, grads=1e-12, params=1e-12)
    assert "over 21 tensors" in out  # every parameter


@pytest.mark.slow
def test_mixtral_experts_train_on_2x2_like_one_device(tmp_path: Path) -> None:
    """A Mixtral-style MoE (4 experts, top-2), one block per stage on 2 devices each: the
    stage plan splits the experts' weights on tp, and DTensor runs HuggingFace's grouped
    matmul with autoshard's rule for it (it had none: "does not have a sharding strategy
    registered"). Loss, gradients and parameters equal one device's. The links have no
    latency: with the default 5 / 20 us per collective step, a plan of these 64-wide
    experts keeps them whole (a stage's ILP shared them out only while it was paid for
    hiding more of a scaled gradient than it cost)."""
    model = write_model(tmp_path, MIXTRAL_SMALL, "mixtral_small")
    no_latency = ("--intra-node-latency", "0us", "--inter-node-latency", "0us")
    plan = _stages(model, tmp_path, "2x2", 2, 2, "--mode", "train", *no_latency)
    experts = {
        name: places
        for stage in load_stage_plan(plan).stages
        for name, places in stage.parameters.items()
        if ".experts." in name
    }
    assert experts and any("S(" in str(p) for p in experts.values()), experts
    run = ranks(4, str(plan), str(model), "--train", "--check")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert_checked(out, 1e-12, grads=1e-12, params=1e-12)
    assert "over 21 tensors" in out  # every parameter
