"""``autoshard compare``: the ILP's plan beside the hand-written baselines, on one graph.

The model is traced and its strategies generated ONCE; the ILP and every baseline
(:mod:`autoshard.baselines`) are then solved on the same
:class:`~autoshard.strategies.StrategyGraph` with the same cost model, so their numbers
are comparable and the ILP's step time is never above a baseline's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autoshard.baselines import ALGOS, plan_for_algo
from autoshard.cli import _mesh_options, _plan_options, _Progress, config_from_options
from autoshard.errors import AutoshardError
from autoshard.mesh import COLLECTIVE_KINDS
from autoshard.plan import Plan
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

    ``config``: the :class:`~autoshard.solve.SolveConfig` ``sg`` was built for (mesh,
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
    budget = _budget(config)
    memory, finish = _memory_model(config, sg, budget)
    rows = []
    for i, algo in enumerate(algos):
        if progress:
            progress("solve", i, len(algos))
        try:
            plan, stats = plan_for_algo(
                sg, algo, config.mesh, config.solver, memory if algo == "ilp" else None, finish
            )
        except AutoshardError as exc:  # e.g. no plan fits the budget: say so in its row
            rows.append(ComparedPlan(algo, error=str(exc)))
            continue
        rows.append(ComparedPlan(algo, plan, stats, fits=plan.memory_bytes <= budget))
    if progress:
        progress("solve", len(algos), len(algos))
    done = [r for r in rows if r.plan is not None]
    pool = [r for r in done if r.fits] or done
    if pool:
        fastest = min(r.plan.step_time_s for r in pool)
        for r in pool:
            r.best = math.isclose(r.plan.step_time_s, fastest, rel_tol=TIE_REL_TOL, abs_tol=1e-15)
    return rows


def _budget(config) -> float:
    """Bytes per device a plan must fit in: the configured budget or the device's memory."""
    if hasattr(config, "budget"):
        return float(config.budget())
    return float(config.device.memory_bytes)


def _memory_model(config, sg, budget: float):
    """The ILP's memory row and the plan builder ``solve`` uses (training memory kinds).

    Falls back to no memory row and :func:`~autoshard.plan.build_plan` where the tree has
    no training memory model.
    """
    try:
        from autoshard.memory import ilp_row, memory_rows
        from autoshard.solve import finish_plan
    except ImportError:
        return None, None
    memory = (ilp_row(sg, memory_rows(sg, config.memory_model())), budget)
    return memory, lambda sg, choice, name: finish_plan(config, sg, choice, name)


_LABEL = {
    "all_gather": "all-gather",
    "all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
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


@click.command("compare")
@click.argument("model_file", type=click.Path(path_type=Path))
@_mesh_options
@_plan_options
@click.option(
    "--plans",
    "plans",
    default=",".join(ALGOS),
    show_default=True,
    help="Comma-separated plans to compare.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help='Print {"plans": [{"name", "step_time_s", "memory_bytes", "fits", ...}]} '
    "instead of the table.",
)
def compare_command(model_file, plans, as_json, **opts) -> None:
    """Compare the ILP's plan with replicate, DDP, FSDP and Megatron(-SP) on MODEL_FILE.

    Traces the model once, generates its strategies once, then solves the ILP and builds
    each baseline on the same graph and cost model: the placements that style of
    parallelism fixes (parameters, inputs, Megatron's column/row matmuls found from the
    graph), then every other op as DTensor's sharding propagation places it. The fastest
    plan that fits the memory budget is marked with *.

    \b
    Examples:
      autoshard compare examples/gpt2.py --mesh 2x4
      autoshard compare examples/mlp.py --mesh 4 --json
    """
    from autoshard.solve import strategies, trace

    config = config_from_options(model_file, opts)
    mesh, device = config.mesh, config.device
    algos = tuple(a.strip() for a in plans.split(",") if a.strip())
    budget = _budget(config)
    err = Console(stderr=True)
    with _Progress(err) as progress:
        graph = trace(config, progress)
        sg = strategies(config, graph, progress)
        rows = compare_plans(config, sg, algos, progress)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "model": graph.model_name,
                    "mesh": mesh.to_dict(),
                    "device": device.name,
                    "cost_model": config.cost_model(),
                    "memory_budget_bytes": budget,
                    "best": [r.name for r in rows if r.best],
                    "plans": [r.to_dict() for r in rows],
                },
                indent=2,
            )
        )
        return
    console = Console()
    title = (
        f"{graph.model_name} on mesh {mesh.shape_str} ({', '.join(mesh.dim_names)}), "
        f"device {device.name}: predicted time and memory per device"
    )
    console.print(comparison_table(rows, title, budget))
    for r in rows:
        if r.error:
            console.print(f"[red]{r.name}[/red]: {escape(r.error)}")
        for note in r.stats.get("notes", []):
            console.print(f"[yellow]{r.name}[/yellow]: {escape(note)}")
