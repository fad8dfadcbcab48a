"""A Llama-2-7B-shaped model (HuggingFace ``LlamaForCausalLM``) from its config.

No weights are downloaded: the model is built from the config, so autoshard can plan it
on the meta device (nothing is allocated; the full model would need 27 GB in float32).

Shape: hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000. Input:
``input_ids`` of global shape (BATCH, SEQ_LEN) = (8, 1024), int64.

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of decoder layers (default 32). Tests and benchmarks set
                       e.g. AUTOSHARD_LAYERS=2 for a small model of the same shape.

Run:  autoshard solve examples/llama.py --mesh 2x4
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH = 8
SEQ_LEN = 1024
N_LAYERS = 32
VOCAB = 32000


def _layers(default: int) -> int:
    """``AUTOSHARD_LAYERS`` if set (a positive integer), else ``default``."""
    value = os.environ.get("AUTOSHARD_LAYERS", "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"AUTOSHARD_LAYERS must be a positive integer, got {value!r}")
    return int(value)


N_LAYERS = _layers(N_LAYERS)


def build_model() -> torch.nn.Module:
    """``LlamaForCausalLM`` with the Llama-2-7B shape and N_LAYERS layers, default attention
    (SDPA) and cache settings."""
    config = LlamaConfig(
        hidden_size=4096,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
    return LlamaForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, VOCAB)."""
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
