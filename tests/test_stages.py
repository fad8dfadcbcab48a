"""Tests of autoshard.pipeline.stages: layer clustering, stage assignment, pipeline degrees.

Every expected value is either worked out by hand (in the test's docstring) or found by brute
force over all contiguous splits.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from itertools import pairwise

import numpy as np
import pytest

from autoshard.errors import AutoshardError
from autoshard.pipeline import stages as stages_module
from autoshard.pipeline.stages import (
    OpCost,
    StageCost,
    StagePlan,
    assign_stages,
    cluster_layers,
    crossing_bytes,
    even_split,
    even_split_fits,
    pipeline_degrees,
    pipeline_step_time,
    stage_ranks,
    submesh_shape,
    validate_balance,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def compositions(n: int, parts: int):
    """All boundaries 0 = b0 < b1 < ... < b_parts = n."""
    for cuts in itertools.combinations(range(1, n), parts - 1):
        yield (0, *cuts, n)


def synthetic_transformer(blocks: int, vocab: int = 32000, pad: int = 44):
    """A Llama-like forward op sequence: per block RMSNorm, q/k/v/o projections with RoPE-like
    elementwise chains, two attention bmms, RMSNorm, gated MLP, two residual adds.

    Returns (ops, edges, residual bytes). Each op produces one tensor; the residual stream of
    1024 tokens x 4096 x 2 bytes is the only tensor alive after each residual add.
    """
    d, ff, s = 4096, 11008, 1024
    act = s * d * 2
    ops: list[OpCost] = []
    edges: list[tuple[int, int, int]] = []
    size: dict[int, int] = {}

    def mk(name, flops, heavy, ins, nbytes, path):
        ops.append(OpCost(name, float(flops), heavy, path))
        i = len(ops) - 1
        edges.extend((p, i, size[p]) for p in ins)
        size[i] = nbytes
        return i

    def chain(x, k, name, path, nbytes=act):
        for j in range(k):
            x = mk(f"{name}{j}", s * d, False, [x], nbytes, path)
        return x

    x = mk("embedding", 0, False, [], act, "embed")
    for b in range(blocks):
        p = f"layers.{b}"
        n1 = chain(x, 6, f"b{b}_ln1_", p + ".ln1")
        q = chain(mk(f"b{b}_q", 2 * s * d * d, True, [n1], act, p), 12, f"b{b}_qr", p)
        k = chain(mk(f"b{b}_k", 2 * s * d * d, True, [n1], act, p), 12, f"b{b}_kr", p)
        v = chain(mk(f"b{b}_v", 2 * s * d * d, True, [n1], act, p), 3, f"b{b}_vr", p)
        sc = mk(f"b{b}_scores", 2 * s * s * d, True, [q, k], 64 * s * s, p)
        sc = chain(sc, 6, f"b{b}_sm", p, 64 * s * s)
        o = chain(mk(f"b{b}_pv", 2 * s * s * d, True, [sc, v], act, p), 3, f"b{b}_ov", p)
        o = mk(f"b{b}_o", 2 * s * d * d, True, [o], act, p)
        h = mk(f"b{b}_res1", s * d, False, [x, o], act, p)
        n2 = chain(h, 6, f"b{b}_ln2_", p + ".ln2")
        g = chain(mk(f"b{b}_gate", 2 * s * d * ff, True, [n2], s * ff * 2, p), 2, f"b{b}_silu", p)
        u = mk(f"b{b}_up", 2 * s * d * ff, True, [n2], s * ff * 2, p)
        m = chain(mk(f"b{b}_mul", s * ff, False, [g, u], s * ff * 2, p), pad, f"b{b}_pad", p)
        dn = mk(f"b{b}_down", 2 * s * d * ff, True, [m], act, p)
        x = mk(f"b{b}_res2", s * d, False, [h, dn], act, p)
    x = chain(x, 6, "norm", "norm")
    logits = mk("lm_head", 2 * s * d * vocab, True, [x], s * vocab * 4, "lm_head")
    chain(logits, 5, "loss", None, s * vocab * 4)
    return ops, edges, act


def brute_force_clustering(ops, edges, num_layers, eps, min_heavy, allowed=None):
    """Best (max cut, sum of cuts, FLOPs deviation) over all splits, or None if none admissible.

    Admissibility mirrors cluster_layers: layer FLOPs <= (1 + eps) * mean (up to the same 1e-9
    relative slack), heavy ops >= min_heavy, boundaries only at allowed cuts.
    """
    n = len(ops)
    cut = crossing_bytes(n, edges)
    flops = [op.flops for op in ops]
    total = sum(flops)
    mean = total / num_layers
    cap = (1 + eps) * mean * (1 + 1e-9)
    best = None
    for bounds in compositions(n, num_layers):
        inner = bounds[1:-1]
        if allowed is not None and not set(inner) <= set(allowed):
            continue
        layers = list(pairwise(bounds))
        if any(sum(flops[a:b]) > cap for a, b in layers):
            continue
        if any(sum(op.heavy for op in ops[a:b]) < min_heavy for a, b in layers):
            continue
        dev = sum(abs(sum(flops[:c]) - k * mean) for k, c in enumerate(inner, start=1))
        key = (max((int(cut[c]) for c in inner), default=0), sum(int(cut[c]) for c in inner), dev)
        if best is None or key[:2] < best[:2] or (key[:2] == best[:2] and key[2] < best[2] - 1e-6):
            best = key
    return best


def key_of(ops, edges, layers, num_layers):
    cut = crossing_bytes(len(ops), edges)
    inner = [r.start for r in layers[1:]]
    mean = sum(op.flops for op in ops) / num_layers
    dev = sum(abs(sum(op.flops for op in ops[:c]) - k * mean) for k, c in enumerate(inner, start=1))
    return (max((int(cut[c]) for c in inner), default=0), sum(int(cut[c]) for c in inner), dev)


def additive(layer_times, layer_mem=None, overhead=0.0):
    """stage_cost for stages whose time is the sum of their layers' times plus an overhead."""

    def cost(i: int, j: int) -> StageCost:
        mem = 0.0 if layer_mem is None else float(sum(layer_mem[i:j]))
        return StageCost(time_s=sum(layer_times[i:j]) + overhead, memory_bytes=mem)

    return cost


