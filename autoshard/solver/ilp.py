"""The sharding ILP: one strategy per node, cheapest total time, its parts built vectorised
as sparse matrices and stated in cvxpy, one variable vector per family of columns
[``_statement``, :mod:`autoshard.solver.cvx`].

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
* Optional memory budget: ``M x <= budget``, each row of ``M`` the bytes each strategy
  keeps on one device at one point of the step: the live activations at that point of
  the graph order plus the parameters, gradients and optimizer state
  (:class:`autoshard.cost.memory.LiveMemory`; the driver adds the rows a plan
  overflows and solves again, :func:`autoshard.solver.solve.solve_within_memory`); when
  infeasible, the least peak ``max_k M_k . x`` any plan reaches is reported
  [``_least_memory``].
* Minimise ``c . x + r . y - sum(z)``: ``c`` the compute seconds of each strategy
  (roofline of its local shard, plus every node merged into it, plus the AdamW step of
  a parameter's shard), ``r`` the resharding seconds of each (produced, wanted) pair
  (alpha-beta ring model in sequence, gradients bucketed, :mod:`autoshard.cost.mesh`).
* Overlap [``_overlap_rows``]: ``z >= 0`` the seconds gradient reductions and parameter
  gathers overlapped with compute save, bounded by each edge's communication over
  ``1 + OVERLAP_SLOWDOWN`` (the compute beside it runs slower) and, per
  window (the neighbouring block's forward or backward), by that window's compute: one
  stream (:mod:`autoshard.cost.overlap`, after autoparallel's PR #353).

Compiled by cvxpy (its chain for HiGHS) and solved by HiGHS, handed the compiled matrices
with a start (:mod:`autoshard.solver.highs`:
``mip_rel_gap``, a work limit per MIP and an iteration limit per LP, one thread, a fixed
seed: the same plan on every run, whatever the machine's load; a wall-clock
``time_limit`` only when asked). A hit limit returns the incumbent with its gap; no
incumbent or infeasibility raises :class:`~autoshard.errors.AutoshardError`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import scipy.sparse as sp

from autoshard.cost.checkpointing import POLICIES, Columns, columns
from autoshard.cost.liveness import local_bytes
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.cost.overlap import overlappable, saving, window_vectors
from autoshard.errors import AutoshardError, MemoryBudgetError, ProgramTooLargeError
from autoshard.solver.cvx import Layout, compile_program
from autoshard.solver.highs import LIMIT_STATUSES, MILP, HighsRun, count_compile, run
from autoshard.solver.options import SolverOptions
from autoshard.strategies.graph import StrategyGraph
from autoshard.strategies.hiding import schedule
from autoshard.strategies.sharing import rerun_refunded
from autoshard.trace.rerun_reads import carried, takes_back
from autoshard.units import format_bandwidth, format_bytes, format_seconds

SCALE = 1e6  # the ILP's objective is in microseconds

SMALL_PROGRAM = 20_000
"""Columns up to which a program with the overlap savings still solves its LP first
(:func:`_search`), whose integral solution is the exact optimum: the stage ILPs of the
launch tests' 4-block model on 1x2 have 1,095 to 2,752 columns; GPT-2 small on 2x4 has
57,140."""


@dataclass
class ILPResult:
    """The chosen strategy per representative node and the solver's report.

    ``choice``: representative name -> chosen strategy index. ``objective_s``: the
    ILP objective (s). ``gap``: relative MIP gap of the returned plan (0 when proven
    optimal). ``status``: ``optimal``, ``within_gap``, or the limit that stopped the
    search before a proof (``work_limit``, ``iteration_limit``, ``time_limit``;
    ``stopped`` for any other stop). ``start``: the
    name of the hand-written plan given as the search's incumbent (see :func:`solve`);
    ``choice`` is that plan itself when the search found nothing better.
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
    start: str | None = None  # the hand-written plan the search started from
    start_objective_s: float | None = None  # its objective (s)
    memory_rounds: int = 1  # solves, each adding budget rows a plan overflowed
    # real blocks that recompute, per (traced block's layer, policy)
    # (autoshard.cost.checkpointing)
    recompute: dict[tuple[int, str], int] = field(default_factory=dict)

    def stats(self) -> dict:
        """Everything but the choice, as a dict, with ``algo`` ``"ilp"`` (the statistics
        ``compare`` and ``solve --algo ilp`` report)."""
        out = asdict(self)
        out.pop("choice")
        out["algo"] = "ilp"
        # (layer, policy) -> count, as text keys a solution file can hold: "3:selective"
        out["recompute"] = {f"{k[0]}:{k[1]}": v for k, v in self.recompute.items()}
        return out


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
    overlap: _OverlapRows | None = None
    recompute: _RecomputeRows | None = None
    shares: _ShareColumns | None = None

    @property
    def savings(self) -> _OverlapRows | None:
        """The overlap savings' rows as the MILP holds them: none without edge columns."""
        return self.overlap if self.n_y else None


@dataclass(frozen=True)
class _ShareColumns:
    """The shared reshardings' part of the ILP (:mod:`autoshard.strategies.sharing`): one
    column ``m_j`` per shared resharding, the last ``len(shares)`` columns of ``y`` (its
    cost in ``r``), what the edges' reads give back (``refund`` over ``[x; y]``,
    subtracted from the objective) and the rows ``m_j - indicator >= 0``."""

    first: int  # the first share column, an index into [x; y]
    refund: np.ndarray  # (n_x + n_y,)
    rows: sp.csr_matrix  # (R, n_x + n_y)
    indicators: list[list[np.ndarray]]  # per share, per indicator: its columns in [x; y]


def _share_columns(sg: StrategyGraph, offsets, n_x, n_edges_y, edge_offsets, keeps):
    """[``_share_columns``] the columns, refunds and rows of ``sg.shares``, and their
    costs (to append to ``r``); ``(None, [])`` without shares."""
    if not sg.shares:
        return None, []
    first = n_x + n_edges_y
    width = first + len(sg.shares)
    refund = np.zeros(width)
    rows, cols, vals, per_share = [], [], [], []
    for j, share in enumerate(sg.shares):
        found = []
        for i, ind in enumerate(share.indicators):
            if ind[0] == "y":
                keep = keeps[ind[1]]
                pos = int(np.searchsorted(keep, ind[2]))
                if pos >= len(keep) or keep[pos] != ind[2]:
                    found.append(np.zeros(0, dtype=np.int64))
                    continue  # an impossible pair (a restricted graph's): no column
                idx = np.array([n_x + edge_offsets[ind[1]] + pos])
            else:
                idx = offsets[ind[1]] + np.asarray(ind[2], dtype=np.int64)
            found.append(idx)
            refund[idx] += share.refund(i)
            rows.append(np.full(len(idx) + 1, len(rows)))
            cols.append(np.concatenate([[first + j], idx]))
            vals.append(np.concatenate([[1.0], -np.ones(len(idx))]))
        per_share.append(found)
    A = (
        sp.csr_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
            shape=(len(rows), width),
        )
        if rows
        else sp.csr_matrix((0, width))  # every read's pair is impossible (a restriction's)
    )
    return _ShareColumns(first, refund, A, per_share), [s.seconds for s in sg.shares]


