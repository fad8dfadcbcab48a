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
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
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
    "about",
    "count_compile",
    "in_processes",
    "listening",
    "processes_peak_bytes",
    "run",
    "serve",
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
    subject: str | None = None  # which problem, where several run at once (:func:`about`)


_listener: contextvars.ContextVar[Callable[[SolverProgress], None] | None] = contextvars.ContextVar(
    "autoshard_highs_listener", default=None
)
_subject: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "autoshard_highs_subject", default=None
)


@contextlib.contextmanager
def about(subject: str) -> Iterator[None]:
    """Within the block, the progress of every MIP :func:`run` solves on this thread is
    labelled ``subject`` (:attr:`SolverProgress.subject`): which of the problems solved at
    once it is (the mesh search's shapes, each on a lane of its own)."""
    token = _subject.set(subject)
    try:
        yield
    finally:
        _subject.reset(token)


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
            with _TALLY_LOCK:  # a block on one of the mesh search's threads adds to this one's
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


def _numbers(event, mip: bool) -> tuple[float, float, float, float, int]:  # noqa: ANN001
    """What a HiGHS callback ``event`` reports: primal and dual bounds, gap, HiGHS's
    running time and its count (a MIP's nodes, an LP's simplex iterations)."""
    d = event.data_out
    if mip:
        return (d.mip_primal_bound, d.mip_dual_bound, d.mip_gap, d.running_time, d.mip_node_count)
    nan = math.nan
    return (nan, nan, nan, d.running_time, d.simplex_iteration_count)


def _subscribe(h: highspy.Highs, mip: bool, record: Callable[[Any], None]) -> None:
    """``record(event)`` on each of HiGHS's progress callbacks: a MIP's interrupt checks
    and improving solutions, an LP's simplex interrupt checks."""
    if mip:
        h.cbMipInterrupt.subscribe(record)
        h.cbMipImprovingSolution.subscribe(record)
    else:
        h.cbSimplexInterrupt.subscribe(record)


class _Watch:
    """The latest numbers HiGHS reported (:func:`_numbers`, recorded by its callbacks on
    its solver thread, or sent by a HiGHS process, :class:`_Worker`), passed on to the
    listener by the calling thread (:meth:`tell`)."""

    def __init__(self, callback, seconds_per_unit: float | None, mip: bool) -> None:
        self.callback = callback
        self.scale = seconds_per_unit
        self.mip = mip
        self.subject = _subject.get()  # made on the calling thread, as tell() runs
        self.latest: tuple[float, float, float, float, int] | None = None

    def record(self, event) -> None:  # noqa: ANN001 - highspy's callback event
        self.latest = _numbers(event, self.mip)

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
                self.subject,
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


_ONE_RUN = threading.Lock()  # held by each HiGHS run in this process (run)


@dataclass(frozen=True)
class _Job:
    """One HiGHS run as data, the same in this process and in a HiGHS process
    (:class:`_Worker`): the program, HiGHS's options, the start and the work limit."""

    milp: MILP
    options: tuple[tuple[str, object], ...]
    start: tuple[np.ndarray, np.ndarray] | None
    work_limit: int | None

    @property
    def mip(self) -> bool:
        return bool(np.any(self.milp.integer))


def _prepared(job: _Job) -> tuple[highspy.Highs, _WorkLimit | None]:
    """A ``Highs`` holding ``job``'s program, options and start, and the work limit it
    watches (None for an LP)."""
    h = new_highs()
    for name, value in job.options:
        h.setOptionValue(name, value)
    h.passModel(_highs_lp(job.milp))
    if job.start is not None and job.mip:
        index, value = job.start
        h.setSolution(
            len(index), np.asarray(index, dtype=np.int32), np.asarray(value, dtype=np.float64)
        )
    return h, (_WorkLimit(h, job.work_limit) if job.mip else None)


def _outcome(h: highspy.Highs, job: _Job, work: _WorkLimit | None) -> HighsRun:
    """What the run of ``h`` (``job``'s, ended) found."""
    word = h.modelStatusToString(h.getModelStatus())
    name = h.getModelStatus().name
    info = h.getInfo()
    status = _STATUS.get(name, "error")
    if work is not None and work.hit and name in ("kInterrupt", "kHighsInterrupt"):
        status, word = "work_limit", f"work limit ({job.work_limit} units)"
    feasible = info.primal_solution_status == highspy.kSolutionStatusFeasible
    x = np.array(h.getSolution().col_value) if feasible else None
    objective = float(info.objective_function_value) if feasible else None
    bound = gap = None
    if job.mip:
        bound = float(info.mip_dual_bound)
        gap = float(info.mip_gap)
        if not np.isfinite(bound):
            bound = None
        if not (0 <= gap < 1e20):
            gap = None
    nodes = max(int(info.mip_node_count), 0) if job.mip else 0
    iterations = int(info.simplex_iteration_count)
    units = work.work if work is not None else 0
    return HighsRun(status, x, objective, bound, gap, word, nodes, iterations, units)