def brute_force_stages(num_layers, num_stages, microbatches, cost, budget=None):
    """Least 1F1B step time over all splits (None if nothing fits)."""
    best = None
    for bounds in compositions(num_layers, num_stages):
        stages = [cost(a, b) for a, b in pairwise(bounds)]
        if any(math.isinf(c.time_s) for c in stages):
            continue
        if budget is not None and any(c.memory_bytes > budget for c in stages):
            continue
        step = pipeline_step_time([c.time_s for c in stages], microbatches)
        best = step if best is None else min(best, step)
    return best


# --------------------------------------------------------------------------------------------
# crossing bytes
# --------------------------------------------------------------------------------------------


def test_crossing_bytes_counts_each_tensor_once_while_it_is_live():
    """Tensors: t0 (10 B, read by ops 1 and 3), t1 (5 B, read by 2), t2 (7 B, read by 4),
    t3 (3 B, read by 4). Cut c crosses the tensors made before c and read at or after c:
    c=1: t0 = 10; c=2: t0 + t1 = 15; c=3: t0 + t2 = 17; c=4: t2 + t3 = 10; ends: 0."""
    edges = [(0, 1, 10), (0, 3, 10), (1, 2, 5), (2, 4, 7), (3, 4, 3)]
    assert crossing_bytes(5, edges).tolist() == [0, 10, 15, 17, 10, 0]


@pytest.mark.parametrize(
    ("edge", "needle"),
    [((2, 1, 4), "does not go forward"), ((0, 9, 4), "outside 0..4"), ((0, 1, -1), ">= 0")],
)
def test_crossing_bytes_rejects_bad_edges(edge, needle):
    with pytest.raises(AutoshardError, match=needle):
        crossing_bytes(5, [edge])


# --------------------------------------------------------------------------------------------
# layer clustering
# --------------------------------------------------------------------------------------------