@dataclass(frozen=True)
class _RecomputeRows:
    """The checkpointing decision's data (:mod:`autoshard.cost.checkpointing`): its
    columns, and per block one copy's forward seconds over ``x`` and ``y`` and their
    largest value."""

    cols: Columns
    rx: list[np.ndarray]  # (n_x,) per block
    ry: list[np.ndarray]  # (n_y,) per block
    r_max: list[float]
    # the recomputation's gathers its backward's take back (autoshard.trace.rerun_reads):
    # one column u_j per (rerun pair, forward source group), u_j <= y[forward[j]] and
    # u_j <= sum y[backward[j]] (indices into [x; y]); per block, its seconds per unit of u
    forward: list[int] = field(default_factory=list)
    backward: list[np.ndarray] = field(default_factory=list)
    ru: list[np.ndarray] = field(default_factory=list)  # (n_u,) per block

    @property
    def n_u(self) -> int:
        """How many take-back columns ``u`` the program has."""
        return len(self.forward)


def _recompute_rows(sg: StrategyGraph, offsets, n_x, r, edge_offsets, keeps, shares=None):
    """[``_recompute_rows``] the checkpointing decision's data, or None without one."""
    cols = columns(sg)
    if cols is None:
        return None
    rx, ry, r_max = [], [], []
    for b in cols.ck.blocks:
        x = np.zeros(n_x)
        for n in b.forward:
            ns = sg.nodes[n]
            start = offsets[ns.rep]
            per_block = ns.compute_s / sg.graph.mult(n) + ns.comm_s  # a rerun's exchange too
            x[start : start + len(ns.choice)] += per_block[ns.choice]
        y = np.zeros(len(r))
        selective = b.policy == "selective"
        for i, e in enumerate(sg.edges):
            uses = (e.selective_uses if selective else e.full_uses).get(b.layer, 0)
            if uses:
                start = edge_offsets[i]
                y[start : start + len(keeps[i])] += r[start : start + len(keeps[i])] * uses / e.uses
        if shares is not None:  # a rerun's reads share their reshardings as the forward's
            xy = np.zeros(n_x + len(r))
            for j, share in enumerate(sg.shares):
                for p in share.parts:
                    refunds = p.selective if selective else p.full
                    if p.layer != b.layer or not p.forward or not refunds:
                        continue
                    xy[shares.first + j] += p.seconds / p.mult
                    for idx, back, ind in zip(
                        shares.indicators[j], refunds, share.indicators, strict=True
                    ):
                        if rerun_refunded(ind):
                            xy[idx] -= back / p.mult
            x += xy[:n_x]
            y += xy[n_x:]
        most = sum(
            float(x[offsets[q] : offsets[q] + len(sg.nodes[q].strategies)].max()) for q in sg.reps
        )
        most += sum(
            float(y[edge_offsets[i] : edge_offsets[i] + len(keeps[i])].max(initial=0.0))
            for i in range(len(sg.edges))
        )
        if shares is not None:  # each shared resharding paid once at most
            most += float(np.clip(y[shares.first - n_x :], 0.0, None).sum())
        rx.append(x)
        ry.append(y)
        r_max.append(most)
    forward, backward, per = _rerun_columns(sg, n_x, edge_offsets, keeps)
    ru = [
        np.array(
            [
                v * (pair.selective if b.policy == "selective" else pair.full).get(b.layer, 0)
                for pair, v in per
            ]
        )
        for b in cols.ck.blocks
    ]
    return _RecomputeRows(cols, rx, ry, r_max, forward, backward, ru)


def _rerun_columns(sg: StrategyGraph, n_x: int, edge_offsets, keeps) -> tuple[list, list, list]:
    """[``_rerun_columns``] per take-back column ``u`` (module docstring of
    :mod:`autoshard.trace.rerun_reads`): its forward read's ``y`` column (the pair's
    forward edge from one source group to one destination placement), the backward
    edge's ``y`` columns from the source groups of the same strategies to the placement
    the pair's chain carries that one to, and (its pair, the seconds one paired read
    takes back): the pairs of groups :func:`~autoshard.trace.rerun_reads.takes_back`
    accepts."""
    forward, backward, per = [], [], []
    for pair in sg.rerun_pairs:
        f, g = sg.edges[pair.forward], sg.edges[pair.backward]
        at_g = {tuple(q): j for j, q in enumerate(g.dst_placements)}
        where_f = {int(v): i for i, v in enumerate(keeps[pair.forward])}
        where_g = {int(v): i for i, v in enumerate(keeps[pair.backward])}
        q_f, q_g = f.cost.shape[1], g.cost.shape[1]
        for bf, wanted in enumerate(f.dst_placements):
            bg = at_g.get(carried(wanted, pair.dims))
            if bg is None:
                continue
            for a in range(f.cost.shape[0]):
                col = where_f.get(a * q_f + bf)
                if col is None:
                    continue
                same = [
                    a2
                    for a2 in np.unique(g.src_groups[f.src_groups == a])  # the same strategies
                    if takes_back(
                        f.src_placements[a],
                        wanted,
                        g.src_placements[a2],
                        g.dst_placements[bg],
                        pair.dims,
                    )
                ]
                cols_g = [where_g.get(int(a2) * q_g + bg) for a2 in same]
                cols_g = [n_x + edge_offsets[pair.backward] + c for c in cols_g if c is not None]
                if not cols_g:
                    continue
                forward.append(n_x + edge_offsets[pair.forward] + col)
                backward.append(np.array(cols_g, dtype=np.int64))
                per.append((pair, float(f.cost[a, bf]) / f.uses))
    return forward, backward, per


@dataclass(frozen=True)
class _OverlapRows:
    """The savings part of the ILP (:mod:`autoshard.cost.overlap`): ``K`` savings, one per
    (overlappable edge, window, owner) triple, and ``R`` capacity rows: per window its
    pool, and per group of savings that only some of its copies host, the group's cap."""

    comm: sp.csr_matrix  # (K, n_y): saving k's most seconds saved over its edge's y block
    saved: sp.csr_matrix  # (R, K): 1 where saving k counts against row r's capacity
    compute: sp.csr_matrix  # (R, n_x): row r's capacity, compute seconds per strategy

    @property
    def count(self) -> int:
        """``K``: the savings variables."""
        return self.comm.shape[0]


def _overlap_rows(sg: StrategyGraph, reps, offsets, n_x, r, edge_offsets, keeps):
    """[``_overlap_rows``] the savings constraints' data, or None when nothing can hide."""
    idx = overlappable(sg)
    if not idx:
        return None
    sched = schedule(sg.graph)
    rows, cols, data = [], [], []
    members: dict[tuple, list[int]] = {}  # (window,) pool or (window, owner, kind) group
    k = 0
    for i in idx:
        e = sg.edges[i]
        start, keep = edge_offsets[i], keeps[i]
        for key in sorted(e.hide):
            rows.append(np.full(len(keep), k))
            cols.append(np.arange(start, start + len(keep)))
            data.append(saving(r[start : start + len(keep)] * e.hide_share(key)))
            members.setdefault((key[0],), []).append(k)
            if sched.hosts(*key) < 1:  # only some of the window's copies host this group
                members.setdefault((key[0], key[1], e.overlap), []).append(k)
            k += 1
    comm = sp.csr_matrix(
        (np.concatenate(data), (np.concatenate(rows), np.concatenate(cols))),
        shape=(k, len(r)),
    )
    order = sorted(members)
    s_row = np.concatenate([np.full(len(members[g]), j) for j, g in enumerate(order)])
    s_col = np.concatenate([members[g] for g in order])
    saved = sp.csr_matrix((np.ones(len(s_col)), (s_row, s_col)), shape=(len(order), k))
    vectors = window_vectors(sg)
    crow, ccol, cval = [], [], []
    for j, g in enumerate(order):
        share = 1.0 if len(g) == 1 else sched.hosts(g[0], g[1])
        for rep, v in vectors[g[0]].items():
            crow.append(np.full(len(v), j))
            ccol.append(offsets[rep] + np.arange(len(v)))
            cval.append(v * share)
    compute = (
        sp.csr_matrix(
            (np.concatenate(cval), (np.concatenate(crow), np.concatenate(ccol))),
            shape=(len(order), n_x),
        )
        if cval
        else sp.csr_matrix((len(order), n_x))  # no window's compute is in this graph
    )
    return _OverlapRows(comm, saved, compute)


