"""One rank of a launch: ``torchrun ... -m autoshard.launch PLAN MODEL [OPTIONS]``.

A pipeline stage plan (``autoshard stages``) runs as a pipeline
(:mod:`autoshard.launch.pipeline`); a sharding map (``autoshard solve``) as SPMD
(:mod:`autoshard.launch.spmd`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import click

from autoshard.errors import AutoshardError
from autoshard.launch import spmd
from autoshard.launch.options import RunOptions, run_options
from autoshard.pipeline.stage_plan import is_stage_plan


def run_rank(plan: Path, model: Path, opts: RunOptions) -> int:
    """The per-rank body of a launch; call under torchrun. Returns the exit code.

    Raises:
        AutoshardError: as :func:`autoshard.launch.spmd.run_rank` or
            :func:`autoshard.launch.pipeline.run_rank`.
    """
    if is_stage_plan(plan):
        # torch.distributed.pipelining costs a rank 2.4 s of imports (measured with
        # ``python -X importtime``): only a pipeline's ranks pay it
        from autoshard.launch import pipeline

        return pipeline.run_rank(plan, model, opts)
    return spmd.run_rank(plan, model, opts)


@click.command("autoshard.launch", context_settings={"help_option_names": ["-h", "--help"]})
@run_options
def rank_command(plan: Path, model: Path, **run: Any) -> None:
    """One rank of a launch; run it as: torchrun ... -m autoshard.launch PLAN MODEL [OPTIONS]."""
    rank = int(os.environ.get("RANK", "0"))
    try:
        rc = run_rank(plan, model, RunOptions(**run))
    except AutoshardError as exc:
        # Plan, model and world-size errors are the same on every rank: say it once.
        if rank == 0:
            click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    # The process group is destroyed and every file written: leave without the
    # interpreter's finalization, where a collective backend's worker thread still alive
    # can abort the process ("terminate called without an active exception", seen once
    # on a loaded machine after a passing --check; pytorch/pytorch PR 179291 describes
    # such finalization crashes of gloo's threads).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
