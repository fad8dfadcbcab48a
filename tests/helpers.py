"""Shared helpers for the tests: tiny model files written on the fly."""

from __future__ import annotations

from pathlib import Path

MLP_TEMPLATE = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h})
        self.act = nn.{act}()
        self.fc2 = nn.Linear({h}, {d})

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

def build_model():
    return MLP()

def example_inputs():
    return (torch.randn({b}, {d}),)
"""


def write_mlp(tmp_path: Path, b: int, d: int, h: int, act: str = "ReLU", name: str = "mlp") -> Path:
    """A 2-layer MLP model file: Linear(d, h) -> act -> Linear(h, d), input (b, d)."""
    path = tmp_path / f"{name}.py"
    path.write_text(MLP_TEMPLATE.format(b=b, d=d, h=h, act=act))
    return path