def program_columns(sg: StrategyGraph) -> int:
    """The columns of ``sg``'s program before any is added for the overlap savings or the
    checkpointing decision: one per strategy of each representative, one per possible
    (produced, wanted) placement pair of each edge, one per shared resharding. The same
    count as :func:`build_problem`'s ``n_x + n_y``, without building it."""
    n_x = sum(len(sg.nodes[r].strategies) for r in sg.reps)
    return n_x + sum(int(np.isfinite(e.cost).sum()) for e in sg.edges) + len(sg.shares)


def check_size(
    sg: StrategyGraph, options: SolverOptions, mesh: MeshSpec, gpus_per_node: int | None = None
) -> None:
    """Refuses a program over ``options.max_columns`` (:class:`SolverOptions`).
    ``gpus_per_node``: the node size a mesh search laid ``mesh`` over, if any.

    Raises:
        ProgramTooLargeError: naming the count, the cap, and the command that plans the
            mesh on its own with the links it has here (``--gpus-per-node`` with ``--mesh``:
            a mesh search lays a shape's dims on the cluster's links, which ``--mesh``'s
            default of dim 0 across nodes may not match).
    """
    cap = options.max_columns
    if cap is None:
        return
    n = program_columns(sg)
    if n > cap:
        shape = "x".join(map(str, mesh.shape))
        links = ", ".join(
            f"{format_bandwidth(b)} and {format_seconds(a)}"
            for b, a in zip(mesh.bandwidth, mesh.latency, strict=True)
        )
        command = f"--mesh {shape}"
        if gpus_per_node is not None:
            command += f" --gpus-per-node {gpus_per_node}"
        raise ProgramTooLargeError(
            f"its ILP has {n:,} columns, over the {cap:,} solved whole (--max-columns); "
            f"to solve it whole anyway: {command} --max-columns {n} (the links it has "
            f"here, per dim {links})",
            n,
            cap,
        )


def _node_blocks(sg: StrategyGraph) -> tuple[list[str], dict[str, int], np.ndarray]:
    reps = sg.reps
    offsets, pos = {}, 0
    for r in reps:
        offsets[r] = pos
        pos += len(sg.nodes[r].strategies)
    c = np.concatenate([sg.rep_cost(r) for r in reps]) if reps else np.zeros(0)
    return reps, offsets, c


def _choice(sg: StrategyGraph, prob: _Problem, xv: np.ndarray) -> dict[str, int]:
    """Each representative's strategy: the largest entry of its block of ``x``."""
    return {
        r: int(np.argmax(xv[prob.offsets[r] : prob.offsets[r] + len(sg.nodes[r].strategies)]))
        for r in prob.reps
    }


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
    """Assemble the sparse equality system and cost vectors."""
    reps, offsets, c = _node_blocks(sg)
    n_x = len(c)
    A_edges, r, edge_offsets, keeps = _edge_rows(sg, offsets, n_x)
    shares, share_costs = _share_columns(sg, offsets, n_x, len(r), edge_offsets, keeps)
    if share_costs:
        r = np.concatenate([r, share_costs])
        A_edges = sp.hstack([A_edges, sp.csr_matrix((A_edges.shape[0], len(share_costs)))])
    n_y = len(r)
    A_one = _one_strategy_rows(reps, offsets, sg, n_x)
    A_one = sp.hstack([A_one, sp.csr_matrix((A_one.shape[0], n_y))], format="csr")
    A = sp.vstack([A_one, A_edges], format="csr")
    b = np.concatenate([np.ones(A_one.shape[0]), np.zeros(A_edges.shape[0])])
    overlap = _overlap_rows(sg, reps, offsets, n_x, r, edge_offsets, keeps)
    recompute = _recompute_rows(sg, offsets, n_x, r, edge_offsets, keeps, shares)
    return _Problem(
        reps, offsets, n_x, n_y, c, r, A, b, edge_offsets, keeps, overlap, recompute, shares
    )


def _milp(
    prob: _Problem,
    boolean: bool = True,
    memory: tuple[np.ndarray, float] | None = None,
    fixed: np.ndarray | None = None,
    peak: np.ndarray | None = None,
) -> MILP:
    """:func:`_statement`'s program, compiled by cvxpy for HiGHS once per ``prob``,
    ``memory`` and ``peak`` (the search's LP relaxation, relax-and-fix and full MIP share
    it): ``boolean=False`` drops every integrality (the LP relaxation, ``0 <= x <= 1``);
    ``fixed`` pins those entries of ``x`` to 1. The seconds of each compile (and of
    cvxpy's import, the first time) join the enclosing
    :func:`~autoshard.solver.highs.tallying` block's ``compile_seconds``."""
    held = prob.__dict__.get("_compiled")
    if held is not None and held[0] is memory and held[1] is peak:
        milp = held[2]
    else:
        began = time.perf_counter()
        milp = compile_program(*_statement(prob, memory, peak))
        count_compile(time.perf_counter() - began)
        prob.__dict__["_compiled"] = (memory, peak, milp)  # holds both: no reused id
    if not boolean:
        milp = replace(milp, integer=np.zeros_like(milp.integer))
    if fixed is not None and len(fixed):
        lower = milp.col_lower.copy()
        lower[np.asarray(fixed)] = 1.0
        milp = replace(milp, col_lower=lower)
    return milp


