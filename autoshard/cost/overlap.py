"""Communication hidden under compute: gradient reductions and parameter prefetch.

Two kinds of collectives run on their own stream beside the compute, as in PyTorch DDP
(gradient buckets reduced while the backward pass goes on) and FSDP (the next block's
parameters gathered while the current block computes):

* a **gradient reduction** (the edge into a gradient output) can hide under the compute
  of the segment after the one that produces the gradient;
* a **parameter gather** (an edge whose source variable is a parameter: the parameter
  resharded for an op that wants it in another placement, forward or backward) can hide
  under the compute of the segment before the one that reads it.

Segments are a step's blocks, forward and backward, and the parts outside them
(:mod:`autoshard.strategies.hiding`, which gives the schedule and its sources). Every
other resharding sits on the critical path (an activation is needed at once), and so
does a gather for the first segment and a reduction of a gradient of the last.

Model (continuous savings variables after meta-pytorch/autoparallel's open PR #353,
with windows as real schedules have them instead of one pool for the whole step): for
each overlappable edge ``e`` and segment ``w`` whose compute can hide some of it, a
saving ``0 <= z_ew``, with

* ``z_ew <= c_ew``: no more than the edge's communication hidden there (``c_ew`` the
  part of ``c_e = r_e . y_e`` its members owned by that window make);
* ``sum_e z_ew <= C_w``: one communication stream per window, so a second of the
  window's compute ``C_w`` (linear in the chosen strategies, over all its real copies)
  hides at most a second of communication;
* ``sum_{e in g} z_ew <= h_g C_w`` per group ``g`` (the uses of one kind that one segment
  makes): only the copies of the window next to that segment's copies hide them, the
  share ``h_g`` of :meth:`~autoshard.strategies.hiding.Schedule.hosts`. A middle block
  traced once for ``m`` real ones hides ``m - 1`` copies of its own gathers (and of its
  own reductions) under ``m - 1`` of its copies and one copy of its neighbour's under
  one; the neighbouring block hides the middle block's one remaining copy
  (:meth:`~autoshard.strategies.hiding.Schedule.windows`). So no plan hides more
  communication than it has compute, and gathers and reductions of the same copies
  share one stream. (Until 2026-12-04 the neighbouring block hid all ``m`` copies, one
  second of its compute for ``m`` of theirs, for gathers and reductions apart: FSDP's
  backward hid both under one block's compute counted twice, Llama-2 13B on 64 A100
  3.83 s of collectives under 3.09 s of compute.)

Hidden communication is not free: compute that runs beside a collective runs slower
(the collective's kernels take SMs and memory bandwidth from it). Lee et al.,
"Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
Learning: Performance and Power Implications" (arXiv 2507.03114, 2025), measured GPT and
Llama training on 4 A100s, H100s, MI250s and MI210s: overlapped compute ran on average
18.9% slower (40.0% at most) than alone (:data:`OVERLAP_SLOWDOWN`). So ``c`` seconds of
communication overlapped with compute stretch that compute by ``s c``, and the step
saves ``c - s c / (1 + s) = c / (1 + s)`` (:func:`saving`), while a window's compute
``C`` overlaps at most ``(1 + s) C`` of communication, which saves ``C``. Each ``c_ew``
above is the saving, ``c / (1 + s)``; the caps keep ``C_w``.

The objective subtracts ``sum z``. For a fixed plan each window is a fractional
knapsack with unit weights and nested caps (the groups inside the window's pool), whose
optimum the greedy fill gives (:func:`hidden_seconds`: each saving takes what its group
and the pool have left), so the ILP's objective and a plan's predicted step time are one price.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.hiding import GATHER, GRADIENT, schedule

OVERLAP_SLOWDOWN = 0.189
"""How much slower compute runs while a collective runs beside it: the mean of Lee et
al.'s measurements (arXiv 2507.03114, abstract: "an average computational slowdown of
18.9%, with a maximum of 40.0%"; GPT and Llama on 4 A100, H100, MI250 and MI210 GPUs)."""


def saving(seconds: float | np.ndarray) -> float | np.ndarray:
    """What ``seconds`` of communication overlapped with compute save on the step:
    ``seconds / (1 + OVERLAP_SLOWDOWN)`` (the module docstring): the compute beside it
    runs :data:`OVERLAP_SLOWDOWN` slower."""
    return seconds / (1.0 + OVERLAP_SLOWDOWN)


@dataclass(frozen=True)
class Overlap:
    """What a plan hides: seconds saved per overlappable edge (index into ``sg.edges``),
    :func:`saving` of the communication it overlaps."""

    hidden_s: dict[int, float]

    @property
    def total_s(self) -> float:
        return float(sum(self.hidden_s.values()))


def window_vectors(sg: StrategyGraph) -> list[dict[str, np.ndarray]]:
    """Per segment of the step (:func:`~autoshard.strategies.hiding.schedule`): for each
    representative with nodes there, the seconds of their compute per strategy (times
    each node's multiplicity; no optimizer step, no resharding): ``C_w`` of the module
    docstring, as vectors."""
    cache = sg.__dict__.get("_window_vectors")
    if cache is not None:
        return cache
    sched = schedule(sg.graph)
    out: list[dict[str, np.ndarray]] = [{} for _ in sched.mult]
    nodes = sg.graph.nodes
    for name, ns in sg.nodes.items():
        info = nodes.get(name)
        w = sched.segment.get(name)
        if info is None or info.kind != "op" or w is None or name in sg.not_compute:
            continue
        per = ns.compute_s[ns.choice]
        held = out[w].get(ns.rep)
        out[w][ns.rep] = per.copy() if held is None else held + per
    sg.__dict__["_window_vectors"] = out
    return out


def overlappable(sg: StrategyGraph) -> list[int]:
    """Indices of the edges of ``sg`` that can hide (see the module docstring)."""
    if not sg.overlap:
        return []
    return [i for i, e in enumerate(sg.edges) if e.overlap in (GRADIENT, GATHER) and e.hide]


def hidden_seconds(sg: StrategyGraph, choice: dict[str, int]) -> Overlap:
    """Seconds of communication a plan hides under compute: per window, the greedy fill
    of the module docstring (the optimum of its LP: every saving weighs 1 and its caps are
    nested, the window's compute over the compute of the copies that host each group);
    0 when ``sg.overlap`` is off."""
    sched = schedule(sg.graph)
    vectors = window_vectors(sg)
    items: dict[int, list[tuple[tuple[int, str], int, float]]] = defaultdict(list)
    for i in overlappable(sg):
        e = sg.edges[i]
        a, b = e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]
        for key in sorted(e.hide):
            u = saving(float(e.cost[a, b]) * e.hide_share(key))
            if u > 0:
                items[key[0]].append(((key[1], e.overlap), i, u))
    hidden: dict[int, float] = {}
    for w in sorted(items):
        left = sum(float(v[choice[r]]) for r, v in vectors[w].items())
        group_left = {g: sched.hosts(w, g[0]) * left for g, _, _ in items[w]}
        for g, i, u in items[w]:
            z = max(0.0, min(u, left, group_left[g]))
            hidden[i] = hidden.get(i, 0.0) + z
            left -= z
            group_left[g] -= z
    return Overlap(hidden)
