"""``autoshard calibrate`` and ``--profile`` (issue 15, item 5)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from helpers import ROOT, autoshard_cli

from autoshard.calibrate import PROFILE_FORMAT, fit_link, load_profile
from autoshard.cost.collective_table import collective
from autoshard.cost.collectives import comm_model
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError

ALPHA, BW = 30e-6, 2e9


def _ring(kind: str, n: int, nbytes: int) -> float:
    """The NCCL tests' ring times, written out for n = 4 (PERFORMANCE.md: algorithm
    bandwidth = bus bandwidth x n / (2(n-1)) for all-reduce, x n / (n-1) for the others)."""
    assert n == 4
    return {
        "all_gather": 3 * ALPHA + 0.75 * nbytes / BW,
        "reduce_scatter": 3 * ALPHA + 0.75 * nbytes / BW,
        "all_reduce": 6 * ALPHA + 1.5 * nbytes / BW,
        "all_to_all": 3 * ALPHA + 0.1875 * nbytes / BW,
    }[kind]


def _samples(slower: dict[str, float] | None = None) -> list[dict]:
    slower = slower or {}
    return [
        {"kind": k, "bytes": b, "seconds": _ring(k, 4, b) * slower.get(k, 1.0)}
        for k in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        for b in (2**14, 2**16, 2**18, 2**20, 2**22)
    ]


def test_the_fit_recovers_the_ring_formulas_latency_and_bandwidth():
    """Times made by the ring formulas (written by hand above) give back alpha and bw, with
    no residual; the coefficients are the cost model's (autoshard.cost.collective_table)."""
    assert collective("all_reduce").coefficients(4) == (6.0, 1.5)
    # the fit's model is the cost model's: the same seconds for every kind and size
    cm = comm_model(MeshSpec((4,), ("d0",), (BW,), (ALPHA,)))
    for sample in _samples():
        assert cm.collective(sample["kind"], sample["bytes"], 0) == pytest.approx(
            sample["seconds"], rel=1e-12
        )
    fit = fit_link(_samples(), 4)
    assert fit.latency == pytest.approx(ALPHA, rel=1e-9)
    assert fit.bandwidth == pytest.approx(BW, rel=1e-9)
    assert fit.residual == pytest.approx(0.0, abs=1e-9)


def test_a_collective_slower_than_its_formula_shows_in_its_residual():
    """A planted fault: reduce-scatter twice as slow as the ring (as gloo's is). The fit
    stays a least-squares compromise and the per-kind residual names reduce-scatter."""
    fit = fit_link(_samples({"reduce_scatter": 2.0}), 4)
    assert fit.residual > 0.1
    assert max(fit.by_kind, key=fit.by_kind.__getitem__) == "reduce_scatter"
    assert fit.by_kind["reduce_scatter"] > 2 * fit.by_kind["all_gather"]


def test_times_that_do_not_grow_with_size_fit_no_bandwidth():
    flat = [{"kind": "all_gather", "bytes": b, "seconds": 1e-3} for b in (2**10, 2**20)]
    with pytest.raises(AutoshardError, match="no bandwidth can be fitted"):
        fit_link(flat, 4)


def test_a_profile_prices_each_matmul_at_the_rate_measured_for_its_size():
    """The H200 profile (tests/data/h200): every timed bfloat16 matmul, priced by the
    profile's device, takes the seconds calibrate measured for it (the two shapes of one
    FLOP count, 8192x4096x11008 and 8192x11008x4096, the mean of their rates); its peak
    (the MFU's denominator) is the best rate measured."""
    path = ROOT / "tests/data/h200/profile.json"
    raw = json.loads(path.read_text())
    device = load_profile(path).device_spec()
    same_size: dict[float, list[float]] = {}
    for m in raw["compute"]["matmuls"]:
        flops = 2 * m["m"] * m["n"] * m["k"]
        same_size.setdefault((m["dtype"], flops), []).append(m["seconds"])
    for (dtype, flops), seconds in same_size.items():
        rate = sum(flops / s for s in seconds) / len(seconds)
        assert device.compute_time(flops, 0.0, dtype) == pytest.approx(flops / rate, rel=1e-12)
    bf16 = [m["flops_per_s"] for m in raw["compute"]["matmuls"] if m["dtype"] == "bfloat16"]
    assert device.peak("bfloat16") == max(bf16)
    # small matmuls are slower per FLOP: 512^3 reached under 5% of the best rate measured
    assert device.matmul_rate(2 * 512**3, "bfloat16") < 0.05 * max(bf16)