def _statement(
    prob: _Problem,
    memory: tuple[np.ndarray, float] | None = None,
    peak: np.ndarray | None = None,
) -> tuple[Layout, np.ndarray, list]:
    """The program over columns ``[x; y; z]`` [``_node_blocks``, ``_edge_rows``,
    ``_overlap_rows``], then the checkpointing decision's, stated in cvxpy
    (:mod:`autoshard.solver.cvx`): its columns' families, objective ``(layout.n,)`` and
    constraints. ``x`` is the first ``prob.n_x`` columns.

    ``x`` is boolean; ``memory`` adds the budget rows; ``peak`` (budget rows over ``x``
    and the checkpointing columns, scaled) minimises their largest value ``t`` (one more
    column, last) instead of time. The time objective is in microseconds: HiGHS's
    absolute tolerances (1e-6) would otherwise stop it a whole objective away from the
    optimum.

    Rows: ``A [x; y] = b`` (one strategy per node, each edge's transport sums);
    ``M [x; ck] <= budget``; with overlap, per saving ``k`` (an overlappable edge's part
    hidden in one window) ``z_k <= SCALE comm_k . y``, and per window ``w`` one stream:
    ``sum_{k in w} z_k <= SCALE C_w . x``, per group ``g`` of savings only some copies of
    ``w`` host ``sum_{k in g} z_k <= SCALE h_g C_w . x`` (:mod:`autoshard.cost.overlap`); the
    checkpointing decision's rows (:func:`_add_recompute`); the shared reshardings'
    ``m_j - indicator >= 0``. The objective subtracts ``sum z`` and the shares' refunds.
    """
    n_x, n_y = prob.n_x, prob.n_y
    ov, rc, sh = prob.savings, prob.recompute, prob.shares
    ck0 = _recompute_offset(prob)  # the first checkpointing column
    u0 = ck0 - (rc.n_u if rc is not None else 0)  # the first take-back column
    n = ck0 + (rc.cols.n if rc is not None else 0)
    col_lower = np.zeros(n)
    col_upper = np.concatenate([np.ones(n_x), np.full(n - n_x, np.inf)])
    integer = np.zeros(n, dtype=bool)
    integer[:n_x] = True
    if sh is not None:
        col_upper[sh.first : n_x + n_y] = 1.0
    ck_rows: tuple[list, list, list] = ([], [], [])
    if rc is not None:
        _add_recompute(prob, rc, ck0, n, *ck_rows, col_lower, col_upper, integer)
    spans = [
        ("x", 0, n_x),
        ("y", n_x, n_x + n_y),
        ("z", n_x + n_y, u0),
        ("rerun", u0, ck0),
        ("checkpointing", ck0, n),
    ]
    families = [
        (k, hi - lo, col_lower[lo:hi], col_upper[lo:hi], integer[lo:hi]) for k, lo, hi in spans
    ]
    if peak is not None:
        families.append(("peak", 1, 0.0, np.inf, False))
    cols = Layout(families)
    constraints = cols.rows(_widened(prob.A, cols.n), prob.b, prob.b)
    if memory is not None:
        budget = np.full(len(_memory_matrix(memory[0])), float(memory[1]))
        constraints += cols.rows(
            _widened(_memory_block(prob, memory[0], n), cols.n), -np.inf, budget
        )
    if ck_rows[0]:
        ck_matrix = _widened(sp.vstack(ck_rows[0]), cols.n)
        constraints += cols.rows(ck_matrix, *map(np.concatenate, ck_rows[1:]))
    if ov is not None:
        z = cols["z"]
        constraints += [
            z <= SCALE * ov.comm @ cols["y"],
            ov.saved @ z <= SCALE * ov.compute @ cols["x"],
        ]
    if sh is not None:
        constraints += cols.rows(_widened(sh.rows, cols.n), 0.0, np.inf)
    c = np.zeros(cols.n)
    if peak is not None:
        rows = sp.hstack([_memory_block(prob, peak, n), -np.ones((len(_memory_matrix(peak)), 1))])
        constraints += cols.rows(rows, -np.inf, np.zeros(rows.shape[0]))
        c[-1] = 1.0
        return cols, c, constraints
    c[:n_x] = SCALE * prob.c
    c[n_x : n_x + n_y] = SCALE * prob.r
    c[n_x + n_y : u0] = -1.0  # the hidden seconds z
    if rc is not None:
        for bi, b in enumerate(rc.cols.ck.blocks):
            c[ck0 + rc.cols.w[bi] : ck0 + rc.cols.w[bi] + b.bits] = 1.0
    if sh is not None:  # the reads' refund
        c[: n_x + n_y] -= SCALE * sh.refund
    return cols, c, constraints


def _widened(matrix: sp.spmatrix, width: int) -> sp.csr_matrix:
    """``matrix`` with zero columns appended up to ``width``."""
    return sp.hstack([matrix, sp.csr_matrix((matrix.shape[0], width - matrix.shape[1]))], "csr")


def _memory_block(prob: _Problem, m: np.ndarray, n: int) -> sp.csr_matrix:
    """The budget rows over all ``n`` columns: given over ``x`` and, with the
    checkpointing decision, its columns after (:meth:`autoshard.cost.memory.LiveMemory.rows`)."""
    rows = _memory_matrix(m)
    rc = prob.recompute
    width = prob.n_x + (rc.cols.n if rc is not None else 0)
    if rows.shape[1] < width:  # rows over x alone (a pipeline stage, a test)
        rows = np.hstack([rows, np.zeros((len(rows), width - rows.shape[1]))])
    if rc is None:
        return sp.hstack([sp.csr_matrix(rows), sp.csr_matrix((len(rows), n - prob.n_x))], "csr")
    ck0 = n - rc.cols.n
    return sp.hstack(
        [
            sp.csr_matrix(rows[:, : prob.n_x]),
            sp.csr_matrix((len(rows), ck0 - prob.n_x)),
            sp.csr_matrix(rows[:, prob.n_x :]),
        ],
        "csr",
    )


def _add_recompute(prob, rc, ck0, n, blocks, lower, upper, col_lower, col_upper, integer):
    """[``_recompute_rows``] the checkpointing decision's columns and rows
    (:mod:`autoshard.cost.checkpointing`, module docstring), added in place."""
    cols = rc.cols
    u0 = ck0 - rc.n_u  # the take-back columns, just before the checkpointing ones

    def sparse_row(entries: dict[int, float]) -> sp.csr_matrix:
        idx = np.fromiter(entries.keys(), dtype=np.int64)
        val = np.fromiter(entries.values(), dtype=float)
        return sp.csr_matrix((val, (np.zeros(len(idx), dtype=np.int64), idx)), shape=(1, n))

    def add(row: sp.csr_matrix, lo: float, hi: float) -> None:
        blocks.append(row)
        lower.append([lo])
        upper.append([hi])

    per_layer: dict[int, list[dict[int, float]]] = {}
    for bi, b in enumerate(cols.ck.blocks):
        beta = ck0 + cols.beta[bi] + np.arange(b.bits)
        w = ck0 + cols.w[bi] + np.arange(b.bits)
        integer[beta] = True
        col_upper[beta] = 1.0
        if cols.ck.fixed is not None:  # every block recomputes under the fixed policy
            k = b.copies if b.policy == cols.ck.fixed else 0
            for d in range(b.bits):
                col_lower[beta[d]] = col_upper[beta[d]] = float((k >> d) & 1)
        weights = {int(beta[d]): float(2**d) for d in range(b.bits)}
        per_layer.setdefault(b.layer, []).append(weights)
        if 2**b.bits - 1 > b.copies:  # k <= copies
            add(sparse_row(weights), -np.inf, float(b.copies))
        # w_d - 2^d S (rx.x + ry.y - ru.u) - 2^d S R_max beta_d >= -2^d S R_max
        time = np.concatenate([rc.rx[bi], rc.ry[bi]])
        nz = np.flatnonzero(time)
        back = {u0 + j: float(v) for j, v in enumerate(rc.ru[bi]) if v}
        big = SCALE * rc.r_max[bi]
        for d in range(b.bits):
            entries = {int(j): -(2**d) * SCALE * time[j] for j in nz}
            entries.update({j: (2**d) * SCALE * v for j, v in back.items()})
            entries[int(w[d])] = 1.0
            entries[int(beta[d])] = -(2**d) * big
            add(sparse_row(entries), -(2**d) * big, np.inf)
        gamma = cols.gamma[bi]
        if gamma is not None:
            col_upper[ck0 + gamma] = 1.0
            for d in range(b.bits):  # gamma >= beta_d
                add(sparse_row({ck0 + gamma: 1.0, int(beta[d]): -1.0}), 0.0, np.inf)
        for r, start in cols.z[bi].items():
            size = cols.sizes[r]
            xs = prob.offsets[r] + np.arange(size)
            zs = ck0 + start + np.arange(size)
            # z - copies x <= 0
            eye = sp.csr_matrix((np.ones(size), (np.arange(size), zs)), shape=(size, n))
            xm = sp.csr_matrix((np.full(size, -float(b.copies)), (np.arange(size), xs)), (size, n))
            blocks.append(eye + xm)
            lower.append(np.full(size, -np.inf))
            upper.append(np.zeros(size))
            # sum z - sum 2^d beta_d = 0
            entries = {int(j): 1.0 for j in zs}
            entries.update({j: -v for j, v in weights.items()})
            add(sparse_row(entries), 0.0, 0.0)
            if gamma is not None and r in cols.g[bi]:  # g - x - gamma >= -1
                gs = ck0 + cols.g[bi][r] + np.arange(size)
                g = sp.csr_matrix((np.ones(size), (np.arange(size), gs)), shape=(size, n))
                xg = sp.csr_matrix((-np.ones(size), (np.arange(size), xs)), shape=(size, n))
                gm = sp.csr_matrix(
                    (-np.ones(size), (np.arange(size), np.full(size, ck0 + gamma))), (size, n)
                )
                blocks.append(g + xg + gm)
                lower.append(np.full(size, -1.0))
                upper.append(np.full(size, np.inf))

    for j, (yf, yg) in enumerate(zip(rc.forward, rc.backward, strict=True)):
        add(sparse_row({u0 + j: 1.0, int(yf): -1.0}), -np.inf, 0.0)  # u_j <= y_f
        row = {u0 + j: 1.0}
        row.update({int(c): -1.0 for c in yg})
        add(sparse_row(row), -np.inf, 0.0)  # u_j <= sum y_g

    copies = {b.layer: b.copies for b in cols.ck.blocks}
    for layer, parts in per_layer.items():  # k_full + k_selective <= copies
        if len(parts) > 1:
            add(
                sparse_row({j: v for p in parts for j, v in p.items()}),
                -np.inf,
                float(copies[layer]),
            )


