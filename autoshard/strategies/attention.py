"""The fused attention ops (:mod:`autoshard.trace.attention`): how they may be sharded,
priced and run, as one :class:`~autoshard.strategies.registry.OpRule`.

Per mesh dim, every ``[B, H, S, D]`` argument and result (and the ``[B, H, S]``
log-sum-exp) is placed alike: ``R`` (``Replicate``), ``S0`` (batch, ``Shard(0)``) or
``S1`` (heads, ``Shard(1)``). Attention is independent per batch row and per head, so
each device computes its shard with no communication (the kernel is the op itself on the
local shards), as DTensor's rule for the CUDA flash kernel places it
(``torch/distributed/tensor/_ops/_matrix_ops.py``). An attention mask follows on its dims
of full size and is ``Replicate`` where it broadcasts (size 1).

With context parallelism (the search's ``context_parallel`` feature, ``--context-parallel``)
a fourth choice, ``S2``, splits the sequence on one mesh dim, for attention with no mask:
each device keeps its block of queries, all-gathers the dim's keys and values (in the
backward again, and reduce-scatters their gradients), and attends its queries to them under
the causal mask offset by its block, as torchtitan's all-gather context parallelism does.
Under grouped-query attention the keys and values are already repeated to the query heads
here (:mod:`autoshard.trace.attention`), so the exchange moves the repeated heads.

Priced by the roofline of the local shard (with the keys and values whole in the sequence
under ``S2``), at a calibrated attention rate where the kernel is the one ``autoshard
calibrate`` times (causal, no mask, no sequence split).

For ``--mode propagate``, where DTensor places activations itself (stage plans), DTensor
gets the same three choices per mesh dim (:func:`dtensor_rule`), with two limits the
planner's graph does not need: heads are offered only where each rank's query heads read
its own key/value heads (the key/value heads equal the query heads, or both counts divide
by the mesh's size: grouped-query attention, query head ``i`` reading key/value head
``i // (Hq / Hkv)``); and a mask stays replicated, a dim offered only where the mask
broadcasts (size 1, or a mask of fewer dims) or there is none. The masks these paths meet
are plain tensors made on every rank (HuggingFace's causal mask inside a stage), which
DTensor's implicit replication passes to the kernel whole, so a batch-sized mask beside a
batch-sharded query would not line up.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from autoshard.errors import AutoshardError
from autoshard.strategies.registry import (
    DimChoice,
    KernelContext,
    register_op_rule,
    roofline,
)
from autoshard.strategies.strategy import Strategy
from autoshard.trace.attention import FLASH_BACKWARD, FLASH_OPS
from autoshard.trace.tracer import TensorInfo

_R = Replicate()
_S2 = Shard(2)


def _follow(t: TensorInfo | None, p: Any, ndims: tuple[int, ...]) -> Any:
    """Where ``t`` sits on a mesh dim the op places ``p``: ``[B, H, S(, D)]`` tensors
    follow ``p``; a mask broadcasts from the right, so only a 4-D one does, and its dims of
    size 1 stay whole."""
    if t is None:
        return None
    if len(t.shape) in ndims:
        return p if not isinstance(p, Shard) or t.shape[p.dim] > 1 else _R
    return _R


def _cost(node: Any, info: Any, s: Any, mesh_shape: Any, compute_time: Any) -> float:
    """The local shard's roofline; the causal, unmasked kernel at the calibrated attention
    rate, which is per batch x head (calibrate times causal attention on several (batch,
    heads, seq); its efficiency follows seq, not the batch). A bidirectional or masked
    attention does twice the causal kernel's work for the same count, so it is priced as a
    matmul of its FLOPs; so is a sequence split, whose kernel runs masked (its block of
    queries against every key, the causal mask explicit)."""
    blocks = _blocks(node, info, s, mesh_shape, compute_time)
    if blocks is not None:
        return sum(blocks)
    whole = _gathered(node.target, s)
    if whole is not s or not _causal_unmasked(node):
        return roofline(node, info, whole, mesh_shape, compute_time)
    backward = node.target is FLASH_BACKWARD
    kind = "attention_backward" if backward else "attention_forward"
    q_at = 1 if backward else 0
    return roofline(
        node,
        info,
        s,
        mesh_shape,
        compute_time,
        kind,
        per=lambda args: args[q_at].shape[0] * args[q_at].shape[1],
    )


def _causal(node: Any) -> bool:
    """The node's ``is_causal``."""
    i = 7 if node.target is FLASH_BACKWARD else 4
    return bool(node.args[i] if len(node.args) > i else node.kwargs.get("is_causal", False))


