"""A small Llama (HuggingFace's ``LlamaForCausalLM``, default-style config: SDPA
attention, causal, KV cache on) for context parallelism: ``AUTOSHARD_BATCH`` sequences
of ``AUTOSHARD_SEQ`` tokens (default 1 x 512), ``AUTOSHARD_HEADS`` heads of 64 (default
1), 2 layers. Long sequences, few of them and few heads: the case only a sequence split
spreads attention over many devices."""

import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BATCH = int(os.environ.get("AUTOSHARD_BATCH", "1"))
SEQ = int(os.environ.get("AUTOSHARD_SEQ", "512"))
HEADS = int(os.environ.get("AUTOSHARD_HEADS", "1"))


def build_model():
    config = LlamaConfig(
        hidden_size=64 * HEADS,
        intermediate_size=128 * HEADS,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=256,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def example_inputs():
    return (torch.randint(0, 256, (BATCH, SEQ)),)
