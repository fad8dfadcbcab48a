"""The collectives a plan prices, one row each: their ring formulas, their names in
reports and in torch's functional collectives.

Torch-free (the command line's import path reads it: ``autoshard calibrate`` fits these
formulas); :mod:`autoshard.cost.collectives` prices reshardings with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from autoshard.errors import AutoshardError

CollectiveKind = Literal["all_gather", "all_reduce", "reduce_scatter", "all_to_all", "send_recv"]


@dataclass(frozen=True)
class Collective:
    """One collective kind: everything autoshard knows of it, in one row of
    :data:`COLLECTIVES` (the cost model, calibration, the launcher's counts and the reports
    all read it here).

    Its time on ``n`` devices of a ring, for a tensor of ``B`` bytes in full, with latency
    ``alpha`` per step and bandwidth ``bw`` per device::

        rounds * steps * (alpha + B / (n**spread * bw)),   steps = n - 1 (a ring's)

    ``rounds``: passes around the ring (an all-reduce is a reduce-scatter then an
    all-gather: 2); ``spread``: 1 when each step moves ``1/n`` of the tensor, 2 for an
    all-to-all (each device sends each peer ``1/n`` of its ``1/n``). Source: NCCL tests,
    PERFORMANCE.md (AllGather, ReduceScatter, AllReduce bus bandwidth). ``one_step``: one
    step only (``steps = 1``): a send/recv, each device sending its ``1/n`` of the tensor
    to its ring neighbour while it receives its other neighbour's, both links at once
    (ring attention's pass of a key/value block: Liu et al., "Ring Attention with
    Blockwise Transformers", 2023). ``title``: how reports name it; ``functional_ops``:
    the ``_c10d_functional`` ops (and their coalesced forms) that run it, as DTensor
    issues them; ``own_ops``: autoshard's own ops that run it (``autoshard::p2p_exchange``,
    the send/recv batch autoshard's kernels issue:
    :func:`autoshard._torch_private.p2p_exchange`); ``dtensor_ops``: DTensor's own
    ``_dtensor`` ops that run it (its
    all-to-all between two shardings of one mesh dim, on CUDA); ``comm_debug``: whether
    ``CommDebugMode`` counts it (it does not count point-to-point ops; the launcher's
    collective log does).
    """

    kind: CollectiveKind
    title: str
    rounds: int
    spread: int
    functional_ops: tuple[str, ...]
    dtensor_ops: tuple[str, ...] = ()
    own_ops: tuple[str, ...] = ()
    one_step: bool = False
    comm_debug: bool = True

    def steps(self, n: int) -> int:
        """Steps on ``n`` devices (``n - 1`` around a ring, or one)."""
        return min(1, n - 1) if self.one_step else n - 1

    def coefficients(self, n: int) -> tuple[float, float]:
        """``(a, b)`` of ``t = a alpha + b B / bw`` on ``n`` devices (the formula above)."""
        k = self.rounds * self.steps(n)
        return float(k), k / n**self.spread

    def seconds(self, n: int, alpha: float, bandwidth: float, nbytes: float) -> float:
        """The formula above (0 on one device)."""
        if n == 1:
            return 0.0
        return self.rounds * self.steps(n) * (alpha + nbytes / (n**self.spread * bandwidth))


COLLECTIVES: dict[str, Collective] = {
    c.kind: c
    for c in (
        Collective(
            "all_gather",
            "all-gather",
            1,
            1,
            ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"),
        ),
        Collective("all_reduce", "all-reduce", 2, 1, ("all_reduce", "all_reduce_coalesced")),
        Collective(
            "reduce_scatter",
            "reduce-scatter",
            1,
            1,
            ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        ),
        Collective(
            "all_to_all", "all-to-all", 1, 2, ("all_to_all_single",), ("shard_dim_alltoall",)
        ),
        Collective(
            "send_recv",
            "send/recv",
            1,
            1,
            ("batch_p2p_ops",),
            own_ops=("p2p_exchange",),
            one_step=True,
            comm_debug=False,
        ),
    )
}
"""Every collective a plan prices, by kind, in the order reports list them."""

COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = tuple(COLLECTIVES)  # type: ignore[assignment]

FUNCTIONAL_OPS: dict[str, str] = {
    **{op: c.kind for c in COLLECTIVES.values() for op in c.functional_ops},
    "broadcast": "broadcast",  # runs (weights from rank 0), never planned
}
"""A ``_c10d_functional`` op's name -> the kind sharding maps count it as."""

LAUNCH_OPS: dict[str, str] = {
    **FUNCTIONAL_OPS,
    **{op: c.kind for c in COLLECTIVES.values() for op in c.dtensor_ops},
    **{op: c.kind for c in COLLECTIVES.values() for op in c.own_ops},
}
"""Every op name a launch's collective counters see (functional collectives and DTensor's
own) -> the kind sharding maps count it as: both counters (CommDebugMode's and the
collective log) read this one map, so their totals by kind can agree."""


def collective(kind: str) -> Collective:
    """The :data:`COLLECTIVES` row of ``kind``.

    Raises:
        AutoshardError: an unknown kind.
    """
    if kind not in COLLECTIVES:
        raise AutoshardError(
            f"unknown collective {kind!r}: use one of {', '.join(COLLECTIVE_KINDS)}"
        )
    return COLLECTIVES[kind]
