"""No op of the models people train is left without a sharded strategy (issue 28, item 1).

A replicate fallback (no sharding rule for an op, so every device computes it whole) or
an op whose every strategy is replicated puts the whole global batch on every device:
at 128 devices that was 55% of Llama-3-8B's step. This walks every op of six HuggingFace
decoder families, default configs (two layers: every layer is alike), in training and
inference, on the meshes people run them on (1-D 8 and 128; 2-D 2x8, 16x8, 8x16; 3-D
4x4x4), and asserts that no op falls back and that every op whose output scales with the
batch can hold a shard of it. The one exception is the broadcast of the loss's 0-d seed
gradient (``expand`` of a scalar: a view with a zero stride, which allocates and computes
nothing); the division after it is checked like every other op.

Llama and GPT-2 are walked again with torchtitan's loss, a cross-entropy of the float32
logits: its backward (``nll_loss_backward``) had only DTensor's replicated strategy.

Mixtral's router backward (the gradient of ``topk``) scatters into
``new_zeros(tokens, experts)``, which DTensor's rule replicates whenever the size differs
from its input's; autoshard's own rule shards it with its input's rows.
"""

from __future__ import annotations

import pytest
from helpers import write_model

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import SolveConfig, strategies, trace

BATCH, SEQ = 128, 64
MESHES = ("8", "2x8", "16x8", "8x16", "128", "4x4x4")

_TEMPLATE = """
import torch
from transformers import {config}, {model}


def build_model():
    return {model}({config}({kwargs}))


def example_inputs():
    return (torch.randint(0, 1000, ({batch}, {seq})),)
"""

# how these models are trained (torchtitan's loss): a cross-entropy of the float32 logits,
# whose backward (``nll_loss_backward``) had only a replicated strategy
_CROSS_ENTROPY = """

def loss_fn(out, input_ids):
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
"""

# default configs but for depth; Llama at the Llama-3-8B shape (LlamaConfig's defaults are
# Llama 2's, without grouped-query attention)
MODELS = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        "num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, "
        "intermediate_size=14336, vocab_size=128256",
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "num_hidden_layers=2"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "num_hidden_layers=2"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "num_hidden_layers=2"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "n_layer=2"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_hidden_layers=2"),
}
CROSS_ENTROPY = {"llama3", "gpt2"}  # also walked with the cross-entropy loss, in training


def _batch_scaled(t) -> bool:
    return t is not None and len(t.shape) > 0 and t.shape[0] in (BATCH, BATCH * SEQ)


def _unshardable(graph, sg) -> list[str]:
    """Ops whose output scales with the batch and that every device computes whole."""
    out = []
    for name, info in graph.nodes.items():
        if info.kind != "op" or not info.results or not _batch_scaled(info.results[0]):
            continue
        if name in sg.free:
            out.append(f"{name} (computed from constants)")
            continue
        ns = sg.nodes.get(name)
        if ns is None:
            continue
        if all(all(p.is_replicate() for p in s.outputs[0]) for s in ns.strategies):
            if all(not graph.nodes[a].results[0].shape for a in info.arg_nodes):
                continue  # the broadcast of a 0-d tensor (module docstring)
            out.append(name)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "loss"),
    [(m, "default") for m in MODELS] + [(m, "cross_entropy") for m in sorted(CROSS_ENTROPY)],
)
def test_no_fallback_and_nothing_computed_whole(tmp_path, model, loss):
    config, cls, kwargs = MODELS[model]
    text = _TEMPLATE.format(config=config, model=cls, kwargs=kwargs, batch=BATCH, seq=SEQ)
    if loss == "cross_entropy":
        text += _CROSS_ENTROPY
    path = write_model(tmp_path, text, model)
    seen = {}
    for mode in ("train", "infer") if loss == "default" else ("train",):
        graph = trace(SolveConfig(path, MeshSpec.from_options("8"), mode=mode))
        for mesh in MESHES:
            sg = strategies(SolveConfig(path, MeshSpec.from_options(mesh), mode=mode), graph)
            seen[(mode, mesh)] = (dict(sg.fallback_ops), _unshardable(graph, sg))
    assert seen == {key: ({}, []) for key in seen}
