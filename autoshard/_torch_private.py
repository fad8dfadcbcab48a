"""Every private PyTorch API autoshard touches, in one place.

PyTorch's DTensor keeps its per-op sharding rules in
``DTensor._op_dispatcher.sharding_propagator``: ``op_strategy_funcs`` (rules that
enumerate strategies from the strategies of their inputs: views, softmax, ...) and
``op_single_dim_strategy_funcs`` (rules given for one mesh dim, expanded by torch to
the whole mesh: mm, addmm, bmm, pointwise ops, layer norm, embedding, ...). Both
are private and change between releases, so autoshard pins ``torch>=2.13,<2.14``
and reaches them only through this module, which ``tests/test_torch_private.py``
checks directly.

Also here: the fake process group that gives a device mesh of any size in one
process (``torch.testing._internal.distributed.fake_pg``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch._functorch._aot_autograd import descriptors as d
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import (
    OpSchema,
    OpSpec,
    OpStrategy,
    RuntimeSchemaInfo,
    TupleStrategy,
)
from torch.distributed.tensor._ops import utils as _ops_utils
from torch.distributed.tensor._ops.single_dim_strategy import (
    _expand_single_dim_strategy_to_mesh,
)
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos_non_cached,
    _optimize_transform_infos,
    redistribute_local_tensor,
)
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.placement_types import _MaskPartial
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only, tree_unflatten

Placements = tuple[Placement, ...]

__all__ = [
    "TorchDispatchMode",  # torch.utils._python_dispatch: see (and change) every ATen call
    "tree_flatten",  # torch.utils._pytree: nested args as leaves and back
    "tree_map",
    "tree_map_only",  # torch.utils._pytree: map over the tensors of nested args
    "tree_unflatten",
    "RuleStrategy",
    "fake_mesh",
    "has_rule",
    "key_sharding_cache_on",
    "register_launch_rule",
    "rule_strategies",
    "tensor_meta",
]


@contextlib.contextmanager
def fake_mesh(shape: Sequence[int], dim_names: Sequence[str] | None = None) -> Iterator[DeviceMesh]:
    """A ``DeviceMesh`` of ``shape`` on a fake process group, in this one process.

    Nothing is communicated; DTensor's sharding rules only need the mesh's shape.
    An existing default process group (e.g. under torchrun) is left alone and
    must already have ``prod(shape)`` ranks.

    Raises:
        RuntimeError: from torch if an existing process group has the wrong size.
    """
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        names = tuple(dim_names) if dim_names else None
        yield init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)
    finally:
        if owns:
            dist.destroy_process_group()


def flatten_mesh_groups(mesh: DeviceMesh) -> dict[str, tuple[int, ...]]:
    """Flatten every group of two or more of ``mesh``'s dims of size above one
    (``DeviceMesh._flatten``, private), so that DTensor runs a resharding's like
    collectives over several mesh dims as one over their flattened group
    (``_optimize_transform_infos`` in ``torch.distributed.tensor._redistribute``, which
    looks the group up by layout), as the cost model prices them
    (:meth:`autoshard.cost.collectives.CommModel._merged`). Collective on every rank of
    ``mesh`` (each flattened group is a new process group).

    Returns:
        The process group name of each flattened group -> its mesh dims, ascending.

    Raises:
        ValueError: ``mesh`` has no dim names (DTensor finds a flattened group by them);
            the launcher names every mesh dim.
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"the {tuple(mesh.shape)} mesh has no dim names: DTensor finds a flattened group "
            "of mesh dims by its names"
        )
    dims = [i for i in range(mesh.ndim) if mesh.size(i) > 1]
    groups: dict[str, tuple[int, ...]] = {}
    for r in range(2, len(dims) + 1):
        for group in itertools.combinations(dims, r):
            picked = tuple(names[g] for g in group)
            flat = mesh[picked]._flatten("_".join(picked) + "_flat")
            groups[flat.get_group().group_name] = group
    return groups


