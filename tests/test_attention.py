"""SDPA as the user runs it: one fused (FlashAttention) op, priced and placed as such.

References outside autoshard: ``FlopCounterMode`` running the CUDA flash kernel (its meta
kernel) on the same shapes; the shapes of what the traced graph saves for the backward pass
(no ``B x H x S x S`` tensor); a single-device run for the launch (tests/test_launch_plan.py
runs the default-config GPT-2 and Llama, whose attention is this op).
"""

from __future__ import annotations

import pytest
import torch
from helpers import GPT2_DEFAULT, LLAMA_SMALL, write_model
from torch.distributed.tensor import Replicate, Shard
from torch.utils.flop_counter import FlopCounterMode

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import SolveConfig, strategies, trace
from autoshard.trace.attention import FLASH_BACKWARD, FLASH_FORWARD

aten = torch.ops.aten
B, H, S, D = 8, 4, 32, 64  # GPT2_DEFAULT: batch 8, 4 heads of 256 / 4, sequence 32

EAGER_GPT2 = GPT2_DEFAULT.replace(
    "    return GPT2LMHeadModel(\n",
    "    m = GPT2LMHeadModel(\n",
).replace(
    "n_positions=128)\n    )\n",
    "n_positions=128)\n    )\n    m.config._attn_implementation = 'eager'\n    return m\n",
)


def _config(tmp_path, text: str, mesh: str) -> SolveConfig:
    path = write_model(tmp_path, text, "m")
    return SolveConfig(model_path=path, mesh=MeshSpec.from_options(mesh))


def _flash_nodes(graph, target):
    return [i for i in graph.nodes.values() if i.kind == "op" and i.target is target]


@pytest.mark.slow
def test_the_default_attention_traces_to_one_fused_op_per_layer(tmp_path):
    cfg = SolveConfig(
        model_path=write_model(tmp_path, GPT2_DEFAULT, "g"), mesh=MeshSpec.from_options("2")
    )
    graph = trace(cfg)
    assert len(_flash_nodes(graph, FLASH_FORWARD)) == 2
    assert len(_flash_nodes(graph, FLASH_BACKWARD)) == 2
    ops = {str(i.target) for i in graph.nodes.values() if i.kind == "op"}
    assert "aten._safe_softmax.default" not in ops and "aten.bmm.default" not in ops


def test_flops_are_what_flop_counter_mode_counts_for_the_cuda_flash_kernel(tmp_path):
    """The CPU op is priced as the counter counts ``_scaled_dot_product_flash_attention``
    and its backward, run here on meta tensors of the same shapes: forward 4 B H S^2 D
    (two matmuls), backward 10 B H S^2 D (``QK^T`` recomputed, four more)."""
    cfg = SolveConfig(
        model_path=write_model(tmp_path, GPT2_DEFAULT, "g"), mesh=MeshSpec.from_options("2")
    )
    graph = trace(cfg)
    fwd = _flash_nodes(graph, FLASH_FORWARD)[0]
    bwd = _flash_nodes(graph, FLASH_BACKWARD)[0]
    assert [a.shape for a in fwd.args[:3]] == [(B, H, S, D)] * 3
    q = torch.empty(B, H, S, D, device="meta")
    with FlopCounterMode(display=False) as fc:
        out = aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)
    assert fwd.counted_flops == fc.get_total_flops() == 4 * B * H * S * S * D
    with FlopCounterMode(display=False) as fc:
        aten._scaled_dot_product_flash_attention_backward(
            out[0], q, q, q, out[0], out[1], out[2], out[3], S, S, 0.0, True, out[6], out[7]
        )
    assert bwd.counted_flops == fc.get_total_flops() == 10 * B * H * S * S * D
    # the step's count: every matmul of the model plus these, once per layer
    assert graph.step_flops == sum(i.counted_flops for i in graph.nodes.values())


