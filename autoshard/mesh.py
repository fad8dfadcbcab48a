"""The device mesh and its communication cost model (alpha-beta, ring collectives).

A mesh is an N-D grid of devices (``2x4``: 2 nodes of 4 GPUs). Each mesh dim has a link
bandwidth ``bw`` (bytes/s, one direction, per device) and a per-step latency ``alpha`` (s).
MASE's convention places mesh dim 0 across nodes and the other mesh dims inside a node.

Collective costs follow the ring algorithm as analysed in the NCCL tests performance notes
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md): on a mesh dim of ``n``
devices, for a tensor of ``B`` bytes in full (its size before sharding along that mesh dim),

- all-gather and reduce-scatter take ``n-1`` steps, each moving ``B/n`` bytes per device:
  ``(n-1) * (alpha + B/(n*bw))``;
- all-reduce is a reduce-scatter followed by an all-gather: twice that;
- all-to-all: each device holds ``B/n`` and sends ``(n-1)/n`` of it, one ``1/n`` piece per
  peer: ``(n-1) * (alpha + B/(n*n*bw))``.

All are zero on a mesh dim of size 1.

Resharding a tensor from source to destination placements (one per mesh dim) is priced
mesh dim by mesh dim, as DESIGN.md describes, except that ``Replicate -> Partial`` is allowed
and free: DTensor does it locally (``Partial._partition_value``), and PyTorch's own op
strategies ask for it (a replicated bias added to a ``Partial`` matmul output):

==================  =====================  ==============================
source              destination            collective on that mesh dim
==================  =====================  ==============================
``Shard(a)``        ``Replicate()``        all-gather
``Partial(op)``     ``Replicate()``        all-reduce
``Partial(op)``     ``Shard(d)``           reduce-scatter
``Shard(a)``        ``Shard(b)``, a != b   all-to-all
``Replicate()``     ``Shard(d)``           none (each device slices locally)
``Replicate()``     ``Partial(op)``        none (local: each device divides its copy
                                           by n for ``sum`` and keeps it for ``avg``,
                                           ``min``, ``max``, as DTensor does)
``Shard(a)``        ``Partial(op)``        impossible (``math.inf``)
``Partial(op1)``    ``Partial(op2)``       impossible (``math.inf``)
==================  =====================  ==============================

A resharding over several mesh dims is a *sequence* of single-dim collectives, each priced
on the tensor as it is at that step (Alpa and autoparallel size each step in sequence), in
the cheapest order (:meth:`MeshSpec._sequence`): steps that shrink the local tensor first
(local slices, then reduce-scatters, fastest link first), then those that keep its size
(all-reduce, all-to-all) on the smallest piece, then the all-gathers that grow it (fastest
link last). A ``Partial -> Replicate`` mesh dim may also run as a reduce-scatter at the
start and an all-gather at the end, so that the dims between work on the scattered piece:
NCCL's hierarchical all-reduce (reduce-scatter inside the node, all-reduce across nodes on
``1/n`` of the bytes, all-gather inside). Each order is optimal by an exchange argument:
every byte term is linear in the local size, a shrinking step moved earlier never costs
more, and two reduce-scatters on links ``i, j`` cost less with the higher bandwidth first.

Gradient reductions go in buckets (PyTorch DDP's ``bucket_cap_mb``, 25 MiB by default), and
so do parameter all-gathers (FSDP gathers a whole block's parameters in one collective; a
25 MiB bucket stands for that group): a tensor of ``G`` bytes on one device fills
``G / bucket`` of a bucket and pays that share of the collective's latency
(:meth:`MeshSpec.bucketed_cost`); bandwidth terms are unchanged.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autoshard.errors import AutoshardError
from autoshard.units import format_bandwidth, format_seconds

# Default link parameters (MASE's two-level cluster: NVLink inside a node, InfiniBand across).
#
# Intra-node bandwidth, 450 GB/s: an H100 SXM5 has 18 NVLink 4 links, 900 GB/s in total
# counting both directions (NVIDIA H100 datasheet), i.e. 450 GB/s each way per GPU.
DEFAULT_INTRA_NODE_BW = 450e9
# Inter-node bandwidth, 50 GB/s: one ConnectX-7 NDR InfiniBand NIC of 400 Gb/s per GPU, as
# in a DGX H100 (400 Gb/s / 8 bits per byte = 50 GB/s each way).
DEFAULT_INTER_NODE_BW = 50e9
# Latencies are the per-step alpha of the ring. NCCL's own tuning model (src/graph/tuning.cc,
# Ring algorithm, Simple protocol, which NCCL uses for the megabyte-sized messages of
# training) charges 3.4 us per NVLink step and 14 us per network step, plus 8.4 us per call.
# Spreading the per-call cost over the n-1 steps of a ring gives about 5 us per intra-node
# step (n = 4: 3.4 + 8.4/3 = 6.2 us; n = 8: 3.4 + 8.4/7 = 4.6 us) and about 20 us per
# inter-node step (n = 2: 14 + 8.4 = 22.4 us; n = 4: 14 + 8.4/3 = 16.8 us).
DEFAULT_INTRA_NODE_LATENCY = 5e-6
DEFAULT_INTER_NODE_LATENCY = 20e-6

CollectiveKind = Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all"]
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
)

# Size of the redistribute_cost cache, in entries (about 200 bytes each).
_COST_CACHE_SIZE = 1 << 20

# Placement codes used inside the cost model: Replicate -> -1, Shard(d) -> d (>= 0),
# Partial(op) -> the reduce op's name (a str).
_R = -1
_Code = int | str


@dataclass(frozen=True)
class CommStep:
    """One collective of a resharding: ``kind`` on ``mesh_dim``, seen as ``bytes`` (the full
    tensor along that mesh dim, in bytes), taking ``seconds`` under the alpha-beta model."""

    kind: CollectiveKind
    mesh_dim: int
    bytes: float
    seconds: float


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """``"2x4"`` -> ``(2, 4)``; also ``"8"`` -> ``(8,)`` and ``"2x2x2"`` -> ``(2, 2, 2)``.

    Raises:
        AutoshardError: an empty part (``"2x"``), a part that is not a whole number (``"a"``),
            or a size below 1 (``"0x4"``).
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
    return shape