def checkpoint_block(
    block: torch.nn.Module,
    context_fn=None,  # noqa: ANN001
    early_stop: bool = True,
) -> torch.nn.Module:
    """``block`` wrapped to recompute its forward in the backward (non-reentrant
    ``torch.utils.checkpoint``), as torchtitan's activation checkpointing wraps a block:
    ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, whose wrapper keeps
    its parameters' names (``named_parameters`` and ``state_dict`` strip its prefix).
    ``context_fn``: a selective policy's contexts
    (:func:`autoshard.trace.selective.context_fn`); ``None`` recomputes everything.
    ``early_stop``: ``torch.utils.checkpoint``'s own (on by default: the recomputation
    stops once every tensor the backward saved is back); off, the whole forward reruns."""
    kwargs = {} if early_stop else {"early_stop": False}
    if context_fn is None:
        return checkpoint_wrapper(block, **kwargs)
    return checkpoint_wrapper(block, context_fn=context_fn, **kwargs)


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    """DTensor's ``TensorMeta`` (shape, stride, dtype) of a (fake or meta) tensor."""
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def key_sharding_cache_on(op: Any, kwargs: Sequence[str]) -> None:
    """Make DTensor's sharding cache for ``op`` tell calls apart by the tensor ``kwargs``
    too (their shapes and placements).

    DTensor caches an op's sharding decision by its positional tensor args and the args
    its ``RuntimeSchemaInfo`` names; ``register_sharding`` names no kwarg, so a rule that
    reads a tensor kwarg (an attention mask's shape) would have a call with another mask
    reuse the first call's decision."""
    _propagator().op_to_schema_info[op] = RuntimeSchemaInfo(
        static_kwargkey=list(kwargs), needs_pytree=True
    )


_LAUNCH_RULES: set[Any] = set()
"""Ops :func:`register_launch_rule` gave DTensor a rule for in this process."""


def register_launch_rule(op: Any, rule: Any) -> None:
    """Give DTensor ``rule`` for ``op`` (``register_sharding``) for a launch path where
    DTensor places activations (once per op and process; later calls do nothing);
    :func:`has_rule` keeps answering for PyTorch's own rules, so a plan never depends on
    whether this process launched something before."""
    if op not in _LAUNCH_RULES:
        register_sharding(op)(rule)
        _LAUNCH_RULES.add(op)


def has_rule(op: Any) -> bool:
    """Whether PyTorch has a DTensor sharding rule for ``op`` (an ``OpOverload``); rules
    autoshard's launcher registered (:func:`register_launch_rule`) do not count."""
    if op in _LAUNCH_RULES:
        return False
    sp = _propagator()
    return op in sp.op_single_dim_strategy_funcs or op in sp.op_strategy_funcs


@dataclass(frozen=True)
class RuleStrategy:
    """One strategy from PyTorch's rule: output placements and tensor-input placements.

    ``outputs`` has one entry per tensor output of the op (``None`` for a non-tensor
    output); ``inputs`` one per tensor input, in the order of
    :func:`rule_strategies`' ``tensor_args``.
    """

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]


def _plain(ps: Sequence[Placement]) -> bool:
    """Only plain Shard / Replicate / Partial(sum); no strided shards, no other reductions."""
    for p in ps:
        if type(p) is Shard or isinstance(p, Replicate):
            continue
        if type(p) is Partial and p.reduce_op == "sum":
            continue
        return False
    return True


def _reduction_to_avg(outputs, inputs) -> bool:
    """A reduction (``mean``) of sharded, non-partial inputs into ``Partial("avg")``.

    Other ``avg`` partials (passed through linear ops) are dropped to keep the search
    small; this one is kept because a loss is a mean over the sharded batch.
    """
    if any(type(p) is Partial for ps in inputs for p in ps):
        return False
    if not all(type(p) is Shard or isinstance(p, Replicate) for ps in inputs for p in ps):
        return False
    return all(
        o is None
        or all(
            type(p) is Shard
            or isinstance(p, Replicate)
            or (type(p) is Partial and p.reduce_op in ("sum", "avg"))
            for p in o
        )
        for o in outputs
    )


def _unpriced_cost(src: DTensorSpec, dst: DTensorSpec) -> float:
    return 0.0