def test_a_profile_prices_attention_at_the_seconds_measured_for_it():
    """The H200 profile's causal attentions: the attention kernel's forward of a measured
    size is priced at its measured forward seconds, its backward at the forward-plus-
    backward run's seconds less the forward's (FLOPs likewise); a dtype with no attention
    measured (float32) falls back to the matmul rates."""
    path = ROOT / "tests/data/h200/profile.json"
    raw = json.loads(path.read_text())
    device = load_profile(path).device_spec()
    for a in raw["compute"]["attention"]:
        f, fb = a["flops_forward"], a["flops_forward_backward"]
        t, tfb = a["seconds_forward"], a["seconds_forward_backward"]
        per = a["batch"] * a["heads"]
        forward = device.compute_time(f, 0.0, "bfloat16", "attention_forward", per=per)
        assert forward == pytest.approx(t)
        backward = device.compute_time(fb - f, 0.0, "bfloat16", "attention_backward", per=per)
        assert backward == pytest.approx(tfb - t)
        # the same sequence length on twice the batch: twice the time, at the same rate
        twice = device.compute_time(2 * f, 0.0, "bfloat16", "attention_forward", per=2 * per)
        assert twice == pytest.approx(2 * t)
    assert device.rate(1e12, "float32", "attention_forward") == device.matmul_rate(1e12, "float32")


def test_a_file_that_is_not_a_profile_is_one_line(tmp_path: Path):
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"format": "autoshard.sharding_map/2"}))
    with pytest.raises(AutoshardError, match="is not an autoshard profile"):
        load_profile(bad)
    with pytest.raises(AutoshardError, match="not found: write one with `autoshard calibrate"):
        load_profile(tmp_path / "missing.json")


