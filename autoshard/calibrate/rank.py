"""One rank of ``autoshard calibrate`` (``torchrun ... -m autoshard.calibrate ...``).

Every rank times the same collectives on its groups of each mesh dim (all groups of a dim
run at once, as in a training step), then matmuls of several sizes per dtype, causal
attention, a copy and an elementwise add; the times are the median over ``iters`` runs on
each rank, then the largest over the ranks (the slowest group sets the pace). Rank 0 fits
and writes the profile (:mod:`autoshard.calibrate`). NCCL and ``cuda:LOCAL_RANK`` when
CUDA is available, gloo on CPU otherwise.
"""

from __future__ import annotations

import datetime
import json
import math
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


BURST_WINDOW_S = 2e-3
"""A timed sample's length (s) without ``--sustain``: long enough that the launch and
synchronisation overhead does not count, short enough that the GPU keeps its boost clock."""


def _timed_per_call(
    fn: Callable[[], object],
    sync: Callable[[], None],
    iters: int,
    device: torch.device,
    sustain: float = 0.0,
) -> float:
    """Seconds of one call of ``fn`` when calls run back to back, as a training step's
    kernels do: each timed sample runs ``fn`` ``reps`` times between two synchronisations,
    so the launch and synchronisation overhead of one sample, tens of microseconds on a
    GPU, is not charged to a kernel of a few microseconds. ``reps`` makes a sample last
    about :data:`BURST_WINDOW_S` (at most 200 calls: a burst, at the boost clock), or, with
    ``sustain`` seconds, at least that long, after one such sample untimed: a GPU running
    matmuls back to back reaches its power limit and lowers its clock, which a burst does
    not see (``autoshard calibrate --sustain``; docs/calibrate.md). ``reps`` comes from the
    slowest rank's median of three single calls, so every rank runs the same number. The
    median sample over ``iters``, divided by ``reps``, on this rank (the caller takes the
    slowest)."""
    one = max(_slowest(_timed(fn, sync, 3, 1, dist.barrier), device), 1e-9)
    if sustain > 0:
        reps = max(1, math.ceil(sustain / one))
    else:
        reps = max(1, min(200, int(BURST_WINDOW_S / one)))

    def repeated() -> None:
        for _ in range(reps):
            fn()

    return _timed(repeated, sync, iters, 1 if sustain > 0 else 0, dist.barrier) / reps


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
    if kind == "send_recv":  # one step of a ring: the 1/n share to the next rank
        back = torch.empty(numel // n, device=device)
        me, ranks = dist.get_rank(group), dist.get_process_group_ranks(group)
        ops = [
            dist.P2POp(dist.isend, piece, ranks[(me + 1) % n], group),
            dist.P2POp(dist.irecv, back, ranks[(me - 1) % n], group),
        ]
        return lambda: [w.wait() for w in dist.batch_isend_irecv(ops)]
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


# (m, n, k) of the matmuls timed on a GPU, the same for each dtype: squares from 512 to 16384
# (the rate of a GEMM by its size) and the GEMMs of a Llama-7B-shaped model on 8192 tokens
# (q/k/v/o, MLP up, MLP down, and its LM head).
_GPU_SIZES = [(s, s, s) for s in (512, 1024, 2048, 4096, 8192, 16384)] + [
    (8192, 4096, 4096),
    (8192, 11008, 4096),
    (8192, 4096, 11008),
    (8192, 32000, 4096),
]
GPU_MATMULS = {"bfloat16": _GPU_SIZES, "float16": _GPU_SIZES, "float32": _GPU_SIZES}
CPU_MATMULS = {"float32": [(256, 256, 256), (512, 512, 512)]}
# (batch, heads, seq, head_dim) of the causal attentions timed (bfloat16 on a GPU).
GPU_ATTENTION = [(8, 32, 1024, 128), (4, 32, 2048, 128), (2, 32, 4096, 128), (1, 32, 8192, 128)]
CPU_ATTENTION = [(1, 4, 256, 64)]
# bfloat16 runs FlashAttention; float32 cannot, and runs the memory-efficient kernel,
# several times slower (docs/validation.md): each dtype is priced by its own rates
GPU_ATTENTION_DTYPES = (torch.bfloat16, torch.float32)


def measure_matmuls(
    device: torch.device,
    shapes: dict[str, list[tuple[int, int, int]]],
    iters: int,
    sync: Callable[[], None],
    sustain: float = 0.0,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Each ``(m, n, k)`` matmul of ``shapes[dtype]``: ``{"dtype", "m", "n", "k", "seconds",
    "flops_per_s"}`` with ``flops_per_s = 2 m n k / seconds``; and the best rate per dtype."""
    matmuls, peak = [], {}
    # float32 matmuls run as TF32 on tensor cores, as large-model training sets them
    # (``torch.backends.cuda.matmul.allow_tf32``) and as the presets' float32 peak assumes
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for name, dims in shapes.items():
            _time_matmuls(device, name, dims, iters, sync, matmuls, peak, sustain)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return matmuls, peak


def _time_matmuls(
    device: torch.device,
    name: str,
    dims: list[tuple[int, int, int]],
    iters: int,
    sync: Callable[[], None],
    matmuls: list[dict[str, Any]],
    peak: dict[str, float],
    sustain: float = 0.0,
) -> None:
    dtype = getattr(torch, name)
    for m, n, k in dims:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n, device=device).to(dtype)
        t = _slowest(_timed_per_call(lambda a=a, b=b: a @ b, sync, iters, device, sustain), device)
        rate = 2.0 * m * n * k / t
        matmuls.append({"dtype": name, "m": m, "n": n, "k": k, "seconds": t, "flops_per_s": rate})
        peak[name] = max(peak.get(name, 0.0), rate)
        del a, b


def measure_attention(
    device: torch.device,
    dtype: torch.dtype,
    shapes: list[tuple[int, int, int, int]],
    iters: int,
    sync: Callable[[], None],
    sustain: float = 0.0,
) -> list[dict[str, Any]]:
    """Causal ``scaled_dot_product_attention`` (the kernel PyTorch picks: FlashAttention on
    recent GPUs) on ``(batch, heads, seq, head_dim)`` q, k, v: forward alone, and forward plus
    backward. ``flops_forward`` and ``flops_forward_backward`` are PyTorch's own counts
    (``torch.utils.flop_counter.sdpa_flop_count`` and ``sdpa_backward_flop_count``, which
    :class:`~torch.utils.flop_counter.FlopCounterMode` uses for every SDPA kernel, and the
    cost model's count: the whole ``seq x seq`` score matrix, causal or not). A causal
    kernel skips half that matrix, so ``flops / seconds`` can exceed the datasheet peak. A
    profile prices the attention kernel's forward and backward at these rates
    (:func:`autoshard.cost.devices.attention_rates`)."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    out = []
    for b, h, s, d in shapes:
        q, k, v = (
            torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(b, h, s, d, device=device, dtype=dtype)

        def forward(q=q, k=k, v=v):
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=True)

        def forward_backward(q=q, k=k, v=v, grad=grad):
            return torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), grad)

        shape = (b, h, s, d)
        flops_f = sdpa_flop_count(shape, shape, shape)
        counts = (flops_f, flops_f + sdpa_backward_flop_count(shape, shape, shape, shape))
        t_f = _slowest(_timed_per_call(forward, sync, iters, device, sustain), device)
        t_fb = _slowest(_timed_per_call(forward_backward, sync, iters, device, sustain), device)
        out.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "batch": b,
                "heads": h,
                "seq": s,
                "head_dim": d,
                "causal": True,
                "seconds_forward": t_f,
                "seconds_forward_backward": t_fb,
                "flops_forward": counts[0],
                "flops_forward_backward": counts[1],
                "flops_per_s_forward": counts[0] / t_f,
                "flops_per_s_forward_backward": counts[1] / t_fb,
            }
        )
        del q, k, v, grad
    return out


