"""Cross-entropy's ops, with loss parallelism: the logits sharded by class (vocabulary).

``F.cross_entropy`` traces to ``_log_softmax`` and ``nll_loss_forward`` (and, in the
backward, ``nll_loss_backward`` and ``_log_softmax_backward_data``). Each op's rule offers
per mesh dim what DTensor's own dispatch places (``R``, and a shard of a dim the loss does
not reduce over: ``S0`` for the rows), and ``V``: the class dim sharded, each rank holding
a contiguous block of the vocabulary, as a column-parallel LM head leaves its logits
(Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019, section 3; DTensor's
``loss_parallel``, ``torch.distributed.tensor.parallel.loss``, torchtitan's default):

- ``_log_softmax`` over a sharded class dim all-reduces each row's maximum (max) and its
  sum of exponentials (sum): two all-reduces of one float per row;
- ``nll_loss_forward`` picks each row's target from the rank whose block holds it: a
  partial loss (``Partial(sum)`` over the ranks), the count of targets whole;
- ``nll_loss_backward`` writes ``-1/count`` (mean) at each rank's own targets: no
  communication;
- ``_log_softmax_backward_data`` all-reduces each row's sum of the output gradient: one
  all-reduce of one float per row.

The launch runs each rank's part in :func:`_log_softmax_kernel` and its siblings, whose
collectives the launcher's log counts; they reduce bfloat16 and float16 in float32, as
ATen's kernels do (so the all-reduces carry float32). With no ``V`` on any mesh dim each
op runs as it is on the local shards (the ``R`` and ``S0`` choices need no
communication). At most one mesh dim shards the class dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.strategies.registry import DimChoice, KernelContext, register_op_rule

aten = torch.ops.aten

_R, _S0 = Replicate(), Shard(0)
VOCAB = "V"
"""The per-mesh-dim choice that shards the class (vocabulary) dim."""


def _reduction(node: Any, at: int) -> int:
    """The loss's reduction argument: 0 none, 1 mean (the default), 2 sum."""
    return node.args[at] if len(node.args) > at else 1


def _one_vocab_dim(node: Any, args: list, modes: tuple[str, ...], mesh_shape: Any) -> bool:
    """At most one mesh dim shards the class dim."""
    return modes.count(VOCAB) <= 1


def _softmax_dim(node: Any, ndim: int) -> int:
    """The ``dim`` argument (``_log_softmax``'s second, its backward's third), made
    non-negative for a tensor of ``ndim`` dims (at least 1)."""
    dim = node.args[2] if node.target is aten._log_softmax_backward_data.default else node.args[1]
    return dim % ndim


def _row_bytes(
    shape: tuple[int, ...], dim: int, modes: tuple[str, ...], mesh_shape: Any, itemsize: int
) -> float:
    """Bytes of one float per row of a ``shape`` tensor reduced over ``dim``, on one device:
    the rows divided by the mesh dims that shard another dim (``S<d>``)."""
    rows = math.prod(shape) // shape[dim]
    split = math.prod(n for n, m in zip(mesh_shape, modes, strict=True) if m.startswith("S"))
    return float(rows // split * itemsize)


def _softmax_choices(ndim: int, dim: int, n_tensors: int) -> list[DimChoice]:
    """``R``, ``S<d>`` for every dim ``d`` but ``dim``, and ``V`` (``dim`` sharded), with
    ``n_tensors`` inputs and one output all placed alike."""
    out = [DimChoice("R", (_R,) * n_tensors, (_R,))]
    for d in range(ndim):
        s = Shard(d)
        out.append(DimChoice(VOCAB if d == dim else f"S{d}", (s,) * n_tensors, (s,)))
    return out


def _log_softmax_collectives(
    node: Any, args: list, modes: tuple[str, ...], mesh_shape: Any
) -> tuple[tuple[str, int, float], ...]:
    """``V``: each row's maximum and its sum of exponentials, all-reduced over that dim."""
    if VOCAB not in modes:
        return ()
    shape, dim = tuple(args[0].shape), _softmax_dim(node, len(args[0].shape))
    nbytes = _row_bytes(shape, dim, modes, mesh_shape, _accumulated(args[0].dtype).itemsize)
    return (("all_reduce", modes.index(VOCAB), nbytes),) * 2


def _log_softmax_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext) -> Any:
    """``log_softmax(x) = x - m - log(sum(exp(x - m)))`` with ``m`` the row's maximum, the
    maximum and the sum taken over the vocabulary dim's ranks under ``V``."""
    if VOCAB not in ctx.modes:
        return target(*args, **kwargs)
    x, dim, half_to_float = args
    at, dtype = ctx.modes.index(VOCAB), torch.float32 if half_to_float else x.dtype
    x = x.to(_accumulated(x.dtype))
    peak = ctx.all_reduce_max(x.amax(dim, keepdim=True), at)
    shifted = x - peak
    total = ctx.all_reduce(shifted.exp().sum(dim, keepdim=True), at)
    return (shifted - total.log()).to(dtype)