def _run_here(job: _Job, watch: _Watch | None) -> HighsRun:
    """``job`` run by HiGHS in this process, one run at a time (:data:`_ONE_RUN`)."""
    with _ONE_RUN:
        h, work = _prepared(job)
        if watch is not None:
            _subscribe(h, job.mip, watch.record)
        _run_interruptibly(h, watch)
        return _outcome(h, job, work)


RSS_UNIT = 1 if sys.platform == "darwin" else 1024
"""Bytes per unit of ``ru_maxrss``: Linux reports KiB, macOS bytes."""

PROGRESS_EVERY_S = 0.1
"""A HiGHS process sends its progress at most this often (s): the listener is told
every 0.1 s in either place."""


def serve(fd: int, alive_fd: int) -> None:
    """A HiGHS process's loop (:class:`_Worker`), on the connection ``fd``: each
    :class:`_Job` received is run and answered with ``("done", HighsRun)`` (or
    ``("error", traceback)``), its progress sent as ``("progress", numbers)`` on the way
    when the job asks for it; ``None`` ends it. Ctrl-C is the parent's: this process
    ignores SIGINT (and runs in a session of its own) and is killed when it is wanted no
    more. ``alive_fd``: the read end of a pipe only the parent writes to; when it closes
    (the parent has ended, however it ended), this process exits at once, in the middle
    of a HiGHS run too."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch_parent() -> None:
        while os.read(alive_fd, 1):
            pass
        os._exit(0)

    threading.Thread(target=watch_parent, name="autoshard-parent", daemon=True).start()
    conn = Connection(fd)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent has gone
            return
        if message is None:
            return
        job, report = message
        del message  # one program held at a time
        try:
            h, work = _prepared(job)
            if report:
                sent = [-math.inf]

                def send(event, sent=sent, mip=job.mip) -> None:  # noqa: ANN001 - highspy's
                    now = time.monotonic()
                    if now - sent[0] >= PROGRESS_EVERY_S:
                        sent[0] = now
                        conn.send(("progress", _numbers(event, mip)))

                _subscribe(h, job.mip, send)
            h.run()
            answer = ("done", _outcome(h, job, work))
        except (BrokenPipeError, ConnectionResetError):  # the parent has gone
            return
        except Exception:  # noqa: BLE001 - sent to the parent, which raises it there
            answer = ("error", traceback.format_exc())
        h = work = job = None  # noqa: F841 - freed before the next program comes
        try:
            conn.send(answer)
        except OSError:  # the parent has gone
            return
        answer = None


class _Worker:
    """A child process that runs HiGHS (:func:`serve`) for one thread of this process:
    two threads' runs, each in its own process, run at once on two cores, where two
    ``Highs`` in one process must take turns (:func:`run`). A fresh interpreter
    (``python -c``), not ``multiprocessing``'s ``spawn``, which runs the parent's main
    script again: a user's script that calls :func:`autoshard.solve` would be run twice.
    The two talk over a socket pair as :class:`multiprocessing.connection.Connection`."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair()
        fd = theirs.fileno()
        alive_read, self.alive = os.pipe()  # the child exits when this end closes
        root = str(Path(__file__).resolve().parents[2])  # this autoshard, wherever it lies
        code = (
            "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); import sys; "
            f"sys.path.insert(0, {root!r}); "
            f"from autoshard.solver.highs import serve; serve({fd}, {alive_read})"
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code],
                pass_fds=(fd, alive_read),
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C at the terminal is this process's
            )
        except BaseException:  # no child: this process's ends would be left open
            mine.close()
            os.close(self.alive)
            raise
        finally:
            theirs.close()
            os.close(alive_read)
        self.conn = Connection(mine.detach())
        self.peak_bytes = 0
        self.status = "still running"  # how it ended, once reaped (:meth:`_reap`)

    def run(self, job: _Job, watch: _Watch | None) -> HighsRun:
        """``job``'s answer; ``watch`` told the progress every 0.1 s.

        Raises:
            KeyboardInterrupt, autoshard.interrupt.Stopped: as :func:`run` (this
                process is then killed: HiGHS stops at once).
            RuntimeError: the process failed or ended (its traceback or exit code)."""
        try:
            self.conn.send((job, watch is not None))
        except OSError:
            self._reap(5)
            raise RuntimeError(f"HiGHS's process ended ({self.status})") from None
        while True:
            if self.conn.poll(PROGRESS_EVERY_S):
                try:
                    kind, payload = self.conn.recv()
                except (EOFError, OSError):
                    self._reap(5)
                    raise RuntimeError(f"HiGHS's process ended ({self.status})") from None
                if kind == "done":
                    return payload
                if kind == "error":
                    raise RuntimeError(f"HiGHS's process failed:\n{payload}")
                if watch is not None:
                    watch.latest = payload
            interrupt.check()
            if watch is not None:
                watch.tell()

    def _reap(self, timeout: float | None) -> bool:
        """Waits for the process to end (at most ``timeout`` s; None: as long as it
        takes) and reaps it with its resource usage (``os.wait4``): its peak memory in
        :attr:`peak_bytes`. Whether it has ended."""
        if self.process.returncode is not None:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                pid, status, usage = os.wait4(
                    self.process.pid, 0 if deadline is None else os.WNOHANG
                )
            except ChildProcessError:  # reaped by another (its status and usage are lost)
                self.process.returncode = -1
                self.status = "its exit status unknown"
                return True
            if pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                self.status = f"exit code {self.process.returncode}"
                self.peak_bytes = usage.ru_maxrss * RSS_UNIT
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self, kill: bool = False) -> int:
        """Ends the process: asked to (``kill`` False: it is idle), or killed. Returns its
        peak memory (bytes; 0 where it was not reaped here)."""
        if not kill and self.process.returncode is None:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self._reap(5)
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self._reap(None)
        self.conn.close()
        os.close(self.alive)
        return self.peak_bytes


