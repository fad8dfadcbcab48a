"""The MIP's progress while HiGHS runs (issue 27, item 3): what a listener is told is what
HiGHS itself ends with, and listening changes nothing in the answer."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import scipy.sparse as sp
from rich.console import Console

from autoshard.solver.highs import MILP, SolverProgress, listening, run


def knapsack(n: int = 120, rows: int = 5, seed: int = 0) -> MILP:
    """A 0/1 multi-knapsack (maximise value under ``rows`` weight rows, a third of each
    row's total weight): hard enough that HiGHS branches for about a second."""
    rng = np.random.default_rng(seed)
    value = rng.integers(10, 100, n).astype(float)
    weights = rng.integers(10, 100, (rows, n)).astype(float)
    return MILP(
        c=-value,
        A=sp.csr_matrix(weights),
        row_lower=np.full(rows, -np.inf),
        row_upper=weights.sum(axis=1) / 3,
        col_lower=np.zeros(n),
        col_upper=np.ones(n),
        integer=np.ones(n, dtype=bool),
    )


@pytest.mark.slow
def test_the_listener_sees_the_incumbent_bound_and_gap_that_highs_ends_with():
    milp = knapsack()
    quiet = run(milp, time_limit=60.0, seconds_per_unit=1e-6)
    told: list[SolverProgress] = []
    with listening(told.append):
        found = run(milp, time_limit=60.0, seconds_per_unit=1e-6)
    assert found.status == quiet.status == "optimal"
    np.testing.assert_array_equal(found.x, quiet.x)  # listening changes nothing
    assert len(told) >= 2 and all(p.mip and p.in_seconds for p in told)
    with_incumbent = [p for p in told if p.incumbent is not None]
    assert with_incumbent, told
    # the incumbent only improves (a minimisation), the bound only rises, both in seconds
    inc = [p.incumbent for p in with_incumbent]
    assert inc == sorted(inc, reverse=True)
    bounds = [p.bound for p in told if p.bound is not None]
    assert bounds == sorted(bounds)
    # the last report is no better than HiGHS's answer and within its final gap
    last = with_incumbent[-1]
    assert last.incumbent >= found.objective * 1e-6 - 1e-12
    assert all(p.bound <= found.objective * 1e-6 + 1e-12 for p in told if p.bound is not None)
    # a report with both has HiGHS's gap: (incumbent - bound) / |incumbent|
    both = [p for p in told if p.incumbent is not None and p.bound is not None and p.gap]
    for p in both:
        assert abs(p.gap - (p.incumbent - p.bound) / abs(p.incumbent)) < 1e-6


def test_nothing_listens_outside_the_block():
    told: list[SolverProgress] = []
    with listening(told.append):
        pass
    run(knapsack(n=40), time_limit=60.0)
    assert told == []


def test_a_piped_solve_prints_the_incumbent_bound_and_gap():
    """The CLI's progress, piped (no terminal): a line per report at most every
    EVERY_S seconds, with the incumbent, the bound and the gap in the step's units."""
    from autoshard.cli.options import Progress

    buf = io.StringIO()
    with Progress(Console(file=buf, force_terminal=False, width=200)) as progress:
        progress.EVERY_S = 0.0
        progress("solve", 0, 1)
        run(knapsack(), time_limit=60.0, seconds_per_unit=1e-6)
        progress("solve", 1, 1)
    lines = [line for line in buf.getvalue().splitlines() if "incumbent" in line]
    assert lines, buf.getvalue()
    assert re.search(r"incumbent -?[\d.]+ ms, bound -?[\d.]+ ms, gap [\d.]+%$", lines[-1]), lines


def test_on_a_terminal_the_solve_phase_shows_the_incumbent_as_it_improves():
    """On a terminal the rich bar's solve line carries the latest report."""
    from autoshard.cli.options import Progress

    buf = io.StringIO()
    with Progress(Console(file=buf, force_terminal=True, width=200)) as progress:
        progress("solve", 0, 1)
        run(knapsack(), time_limit=60.0, seconds_per_unit=1e-6)
        task = progress.bar.tasks[progress.tasks["solve"]]
        assert re.search(r"incumbent -?[\d.]+ ms, bound -?[\d.]+ ms, gap", task.description)
        progress("solve", 1, 1)


def _two_labelled_runs_at_once() -> None:
    """Two MIPs at once, as the mesh search's lanes run them: each on a thread of its own
    (in this context: the listener), in a HiGHS process of its own, labelled A and B."""
    import contextvars
    import threading

    from autoshard.solver.highs import about, in_processes

    def solve(subject: str, seed: int) -> None:
        with about(subject):
            run(knapsack(seed=seed), time_limit=60.0, seconds_per_unit=1e-6)

    with in_processes():
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(solve, s, k))
            for k, s in enumerate("AB")
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def test_two_mips_at_once_each_print_their_own_labelled_line():
    """Piped, two MIPs solved at once (the mesh search's two lanes) each get lines of
    their own, labelled with their subject, where before one unlabelled line took
    turns between two problems' incumbents."""
    from autoshard.cli.options import Progress

    buf = io.StringIO()
    with Progress(Console(file=buf, force_terminal=False, width=200)) as progress:
        progress.EVERY_S = 0.0
        progress("solve", 0, 1)
        _two_labelled_runs_at_once()
        progress("solve", 1, 1)
    lines = [line for line in buf.getvalue().splitlines() if "incumbent" in line]
    for subject in "AB":
        assert any(re.search(rf", {subject}: incumbent -?[\d.]+ ms", x) for x in lines), lines
    assert all(re.search(r", [AB]: incumbent", x) for x in lines), lines