def log_softmax_choices(node: Any, args: list, results: list) -> list[DimChoice]:
    """``_log_softmax(x, dim, half_to_float)``: ``R``, a shard of any other dim, or ``V``
    (``dim`` sharded: two all-reduces of one float per row, :func:`_log_softmax_kernel`).
    A 0-d ``x`` is only replicated."""
    ndim = len(args[0].shape)
    return _softmax_choices(ndim, _softmax_dim(node, ndim) if ndim else -1, 1)


register_op_rule(
    aten._log_softmax.default,
    kernel=_log_softmax_kernel,
    allow=_one_vocab_dim,
    collectives=_log_softmax_collectives,
)(log_softmax_choices)


def _log_softmax_backward_collectives(
    node: Any, args: list, modes: tuple[str, ...], mesh_shape: Any
) -> tuple[tuple[str, int, float], ...]:
    """``V``: each row's sum of the output gradient, all-reduced over that dim."""
    if VOCAB not in modes:
        return ()
    shape, dim = tuple(args[0].shape), _softmax_dim(node, len(args[0].shape))
    nbytes = _row_bytes(shape, dim, modes, mesh_shape, _accumulated(args[0].dtype).itemsize)
    return (("all_reduce", modes.index(VOCAB), nbytes),)


def _log_softmax_backward_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext) -> Any:
    """``grad_input = grad - exp(output) * sum(grad)`` over ``dim`` (ATen's formula), the
    sum taken over the vocabulary dim's ranks under ``V``."""
    if VOCAB not in ctx.modes:
        return target(*args, **kwargs)
    grad, output, dim, input_dtype = args
    acc = _accumulated(grad.dtype)
    grad, output = grad.to(acc), output.to(acc)
    total = ctx.all_reduce(grad.sum(dim, keepdim=True), ctx.modes.index(VOCAB))
    return (grad - output.exp() * total).to(input_dtype)


@register_op_rule(
    aten._log_softmax_backward_data.default,
    kernel=_log_softmax_backward_kernel,
    allow=_one_vocab_dim,
    collectives=_log_softmax_backward_collectives,
)
def log_softmax_backward_choices(node: Any, args: list, results: list) -> list[DimChoice]:
    """``_log_softmax_backward_data(grad_output, output, dim, input_dtype)``: the two
    tensors and the gradient placed alike, ``R``, a shard of any other dim, or ``V`` (one
    all-reduce of one float per row)."""
    ndim = len(args[0].shape)
    return _softmax_choices(ndim, _softmax_dim(node, ndim) if ndim else -1, 2)


def _accumulated(dtype: torch.dtype) -> torch.dtype:
    """The dtype ATen's CPU and CUDA kernels reduce ``dtype`` in: float32 for bfloat16 and
    float16, the dtype itself for float32 and float64."""
    return torch.promote_types(dtype, torch.float32)


def _check_targets(labels: torch.Tensor, counted: torch.Tensor, classes: int) -> None:
    """Fail, as ATen's kernel does, on a target outside ``[0, classes)`` that is not
    ``ignore_index`` (``counted`` false): under ``V`` no rank would pick it, and its loss
    would be 0 unseen. An asynchronous assert (``RuntimeError`` where the device reports
    it), which a lowered step records as an op, where a Python test of the values could
    not be traced."""
    outside = counted & ((labels < 0) | (labels >= classes))
    torch._assert_async(~outside.any(), f"a target is out of bounds (classes: {classes})")


def _nll_forward_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext) -> Any:
    """Under ``V``, each row's loss from the rank whose vocabulary block holds its target,
    ``0`` on the others (a partial sum over the ranks); the count of targets other than
    ``ignore_index`` is the whole one, which every rank has. Otherwise ATen's kernel on
    the local shards."""
    if VOCAB not in ctx.modes:
        return target(*args, **kwargs)
    x, labels, _weight, reduction, ignore_index = args
    at, width = ctx.modes.index(VOCAB), x.shape[1]
    counted = labels != ignore_index
    _check_targets(labels, counted, width * ctx.size(at))
    local = labels - ctx.rank(at) * width
    mine = counted & (local >= 0) & (local < width)
    picked = x.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
    losses = -torch.where(mine, picked, torch.zeros_like(picked))
    if reduction == 0:
        return losses, x.new_zeros(())
    acc = _accumulated(x.dtype)
    count, total = counted.sum().to(acc), losses.to(acc).sum()
    return (total / count if reduction == 1 else total).to(x.dtype), count.to(x.dtype)


