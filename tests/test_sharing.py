"""One redistribution per tensor and target (issue 28 item 3).

Independent references: brute force over every plan of small graphs (the ILP's extra
columns against the plain definition "paid once if any reader reads it"), and the count
of sequence-parallel collectives per transformer layer worked by hand from Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models" (2022), section
4.2.2 and figure 5: in the forward pass, one all-gather before the attention (``g``) and
one before the MLP, one reduce-scatter after each (``g-bar``).
"""

from __future__ import annotations

import textwrap
from collections import Counter

import numpy as np
import pytest
import torch
from test_ilp import _random_graph

from autoshard.cost.collectives import comm_model
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.plan.plan import build_plan
from autoshard.solver.baselines import plan_for_algo
from autoshard.solver.ilp import brute_force, solve
from autoshard.solver.options import SolverOptions
from autoshard.solver.solve import SolveConfig, strategies, trace
from autoshard.strategies.graph import Edge, NodeStrategies, Strategy, StrategyGraph
from autoshard.strategies.sharing import SharedResharding, SharePart, build_shares
from autoshard.trace.tracer import TensorInfo

LLAMA = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

def build_model():
    config = LlamaConfig(hidden_size=256, num_hidden_layers={layers}, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=512, vocab_size=512,
                         max_position_embeddings=256, use_cache=False)
    return LlamaForCausalLM(config)

def example_inputs():
    return (torch.randint(0, 512, (8, 128), dtype=torch.int64),)
"""


def _with_shares(seed: int):
    """A random graph (test_ilp) with shared reshardings over pairs of its edges out of
    one node, and one over a node's own strategies (a read inside one variable)."""
    sg = _random_graph(seed)
    rng = np.random.default_rng(100 + seed)
    by_src: dict[str, list[int]] = {}
    for i, e in enumerate(sg.edges):
        by_src.setdefault(e.src, []).append(i)
    for src, idx in by_src.items():
        if len(idx) < 2:
            continue
        i, j = idx[:2]
        for _ in range(2):
            inds = []
            for k in (i, j):
                e = sg.edges[k]
                finite = np.flatnonzero(np.isfinite(e.cost).ravel())
                inds.append(("y", k, int(rng.choice(finite))))
            k_own = len(sg.nodes[src].strategies)
            own = ("x", src, tuple(int(s) for s in rng.choice(k_own, 1)))
            inds.append(own)
            seconds = float(rng.uniform(1, 4))
            sg.shares.append(
                SharedResharding(
                    tuple(inds),
                    [SharePart(seconds, (seconds,) * len(inds), None, True, 1)],
                )
            )
    assert sg.shares, "no node of this graph has two edges out"
    return sg


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5, 6, 8, 12])
def test_ilp_with_shared_reshardings_equals_brute_force(seed):
    sg = _with_shares(seed)
    best_choice, best = brute_force(sg)
    result = solve(sg, SolverOptions(time_limit_s=60, mip_gap=0.0))
    assert result.status == "optimal"
    assert result.objective_s == pytest.approx(best, rel=1e-9, abs=1e-9)


def _fan_out() -> StrategyGraph:
    """A producer ``p`` read by three readers. ``p``'s strategy 1 costs 10 s; a reader
    wanting placement ``"B"`` (its strategy 1) from ``p``'s ``"A"`` pays a 3 s resharding,
    one wanting ``"A"`` (strategy 0) pays nothing but computes 1.5 s more."""
    nodes = {
        "p": NodeStrategies("p", [Strategy((), ())] * 2, np.array([0.0, 10.0]), "p", np.arange(2))
    }
    edges = []
    for r in ("r1", "r2", "r3"):
        nodes[r] = NodeStrategies(r, [Strategy((), ())] * 2, np.array([1.5, 0.0]), r, np.arange(2))
        edges.append(
            Edge(
                "p",
                r,
                TensorInfo((4,), np.float32),
                ["A", "B"],
                ["A", "B"],
                np.arange(2),
                np.arange(2),
                np.array([[0.0, 3.0], [3.0, 0.0]]),
                producer="p",
                consumer=r,
            )
        )
    sg = StrategyGraph(None, (2,), nodes, set(), edges, Counter(), 0.0)

    class _Graph:  # every read in one block, phase and multiplicity
        @staticmethod
        def mult(_name: str) -> int:
            return 1

    key = ("p", False, 0)
    sg.shares = build_shares(edges, [0, 1, 2], [key] * 3, _Graph())
    sg.share_reads = True
    return sg


