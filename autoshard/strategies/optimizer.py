"""The optimizer implementations a training step can be priced as (``--optimizer``); the
price itself is :func:`autoshard.strategies.graph.adamw_step_time`. A module of its own
that imports nothing, so that the file formats (:mod:`autoshard.plan.formats`, the stage
plan) check a name (``predicted.optimizer``) without the strategy graph."""

OPTIMIZERS = ("adamw-fused", "adamw-foreach")
"""PyTorch's fused AdamW kernel (``torch.optim.AdamW(fused=True)``, apex's FusedAdam), the
default, and its ``foreach`` implementation (the default of ``torch.optim.AdamW`` for
CUDA tensors, torchtitan's)."""
