"""Device table and roofline compute time: exact values worked by hand from the datasheets."""

import json

import pytest
import torch

from autoshard.cost.devices import DEFAULT_DEVICE, DEVICES, DeviceSpec, get_device
from autoshard.errors import AutoshardError


def test_table_holds_the_datasheet_numbers() -> None:
    h100 = DEVICES["h100"]
    # H100 SXM: 1,979 TFLOPS bf16 with sparsity -> 989.5 dense; TF32 989 sparse -> 494.5 dense.
    assert h100.peak(torch.bfloat16) == 989.5e12
    assert h100.peak(torch.float16) == 989.5e12
    assert h100.peak(torch.float32) == 494.5e12
    assert h100.memory_bandwidth == 3.35e12
    assert h100.memory_bytes == 80_000_000_000
    assert DEVICES["h200"].memory_bandwidth == 4.8e12
    assert DEVICES["h200"].memory_bytes == 141_000_000_000
    assert DEVICES["a100"].peak(torch.bfloat16) == 312e12
    assert DEVICES["a100"].peak(torch.float32) == 156e12
    assert DEVICES["a100"].memory_bandwidth == 2.039e12
    assert "float8_e4m3fn" not in DEVICES["a100"].peak_flops  # Ampere has no FP8
    assert DEVICES[DEFAULT_DEVICE].name == DEFAULT_DEVICE
    for name, spec in DEVICES.items():
        assert spec.name == name


def test_compute_bound_matmul_on_h100() -> None:
    # A 4096 x 4096 x 4096 bf16 matmul: 2 * 4096**3 = 137,438,953,472 FLOPs; it reads two
    # 4096 x 4096 operands and writes one: 3 * 4096**2 * 2 B = 100,663,296 bytes.
    # compute: 137438953472 / 989.5e12 = 1.3890e-4 s; memory: 100663296 / 3.35e12 = 3.005e-5 s.
    t = DEVICES["h100"].compute_time(137_438_953_472, 100_663_296, torch.bfloat16)
    assert t == 137_438_953_472 / 989.5e12
    assert t == pytest.approx(1.38897e-4, rel=1e-5)


def test_memory_bound_add_on_h100() -> None:
    # Elementwise add of 2**24 bf16 values: 16,777,216 FLOPs, 3 * 2**24 * 2 = 100,663,296 bytes.
    # compute: 1.696e-8 s; memory: 100663296 / 3.35e12 = 3.0049e-5 s, the larger.
    t = DEVICES["h100"].compute_time(16_777_216, 100_663_296, torch.bfloat16)
    assert t == 100_663_296 / 3.35e12
    assert t == pytest.approx(3.00487e-5, rel=1e-5)


def test_same_op_is_slower_on_a100() -> None:
    # 312e12 FLOPs of bf16 is exactly one second on an A100 (312 TFLOPS dense) and
    # 312 / 989.5 = 0.31531 s on an H100.
    assert DEVICES["a100"].compute_time(312e12, 0, torch.bfloat16) == 1.0
    assert DEVICES["h100"].compute_time(312e12, 0, torch.bfloat16) == 312 / 989.5


def test_missing_dtype_falls_back_to_fp32_peak() -> None:
    # float64 is in no table: 494.5e12 FLOPs at the H100's TF32 peak (494.5 TFLOPS) is 1 s.
    h100 = DEVICES["h100"]
    assert h100.compute_time(494.5e12, 0, torch.float64) == 1.0
    assert h100.peak(torch.float64) == 494.5e12
    # FP8 on an A100 also falls back to its TF32 peak: 156e12 FLOPs -> 1 s.
    assert DEVICES["a100"].compute_time(156e12, 0, torch.float8_e4m3fn) == 1.0


def test_zero_work_takes_zero_time() -> None:
    assert DEVICES["h100"].compute_time(0, 0, torch.float32) == 0.0


@pytest.mark.parametrize("flops, nbytes", [(-1.0, 0.0), (0.0, -8.0), (float("nan"), 0.0)])
def test_compute_time_rejects_bad_counts(flops: float, nbytes: float) -> None:
    with pytest.raises(AutoshardError, match="non-negative"):
        DEVICES["h100"].compute_time(flops, nbytes, torch.float32)


@pytest.mark.parametrize("name", ["h100", "H100", " H200 ", "A100", "mi300x", "L40S"])
def test_get_device_is_case_insensitive(name: str) -> None:
    assert get_device(name) is DEVICES[name.strip().lower()]