class _Workers:
    """The HiGHS processes of an :func:`in_processes` block: one per thread that runs
    HiGHS in it, started on its first run and ended with the block. ``peak_bytes``: the
    sum of the ended processes' peak memory, an upper bound on what they held at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_thread: dict[int, _Worker] = {}
        self.peak_bytes = 0
        self.closed = False

    def run(self, job: _Job, watch: _Watch | None) -> HighsRun:
        me = threading.get_ident()
        with self.lock:
            if self.closed:  # a thread the block's end did not wait for
                raise RuntimeError("HiGHS's processes have ended with their block")
            worker = self.by_thread.get(me)
        if worker is None:
            worker = _Worker()
            with self.lock:
                self.by_thread[me] = worker
        try:
            return worker.run(job, watch)
        except BaseException:  # Ctrl-C, a stop, a failure: HiGHS stops with its process
            with self.lock:
                self.by_thread.pop(me, None)
            peak = worker.close(kill=True)
            with self.lock:
                self.peak_bytes += peak
            raise

    def close(self) -> None:
        with self.lock:
            workers, self.by_thread = list(self.by_thread.values()), {}
            self.closed = True
        peaks = [worker.close() for worker in workers]
        with self.lock:
            self.peak_bytes += sum(peaks)


_PEAK_LOCK = threading.Lock()
_processes_peak = 0  # processes_peak_bytes


def processes_peak_bytes() -> int:
    """An upper bound on the memory the HiGHS processes of one :func:`in_processes` block
    of this process held at once: the sum of each one's peak, the largest block's so far
    (bytes; 0 when none has ended). What a mesh search adds to its own process's peak
    (:func:`autoshard.solver.solve.peak_rss_bytes`)."""
    with _PEAK_LOCK:
        return _processes_peak


_processes: contextvars.ContextVar[_Workers | None] = contextvars.ContextVar(
    "autoshard_highs_processes", default=None
)


@contextlib.contextmanager
def in_processes() -> Iterator[None]:
    """Within the block (and in the threads it starts with a copy of its context), each
    thread's :func:`run` runs HiGHS in a child process of its own, so that HiGHS runs of
    two threads run at once, each on its own core (the mesh search's:
    :func:`autoshard.solver.meshes._plan_rows`). Each run is the run :func:`run` does in
    this process (the same options, one thread, a fixed seed and work units): the same
    answer. The processes end with the block."""
    global _processes_peak
    workers = _Workers()
    token = _processes.set(workers)
    try:
        yield
    finally:
        _processes.reset(token)
        workers.close()
        with _PEAK_LOCK:
            _processes_peak = max(_processes_peak, workers.peak_bytes)


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
        RuntimeError: inside :func:`in_processes`, HiGHS's process failed.

    In this process, one run at a time (a second thread's waits): highspy resets HiGHS's
    task scheduler, which the process shares, after each run, and two instances run at
    once from two threads have crashed (HiGHS PR #3141, 2026-07). Inside
    :func:`in_processes`, each thread's runs go to a HiGHS process of its own instead.
    """
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
    job = _Job(milp, tuple(options), start, work_limit)
    callback = _listener.get()
    watch = _Watch(callback, seconds_per_unit, mip) if callback is not None else None
    workers = _processes.get()
    began = time.perf_counter()
    found = workers.run(job, watch) if workers is not None else _run_here(job, watch)
    took = time.perf_counter() - began
    tally = _tally.get()
    if tally is not None:
        _add_run(tally, mip, took, found.nodes, found.iterations)
    return found


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