def _nll_backward_kernel(target: Any, args: list, kwargs: dict, ctx: KernelContext) -> Any:
    """Under ``V``, ``-grad_output`` (over the count, for the mean) at each row's target on
    the rank whose vocabulary block holds it, zeros elsewhere. Otherwise ATen's kernel on
    the local shards."""
    if VOCAB not in ctx.modes:
        return target(*args, **kwargs)
    grad_output, x, labels, _weight, reduction, ignore_index, total_weight = args
    at, width = ctx.modes.index(VOCAB), x.shape[1]
    counted = labels != ignore_index
    _check_targets(labels, counted, width * ctx.size(at))
    local = labels - ctx.rank(at) * width
    mine = counted & (local >= 0) & (local < width)
    scale = -grad_output / total_weight if reduction == 1 else -grad_output
    values = torch.where(mine, scale.expand(labels.shape), torch.zeros((), dtype=x.dtype))
    grad = torch.zeros_like(x)
    return grad.scatter_(1, local.clamp(0, width - 1).unsqueeze(1), values.unsqueeze(1).to(x.dtype))


@register_op_rule(aten.nll_loss_forward.default, kernel=_nll_forward_kernel, allow=_one_vocab_dim)
def nll_loss_forward(node: Any, args: list, results: list) -> list[DimChoice]:
    """``nll_loss_forward(input[N, C], target[N], weight?, reduction, ignore_index) ->
    (loss, total_weight)``.

    PyTorch's rule indexes the target's strategy by the input's index and breaks with
    several input strategies. Per mesh dim: ``R``, everything replicated; ``S0``, input and
    target sharded on the batch dim ``N``, giving a partial loss placed as DTensor's own
    dispatch places it: ``Partial(avg)`` for the mean (the mean of local means, exact for
    equal shards), ``Partial(sum)`` for the sum, batch-sharded with no reduction;
    ``total_weight`` a ``Partial(sum)``. ``V`` (without class weights): the input sharded
    on the classes ``C`` and the target whole, giving a ``Partial(sum)`` loss and the
    whole ``total_weight`` (:func:`_nll_forward_kernel`). A 1-D input (one sample: ``C``
    classes and a 0-d target) is only replicated."""
    out = [DimChoice("R", (_R,) * len(args), (_R, _R))]
    if len(args[0].shape) >= 2:
        loss = {0: _S0, 1: Partial("avg")}.get(_reduction(node, 3), Partial())
        out.append(DimChoice("S0", (_S0, _S0) + (_R,) * (len(args) - 2), (loss, Partial())))
        if len(args) == 2:  # no class weights
            out.append(DimChoice(VOCAB, (Shard(1), _R), (Partial(), _R)))
    return out


@register_op_rule(aten.nll_loss_backward.default, kernel=_nll_backward_kernel, allow=_one_vocab_dim)
def nll_loss_backward(node: Any, args: list, results: list) -> list[DimChoice]:
    """``nll_loss_backward(grad_output, input[N, C], target[N], weight?, reduction,
    ignore_index, total_weight)``, the gradient of a cross-entropy loss.

    PyTorch's rule indexes the target's, the gradient's and ``total_weight``'s strategies
    by the input's index, as its forward rule does, and so offers only ``Replicate`` when
    each input has several candidates: the whole ``(N, C)`` gradient of the logits was
    computed on every device (67 GB in float32 for Llama-3.1-8B at 16 x 8192 tokens).
    Per mesh dim, as DTensor's rule places one concrete case: ``R``; ``S0``, input, target
    and the gradient sharded alike on ``N``, ``grad_output`` following the target without
    reduction and the replicated 0-d seed otherwise, ``weight`` replicated,
    ``total_weight`` replicated for the mean (the all-reduced count: each shard of the
    gradient is then ``-grad_output / total_weight`` at its targets, the global mean's
    gradient) and, as DTensor leaves it, as the forward made it (``Partial``) for the sum
    or no reduction, whose kernel does not read it. ``V`` (without class weights): the
    input and the gradient sharded on the classes, everything else whole
    (:func:`_nll_backward_kernel`). A 1-D input is only replicated."""
    out = [DimChoice("R", (_R,) * len(args), (_R,))]
    if len(args[1].shape) >= 2:
        reduction = _reduction(node, 4)
        grad_out = _S0 if reduction == 0 else _R
        total_weight = _R if reduction == 1 else Partial()
        weight = (_R,) * (len(args) - 4)  # given or not
        out.append(DimChoice("S0", (grad_out, _S0, _S0, *weight, total_weight), (_S0,)))
        if len(args) == 4:  # no class weights
            out.append(DimChoice(VOCAB, (_R, Shard(1), _R, _R), (Shard(1),)))
    return out
