"""Scaled dot-product attention as the user runs it: one fused (FlashAttention) op.

``torch.nn.functional.scaled_dot_product_attention`` (HuggingFace's default
``attn_implementation="sdpa"``) picks a kernel by device; on the meta device autoshard traces
on, it would fall back to the math path (``bmm``, softmax, ``bmm``), which keeps the
``B x H x S x S`` attention probabilities for the backward pass. On a GPU it runs
FlashAttention (Dao et al., "FlashAttention", NeurIPS'22): it keeps only the output and the
log-sum-exp per row, and its backward recomputes the probabilities block by block.

While tracing, :func:`flash_attention_traced` stands in for the functional, so the graph
holds ``aten._scaled_dot_product_flash_attention_for_cpu`` (the one fused SDPA op with a meta
kernel, a CPU kernel for the launcher, and an autograd formula whose backward is
``..._for_cpu_backward``): the same inputs, outputs and saved tensors as the CUDA flash
kernel. :data:`FLASH_OPS` names them for the FLOP count (priced with the counter's formula
for the CUDA flash kernel, :func:`flash_flops`) and for the strategies and the launcher
(:mod:`autoshard.strategies.attention`: batch- or head-sharded, computed shard by
shard with no communication; or, with context parallelism, sequence-sharded with the
keys and values gathered).

The causal mask as eager runs it: HuggingFace builds no mask when there is no padding mask
(``transformers.masking_utils._ignore_causal_mask_sdpa``: SDPA's ``is_causal=True``
instead, and likewise no mask for bidirectional attention), except under ``torch.export``,
where it builds the ``[B, 1, S, S]`` mask in full, since an exported program could be run at
other lengths (its comment cites pytorch#108108). autoshard traces one step at the given
shapes, so while tracing, masking_utils is told it is not exporting: the graph holds
``is_causal=True`` as the user's run does, not a mask computed whole on every device
(at 8 x 8192: 512 MiB of booleans, and its additive form, 2 bytes an element in bf16). A padding
mask the model is given is still traced, never read (masking_utils checks ``is_tracing``).

Attention with dropout (``dropout_p > 0``, a model traced in training mode with attention
dropout) keeps the math path. Grouped-query attention (``enable_gqa``) repeats the key and
value heads first, as the math path does; the fused GPU kernels read them without the copy,
so its memory is overstated by the repeated keys and values.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

FLASH_FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
FLASH_OPS = frozenset({FLASH_FORWARD, FLASH_BACKWARD})
"""The fused attention ops a traced graph holds (forward: ``(output [B, H, S, D],
logsumexp [B, H, S])``; backward: ``(grad_query, grad_key, grad_value)``)."""

_original = F.scaled_dot_product_attention


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as one fused op (dropout: the math path)."""
    if dropout_p != 0.0 or query.dim() != 4:
        return _original(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # the fused CPU kernel takes an additive mask in the query's dtype, as the math
        # path builds one from a boolean mask (True: attend)
        attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(
            attn_mask.logical_not(), float("-inf")
        )
    elif attn_mask is not None and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    if enable_gqa and key.size(-3) != query.size(-3):
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    out, _ = FLASH_FORWARD(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return out


def _not_exporting() -> bool:
    return False


def _one_sequence_per_row(position_ids: torch.Tensor) -> None:
    return None


@contextlib.contextmanager
def flash_attention_traced(input_names: tuple[str, ...] = ()) -> Iterator[None]:
    """While tracing: ``F.scaled_dot_product_attention`` is one fused op, and HuggingFace
    skips the causal mask where eager skips it (module docstring).

    ``input_names``: the forward's parameters the model is given. Without
    ``position_ids`` among them, the model makes its own (``0 .. S-1`` on every row), in
    which masking_utils' packed-sequence check (``find_packed_sequence_indices``) finds one
    sequence per row in eager; traced, it could not read them and would build the mask, so
    it is told so. Given ``position_ids`` (packed sequences), the check is traced as is.
    """
    masking = sys.modules.get("transformers.masking_utils")
    patches = {}
    if masking is not None:
        patches["is_torchdynamo_exporting"] = _not_exporting
        if "position_ids" not in input_names:
            patches["find_packed_sequence_indices"] = _one_sequence_per_row
    saved = {k: getattr(masking, k) for k in patches if hasattr(masking, k)}
    F.scaled_dot_product_attention = _flash
    for k in saved:
        setattr(masking, k, patches[k])
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _original
        for k, v in saved.items():
            setattr(masking, k, v)


def flash_flops(target: Any, shapes: list[tuple[int, ...]]) -> float:
    """FLOPs of a :data:`FLASH_OPS` node as ``FlopCounterMode`` counts the CUDA flash kernel
    (``torch.utils.flop_counter.sdpa_flop_count`` / ``sdpa_backward_flop_count``: the two
    matmuls ``Q K^T`` and ``P V`` forward; backward, those recomputed with the three of the
    gradients), given the tensor arguments' shapes in order (forward: query, key, value;
    backward: grad_out, query, key, value, ...).

    Raises:
        KeyError: ``target`` is not in :data:`FLASH_OPS`.
    """
    if target is FLASH_FORWARD:
        return float(sdpa_flop_count(shapes[0], shapes[1], shapes[2]))
    if target is FLASH_BACKWARD:
        return float(sdpa_backward_flop_count(shapes[0], shapes[1], shapes[2], shapes[3]))
    raise KeyError(f"{target} is not a fused attention op")
