"""Activation checkpointing as a decision of the plan: which repeated blocks recompute.

A block that recomputes (``torch.utils.checkpoint`` around it, as torchtitan's full
activation checkpointing does per transformer block) keeps only its input from the
forward pass to the backward pass; its backward first runs its forward again. In the
step's terms (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016):

* time: one more forward pass of the block, its compute and every resharding its
  forward ops read (a tensor-parallel all-reduce, an FSDP all-gather of its weights),
  priced exactly as in the forward pass under the same plan;
* memory: the activations the block saves for its backward, except its input (what it
  reads from outside the block), are not live between its forward and its backward.
  While the block's own backward runs they are live again, recomputed.

A traced block standing for ``m`` identical real blocks (:func:`autoshard.trace.tracer.
reduce_depth`) chooses how many of them, ``k`` in ``0..m``, recompute: the liveness
(:class:`autoshard.cost.liveness.Liveness`) counts its saved activations ``m`` times at every
point where they are live. Between the block's forward and its backward, recomputing
``k`` blocks frees ``k`` copies; inside its own forward or backward (where one copy is
being computed or recomputed) ``max(k - 1, 0)`` copies. A traced block standing for one
block frees its copy between its forward and its backward only.

The ILP (:mod:`autoshard.solver.ilp`) decides ``k`` with binary digits ``k = sum_b 2^b
beta_b`` and linearises the products with the plan exactly (at integral points):

* time: ``w_b >= 2^b (R(x, y) - R_max (1 - beta_b))``, ``w_b >= 0``, the objective adding
  ``sum_b w_b``, ``R`` one copy's forward seconds and ``R_max`` its largest value;
* memory: per representative ``r`` of a saved activation and strategy ``i``,
  ``0 <= z_ri <= m x_ri`` with ``sum_i z_ri = k`` (so ``z = k x``), and for ``m > 1``
  ``g_ri >= x_ri + gamma - 1``, ``g >= 0``, ``gamma >= beta_b`` (so ``g = [k >= 1] x``); a
  budget row subtracts ``sum_i bytes_ji z_ri`` (between) or ``sum_i bytes_ji (z_ri -
  g_ri)`` (inside) for every saved activation ``j`` live at its point.

What is left out, and errs on the side of more memory: the recomputed forward's
collectives are not hidden under compute, and the one block recomputed at a time is
counted at every point of its forward as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from autoshard.cost.liveness import activation_sizes, last_uses, liveness, local_bytes
from autoshard.strategies.sharing import shared_seconds

MODES = ("auto", "none", "full")
"""``--activation-checkpointing``: ``auto`` (the ILP decides per block), ``none`` (no
block recomputes), ``full`` (every repeated block recomputes)."""


@dataclass(frozen=True)
class CheckpointBlock:
    """One traced repeated block that may recompute.

    ``layer``: its layer index (the first real block it stands for); ``real``: the real
    blocks it stands for (``k`` of them recompute: the first ``k``); ``forward``: its
    forward op nodes that have strategies; ``saved``: indices (into the liveness nodes) of
    the activations recomputing frees.
    """

    layer: int
    real: tuple[int, ...]
    forward: tuple[str, ...]
    saved: tuple[int, ...]

    @property
    def copies(self) -> int:
        return len(self.real)

    @property
    def bits(self) -> int:
        """Binary digits of the count of blocks that recompute (0..copies)."""
        return self.copies.bit_length()


class Checkpointing:
    """The repeated blocks of a training graph that may recompute, and what that costs
    (module docstring).

    Attributes:
        blocks: one per traced repeated block with activations to free.
        between: ``(points, liveness nodes)`` sparse 0/1: a freed activation live at a
            point between its block's forward and backward (``k`` copies freed there).
        inside: the same at points inside its block's forward or backward, for blocks
            standing for more than one (``max(k - 1, 0)`` copies freed there).
        fixed: ``True`` when every block recomputes (``--activation-checkpointing full``).
    """

    def __init__(self, sg, fixed: bool = False) -> None:  # noqa: ANN001 - a StrategyGraph
        graph = sg.graph
        self.fixed = fixed
        live = liveness(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = last_uses(graph)
        users = graph.users()
        stands_for = graph.depth.stands_for if graph.depth is not None else None
        fwd_end, bwd_start = {}, {}
        for n, info in graph.nodes.items():
            if info.kind != "op" or info.layer is None:
                continue
            t, p = info.layer, order[n]
            if info.backward:
                bwd_start.setdefault(t, p)
            else:
                fwd_end[t] = p
        index = {n: j for j, n in enumerate(live.nodes)}

        def read_outside(n: str, layer: int) -> bool:
            """Whether an op outside ``layer`` reads ``n``, directly or through views."""
            for u in users.get(n, ()):
                info = graph.nodes[u]
                if info.layer != layer:
                    return True
                if info.kind == "op" and u not in index and read_outside(u, layer):
                    return True  # a view of it (views are not liveness nodes)
            return False

        blocks = []
        for t in sorted(fwd_end):
            if t not in bwd_start:
                continue
            forward = tuple(
                n
                for n, info in graph.nodes.items()
                if info.kind == "op" and info.layer == t and not info.backward and n in sg.nodes
            )
            saved = tuple(
                index[n]
                for n in forward
                if n in index and last.get(n, -1) >= bwd_start[t] and not read_outside(n, t)
            )
            if not saved:
                continue
            ordinal = sorted(fwd_end).index(t)
            real = stands_for[ordinal] if stands_for is not None else (t,)
            blocks.append(CheckpointBlock(t, tuple(real), forward, saved))
        self.blocks = blocks
        at = live.positions
        rows_b, cols_b, rows_i, cols_i = [], [], [], []
        for b in blocks:
            # strictly after its last forward op (which still runs at its own point)
            gap = (at > fwd_end[b.layer]) & (at < bwd_start[b.layer])
            for j in b.saved:
                pts = live.points[:, j].nonzero()[0]
                between = pts[gap[pts]]
                rows_b.append(between)
                cols_b.append(np.full(len(between), j))
                if b.copies > 1:
                    inside = pts[~gap[pts]]
                    rows_i.append(inside)
                    cols_i.append(np.full(len(inside), j))
        shape = live.points.shape

        def matrix(rows, cols) -> sp.csr_matrix:
            if not rows:
                return sp.csr_matrix(shape)
            r, c = np.concatenate(rows), np.concatenate(cols)
            return sp.csr_matrix((np.ones(len(r)), (r, c)), shape=shape)

        self.between = matrix(rows_b, cols_b)
        self.inside = matrix(rows_i, cols_i)

    def full(self) -> dict[int, int]:
        """Every block recomputes: layer -> its copies."""
        return {b.layer: b.copies for b in self.blocks}

    def counts(self, recompute: dict[int, int] | None) -> dict[int, int]:
        """``recompute`` with every block present (0 where absent); ``full`` when fixed."""
        if self.fixed:
            return self.full()
        given = recompute or {}
        return {b.layer: int(given.get(b.layer, 0)) for b in self.blocks}

    def forward_seconds(self, sg, block: CheckpointBlock, choice: dict[str, int]) -> float:  # noqa: ANN001
        """Seconds of one real copy of ``block``'s forward pass under ``choice``: its ops'
        compute and what they communicate themselves, and the reshardings they read
        (:attr:`autoshard.strategies.graph.Edge.forward_uses` of every edge's real reads)."""
        graph = sg.graph
        total = 0.0
        for n in block.forward:
            ns = sg.nodes[n]
            k = ns.choice[choice[ns.rep]]
            total += float(ns.compute_s[k]) / graph.mult(n) + ns.strategies[k].own_s
        for e in sg.edges:
            uses = e.forward_uses.get(block.layer, 0)
            if uses:
                cost = float(e.cost[e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]])
                total += cost * uses / e.uses
        return total + shared_seconds(sg, choice, block.layer)

    def seconds(self, sg, choice: dict[str, int], recompute: dict[int, int] | None) -> float:  # noqa: ANN001
        """Seconds the recomputation adds to the step: ``sum_k k * forward_seconds``."""
        counts = self.counts(recompute)
        return sum(
            counts[b.layer] * self.forward_seconds(sg, b, choice)
            for b in self.blocks
            if counts[b.layer]
        )

    def freed(self, sg, node_strategy: dict, recompute: dict[int, int] | None) -> np.ndarray:  # noqa: ANN001
        """Bytes one device frees at each liveness point under a plan (its strategy per
        node) when the blocks ``recompute`` names recompute."""
        one_copy = activation_sizes(sg, node_strategy, sg.mesh_shape, scaled=False)
        counts = self.counts(recompute)
        k_between = np.zeros(len(one_copy))
        k_inside = np.zeros(len(one_copy))
        for b in self.blocks:
            k = counts[b.layer]
            idx = np.array(b.saved)
            k_between[idx] = k
            k_inside[idx] = max(k - 1, 0)
        return self.between @ (one_copy * k_between) + self.inside @ (one_copy * k_inside)

    def saved_bytes(self, sg, node_strategy: dict, recompute: dict[int, int] | None) -> float:  # noqa: ANN001
        """Bytes one device does not keep from forward to backward because the blocks
        ``recompute`` names recompute."""
        one_copy = activation_sizes(sg, node_strategy, sg.mesh_shape, scaled=False)
        counts = self.counts(recompute)
        return sum(counts[b.layer] * float(one_copy[list(b.saved)].sum()) for b in self.blocks)

    def counts_of_blocks(self, real: list[int]) -> dict[int, int]:
        """The counts that recompute the real blocks ``real`` (a solution's
        ``recomputed_blocks``): per traced block, how many of those it stands for."""
        wanted = set(real)
        return {b.layer: len(wanted.intersection(b.real)) for b in self.blocks}

    def recomputed_blocks(self, recompute: dict[int, int] | None) -> list[int]:
        """The real block indices that recompute (the first ``k`` of each traced block's)."""
        counts = self.counts(recompute)
        return sorted(i for b in self.blocks for i in b.real[: counts[b.layer]])


