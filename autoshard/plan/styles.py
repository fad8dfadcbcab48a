"""A plan as torchtitan users write one: ``parallelize_module`` styles and FSDP2 groups.

torchtitan (and anyone using ``torch.distributed.tensor.parallel``) writes 2-D parallelism
as a *tensor-parallel plan*, module FQN -> ``ColwiseParallel`` / ``RowwiseParallel``, on
one mesh dim, and FSDP2 ``fully_shard`` (or replication, DDP-style) over the data-parallel
dim, one group per transformer block and one for the root. :func:`style_plan` reads that
out of a sharding map's parameter placements:

- A mesh dim on which the inputs are batch-sharded is a *data-parallel dim*: FSDP if the
  plan shards parameters there (``shard_placement_fn`` keeps the plan's tensor dim), DDP if
  it keeps them replicated (HSDP with a shard group of one: every gradient all-reduced).
  Several data-parallel dims run as torchtitan's ``dp_replicate`` x ``dp_shard`` mesh:
  the replicating dims (outer) form one group, the sharding dims (inner) another, each
  group's adjacent mesh dims flattened into one (HSDP: FSDP2's 2-D mesh; FSDP or DDP over
  the whole group when one of them is empty).
- Another mesh dim is the *tensor-parallel dim*. There a ``nn.Linear`` whose weight
  (``out x in``) is ``S(0)`` is ``ColwiseParallel`` (bias ``S(0)``), ``S(1)``
  ``RowwiseParallel`` (bias ``R``); an ``nn.Embedding`` ``S(0)`` is ``RowwiseParallel``
  (vocab-parallel, ``input_layouts=Replicate()``), ``S(1)`` ``ColwiseParallel`` (its output
  gathered). A row-parallel linear takes its input as the column-parallel siblings in its
  parent module leave it (sharded on features: Megatron's pair, Shoeybi et al. 2019,
  section 3; attention's q/k/v and o_proj, an MLP's gate/up and down); with no such sibling
  it takes a replicated input. A column-parallel linear with no row-parallel sibling to
  feed returns its output gathered (``output_layouts=Replicate()``). Other module types
  (HF's ``Conv1D`` in GPT-2) get no style: their parameters are listed as differences.
- Every other parameter is replicated on the tensor-parallel dim.

What the styles place is compared with the plan parameter by parameter; every difference
(a norm's weight sharded, a bias placed unlike its weight, a third mesh dim) is listed in
:attr:`StylePlan.differences`: the styles are then an approximation of the plan, whose
activation placements are DTensor's propagation, not the ILP's (``autoshard launch`` runs
the plan's own graph).
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from autoshard.errors import AutoshardError
from autoshard.model.blocks import find_block_prefixes
from autoshard.placements import short
from autoshard.plan.formats import ShardingMap
from autoshard.plan.show import natural_key
from autoshard.trace.selective import early_stops

COLWISE, ROWWISE = "ColwiseParallel", "RowwiseParallel"


@dataclass
class StylePlan:
    """What :func:`style_plan` found.

    Attributes:
        tp_dim: the mesh dim (index) of tensor parallelism, or None.
        dp_replicate: the data-parallel mesh dims that replicate parameters (DDP, or
            HSDP's replica groups), in mesh order.
        dp_shard: the data-parallel mesh dims FSDP shards parameters over, in mesh order.
        tp: module FQN -> ``(style, kwargs)``, kwargs as text (``input_layouts=Replicate()``).
        shard_dims: parameter FQN -> the tensor dim FSDP shards (``fsdp`` only).
        groups: module FQNs given their own FSDP group (the repeated blocks), root last
            (``""``).
        differences: ``(parameter FQN, planned, applied)`` placements, one per parameter the
            styles place otherwise than the plan.
        placements: parameter FQN -> the placements the styles give it (one per mesh dim).
        unrunnable: why the styles cannot run on the model's own code (a column-parallel
            projection whose shard is not a whole number of attention heads: the model
            reshapes its local output by ``head_dim``).
        recompute: the blocks (FQNs) the plan recomputes in the backward (the map's
            ``predicted.recomputed_blocks``), wrapped in ``checkpoint_wrapper`` as
            torchtitan's activation checkpointing wraps its blocks.
        selective: the blocks (FQNs) the plan recomputes selectively (the map's
            ``predicted.selective_blocks``), wrapped with torchtitan's op-level policy
            (:func:`autoshard.trace.selective.context_fn`).
        early_stop: per policy (``"full"``, ``"selective"``), whether a recomputed block's
            forward reruns only up to the last op its backward reads (the map's
            ``predicted.checkpoint_early_stop``; a map from before it as it was priced:
            :func:`autoshard.trace.selective.early_stops`), passed to
            ``torch.utils.checkpoint`` (``early_stop=False`` otherwise).
    """

    tp_dim: int | None
    dp_replicate: tuple[int, ...] = ()
    dp_shard: tuple[int, ...] = ()
    tp: dict[str, tuple[str, dict[str, str]]] = field(default_factory=dict)
    shard_dims: dict[str, int] = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)
    differences: list[tuple[str, str, str]] = field(default_factory=list)
    placements: dict[str, tuple[Placement, ...]] = field(default_factory=dict)
    unrunnable: list[str] = field(default_factory=list)
    blocks: list[str] = field(default_factory=list)  # the repeated blocks' FQNs, in order
    container: str | None = None  # the module whose children are exactly the blocks
    recompute: list[str] = field(default_factory=list)  # blocks checkpointed, in order
    selective: list[str] = field(default_factory=list)  # blocks checkpointed selectively
    # torch.utils.checkpoint's early stop per policy (False: the whole forward)
    early_stop: dict[str, bool] = field(default_factory=lambda: {"full": True, "selective": True})

    @property
    def dp_dims(self) -> tuple[int, ...]:
        """Every data-parallel mesh dim (the inputs' batch is split over them), in order."""
        return tuple(sorted(self.dp_replicate + self.dp_shard))

    @property
    def dp_dim(self) -> int | None:
        """The one data-parallel mesh dim, or None (none, or several: :attr:`dp_dims`)."""
        return self.dp_dims[0] if len(self.dp_dims) == 1 else None

    @property
    def dp_mode(self) -> str | None:
        """``"fsdp"`` (parameters sharded on every data-parallel dim), ``"ddp"``
        (replicated on every one), ``"hsdp"`` (both), or None (no data parallelism)."""
        if self.dp_shard:
            return "hsdp" if self.dp_replicate else "fsdp"
        return "ddp" if self.dp_replicate else None

    def block_layout(self) -> BlockLayout | None:
        """The styles as one plan per block, when every block is styled and sharded alike
        and the blocks are all the children of one module (``model.layers``); else None."""
        blocks = self.blocks
        if self.container is None or len(blocks) < 2:
            return None

        def inside(names, block: str) -> dict[str, str]:
            return {n[len(block) + 1 :]: n for n in names if n.startswith(block + ".")}

        def of_block(block: str) -> tuple[dict, dict]:
            tp = {k: self.tp[n] for k, n in inside(self.tp, block).items()}
            dims = {k: self.shard_dims[n] for k, n in inside(self.shard_dims, block).items()}
            return tp, {k: d for k, d in dims.items() if d}

        first = of_block(blocks[0])
        if any(of_block(b) != first for b in blocks[1:]):
            return None
        in_block = tuple(b + "." for b in blocks)
        return BlockLayout(
            container=self.container,
            layer_plan=first[0],
            shard_dims=first[1],
            root_tp={n: st for n, st in self.tp.items() if not n.startswith(in_block)},
            root_shard_dims={
                n: d for n, d in self.shard_dims.items() if d and not n.startswith(in_block)
            },
        )

    def folded_tp(self) -> dict[str, tuple[str, dict[str, str]]]:
        """``tp`` with the repeated blocks folded: ``layers.*.mlp.up_proj`` for an entry
        every block has alike (``parallelize_module`` matches ``*`` per FQN atom)."""
        blocks = [g for g in self.groups if g]
        if len(blocks) < 2:
            return dict(self.tp)
        container = blocks[0].rsplit(".", 1)[0] if "." in blocks[0] else ""
        per_block: dict[str, list[tuple[str, tuple]]] = {}
        rest: dict[str, tuple[str, dict[str, str]]] = {}
        for fqn, style in self.tp.items():
            block = next((b for b in blocks if fqn.startswith(b + ".")), None)
            if block is None:
                rest[fqn] = style
            else:
                key = fqn[len(block) + 1 :]
                per_block.setdefault(key, []).append((block, (style[0], tuple(style[1].items()))))
        out: dict[str, tuple[str, dict[str, str]]] = {}
        star = f"{container}.*" if container else "*"
        for key, entries in per_block.items():
            kinds = {e[1] for e in entries}
            if len(entries) == len(blocks) and len(kinds) == 1:
                style, kw = next(iter(kinds))
                out[f"{star}.{key}"] = (style, dict(kw))
            else:
                for block, (style, kw) in entries:
                    out[f"{block}.{key}"] = (style, dict(kw))
        return {**rest, **out}


@dataclass(frozen=True)
class BlockLayout:
    """:meth:`StylePlan.block_layout`: what torchtitan's loop over blocks applies.

    ``container``: the module FQN whose children are the blocks. ``layer_plan``: block-
    relative module name -> ``(style, kwargs)``, one dict for every block.
    ``shard_dims``: block-relative parameter name -> the tensor dim FSDP shards, where not
    0. ``root_tp`` and ``root_shard_dims``: the same outside the blocks, by FQN.
    """

    container: str
    layer_plan: dict[str, tuple[str, dict[str, str]]]
    shard_dims: dict[str, int]
    root_tp: dict[str, tuple[str, dict[str, str]]]
    root_shard_dims: dict[str, int]


_ELSEWHERE = (
    "run this plan with `autoshard launch`, or solve with `--space torchtitan` for one that "
    "export writes"
)


def _roles(smap: ShardingMap) -> tuple[int | None, list[int]]:
    """(tp_dim, data-parallel dims): a mesh dim the inputs are batch-sharded on is data
    parallel; at most one other dim of 2+ devices, the tensor-parallel one."""
    n = len(smap.mesh_shape)
    sized = [d for d in range(n) if smap.mesh_shape[d] > 1]
    batch = [
        d
        for d in sized
        if any(isinstance(ps[d], Shard) and ps[d].dim == 0 for ps in smap.inputs.values())
    ]
    others = [d for d in sized if d not in batch]
    if len(others) > 1:
        raise AutoshardError(
            f"{smap.source}: torchtitan styles shard the batch on the data-parallel mesh "
            f"dims and take at most one other (tensor-parallel) dim; this plan's mesh "
            f"{'x'.join(map(str, smap.mesh_shape))} has {len(others)} dims of 2+ devices "
            f"that do not shard the inputs' batch; {_ELSEWHERE}"
        )
    return (others[0] if others else None), batch


def _fsdp_dim(placements: list[Placement]) -> int:
    """The tensor dim FSDP shards a parameter planned as ``placements`` on the sharding
    dims: the plan's own when every such dim shards that one tensor dim, else 0."""
    dims = {p.dim if isinstance(p, Shard) else None for p in placements}
    return dims.pop() if len(dims) == 1 and None not in dims else 0


def style_plan(model: nn.Module, smap: ShardingMap) -> StylePlan:
    """The torchtitan styles of ``smap`` for ``model`` (its parameters' FQNs as the map's).

    Raises:
        AutoshardError: the map names a parameter the model lacks (or the reverse), has
            more than one tensor-parallel mesh dim, or data-parallel dims FSDP2 cannot group
            (:func:`_check_groups`).
    """
    params = dict(model.named_parameters(remove_duplicate=False))  # tied aliases too
    missing = sorted(set(smap.parameters) ^ set(params))
    if missing:
        raise AutoshardError(
            f"{smap.source} and the model differ in parameters ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}): solve again for this model"
        )
    tp_dim, dp_dims = _roles(smap)
    applied: dict[str, list[Placement]] = {
        name: [Replicate()] * len(smap.mesh_shape) for name in params
    }
    sp = StylePlan(tp_dim)
    if tp_dim is not None:
        _tensor_parallel(model, smap, tp_dim, sp, applied)
    if dp_dims:
        # per dim: FSDP where the plan shards most parameters, DDP where it replicates them
        def shards(d: int) -> bool:
            sharded = [n for n in params if isinstance(smap.parameters[n][d], Shard)]
            return len(sharded) * 2 > len(params)

        sp.dp_shard = tuple(d for d in dp_dims if shards(d))
        sp.dp_replicate = tuple(d for d in dp_dims if not shards(d))
        _check_groups(smap, sp)
        if sp.dp_shard:
            for name in params:
                k = _fsdp_dim([smap.parameters[name][d] for d in sp.dp_shard])
                sp.shard_dims[name] = k
                for d in sp.dp_shard:
                    applied[name][d] = Shard(k)
        sp.groups = [*sorted(find_block_prefixes(model), key=natural_key), ""]
    sp.blocks = sorted(find_block_prefixes(model), key=natural_key)
    sp.container = _block_container(model)
    recomputed = smap.predicted.get("recomputed_blocks") or []
    selective = smap.predicted.get("selective_blocks") or []
    block_of = {i: fqn for fqn, i in find_block_prefixes(model).items()}  # by its number
    if any(b not in block_of for b in [*recomputed, *selective]):
        raise AutoshardError(
            f"{smap.source} recomputes blocks {sorted([*recomputed, *selective])} but the "
            f"model's blocks are numbered {sorted(block_of)}: solve again for this model"
        )
    sp.recompute = [block_of[b] for b in sorted(recomputed)]
    sp.selective = [block_of[b] for b in sorted(selective)]
    sp.early_stop = early_stops(smap.predicted)
    for name in params:
        planned, got = tuple(smap.parameters[name]), tuple(applied[name])
        sp.placements[name] = got
        if planned != got:
            sp.differences.append((name, short(planned), short(got)))
    return sp


def _check_groups(smap: ShardingMap, sp: StylePlan) -> None:
    """FSDP2 takes a 1-D mesh (FSDP) or a 2-D ``(replicate, shard)`` one (HSDP): each group
    of data-parallel dims must be adjacent mesh dims, the replicating ones first.

    Raises:
        AutoshardError: a group split by another mesh dim, or sharding dims outside the
            replicating ones (the message names the dims).
    """
    sized = [d for d in range(len(smap.mesh_shape)) if smap.mesh_shape[d] > 1]
    for kind, dims in (("replicating", sp.dp_replicate), ("sharding", sp.dp_shard)):
        if dims and sized.index(dims[-1]) - sized.index(dims[0]) != len(dims) - 1:
            raise AutoshardError(
                f"{smap.source}: the data-parallel dims {kind} parameters ({list(dims)}) are "
                f"not adjacent mesh dims, which FSDP2 cannot group; {_ELSEWHERE}"
            )
    if sp.dp_replicate and sp.dp_shard and sp.dp_shard[0] < sp.dp_replicate[-1]:
        raise AutoshardError(
            f"{smap.source}: parameters are sharded on mesh dim {sp.dp_shard[0]} and "
            f"replicated on the inner dim {sp.dp_replicate[-1]}; FSDP2's HSDP replicates on "
            f"the outer dims; {_ELSEWHERE}"
        )


def _block_container(model: nn.Module) -> str | None:
    """The FQN of the module whose children are exactly the repeated blocks, or None."""
    blocks = set(find_block_prefixes(model))
    if len(blocks) < 2:
        return None
    container = next(iter(blocks)).rpartition(".")[0]
    children = {
        f"{container}.{k}" if container else k
        for k, _ in model.get_submodule(container).named_children()
    }
    return container if children == blocks else None


def _tensor_parallel(
    model: nn.Module, smap: ShardingMap, d: int, sp: StylePlan, applied: dict
) -> None:
    role: dict[str, str] = {}
    for fqn, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            p = smap.parameters[f"{fqn}.weight"][d]
            if isinstance(p, Shard):
                linear = isinstance(mod, nn.Linear)
                role[fqn] = (
                    (COLWISE if p.dim == 0 else ROWWISE)
                    if linear
                    else (ROWWISE if p.dim == 0 else COLWISE)
                )
    modules = dict(model.named_modules())
    for fqn, style in role.items():
        mod = modules[fqn]
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        siblings = [
            (f, modules[f])
            for f in role
            if f != fqn and (f.rsplit(".", 1)[0] if "." in f else "") == parent
        ]
        kwargs: dict[str, str] = {}
        if isinstance(mod, nn.Embedding):  # vocab- or feature-parallel, whole tokens in and out
            kwargs["input_layouts"] = "Replicate()"
            if style == COLWISE:
                kwargs["output_layouts"] = "Replicate()"
        elif style == ROWWISE:
            # Megatron's pair: the column-parallel siblings (q/k/v, gate/up) feed it
            if not any(role[f] == COLWISE for f, _ in siblings):
                kwargs["input_layouts"] = "Replicate()"
        elif not any(role[f] == ROWWISE for f, _ in siblings):
            kwargs["output_layouts"] = "Replicate()"  # no row-parallel sibling to feed
        head_dim = getattr(modules.get(parent), "head_dim", None)
        if (
            style == COLWISE
            and isinstance(mod, nn.Linear)
            and isinstance(head_dim, int)
            and head_dim > 0
            and (mod.out_features // smap.mesh_shape[d]) % head_dim
        ):
            sp.unrunnable.append(
                f"{fqn}: {mod.out_features} features over {smap.mesh_shape[d]} devices is "
                f"not a whole number of heads of {head_dim}"
            )
        sp.tp[fqn] = (style, kwargs)
        weight_dim = 0 if (style == COLWISE) == isinstance(mod, nn.Linear) else 1
        applied[f"{fqn}.weight"][d] = Shard(weight_dim)
        if isinstance(mod, nn.Linear) and mod.bias is not None and style == COLWISE:
            applied[f"{fqn}.bias"][d] = Shard(0)


@dataclass(frozen=True)
class MeshGroup:
    """One dim of the mesh the styles run on: adjacent plan mesh dims flattened.

    ``name``: its mesh dim name; ``size``: its devices; ``dims``: the plan's mesh dims it
    stands for, outer first (empty for the shard group of one device that DDP runs as).
    """

    name: str
    size: int
    dims: tuple[int, ...]


def styles_mesh_groups(
    sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]
) -> list[MeshGroup]:
    """The mesh the styles run on, one :class:`MeshGroup` per dim: the plan's mesh dims in
    order, the replicating data-parallel dims flattened into one dim and the sharding ones
    into another (a group of one plan dim keeps its name; several are named by joining
    theirs with ``_``); after a replicating group with no sharding one, a ``<name>_shard``
    dim of one device (FSDP2's HSDP with a shard group of one: every gradient all-reduced,
    as DDP does). A flattened group holds the same devices in the same order as its plan
    dims (``torch.arange(n).reshape(mesh_shape)``)."""
    groups: list[MeshGroup] = []
    for d in range(len(mesh_shape)):
        group = sp.dp_replicate if d in sp.dp_replicate else sp.dp_shard
        if d in group and d != group[0]:
            continue  # flattened into its group's first dim
        dims = group if d in group else (d,)
        name = "_".join(dim_names[g] for g in dims)
        groups.append(MeshGroup(name, math.prod(mesh_shape[g] for g in dims), tuple(dims)))
        if dims == sp.dp_replicate and not sp.dp_shard:
            groups.append(MeshGroup(f"{name}_shard", 1, ()))
    return groups


def styles_mesh(
    sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The shape and dim names of :func:`styles_mesh_groups`."""
    groups = styles_mesh_groups(sp, mesh_shape, dim_names)
    return tuple(g.size for g in groups), tuple(g.name for g in groups)


def dp_mesh_names(
    sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]
) -> tuple[str, ...]:
    """The styles mesh dims FSDP2's ``fully_shard`` takes: the sharding group (FSDP), or
    the replicating and the sharding group (HSDP, DDP as HSDP with a shard of one)."""
    groups = styles_mesh_groups(sp, mesh_shape, dim_names)
    rep = [g.name for g in groups if g.dims and g.dims == sp.dp_replicate]
    shard = [g.name for g in groups if g.dims and g.dims == sp.dp_shard]
    if not sp.dp_shard:
        shard = [f"{rep[0]}_shard"]
    return (*rep, *shard)


def _style_lines(entries: dict[str, tuple[str, dict[str, str]]], indent: str) -> list[str]:
    out = []
    for fqn, (style, kw) in entries.items():
        args = ", ".join(f"{k}={v}" for k, v in kw.items())
        out.append(f"{indent}{fqn!r}: {style}({args}),")
    return out


def _dp_mesh(sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]) -> str:
    names = dp_mesh_names(sp, mesh_shape, dim_names)
    return f"mesh[{names[0]!r}]" if len(names) == 1 else f"mesh[{names[0]!r}, {names[1]!r}]"


def _checkpoint_lines(sp: StylePlan) -> list[str]:
    """Activation checkpointing of the blocks the plan recomputes, before FSDP (torchtitan's
    order: tensor parallelism, checkpointing, FSDP): each block replaced in its parent by
    ``checkpoint_wrapper(block)``, whose parameters keep their names."""
    if not sp.recompute and not sp.selective:
        return []
    comment = "  # recompute each in the backward (torchtitan's activation checkpointing)"
    # the whole forward again where the plan was priced so (torch stops early by default)
    stop = {p: "" if on else ", early_stop=False" for p, on in sp.early_stop.items()}
    lines = []
    if sp.selective:
        lines += [
            f"    for name in ({''.join(f'{b!r}, ' for b in sp.selective).rstrip()}):"
            "  # op-level selective AC: keep attention and every other mm",
            "        parent, _, child = name.rpartition('.')",
            "        block = checkpoint_wrapper(",
            f"            model.get_submodule(name), context_fn=sac_context{stop['selective']}",
            "        )",
            "        model.get_submodule(parent).register_module(child, block)",
        ]
    if not sp.recompute:
        return lines
    if sp.container is not None and sp.recompute == sp.blocks:
        return [
            f"    blocks = model.get_submodule({sp.container!r})",
            f"    for name, block in list(blocks.named_children()):{comment}",
            f"        blocks.register_module(name, checkpoint_wrapper(block{stop['full']}))",
        ]
    return lines + [
        f"    for name in ({''.join(f'{b!r}, ' for b in sp.recompute).rstrip()}):{comment}",
        "        parent, _, child = name.rpartition('.')",
        f"        block = checkpoint_wrapper(model.get_submodule(name){stop['full']})",
        "        model.get_submodule(parent).register_module(child, block)",
    ]


def _looped_body(
    sp: StylePlan, layout: BlockLayout, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]
) -> list[str]:
    """torchtitan's shape: one ``layer_plan`` applied in a loop over the blocks, then the
    root's styles; ``fully_shard`` per block in a second loop, then on the root."""
    lines: list[str] = []
    blocks = f"model.get_submodule({layout.container!r}).children()"
    if sp.tp:
        tp_mesh = f"mesh[{dim_names[sp.tp_dim]!r}]"
        if layout.layer_plan:
            lines.append("    layer_plan = {  # every block alike")
            lines += _style_lines(layout.layer_plan, "        ")
            lines.append("    }")
            lines.append(f"    for block in {blocks}:")
            lines.append(f"        parallelize_module(block, {tp_mesh}, layer_plan)")
        if layout.root_tp:
            lines.append(f"    parallelize_module(model, {tp_mesh}, {{")
            lines += _style_lines(layout.root_tp, "        ")
            lines.append("    })")
    lines += _checkpoint_lines(sp)
    if sp.dp_mode is not None:
        mesh = _dp_mesh(sp, mesh_shape, dim_names)
        block_kw = root_kw = ""
        if layout.shard_dims:
            lines.append(
                "    shard_dims = {  # the tensor dim FSDP shards in each block, where not 0"
            )
            lines += [f"        {k!r}: {v}," for k, v in layout.shard_dims.items()]
            lines.append("    }")
            block_kw = ", shard_placement_fn=placement_fn(block, shard_dims)"
        if layout.root_shard_dims:
            lines.append("    root_shard_dims = {  # the same outside the blocks")
            lines += [f"        {k!r}: {v}," for k, v in layout.root_shard_dims.items()]
            lines.append("    }")
            root_kw = ", shard_placement_fn=placement_fn(model, root_shard_dims)"
        lines.append(f"    for block in {blocks}:  # one FSDP group per block")
        lines.append(f"        fully_shard(block, mesh={mesh}{block_kw})")
        lines.append(f"    fully_shard(model, mesh={mesh}{root_kw})")
    lines.append("    return model")
    if "placement_fn(" in "\n".join(lines):
        lines += [
            "",
            "",
            "def placement_fn(module, shard_dims):",
            '    """FSDP2\'s shard_placement_fn: the tensor dim shard_dims names, else 0."""',
            "    names = {p: n for n, p in module.named_parameters()}",
            "    return lambda p: Shard(shard_dims.get(names[p], 0))",
        ]
    return lines


def _listed_body(
    sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]
) -> list[str]:
    """Blocks styled unlike each other: every style by FQN (folded where alike), every
    FSDP group by name."""
    lines: list[str] = []
    if sp.tp:
        lines.append(f"    parallelize_module(model, mesh[{dim_names[sp.tp_dim]!r}], {{")
        lines += _style_lines(sp.folded_tp(), "        ")
        lines.append("    })")
    fsdp_dims = sp.dp_mode is not None and sp.dp_shard and any(sp.shard_dims.values())
    if fsdp_dims:  # named before any checkpoint wrapper adds its prefix to the names
        lines.append("    names = {p: n for n, p in model.named_parameters()}")
    lines += _checkpoint_lines(sp)
    if sp.dp_mode is not None:
        dp_mesh = _dp_mesh(sp, mesh_shape, dim_names)
        kw = ""
        if fsdp_dims:
            lines.append("    shard_dims = {  # the tensor dim FSDP shards, where not 0")
            lines += [f"        {k!r}: {v}," for k, v in sp.shard_dims.items() if v]
            lines.append("    }")
            lines.append("")
            lines.append("    def placement(p):")
            lines.append("        return Shard(shard_dims.get(names[p], 0))")
            lines.append("")
            kw = ", shard_placement_fn=placement"
        blocks = [g for g in sp.groups if g]
        if blocks:  # one FSDP group per repeated block, as torchtitan groups its layers
            lines.append("    for name in (")
            lines += [f"        {b!r}," for b in blocks]
            lines.append("    ):")
            lines.append(f"        fully_shard(model.get_submodule(name), mesh={dp_mesh}{kw})")
        lines.append(f"    fully_shard(model, mesh={dp_mesh}{kw})")
    lines.append("    return model")
    return lines


_IMPORTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", ("checkpoint_wrapper",)),
    ("autoshard.trace.selective", ("context_fn as sac_context",)),
    ("torch.distributed.device_mesh", ("init_device_mesh",)),
    ("torch.distributed.fsdp", ("fully_shard",)),
    ("torch.distributed.tensor", ("Replicate", "Shard")),
    (
        "torch.distributed.tensor.parallel",
        ("ColwiseParallel", "RowwiseParallel", "parallelize_module"),
    ),
)
"""What :func:`torchtitan_code`'s body may call, by module, in the order it imports them."""


