"""The options of the ILP search (no solver import: the command line reads them)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autoshard.errors import AutoshardError

BASELINES: tuple[str, ...] = ("replicate", "ddp", "fsdp", "megatron", "megatron_sp", "fsdp_tp")
"""Baseline names, in the order ``compare`` prints them."""

ALGOS: tuple[str, ...] = ("ilp",) + BASELINES
"""Every ``--algo``: the ILP and each baseline."""

FSDP_VERSIONS: tuple[int, ...] = (2, 1)
"""``--fsdp-version``: the FSDP that runs the fsdp and fsdp_tp plans
(:mod:`autoshard.plan.fsdp_runtime`): 2, ``torch.distributed.fsdp.fully_shard``
(torchtitan's), the default; 1, ``FullyShardedDataParallel`` (Composer's, HF
Accelerate's)."""

COMPARED: tuple[str, ...] = ALGOS + ("torchtitan",)
"""What ``compare`` prints by default: every ``--algo`` and the fastest plan of the
torchtitan space (``solve --space torchtitan``)."""


WORK_LIMIT = 200
"""Default work units per MIP solve (:class:`autoshard.solver.highs._WorkLimit`: HiGHS's
limit checks, made at fixed points of its search). The bf16-mixed bench cases, each a
full MIP with the overlap savings, took 9 (the 4-layer Qwen2), 28 (GPT-2 small) and 108
(the Llama-7B shape, 32 layers, 2x4) units to reach the 1% gap (issue 29)."""

LP_ITERATION_LIMIT = 200_000
"""Default simplex iterations per LP relaxation (HiGHS's ``simplex_iteration_limit``)."""


MESH_SEARCH_COLUMNS = 1_000_000
"""The most columns a program is solved whole with, unless ``--max-columns`` says
otherwise: per shape of ``--gpus``'s mesh search, and for ``solve --mesh``
(:func:`autoshard.solver.meshes.plan_mesh`); a larger one is planned by lifting the plan
of a shape with one dim fewer, or in torchtitan's space. A 3-D mesh is where this
bites: the Llama shape at 2 layers, bf16-mixed, has 127,171 columns on 2x4 and 2,586,569
on 2x2x2, whose LP relaxation had not ended after 500 s (issue 29)."""


@dataclass(frozen=True)
class SolverOptions:
    """Options of the ILP search, validated once.

    ``work_limit``: work units each MIP solve may take (the search without overlap,
    relax-and-fix, the full MIP, each memory round: HiGHS's limit checks, made at fixed
    points of its search); ``lp_iteration_limit``: simplex iterations each LP relaxation
    may take. Both count work, not seconds: a search they stop ends on the same plan
    whatever the machine's load (issue 29). ``time_limit_s``: an optional wall-clock
    limit (s) for the whole search, shared by its phases; a search it stops may end on
    another plan on a busier machine, and the report says so. ``mip_gap``: relative
    optimality gap accepted (0 = prove optimality; default 1%). ``lp_first``: solve the
    LP relaxation first; when it is integral it is the optimum, and when rounding it
    (each node's largest strategy) is within ``mip_gap`` of the LP bound, that plan is
    returned with its gap; otherwise the MIP is solved. A program with the overlap
    savings and over ``SMALL_PROGRAM`` columns skips it (its LP is weak:
    :func:`autoshard.solver.ilp._search`).
    ``max_columns``: the most columns (strategies, edge transport variables and shared
    reshardings: :func:`autoshard.solver.ilp.program_columns`) a program
    may have to be solved; a larger one is refused before its search starts (None: no
    cap for :func:`~autoshard.solver.solve.plan_model`; the mesh search and
    :func:`~autoshard.solver.meshes.plan_mesh` read None as :data:`MESH_SEARCH_COLUMNS`).
    Counted from the program, never timed.

    Raises:
        AutoshardError: a limit that is not positive, a gap outside ``[0, 1)``; the
            message names the option as the command line spells it and as this class
            does.
    """

    time_limit_s: float | None = None
    mip_gap: float = 1e-2
    lp_first: bool = True
    work_limit: int = WORK_LIMIT
    lp_iteration_limit: int = LP_ITERATION_LIMIT
    max_columns: int | None = None
    spent: bool = False
    """Set by :meth:`after` when ``time_limit_s`` is used up: a search then starts only
    where no start plan fits (:func:`autoshard.solver.ilp.solve`)."""

    def __post_init__(self) -> None:
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise AutoshardError(
                f"--time-limit (time_limit_s) must be positive seconds, got {self.time_limit_s}"
            )
        if not 0 <= self.mip_gap < 1:
            raise AutoshardError(f"--mip-gap (mip_gap) must be in [0, 1), got {self.mip_gap}")
        if not (isinstance(self.work_limit, int) and self.work_limit > 0):
            raise AutoshardError(
                f"--work-limit (work_limit) must be a positive whole number, got {self.work_limit}"
            )
        if self.max_columns is not None and not (
            isinstance(self.max_columns, int) and self.max_columns > 0
        ):
            raise AutoshardError(
                f"max_columns must be a positive whole number or None, got {self.max_columns}"
            )
        if not (isinstance(self.lp_iteration_limit, int) and self.lp_iteration_limit > 0):
            raise AutoshardError(
                f"lp_iteration_limit must be a positive whole number, got {self.lp_iteration_limit}"
            )

    def capped(self) -> SolverOptions:
        """These options with ``max_columns`` at :data:`MESH_SEARCH_COLUMNS` where none
        was given: the cap the mesh search, ``solve --mesh``
        (:func:`~autoshard.solver.meshes.plan_mesh`) and ``compare``'s ILP row apply."""
        if self.max_columns is not None:
            return self
        return replace(self, max_columns=MESH_SEARCH_COLUMNS)

    def deadline(self, t0: float) -> float | None:
        """The ``time.perf_counter()`` reading at which a search started at ``t0`` must
        stop, or None without a wall-clock limit."""
        return None if self.time_limit_s is None else t0 + self.time_limit_s

    def after(self, seconds: float) -> SolverOptions:
        """These options for what is left once ``seconds`` of the wall-clock limit are
        spent (at least 1 s, for a search that has no plan yet; :attr:`spent` when none
        is left); unchanged without one."""
        if self.time_limit_s is None:
            return self
        left = self.time_limit_s - seconds
        return replace(self, time_limit_s=max(1.0, left), spent=self.spent or left <= 0)
