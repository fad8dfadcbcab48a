"""What the published-run model files (``llama.py``, ``gpt.py``) share: the run read from
the environment, and torchtitan's loss."""

import os

import torch


def _env(name: str) -> str:
    value = os.environ.get(name, "").strip()
    if not value:
        raise ValueError(f"{name} must be set (see the model file's docstring)")
    return value


def read_run(shapes: dict[str, tuple]) -> tuple[tuple, int, int, int]:
    """``(shape, layers, batch, seq)`` of the run the environment names:
    ``AUTOSHARD_MODEL`` (a key of ``shapes``, whose first entry is the depth),
    ``AUTOSHARD_LAYERS`` (optional), ``AUTOSHARD_BATCH`` (global) and ``AUTOSHARD_SEQ``.

    Raises:
        ValueError: a variable is missing or names no model of ``shapes``.
    """
    model = _env("AUTOSHARD_MODEL")
    if model not in shapes:
        raise ValueError(f"AUTOSHARD_MODEL must be one of {', '.join(shapes)}, got {model!r}")
    shape = shapes[model]
    layers = int(os.environ.get("AUTOSHARD_LAYERS") or shape[0])
    return shape, layers, int(_env("AUTOSHARD_BATCH")), int(_env("AUTOSHARD_SEQ"))


def loss_fn(out, input_ids: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: cross-entropy of the float32 logits against the tokens."""
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