def test_get_device_unknown_lists_known_names() -> None:
    with pytest.raises(AutoshardError) as info:
        get_device("v100")
    message = str(info.value)
    assert "'v100'" in message
    for known in ("h100", "h200", "a100"):
        assert known in message


def test_spec_validation_names_the_number() -> None:
    fp32 = {torch.float32: 1e12}
    with pytest.raises(AutoshardError, match=r"memory_bandwidth\(0\)"):
        DeviceSpec("x", fp32, memory_bandwidth=0, memory_bytes=1)
    with pytest.raises(AutoshardError, match=r"memory_bytes\(-5\)"):
        DeviceSpec("x", fp32, memory_bandwidth=1e9, memory_bytes=-5)
    with pytest.raises(AutoshardError, match=r"peak_flops\[torch.float16\]\(-1.0\)"):
        DeviceSpec("x", {torch.float32: 1e12, torch.float16: -1.0}, 1e9, 1)
    with pytest.raises(AutoshardError, match="needs torch.float32"):
        DeviceSpec("x", {torch.bfloat16: 1e12}, 1e9, 1)


def test_spec_keeps_its_own_copy_of_the_table() -> None:
    table = {torch.float32: 1e12}
    spec = DeviceSpec("x", table, 1e9, 1)
    table[torch.float32] = 5.0
    assert spec.peak(torch.float32) == 1e12


def test_to_dict_round_trips() -> None:
    h100 = DEVICES["h100"]
    data = h100.to_dict()
    assert data["peak_flops"]["bfloat16"] == 989.5e12
    assert data["memory_bandwidth_Bps"] == 3.35e12
    assert DeviceSpec.from_dict(data) == h100
    with pytest.raises(AutoshardError, match="unknown dtype 'bfloat17'"):
        DeviceSpec.from_dict({**data, "peak_flops": {"float32": 1.0, "bfloat17": 1.0}})
    with pytest.raises(AutoshardError, match="memory_bytes"):
        DeviceSpec.from_dict({"name": "x", "peak_flops": {}, "memory_bandwidth_Bps": 1.0})


def test_dtype_names_are_torch_floating_dtypes() -> None:
    from autoshard.cost.devices import DTYPE_NAMES, dtype_name

    for name in DTYPE_NAMES:
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype) and dtype.is_floating_point
        assert dtype_name(dtype) == name == dtype_name(name)
    with pytest.raises(AutoshardError, match="unknown dtype"):
        dtype_name(torch.int64)
    with pytest.raises(AutoshardError, match="peak_flops keys"):
        DeviceSpec("x", {torch.float32: 1e12, 3: 1.0}, 1e9, 1)


def test_a_measured_matmul_is_priced_at_the_time_it_was_measured() -> None:
    """Two sizes measured (calibrate's points): a matmul of a measured size costs what was
    measured; between them the rate follows the power law through both (worked by hand:
    1e10 FLOPs is halfway in log between 1e9 and 1e11, so its rate is the geometric mean
    of 100 and 700 TFLOP/s, sqrt(70000) = 264.6); outside them the nearest measured rate
    holds; a dtype with no points, or an op that is not a matmul, runs at the peak."""
    spec = DeviceSpec(
        "m",
        {torch.float32: 100e12, torch.bfloat16: 800e12},
        1e12,
        1,
        {"bfloat16": ((1e9, 100e12), (1e11, 700e12))},
    )
    # measured: 1e11 FLOPs in 1e11 / 700e12 s
    assert spec.compute_time(1e11, 0.0, torch.bfloat16) == pytest.approx(1e11 / 700e12)
    assert spec.compute_time(1e9, 0.0, torch.bfloat16) == pytest.approx(1e9 / 100e12)
    assert spec.matmul_rate(1e10, torch.bfloat16) == pytest.approx(264.575e12, rel=1e-5)
    # the time grows with the size between the points: 1e10 FLOPs take 37.8 us, between
    # the 10 us of 1e9 and the 142.9 us of 1e11
    assert spec.compute_time(1e10, 0.0, torch.bfloat16) == pytest.approx(37.796e-6, rel=1e-4)
    assert spec.compute_time(1e10, 0.0, torch.bfloat16, kind="other") == 1e10 / 800e12
    assert spec.matmul_rate(1e6, torch.bfloat16) == 100e12
    assert spec.matmul_rate(1e15, torch.bfloat16) == 700e12
    assert spec.matmul_rate(1e10, torch.float32) == 100e12  # no points: the peak
    # the byte term is untouched: a memory-bound op still runs at the bandwidth
    assert spec.compute_time(0.0, 2e9, torch.bfloat16) == pytest.approx(2e-3)
    assert DeviceSpec.from_dict(spec.to_dict()) == spec
    assert "matmul_rates" not in DEVICES["h100"].to_dict()


