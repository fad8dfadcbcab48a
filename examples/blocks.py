"""Four Linear + ReLU blocks in an ``nn.Sequential``: the smallest model with repeated
blocks, for pipeline stage plans (docs/launch.md, "Pipeline stage plans").

Run:  autoshard stages examples/blocks.py --mesh 2 --pp 2 --microbatches 4 --out plans

x: (BATCH, D) -> (BATCH, D). Each block is ``relu(fc(x))`` with ``fc`` a D x D Linear; the
blocks are ``layers.0`` .. ``layers.3``, so a 2-stage plan splits them two and two.
"""

import torch
from torch import nn

BATCH = 8  # rows in the global batch
D = 16  # features in and out of every block
NUM_BLOCKS = 4


class Block(nn.Module):
    """``relu(fc(x))``; x: (batch, d) -> (batch, d)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Blocks(nn.Module):
    """``NUM_BLOCKS`` blocks in a row; x: (batch, d) -> (batch, d)."""

    def __init__(self, d: int = D, num_blocks: int = NUM_BLOCKS) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[Block(d) for _ in range(num_blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def build_model() -> nn.Module:
    """The four blocks, with default sizes."""
    return Blocks()


def example_inputs() -> tuple[torch.Tensor, ...]:
    """One global batch: (BATCH, D) floats."""
    return (torch.randn(BATCH, D),)
