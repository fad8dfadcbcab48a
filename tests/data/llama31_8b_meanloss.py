"""``tests/data/llama31_8b.py`` with autoshard's default loss (the mean of the logits in
float32) in place of torchtitan's cross-entropy: the first rows measured on the second
H100 (``tests/data/h100b``) ran this step."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama31_8b  # noqa: E402


def build_model() -> torch.nn.Module:
    return llama31_8b.build_model()


def example_inputs() -> tuple[torch.Tensor, ...]:
    return llama31_8b.example_inputs()