def test_matmul_rates_that_cannot_be_rates_are_refused() -> None:
    fp32 = {torch.float32: 1e12}
    with pytest.raises(AutoshardError, match=r"matmul_rates\[torch.bfloat16\] needs"):
        DeviceSpec("x", fp32, 1e9, 1, {"bfloat16": ((1e9, 0.0),)})
    with pytest.raises(AutoshardError, match="two rates for one size"):
        DeviceSpec("x", fp32, 1e9, 1, {"float32": ((1e9, 1e12), (1e9, 2e12))})
    with pytest.raises(AutoshardError, match="unknown dtype"):
        DeviceSpec("x", fp32, 1e9, 1, {"bfloat17": ((1e9, 1e12),)})


@pytest.mark.parametrize(("name", "profile"), [("h100", "h100b"), ("h200", "h200")])
def test_a_measured_preset_prices_what_its_gpu_measured(name: str, profile: str) -> None:
    """``h100-measured`` and ``h200-measured`` are the GPUs lent to this project, read here
    from their raw calibration files (tests/data/*/profile.json), not through autoshard:
    each timed bfloat16 matmul is priced at the time it took (the curve passes through
    the measured points), a copy of 1 GiB in and out at the measured bandwidth; the MFU's
    peak and the memory stay the datasheet's."""
    import json
    from pathlib import Path

    from autoshard.cost.devices import MEASURED_DIR

    raw = json.loads((Path(__file__).parent / f"data/{profile}/profile.json").read_text())
    kept = json.loads((MEASURED_DIR / f"{name}.json").read_text())
    # the package keeps that GPU's measurement whole: every timed matmul and attention
    assert kept["matmuls"] == raw["compute"]["matmuls"]
    assert kept["attention"] == raw["compute"]["attention"]
    measured, datasheet = get_device(f"{name}-measured"), get_device(name)
    assert measured.peak_flops == datasheet.peak_flops
    assert measured.memory_bytes == datasheet.memory_bytes
    bandwidth = raw["compute"]["memory_bandwidth_Bps"]
    assert measured.compute_time(0, 2**31, "bfloat16", kind="other") == pytest.approx(
        2**31 / bandwidth, rel=1e-12
    )
    sizes = {}
    for m in raw["compute"]["matmuls"]:
        if m["dtype"] == "bfloat16":
            sizes.setdefault(2.0 * m["m"] * m["n"] * m["k"], []).append(m["seconds"])
    assert len(sizes) >= 4
    for flops, seconds in sizes.items():
        # shapes of equal FLOPs average their rates; each square is its own size
        rate = sum(flops / t for t in seconds) / len(seconds)
        assert measured.compute_time(flops, 0, "bfloat16") == pytest.approx(flops / rate)
    # the datasheet prices the largest square 20% or more faster than the GPU ran it
    big = max(sizes)
    assert datasheet.compute_time(big, 0, "bfloat16") < 0.8 * measured.compute_time(
        big, 0, "bfloat16"
    )


def test_a_preset_with_no_measurement_says_which_are_kept() -> None:
    from autoshard.cost.devices import measured_device

    kept = "pick one of a100, h100, h200"
    with pytest.raises(AutoshardError, match=f"no measured rates of 'l40s' are kept: {kept}"):
        measured_device("l40s")