@pytest.mark.slow
def test_no_s_by_s_tensor_is_kept_for_the_backward_pass(tmp_path):
    """Flash keeps the output and the log-sum-exp ``[B, H, S]``; eager attention keeps the
    ``[B, H, S, S]`` probabilities (and the scores) per layer. (Both read the ``[B, 1, S, S]``
    mask HuggingFace builds on the meta device, where it cannot see that the mask is
    plain causal; a free node, the same for every head.)"""

    def square(text: str, name: str) -> list[tuple[int, ...]]:
        path = write_model(tmp_path, text, name)
        graph = trace(SolveConfig(model_path=path, mesh=MeshSpec.from_options("2")))
        shapes = [graph.nodes[n].results[0].shape for n in graph.saved_for_backward()]
        return [s for s in shapes if len(s) == 4 and s[1] == H and s[-1] == s[-2] == S]

    assert square(GPT2_DEFAULT, "flash") == []
    assert len(square(EAGER_GPT2, "eager")) >= 2  # at least one per layer


def test_attention_is_sharded_by_batch_or_heads_with_no_communication(tmp_path):
    cfg = SolveConfig(
        model_path=write_model(tmp_path, GPT2_DEFAULT, "g"), mesh=MeshSpec.from_options("2x2")
    )
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    fwd = next(n for n, i in graph.nodes.items() if i.target is FLASH_FORWARD)
    strats = sg.nodes[fwd].strategies
    outs = {s.outputs[0] for s in strats}
    assert {(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Replicate(), Replicate())} <= outs
    for s in strats:  # inputs, output and log-sum-exp placed alike: nothing to communicate
        assert s.inputs[0] == s.inputs[1] == s.inputs[2] == s.outputs[0] == s.outputs[1]
    assert str(FLASH_FORWARD) not in sg.fallback_ops


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        pytest.param(GPT2_DEFAULT, id="gpt2"),
        pytest.param(LLAMA_SMALL, id="llama-gqa"),
    ],
)
def test_models_with_default_attention_plan_without_fallback(tmp_path, text):
    """Llama's grouped-query attention repeats its key/value heads before the fused op.
    Whether an op falls back is the strategy graph's (the ILP only chooses among its
    strategies): every fused attention op, forward and backward, has its own."""
    cfg = SolveConfig(
        model_path=write_model(tmp_path, text, "m"), mesh=MeshSpec.from_options("2x2")
    )
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    fused = [n for n, i in graph.nodes.items() if i.target in (FLASH_FORWARD, FLASH_BACKWARD)]
    assert len(fused) == 4, fused  # two layers, forward and backward
    assert not any("flash" in op for op in sg.fallback_ops), sg.fallback_ops
    for n in fused:
        assert any(s.inputs[0] != (Replicate(), Replicate()) for s in sg.nodes[n].strategies)


@pytest.mark.slow
def test_grouped_query_key_value_views_keep_the_batch_shard_on_8_devices(tmp_path):
    """Issue 28: Llama's key/value projection (B, S, 2 heads x 32) viewed as (B, S, 2, 32).
    On 8 devices its S(2) candidate cannot be split into 2 heads, and DTensor's strict view
    rule raised for the whole op, replicate fallback included, which gathered keys and
    values to the whole batch on every device. Only the refused candidate is left out now:
    no fallback, and the view keeps the batch shard. DTensor's own dispatch is the reference:
    on the same mesh it refuses the S(2) view and runs the S(0) one."""
    import torch
    from torch.distributed.tensor import DTensor

    from autoshard._torch_private import fake_mesh

    cfg = SolveConfig(
        model_path=write_model(tmp_path, LLAMA_SMALL, "m"), mesh=MeshSpec.from_options("8")
    )
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    assert not sg.fallback_ops, sg.fallback_ops
    kv_views = [
        n
        for n, i in graph.nodes.items()
        if i.op_name == "aten.view.default"
        and i.args[0] is not None
        and tuple(i.args[0].shape) == (8, 32, 64)
        and tuple(i.results[0].shape) == (8, 32, 2, 32)
    ]
    assert kv_views
    for name in kv_views:
        placed = {(s.inputs[0], s.outputs[0]) for s in sg.nodes[name].strategies}
        assert ((Shard(0),), (Shard(0),)) in placed, (name, placed)
        assert not any(i == (Shard(2),) for i, _ in placed), (name, placed)
    with fake_mesh((8,)) as mesh:
        local = torch.empty(8, 32, 8, device="meta")
        refused = DTensor.from_local(local, mesh, [Shard(2)], run_check=False)
        with pytest.raises(RuntimeError, match="unevenly"):
            refused.view(8, 32, 2, 32)
        kept = DTensor.from_local(torch.empty(1, 32, 64, device="meta"), mesh, [Shard(0)])
        assert kept.view(8, 32, 2, 32).placements == (Shard(0),)


