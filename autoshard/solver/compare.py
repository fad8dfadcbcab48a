"""The ILP's plan beside the hand-written baselines, on one graph (``autoshard compare``).

The model is traced and its strategies generated ONCE; the ILP and every baseline
(:mod:`autoshard.solver.baselines`) are then solved on the same
:class:`~autoshard.strategies.graph.StrategyGraph` with the same cost model, so their numbers
are comparable and the ILP's step time is never above a baseline's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rich import box
from rich.table import Table

from autoshard.cost.collective_table import COLLECTIVE_KINDS, COLLECTIVES
from autoshard.errors import AutoshardError
from autoshard.plan.plan import Plan
from autoshard.solver.baselines import ALGOS, hand_plan_starts, plan_for_algo
from autoshard.solver.solve import finish_plan, solve_within_memory
from autoshard.strategies.graph import StrategyGraph
from autoshard.units import format_bytes, format_seconds

# Plans whose step times differ by less than this (relative) tie: the ILP and a baseline
# that reach the same optimum are both marked best.
TIE_REL_TOL = 1e-6


@dataclass
class ComparedPlan:
    """One row of the comparison: a plan, or the error that kept it from existing."""

    name: str
    plan: Plan | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    fits: bool = False
    best: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins for ``--json`` (seconds and bytes)."""
        if self.plan is None:
            return {
                "name": self.name,
                "error": self.error,
                "step_time_s": None,
                "memory_bytes": None,
                "fits": False,
                "best": False,
            }
        p = self.plan
        return {
            "name": self.name,
            "step_time_s": float(p.step_time_s),
            "compute_s": float(p.compute_s),
            "optimizer_s": float(p.optimizer_s),
            "comm_s": {k: float(p.comm_s.get(k, 0.0)) for k in COLLECTIVE_KINDS},
            "hidden_s": {k: float(p.hidden_s.get(k, 0.0)) for k in COLLECTIVE_KINDS},
            "flops": float(p.step_flops),
            "mfu": float(p.mfu),
            "collectives": {k: int(p.collectives.get(k, 0)) for k in COLLECTIVE_KINDS},
            "memory_bytes": float(p.memory_bytes),
            "memory_by_kind": {k: float(v) for k, v in p.memory_by_kind().items()},
            "fits": self.fits,
            "best": self.best,
            "solver_status": self.stats.get("status"),
            "notes": list(self.stats.get("notes", [])),
        }


def compare_plans(
    config,
    sg,
    algos: tuple[str, ...] = ALGOS,
    progress=None,
) -> list[ComparedPlan]:
    """Solve each of ``algos`` on the strategy graph ``sg``; mark which fit and which are best.

    ``config``: the :class:`~autoshard.solver.solve.SolveConfig` ``sg`` was built for (mesh,
    solver options, mode and memory budget). The ILP honours the memory budget as
    ``solve`` does; a baseline is what it is, and ``fits`` says whether its predicted
    memory per device is within the budget. A plan that cannot be made (the ILP when no
    plan fits the budget) becomes a row with its error. ``best``: the fastest plan among
    those that fit (among all when none fits), ties within :data:`TIE_REL_TOL` all marked.

    Raises:
        AutoshardError: an unknown algo.
    """
    for a in algos:
        if a not in ALGOS:
            raise AutoshardError(f"unknown plan {a!r}; choose from {', '.join(ALGOS)}")
    budget = config.budget()

    def finish(sg: StrategyGraph, choice: dict[str, int], name: str, recompute=None) -> Plan:  # noqa: ANN001
        return finish_plan(config, sg, choice, name, recompute)

    rows = []
    for i, algo in enumerate(algos):
        if progress:
            progress("solve", i, len(algos))
        try:
            if algo == "ilp":  # as `solve` plans it: the budget at every point of the step
                starts, _ = hand_plan_starts(sg, config.mesh)
                result = solve_within_memory(sg, config, starts)
                plan = finish(sg, result.choice, "ilp", result.recompute)
                stats = result.stats()
            else:
                plan, stats = plan_for_algo(sg, algo, config.mesh, config.solver, None, finish)
        except AutoshardError as exc:  # e.g. no plan fits the budget: say so in its row
            rows.append(ComparedPlan(algo, error=str(exc)))
            continue
        rows.append(ComparedPlan(algo, plan, stats, fits=plan.memory_bytes <= budget))
    if progress:
        progress("solve", len(algos), len(algos))
    mark_best(rows)
    return rows


