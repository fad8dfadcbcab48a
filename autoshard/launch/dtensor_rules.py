"""DTensor sharding rules for ops torch 2.13's DTensor has none for, for the paths that let
DTensor place activations (stage plans, ``--mode propagate``): the fused CPU attention and
HuggingFace's experts matmul (:func:`register_transformers_grouped_mm_rules`).

``F.scaled_dot_product_attention`` on CPU runs ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward); torch 2.13's DTensor has rules for the CUDA flash and efficient kernels but
none for these, so a model with SDPA on DTensors raised "does not have a sharding strategy
registered" (eager) or, in a stage's exported graph, fell to DTensor's decomposition-based
propagation.

:func:`register_launch_rules` gives them the strategies DTensor gives the CUDA
flash kernel, per mesh dim, as the op rule of :mod:`autoshard.strategies.attention`
states them (its DTensor form, with the limits these paths need).

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
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autoshard._torch_private import is_mask_partial, key_sharding_cache_on, register_launch_rule
from autoshard.strategies.rules import op_rules


def register_launch_rules() -> None:
    """Give DTensor the rules it lacks (once per process; later calls do nothing): every op
    rule's DTensor form (:attr:`autoshard.strategies.registry.OpRule.dtensor_rule`: the
    fused CPU attention's, :mod:`autoshard.strategies.attention`), and the HF experts
    matmul's where transformers defines it (:func:`register_transformers_grouped_mm_rules`).
    Call after the model file is loaded and before the first DTensor op runs (DTensor
    caches its sharding decisions)."""
    for rule in op_rules():
        if rule.dtensor_rule is None:
            continue
        for op in sorted(rule.targets, key=str):
            register_launch_rule(op, rule.dtensor_rule)
            if rule.dtensor_cache_keys:
                key_sharding_cache_on(op, list(rule.dtensor_cache_keys))
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
