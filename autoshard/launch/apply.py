"""``autoshard.apply``: a plan on the user's own eager model, as torchtitan applies its plans.

:func:`apply` turns a sharding map into ``parallelize_module`` styles and FSDP2 groups
(:func:`autoshard.plan.styles.style_plan`) and applies them in place, so that the user's
training loop, ``torch.optim`` optimizer, ``state_dict`` and DCP checkpoints work on
DTensor parameters under their FQNs. A data-parallel dim with replicated parameters runs
as HSDP with a shard group of one device (FSDP2's replication: each gradient all-reduced,
as DDP does), so only public PyTorch APIs are used. Call it on every rank, under torchrun.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autoshard._torch_private import checkpoint_block
from autoshard.cost.mesh import default_dim_names
from autoshard.errors import AutoshardError
from autoshard.plan.formats import ShardingMap, load_sharding_map
from autoshard.plan.styles import (
    COLWISE,
    StylePlan,
    dp_mesh_names,
    style_plan,
    styles_mesh,
    styles_mesh_groups,
)
from autoshard.trace.selective import context_fn as sac

_LAYOUTS = {"Replicate()": Replicate()}


@dataclass
class Applied:
    """What :func:`apply` did.

    Attributes:
        model: the model, parallelized in place (the same object that was passed).
        mesh: the device mesh the styles use (:func:`~autoshard.plan.styles.styles_mesh`:
            adjacent data-parallel dims flattened, a ``<dp>_shard`` dim of one device when
            the data-parallel dims only replicate parameters).
        styles: the tensor-parallel styles and FSDP groups (:class:`StylePlan`), with
            ``differences`` from the plan.
        smap: the sharding map applied.
    """

    model: nn.Module
    mesh: DeviceMesh
    styles: StylePlan
    smap: ShardingMap

    def local_inputs(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of each global input: its batch shard on the data-parallel
        dims (the map's ``S(0)``, split over those dims in mesh order as DTensor nests
        them), the whole tensor on the tensor-parallel dim.

        Raises:
            AutoshardError: a batch the data-parallel dims do not divide.
        """
        if not self.styles.dp_dims:
            return tuple(inputs)
        coordinate = self._plan_coordinate()
        placed = list(self.smap.inputs.values())
        out = []
        for i, x in enumerate(inputs):
            ps = placed[i] if i < len(placed) else None
            dims = [
                d
                for d in self.styles.dp_dims
                if ps is not None and isinstance(ps[d], Shard) and ps[d].dim == 0
            ]
            if not dims:
                out.append(x)  # the plan keeps it whole on the data-parallel dims
                continue
            n, r = 1, 0
            for d in dims:  # the rank's index in the nested split, outer dim first
                n, r = n * self.smap.mesh_shape[d], r * self.smap.mesh_shape[d] + coordinate[d]
            if x.shape[0] % n:
                raise AutoshardError(
                    f"a batch of {x.shape[0]} does not split over {n} data-parallel ranks"
                )
            step = x.shape[0] // n
            out.append(x[r * step : (r + 1) * step])
        return tuple(out)

    def _plan_coordinate(self) -> list[int]:
        """This rank's coordinate on the plan's mesh (one index per plan mesh dim), from its
        coordinate on the styles' mesh, whose dims flatten adjacent plan dims."""
        groups = styles_mesh_groups(self.styles, self.smap.mesh_shape, self._names())
        coordinate = [0] * len(self.smap.mesh_shape)
        for group in groups:
            r = self.mesh[group.name].get_local_rank()
            for d in reversed(group.dims):  # unflatten, inner dim first
                r, coordinate[d] = divmod(r, self.smap.mesh_shape[d])
        return coordinate

    def _names(self) -> tuple[str, ...]:
        return self.smap.dim_names or default_dim_names(len(self.smap.mesh_shape))


