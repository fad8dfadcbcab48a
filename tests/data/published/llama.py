"""The Llama models of published training runs (docs/validation.md, "Published runs"),
from their configs on the meta device, trained with torchtitan's loss.

Environment variables (read when the file is imported):
    AUTOSHARD_MODEL    llama3_8b (Llama 3 / 3.1 8B), llama3_70b, llama3_405b, llama2_13b,
                       llama2_70b: the shapes of torchtitan's model configs
                       (``torchtitan/models/llama3/__init__.py``) and the Llama 2 paper.
    AUTOSHARD_BATCH    global batch (sequences): the run's local batch times its
                       data-parallel degree.
    AUTOSHARD_SEQ      sequence length (tokens).
    AUTOSHARD_LAYERS   depth (default: the model's), as in ``examples/llama.py``.
"""

import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_env import loss_fn, read_run  # noqa: E402, F401 (loss_fn: the model file's loss)

# name -> (layers, hidden, heads, key/value heads, intermediate, vocab, rope theta)
SHAPES = {
    "llama3_8b": (32, 4096, 32, 8, 14336, 128256, 500000.0),
    "llama3_70b": (80, 8192, 64, 8, 28672, 128256, 500000.0),
    "llama3_405b": (126, 16384, 128, 8, 53248, 128256, 500000.0),
    "llama2_13b": (40, 5120, 40, 40, 13824, 32000, 10000.0),
    "llama2_70b": (80, 8192, 64, 8, 28672, 32000, 10000.0),
}


(_, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, THETA), LAYERS, BATCH, SEQ_LEN = read_run(SHAPES)


def build_model() -> torch.nn.Module:
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=FFN,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        rope_theta=THETA,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
