"""The device mesh: its shape, mesh dim names and links (bandwidth, latency per mesh dim).

A mesh is an N-D grid of devices (``2x4``: 2 nodes of 4 GPUs). Each mesh dim has a link
bandwidth ``bw`` (bytes/s, one direction, per device) and a per-step latency ``alpha`` (s).
MASE's convention places mesh dim 0 across nodes and the other mesh dims inside a node.

The collectives and the resharding planner that price moving tensors over these links
live in :mod:`autoshard.cost.collectives`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.units import format_bandwidth, format_seconds

# Default link parameters (MASE's two-level cluster: NVLink inside a node, InfiniBand across),
# at the bus bandwidth NCCL reaches on an H100 cluster's links, not their line rates: a
# prediction is a claim about what a cluster runs (docs/validation.md prices published runs
# on them).
#
# Line rates, each way per GPU: an H100 SXM5 has 18 NVLink 4 links, 900 GB/s in total
# counting both directions (NVIDIA H100 datasheet), i.e. 450 GB/s; one ConnectX-7 NDR
# InfiniBand NIC of 400 Gb/s per GPU, as in a DGX H100 (400 Gb/s / 8 = 50 GB/s).
DATASHEET_INTRA_NODE_BW = 450e9
DATASHEET_INTER_NODE_BW = 50e9
# Intra-node bandwidth, 370 GB/s: "with the protocol overhead (~20%) NCCL can get an
# effective NVLink bandwidth of 370GB/s, which you can observe as BusBw when running
# non-allreduce operations, or when running with NCCL_ALGO=RING" (the NCCL maintainer,
# NVIDIA/nccl-tests issue #212, 2024-05-06, H100). NVLink SHARP all-reduce reaches about
# 480 GB/s of bus bandwidth on 8 GPUs (the same reply); one bandwidth per mesh dim prices
# every collective at the ring's, so an intra-node all-reduce is priced about 30% slow.
DEFAULT_INTRA_NODE_BW = 370e9
# Inter-node bandwidth, 47 GB/s: "for NDR @ 400Gbps you should see 46-48GB/s per NIC"
# (NVIDIA's NCCL team, NVIDIA/nccl-tests issue #290, 2025-03-03); the middle is taken.
DEFAULT_INTER_NODE_BW = 47e9
# Latencies are the per-step alpha of the ring. NCCL's own tuning model (src/graph/tuning.cc,
# Ring algorithm, Simple protocol, which NCCL uses for the megabyte-sized messages of
# training) charges 3.4 us per NVLink step and 14 us per network step, plus 8.4 us per call.
# Spreading the per-call cost over the n-1 steps of a ring gives about 5 us per intra-node
# step (n = 4: 3.4 + 8.4/3 = 6.2 us; n = 8: 3.4 + 8.4/7 = 4.6 us) and about 20 us per
# inter-node step (n = 2: 14 + 8.4 = 22.4 us; n = 4: 14 + 8.4/3 = 16.8 us).
DEFAULT_INTRA_NODE_LATENCY = 5e-6
DEFAULT_INTER_NODE_LATENCY = 20e-6

# Gradient bucket size, bytes: PyTorch DDP's default ``bucket_cap_mb=25``
# (torch.nn.parallel.DistributedDataParallel), the default of ``--bucket-size``.
DDP_BUCKET_BYTES = 25 * 2**20


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``; also ``"8"`` -> ``(8,)`` and ``"2x2x2"`` -> ``(2, 2, 2)``.

    Raises:
        AutoshardError: an empty part (``"2x"``), a part that is not a whole number (``"a"``),
            a size below 1 (``"0x4"``), or more than :data:`MAX_DEVICES` devices.
    """
    parts = text.strip().lower().split("x") if isinstance(text, str) else [""]
    if not all(p.strip().isdecimal() for p in parts):
        raise AutoshardError(
            f"bad mesh shape {text!r}: write mesh dim sizes joined by 'x', e.g. 2x4 or 8"
        )
    shape = tuple(int(p) for p in parts)
    for i, n in enumerate(shape):
        if n < 1:
            raise AutoshardError(
                f"mesh shape {text!r} has size {n} on mesh dim {i}: every size must be >= 1"
            )
    check_devices(shape, repr(text))
    return shape


