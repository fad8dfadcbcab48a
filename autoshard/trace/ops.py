"""The op tables: which ATen ops autoshard treats specially, keyed on torch's own op objects
(``OpOverload`` for exact overloads, ``OpOverloadPacket`` for every overload of an op).

Each table says what the ops in it have in common and who reads it:

- :data:`VIEW_OPS` (overloads): the output aliases the input, so no new memory and no
  memory traffic (the roofline prices them 0 s; the activation peak skips them);
- :data:`LAYOUT_OPS` (packets): ops that only move or relabel elements, no reduction across a
  dim they keep (Megatron's tensor-parallel regions pass through them);
- :data:`ATTENTION_REGION_OPS` (packets): what a tensor-parallel region may hold besides
  pointwise and layout ops (attention's matmuls and softmax, or its fused op);
- :data:`WEIGHT_CHAIN_OPS` (packets): what may stand between a parameter and the matmul that
  reads it (a transpose, a cast, a view);
- :func:`is_heavy`: the matmul, convolution and SDPA families, which the pipeline's layer
  clustering counts.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

aten = torch.ops.aten

VIEW_OPS: frozenset[Any] = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten.permute.default,
        aten.t.default,
        aten.expand.default,
        aten.unsqueeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.slice.Tensor,
        aten.alias.default,
        aten.detach.default,
        aten.transpose.int,
        aten.select.int,
        aten.split_with_sizes.default,
        aten.split.Tensor,
        operator.getitem,
    }
)

LAYOUT_OPS: frozenset[Any] = frozenset(
    {
        aten.detach,
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten.t,
        aten.transpose,
        aten.permute,
        aten.expand,
        aten.clone,
        aten.alias,
        aten.unsqueeze,
        aten.squeeze,
        aten._to_copy,
        aten.contiguous,
        aten.slice,
        aten.select,
        aten.cat,
        aten.split,
        aten.split_with_sizes,
        aten.chunk,
        aten.unbind,
    }
)

ATTENTION_REGION_OPS: frozenset[Any] = frozenset(
    {
        aten._softmax,
        aten._safe_softmax,
        aten.softmax,
        aten._softmax_backward_data,
        aten.bmm,
        aten.baddbmm,
        aten.mm,
        aten.addmm,
        aten.matmul,
        # the fused attention of autoshard.trace.attention, forward and backward
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
    }
)

WEIGHT_CHAIN_OPS: frozenset[Any] = frozenset(
    {
        aten.view,
        aten._unsafe_view,
        aten.reshape,
        aten.t,
        aten.transpose,
        aten.permute,
        aten.expand,
        aten.clone,
        aten.alias,
        aten._to_copy,
        aten.contiguous,
        aten.unsqueeze,
        aten.squeeze,
    }
)

_HEAVY_OPS: frozenset[Any] = frozenset(
    {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.convolution}
)
_SDPA_PREFIX = "_scaled_dot_product"  # every SDPA kernel, forward and backward


def packet(target: Any) -> Any:
    """The ``OpOverloadPacket`` of an FX node's target (``aten.mm`` for ``aten.mm.default``);
    the target itself when it has none (``operator.getitem``, a placeholder's name)."""
    return getattr(target, "overloadpacket", target)


def is_view(target: Any) -> bool:
    """True for an op whose output aliases its input (:data:`VIEW_OPS`)."""
    return target in VIEW_OPS


def is_heavy(target: Any) -> bool:
    """True for the matmul, convolution and SDPA families (forward and backward of SDPA)."""
    p = packet(target)
    return p in _HEAVY_OPS or getattr(p, "__name__", "").startswith(_SDPA_PREFIX)
