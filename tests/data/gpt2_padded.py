"""GPT-2 small as ``examples/gpt2.py`` builds it, but with its vocabulary padded from 50257
to 50304 (a multiple of 64), as nanoGPT pads it: the LM head's matmuls then have aligned
rows. A measured row of tests/test_validation.py (docs/validation.md: the LM head's
fallback kernel)."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

BATCH, SEQ_LEN, VOCAB = 8, 1024, 50304


def build_model() -> torch.nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB))


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 50257, (BATCH, SEQ_LEN), dtype=torch.int64),)