def check_devices(shape: Sequence[int], text: str) -> None:
    """Refuse a mesh of more than :data:`MAX_DEVICES` devices (``text``: how the message
    names the shape). The parsed ``--mesh`` and every :class:`MeshSpec` check it.

    Raises:
        AutoshardError: too many devices.
    """
    if math.prod(shape) > MAX_DEVICES:
        raise AutoshardError(
            f"mesh shape {text} has {math.prod(shape):,} devices: autoshard plans meshes "
            f"of up to {MAX_DEVICES:,}"
        )


MAX_DEVICES = 2**24
"""The most devices a mesh may have: far above any cluster, and well inside the 32-bit
world size of ``torch.distributed``'s process groups (the planner's fake process group
raised an overflow, as a traceback, for a mesh of 10**20 devices)."""


def default_dim_names(ndim: int) -> tuple[str, ...]:
    """``("dp", "tp")`` for a 2-D mesh, else ``("d0", "d1", ...)``."""
    return ("dp", "tp") if ndim == 2 else tuple(f"d{i}" for i in range(ndim))


MeshDims = int | tuple[int, ...]
"""Where a collective runs: one mesh dim, or a flattened group of mesh dims (ascending),
over which DTensor runs one collective (:meth:`autoshard.cost.collectives.CommModel._merged`);
``-1`` for a group that is neither."""


def mesh_dims_of(value: Any) -> MeshDims:
    """A collective's mesh dim as a solution or a sharding map stores it (an int, or a list
    of ints for a flattened group) as :data:`MeshDims`."""
    if isinstance(value, list | tuple):
        return tuple(int(v) for v in value)
    return int(value)


def mesh_dims_json(dims: MeshDims) -> int | list[int]:
    """:data:`MeshDims` as JSON holds it (the inverse of :func:`mesh_dims_of`)."""
    return list(dims) if isinstance(dims, tuple) else int(dims)


def mesh_dims_name(dims: MeshDims, names: Sequence[str]) -> str | None:
    """``"dp"``, or ``"dp+tp"`` for a flattened group; ``None`` for a dim not in ``names``."""
    group = mesh_dims_tuple(dims)
    if not all(0 <= g < len(names) for g in group):
        return None
    return "+".join(names[g] for g in group)


def mesh_dims_tuple(dims: MeshDims) -> tuple[int, ...]:
    """The mesh dims as a tuple (one for a single dim): what a step changes, and a sort
    key that orders single mesh dims and flattened groups together."""
    return dims if isinstance(dims, tuple) else (dims,)


def inside_node(shape: Sequence[int], gpus_per_node: int) -> list[bool]:
    """Per mesh dim of ``shape`` (ranks row-major over nodes of ``gpus_per_node``): whether
    its groups lie inside one node, i.e. its span ``prod(shape[i:])`` fits in a node."""
    return [math.prod(shape[i:]) <= gpus_per_node for i in range(len(shape))]


def respects_nodes(shape: Sequence[int], gpus_per_node: int) -> bool:
    """Whether ``shape``, ranks row-major over nodes of ``gpus_per_node``, keeps each mesh
    dim (of 2 or more devices) inside a node (its span, ``prod(shape[i:])`` ranks, divides
    ``gpus_per_node``) or across whole nodes (its stride, ``prod(shape[i+1:])``, is a
    multiple of ``gpus_per_node``), never half of each. A 1-D mesh, or one that fits in a
    node, always does."""
    shape = tuple(shape)
    if len(shape) == 1 or math.prod(shape) <= gpus_per_node:
        return True
    return all(
        shape[i] == 1
        or gpus_per_node % math.prod(shape[i:]) == 0
        or math.prod(shape[i + 1 :]) % gpus_per_node == 0
        for i in range(len(shape))
    )


