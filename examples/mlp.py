"""A 2-layer MLP: Linear(D_MODEL, D_HIDDEN) -> GELU -> Linear(D_HIDDEN, D_MODEL).

The smallest useful autoshard model file. On a 1-D mesh with replicated inputs the best
plan is Megatron's: the first weight sharded by output features, the second by input
features, one all-reduce at the end.

Run:  autoshard solve examples/mlp.py --mesh 4

A model file defines two functions, which autoshard calls under ``torch.device("meta")``
while planning (nothing is allocated) and on a real device when launching:

- ``build_model()`` returns the ``nn.Module``;
- ``example_inputs()`` returns a tuple of input tensors with GLOBAL shapes (the whole
  batch, before any sharding), in the order ``forward()`` takes them.
"""

import torch
from torch import nn

BATCH = 64  # rows in the global batch
D_MODEL = 1024  # input and output features
D_HIDDEN = 4096  # hidden features (4 x D_MODEL, as in a transformer's MLP block)


class MLP(nn.Module):
    """``fc2(gelu(fc1(x)))``; x: (batch, D_MODEL) -> (batch, D_MODEL)."""

    def __init__(self, d_model: int = D_MODEL, d_hidden: int = D_HIDDEN) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build_model() -> nn.Module:
    """The MLP, with default sizes."""
    return MLP()


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One input ``x`` of global shape (BATCH, D_MODEL), float32."""
    return (torch.randn(BATCH, D_MODEL),)