def torchtitan_code(sp: StylePlan, mesh_shape: tuple[int, ...], dim_names: tuple[str, ...]) -> str:
    """Python that applies ``sp`` as a torchtitan user writes it: ``parallelize_module``
    with one ``layer_plan`` in a loop over the blocks (when every block is alike,
    :meth:`StylePlan.block_layout`; else every style by FQN), ``checkpoint_wrapper`` on
    the blocks the plan recomputes, then ``fully_shard`` per block and on the root."""
    lines = ["def parallelize(model, device_type='cuda'):"]
    shape, names = styles_mesh(sp, mesh_shape, dim_names)
    lines.append(
        f"    mesh = init_device_mesh(device_type, {tuple(shape)}, mesh_dim_names={tuple(names)})"
    )
    layout = sp.block_layout()
    if layout:
        lines += _looped_body(sp, layout, mesh_shape, dim_names)
    else:
        lines += _listed_body(sp, mesh_shape, dim_names)
    body = "\n".join(lines)
    header = ["# written by `autoshard export --format torchtitan`"]
    names_used = {n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name)}
    for module, names in _IMPORTS:  # only what the body uses: an FSDP-only plan has no styles
        used = [n for n in names if n.split(" as ")[-1] in names_used]
        if len(used) > 2:
            header += [f"from {module} import (", *(f"    {n}," for n in used), ")"]
        elif used:
            header.append(f"from {module} import {', '.join(used)}")
    return "\n".join(header) + "\n\n\n" + body + "\n"