def test_on_a_terminal_two_mips_at_once_show_side_by_side():
    """On a terminal the solve line carries each running thread's latest report, each
    labelled with its subject, side by side while both run; a MIP silent for
    ``STALE_S`` (it ended) leaves the line."""
    from autoshard.cli.options import Progress
    from autoshard.solver.highs import SolverProgress

    buf = io.StringIO()
    with Progress(Console(file=buf, force_terminal=True, width=200)) as progress:
        progress("solve", 0, 1)
        shown_lines: list[str] = []
        update = progress.bar.update

        def seen(task, **fields) -> None:  # noqa: ANN001 - rich's task id
            shown_lines.append(fields.get("description", ""))
            update(task, **fields)

        progress.bar.update = seen
        _two_labelled_runs_at_once()
        both = [d for d in shown_lines if "A: incumbent" in d and "B: incumbent" in d]
        assert both, shown_lines[-5:]
        shown = both[-1].split(": ", 1)[1].split("; ")
        assert len(shown) == 2, both[-1]
        for subject in "AB":
            assert any(re.match(rf"{subject}: incumbent -?[\d.]+ ms", x) for x in shown), shown
        progress.STALE_S = 0.0  # both ended: a third report shows alone
        progress.solver(SolverProgress(1e-3, 1e-3, 0.0, 1.0, True, subject="C"))
        assert shown_lines[-1].endswith("(HiGHS): C: incumbent 1.00 ms, bound 1.00 ms, gap 0.00%")
        progress("solve", 1, 1)


@pytest.mark.slow
def test_an_autoshard_plan_is_the_same_whether_or_not_a_listener_is_told():
    """Two Megatron MLP blocks on 2x2, planned by the Python API with and without a
    listener: the listener is told (the MIP branches), and the choice, the objective and
    every parameter's placements are the same."""
    import torch
    from torch import nn

    from autoshard import api

    def model() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(
                *(
                    nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
                    for _ in range(2)
                )
            )

    x = torch.empty(256, 1024, device="meta")  # at 64 rows HiGHS ends the MIP at its root
    quiet = api.solve(model(), (x,), "2x2")
    told: list[SolverProgress] = []
    with listening(told.append):
        heard = api.solve(model(), (x,), "2x2")
    assert told
    assert heard.ilp.choice == quiet.ilp.choice
    assert heard.ilp.objective_s == quiet.ilp.objective_s
    assert heard.plan.parameters == quiet.plan.parameters


