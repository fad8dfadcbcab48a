"""A mixed-integer linear program handed to HiGHS (highspy) as matrices.

The sharding ILP is stated in cvxpy and compiled by it (:mod:`autoshard.solver.cvx`); this
module passes the compiled matrices to HiGHS unchanged, the way cvxpy's HiGHS interface
does, adding what cvxpy's ``solve`` cannot pass: a start (a feasible
point, possibly partial, through ``Highs.setSolution``: HiGHS completes the continuous
columns), a fixed seed and one thread so that a solve is the same on every run, and a
status in a few words.

HiGHS's model statuses map to :attr:`HighsRun.status` (:data:`_STATUS`):

=================================================  ===================
``kOptimal``                                       ``optimal``
``kInfeasible``                                    ``infeasible``
the work limit (see :class:`_WorkLimit`)           ``work_limit``
``kIterationLimit`` (an LP's iterations)           ``iteration_limit``
``kTimeLimit`` (``--time-limit``)                  ``time_limit``
other stops (bounds, targets, interrupts, memory)  ``stopped``
anything else (model or solve errors, ...)         ``error``
=================================================  ===================

The work and iteration limits count what HiGHS did, not seconds: with one thread and a
fixed seed HiGHS takes the same path on every run, so a search they stop ends on the same
plan whatever the machine's load. A wall-clock limit does not (issue 29).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np
import scipy.sparse as sp

from autoshard import interrupt

__all__ = [
    "HighsRun",
    "HighsWork",
    "MILP",
    "SolverProgress",
    "count_compile",
    "listening",
    "run",
    "tallying",
]

_STATUS = {
    "kOptimal": "optimal",
    "kInfeasible": "infeasible",
    "kIterationLimit": "iteration_limit",
    "kTimeLimit": "time_limit",
    # stops that are no limit of ours: a bound or target HiGHS met, an interruption that
    # is not the work limit (run() tells that one apart), its memory
    "kSolutionLimit": "stopped",
    "kObjectiveBound": "stopped",
    "kObjectiveTarget": "stopped",
    "kInterrupt": "stopped",
    "kHighsInterrupt": "stopped",
    "kMemoryLimit": "stopped",
}
"""HiGHS's model status -> a run's ``status``; any other (unbounded, load errors,
kNotset...) is ``error``."""

LIMIT_STATUSES = ("work_limit", "iteration_limit", "time_limit")
"""The statuses of a run a limit stopped (its best point, if any, is still returned)."""


@dataclass
class MILP:
    """``min c.v  s.t.  row_lower <= A v <= row_upper,  col_lower <= v <= col_upper``,
    with ``v[integer]`` integral.

    Shapes: ``c``, ``col_lower``, ``col_upper``, ``integer`` ``(n,)``; ``A`` ``(m, n)``
    sparse; ``row_lower``, ``row_upper`` ``(m,)``. Infinite bounds are ``±np.inf``.
    """

    c: np.ndarray
    A: sp.spmatrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    col_lower: np.ndarray
    col_upper: np.ndarray
    integer: np.ndarray

    @property
    def num_cols(self) -> int:
        return len(self.c)

    @property
    def num_rows(self) -> int:
        return self.A.shape[0]


@dataclass
class HighsRun:
    """What one HiGHS run found.

    ``status``: ``optimal``, ``infeasible``, one of :data:`LIMIT_STATUSES` (``work_limit``,
    ``iteration_limit``, ``time_limit``), ``stopped`` (another stop before a proof) or
    ``error`` (:data:`_STATUS`); ``x``: the column values of the best feasible point, or
    None when there is none; ``objective``: its objective; ``bound``: the MIP's dual bound
    (None for an LP); ``gap``: HiGHS's relative MIP gap (None when it has none);
    ``model_status``: HiGHS's own word, for messages; ``nodes``: branch-and-bound nodes;
    ``iterations``: simplex iterations (the LP's, or all of the MIP's); ``work``: a MIP's
    work units (see :class:`_WorkLimit`).
    """

    status: str
    x: np.ndarray | None
    objective: float | None
    bound: float | None
    gap: float | None
    model_status: str
    nodes: int = 0
    iterations: int = 0
    work: int = 0


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """The process's file descriptor 1 on /dev/null for the block (C code's printf)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def new_highs() -> highspy.Highs:
    """A ``highspy.Highs`` made without its banner: highspy 1.16 prints "Running HiGHS
    ..." from C++ as it is constructed, before ``output_flag`` can be set (issue 13: no
    third-party output reaches the terminal unasked)."""
    with _stdout_silenced():
        return highspy.Highs()


