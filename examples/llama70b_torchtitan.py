"""The Llama-3-70B shape at the batch torchtitan trains it with on 64 GPUs.

``examples/llama70b.py``'s model (80 layers, hidden 8192, 64 heads with 8 key/value heads,
intermediate 28672, vocabulary 128256, default attention: SDPA) with ``input_ids`` of
global shape (BATCH, SEQ_LEN) = (32, 2048): 65,536 tokens per step.

Run:  autoshard solve examples/llama70b_torchtitan.py --mesh 8x8 --precision bf16-mixed

Environment variables (read when the file is imported):
    AUTOSHARD_LAYERS   number of decoder layers (default 80).
"""

import importlib.util
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "_llama70b_example", Path(__file__).with_name("llama70b.py")
)
_llama70b = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_llama70b)

BATCH = 32
SEQ_LEN = 2048
build_model = _llama70b.build_model


def example_inputs() -> tuple[torch.Tensor, ...]:
    """``input_ids`` of global shape (BATCH, SEQ_LEN), token ids in [0, vocab)."""
    return (torch.randint(0, _llama70b.VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