def node_bytes(sg, j: int, strategy: int) -> float:  # noqa: ANN001
    """Bytes one device holds of liveness node ``j`` (one copy) when its representative
    takes ``strategy``."""
    live = liveness(sg.graph)
    n = live.nodes[j]
    ns = sg.nodes[n]
    info = sg.graph.nodes[n]
    outs = ns.strategies[ns.choice[strategy]].outputs
    return sum(
        local_bytes(r, ps, sg.mesh_shape)
        for r, ps in zip(info.results, outs, strict=False)
        if r is not None
    )


class Columns:
    """The ILP's columns for the checkpointing decision, after its own (module docstring).

    Per block, in order: ``beta`` (its binary digits), ``w`` (their seconds), ``z`` (per
    representative of a freed activation, one per strategy) and, for a block standing for
    more than one, ``gamma`` and ``g`` (like ``z``). ``credit``: ``(liveness nodes, n)``
    bytes of one copy of each freed activation over its ``z`` columns; ``credit_g`` the
    same over its ``g`` columns.
    """

    def __init__(self, sg, ck: Checkpointing) -> None:  # noqa: ANN001 - a StrategyGraph
        self.ck = ck
        live = liveness(sg.graph)
        pos = 0
        self.beta, self.w, self.z, self.gamma, self.g = [], [], [], [], []
        self.sizes: dict[str, int] = {}
        rows, cols, vals, g_rows, g_cols, g_vals = [], [], [], [], [], []
        for b in ck.blocks:
            self.beta.append(pos)
            self.w.append(pos + b.bits)
            pos += 2 * b.bits
            reps = list(dict.fromkeys(sg.nodes[live.nodes[j]].rep for j in b.saved))
            self.sizes.update({r: len(sg.nodes[r].strategies) for r in reps})
            z = {}
            for r in reps:
                z[r] = pos
                pos += len(sg.nodes[r].strategies)
            self.z.append(z)
            g = {}
            if b.copies > 1:
                self.gamma.append(pos)
                pos += 1
                for r in reps:
                    g[r] = pos
                    pos += len(sg.nodes[r].strategies)
            else:
                self.gamma.append(None)
            self.g.append(g)
            for j in b.saved:
                r = sg.nodes[live.nodes[j]].rep
                for i in range(len(sg.nodes[r].strategies)):
                    v = node_bytes(sg, j, i)
                    rows.append(j)
                    cols.append(z[r] + i)
                    vals.append(v)
                    if g:
                        g_rows.append(j)
                        g_cols.append(g[r] + i)
                        g_vals.append(v)
        self.n = pos
        shape = (len(live.nodes), pos)
        self.credit = sp.csr_matrix((vals, (rows, cols)), shape=shape)
        self.credit_g = sp.csr_matrix((g_vals, (g_rows, g_cols)), shape=shape)

    def memory_rows(self, points) -> np.ndarray:  # noqa: ANN001 - point indices
        """The budget rows' part over these columns: bytes freed, negative,
        ``(len(points), n)``."""
        pts = list(points)
        between, inside = self.ck.between[pts], self.ck.inside[pts]
        return (-((between + inside) @ self.credit) + inside @ self.credit_g).toarray()

    def values(self, choice: dict[str, int], recompute: dict[int, int] | None) -> np.ndarray:
        """The columns' values for a plan and its counts (``w`` left 0: the ILP sets it)."""
        v = np.zeros(self.n)
        counts = self.ck.counts(recompute)
        for bi, b in enumerate(self.ck.blocks):
            k = counts[b.layer]
            for d in range(b.bits):
                v[self.beta[bi] + d] = (k >> d) & 1
            for r, start in self.z[bi].items():
                v[start + choice[r]] = k
            if self.gamma[bi] is not None:
                v[self.gamma[bi]] = 1.0 if k else 0.0
                for r, start in self.g[bi].items():
                    v[start + choice[r]] = 1.0 if k else 0.0
        return v

    def digit_mask(self) -> np.ndarray:
        """Which of the columns are binary digits (``beta``)."""
        mask = np.zeros(self.n, dtype=bool)
        for bi, b in enumerate(self.ck.blocks):
            mask[self.beta[bi] : self.beta[bi] + b.bits] = True
        return mask

    def counts(self, v: np.ndarray) -> dict[int, int]:
        """Blocks that recompute, per traced block, from the columns' values."""
        return {
            b.layer: sum(int(round(v[self.beta[bi] + d])) << d for d in range(b.bits))
            for bi, b in enumerate(self.ck.blocks)
        }


def columns(sg) -> Columns | None:  # noqa: ANN001 - a StrategyGraph
    """The checkpointing decision's ILP columns of ``sg`` (cached on its
    :class:`Checkpointing`), or None when ``sg`` has none."""
    ck = getattr(sg, "checkpointing", None)
    if ck is None or not ck.blocks:
        return None
    cached = ck.__dict__.get("_columns")
    if cached is None:
        cached = Columns(sg, ck)
        ck.__dict__["_columns"] = cached
    return cached