def _causal_unmasked(node: Any) -> bool:
    """``is_causal`` and no ``attn_mask``: what calibrate times."""
    return _causal(node) and node.kwargs.get("attn_mask") is None


def _heads_shardable(query: Any, key: Any) -> bool:
    """Whether sharding dim 1 (heads) keeps every query head with its key/value head."""
    hq, hkv = query.shape[1], key.shape[1]
    n = query.mesh.size()
    return hq == hkv or (hq % n == 0 and hkv % n == 0)


def _mask_broadcasts(mask: Any, dim: int) -> bool:
    """Whether a mask broadcasts over the query's ``dim`` (0: batch, 1: heads): it has no
    such dim (a 2-D ``[L, S]`` or 3-D mask aligns from the right) or size 1 there."""
    k = dim - (4 - len(mask.shape))
    return k < 0 or mask.shape[k] == 1


def dtensor_rule(
    query_at: int, outputs: int, *args: Any, attn_mask: Any = None, **_: Any
) -> list[tuple[list[Any], list[Any]]]:
    """DTensor's form of the rule (module docstring): (outputs' placements, tensor inputs'
    placements) per strategy, for one mesh dim, of the forward (``query_at=0``, 2 outputs:
    output, logsumexp; tensors query, key, value) or the backward (``query_at=1``, 3
    outputs: the gradients; tensors grad_out, query, key, value, out, logsumexp);
    ``attn_mask``, when given, comes last. ``args`` are DTensor's specs."""
    tensors = sum(hasattr(a, "placements") for a in args)  # DTensorSpecs; floats are not
    query, key = args[query_at], args[query_at + 1]
    dims = [0] + ([1] if _heads_shardable(query, key) else [])
    if attn_mask is not None:
        dims = [d for d in dims if _mask_broadcasts(attn_mask, d)]
    mask = [Replicate()] if attn_mask is not None else []
    out = [([Replicate()] * outputs, [Replicate()] * tensors + mask)]
    for dim in dims:
        out.append(([Shard(dim)] * outputs, [Shard(dim)] * tensors + mask))
    return out


def _dtensor_rule(op: Any) -> Any:
    query_at, outputs = (1, 3) if op is FLASH_BACKWARD else (0, 2)

    def rule(*args: Any, **kwargs: Any) -> Any:
        return dtensor_rule(query_at, outputs, *args, **kwargs)

    return rule


RING = "S2r"
"""The choice of ring context parallelism (the sequence split, the keys and values passed
around the dim's ring block by block); ``"S2"`` gathers them whole."""

ZIGZAG = "S2z"
"""The ring with the causal load balanced (the zig-zag or head-tail split of Llama 3's and
torchtitan's context parallelism, Brandon et al.'s striped attention in its chunked form):
the sequence cut in ``2n`` chunks, device ``j`` of the dim holding chunks ``j`` and
``2n - 1 - j``, so that under a causal mask every device computes the same share of every
block. The op receives and returns the plain split (device ``j`` holding chunks ``2j`` and
``2j + 1``), so the kernel moves its operands' half-blocks into the zig-zag layout first
and its results back after (one send/recv batch each)."""

_SEQUENCE = ("S2", RING, ZIGZAG)


def _seq_dims(modes: Sequence[str]) -> list[int]:
    return [d for d, m in enumerate(modes) if m in _SEQUENCE]


def _one_sequence_dim(node: Any, args: list, modes: Sequence[str], mesh_shape: Any) -> bool:
    """At most one mesh dim shards the sequence, and one of more than one device; the
    zig-zag split only under a causal mask (it balances nothing else) and a sequence of
    ``2n`` equal chunks."""
    seq = _seq_dims(modes)
    if len(seq) > 1 or any(mesh_shape[d] <= 1 for d in seq):
        return False
    if seq and modes[seq[0]] == ZIGZAG:
        q = args[1 if node.target is FLASH_BACKWARD else 0]
        return _causal(node) and q.shape[2] % (2 * mesh_shape[seq[0]]) == 0
    return True


