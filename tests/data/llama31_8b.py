"""The Llama-3.1-8B shape (HuggingFace ``LlamaForCausalLM``) on the per-GPU batch of
torchtitan's 8-GPU FSDP run (docs/performance.md of pytorch/torchtitan, Table 1: local
batch 2, sequence 8192): hidden 4096, 32 heads, 8 key/value heads, intermediate 14336,
vocab 128256, untied embeddings. ``AUTOSHARD_LAYERS`` sets the depth (default 32), as in
``examples/llama.py``; ``AUTOSHARD_BATCH`` the global batch (default 2, one GPU's share:
16 prices the 8-GPU run, 256 the 128-GPU one). A measured row of docs/validation.md (one
H100, one GPU's share of that run's work)."""

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import llama  # noqa: E402

SEQ_LEN, VOCAB = 8192, 128256
BATCH = int(os.environ.get("AUTOSHARD_BATCH", "2"))


def build_model() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=llama._layers(32),
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        rope_theta=500000.0,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)


def loss_fn(out, input_ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits in float32 against the tokens, as torchtitan's loss
    (``cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))``)."""
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