def measure_compute(
    device: torch.device,
    matmul_shapes: dict[str, list[tuple[int, int, int]]],
    attention_shapes: list[tuple[int, int, int, int]],
    attention_dtypes: tuple[torch.dtype, ...],
    copy_bytes: int,
    iters: int,
    sync: Callable[[], None],
    sustain: float = 0.0,
) -> dict[str, Any]:
    """Achieved matmul FLOP/s per dtype (the best over ``matmul_shapes``), every timed
    matmul and attention, and the memory bandwidth of a copy (``2 copy_bytes / t``: read
    plus write) and of an elementwise add of two bfloat16 tensors of ``copy_bytes`` each
    (``3 copy_bytes / t``: two reads, one write). ``sustain`` > 0 times the matmuls and
    the attention in samples of at least that many seconds (:func:`_timed_per_call`), the
    copies as bursts (memory-bound: far from the power limit); ``sustain_s`` records it."""
    matmuls, peak = measure_matmuls(device, matmul_shapes, iters, sync, sustain)
    attention = [
        a
        for dtype in attention_dtypes
        for a in measure_attention(device, dtype, attention_shapes, iters, sync, sustain)
    ]
    x = torch.ones(copy_bytes // 4, device=device)
    y = torch.empty_like(x)
    t = _slowest(_timed_per_call(lambda x=x, y=y: y.copy_(x), sync, iters, device), device)
    del x, y
    a = torch.ones(copy_bytes // 2, device=device, dtype=torch.bfloat16)
    b = torch.ones_like(a)
    c = torch.empty_like(a)
    t_add = _slowest(
        _timed_per_call(lambda a=a, b=b, c=c: torch.add(a, b, out=c), sync, iters, device),
        device,
    )
    del a, b, c
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local)
    return {
        "peak_flops": peak,
        "matmuls": matmuls,
        "attention": attention,
        "memory_bandwidth_Bps": 2.0 * copy_bytes / t,
        "elementwise_bandwidth_Bps": 3.0 * copy_bytes / t_add,
        "copy_bytes": copy_bytes,
        "memory_bytes": int(memory),
        "sustain_s": sustain,
    }


def run_rank(
    mesh_shape: tuple[int, ...],
    dim_names: tuple[str, ...] | None,
    out: Path,
    min_bytes: int,
    max_bytes: int,
    iters: int,
    sustain: float = 0.0,
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
                GPU_MATMULS,
                GPU_ATTENTION,
                GPU_ATTENTION_DTYPES,
                1 << 30,
                iters,
                sync,
                sustain,
            )
        else:
            compute = measure_compute(
                device, CPU_MATMULS, CPU_ATTENTION, (torch.float32,), 64 << 20, iters, sync, sustain
            )
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
def rank_command(mesh_text, mesh_dim_names, out, min_bytes, max_bytes, iters, sustain) -> None:
    """One rank of a calibration; run it as torchrun ... -m autoshard.calibrate ...
    (`autoshard calibrate` does)."""
    if "RANK" not in os.environ:
        raise click.ClickException(
            "autoshard.calibrate runs on each rank under torchrun; use `autoshard calibrate "
            f"--mesh {mesh_text}`"
        )
    shape = parse_mesh_shape(mesh_text)
    try:
        names = mesh_dim_names_of(mesh_text, mesh_dim_names)
        run_rank(shape, names, out, min_bytes, max_bytes, iters, sustain)
    except AutoshardError as exc:  # e.g. no bandwidth fitted: say it once, in one line
        if os.environ.get("RANK", "0") == "0":
            click.echo(f"error: {exc}", err=True)
        sys.exit(2)
