"""The sharding ILP stated in cvxpy, compiled once to the matrices HiGHS takes.

:mod:`autoshard.solver.ilp` writes its program here as cvxpy's model: one variable vector per
family of columns (the strategy choices ``x``, the edges' transport ``y``, the hidden
seconds ``z``, the checkpointing decision's columns), and every family of constraints as
sparse matrices times those vectors. :func:`compile_program` compiles it with cvxpy's own
chain for HiGHS (``Problem.get_problem_data(cvxpy.HIGHS)``: Dcp2Cone, CvxAttr2Constr,
ConeMatrixStuffing, the matrices cvxpy's HiGHS interface passes) and returns them as a
:class:`~autoshard.solver.highs.MILP` with its columns in the families' order, so that a
MIP start and a solution read as the ILP's own ``[x; y; z; ...]``. The compiled matrices go
to :func:`autoshard.solver.highs.run`, which adds what cvxpy's ``solve`` cannot pass: the
start, the work limit, one thread and a fixed seed.

cvxpy is imported only when a program is built: ``autoshard --help`` and ``show`` never
load it (1.3 s on a 2-core machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from autoshard.solver.highs import MILP

__all__ = ["Layout", "compile_program"]


class Layout:
    """The program's columns as named families, in order: one cvxpy variable each.

    ``families``: ``(name, size, lower, upper, integer)`` with ``lower``/``upper`` arrays
    of ``size`` (``±np.inf`` for none) and ``integer`` a boolean array of ``size`` (the
    integral columns). A family of size 0 has no variable. Columns are numbered across the
    families in order, as the ILP numbers them.
    """

    def __init__(self, families: Sequence[tuple[str, int, Any, Any, Any]]) -> None:
        import cvxpy as cp

        self.names: list[str] = []
        self.sizes: list[int] = []
        self.variables: dict[str, Any] = {}
        for name, size, lower, upper, integer in families:
            self.names.append(name)
            self.sizes.append(int(size))
            if not size:
                continue
            lo = np.broadcast_to(np.asarray(lower, dtype=float), (size,)).copy()
            hi = np.broadcast_to(np.asarray(upper, dtype=float), (size,)).copy()
            flags = np.broadcast_to(np.asarray(integer, dtype=bool), (size,))
            kind: dict[str, Any] = {}
            if flags.all():
                kind["integer"] = True
            elif flags.any():
                kind["integer"] = [np.flatnonzero(flags)]  # cvxpy: one index list per axis
            self.variables[name] = cp.Variable(size, name=name, bounds=[lo, hi], **kind)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    @property
    def n(self) -> int:
        """Columns in all."""
        return int(self.starts[-1])

    def __getitem__(self, name: str) -> Any:
        return self.variables[name]

    def times(self, matrix: sp.spmatrix | np.ndarray) -> Any:
        """``matrix @ [every family]`` as a cvxpy expression: ``matrix`` ``(rows, n)`` split
        by family, the all-zero blocks left out. A vector is one row (a scalar)."""
        m = sp.csc_matrix(np.atleast_2d(matrix) if not sp.issparse(matrix) else matrix)
        if m.shape[1] != self.n:
            raise ValueError(f"a matrix of {m.shape[1]} columns over {self.n} columns")
        if not self.variables:  # no columns at all: the zero it is
            return 0.0 if np.ndim(matrix) == 1 and not sp.issparse(matrix) else np.zeros(len(m))
        terms = []
        for k, name in enumerate(self.names):
            if name not in self.variables:
                continue
            block = m[:, self.starts[k] : self.starts[k + 1]]
            if block.nnz:
                terms.append(block @ self.variables[name])
        if not terms:
            first = next(iter(self.variables.values()))
            terms.append(sp.csc_matrix((m.shape[0], first.size)) @ first)  # 0, shaped
        out = terms[0]
        for t in terms[1:]:
            out = out + t
        return out[0] if not sp.issparse(matrix) and np.ndim(matrix) == 1 else out

    def rows(self, matrix: sp.spmatrix, lower: np.ndarray, upper: np.ndarray) -> list:
        """``lower <= matrix @ [every family] <= upper`` as cvxpy constraints: equalities
        where both bounds are equal, one side where the other is infinite. ``lower`` and
        ``upper``: ``(rows,)`` or scalars."""
        import cvxpy as cp

        m = sp.csr_matrix(matrix)
        if not self.variables:  # rows over no column constrain nothing a solver can change
            return []
        lower = np.broadcast_to(np.asarray(lower, dtype=float), (m.shape[0],))
        upper = np.broadcast_to(np.asarray(upper, dtype=float), (m.shape[0],))
        out: list[cp.Constraint] = []
        equal = lower == upper
        for mask, make in (
            (equal, lambda e, lo, hi: e == hi),
            (~equal & np.isfinite(upper), lambda e, lo, hi: e <= hi),
            (~equal & np.isfinite(lower), lambda e, lo, hi: e >= lo),
        ):
            if mask.any():
                out.append(make(self.times(m[mask]), lower[mask], upper[mask]))
        return out


def compile_program(layout: Layout, objective: np.ndarray, constraints: list) -> MILP:
    """Minimise ``objective . [every family]`` subject to ``constraints``: compiled by
    cvxpy for HiGHS, as a :class:`~autoshard.solver.highs.MILP` over the layout's columns
    in the layout's order (cvxpy's own order is by variable; its column offsets map it
    back). ``objective``: ``(layout.n,)``.

    A layout without columns compiles to the empty program (no columns, no rows).

    Raises:
        ValueError: cvxpy compiled a program of other columns than the layout's: a
            family that no row reads and the objective does not price (cvxpy leaves it
            out), or a reduction that added columns.
    """
    import cvxpy as cp

    if not layout.variables:  # nothing to decide: the empty program, for HiGHS to say so
        empty = np.zeros(0)
        return MILP(empty, sp.csc_matrix((0, 0)), empty, empty, empty, empty, empty.astype(bool))
    goal = cp.Minimize(layout.times(np.asarray(objective, dtype=float)))
    data, _, inverse = cp.Problem(goal, constraints).get_problem_data(cp.HIGHS)
    offsets = next(i.var_offsets for i in reversed(inverse) if hasattr(i, "var_offsets"))
    missing = [name for name, v in layout.variables.items() if v.id not in offsets]
    if missing:  # a family in no row and not priced: cvxpy leaves it out
        raise ValueError(f"cvxpy compiled no column for the families {missing}")
    order = np.concatenate(
        [offsets[layout[name].id] + np.arange(layout[name].size) for name in layout.variables]
    )
    A = data[cp.settings.A].tocsc()
    if A.shape[1] != layout.n or len(order) != layout.n:
        raise ValueError(f"cvxpy compiled {A.shape[1]} columns for the {layout.n} stated")
    dims = data[cp.settings.DIMS]
    b = np.asarray(data[cp.settings.B], dtype=float)
    n_eq, n_leq = int(dims.zero), int(dims.nonneg)
    if n_eq + n_leq != A.shape[0]:
        raise ValueError("cvxpy compiled cones other than equalities and inequalities")
    integral = np.zeros(layout.n, dtype=bool)
    integral[list(data[cp.settings.BOOL_IDX]) + list(data[cp.settings.INT_IDX])] = True
    lower, upper = data[cp.settings.LOWER_BOUNDS], data[cp.settings.UPPER_BOUNDS]
    milp = MILP(
        c=np.asarray(data[cp.settings.C], dtype=float)[order],
        A=A[:, order],
        row_lower=np.concatenate([b[:n_eq], np.full(n_leq, -np.inf)]),
        row_upper=b,
        col_lower=np.full(layout.n, -np.inf) if lower is None else np.asarray(lower)[order],
        col_upper=np.full(layout.n, np.inf) if upper is None else np.asarray(upper)[order],
        integer=integral[order],
    )
    return milp