def test_a100_measured_prices_what_published_a100_benchmarks_reached() -> None:
    """``a100-measured`` holds the rates published benchmarks of an A100 reached, typed
    here from the sources (not read from autoshard's file): a large bfloat16 matmul
    sustained at 257 TFLOP/s (Horace He, thonking.ai 2024: 8192^3 through cuBLAS with
    torch.randn inputs, 257-258; the ml-engineering table's A100 PCIe MSMF, 258), not
    mamf-finder's 271.2 TFLOP/s burst at its best shape, 1024 x 10240 x 5120 (its MAMF,
    the table at 744d01e); BabelStream's copy 1.71 TB/s. With that one point every
    bfloat16 matmul runs at it (a 8192^3 matmul: 2 * 8192^3 / 257e12 = 4.278 ms, where the
    burst said 4.054 ms and the datasheet's 312 TFLOP/s says 3.524 ms); the MFU's peak, the
    memory and the other dtypes stay the datasheet's."""
    achieved, datasheet = get_device("a100-measured"), get_device("a100")
    burst_shape = 2 * 1024 * 10240 * 5120
    assert achieved.compute_time(burst_shape, 0, "bfloat16") == pytest.approx(burst_shape / 257e12)
    big = 2 * 8192**3
    assert achieved.compute_time(big, 0, "bfloat16") == pytest.approx(4.2783e-3, rel=1e-4)
    assert datasheet.compute_time(big, 0, "bfloat16") == pytest.approx(3.5240e-3, rel=1e-4)
    # a memory-bound op: 1 GiB read and written at the copy rate
    assert achieved.compute_time(0, 2**31, "bfloat16", kind="other") == pytest.approx(
        2**31 / 1.71e12
    )
    assert achieved.peak_flops == datasheet.peak_flops
    assert achieved.memory_bytes == datasheet.memory_bytes
    assert achieved.compute_time(big, 0, "float32") == datasheet.compute_time(big, 0, "float32")


@pytest.mark.parametrize(("seq", "tflops"), [(2048, 155), (8192, 182)])
def test_a100_measured_times_causal_attention_as_flash_attention_2_s_figure(seq, tflops):
    """FlashAttention-2's A100 figure (Dao-AILab/flash-attention,
    assets/flash2_a100_fwd_bwd_benchmark.png at 4f285b35, panel d: causal, head dim 128,
    forward and backward) gives 155 TFLOP/s at 2k tokens and 182 at 8k, on its benchmark's
    count (benchmarks/benchmark_flash_attention.py: ``4 b s^2 h d / 2`` for a causal
    forward, 3.5 times that with the backward). A causal attention of that shape, priced
    on PyTorch's count (FlopCounterMode: ``4 b h s^2 d`` forward, 2.5 times that backward),
    takes the figure's time for its forward and backward together."""
    assert _attention_s(get_device("a100-measured"), seq) == pytest.approx(
        _figure_s(seq, tflops), rel=1e-9
    )


def _figure_s(seq: int, tflops: float) -> float:
    """The seconds FlashAttention-2's benchmark figures give a causal forward and backward
    of ``seq`` tokens (16k tokens a batch, 16 heads, head dim 128) at ``tflops`` on their
    count: ``4 b s^2 h d / 2`` the forward, 3.5 times that with the backward."""
    b, h, d = 16384 // seq, 16, 128
    return 3.5 * (4 * b * seq**2 * h * d / 2) / (tflops * 1e12)


def _attention_s(device: DeviceSpec, seq: int) -> float:
    """``device``'s price of that attention on PyTorch's count (FlopCounterMode: ``4 b h
    s^2 d`` the forward, 2.5 times that the backward)."""
    b, h, d = 16384 // seq, 16, 128
    forward = 4 * b * h * seq**2 * d
    return device.compute_time(
        forward, 0, "bfloat16", kind="attention_forward", per=b * h
    ) + device.compute_time(2.5 * forward, 0, "bfloat16", kind="attention_backward", per=b * h)


H100B = "tests/data/h100b/profile.json"


def _script_profile(tmp_path, script: str, *args: str):
    """``scripts/SCRIPT ARGS --out FILE`` run from the checkout: the file and its profile,
    loaded."""
    import subprocess
    import sys

    from helpers import ROOT

    from autoshard.calibrate import load_profile

    out = tmp_path / "profile.json"
    command = [sys.executable, ROOT / "scripts" / script, *args, "--out", out]
    subprocess.run(command, check=True, cwd=ROOT)
    return out, load_profile(out).device_spec()