def test_clustering_cuts_where_the_least_crosses():
    """Ops mm(h) add mm(h) add mm(h) add: 10 FLOPs per mm, 1 per add. Tensors: mm outputs
    100 B; t1 (the first add, 4 B) is read by ops 2 and 3; t3 (the second add) is 6 B.
    Crossings: cut 1 = t0 = 100, cut 2 = t1 = 4, cut 3 = t1 + t2 = 104, cut 4 = t3 = 6,
    cut 5 = t4 = 100. With eps = 1 (cap = 2 x mean, never binding here) and one heavy op per
    layer: L = 2 cuts at 2 (4 B < 6 B); L = 3 needs two cuts and only {2, 4} keeps the worst
    below 100 B."""
    ops = [OpCost(f"op{i}", 10.0 if i % 2 == 0 else 1.0, i % 2 == 0) for i in range(6)]
    edges = [(0, 1, 100), (1, 2, 4), (1, 3, 4), (2, 3, 100), (3, 4, 6), (4, 5, 100)]
    assert crossing_bytes(6, edges).tolist() == [0, 100, 4, 104, 6, 100, 0]
    layers = cluster_layers(ops, edges, num_layers=2, eps=1.0, min_heavy_ops=1)
    assert layers == [range(0, 2), range(2, 6)]
    layers = cluster_layers(ops, edges, num_layers=3, eps=1.0, min_heavy_ops=1)
    assert layers == [range(0, 2), range(2, 4), range(4, 6)]


def test_sum_of_crossings_breaks_ties_in_the_worst_cut():
    """8 ops in a chain, FLOPs [1, 2, 2, 1, 1, 2, 1, 2] (cumulative 0 1 3 5 6 7 9 10 12), all
    heavy but op 5; cut c crosses [3, 3, 3, 2, 2, 1, 1][c - 1] bytes. L = 3, eps = 1: cap 8
    FLOPs per layer. Two 1-byte cuts {6, 7} would leave 9 FLOPs in layer 0, so the worst cut
    is 2 B (cut 4 or 5) and the least sum 3 B: {4 or 5} x {6 or 7}. The FLOPs deviation from
    the ideal cuts at 4 and 8 FLOPs is |6-4| + |9-8| = 3 for {4, 6}, 4 for {4, 7} and {5, 6},
    5 for {5, 7}: the answer is {4, 6}. (A DP that keeps the least worst cut per prefix
    instead of the least sum returns {4, 5}: worst 2 B, sum 4 B.)"""
    flops = [1, 2, 2, 1, 1, 2, 1, 2]
    ops = [OpCost(f"op{i}", float(f), i != 5) for i, f in enumerate(flops)]
    edges = [(i, i + 1, nbytes) for i, nbytes in enumerate([3, 3, 3, 2, 2, 1, 1])]
    layers = cluster_layers(ops, edges, num_layers=3, eps=1.0, min_heavy_ops=1)
    assert layers == [range(0, 4), range(4, 6), range(6, 8)]


def test_identical_ops_split_evenly():
    """A chain of 6 identical ops, each passing 8 B on: every cut crosses 8 B, so bytes tie
    everywhere and the FLOPs tie-break picks the even split (cumulative FLOPs at k / L)."""
    ops = [OpCost(f"op{i}", 1.0, True) for i in range(6)]
    edges = [(i, i + 1, 8) for i in range(5)]
    assert cluster_layers(ops, edges, num_layers=2, eps=1.0) == [range(0, 3), range(3, 6)]
    assert cluster_layers(ops, edges, num_layers=3, eps=1.0) == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
    ]


def test_clustering_flops_cap_overrides_bytes():
    """Same chain with eps = 0 and L = 3: the cap is the mean, 11 FLOPs, so each layer must be
    exactly one mm and its add; the result is forced whatever the bytes."""
    ops = [OpCost(f"op{i}", 10.0 if i % 2 == 0 else 1.0, i % 2 == 0) for i in range(6)]
    edges = [(0, 1, 1), (1, 2, 500), (2, 3, 1), (3, 4, 500), (4, 5, 1)]
    assert cluster_layers(ops, edges, num_layers=3, eps=0.0, min_heavy_ops=1) == [
        range(0, 2),
        range(2, 4),
        range(4, 6),
    ]


def random_clustering_instance(seed: int):
    """A small random op graph and clustering arguments. Odd seeds draw tensor sizes from
    {1, 2, 3} so that many splits tie on the worst cut and the tie-breaks decide."""
    rng = random.Random(seed)
    n = rng.randint(4, 10)
    num_layers = rng.randint(1, min(4, n))
    ops = [
        OpCost(f"op{i}", float(rng.choice([0, 1, 2, 5, 8])), rng.random() < 0.5) for i in range(n)
    ]
    sizes = [1, 2, 3] if seed % 2 else [1, 2, 4, 16, 64]
    edges = []
    for p in range(n - 1):
        nbytes = rng.choice(sizes)
        for c in rng.sample(range(p + 1, n), k=rng.randint(0, min(3, n - p - 1))):
            edges.append((p, c, nbytes))
    eps = rng.choice([0.0, 0.25, 0.6, 1.5])
    min_heavy = rng.choice([0, 1, 2])
    allowed = sorted(rng.sample(range(1, n), k=rng.randint(0, n - 1))) if seed % 3 == 0 else None
    return ops, edges, num_layers, eps, min_heavy, allowed