def _start(
    prob: _Problem, choice: dict[str, int], recompute: dict[int, int] | None = None
) -> tuple:
    """A plan as a partial MIP start: every column of ``x`` and, with the checkpointing
    decision, its columns but ``w`` (HiGHS completes the rest)."""
    xv = np.zeros(prob.n_x)
    for r, i in choice.items():
        xv[prob.offsets[r] + i] = 1.0
    if prob.recompute is None:
        return np.arange(prob.n_x), xv
    cols = prob.recompute.cols
    ck = cols.values(choice, recompute)
    w = np.zeros(cols.n, dtype=bool)
    for bi, b in enumerate(cols.ck.blocks):
        w[cols.w[bi] : cols.w[bi] + b.bits] = True
    ck0 = _recompute_offset(prob)
    idx = np.concatenate([np.arange(prob.n_x), ck0 + np.flatnonzero(~w)])
    return idx, np.concatenate([xv, ck[~w]])


def _size(prob: _Problem, memory: tuple[np.ndarray, float] | None) -> dict[str, int]:
    """The program's size as :class:`ILPResult` reports it: the decision columns (``x``
    and edge ``y``) and the rows (the structure's and the memory budget's)."""
    rows = prob.A.shape[0] + (len(_memory_matrix(memory[0])) if memory else 0)
    return {"num_variables": prob.n_x + prob.n_y, "num_constraints": rows}


def _recompute_offset(prob: _Problem) -> int:
    """The first checkpointing column in the MILP (:func:`_milp`)."""
    ov, rc = prob.savings, prob.recompute
    return (
        prob.n_x
        + prob.n_y
        + (ov.count if ov is not None else 0)
        + (rc.n_u if rc is not None else 0)
    )


def solve(
    sg: StrategyGraph,
    options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
    starts: dict[str, dict[str, int]] | None = None,
) -> ILPResult:
    """Solve the sharding ILP of ``sg``, never returning a plan above a given start.

    ``starts``: named feasible points of the ILP (hand-written plans: DDP, FSDP,
    Megatron, ...; a choice per representative); when some communication can hide under
    compute, the optimum of the ILP without the overlap savings joins them (solved first,
    within the same limits). The cheapest that fits ``memory`` is the search's
    incumbent: HiGHS prunes every branch that cannot beat it, and it is the fallback.
    Whatever the limits, the plan returned is at or below
    every start that fits (``ILPResult.start`` names the one it started from). The start is
    HiGHS's first incumbent (``Highs.setSolution`` with its ``x``; HiGHS completes the
    continuous columns) and the fallback.

    Raises:
        AutoshardError: as :func:`_search`, when no start fits either.
    """
    options = options or SolverOptions()
    t0 = time.perf_counter()
    starts = dict(starts or {})
    start_counts: dict[str, dict[int, int]] = {}  # a start's own recomputed blocks
    plain: ILPResult | None = None
    if overlappable(sg) and not options.spent:
        # The savings variables make the LP relaxation fractional and slow on large meshes
        # (the Llama-7B shape on 8x8: no plan within 120 s, against 14 s without them).
        # Solve without them first; that plan, priced with overlap, is one more start.
        try:
            plain = _search(replace(sg, overlap=False), options, memory, None)
            starts[NO_OVERLAP_START] = plain.choice
            start_counts[NO_OVERLAP_START] = plain.recompute
        except MemoryBudgetError:
            raise
        except AutoshardError:  # no plan within the limits: the hand-written starts remain
            pass
        # the search with overlap, cut off at the best start, gets what is left of the time
        # limit (capping it at twice the first search's time lost the Llama-7B shape's
        # 2x4 plan: 257 ms kept instead of 193 ms found at 50 s)
        options = options.after(time.perf_counter() - t0)
    start = _best_start(sg, starts, memory, start_counts)
    if options.spent and start is not None:  # --time-limit used up: keep the start, no search
        result = sized_as(replace(start, status="time_limit"), plain)
    else:
        try:
            result = _search(sg, options, memory, start)
        except MemoryBudgetError:
            raise  # no start fits either: _best_start checked the same budget
        except AutoshardError:
            if start is None:
                raise
            # the search found no plan in time: keep the start, with the size of the
            # program the first search built
            result = sized_as(start, plain)
    if start is not None and result is not start and start.objective_s < result.objective_s:
        # the search stopped above the start (a gap or a limit): keep the start, with
        # its gap to the search's bound
        bound = result.bound_s
        finite = bound is not None and math.isfinite(bound)
        gap = max(0.0, 1 - bound / start.objective_s) if finite else math.nan
        kept = "within_gap" if gap <= options.mip_gap else _stopped(result.status)
        result = replace(
            result,
            choice=start.choice,
            recompute=start.recompute,
            objective_s=start.objective_s,
            gap=gap,
            status=kept,
        )
    if start is not None:
        result = replace(result, start=start.start, start_objective_s=start.objective_s)
    # every phase's seconds (the search without overlap included) but the last build
    return replace(result, solve_seconds=time.perf_counter() - t0 - result.build_seconds)


