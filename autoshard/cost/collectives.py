"""Collectives and resharding on a :class:`~autoshard.cost.mesh.MeshSpec` (alpha-beta, ring).

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
the cheapest order (:meth:`CommModel._sequence`, every order tried): usually steps that
shrink the local tensor first (local slices, then reduce-scatters, fastest link first), then
those that keep its size (all-reduce, all-to-all) on the smallest piece, then the all-
gathers that grow it (fastest link last). DTensor nests shardings of one tensor dim left to
right over the mesh dims, and a step that breaks the nesting needs the inner mesh dims
gathered first (:meth:`CommModel._nested`): ``(S(0), S(0)) -> (R, R)`` gathers mesh dim 1
before mesh dim 0, whatever the links. A ``Partial -> Replicate`` mesh dim may also run as a
reduce-scatter at the start and an all-gather at the end, so that the dims between work on
the scattered piece: NCCL's hierarchical all-reduce (reduce-scatter inside the node, all-
reduce across nodes on ``1/n`` of the bytes, all-gather inside). Each order is optimal by an
exchange argument: every byte term is linear in the local size, a shrinking step moved
earlier never costs more, and two reduce-scatters on links ``i, j`` cost less with the
higher bandwidth first (where nesting allows).

Consecutive like collectives of one resharding on several mesh dims (all-gathers,
reduce-scatters, all-reduces) may instead run as one ring over the flattened group of those
dims, as DTensor runs them where the mesh has the group flattened and FSDP2 runs its
gathers over a flattened data-parallel mesh (:meth:`CommModel._merged`): ``n - 1`` steps,
each at the latency of the link it crosses (NCCL's ring model: the network's on the steps
between nodes, the NVLink's on the rest), at the bandwidth of its narrowest cut
(:meth:`CommModel._links`).
Each resharding weighs the two (:meth:`CommModel._cheapest`, by the tensor's element count);
the launcher flattens every group and walks the same choice.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autoshard.cost.collective_table import COLLECTIVES, CollectiveKind, collective
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError

# Size of the resharding price cache (by placement codes and bytes), in entries.
_COST_CACHE_SIZE = 1 << 20

# Size of the step-sequence cache, in entries (placement codes in and out: about 520 bytes
# each, so at most 68 MB per mesh). The Llama-70B shape on 8x4x2 asks for 100,749
# distinct sequences; 4,096 entries recomputed 275,279 of them (61 s of its 128 s of
# strategy generation under cProfile). A 2-D mesh needs a few thousand.
_SEQUENCE_CACHE_SIZE = 1 << 17

# Collectives DTensor runs as one over a flattened group of mesh dims (CommModel._merged).
_FLATTENED = frozenset({"all_gather", "reduce_scatter", "all_reduce"})

# Bytes per element at which one ring over a flattened group is weighed against one
# collective per mesh dim (CommModel._cheapest): bf16, what training moves.
_CHOICE_ITEMSIZE = 2

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


class CommModel:
    """The collectives and reshardings of one :class:`~autoshard.cost.mesh.MeshSpec`, priced
    by the alpha-beta ring model of the module docstring. Get one with :func:`comm_model`,
    which keeps one per mesh so that its memo serves every caller.

    Args:
        mesh: the mesh whose links price every collective.
    """

    def __init__(self, mesh: MeshSpec) -> None:
        self.mesh = mesh
        # A resharding's price, memoised by placement codes and bytes; its steps, by codes
        # alone (see redistribute_cost's docstring).
        self._cost_of = functools.lru_cache(maxsize=_COST_CACHE_SIZE)(self._cost_of_codes)
        self._templates = functools.lru_cache(maxsize=_SEQUENCE_CACHE_SIZE)(self._template_uncached)
        self._links = functools.lru_cache(maxsize=None)(self._links_uncached)
        self._canonical_sequence = functools.lru_cache(maxsize=_SEQUENCE_CACHE_SIZE)(
            self._sequence_uncached
        )
        self._canonical_templates = functools.lru_cache(maxsize=_SEQUENCE_CACHE_SIZE)(
            self._canonical_template_uncached
        )

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
        self.mesh.check_dim(mesh_dim)
        collective(kind)
        if not nbytes >= 0:
            raise AutoshardError(f"collective of {nbytes!r} bytes: the size must be >= 0")
        return self._collective(kind, nbytes, mesh_dim)

    def _collective(
        self, kind: str, nbytes: float, i: int | tuple[int, ...], latency_share: float = 1.0
    ) -> float:
        n, alpha, bw = self._links(i)
        return COLLECTIVES[kind].seconds(n, alpha * latency_share, bw, nbytes)

    def _links_uncached(self, i: int | tuple[int, ...]) -> tuple[int, float, float]:
        """``(devices, latency, bandwidth)`` of mesh dim ``i``, or of the flattened group
        of mesh dims ``i`` (a tuple, ascending) that one collective spans.

        A flattened group is one NCCL ring over all its ``n`` devices, ranks row-major (as
        ``DeviceMesh._flatten`` lays them). Its latency is NCCL's ring model's
        (``ncclTopoTuneModel`` in NCCL's ``src/graph/tuning.cc``: ``(nsteps - nInterSteps) *
        intraLat + nInterSteps * interLat``, a ring over several nodes paying the network's
        latency on its ``nNodes - 1`` steps between nodes and the NVLink's on the rest): of
        the ``n - 1`` steps, ``prod(group dims before g) * (n_g - 1)`` move along dim ``g``
        (the outermost index that changes), each at dim ``g``'s latency; the alpha returned
        is their mean, so that ``(n - 1) * alpha`` is the sum. Its bandwidth is that of its
        narrowest cut: the links of group dim ``g`` join blocks of ``m`` devices (the
        product of the group's dims after ``g``), each device with its own link (one NIC per
        GPU, NCCL opening one channel per NIC), so ``m`` rings cross the cut at once, ``m *
        bw_g``; the ring runs at ``min_g m * bw_g``. Across DGX A100 nodes of 8 GPUs with 8
        HDR NICs (24 GB/s each) that is 192 GB/s, the all-reduce bus bandwidth NCCL's
        maintainer measures there (NVIDIA/nccl issue #812); over NVLink alone it is the
        NVLink's.
        """
        if isinstance(i, int):
            return self.mesh.shape[i], self.mesh.latency[i], self.mesh.bandwidth[i]
        n = math.prod(self.mesh.shape[g] for g in i)
        steps, outer = 0.0, 1
        for g in i:  # ascending: outermost dim first
            steps += outer * (self.mesh.shape[g] - 1) * self.mesh.latency[g]
            outer *= self.mesh.shape[g]
        alpha = steps / (n - 1)  # a group spans 2+ devices: no step runs on a dim of one
        bw = min(
            self.mesh.bandwidth[g] * math.prod(self.mesh.shape[h] for h in i if h > g) for g in i
        )
        return n, alpha, bw

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

        Memoised per mesh by the placements' codes and the tensor's bytes (an LRU of 2**20
        entries); the steps themselves depend on the codes only (:meth:`_template`), never
        on the shape. An edge of the strategy graph asks for every pair of its placements
        at once (:meth:`redistribute_costs`), encoding each placement once.

        Raises:
            AutoshardError: a placement count that differs from the mesh's dims, a placement
                kind other than Shard/Replicate/Partial, a Shard dim outside the tensor, or a
                bad itemsize.
        """
        s, d, form, total = self._encoded(src, dst, shape, itemsize)
        return self._cost_of(s, d, form, total)

    def redistribute_costs(
        self,
        srcs: Sequence[Sequence[Placement]],
        dsts: Sequence[Sequence[Placement]],
        shape: Sequence[int],
        itemsize: int,
    ) -> list[list[float]]:
        """:meth:`redistribute_cost` of every pair, a row per source and a column per
        destination: what an edge of the strategy graph costs (every strategy its producer
        can give against every one its reader wants). Each placement is encoded once and
        the shape checked once, where a call per pair would do both per pair.

        Raises:
            AutoshardError: as :meth:`redistribute_cost`.
        """
        return self._matrix(self._cost_of, srcs, dsts, shape, itemsize)

    def bucketed_costs(
        self,
        srcs: Sequence[Sequence[Placement]],
        dsts: Sequence[Sequence[Placement]],
        shape: Sequence[int],
        itemsize: int,
        bucket_bytes: float,
    ) -> list[list[float]]:
        """:meth:`bucketed_cost` of every pair, a row per source and a column per
        destination (as :meth:`redistribute_costs`)."""
        price = functools.partial(self._bucketed_of_codes, bucket_bytes=bucket_bytes)
        return self._matrix(price, srcs, dsts, shape, itemsize)

    def _matrix(self, price, srcs, dsts, shape: Sequence[int], itemsize: int) -> list[list[float]]:
        """``price(source codes, destination codes, ndim, bytes)`` of every pair, each
        placement encoded once."""
        total, ndim = self._total_bytes(shape, itemsize)
        form = (ndim, self._divisors(shape), math.prod(shape))
        s_codes = [self._encode(p, ndim, "source") for p in srcs]
        d_codes = [self._encode(q, ndim, "destination") for q in dsts]
        return [[price(s, d, form, total) for d in d_codes] for s in s_codes]

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

    def redistribute_path(
        self, src: Sequence[Placement], dst: Sequence[Placement], shape: Sequence[int]
    ) -> list[tuple[Placement, ...]]:
        """The placements after each single-mesh-dim step of the resharding
        :meth:`redistribute_steps` prices, in the same order, ending at ``dst``: what a
        launcher passes to ``DTensor.redistribute`` one step at a time so that the
        collectives that run are the priced ones. Local steps (``Replicate -> Shard``
        slices, ``Replicate -> Partial``) are included; a ``Partial -> Replicate`` dim
        priced as a reduce-scatter then an all-gather goes through ``Shard(d)`` with
        ``d`` the first tensor dim no mesh dim shards (:meth:`_sequence`).

        Raises:
            AutoshardError: the change is impossible, or bad arguments as in
                :meth:`redistribute_cost`.
        """
        shape = _whole_numbers(shape, "tensor shape")
        plan = self._plan(src, dst, shape, 1)
        if isinstance(plan, str):
            raise AutoshardError(plan)
        s = self._encode(src, len(shape), "source")
        d = self._encode(dst, len(shape), "destination")
        current = list(src)
        path: list[tuple[Placement, ...]] = []
        form = (len(shape), self._divisors(shape), math.prod(shape))
        for _, i, code in self._sequence(s, d, form):
            for g in (i,) if isinstance(i, int) else i:  # a flattened group: all its dims
                current[g] = _placement(code, dst[g])
            path.append(tuple(current))
        if tuple(current) != tuple(dst):
            path.append(tuple(dst))
        return path

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
        s, d, form, total = self._encoded(src, dst, shape, itemsize)
        return self._bucketed_of_codes(s, d, form, total, bucket_bytes)

    def _bucketed_of_codes(
        self, s: tuple, d: tuple, form: tuple, total: int, bucket_bytes: float
    ) -> float:
        """:meth:`bucketed_cost` of codes ``s`` to ``d`` of a tensor of ``form`` (its
        dims and their divisors, :meth:`_encoded`) and ``total`` bytes."""
        template = self._template(s, d, form)
        plan = self._replay(template, total)
        if isinstance(plan, str):
            return math.inf
        share = 1.0
        if bucket_bytes > 0:
            pieces = min(template[0], self._pieces_of(d))
            share = min(1.0, total / pieces / bucket_bytes)
        return sum(step.seconds for step in self._steps(plan, share))

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
        return self._pieces_of(self._encode(placements, ndim, what))

    def _pieces_of(self, codes: tuple) -> int:
        return math.prod(
            n
            for n, c in zip(self.mesh.shape, codes, strict=True)
            if not isinstance(c, str) and c >= 0
        )

    def _steps(self, plan, latency_share: float = 1.0) -> list[CommStep]:
        return [
            CommStep(kind, i, b, self._collective(kind, b, i, latency_share)) for kind, i, b in plan
        ]

    def _cost_of_codes(self, s: tuple, d: tuple, form: tuple, total: int) -> float:
        """Seconds of the resharding from codes ``s`` to ``d`` of a tensor of ``form``
        (:meth:`_encoded`) and ``total`` bytes (``math.inf`` when impossible)."""
        plan = self._replay(self._template(s, d, form), total)
        if isinstance(plan, str):
            return math.inf
        return sum(self._collective(kind, b, i) for kind, i, b in plan)

    def _encoded(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
    ) -> tuple[tuple, tuple, tuple, int]:
        """``(source codes, destination codes, form, bytes)`` of one resharding's
        arguments (:meth:`_total_bytes`, :meth:`_encode`; their errors); ``form`` is
        ``(ndim, divisors, elements)`` (:meth:`_divisors`; the element count,
        :meth:`_pick`): what the steps depend on besides the codes."""
        total, ndim = self._total_bytes(shape, itemsize)
        return (
            self._encode(src, ndim, "source"),
            self._encode(dst, ndim, "destination"),
            (ndim, self._divisors(shape), math.prod(shape)),
            total,
        )

    def _divisors(self, shape: Sequence[int]) -> tuple[int, ...]:
        """Per tensor dim, ``gcd(size, devices)``: a group of mesh dims (a divisor of the
        mesh's device count) splits the dim evenly exactly when it divides this. What a
        flattened reduce-scatter needs (:meth:`_merged`)."""
        devices = math.prod(self.mesh.shape)
        return tuple(math.gcd(int(n), devices) for n in shape)

    def _total_bytes(self, shape: Sequence[int], itemsize: int) -> tuple[int, int]:
        """``(bytes, ndim)`` of a tensor of global ``shape``, ``itemsize`` bytes each.

        Raises:
            AutoshardError: a size that is not a whole number, a negative size, or an
                itemsize below one byte.
        """
        shape = _whole_numbers(shape, "tensor shape")
        (itemsize,) = _whole_numbers((itemsize,), "itemsize")
        if any(n < 0 for n in shape) or itemsize < 1:
            raise AutoshardError(
                f"tensor shape {shape} and itemsize {itemsize}: sizes must be >= 0 and the "
                "itemsize >= 1 byte"
            )
        return math.prod(shape) * itemsize, len(shape)

    def _plan(
        self,
        src: Sequence[Placement],
        dst: Sequence[Placement],
        shape: Sequence[int],
        itemsize: int,
    ) -> list[tuple[CollectiveKind, int, float]] | str:
        """``(kind, mesh dim, bytes)`` per collective in the order they run (see the module
        docstring), or why the resharding is impossible."""
        s, d, form, total = self._encoded(src, dst, shape, itemsize)
        return self._replay(self._template(s, d, form), total)

    def _template(self, s: tuple, d: tuple, form: tuple) -> tuple | str:
        """What the resharding from codes ``s`` to ``d`` does to a tensor of ``form``
        (:meth:`_encoded`): the number of pieces the source cuts it into and the steps as
        ``(kind, mesh dim or flattened group, devices on it)``, the candidate
        :meth:`_pick` takes; or why the resharding is impossible."""
        key, k = self._pick(s, d, form)
        found = self._templates(s, d, key)
        return found if isinstance(found, str) else (found[0], found[1][k])

    def _pick(self, s: tuple, d: tuple, form: tuple) -> tuple[tuple, int]:
        """``(key, k)``: the step search's key for codes ``s`` to ``d`` of a tensor of
        ``form`` (``(ndim, divisors)``, a divisor kept only where a reduce-scatter may land:
        a dim ``d`` shards, or the first free dim a split all-reduce scatters, so that the
        memo serves every other size), and which of its candidates runs (:meth:`_cheapest`
        at the tensor's element count). The one choice the price (:meth:`_template`) and
        the launcher's path (:meth:`_sequence`) both read."""
        ndim, divisors, elements = form
        taken = {c for c in (*s, *d) if type(c) is int and c >= 0}
        free = next((t for t in range(ndim) if t not in taken), None)
        lands = {c for c in d if type(c) is int and c >= 0} | {free}
        key = (ndim, tuple(n if t in lands else 0 for t, n in enumerate(divisors)))
        found = self._templates(s, d, key)
        if isinstance(found, str) or len(found[1]) == 1:
            return key, 0
        return key, self._cheapest(found[0], found[1], elements)

    def _cheapest(self, pieces: int, candidates: Sequence[tuple], elements: int) -> int:
        """Of ``candidates`` (step templates ``(kind, mesh dim, devices)`` from a source
        that cuts the tensor into ``pieces``), the index of the cheapest for a tensor of
        ``elements`` at 2 bytes each (bandwidth and latency, no bucket share; the first
        on a tie): whether like collectives over several mesh dims run as one ring over
        their flattened group (more latency steps, at the group's narrowest cut) or one
        per dim is a matter of size, and the launcher, which knows the tensor's shape and
        not the bytes the plan moved it in, makes the same choice (:meth:`_pick`)."""
        total = elements * _CHOICE_ITEMSIZE
        best, best_s = 0, math.inf
        for k, steps in enumerate(candidates):
            plan = self._replay((pieces, steps), total)
            seconds = sum(self._collective(kind, b, i) for kind, i, b in plan)
            if seconds < best_s * (1 - 1e-12):
                best, best_s = k, seconds
        return best

    def _template_uncached(self, s: tuple, d: tuple, form: tuple) -> tuple | str:
        """:meth:`_template` for every size: the pieces and the candidates' step templates
        (one, or two where one ring over a flattened group may run, :meth:`_candidates`);
        ``form`` is ``(ndim, divisors)``. Neither names a tensor dim, so they are memoised
        by the codes renamed as :meth:`_candidates` renames them
        (:meth:`_canonical_template_uncached`): the Llama-70B shape's 4x2x8 strategies ask
        for 229,694 templates, of 37,770 renamed sequences."""
        for i, (a, b) in enumerate(zip(s, d, strict=True)):
            if isinstance(b, str) and a != b and a != _R:  # Shard -> Partial, P(op1) -> P(op2)
                return (
                    f"cannot reshard mesh dim {i} ({self.mesh.dim_names[i]}) from "
                    f"{_show(a)} to {_show(b)}: a Partial placement comes only out of an op "
                    "or from Replicate"
                )
        renamed_s, renamed_d, canonical, _ = self._canonical(s, d, form)
        return self._canonical_templates(renamed_s, renamed_d, canonical)

    def _canonical_template_uncached(self, s: tuple, d: tuple, form: tuple) -> tuple:
        """:meth:`_template_uncached` of codes already renamed (:meth:`_canonical`): the
        pieces the source cuts the tensor into (a renaming keeps which codes shard) and
        each candidate's ``(kind, mesh dim or group, devices)``, whose steps are the
        renamed codes' (:meth:`_sequence_uncached`)."""
        apart, flat = self._canonical_sequence(s, d, form)
        return self._pieces_of(s), tuple(
            tuple((kind, i, self._links(i)[0]) for kind, i, _ in steps)
            for steps in ((apart,) if flat == apart else (apart, flat))
        )

    @staticmethod
    def _replay(template, total: int) -> list[tuple[CollectiveKind, int, float]] | str:
        """A :meth:`_template` applied to a tensor of ``total`` bytes: ``(kind, mesh dim,
        bytes)`` per collective (a slice moves nothing), or the template's reason."""
        if isinstance(template, str):
            return template
        pieces, steps = template
        local = total / pieces  # the bytes one device holds before the first step
        plan: list[tuple[CollectiveKind, int, float]] = []
        for kind, i, n in steps:
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

    def _sequence(self, s: tuple, d: tuple, form: tuple) -> tuple[tuple[str, Any, _Code], ...]:
        """The steps from codes ``s`` to ``d`` of a tensor of ``form`` (``(ndim, divisors,
        elements)``, :meth:`_encoded`): the candidate of :meth:`_candidates` that
        :meth:`_pick` takes, as the price does."""
        key, k = self._pick(s, d, form)
        return self._candidates(s, d, key)[k]

    def _candidates(self, s: tuple, d: tuple, form: tuple) -> tuple[tuple, tuple]:
        """:meth:`_sequence_uncached`, memoised up to a renaming of the tensor dims: the
        steps depend on which codes are equal and on the named dims' divisors, never on
        the dims' numbers, except that a split all-reduce shards the first free dim. So
        the dims ``s`` and ``d`` shard are renamed 0, 1, ... in order of appearance, the
        first free dim (if any) gets the next number, and the steps found for those codes
        are renamed back (the Llama-70B shape on 8x4x2 asks for 100,749 distinct
        ``(s, d, ndim)``). ``form``: ``(ndim, divisors)``, the key :meth:`_pick` makes."""
        renamed_s, renamed_d, canonical, back = self._canonical(s, d, form)
        found = self._canonical_sequence(renamed_s, renamed_d, canonical)
        return tuple(
            tuple((kind, i, back[c] if type(c) is int and c >= 0 else c) for kind, i, c in steps)
            for steps in found
        )

    @staticmethod
    def _canonical(s: tuple, d: tuple, form: tuple) -> tuple[tuple, tuple, tuple, dict]:
        """``(s renamed, d renamed, the renamed form, back)``: the dims ``s`` and ``d``
        shard renamed 0, 1, ... in order of appearance, the first free dim (if any) the
        next number (:meth:`_candidates`); the renamed form is ``(dims named, their
        divisors)``; ``back`` maps each new name to its dim."""
        ndim, divisors = form
        names: dict[int, int] = {}
        for c in (*s, *d):
            if type(c) is int and c >= 0 and c not in names:
                names[c] = len(names)
        free = next((t for t in range(ndim) if t not in names), None)
        back = {v: k for k, v in names.items()}
        if free is not None:
            back[len(names)] = free

        def rename(codes: tuple) -> tuple:
            return tuple(names[c] if type(c) is int and c >= 0 else c for c in codes)

        canonical = (len(back), tuple(divisors[back[k]] for k in range(len(back))))
        return rename(s), rename(d), canonical, back

    def _sequence_uncached(self, s: tuple, d: tuple, form: tuple) -> tuple[tuple, tuple]:
        """Two candidate sequences of steps from codes ``s`` to ``d`` of a tensor of
        ``form`` (``(ndim, divisors)``, :meth:`_encoded`), each step ``(kind, mesh dim,
        code after)``, as DTensor runs them (:meth:`_nested`): the cheapest with one
        collective per mesh dim, and the cheapest where consecutive like steps on several
        mesh dims run as one collective over their flattened group (:meth:`_merged`: the
        step's mesh dim is then the group, a tuple), the first again when no step merges.
        Which runs is a matter of the tensor's size (:meth:`_pick`). A split
        all-reduce's reduce-scatter shards the first tensor dim that no mesh dim shards in
        ``s`` or ``d`` (so it nests with nothing); without one (a 0-d loss, or every dim
        taken) all-reduces are never split.

        Each mesh dim whose placement changes (size > 1) gives one step: ``slice``
        (Replicate -> Shard, free), ``reduce_scatter``, ``all_reduce``, ``all_to_all`` or
        ``all_gather``; a ``Partial -> Replicate`` dim may instead give a reduce-scatter
        and an all-gather (NCCL's hierarchical all-reduce). Every split choice and every
        order of the steps (a split dim's reduce-scatter before its all-gather) is priced
        on a unit tensor after the nested-sharding steps are added; the cheapest wins, ties
        to the least latency (:meth:`_latency`), then to fewer steps, then to the
        conventional order (slices, reduce-scatters fastest
        link first, all-reduces and all-to-alls, all-gathers fastest link last). Beyond 6
        steps only the conventional order is tried. The choice depends on the placements
        and the links only: every byte term is linear in the tensor's size.
        """
        ndim, divisors = form
        base: list[tuple[str, int]] = []
        splittable: list[int] = []
        taken = {c for c in (*s, *d) if not isinstance(c, str) and c >= 0}
        free = [t for t in range(ndim) if t not in taken]
        rs_dim = free[0] if free else None
        for i, (a, b) in enumerate(zip(s, d, strict=True)):
            if a == b or self.mesh.shape[i] == 1 or isinstance(b, str):
                continue  # unchanged, a size-1 dim, or Replicate -> Partial (local)
            if b == _R:
                if isinstance(a, str) and rs_dim is not None:
                    splittable.append(i)
                elif isinstance(a, str):
                    base.append(("all_reduce", i))
                else:
                    base.append(("all_gather", i))
            elif a == _R:
                base.append(("slice", i))
            else:
                base.append(("reduce_scatter" if isinstance(a, str) else "all_to_all", i))
        rank = {"slice": 0, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 2, "all_gather": 3}

        def conventional(steps: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
            def key(step: tuple[str, int]) -> tuple:
                kind, i = step
                bw = self.mesh.bandwidth[i]
                return (rank[kind], -bw if kind == "reduce_scatter" else bw, i)

            return tuple(sorted(steps, key=key))

        def valid(order: tuple[tuple[str, int], ...]) -> bool:
            seen_rs: set[int] = set()
            for kind, i in order:
                if kind == "reduce_scatter":
                    seen_rs.add(i)
                elif kind == "all_gather" and i in splittable and i not in seen_rs:
                    return False
            return True

        best: list[tuple] = [(), ()]  # one collective per mesh dim; flattened groups
        best_key: list[tuple] = [(math.inf, 0.0, 0, 0), (math.inf, 0.0, 0, 0)]
        for split in itertools.product((False, True), repeat=len(splittable)):
            steps = list(base)
            for i, sp in zip(splittable, split, strict=True):
                steps += [("reduce_scatter", i), ("all_gather", i)] if sp else [("all_reduce", i)]
            first = conventional(steps)
            orders = [first]
            if len(steps) <= 6:
                orders += [o for o in itertools.permutations(first) if o != first and valid(o)]
            for rank_of_order, order in enumerate(orders):
                apart = self._nested(s, d, order, rs_dim)
                merging = sum(step[0] in _FLATTENED for step in apart) >= 2
                flat = self._merged(s, apart, divisors) if merging else apart
                for k, expanded in enumerate((apart, flat) if flat != apart else (apart,)):
                    key = (
                        self._unit_cost(expanded),
                        self._latency(expanded),
                        len(expanded),
                        rank_of_order,
                    )
                    if key[0] < best_key[k][0] * (1 - 1e-12) or (
                        key[0] <= best_key[k][0] * (1 + 1e-12) and key[1:] < best_key[k][1:]
                    ):
                        best[k], best_key[k] = expanded, key
        return best[0], best[1] or best[0]

    def _latency(self, steps: Sequence[tuple[str, Any, _Code]]) -> float:
        """Latency seconds of ``steps`` (their alpha terms, whatever the bytes): between
        two sequences of equal bandwidth, the one with fewer or faster steps (a scalar's
        all-reduce over two mesh dims runs per dim, 1 + 3 steps, not as one ring of 7)."""
        total = 0.0
        for kind, i, _ in steps:
            if kind != "slice":
                n, alpha, _ = self._links(i)
                total += (2 if kind == "all_reduce" else 1) * (n - 1) * alpha
        return total

    def _unit_cost(self, steps: Sequence[tuple[str, Any, _Code]]) -> float:
        """Bandwidth seconds of ``steps`` on a tensor of one byte per device at the start."""
        local, total = 1.0, 0.0
        for kind, i, _ in steps:
            n, _, bw = self._links(i)
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

    def _merged(
        self, s: tuple, steps: Sequence[tuple[str, int, _Code]], divisors: tuple[int, ...]
    ) -> tuple[tuple[str, Any, _Code], ...]:
        """``steps`` (from codes ``s``) with each run of consecutive like collectives on
        several mesh dims made one collective over their flattened group, as DTensor runs
        them where the mesh has that group flattened (``_optimize_transform_infos`` in
        ``torch.distributed.tensor._redistribute``; the launcher flattens every group of
        mesh dims, :func:`autoshard._torch_private.flatten_mesh_groups`), and as FSDP2
        runs its collectives over a flattened data-parallel mesh: ``(S(0), S(0)) -> (R,
        R)``, one all-gather over both dims. DTensor's rule: the same kind (all-gather,
        reduce-scatter or all-reduce), the same placement before and after on each dim,
        all-gathers innermost dim first, reduce-scatters outermost first, and a
        reduce-scatter only when its tensor dim splits evenly over the group; here, over
        every mesh dim that shards it afterwards (``divisors``, :meth:`_divisors`), which
        implies DTensor's condition. The merged step's mesh dim is the group, ascending.
        """
        current = list(s)
        out: list[tuple[str, Any, _Code]] = []
        k = 0
        while k < len(steps):
            kind, i, after = steps[k]
            j = k + 1
            if kind in _FLATTENED:
                while j < len(steps) and steps[j][0] == kind and steps[j][2] == after:
                    if current[steps[j][1]] != current[i]:
                        break
                    j += 1
            group = [step[1] for step in steps[k:j]]
            if len(group) > 1 and self._flattens(kind, group, current, after, divisors):
                out.append((kind, tuple(sorted(group)), after))
                for g in group:
                    current[g] = after
                k = j
                continue
            out.append((kind, i, after))
            current[i] = after
            k += 1
        return tuple(out)

    def _flattens(
        self, kind: str, group: list[int], current: list, after: _Code, divisors: tuple
    ) -> bool:
        """Whether DTensor runs ``kind`` on mesh dims ``group`` (in this order, from the
        codes ``current``, each to ``after``) as one collective over their flattened group:
        all-gathers innermost dim first, reduce-scatters outermost first; a reduce-scatter
        only where every other mesh dim is replicated (from ``(S(0), P, P)`` DTensor's
        greedy planner all-reduces one dim and slices it again) and the tensor dim splits
        evenly over the group (``divisors``)."""
        if kind == "all_gather":
            return group == sorted(group, reverse=True)
        if kind != "reduce_scatter":
            return True  # all-reduces, in any order
        others = (m for m in range(len(current)) if m not in group)
        return (
            group == sorted(group)
            and all(current[m] == _R or self.mesh.shape[m] == 1 for m in others)
            and divisors[after] % math.prod(self.mesh.shape[m] for m in group) == 0
        )

    def _nested(
        self, s: tuple, d: tuple, order: Sequence[tuple[str, int]], rs_dim: int | None = None
    ) -> tuple[tuple[str, int, _Code], ...]:
        """``order``'s steps as DTensor runs them, each ``(kind, mesh dim, code after)``,
        with the extra steps nested sharding needs; ``rs_dim``: the tensor dim a split
        all-reduce's reduce-scatter shards.

        DTensor shards a tensor dim over several mesh dims left to right (``(S(0), S(0))``
        cuts dim 0 by mesh dim 0, then each piece by mesh dim 1). A step on mesh dim ``i``
        that shards or unshards tensor dim ``t`` while a later mesh dim ``m > i`` holds
        ``Shard(t)`` breaks that nesting, so DTensor's redistribute planner
        (``generate_greedy_transform_infos`` in ``torch.distributed.tensor._redistribute``)
        first all-gathers ``m`` (innermost first), then runs the step, then slices ``m``
        again. Here a gathered ``m`` goes straight to its target instead (a slice, itself
        checked the same way, or nothing), and its own later step is dropped. So
        ``(S(0), S(0)) -> (R, R)`` is an all-gather on mesh dim 1, then on mesh dim 0, the
        order DTensor must use.
        """
        current = list(s)
        done: set[int] = set()  # mesh dims already at (or on their way to) their target
        out: list[tuple[str, int, _Code]] = []
        queue: list[tuple[str, int]] = list(order)
        while queue:
            kind, i = queue.pop(0)
            if kind == "reslice":
                kind, after = "slice", d[i]
            elif i in done:
                continue
            else:
                after = rs_dim if kind == "reduce_scatter" and d[i] == _R else d[i]
            dims = {c for c in (current[i], after) if not isinstance(c, str) and c >= 0}
            nested = [
                m
                for m in range(i + 1, len(current))
                if not isinstance(current[m], str) and current[m] in dims and self.mesh.shape[m] > 1
            ]
            for m in reversed(nested):
                out.append(("all_gather", m, _R))
                current[m] = _R
            out.append((kind, i, after))
            current[i] = after
            reslices = []
            for m in nested:
                done.add(m)
                if not isinstance(d[m], str) and d[m] >= 0:
                    reslices.append(("reslice", m))
                else:
                    current[m] = d[m]  # Replicate, or Replicate -> Partial (local)
            queue = reslices + queue
        return tuple(out)

    def _encode(self, placements: Sequence[Placement], tensor_ndim: int, what: str) -> tuple:
        """Placements -> codes (Replicate -> -1, Shard(d) -> d >= 0, Partial(op) -> op)."""
        if len(placements) != self.mesh.ndim:
            raise AutoshardError(
                f"{what} placements {tuple(placements)} are {len(placements)} for the "
                f"{self.mesh.ndim} mesh dims of the {self.mesh.shape_str} mesh: "
                "give one per mesh dim"
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


def _placement(code: _Code, fallback: Placement) -> Placement:
    """The placement a code stands for (``fallback`` for a Partial, whose op it keeps)."""
    if isinstance(code, str):
        return fallback
    return Replicate() if code == _R else Shard(code)


@functools.lru_cache(maxsize=64)
def comm_model(mesh: MeshSpec) -> CommModel:
    """The :class:`CommModel` of ``mesh``, one per distinct mesh (meshes are frozen and
    hashable), so that the resharding memo is shared by the whole solve."""
    return CommModel(mesh)


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