CLUSTER_SEEDS = range(120)


@pytest.mark.parametrize("seed", CLUSTER_SEEDS)
def test_clustering_dp_equals_brute_force(seed):
    ops, edges, num_layers, eps, min_heavy, allowed = random_clustering_instance(seed)
    expected = brute_force_clustering(ops, edges, num_layers, eps, min_heavy, allowed)
    kwargs = dict(num_layers=num_layers, eps=eps, min_heavy_ops=min_heavy, allowed_cuts=allowed)
    if expected is None:
        with pytest.raises(AutoshardError, match="cannot cluster"):
            cluster_layers(ops, edges, **kwargs)
        return
    layers = cluster_layers(ops, edges, **kwargs)
    assert len(layers) == num_layers
    assert [i for r in layers for i in r] == list(range(len(ops)))
    got = key_of(ops, edges, layers, num_layers)
    assert got[:2] == expected[:2]
    assert got[2] == pytest.approx(expected[2], abs=1e-6)


def test_brute_force_covers_both_outcomes():
    """The random cases above include both admissible and inadmissible instances."""
    outcomes = {
        brute_force_clustering(*random_clustering_instance(seed)) is None for seed in CLUSTER_SEEDS
    }
    assert outcomes == {True, False}


def block_chain(blocks: int):
    """Blocks of [mm, mm, mm, add]: mm outputs are 100 B, the add output 4 B, 1 FLOP each op
    except mm (10 FLOPs). The only 4-byte cuts are block ends."""
    ops, edges = [], []
    for b in range(blocks):
        for j in range(4):
            ops.append(OpCost(f"b{b}_{j}", 10.0 if j < 3 else 1.0, j < 3))
    for i in range(len(ops) - 1):
        edges.append((i, i + 1, 4 if i % 4 == 3 else 100))
    return ops, edges


def test_automatic_layer_count_finds_the_blocks():
    """5 blocks of 3 heavy ops: Alpa's rule (3 heavy ops per layer) allows at most 5 layers.
    L = 2 crosses 4 B (a block end); 5 layers cut at every block end, also 4 B each, so the
    largest L whose worst cut is not above L = 2's is 5, and the layers are the blocks."""
    ops, edges = block_chain(5)
    layers = cluster_layers(ops, edges)
    assert layers == [range(4 * b, 4 * b + 4) for b in range(5)]
    # max_layers caps the search; 3 layers still cut only at block ends.
    capped = cluster_layers(ops, edges, max_layers=3)
    assert len(capped) == 3 and all(r.start % 4 == 0 for r in capped)


def test_automatic_layer_count_with_too_few_heavy_ops_gives_one_layer():
    ops = [OpCost("mm", 10.0, True), OpCost("relu", 1.0), OpCost("mm2", 10.0, True)]
    assert cluster_layers(ops, [(0, 1, 8), (1, 2, 8)]) == [range(0, 3)]


def test_synthetic_transformer_layers_are_its_blocks():
    """32 Llama-like blocks with a tiny vocabulary (the head is cheap) into 32 layers. The
    least worst cut is the residual stream (1024 x 4096 x 2 B): only it is alive after a
    residual add. Among the residual-only cuts (block ends, after attention) the FLOPs
    tie-break picks block ends: they sit at k / 32 of the FLOPs, while a cut after attention
    lies an attention half away."""
    ops, edges, act = synthetic_transformer(32, vocab=8)
    layers = cluster_layers(ops, edges, num_layers=32)
    assert [ops[r.start].name for r in layers[1:]] == [f"b{k}_ln1_0" for k in range(1, 32)]
    cut = crossing_bytes(len(ops), edges)
    assert all(cut[r.start] == act for r in layers[1:])


