"""A plan's objective: the step time the ILP minimises, for one given choice.

The one price every path agrees on: the ILP's objective at its optimum, a baseline's
cost, a preloaded plan's, the report's block-by-block differences and the brute-force
cross-check all call :func:`evaluate`.
"""

from __future__ import annotations

from autoshard.cost.checkpointing import columns
from autoshard.cost.overlap import hidden_seconds
from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.sharing import shared_seconds


def evaluate(sg: StrategyGraph, choice: dict[str, int], recompute: dict | None = None) -> float:
    """The objective (s) of a given choice, as the ILP counts it: compute (with the
    optimizer step) plus resharding (a tensor moved once per wanted placement for the
    readers that share it, :mod:`autoshard.strategies.sharing`), less the communication
    hidden under compute (:func:`autoshard.cost.overlap.hidden_seconds`), plus the
    forward passes of the blocks ``recompute`` names ((layer, policy) -> how many real blocks;
    :meth:`autoshard.cost.checkpointing.Checkpointing.seconds`)."""
    total = sum(float(sg.rep_cost(r)[choice[r]]) for r in sg.reps)
    for e in sg.edges:
        total += float(e.cost[e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]])
    total += shared_seconds(sg, choice)
    if sg.overlap and sg.graph is not None:
        total -= hidden_seconds(sg, choice).total_s
    if columns(sg) is not None:
        total += sg.checkpointing.seconds(sg, choice, recompute)
    return total
