"""The GPT-architecture models of published training runs (docs/validation.md, "Published
runs"): Megatron-LM's GPT models (Narayanan et al. 2021, Table 1) and MosaicML's MPT
models (llm-foundry's benchmark table), as HuggingFace ``GPT2LMHeadModel`` from a config on
the meta device: learned positions, LayerNorm, a 4 x hidden GELU MLP (one kernel, as both
systems run it), SDPA attention.

Megatron's GPT is this architecture; its 2021 runs predate FlashAttention and computed
the attention matrix explicitly (a fused scale-mask-softmax between two batched matmuls),
so the ``gpt_*`` models use HuggingFace's eager attention, which does the same. MPT (with
FlashAttention, llm-foundry's default) uses SDPA. MPT differs in two small ways: ALiBi in place of
learned positions (a bias added inside the attention kernel, no matmul) and no biases
(a few FLOPs per token); both are below the table's precision.

Environment variables (read when the file is imported):
    AUTOSHARD_MODEL    gpt_1.7b, gpt_3.6b, gpt_7.5b, gpt_18.4b (Megatron), mpt_7b, mpt_13b
    AUTOSHARD_BATCH    global batch (sequences)
    AUTOSHARD_SEQ      sequence length (tokens)
    AUTOSHARD_LAYERS   depth (default: the model's)
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run_env import loss_fn, read_run  # noqa: E402, F401 (loss_fn: the model file's loss)

# name -> (layers, hidden, heads, vocab)
SHAPES = {
    # Narayanan et al. 2021, Table 1 (vocabulary 51,200)
    "gpt_1.7b": (24, 2304, 24, 51200),
    "gpt_3.6b": (30, 3072, 32, 51200),
    "gpt_7.5b": (36, 4096, 32, 51200),
    "gpt_18.4b": (40, 6144, 48, 51200),
    # llm-foundry scripts/train/yamls/pretrain/mpt-{7b,13b}.yaml (vocabulary 50,368)
    "mpt_7b": (32, 4096, 32, 50368),
    "mpt_13b": (40, 5120, 40, 50368),
}


MODEL = os.environ.get("AUTOSHARD_MODEL", "")
(_, HIDDEN, HEADS, VOCAB), LAYERS, BATCH, SEQ_LEN = read_run(SHAPES)
MEGATRON = MODEL.startswith("gpt_")
ATTENTION = "eager" if MEGATRON else "sdpa"
# The MLP's activation, one kernel as each system runs it (HuggingFace's GPT-2 default,
# ``gelu_new``, is eight unfused ATen ops: 19% of MPT-7B's priced compute and half of its
# activation memory, neither of which these systems spend). Megatron-LM fuses the bias and
# the tanh approximation into one TorchScript kernel (``megatron/model/fused_bias_gelu.py``,
# ``bias_gelu``); llm-foundry's MPT MLP runs ``nn.GELU(approximate="none")``
# (``llmfoundry/models/layers/ffn.py``, ``MPTMLP``). docs/validation.md, "The MLP's
# activation as the systems ran it".
ACTIVATION = "gelu_pytorch_tanh" if MEGATRON else "gelu"


def build_model() -> torch.nn.Module:
    config = GPT2Config(
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        vocab_size=VOCAB,
        n_positions=SEQ_LEN,
        use_cache=False,
        tie_word_embeddings=True,
        activation_function=ACTIVATION,
    )
    config._attn_implementation = ATTENTION
    return GPT2LMHeadModel(config)


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (BATCH, SEQ_LEN), dtype=torch.int64),)
