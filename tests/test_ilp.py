"""The ILP's optimum equals brute force; the transportation form prices edges exactly."""

import math
from collections import Counter

import numpy as np
import pytest

from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.solver.ilp import brute_force, solve
from autoshard.solver.options import SolverOptions
from autoshard.strategies.graph import Edge, NodeStrategies, Strategy, StrategyGraph
from autoshard.trace.tracer import TensorInfo


def _random_graph(seed: int) -> StrategyGraph:
    """4-6 nodes, 2-4 strategies each, random DAG edges whose strategies group into
    random produced/wanted placements; some resharding pairs impossible (inf)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 7))
    nodes = {}
    for i in range(n):
        k = int(rng.integers(2, 5))
        nodes[f"n{i}"] = NodeStrategies(
            f"n{i}",
            [Strategy((), ()) for _ in range(k)],
            rng.uniform(0, 5, k),
            f"n{i}",
            np.arange(k),
        )
    edges = []
    for j in range(1, n):
        for i in range(j):
            if rng.random() < 0.5:
                ki, kj = len(nodes[f"n{i}"].strategies), len(nodes[f"n{j}"].strategies)
                P, Q = int(rng.integers(1, ki + 1)), int(rng.integers(1, kj + 1))
                cost = rng.uniform(0, 5, (P, Q))
                cost[rng.random((P, Q)) < 0.2] = math.inf
                cost[:, 0] = rng.uniform(0, 5, P)  # every source can reach wanted group 0
                edges.append(
                    Edge(
                        f"n{i}",
                        f"n{j}",
                        TensorInfo((4,), np.float32),
                        [None] * P,
                        [None] * Q,
                        rng.integers(0, P, ki),
                        rng.integers(0, Q, kj),
                        cost,
                    )
                )
    return StrategyGraph(None, (2,), nodes, set(), edges, Counter(), 0.0)


@pytest.mark.parametrize("seed", range(12))
def test_ilp_optimum_equals_brute_force(seed):
    sg = _random_graph(seed)
    best_choice, best = brute_force(sg)
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0))
    assert result.status == "optimal"
    assert result.objective_s == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert evaluate(sg, result.choice) == pytest.approx(best, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_the_compiled_program_is_the_program_cvxpy_solves(seed):
    """The ILP is stated in cvxpy and compiled to matrices for HiGHS (autoshard.solver.cvx).
    cvxpy's own solve of the same statement (its HiGHS interface, its own mapping of the
    columns back) reaches the optimum HiGHS reaches on the compiled matrices, and the
    compiled matrices' plan is the brute-force optimum. With the least-memory objective
    (only the last family's column priced), cvxpy orders its columns otherwise than the
    families: the peak column the compiled program reports is cvxpy's."""
    import cvxpy as cp

    from autoshard.solver.cvx import compile_program
    from autoshard.solver.highs import run
    from autoshard.solver.ilp import SCALE, _statement, build_problem

    sg = _random_graph(seed)
    prob = build_problem(sg)
    rng = np.random.default_rng(seed)
    per_strategy = rng.uniform(1, 9, prob.n_x)  # bytes of each strategy, one budget row
    for statement in (_statement(prob), _statement(prob, peak=per_strategy)):
        layout, c, constraints = statement
        stated = cp.Problem(cp.Minimize(layout.times(c)), constraints)
        stated.solve(solver=cp.HIGHS, mip_rel_gap=0.0)
        found = run(compile_program(layout, c, constraints), mip_rel_gap=0.0)
        assert stated.status == "optimal" and found.status == "optimal"
        assert found.objective == pytest.approx(stated.value, rel=1e-9, abs=1e-9)
        last = list(layout.variables.values())[-1]
        assert found.x[-last.size :] == pytest.approx(last.value, rel=1e-9, abs=1e-9)
    best_choice, best = brute_force(sg)
    found = run(compile_program(*_statement(prob)), mip_rel_gap=0.0)
    assert found.objective / SCALE == pytest.approx(best, rel=1e-9, abs=1e-9)
    least = min(
        sum(per_strategy[prob.offsets[r] + i] for r, i in choice.items())
        for choice in _all_choices(sg)
        if math.isfinite(evaluate(sg, choice))  # no impossible resharding
    )
    assert found_peak(prob, per_strategy) == pytest.approx(least, rel=1e-9)


def test_a_family_cvxpy_would_leave_out_is_an_error_and_an_empty_graph_the_solver_s():
    """A family of columns that no row reads and the objective does not price is left out
    by cvxpy's compile, which would shift every column after it: it is refused. A graph
    with nothing to decide compiles to the empty program, which the search refuses with
    its own error (as before the cvxpy statement), not a crash."""
    from autoshard.solver.cvx import Layout, compile_program

    layout = Layout([("a", 2, 0.0, 1.0, True), ("b", 1, 0.0, 1.0, False)])
    with pytest.raises(ValueError, match=r"no column for the families \['b'\]"):
        compile_program(
            layout, np.array([1.0, 2.0, 0.0]), layout.rows(np.ones((1, 3)) * [1, 1, 0], 1, 1)
        )
    empty = StrategyGraph(None, (2,), {}, set(), [], Counter(), 0.0)
    with pytest.raises(AutoshardError, match="the ILP solver failed"):
        solve(empty)


def found_peak(prob, per_strategy) -> float:
    from autoshard.solver.cvx import compile_program
    from autoshard.solver.highs import run
    from autoshard.solver.ilp import _statement

    found = run(compile_program(*_statement(prob, peak=per_strategy)), mip_rel_gap=0.0)
    return float(found.x[-1])


def test_impossible_pairs_are_never_chosen():
    """Two nodes, the cheap strategies can only be joined through an impossible resharding."""
    a = NodeStrategies("a", [Strategy((), ())] * 2, np.array([0.0, 10.0]), "a", np.arange(2))
    b = NodeStrategies("b", [Strategy((), ())] * 2, np.array([0.0, 10.0]), "b", np.arange(2))
    cost = np.array([[math.inf, 1.0], [2.0, 3.0]])
    e = Edge(
        "a",
        "b",
        TensorInfo((4,), np.float32),
        [None] * 2,
        [None] * 2,
        np.arange(2),
        np.arange(2),
        cost,
    )
    sg = StrategyGraph(None, (2,), {"a": a, "b": b}, set(), [e], Counter(), 0.0)
    result = solve(sg)
    # (0, 0) is impossible; (0, 1) costs 0 + 10 + 1 = 11; (1, 0) costs 10 + 0 + 2 = 12
    assert result.choice == {"a": 0, "b": 1}
    assert result.objective_s == pytest.approx(11.0)


def test_infeasible_memory_budget_is_a_clear_error():
    a = NodeStrategies("a", [Strategy((), ())] * 2, np.array([1.0, 2.0]), "a", np.arange(2))
    sg = StrategyGraph(None, (2,), {"a": a}, set(), [], Counter(), 0.0)
    with pytest.raises(AutoshardError, match="budget of 5 B .* needs at least 10 B"):
        solve(sg, memory=(np.array([10.0, 20.0]), 5.0))


def test_solver_options_validated():
    with pytest.raises(AutoshardError, match="time-limit"):
        SolverOptions(time_limit_s=0)
    with pytest.raises(AutoshardError, match="mip-gap"):
        SolverOptions(mip_gap=1.5)


def _as_incumbent(sg, choice):
    from autoshard.solver.ilp import ILPResult

    return ILPResult(dict(choice), evaluate(sg, choice), "incumbent", 1.0, 0, 0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_full_mip_beats_a_poor_relax_and_fix_plan(seed, monkeypatch):
    """Relax-and-fix outside the gap: the full MIP, cut off at that plan's objective,
    must still reach the brute-force optimum (and never return the poorer plan)."""
    import autoshard.solver.ilp as ilp

    sg = _random_graph(seed)
    best_choice, best = brute_force(sg)
    worst = max(
        (c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c))),
        key=lambda c: evaluate(sg, c),
    )
    monkeypatch.setattr(ilp, "_lp_first", lambda sg_, *a: _as_incumbent(sg_, worst))
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0))
    assert result.objective_s == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert evaluate(sg, result.choice) == pytest.approx(best, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_optimal_relax_and_fix_plan_is_proven_by_the_cut_off_mip(seed, monkeypatch):
    """The relax-and-fix plan is already optimal: the MIP cut off at its objective finds
    nothing better (infeasible), which proves it: status optimal, gap 0."""
    import autoshard.solver.ilp as ilp

    sg = _random_graph(seed)
    best_choice, best = brute_force(sg)
    monkeypatch.setattr(ilp, "_lp_first", lambda sg_, *a: _as_incumbent(sg_, best_choice))
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0))
    assert result.status == "optimal" and result.gap == 0.0
    assert result.objective_s == pytest.approx(best, rel=1e-9, abs=1e-9)


