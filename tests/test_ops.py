"""The op tables (autoshard/trace/ops.py) against torch's own op metadata."""

from __future__ import annotations

import operator

import torch

from autoshard.trace.ops import (
    ATTENTION_REGION_OPS,
    LAYOUT_OPS,
    VIEW_OPS,
    WEIGHT_CHAIN_OPS,
    is_heavy,
    is_view,
    packet,
)

aten = torch.ops.aten


def test_every_view_op_returns_an_alias_of_its_input_per_its_schema():
    """A view op's schema marks its result as aliasing an argument (``Tensor(a)``)."""
    # _unsafe_view is a view that its schema does not declare (it exists for autograd,
    # which must not see the alias; its result shares the input's storage all the same)
    for op in VIEW_OPS - {operator.getitem, aten._unsafe_view.default}:
        assert isinstance(op, torch._ops.OpOverload), op
        assert all(r.alias_info is not None for r in op._schema.returns), op
    x = torch.arange(6.0)
    assert aten._unsafe_view.default(x, [2, 3]).untyped_storage().data_ptr() == (
        x.untyped_storage().data_ptr()
    )
    assert not is_view(aten.clone.default)  # a copy: its result aliases nothing
    assert aten.clone.default._schema.returns[0].alias_info is None


def test_packet_tables_hold_packets():
    for table in (LAYOUT_OPS, ATTENTION_REGION_OPS, WEIGHT_CHAIN_OPS):
        for op in table:
            assert isinstance(op, torch._ops.OpOverloadPacket), op
    assert packet(aten.mm.default) is aten.mm
    assert packet(operator.getitem) is operator.getitem


def test_heavy_ops_are_the_matmul_convolution_and_sdpa_families():
    assert is_heavy(aten.mm.default) and is_heavy(aten.convolution.default)
    assert is_heavy(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert not is_heavy(aten.convolution_backward.default)  # as the layer clustering counts
    assert not is_heavy(aten.add.Tensor) and not is_heavy(operator.getitem)


def test_a_view_round_trip_reads_the_tensor_itself():
    """``(6, 4) -> (2, 3, 4) -> (6, 4)`` is ``x``: the second view is cut, its reader reads
    ``x``; a view to another shape, or back with other strides, stays."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.trace.tracer import cut_view_round_trips

    def step(x):
        y = x.view(2, 3, 4)
        return y.view(6, 4) * 2, y.view(3, 8) + 1, y.view(6, 4).t().contiguous().view(4, 6)

    x = torch.randn(6, 4)
    gm = make_fx(step)(x)
    want = gm(x)
    assert cut_view_round_trips(gm) == 2
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default]
    shapes = sorted(tuple(n.meta["val"].shape) for n in views)
    assert shapes == [(2, 3, 4), (3, 8), (4, 6)]
    for got, expected in zip(gm(x), want, strict=True):
        assert torch.equal(got, expected)
