"""A plan laid onto a mesh with one of its dims split in two (autoshard.solver.lifting).

Independent references: the split shapes and placements worked by hand, and DTensor's
own layout of ``(Shard(d), Shard(d))`` on a split mesh against ``Shard(d)`` on the flat
one (which chunk each device holds).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.solver.lifting import split_placements, splits


def test_the_splits_of_a_shape_are_worked_by_hand():
    assert splits((8, 8), (4, 2, 8)) == [0]
    assert splits((8, 8), (8, 2, 4)) == [1]
    assert splits((4,), (2, 2)) == [0]
    assert splits((4, 4), (2, 2, 4)) == [0]
    assert splits((4, 4), (4, 2, 2)) == [1]
    assert splits((4, 4), (2, 2, 2, 2)) == []  # two dims more
    assert splits((8, 8), (4, 4, 4)) == []
    assert splits((2, 2), (2, 2)) == []


def test_a_split_dim_carries_its_placement_on_both_new_dims():
    assert split_placements((Shard(0), Replicate()), 0) == (Shard(0), Shard(0), Replicate())
    assert split_placements((Replicate(), Partial()), 1) == (Replicate(), Partial(), Partial())
    assert split_placements(None, 0) is None


def test_shard_on_both_split_dims_holds_the_chunk_the_flat_dim_holds():
    """DTensor's own split (``Shard._split_tensor``, what ``distribute_tensor`` runs per
    mesh dim, in mesh-dim order): on a 2x2 mesh ``(Shard(0), Shard(0))`` splits over dim
    0 and then each part over dim 1, so device (i, j) holds part ``j`` of part ``i``;
    that is chunk ``2 i + j`` of ``Shard(0)`` over the flat mesh of 4 (row-major ranks)."""
    t = torch.arange(8 * 3).reshape(8, 3)
    flat, _ = Shard(0)._split_tensor(t, 4)
    outer, _ = Shard(0)._split_tensor(t, 2)
    for i in range(2):
        inner, _ = Shard(0)._split_tensor(outer[i], 2)
        for j in range(2):
            assert torch.equal(inner[j], flat[2 * i + j]), (i, j)


@pytest.mark.slow  # two strategy graphs of a Llama block (8 s)
def test_a_lifted_attention_sends_what_the_source_s_sends(monkeypatch):
    """Attention strategies with the same placements differ in what they send (all-gather
    or ring context parallelism): a plan using the ring on 4x2, laid onto 2x2x2, keeps
    the ring (it took the first strategy with those placements, the all-gather, before:
    a review found it)."""
    from dataclasses import replace
    from pathlib import Path

    from autoshard.cost.mesh import MeshSpec
    from autoshard.solver.lifting import lift_choice
    from autoshard.solver.solve import SolveConfig, strategies, trace

    monkeypatch.setenv("AUTOSHARD_LAYERS", "1")
    model = Path(__file__).resolve().parents[1] / "examples" / "llama.py"
    cfg = SolveConfig(model_path=model, mesh=MeshSpec.from_options("4x2"), context_parallel=True)
    graph = trace(cfg)
    src = strategies(cfg, graph)
    tgt = strategies(replace(cfg, mesh=MeshSpec.from_options("2x2x2")), graph)
    choice, ring = {}, []
    for name in src.reps:
        strategies_ = src.nodes[name].strategies
        rings = [
            j for j, s in enumerate(strategies_) if {c[0] for c in s.collectives} == {"send_recv"}
        ]
        choice[name] = rings[0] if rings else 0
        if rings:
            ring.append(name)
    assert ring, "the Llama block has no ring attention strategy on 4x2"
    lifted = lift_choice(src, choice, tgt, 0)
    assert lifted is not None
    for name in ring:
        kinds = {c[0] for c in tgt.nodes[name].strategies[lifted[name]].collectives}
        assert kinds == {"send_recv"}, (name, kinds)
