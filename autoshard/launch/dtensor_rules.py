"""DTensor sharding rules for ops torch 2.13's DTensor has none for, for the paths that let
DTensor place activations (stage plans, ``--mode propagate``): the fused CPU attention and
HuggingFace's experts matmul (:func:`register_transformers_grouped_mm_rules`).

``F.scaled_dot_product_attention`` on CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward); torch 2.13's DTensor has rules for the CUDA flash and efficient kernels but
none for these, so a model with SDPA on DTensors raised "does not have a sharding strategy
registered" (eager) or, in a stage's exported graph, fell to DTensor's decomposition-based
propagation.

:func:`register_launch_rules` gives them the strategies DTensor gives the CUDA
flash kernel (``torch/distributed/tensor/_ops/_matrix_ops.py``), per mesh dim: everything
replicated; everything sharded by batch (``Shard(0)``); everything sharded by heads
(``Shard(1)``). Attention is independent per batch row and per head, so each needs no
communication. Heads are offered only where each rank's query heads read its own key/value
heads: the key/value heads equal the query heads, or both counts divide by the mesh's size
(grouped-query attention, query head ``i`` reading key/value head ``i // (Hq / Hkv)``). A mask
stays replicated, and a dim is offered only where the mask broadcasts (size 1, or a mask of
fewer dims) or there is none: the masks these paths meet are plain tensors made on every
rank (HuggingFace's causal mask inside a stage), which DTensor's implicit replication passes
to the kernel whole, never resharded, so a batch-sized mask beside a batch-sharded query
would not line up.

A DTensor's strides are the global tensor's, worked out by the ops' meta kernels, and a
reshape decides on them to view rather than copy. The fused CPU attention lays its output out
as its query is laid out, so after a redistribution made the query's shard contiguous where
the global query is a transposed projection, the output's shard is laid out unlike the global
output, and HuggingFace's ``attn_output.transpose(1, 2).reshape(B, S, -1)`` failed on it with
"view size is not compatible with input tensor's size and stride" (Llama, on 2 devices).
:func:`view_with_contiguous_local` copies such a shard first (:func:`in_global_layout`); the
stage graphs' views and reshapes run through it.

The plan's own interpreter (:mod:`autoshard.launch.graph_run`) uses none of these: it runs the
fused ops shard by shard as the solution places them, and reshapes the shards it holds.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoshard._torch_private import is_mask_partial, key_sharding_cache_on, register_launch_rule
from autoshard.trace.attention import FLASH_BACKWARD, FLASH_FORWARD


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


def _attention_rule(
    query_at: int, outputs: int, *args: Any, attn_mask: Any = None, **_: Any
) -> list[tuple[list[Any], list[Any]]]:
    """(outputs' placements, tensor inputs' placements) per strategy, for one mesh dim, of
    the forward (``query_at=0``, 2 outputs: output, logsumexp; tensors query, key, value)
    or the backward (``query_at=1``, 3 outputs: the gradients; tensors grad_out, query,
    key, value, out, logsumexp); ``attn_mask``, when given, comes last."""
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


def register_launch_rules() -> None:
    """Give DTensor the rules of this module (once per process; later calls do nothing):
    the fused CPU attention's, and the HF experts matmul's where transformers defines it
    (:func:`register_transformers_grouped_mm_rules`). Call after the model file is loaded
    and before the first DTensor op runs (DTensor caches its sharding decisions)."""
    register_launch_rule(FLASH_FORWARD, partial(_attention_rule, 0, 2))
    register_launch_rule(FLASH_BACKWARD, partial(_attention_rule, 1, 3))
    for op in (FLASH_FORWARD, FLASH_BACKWARD):
        key_sharding_cache_on(op, ["attn_mask"])  # the rules read the mask's shape
    register_transformers_grouped_mm_rules()


def _global_order(x: Any) -> list[int]:
    """``x``'s dims from outermost to innermost in memory, by its (global) strides."""
    return sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))


def in_global_layout(x: Any) -> Any:
    """``x`` unchanged, unless it is a DTensor whose shard is not laid out densely in the
    global tensor's dim order: then a copy whose shard is (same values, same placements).

    DTensor's view rule works out the shard's view from shapes and then views the shard,
    which fails when the shard is laid out otherwise (module docstring). The copy permutes
    the dims into the global order, makes the shard contiguous there
    (``clone(memory_format=contiguous_format)`` acts on the shard, where ``contiguous()``
    would read the global strides and do nothing), and permutes back."""
    if not isinstance(x, DTensor):
        return x
    order = _global_order(x)
    if x.to_local().permute(order).is_contiguous():
        return x
    back = sorted(range(len(order)), key=order.__getitem__)
    return x.permute(order).clone(memory_format=torch.contiguous_format).permute(back)