LLAMA_WITH_POSITIONS = (
    LLAMA_SMALL.replace(
        "def build_model():\n    return LlamaForCausalLM(",
        "class WithPositions(torch.nn.Module):\n"
        "    def __init__(self, inner):\n"
        "        super().__init__()\n"
        "        self.inner = inner\n\n"
        "    def forward(self, input_ids, position_ids):\n"
        "        return self.inner(input_ids=input_ids, position_ids=position_ids).logits\n\n\n"
        "def build_model():\n    return WithPositions(LlamaForCausalLM(",
    )
    .replace("        )\n    )\n", "        )\n    ))\n")
    .replace(
        "    return (torch.randint(0, 512, (8, 32)),)",
        "    return (torch.randint(0, 512, (8, 32)), torch.arange(32).repeat(8, 1))",
    )
)


def _eager_sdpa_calls(text: str, tmp_path) -> list[tuple[bool, bool]]:
    """What HuggingFace hands ``F.scaled_dot_product_attention`` when the model runs
    eagerly (meta tensors): per call, (is_causal, a mask was given)."""
    from autoshard.model.model_file import load_model_file

    path = write_model(tmp_path, text, "eager_ref")
    mod = load_model_file(path).module
    with torch.device("meta"):
        model = mod.build_model()
    inputs = [t.to("meta") for t in mod.example_inputs()]
    calls = []
    original = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((bool(is_causal), attn_mask is not None))
        return original(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw
        )

    torch.nn.functional.scaled_dot_product_attention = record
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = original
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("text", [GPT2_DEFAULT, LLAMA_SMALL], ids=["gpt2", "llama"])
def test_the_causal_mask_is_traced_as_eager_runs_it(tmp_path, text):
    """Run eagerly, HuggingFace builds no mask for a batch without padding: SDPA gets
    ``is_causal=True``. Under torch.export it would build the (B, 1, S, S) mask whole on
    every device; the traced step must hold what eager runs (the reference: HF's own calls,
    recorded)."""
    assert set(_eager_sdpa_calls(text, tmp_path)) == {(True, False)}
    graph = trace(_config(tmp_path, text, "2"))
    forwards = _flash_nodes(graph, FLASH_FORWARD)
    assert forwards
    fx = {n.name: n for n in graph.graph_module.graph.nodes}
    for node in (fx[n] for n, i in graph.nodes.items() if i in forwards):
        assert node.args[4:5] == (True,) and "attn_mask" not in node.kwargs, node.kwargs
    square = [
        n
        for n, i in graph.nodes.items()
        if i.kind == "op"
        and i.results
        and i.results[0] is not None
        and i.results[0].shape == (8, 1, 32, 32)  # HF's (B, 1, S, S) mask
    ]
    assert square == []


@pytest.mark.slow
def test_given_position_ids_the_packed_sequence_check_is_traced_not_assumed(tmp_path):
    """Position ids the model is given may pack several sequences in a row: masking_utils
    cannot read them while tracing, so the mask it builds stays in the graph."""
    graph = trace(_config(tmp_path, LLAMA_WITH_POSITIONS, "2"))
    fx = {n.name: n for n in graph.graph_module.graph.nodes}
    forwards = [
        fx[n] for n, i in graph.nodes.items() if i.kind == "op" and i.target is FLASH_FORWARD
    ]
    assert forwards and all("attn_mask" in n.kwargs for n in forwards)