def node_shapes(gpus: int, gpus_per_node: int, max_dims: int = 3) -> list[tuple[int, ...]]:
    """Every mesh shape of ``gpus`` devices with 1 to ``max_dims`` dims of 2 or more
    devices each that respects the node boundary, ranks laid out row-major over nodes of
    ``gpus_per_node``: a dim of a multi-dim mesh lies either inside a node (its span,
    ``prod(shape[i:])`` ranks, divides ``gpus_per_node``) or across nodes (its stride,
    ``prod(shape[i+1:])``, is a multiple of ``gpus_per_node``), never half of each (a
    tensor-parallel group split between NVLink and the network). A 1-D mesh is every
    device in one group (one GPU: the mesh ``(1,)``). Largest dims first for equal dim
    counts.

    Raises:
        AutoshardError: ``gpus`` or ``gpus_per_node`` below 1, or more than one node that
            is not whole (``gpus`` not a multiple of ``gpus_per_node``).
    """
    if gpus < 1 or gpus_per_node < 1:
        raise AutoshardError(
            f"--gpus (gpus) is {gpus} and --gpus-per-node (gpus_per_node) {gpus_per_node}: "
            "both must be at least 1"
        )
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise AutoshardError(
            f"--gpus (gpus) {gpus} is not a whole number of nodes of {gpus_per_node} "
            "(--gpus-per-node, gpus_per_node): give a multiple"
        )
    if gpus == 1:
        return [(1,)]

    def factorizations(n: int, dims: int) -> list[tuple[int, ...]]:
        if dims == 1:
            return [(n,)] if n >= 2 else []
        return [
            (d, *rest)
            for d in range(2, n + 1)
            if n % d == 0
            for rest in factorizations(n // d, dims - 1)
        ]

    shapes = [
        s
        for k in range(1, max_dims + 1)
        for s in factorizations(gpus, k)
        if respects_nodes(s, gpus_per_node)
    ]
    return sorted(shapes, key=lambda s: (len(s), tuple(-d for d in s)))


def _as_tuple(value: Any, what: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise AutoshardError(f"mesh {what} {value!r} is not a sequence: give one entry per dim")
    return tuple(value)


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh and its links, validated on construction.

    Attributes:
        shape: devices along each mesh dim, e.g. ``(2, 4)``.
        dim_names: one identifier per mesh dim, e.g. ``("dp", "tp")``.
        bandwidth: bytes/s per mesh dim (one direction, per device).
        latency: seconds per ring step (alpha) per mesh dim.

    Raises:
        AutoshardError: an empty shape, a size below 1, a count of names, bandwidths or
            latencies that differs from the number of mesh dims, a repeated or non-identifier
            name, a bandwidth that is not finite and > 0, a latency that is not finite and >= 0.
    """

    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    bandwidth: tuple[float, ...]
    latency: tuple[float, ...]

    def __post_init__(self) -> None:
        shape = _as_tuple(self.shape, "shape")
        names = _as_tuple(self.dim_names, "dim_names")
        bandwidth = _as_tuple(self.bandwidth, "bandwidth")
        latency = _as_tuple(self.latency, "latency")
        if not shape:
            raise AutoshardError("mesh shape () is empty: give at least one mesh dim, e.g. 2x4")
        for i, n in enumerate(shape):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise AutoshardError(
                    f"mesh shape {shape} has size {n!r} on mesh dim {i}: "
                    "every size must be a whole number >= 1"
                )
        check_devices(shape, str(shape))  # the Python API's meshes too, not only --mesh
        ndim = len(shape)
        for what, values in (("dim_names", names), ("bandwidth", bandwidth), ("latency", latency)):
            if len(values) != ndim:
                raise AutoshardError(
                    f"mesh shape {shape} has {ndim} dims but {what} {values} has {len(values)}: "
                    "give one per mesh dim"
                )
        for i, name in enumerate(names):
            if not isinstance(name, str) or not name.isidentifier():
                raise AutoshardError(
                    f"mesh dim {i} name {name!r} is not an identifier: use names like dp, tp"
                )
            if names.index(name) != i:
                raise AutoshardError(
                    f"mesh dim names {names} repeat {name!r} (mesh dims {names.index(name)} "
                    f"and {i}): give each mesh dim its own name"
                )
        for i, (name, bw, lat) in enumerate(zip(names, bandwidth, latency, strict=True)):
            if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < math.inf:
                raise AutoshardError(
                    f"bandwidth of mesh dim {i} ({name}) is {bw!r} bytes/s: "
                    "it must be finite and > 0, e.g. 450GB/s"
                )
            if (
                isinstance(lat, bool)
                or not isinstance(lat, (int, float))
                or not 0 <= lat < math.inf
            ):
                raise AutoshardError(
                    f"latency of mesh dim {i} ({name}) is {lat!r} s: "
                    "it must be finite and >= 0, e.g. 5us"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dim_names", names)
        object.__setattr__(self, "bandwidth", tuple(float(b) for b in bandwidth))
        object.__setattr__(self, "latency", tuple(float(t) for t in latency))

    # ----------------------------------------------------------------------------------------
    # Construction and plain-data form

    @classmethod
    def from_options(
        cls,
        shape: str | Sequence[int],
        dim_names: str | Sequence[str] | None = None,
        intra_node_bw: float = DEFAULT_INTRA_NODE_BW,
        inter_node_bw: float = DEFAULT_INTER_NODE_BW,
        intra_node_latency: float = DEFAULT_INTRA_NODE_LATENCY,
        inter_node_latency: float = DEFAULT_INTER_NODE_LATENCY,
    ) -> MeshSpec:
        """A mesh from CLI-style options, with MASE's two-level convention.

        Args:
            shape: ``"2x4"`` or ``(2, 4)``.
            dim_names: ``"dp,tp"`` or ``("dp", "tp")``; default ``("dp", "tp")`` for a 2-D
                mesh, else ``("d0", "d1", ...)``.
            intra_node_bw, inter_node_bw: bytes/s (defaults 370 GB/s and 47 GB/s, the bus
                bandwidth NCCL reaches on NVLink 4 and on a 400 Gb/s NDR InfiniBand NIC;
                sources beside the constants in this module).
            intra_node_latency, inter_node_latency: seconds per ring step (defaults 5 us and
                20 us, from NCCL's tuning model; see the constants).

        With two or more mesh dims, mesh dim 0 is inter-node and the others intra-node; a
        1-D mesh is one node (intra-node).

        Raises:
            AutoshardError: a bad shape, names or link parameters (see :class:`MeshSpec`).
        """
        dims = parse_mesh_shape(shape) if isinstance(shape, str) else tuple(shape)
        if dim_names is None:
            names = default_dim_names(len(dims))
        elif isinstance(dim_names, str):
            names = tuple(n.strip() for n in dim_names.split(","))
        else:
            names = tuple(dim_names)
        if len(names) != len(dims):
            raise AutoshardError(
                f"--mesh-dim-names {','.join(map(str, names))} gives {len(names)} name(s) but "
                f"--mesh {'x'.join(map(str, dims))} has {len(dims)} dims: give one name per dim, "
                f"e.g. --mesh-dim-names {','.join(default_dim_names(len(dims)))}"
            )
        if len(dims) == 1:
            bandwidth, latency = (intra_node_bw,), (intra_node_latency,)
        else:
            rest = len(dims) - 1
            bandwidth = (inter_node_bw,) + (intra_node_bw,) * rest
            latency = (inter_node_latency,) + (intra_node_latency,) * rest
        return cls(dims, names, bandwidth, latency)

    @classmethod
    def on_nodes(
        cls,
        shape: Sequence[int],
        gpus_per_node: int,
        intra_node_bw: float = DEFAULT_INTRA_NODE_BW,
        inter_node_bw: float = DEFAULT_INTER_NODE_BW,
        intra_node_latency: float = DEFAULT_INTRA_NODE_LATENCY,
        inter_node_latency: float = DEFAULT_INTER_NODE_LATENCY,
    ) -> MeshSpec:
        """A mesh laid over nodes of ``gpus_per_node`` devices, ranks in row-major order (as
        ``init_device_mesh`` lays them out): a mesh dim is intra-node when its devices
        (``shape[i]`` of them, ``prod(shape[i+1:])`` ranks apart) all sit in one node,
        else inter-node (its ring crosses the network, whose links bound it).

        Raises:
            AutoshardError: as :class:`MeshSpec`.
        """
        dims = tuple(shape)
        intra = inside_node(dims, gpus_per_node)
        return cls(
            dims,
            default_dim_names(len(dims)),
            tuple(intra_node_bw if x else inter_node_bw for x in intra),
            tuple(intra_node_latency if x else inter_node_latency for x in intra),
        )

    def to_dict(self) -> dict[str, list]:
        """Plain builtins for the solution file:
        ``{"shape", "dim_names", "bandwidth_Bps", "latency_s"}``, each a list per mesh dim."""
        return {
            "shape": list(self.shape),
            "dim_names": list(self.dim_names),
            "bandwidth_Bps": list(self.bandwidth),
            "latency_s": list(self.latency),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeshSpec:
        """Inverse of :meth:`to_dict`.

        Raises:
            AutoshardError: not a mapping, a missing or unknown key, or invalid values.
        """
        keys = ("shape", "dim_names", "bandwidth_Bps", "latency_s")
        if not isinstance(data, Mapping):
            raise AutoshardError(
                f"mesh description is a {type(data).__name__}, not a mapping with keys "
                f"{', '.join(keys)}"
            )
        missing = [k for k in keys if k not in data]
        unknown = sorted(str(k) for k in data if k not in keys)
        if missing or unknown:
            raise AutoshardError(
                f"mesh description has missing keys {missing} and unknown keys {unknown}: "
                f"it needs exactly {', '.join(keys)}"
            )
        return cls(data["shape"], data["dim_names"], data["bandwidth_Bps"], data["latency_s"])

    # ----------------------------------------------------------------------------------------
    # Shape

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        """Total devices: the product of the mesh dim sizes."""
        return math.prod(self.shape)

    @property
    def shape_str(self) -> str:
        """The shape as typed on the command line, e.g. ``"2x4"``."""
        return "x".join(str(n) for n in self.shape)

    def size(self, mesh_dim: int) -> int:
        """Devices along ``mesh_dim``.

        Raises:
            AutoshardError: ``mesh_dim`` outside ``0 .. ndim-1``.
        """
        return self.shape[self.check_dim(mesh_dim)]

    def describe(self) -> str:
        """One line for reports, e.g.
        ``"2x4 mesh (8 devices): dp=2 at 47.0 GB/s, 20.0 us; tp=4 at 370 GB/s, 5.00 us"``."""
        dims = "; ".join(
            f"{name}={n} at {format_bandwidth(bw)}, {format_seconds(lat)}"
            for name, n, bw, lat in zip(
                self.dim_names, self.shape, self.bandwidth, self.latency, strict=True
            )
        )
        return f"{self.shape_str} mesh ({self.num_devices} devices): {dims}"

    def check_dim(self, mesh_dim: int) -> int:
        """``mesh_dim`` itself when it names a mesh dim.

        Raises:
            AutoshardError: not an int, or outside ``0 .. ndim-1``.
        """
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise AutoshardError(f"mesh dim {mesh_dim!r} is not an int")
        if not 0 <= mesh_dim < len(self.shape):
            raise AutoshardError(
                f"mesh dim {mesh_dim} is out of range for the {self.shape_str} mesh "
                f"({self.ndim} dims: 0..{self.ndim - 1})"
            )
        return mesh_dim
