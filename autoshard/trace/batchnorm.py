"""Batch normalisation as a training step runs it, in ops every sharding can price.

A model is planned with dropout off (``eval()``), but a training step normalises with the
statistics of the batch it sees (Ioffe & Szegedy, "Batch Normalization", ICML'15): the
eval-mode op (``_native_batch_norm_legit_no_training``) is not what trains, and neither
that op nor the training one (``_native_batch_norm_legit_functional``) has a DTensor rule
that keeps a batch-sharded input sharded, so every data-parallel plan of a CNN was priced
with an all-gather of each activation around every BatchNorm (issue 13: DDP of 8 ResNet
blocks at 11.3 ms of all-gathers against 5.2 ms of compute).

While tracing, :func:`batch_norm_traced` makes every ``nn.BatchNorm1d/2d/3d`` (and
``SyncBatchNorm``) compute in plain ops. In training mode, with the batch's statistics over
every dim but the channels (dim 1):

    mean = sum(x) / n,  var = sum((x - mean)^2) / n,  y = (x - mean) * rsqrt(var + eps) * w + b

(two passes, as ``torch.var`` is computed, ``n`` the elements per channel). Sharded on the
batch or a spatial dim, each sum is a per-channel partial sum, made whole by an all-reduce of
``C`` numbers: the statistics of the global batch, as one device (and ``SyncBatchNorm``)
computes them; sharded on the channels, no communication. DTensor's own rules for ``sum``,
``sub``, ``mul`` and ``rsqrt`` price and run that, and autograd derives the backward (two more
per-channel sums). In inference the running statistics stand in for the batch's: a
per-channel affine map, no communication (a module that keeps no running statistics uses
the batch's in both modes, as torch does).

Not traced: the update of ``running_mean`` / ``running_var`` (a step's outputs and gradients
do not read them; 2 x C numbers per layer). Numerically the plain ops equal torch's kernel to
rounding (``--check`` compares them in float64).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["batch_norm_traced", "train_batch_norms"]


def _forward(module: nn.modules.batchnorm._BatchNorm, train: bool):  # noqa: ANN202
    """``module``'s forward in plain ops (the module docstring's formulas)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        batch_stats = train or module.running_mean is None or module.running_var is None
        if batch_stats:
            n = x.numel() // x.shape[1]
            mean = x.sum(dims, keepdim=True) / n
            centred = x - mean
            var = (centred * centred).sum(dims, keepdim=True) / n
        else:
            centred = x - module.running_mean.view(shape)
            var = module.running_var.view(shape)
        y = centred * torch.rsqrt(var + module.eps)
        if module.affine:
            y = y * module.weight.view(shape) + module.bias.view(shape)
        return y

    return forward


@contextlib.contextmanager
def batch_norm_traced(root: nn.Module, train: bool) -> Iterator[None]:
    """While tracing ``root``: every batch-norm module computes in plain ops, with the
    batch's statistics when ``train`` (module docstring), then as it was."""
    patched = [m for m in root.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in patched:
        m.forward = _forward(m, train)  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        for m in patched:
            del m.forward


def train_batch_norms(root: nn.Module) -> None:
    """``root``'s batch-norm modules in training mode (batch statistics), the rest as they
    are (``eval()``: dropout off): what a traced training step computes, for the eager
    single-device reference of ``launch --check --train``."""
    for m in root.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.train()
