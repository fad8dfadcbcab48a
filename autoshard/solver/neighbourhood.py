"""Improving a plan by solving the ILP over its neighbourhoods (large neighbourhood search).

A 3-D mesh's ILP pairs up to ``6^3 = 216`` placements on each side of an edge: the
Llama-70B shape on 4x2x8 has 2,870,566 columns, more than this machine solves
(docs/performance.md). A plan of that mesh (the 2-D ILP's plan laid onto it,
:mod:`autoshard.solver.lifting`) fixes every tensor's placement on every mesh dim. Its
*neighbourhood on the mesh dims* ``D`` is every plan that keeps those placements on the
dims outside ``D`` (:func:`neighbourhood`): per representative, the strategies whose every
output and input placement equals the plan's strategy's on each dim outside ``D`` and
whose own collectives on those dims are of the plan's kinds (an attention's context
parallelism over a fixed dim stays; over a free dim it may go or come); per edge, the
(produced, wanted) placement pairs whose sides such strategies produce and want (any
other pair's column would be held at zero). With one dim of 4x2x8 fixed it has 134,111
columns on the Llama-70B shape (its traced blocks tied), an ILP of a 2-D mesh's size.

The ILP over a neighbourhood (:func:`autoshard.solver.restriction.restrict`, the full
graph's costs, the memory budget's rows) starts from the plan, which lies in it, so its
plan is never slower than the plan as the ILP prices it. :func:`improve` takes the
neighbourhood of each set in ``free`` in turn, each from the best plan so far, for one
pass: every ILP stops at its own work limit (:data:`NEIGHBOURHOOD_WORK`: work counted,
never seconds, so the same plan on every run), each but the last solved without the
overlap savings (faster, and often to the same plan) and the last with them (the outer
dims, whose collectives the savings hide: on the Llama-70B shape it takes 8x8's plan
laid onto 4x2x8 from 1.4043 to 1.3896 s, where without them it stays), a plan kept when
it is cheaper with them. The method is large neighbourhood search
(Shaw, "Using constraint programming and local search methods to solve vehicle routing
problems", CP 1998; Pisinger and Ropke, "Large neighborhood search", Handbook of
Metaheuristics, 2010): a local optimum, with no bound on the whole mesh's optimum.

Recomputation is left as the plan has it: a plan that recomputes some block is not
improved (the restricted graph has no checkpointing decision, :func:`restrict`), and
:func:`improve` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from autoshard import interrupt
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError, ProgramTooLargeError
from autoshard.solver.ilp import check_size
from autoshard.solver.restriction import Restriction, restrict, unrestrict_choice
from autoshard.solver.solve import Progress, SolveConfig, solve_within_memory
from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.strategy import Strategy

NEIGHBOURHOOD_WORK = 5
"""Work units (:data:`autoshard.solver.options.WORK_LIMIT`'s) each neighbourhood's ILP may
take (each MIP of it: each memory round gets its own). The Llama-70B
shape's neighbourhood of dims 1 and 2 of 8x8's plan laid onto 4x2x8 (134,111 columns,
without the overlap savings) took 14.4 s at 5 units, from 1.6741 s to 1.4074 s. On a
graph with its traced blocks untied (253,765 columns) the ILP took 32.5 s at 5 units,
and with the savings 166.7 s at 20 units to the same plan; those plans' prices are not
the model's (an untied depth-reduced graph charges the boundaries between the middle
block's copies at the previous block's placements: docs/performance.md)."""


@dataclass
class Improvement:
    """What :func:`improve` did. ``steps``: per neighbourhood tried, its free mesh dims,
    the columns of its ILP, the ILP's status and the step time (s) of the best plan after
    it; ``before_s`` / ``after_s``: the step time of the plan given and returned;
    ``skipped``: why nothing was tried, or None (both times None then)."""

    choice: dict[str, int]
    before_s: float | None
    after_s: float | None
    steps: list[dict] = field(default_factory=list)
    skipped: str | None = None

    @property
    def improved(self) -> bool:
        """Whether the plan returned is faster than the one given."""
        return self.skipped is None and self.after_s < self.before_s

    def to_dict(self) -> dict:
        """Plain data for the plan's ``extra`` (JSON)."""
        return {
            "before_s": self.before_s,
            "after_s": self.after_s,
            "steps": self.steps,
            "skipped": self.skipped,
            "improved": self.improved,
        }


def _differs_only_on(s: Strategy, s0: Strategy, fixed: Sequence[int]) -> bool:
    """Whether ``s`` has ``s0``'s placement on every mesh dim in ``fixed``, for every
    output and input (a missing one, ``None``, on both), and sends the same kinds of its
    own collective (:attr:`~autoshard.strategies.strategy.Strategy.collectives`) on those
    dims."""
    if len(s.outputs) != len(s0.outputs) or len(s.inputs) != len(s0.inputs):
        return False
    for a, b in zip((*s.outputs, *s.inputs), (*s0.outputs, *s0.inputs), strict=True):
        if a is None or b is None:
            if a is not b:
                return False
            continue
        if any(a[d] != b[d] for d in fixed):
            return False
    on_fixed = set(fixed)
    own = {(c[0], c[1]) for c in s.collectives if c[1] in on_fixed}
    return own == {(c[0], c[1]) for c in s0.collectives if c[1] in on_fixed}