def test_synthetic_transformer_3400_ops_is_fast():
    """32 blocks, ~3400 ops: every boundary of the 32-layer clustering crosses only the
    residual stream (the hand answer for the worst cut), in well under a few seconds."""
    ops, edges, act = synthetic_transformer(32)
    assert 3300 <= len(ops) <= 3500
    start = time.perf_counter()
    layers = cluster_layers(ops, edges, num_layers=32)
    elapsed = time.perf_counter() - start
    cut = crossing_bytes(len(ops), edges)
    assert len(layers) == 32
    assert max(cut[r.start] for r in layers[1:]) == act
    assert elapsed < 5.0


def test_allowed_cuts_restrict_boundaries():
    """Allowing only the block starts of the synthetic transformer (and the lm_head's norm)
    gives exactly one block per layer when L equals the number of blocks + 1."""
    ops, edges, _ = synthetic_transformer(3, vocab=8)
    starts = [i for i, op in enumerate(ops) if op.name.endswith("_ln1_0") and i > 1]
    starts.append(next(i for i, op in enumerate(ops) if op.name == "norm0"))
    layers = cluster_layers(ops, edges, num_layers=4, allowed_cuts=starts, min_heavy_ops=0)
    assert [r.start for r in layers[1:]] == starts


def test_clustering_errors_say_what_to_change():
    ops, edges = block_chain(2)  # 8 ops, 6 heavy
    with pytest.raises(AutoshardError, match="use at most 8 layers"):
        cluster_layers(ops, edges, num_layers=9)
    with pytest.raises(AutoshardError, match="6 heavy .* use at most 3 layers"):
        cluster_layers(ops, edges, num_layers=4, min_heavy_ops=2)
    big = [OpCost("a", 1.0, True), OpCost("huge_mm", 100.0, True), OpCost("b", 1.0, True)]
    # mean for L = 3 is 34, cap 54.4 < 100: the op alone breaks it; eps >= 100*3/102 - 1.
    with pytest.raises(AutoshardError, match=r"huge_mm.*at most 1 layers or eps >= 1\.94"):
        cluster_layers(big, [(0, 1, 1), (1, 2, 1)], num_layers=3, min_heavy_ops=1)
    with pytest.raises(AutoshardError, match="only 1 cuts are allowed"):
        cluster_layers(ops, edges, num_layers=3, min_heavy_ops=1, allowed_cuts=[4])
    with pytest.raises(AutoshardError, match="eps=-1"):
        cluster_layers(ops, edges, num_layers=2, eps=-1)
    with pytest.raises(AutoshardError, match="empty"):
        cluster_layers([], [], num_layers=1)
    with pytest.raises(AutoshardError, match="flops=nan"):
        cluster_layers([OpCost("x", math.nan)], [], num_layers=1)


# --------------------------------------------------------------------------------------------
# stage assignment
# --------------------------------------------------------------------------------------------


def test_identical_layers_balance_evenly():
    """8 layers of 1 s plus 0.1 s send/receive per stage, 4 stages, B = 8: every split has
    sum = 8.4 s, so the step time 8.4 + 7 * max is least when max is least, 2.1 s, which only
    [2, 2, 2, 2] reaches: 8.4 + 14.7 = 23.1 s."""
    plan = assign_stages(8, 4, 8, additive([1.0] * 8, overhead=0.1))
    assert plan.balance == (2, 2, 2, 2)
    assert plan.boundaries == (0, 2, 4, 6, 8)
    assert plan.step_time_s == pytest.approx(23.1)
    assert plan.stage_times_s == pytest.approx((2.1,) * 4)


def test_heavy_layer_gets_a_stage_of_its_own():
    """Layer times [1, 1, 4, 1, 1, 1], 3 stages, B = 8. Any split has sum = 9 s and a stage
    holding layer 2 takes >= 4 s, so step >= 9 + 7 * 4 = 37 s, reached only when layer 2 is
    alone: then layers 0-1 (2 s) and 3-5 (3 s) are the other two stages, balance [2, 1, 3].
    The next best, e.g. [1, 2, 3] (1, 5, 3 s), costs 9 + 35 = 44 s."""
    plan = assign_stages(6, 3, 8, additive([1, 1, 4, 1, 1, 1]))
    assert plan.balance == (2, 1, 3)
    assert plan.step_time_s == pytest.approx(37.0)
    assert plan.bottleneck_s == pytest.approx(4.0)