def sized_as(result: ILPResult, before: ILPResult | None) -> ILPResult:
    """``result`` with the program size and build time of the search ``before`` when it
    has none of its own (a start kept without a search); else ``result`` itself."""
    if result.num_variables or before is None:
        return result
    return replace(
        result,
        num_variables=before.num_variables,
        num_constraints=before.num_constraints,
        build_seconds=before.build_seconds,
    )


def lp_bound(
    sg: StrategyGraph,
    options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
) -> float | None:
    """A lower bound on :func:`solve`'s objective (s): the optimum of the ILP's LP
    relaxation (every integrality dropped, the same rows, ``memory`` included). Every
    plan, the ILP's optimum included, costs at least this much, so a search may skip a
    program whose bound cannot beat a plan it already has. HiGHS's simplex, deterministic
    (``options.lp_iteration_limit``).

    Returns:
        The bound in seconds; ``math.inf`` when the relaxation is infeasible (no plan fits
        ``memory``, so none beats anything); ``None`` when the LP stopped at its limits or
        failed (no bound: the caller solves the ILP).
    """
    options = options or SolverOptions()
    prob = build_problem(sg)
    milp = _milp(prob, boolean=False, memory=memory)
    t0 = time.perf_counter()
    lp = run(milp, _left(options.deadline(t0)), iteration_limit=options.lp_iteration_limit)
    if lp.status == "infeasible":
        return math.inf
    if lp.status != "optimal" or lp.objective is None:
        return None
    return float(lp.objective) / SCALE


# the name of the start solved without the overlap savings (see solve)
NO_OVERLAP_START = "ILP without overlap"


def _best_start(
    sg: StrategyGraph,
    starts: dict[str, dict[str, int]],
    memory,
    start_counts: dict[str, dict[int, int]] | None = None,
) -> ILPResult | None:
    """The cheapest of ``starts`` that fits the memory budget, as an ILP result. With the
    checkpointing decision each start is tried keeping every activation, recomputing
    every block, and with its own counts in ``start_counts``."""
    best: ILPResult | None = None
    ck = sg.checkpointing if columns(sg) is not None else None
    # a start keeps every activation, or (when that does not fit) recomputes every block
    # under one policy
    counts = [None] if ck is None or ck.fixed else [{}, *map(ck.of_policy, POLICIES)]
    tries = [(n, c, k) for (n, c), k in itertools.product(starts.items(), counts)]
    tries += [(n, starts[n], k) for n, k in (start_counts or {}).items() if n in starts]
    for name, choice, recompute in tries:
        cost = evaluate(sg, choice, recompute)
        if not math.isfinite(cost):
            continue
        if memory is not None:
            used = _memory(sg, memory[0], choice, recompute)
            if used > memory[1] * (1 + 1e-9):
                continue
        if best is None or cost < best.objective_s:
            best = ILPResult(
                choice=dict(choice),
                recompute=_counts(sg, recompute),
                objective_s=cost,
                status="stopped",  # replaced by the search's own, unless it found nothing
                gap=math.nan,
                num_variables=0,
                num_constraints=0,
                build_seconds=0.0,
                solve_seconds=0.0,
                start=name,
            )
    return best


def _counts(sg: StrategyGraph, recompute: dict[int, int] | None) -> dict[int, int]:
    """Every block's count of real blocks that recompute (empty without the decision)."""
    return sg.checkpointing.counts(recompute) if columns(sg) is not None else {}


def _offsets(sg: StrategyGraph) -> dict[str, int]:
    offsets, pos = {}, 0
    for r in sg.reps:
        offsets[r] = pos
        pos += len(sg.nodes[r].strategies)
    return offsets


def _search(
    sg: StrategyGraph,
    options: SolverOptions | None = None,
    memory: tuple[np.ndarray, float] | None = None,
    start: ILPResult | None = None,
) -> ILPResult:
    """Search the sharding ILP of ``sg`` (``start``: an incumbent plan, or None).

    First the LP relaxation: an integral LP solution is optimal; otherwise relax-and-fix
    (the MIP over the nodes the LP left fractional) gives a plan, returned when it lies
    within ``mip_gap`` of the LP bound. Otherwise the full MIP runs with the better of that
    plan and ``start`` as its first incumbent (it prunes every branch that cannot beat it),
    and the better of the plans is returned: a full MIP that finds nothing better
    proves the relax-and-fix plan optimal, or stops at a limit with it in hand.

    With the overlap savings the LP relaxation is fractional and weak (a fractional plan
    mixes the strategies that communicate most with those that compute most, and hides
    more than any plan can: GPT-2 small bf16-mixed on 2x4, bound 8% under the optimum), and
    relax-and-fix then spent most of the search: such a program goes straight to the full
    MIP, whose cuts and branching close the gap (issue 29, docs/performance.md: GPT-2
    within 0.33% in 23.5 s where LP, relax-and-fix and MIP stopped at the work limit 8.1%
    from the bound after 33 s; the 4-layer Qwen2, whose LP is nearly tight, is slower
    this way: 22.8 s against 15.3 s). The MIP's root LP has no iteration cap (HiGHS
    applies ``simplex_iteration_limit`` to LPs only); ``time_limit_s`` bounds it. A
    program of at most :data:`SMALL_PROGRAM` columns keeps the LP first: it costs little
    there, and an integral LP is the exact optimum where the MIP stops at its gap.

    Args:
        sg: strategies, costs and edges.
        options: the limits and the MIP gap.
        memory: optional ``(bytes per strategy over x, budget bytes)``.

    Raises:
        AutoshardError: infeasible (e.g. the memory budget), or no plan found
            within the limits.
    """
    options = options or SolverOptions()
    t0 = time.perf_counter()
    deadline = options.deadline(t0)  # one budget for the LP, relax-and-fix and the MIP
    prob = build_problem(sg)
    build_s = time.perf_counter() - t0  # building the matrices, not the LP's solve
    incumbent: ILPResult | None = start
    straight = prob.savings is not None and prob.n_x + prob.n_y > SMALL_PROGRAM
    if options.lp_first and not straight:  # see the docstring
        try:
            found = _lp_first(sg, prob, options, memory, t0, deadline)
        except _RelaxationStopped:
            # the full MIP's root would solve the same LP again, with nothing to cap it
            size = {
                **_size(prob, memory),
                "build_seconds": build_s,
                "solve_seconds": time.perf_counter() - t0 - build_s,
            }
            if incumbent is None:
                raise AutoshardError(
                    "the ILP found no plan (its LP relaxation "
                    f"{_limit_words('iteration_limit', options)})"
                ) from None
            return replace(incumbent, status="iteration_limit", gap=math.nan, **size)
        if found is not None and found.status != "incumbent":
            return found
        if found is not None and (incumbent is None or found.objective_s < incumbent.objective_s):
            incumbent = found
    t1 = time.perf_counter()
    milp = _milp(prob, memory=memory)
    build_s += time.perf_counter() - t1
    t1 = time.perf_counter()
    start_cols = (
        _start(prob, incumbent.choice, incumbent.recompute) if incumbent is not None else None
    )
    cutoff = incumbent.objective_s * SCALE * (1 + 1e-9) if incumbent is not None else None
    found = run(
        milp,
        _left(deadline),
        float(options.mip_gap),
        start_cols,
        cutoff,
        1 / SCALE,
        work_limit=options.work_limit,
    )
    solve_s = time.perf_counter() - t1
    return _mip_result(sg, prob, found, incumbent, memory, options, build_s, solve_s)