@pytest.mark.parametrize(
    ("base", "figure", "seq", "tflops", "kept"),
    [
        (H100B, ("h100", "fa2"), 2048, 265, "tests/data/h100b/profile_fa2.json"),
        (H100B, ("h100", "fa2"), 8192, 308, None),
        (H100B, ("h100", "fa1"), 2048, 108, "tests/data/h100b/profile_fa1.json"),
        ("a100-measured", ("a100", "fa1"), 2048, 69, "tests/data/published/profiles/a100_fa1.json"),
    ],
)
def test_an_attention_profile_times_causal_attention_as_its_figure(
    tmp_path, base, figure, seq, tflops, kept
):
    """``scripts/attention_profile.py`` (docs/validation.md, the attention kernel the H100
    runs ran; the Triton attention the MPT rows ran) writes a measured profile with a
    FlashAttention kernel's published figure for causal attention (Dao-AILab/
    flash-attention, assets/flash2_{h100,a100}_fwd_bwd_benchmark.png at 4f285b35, panel d:
    FlashAttention-2 265 TFLOP/s at 2k tokens and 308 at 8k on the H100; FlashAttention
    108 on the H100 and 69 on the A100 at 2k; on the benchmark's causal count): an
    attention of the figure's shape takes the figure's time for its forward and backward
    together, every other rate stays the base's, and the files the published rows are
    priced with are what the script writes."""
    from helpers import ROOT

    from autoshard.calibrate import load_profile

    gpu, kernel = figure
    source = ("--device", base) if base.endswith("-measured") else (base,)
    args = (*source, "--gpu", gpu, "--kernel", kernel)
    out, priced_on = _script_profile(tmp_path, "attention_profile.py", *args)
    measured = (
        DEVICES[base] if base.endswith("-measured") else load_profile(ROOT / base).device_spec()
    )
    priced = _attention_s(priced_on, seq)
    assert priced == pytest.approx(_figure_s(seq, tflops), rel=1e-9)
    if (gpu, kernel) == ("h100", "fa2"):  # the measured H100's cuDNN kernel: 1.47x, 1.72x
        assert 1.4 < priced / _attention_s(measured, seq) < 1.8
    big = 2 * 8192**3
    assert priced_on.compute_time(big, 0, "bfloat16") == measured.compute_time(big, 0, "bfloat16")
    assert priced_on.compute_time(0, 2**31, "bfloat16", kind="other") == measured.compute_time(
        0, 2**31, "bfloat16", kind="other"
    )
    if kept:
        assert json.loads((ROOT / kept).read_text()) == json.loads(out.read_text())


def test_a100_measured_s_attention_is_flash_attention_2_s_a100_figure(tmp_path):
    """The FlashAttention-2 A100 figure typed into ``scripts/attention_profile.py`` and
    a100-measured's file (typed from the same figure apart) price every op alike: the
    profile the script writes from ``--device a100-measured --kernel fa2`` holds the
    preset's matmul, attention and copy rates, peaks and memory."""
    args = ("--device", "a100-measured", "--gpu", "a100", "--kernel", "fa2")
    _, spec = _script_profile(tmp_path, "attention_profile.py", *args)
    preset = DEVICES["a100-measured"]
    for field_ in ("matmul_rates", "attention_forward_rates", "attention_backward_rates"):
        assert getattr(spec, field_) == getattr(preset, field_), field_
    assert (spec.peak_flops, spec.memory_bandwidth) == (preset.peak_flops, preset.memory_bandwidth)
    assert spec.memory_bytes == preset.memory_bytes


def test_a_datasheet_profile_prices_what_its_preset_does(tmp_path):
    """``scripts/memory_part_profile.py --device h100`` with the preset's own bandwidth and
    capacity (NVIDIA's H100 SXM datasheet: 3.35 TB/s, 80 GB) is ``--device h100``: the same
    peaks, and the same seconds for a matmul, an attention and a memory-bound op."""
    _, part = _script_profile(
        tmp_path,
        "memory_part_profile.py",
        "--device",
        "h100",
        "--peak",
        "3.35TB/s",
        "--memory",
        "80GB",
    )
    h100 = DEVICES["h100"]
    assert part.peak_flops == h100.peak_flops and part.memory_bytes == 80 * 10**9
    assert part.memory_bandwidth == h100.memory_bandwidth == 3.35e12
    for flops, moved, kind in ((2 * 8192**3, 3 * 2 * 8192**2, "matmul"), (0, 2**31, "other")):
        assert part.compute_time(flops, moved, "bfloat16", kind=kind) == h100.compute_time(
            flops, moved, "bfloat16", kind=kind
        )
    assert _attention_s(part, 8192) == _attention_s(h100, 8192)