def _solve_json(tmp_path: Path, *extra: str) -> dict:
    args = ["solve", str(ROOT / "examples/mlp.py"), "--mesh", "2x2", "--mode", "infer"]
    args += ["--inputs", "replicate", "--outputs", "replicate", "--out", str(tmp_path / "s")]
    out = autoshard_cli(*args, "--json", "-q", *extra, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_calibrated_profile_on_four_gloo_ranks_changes_the_plan(tmp_path: Path):
    """4 gloo ranks on this CPU: latency hundreds of times an H100's NVLink step and matmuls
    thousands of times slower. The MLP example (1.07 GFLOP, replicated input and output):
    on H100 numbers sharding saves ~9 us of compute and would cost >= 25 us of all-gather
    latency, so every device runs it whole; on the profile's, the 4-way batch split saves
    ~3/4 of milliseconds of compute for one all-gather of the output (256 KiB), priced
    with the profile's own alpha and bw by hand below."""
    profile = tmp_path / "cpu.json"
    out = autoshard_cli("calibrate", "--mesh", "2x2", "--out", str(profile), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"profile {profile} (gloo, cpu):" in out.stdout
    assert "fit residual" in out.stdout
    raw = json.loads(profile.read_text())
    assert raw["format"] == PROFILE_FORMAT and raw["world_size"] == 4
    assert {s["kind"] for s in raw["links"][0]["samples"]} == {
        "all_gather",
        "reduce_scatter",
        "all_reduce",
        "all_to_all",
        "send_recv",  # one ring step, ring attention's pass
    }
    for m in raw["compute"]["matmuls"]:
        assert m["flops_per_s"] == pytest.approx(2 * m["m"] * m["n"] * m["k"] / m["seconds"])
    # causal attention, counted over the whole score matrix as FlopCounterMode counts it:
    # forward 4 b h s^2 d (two matmuls), backward 2.5 times that (five), the count of
    # Dao's FlashAttention-2 benchmarks (2023) before they halve it for causal masks
    for a in raw["compute"]["attention"]:
        forward = 4 * a["batch"] * a["heads"] * a["seq"] ** 2 * a["head_dim"]
        assert a["flops_forward"] == forward
        assert a["flops_forward_backward"] == forward * 3.5
        assert a["flops_per_s_forward"] == pytest.approx(forward / a["seconds_forward"])
    assert raw["compute"]["elementwise_bandwidth_Bps"] > 0
    assert "matmul float32 512x512x512:" in out.stdout
    assert "attention float32 causal 1x4x256x64: forward" in out.stdout
    p = load_profile(profile)
    (a0, a1), (bw0, bw1) = (f.latency for f in p.links), (f.bandwidth for f in p.links)

    datasheet = _solve_json(tmp_path, "--device", "h100")
    assert datasheet["device"] == "h100"
    assert datasheet["time_s"]["collectives"] == {}
    assert all(ps == ["R", "R"] for ps in datasheet["plan"]["parameters"].values())
    unsplit = _solve_json(tmp_path, "--device", "h100", "--algo", "replicate")["time_s"]
    assert datasheet["time_s"]["compute"] == pytest.approx(unsplit["compute"])  # whole

    measured = _solve_json(tmp_path, "--profile", str(profile))
    assert measured["device"] == "calibrated"
    assert measured["mesh"]["latency_s"] == [a0, a1]
    assert measured["mesh"]["bandwidth_Bps"] == [bw0, bw1]
    whole = _solve_json(tmp_path, "--profile", str(profile), "--algo", "replicate")
    # split 4 ways, so less compute per device than whole; how much less depends on the
    # machine: the weights every device reads whole bound the split matmuls (0.36 of whole
    # on CI's machine), and the profile's rates by matmul size may favour the smaller
    # shards (0.248 of whole seen here, on a busy machine)
    assert measured["time_s"]["compute"] < whole["time_s"]["compute"]
    # what the plan moves, by hand with the profile's alpha and bw (n = 2 on each dim);
    # the output is 64 x 1024 fp32, B bytes. Which plan wins depends on the measured
    # numbers: the batch split on both dims, or on one dim with Megatron's column/row
    # pair on the other
    b = 64 * 1024 * 4
    alpha, bw = (a0, a1), (bw0, bw1)
    params = measured["plan"]["parameters"]
    seen = {k: v["total"] for k, v in measured["time_s"]["collectives"].items()}
    if all(ps == ["R", "R"] for ps in params.values()):
        # S(0)·S(0) -> R·R: the inner (tp) dim first, as DTensor nests it, on the half
        # each tp pair holds, then dp on the whole
        want = {"all_gather": a1 + (b / 2) / (2 * bw1) + a0 + b / (2 * bw0)}
    elif params["fc1.weight"] == ["S(0)", "S(0)"]:
        # Megatron's pair over all four devices (a profile measured on a busy machine can
        # make it win): fc2's output is Partial on both dims and made whole
        assert params["fc2.weight"] == ["S(1)", "S(1)"], params
        want = min(_whole_from_partial_on_both_dims(b, alpha, bw), key=lambda w: _off(w, seen))
    else:
        (t,) = [d for d in (0, 1) if params["fc1.weight"][d] == "S(0)"]
        assert params["fc2.weight"][t] == "S(1)", params  # the row of the pair
        d = 1 - t
        if "reduce_scatter" not in seen:
            # fc2's Partial output all-reduced on t (on the batch half), then gathered on d
            want = {
                "all_reduce": 2 * alpha[t] + (b / 2) / bw[t],
                "all_gather": alpha[d] + b / (2 * bw[d]),
            }
        else:
            # or, at the same ring cost, reduce-scattered on t (the batch half), then
            # gathered on both dims: the inner half first, then the whole, either nesting
            half = alpha[t] + (b / 2) / (2 * bw[t])
            gathers = [
                half + alpha[d] + b / (2 * bw[d]),
                alpha[d] + (b / 2) / (2 * bw[d]) + alpha[t] + b / (2 * bw[t]),
            ]
            gather = min(gathers, key=lambda g: abs(g - seen.get("all_gather", 0.0)))
            want = {"reduce_scatter": half, "all_gather": gather}
    assert seen == pytest.approx(want), params
    assert measured["time_s"]["step"] < whole["time_s"]["step"] / 2


def _whole_from_partial_on_both_dims(b: float, alpha, bw) -> list[dict[str, float]]:
    """Seconds by kind of every way to make a tensor of ``b`` bytes, ``Partial`` on both
    dims of a 2x2 mesh, whole: per dim an all-reduce, or a reduce-scatter then later an
    all-gather, in any order. Ring formulas for n = 2 (NCCL tests PERFORMANCE.md) on the
    bytes each device holds when the step runs: all-reduce 2 alpha + L / bw,
    reduce-scatter alpha + L / (2 bw) (L halves), all-gather alpha + L / bw (L doubles)."""
    ways = []
    for split in itertools.product((False, True), repeat=2):
        steps = [s for d in (0, 1) for s in ((("rs", d), ("ag", d)) if split[d] else (("ar", d),))]
        for order in set(itertools.permutations(steps)):
            if any(order.index(("rs", d)) > order.index(("ag", d)) for d in (0, 1) if split[d]):
                continue
            local, by_kind = b, {}
            for kind, d in order:
                if kind == "ar":
                    t, name = 2 * alpha[d] + local / bw[d], "all_reduce"
                elif kind == "rs":
                    t, name = alpha[d] + local / (2 * bw[d]), "reduce_scatter"
                    local /= 2
                else:
                    t, name = alpha[d] + local / bw[d], "all_gather"
                    local *= 2
                by_kind[name] = by_kind.get(name, 0.0) + t
            ways.append(by_kind)
    return ways


def _off(want: dict[str, float], seen: dict[str, float]) -> float:
    return sum(abs(want.get(k, 0.0) - seen.get(k, 0.0)) for k in set(want) | set(seen))


def _write_profile(path: Path) -> Path:
    fit = {"latency_s": ALPHA, "bandwidth_Bps": BW, "residual": 0.0}
    path.write_text(
        json.dumps(
            {
                "format": PROFILE_FORMAT,
                "backend": "gloo",
                "device": "cpu",
                "mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"]},
                "links": [fit, fit],
                "compute": {
                    "peak_flops": {"float32": 1e11},
                    "memory_bandwidth_Bps": 1e12,
                    "memory_bytes": 2**33,
                },
            }
        )
    )
    return path


