"""The optimizer implementations a training step can be priced as (``--optimizer``); the
price itself is :func:`autoshard.strategies.graph.adamw_step_time`. A module of its own,
without torch, so that the file formats can check a name (``predicted.optimizer``)."""

OPTIMIZERS = ("adamw-fused", "adamw-foreach")
"""PyTorch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``, apex's FusedAdam), the
default, and its ``foreach`` implementation (the default of ``torch.optim.AdamW`` for
CUDA tensors, torchtitan's)."""