def test_torchtitan_s_hbm2e_h100_copies_at_2_4_over_3_35_of_the_measured_h100(tmp_path):
    """torchtitan's H100s (its docs/performance.md at d4c86e3: "96GB HBM2e with 2.4 TB/sec
    peak memory bandwidth") priced from the measured H100 SXM (3.35 TB/s, NVIDIA's
    datasheet): a memory-bound op takes 3.35 / 2.4 of its time there, a large matmul and
    an attention the same time; the files tests/test_published.py prices the rows with
    (from the FlashAttention-2 profile for the 8B rows, from the measured profile itself
    for the 405B row) are what the script writes."""
    from helpers import ROOT

    from autoshard.calibrate import load_profile

    fa2 = "tests/data/h100b/profile_fa2.json"
    args = (fa2, "--measured-peak", "3.35TB/s", "--peak", "2.4TB/s", "--memory", "96GB")
    out, part = _script_profile(tmp_path, "memory_part_profile.py", *args)
    h100 = load_profile(ROOT / fa2).device_spec()
    moved = 2**31
    slow = part.compute_time(0, moved, "bfloat16", kind="other")
    assert slow == pytest.approx(h100.compute_time(0, moved, "bfloat16", kind="other") * 3.35 / 2.4)
    assert slow == pytest.approx(moved / (2.4e12 * 2939836453488.2915 / 3.35e12))  # 88% of peak
    big = 2 * 8192**3
    assert part.compute_time(big, 0, "bfloat16") == h100.compute_time(big, 0, "bfloat16")
    assert _attention_s(part, 8192) == _attention_s(h100, 8192)
    assert part.memory_bytes == 96 * 10**9
    kept = json.loads((ROOT / "tests/data/h100b/profile_fa2_hbm2e.json").read_text())
    assert kept == json.loads(out.read_text())
    # the 405B row's: the measured H100's own profile (its measured attention) on the part
    args = ("tests/data/h100b/profile.json", *args[1:])
    out, own = _script_profile(tmp_path, "memory_part_profile.py", *args)
    measured = load_profile(ROOT / "tests/data/h100b/profile.json").device_spec()
    assert own.compute_time(0, moved, "bfloat16", kind="other") == pytest.approx(slow)
    assert own.compute_time(big, 0, "bfloat16") == measured.compute_time(big, 0, "bfloat16")
    assert _attention_s(own, 8192) == _attention_s(measured, 8192) < _attention_s(part, 8192)
    kept = json.loads((ROOT / "tests/data/h100b/profile_hbm2e.json").read_text())
    assert kept == json.loads(out.read_text())
    out, sheet = _script_profile(
        tmp_path,
        "memory_part_profile.py",
        "--device",
        "h100",
        "--peak",
        "2.4TB/s",
        "--memory",
        "96GB",
    )
    kept = json.loads((ROOT / "tests/data/h100b/datasheet_hbm2e.json").read_text())
    assert kept == json.loads(out.read_text())
    assert (sheet.memory_bandwidth, sheet.peak_flops) == (2.4e12, DEVICES["h100"].peak_flops)


def test_a_softmax_over_a_long_row_reads_it_as_pytorch_s_kernel_does():
    """``softmax_rereads``, worked by hand from ``cunn_SoftMaxForward`` (PyTorch's
    ``SoftMax.cu``: a row it cannot keep in a block's 48 KiB of shared memory is read for
    its max, for its sum of exponentials, and to write the result): a vocabulary's float32
    logits (8 x 128256, 501 KiB a row) are read twice more forward; the backward reads the
    gradient once more for its sum (log-softmax) or the gradient and the output (softmax);
    a row that fits (8 x 2048 bfloat16, 4 KiB), a softmax over dim 0, and a matmul read
    nothing more."""
    from types import SimpleNamespace

    from autoshard.strategies.registry import softmax_rereads
    from autoshard.trace.tracer import TensorInfo

    aten = torch.ops.aten
    logits = TensorInfo((8, 128256), torch.float32)
    row = 8 * 128256 * 4

    def node(target, *args):
        return SimpleNamespace(target=target, args=args)

    assert softmax_rereads(node(aten._log_softmax.default, "x", -1, False), [logits]) == 2 * row
    assert softmax_rereads(node(aten._softmax.default, "x", 1, False), [logits]) == 2 * row
    assert softmax_rereads(node(aten._safe_softmax.default, "x", -1), [logits]) == 2 * row
    back = node(aten._log_softmax_backward_data.default, "g", "y", 1, torch.float32)
    assert softmax_rereads(back, [logits, logits]) == row
    back = node(aten._softmax_backward_data.default, "g", "y", -1, torch.float32)
    assert softmax_rereads(back, [logits, logits]) == 2 * row
    scores = TensorInfo((8, 2048), torch.bfloat16)
    assert softmax_rereads(node(aten._softmax.default, "x", -1, False), [scores]) == 0
    assert softmax_rereads(node(aten._softmax.default, "x", 0, False), [logits]) == 0
    assert softmax_rereads(node(aten.mm.default, "a", "b"), [logits, logits]) == 0
