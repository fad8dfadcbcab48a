"""A 4-layer Qwen2 (HuggingFace ``Qwen2ForCausalLM``) with grouped-query attention, from
its config: issue 29's everyday case.

No weights are downloaded: the model is built from the config on the meta device.

Shape: hidden 1024, 4 layers, 16 heads, 4 key/value heads (grouped-query attention),
intermediate 2816, vocab 151936 (Qwen2's own). Input: ``input_ids`` of global shape
(BATCH, SEQ_LEN) = (8, 512), int64.

Run:  autoshard solve examples/qwen2.py --mesh 2x4 --precision bf16-mixed
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

BATCH = 8
SEQ_LEN = 512
VOCAB = 151936


def build_model() -> torch.nn.Module:
    """``Qwen2ForCausalLM``: 4 layers of hidden 1024, 16 query and 4 key/value heads,
    default attention (SDPA) and cache settings."""
    config = Qwen2Config(
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=2816,
        vocab_size=VOCAB,
    )
    return Qwen2ForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, VOCAB)."""
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