def test_memory_budget_can_forbid_isolating_the_heavy_layer():
    """Same layers, 1 byte per layer, budget 2 bytes: no stage may hold 3 layers, so the only
    split is [2, 2, 2] (2, 5, 2 s): step 9 + 7 * 5 = 44 s."""
    plan = assign_stages(6, 3, 8, additive([1, 1, 4, 1, 1, 1], [1] * 6), memory_budget=2)
    assert plan.balance == (2, 2, 2)
    assert plan.step_time_s == pytest.approx(44.0)
    assert plan.stage_memory_bytes == (2.0, 2.0, 2.0)


def test_one_microbatch_minimises_the_sum():
    """B = 1: step = sum(t). With a 1 s overhead per stage and layer times [3, 1, 1, 1] on 2
    stages the sum is always 8 s; ties go to the smaller bottleneck: [1, 3] (4 s, 4 s)."""
    plan = assign_stages(4, 2, 1, additive([3, 1, 1, 1], overhead=1.0))
    assert plan.step_time_s == pytest.approx(8.0)
    assert plan.balance == (1, 3)


@pytest.mark.parametrize("first_batch", [1, 8])
def test_microbatches_trade_sum_against_bottleneck(first_batch, monkeypatch):
    """3 layers on 2 stages with non-additive stage times: split [1, 2] runs (2, 2) s (sum 4,
    bottleneck 2), split [2, 1] runs (1, 2.5) s (sum 3.5, bottleneck 2.5). B = 1: step = sum,
    [2, 1] wins with 3.5 s against 4 s. B = 8: [1, 2] takes 4 + 7 x 2 = 18 s, [2, 1] takes
    3.5 + 7 x 2.5 = 21 s: [1, 2] wins. Scanning one threshold at a time, the bound that skips
    thresholds must not skip 2.5 s for B = 1 (least sum 3.5 + 0 x 2.5 < 4)."""
    monkeypatch.setattr(stages_module, "_FIRST_BATCH", first_batch)
    monkeypatch.setattr(stages_module, "_BATCH_ELEMENTS", first_batch)
    times = {(0, 1): 2.0, (1, 3): 2.0, (0, 2): 1.0, (2, 3): 2.5}

    def cost(i, j):
        return StageCost(times[(i, j)], 0.0)

    assert assign_stages(3, 2, 1, cost).balance == (2, 1)
    assert assign_stages(3, 2, 1, cost).step_time_s == pytest.approx(3.5)
    assert assign_stages(3, 2, 8, cost).balance == (1, 2)
    assert assign_stages(3, 2, 8, cost).step_time_s == pytest.approx(18.0)


@pytest.mark.parametrize("seed", range(80))
def test_stage_dp_equals_brute_force(seed, monkeypatch):
    if seed % 2:
        # One threshold per batch, so that the pruning bound decides which are evaluated.
        monkeypatch.setattr(stages_module, "_FIRST_BATCH", 1)
        monkeypatch.setattr(stages_module, "_BATCH_ELEMENTS", 1)
    rng = random.Random(seed)
    num_layers = rng.randint(1, 8)
    num_stages = rng.randint(1, num_layers)
    b = rng.choice([1, 2, 4, 16])
    table = {
        (i, j): StageCost(
            time_s=math.inf if rng.random() < 0.05 else rng.uniform(0.1, 5.0) * (j - i) ** 0.7,
            memory_bytes=float(rng.randint(1, 10) * (j - i)),
        )
        for i in range(num_layers)
        for j in range(i + 1, num_layers + 1)
    }
    calls = []

    def cost(i, j):
        calls.append((i, j))
        return table[(i, j)]

    budget = rng.choice([None, 10.0, 25.0])
    expected = brute_force_stages(num_layers, num_stages, b, lambda i, j: table[(i, j)], budget)
    if expected is None:
        with pytest.raises(AutoshardError, match="stages"):
            assign_stages(num_layers, num_stages, b, cost, budget)
        return
    plan = assign_stages(num_layers, num_stages, b, cost, budget)
    assert plan.step_time_s == pytest.approx(expected, rel=1e-9)
    assert len(calls) == len(set(calls)) == plan.stage_cost_calls
    stages = [table[(i, j)] for i, j in pairwise(plan.boundaries)]
    assert plan.stage_times_s == tuple(c.time_s for c in stages)
    assert plan.step_time_s == pytest.approx(pipeline_step_time(plan.stage_times_s, b))
    if budget is not None:
        assert max(plan.stage_memory_bytes) <= budget