def _all_choices(sg):
    import itertools

    reps = sg.reps
    for combo in itertools.product(*(range(len(sg.nodes[r].strategies)) for r in reps)):
        yield dict(zip(reps, combo, strict=True))


# ---- hand-written starts: the ILP is never above one ----------------------------------------


def test_search_gains_over_a_start_and_says_so():
    sg = _random_graph(3)
    best_choice, best = brute_force(sg)
    worst = max(
        (c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c))),
        key=lambda c: evaluate(sg, c),
    )
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0), starts={"worst": worst})
    assert result.objective_s == pytest.approx(best, rel=1e-9, abs=1e-9)
    assert result.start == "worst"
    assert result.start_objective_s == pytest.approx(evaluate(sg, worst))


@pytest.mark.parametrize("seed", range(4))
def test_a_plan_above_the_start_is_never_returned(seed, monkeypatch):
    """Planted fault: the search hands back its worst plan as 'within the gap'. The start
    (the optimum here) must win, whatever the search says."""
    import autoshard.solver.ilp as ilp

    sg = _random_graph(seed)
    best_choice, best = brute_force(sg)
    finite = [c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c))]
    worst = max(finite, key=lambda c: evaluate(sg, c))
    if evaluate(sg, worst) <= best:
        pytest.skip("every plan costs the same")
    poor = ilp.replace(_as_incumbent(sg, worst), status="within_gap", bound_s=0.0)
    monkeypatch.setattr(ilp, "_lp_first", lambda *a: poor)
    result = solve(sg, SolverOptions(time_limit_s=60), starts={"hand": best_choice})
    assert result.choice == best_choice
    assert result.objective_s == pytest.approx(best)


