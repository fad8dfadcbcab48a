"""Communication hidden under compute: gradient reductions and parameter prefetch.

Two kinds of collectives run on their own stream beside the compute, as in PyTorch DDP
(gradient buckets reduced while the backward pass goes on) and FSDP (parameter
all-gathers prefetched under the compute before them):

* a **gradient reduction** (the edge into a gradient output) can hide under the backward
  compute still to run after its gradient is produced;
* a **parameter gather** (an edge whose source variable is a parameter: the parameter
  resharded for an op that wants it in another placement, forward or backward) can hide
  under the compute that runs before its consumer.

Every other resharding sits on the critical path (an activation is needed at once).

Model, after meta-pytorch/autoparallel's open PR #353 (continuous savings variables): for
each overlappable edge ``e`` a saving ``0 <= z_e``, with

* ``z_e <= c_e``: no more than the edge's own communication (``c_e = r_e . y_e``);
* ``z_e <= f_e * C``: no more than the compute that can hide it, ``f_e`` the share of
  that compute available (for a gradient, the share of backward FLOPs after its
  producer; for a gather, the share of all FLOPs before its consumer; summed over the
  tensors of a merged edge), ``C`` the backward compute ``C_bwd`` (gradients) or all
  compute ``C_all`` (gathers), both linear in the chosen strategies;
* ``sum_{gradients} z_e <= C_bwd`` and ``sum_e z_e <= C_all``: one communication stream,
  so a second of compute hides at most a second of communication.

The objective subtracts ``sum_e z_e``. For a fixed plan the savings have a closed form
(:func:`hidden_seconds`): ``u_e = min(c_e, f_e C)``, ``A = min(sum_grad u_e, C_bwd)``,
``hidden = min(A + sum_gather u_e, C_all)``, which is the optimum of that LP, so the ILP's
objective and a plan's predicted step time agree.

Shares ``f_e`` (:func:`autoshard.strategies.hiding.hide_share_fn`, set on each edge
when the strategy graph is built) come from the graph's FLOPs (:attr:`NodeInfo.flops`,
global shapes, times each node's multiplicity): they are constants, so the model stays
linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.hiding import GATHER, GRADIENT


@dataclass(frozen=True)
class Overlap:
    """What a plan hides: seconds per overlappable edge (index into ``sg.edges``)."""

    hidden_s: dict[int, float]

    @property
    def total_s(self) -> float:
        return float(sum(self.hidden_s.values()))


def compute_vectors(sg: StrategyGraph) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per representative: (all compute, backward compute) seconds per strategy.

    The compute of every node merged into the representative (no optimizer step, no
    resharding): ``C_all`` and ``C_bwd`` of the module docstring, as vectors.
    """
    cache = sg.__dict__.get("_compute_vectors")
    if cache is not None:
        return cache
    out = {
        r: (np.zeros(len(sg.nodes[r].strategies)), np.zeros(len(sg.nodes[r].strategies)))
        for r in sg.reps
    }
    nodes = sg.graph.nodes
    for name, ns in sg.nodes.items():
        info = nodes.get(name)
        if info is None or info.kind != "op":  # a parameter's cost is its optimizer step
            continue
        per = ns.compute_s[ns.choice]
        total, backward = out[ns.rep]
        total += per
        if info.backward:
            backward += per
    sg.__dict__["_compute_vectors"] = out
    return out


def overlappable(sg: StrategyGraph) -> list[int]:
    """Indices of the edges of ``sg`` that can hide (see the module docstring)."""
    if not sg.overlap:
        return []
    return [
        i for i, e in enumerate(sg.edges) if e.overlap in (GRADIENT, GATHER) and e.hide_share > 0
    ]


def hidden_seconds(sg: StrategyGraph, choice: dict[str, int]) -> Overlap:
    """Seconds of communication a plan hides under compute (the closed form of the
    module docstring; 0 when ``sg.overlap`` is off)."""
    vectors = compute_vectors(sg)
    c_all = sum(float(vectors[r][0][choice[r]]) for r in sg.reps)
    c_bwd = sum(float(vectors[r][1][choice[r]]) for r in sg.reps)
    bounds: dict[int, float] = {}
    grad_sum = gather_sum = 0.0
    for i in overlappable(sg):
        e = sg.edges[i]
        c = float(e.cost[e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]])
        pool = c_bwd if e.overlap == GRADIENT else c_all
        u = min(c, e.hide_share * pool)
        bounds[i] = u
        if e.overlap == GRADIENT:
            grad_sum += u
        else:
            gather_sum += u
    grad_hidden = min(grad_sum, c_bwd)
    gather_hidden = min(gather_sum, c_all - grad_hidden)
    hidden = {}
    for i, u in bounds.items():
        if sg.edges[i].overlap == GRADIENT:
            hidden[i] = u * (grad_hidden / grad_sum if grad_sum > 0 else 0.0)
        else:
            hidden[i] = u * (gather_hidden / gather_sum if gather_sum > 0 else 0.0)
    return Overlap(hidden)