@pytest.mark.parametrize(
    ("layers", "stages", "calls"), [(6, 2, 10), (6, 6, 6), (6, 1, 1), (5, 3, 12)]
)
def test_stage_cost_is_called_once_per_possible_stage(layers, stages, calls):
    """Only stages that occur in some split are priced, each once. S = 2: (0, j) and (j, L)
    for j = 1..L-1, 2 (L - 1) = 10 pairs for L = 6; S = L: the L single layers; S = 1: (0, L).
    L = 5, S = 3: first stages (0, 1..3), last stages (2..4, 5), middle stages (i, j) with
    1 <= i < j <= 4 (6 pairs): 12."""
    seen = []

    def cost(i, j):
        seen.append((i, j))
        return StageCost(j - i, 0)

    plan = assign_stages(layers, stages, 4, cost)
    assert len(seen) == len(set(seen)) == calls == plan.stage_cost_calls


def test_stage_errors_are_clear():
    with pytest.raises(AutoshardError, match="cannot split 3 layers into 4 pipeline stages"):
        assign_stages(3, 4, 8, additive([1, 1, 1]))
    with pytest.raises(AutoshardError, match="at least 1 stage"):
        assign_stages(3, 0, 8, additive([1, 1, 1]))
    with pytest.raises(AutoshardError, match="microbatches=0"):
        assign_stages(3, 1, 0, additive([1, 1, 1]))
    # Layers of 3, 1, 1, 3 GiB on 2 stages: the best split is [2, 2] with 4 GiB per stage.
    gib = 2**30
    with pytest.raises(AutoshardError, match=r"budget of 3.00 GiB .* needs 4.00 GiB"):
        assign_stages(4, 2, 8, additive([1] * 4, [3 * gib, gib, gib, 3 * gib]), 3 * gib)
    with pytest.raises(AutoshardError, match="cannot run"):
        assign_stages(2, 2, 8, lambda i, j: StageCost(math.inf, 0))
    with pytest.raises(AutoshardError, match="return a StageCost"):
        assign_stages(2, 1, 8, lambda i, j: (1.0, 0.0))


def test_stage_plan_validates_itself():
    with pytest.raises(AutoshardError, match="rise strictly"):
        StagePlan((0, 2, 2), (2, 0), (1.0, 1.0), (0.0, 0.0), 1, 2.0)
    with pytest.raises(AutoshardError, match="does not match"):
        StagePlan((0, 2, 4), (1, 3), (1.0, 1.0), (0.0, 0.0), 1, 2.0)
    plan = StagePlan((0, 1, 4), (1, 3), (1.0, 3.0), (0.0, 0.0), 2, 7.0)
    assert plan.num_stages == 2 and plan.num_layers == 4
    assert plan.layer_ranges == [range(0, 1), range(1, 4)]


def test_validate_balance_messages():
    validate_balance([2, 2], 4)
    with pytest.raises(AutoshardError, match=r"layers: 5, sum of balance: 4"):
        validate_balance([2, 2], 5)
    with pytest.raises(AutoshardError, match="positive integers"):
        validate_balance([2, 0, 2], 4)


def test_pipeline_step_time_formula():
    """sum 1 + 3 + 2 = 6 s, plus (4 - 1) x 3 s = 15 s."""
    assert pipeline_step_time([1.0, 3.0, 2.0], 4) == pytest.approx(15.0)


# --------------------------------------------------------------------------------------------
# pipeline degrees and submeshes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mesh", "degrees"),
    [
        ((8,), [1, 2, 4, 8]),
        ((2, 4), [1, 2, 4, 8]),
        ((3, 4), [1, 3, 6, 12]),
        ((2, 2, 2), [1, 2, 4, 8]),
    ],
)
def test_pipeline_degrees(mesh, degrees):
    assert pipeline_degrees(mesh) == degrees
    # Brute force: pp is admitted iff each stage's block of contiguous ranks is a box.
    world = math.prod(mesh)
    coords = np.array(list(np.ndindex(*mesh)))
    boxes = []
    for pp in range(1, world + 1):
        if world % pp:
            continue
        size = world // pp
        ok = True
        for s in range(pp):
            block = coords[s * size : (s + 1) * size]
            extent = block.max(axis=0) - block.min(axis=0) + 1
            ok &= int(np.prod(extent)) == size
        if ok:
            boxes.append(pp)
    assert boxes == degrees


