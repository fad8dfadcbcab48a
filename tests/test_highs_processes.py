"""HiGHS in processes of its own (``autoshard.solver.highs.in_processes``), as the mesh
search runs it so that two threads' runs use two cores: the same answer as in this
process, the progress and the tally as before, and a stop or a dead process that never
leaves a search waiting or a process behind."""

from __future__ import annotations

import contextvars
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_solver_progress import knapsack

from autoshard import interrupt
from autoshard.solver.highs import (
    SolverProgress,
    in_processes,
    listening,
    processes_peak_bytes,
    run,
    tallying,
)


def _children() -> set[int]:
    """The pids of this process's living children (Linux's /proc)."""
    me = os.getpid()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == me and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def test_two_threads_runs_in_processes_answer_as_this_process_does(
    monkeypatch: pytest.MonkeyPatch,
):
    """Each thread's runs go to a HiGHS process of its own and end on the point the run
    in this process ends on (one thread, a fixed seed, the same work units): two at once,
    and a process's second program after its first, change nothing; the processes end
    with the block, and their memory counts in the peak a report prints (each holds an
    interpreter, numpy and HiGHS: tens of MB)."""
    from autoshard.solver import highs as highs_module
    from autoshard.solver.solve import peak_rss_bytes

    monkeypatch.setattr(highs_module, "_processes_peak", 0)  # this block's, not another's
    a, b = knapsack(seed=0), knapsack(seed=1)
    here = [run(m, work_limit=300) for m in (a, b)]
    before = _children()

    def both(first, second):  # noqa: ANN001, ANN202
        return [run(m, None, None, None, None, None, 300) for m in (first, second)]

    with in_processes():
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [
                pool.submit(contextvars.copy_context().run, both, *order)
                for order in ((a, b), (b, a))
            ]
            there = [f.result() for f in futures]
        assert len(_children() - before) == 2  # one per thread, alive until the block ends
    for mine, theirs in ((here, there[0]), (here[::-1], there[1])):
        for m, t in zip(mine, theirs, strict=True):
            assert t.status == m.status
            assert t.objective == m.objective and t.work == m.work
            np.testing.assert_array_equal(t.x, m.x)
    assert not _children() - before  # reaped: no process left behind
    assert processes_peak_bytes() > 40 * 2**20  # two processes
    assert peak_rss_bytes() >= processes_peak_bytes() + 20 * 2**20


def test_a_highs_process_reports_progress_and_counts_in_the_tally():
    """The listener hears a process's run as it hears one in this process (incumbents in
    seconds, the last no better than the answer), and the tally counts it."""
    milp = knapsack()
    told: list[SolverProgress] = []
    with in_processes(), listening(told.append), tallying() as work:
        found = run(milp, time_limit=60.0, seconds_per_unit=1e-6)
    assert found.status == "optimal"
    with_incumbent = [p for p in told if p.incumbent is not None]
    assert with_incumbent and all(p.mip and p.in_seconds for p in told)
    assert with_incumbent[-1].incumbent >= found.objective * 1e-6 - 1e-12
    assert (work.mip_runs, work.nodes) == (1, found.nodes)


