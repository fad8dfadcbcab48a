"""A recomputed block's parameter gathers, shared with its backward pass's.

FSDP2 wraps an activation-checkpointed block inside ``fully_shard`` (torchtitan's
``apply_ac`` then ``apply_fsdp``): the backward's pre-hook all-gathers the block's
parameters once, the recomputation runs under that hook with the gathered copy, and the
backward reads the same copy. So such a block gathers its parameters twice per step (in
the forward, and once for recomputation and backward together), not three times:
measured with torch 2.13's own ``fully_shard`` and ``torch.utils.checkpoint``
(non-reentrant), 4 blocks on 2 gloo ranks, ``CommDebugMode``: 8 all-gathers per step
with and without checkpointing.

In a traced joint graph the two reads are different nodes: the forward's matmul reads
``t_27 = t(W)`` and the backward's reads ``t_35 = t(t_27)``. :func:`shared_rerun_reads`
pairs them: a read in a repeated block's forward pass of a tensor ``y`` whose chain of
one-input ops ends at a parameter, with the first read in the same block's backward pass
of ``y`` or of a tensor whose one-input chain passes through ``y``. When a plan moves
both reads, and the chain carries the forward's wanted placement to the backward's
(:func:`takes_back`: every mesh dim ``Replicate`` as FSDP and HSDP want, or FSDP+TP's
``(Replicate, Shard(tp))`` through the chain's transposes, as torchtitan's 2-D plan
gathers over the FSDP dim only), the recomputation's gather is the backward's: its cost
leaves the recomputation's price
(:mod:`autoshard.cost.checkpointing`, :mod:`autoshard.solver.ilp`) and its collectives
leave the ``recompute`` count (:func:`autoshard.plan.plan.build_plan`); the launcher
gathers ``y`` once for both, counted in the backward, and derives the backward's tensor
from the gathered copy by replaying the chain's ops on it
(:class:`autoshard.launch.graph_run.PlanInterpreter`), which needs no communication: a
transpose moves a shard to the swapped tensor dim, a cast keeps it. A read whose
placements the chain does not carry (a view of a sharded tensor) pays as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Placement, Shard

from autoshard.placements import all_replicate, is_shard
from autoshard.trace.ops import WEIGHT_CHAIN_OPS, packet

aten = torch.ops.aten


@dataclass(frozen=True)
class RerunRead:
    """One forward read ``(producer, consumer, k)`` (``k``: the consumer's tensor argument)
    and the backward read that can share its gather; ``chain``: the backward read's
    producer back to the forward's, the ops to replay on the gathered copy (last first);
    ``dims``: per tensor dim of the backward's tensor, the forward's tensor dim it is
    through the chain (:func:`chain_dims`, ``()`` for no chain; ``None`` where the chain
    views or expands)."""

    forward: tuple[str, str, int]
    backward: tuple[str, str, int]
    chain: tuple[str, ...]
    dims: tuple[int, ...] | None = ()


def one_input_chain(graph, name: str) -> list[str]:  # noqa: ANN001 - a TracedGraph
    """``name`` and its ancestors through ops of exactly one tensor argument that only
    transpose, view or cast it (:data:`~autoshard.trace.ops.WEIGHT_CHAIN_OPS`: replayed on
    a replicated copy they need no communication and read no strides), nearest first,
    ending at the first node that is not such an op (a parameter, say)."""
    out = [name]
    info = graph.nodes.get(name)
    while (
        info is not None
        and info.kind == "op"
        and len(info.arg_nodes) == 1
        and packet(info.target) in WEIGHT_CHAIN_OPS
    ):
        name = info.arg_nodes[0]
        out.append(name)
        info = graph.nodes.get(name)
    return out


# links of a chain that keep every tensor dim where it is (casts, copies), and those
# that reorder them (WEIGHT_CHAIN_OPS)
_KEEP_DIMS = frozenset({aten._to_copy, aten.clone, aten.alias, aten.contiguous})
_TRANSPOSES = frozenset({aten.t, aten.transpose, aten.permute})


def chain_dims(graph, chain: Sequence[str], fx: dict | None = None) -> tuple[int, ...] | None:  # noqa: ANN001
    """Per tensor dim of ``chain[0]``'s output, the dim of the last link's input it is:
    ``chain`` a backward read's producer back to (not including) the forward's tensor,
    nearest first, as :attr:`RerunRead.chain` holds it (``()`` for no chain). ``t`` and
    ``transpose`` swap two dims (``t`` of a 1-D tensor is itself), ``permute`` reorders
    them, casts and copies keep them (ATen's native_functions.yaml); ``None`` when a link
    views, reshapes or expands (a shard of such a tensor does not move to one dim of the
    other by itself). ``fx``: the graph's fx nodes by name, when the caller has them."""
    if not chain:
        return ()
    if fx is None:
        fx = {n.name: n for n in graph.graph_module.graph.nodes}
    rank = len(graph.nodes[chain[-1]].args[0].shape)
    dims = list(range(rank))
    for name in reversed(chain):  # from the forward's tensor towards the backward's
        target = packet(graph.nodes[name].target)
        if target in _KEEP_DIMS:
            continue
        if target not in _TRANSPOSES:
            return None
        args = fx[name].args
        if target is aten.permute:
            order = [d % rank for d in args[1]]
        elif target is aten.t and rank < 2:
            continue
        else:
            order = list(range(rank))
            a, b = (0, 1) if target is aten.t else (args[1] % rank, args[2] % rank)
            order[a], order[b] = order[b], order[a]
        dims = [dims[d] for d in order]
    return tuple(dims)


def carried(placements: Sequence[Placement], dims: tuple[int, ...] | None) -> tuple | None:
    """``placements`` of a pair's forward tensor as its backward tensor has them through
    the chain (``dims``: :func:`chain_dims`): a ``Shard(d)`` goes to the dim that is
    ``d``, ``Replicate`` and ``Partial`` stay; ``None`` when a shard cannot be carried
    (the chain views the tensor, or the shard is a strided one)."""
    if not any(is_shard(p) for p in placements) or dims == ():
        return tuple(placements)
    if dims is None or any(is_shard(p) and type(p) is not Shard for p in placements):
        return None
    return tuple(Shard(dims.index(p.dim)) if is_shard(p) else p for p in placements)


def _param_reads(graph, names: Iterable[str]) -> list[tuple[str, str, int, list[str]]]:  # noqa: ANN001
    """The reads by ops ``names`` of a tensor whose one-input chain ends at a parameter,
    each read once by its op: (producer, consumer, k, chain). An op of one tensor argument
    is a link of such a chain, not a reader of it."""
    out = []
    for c in names:
        info = graph.nodes[c]
        if len(info.arg_nodes) == 1:
            continue
        for k, a in enumerate(info.arg_nodes):
            if info.arg_nodes.count(a) != 1:
                continue
            chain = one_input_chain(graph, a)
            root = graph.nodes.get(chain[-1])
            if root is not None and root.kind == "param":
                out.append((a, c, k, chain))
    return out


def shared_rerun_reads(graph) -> dict[tuple[str, str, int], RerunRead]:  # noqa: ANN001
    """Per forward read ``(producer, consumer, k)`` of a repeated block that can share its
    recomputation's gather with the block's backward (module docstring), its pair. A
    tensor read more than once in its block's forward pass, or a backward read a second
    forward read would want too, pairs with nothing (each pays as before)."""
    forward: dict[int, list[str]] = {}
    backward: dict[int, list[str]] = {}
    for name, info in graph.nodes.items():
        if info.kind == "op" and info.layer is not None:
            (backward if info.backward else forward).setdefault(info.layer, []).append(name)
    out: dict[tuple[str, str, int], RerunRead] = {}
    fx = {n.name: n for n in graph.graph_module.graph.nodes}
    for layer, names in forward.items():
        reads = _param_reads(graph, names)
        times = Counter(y for y, _, _, _ in reads)
        taken: set[tuple[str, str, int]] = set()
        back = _param_reads(graph, backward.get(layer, ()))
        for y, c, k, _ in reads:
            if times[y] != 1:
                continue
            for x, cb, kb, chain in back:
                if y in chain and (x, cb, kb) not in taken:
                    taken.add((x, cb, kb))
                    cut = tuple(chain[: chain.index(y)])
                    dims = chain_dims(graph, cut, fx)
                    out[(y, c, k)] = RerunRead((y, c, k), (x, cb, kb), cut, dims)
                    break
    return out


def takes_back(
    produced: Sequence,
    wanted: Sequence,
    produced_back: Sequence,
    wanted_back: Sequence,
    dims: tuple[int, ...] | None,
) -> bool:
    """Whether a recomputation's read (``produced`` -> ``wanted``) takes its pair's
    gathered copy (the backward's read, ``produced_back`` -> ``wanted_back``; ``dims``:
    the pair's :attr:`RerunRead.dims`): both reads move their tensor, and the chain
    carries the forward's wanted placement to the backward's (:func:`carried`). Short of
    every mesh dim replicated (FSDP, HSDP), it must carry the produced placement too, so
    that the one move the launcher runs is the backward's, collective for collective
    (FSDP+TP: ``t(W)`` from ``(Shard(0), Shard(1))`` to ``(Replicate, Shard(1))`` is the
    backward's ``W`` from ``(Shard(1), Shard(0))`` to ``(Replicate, Shard(0))``). The one
    test the price (edge by edge), the plan's counts (node by node) and the ILP's columns
    apply."""
    if tuple(produced) == tuple(wanted) or tuple(produced_back) == tuple(wanted_back):
        return False
    if carried(wanted, dims) != tuple(wanted_back):
        return False
    return all_replicate(wanted) or carried(produced, dims) == tuple(produced_back)