def view_with_contiguous_local(op: Any) -> Any:
    """``op`` (a view or reshape taking the tensor first) on :func:`in_global_layout` of
    its tensor."""

    def run(x: Any, *args: Any, **kwargs: Any) -> Any:
        return op(in_global_layout(x), *args, **kwargs)

    return run


def embedding_reduced_once(op: Any) -> Any:
    """``op`` (``aten.embedding``) whose vocabulary-sharded output is reduced at once.

    A vocabulary-sharded embedding gives a pending sum that holds its rows' mask until its
    first reduction (:func:`autoshard._torch_private.is_mask_partial`). DTensor reduces it
    in each consumer, so an embedding read twice (a decoder's residual stream: the first
    block's norm and its residual add) failed with ``AssertionError`` in the second. Its
    output is reduced to ``Replicate`` on those mesh dims right away (one all-reduce where
    DTensor would run one per consumer); a plain tensor or another placement passes
    unchanged. Differentiable (``DTensor.redistribute``)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = op(*args, **kwargs)
        if not isinstance(out, DTensor) or not any(map(is_mask_partial, out.placements)):
            return out
        placements = [Replicate() if is_mask_partial(p) else p for p in out.placements]
        return out.redistribute(out.device_mesh, placements)

    return run


def _grouped_mm_rule(input: Any, weight: Any, offs: Any) -> list[tuple[list[Any], list[Any]]]:
    """``transformers::grouped_mm_fallback(input [T, K], weight [E, K, N], offs [E]) ->
    [T, N]``: rows ``offs[e-1]:offs[e]`` of ``input`` times ``weight[e]``. Per mesh dim:
    replicated; column-parallel (``N`` sharded: output ``Shard(1)``); row-parallel (``K``
    sharded in both: output ``Partial``). Each group's product is a matmul, split as
    Megatron splits one; tokens and experts stay whole (``offs`` counts rows globally)."""
    return [
        ([Replicate()], [Replicate(), Replicate(), Replicate()]),
        ([Shard(1)], [Replicate(), Shard(2), Replicate()]),
        ([Partial()], [Shard(1), Shard(1), Replicate()]),
    ]


def _grouped_mm_backward_rule(
    input: Any, weight: Any, offs: Any, grad_output: Any
) -> list[tuple[list[Any], list[Any]]]:
    """``transformers::grouped_mm_fallback_backward(input, weight, offs, grad_output) ->
    (grad_input [T, K], grad_weight [E, K, N])``: the three strategies of
    :func:`_grouped_mm_rule`, their gradients placed as a matmul's."""
    return [
        ([Replicate(), Replicate()], [Replicate()] * 4),
        ([Partial(), Shard(2)], [Replicate(), Shard(2), Replicate(), Shard(1)]),
        ([Shard(1), Shard(1)], [Shard(1), Shard(1), Replicate(), Replicate()]),
    ]


def register_transformers_grouped_mm_rules() -> bool:
    """Register :func:`_grouped_mm_rule` and its backward for HuggingFace's experts
    (``transformers.integrations.moe`` defines the ops; DTensor has no rule for them),
    where transformers has been imported (a model file that builds an HF model) and
    defines them. Returns whether they are registered. The planner does not use them
    (:func:`autoshard._torch_private.register_launch_rule`): it prices an unfused experts
    matmul as a replicated fallback, as the launch's plan runs it."""
    # transformers releases before its integrations.moe module lack the ops
    if "transformers" not in sys.modules or not importlib.util.find_spec(
        "transformers.integrations.moe"
    ):
        return False
    importlib.import_module("transformers.integrations.moe")
    ops = torch.ops.transformers
    if not (hasattr(ops, "grouped_mm_fallback") and hasattr(ops, "grouped_mm_fallback_backward")):
        return False
    register_launch_rule(ops.grouped_mm_fallback.default, _grouped_mm_rule)
    register_launch_rule(ops.grouped_mm_fallback_backward.default, _grouped_mm_backward_rule)
    return True
