"""autoshard's own op rules, in one table: what PyTorch's DTensor does not know of an op.

An op gets an :class:`OpRule` when DTensor has no sharding rule for it (a custom op, the
fused attention and experts ops), or a broken one (``nll_loss``). The rule says, in one
place, everything autoshard needs to plan, price, report and launch the op:

- its **strategies per mesh dim** (:attr:`OpRule.per_dim`: a list of :class:`DimChoice`,
  one placement per tensor input and output), as DTensor's
  ``register_single_dim_strategy`` and meta-pytorch/autoparallel's ``register_rule`` take
  them: the framework takes their product over the mesh dims (dim 0 outermost), keeps the
  combinations :attr:`OpRule.allow` admits, and drops any that does not shard evenly;
- the **collectives it runs itself** under each combination (:attr:`OpRule.collectives`:
  ``(kind, mesh dim, bytes of the whole group)``, priced by
  :meth:`autoshard.cost.collectives.CommModel.collective` and counted in the plan's
  prediction, so the launch's observed counts must show them);
- its **compute cost** when the default roofline over its local shards does not hold
  (:attr:`OpRule.compute_cost`; :func:`roofline` is the default);
- its **launch kernel** (:attr:`OpRule.kernel`): what each rank runs on its local shards,
  given the mode of every mesh dim and the mesh dim's process group
  (:class:`KernelContext`); ``None`` runs the op under DTensor's own dispatch.

Register with the decorator, on the function that gives the per-dim choices::

    @register_op_rule(torch.ops.mylib.center.default, kernel=center_kernel,
                      collectives=center_collectives)
    def center_choices(node, args, results):
        return [DimChoice("R", (R,), (R,)), DimChoice("S0", (S0,), (S0,))]

An op file (a model's own, or :mod:`autoshard.strategies.attention` and
:mod:`autoshard.strategies.experts`) registers its rules when imported;
:mod:`autoshard.strategies.rules` imports autoshard's own (look ops up there), and a model
file imports its own (or defines them) before autoshard traces it. A rule whose choices
are not a product over the mesh dims passes ``strategies=`` (with ``whole=True``)
instead: a function of ``(node, args, results, mesh_shape)`` that returns whole
:class:`Strategy` objects, run under DTensor's dispatch at launch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Placement

from autoshard import _torch_private as tp
from autoshard.errors import AutoshardError
from autoshard.strategies.strategy import Strategy, local_shape
from autoshard.trace.tracer import TensorInfo, counted_flops, op_flops

OwnStrategies = Callable[
    [Any, list[TensorInfo], list[TensorInfo | None], tuple[int, ...]], list[Strategy]
]
"""``(node, args, results, mesh_shape) -> strategies``: a rule given whole."""


@dataclass(frozen=True)
class DimChoice:
    """One way an op may be placed on one mesh dim.

    ``name``: what reports and kernels call it (``"R"``, ``"S0"``, ``"EP"``, ...);
    ``inputs``: one placement per tensor input, in the traced node's tensor-argument order;
    ``outputs``: one per output (``None`` for an output that is not a tensor)."""

    name: str
    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]
    feature: str | None = None
    """A search option the choice needs (``"context_parallel"``): offered only when the
    search enables it (:meth:`OpRule.generate`'s ``features``); a launch names it
    whatever the search was."""


@dataclass(frozen=True)
class KernelContext:
    """What a launch kernel knows of where it runs: the mode (:attr:`DimChoice.name`) the
    plan chose on each mesh dim, and the mesh (a ``DeviceMesh``) whose dims' process groups
    its collectives use. Collectives go through :meth:`all_reduce`, :meth:`all_reduce_max`,
    :meth:`all_gather`, :meth:`reduce_scatter`, :meth:`all_to_all`, :meth:`shift` and
    :meth:`exchange`, torch's functional collectives, which the launcher's collective log
    counts per mesh dim and a lowered step records."""

    modes: tuple[str, ...]
    mesh: Any

    def size(self, dim: int) -> int:
        """Devices on mesh dim ``dim``."""
        return self.mesh.size(dim)

    def rank(self, dim: int) -> int:
        """This rank's coordinate on mesh dim ``dim``: the place of its shard, and its rank
        in the dim's group (the order collectives concatenate in).

        Raises:
            AutoshardError: the two differ (a mesh built with its ranks permuted), where a
                kernel's gathered blocks would not line up with the shards.
        """
        coordinate = self.mesh.get_coordinate()[dim]
        if coordinate != self.mesh.get_local_rank(dim):
            raise AutoshardError(
                f"mesh dim {dim}: this rank's coordinate {coordinate} is not its rank "
                f"{self.mesh.get_local_rank(dim)} in the dim's group; build the mesh with "
                "init_device_mesh (ranks in order)"
            )
        return coordinate

    def group(self, dim: int) -> Any:
        """The process group of this rank's mesh dim ``dim``."""
        return self.mesh.get_group(dim)

    def all_reduce(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum of ``x`` over mesh dim ``dim`` (a new tensor; waited on)."""
        return tp.all_reduce_sum(x, self.group(dim))

    def all_reduce_max(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Elementwise maximum of ``x`` over mesh dim ``dim`` (a new tensor; waited on)."""
        return tp.all_reduce_max(x, self.group(dim))

    def all_gather(self, x: torch.Tensor, dim: int, tensor_dim: int) -> torch.Tensor:
        """Every rank's ``x`` on mesh dim ``dim``, concatenated along ``tensor_dim`` in the
        dim's rank order."""
        return tp.all_gather_dim(x, tensor_dim, self.group(dim))

    def reduce_scatter(self, x: torch.Tensor, dim: int, tensor_dim: int) -> torch.Tensor:
        """The sum of ``x`` over mesh dim ``dim``, this rank keeping its block of
        ``tensor_dim``."""
        return tp.reduce_scatter_dim(x, tensor_dim, self.group(dim))

    def shift(self, tensors: list[torch.Tensor], dim: int) -> list[torch.Tensor]:
        """Each of ``tensors`` passed one step around mesh dim ``dim``'s ring: sent to the
        next rank of the dim, the previous rank's received in its place (one send/recv)."""
        return tp.ring_shift(tensors, self.group(dim))

    def exchange(
        self,
        sends: list[tuple[torch.Tensor, int, int]],
        recvs: list[tuple[torch.Tensor, int, int]],
        dim: int,
    ) -> list[torch.Tensor]:
        """One send/recv batch on mesh dim ``dim``: each ``(tensor, peer, tag)`` of
        ``sends`` to rank ``peer`` of the dim, and one tensor shaped as ``like`` from each
        ``(like, peer, tag)`` of ``recvs``, returned in their order."""
        return tp.p2p_exchange(sends, recvs, self.group(dim))

    def all_to_all(
        self, x: torch.Tensor, out_splits: list[int], in_splits: list[int], dim: int
    ) -> torch.Tensor:
        """Rows of ``x`` exchanged over mesh dim ``dim``: ``in_splits[r]`` rows sent to rank
        ``r`` of the dim, ``out_splits[r]`` received from it."""
        return tp.all_to_all_uneven(x, out_splits, in_splits, self.group(dim))


Kernel = Callable[[Any, list[Any], dict[str, Any], KernelContext], Any]
"""``(target, local args, local kwargs, context) -> local output(s)``: each rank's part."""


def shard_local(target: Any, args: list[Any], kwargs: dict[str, Any], ctx: KernelContext) -> Any:
    """The kernel of an op whose every strategy needs no communication: the op itself on
    each rank's local shards."""
    return target(*args, **kwargs)


@dataclass(frozen=True)
class OpRule:
    """Everything autoshard knows of one op DTensor does not (module docstring).

    Attributes:
        targets: the ops (``OpOverload``) the rule is for.
        per_dim: ``(node, args, results) -> [DimChoice]``: the choices on any one mesh dim
            (``args``/``results``: :class:`TensorInfo` of the tensor inputs and outputs).
        strategies: instead of ``per_dim``, the whole strategies (:data:`OwnStrategies`).
        allow: ``(node, args, modes, mesh_shape) -> bool``: whether a combination of
            per-dim choices (their names, one per mesh dim) is one.
        collectives: ``(node, args, modes, mesh_shape) -> ((kind, mesh dim, bytes), ...)``:
            what the op communicates itself under that combination (bytes of the whole
            group, as :meth:`~autoshard.cost.collectives.CommModel.collective` takes them).
        compute_cost: ``(node, info, strategy, mesh_shape, compute_time) -> seconds`` on
            one device; default :func:`roofline`.
        hidden: ``(node, info, strategy, mesh_shape, compute_time, seconds) -> seconds``:
            of its collectives' seconds (``seconds``, one per entry of the strategy's
            ``collectives``), those its own compute hides (a ring passing each block while
            it computes on the one it has); default none.
        kernel: the launch kernel (:data:`Kernel`) for ``per_dim`` rules, or ``None``: the
            op runs under DTensor's dispatch (a rule DTensor has, mended).
        lowerable: whether a step holding the op can be recorded once and replayed
            (:mod:`autoshard.launch.lowered`); not when what its kernel sends depends on
            the values (the experts' routing).
        dtensor_rule: for ``--mode propagate``, where DTensor places activations itself:
            a per-mesh-dim rule in DTensor's form, registered with it at launch
            (:func:`autoshard._torch_private.register_launch_rule`), and the keyword
            arguments its sharding cache must key on (``dtensor_cache_keys``).
    """

    targets: frozenset
    per_dim: Callable[..., Sequence[DimChoice]] | None = None
    strategies: OwnStrategies | None = None
    allow: Callable[..., bool] | None = None
    collectives: Callable[..., tuple[tuple[str, int, float], ...]] | None = None
    compute_cost: Callable[..., float] | None = None
    hidden: Callable[..., float] | None = None
    kernel: Kernel | None = None
    lowerable: bool = True
    dtensor_rule: Callable[..., Any] | None = None
    dtensor_cache_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.per_dim is None) == (self.strategies is None):
            raise ValueError(f"{set(self.targets)}: give an op rule per_dim or strategies")
        per_dim_only = ("allow", "collectives", "kernel")
        if self.strategies is not None and any(getattr(self, f) for f in per_dim_only):
            raise ValueError(
                f"{set(self.targets)}: allow, collectives and kernel need the choices per "
                "mesh dim (per_dim), which name each dim's mode"
            )

    def generate(
        self, node: Any, args: list, results: list, mesh_shape, features: frozenset = frozenset()
    ) -> list[Strategy]:
        """Every strategy of ``node`` on a mesh of ``mesh_shape`` (unfiltered for even
        sharding, which the strategy builder checks for every rule), of the choices whose
        :attr:`DimChoice.feature` is none or in ``features``."""
        if self.strategies is not None:
            return self.strategies(node, args, results, mesh_shape)
        choices = [
            c
            for c in self.per_dim(node, args, results)
            if c.feature is None or c.feature in features
        ]
        for c in choices:
            if len(c.inputs) != len(args) or len(c.outputs) != len(results):
                raise ValueError(
                    f"{node.target}: choice {c.name} places {len(c.inputs)} inputs and "
                    f"{len(c.outputs)} outputs; the op has {len(args)} and {len(results)}"
                )
            if [p is None for p in c.outputs] != [r is None for r in results]:
                raise ValueError(
                    f"{node.target}: choice {c.name} must place exactly the outputs that "
                    "are tensors (None for the others)"
                )
        out = []
        for combo in itertools.product(choices, repeat=len(mesh_shape)):
            modes = tuple(c.name for c in combo)
            if self.allow is not None and not self.allow(node, args, modes, mesh_shape):
                continue
            ins = tuple(tuple(c.inputs[i] for c in combo) for i in range(len(args)))
            outs = tuple(
                None if combo[0].outputs[j] is None else tuple(c.outputs[j] for c in combo)
                for j in range(len(results))
            )
            own = self.collectives(node, args, modes, mesh_shape) if self.collectives else ()
            out.append(Strategy(outs, ins, tuple(own)))
        return out

    def modes(
        self, node: Any, args: list, results: list, s: Strategy, mesh_shape: Any = None
    ) -> tuple[str, ...]:
        """The choice (:attr:`DimChoice.name`) strategy ``s`` makes on each mesh dim.
        Choices that place every tensor alike are told apart by the collectives they run
        (attention's all-gather and ring context parallelism), given ``mesh_shape``;
        those that run the same ones too (attention's batch split where the batch is 1)
        are one: the first is named, as the strategy builder keeps the first of equal
        strategies.

        Raises:
            ValueError: ``s`` is no product of this rule's choices, or (given
                ``mesh_shape``) none of those products runs ``s``'s collectives (a plan
                made for another rule or mesh).
        """
        choices: dict[tuple, list[str]] = {}
        for c in self.per_dim(node, args, results):
            choices.setdefault((c.inputs, c.outputs), []).append(c.name)
        placed = s.inputs or tuple(p for p in s.outputs if p is not None)
        names = []
        for d in range(len(placed[0]) if placed else 0):
            ins = tuple(p[d] for p in s.inputs)
            outs = tuple(None if p is None else p[d] for p in s.outputs)
            found = choices.get((ins, outs))
            if found is None:
                raise ValueError(
                    f"{node.target}: mesh dim {d} places inputs {ins} and outputs {outs}, "
                    "which none of its rule's choices does"
                )
            names.append(found)
        if mesh_shape is not None and self.collectives is not None:
            for modes in itertools.product(*names):
                if self.allow is not None and not self.allow(node, args, modes, mesh_shape):
                    continue
                if tuple(self.collectives(node, args, modes, mesh_shape)) == s.collectives:
                    return modes
            raise ValueError(
                f"{node.target}: no choice of its rule on mesh {tuple(mesh_shape)} runs the "
                f"collectives {s.collectives} of this strategy (a plan made for another "
                "rule or mesh)"
            )
        return tuple(n[0] for n in names)


_RULES: dict[Any, OpRule] = {}


def register_op_rule(*targets: Any, **fields: Any) -> Callable:
    """Decorator: the function it decorates is the ``per_dim`` choices (or, with
    ``whole=True``, the ``strategies``) of an :class:`OpRule` for ``targets``, with the
    rule's other ``fields``. Returns the function unchanged.

    Raises:
        ValueError: one of ``targets`` has a rule already (two files claim one op).
    """
    whole = fields.pop("whole", False)

    def register(fn: Callable) -> Callable:
        rule = OpRule(frozenset(targets), **{("strategies" if whole else "per_dim"): fn}, **fields)
        for t in targets:
            had = _RULES.get(t)
            if had is not None and _origin(had) != _origin(rule):
                raise ValueError(
                    f"{t} has an op rule already, from {_origin(had)}; this one is from "
                    f"{_origin(rule)}"
                )
            _RULES[t] = rule  # the same file run again (a model file loaded twice) replaces
        return fn

    return register


def _origin(rule: OpRule) -> str:
    """Where the rule's function is defined: its file and name (a model file's module
    gets a new name each time it is loaded; its file stays)."""
    fn = rule.per_dim or rule.strategies
    return f"{fn.__code__.co_filename}:{fn.__qualname__}"


def op_rule(target: Any) -> OpRule | None:
    """The rule registered for ``target``, or ``None``."""
    return _RULES.get(target)


def op_rules() -> list[OpRule]:
    """Every rule registered, once each, in registration order."""
    return list(dict.fromkeys(_RULES.values()))


SOFTMAX_ROW_ON_CHIP = 48 * 1024
"""Bytes of one row that PyTorch's CUDA softmax keeps on chip (``host_softmax`` in
``aten/src/ATen/native/cuda/SoftMax.cu``): a row of the last dim of up to 2048 elements and
8 KiB runs from registers, a longer one is cached in shared memory when it fits a block's
``sharedMemPerBlock`` (48 KiB, less a word per warp for the block's reductions:
``cunn_SoftMaxForwardSmem``). A row at least this long (a vocabulary's logits: 128,256
float32 values are 501 KiB) runs ``cunn_SoftMaxForward``, which reads it from memory three
times: for its max, for its sum of exponentials, and to write the result."""

_SOFTMAX_FORWARD = frozenset(
    {
        torch.ops.aten._softmax.default,
        torch.ops.aten._log_softmax.default,
        torch.ops.aten._safe_softmax.default,  # the softmax kernel, then a masked fill
    }
)
_SOFTMAX_BACKWARD = {  # backward -> whether its sum reads the output too (softmax's does)
    torch.ops.aten._softmax_backward_data.default: True,
    torch.ops.aten._log_softmax_backward_data.default: False,
}


def softmax_rereads(node: Any, args: Sequence[TensorInfo]) -> int:
    """Bytes a softmax over rows too long to keep on chip (:data:`SOFTMAX_ROW_ON_CHIP`)
    reads beyond its inputs once: the forward (``_softmax``, ``_log_softmax``,
    ``_safe_softmax``) reads its
    input twice more (its max and its sum pass), the backward reads its gradient once more
    for the sum (``_log_softmax_backward_data``: the sum of the gradient;
    ``_softmax_backward_data``: of the gradient times the output, so the output too). 0
    for every other op, a row that fits, or a softmax over another dim than the last (a
    spatial kernel). ``args`` are the op's local tensor arguments. The threshold is
    PyTorch's shared-memory bound; its register path for rows of a few thousand elements
    and its alignment conditions are not modelled (errs by a few rows' bytes, never on a
    vocabulary), and the backward's extra read of the output under ``_softmax`` is the
    kernel's sum, not measured here.

    Measured on an H100 SXM (tests/data/h100b, torch.profiler): ``_log_softmax`` over 16384
    x 128256 float32 logits took 11.05 ms and its backward 11.34 ms, four passes of the
    8.4 GB each at the 2.94 TB/s the GPU copied at (11.4 ms), not two (5.7 ms) or three."""
    target = node.target
    forward = target in _SOFTMAX_FORWARD
    if not forward and target not in _SOFTMAX_BACKWARD:
        return 0
    x = args[0]
    dim = node.args[1] if forward else node.args[2]
    ndim = len(x.shape)
    if not ndim or dim % ndim != ndim - 1 or x.shape[-1] * x.itemsize < SOFTMAX_ROW_ON_CHIP:
        return 0
    if forward:
        return 2 * x.nbytes
    return x.nbytes + (args[1].nbytes if _SOFTMAX_BACKWARD[target] else 0)


def roofline(
    node: Any,
    info: Any,
    s: Strategy,
    mesh_shape: Sequence[int],
    compute_time: Callable[..., float],
    kind: str | None = None,
    per: Callable[[list[TensorInfo]], int] | None = None,
) -> float:
    """Roofline seconds of strategy ``s`` of ``node`` on one device: the FLOPs of its local
    shard (``FlopCounterMode``'s count, or autoshard's for ops it does not count) against
    the bytes of its local inputs and outputs (and what a long softmax reads again,
    :func:`softmax_rereads`), at ``compute_time``'s rates for ``kind``
    (default: ``"matmul"`` for ops the counter counts, ``"other"`` for the rest); ``per``
    gives the rate's batch (a calibrated attention rate is per batch x head) from the local
    inputs."""
    args = [
        TensorInfo(local_shape(t.shape, p, mesh_shape), t.dtype)
        for t, p in zip(info.args, s.inputs, strict=True)
    ]
    results = [
        TensorInfo(local_shape(r.shape, p, mesh_shape), r.dtype) if r is not None and p else r
        for r, p in zip(info.results, s.outputs + (None,) * len(info.results), strict=False)
    ]
    counted = counted_flops(node, args, results)
    flops = counted if counted is not None else op_flops(node, args, results)
    nbytes = sum(a.nbytes for a in args) + sum(r.nbytes for r in results if r is not None)
    nbytes += softmax_rereads(node, args)
    dtype = next((r.dtype for r in results if r is not None), torch.float32)
    if counted is None:
        return compute_time(flops, nbytes, dtype, "other")
    if kind is not None and per is not None:
        return compute_time(flops, nbytes, dtype, kind, per=per(args))
    return compute_time(flops, nbytes, dtype, kind or "matmul")