def _gathered(target: Any, s: Strategy) -> Strategy:
    """``s`` with the keys and values (and in the backward their gradients, before the
    reduce-scatter) whole in the sequence on its ``S2`` dim: what the kernel computes
    with (a device attends its queries to every key)."""
    q_at = 1 if target is FLASH_BACKWARD else 0
    seq = [d for d, p in enumerate(s.inputs[q_at]) if p == _S2]
    if not seq:
        return s

    def whole(ps: Any) -> Any:
        return tuple(_R if d in seq else p for d, p in enumerate(ps))

    ins = tuple(whole(p) if i in (q_at + 1, q_at + 2) else p for i, p in enumerate(s.inputs))
    outs = s.outputs
    if target is FLASH_BACKWARD:  # grad_query stays a shard; grad_key, grad_value whole
        outs = (outs[0], whole(outs[1]), whole(outs[2]))
    return Strategy(outs, ins, s.collectives, s.own_s)


def _local_bytes(t: TensorInfo, modes: Sequence[str], mesh_shape: Any) -> float:
    """Bytes of ``t`` (``[B, H, S(, D)]``, ``S`` whole) split by the batch and head choices
    of ``modes`` (as :func:`_follow` splits it)."""
    local = list(t.shape)
    for m, n in zip(modes, mesh_shape, strict=True):
        if m in ("S0", "S1") and t.shape[int(m[1])] > 1:
            local[int(m[1])] //= n
    return float(math.prod(local) * t.itemsize)


def _exchanges(node: Any, args: list, modes: Sequence[str], mesh_shape: Any) -> tuple:
    """Context parallelism's key/value exchange on its sequence dim: ``(kind, mesh dim,
    bytes of the whole group)``, each tensor the local ``[B_l, H_l, S, D]`` (``B_l``,
    ``H_l``: split by the other dims).

    ``S2`` (all-gather): the forward all-gathers the keys and the values; the backward
    gathers them again (the forward saved its shards) and reduce-scatters their gradients.
    ``S2r`` (ring, on ``n`` devices): the forward passes the key/value block to the next
    device ``n - 1`` times (one send/recv of both); the backward passes it ``n - 1`` times
    again and the block's key/value gradients, which travel with it collecting each
    device's part, ``n`` times (the last pass brings them home), in that order. ``S2z``
    (zig-zag ring): the ring's passes between one send/recv that moves the operands into
    the zig-zag layout (forward: query, key, value; backward: those, the output's
    gradient, the output and the log-sum-exp) and one that moves the results back
    (forward: output and log-sum-exp; backward: the three gradients), each priced as the
    halves of its local block the busiest device sends (both from ``n = 3`` on, one at
    ``n = 2``)."""
    seq = _seq_dims(modes)
    if not seq:
        return ()
    (d,) = seq
    backward = node.target is FLASH_BACKWARD
    q_at = 1 if backward else 0
    kv = [_local_bytes(t, modes, mesh_shape) for t in (args[q_at + 1], args[q_at + 2])]
    if modes[d] == "S2":
        gathers = tuple(("all_gather", d, b) for b in kv)
        if backward:
            return gathers + tuple(("reduce_scatter", d, b) for b in kv)
        return gathers
    n = mesh_shape[d]
    passes = (("send_recv", d, sum(kv)),) * (n - 1 + (n if backward else 0))
    if modes[d] == RING:
        return passes
    q = args[q_at]
    if backward:  # in: grad_out, query, key, value, out, logsumexp; out: three gradients
        into, back = args, args[1:4]
    else:
        lse = TensorInfo(q.shape[:3], torch.promote_types(q.dtype, torch.float32))
        into, back = args, (q, lse)
    leaving = max(  # halves the busiest device sends (2 from n = 3 on; 1 at n = 2)
        sum(c not in _zigzag(r, n) for c in _plain(r, n)) for r in range(n)
    )
    share = leaving / 2
    moved = [share * sum(_local_bytes(t, modes, mesh_shape) for t in ts) for ts in (into, back)]
    return (("send_recv", d, moved[0]),) + passes + (("send_recv", d, moved[1]),)


def _layout(node: Any, s: Strategy, mesh_shape: Any) -> str | None:
    """``RING`` or ``ZIGZAG`` for a strategy that passes blocks around a ring (told apart
    by their count of send/recvs, :func:`_exchanges`), else ``None``."""
    passes = sum(kind == "send_recv" for kind, _, _ in s.collectives)
    if not passes:
        return None
    n, _ = _sequence_dim(node, s, mesh_shape)
    ring = 2 * n - 1 if node.target is FLASH_BACKWARD else n - 1
    return RING if passes == ring else ZIGZAG