@contextlib.contextmanager
def _unpriced() -> Iterator[None]:
    """DTensor's rules price every input of every strategy they enumerate with torch's
    own cost model (``generate_redistribute_costs`` into ``OpSpec.redistribute_cost``,
    which only the runtime propagator reads to pick one). :func:`rule_strategies` keeps the
    placements alone, and autoshard prices them with its own model
    (:mod:`autoshard.cost.collectives`): torch's pricing is skipped while a rule runs
    (measured: 2.7 s of the 6.0 s of strategy generation of a 2-layer Llama on 2x4).
    ``tests/test_torch_private.py`` holds the strategies equal to the priced rules'."""
    priced = _ops_utils.redistribute_cost
    try:
        _ops_utils.redistribute_cost = _unpriced_cost
        yield
    finally:
        _ops_utils.redistribute_cost = priced


@_unpriced()  # torch's pricing off while the rule runs (a fresh swap per call)
def rule_strategies(
    op: Any,
    args: tuple,
    kwargs: dict,
    mesh: DeviceMesh,
    candidates: dict[int, Sequence[Placements]],
    out_meta: Any,
) -> list[RuleStrategy]:
    """Enumerate the strategies PyTorch's own DTensor rule allows for one op.

    Args:
        op: the ``OpOverload`` (e.g. ``aten.mm.default``).
        args, kwargs: the op's arguments, with every tensor argument replaced by its
            ``TensorMeta`` (see :func:`tensor_meta`); other values as in the graph.
        mesh: the device mesh (from :func:`fake_mesh`).
        candidates: for the i-th tensor argument (flattened order), the placements
            its producer can give it. Rules that follow their inputs (views,
            softmax, ...) enumerate one strategy per candidate; rules given for a
            single mesh dim enumerate every combination regardless.
        out_meta: the op's output ``TensorMeta`` (or tuple of them).

    Returns:
        The strategies with only plain placements (``Shard``, ``Replicate``,
        ``Partial("sum")``, and ``Partial("avg")`` out of a reduction of non-partial
        inputs); strided shards and other reductions are dropped.

    Raises:
        KeyError: when PyTorch has no rule for ``op`` (check :func:`has_rule`).
        Exception: whatever the rule raises for arguments it cannot handle.
    """
    sp = _propagator()
    counter = iter(range(1 << 30))

    def wrap(x: Any) -> Any:
        if isinstance(x, TensorMeta):
            i = next(counter)
            cands = candidates.get(i) or [(Replicate(),) * mesh.ndim]
            return OpStrategy([OpSpec(DTensorSpec(mesh, tuple(c), x)) for c in cands])
        return x

    single = sp.op_single_dim_strategy_funcs.get(op)
    if single is not None:
        # The single-dim expansion wants one spec per input; it fills its sharding
        # placeholders with the Shard kinds present there, so give it a Shard.
        def wrap1(x: Any) -> Any:
            if isinstance(x, TensorMeta):
                ps = (Shard(0),) if len(x.shape) else (Replicate(),)
                ps = ps + (Replicate(),) * (mesh.ndim - 1)
                return OpStrategy([OpSpec(DTensorSpec(mesh, ps, x))])
            return x

        s_args = tuple(_map_tensor_list(wrap1, a) for a in args)
        s_kwargs = {k: _map_tensor_list(wrap1, v) for k, v in kwargs.items()}
        schema = OpSchema(op, s_args, s_kwargs, schema_info=_schema_info(op, single=True))
        fn = _expand_single_dim_strategy_to_mesh(mesh, schema, single, out_meta)
        strategy = fn(op, schema.args_meta, schema.kwargs_meta)
    else:
        func = sp.op_strategy_funcs[op]
        s_args = tuple(_map_tensor_list(wrap, a) for a in args)
        s_kwargs = {k: _map_tensor_list(wrap, v) for k, v in kwargs.items()}
        schema = OpSchema(op, s_args, s_kwargs, schema_info=_schema_info(op, single=False))
        strategy = func(schema)
    return _to_rule_strategies(strategy)


def _schema_info(op: Any, single: bool):
    sp = _propagator()
    table = sp.op_to_schema_info_for_single_dim_strategy if single else sp.op_to_schema_info
    return table.get(op) or sp.op_to_schema_info.get(op)


