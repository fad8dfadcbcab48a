"""One rank of ``autoshard calibrate`` (``torchrun ... -m autoshard.calibrate ...``).

Every rank times the same collectives on its groups of each mesh dim (all groups of a dim
run at once, as in a training step), then a few matmuls and a copy; the times are the
median over ``iters`` runs on each rank, then the largest over the ranks (the slowest
group sets the pace). Rank 0 fits and writes the profile (:mod:`autoshard.calibrate`).
NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, gloo on CPU otherwise.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.calibrate import PROFILE_FORMAT, fit_link
from autoshard.calibrate.options import SIZE_OPTIONS, mesh_dim_names_of, with_options
from autoshard.cost.collective_table import COLLECTIVE_KINDS
from autoshard.cost.mesh import parse_mesh_shape
from autoshard.errors import AutoshardError
from autoshard.plan.atomic import atomic_write_text


def sizes_between(min_bytes: int, max_bytes: int, n: int) -> list[int]:
    """Powers of 4 from ``min_bytes`` to ``max_bytes`` (both kept), each rounded down to a
    multiple of ``4 n^2`` bytes (float32 elements that ``n`` devices split ``n`` ways)."""
    unit = 4 * n * n
    out, b = [], min_bytes
    while b < max_bytes:
        out.append(b)
        b *= 4
    out.append(max_bytes)
    return sorted({max(unit, s // unit * unit) for s in out})


def _timed(
    fn: Callable[[], object],
    sync: Callable[[], None],
    iters: int,
    warmup: int,
    barrier: Callable[[], None],
) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _collective(kind: str, nbytes: int, n: int, group, device: torch.device) -> Callable:
    numel = nbytes // 4
    full = torch.ones(numel, device=device)
    piece = torch.ones(numel // n, device=device)
    if kind == "all_gather":
        return lambda: dist.all_gather_single(full, piece, group=group)
    if kind == "reduce_scatter":
        return lambda: dist.reduce_scatter_single(piece, full, group=group)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    out = torch.empty(numel // n, device=device)
    local = torch.ones(numel // n, device=device)
    return lambda: dist.all_to_all_single(out, local, group=group)


def measure_links(
    mesh: DeviceMesh,
    sizes: tuple[int, int],
    iters: int,
    device: torch.device,
    sync: Callable[[], None],
) -> list[dict[str, Any]]:
    """Per mesh dim: ``{"dim", "name", "size", "samples": [{"kind", "bytes", "seconds"}]}``.

    ``bytes`` is the tensor's size in full (before the split over the dim), as the cost
    model counts it."""
    out = []
    for d, n in enumerate(mesh.shape):
        name = mesh.mesh_dim_names[d] if mesh.mesh_dim_names else f"d{d}"
        entry: dict[str, Any] = {"dim": d, "name": name, "size": n, "samples": []}
        if n > 1:
            group = mesh.get_group(d)
            for kind in COLLECTIVE_KINDS:
                for nbytes in sizes_between(sizes[0], sizes[1], n):
                    fn = _collective(kind, nbytes, n, group, device)
                    t = _timed(fn, sync, iters, 2, lambda g=group: dist.barrier(group=g))
                    entry["samples"].append(
                        {"kind": kind, "bytes": nbytes, "seconds": _slowest(t, device)}
                    )
        out.append(entry)
    return out


def measure_compute(
    device: torch.device,
    dtypes: list[torch.dtype],
    sides: list[int],
    copy_bytes: int,
    iters: int,
    sync: Callable[[], None],
) -> dict[str, Any]:
    """Achieved matmul FLOP/s per dtype (best over square sides) and copy bandwidth."""
    matmuls, peak = [], {}
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for side in sides:
            a = torch.randn(side, side, device=device).to(dtype)
            b = torch.randn(side, side, device=device).to(dtype)
            t = _slowest(_timed(lambda a=a, b=b: a @ b, sync, iters, 1, dist.barrier), device)
            rate = 2.0 * side**3 / t
            matmuls.append(
                {"dtype": name, "m": side, "n": side, "k": side, "seconds": t, "flops_per_s": rate}
            )
            peak[name] = max(peak.get(name, 0.0), rate)
    x = torch.ones(copy_bytes // 4, device=device)
    y = torch.empty_like(x)
    t = _slowest(_timed(lambda: y.copy_(x), sync, iters, 1, dist.barrier), device)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)
    return {
        "peak_flops": peak,
        "matmuls": matmuls,
        "memory_bandwidth_Bps": 2.0 * copy_bytes / t,
        "copy_bytes": copy_bytes,
        "memory_bytes": int(memory),
    }


def run_rank(
    mesh_shape: tuple[int, ...],
    dim_names: tuple[str, ...] | None,
    out: Path,
    min_bytes: int,
    max_bytes: int,
    iters: int,
) -> None:
    """Measure on this rank; rank 0 fits and writes ``out``. Call under torchrun."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend)
    try:
        mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=dim_names)

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        links = measure_links(mesh, (min_bytes, max_bytes), iters, device, sync)
        if cuda:
            compute = measure_compute(
                device,
                [torch.float32, torch.bfloat16, torch.float16],
                [4096, 8192],
                1 << 30,
                iters,
                sync,
            )
        else:
            compute = measure_compute(device, [torch.float32], [256, 512], 64 << 20, iters, sync)
        error = None
        if dist.get_rank() == 0:
            try:
                for link in links:
                    if link["size"] > 1:
                        fit = fit_link(link["samples"], link["size"])
                        link.update(
                            latency_s=fit.latency,
                            bandwidth_Bps=fit.bandwidth,
                            residual=fit.residual,
                            residual_by_kind=fit.by_kind,
                        )
                    else:
                        link.update(latency_s=None, bandwidth_Bps=None, residual=None)
                profile = {
                    "format": PROFILE_FORMAT,
                    "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "backend": backend,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu",
                    "world_size": dist.get_world_size(),
                    "mesh": {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names)},
                    "links": links,
                    "compute": compute,
                }
                atomic_write_text(out, json.dumps(profile, indent=1) + "\n")
            except AutoshardError as exc:  # raised after the barrier: no rank is left waiting
                error = exc
        dist.barrier()
        if error is not None:
            raise error
    finally:
        dist.destroy_process_group()


@click.command("autoshard.calibrate", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--mesh", "mesh_text", required=True)
@click.option("--mesh-dim-names", required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@with_options(SIZE_OPTIONS)
def rank_command(mesh_text, mesh_dim_names, out, min_bytes, max_bytes, iters) -> None:
    """One rank of a calibration; run it as torchrun ... -m autoshard.calibrate ...
    (`autoshard calibrate` does)."""
    if "RANK" not in os.environ:
        raise click.ClickException(
            "autoshard.calibrate runs on each rank under torchrun; use `autoshard calibrate "
            f"--mesh {mesh_text}`"
        )
    shape = parse_mesh_shape(mesh_text)
    try:
        run_rank(
            shape, mesh_dim_names_of(mesh_text, mesh_dim_names), out, min_bytes, max_bytes, iters
        )
    except AutoshardError as exc:  # e.g. no bandwidth fitted: say it once, in one line
        if os.environ.get("RANK", "0") == "0":
            click.echo(f"error: {exc}", err=True)
        sys.exit(2)