def _mip_result(
    sg: StrategyGraph,
    prob: _Problem,
    found: HighsRun,
    incumbent: ILPResult | None,
    memory: tuple[np.ndarray, float] | None,
    options: SolverOptions,
    build_s: float,
    solve_s: float,
) -> ILPResult:
    """The answer of :func:`_search` from the full MIP's run ``found``: its plan when it
    beats ``incumbent``, else the incumbent with the MIP's bound (proven when the MIP
    ended); the errors of :func:`_search` when there is neither."""
    status = found.status

    def _finish(inc: ILPResult, mip_bound: float | None, proven: bool) -> ILPResult:
        # the incumbent (a hand-written start has no program) reports this search's size
        return replace(
            _finish_incumbent(inc, mip_bound, proven=proven, solve_s=solve_s, stopped=status),
            **_size(prob, memory),
            build_seconds=build_s,
        )

    if status == "error":
        if incumbent is not None:
            return _finish(incumbent, None, proven=False)
        raise AutoshardError(f"the ILP solver failed: HiGHS ended with {found.model_status}")
    if status == "infeasible":
        if incumbent is not None:  # nothing beats the incumbent: it is optimal
            return _finish(incumbent, None, proven=True)
        if memory is not None:
            least = _least_memory(prob, memory[0], options)
            raise MemoryBudgetError(
                f"no plan fits the memory budget of {format_bytes(memory[1])} per device: every "
                f"plan in the search space needs at least {format_bytes(least)}; "
                "raise --memory-budget or use more devices",
                least,
            )
        raise AutoshardError("no sharding plan satisfies the constraints (ILP infeasible)")
    bound, gap = _bound_and_gap(found.bound, found.gap)
    bound = bound / SCALE if bound is not None else None
    xv = found.x[: prob.n_x] if found.x is not None else None
    choice = _valid_choice(sg, prob, xv)
    recompute = _found_counts(prob, found.x)
    objective = evaluate(sg, choice, recompute) if choice is not None else math.inf
    if (
        memory is not None
        and choice is not None
        and _memory(sg, memory[0], choice, recompute) > memory[1] * (1 + 1e-9)
    ):
        objective = math.inf  # a solution HiGHS left over its budget row (tolerances)
    if not math.isfinite(objective) or (
        incumbent is not None and objective >= incumbent.objective_s
    ):
        if incumbent is not None:  # the MIP ended optimal: nothing beats the incumbent
            proven = status == "optimal" and xv is not None
            return _finish(incumbent, bound, proven=proven)
        raise AutoshardError(f"the ILP found no plan ({_limit_words(status, options)})")
    choice = prefer_smaller_shards(sg, choice, recompute=recompute)  # never breaks the budget
    objective = evaluate(sg, choice, recompute)
    status_text = "optimal" if status == "optimal" else _stopped(status)
    if status_text == "optimal" and gap is not None and gap > 1e-9:
        status_text = "within_gap"
    if status_text == "optimal" and gap is None:
        gap = 0.0
    return ILPResult(
        choice=choice,
        recompute=_counts(sg, recompute),
        objective_s=objective,
        status=status_text,
        gap=float(gap) if gap is not None else math.nan,
        **_size(prob, memory),
        build_seconds=build_s,
        solve_seconds=solve_s,
        bound_s=bound,
    )


def _valid_choice(sg: StrategyGraph, prob: _Problem, xv: np.ndarray | None) -> dict | None:
    """The choice an integral ``x`` encodes, or None when ``x`` is missing or not a plan
    (HiGHS stopped by its time limit before any feasible point hands back zeros)."""
    if xv is None:
        return None
    for r in prob.reps:
        block = xv[prob.offsets[r] : prob.offsets[r] + len(sg.nodes[r].strategies)]
        if abs(block.sum() - 1) > 1e-6 or block.max() < 1 - 1e-6:
            return None
    return _choice(sg, prob, xv)


def _memory_matrix(m: np.ndarray) -> np.ndarray:
    """The budget rows as a matrix ``(rows, n_x)``: one row (a vector) or several."""
    return np.atleast_2d(np.asarray(m, dtype=float))


def _memory(
    sg: StrategyGraph, m: np.ndarray, choice: dict[str, int], recompute: dict[int, int] | None
) -> float:
    """The largest budget row's bytes under ``choice`` and ``recompute`` (its peak over the
    rows; rows over ``x`` and, with the checkpointing decision, its columns)."""
    rows = _memory_matrix(m)
    offsets = _offsets(sg)
    n_x = sum(len(sg.nodes[r].strategies) for r in sg.reps)
    v = np.zeros(rows.shape[1])
    for r, c in choice.items():
        v[offsets[r] + c] = 1.0
    cols = columns(sg)
    if cols is not None and rows.shape[1] > n_x:
        v[n_x:] = cols.values(choice, recompute)
    return float((rows @ v).max())


def _found_counts(prob: _Problem, values: np.ndarray | None) -> dict[int, int] | None:
    """The counts of recomputed blocks in a HiGHS solution (None without the decision)."""
    if prob.recompute is None or values is None:
        return None
    ck0 = _recompute_offset(prob)
    return prob.recompute.cols.counts(values[ck0 : ck0 + prob.recompute.cols.n])


def _finish_incumbent(
    inc: ILPResult, mip_bound: float | None, proven: bool, solve_s: float, stopped: str
) -> ILPResult:
    """The relax-and-fix plan as the answer, with its gap to the best bound known.

    ``proven``: the MIP cut off at the plan's objective ended (infeasible: nothing better
    exists, gap 0; or optimal within its gap, whose bound then holds for the plan too).
    Otherwise a limit stopped the MIP before it beat the plan: the status is that limit
    (``stopped``, the MIP's status, through :func:`_stopped`).
    """
    cost = inc.objective_s
    bounds = [b for b in (inc.bound_s, mip_bound) if b is not None and math.isfinite(b)]
    if proven and (mip_bound is None or not math.isfinite(mip_bound)):
        bound = cost
    elif bounds:
        bound = max(bounds)
    else:  # a start the search never bounded (the LP did not finish)
        return replace(inc, status=_stopped(stopped), gap=math.nan, solve_seconds=solve_s)
    gap = max(0.0, (cost - bound) / cost) if cost > 0 else 0.0
    status = ("optimal" if gap <= 1e-9 else "within_gap") if proven else _stopped(stopped)
    return replace(
        inc, status=status, gap=gap, bound_s=bound, solve_seconds=inc.solve_seconds + solve_s
    )