def test_the_python_api_plans_with_a_profile(tmp_path: Path):
    """``autoshard.solve(..., profile=)``: the profile's links and device price the plan.
    Two 256x256 matmuls on a batch of 8 take 2 x 2 x 8 x 256 x 256 FLOPs, 21 us at the
    profile's 1e11 FLOP/s (compute-bound: 0.5 MiB of weights at 1e12 B/s is 0.5 us). The
    best plan splits the batch 4 ways with nothing to communicate (free inputs and
    outputs): a quarter of that, and no collective."""
    import torch

    import autoshard

    profile = _write_profile(tmp_path / "p.json")
    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False)
        )
    x = torch.empty(8, 256, device="meta")
    result = autoshard.solve(model, x, mesh="2x2", mode="infer", profile=profile)
    assert result.config.mesh.latency == (ALPHA, ALPHA)
    assert result.config.mesh.bandwidth == (BW, BW)
    assert result.config.device.name == "calibrated"
    whole = 2 * 2 * 8 * 256 * 256 / 1e11
    assert result.plan.compute_s == pytest.approx(whole / 4, rel=1e-3)
    assert result.plan.step_time_s == pytest.approx(result.plan.compute_s)
    with pytest.raises(AutoshardError, match="was measured on mesh 2x2, not 4"):
        autoshard.solve(model, x, mesh="4", mode="infer", profile=profile)