@pytest.mark.parametrize("readers_b, price", [(0, 4.5), (1, 3 + 3.0), (2, 1.5 + 3.0), (3, 3.0)])
def test_a_shared_resharding_is_paid_once_by_any_number_of_readers(readers_b, price):
    """Worked by hand: ``readers_b`` readers read ``"B"`` (one 3 s resharding between
    them), the others compute 1.5 s each."""
    sg = _fan_out()
    choice = {
        "p": 0,
        "r1": int(readers_b >= 1),
        "r2": int(readers_b >= 2),
        "r3": int(readers_b >= 3),
    }
    assert evaluate(sg, choice) == pytest.approx(price)


def test_the_ilp_shares_the_resharding_where_reading_apart_would_not_pay():
    """Per read, moving the tensor for three readers (9 s) costs more than their extra
    compute (4.5 s); shared (3 s), it costs less: the ILP's optimum moves it."""
    sg = _fan_out()
    shared = solve(sg, SolverOptions(mip_gap=0.0))
    assert shared.objective_s == pytest.approx(3.0)
    assert shared.choice == {"p": 0, "r1": 1, "r2": 1, "r3": 1}
    sg.shares, sg.share_reads = [], False
    apart = solve(sg, SolverOptions(mip_gap=0.0))
    assert apart.objective_s == pytest.approx(4.5)
    assert apart.choice == {"p": 0, "r1": 0, "r2": 0, "r3": 0}


@pytest.fixture(scope="module")
def llama_tp(tmp_path_factory):
    """A 2-layer Llama traced for inference and its strategies on a tp mesh of 4."""
    path = tmp_path_factory.mktemp("sharing") / "llama.py"
    path.write_text(textwrap.dedent(LLAMA.format(layers=2)))
    mesh = MeshSpec.from_options("4", None)
    config = SolveConfig(model_path=path, mesh=mesh, mode="infer", share_reshardings=True)
    return mesh, strategies(config, trace(config))


def test_sequence_parallel_gathers_once_before_the_attention_and_once_before_the_mlp(llama_tp):
    """Megatron-LM's sequence parallelism, forward pass (Korthikanti et al. 2022, figure
    5): per layer two all-gathers (the attention's input, read by the query, key and value
    projections; the MLP's, read by the gate and up projections) and two reduce-scatters,
    plus one all-gather of the final norm's output for the column-parallel head. Each
    all-gather moves one ``(batch, sequence, hidden)`` activation: its seconds are a ring
    all-gather of those bytes on the tp dim."""
    mesh, sg = llama_tp
    plan, _ = plan_for_algo(sg, "megatron_sp", mesh)
    layers = 2
    assert plan.collectives["all_gather"] == 2 * layers + 1
    assert plan.collectives["reduce_scatter"] == 2 * layers
    one = comm_model(mesh).collective("all_gather", 8 * 128 * 256 * 4, 0)
    # a ring all-gather of B bytes over n devices: (n-1) steps of B/n (NCCL's algbw)
    n, bw, alpha = 4, mesh.bandwidth[0], mesh.latency[0]
    by_hand = (n - 1) * (alpha + 8 * 128 * 256 * 4 / n / bw)
    assert one == pytest.approx(by_hand, rel=1e-6)
    assert plan.comm_s["all_gather"] == pytest.approx((2 * layers + 1) * one, rel=1e-6)


def test_the_plan_s_price_counts_a_shared_resharding_once(llama_tp):
    """The same plan priced without sharing pays the three extra gathers per attention and
    the extra one per MLP: the difference is exactly ``3 * layers`` all-gathers."""
    mesh, sg = llama_tp
    plan, _ = plan_for_algo(sg, "megatron_sp", mesh)
    shared = evaluate(sg, plan.choice)
    kept = sg.shares
    sg.shares, sg.share_reads = [], False
    try:
        per_read = evaluate(sg, plan.choice)
        apart = build_plan(sg, plan.choice, mesh)
    finally:
        sg.shares, sg.share_reads = kept, True
    one = comm_model(mesh).collective("all_gather", 8 * 128 * 256 * 4, 0)
    # what the default (no --share-reshardings) counts: one per projection
    assert apart.collectives["all_gather"] == 5 * 2 + 1
    assert per_read - shared == pytest.approx(3 * 2 * one, rel=1e-6)
    assert plan.step_time_s == pytest.approx(shared, rel=1e-9)


