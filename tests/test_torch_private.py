"""The one module with PyTorch's private DTensor APIs, tested directly (torch 2.13)."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard import _torch_private as tp

aten = torch.ops.aten


def _tm(*shape):
    return tp.tensor_meta(torch.empty(shape, device="meta"))


def test_fake_mesh_any_size_in_one_process():
    with tp.fake_mesh((2, 4)) as mesh:
        assert tuple(mesh.shape) == (2, 4)
    with tp.fake_mesh((8, 8)) as mesh:  # a second, larger mesh after the first
        assert mesh.size() == 64


def test_rules_exist_for_core_ops_and_not_for_factories():
    for op in (
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.view.default,
        aten._softmax.default,
        aten.native_layer_norm.default,
        aten.embedding.default,
    ):
        assert tp.has_rule(op), op
    assert not tp.has_rule(aten.arange.start)


def test_mm_strategies_on_a_2x4_mesh():
    """mm (64x32 @ 32x16): every combination of the 1-D rule on each mesh dim.

    Per mesh dim the plain 1-D strategies of mm are R,R->R; S(0),R->S(0); R,S(1)->S(1);
    S(1),S(0)->P; P,R->P; R,P->P (6, Partial(sum) only), so 6 * 6 = 36 on 2 mesh dims.
    """
    with tp.fake_mesh((2, 4)) as mesh:
        rs = tp.rule_strategies(
            aten.mm.default, (_tm(64, 32), _tm(32, 16)), {}, mesh, {}, _tm(64, 16)
        )
    assert len(rs) == 36
    combos = {(s.inputs, s.outputs[0]) for s in rs}
    r, p = Replicate(), Partial()
    assert (((Shard(0), r), (r, Shard(1))), (Shard(0), Shard(1))) in combos
    assert (((r, Shard(1)), (r, Shard(0))), (r, p)) in combos
    assert all(len(s.inputs) == 2 for s in rs)


def test_view_follows_its_input_candidates():
    """Rules of view ops enumerate one strategy per input candidate (no placeholders)."""
    with tp.fake_mesh((4,)) as mesh:
        cands = {0: [(Replicate(),), (Shard(0),), (Shard(2),)]}
        rs = tp.rule_strategies(
            aten.view.default, (_tm(8, 16, 32), [128, 32]), {}, mesh, cands, _tm(128, 32)
        )
    ins = [s.inputs[0] for s in rs]
    assert (Replicate(),) in ins and (Shard(0),) in ins
    # S(2) of (8, 16, 32) is S(1) of (128, 32)
    assert any(s.inputs[0] == (Shard(2),) and s.outputs[0] == (Shard(1),) for s in rs)


def test_single_dim_detection():
    assert tp.is_single_dim(aten.mm.default)
    assert not tp.is_single_dim(aten.view.default)


@pytest.mark.slow
def test_rules_run_unpriced_enumerate_what_the_priced_rules_do(tmp_path, monkeypatch):
    """DTensor's rules run with torch's own pricing skipped (``_unpriced``): a 2-layer
    Llama's training graph on 2x2 gets the same strategies, costs and edges as with the
    rules run as torch runs them, pricing every input (counted here: it ran)."""
    import numpy as np
    from helpers import LLAMA_SMALL, write_model

    from autoshard.cost.mesh import MeshSpec
    from autoshard.solver.solve import SolveConfig, strategies, trace

    cfg = SolveConfig(
        model_path=write_model(tmp_path, LLAMA_SMALL, "llama"), mesh=MeshSpec.from_options("2x2")
    )
    graph = trace(cfg)
    priced_calls = []
    torch_cost = tp._ops_utils.redistribute_cost

    def counted(src, dst):
        priced_calls.append(1)
        return torch_cost(src, dst)

    monkeypatch.setattr(tp._ops_utils, "redistribute_cost", counted)
    fast = strategies(cfg, graph)
    assert not priced_calls
    monkeypatch.setattr(tp, "_unpriced_cost", counted)  # the swap puts torch's pricing back
    priced = strategies(cfg, graph)
    assert len(priced_calls) > 1000  # torch priced every input of every strategy
    assert list(fast.nodes) == list(priced.nodes)
    for name, a in fast.nodes.items():
        b = priced.nodes[name]
        assert a.strategies == b.strategies, name
        assert np.array_equal(a.compute_s, b.compute_s) and a.rep == b.rep, name
    assert len(fast.edges) == len(priced.edges)
    for a, b in zip(fast.edges, priced.edges, strict=True):
        assert (a.src, a.dst, a.src_placements, a.dst_placements) == (
            b.src,
            b.dst,
            b.src_placements,
            b.dst_placements,
        )
        assert np.array_equal(a.cost, b.cost)
