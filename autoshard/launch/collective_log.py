"""Which collectives really ran, by kind and mesh dim.

``torch.distributed.tensor.debug.CommDebugMode`` counts collectives by kind only. To
compare a run with the plan per mesh dim, :class:`CollectiveLog` is a
``TorchDispatchMode`` that sees the functional collectives DTensor issues
(``_c10d_functional.all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``,
``all_to_all_single``, and DTensor's own ``_dtensor.shard_dim_alltoall``) and reads the
mesh dim from the process group each one names. The launcher counts with both and
requires their totals by kind to agree.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoshard._torch_private import TorchDispatchMode, flatten_mesh_groups
from autoshard.cost.collective_table import LAUNCH_OPS

_NAMESPACES = ("_c10d_functional", "_dtensor", "autoshard")  # autoshard::p2p_exchange


def collective_kind(op: Any) -> str | None:
    """The kind sharding maps predict (``all_gather``, ``all_reduce``, ...) of a
    functional collective op (an ``OpOverload``), else ``None``."""
    ns = getattr(op, "namespace", "")
    name = getattr(getattr(op, "_overloadpacket", None), "__name__", "")
    return LAUNCH_OPS[name] if ns in _NAMESPACES and name in LAUNCH_OPS else None


def group_dims(mesh: DeviceMesh) -> dict[str, int | tuple[int, ...]]:
    """Process group name -> the mesh dim it runs on, or the dims of a flattened group
    (:func:`autoshard._torch_private.flatten_mesh_groups`, which the launcher calls before
    a run; here the same call only looks them up)."""
    dims: dict[str, int | tuple[int, ...]] = {
        mesh.get_group(i).group_name: i for i in range(mesh.ndim)
    }
    dims.update(flatten_mesh_groups(mesh))
    return dims


class CollectiveLog(TorchDispatchMode):
    """Counts the collectives issued under it, keyed ``(kind, mesh dim)``, a collective
    over a flattened group of mesh dims with the dims, a tuple (:func:`group_dims`).

    Use as a context manager; :meth:`take` returns and clears the counts. A collective on
    any other group is keyed with mesh dim ``-1``.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.dims = group_dims(mesh)
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself into collectives first
        kwargs = kwargs or {}
        kind = collective_kind(func)
        if kind is not None:
            group = next(
                (a for a in (*args, *kwargs.values()) if isinstance(a, str) and a in self.dims),
                None,
            )
            self.counts[(kind, self.dims.get(group, -1) if group else -1)] += 1
        return func(*args, **kwargs)

    def take(self) -> Counter:
        """The counts so far, cleared."""
        out, self.counts = self.counts, Counter()
        return out