def _default_dim_names(ndim: int) -> tuple[str, ...]:
    """``("dp", "tp")`` for a 2-D mesh, else ``("d0", "d1", ...)``."""
    return ("dp", "tp") if ndim == 2 else tuple(f"d{i}" for i in range(ndim))


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
        # The hot path, redistribute_cost, has two memo levels (see its docstring): by the
        # identity of the placement tuples, then by their value.
        object.__setattr__(self, "_memo_by_id", {})
        object.__setattr__(
            self,
            "_memo_by_value",
            functools.lru_cache(maxsize=_COST_CACHE_SIZE)(self._redistribute_cost_uncached),
        )

    def __reduce__(self) -> tuple[type[MeshSpec], tuple]:
        # Pickle the four fields only, never the cost cache.
        return (MeshSpec, (self.shape, self.dim_names, self.bandwidth, self.latency))

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
            intra_node_bw, inter_node_bw: bytes/s (defaults 450 GB/s NVLink 4 and 50 GB/s
                NDR InfiniBand; sources beside the constants in this module).
            intra_node_latency, inter_node_latency: seconds per ring step (defaults 5 us and
                20 us, from NCCL's tuning model; see the constants).

        With two or more mesh dims, mesh dim 0 is inter-node and the others intra-node; a
        1-D mesh is one node (intra-node).

        Raises:
            AutoshardError: a bad shape, names or link parameters (see :class:`MeshSpec`).
        """
        dims = parse_mesh_shape(shape) if isinstance(shape, str) else tuple(shape)
        if dim_names is None:
            names = _default_dim_names(len(dims))
        elif isinstance(dim_names, str):
            names = tuple(n.strip() for n in dim_names.split(","))
        else:
            names = tuple(dim_names)
        if len(dims) == 1:
            bandwidth, latency = (intra_node_bw,), (intra_node_latency,)
        else:
            rest = len(dims) - 1
            bandwidth = (inter_node_bw,) + (intra_node_bw,) * rest
            latency = (inter_node_latency,) + (intra_node_latency,) * rest
        return cls(dims, names, bandwidth, latency)

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
        return self.shape[self._check_dim(mesh_dim)]

    def describe(self) -> str:
        """One line for reports, e.g.
        ``"2x4 mesh (8 devices): dp=2 at 50.0 GB/s, 20.0 us; tp=4 at 450 GB/s, 5.00 us"``."""
        dims = "; ".join(
            f"{name}={n} at {format_bandwidth(bw)}, {format_seconds(lat)}"
            for name, n, bw, lat in zip(
                self.dim_names, self.shape, self.bandwidth, self.latency, strict=True
            )
        )
        return f"{self.shape_str} mesh ({self.num_devices} devices): {dims}"

    def _check_dim(self, mesh_dim: int) -> int:
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, int):
            raise AutoshardError(f"mesh dim {mesh_dim!r} is not an int")
        if not 0 <= mesh_dim < len(self.shape):
            raise AutoshardError(
                f"mesh dim {mesh_dim} is out of range for the {self.shape_str} mesh "
                f"({self.ndim} dims: 0..{self.ndim - 1})"
            )
        return mesh_dim

    # ----------------------------------------------------------------------------------------
    # Collectives (alpha-beta ring model, see the module docstring)

    def all_gather(self, nbytes: float, mesh_dim: int) -> float:
        """Seconds to all-gather a tensor of ``nbytes`` in full over ``mesh_dim``:
        ``(n-1) * (alpha + B/(n*bw))`` (NCCL tests PERFORMANCE.md, AllGather)."""
        return self.collective("all_gather", nbytes, mesh_dim)

    def reduce_scatter(self, nbytes: float, mesh_dim: int) -> float:
        """Seconds to reduce-scatter ``nbytes`` (the full, unscattered tensor) over
        ``mesh_dim``: ``(n-1) * (alpha + B/(n*bw))`` (NCCL tests PERFORMANCE.md)."""
        return self.collective("reduce_scatter", nbytes, mesh_dim)

    def all_reduce(self, nbytes: float, mesh_dim: int) -> float:
        """Seconds to all-reduce ``nbytes`` over ``mesh_dim``: reduce-scatter then all-gather,
        ``2 * (n-1) * (alpha + B/(n*bw))`` (NCCL tests PERFORMANCE.md, AllReduce)."""
        return self.collective("all_reduce", nbytes, mesh_dim)

    def all_to_all(self, nbytes: float, mesh_dim: int) -> float:
        """Seconds to all-to-all a tensor of ``nbytes`` in full over ``mesh_dim``:
        ``(n-1) * (alpha + B/(n*n*bw))``."""
        return self.collective("all_to_all", nbytes, mesh_dim)

    def collective(self, kind: CollectiveKind, nbytes: float, mesh_dim: int) -> float:
        """Seconds for collective ``kind`` on ``nbytes`` (full tensor) over ``mesh_dim``.

        Raises:
            AutoshardError: an unknown ``kind``, a bad ``mesh_dim`` or negative ``nbytes``.
        """
        self._check_dim(mesh_dim)
        if kind not in COLLECTIVE_KINDS:
            raise AutoshardError(f"unknown collective {kind!r}: use one of {COLLECTIVE_KINDS}")
        if not nbytes >= 0:
            raise AutoshardError(f"collective of {nbytes!r} bytes: the size must be >= 0")
        return self._collective(kind, nbytes, mesh_dim)

    def _collective(self, kind: str, nbytes: float, i: int, latency_share: float = 1.0) -> float:
        n = self.shape[i]
        if n == 1:
            return 0.0
        alpha, bw = self.latency[i] * latency_share, self.bandwidth[i]
        if kind == "all_to_all":
            return (n - 1) * (alpha + nbytes / (n * n * bw))
        ring = (n - 1) * (alpha + nbytes / (n * bw))
        return 2 * ring if kind == "all_reduce" else ring

    # ----------------------------------------------------------------------------------------
    # Resharding

    def redistribute_cost(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
    ) -> float:
        """Seconds to reshard a tensor from ``src`` to ``dst`` placements (one per mesh dim).

        Args:
            src, dst: tuples of ``Shard`` / ``Replicate`` / ``Partial``, one per mesh dim.
            shape: the global (unsharded) tensor shape.
            itemsize: bytes per element.

        Returns:
            The sum of the collectives of :meth:`redistribute_steps`; 0 when nothing moves;
            ``math.inf`` when the change is impossible (``Shard`` into ``Partial``, or
            between two ``Partial`` reduce ops).

        Memoised per mesh, since the ILP builder asks for every pair of strategies of every
        edge (10^5 to 10^6 calls). Hashing torch placements is slow (about 0.2 us each), so a
        first memo is keyed by the *identity* of the ``src`` and ``dst`` tuples (it holds
        them, so an id cannot be reused while its entry lives; only hashable, hence
        immutable, arguments ever enter it) and a second one, an LRU of 2**20 entries, by
        their value. Reusing the same tuple objects, as strategy lists do, is the fast path.

        Raises:
            AutoshardError: a placement count that differs from the mesh's dims, a placement
                kind other than Shard/Replicate/Partial, a Shard dim outside the tensor, or a
                bad itemsize.
        """
        key = (id(src), id(dst), shape, itemsize)
        try:
            hit = self._memo_by_id.get(key)
            if hit is not None and hit[0] is src and hit[1] is dst:
                return hit[2]
            cost = self._memo_by_value(src, dst, shape, itemsize)
        except TypeError:  # unhashable arguments (lists): compute without memo
            return self._redistribute_cost_uncached(src, dst, shape, itemsize)
        if len(self._memo_by_id) >= _COST_CACHE_SIZE:
            self._memo_by_id.clear()
        self._memo_by_id[key] = (src, dst, cost)
        return cost

    def redistribute_steps(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
        latency_share: float = 1.0,
    ) -> list[CommStep]:
        """The collectives that reshard a tensor from ``src`` to ``dst``, in the order they
        run (see the module docstring); mesh dims of size 1 and local slices give no step.
        Arguments as in :meth:`redistribute_cost`; ``latency_share`` scales each step's
        latency term (a bucketed gradient's share of its bucket, :meth:`bucket_share`).

        Raises:
            AutoshardError: the change is impossible (``Shard`` into ``Partial``, or between
                two ``Partial`` reduce ops), or bad arguments as in :meth:`redistribute_cost`.
        """
        plan = self._plan(src, dst, shape, itemsize)
        if isinstance(plan, str):
            raise AutoshardError(plan)
        return self._steps(plan, latency_share)

    def bucketed_cost(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
        bucket_bytes: float,
    ) -> float:
        """Seconds of a bucketed collective ``src -> dst`` (a gradient's reduction, a
        parameter's gather) with buckets of ``bucket_bytes``: the steps of
        :meth:`redistribute_steps`, each step's latency term scaled by
        ``min(1, G / bucket_bytes)`` (:meth:`bucket_share`: the share of a bucket it
        fills, as DDP's ``bucket_cap_mb``).

        Returns ``math.inf`` when the change is impossible.
        """
        plan = self._plan(src, dst, shape, itemsize)
        if isinstance(plan, str):
            return math.inf
        return sum(
            s.seconds
            for s in self._steps(plan, self.bucket_share(src, dst, shape, itemsize, bucket_bytes))
        )

    def bucket_share(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
        bucket_bytes: float,
    ) -> float:
        """``min(1, G / bucket_bytes)``: the share of a bucket a tensor of global ``shape``
        fills, ``G`` its larger local size on one device under ``src`` or ``dst`` (a
        reduction's input, a gather's output: what the bucket holds); 1 when
        ``bucket_bytes`` is 0 (no buckets)."""
        if bucket_bytes <= 0:
            return 1.0
        total = math.prod(shape) * itemsize
        pieces = min(
            self._pieces(src, len(shape), "source"), self._pieces(dst, len(shape), "destination")
        )
        return min(1.0, total / pieces / bucket_bytes)

    def _pieces(self, placements: Sequence[Placement], ndim: int, what: str) -> int:
        """How many pieces ``placements`` cut a tensor into (product of the sharding dims)."""
        codes = self._encode(placements, ndim, what)
        return math.prod(
            n for n, c in zip(self.shape, codes, strict=True) if not isinstance(c, str) and c >= 0
        )

    def _steps(self, plan, latency_share: float = 1.0) -> list[CommStep]:
        return [
            CommStep(kind, i, b, self._collective(kind, b, i, latency_share)) for kind, i, b in plan
        ]

    def _redistribute_cost_uncached(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
    ) -> float:
        plan = self._plan(src, dst, shape, itemsize)
        if isinstance(plan, str):
            return math.inf
        return sum(self._collective(kind, b, i) for kind, i, b in plan)

    def _plan(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
    ) -> list[tuple[CollectiveKind, int, float]] | str:
        """``(kind, mesh dim, bytes)`` per collective in the order they run (see the module
        docstring), or why the resharding is impossible."""
        shape = _whole_numbers(shape, "tensor shape")
        (itemsize,) = _whole_numbers((itemsize,), "itemsize")
        if any(n < 0 for n in shape) or itemsize < 1:
            raise AutoshardError(
                f"tensor shape {shape} and itemsize {itemsize}: sizes must be >= 0 and the "
                "itemsize >= 1 byte"
            )
        s = self._encode(src, len(shape), "source")
        d = self._encode(dst, len(shape), "destination")
        for i, (a, b) in enumerate(zip(s, d, strict=True)):
            if isinstance(b, str) and a != b and a != _R:  # Shard -> Partial, P(op1) -> P(op2)
                return (
                    f"cannot reshard mesh dim {i} ({self.dim_names[i]}) from "
                    f"{_show(a)} to {_show(b)}: a Partial placement comes only out of an op "
                    "or from Replicate"
                )
        # local bytes: the global bytes over the mesh dims on which the source is sharded
        local = (
            math.prod(shape)
            * itemsize
            / math.prod(
                n for n, c in zip(self.shape, s, strict=True) if not isinstance(c, str) and c >= 0
            )
        )
        plan: list[tuple[CollectiveKind, int, float]] = []
        for kind, i in self._sequence(s, d):
            n = self.shape[i]
            if kind == "slice":
                local /= n
                continue
            if kind in ("all_gather", "all_to_all"):
                plan.append((kind, i, local * n))  # B: the tensor in full along mesh dim i
            else:
                plan.append((kind, i, local))
            if kind == "all_gather":
                local *= n
            elif kind == "reduce_scatter":
                local /= n
        return plan

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (MeshSpec lives as long as its solve)
    def _sequence(self, s: tuple, d: tuple) -> tuple[tuple[str, int], ...]:
        """The cheapest order of the single-dim steps from codes ``s`` to ``d``.

        Each mesh dim whose placement changes (size > 1) gives one step: ``slice``
        (Replicate -> Shard, free), ``reduce_scatter``, ``all_reduce``, ``all_to_all`` or
        ``all_gather``; a ``Partial -> Replicate`` dim may instead give a reduce-scatter
        and an all-gather. Order: slices, reduce-scatters by bandwidth (highest first),
        all-reduces and all-to-alls, all-gathers by bandwidth (highest last). Every
        choice of splitting the all-reduces is priced on a unit tensor; the cheapest wins
        (ties: fewer steps). The order depends on the placements and the links only, since
        every byte term is linear in the tensor's size and latencies do not depend on it.
        """
        base: list[tuple[str, int]] = []
        splittable: list[int] = []
        for i, (a, b) in enumerate(zip(s, d, strict=True)):
            if a == b or self.shape[i] == 1 or isinstance(b, str):
                continue  # unchanged, a size-1 dim, or Replicate -> Partial (local)
            if b == _R:
                if isinstance(a, str):
                    splittable.append(i)
                else:
                    base.append(("all_gather", i))
            elif a == _R:
                base.append(("slice", i))
            else:
                base.append(("reduce_scatter" if isinstance(a, str) else "all_to_all", i))
        rank = {"slice": 0, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 2, "all_gather": 3}

        def order(steps: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
            def key(step: tuple[str, int]) -> tuple:
                kind, i = step
                bw = self.bandwidth[i]
                return (rank[kind], -bw if kind == "reduce_scatter" else bw, i)

            return tuple(sorted(steps, key=key))

        def unit_cost(steps: tuple[tuple[str, int], ...]) -> float:
            local, total = 1.0, 0.0
            for kind, i in steps:
                n, bw = self.shape[i], self.bandwidth[i]
                if kind == "slice":
                    local /= n
                elif kind == "all_gather":
                    total += (n - 1) * local / bw
                    local *= n
                elif kind == "reduce_scatter":
                    total += (n - 1) * local / (n * bw)
                    local /= n
                else:
                    factor = 2 if kind == "all_reduce" else 1
                    total += factor * (n - 1) * local / (n * bw)
            return total

        best: tuple[tuple[str, int], ...] | None = None
        best_cost = math.inf
        for split in itertools.product((False, True), repeat=len(splittable)):
            steps = list(base)
            for i, sp in zip(splittable, split, strict=True):
                steps += [("reduce_scatter", i), ("all_gather", i)] if sp else [("all_reduce", i)]
            cand = order(steps)
            cost = unit_cost(cand)
            if cost < best_cost * (1 - 1e-12):
                best, best_cost = cand, cost
        return best if best is not None else ()

    def _encode(self, placements: Sequence[Placement], tensor_ndim: int, what: str) -> tuple:
        """Placements -> codes (Replicate -> -1, Shard(d) -> d >= 0, Partial(op) -> op)."""
        if len(placements) != self.ndim:
            raise AutoshardError(
                f"{what} placements {tuple(placements)} are {len(placements)} for the "
                f"{self.ndim} mesh dims of the {self.shape_str} mesh: give one per mesh dim"
            )
        codes: list[_Code] = []
        for p in placements:
            # Exact type first: isinstance() on torch placements runs a Python-level
            # __instancecheck__, the slowest part of this function.
            kind = type(p)
            if kind is not Replicate and kind is not Shard and kind is not Partial:
                kind = next((k for k in (Shard, Replicate, Partial) if isinstance(p, k)), None)
            if kind is Replicate:
                codes.append(_R)
            elif kind is Shard:
                dim = p.dim + tensor_ndim if p.dim < 0 else p.dim
                if not 0 <= dim < tensor_ndim:
                    raise AutoshardError(
                        f"{what} placement {p} shards tensor dim {p.dim} of a "
                        f"{tensor_ndim}-D tensor: use a dim in 0..{tensor_ndim - 1}"
                    )
                codes.append(dim)
            elif kind is Partial:
                codes.append(str(p.reduce_op))
            else:
                raise AutoshardError(f"{what} placement {p!r} is not Shard, Replicate or Partial")
        return tuple(codes)


def _whole_numbers(values: Sequence[Any], what: str) -> tuple[int, ...]:
    """``values`` as Python ints (numpy and torch integers too), else AutoshardError."""
    try:
        return tuple(operator.index(v) for v in values)
    except TypeError:
        raise AutoshardError(f"{what} {tuple(values)} must hold whole numbers") from None


def _show(code: _Code) -> str:
    if isinstance(code, str):
        return f"P({code})"
    return "R" if code == _R else f"S({code})"
