"""BERT-base (HuggingFace ``BertForMaskedLM``, default ``BertConfig``) from its config.

No weights are downloaded: the model is built from the config, so autoshard can plan it
on the meta device, and the launcher initialises it randomly.

Shape: 12 layers, hidden 768, 12 heads, intermediate 3072, vocab 30522, at most 512
positions. Input: ``input_ids`` of global shape (BATCH, SEQ_LEN) = (8, 512), int64.

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of encoder layers (default 12). Tests and benchmarks set
                       e.g. AUTOSHARD_LAYERS=2 for a small model of the same shape.

Run:  autoshard solve examples/bert.py --mesh 2x4
"""

import os

import torch
from transformers import BertConfig, BertForMaskedLM

BATCH = 8
SEQ_LEN = 512
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
    """``BertForMaskedLM`` with the default (base) config (default attention, SDPA) and
    N_LAYERS layers."""
    return BertForMaskedLM(BertConfig(num_hidden_layers=N_LAYERS))


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, vocab)."""
    vocab = BertConfig().vocab_size
    return (torch.randint(0, vocab, (BATCH, SEQ_LEN), dtype=torch.int64),)
