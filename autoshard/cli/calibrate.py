"""``autoshard calibrate``: measure the mesh's links and the device, write a profile
(:mod:`autoshard.calibrate`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import click

from autoshard.calibrate.options import SIZE_OPTIONS, mesh_dim_names_of, with_options
from autoshard.cli.options import NonEmptyPath, check_writable
from autoshard.cost.mesh import parse_mesh_shape
from autoshard.errors import AutoshardError
from autoshard.launch.torchrun import rank_environment, torchrun_prefix
from autoshard.units import format_bandwidth, format_bytes, format_seconds


@click.command(
    "calibrate",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Anything after -- goes to torchrun, e.g. "
    "-- --nnodes 2 --rdzv-endpoint host:29500 --rdzv-id cal1.",
)
@click.option("--mesh", "mesh_text", required=True, metavar="SHAPE", help="e.g. 8, 2x4.")
@click.option("--mesh-dim-names", default=None, metavar="NAMES", help="e.g. dp,tp.")
@click.option(
    "--out",
    type=NonEmptyPath(),
    default=None,
    help="Profile to write (default: profiles/<mesh>.json).",
)
@with_options(SIZE_OPTIONS)
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TORCHRUN...]")
def calibrate_command(
    mesh_text, mesh_dim_names, out, min_bytes, max_bytes, iters, sustain, torchrun_args
):
    """Measure the links of each mesh dim and the device's speed; write a profile that
    `solve --profile FILE` (and compare, stages) use instead of the default links and device.

    Starts one process per device under torchrun (NCCL on GPUs, gloo on CPU). Each times
    all-gather, reduce-scatter, all-reduce and all-to-all on every mesh dim at sizes from
    --min-size to --max-size, fits the cost model's ring formulas (latency alpha per step,
    bandwidth per device) by least squares and reports the fit's residual; then times
    matmuls (achieved FLOP/s) and a copy (memory bandwidth). docs/calibrate.md.

    \b
    Examples:
      autoshard calibrate --mesh 2x4
      autoshard calibrate --mesh 1 --sustain 2s --iters 3   # rates a training step sustains
      autoshard solve examples/gpt2.py --mesh 2x4 --profile profiles/2x4.json
    """
    shape = parse_mesh_shape(mesh_text)
    names = mesh_dim_names_of(mesh_text, mesh_dim_names)
    if min_bytes <= 0 or max_bytes < min_bytes:
        raise AutoshardError(
            f"--min-size {min_bytes} B and --max-size {max_bytes} B: give 0 < min <= max"
        )
    path = out if out is not None else Path("profiles") / f"{'x'.join(map(str, shape))}.json"
    check_writable(path.parent)
    n_devices = 1
    for s in shape:
        n_devices *= s
    argv = torchrun_prefix(torchrun_args, n_devices)
    argv += [
        "-m",
        "autoshard.calibrate",
        "--mesh",
        mesh_text,
        "--mesh-dim-names",
        ",".join(names),
        "--out",
        str(path.resolve()),
        "--min-size",
        f"{min_bytes}B",
        "--max-size",
        f"{max_bytes}B",
        "--iters",
        str(iters),
        "--sustain",
        f"{sustain!r}s",
    ]
    env = rank_environment(os.environ, Path(__file__).resolve().parents[2], mmap=False)
    click.echo("running: " + shlex.join(argv), err=True)
    code = subprocess.run(argv, env=env, check=False).returncode
    if code:
        raise AutoshardError(
            f"the calibration ranks failed (torchrun exit {code}); rank 0's error is above"
        )
    print_profile(path)


def print_profile(path: Path) -> None:
    """The profile's fits, one line per mesh dim, then the device."""
    from autoshard.calibrate import load_profile

    p = load_profile(path)
    click.echo(f"profile {path} ({p.backend}, {p.device}):")
    for d, (name, n, fit) in enumerate(zip(p.dim_names, p.mesh_shape, p.links, strict=True)):
        if fit is None:
            click.echo(f"  mesh dim {d} ({name}, {n} device): no link")
        else:
            click.echo(
                f"  mesh dim {d} ({name}, {n} devices): latency {format_seconds(fit.latency)} "
                f"per step, bandwidth {format_bandwidth(fit.bandwidth)}, fit residual "
                f"{fit.residual:.1%}" + _worst(fit.by_kind)
            )
    flops = ", ".join(f"{k} {v / 1e9:.3g} GFLOP/s" for k, v in p.peak_flops.items())
    click.echo(
        f"  device: matmul {flops}; memory {format_bandwidth(p.memory_bandwidth)}, "
        f"{format_bytes(p.memory_bytes)}"
    )
    for line in rate_lines(json.loads(path.read_text())):
        click.echo("  " + line)


