"""Check a sharding map against the model and the world size, before any collective."""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.tensor import Placement, Shard

from autoshard.errors import AutoshardError
from autoshard.model.model_file import LoadedModel
from autoshard.placements import short
from autoshard.plan.formats import ShardingMap

_LIST_AT_MOST = 8  # names listed in one error line before "... and N more"


def _count(n: int, singular: str, plural: str | None = None) -> str:
    """``1 parameter``, ``3 parameters``."""
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def listing(names: Sequence[str]) -> str:
    """``a, b, c`` or ``a, b, ... and 12 more``."""
    head = ", ".join(names[:_LIST_AT_MOST])
    more = len(names) - _LIST_AT_MOST
    return f"{head} ... and {more} more" if more > 0 else head


def check_world_size(smap: ShardingMap, world_size: int) -> None:
    """The mesh must have exactly one device per process.

    Raises:
        AutoshardError: ``world_size`` differs from the mesh size; the message names both
            and the torchrun option that fixes it.
    """
    need = smap.world_size
    if world_size != need:
        raise AutoshardError(
            f"the sharding map's mesh {smap.mesh_text} needs {need} processes but torchrun "
            f"started {world_size}; pass --nproc-per-node {need} (or --nnodes N "
            f"--nproc-per-node {need}/N), or solve for a mesh of {world_size} devices"
        )


def check_placements(
    kind: str, name: str, placements: Sequence[Placement], shape: Sequence[int], ndim: int
) -> None:
    """One placement per mesh dim; every ``S(d)`` names a dim the tensor has."""
    if len(placements) != ndim:
        raise AutoshardError(
            f"{kind} {name} has {len(placements)} placement(s) ({short(placements)}) but the "
            f"mesh has {ndim} dim(s); write one placement per mesh dim"
        )
    for p in placements:
        if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):
            raise AutoshardError(
                f"{kind} {name} of shape {tuple(shape)} cannot be sharded as {short(placements)}: "
                f"it has no dim {p.dim}"
            )


def check_plan(smap: ShardingMap, loaded: LoadedModel, model_name: str = "the model") -> None:
    """The map must name exactly the model's parameters and inputs, with valid placements.

    Parameters are named as ``named_parameters(remove_duplicate=False)`` names them, so a
    tied weight appears under each of its names, and all its names must carry the same
    placements (one tensor has one placement).

    Raises:
        AutoshardError: parameters missing from the map and map entries the model lacks
            (listed, in one line); the same for inputs; a placement count that differs
            from the mesh's dims; a shard dim the tensor lacks; tied names placed apart.
    """
    module = loaded.module
    params = list(module.named_parameters(remove_duplicate=False))
    names = [n for n, _ in params]
    missing = sorted(set(names) - set(smap.parameters))
    unknown = sorted(set(smap.parameters) - set(names))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(
                f"{_count(len(missing), 'parameter')} missing from the map: {listing(missing)}"
            )
        if unknown:
            parts.append(
                f"{_count(len(unknown), 'map entry', 'map entries')} that {model_name} lacks: "
                f"{listing(unknown)}"
            )
        raise AutoshardError(
            f"the sharding map does not match {model_name}: {'; '.join(parts)}; "
            "solve again for this model"
        )
    in_names = list(loaded.input_names)
    missing = [n for n in in_names if n not in smap.inputs]
    unknown = sorted(set(smap.inputs) - set(in_names))
    if missing or unknown:
        parts = []
        if missing:
            parts.append(f"input(s) missing from the map: {listing(missing)}")
        if unknown:
            parts.append(f"map input(s) {model_name} does not take: {listing(unknown)}")
        raise AutoshardError(
            f"the sharding map's inputs do not match {model_name} (its inputs: "
            f"{', '.join(in_names)}): {'; '.join(parts)}"
        )
    ndim = len(smap.mesh_shape)
    first_name: dict[int, str] = {}
    for name, p in params:
        check_placements("parameter", name, smap.parameters[name], p.shape, ndim)
        other = first_name.setdefault(id(p), name)
        if other != name and tuple(smap.parameters[other]) != tuple(smap.parameters[name]):
            raise AutoshardError(
                f"tied parameters {other} and {name} are one tensor but the map places them "
                f"differently ({short(smap.parameters[other])} vs {short(smap.parameters[name])})"
                "; give both the same placements"
            )
    for name, x in zip(in_names, loaded.inputs, strict=True):
        check_placements("input", name, smap.inputs[name], x.shape, ndim)