def _map_tensor_list(fn, value: Any) -> Any:
    """Apply ``fn`` to every leaf; lists of tensors become ``TupleStrategy`` as DTensor expects."""
    if isinstance(value, TensorMeta):
        return fn(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, TensorMeta) for v in value):
        return TupleStrategy([fn(v) for v in value])
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensor_list(fn, v) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensor_list(fn, v) for k, v in value.items()}
    return fn(value)


def _to_rule_strategies(strategy: Any) -> list[RuleStrategy]:
    if isinstance(strategy, TupleStrategy):
        # e.g. ops returning a list of tensors through a per-output strategy: combine
        # the children index-wise only when they are aligned one strategy each.
        children = [_to_rule_strategies(c) for c in strategy.children]
        if not children or any(len(c) != len(children[0]) for c in children):
            raise ValueError("unaligned tuple strategy")
        out = []
        for parts in zip(*children, strict=True):
            out.append(
                RuleStrategy(
                    outputs=tuple(p.outputs[0] for p in parts),
                    inputs=parts[0].inputs,
                )
            )
        return out
    result = []
    for spec in strategy.strategies:
        outs = spec.output_specs
        if isinstance(outs, DTensorSpec):
            outputs = (tuple(outs.placements),)
        else:
            outputs = tuple(tuple(o.placements) if o is not None else None for o in outs)
        ins = spec.input_specs
        if ins is None:  # "same as output" convention
            first = next(o for o in outputs if o is not None)
            n_in = len(strategy.strategies[0].input_specs or ()) or 1
            inputs = (first,) * n_in
        else:
            inputs = tuple(tuple(s.placements) for s in ins)
        if all(o is None or _plain(o) for o in outputs) and all(_plain(i) for i in inputs):
            result.append(RuleStrategy(outputs=outputs, inputs=inputs))
        elif _reduction_to_avg(outputs, inputs):
            result.append(RuleStrategy(outputs=outputs, inputs=inputs))
    return result


def is_single_dim(op: Any) -> bool:
    """Whether ``op``'s rule is given per mesh dim (its strategies ignore input candidates)."""
    return op in _propagator().op_single_dim_strategy_funcs


def export_joint(stack, module: torch.nn.Module, inputs: tuple) -> Any:
    """The joint forward+backward graph of ``module`` (a scalar-loss module) on ``inputs``.

    ``aot_export_joint_with_descriptors`` (private in torch 2.13). ``stack`` is a
    ``contextlib.ExitStack`` the caller closes once it is done with the graph.
    """
    # imported here: it imports torch._dynamo (about 2 s), which planning from a
    # traced graph, --help and show never need
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    return aot_export_joint_with_descriptors(stack, module, inputs)


@functools.cache
def composite_implicit_decompositions() -> dict:
    """``torch.export``'s default decompositions of the CompositeImplicitAutograd ops only.

    Applied to an exported program before :func:`export_joint`. On the meta device torch
    2.13 gives these ops a Python Meta kernel (``torch._meta_registrations``), which AOT
    autograd's Python dispatcher takes for a backend kernel: it skips the op's
    decomposition and falls to autograd's not-implemented fallback, whose backward is an
    undefined gradient. ``F.cross_entropy`` (``nll_loss``), ``relu6``, ``selu`` (and
    whichever such ops the default table holds) then lose every gradient upstream of
    them (the loss's seed gradient had no user; a GPT-2's last block and head got none).
    Decomposed first, AOT autograd only sees ops with autograd formulas. Private:
    ``torch._C._dispatch_has_kernel_for_dispatch_key``. Built once, on first use; the
    caller must not change the table it returns.
    """
    table = torch.export.default_decompositions()
    for op in list(table):
        implicit = isinstance(op, torch._ops.OpOverload) and (
            torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        )
        if not implicit:
            del table[op]
    return table


def describe_input(node: torch.fx.Node) -> tuple[str, str]:
    """A joint-graph placeholder's role: (``param`` | ``buffer`` | ``input`` | ``tangent``, target).

    For ``input`` the target is the index of the user input, as text.
    """
    desc = node.meta.get("desc")
    if isinstance(desc, d.ParamAOTInput):
        return "param", desc.target
    if isinstance(desc, d.BufferAOTInput):
        return "buffer", desc.target
    if isinstance(desc, d.PlainAOTInput):
        return "input", str(desc.idx)
    return "tangent", node.name


