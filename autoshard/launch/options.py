"""What every rank of a launch does, and the options that say it (no torch import: the
command line reads them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from autoshard.errors import AutoshardError

DEFAULT_RTOL = 1e-6
"""Default tolerance of ``--check``: a tensor's max absolute difference from the
single-device run over its largest reference value. Both runs compute in float64, where
summing in another order errs by ~1e-15; a sharding bug errs by O(1) and a 1% error is
10,000 times the tolerance."""

DEFAULT_ATOL = 1e-12
"""``--check`` measures each tensor against a scale of at least ``atol / rtol`` (1e-6 by
default): a gradient that is 0 in exact arithmetic is ~1e-17 in float64, in both runs,
and must not be divided by its own rounding."""

MODES = ("plan", "propagate")
"""``plan``: run the solution's graph with every planned redistribution (the default);
``propagate``: place parameters and inputs only and let DTensor pick the rest (not the
plan; what version-1 sharding maps run)."""


@dataclass(frozen=True)
class RunOptions:
    """What each rank does after placing the model.

    Attributes:
        steps: number of steps (>= 1); each is a forward pass, and with ``train`` also a
            backward pass and an AdamW step.
        train: run backward and AdamW (``lr``) in each step; the loss is the model file's
            ``loss_fn`` or the mean of the output (:mod:`autoshard.model.loss`).
        check: compare with a single-device run on rank 0, both in float64.
        seed: seeds the weights and the synthetic inputs (same on every rank).
        rtol: ``check`` tolerance, relative to each tensor's largest reference value.
        atol: ``check``: each tensor's scale is at least ``atol / rtol``.
        lr: AdamW learning rate.
        mode: ``plan`` or ``propagate`` (see :data:`MODES`).
        json_path: where rank 0 writes the report as JSON (``--json``), or ``None``.
        lower: in ``plan`` mode with two steps or more, record step 1 as a graph on local
            tensors and run steps 2..N from it (:mod:`autoshard.launch.lowered`).
        optimizer: the AdamW implementation the plan was priced with (its map's
            ``predicted.optimizer``; not an option: each rank reads it from the map),
            which :func:`autoshard.launch.steps.adamw` builds.
    """

    steps: int = 1
    train: bool = False
    check: bool = False
    seed: int = 0
    rtol: float = DEFAULT_RTOL
    atol: float = DEFAULT_ATOL
    lr: float = 1e-3
    mode: str = "plan"
    json_path: str | None = None
    lower: bool = True
    optimizer: str = "adamw-fused"

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AutoshardError(f"--steps must be at least 1, got {self.steps}")
        if not self.atol >= 0:
            raise AutoshardError(f"--atol must be a non-negative number, got {self.atol}")
        if not self.rtol > 0:
            raise AutoshardError(f"--rtol must be a positive number, got {self.rtol}")
        if self.mode not in MODES:
            raise AutoshardError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.lr > 0:
            raise AutoshardError(f"--lr must be positive, got {self.lr}")

    def to_argv(self) -> list[str]:
        """The options as ``rank_command`` arguments (the inverse of its parsing)."""
        argv = ["--steps", str(self.steps), "--seed", str(self.seed)]
        argv += ["--rtol", repr(self.rtol), "--atol", repr(self.atol)]
        argv += ["--lr", repr(self.lr), "--mode", self.mode]
        if self.json_path:
            argv += ["--json", str(Path(self.json_path).resolve())]
        if self.train:
            argv.append("--train")
        if self.check:
            argv.append("--check")
        if not self.lower:
            argv.append("--no-lower")
        return argv


_RUN_OPTIONS = (
    click.argument("plan", type=click.Path(dir_okay=False, path_type=Path)),
    click.argument("model", type=click.Path(dir_okay=False, path_type=Path)),
    click.option("--steps", type=int, default=1, show_default=True, help="Steps to run (>= 1)."),
    click.option(
        "--train",
        is_flag=True,
        help="Backward pass and AdamW step in each step (loss: the model file's loss_fn, "
        "else the mean of the output).",
    ),
    click.option(
        "--check",
        is_flag=True,
        help="Compare step 1 with a single-device run on rank 0, both in float64: the "
        "output (the loss with --train), every gradient and every parameter after the "
        "optimizer step; and the collectives that ran with the plan's, per phase, kind and "
        "mesh dim.",
    ),
    click.option(
        "--mode",
        type=click.Choice(MODES),
        default="plan",
        show_default=True,
        help="plan: run the solution's graph, every activation placed as planned. "
        "propagate: place parameters and inputs only and let DTensor choose the rest "
        "(not the plan).",
    ),
    click.option(
        "--lower/--no-lower",
        default=True,
        show_default=True,
        help="With --mode plan and --steps 2 or more: record step 1 (run on DTensors) as a "
        "graph of local ops and explicit collectives (make_fx), and run steps 2..N from it "
        "without DTensor (--check compares step 2 with a DTensor run). Graphs with the "
        "fused experts ops run on DTensors at every step.",
    ),
    click.option(
        "--seed", type=int, default=0, show_default=True, help="Seed of weights and inputs."
    ),
    click.option(
        "--rtol",
        type=float,
        default=DEFAULT_RTOL,
        show_default=True,
        help="--check tolerance: each tensor's max absolute difference over its largest "
        "reference value.",
    ),
    click.option(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        show_default=True,
        help="--check: a max absolute difference this small passes (values 0 in exact arithmetic).",
    ),
    click.option("--lr", type=float, default=1e-3, show_default=True, help="AdamW learning rate."),
    click.option(
        "--json",
        "json_path",
        type=click.Path(dir_okay=False),
        default=None,
        help="Also write the report (collectives seen and predicted per phase, kind and mesh "
        "dim; step times; memory; the check) to this file as JSON.",
    ),
)


def run_options(f: Callable[..., None]) -> Callable[..., None]:
    """The arguments and options both commands take (the rank command gets them forwarded)."""
    for decorate in reversed(_RUN_OPTIONS):
        f = decorate(f)
    return f