def _sequence_dim(node: Any, s: Strategy, mesh_shape: Any) -> tuple[int, int]:
    """``(devices, mesh dim)`` of the strategy's sequence split."""
    q_at = 1 if node.target is FLASH_BACKWARD else 0
    (d,) = [d for d, p in enumerate(s.inputs[q_at]) if p == _S2]
    return mesh_shape[d], d


def _blocks(node: Any, info: Any, s: Strategy, mesh_shape: Any, compute_time: Any):
    """The seconds of each step of a ring strategy on the device that computes most (the
    gathered kernel's roofline over ``n``: a device's queries against one device's keys,
    ``c``, per step), or ``None`` for no ring. The plain ring under a causal mask skips
    the blocks of later devices, so its last device computes most: its own block (half
    of it masked), then ``n - 1`` whole ones. The zig-zag split gives every device half a
    block every step (of its two query chunks against the two key chunks it holds, two
    pairs are in the past, or the diagonal's two halves and one whole pair)."""
    layout = _layout(node, s, mesh_shape)
    if layout is None:
        return None
    n, _ = _sequence_dim(node, s, mesh_shape)
    c = roofline(node, info, _gathered(node.target, s), mesh_shape, compute_time) / n
    if layout == ZIGZAG:
        return [c / 2] * n
    return [c / 2 if _causal(node) else c] + [c] * (n - 1)


def _causal_mask(q: torch.Tensor, keys: int, rank: int) -> torch.Tensor:
    """The additive causal mask ``[S_l, S]`` of the ``rank``-th block of ``S_l`` queries
    against all ``keys``: query ``i`` (global ``rank S_l + i``) sees keys up to itself."""
    rows = q.shape[2]
    pos_q = torch.arange(rank * rows, (rank + 1) * rows, device=q.device)[:, None]
    pos_k = torch.arange(keys, device=q.device)[None, :]
    mask = torch.zeros(rows, keys, dtype=q.dtype, device=q.device)
    return mask.masked_fill(pos_k > pos_q, float("-inf"))


def _merge(out: Any, lse: Any, o: torch.Tensor, lse_o: torch.Tensor) -> tuple:
    """Two attentions of the same queries over disjoint keys, as one (each output weighted
    by its share of the exponentials' sum: the log-sum-exp's online update, Milakov and
    Gimelshein 2018; FlashAttention's)."""
    wide = torch.promote_types(o.dtype, torch.float32)  # bf16 merged in fp32, fp64 in fp64
    o, lse_o = o.to(wide), lse_o.to(wide)
    if out is None:
        return o, lse_o
    both = torch.logaddexp(lse, lse_o)
    out = out * torch.exp(lse - both).unsqueeze(-1) + o * torch.exp(lse_o - both).unsqueeze(-1)
    return out, both


def _ring_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext, d: int) -> Any:
    """Ring attention on mesh dim ``d`` (Liu et al. 2023): the rank keeps its queries and
    passes the key/value block it holds to the next rank ``n - 1`` times, attending its
    queries to each block it holds (its own first: causal within it; under a causal mask
    the blocks of later ranks are skipped, their keys all in its queries' future). The
    forward merges the blocks' outputs by their log-sum-exps; the backward runs the fused
    backward per block with the whole output and log-sum-exp (FlashAttention's, which is
    the block's part of the gradient), and each block's key/value gradients travel with
    it, every rank adding its part, until a last pass brings them home."""
    backward = target is FLASH_BACKWARD
    q_at, causal_at = (1, 7) if backward else (0, 4)
    causal = bool(args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False))
    n, rank = ctx.size(d), ctx.rank(d)
    q, kv = args[q_at], [args[q_at + 1], args[q_at + 2]]
    scale = kwargs.get("scale")
    out = lse = grads = None
    grad_q = torch.zeros_like(q) if backward else None
    for t in range(n):
        j = (rank - t) % n  # whose block this rank holds at step t
        if not (causal and j > rank):
            if backward:
                g = target(
                    args[0], q, *kv, args[4], args[5], 0.0, causal and j == rank, scale=scale
                )
                grad_q = grad_q + g[0]
                part = [g[1], g[2]]
            else:
                o, lse_o = target(q, *kv, 0.0, causal and j == rank, scale=scale)
                out, lse = _merge(out, lse, o, lse_o)
                lse_dtype = lse_o.dtype
        elif backward:
            part = [torch.zeros_like(kv[0]), torch.zeros_like(kv[1])]
        if t < n - 1:
            kv = ctx.shift(kv, d)
        if backward:
            grads = part if grads is None else [a + b for a, b in zip(grads, part, strict=True)]
            grads = ctx.shift(grads, d)
    if backward:
        return grad_q, grads[0], grads[1]
    return out.to(q.dtype), lse.to(lse_dtype)