@pytest.mark.parametrize("seed", range(3))
def test_a_start_that_the_search_proves_optimal_reports_the_search_s_size(seed, monkeypatch):
    """Issue 27 (a report seen at a time limit: "0 variables, 0 constraints"): the search
    cut off at an optimal start finds nothing better and keeps the start, whose own record
    has no program; the result gives the size of the program that proved it."""
    import autoshard.solver.ilp as ilp

    sg = _random_graph(seed)
    best_choice, best = brute_force(sg)
    monkeypatch.setattr(ilp, "_lp_first", lambda *a: None)  # straight to the cut-off MIP
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0), starts={"hand": best_choice})
    prob = ilp.build_problem(sg)
    assert result.choice == best_choice and result.start == "hand"
    assert result.status == "optimal" and result.gap == 0.0
    assert result.num_variables == prob.n_x + prob.n_y > 0
    assert result.num_constraints == prob.A.shape[0] > 0


def test_a_search_that_finds_nothing_in_time_keeps_the_start(monkeypatch):
    import autoshard.solver.ilp as ilp

    sg = _random_graph(5)
    choice = next(c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c)))

    def no_plan(*a, **k):
        raise AutoshardError("the ILP found no plan within --time-limit 3 s")

    monkeypatch.setattr(ilp, "_search", no_plan)
    result = solve(sg, SolverOptions(time_limit_s=3), starts={"ddp": choice})
    assert result.choice == choice and result.start == "ddp"
    assert result.status == "stopped"  # not proven; no limit of its own stopped it


def test_a_spent_time_limit_keeps_the_best_start_and_searches_no_more(monkeypatch):
    """``--time-limit`` is one budget for the whole solve: once spent (``after``), a solve
    with a start that fits makes no search and keeps the cheapest start. Each search used
    to get at least 1 s again, so the memory rounds of a binding budget ran on: GPT-2 at
    2x4 under 1 GiB with ``--time-limit 20`` searched for 40 s (issue 28's closing note)."""
    import autoshard.solver.ilp as ilp

    sg = _random_graph(4)
    finite = sorted(
        (c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c))),
        key=lambda c: evaluate(sg, c),
    )
    cheap, dear = finite[1], finite[-1]  # the cheaper start is not the optimum

    def no_search(*a, **k):
        raise AssertionError("searched with the time limit spent")

    monkeypatch.setattr(ilp, "_search", no_search)
    spent = SolverOptions(time_limit_s=3).after(4.0)
    assert spent.spent and not SolverOptions(time_limit_s=3).after(2.0).spent
    assert not SolverOptions().after(100.0).spent  # no wall-clock limit: never spent
    result = solve(sg, spent, starts={"dear": dear, "cheap": cheap})
    assert result.choice == cheap and result.start == "cheap"
    assert result.objective_s == pytest.approx(evaluate(sg, cheap))
    assert result.status == "time_limit"
    with pytest.raises(AssertionError, match="searched"):  # no start: it must search
        solve(sg, spent, starts={})