def test_profile_and_link_options_together_are_refused(tmp_path: Path):
    profile = _write_profile(tmp_path / "p.json")
    mlp = str(ROOT / "examples/mlp.py")
    out = autoshard_cli(
        "solve", mlp, "--mesh", "2x2", "--profile", str(profile), "--device", "a100", cwd=tmp_path
    )
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "error: --profile sets the links and the device; drop --device"
    ]
    out = autoshard_cli("solve", mlp, "--mesh", "4", "--profile", str(profile), cwd=tmp_path)
    assert out.returncode != 0
    assert "was measured on mesh 2x2, not 4" in out.stderr


def test_the_planner_prices_attention_at_the_profile_s_attention_rates(tmp_path: Path):
    """A model of one SDPA on q, k, v of (2, 4, 256, 64) (q scaled by a parameter, so that
    it trains), planned on a 2x2 mesh with a profile whose causal attention runs its
    forward at 1e9 FLOP/s and its backward at 1e8 (matmuls at the profile's 1e11 peak).
    Split 4 ways (batch and heads, nothing to communicate):

    - inference, causal: the forward's 4 x 2 x 4 x 256^2 x 64 = 134,217,728 FLOPs (the
      whole score matrix) at 1e9, a quarter each: 33.6 ms;
    - training, causal: that plus the backward's 2.5 times as many FLOPs at 1e8: 872 ms
      (the scaling and the loss, a few microseconds, within the tolerance);
    - inference, not causal: the measured rates are a causal kernel's, so it is priced as
      a matmul of its FLOPs, at 1e11."""
    import torch

    import autoshard

    raw = json.loads(_write_profile(tmp_path / "p.json").read_text())
    raw["compute"]["attention"] = [
        {
            "dtype": "float32",
            "batch": 1,
            "heads": 1,
            "causal": True,
            "flops_forward": 1e6,
            "seconds_forward": 1e-3,
            "flops_forward_backward": 3.5e6,
            "seconds_forward_backward": 1e-3 + 2.5e6 / 1e8,
        }
    ]
    profile = tmp_path / "attention.json"
    profile.write_text(json.dumps(raw))

    class Attention(torch.nn.Module):
        def __init__(self, causal: bool):
            super().__init__()
            self.causal = causal
            self.scale = torch.nn.Parameter(torch.ones(1))

        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(
                q * self.scale, k, v, is_causal=self.causal
            )

    q = torch.empty(2, 4, 256, 64, device="meta")
    flops = 4 * 2 * 4 * 256**2 * 64

    def compute(mode: str, causal: bool) -> float:
        with torch.device("meta"):
            model = Attention(causal)
        result = autoshard.solve(model, (q, q, q), mesh="2x2", mode=mode, profile=profile)
        return result.plan.compute_s

    assert compute("infer", True) == pytest.approx(flops / 1e9 / 4, rel=1e-3)
    assert compute("train", True) == pytest.approx((flops / 1e9 + 2.5 * flops / 1e8) / 4, rel=1e-3)
    assert compute("infer", False) == pytest.approx(flops / 1e11 / 4, rel=1e-2)


