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
from autoshard.errors import AutoshardError, ProgramTooLargeError
from autoshard.plan.plan import Plan
from autoshard.solver.baselines import hand_plan_starts, plan_for_algo
from autoshard.solver.ilp import check_size
from autoshard.solver.options import COMPARED
from autoshard.solver.solve import finish_plan, solve_within_memory
from autoshard.solver.space import search_space
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
            "recompute_s": float(p.recompute_s),
            "fsdp_s": float(p.fsdp_s),
            "fsdp_bytes": float(p.fsdp_bytes),
            "comm_s": {k: float(p.comm_s.get(k, 0.0)) for k in COLLECTIVE_KINDS},
            "hidden_s": {k: float(p.hidden_s.get(k, 0.0)) for k in COLLECTIVE_KINDS},
            "flops": float(p.step_flops),
            "grad_accumulation": int(p.grad_accumulation),
            "mfu": float(p.mfu),
            "collectives": {k: int(p.collectives.get(k, 0)) for k in COLLECTIVE_KINDS},
            "memory_bytes": float(p.memory_bytes),
            "memory_by_kind": {k: float(v) for k, v in p.memory_by_kind().items()},
            "fits": self.fits,
            "best": self.best,
            "solver_status": self.stats.get("status"),
            "notes": list(self.stats.get("notes", [])),
            **({"space": self.stats["points"]} if "points" in self.stats else {}),
        }


def _check_whole(sg: StrategyGraph, config) -> None:  # noqa: ANN001
    """Refuses the ILP row of a program over ``solve``'s column cap
    (``config.solver.max_columns``, else :data:`MESH_SEARCH_COLUMNS`), which ``solve``
    plans by lifting a plan of a shape with one dim fewer
    (:func:`autoshard.solver.meshes.plan_mesh`): its whole ILP would run for hours.

    Raises:
        AutoshardError: the count, the cap and the command that plans it.
    """
    try:
        check_size(sg, config.solver.capped(), config.mesh)
    except ProgramTooLargeError as exc:
        raise AutoshardError(
            f"its ILP has {exc.columns:,} columns, over the {exc.cap:,} solved whole: "
            f"autoshard solve --mesh {config.mesh.shape_str} plans it (a plan of a shape "
            "with one dim fewer laid onto it and improved)"
        ) from None


def compare_plans(
    config,
    sg,
    algos: tuple[str, ...] = COMPARED,
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
        if a not in COMPARED:
            raise AutoshardError(f"unknown plan {a!r}; choose from {', '.join(COMPARED)}")
    budget = config.budget()

    def finish(sg: StrategyGraph, choice: dict[str, int], name: str, recompute=None) -> Plan:  # noqa: ANN001
        return finish_plan(config, sg, choice, name, recompute)

    rows = []
    for i, algo in enumerate(algos):
        if progress:
            progress("solve", i, len(algos))
        try:
            if algo == "ilp":  # as `solve` plans it: the budget at every point of the step
                _check_whole(sg, config)
                starts, _ = hand_plan_starts(sg, config.mesh)
                result = solve_within_memory(sg, config, starts)
                plan = finish(sg, result.choice, "ilp", result.recompute)
                stats = result.stats()
            elif algo == "torchtitan":  # the fastest plan FSDP2 + parallelize_module express
                best, points = search_space(config, sg)
                plan = best.plan
                stats = {
                    "status": f"space torchtitan ({best.name})",
                    "chosen": best.name,
                    "points": [p.to_dict() for p in points],
                }
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
    "unsharded_parameters": "unsharded",
}


def comparison_tables(rows: list[ComparedPlan], title: str, budget: float | None) -> list[Table]:
    """Three tables with one row per plan, each within 80 columns with whole plan names:
    the step (time, compute, recomputation when a plan recomputes, optimizer step,
    exposed collectives, MFU, memory, whether it fits ``budget``), the collectives (each
    kind's time and what hides), the memory per device by kind."""
    done = [r for r in rows if r.plan is not None]
    kinds = [k for k in COLLECTIVE_KINDS if any(r.plan.comm_s.get(k) for r in done)]
    mem_kinds: list[str] = []
    for r in done:
        for k in r.plan.memory_by_kind():
            if k not in mem_kinds:
                mem_kinds.append(k)

    def table(caption: str | None, headers: list[str], table_title: str | None = None) -> Table:
        t = Table(
            title=table_title,
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            collapse_padding=True,
            caption=caption,
        )
        t.add_column("plan", no_wrap=True)
        for h in headers:
            t.add_column(h, justify="right", no_wrap=True)
        return t

    def add(t: Table, cells) -> None:  # noqa: ANN001 - (plan, row) -> list[str]
        for r in rows:
            name = f"{r.name} *" if r.best else r.name
            if r.plan is None:
                t.add_row(f"[red]{name}[/red]", "[red]no plan[/red]", *[""] * (len(t.columns) - 2))
                continue
            values = cells(r.plan, r)
            if r.best:
                name, values = (
                    f"[bold green]{name}[/bold green]",
                    [f"[bold]{v}[/bold]" for v in values],
                )
            t.add_row(name, *values)

    recomputes = any(r.plan.recompute_s for r in done)
    copies = any(r.plan.fsdp_s for r in done)
    # compare_plans marks the fastest of all when none fits: the legend says which
    within = f" in {format_bytes(budget)}" if budget is not None else ""
    fits = any(r.fits for r in done)
    star = f"* fastest that fits{within}" if fits else f"* fastest (none fits{within})"
    step = table(
        star
        + "\nstep = compute + "
        + ("recomp. + " if recomputes else "")
        + "optim. + exposed"
        + ("\ncompute: with FSDP's copies where FSDP runs the plan" if copies else ""),
        ["step", "compute", *(["recomp."] if recomputes else []), "optim.", "exposed"]
        + ["MFU", "memory", "fits"],
        title,
    )
    add(
        step,
        lambda p, r: [
            format_seconds(p.step_time_s),
            format_seconds(p.compute_s + p.fsdp_s),
            *([format_seconds(p.recompute_s) if p.recompute_s else "-"] if recomputes else []),
            format_seconds(p.optimizer_s) if p.optimizer_s else "-",
            format_seconds(sum(p.comm_s.values()) - p.hidden_total_s) if p.comm_s else "-",
            f"{p.mfu:.1%}",
            format_bytes(p.memory_bytes),
            "yes" if r.fits else "[red]no[/red]",
        ],
    )
    tables = [step]
    if kinds:
        comm = table(
            "hidden: of the collectives, what overlapping with compute saves (exposed = "
            "collectives - hidden)",
            [*(_LABEL[k] for k in kinds), "hidden", *(["FSDP copies"] if copies else [])],
            "collectives per step",
        )
        add(
            comm,
            lambda p, r: [
                *(format_seconds(p.comm_s[k]) if p.comm_s.get(k) else "-" for k in kinds),
                format_seconds(p.hidden_total_s) if p.hidden_s else "-",
                *([format_seconds(p.fsdp_s) if p.fsdp_s else "-"] if copies else []),
            ],
        )
        tables.append(comm)
    memory = table(
        None, [_LABEL.get(k, k.replace("_", " ")) for k in mem_kinds], "memory per device"
    )
    add(
        memory,
        lambda p, r: [
            format_bytes(p.memory_by_kind()[k]) if k in p.memory_by_kind() else "-"
            for k in mem_kinds
        ],
    )
    tables.append(memory)
    return tables
