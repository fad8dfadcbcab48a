"""What every rank of a launch does, and the options that say it (no torch import: the
command line reads them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from autoshard.errors import AutoshardError

DEFAULT_ATOL = 1e-5
"""Default tolerance of ``--check`` for outputs and parameters: max absolute difference,
right for float32."""

DEFAULT_GRAD_RTOL = 1e-4
"""Default tolerance of ``--check`` for gradients, relative to the largest one of each
tensor. A float32 gradient sums thousands of terms in an order that sharding changes
(measured: up to 7e-6 on a 2-layer GPT-2, 2x4 mesh); a sharding bug errs by O(1)."""


@dataclass(frozen=True)
class RunOptions:
    """What each rank does after placing the model.

    Attributes:
        steps: number of steps (>= 1); each is a forward pass, and with ``train`` also a
            backward pass and an AdamW step.
        train: run backward and AdamW (``lr``) in each step; loss = sum of the output.
        check: compare with a single-device run on rank 0 (see :func:`run_rank`).
        seed: seeds the weights and the synthetic inputs (same on every rank).
        atol: ``check`` tolerance of outputs and parameters, max absolute difference.
        grad_rtol: ``check`` tolerance of step 1's gradients, max absolute difference
            relative to the largest reference gradient of the tensor (at least 1).
        lr: AdamW learning rate.
    """

    steps: int = 1
    train: bool = False
    check: bool = False
    seed: int = 0
    atol: float = DEFAULT_ATOL
    grad_rtol: float = DEFAULT_GRAD_RTOL
    lr: float = 1e-3

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise AutoshardError(f"--steps must be at least 1, got {self.steps}")
        if not self.atol >= 0:
            raise AutoshardError(f"--atol must be a non-negative number, got {self.atol}")
        if not self.grad_rtol >= 0:
            raise AutoshardError(f"--grad-rtol must be a non-negative number, got {self.grad_rtol}")
        if not self.lr > 0:
            raise AutoshardError(f"--lr must be positive, got {self.lr}")

    def to_argv(self) -> list[str]:
        """The options as ``rank_command`` arguments (the inverse of its parsing)."""
        argv = ["--steps", str(self.steps), "--seed", str(self.seed)]
        argv += ["--atol", repr(self.atol), "--grad-rtol", repr(self.grad_rtol)]
        argv += ["--lr", repr(self.lr)]
        if self.train:
            argv.append("--train")
        if self.check:
            argv.append("--check")
        return argv


_RUN_OPTIONS = (
    click.argument("plan", type=click.Path(dir_okay=False, path_type=Path)),
    click.argument("model", type=click.Path(dir_okay=False, path_type=Path)),
    click.option("--steps", type=int, default=1, show_default=True, help="Steps to run (>= 1)."),
    click.option("--train", is_flag=True, help="Backward pass and AdamW step in each step."),
    click.option(
        "--check",
        is_flag=True,
        help="Compare with a single-device run on rank 0: outputs; with --train also step "
        "1's gradients and the parameters after the steps.",
    ),
    click.option(
        "--seed", type=int, default=0, show_default=True, help="Seed of weights and inputs."
    ),
    click.option(
        "--atol",
        type=float,
        default=DEFAULT_ATOL,
        show_default=True,
        help="--check tolerance of outputs and parameters: max absolute difference.",
    ),
    click.option(
        "--grad-rtol",
        type=float,
        default=DEFAULT_GRAD_RTOL,
        show_default=True,
        help="--check tolerance of gradients: max absolute difference over the largest.",
    ),
    click.option("--lr", type=float, default=1e-3, show_default=True, help="AdamW learning rate."),
)


def run_options(f: Callable[..., None]) -> Callable[..., None]:
    """The arguments and options both commands take (the rank command gets them forwarded)."""
    for decorate in reversed(_RUN_OPTIONS):
        f = decorate(f)
    return f
