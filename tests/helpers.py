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


MSE_TEMPLATE = """
import torch
from torch import nn

class MLPRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h})
        self.act = nn.ReLU()
        self.fc2 = nn.Linear({h}, {d})

    def forward(self, x, y):
        return ((self.fc2(self.act(self.fc1(x))) - y) ** 2).mean()

def build_model():
    return MLPRegression()

def example_inputs():
    return (torch.randn({b}, {d}), torch.randn({b}, {d}))
"""


def write_mlp(tmp_path: Path, b: int, d: int, h: int, act: str = "ReLU", name: str = "mlp") -> Path:
    """A 2-layer MLP model file: Linear(d, h) -> act -> Linear(h, d), input (b, d)."""
    path = tmp_path / f"{name}.py"
    path.write_text(MLP_TEMPLATE.format(b=b, d=d, h=h, act=act))
    return path


def write_mlp_mse(tmp_path: Path, b: int, d: int, h: int, name: str = "mlp_mse") -> Path:
    """Alpa's test MLP: Linear(d, h) -> ReLU -> Linear(h, d) with the MSE loss against a
    target inside ``forward``; inputs x and y, both (b, d); the output is the scalar loss.

    Unlike a loss that is linear in the output (the mean), MSE needs the output whole
    before squaring it, so a row-parallel matmul's Partial output must be reduced."""
    path = tmp_path / f"{name}.py"
    path.write_text(MSE_TEMPLATE.format(b=b, d=d, h=h))
    return path
