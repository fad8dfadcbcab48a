"""Activation checkpointing as a decision of the plan: which repeated blocks recompute,
and how much of them.

Two policies, as torchtitan runs them per transformer block:

* **full**: ``torch.utils.checkpoint`` around the block. It keeps only its input from the
  forward pass to the backward pass; its backward first runs its forward again, up to the
  last op whose output the block's backward reads: non-reentrant checkpointing stops
  there once every saved tensor is back (its "early stop", on by default), so a block's
  last projection and residual add do not run again
  (:func:`autoshard.trace.selective.recomputed_ops`).
* **selective** (op-level, :mod:`autoshard.trace.selective`): the block keeps the outputs
  of its attention kernels and of every other ``aten.mm``, and recomputes the rest of its
  forward in the backward pass.

In the step's terms (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016;
Korthikanti et al., 2022, for the selective policy):

* time: the recomputed ops of the block's forward pass run once more, their compute and
  every resharding they read (a tensor-parallel all-reduce, a sequence-parallel
  all-gather), priced exactly as in the forward pass under the same plan, except a
  parameter the block's backward gathers to every mesh dim replicated as the forward
  does: FSDP2 gathers it once for the recomputation and the backward together
  (:mod:`autoshard.trace.rerun_reads`), so the recomputation pays no gather of its own;
* memory: the activations the block saves for its backward, except its input (what it
  reads from outside the block) and, under the selective policy, the outputs it keeps,
  are not live between its forward and its backward. While the block's own backward
  runs they are live again, recomputed.

Every-other-layer checkpointing (torchtitan's selective "layer" option) is the full
policy on half of the blocks: the counts below already express it.

A traced block standing for ``m`` identical real blocks (:func:`autoshard.trace.tracer.
reduce_depth`) chooses how many of them recompute under each policy, ``k_full + k_sel <=
m``: the liveness (:class:`autoshard.cost.liveness.Liveness`) counts its saved activations
``m`` times at every point where they are live. Between the block's forward and its
backward, a policy recomputing ``k`` blocks frees ``k`` copies of what it frees; inside its
own forward or backward (where one copy is being computed or recomputed) ``max(k - 1, 0)``
copies per policy. A traced block standing for one block frees its copy between its
forward and its backward only. The real blocks that recompute are the first ``k_full``
(full) and the next ``k_sel`` (selective).

The ILP (:mod:`autoshard.solver.ilp`) decides each ``k`` with binary digits ``k = sum_b
2^b beta_b`` and linearises the products with the plan exactly (at integral points):

* time: ``w_b >= 2^b (R(x, y) - R_max (1 - beta_b))``, ``w_b >= 0``, the objective adding
  ``sum_b w_b``, ``R`` one copy's recomputed seconds under the policy and ``R_max`` its
  largest value;
* memory: per representative ``r`` of a freed activation and strategy ``i``,
  ``0 <= z_ri <= m x_ri`` with ``sum_i z_ri = k`` (so ``z = k x``), and for ``m > 1``
  ``g_ri >= x_ri + gamma - 1``, ``g >= 0``, ``gamma >= beta_b`` (so ``g = [k >= 1] x``); a
  budget row subtracts ``sum_i bytes_ji z_ri`` (between) or ``sum_i bytes_ji (z_ri -
  g_ri)`` (inside) for every freed activation ``j`` live at its point.

What is left out, and errs on the side of more memory and time: the recomputed forward's
collectives are not hidden under compute; the one block recomputed at a time is counted
at every point of its forward as well (once per policy that recomputes some block); a
resharding shared by a kept op and a recomputed op is paid again in full.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from autoshard.cost.liveness import (
    activation_sizes,
    getitem_sources,
    last_uses,
    liveness,
    local_bytes,
)
from autoshard.strategies.sharing import shared_seconds
from autoshard.trace.rerun_reads import takes_back
from autoshard.trace.selective import recomputed_ops, saved_ops

MODES = ("auto", "none", "full", "selective")
"""``--activation-checkpointing``: ``auto`` (the ILP decides per block: none, full or
selective), ``none`` (no block recomputes), ``full`` (every repeated block recomputes its
forward, up to its early stop), ``selective`` (every repeated block recomputes all but its
attention and every other matmul, :mod:`autoshard.trace.selective`)."""

POLICIES = ("full", "selective")
"""How a block recomputes (module docstring)."""


def rerun_refund(sg, choice: dict[str, int], layer: int, selective: bool) -> float:  # noqa: ANN001
    """Seconds of one real copy of block ``layer``'s recomputation that its backward's
    gathers take back under ``choice``: each paired read
    (:attr:`~autoshard.strategies.graph.StrategyGraph.rerun_pairs`) that
    :func:`~autoshard.trace.rerun_reads.takes_back` gives back what the recomputation's
    read charges."""
    total = 0.0
    for pair in sg.rerun_pairs:
        n = (pair.selective if selective else pair.full).get(layer, 0)
        if not n:
            continue
        f, g = sg.edges[pair.forward], sg.edges[pair.backward]
        a, b = f.src_groups[choice[f.src]], f.dst_groups[choice[f.dst]]
        a_g, b_g = g.src_groups[choice[g.src]], g.dst_groups[choice[g.dst]]
        if takes_back(
            f.src_placements[a],
            f.dst_placements[b],
            g.src_placements[a_g],
            g.dst_placements[b_g],
            pair.dims,
        ):
            total += float(f.cost[a, b]) * n / f.uses
    return total


def rerun_takes_gather(sg, node_strategy: dict, producer: str, consumer: str, k: int) -> bool:  # noqa: ANN001
    """Whether a recomputation's read of ``producer`` (``consumer``'s tensor argument
    ``k``) takes its block's backward gathered copy under a plan (its strategy per node):
    the read node by node that :func:`rerun_refund` prices edge by edge. Its collectives
    run once, in the backward; the recomputation runs none for it."""
    pair = sg.rerun_reads.get((producer, consumer, k))
    if pair is None:
        return False
    x, back, kb = pair.backward
    return takes_back(
        node_strategy[producer].outputs[0],
        node_strategy[consumer].inputs[k],
        node_strategy[x].outputs[0],
        node_strategy[back].inputs[kb],
        pair.dims,
    )


@dataclass(frozen=True)
class CheckpointBlock:
    """One traced repeated block that may recompute.

    ``layer``: its layer index (the first real block it stands for); ``real``: the real
    blocks it stands for (``k`` of them recompute: the first ``k``, after those the full
    policy takes); ``forward``: the forward op nodes with strategies the policy recomputes;
    ``saved``: indices (into the liveness nodes) of the activations recomputing frees;
    ``policy``: ``"full"`` or ``"selective"`` (:data:`POLICIES`); ``kept``: under the
    selective policy, indices of the outputs it keeps for its recomputation that its
    backward would not otherwise hold (they stay live from forward to backward).
    """

    layer: int
    real: tuple[int, ...]
    forward: tuple[str, ...]
    saved: tuple[int, ...]
    policy: str = "full"
    kept: tuple[int, ...] = ()

    @property
    def key(self) -> tuple[int, str]:
        """The block's key in a plan's counts: ``(layer, policy)``."""
        return (self.layer, self.policy)

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
        blocks: per traced repeated block with activations to free, one per policy of
            ``policies`` that frees some (the full policy's first).
        between: ``(points, liveness nodes)`` sparse 0/1: a freed activation live at a
            point between its block's forward and backward (``k`` copies freed there).
        inside: the same at points inside its block's forward or backward, for blocks
            standing for more than one (``max(k - 1, 0)`` copies freed there).
        held: ``(points, liveness nodes)`` sparse 0/1: a kept output (``CheckpointBlock.
            kept``) at a point between its block's forward and backward or, for blocks
            standing for more than one, inside them (``k`` copies held there).
        fixed: the policy every block recomputes under (``--activation-checkpointing
            full`` / ``selective``), or ``None`` when the plan decides.
    """

    def __init__(
        self,
        sg,  # noqa: ANN001 - a StrategyGraph
        fixed: str | None = None,
        policies: tuple[str, ...] = POLICIES,
    ) -> None:
        if fixed is not None and fixed not in POLICIES:
            raise ValueError(f"fixed must be one of {POLICIES} or None, got {fixed!r}")
        graph = sg.graph
        self.fixed = fixed
        live = liveness(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        last = last_uses(graph)
        users = graph.users()
        for picked, op in getitem_sources(graph).items():  # a tuple's outputs' readers
            users.setdefault(op, []).append(picked)
        stands_for = graph.depth.stands_for if graph.depth is not None else None
        fwd_start, fwd_end, bwd_start, bwd_end = {}, {}, {}, {}
        for n, info in graph.nodes.items():
            if info.kind != "op" or info.layer is None:
                continue
            t, p = info.layer, order[n]
            if info.backward:
                bwd_start.setdefault(t, p)
                bwd_end[t] = p
            else:
                fwd_start.setdefault(t, p)
                fwd_end[t] = p
        index = {n: j for j, n in enumerate(live.nodes)}
        rerun = sg.rerun_ops or {p: recomputed_ops(graph, p, sg.early_stop) for p in POLICIES}
        keeps = saved_ops(graph)

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
        for ordinal, t in enumerate(sorted(fwd_end)):
            if t not in bwd_start:
                continue
            forward = tuple(
                n
                for n, info in graph.nodes.items()
                if info.kind == "op" and info.layer == t and not info.backward and n in sg.nodes
            )
            freed = [
                n
                for n in forward
                if n in index and last.get(n, -1) >= bwd_start[t] and not read_outside(n, t)
            ]
            real = tuple(stands_for[ordinal] if stands_for is not None else (t,))
            whole = tuple(n for n in forward if n in rerun["full"])
            for policy in policies:
                saved = tuple(index[n] for n in freed if n in rerun[policy])
                ops = tuple(n for n in forward if n in rerun[policy])
                if not saved or (policy == "selective" and ops == whole and fixed != policy):
                    # frees nothing, or is the full policy under another name; asked for
                    # (--activation-checkpointing selective), it is kept
                    continue
                kept = tuple(
                    index[n]
                    for n in forward
                    if policy == "selective"
                    and n in keeps
                    and n in index
                    and last.get(n, -1) < bwd_start[t]
                )
                blocks.append(CheckpointBlock(t, real, ops, saved, policy, kept))
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
            m = sp.csr_matrix((np.ones(len(r)), (r, c)), shape=shape)
            m.data[:] = 1.0  # an activation two policies free is one entry
            return m

        self.between = matrix(rows_b, cols_b)
        self.inside = matrix(rows_i, cols_i)
        rows_h, cols_h = [], []
        for b in blocks:
            t = b.layer
            span = (at > fwd_end[t]) & (at < bwd_start[t])
            if b.copies > 1:  # the other copies' kept outputs, inside its passes too
                span |= (at >= fwd_start[t]) & (at <= bwd_end[t])
            pts = np.flatnonzero(span)
            for j in b.kept:
                rows_h.append(pts)
                cols_h.append(np.full(len(pts), j))
        self.held = matrix(rows_h, cols_h)

    def only(self, policy: str) -> Checkpointing:
        """The same decision with only ``policy``'s blocks (a copy; the liveness matrices
        are shared: another policy's blocks free a subset of the full policy's)."""
        out = copy.copy(self)
        out.__dict__.pop("_columns", None)
        out.blocks = [b for b in self.blocks if b.policy == policy]
        return out

    def of_policy(self, policy: str) -> dict[int, int]:
        """Every block recomputes under ``policy``: its key -> its copies (the other
        policy's blocks 0)."""
        return {b.key: b.copies if b.policy == policy else 0 for b in self.blocks}

    def full(self) -> dict[tuple[int, str], int]:
        """Every block recomputes its forward (up to its early stop)."""
        return self.of_policy("full")

    def counts(self, recompute: dict | None) -> dict[tuple[int, str], int]:
        """``recompute`` (block key -> count) with every block present (0 where absent);
        every block under the fixed policy when there is one."""
        if self.fixed is not None:
            return self.of_policy(self.fixed)
        given = recompute or {}
        return {b.key: int(given.get(b.key, 0)) for b in self.blocks}

    def forward_seconds(self, sg, block: CheckpointBlock, choice: dict[str, int]) -> float:  # noqa: ANN001
        """Seconds of one real copy of what ``block`` recomputes under ``choice``: its
        recomputed ops' compute and what they communicate themselves, and the reshardings
        they read (:attr:`autoshard.strategies.graph.Edge.full_uses`, or
        ``selective_uses`` under the selective policy, of every edge's real reads)."""
        graph = sg.graph
        selective = block.policy == "selective"
        total = 0.0
        for n in block.forward:
            ns = sg.nodes[n]
            k = ns.choice[choice[ns.rep]]
            total += float(ns.compute_s[k]) / graph.mult(n) + ns.strategies[k].own_s
        for e in sg.edges:
            uses = (e.selective_uses if selective else e.full_uses).get(block.layer, 0)
            if uses:
                cost = float(e.cost[e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]])
                total += cost * uses / e.uses
        total -= rerun_refund(sg, choice, block.layer, selective)
        return total + shared_seconds(sg, choice, block.layer, selective)

    def seconds(self, sg, choice: dict[str, int], recompute: dict | None) -> float:  # noqa: ANN001
        """Seconds the recomputation adds to the step: ``sum_k k * forward_seconds``."""
        counts = self.counts(recompute)
        return sum(
            counts[b.key] * self.forward_seconds(sg, b, choice)
            for b in self.blocks
            if counts[b.key]
        )

    def freed(self, sg, node_strategy: dict, recompute: dict | None) -> np.ndarray:  # noqa: ANN001
        """Bytes one device frees at each liveness point under a plan (its strategy per
        node) when the blocks ``recompute`` names recompute."""
        one_copy = activation_sizes(sg, node_strategy, sg.mesh_shape, scaled=False)
        counts = self.counts(recompute)
        k_between = np.zeros(len(one_copy))
        k_inside = np.zeros(len(one_copy))
        k_held = np.zeros(len(one_copy))
        for b in self.blocks:
            k = counts[b.key]
            idx = np.array(b.saved)
            k_between[idx] += k
            k_inside[idx] += max(k - 1, 0)
            k_held[list(b.kept)] += k
        return (
            self.between @ (one_copy * k_between)
            + self.inside @ (one_copy * k_inside)
            - self.held @ (one_copy * k_held)
        )

    def saved_bytes(self, sg, node_strategy: dict, recompute: dict | None) -> float:  # noqa: ANN001
        """Bytes one device does not keep from forward to backward because the blocks
        ``recompute`` names recompute."""
        one_copy = activation_sizes(sg, node_strategy, sg.mesh_shape, scaled=False)
        counts = self.counts(recompute)
        return sum(
            counts[b.key] * float(one_copy[list(b.saved)].sum() - one_copy[list(b.kept)].sum())
            for b in self.blocks
        )

    def counts_of_blocks(self, real: list[int], selective: list[int] = ()) -> dict:
        """The counts that recompute the real blocks ``real`` in full and ``selective``
        under the selective policy (a solution's ``recomputed_blocks`` and
        ``selective_blocks``): per block, how many of those it stands for.

        A block in ``selective`` that this decision offers only in full (its selective
        recomputation reruns what the full one reruns, so the selective block is not
        kept unless selective is asked for: :meth:`__init__`) counts as recomputing in
        full, which reruns the same ops and frees the same activations;
        :meth:`selective_as_full` names them. A real block no block here stands for (no
        checkpointing offered for it) counts nowhere."""
        moved = set(self.selective_as_full(selective))
        wanted = {"full": set(real) | moved, "selective": set(selective) - moved}
        return {b.key: len(wanted[b.policy].intersection(b.real)) for b in self.blocks}

    def selective_as_full(self, selective: list[int]) -> list[int]:
        """Of the real blocks ``selective``, those this decision recomputes only in full
        (sorted): no selective block stands for them and a full one does."""
        offered = {p: set() for p in POLICIES}
        for b in self.blocks:
            offered[b.policy].update(b.real)
        return sorted((set(selective) - offered["selective"]) & offered["full"])

    def offered_blocks(self) -> set[int]:
        """The real blocks some policy of this decision can recompute."""
        return {i for b in self.blocks for i in b.real}

    def _real(self, recompute: dict | None, policy: str) -> list[int]:
        counts = self.counts(recompute)
        out = []
        for b in self.blocks:
            if b.policy != policy:
                continue
            first = counts.get((b.layer, "full"), 0) if policy == "selective" else 0
            out.extend(b.real[first : first + counts[b.key]])
        return sorted(out)

    def recomputed_blocks(self, recompute: dict | None) -> list[int]:
        """The real block indices that recompute in full (the first ``k`` of each traced
        block's)."""
        return self._real(recompute, "full")

    def selective_blocks(self, recompute: dict | None) -> list[int]:
        """The real block indices that recompute under the selective policy (after those
        that recompute in full)."""
        return self._real(recompute, "selective")


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
    same over its ``g`` columns; ``credit_h`` the bytes of each kept output
    (``CheckpointBlock.kept``) over its ``z`` columns.
    """

    def __init__(self, sg, ck: Checkpointing) -> None:  # noqa: ANN001 - a StrategyGraph
        self.ck = ck
        live = liveness(sg.graph)
        pos = 0
        self.beta, self.w, self.z, self.gamma, self.g = [], [], [], [], []
        self.sizes: dict[str, int] = {}
        rows, cols, vals, g_rows, g_cols, g_vals = [], [], [], [], [], []
        h_rows, h_cols, h_vals = [], [], []
        for b in ck.blocks:
            self.beta.append(pos)
            self.w.append(pos + b.bits)
            pos += 2 * b.bits
            reps = list(dict.fromkeys(sg.nodes[live.nodes[j]].rep for j in b.saved))
            held = [sg.nodes[live.nodes[j]].rep for j in b.kept]
            self.sizes.update({r: len(sg.nodes[r].strategies) for r in reps + held})
            z = {}
            for r in dict.fromkeys(reps + held):
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
            for j in b.kept:
                r = sg.nodes[live.nodes[j]].rep
                for i in range(len(sg.nodes[r].strategies)):
                    h_rows.append(j)
                    h_cols.append(z[r] + i)
                    h_vals.append(node_bytes(sg, j, i))
        self.n = pos
        shape = (len(live.nodes), pos)
        self.credit = sp.csr_matrix((vals, (rows, cols)), shape=shape)
        self.credit_g = sp.csr_matrix((g_vals, (g_rows, g_cols)), shape=shape)
        self.credit_h = sp.csr_matrix((h_vals, (h_rows, h_cols)), shape=shape)

    def memory_rows(self, points) -> np.ndarray:  # noqa: ANN001 - point indices
        """The budget rows' part over these columns: bytes freed, negative (kept outputs
        held, positive), ``(len(points), n)``."""
        pts = list(points)
        between, inside = self.ck.between[pts], self.ck.inside[pts]
        rows = -((between + inside) @ self.credit) + inside @ self.credit_g
        return (rows + self.ck.held[pts] @ self.credit_h).toarray()

    def values(self, choice: dict[str, int], recompute: dict[int, int] | None) -> np.ndarray:
        """The columns' values for a plan and its counts (``w`` left 0: the ILP sets it)."""
        v = np.zeros(self.n)
        counts = self.ck.counts(recompute)
        for bi, b in enumerate(self.ck.blocks):
            k = counts[b.key]
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

    def counts(self, v: np.ndarray) -> dict[tuple[int, str], int]:
        """Blocks that recompute, per block key, from the columns' values."""
        return {
            b.key: sum(int(round(v[self.beta[bi] + d])) << d for d in range(b.bits))
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