def _plain(rank: int, n: int) -> tuple[int, int]:
    """The two chunks (of ``2n``) a device holds under the plain sequence split."""
    return 2 * rank, 2 * rank + 1


def _zigzag(rank: int, n: int) -> tuple[int, int]:
    """The two chunks (of ``2n``) a device holds in the zig-zag layout."""
    return rank, 2 * n - 1 - rank


def _move_chunks(tensors: list, ctx: KernelContext, d: int, before: Any, after: Any) -> list:
    """``tensors`` (sequence on dim 2, two chunks of ``2n`` each, in ``before``'s layout)
    in ``after``'s, in one send/recv batch on mesh dim ``d``: each chunk another device
    holds next is sent to it, the ones this device holds next received from their
    holders (tagged by tensor and chunk; between two devices both sides list them in
    chunk order, as both layouts hold their chunks in increasing order)."""
    n, me = ctx.size(d), ctx.rank(d)
    held = {c: (r, i) for r in range(n) for i, c in enumerate(before(r, n))}
    going = {c: r for r in range(n) for c in after(r, n)}
    halves = [[h.contiguous() for h in t.chunk(2, dim=2)] for t in tensors]
    sends, recvs, got = [], [], {}
    for k, parts in enumerate(halves):
        for i, c in enumerate(before(me, n)):
            if going[c] != me:
                sends.append((parts[i], going[c], k * 2 * n + c))
        for c in after(me, n):
            if held[c][0] != me:
                got[k, c] = len(recvs)
                recvs.append((parts[0], held[c][0], k * 2 * n + c))
    received = ctx.exchange(sends, recvs, d)
    return [
        torch.cat(
            [received[got[k, c]] if (k, c) in got else halves[k][held[c][1]] for c in after(me, n)],
            dim=2,
        )
        for k in range(len(tensors))
    ]


def _zigzag_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext, d: int) -> Any:
    """The ring of :func:`_ring_kernel` in the zig-zag layout (:data:`ZIGZAG`): the
    operands moved into it, each step every pair of a query chunk and a key chunk not in
    its future attended (the diagonal's two pairs causal), the results moved back.

    Raises:
        AutoshardError: the attention is not causal (the rule offers the split only
            under a causal mask).
    """
    backward = target is FLASH_BACKWARD
    causal_at = 7 if backward else 4
    if not (args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)):
        raise AutoshardError("the zig-zag sequence split runs causal attention only")
    n, rank = ctx.size(d), ctx.rank(d)
    scale = kwargs.get("scale")
    ops = _move_chunks(list(args[:6] if backward else args[:3]), ctx, d, _plain, _zigzag)
    chunks = [[h.contiguous() for h in t.chunk(2, dim=2)] for t in ops]
    kv = ops[2:4] if backward else ops[1:3]
    mine = _zigzag(rank, n)
    acc: list = [None, None]  # per query chunk: (output, lse), or its gradient
    grads = None
    for t in range(n):
        keys = _zigzag((rank - t) % n, n)
        ks, vs = ([h.contiguous() for h in x.chunk(2, dim=2)] for x in kv)
        part = [[torch.zeros_like(h) for h in ks], [torch.zeros_like(h) for h in vs]]
        for a, qa in enumerate(mine):
            for b, kb in enumerate(keys):
                if kb > qa:
                    continue
                if backward:
                    g_o, q, _, _, o, lse = (c[a] for c in chunks)
                    g = target(g_o, q, ks[b], vs[b], o, lse, 0.0, kb == qa, scale=scale)
                    acc[a] = g[0] if acc[a] is None else acc[a] + g[0]
                    part[0][b], part[1][b] = part[0][b] + g[1], part[1][b] + g[2]
                else:
                    o, lse = target(chunks[0][a], ks[b], vs[b], 0.0, kb == qa, scale=scale)
                    acc[a] = _merge(*(acc[a] or (None, None)), o, lse)
                    lse_dtype = lse.dtype
        if t < n - 1:
            kv = ctx.shift(kv, d)
        if backward:
            step = [torch.cat(p, dim=2) for p in part]
            grads = step if grads is None else [x + y for x, y in zip(grads, step, strict=True)]
            grads = ctx.shift(grads, d)
    if backward:
        results = [torch.cat(acc, dim=2), *grads]
    else:
        out = torch.cat([o for o, _ in acc], dim=2).to(args[0].dtype)
        results = [out, torch.cat([lse for _, lse in acc], dim=2).to(lse_dtype)]
    return tuple(_move_chunks(results, ctx, d, _zigzag, _plain))