def test_submesh_shapes_and_ranks():
    assert submesh_shape((2, 4), 1) == (2, 4)
    assert submesh_shape((2, 4), 2) == (1, 4)
    assert submesh_shape((2, 4), 4) == (1, 2)
    assert submesh_shape((2, 4), 8) == (1, 1)
    assert submesh_shape((2, 2, 2), 4) == (1, 1, 2)
    assert list(stage_ranks((2, 4), 4, 1)) == [2, 3]
    assert list(stage_ranks((2, 4), 2, 1)) == [4, 5, 6, 7]


def test_pipeline_degree_that_does_not_split_the_mesh_is_an_error():
    with pytest.raises(AutoshardError, match=r"pp=2 does not split mesh 3x4.*\[1, 3, 6, 12\]"):
        submesh_shape((3, 4), 2)
    with pytest.raises(AutoshardError, match="pp=16 does not split mesh 2x4"):
        submesh_shape((2, 4), 16)
    with pytest.raises(AutoshardError, match="pp=0"):
        submesh_shape((2, 4), 0)
    with pytest.raises(AutoshardError, match="not a mesh"):
        pipeline_degrees((2, 0))
    with pytest.raises(AutoshardError, match="stage 4 does not exist"):
        stage_ranks((2, 4), 4, 4)


# --------------------------------------------------------------------------------------------
# torchtitan's even split
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "bounds"),
    [
        # L + 2 weighted layers dealt evenly, the first (L + 2) mod S stages one more; the
        # first stage gives back the embedding's 1, the last the head's 1 (torchtitan's
        # generate_llm_fqn_per_model_part, input_weight = output_weight = 1), by hand:
        (80, 2, [0, 40, 80]),  # 82 = 41 + 41 -> 40, 40
        (80, 4, [0, 20, 41, 61, 80]),  # 82 = 21 + 21 + 20 + 20 -> 20, 21, 20, 19
        (32, 4, [0, 8, 17, 25, 32]),  # 34 = 9 + 9 + 8 + 8 -> 8, 9, 8, 7
        (12, 2, [0, 6, 12]),  # 14 = 7 + 7 -> 6, 6
        (7, 3, [0, 2, 5, 7]),  # 9 = 3 + 3 + 3 -> 2, 3, 2
        (5, 1, [0, 5]),
    ],
)
def test_the_even_split_is_torchtitan_s(layers, stages, bounds):
    assert even_split(layers, stages) == bounds


def test_an_even_split_that_leaves_a_stage_empty_is_one_line():
    with pytest.raises(AutoshardError, match=r"3 layers .* into 4 stages .* use fewer stages"):
        even_split(3, 4)  # 5 = 2 + 1 + 1 + 1 -> 1, 1, 1, 0


def test_the_even_split_fits_exactly_where_it_leaves_no_stage_empty():
    """``even_split_fits`` (the rule the pipeline search and ``stages --split`` share)
    agrees with :func:`even_split` itself on every L < 60, S < 40."""
    for layers in range(1, 60):
        for stages in range(1, 40):
            try:
                even_split(layers, stages)
                fits = True
            except AutoshardError:
                fits = False
            assert even_split_fits(layers, stages) == fits, (layers, stages)


def test_a_given_split_is_the_only_one_priced():
    """``split=``: stage_cost is called for that split's stages alone, and the plan is
    that split, priced: its step is 1F1B's over those stage times."""
    seen = []

    def cost(i, j):
        seen.append((i, j))
        return StageCost(float(j - i) ** 2, 1.0)

    plan = assign_stages(6, 3, 4, cost, split=[0, 1, 5, 6])
    assert seen == [(0, 1), (1, 5), (5, 6)]
    assert plan.boundaries == (0, 1, 5, 6)
    assert plan.step_time_s == pytest.approx(1 + 16 + 1 + 3 * 16)
    assert assign_stages(6, 3, 4, cost).boundaries == (0, 2, 4, 6)  # the search's own
    with pytest.raises(AutoshardError, match="4 boundaries rising strictly from 0 to 6"):
        assign_stages(6, 3, 4, cost, split=[0, 3, 3, 6])
    with pytest.raises(
        AutoshardError,
        match=r"the split \[0, 1, 5, 6\] of 6 layers into 3 stages does not fit",
    ):
        assign_stages(6, 3, 4, cost, memory_budget=0.5, split=[0, 1, 5, 6])