def test_a_start_over_the_memory_budget_is_not_used():
    sg = _random_graph(2)
    _, best = brute_force(sg)
    n_x = sum(len(sg.nodes[r].strategies) for r in sg.reps)
    memory = (np.ones(n_x), float(len(sg.reps)))  # every plan uses len(reps) bytes: fits
    tight = (np.ones(n_x), float(len(sg.reps)) - 0.5)  # nothing fits
    choice = next(c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c)))
    assert solve(sg, SolverOptions(mip_gap=0.0), memory, {"a": choice}).start == "a"
    with pytest.raises(AutoshardError, match="memory budget"):
        solve(sg, SolverOptions(mip_gap=0.0), tight, {"a": choice})


def test_zeros_from_a_stopped_mip_are_not_a_plan():
    """HiGHS stopped by its time limit before any feasible point hands back zeros; they
    once came back as a plan (every node's strategy 0) with objective 0."""
    from autoshard.solver.ilp import _valid_choice, build_problem

    sg = _random_graph(1)
    prob = build_problem(sg)
    assert _valid_choice(sg, prob, np.zeros(prob.n_x + prob.n_y)) is None
    assert _valid_choice(sg, prob, None) is None
    x = np.zeros(prob.n_x)
    for r in prob.reps:
        x[prob.offsets[r]] = 1
    assert _valid_choice(sg, prob, x) == {r: 0 for r in prob.reps}


@pytest.mark.parametrize("seed", range(6))
def test_highs_run_agrees_with_scipy_milp(seed):
    """autoshard.solver.highs hands matrices to HiGHS itself; scipy.optimize.milp (another
    interface, its own bounds and integrality handling) must reach the same optimum."""
    import scipy.sparse as sparse
    from scipy.optimize import Bounds, LinearConstraint, milp

    from autoshard.solver.highs import MILP, run

    rng = np.random.default_rng(seed)
    n, m = 12, 8
    dense = np.round(rng.random((m, n)) * 4 - 1) * (rng.random((m, n)) < 0.4)
    A = sparse.csr_matrix(dense)
    x0 = (rng.random(n) < 0.5).astype(float)  # a feasible point by construction
    slack = rng.integers(0, 3, m)
    lower, upper = np.full(m, -np.inf), A @ x0 + slack
    c = rng.normal(size=n)
    integer = np.arange(n) < 8
    col_upper = np.where(integer, 1.0, 3.0)
    ours = run(MILP(c, A, lower, upper, np.zeros(n), col_upper, integer), 10.0, 0.0)
    ref = milp(
        c,
        constraints=LinearConstraint(A, lower, upper),
        integrality=integer.astype(int),
        bounds=Bounds(np.zeros(n), col_upper),
    )
    assert ref.success and ours.status == "optimal"
    assert ours.objective == pytest.approx(ref.fun, abs=1e-7)
    assert np.all(A @ ours.x <= upper + 1e-7)
    started = run(
        MILP(c, A, lower, upper, np.zeros(n), col_upper, integer),
        10.0,
        0.0,
        start=(np.arange(8), x0[:8]),
    )
    assert started.objective == pytest.approx(ref.fun, abs=1e-7)


def test_ctrl_c_cancels_highs_at_once():
    """A market-split instance (Cornuejols and Dawande: 6 equality rows of random
    coefficients over 50 binaries) that HiGHS does not finish in 30 s; Ctrl-C after 1 s
    stops it within a second and raises KeyboardInterrupt."""
    import _thread
    import signal
    import threading
    import time

    import scipy.sparse as sparse

    from autoshard.solver.highs import MILP, run

    rng = np.random.default_rng(0)
    m, n = 6, 50
    A = rng.integers(0, 100, (m, n)).astype(float)
    b = np.floor(A.sum(1) / 2)
    full = sparse.hstack([sparse.csr_matrix(A), sparse.identity(m), -sparse.identity(m)])
    c = np.concatenate([np.zeros(n), np.ones(2 * m)])  # min |slack|
    upper = np.concatenate([np.ones(n), np.full(2 * m, np.inf)])
    milp = MILP(c, full, b, b, np.zeros(n + 2 * m), upper, np.arange(n + 2 * m) < n)
    timer = threading.Timer(1.0, _thread.interrupt_main)  # what SIGINT does
    # interrupt_main does nothing where SIGINT is ignored (a suite started in the
    # background of a shell without job control): Ctrl-C as in a terminal
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    t0 = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(milp, 30.0, 0.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - t0 < 3.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"work_limit": 0}, r"--work-limit \(work_limit\) must be a positive whole number"),
        ({"time_limit_s": 0.0}, r"--time-limit \(time_limit_s\) must be positive seconds"),
        ({"mip_gap": 1.0}, r"--mip-gap \(mip_gap\) must be in \[0, 1\)"),
    ],
)
def test_solver_options_name_the_option_as_the_cli_and_the_api_spell_it(kwargs, message):
    with pytest.raises(AutoshardError, match=message):
        SolverOptions(**kwargs)


