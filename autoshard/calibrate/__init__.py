"""Calibration: the mesh's links and the device's speed, measured instead of read off a datasheet.

``autoshard calibrate --mesh 2x4`` starts one process per device under torchrun
(:mod:`autoshard.calibrate.rank`); they time all-gather, all-reduce, reduce-scatter and
all-to-all (the collective table's order) on each mesh dim at several sizes, and a few
matmuls and a copy on each device.
Rank 0 fits the cost model's own formulas to the times and writes a *profile*
(``autoshard.profile/1``, JSON, docs/formats.md) that ``solve --profile FILE`` (and
``compare``, ``stages``) read in place of the link options and ``--device``.

The fit. :mod:`autoshard.cost.collective_table` prices a collective on a mesh dim of ``n``
devices, for a tensor of ``B`` bytes in full, with the ring formulas of the NCCL tests'
performance notes (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)::

    all-gather, reduce-scatter   (n-1) alpha + (n-1)/n   B / bw
    all-reduce                  2(n-1) alpha + 2(n-1)/n  B / bw
    all-to-all                   (n-1) alpha + (n-1)/n^2 B / bw

Every measured time ``t`` is thus ``a alpha + b (1/bw)`` with known ``a`` and ``b``: a
linear least-squares problem in ``(alpha, 1/bw)``, solved with both unknowns >= 0
(:func:`scipy.optimize.nnls`), each row divided by its ``t`` so that the small, latency-
bound sizes weigh as much as the large ones (relative error). The profile reports the fit's
residual: the root mean square of the relative errors ``(model - t) / t``.

Compute: the device's FLOP/s per dtype is the best achieved over a few square matmuls
(``2 m n k / t``), its memory bandwidth the best over copies of a large tensor (``2 S / t``,
read and write); memory is the GPU's total, or on CPU the machine's memory divided among its
local ranks. These replace the datasheet's peaks in the roofline
(:class:`~autoshard.cost.devices.DeviceSpec`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoshard.cost.collective_table import collective
from autoshard.cost.devices import DeviceSpec, measured_rates
from autoshard.cost.mesh import DEFAULT_INTRA_NODE_BW, MeshSpec
from autoshard.errors import AutoshardError

PROFILE_FORMAT = "autoshard.profile/1"


@dataclass(frozen=True)
class LinkFit:
    """A mesh dim's fitted link: ``latency`` (alpha, s per ring step), ``bandwidth``
    (bytes/s per device, one way), ``residual`` (RMS relative error of the fit) and
    ``by_kind`` (the same per collective kind: a backend whose reduce-scatter is slower
    than its ring formula shows there)."""

    latency: float
    bandwidth: float
    residual: float
    by_kind: dict[str, float] = field(default_factory=dict, compare=False)


def fit_link(samples: list[dict[str, Any]], n: int) -> LinkFit:
    """Fit alpha and 1/bw to ``samples`` (``{"kind", "bytes", "seconds"}``) on ``n`` devices.

    Weighted non-negative least squares (rows divided by the measured time); see the
    module docstring.

    Raises:
        AutoshardError: fewer than two samples, a time that is not positive, or times
            that do not grow with the bytes (no bandwidth can be fitted: measure larger
            sizes).
    """
    import numpy as np
    from scipy.optimize import nnls

    if len(samples) < 2:
        raise AutoshardError(f"a link fit needs two or more timed sizes, got {len(samples)}")
    rows, times = [], []
    for s in samples:
        t = float(s["seconds"])
        if not t > 0 or not math.isfinite(t):
            raise AutoshardError(f"a timed {s['kind']} of {s['bytes']} bytes took {t} s")
        a, b = collective(s["kind"]).coefficients(n)
        rows.append([a / t, b * float(s["bytes"]) / t])
        times.append(t)
    x, _ = nnls(np.array(rows), np.ones(len(rows)))
    alpha, inv_bw = float(x[0]), float(x[1])
    if inv_bw <= 0:
        raise AutoshardError(
            f"the collectives on {n} devices took no longer at larger sizes: no bandwidth "
            "can be fitted; measure larger sizes (--max-size)"
        )
    error = np.array(rows) @ x - 1.0  # (model - t) / t for each sample

    def rms(e: np.ndarray) -> float:
        return float(np.sqrt(np.mean(e**2)))

    kinds = np.array([s["kind"] for s in samples])
    by_kind = {str(k): rms(error[kinds == k]) for k in dict.fromkeys(kinds)}
    return LinkFit(alpha, 1.0 / inv_bw, rms(error), by_kind)


@dataclass(frozen=True)
class Profile:
    """A calibration profile (format :data:`PROFILE_FORMAT`), as read from its JSON file.

    ``links[d]`` is mesh dim ``d``'s fit, ``None`` for a dim of one device (no link).
    ``peak_flops`` maps dtype names to achieved FLOP/s; ``memory_bandwidth`` is bytes/s and
    ``memory_bytes`` the memory per device.
    """

    path: Path
    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    backend: str
    device: str
    links: tuple[LinkFit | None, ...]
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int
    matmul_rates: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    attention_forward_rates: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict
    )
    attention_backward_rates: dict[str, tuple[tuple[float, float], ...]] = field(
        default_factory=dict
    )

    @property
    def device_only(self) -> bool:
        """Measured on one device (``--mesh 1``): no links, only the device's rates, which
        hold on any mesh of that device (the links then come from the link options)."""
        return all(link is None for link in self.links)

    def mesh(self, shape: tuple[int, ...], dim_names: tuple[str, ...] | None = None) -> MeshSpec:
        """The :class:`MeshSpec` of ``shape`` with the profile's links.

        Raises:
            AutoshardError: ``shape`` is not the profile's mesh (a profile measures the
                links of one mesh; calibrate again for another).
        """
        if tuple(shape) != self.mesh_shape:
            mesh_text = "x".join(map(str, self.mesh_shape))
            raise AutoshardError(
                f"profile {self.path} was measured on mesh {mesh_text}, not "
                f"{'x'.join(map(str, shape))}: run `autoshard calibrate --mesh "
                f"{'x'.join(map(str, shape))}`, or solve with --mesh {mesh_text}"
            )
        return MeshSpec(
            tuple(shape),
            tuple(dim_names) if dim_names else self.dim_names,
            tuple(f.bandwidth if f else DEFAULT_INTRA_NODE_BW for f in self.links),
            tuple(f.latency if f else 0.0 for f in self.links),
        )

    def device_spec(self) -> DeviceSpec:
        """The measured device as a :class:`DeviceSpec` (name ``calibrated``)."""
        return DeviceSpec(
            "calibrated",
            dict(self.peak_flops),
            self.memory_bandwidth,
            self.memory_bytes,
            dict(self.matmul_rates),
            dict(self.attention_forward_rates),
            dict(self.attention_backward_rates),
        )


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile written by ``autoshard calibrate``.

    Raises:
        AutoshardError: the file is missing, not JSON, not a profile, or lacks a field (the
            message names the file and the field).
    """
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise AutoshardError(
            f"profile {p} not found: write one with `autoshard calibrate --mesh SHAPE`"
        ) from None
    except (OSError, ValueError) as exc:
        raise AutoshardError(f"profile {p} is not readable JSON ({exc})") from None
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise AutoshardError(f"{p} is not an autoshard profile ({PROFILE_FORMAT}); it says {got!r}")
    try:
        links = tuple(
            None
            if link.get("latency_s") is None
            else LinkFit(
                link["latency_s"],
                link["bandwidth_Bps"],
                link["residual"],
                dict(link.get("residual_by_kind", {})),
            )
            for link in d["links"]
        )
        c = d["compute"]
        return Profile(
            path=p,
            mesh_shape=tuple(d["mesh"]["shape"]),
            dim_names=tuple(d["mesh"]["dim_names"]),
            backend=d["backend"],
            device=d["device"],
            links=links,
            peak_flops={k: float(v) for k, v in c["peak_flops"].items()},
            memory_bandwidth=float(c["memory_bandwidth_Bps"]),
            memory_bytes=int(c["memory_bytes"]),
            **measured_rates(c),
        )
    except (KeyError, TypeError) as exc:
        raise AutoshardError(f"profile {p} lacks field {exc}: calibrate again") from None