def _kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext) -> Any:
    """On each rank's shards. Batch and heads need no communication; on a sequence dim
    the rank either gathers the keys and values of the dim (``S2``), attends its queries
    to them (the causal mask offset by its block's place), and in the backward
    reduce-scatters their gradients back to the shards; or passes them around the ring
    (``S2r``, :func:`_ring_kernel`)."""
    seq = _seq_dims(ctx.modes)
    if not seq:
        return target(*args, **kwargs)
    (d,) = seq
    if ctx.modes[d] == RING:
        return _ring_kernel(target, list(args), kwargs, ctx, d)
    if ctx.modes[d] == ZIGZAG:
        return _zigzag_kernel(target, list(args), kwargs, ctx, d)
    rank = ctx.rank(d)  # the gather's order and the shard's place on the dim
    backward = target is FLASH_BACKWARD
    q_at, causal_at = (1, 7) if backward else (0, 4)
    args = list(args)
    q = args[q_at]
    for i in (q_at + 1, q_at + 2):
        args[i] = ctx.all_gather(args[i], d, 2)
    causal = args[causal_at] if len(args) > causal_at else kwargs.get("is_causal", False)
    if causal:
        if len(args) > causal_at:
            args[causal_at] = False
        else:
            kwargs = {**kwargs, "is_causal": False}
        kwargs = {**kwargs, "attn_mask": _causal_mask(q, args[q_at + 1].shape[2], rank)}
    out = target(*args, **kwargs)
    if not backward:
        return out
    grad_q, grad_k, grad_v = out
    return grad_q, ctx.reduce_scatter(grad_k, d, 2), ctx.reduce_scatter(grad_v, d, 2)


def _register(op: Any) -> None:
    @register_op_rule(
        op,
        allow=_one_sequence_dim,
        collectives=_exchanges,
        compute_cost=_cost,
        kernel=_kernel,
        dtensor_rule=_dtensor_rule(op),
        dtensor_cache_keys=("attn_mask",),
    )
    def choices(node: Any, args: list, results: list) -> list[DimChoice]:
        """``R``, ``S0`` (batch), ``S1`` (heads), and with context parallelism ``S2``
        (sequence, keys and values all-gathered), ``S2r`` (sequence, ring) and ``S2z``
        (sequence, zig-zag ring; all three not with an attention mask): the
        query/key/value-like arguments (and
        grad_out, out, logsumexp in the backward) lead; an attention mask, when given, is
        the last tensor argument."""
        n_bhs = 6 if node.target is FLASH_BACKWARD else 3
        out = []
        for name, p in (("R", _R), ("S0", Shard(0)), ("S1", Shard(1))):
            ins = tuple(_follow(a, p, (3, 4) if i < n_bhs else (4,)) for i, a in enumerate(args))
            out.append(DimChoice(name, ins, tuple(_follow(r, p, (3, 4)) for r in results)))
        if len(args) == n_bhs:
            outs = tuple(None if r is None else _S2 for r in results)
            out.append(DimChoice("S2", (_S2,) * n_bhs, outs, feature="context_parallel"))
            out.append(DimChoice(RING, (_S2,) * n_bhs, outs, feature="context_parallel_ring"))
            zigzag = DimChoice(ZIGZAG, (_S2,) * n_bhs, outs, feature="context_parallel_zigzag")
            out.append(zigzag)
        return out


for _op in sorted(FLASH_OPS, key=str):
    _register(_op)
