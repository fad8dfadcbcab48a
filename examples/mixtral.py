"""The Mixtral-8x7B shape (``MixtralForCausalLM`` from a config; no weights, no network).

Shape: 32 layers, hidden 4096, 32 attention heads with 8 key/value heads, and in each layer
a mixture of 8 experts (intermediate 14336) of which each token uses 2; vocabulary 32000.
46.7 billion parameters. Input: ``input_ids`` of global shape (BATCH, SEQ_LEN) =
(32, 2048), int64.

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of decoder layers (default 32).

Run:  autoshard solve examples/mixtral.py --mesh 8x8
"""

import os

import torch
from transformers import MixtralConfig, MixtralForCausalLM

BATCH = 32
SEQ_LEN = 2048
VOCAB = 32000
N_LAYERS = int(os.environ.get("AUTOSHARD_LAYERS", "").strip() or 32)


def build_model() -> torch.nn.Module:
    """``MixtralForCausalLM`` with the 8x7B shape and N_LAYERS layers, default attention
    (SDPA) and cache settings."""
    config = MixtralConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        max_position_embeddings=32768,
        rope_theta=1e6,
    )
    return MixtralForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, VOCAB)."""
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