def neighbourhood(sg: StrategyGraph, choice: dict[str, int], free: Sequence[int]) -> Restriction:
    """The plans that keep ``choice``'s placements on every mesh dim not in ``free``, as a
    :class:`~autoshard.solver.restriction.Restriction` of ``sg`` (``choice``: a strategy
    index per representative; it lies in the restriction).

    Raises:
        AutoshardError: a mesh dim in ``free`` outside ``sg``'s mesh.
    """
    ndim = len(sg.mesh_shape)
    if not set(free) <= set(range(ndim)):
        raise AutoshardError(f"mesh dims {sorted(free)} are not all dims of a {ndim}-D mesh")
    fixed = [d for d in range(ndim) if d not in set(free)]
    r = Restriction()
    for rep in sg.reps:
        strategies = sg.nodes[rep].strategies
        s0 = strategies[choice[rep]]
        keep = [i for i, s in enumerate(strategies) if _differs_only_on(s, s0, fixed)]
        r.allowed[rep] = np.array(keep, dtype=np.int64)
    for index, e in enumerate(sg.edges):
        produced = np.zeros(e.cost.shape[0], dtype=bool)
        produced[e.src_groups[r.allowed[e.src]]] = True
        wanted = np.zeros(e.cost.shape[1], dtype=bool)
        wanted[e.dst_groups[r.allowed[e.dst]]] = True
        r.forbid_mask(index, ~(produced[:, None] & wanted[None, :]))
    return r


def pairs_of_dims(ndim: int) -> list[tuple[int, ...]]:
    """The neighbourhoods :func:`improve` takes by default: each pair of mesh dims free,
    the others kept (one dim on a 2-D mesh), the last dims first."""
    if ndim < 3:
        return [(d,) for d in reversed(range(ndim))]
    return [(a, b) for a in reversed(range(ndim)) for b in reversed(range(a + 1, ndim))]


def improve(
    config: SolveConfig,
    sg: StrategyGraph,
    choice: dict[str, int],
    recompute: dict | None = None,
    free: Sequence[Sequence[int]] | None = None,
    progress: Progress | None = None,
    overlap: bool | None = None,
) -> Improvement:
    """``choice`` improved by the ILP over each of its neighbourhoods ``free`` in turn
    (default :func:`pairs_of_dims`), each from the best plan so far, one pass.

    Each neighbourhood's ILP is :func:`~autoshard.solver.solve.solve_within_memory`'s
    under ``config``'s budget, column cap and gap, within :data:`NEIGHBOURHOOD_WORK` work
    units per MIP (or ``config``'s own limit, if lower). ``overlap``: True, each ILP
    prices the overlap savings (the step's own objective, slower); False, none does;
    None (the default), only the last one (with the default ``free``, the outer dims:
    :func:`pairs_of_dims` ends with dims 0 and 1, on a mesh laid over nodes those with
    the slowest links, whose collectives the savings hide). Without the savings an ILP
    is faster and its plan often the same: the Llama-70B shape's 4x2x8 neighbourhood of
    dims 1 and 2 (its traced blocks untied) took 166.7 s at 20 units with them, 32.5 s
    at 5 without, to the same plan; but the last neighbourhood of 8x8's plan laid onto 4x2x8 (tied)
    finds 1.3896 s with them in 6.2 s, 1.4043 s without (docs/performance.md). A plan is
    kept when its price with the savings (:func:`~autoshard.cost.objective.evaluate`,
    the plan's step) is lower.

    Args:
        config: the solve's options (its mesh is ``sg``'s).
        sg: the strategy graph ``choice`` indexes.
        recompute: the plan's recomputed blocks per traced block; a plan that recomputes
            any is returned as it is (``skipped`` says why).

    A neighbourhood over ``config``'s column cap
    (:class:`~autoshard.errors.ProgramTooLargeError`) is passed over; its step in the
    result says why. Any other error is raised: the start lies in every neighbourhood and
    fits the budget, so a neighbourhood always has a plan.
    """
    if recompute and any(recompute.values()):
        why = "the plan recomputes blocks (the neighbourhoods have no checkpointing)"
        return Improvement(dict(choice), None, None, skipped=why)
    solver = config.solver
    limited = replace(
        config, solver=replace(solver, work_limit=min(solver.work_limit, NEIGHBOURHOOD_WORK))
    )
    plain = replace(sg, checkpointing=None)
    before = evaluate(plain, choice)
    found = Improvement(dict(choice), before, before)
    sets = [tuple(f) for f in (free if free is not None else pairs_of_dims(len(sg.mesh_shape)))]
    for k, dims in enumerate(sets):
        savings = overlap if overlap is not None else k == len(sets) - 1
        interrupt.check()  # Ctrl-C, or the mesh search's thread failed
        if progress:
            progress("neighbourhoods", k, len(sets))
        r = neighbourhood(plain, found.choice, dims)
        sub = restrict(plain, r)
        start = {rep: int(np.searchsorted(r.allowed[rep], i)) for rep, i in found.choice.items()}
        step: dict = {"free": list(dims)}
        try:
            check_size(sub, limited.solver, config.mesh)
        except ProgramTooLargeError as exc:  # counted in the result, never a silent pass
            step.update(status=f"not solved: {exc}", step_s=found.after_s)
            found.steps.append(step)
            continue
        sub = replace(sub, overlap=sub.overlap and savings)
        result = solve_within_memory(sub, limited, {"the plan": start})
        step.update(columns=result.num_variables, status=result.status, overlap=sub.overlap)
        new = unrestrict_choice(r, result.choice)
        s = evaluate(plain, new)
        if s < found.after_s:
            found.choice, found.after_s = new, s
        step.update(step_s=found.after_s)
        found.steps.append(step)
    if progress:
        progress("neighbourhoods", len(sets), len(sets))
    return found
