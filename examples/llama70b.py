"""The Llama-3-70B shape (``LlamaForCausalLM`` from a config; no weights, no network).

Shape: 80 layers, hidden 8192, 64 attention heads with 8 key/value heads (grouped-query
attention), intermediate 28672, vocabulary 128256. Input: ``input_ids`` of global shape
(BATCH, SEQ_LEN) = (8, 1024), int64.

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of decoder layers (default 80).

Run:  autoshard solve examples/llama70b.py --mesh 8x8
"""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH = 8
SEQ_LEN = 1024
VOCAB = 128256
N_LAYERS = int(os.environ.get("AUTOSHARD_LAYERS", "").strip() or 80)


def build_model() -> torch.nn.Module:
    """``LlamaForCausalLM`` with the 70B shape and N_LAYERS layers, default attention (SDPA)
    and cache settings."""
    config = LlamaConfig(
        hidden_size=8192,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    )
    return LlamaForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, VOCAB)."""
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
