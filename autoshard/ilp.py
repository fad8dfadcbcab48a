"""The sharding ILP: one strategy per node, cheapest total time, built vectorised.

Mathematics (the method that builds each part is named in brackets):

* For every representative node ``v`` with strategies ``1..k_v`` a boolean vector
  ``s_v``; all of them are concatenated into ONE boolean vector ``x``
  [``_node_blocks``]. Each node picks exactly one strategy:
  ``sum(s_v) = 1`` [``_one_strategy_rows``].
* For every edge ``(u -> v)`` (a tensor ``u`` produces and ``v`` reads) the
  strategies of ``u`` are grouped by the placement they *produce* (``a = 1..P``)
  and those of ``v`` by the placement they *want* (``b = 1..Q``). A nonnegative
  matrix ``e_uv`` (``P x Q``, concatenated into one vector ``y``) with
  row sums ``sum_b e_uv[a, b] = sum_{i: group(i) = a} s_u[i]`` and column sums
  ``sum_a e_uv[a, b] = sum_{j: group(j) = b} s_v[j]`` [``_edge_rows``]. Once ``x`` is
  integral exactly one entry of ``e_uv`` is 1, so ``y`` needs no integrality; this
  transportation form is tighter than MASE's three-inequality linearisation of
  ``s_u[i] * s_v[j]`` and, grouping by placement, much smaller than the
  ``k_u x k_v`` strategy pairs. Pairs that cannot be resharded (anything into
  ``Partial``) get no variable at all.
* Optional memory budget: ``m . x <= budget`` with ``m`` the bytes a strategy
  keeps on one device (:func:`autoshard.memory.memory_rows`); when infeasible, the
  least ``m . x`` any plan reaches is reported [``_least_memory``].
* Minimise ``c . x + r . y``: ``c`` the compute seconds of each strategy
  (roofline of its local shard, plus every node merged into it), ``r`` the
  resharding seconds of each (produced, wanted) pair (alpha-beta ring model,
  :mod:`autoshard.mesh`).

Solved with cvxpy + HiGHS (``mip_rel_gap``, ``time_limit``). A hit time limit
returns the incumbent with its gap; no incumbent or infeasibility raises
:class:`~autoshard.errors.AutoshardError`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import cvxpy as cp
import numpy as np
import scipy.sparse as sp

from autoshard.errors import AutoshardError
from autoshard.strategies import StrategyGraph

SCALE = 1e6  # the ILP's objective is in microseconds


@dataclass(frozen=True)
class SolverOptions:
    """Options of the ILP solve, validated once.

    ``time_limit_s``: wall-clock limit for HiGHS (s). ``mip_gap``: relative
    optimality gap at which HiGHS stops (0 = prove optimality).
    """

    time_limit_s: float = 600.0
    mip_gap: float = 0.0

    def __post_init__(self) -> None:
        if not self.time_limit_s > 0:
            raise AutoshardError(f"--time-limit must be positive seconds, got {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise AutoshardError(f"--mip-gap must be in [0, 1), got {self.mip_gap}")


@dataclass
class ILPResult:
    """The chosen strategy per representative node and the solver's report.

    ``choice``: representative name -> chosen strategy index. ``objective_s``: the
    ILP objective (s). ``gap``: relative MIP gap of the returned plan (0 when proven
    optimal). ``status``: ``optimal`` or ``time_limit``.
    """

    choice: dict[str, int]
    objective_s: float
    status: str
    gap: float
    num_variables: int
    num_constraints: int
    build_seconds: float
    solve_seconds: float
    bound_s: float | None = None


@dataclass
class _Problem:
    reps: list[str]
    offsets: dict[str, int]
    n_x: int
    n_y: int
    c: np.ndarray
    r: np.ndarray
    A: sp.csr_matrix
    b: np.ndarray
    edge_offsets: list[int]
    keep: list[np.ndarray]


def _node_blocks(sg: StrategyGraph) -> tuple[list[str], dict[str, int], np.ndarray]:
    reps = sg.reps
    offsets, pos = {}, 0
    for r in reps:
        offsets[r] = pos
        pos += len(sg.nodes[r].strategies)
    c = np.concatenate([sg.rep_cost(r) for r in reps]) if reps else np.zeros(0)
    return reps, offsets, c


def _one_strategy_rows(reps, offsets, sg, n_x) -> sp.csr_matrix:
    rows, cols = [], []
    for i, r in enumerate(reps):
        k = len(sg.nodes[r].strategies)
        rows.append(np.full(k, i))
        cols.append(np.arange(offsets[r], offsets[r] + k))
    if not rows:
        return sp.csr_matrix((0, n_x))
    return sp.csr_matrix(
        (np.ones(sum(len(x) for x in rows)), (np.concatenate(rows), np.concatenate(cols))),
        shape=(len(reps), n_x),
    )


def _edge_rows(sg, offsets, n_x) -> tuple[sp.csr_matrix, np.ndarray, list[int], list[np.ndarray]]:
    """Row- and column-sum constraints of every edge, over ``[x; y]``."""
    data, rows, cols = [], [], []
    r_costs, edge_offsets, keeps = [], [], []
    row = 0
    y_pos = 0
    for e in sg.edges:
        P, Q = e.cost.shape
        keep = np.isfinite(e.cost).ravel()
        idx = np.flatnonzero(keep)
        a_of, b_of = idx // Q, idx % Q
        ycols = n_x + y_pos + np.arange(len(idx))
        # row sums: sum_b e[a, b] - sum_{i in group a} s_u[i] = 0
        rows.append(row + a_of)
        cols.append(ycols)
        data.append(np.ones(len(idx)))
        rows.append(row + e.src_groups)
        cols.append(offsets[e.src] + np.arange(len(e.src_groups)))
        data.append(-np.ones(len(e.src_groups)))
        row += P
        # column sums: sum_a e[a, b] - sum_{j in group b} s_v[j] = 0
        rows.append(row + b_of)
        cols.append(ycols)
        data.append(np.ones(len(idx)))
        rows.append(row + e.dst_groups)
        cols.append(offsets[e.dst] + np.arange(len(e.dst_groups)))
        data.append(-np.ones(len(e.dst_groups)))
        row += Q
        r_costs.append(e.cost.ravel()[idx])
        edge_offsets.append(y_pos)
        keeps.append(idx)
        y_pos += len(idx)
    n_y = y_pos
    if not rows:
        return sp.csr_matrix((0, n_x)), np.zeros(0), [], []
    A = sp.csr_matrix(
        (np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))),
        shape=(row, n_x + n_y),
    )
    return A, np.concatenate(r_costs), edge_offsets, keeps


def build_problem(sg: StrategyGraph) -> _Problem:
    """Assemble the sparse equality system and cost vectors (no cvxpy yet)."""
    reps, offsets, c = _node_blocks(sg)
    n_x = len(c)
    A_edges, r, edge_offsets, keeps = _edge_rows(sg, offsets, n_x)
    n_y = len(r)
    A_one = _one_strategy_rows(reps, offsets, sg, n_x)
    A_one = sp.hstack([A_one, sp.csr_matrix((A_one.shape[0], n_y))], format="csr")
    A = sp.vstack([A_one, A_edges], format="csr")
    b = np.concatenate([np.ones(A_one.shape[0]), np.zeros(A_edges.shape[0])])
    return _Problem(reps, offsets, n_x, n_y, c, r, A, b, edge_offsets, keeps)


def solve(
    sg: StrategyGraph,
    options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
) -> ILPResult:
    """Solve the sharding ILP of ``sg``.

    Args:
        sg: strategies, costs and edges.
        options: time limit and MIP gap.
        memory: optional ``(bytes per strategy over x, budget bytes)``.

    Raises:
        AutoshardError: infeasible (e.g. the memory budget), or no plan found
            within the time limit.
    """
    options = options or SolverOptions()
    t0 = time.perf_counter()
    prob = build_problem(sg)
    x = cp.Variable(prob.n_x, boolean=True)
    y = cp.Variable(prob.n_y, nonneg=True) if prob.n_y else None
    z = cp.hstack([x, y]) if y is not None else x
    constraints = [prob.A @ z == prob.b]
    if memory is not None:
        m, budget = memory
        constraints.append(m @ x <= budget)
    # in microseconds: HiGHS's absolute tolerances (mip_abs_gap 1e-6) would otherwise
    # stop it at plans a whole microsecond-scale objective away from the optimum
    objective = SCALE * prob.c @ x + (SCALE * prob.r @ y if y is not None else 0)
    problem = cp.Problem(cp.Minimize(objective), constraints)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    try:
        problem.solve(
            solver=cp.HIGHS,
            time_limit=float(options.time_limit_s),
            mip_rel_gap=float(options.mip_gap),
            mip_abs_gap=0.0,
        )
    except cp.error.SolverError as exc:
        raise AutoshardError(f"the ILP solver failed: {exc}") from exc
    solve_s = time.perf_counter() - t1
    status = problem.status
    if status in (cp.INFEASIBLE, cp.INFEASIBLE_INACCURATE):
        if memory is not None:
            from autoshard.units import format_bytes

            least = _least_memory(prob, memory[0], options)
            raise AutoshardError(
                f"no plan fits the memory budget of {format_bytes(memory[1])} per device: the "
                f"smallest any plan in the search space reaches is {format_bytes(least)}; "
                "raise --memory-budget, use more devices, or a smaller --dtype"
            )
        raise AutoshardError("no sharding plan satisfies the constraints (ILP infeasible)")
    if x.value is None:
        raise AutoshardError(
            f"the ILP found no plan within --time-limit {options.time_limit_s:g} s "
            f"(status {status}); raise --time-limit"
        )
    xv = x.value
    choice = {}
    for rname in prob.reps:
        k = len(sg.nodes[rname].strategies)
        block = xv[prob.offsets[rname] : prob.offsets[rname] + k]
        choice[rname] = int(np.argmax(block))
    bound, gap = _bound_and_gap(problem)
    bound = bound / SCALE if bound is not None else None
    objective = float(problem.value) / SCALE
    status_text = "optimal" if status == cp.OPTIMAL else "time_limit"
    if status_text == "optimal" and gap is None:
        gap = 0.0
    return ILPResult(
        choice=choice,
        objective_s=objective,
        status=status_text,
        gap=float(gap) if gap is not None else math.nan,
        num_variables=prob.n_x + prob.n_y,
        num_constraints=prob.A.shape[0] + (1 if memory is not None else 0),
        build_seconds=build_s,
        solve_seconds=solve_s,
        bound_s=bound,
    )


def _least_memory(prob: _Problem, m: np.ndarray, options: SolverOptions) -> float:
    """The least ``m . x`` over every plan (the same ILP, memory as the objective)."""
    x = cp.Variable(prob.n_x, boolean=True)
    y = cp.Variable(prob.n_y, nonneg=True) if prob.n_y else None
    z = cp.hstack([x, y]) if y is not None else x
    problem = cp.Problem(cp.Minimize(m @ x), [prob.A @ z == prob.b])
    problem.solve(solver=cp.HIGHS, time_limit=float(options.time_limit_s))
    return float(problem.value)


def _bound_and_gap(problem: cp.Problem) -> tuple[float | None, float | None]:
    """HiGHS's dual bound and relative gap, when cvxpy exposes them."""
    stats = problem.solver_stats
    extra = getattr(stats, "extra_stats", None)
    info = None
    if extra is not None:
        for attr in ("getInfo",):
            if hasattr(extra, attr):
                try:
                    info = extra.getInfo()
                except Exception:
                    info = None
    if info is None:
        return None, None
    bound = getattr(info, "mip_dual_bound", None)
    gap = getattr(info, "mip_gap", None)
    if gap is not None and (gap < 0 or gap > 1e20):
        gap = None
    return bound, gap


def evaluate(sg: StrategyGraph, choice: dict[str, int]) -> float:
    """The objective (s) of a given choice: compute plus resharding, as the ILP counts it."""
    total = sum(float(sg.rep_cost(r)[choice[r]]) for r in sg.reps)
    for e in sg.edges:
        total += float(e.cost[e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]])
    return total


def brute_force(sg: StrategyGraph, limit: int = 200_000) -> tuple[dict[str, int], float]:
    """Exhaustive minimum of :func:`evaluate` (tests only; at most ``limit`` plans)."""
    import itertools

    reps = sg.reps
    sizes: Sequence[int] = [len(sg.nodes[r].strategies) for r in reps]
    if math.prod(sizes) > limit:
        raise ValueError(f"{math.prod(sizes)} plans exceed the brute-force limit {limit}")
    best, best_cost = None, math.inf
    for combo in itertools.product(*[range(k) for k in sizes]):
        choice = dict(zip(reps, combo, strict=True))
        cost = evaluate(sg, choice)
        if cost < best_cost:
            best, best_cost = choice, cost
    return best, best_cost