def mark_best(rows: list[ComparedPlan]) -> None:
    """Set ``best`` on the fastest rows that fit (on the fastest of all when none fits),
    ties within :data:`TIE_REL_TOL` all marked."""
    done = [r for r in rows if r.plan is not None]
    pool = [r for r in done if r.fits] or done
    if pool:
        fastest = min(r.plan.step_time_s for r in pool)
        for r in pool:
            r.best = math.isclose(r.plan.step_time_s, fastest, rel_tol=TIE_REL_TOL, abs_tol=1e-15)


_LABEL = {
    **{kind: c.title for kind, c in COLLECTIVES.items()},
    "optimizer_state": "optimizer",
    "saved_activations": "saved activ.",
}


def comparison_table(rows: list[ComparedPlan], title: str, budget: float | None) -> Table:
    """One column per plan; rows: step time, ratio to the best, compute, each collective's
    time, memory per device by kind and in total, and whether it fits ``budget``.

    Plans are columns so that the table stays readable in 80 columns.
    """
    done = [r for r in rows if r.plan is not None]
    kinds = [k for k in COLLECTIVE_KINDS if any(r.plan.comm_s.get(k) for r in done)]
    mem_kinds: list[str] = []
    for r in done:
        for k in r.plan.memory_by_kind():
            if k not in mem_kinds:
                mem_kinds.append(k)
    best = min((r.plan.step_time_s for r in done if r.best), default=None)
    table = Table(
        title=title,
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption="* fastest plan that fits"
        + (f" in {format_bytes(budget)}" if budget is not None else "")
        + "; step = compute + optimizer + communication - hidden",
    )
    table.add_column("", no_wrap=True)
    for r in rows:
        header = r.name.replace("_", "\n_") + ("\n*" if r.best else "")
        table.add_column(
            f"[bold green]{header}[/bold green]" if r.best else header,
            justify="right",
            width=max(9, *(len(x) for x in header.split("\n"))),
        )

    def row(label: str, cell, style: str = "") -> None:
        cells = [cell(r.plan, r) if r.plan is not None else "" for r in rows]
        if style:
            label, cells = f"[{style}]{label}[/{style}]", [f"[{style}]{c}[/{style}]" for c in cells]
        table.add_row(label, *cells)

    row("step time", lambda p, r: format_seconds(p.step_time_s), "bold")
    row("vs best", lambda p, r: f"{p.step_time_s / best:.2f}x" if best else "")
    row("compute", lambda p, r: format_seconds(p.compute_s))
    row("optimizer step", lambda p, r: format_seconds(p.optimizer_s) if p.optimizer_s else "-")
    for k in kinds:
        row(_LABEL[k], lambda p, r, k=k: format_seconds(p.comm_s[k]) if p.comm_s.get(k) else "-")
    row("hidden", lambda p, r: f"-{format_seconds(p.hidden_total_s)}" if p.hidden_s else "-")
    row("MFU", lambda p, r: f"{p.mfu:.1%}")
    table.add_section()
    for k in mem_kinds:
        row(
            _LABEL.get(k, k.replace("_", " ")),
            lambda p, r, k=k: (
                format_bytes(p.memory_by_kind()[k]) if k in p.memory_by_kind() else "-"
            ),
        )
    row("memory", lambda p, r: format_bytes(p.memory_bytes), "bold")
    row("fits", lambda p, r: "yes" if r.fits else "[red]no[/red]")
    if any(r.plan is None for r in rows):
        table.add_row("error", *["" if r.plan is not None else "[red]no plan[/red]" for r in rows])
    return table
