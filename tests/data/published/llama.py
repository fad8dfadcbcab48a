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

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# name -> (layers, hidden, heads, key/value heads, intermediate, vocab, rope theta)
SHAPES = {
    "llama3_8b": (32, 4096, 32, 8, 14336, 128256, 500000.0),
    "llama3_70b": (80, 8192, 64, 8, 28672, 128256, 500000.0),
    "llama3_405b": (126, 16384, 128, 8, 53248, 128256, 500000.0),
    "llama2_13b": (40, 5120, 40, 40, 13824, 32000, 10000.0),
    "llama2_70b": (80, 8192, 64, 8, 28672, 32000, 10000.0),
}


def _env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{name} must be set (see this file's docstring)")
    return value


MODEL = _env("AUTOSHARD_MODEL")
if MODEL not in SHAPES:
    raise ValueError(f"AUTOSHARD_MODEL must be one of {', '.join(SHAPES)}, got {MODEL!r}")
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, THETA = SHAPES[MODEL]
LAYERS = int(os.environ.get("AUTOSHARD_LAYERS") or LAYERS)
BATCH = int(_env("AUTOSHARD_BATCH"))
SEQ_LEN = int(_env("AUTOSHARD_SEQ"))


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


def loss_fn(out, input_ids: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: cross-entropy of the float32 logits against the tokens."""
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