def _left(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` for the next solver call (at least 1); None
    without a wall-clock limit."""
    return None if deadline is None else max(1.0, deadline - time.perf_counter())


class _RelaxationStopped(Exception):
    """The LP relaxation stopped at its iteration limit (:func:`_lp_first`)."""


def _stopped(status: str) -> str:
    """The status of a search HiGHS stopped before a proof: the limit it named
    (``work_limit``, ``iteration_limit``, ``time_limit``), or ``stopped`` for any other
    stop (an error with a plan in hand, an objective bound)."""
    return status if status in LIMIT_STATUSES else "stopped"


def _limit_words(status: str, options: SolverOptions) -> str:
    """What stopped a search, as the option a user would raise."""
    if status == "work_limit":
        return f"stopped at --work-limit {options.work_limit}; raise it"
    if status == "iteration_limit":
        return f"stopped at {options.lp_iteration_limit} simplex iterations"
    if status == "time_limit" and options.time_limit_s is not None:
        return f"stopped at --time-limit {options.time_limit_s:g} s; raise it"
    if status == "stopped":
        return "HiGHS stopped before a proof, at none of autoshard's limits (status stopped)"
    return f"status {status}"


def _lp_first(
    sg, prob: _Problem, options: SolverOptions, memory, t0: float, deadline: float
) -> ILPResult | None:
    """The LP relaxation; its plan when integral, or rounded within ``mip_gap``.

    Returns None when the LP fails, or a result whose status is ``incumbent`` when
    relax-and-fix found a plan outside the gap (the full MIP may still beat it).

    Raises:
        _RelaxationStopped: the LP stopped at ``options.lp_iteration_limit``.
    """
    milp = _milp(prob, boolean=False, memory=memory)
    build_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    lp = run(milp, _left(deadline), iteration_limit=options.lp_iteration_limit)
    if lp.status == "iteration_limit":
        raise _RelaxationStopped
    if lp.status != "optimal" or lp.x is None:
        return None  # infeasible or odd: the MIP path reports it properly
    values = lp.x
    xv = values[: prob.n_x]
    bound = float(lp.objective) / SCALE
    integral = bool(np.all((xv < 1e-6) | (xv > 1 - 1e-6)))
    if prob.recompute is not None:  # the digits of the recomputed counts too
        ck0 = _recompute_offset(prob)
        digits = values[ck0 : ck0 + prob.recompute.cols.n][prob.recompute.cols.digit_mask()]
        integral = integral and bool(np.all((digits < 1e-6) | (digits > 1 - 1e-6)))
    if not integral:
        # relax-and-fix: keep every node the LP decided, solve the MIP on the rest
        decided = np.flatnonzero(xv > 1 - 1e-6)
        left = _left(deadline)
        values = _fixed_mip(prob, memory, decided, options, None if left is None else left / 2)
        if values is None:
            return None
        xv = values[: prob.n_x]
    recompute = _found_counts(prob, values)
    choice = prefer_smaller_shards(sg, _choice(sg, prob, xv), recompute=recompute)
    cost = evaluate(sg, choice, recompute)
    if memory is not None:  # prefer_smaller_shards never breaks the budget: a check
        if _memory(sg, memory[0], choice, recompute) > memory[1] * (1 + 1e-9):
            return None
    if not math.isfinite(cost):
        return None
    gap = max(0.0, (cost - bound) / cost) if cost > 0 else 0.0
    status = "optimal" if integral or gap <= 1e-12 else "within_gap"
    if not integral and gap > options.mip_gap:
        status = "incumbent"
    return ILPResult(
        choice=choice,
        recompute=_counts(sg, recompute),
        objective_s=cost,
        status=status,
        gap=0.0 if integral else gap,
        **_size(prob, memory),
        build_seconds=build_s,
        solve_seconds=time.perf_counter() - t1,
        bound_s=bound,
    )


def _fixed_mip(
    prob: _Problem, memory, decided: np.ndarray, options: SolverOptions, time_limit: float | None
):
    """The MIP with the variables in ``decided`` fixed to 1; its columns' values, or None.

    Solved to ``mip_gap`` (the caller measures the plan against the LP bound anyway)
    within ``time_limit`` seconds; a plan found when the time runs out is still returned
    (its gap is measured by the caller)."""
    milp = _milp(prob, memory=memory, fixed=decided)
    found = run(
        milp,
        time_limit,
        float(options.mip_gap),
        seconds_per_unit=1 / SCALE,
        work_limit=options.work_limit,
    )
    if found.status in ("infeasible", "error") or found.x is None:
        return None
    return found.x


def _least_memory(prob: _Problem, m: np.ndarray, options: SolverOptions) -> float:
    """The least peak ``max_k M_k . x`` over every plan: the same ILP with one more column
    ``t >= M_k . x`` for every budget row, and ``t`` as the objective (:func:`_milp`'s
    ``peak``)."""
    rows = _memory_matrix(m)
    # in units of the largest coefficient: bytes (1e9 and more, of both signs with
    # recomputation) left HiGHS's presolve calling the program infeasible
    unit = max(float(np.abs(rows).max()) if rows.size else 1.0, 1.0)
    milp = _milp(prob, peak=rows / unit)
    found = run(milp, options.time_limit_s, work_limit=options.work_limit)
    # a search stopped before its proof knows only that no plan goes below its bound
    least = found.objective if found.status == "optimal" else found.bound
    if least is None:
        raise AutoshardError(
            f"HiGHS found no plan at all when minimising memory ({found.model_status})"
        )
    return least * unit


def _bound_and_gap(bound: float | None, gap: float | None) -> tuple[float | None, float | None]:
    """HiGHS's dual bound, clamped at 0 (every cost is >= 0, so 0 is a bound anyway), and
    its relative gap."""
    if bound is not None and not bound > 0:
        bound = 0.0
    return bound, gap


def prefer_smaller_shards(
    sg: StrategyGraph,
    choice: dict[str, int],
    tol: float = 1e-12,
    recompute: dict[int, int] | None = None,
) -> dict:
    """Among plans of equal time, prefer parameters and inputs held in smaller pieces.

    Slicing a replicated tensor is free, so storing a weight whole or sharded often
    costs the same time; the solver then picks either. One greedy pass moves each
    parameter and input to the placement with the fewest bytes per device whose
    change does not raise the objective by more than ``tol`` seconds. Returns a new
    choice.
    """
    original, choice = choice, dict(choice)
    if sg.graph is None:  # a bare strategy graph (tests): nothing to compare
        return choice
    incident: dict[str, list] = {}
    for e in sg.edges:
        incident.setdefault(e.src, []).append(e)
        incident.setdefault(e.dst, []).append(e)

    def local_cost(rep: str, i: int) -> float:
        c = float(sg.rep_cost(rep)[i])
        for e in incident.get(rep, ()):
            a = e.src_groups[i if e.src == rep else choice[e.src]]
            b = e.dst_groups[i if e.dst == rep else choice[e.dst]]
            c += float(e.cost[a, b])
        return c

    for name, info in sg.graph.nodes.items():
        if info.kind not in ("param", "input") or name not in sg.nodes:
            continue
        ns = sg.nodes[name]
        if ns.rep != name:
            continue
        t = info.results[0]
        size = [local_bytes(t, s.outputs[0], sg.mesh_shape) for s in ns.strategies]
        now = local_cost(name, choice[name])
        best = choice[name]
        for i in sorted(range(len(ns.strategies)), key=lambda j: size[j]):
            if size[i] >= size[best]:
                break
            if local_cost(name, i) <= now + tol:
                best = i
                break
        choice[name] = best
    if (sg.overlap or recompute or sg.shares) and evaluate(sg, choice, recompute) > evaluate(
        sg, original, recompute
    ) + tol:
        # the local check sees neither hidden communication move, nor a recomputed
        # forward read a parameter again, nor reads share a resharding
        return dict(original)
    return choice


def brute_force(sg: StrategyGraph, limit: int = 200_000) -> tuple[dict[str, int], float]:
    """Exhaustive minimum of :func:`evaluate` (tests only; at most ``limit`` plans)."""
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
