"""``autoshard compare``: the ILP's plan beside the hand-written plans, on one graph."""

from __future__ import annotations

import json

import click
from rich.console import Console
from rich.markup import escape

from autoshard.cli.options import (
    NonEmptyPath,
    Progress,
    config_from_options,
    mesh_options,
    plan_options,
    report_console,
)
from autoshard.errors import AutoshardError
from autoshard.solver.options import COMPARED


@click.command("compare")
@click.argument("model_file", type=NonEmptyPath())
@mesh_options
@plan_options
@click.option(
    "--plans",
    "plans",
    default=",".join(COMPARED),
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
    """Compare the ILP's plan with replicate, DDP, FSDP, Megatron(-SP) and the fastest plan
    torchtitan's styles express (solve --space torchtitan) on MODEL_FILE.

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
    # heavy (torch, HiGHS): only once the command runs
    from autoshard.solver.baselines import TWO_D_ONLY
    from autoshard.solver.compare import compare_plans, comparison_tables
    from autoshard.solver.solve import strategies, trace

    config = config_from_options(model_file, opts)
    mesh, device = config.mesh, config.device
    algos = tuple(dict.fromkeys(a.strip() for a in plans.split(",") if a.strip()))  # once each
    if not algos:
        raise AutoshardError(f"--plans names no plan: give one or more of {', '.join(COMPARED)}")
    if plans == ",".join(COMPARED) and mesh.ndim < 2:  # the default: no duplicate column
        algos = tuple(a for a in algos if a not in TWO_D_ONLY)
    budget = config.budget()
    err = Console(stderr=True)
    with Progress(err, config.grad_accumulation) as progress:
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
    console = report_console()
    title = (
        f"{graph.model_name} on mesh {mesh.shape_str} ({', '.join(mesh.dim_names)}), "
        f"device {device.name}: predicted time and memory per device"
    )
    if config.grad_accumulation > 1:
        title += (
            f", a step of {config.grad_accumulation} micro-batches (gradient accumulation), "
            "one micro-batch's memory"
        )
    for table in comparison_tables(rows, title, budget):
        console.print(table)
    for r in rows:
        if r.error:
            console.print(f"[red]{r.name}[/red]: {escape(r.error)}")
        for note in r.stats.get("notes", []):
            console.print(f"[yellow]{r.name}[/yellow]: {escape(note)}")
