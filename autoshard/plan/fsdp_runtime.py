"""The copies FSDP's runtime makes around its collectives: what a plan run by FSDP pays
beyond its reshardings.

A plan's price holds each parameter's all-gather and each gradient's reduction
(:func:`autoshard.plan.plan.build_plan`). PyTorch's FSDP runs more than the collective
around each of them: it casts and copies the shard into the all-gather's buffer, copies
the gathered buffer out into the parameters (FSDP2), copies the gradients into the
reduce-scatter's buffer in the reduce dtype, and divides them (FSDP1). Most passes move
the unsharded bytes of every parameter they touch, on every device (the shard's cast and
copy-in move a shard's): in bf16-mixed with an fp32 reduction on 8 devices, 16.5 bytes per
parameter per step with FSDP2, 20.5 with FSDP1.

The ``fsdp`` and ``fsdp_tp`` plans are run by FSDP (:data:`FSDP_PLANS`), of the version
``--fsdp-version`` names, and so are the torchtitan space's points that shard parameters,
always by FSDP2 (``autoshard export`` writes them as ``fully_shard``): their price adds
these passes (``Plan.fsdp_s``). The ILP's plans are run by autoshard's launcher, whose
DTensor reshardings gather and reduce each tensor in place; they add nothing here.

Bytes per element of one tensor, ``p`` its dtype's size (the compute dtype: bf16 in
bf16-mixed), ``m`` the master copy's (fp32 in mixed precision, else ``p``), ``r`` the
reduce dtype's, from torch 2.13's sources:

FSDP2 (``torch.distributed.fsdp.fully_shard``, ``_fsdp_collectives.py``), per all-gather
of a shard of ``E_s`` elements into ``E_g``:

- ``_get_param_all_gather_inputs``: with mixed precision, ``torch._foreach_copy_`` casts
  the fp32 shard to the param dtype: ``E_s (m + p)``;
- ``all_gather_copy_in``: the shard into its slot of the all-gather's buffer: ``2 E_s p``;
- ``foreach_all_gather_copy_out``: ``split_with_sizes_copy`` of the buffer into each
  parameter: ``2 E_g p``, on the compute stream;

per reduction of a gradient of ``E_g`` elements into ``E_s``:

- ``foreach_reduce_scatter_copy_in``: ``_chunk_cat`` of the gradients into the
  reduce-scatter's buffer in the reduce dtype: ``E_g (p + r)``;
- the reduced shard cast to the master's dtype when ``r != m``: ``E_s (r + m)``. The
  average is NCCL's (``ReduceOp.AVG`` for fp32 and bf16): no division pass.

FSDP1 (``FullyShardedDataParallel``, ``_runtime_utils.py``, ``flat_param.py``), per
all-gather: with mixed precision the flat shard cast into ``_mp_shard``: ``E_s (m + p)``;
the gathered flat parameter is viewed, not copied. Per reduction:

- autograd's backward of the views into the flat parameter (``split``) concatenates the
  gradients into one flat gradient: ``2 E_g p``;
- ``_post_backward_hook`` casts it to the reduce dtype when ``r != p``: ``E_g (p + r)``;
- ``_reduce_grad`` divides it by the predivide factor (``DefaultState.
  _get_gradient_predivide_factor`` of the group's size, above 1 for two ranks or more):
  ``2 E_g r``; the shard by the postdivide factor when it is above 1: ``2 E_s r``;
- the shard cast to the master's dtype when ``r != m``: ``E_s (r + m)``.

Each pass is priced at the device's memory bandwidth (the roofline's byte term, as the
AdamW step is) and added to the step whole. Some run on FSDP's own streams (FSDP1's cast
and divisions on its post-backward stream, FSDP2's copy-in on its all-gather copy-in
stream), beside the compute: a memory-bound kernel there takes the SMs the compute would
have used, so it is priced as if it ran alone, as the compute slowed by a collective
beside it is (:mod:`autoshard.cost.overlap`). ``tests/test_fsdp_runtime.py`` counts these
bytes from the ops PyTorch's FSDP2 and FSDP1 run for one step and holds the price to them.

The passes are counted per all-gather and reduction the plan prices, as its collectives
are: once per read of a parameter that needs it gathered. FSDP gathers a whole wrapped
module at a time, in the forward and again in the backward unless the module is the root
(which keeps its parameters) or is not resharded: the counts agree for a block whose every
parameter its backward reads (a transformer block's weights), and differ for a parameter
the backward does not read (a bias: FSDP gathers it again, the plan does not) and a root
parameter the backward reads (a language model's head: the plan gathers it again, FSDP
does not), by one copy-out each. Not priced: FSDP2's division of an fp16 reduction (an
fp32 or bf16 one is NCCL's average), and the copies' memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from autoshard.cost.liveness import local_bytes, view_base
from autoshard.cost.memory import FP32_MASTER_BYTES
from autoshard.plan.plan import Plan
from autoshard.strategies.hiding import GATHER, GRADIENT
from autoshard.strategies.strategy import local_shape

if TYPE_CHECKING:
    import torch

FSDP_PLANS: frozenset[str] = frozenset({"fsdp", "fsdp_tp"})
"""The hand plans FSDP runs (:mod:`autoshard.solver.baselines`)."""


def fsdp_version_of(name: str, configured: int) -> int | None:
    """The FSDP version that runs the plan named ``name`` (``None``: FSDP does not): a
    hand plan of :data:`FSDP_PLANS` runs ``configured`` (``--fsdp-version``); a point of
    the torchtitan space that shards parameters (``torchtitan fsdp+tp``, ``torchtitan
    hsdp+ac``: :mod:`autoshard.solver.space`) runs FSDP2, which torchtitan and
    ``autoshard export`` write (``fully_shard``)."""
    if name in FSDP_PLANS:
        return configured
    layout = name.removeprefix("torchtitan ").split("+")[0]
    if name.startswith("torchtitan ") and layout in ("fsdp", "hsdp"):
        return 2
    return None


def predivide_factor(world_size: int) -> int:
    """FSDP1's gradient predivide factor for a group of ``world_size`` ranks: the
    smallest power of two ``f`` with ``world_size / f <= f`` or ``world_size % f != 0``
    (torch's ``DefaultState._get_gradient_predivide_factor``); the postdivide factor is
    ``world_size / f``, a fraction where ``f`` does not divide it (6 ranks: 4 and 1.5).
    The group is the parameter's sharding group: an HSDP group's replicas would divide
    by their count too, a plan FSDP1 is not given here (:func:`fsdp_version_of`)."""
    f = 1
    while world_size % f == 0 and world_size / f > f:
        f *= 2
    return f


def gather_bytes(version: int, shard: float, gathered: float, p: int, m: int) -> float:
    """Bytes FSDP ``version`` moves around one all-gather of ``shard`` elements into
    ``gathered`` (module docstring): ``p`` the dtype's size, ``m`` the master copy's."""
    cast = shard * (m + p) if m != p else 0.0
    if version == 1:
        return cast
    return cast + 2 * shard * p + 2 * gathered * p


def reduce_bytes(version: int, unsharded: float, shard: float, p: int, r: int, m: int) -> float:
    """Bytes FSDP ``version`` moves around one reduction of a gradient of ``unsharded``
    elements into ``shard`` (module docstring): ``p`` the gradient's dtype size, ``r`` the
    reduce dtype's, ``m`` the master copy's."""
    to_master = shard * (r + m) if r != m else 0.0
    if version == 2:
        return unsharded * (p + r) + to_master
    world = max(1, round(unsharded / shard))
    pre = predivide_factor(world)
    flatten = 2 * unsharded * p
    cast = unsharded * (p + r) if r != p else 0.0
    post = world / pre  # torch divides when a factor is above 1 (_div_if_needed)
    divide = (2 * unsharded * r if pre > 1 else 0.0) + (2 * shard * r if post > 1 else 0.0)
    return flatten + cast + divide + to_master


def fsdp_copy_bytes(plan: Plan, version: int) -> float:
    """Bytes one device moves per step in FSDP ``version``'s copies around the plan's
    parameter all-gathers and gradient reductions (module docstring), each counted as
    often as the plan runs it (:attr:`~autoshard.plan.plan.Plan.bucketed_moves`). Mixed
    precision (the graph's ``reduce_itemsize`` set) keeps an fp32 master copy and
    reduces in the reduce dtype; otherwise both are the tensor's own dtype."""
    mesh, reduce_itemsize = plan.mesh.shape, plan.sg.reduce_itemsize
    total = 0.0
    for move in plan.bucketed_moves:
        before = float(math.prod(local_shape(move.t.shape, move.src, mesh)))
        after = float(math.prod(local_shape(move.t.shape, move.dst, mesh)))
        item = move.t.itemsize
        master = FP32_MASTER_BYTES if reduce_itemsize else item
        if move.kind == GATHER and after > before:
            total += move.times * gather_bytes(version, before, after, item, master)
        elif move.kind == GRADIENT and before > after:
            r = reduce_itemsize or item
            total += move.times * reduce_bytes(version, before, after, item, r, master)
    return total


def unsharded_parameter_bytes(plan: Plan) -> float:
    """Bytes of parameters FSDP holds unsharded on one device at the step's peak, beyond
    the shards the plan keeps: the root's (the parameters outside the repeated blocks,
    which FSDP does not reshard between the forward and the backward) and two blocks'
    (the one computing and the one it prefetches, one block ahead: at the turn to the
    backward the last block's and the next one's all-gather), each parameter at its
    gathered placement (:attr:`~autoshard.plan.plan.Plan.bucketed_moves`), a block the
    largest one's. PyTorch's ``FSDPMemTracker`` (``torch.distributed._tools``) reports
    this at the peak of an FSDP2 step whose activations peak at that turn
    (``tests/test_fsdp_runtime.py``); FSDP1's root flat parameter and its backward
    prefetch (``BACKWARD_PRE``) are taken to hold the same."""
    graph, mesh = plan.sg.graph, plan.mesh.shape
    gathered: dict[str, tuple[int | None, float]] = {}
    for move in plan.bucketed_moves:
        before = local_bytes(move.t, move.src, mesh)
        after = local_bytes(move.t, move.dst, mesh)
        if move.kind != GATHER or after <= before:
            continue
        param = view_base(graph, move.node)  # a weight gathered as its transpose is itself
        info = graph.nodes.get(param)
        layer = info.layer if info is not None else None
        gathered[param] = (layer, max(after, gathered.get(param, (layer, 0.0))[1]))
    root = sum(b for layer, b in gathered.values() if layer is None)
    blocks: dict[int, float] = {}
    for layer, b in gathered.values():
        if layer is not None:
            blocks[layer] = blocks.get(layer, 0.0) + b
    return root + 2 * max(blocks.values(), default=0.0)


def add_fsdp_copies(
    plan: Plan, version: int, compute_time: Callable[..., float], dtype: torch.dtype
) -> None:
    """Set ``plan.fsdp_bytes`` and ``plan.fsdp_s``: FSDP ``version``'s copies
    (:func:`fsdp_copy_bytes`) at the device's memory bandwidth
    (``compute_time(0, bytes, dtype)``, the roofline's byte term; ``dtype`` the step's)."""
    plan.fsdp_bytes = fsdp_copy_bytes(plan, version)
    plan.fsdp_s = compute_time(0.0, plan.fsdp_bytes, dtype) if plan.fsdp_bytes else 0.0
