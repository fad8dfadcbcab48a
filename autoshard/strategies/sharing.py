"""One redistribution per tensor and target: reads of one tensor that want the same
placement share one resharding.

A tensor read by several ops of one block in one phase (a sequence-parallel norm's output
read by the query, key and value projections, or by the gate and up projections) is moved
to each wanted placement once, and every reader of that placement reads the moved copy:
what Megatron-LM's sequence parallelism does by hand (one all-gather before the attention
and one before the MLP, Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022, section 4.2.2: ``g`` is one all-gather per transformer layer
part) and what a compiled graph gets from common subexpression elimination.

The *share key* of a read is ``(producer, phase, layer of the reader)`` (:func:`share_key`):
reads with one key and one wanted placement pay one resharding. Left out, each still paid
per read: a parameter's gather and a gradient's reduction (their collectives are bucketed
and overlap, :mod:`autoshard.cost.overlap`), and a model output's sink. Reads in another
phase or another block move the tensor again (a backward pass gathers a
sequence-parallel activation again, as Megatron-LM does, instead of keeping the gathered
copy alive until then).

Edges keep pricing every read (:class:`~autoshard.strategies.graph.Edge` costs are what
DTensor's eager propagation pays, which :mod:`autoshard.solver.propagate` simulates). A
:class:`SharedResharding` says what sharing takes back: for one (produced placement,
wanted placement) of one tensor, read by ``n`` readers, the cost is paid once instead of
``n`` times. In a plan: ``seconds * [any reader reads it] - sum_i refund_i * [reader i
reads it]``; in the ILP one more column ``m >= indicator_i`` per shared resharding
(:mod:`autoshard.solver.ilp`). The launcher keeps the moved copy for the other readers of
the same key (:class:`autoshard.launch.graph_run.PlanInterpreter`), so the collectives
that run are the ones priced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

# an indicator that a read moves the tensor from one produced placement to one wanted:
# ("y", edge index, flat index into the edge's cost matrix) for an edge between two
# variables, ("x", representative, strategy indices) for a read whose producer and reader
# follow one variable (tied layers: the residual add of layer i reads layer i-1's)
Indicator = tuple


@dataclass
class SharePart:
    """What one tensor's shared resharding costs and takes back.

    ``seconds``: the resharding paid once (s, times the reader's multiplicity);
    ``refunds``: per indicator (in :attr:`SharedResharding.indicators` order), the seconds
    the edges charge for its reads; ``layer``/``forward``: the readers' block and phase (a
    recomputed block's forward reads again, :mod:`autoshard.cost.checkpointing`);
    ``mult``: how many real copies of the reads ``seconds`` counts; ``full`` and
    ``selective``: the part of ``refunds`` charged for reads by ops that full and
    selective checkpointing recompute (:func:`autoshard.trace.selective.recomputed_ops`;
    empty when none is), what a block under that policy reads again.
    """

    seconds: float
    refunds: tuple[float, ...]
    layer: int | None
    forward: bool
    mult: int
    full: tuple[float, ...] = ()
    selective: tuple[float, ...] = ()


@dataclass
class SharedResharding:
    """One (produced, wanted) placement pair that several reads of a tensor share; tied
    layers' tensors with the same indicators add their parts."""

    indicators: tuple[Indicator, ...]
    parts: list[SharePart] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """The objective coefficient of "some reader reads it" (s)."""
        return sum(p.seconds for p in self.parts)

    def refund(self, i: int) -> float:
        """What the edges charge for indicator ``i`` in all (s)."""
        return sum(p.refunds[i] for p in self.parts)


def share_key(graph, reader: str, producer: str, kind: str) -> tuple | None:  # noqa: ANN001
    """The key under which the read of ``producer`` by op ``reader`` shares its
    resharding, or ``None`` when it pays its own: ``kind`` is the edge's bucketed kind
    (``"gradient"`` / ``"gather"``, :func:`autoshard.strategies.graph.bucketed_use`; they
    pay their own), and a reader that is not an op (an output sink) pays its own."""
    info = graph.nodes.get(reader)
    if kind or info is None or info.kind != "op":
        return None
    return (producer, info.backward, info.layer)


def active(sg, share: SharedResharding, choice: Mapping[str, int]) -> list[bool]:  # noqa: ANN001
    """Whether each indicator of ``share`` holds under ``choice``."""
    out = []
    for ind in share.indicators:
        if ind[0] == "y":
            e = sg.edges[ind[1]]
            q = e.cost.shape[1]
            a, b = e.src_groups[choice[e.src]], e.dst_groups[choice[e.dst]]
            out.append(int(a) * q + int(b) == ind[2])
        else:
            out.append(choice[ind[1]] in ind[2])
    return out


def shared_seconds(
    sg,  # noqa: ANN001 - a StrategyGraph
    choice: Mapping[str, int],
    layer: int | None = None,
    selective: bool = False,
) -> float:
    """What sharing changes in the edges' price under ``choice`` (s): each shared
    resharding some reader reads is paid once (<= 0 over the step). With ``layer``, one
    real copy of that block's forward reads only (a recomputed block's rerun, whose price
    counts the reads of its edges, not those folded into a variable's own cost: only the
    edges' reads are given back there, :func:`rerun_refunded`), and only the parts some op
    the policy recomputes reads (full checkpointing, or selective with ``selective``:
    their resharding runs again once; it errs high when the share is on through a read
    the rerun does not make)."""
    total = 0.0
    for share in sg.shares:
        on = active(sg, share, choice)
        if not any(on):
            continue
        for p in share.parts:
            if layer is not None and (p.layer != layer or not p.forward):
                continue
            again = p.selective if selective else p.full
            if layer is not None and not again:
                continue
            div = p.mult if layer is not None else 1
            refunds = again if layer is not None else p.refunds
            taken = sum(
                r
                for r, o, ind in zip(refunds, on, share.indicators, strict=True)
                if o and (layer is None or rerun_refunded(ind))
            )
            total += (p.seconds - taken) / div
    return total


def rerun_refunded(ind: Indicator) -> bool:
    """Whether a recomputed block's rerun gives back the refund of ``ind``: only an edge's
    read (a read folded into its variable's own cost has no rerun price to give back)."""
    return ind[0] == "y"


def build_shares(
    raw: list,
    where: list[int | None],
    keys: list[tuple | None],
    graph,  # noqa: ANN001 - a TracedGraph
    rerun: dict[str, frozenset[str]] | None = None,
) -> list:
    """The shared reshardings of a graph's reads.

    ``raw``: one :class:`~autoshard.strategies.graph.Edge` per tensor read (before
    merging; its cost already times the reader's multiplicity), ``graph``: the traced
    graph, ``where``: the merged edge each went into (``None``: folded into its
    variable's own cost, both ends on one variable), ``keys``: each read's
    :func:`share_key`, ``rerun``: the ops selective checkpointing recomputes. Per key and
    (produced, wanted) pair read by two or more reads at a finite, nonzero price, one
    :class:`SharePart`; parts with the same indicators (the same reads of tied layers)
    share one :class:`SharedResharding`.
    """
    rerun = rerun or {}
    groups: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        if k is not None:
            groups.setdefault(k, []).append(i)
    shares: dict[tuple, SharedResharding] = {}
    for key, reads in groups.items():
        if len(reads) < 2:
            continue
        wanted: dict = {}
        for i in reads:
            for b, q in enumerate(raw[i].dst_placements):
                wanted.setdefault(q, []).append((i, b))
        n_src = len(raw[reads[0]].src_placements)
        for a in range(n_src):
            for pairs in wanted.values():
                inds: dict[Indicator, float] = {}
                again: dict[str, dict[Indicator, float]] = {"full": {}, "selective": {}}
                prices = []
                for i, b in pairs:
                    price = float(raw[i].cost[a, b])
                    if not np.isfinite(price) or price <= 0:
                        continue
                    ind = _indicator(raw[i], where[i], a, b)
                    if ind is None:
                        continue
                    inds[ind] = inds.get(ind, 0.0) + price
                    for policy, ran in again.items():
                        if raw[i].consumer in rerun.get(policy, ()):
                            ran[ind] = ran.get(ind, 0.0) + price
                    prices.append(price)
                if len(prices) < 2:
                    continue
                order = tuple(sorted(inds, key=repr))
                share = shares.setdefault(order, SharedResharding(order))
                reader = raw[reads[0]].consumer
                share.parts.append(
                    SharePart(
                        seconds=max(prices),
                        refunds=tuple(inds[i] for i in order),
                        layer=key[2],
                        forward=not key[1],
                        mult=graph.mult(reader),
                        full=_rerun_refunds(again["full"], order),
                        selective=_rerun_refunds(again["selective"], order),
                    )
                )
    return list(shares.values())


def _rerun_refunds(ran: dict, order: tuple) -> tuple[float, ...]:
    """Per indicator of ``order``, what the reads a policy reruns charge (``()``: none)."""
    return tuple(ran.get(i, 0.0) for i in order) if ran else ()


def _indicator(e, merged: int | None, a: int, b: int) -> Indicator | None:  # noqa: ANN001
    """The indicator of read ``e`` moving produced group ``a`` into wanted group ``b``:
    its merged edge's pair, or (both ends on one variable) the strategies of that
    variable that produce ``a`` and want ``b`` (``None`` when none does)."""
    if merged is not None:
        return ("y", merged, a * e.cost.shape[1] + b)
    idx = np.flatnonzero((e.src_groups == a) & (e.dst_groups == b))
    if len(idx) == 0:
        return None
    return ("x", e.src, tuple(int(i) for i in idx))