def apply(
    model: nn.Module,
    plan: str | os.PathLike[str] | ShardingMap,
    device_mesh: DeviceMesh | None = None,
) -> Applied:
    """Parallelize ``model`` in place as the sharding map ``plan`` says, torchtitan-style.

    Args:
        model: the eager model (real weights, the same on every rank: build it with one
            seed, or load a checkpoint after ``apply``); its parameter FQNs must be the map's.
        plan: a sharding map from ``autoshard solve`` (path or :class:`ShardingMap`).
        device_mesh: the mesh to use, shaped as the map's; default: a new one on
            ``cuda`` (NCCL) when available, else ``cpu`` (gloo).

    Returns:
        :class:`Applied`; its ``styles.differences`` lists each parameter the styles place
        otherwise than the plan (then the run is the styles' approximation of the plan).

    Raises:
        AutoshardError: the map does not fit the model or the mesh, its mesh has more than
            one tensor-parallel dim or data-parallel dims FSDP2 cannot group (not adjacent,
            or sharding outside replicating), or a column-parallel projection would
            split an attention head (run such plans with ``autoshard launch``).
    """
    smap = plan if isinstance(plan, ShardingMap) else load_sharding_map(Path(plan))
    sp = style_plan(model, smap)
    if sp.unrunnable:
        raise AutoshardError(
            f"the styles of {smap.source} would split attention heads ({sp.unrunnable[0]}): "
            "solve for a tensor-parallel size that divides the heads, or run the plan with "
            "`autoshard launch`"
        )
    names = smap.dim_names or default_dim_names(len(smap.mesh_shape))
    if device_mesh is not None and tuple(device_mesh.shape) != tuple(smap.mesh_shape):
        raise AutoshardError(
            f"device_mesh has shape {tuple(device_mesh.shape)}; {smap.source} was solved for "
            f"{tuple(smap.mesh_shape)}"
        )
    mesh = _mesh(smap, sp, names, device_mesh)
    if sp.tp:
        styles = {}
        for fqn, (style, kwargs) in sp.folded_tp().items():
            kw = {k: _LAYOUTS[v] for k, v in kwargs.items()}
            styles[fqn] = ColwiseParallel(**kw) if style == COLWISE else RowwiseParallel(**kw)
        parallelize_module(model, mesh[names[sp.tp_dim]], styles)
    by_param = {id(p): n for n, p in model.named_parameters()}  # before any wrapper
    # torchtitan's order: tensor parallelism, checkpointing, FSDP
    for fqn, policy in [*((f, None) for f in sp.recompute), *((f, sac) for f in sp.selective)]:
        parent, _, child = fqn.rpartition(".")
        model.get_submodule(parent).register_module(
            child,
            checkpoint_block(
                model.get_submodule(fqn),
                policy,
                sp.early_stop["full" if policy is None else "selective"],
            ),
        )
    if sp.dp_mode is not None:
        dp_names = dp_mesh_names(sp, smap.mesh_shape, names)
        dp_mesh = mesh[dp_names[0]] if len(dp_names) == 1 else mesh[dp_names]

        def placement(p: nn.Parameter) -> Shard:
            return Shard(sp.shard_dims.get(by_param.get(id(p), ""), 0))

        for g in sp.groups:
            fully_shard(
                model.get_submodule(g) if g else model,
                mesh=dp_mesh,
                shard_placement_fn=placement if sp.dp_shard else None,
            )
    return Applied(model, mesh, sp, smap)


def _mesh(
    smap: ShardingMap, sp: StylePlan, names: tuple[str, ...], given: DeviceMesh | None
) -> DeviceMesh:
    device = (
        given.device_type if given is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    shape, dim_names = styles_mesh(sp, smap.mesh_shape, names)
    if given is None:
        return init_device_mesh(device, shape, mesh_dim_names=dim_names)
    return DeviceMesh(device, given.mesh.reshape(shape), mesh_dim_names=dim_names)
