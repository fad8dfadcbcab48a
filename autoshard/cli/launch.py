"""``autoshard launch``: check a plan against the model, then run it under torchrun."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from autoshard.cli.options import check_writable_file
from autoshard.launch.options import RunOptions, run_options
from autoshard.launch.torchrun import rank_environment, torchrun_argv


@click.command(
    "launch",
    context_settings={"help_option_names": ["-h", "--help"]},
    epilog="Anything after -- goes to torchrun, e.g. "
    "-- --nnodes 2 --rdzv-endpoint host:29500 --rdzv-id job1.",
)
@run_options
@click.argument("torchrun_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- TORCHRUN...]")
def launch_command(plan: Path, model: Path, torchrun_args: tuple[str, ...], **run: Any) -> None:
    """Run MODEL sharded per the sharding map PLAN (JSON) under torchrun. PLAN may also be
    a stage plan from `autoshard stages`, run as a pipeline (pp x intra-stage sharding).

    Checks the map against the model first, then starts one process per device of the
    map's mesh on this node (torchrun --standalone) and exits with torchrun's exit code.
    """
    # heavy (torch): only once the command runs
    from autoshard.launch.observed import check_launchable, prepare_program
    from autoshard.launch.pipeline import prepare_launch
    from autoshard.launch.validate import check_plan
    from autoshard.model.model_file import instantiate, load_model_file
    from autoshard.pipeline.stage_plan import is_stage_plan
    from autoshard.plan.formats import load_sharding_map

    opts = RunOptions(**run)
    if opts.json_path is not None:  # before any rank starts: a run's report is never lost
        if not str(opts.json_path).strip():
            raise click.UsageError("Invalid value for '--json': is empty: give a file to write")
        check_writable_file(Path(opts.json_path), "--json")
    if is_stage_plan(plan):
        n_devices = prepare_launch(plan, model)
    else:
        smap = load_sharding_map(plan)
        mf = load_model_file(model)
        check_plan(smap, instantiate(mf, device="meta"), mf.path.name)
        check_launchable(smap)  # every --mode: a solution it cannot run as priced
        if opts.mode == "plan":  # the plan must describe this model's graph: refuse now
            prepare_program(smap, mf, opts)
        n_devices = smap.world_size
    argv = torchrun_argv(plan, model, opts, torchrun_args, n_devices)

    env = rank_environment(os.environ, Path(__file__).resolve().parents[2])
    click.echo("running: " + shlex.join(argv), err=True)
    sys.exit(subprocess.run(argv, env=env, check=False).returncode)
