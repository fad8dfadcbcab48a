"""The Llama-2-7B shape of ``examples/llama.py`` on long sequences: batch 2 x 4096 tokens
(the same 8192 tokens per step, four times the attention per token). A measured row of
tests/test_validation.py; ``AUTOSHARD_LAYERS`` as in the example (default 32)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import llama  # noqa: E402

BATCH, SEQ_LEN = 2, 4096


def build_model() -> torch.nn.Module:
    return llama.build_model()


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, llama.VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