@pytest.mark.slow  # over 5 s: the fast tier stays under 2 minutes
def test_a_one_device_profile_prices_the_device_on_any_mesh(tmp_path: Path):
    """A profile of one GPU (``calibrate --mesh 1``: no links) sets the device only: the
    Python API plans a 2x2 mesh with it, the links the mesh's own (the datasheet's
    defaults; here the ones given), the compute the profile's (the 256x256 MLP of the test
    above: 21 us whole at the profile's 1e11 FLOP/s, a quarter split 4 ways). The command
    line takes it with --mesh and refuses --device beside it."""
    import torch

    import autoshard
    from autoshard.cost.mesh import DEFAULT_INTRA_NODE_BW

    raw = json.loads(_write_profile(tmp_path / "p.json").read_text())
    raw["mesh"] = {"shape": [1], "dim_names": ["d0"]}
    raw["links"] = [{"dim": 0, "name": "d0", "size": 1, "samples": [], "latency_s": None}]
    profile = tmp_path / "one.json"
    profile.write_text(json.dumps(raw))
    assert load_profile(profile).device_only and not load_profile(tmp_path / "p.json").device_only

    with torch.device("meta"):
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False)
        )
    x = torch.empty(8, 256, device="meta")
    result = autoshard.solve(model, x, mesh="2x2", mode="infer", profile=profile)
    assert result.config.device.name == "calibrated"
    assert result.config.mesh == MeshSpec.from_options("2x2")
    assert result.plan.compute_s == pytest.approx(2 * 2 * 8 * 256 * 256 / 1e11 / 4, rel=1e-3)

    args = ["solve", str(ROOT / "examples/mlp.py"), "--mesh", "2x4", "--mode", "infer"]
    args += ["--out", str(tmp_path / "s"), "--profile", str(profile)]
    out = autoshard_cli(*args, "--json", "-q", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    solved = json.loads(out.stdout)
    assert solved["device"] == "calibrated"
    assert solved["mesh"]["bandwidth_Bps"][1] == DEFAULT_INTRA_NODE_BW
    refused = autoshard_cli(*args, "--device", "h200", cwd=tmp_path)
    assert refused.returncode != 0
    assert "--profile sets the device; drop --device" in refused.stderr
    gpus = ["solve", str(ROOT / "examples/mlp.py"), "--gpus", "4", "--gpus-per-node", "2"]
    gpus += ["--mode", "infer", "--out", str(tmp_path / "g"), "--profile", str(profile)]
    out = autoshard_cli(*gpus, "--json", "-q", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["device"] == "calibrated"


@pytest.fixture
def one_gloo_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(("sustain", "reps"), [(0.0, 4), (0.06, 120)])
def test_a_sustained_sample_runs_its_calls_back_to_back_for_the_window(
    one_gloo_rank, monkeypatch, sustain, reps
):
    """``--sustain``: a GPU's clock falls once back-to-back matmuls reach its power limit,
    which a 2 ms burst never sees (mamf-finder's MAMF against MSMF, docs/calibrate.md).
    With a call of 0.5 ms (on a clock the call itself advances, so this CPU's load does
    not count), a burst sample runs 2 ms / 0.5 ms = 4 calls; a 60 ms window 120, after
    one such window untimed. Counted calls: the three single calls that size ``reps``
    and their one warm-up, then (warm-up +) ``iters`` = 3 samples of ``reps`` calls."""
    import torch

    from autoshard.calibrate import rank

    clock = [0.0]
    monkeypatch.setattr(rank.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn():
        calls.append(1)
        clock[0] += 5e-4

    t = rank._timed_per_call(fn, lambda: None, 3, torch.device("cpu"), sustain)
    assert len(calls) == 4 + ((1 if sustain else 0) + 3) * reps
    assert t == pytest.approx(5e-4, rel=1e-9)


def test_calibrate_refuses_a_negative_sustain(tmp_path: Path):
    out = autoshard_cli("calibrate", "--mesh", "1", "--sustain", "-1s", cwd=tmp_path)
    assert out.returncode != 0
    assert "--sustain" in out.stderr and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_sustained_calibration_says_so_in_its_profile_and_its_report(tmp_path: Path):
    """One CPU device, 20 ms windows: the profile records the window (``sustain_s``) and
    the report says which rates it holds; a profile timed in bursts (the default) says
    that it is a burst, faster than a step sustains."""
    profile = tmp_path / "p.json"
    args = ("calibrate", "--mesh", "1", "--iters", "2", "--out", str(profile))
    out = autoshard_cli(*args, "--sustain", "20ms", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(profile.read_text())["compute"]["sustain_s"] == pytest.approx(0.02)
    assert "timed over 20.0 ms of back-to-back calls" in out.stdout
    out = autoshard_cli(*args, cwd=tmp_path)
    assert json.loads(profile.read_text())["compute"]["sustain_s"] == 0
    assert "the boost-clock burst, faster than a training step sustains" in out.stdout