def preset_of(device_name: str):
    """The preset :class:`~autoshard.cost.devices.DeviceSpec` whose name is in the measured
    device's name (``"NVIDIA H100 80GB HBM3"`` -> ``h100``), else ``None`` (also for the
    PCIe and NVL parts, which have lower peaks than the SXM presets)."""
    from autoshard.cost.devices import DEVICES

    words = device_name.lower().replace("-", " ").split()
    if "pcie" in words or "nvl" in words:
        return None  # the presets are the SXM parts
    for key, spec in DEVICES.items():
        if key in words:
            return spec
    return None


def _tflops(rate: float) -> str:
    return f"{rate / 1e12:.4g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.4g} GFLOP/s"


def rate_lines(raw: dict) -> list[str]:
    """Each timed matmul and attention of a profile's JSON, as achieved rate and, where the
    device has a preset, the fraction of the preset's datasheet peak it reached."""
    preset = preset_of(str(raw.get("device", "")))
    compute = raw["compute"]

    def of_peak(rate: float, dtype: str) -> str:
        return f" ({rate / preset.peak(dtype):.0%} of {preset.name})" if preset else ""

    sustain = compute.get("sustain_s", 0.0)
    if sustain > 0:
        regime = (
            f"matmuls and attention timed over {format_seconds(sustain)} of back-to-back "
            "calls after as long a warm-up: the rates a training step sustains"
        )
    else:
        regime = (
            "matmuls and attention timed in samples of about 2 ms: the boost-clock burst, "
            "faster than a training step sustains (--sustain 2s times that)"
        )
    lines = [regime]
    for m in compute.get("matmuls", []):
        rate = m["flops_per_s"]
        lines.append(
            f"matmul {m['dtype']} {m['m']}x{m['n']}x{m['k']}: {_tflops(rate)}"
            + of_peak(rate, m["dtype"])
        )
    for a in compute.get("attention", []):
        shape = f"{a['batch']}x{a['heads']}x{a['seq']}x{a['head_dim']}"
        f, fb = a["flops_per_s_forward"], a["flops_per_s_forward_backward"]
        lines.append(
            f"attention {a['dtype']} causal {shape}: forward {_tflops(f)}, forward+backward "
            f"{_tflops(fb)} (PyTorch's count: the whole score matrix, which a causal kernel "
            "half skips)"
        )
    if "elementwise_bandwidth_Bps" in compute:
        bw = compute["elementwise_bandwidth_Bps"]
        ratio = f" ({bw / preset.memory_bandwidth:.0%} of {preset.name})" if preset else ""
        copy = compute["memory_bandwidth_Bps"]
        copy_ratio = f" ({copy / preset.memory_bandwidth:.0%})" if preset else ""
        lines.append(
            f"memory: copy {format_bandwidth(copy)}{copy_ratio}, bfloat16 add "
            f"{format_bandwidth(bw)}{ratio}"
        )
    return lines


def _worst(by_kind: dict[str, float]) -> str:
    if not by_kind:
        return ""
    kind = max(by_kind, key=by_kind.__getitem__)
    return f" (worst: {kind.replace('_', '-')}, {by_kind[kind]:.1%})"