def describe_outputs(node: torch.fx.Node) -> list[str | None]:
    """Per output of the joint graph, the parameter FQN it is the gradient of (else None)."""
    out = []
    for desc in node.meta.get("desc") or []:
        if isinstance(desc, d.GradAOTOutput) and isinstance(desc.grad_of, d.ParamAOTInput):
            out.append(desc.grad_of.target)
        else:
            out.append(None)
    return out


def is_mask_partial(p: Placement) -> bool:
    """``p`` is DTensor's ``_MaskPartial`` (``torch.distributed.tensor.placement_types``,
    private): the pending sum a vocabulary-sharded embedding gives, which holds the rows'
    mask until its first reduction and releases it then, so a second reduction of the same
    DTensor (a second consumer) raises ``AssertionError``."""
    return isinstance(p, _MaskPartial)


def redistribute_step(value: DTensor, placements: Sequence[Placement]) -> DTensor:
    """``value`` with ``placements`` on its mesh, without autograd, including the moves
    ``DTensor.redistribute`` refuses (``Replicate -> Partial``: a local split of the value,
    which a plan may choose where an op's strategy wants a ``Partial`` input).

    ``torch.distributed.tensor._redistribute.redistribute_local_tensor`` does the work.
    """
    target = DTensorSpec(value.device_mesh, tuple(placements), tensor_meta=value._spec.tensor_meta)
    local = redistribute_local_tensor(value._local_tensor, value._spec, target)
    return DTensor(local, target, requires_grad=False)


def dtensor_transform_steps(
    mesh: DeviceMesh, src: Sequence[Placement], dst: Sequence[Placement], shape: Sequence[int]
) -> list[tuple[int | tuple[int, ...], Placement, Placement]]:
    """The steps DTensor's redistribute takes from ``src`` to ``dst`` for a float32 tensor
    of ``shape``, as ``redistribute_local_tensor`` runs them: ``(mesh dim, from, to)`` in
    order, the mesh dim a tuple (ascending) for a collective DTensor runs over a flattened
    group of mesh dims (those :func:`flatten_mesh_groups` made).

    ``torch.distributed.tensor._redistribute._gen_transform_infos_non_cached`` and
    ``_optimize_transform_infos`` (private); tests compare autoshard's priced reshardings
    with them.
    """
    meta = TensorMeta(torch.Size(shape), torch.empty(tuple(shape)).stride(), torch.float32)
    infos = _gen_transform_infos_non_cached(
        DTensorSpec(mesh, tuple(src), meta), DTensorSpec(mesh, tuple(dst), meta)
    )
    infos = _optimize_transform_infos(infos, mesh, tuple(src), tuple(dst))
    return [(getattr(t, "original_mesh_dims", t.mesh_dim), *t.src_dst_placements) for t in infos]


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd recording inside a custom op's implementation, which torch runs with the
    autograd dispatch keys excluded (``torch._library.autograd``: the op's own autograd
    formula stands for it): the keys are taken out of the thread's exclude set while the
    body runs, so it may differentiate its own computation (``torch.autograd.grad``)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keys = [k for k in torch._C.DispatchKey.__members__.values() if excluded.has(k)]
    autograd = [k for k in keys if k.name.startswith("Autograd") or k.name == "ADInplaceOrView"]
    for k in autograd:
        excluded = excluded.remove(k)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        yield


