"""Device specs for the compute part of the cost model: peak FLOP/s, memory bandwidth, memory.

Compute time of one op on one device is the roofline model (Williams, Waterman and Patterson,
"Roofline: an insightful visual performance model for multicore architectures", CACM 52(4),
2009): the op is bound either by arithmetic or by memory traffic, whichever takes longer,

    t = max(flops / peak_flops[dtype], bytes_moved / memory_bandwidth).

A calibrated device (``autoshard calibrate``'s profile) replaces the peak of a matmul or
convolution by the rate measured for a matmul of its size (:meth:`DeviceSpec.matmul_rate`),
and that of a causal attention by the rate measured for attention of its sequence length
(:meth:`DeviceSpec.rate`).

Every number of the presets ``h100``, ``h200``, ``a100``, ``l40s`` and ``mi300x`` in
:data:`DEVICES` is a vendor datasheet's peak for dense math (no structured sparsity:
datasheets print the sparse figure, twice the dense one, with an asterisk). The presets
``h100-measured`` and ``h200-measured`` (:func:`measured_device`) keep those peaks for the
MFU, and price matmuls, attention and memory-bound ops at the rates one such GPU reached
under ``autoshard calibrate --mesh 1`` (``autoshard/cost/measured``): a datasheet's peak
is not what a GPU achieves (docs/validation.md). ``a100-measured`` does the same with the
rates published benchmarks of an A100 SXM4 80GB reached (its file's ``source`` names
them: the bfloat16 GEMM rate an A100 sustains at its power limit, FlashAttention-2's
causal attention and the HBM copy; no GEMM size curve).

Which peak stands for float32: matmul-heavy fp32 training runs its matmuls on the tensor cores
as TF32 (PyTorch's ``torch.backends.cuda.matmul.allow_tf32`` / ``set_float32_matmul_precision
("high")``, the setting large-model training uses), so the ``float32`` entry is the dense
TF32 tensor-core peak, not the non-tensor FP32 (CUDA-core) peak. The latter is given in a
comment beside each entry. A dtype missing from a device's table falls back to the float32 one.

Memory sizes are the datasheet's decimal gigabytes (80 GB = 80e9 bytes). The usable memory the
driver reports is a little larger (an "80GB" H100 shows about 79.6 GiB = 85.5e9 bytes), so the
decimal figure is a slightly conservative budget.

Tables are keyed by dtype *name* (``"bfloat16"``, as ``str(torch.bfloat16)`` without its
``torch.`` prefix), and every method takes a ``torch.dtype`` or its name, so that this module
does not import torch (the command line reads :data:`DEVICES` before anything heavy loads).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError

__all__ = [
    "DEFAULT_DEVICE",
    "DEVICES",
    "DeviceSpec",
    "get_device",
    "measured_device",
    "measured_rates",
]

TERA = 1e12

# The floating-point dtypes of torch 2.13 a peak table may name (test_devices checks each is a
# torch dtype).
DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)


@functools.lru_cache(maxsize=64)
def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` or ``"torch.bfloat16"`` -> ``"bfloat16"``.

    Raises:
        AutoshardError: neither a torch dtype nor the name of one in :data:`DTYPE_NAMES`.
    """
    is_dtype = type(dtype).__name__ == "dtype" and type(dtype).__module__ == "torch"
    name = str(dtype).removeprefix("torch.") if is_dtype or isinstance(dtype, str) else None
    if name not in DTYPE_NAMES:
        raise AutoshardError(
            f"unknown dtype {dtype!r}: write a torch floating dtype or its name, one of "
            f"{', '.join(DTYPE_NAMES)}"
        )
    return name


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model, as the cost model sees it.

    Attributes:
        name: short lower-case name, the key in :data:`DEVICES` (e.g. ``"h100"``).
        peak_flops: dense peak per dtype, FLOP/s, keyed by dtype name (torch dtypes given
            to the constructor become their names). Must hold ``float32``, which is the
            fallback for any dtype not listed.
        memory_bandwidth: peak device-memory (HBM/GDDR) bandwidth, bytes/s.
        memory_bytes: device memory, bytes.
        matmul_rates: measured matmul rates by size, keyed by dtype name: each a tuple of
            ``(flops, flops_per_s)`` points, ``flops`` the FLOPs of one timed matmul
            (``2 m n k``) and ``flops_per_s`` the rate it reached (``autoshard calibrate``
            writes them). Empty (the presets) means every matmul runs at :attr:`peak_flops`.
            See :meth:`matmul_rate`.
        attention_forward_rates, attention_backward_rates: the same for causal attention
            with no mask (FlashAttention's forward, and its backward alone), ``flops`` as
            PyTorch counts them (the whole score matrix, causal or not) per batch x head,
            so that a point is the efficiency of one sequence length. A dtype with no
            points prices attention by :meth:`matmul_rate`.

    Raises:
        AutoshardError: from ``__post_init__`` when a number is missing, zero, negative or not
            finite; the message names the device and the number.
    """

    name: str
    peak_flops: dict[str, float] = field(hash=False)
    memory_bandwidth: float
    memory_bytes: int
    matmul_rates: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict, hash=False
    )
    attention_forward_rates: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict, hash=False
    )
    attention_backward_rates: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict, hash=False
    )

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AutoshardError(f"device name must be a non-empty string, got {self.name!r}")
        flops: dict[str, float] = {}  # a private copy: the spec must not change under us
        for dtype, peak in dict(self.peak_flops).items():
            try:
                name = dtype_name(dtype)
            except AutoshardError:
                raise AutoshardError(
                    f"device {self.name}: peak_flops keys must be torch dtypes or their names "
                    f"({', '.join(DTYPE_NAMES)}), got {dtype!r}"
                ) from None
            if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
                raise AutoshardError(
                    f"device {self.name}: peak_flops[torch.{name}]({peak!r}) must be a positive "
                    "finite FLOP/s"
                )
            flops[name] = peak
        object.__setattr__(self, "peak_flops", flops)
        if "float32" not in flops:
            raise AutoshardError(
                f"device {self.name}: peak_flops has {sorted(flops)} but needs "
                "torch.float32, the fallback for other dtypes"
            )
        bw = self.memory_bandwidth
        if not (isinstance(bw, (int, float)) and math.isfinite(bw) and bw > 0):
            raise AutoshardError(
                f"device {self.name}: memory_bandwidth({bw!r}) must be a positive finite bytes/s"
            )
        mem = self.memory_bytes
        if not (isinstance(mem, int) and not isinstance(mem, bool) and mem > 0):
            raise AutoshardError(
                f"device {self.name}: memory_bytes({mem!r}) must be a positive whole number"
            )
        self._check_rates()

    def _check_rates(self) -> None:
        for kind in RATE_KINDS.values():
            rates: dict[str, tuple[tuple[float, float], ...]] = {}
            for dtype, points in dict(getattr(self, kind)).items():
                name = dtype_name(dtype)
                pts = sorted((float(f), float(r)) for f, r in points)
                if not pts or any(
                    not (math.isfinite(f) and math.isfinite(r) and f > 0 and r > 0) for f, r in pts
                ):
                    raise AutoshardError(
                        f"device {self.name}: {kind}[torch.{name}] needs (flops, flops_per_s) "
                        f"points, both positive and finite, got {points!r}"
                    )
                if len({f for f, _ in pts}) != len(pts):
                    raise AutoshardError(
                        f"device {self.name}: {kind}[torch.{name}] gives two rates for one "
                        "size; average them first"
                    )
                rates[name] = tuple(pts)
            object.__setattr__(self, kind, rates)

    def rate(
        self, flops: float, dtype: Any, kind: str = "matmul", total: float | None = None
    ) -> float:
        """FLOP/s of one op of ``kind`` (``"matmul"``, ``"attention_forward"``,
        ``"attention_backward"``): at ``flops`` on the measured points of that kind
        (:func:`_interpolate`; attention's points are per batch x head), else
        :meth:`matmul_rate` of its ``total`` FLOPs (``flops`` unless given), else the peak.

        Raises:
            AutoshardError: an unknown ``kind``.
        """
        if kind not in RATE_KINDS:
            raise AutoshardError(f"unknown op kind {kind!r}: one of {', '.join(RATE_KINDS)}")
        if kind != "matmul":
            points = getattr(self, RATE_KINDS[kind]).get(_name(dtype))
            if points:
                return _interpolate(points, flops)
        return self.matmul_rate(flops if total is None else total, dtype)

    def matmul_rate(self, flops: float, dtype: Any) -> float:
        """FLOP/s of one matmul-like op of ``flops`` FLOPs in ``dtype``.

        Without measured points for ``dtype``: :meth:`peak`. With them: between two measured
        sizes, the power law through them (``log rate`` linear in ``log flops``), so that
        the time grows with the size wherever the measured times do; outside them, the
        nearest measured rate. Small matmuls are slower per FLOP: a GEMM's tiles do not fill
        the GPU, and below some size the host's per-call dispatch, not the GPU, sets the
        time (on the H100 and H200 measured in tests/data, about 14 us per call for every
        bfloat16 matmul up to 1024^3).
        """
        points = self.matmul_rates.get(_name(dtype))
        return _interpolate(points, flops) if points else self.peak(dtype)

    def peak(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype`` (a torch dtype or its name); the float32 peak when
        ``dtype`` is not listed (integer dtypes included)."""
        flops = self.peak_flops
        return flops.get(_name(dtype), flops["float32"])

    def compute_time(
        self,
        flops: float,
        bytes_moved: float,
        dtype: Any,
        kind: str = "matmul",
        per: float = 1.0,
    ) -> float:
        """Roofline time of one op on one device, in seconds.

        ``max(flops / rate, bytes_moved / memory_bandwidth)`` (Williams et al., CACM
        2009). For a matmul-like op (one whose FLOPs FlopCounterMode counts: ``kind``
        ``"matmul"`` for a matmul or convolution, ``"attention_forward"`` or
        ``"attention_backward"`` for the attention kernel) ``rate`` is :meth:`rate` at its
        size, the dtype's peak unless measured rates are given; any other op's FLOPs
        (``kind="other"``: one per element, an approximation) run at the peak, as its bytes
        set its time. Both counts are for the local shard on one device.

        Args:
            flops: floating-point operations (a multiply-add counts 2), >= 0.
            bytes_moved: bytes read plus written in device memory, >= 0.
            dtype: the op's compute dtype; one missing from :attr:`peak_flops` uses float32's.
            kind: ``"matmul"``, ``"attention_forward"``, ``"attention_backward"`` or
                ``"other"``.
            per: the attention's batch x heads: its rate is looked up at ``flops / per``,
                the FLOPs of one head of one sequence (attention rates are kept per head).

        Raises:
            AutoshardError: a negative or non-finite count.
        """
        if not (flops >= 0 and bytes_moved >= 0) or math.isinf(flops) or math.isinf(bytes_moved):
            raise AutoshardError(
                f"compute_time needs finite, non-negative counts, got flops({flops!r}) and "
                f"bytes_moved({bytes_moved!r})"
            )
        if flops == 0:
            return bytes_moved / self.memory_bandwidth
        if kind == "other":
            rate = self.peak(dtype)
        elif kind == "matmul":
            rate = self.matmul_rate(flops, dtype)
        else:
            rate = self.rate(flops / per, dtype, kind, total=flops)
        return max(flops / rate, bytes_moved / self.memory_bandwidth)

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins for the solution file: dtypes by name (``"bfloat16"``), SI units."""
        return {
            "name": self.name,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_Bps": self.memory_bandwidth,
            "memory_bytes": self.memory_bytes,
            **{
                kind: {k: [list(p) for p in v] for k, v in getattr(self, kind).items()}
                for kind in RATE_KINDS.values()
                if getattr(self, kind)
            },
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            AutoshardError: a missing key or an unknown dtype name.
        """
        try:
            name = data["name"]
            raw = data["peak_flops"]
            bandwidth = data["memory_bandwidth_Bps"]
            memory = data["memory_bytes"]
        except (KeyError, TypeError) as e:
            raise AutoshardError(
                f"device description {data!r} lacks {e}: it needs name, peak_flops, "
                "memory_bandwidth_Bps and memory_bytes"
            ) from None
        flops: dict[str, float] = {}
        for dname, peak in dict(raw).items():
            if str(dname) not in DTYPE_NAMES:
                raise AutoshardError(
                    f"device {name}: unknown dtype {dname!r} in peak_flops; write a torch dtype "
                    "name such as bfloat16"
                )
            flops[str(dname)] = peak
        rates = {}
        for kind in RATE_KINDS.values():
            try:
                rates[kind] = {
                    str(k): tuple((float(f), float(r)) for f, r in v)
                    for k, v in dict(data.get(kind) or {}).items()
                }
            except (TypeError, ValueError):
                raise AutoshardError(
                    f"device {name}: {kind} must map dtype names to [flops, flops_per_s] "
                    f"pairs, got {data.get(kind)!r}"
                ) from None
        return cls(name, flops, bandwidth, memory, **rates)


RATE_KINDS = {
    "matmul": "matmul_rates",
    "attention_forward": "attention_forward_rates",
    "attention_backward": "attention_backward_rates",
}
"""An op kind of :meth:`DeviceSpec.compute_time` -> the field of its measured rates."""


def _interpolate(points: tuple[tuple[float, float], ...], flops: float) -> float:
    """The rate at ``flops`` on measured ``(flops, flops_per_s)`` points (sorted): the power
    law through the two nearest points between them (``log rate`` linear in ``log flops``),
    the nearest point's rate outside them."""
    if flops <= points[0][0]:
        return points[0][1]
    if flops >= points[-1][0]:
        return points[-1][1]
    x = math.log(flops)
    for (f0, r0), (f1, r1) in zip(points, points[1:], strict=False):
        if flops <= f1:
            w = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
    raise AssertionError("unreachable: flops is inside the measured range")


def matmul_rates(matmuls: list[dict]) -> dict[str, tuple[tuple[float, float], ...]]:
    """The timed matmuls of a profile as :class:`DeviceSpec`'s ``matmul_rates``: per dtype,
    ``(2 m n k, 2 m n k / seconds)`` by size; shapes of equal FLOPs (``8192x4096x11008`` and
    ``8192x11008x4096``) give the mean of their rates."""
    by_size: dict[str, dict[float, list[float]]] = {}
    for m in matmuls:
        flops = 2.0 * m["m"] * m["n"] * m["k"]
        by_size.setdefault(m["dtype"], {}).setdefault(flops, []).append(flops / m["seconds"])
    return _mean_curves(by_size)


def _mean_curves(
    by: dict[str, dict[float, list[float]]],
) -> dict[str, tuple[tuple[float, float], ...]]:
    """Per dtype, ``(key, mean rate)`` points sorted by key, from the rates timed per key."""
    return {
        dtype: tuple((f, sum(rs) / len(rs)) for f, rs in sorted(sizes.items()))
        for dtype, sizes in by.items()
    }


def attention_rates(
    attention: list[dict],
) -> dict[str, dict[str, tuple[tuple[float, float], ...]]]:
    """A profile's timed causal attentions as :class:`DeviceSpec`'s
    ``attention_forward_rates`` and ``attention_backward_rates``: per dtype,
    ``(flops / (batch x heads), flops / seconds)`` of the forward, and of the backward alone
    (the forward-plus-backward run less the forward: its FLOPs and its seconds). Keyed per
    batch x head, a point stands for one sequence length. Points of equal key give the mean
    of their rates; a backward that timed no slower than its forward (noise) gives none."""
    forward: dict[str, dict[float, list[float]]] = {}
    backward: dict[str, dict[float, list[float]]] = {}
    for a in attention:
        if not a.get("causal", True):
            continue  # the model prices causal, unmasked attention by these
        per = float(a.get("batch", 1) * a.get("heads", 1))
        f, t = float(a["flops_forward"]), float(a["seconds_forward"])
        forward.setdefault(a["dtype"], {}).setdefault(f / per, []).append(f / t)
        fb = float(a["flops_forward_backward"]) - f
        tb = float(a["seconds_forward_backward"]) - t
        if tb > 0:
            backward.setdefault(a["dtype"], {}).setdefault(fb / per, []).append(fb / tb)

    return {
        "attention_forward_rates": _mean_curves(forward),
        "attention_backward_rates": _mean_curves(backward),
    }


def _table(bf16_fp16: float, tf32: float, fp8: float | None = None) -> dict[str, float]:
    """Peak table from dense tensor-core TFLOPS: bf16 = fp16, fp32 -> TF32, optional fp8."""
    t = {"bfloat16": bf16_fp16 * TERA, "float16": bf16_fp16 * TERA, "float32": tf32 * TERA}
    if fp8 is not None:
        t["float8_e4m3fn"] = fp8 * TERA
        t["float8_e5m2"] = fp8 * TERA
    return t


DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: BF16/FP16 tensor 1,979 TFLOPS,
    # TF32 tensor 989 TFLOPS, FP8 tensor 3,958 TFLOPS, all "with sparsity", so dense is half:
    # 989.5 / 494.5 / 1,979. (Non-tensor FP32: 67 TFLOPS.) GPU memory 80 GB HBM3 at 3.35 TB/s.
    "h100": DeviceSpec(
        "h100",
        _table(bf16_fp16=989.5, tf32=494.5, fp8=1979.0),
        memory_bandwidth=3.35e12,
        memory_bytes=80 * 10**9,
    ),
    # NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: the same tensor-core peaks as
    # H100 SXM (BF16/FP16 1,979, TF32 989, FP8 3,958 TFLOPS with sparsity; dense is half;
    # non-tensor FP32 67 TFLOPS). GPU memory 141 GB HBM3e at 4.8 TB/s.
    "h200": DeviceSpec(
        "h200",
        _table(bf16_fp16=989.5, tf32=494.5, fp8=1979.0),
        memory_bandwidth=4.8e12,
        memory_bytes=141 * 10**9,
    ),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: BF16/FP16 tensor 312 TFLOPS
    # dense (624 sparse), TF32 tensor 156 dense (312 sparse); no FP8. (Non-tensor FP32:
    # 19.5 TFLOPS.) GPU memory 80 GB HBM2e at 2,039 GB/s.
    "a100": DeviceSpec(
        "a100",
        _table(bf16_fp16=312.0, tf32=156.0),
        memory_bandwidth=2.039e12,
        memory_bytes=80 * 10**9,
    ),
    # NVIDIA L40S datasheet: BF16/FP16 tensor 362.05 TFLOPS dense (733 sparse), TF32 tensor
    # 183 dense (366 sparse), FP8 733 dense (1,466 sparse). (Non-tensor FP32: 91.6 TFLOPS.)
    # GPU memory 48 GB GDDR6 at 864 GB/s.
    "l40s": DeviceSpec(
        "l40s",
        _table(bf16_fp16=362.05, tf32=183.0, fp8=733.0),
        memory_bandwidth=864e9,
        memory_bytes=48 * 10**9,
    ),
    # AMD Instinct MI300X data sheet: FP16/BF16 matrix 1,307.4 TFLOPS dense (2,614.9 with
    # sparsity), TF32 matrix 653.7 dense, FP8 2,614.9 dense. (FP32 vector/matrix: 163.4 TFLOPS.)
    # 192 GB HBM3 at 5.3 TB/s peak.
    "mi300x": DeviceSpec(
        "mi300x",
        _table(bf16_fp16=1307.4, tf32=653.7, fp8=2614.9),
        memory_bandwidth=5.3e12,
        memory_bytes=192 * 10**9,
    ),
}


def measured_rates(compute: dict) -> dict[str, dict[str, tuple[tuple[float, float], ...]]]:
    """The rate fields of a :class:`DeviceSpec` (``matmul_rates``,
    ``attention_forward_rates``, ``attention_backward_rates``) from the ``compute`` part of
    a calibration profile: its timed ``matmuls`` and ``attention`` lists."""
    return {
        "matmul_rates": matmul_rates(compute.get("matmuls", [])),
        **attention_rates(compute.get("attention", [])),
    }


MEASURED_FORMAT = "autoshard.measured-device/1"
MEASURED_DIR = Path(__file__).with_name("measured")
"""The rates GPUs achieved: one JSON file per preset (format :data:`MEASURED_FORMAT`),
``autoshard calibrate --mesh 1``'s compute part with a ``source`` naming the machine and
the command (h100, h200: GPUs lent to this project), or the published benchmarks whose
numbers it holds (a100); :func:`measured_device`."""


def measured_device(name: str) -> DeviceSpec:
    """The preset ``name`` with the rates one such GPU achieved in place of its datasheet's:
    matmul rates by size, causal attention rates and the copy bandwidth that
    ``autoshard calibrate --mesh 1`` measured (``MEASURED_DIR/NAME.json``). ``peak_flops``
    stays the datasheet's: it is the MFU's denominator, and prices only a dtype with no
    measured matmul.

    Raises:
        AutoshardError: no measurement of ``name`` is kept (the message lists those kept),
            or its file is not a measured-device file.
    """
    path = MEASURED_DIR / f"{name}.json"
    if not path.is_file():
        kept = ", ".join(sorted(p.stem for p in MEASURED_DIR.glob("*.json")))
        raise AutoshardError(f"no measured rates of {name!r} are kept: pick one of {kept}")
    d = json.loads(path.read_text())
    if d.get("format") != MEASURED_FORMAT or d.get("device") != name:
        raise AutoshardError(f"{path} is not {MEASURED_FORMAT} for {name!r}")
    base = DEVICES[name]
    return DeviceSpec(
        f"{name}-measured",
        dict(base.peak_flops),
        float(d["memory_bandwidth_Bps"]),
        base.memory_bytes,
        **measured_rates(d),
    )


for _path in sorted(MEASURED_DIR.glob("*.json")):
    DEVICES[f"{_path.stem}-measured"] = measured_device(_path.stem)

DEFAULT_DEVICE = "h100-measured"
"""The device the cost model assumes unless the user picks one (``--device``): an H100 SXM
at the rates one reached (:func:`measured_device`), not at its datasheet's peaks, which no
GPU reaches. Priced at the datasheet, the six published H100 runs of docs/validation.md
come out 1.32-1.69x faster than they measured; at the measured rates (with the attention
kernel and the memory their sources name, their links at NCCL's bus bandwidth), 1.12-1.25x
(docs/validation.md keeps the table). ``--device h100`` keeps the datasheet's peaks."""


def get_device(name: str) -> DeviceSpec:
    """The :class:`DeviceSpec` called ``name``, case-insensitive (``"H100"`` works).

    Raises:
        AutoshardError: unknown name; the message lists the known ones.
    """
    key = str(name).strip().lower()
    if key not in DEVICES:
        raise AutoshardError(
            f"unknown device {name!r}: pick one of {', '.join(DEVICES)} (e.g. --device h100)"
        )
    return DEVICES[key]
