"""GPT-2 small (HuggingFace ``GPT2LMHeadModel``, default ``GPT2Config``) from its config.

No weights are downloaded: the model is built from the config, so autoshard can plan it
on the meta device, and the launcher initialises it randomly.

Shape: 12 layers, hidden 768, 12 heads, vocab 50257, context 1024. Input: ``input_ids``
of global shape (BATCH, SEQ_LEN) = (8, 1024), int64.

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of transformer layers (default 12). Tests and benchmarks
                       set e.g. AUTOSHARD_LAYERS=2 for a small model of the same shape.

Run:  autoshard solve examples/gpt2.py --mesh 2x4
"""

import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH = 8
SEQ_LEN = 1024
N_LAYERS = 12


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
    """``GPT2LMHeadModel`` with the default config (default attention, SDPA) and N_LAYERS
    layers, as anyone writes it: autoshard traces SDPA as FlashAttention and turns the
    KV cache off while tracing."""
    return GPT2LMHeadModel(GPT2Config(n_layer=N_LAYERS))


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, vocab)."""
    vocab = GPT2Config().vocab_size
    return (torch.randint(0, vocab, (BATCH, SEQ_LEN), dtype=torch.int64),)