def all_to_all_uneven(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
    """``all_to_all_single`` with uneven splits (rows sent to / received from each rank of
    ``group``) through torch's functional collectives
    (``torch.distributed._functional_collectives``), which DTensor uses and the launcher's
    collective log sees; waited on before it returns."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_to_all_single(x.contiguous(), out_splits, in_splits, group))


def ring_shift(tensors: list[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """Each tensor sent to the next rank of ``group`` (in its rank order, the last to the
    first) and the previous rank's received in its place, all in one batch of
    point-to-point ops (:func:`p2p_exchange`); waited on before it returns."""
    import torch.distributed as dist

    n, me = dist.get_world_size(group), dist.get_rank(group)
    sends = [(t, (me + 1) % n, 0) for t in tensors]
    recvs = [(t, (me - 1) % n, 0) for t in tensors]
    return p2p_exchange(sends, recvs, group)


def p2p_exchange(
    sends: list[tuple[torch.Tensor, int, int]],
    recvs: list[tuple[torch.Tensor, int, int]],
    group: Any,
) -> list[torch.Tensor]:
    """One batch of point-to-point ops on ``group``: each ``(tensor, peer, tag)`` of
    ``sends`` sent to ``peer``, and for each ``(like, peer, tag)`` of ``recvs`` a tensor
    shaped as ``like`` received from ``peer`` (returned in that order). Peers are ranks in
    ``group``; messages between two ranks match in order and by tag. Every send and
    receive is waited on before it returns.

    One op, ``autoshard::p2p_exchange`` (:func:`_p2p_exchange_op`), which the launcher's
    collective log counts and a lowered step records as one node. Not torch's
    ``_c10d_functional.batch_p2p_ops``: in torch 2.13 each call of it leaves a work
    registered, and with it its buffers, until the process ends, however its outputs are
    waited on (``torch._C._distributed_c10d._get_work_registry_size()`` grows by one a
    call): a ring would keep every key/value block it ever passed."""
    return torch.ops.autoshard.p2p_exchange(
        [t.contiguous() for t, _, _ in sends],
        [p for _, p, _ in sends],
        [g for _, _, g in sends],
        [t for t, _, _ in recvs],
        [p for _, p, _ in recvs],
        [g for _, _, g in recvs],
        group.group_name,
    )


@torch.library.custom_op("autoshard::p2p_exchange", mutates_args=())
def _p2p_exchange_op(
    sends: list[torch.Tensor],
    send_peers: list[int],
    send_tags: list[int],
    likes: list[torch.Tensor],
    recv_peers: list[int],
    recv_tags: list[int],
    group_name: str,
) -> list[torch.Tensor]:
    """:func:`p2p_exchange`'s op: ``torch.distributed.batch_isend_irecv`` on the group
    named ``group_name`` (peers are its ranks), every work waited on."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in likes]
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(group, p), group, g)
        for t, p, g in zip(sends, send_peers, send_tags, strict=True)
    ] + [
        dist.P2POp(dist.irecv, t, dist.get_global_rank(group, p), group, g)
        for t, p, g in zip(received, recv_peers, recv_tags, strict=True)
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


@_p2p_exchange_op.register_fake
def _(sends, send_peers, send_tags, likes, recv_peers, recv_tags, group_name):  # noqa: ANN001
    return [torch.empty_like(t) for t in likes]


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, through torch's functional collectives (as
    :func:`all_to_all_uneven`: DTensor's, seen by the launcher's collective log and recorded
    by a lowered step); a new tensor, waited on before it returns."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(x.contiguous(), "sum", group))


def all_reduce_max(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The elementwise maximum of ``x`` over ``group``'s ranks, as :func:`all_reduce_sum`."""
    import torch.distributed._functional_collectives as fc

    return fc.wait_tensor(fc.all_reduce(x.contiguous(), "max", group))


def all_gather_dim(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """``x`` from every rank of ``group``, concatenated along tensor dim ``dim`` in rank
    order, through torch's functional collectives (as :func:`all_reduce_sum`)."""
    import torch.distributed._functional_collectives as fc

    front = x.movedim(dim, 0).contiguous()  # all_gather_single gathers along dim 0
    return fc.wait_tensor(fc.all_gather_single(front, 0, group)).movedim(0, dim)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, each rank keeping its block of tensor dim
    ``dim`` (rank order), through torch's functional collectives (as :func:`all_reduce_sum`)."""
    import torch.distributed._functional_collectives as fc

    front = x.movedim(dim, 0).contiguous()  # as all_gather_dim: along dim 0
    return fc.wait_tensor(fc.reduce_scatter_single(front, "sum", 0, group)).movedim(0, dim)