@dataclass(frozen=True)
class SolverProgress:
    """Where a running MIP stands, as HiGHS's callbacks last reported it.

    ``incumbent``: the best feasible objective so far (None before the first);
    ``bound``: the dual bound (None while it is unbounded); ``gap``: HiGHS's relative gap
    (None while it is infinite); ``seconds``: HiGHS's own running time (-1 where HiGHS
    does not report it, as in a simplex callback). Objectives are in seconds when the
    caller of :func:`run` gave ``seconds_per_unit``, else in the program's own units. A
    linear program (``mip`` False) has no incumbent, bound or gap until it ends:
    ``iterations`` counts its simplex iterations (a MIP's: its branch-and-bound nodes).
    """

    incumbent: float | None
    bound: float | None
    gap: float | None
    seconds: float
    in_seconds: bool
    mip: bool = True
    iterations: int = 0


_listener: contextvars.ContextVar[Callable[[SolverProgress], None] | None] = contextvars.ContextVar(
    "autoshard_highs_listener", default=None
)


@contextlib.contextmanager
def listening(callback: Callable[[SolverProgress], None]) -> Iterator[None]:
    """Within the block, every MIP :func:`run` solves reports its progress to ``callback``:
    on the calling thread, every 0.1 s once HiGHS has reported. Reading HiGHS's callbacks
    changes nothing in its search (the same plan)."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


@dataclass
class HighsWork:
    """What every :func:`run` inside a :func:`tallying` block did, split into LPs (the
    relaxations) and MIPs (branch and bound, each with its own root LP), and the programs
    cvxpy compiled for them (:func:`count_compile`).

    ``lp_seconds``, ``mip_seconds`` and ``compile_seconds`` are wall-clock (for a
    benchmark's table, never for a result); ``nodes`` (branch-and-bound nodes) and
    ``iterations`` (simplex iterations of LPs and MIPs alike) count what
    HiGHS did, the same on every run.
    """

    lp_runs: int = 0
    lp_seconds: float = 0.0
    compile_runs: int = 0  # programs stated in cvxpy and compiled (autoshard.solver.cvx)
    compile_seconds: float = 0.0
    mip_runs: int = 0
    mip_seconds: float = 0.0
    nodes: int = 0
    iterations: int = 0


_TALLY_LOCK = threading.Lock()

_tally: contextvars.ContextVar[HighsWork | None] = contextvars.ContextVar(
    "autoshard_highs_tally", default=None
)


@contextlib.contextmanager
def tallying() -> Iterator[HighsWork]:
    """Within the block, every :func:`run` adds what it did to the :class:`HighsWork`
    yielded (blocks nest: the outer one counts the inner one's runs too)."""
    outer = _tally.get()
    work = HighsWork()
    token = _tally.set(work)
    try:
        yield work
    finally:
        _tally.reset(token)
        if outer is not None:
            with _TALLY_LOCK:  # a block on the mesh search's second thread adds to this one's
                for name, value in vars(work).items():
                    setattr(outer, name, getattr(outer, name) + value)


def count_compile(seconds: float) -> None:
    """Adds one program stated in cvxpy and compiled, in ``seconds``, to the enclosing
    :func:`tallying` block, if any (:func:`autoshard.solver.ilp._milp`)."""
    tally = _tally.get()
    if tally is not None:
        with _TALLY_LOCK:
            tally.compile_runs += 1
            tally.compile_seconds += seconds


class _WorkLimit:
    """A deterministic limit on a MIP's work: HiGHS's MIP solver checks its limits at
    fixed points of its search (each LP solve of the root's cut rounds and heuristics,
    each node) and calls ``cbMipInterrupt`` there; one call is one work unit. With one
    thread and a fixed seed the calls fall on the same points on every run, so stopping
    at the ``limit``-th stops on the same incumbent whatever the machine's load, where
    ``time_limit`` does not. (HiGHS's ``mip_max_nodes`` is deterministic too, but most of
    a large sharding MIP's time goes to its root node: 1 node in 145 s on GPT-2 small
    bf16-mixed; and a MIP's callbacks do not report its simplex iterations.)"""

    def __init__(self, h: highspy.Highs, limit: int | None) -> None:
        self.limit = limit
        self.work = 0
        self.hit = False
        h.cbMipInterrupt.subscribe(self._check)

    def _check(self, event) -> None:  # noqa: ANN001 - highspy's callback event
        self.work += 1
        if self.limit is not None and self.work >= self.limit:
            self.hit = True
            event.interrupt()


class _Watch:
    """HiGHS's MIP callbacks (its solver thread) record the latest numbers here; the
    calling thread passes them on (:func:`_run_interruptibly`)."""

    def __init__(
        self, h: highspy.Highs, callback, seconds_per_unit: float | None, mip: bool
    ) -> None:
        self.callback = callback
        self.scale = seconds_per_unit
        self.mip = mip
        self.latest: tuple[float, float, float, float, int] | None = None
        if mip:
            h.cbMipInterrupt.subscribe(self._record)
            h.cbMipImprovingSolution.subscribe(self._record)
        else:
            h.cbSimplexInterrupt.subscribe(self._record)

    def _record(self, event) -> None:  # noqa: ANN001 - highspy's callback event
        d = event.data_out
        count = d.mip_node_count if self.mip else d.simplex_iteration_count
        nan = math.nan
        if self.mip:
            self.latest = (d.mip_primal_bound, d.mip_dual_bound, d.mip_gap, d.running_time, count)
        else:
            self.latest = (nan, nan, nan, d.running_time, count)

    def tell(self) -> None:
        if self.latest is None:
            return
        primal, dual, gap, seconds, count = self.latest
        scale = self.scale if self.scale is not None else 1.0

        def finite(v: float) -> float | None:
            return float(v) * scale if math.isfinite(v) and abs(v) < 1e30 else None

        g = float(gap) if math.isfinite(gap) and 0 <= gap < 1e20 else None
        self.callback(
            SolverProgress(
                finite(primal),
                finite(dual),
                g,
                float(seconds),
                self.scale is not None,
                self.mip,
                int(count),
            )
        )


def _run_interruptibly(h: highspy.Highs, watch: _Watch | None = None) -> None:
    """``h.run()`` in highspy's solver thread, so that Ctrl-C reaches the main thread at
    once: HiGHS is then cancelled at its next interrupt check (highspy's
    ``HandleUserInterrupt`` callbacks) and the :class:`KeyboardInterrupt` goes on, as
    does any exception of ``watch``'s listener (HiGHS never runs on unwatched).
    ``watch``: progress passed on every 0.1 s."""
    h.HandleUserInterrupt = True
    h.startSolve()
    try:
        while not h.wait(0.1)[0]:
            interrupt.check()  # a Ctrl-C that landed in a finaliser and was swallowed
            if watch is not None:
                watch.tell()
    except BaseException:  # Ctrl-C, or a listener that failed: HiGHS stops, then it goes on
        h.cancelSolve()
        while not h.wait(0.1)[0]:
            pass
        raise


def _highs_lp(milp: MILP) -> highspy.HighsLp:
    """``milp`` as HiGHS's model: its columns, rows, column-wise matrix and integrality."""
    lp = highspy.HighsLp()
    lp.num_col_ = milp.num_cols
    lp.num_row_ = milp.num_rows
    lp.col_cost_ = np.asarray(milp.c, dtype=np.float64)
    lp.col_lower_ = np.asarray(milp.col_lower, dtype=np.float64)
    lp.col_upper_ = np.asarray(milp.col_upper, dtype=np.float64)
    lp.row_lower_ = np.asarray(milp.row_lower, dtype=np.float64)
    lp.row_upper_ = np.asarray(milp.row_upper, dtype=np.float64)
    A = sp.csc_matrix(milp.A)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = A.indptr
    lp.a_matrix_.index_ = A.indices
    lp.a_matrix_.value_ = A.data.astype(np.float64)
    if np.any(milp.integer):
        lp.integrality_ = [
            highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous
            for i in milp.integer
        ]
    return lp


MIP_PRESOLVE = "off"
"""HiGHS's presolve for a MIP. It costs more than it saves on these programs (mostly the
continuous edge columns): with it off, measured on a 2-core machine (HiGHS alone, the
same bound, plans within the gap): 2-block GPT-2 fp32 5.6 -> 2.2 s, the 4-block Qwen2
bf16-mixed 38.8 -> 31.4 s, the Llama-7B shape L32 bf16-mixed 348 -> 304 s (same plan),
GPT-2 small bf16-mixed 40 -> 39.5 s (docs/performance.md, 2026-11-28). LP relaxations
keep theirs; sub-MIPs inside HiGHS still presolve."""


_ONE_RUN = threading.Lock()  # held by each HiGHS run (_one_at_a_time)


def _one_at_a_time(fn: Callable) -> Callable:
    """``fn`` under :data:`_ONE_RUN`: one HiGHS run at a time in the process (see
    :func:`run`)."""

    @functools.wraps(fn)
    def locked(*args: Any, **kwargs: Any) -> Any:
        with _ONE_RUN:
            return fn(*args, **kwargs)

    return locked


@_one_at_a_time
def run(
    milp: MILP,
    time_limit: float | None = None,
    mip_rel_gap: float | None = None,
    start: tuple[np.ndarray, np.ndarray] | None = None,
    objective_bound: float | None = None,
    seconds_per_unit: float | None = None,
    work_limit: int | None = None,
    iteration_limit: int | None = None,
) -> HighsRun:
    """Solve ``milp`` with HiGHS, within the limits given.

    Args:
        milp: the program.
        time_limit: wall-clock seconds (HiGHS's ``time_limit``); None: none. A search it
            stops depends on the machine's load: prefer the work limits.
        mip_rel_gap: relative gap at which the MIP stops (``mip_abs_gap`` is 0, so that
            only the relative one counts).
        start: ``(column indices, values)`` of a feasible point, possibly partial (HiGHS
            completes the rest); the MIP's first incumbent.
        objective_bound: HiGHS's ``objective_bound``: every branch whose bound is not
            below it is cut (a start's objective, slightly raised, prunes as the start
            would once HiGHS has completed it).
        seconds_per_unit: seconds of the step per unit of the objective, for the progress
            a :func:`listening` block reports (None: the objective is not a time).
        work_limit: work units of a MIP (:class:`_WorkLimit`); None: none.
            Deterministic.
        iteration_limit: simplex iterations of an LP (HiGHS's ``simplex_iteration_limit``;
            HiGHS applies it to LPs, not to a MIP's node LPs); None: none. Deterministic.

    Returns:
        A :class:`HighsRun`; no exception for infeasibility or limits, which its
        ``status`` says.

    Raises:
        KeyboardInterrupt: Ctrl-C, after HiGHS has stopped.
        autoshard.interrupt.Stopped: the thread that started this work failed
            (:func:`autoshard.interrupt.stoppable`), after HiGHS has stopped.

    One run at a time in the process (a second thread's waits): highspy resets HiGHS's
    task scheduler, which the process shares, after each run, and two instances run at
    once from two threads have crashed (HiGHS PR #3141, 2026-07).
    """
    h = new_highs()
    options: list[tuple[str, object]] = [
        ("output_flag", bool(os.environ.get("AUTOSHARD_HIGHS_LOG"))),
        ("threads", 1),  # deterministic: the same plan on every run and machine load
        ("random_seed", 0),
        ("mip_abs_gap", 0.0),
    ]
    mip = bool(np.any(milp.integer))
    if mip:
        options.append(("presolve", MIP_PRESOLVE))
    if time_limit is not None:
        options.append(("time_limit", float(time_limit)))
    if iteration_limit is not None:
        options.append(("simplex_iteration_limit", int(iteration_limit)))
    if mip_rel_gap is not None:
        options.append(("mip_rel_gap", float(mip_rel_gap)))
    if objective_bound is not None:
        options.append(("objective_bound", float(objective_bound)))
    for name, value in options:
        h.setOptionValue(name, value)
    h.passModel(_highs_lp(milp))
    if start is not None and mip:
        index, value = start
        h.setSolution(
            len(index), np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.float64)
        )
    work = _WorkLimit(h, work_limit) if mip else None
    callback = _listener.get()
    watch = _Watch(h, callback, seconds_per_unit, mip) if callback is not None else None
    began = time.perf_counter()
    _run_interruptibly(h, watch)
    took = time.perf_counter() - began
    word = h.modelStatusToString(h.getModelStatus())
    name = h.getModelStatus().name
    info = h.getInfo()
    status = _STATUS.get(name, "error")
    if work is not None and work.hit and name in ("kInterrupt", "kHighsInterrupt"):
        status, word = "work_limit", f"work limit ({work_limit} units)"
    feasible = info.primal_solution_status == highspy.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if feasible else None
    objective = float(info.objective_function_value) if feasible else None
    bound = gap = None
    if mip:
        bound = float(info.mip_dual_bound)
        gap = float(info.mip_gap)
        if not np.isfinite(bound):
            bound = None
        if not (0 <= gap < 1e20):
            gap = None
    nodes = max(int(info.mip_node_count), 0) if mip else 0
    iterations = int(info.simplex_iteration_count)
    units = work.work if work is not None else 0
    tally = _tally.get()
    if tally is not None:
        _add_run(tally, mip, took, nodes, iterations)
    return HighsRun(status, x, objective, bound, gap, word, nodes, iterations, units)


def _add_run(tally: HighsWork, mip: bool, took: float, nodes: int, iterations: int) -> None:
    """One HiGHS run added to ``tally`` (under :data:`_TALLY_LOCK`: the mesh search's two
    threads may share one)."""
    with _TALLY_LOCK:
        if mip:
            tally.mip_runs += 1
            tally.mip_seconds += took
        else:
            tally.lp_runs += 1
            tally.lp_seconds += took
        tally.nodes += nodes
        tally.iterations += iterations