@pytest.mark.slow
def test_a_recomputed_block_gathers_its_inputs_once_again(tmp_path):
    """Full activation checkpointing: each block's rerun gathers the attention's and the
    MLP's input once more (2 per layer, priced in ``recompute_s``), not once per
    projection (5): the rerun's price drops by 3 all-gathers per layer with sharing.
    Traced with identical views merged (as ``--share-reshardings`` traces), the three
    projections of a block read one view node."""
    path = tmp_path / "llama.py"
    path.write_text(textwrap.dedent(LLAMA.format(layers=2)))
    mesh = MeshSpec.from_options("4", None)
    config = SolveConfig(
        model_path=path,
        mesh=mesh,
        mode="train",
        share_reshardings=True,
        activation_checkpointing="full",
    )
    graph = trace(config)
    plain = trace(SolveConfig(model_path=path, mesh=mesh, mode="train"))
    assert graph.step_flops == plain.step_flops  # a view computes nothing

    def views(g) -> int:  # noqa: ANN001
        return sum(str(i.target) == "aten.view.default" for i in g.nodes.values())

    assert views(graph) < views(plain)
    sg = strategies(config, graph)
    plan, _ = plan_for_algo(sg, "megatron_sp", mesh)
    kept = sg.shares
    sg.shares, sg.share_reads = [], False
    try:
        apart = build_plan(sg, plan.choice, mesh, recompute=plan.recompute)
    finally:
        sg.shares, sg.share_reads = kept, True
    one = comm_model(mesh).collective("all_gather", 8 * 128 * 256 * 4, 0)
    assert apart.recompute_s - plan.recompute_s == pytest.approx(3 * 2 * one, rel=1e-6)
    again = sum(
        v
        for (ph, kind, _), v in plan.collective_steps.items()
        if ph == "recompute" and kind == "all_gather"
    )
    assert again == 2 * 2


def test_a_gradient_read_transposed_and_as_it_is_is_read_as_it_is_twice():
    """``read_untransposed``: the weight gradient ``g^T x`` of a linear layer whose input
    gradient reads ``g`` too becomes ``(x^T g)^T``, so both matmuls read ``g`` itself (one
    tensor to move once); the graph computes the same values (float64, against eager,
    strides included). Left alone: a transposed read of a tensor read nowhere else, a
    product whose layout a later op would read (not only transposed out of the graph), and
    ``mm(t(a), a)``."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoshard.trace.tracer import read_untransposed

    def step(g, x, w):  # noqa: ANN001, ANN202
        return torch.mm(g.t(), x).t(), torch.mm(g, w)

    def alone(g, x):  # noqa: ANN001, ANN202
        return torch.mm(g.t(), x).t()

    def used(g, x, w):  # noqa: ANN001, ANN202
        return torch.mm(g.t(), x) * 2.0, torch.mm(g, w)

    def gram(g):  # noqa: ANN001, ANN202
        return torch.mm(g.t(), g).t(), g * 2.0

    g, x, w = (torch.randn(*s, dtype=torch.float64) for s in ((64, 8), (64, 16), (8, 16)))
    gm = make_fx(step, tracing_mode="fake")(g, x, w)
    assert read_untransposed(gm) == 1
    mms = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default]
    assert len(mms) == 2
    g_node = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert all(g_node in n.args for n in mms)  # g itself, in both
    for got, want in zip(gm(g, x, w), step(g, x, w), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    class Layouts(torch.fx.Interpreter):  # every node's real layout against its traced one
        def run_node(self, n):  # noqa: ANN001, ANN202
            out = super().run_node(n)
            val = n.meta.get("val")
            if isinstance(out, torch.Tensor) and isinstance(val, torch.Tensor):
                assert (out.shape, out.stride()) == (val.shape, val.stride()), n.name
            return out

    Layouts(gm).run(g, x, w)
    assert read_untransposed(make_fx(alone, tracing_mode="fake")(g, x)) == 0
    assert read_untransposed(make_fx(used, tracing_mode="fake")(g, x, w)) == 0
    assert read_untransposed(make_fx(gram, tracing_mode="fake")(g)) == 0