@pytest.mark.slow
def test_a_work_limit_stops_the_mip_on_the_same_point_every_run():
    """HiGHS's limit checks counted (the work limit): a stopped MIP ends on the same
    incumbent, bound and count of nodes on every run; without a limit it is optimal, at
    an objective no worse than the stopped one."""
    milp = knapsack()
    free = run(milp)
    assert free.status == "optimal" and free.work > 40
    limit = free.work // 4
    first, second = run(milp, work_limit=limit), run(milp, work_limit=limit)
    assert first.status == second.status == "work_limit"
    assert first.model_status == f"work limit ({limit} units)"
    assert limit <= first.work <= limit + 5  # HiGHS stops at its next check
    assert (first.work, first.nodes, first.objective, first.bound) == (
        second.work,
        second.nodes,
        second.objective,
        second.bound,
    )
    np.testing.assert_array_equal(first.x, second.x)
    assert free.objective <= first.objective  # a minimisation


def test_an_lp_stops_at_its_iteration_limit():
    lp = knapsack()
    lp.integer = np.zeros(lp.num_cols, dtype=bool)
    free = run(lp)
    assert free.status == "optimal" and free.iterations > 2
    stopped = run(lp, iteration_limit=1)
    assert stopped.status == "iteration_limit"


def test_a_stop_that_is_no_limit_of_ours_is_stopped_not_blamed_on_a_limit(monkeypatch):
    """HiGHS stopped by a limit autoshard never sets (here its node limit, planted through
    the options of the Highs object it gets) says ``stopped``: a report must not tell the
    user to raise ``--time-limit`` for it (HiGHS's kSolutionLimit was once ``time_limit``)."""
    import autoshard.solver.highs as highs_module

    made = highs_module.new_highs

    def node_limited():
        h = made()
        h.setOptionValue("mip_max_nodes", 1)
        return h

    milp = knapsack()
    assert run(milp).status == "optimal"  # the unplanted search ends with a proof
    monkeypatch.setattr(highs_module, "new_highs", node_limited)
    stopped = run(milp)
    assert stopped.model_status == "Solution limit reached"
    assert stopped.status == "stopped"


@pytest.mark.slow
def test_a_tally_splits_highs_runs_into_lps_and_mips_and_nests():
    """What the bench prints as HiGHS's LP and branch-and-bound share: every run inside the
    block, each counted once on its side, its nodes and iterations as HiGHS reported them;
    an inner block's runs count in the outer one too, and nothing outside a block counts."""
    from autoshard.solver.highs import tallying

    milp = knapsack()
    lp = knapsack()
    lp.integer = np.zeros(lp.num_cols, dtype=bool)
    run(milp)  # outside any block
    with tallying() as outer:
        first = run(lp)
        with tallying() as inner:
            second = run(milp)
    assert (inner.lp_runs, inner.mip_runs) == (0, 1)
    assert (inner.nodes, inner.iterations) == (second.nodes, second.iterations)
    assert (outer.lp_runs, outer.mip_runs) == (1, 1)
    assert outer.nodes == second.nodes > 0
    assert outer.iterations == first.iterations + second.iterations
    assert outer.lp_seconds > 0 and outer.mip_seconds == inner.mip_seconds > 0


def test_an_error_after_a_stop_of_no_limit_of_ours_does_not_blame_the_time_limit():
    """With --time-limit set, a search HiGHS stopped on its own (status ``stopped``) says
    so; only a search the time limit stopped says to raise it."""
    from autoshard.solver.ilp import _limit_words
    from autoshard.solver.options import SolverOptions

    options = SolverOptions(time_limit_s=30)
    assert "--time-limit" not in _limit_words("stopped", options)
    assert "none of autoshard's limits" in _limit_words("stopped", options)
    assert _limit_words("time_limit", options) == "stopped at --time-limit 30 s; raise it"
    from autoshard.solver.options import WORK_LIMIT

    assert f"--work-limit {WORK_LIMIT}" in _limit_words("work_limit", SolverOptions())
