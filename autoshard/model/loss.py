"""The training loss: one definition for planning, launching and the single-device check.

A model file may define ``loss_fn(output, *inputs) -> torch.Tensor`` (a scalar); the
joint forward/backward graph that ``autoshard solve --mode train`` prices and that
``autoshard launch --train`` runs ends with it, and ``--check`` computes the reference's
loss with it too. Without one, :func:`default_loss` is used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from autoshard._torch_private import tree_flatten
from autoshard.errors import AutoshardError


def first_float_output(out: object) -> torch.Tensor:
    """The tensor a model's output stands for: itself, else ``logits`` (HF outputs), else
    the first floating-point tensor in it (tuple, list, mapping, in order).

    Raises:
        AutoshardError: the output holds no floating-point tensor.
    """
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        return out
    logits = getattr(out, "logits", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(logits, torch.Tensor) and logits.is_floating_point():
        return logits
    leaves, _ = tree_flatten(out)
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x
    if isinstance(out, torch.Tensor):
        dtype = str(out.dtype).removeprefix("torch.")
        what = f"{'an' if dtype[0] in 'aeiou' else 'a'} {dtype} tensor of shape {tuple(out.shape)}"
    else:
        what = f"{type(out).__name__} with no floating-point tensor"
    raise AutoshardError(
        f"the model's forward() returned {what}: there is nothing to train on; return "
        "floating-point outputs, or define loss_fn(output, *inputs) in the model file"
    )


def default_loss(out: object, *inputs: torch.Tensor) -> torch.Tensor:
    """The mean of :func:`first_float_output`, in float32 when the output is narrower.

    A scalar output, or the scalar ``loss`` of a HuggingFace output (the model given
    ``labels=``, e.g. by ``example_inputs()`` returning a dict), is its own loss. The mean gives
    every output element a gradient, which is what a backward pass's cost depends on.
    """
    del inputs
    loss = getattr(out, "loss", None) if not isinstance(out, torch.Tensor) else None
    if isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point():
        return loss  # a HuggingFace model given labels= computed its own loss
    t = first_float_output(out)
    if t.dim() == 0:
        return t
    if t.dtype.itemsize < 4:
        t = t.float()
    return t.mean()


def loss_function(user: Callable[..., torch.Tensor] | None) -> Callable[..., torch.Tensor]:
    """The model file's ``loss_fn`` checked to return a scalar, or :func:`default_loss`."""
    if user is None:
        return default_loss

    def checked(out: object, *inputs: torch.Tensor) -> torch.Tensor:
        loss = user(out, *inputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            got = (
                f"shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise AutoshardError(f"loss_fn(output, *inputs) returned {got}; return a scalar tensor")
        return loss

    return checked