def test_without_a_time_limit_the_options_have_no_deadline():
    assert SolverOptions().deadline(100.0) is None
    assert SolverOptions().after(50.0) == SolverOptions()
    assert SolverOptions(time_limit_s=30.0).deadline(100.0) == 130.0
    assert SolverOptions(time_limit_s=30.0).after(50.0).time_limit_s == 1.0  # at least 1 s


def test_an_lp_relaxation_stopped_at_its_iteration_limit_keeps_the_start():
    """The full MIP's root would solve the same LP again with nothing to cap it: the search
    keeps its start, says which limit stopped it, and without a start says so in one line."""
    from autoshard.solver.ilp import _best_start, _search

    sg = _random_graph(5)
    choice = next(c for c in _all_choices(sg) if math.isfinite(evaluate(sg, c)))
    start = _best_start(sg, {"ddp": choice}, None)
    stopped = SolverOptions(lp_iteration_limit=1)
    result = _search(sg, stopped, None, start)
    assert result.status == "iteration_limit" and result.choice == choice
    assert result.num_variables > 0
    with pytest.raises(AutoshardError, match="stopped at 1 simplex iterations"):
        _search(sg, stopped, None, None)
    assert _search(sg, SolverOptions(), None, start).status in ("optimal", "within_gap")


# ---- the overlap savings: straight to the full MIP (issue 29) ---------------------------------


def test_with_overlap_the_full_mip_proves_the_optimum_the_fractional_lp_cannot(
    tmp_path, monkeypatch
):
    """bf16-mixed training of a 2-layer MLP (2048 x 2048 -> 8192) on 4 devices: with the
    overlap savings the LP relaxation is fractional, 2% under the optimum, so a plan can
    only be proven by branch and bound. The search (straight to the full MIP) proves its
    plan optimal; its objective is the plan's step time as the greedy fill prices it; and
    no plan that changes the strategies of the four nodes with the most choices (1,296
    plans, every other node as the search chose) is faster."""
    import itertools

    from helpers import write_mlp

    from autoshard.cost.mesh import MeshSpec
    from autoshard.solver.highs import run
    from autoshard.solver.ilp import SCALE, _milp, build_problem
    from autoshard.solver.solve import SolveConfig, strategies, trace

    config = SolveConfig(
        write_mlp(tmp_path, b=2048, d=2048, h=8192),
        MeshSpec.from_options("4"),
        precision="bf16-mixed",
    )
    sg = strategies(config, trace(config))
    prob = build_problem(sg)
    assert prob.overlap is not None
    lp = run(_milp(prob, boolean=False))
    xv = lp.x[: prob.n_x]
    assert np.any((xv > 1e-6) & (xv < 1 - 1e-6)), "the LP must be fractional here"
    import autoshard.solver.ilp as ilp

    lp_first = ilp._lp_first

    def only_without_overlap(sg_, prob_, *args):
        assert prob_.overlap is None, "LP first on a program with the overlap savings"
        return lp_first(sg_, prob_, *args)  # the start solved without them

    monkeypatch.setattr(ilp, "_lp_first", only_without_overlap)
    monkeypatch.setattr(ilp, "SMALL_PROGRAM", 0)  # this one is small: take the large path
    result = solve(sg, SolverOptions(mip_gap=0.0))
    assert result.status == "optimal" and result.gap <= 1e-9
    assert result.objective_s == pytest.approx(evaluate(sg, result.choice), rel=1e-12)
    assert lp.objective / SCALE < result.objective_s * (1 - 0.01)  # the LP is 2% under
    widest = sorted(sg.reps, key=lambda r: -len(sg.nodes[r].strategies))[:4]
    best = result.objective_s
    for combo in itertools.product(*(range(len(sg.nodes[r].strategies)) for r in widest)):
        choice = {**result.choice, **dict(zip(widest, combo, strict=True))}
        assert evaluate(sg, choice) >= best * (1 - 1e-9), choice
