"""``autoshard show FILE``: print a solution, a sharding map or a stage plan readably."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console


@click.command("show")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--nodes", is_flag=True, help="Also list each node's arg and result placements.")
@click.option("--all-nodes", is_flag=True, help="With --nodes: list every node, not the first 40.")
def show_command(file: Path, nodes: bool, all_nodes: bool) -> None:
    """Print a solution (.pkl), a sharding map (.json) or a stage plan readably.

    The kind is read from the file's content (a stage plan is what `autoshard stages`
    writes: its stages, their ranks and predictions, each stage's parameters). Solutions
    are loaded safely: a file that references anything but placements and builtins is
    refused, and nothing in it runs.
    """
    from autoshard.pipeline.stage_plan import is_stage_plan, load_stage_plan
    from autoshard.plan.show import render, render_stage_plan  # heavy: torch placements

    if is_stage_plan(file):  # the pipeline's own format
        plan = load_stage_plan(file)  # validated before its predictions are read
        stages = json.loads(file.read_text())["stages"]
        render_stage_plan(file, plan, [s.get("predicted") or {} for s in stages], Console())
        return

    render(file, Console(), nodes=nodes or all_nodes, all_nodes=all_nodes)
