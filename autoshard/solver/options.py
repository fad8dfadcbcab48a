"""The options of the ILP search (no solver import: the command line reads them)."""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.errors import AutoshardError

BASELINES: tuple[str, ...] = ("replicate", "ddp", "fsdp", "megatron", "megatron_sp", "fsdp_tp")
"""Baseline names, in the order ``compare`` prints them."""

ALGOS: tuple[str, ...] = ("ilp",) + BASELINES
"""Every ``--algo``: the ILP and each baseline."""


@dataclass(frozen=True)
class SolverOptions:
    """Options of the ILP solve, validated once.

    ``time_limit_s``: wall-clock limit for HiGHS (s), shared by the LP, relax-and-fix
    and the full MIP. ``mip_gap``: relative
    optimality gap accepted (0 = prove optimality; default 1%). ``lp_first``: solve
    the LP relaxation first; when it is integral it is the optimum, and when rounding
    it (each node's largest strategy) is within ``mip_gap`` of the LP bound, that plan
    is returned with its gap; otherwise the MIP is solved.
    """

    time_limit_s: float = 120.0
    mip_gap: float = 1e-2
    lp_first: bool = True

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise AutoshardError(f"--time-limit must be positive seconds, got {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise AutoshardError(f"--mip-gap must be in [0, 1), got {self.mip_gap}")