def test_a_stop_kills_the_highs_process_at_once():
    """The thread that started the work fails (the mesh search's stop event): the run in
    the process raises ``Stopped`` within a poll, and its process is killed, not left
    to finish a search no one waits for."""
    big = knapsack(n=400, rows=12)
    stop = threading.Event()
    before = _children()
    outcome: list[BaseException] = []

    def solve() -> None:
        try:
            run(big, time_limit=120.0)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    with in_processes(), interrupt.stoppable(stop):
        worker = threading.Thread(target=contextvars.copy_context().run, args=(solve,))
        worker.start()
        deadline = time.monotonic() + 20
        while not (_children() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # HiGHS is searching
        began = time.monotonic()
        stop.set()
        worker.join(10)
        assert time.monotonic() - began < 5.0
        assert not _children() - before  # killed, before the block ends
    assert len(outcome) == 1 and isinstance(outcome[0], interrupt.Stopped)


def test_a_highs_process_that_dies_is_an_error_that_says_so():
    """A planted fault: the HiGHS process is killed mid-run (out of memory, a crash). The
    run raises an error naming the exit code; it never waits on."""
    big = knapsack(n=400, rows=12)
    before = _children()
    killer_done = threading.Event()

    def kill_it() -> None:
        deadline = time.monotonic() + 20
        while not (_children() - before) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        for pid in _children() - before:
            os.kill(pid, 9)
        killer_done.set()

    threading.Thread(target=kill_it, daemon=True).start()
    with (
        in_processes(),
        pytest.raises(RuntimeError, match=r"HiGHS's process ended \(exit code -9\)"),
    ):
        run(big, time_limit=120.0)
    assert killer_done.wait(5)


def test_a_mesh_search_s_peak_memory_counts_its_highs_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The search's HiGHS runs in processes of its own; the peak its report prints is this
    process's and theirs together, never this process's alone."""
    from helpers import write_mlp

    from autoshard.cost.mesh import MeshSpec, node_shapes
    from autoshard.solver import highs as highs_module
    from autoshard.solver.meshes import search_meshes
    from autoshard.solver.solve import SolveConfig

    monkeypatch.setattr(highs_module, "_processes_peak", 0)  # this search's, not another's

    model = write_mlp(tmp_path, 64, 256, 1024)
    config = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4"))
    meshes = [MeshSpec.on_nodes(s, 2) for s in node_shapes(4, 2)]
    search = search_meshes(config, meshes)
    assert processes_peak_bytes() > 20 * 2**20
    for row in search.rows:
        assert row.result.peak_rss_bytes >= processes_peak_bytes() + 20 * 2**20


_ORPHAN = """
import os, sys, threading, time
sys.path.insert(0, {tests!r})
from test_solver_progress import knapsack
from autoshard.solver.highs import in_processes, run

def tell():
    me = str(os.getpid())
    while True:
        for entry in os.listdir("/proc"):
            try:
                stat = open(f"/proc/{{entry}}/stat").read()
            except OSError:
                continue
            if entry.isdigit() and stat[stat.rindex(")") + 2 :].split()[1] == me:
                print(entry, flush=True)
                return
        time.sleep(0.05)

threading.Thread(target=tell, daemon=True).start()
with in_processes():
    run(knapsack(n=400, rows=12), time_limit=120.0)
"""


def test_a_highs_process_whose_parent_is_killed_ends_at_once():
    """Planted: the process that started a HiGHS process is killed (SIGKILL: no cleanup
    runs) while HiGHS searches. The HiGHS process sees its parent's pipe close and
    exits at once, where it would otherwise search on for up to its time limit."""
    import signal
    import subprocess
    import sys

    tests = str(Path(__file__).parent)
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN.format(tests=tests)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.5)  # HiGHS is searching
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                stat = Path(f"/proc/{child}/stat").read_text()
            except OSError:
                break  # gone
            if stat[stat.rindex(")") + 2] == "Z":
                break  # ended, not yet reaped by its new parent
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the HiGHS process searched on after its parent was killed")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_highs_process_that_cannot_start_is_an_error_and_leaves_no_open_file(monkeypatch):
    """A planted fault: the child cannot be started (here the interpreter's path is
    gone). The run raises the start's own error, and this process keeps none of the
    socket's or the pipe's ends it made for that child (counted in /proc/self/fd)."""
    import autoshard.solver.highs as highs

    def opened() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    monkeypatch.setattr(highs.sys, "executable", "/nonexistent/python")
    before = opened()
    with in_processes(), pytest.raises(FileNotFoundError, match="/nonexistent/python"):
        run(knapsack(n=20, rows=2), time_limit=10.0)
    assert opened() <= before
