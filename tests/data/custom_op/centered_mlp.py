"""A model that calls a custom op (``center_op.center``, defined and given its sharding
rule in the file beside this one): ``fc2(center(relu(fc1(x))))``, x: (BATCH, D).

Many rows, narrow layers: data parallelism wins (the weights' gradients are 33 KB, an
activation 2 MiB), so the centering runs batch-split with its column sums all-reduced."""

import torch
from center_op import center
from torch import nn

BATCH, D = 8192, 64


class CenteredMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(center(torch.relu(self.fc1(x))))


def build_model() -> nn.Module:
    return CenteredMLP()


def example_inputs() -> tuple[torch.Tensor, ...]:
    return (torch.randn(BATCH, D),)
