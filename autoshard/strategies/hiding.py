"""Which tensor uses can hide under compute, and how much compute is there to hide them.

Two kinds of resharding run on a stream of their own beside the compute (as PyTorch DDP
reduces gradient buckets and FSDP prefetches parameters): a ``GRADIENT`` reduction (the
use of a gradient output) and a parameter ``GATHER`` (a parameter resharded for an op).
The strategy graph marks each edge with its kind and ``f_e``, the share of compute
available to hide it; :mod:`autoshard.cost.overlap` prices the hiding from them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autoshard.trace.tracer import TracedGraph

GRADIENT = "gradient"
GATHER = "gather"


def hide_share_fn(graph: TracedGraph) -> Callable[[str, str, str], float]:
    """``f_e`` of a tensor use ``(kind, producer, consumer)``: for a gradient, the share of
    the backward FLOPs after its producer; for a gather, the share of all FLOPs before its
    consumer; 0 otherwise (:mod:`autoshard.cost.overlap`). Node FLOPs are global, times
    multiplicity."""
    names = list(graph.nodes)
    flops = np.array(
        [i.flops * graph.mult(n) if i.kind == "op" else 0.0 for n, i in graph.nodes.items()]
    )
    bwd = np.array([i.backward and i.kind == "op" for i in graph.nodes.values()], dtype=bool)
    total, total_bwd = float(flops.sum()), float(flops[bwd].sum())
    before = np.concatenate([[0.0], np.cumsum(flops)])  # before[k]: FLOPs of nodes < k
    bwd_flops = np.where(bwd, flops, 0.0)
    after = np.concatenate([np.cumsum(bwd_flops[::-1])[::-1][1:], [0.0]])  # nodes > k
    pos = {n: k for k, n in enumerate(names)}

    def share(kind: str, producer: str, consumer: str) -> float:
        if kind == GRADIENT and total_bwd > 0 and producer in pos:
            return float(after[pos[producer]] / total_bwd)
        if kind == GATHER and total > 0 and consumer in pos:
            return float(before[pos[consumer]] / total)
        return 0.0

    return share
