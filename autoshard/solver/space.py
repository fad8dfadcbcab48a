"""torchtitan's search space (``autoshard solve --space torchtitan``): the plans that FSDP2
and ``parallelize_module`` express, each priced as it runs, the fastest that fits.

A torchtitan user does not choose a placement per op. They choose, per mesh dim, what it
does, and the styles fix the parameters; DTensor's propagation places every activation
(torchtitan's ``parallelize_llama``: ``dp_replicate`` x ``dp_shard`` x ``tp``, FSDP2 per
block, Megatron's ``ColwiseParallel``/``RowwiseParallel`` pairs on the tensor-parallel dim).
The space here is what those choices make on the plan's mesh (:func:`layouts`):

- **tensor parallelism** on the last mesh dim when it has 2+ devices (the ``megatron``
  plan's dim, inside a node, as torchtitan puts it), or none. Its styles are Megatron's
  pairs as the ``megatron`` hand plan finds them
  (:func:`autoshard.solver.tensor_parallel.find_tensor_parallel`), read back as
  ``parallelize_module`` styles (:func:`autoshard.plan.styles.style_plan`): only modules the
  built-in styles shard (``nn.Linear``, ``nn.Embedding``), only whole attention heads;
- **data parallelism** on every other dim of 2+ devices: the first ``k`` replicate
  parameters (DDP, HSDP's replica groups) and the rest shard them (FSDP2 over one flattened
  group), ``k`` from none to all; each parameter sharded on its first tensor dim that the
  group divides and tensor parallelism does not split (``shard_placement_fn``), the inputs
  split on the batch (a layout whose batch does not split over all its data-parallel dims
  has no plan);
- **activation checkpointing** of every block (torchtitan's ``full``; the export wraps
  each block in ``checkpoint_wrapper``) under ``--activation-checkpointing full``; under
  ``auto``, only for a layout that does not fit without it.

Each point is priced by DTensor's propagation from its pinned parameters and inputs
(:func:`autoshard.solver.baselines.pinned`, what ``autoshard export`` prices), not by the
restricted ILP: the ILP would place activations as DTensor never does, and its price
would not be what the exported styles run. The point's plan is read back as styles and
must give every parameter the same placement (:func:`_styles_of_plan`), so every plan
this space returns exports with no difference from the plan.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.plan.formats import ShardingMap
from autoshard.plan.plan import Plan
from autoshard.plan.styles import COLWISE, StylePlan, style_plan
from autoshard.solver.baselines import pinned, run_baseline
from autoshard.solver.restriction import placeholders, shard_dim0
from autoshard.solver.solve import (
    SolveConfig,
    SolveResult,
    finish_plan,
    plan_model,
    strategies,
    trace,
    unsolved_result,
)
from autoshard.strategies.graph import StrategyGraph
from autoshard.trace.tracer import TracedGraph
from autoshard.units import format_bytes

SPACES: tuple[str, ...] = ("free", "torchtitan")
"""``--space``: ``free`` (every DTensor strategy of every op, the ILP's) or ``torchtitan``."""

Placements = tuple[Placement, ...]
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Layout:
    """One point of the space before checkpointing: what each mesh dim does.

    ``dp_replicate`` / ``dp_shard``: the data-parallel mesh dims that replicate / shard
    parameters; ``tp_dim``: the tensor-parallel mesh dim, or None.
    """

    dp_replicate: tuple[int, ...]
    dp_shard: tuple[int, ...]
    tp_dim: int | None

    @property
    def name(self) -> str:
        """``fsdp``, ``ddp``, ``hsdp``, each ``+tp``; ``tp`` alone; ``single`` (no dims)."""
        if self.dp_shard:
            dp = "hsdp" if self.dp_replicate else "fsdp"
        else:
            dp = "ddp" if self.dp_replicate else ""
        tp = "tp" if self.tp_dim is not None else ""
        return "+".join(x for x in (dp, tp) if x) or "single"


def layouts(mesh_shape: tuple[int, ...]) -> list[Layout]:
    """Every :class:`Layout` of the mesh: tensor parallelism on the last mesh dim (when it
    has 2+ devices: the ``megatron`` plan's dim, inside a node) or none; the other dims of
    2+ devices data parallel, the first ``k`` replicating (``k`` from 0).

    On ``2x4``: ``fsdp``, ``hsdp``, ``ddp`` (over both dims), ``fsdp+tp``, ``ddp+tp``.
    """
    sized = [d for d, n in enumerate(mesh_shape) if n > 1]
    last = len(mesh_shape) - 1
    out: list[Layout] = []
    for tp in [None, *([last] if mesh_shape[last] > 1 else [])]:
        dp = [d for d in sized if d != tp]
        for k in range(len(dp) + 1):
            out.append(Layout(tuple(dp[:k]), tuple(dp[k:]), tp))
    return out


@dataclass
class SpacePoint:
    """One priced point: ``name`` (the layout's, ``+ac`` when every block recomputes), its
    ``layout``, its ``plan`` (or the ``error`` that kept it from being made), whether it
    ``fits`` the budget, and its ``styles`` (what ``autoshard export`` writes for it)."""

    name: str
    layout: Layout
    checkpointing: bool = False
    plan: Plan | None = None
    styles: StylePlan | None = None
    fits: bool = False
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain builtins for the solution's solver statistics and ``--json``."""
        p = self.plan
        return {
            "name": self.name,
            "step_time_s": None if p is None else float(p.step_time_s),
            "memory_bytes": None if p is None else float(p.memory_bytes),
            "fits": self.fits,
            "error": self.error,
        }


def _fsdp_dim(shape: tuple[int, ...], group: int, tp: Placement | None, tp_size: int) -> int:
    """The tensor dim FSDP shards a parameter of ``shape`` on over ``group`` devices: its
    first dim that ``group`` divides and tensor parallelism does not split (so that the
    gather is over the data-parallel dims alone, as FSDP2's strided shard of a
    tensor-parallel parameter is), else the split dim when ``group`` divides its local size
    (FSDP2 shards the local tensor), else 0 (FSDP2 pads an uneven dim 0)."""
    split = tp.dim if isinstance(tp, Shard) else None
    whole = [k for k, n in enumerate(shape) if k != split and n % group == 0]
    if whole:
        return whole[0]
    if split is not None and (shape[split] // tp_size) % group == 0:
        return split
    return 0


def _point_map(
    sg: StrategyGraph,
    params: dict[str, torch.Size],
    layout: Layout,
    tp_placements: dict[str, Placements] | None,
    dim_names: tuple[str, ...] | None,
) -> ShardingMap:
    """The parameter and input placements ``layout`` gives (before the styles read them)."""
    mesh = tuple(sg.mesh_shape)
    group = math.prod(mesh[d] for d in layout.dp_shard)
    t = layout.tp_dim
    parameters: dict[str, Placements] = {}
    for name, shape in params.items():
        ps: list[Placement] = [Replicate()] * len(mesh)
        if t is not None and tp_placements is not None:
            ps[t] = tp_placements[name][t]
        if layout.dp_shard and len(shape):
            k = _fsdp_dim(tuple(shape), group, ps[t] if t is not None else None, mesh[-1])
            for d in layout.dp_shard:
                ps[d] = Shard(k)
        parameters[name] = tuple(ps)
    dp = sorted(layout.dp_replicate + layout.dp_shard)
    inputs = {
        sg.graph.nodes[rep].fqn or rep: shard_dim0(
            tuple(sg.graph.nodes[rep].results[0].shape), mesh, dp
        )
        for rep in placeholders(sg, "input")
    }
    return ShardingMap(mesh, dim_names, parameters, inputs, source=f"layout {layout.name}")


def _styles_of_plan(model: nn.Module, plan: Plan, dim_names: tuple[str, ...] | None) -> StylePlan:
    """The styles ``autoshard export`` reads from ``plan`` (its sharding map)."""
    smap = ShardingMap(
        tuple(plan.mesh.shape),
        dim_names,
        {k: tuple(v) for k, v in plan.parameters.items()},
        {k: tuple(v) for k, v in plan.inputs.items()},
        source="the plan",
    )
    return style_plan(model, smap)


def _model(config: SolveConfig) -> nn.Module:
    """The model on the meta device, every block (the styles name every parameter)."""
    if config.model is not None:
        return config.model.module
    return instantiate(load_model_file(config.model_path), device="meta").module


def _megatron_placements(
    config: SolveConfig, sg: StrategyGraph
) -> tuple[dict[str, Placements] | None, str | None]:
    """The ``megatron`` plan's parameter placements (the tensor-parallel styles' source),
    or None and why there is none."""
    try:
        megatron = run_baseline(sg, "megatron", config.mesh)
    except AutoshardError as exc:
        return None, f"no Megatron pairs to style: {exc}"
    return finish_plan(config, sg, megatron.choice, "megatron").parameters, None


def search_space(
    config: SolveConfig, sg: StrategyGraph, progress: Progress | None = None
) -> tuple[SpacePoint, list[SpacePoint]]:
    """The fastest point of torchtitan's space on ``config.mesh`` that fits its budget, and
    every point priced (in :func:`layouts` order, each with and without checkpointing as
    the option allows). ``sg``: the strategies of ``config``; ``progress``: ``(phase,
    done, total)``, called with ``"space"`` once per layout.

    A data-parallel group over several mesh dims (FSDP over all of a 2x4 mesh) runs as one
    FSDP2 process group; each of its collectives is priced as one ring over the flattened
    group or one collective per mesh dim in turn, whichever is cheaper for the tensor
    (:mod:`autoshard.cost.collectives`, ``CommModel._merged``), the choice the launcher
    walks too.

    Raises:
        MemoryBudgetError: no point fits (the message names the one needing least memory).
        AutoshardError: no point could be made at all (each point's reason).
    """
    model = _model(config)
    params = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    budget = config.budget()
    todo = layouts(tuple(sg.mesh_shape))
    tp_placements, tp_error = None, None
    if any(lay.tp_dim is not None for lay in todo):
        tp_placements, tp_error = _megatron_placements(config, sg)
    ck = sg.checkpointing
    modes = [False] if ck is None or not ck.blocks else [True] if ck.fixed else [False, True]
    # a layout that recomputes does so as --activation-checkpointing says (auto: in full)
    points: list[SpacePoint] = []
    for i, layout in enumerate(todo):
        if progress:
            progress("space", i, len(todo))
        for recompute in modes:
            if recompute and len(modes) == 2 and (points[-1].fits or points[-1].plan is None):
                continue  # auto: recompute only a layout whose plan does not fit without
            point = SpacePoint(layout.name + ("+ac" if recompute else ""), layout, recompute)
            points.append(point)
            if layout.tp_dim is not None and tp_placements is None:
                point.error = tp_error
                continue
            _price(point, config, sg, model, params, tp_placements)
            point.fits = point.plan is not None and point.plan.memory_bytes <= budget * (1 + 1e-9)
    if progress:
        progress("space", len(todo), len(todo))
    made = [p for p in points if p.plan is not None]
    if not made:
        raise AutoshardError(
            "no plan of the torchtitan space could be made: "
            + "; ".join(f"{p.name}: {p.error}" for p in points)
        )
    fitting = [p for p in made if p.fits]
    if not fitting:
        least = min(made, key=lambda p: p.plan.memory_bytes)
        raise MemoryBudgetError(
            f"no plan of the torchtitan space fits {format_bytes(budget)} per device; the "
            f"least memory is {least.name}'s {format_bytes(least.plan.memory_bytes)}: raise "
            "--memory-budget, use more devices, or search the free space (--space free)",
            least.plan.memory_bytes,
        )
    best = min(fitting, key=lambda p: p.plan.step_time_s)  # the first of equals: simplest
    return best, points


def _price(  # noqa: PLR0913
    point: SpacePoint,
    config: SolveConfig,
    sg: StrategyGraph,
    model: nn.Module,
    params: dict,
    tp_placements: dict[str, Placements] | None,
) -> None:
    """Make ``point``'s plan (DTensor's propagation from its styles' pins) into
    ``point.plan`` and ``point.styles``, or say in ``point.error`` why it cannot be."""
    layout = point.layout
    names = tuple(config.mesh.dim_names)
    try:
        styles = style_plan(model, _point_map(sg, params, layout, tp_placements, names))
    except AutoshardError as exc:
        point.error = str(exc)
        return
    roles = (styles.tp_dim, styles.dp_replicate, styles.dp_shard)
    if roles != (layout.tp_dim, layout.dp_replicate, layout.dp_shard):
        point.error = (  # e.g. a data-parallel dim the batch does not split over
            f"the inputs {', '.join(f'{k} {tuple(v)}' for k, v in styles_inputs(sg).items())} "
            f"do not split their batch over every data-parallel dim of mesh "
            f"{config.mesh.shape_str}"
        )
        return
    if styles.unrunnable:
        point.error = f"the styles would split attention heads ({styles.unrunnable[0]})"
        return
    if layout.tp_dim is not None and not styles.tp:
        point.error = (
            "no module has a built-in tensor-parallel style (nn.Linear / nn.Embedding in "
            "Megatron's pairs; HF's Conv1D has none)"
        )
        return
    inputs = _point_map(sg, {}, layout, None, names).inputs
    tp_styles = {m: "column" if s == COLWISE else "row" for m, (s, _) in styles.tp.items()}
    pins = pinned(
        sg, styles.placements, inputs, frozenset(layout.dp_shard), tp_styles, layout.tp_dim
    )
    try:
        found = run_baseline(sg, point.name, config.mesh, config.solver, pins=pins)
    except AutoshardError as exc:
        point.error = str(exc)
        return
    ck = sg.checkpointing
    recompute = ck.of_policy(ck.fixed or "full") if point.checkpointing else None
    plan = finish_plan(config, sg, found.choice, f"torchtitan {point.name}", recompute)
    back = _styles_of_plan(model, plan, names)
    moved = [k for k, v in inputs.items() if tuple(plan.inputs.get(k, v)) != tuple(v)]
    if back.differences or moved:
        what = (
            f"parameter {back.differences[0][0]} placed {back.differences[0][1]}"
            if back.differences
            else f"input {moved[0]} placed {''.join(map(str, plan.inputs[moved[0]]))}"
        )
        point.error = f"DTensor's propagation departs from the styles ({what})"
        return
    point.plan, point.styles = plan, back
    plan.extra.setdefault("notes", []).extend(found.notes)


def styles_inputs(sg: StrategyGraph) -> dict[str, tuple[int, ...]]:
    """Each input's global shape, by name (for messages)."""
    return {
        sg.graph.nodes[rep].fqn or rep: tuple(sg.graph.nodes[rep].results[0].shape)
        for rep in placeholders(sg, "input")
    }


def plan_space(
    config: SolveConfig,
    space: str,
    progress: Progress | None = None,
    graph: TracedGraph | None = None,
    sg: StrategyGraph | None = None,
) -> SolveResult:
    """``solve --space torchtitan``: the fastest plan FSDP2 and ``parallelize_module``
    express that fits (:func:`search_space`), on the same graph and cost model; every point
    priced is in ``plan.extra["space"]``. ``space="free"`` is
    :func:`~autoshard.solver.solve.plan_model`. ``graph``: the model already traced, and
    ``sg`` its strategies already built, as for ``plan_model``.

    Raises:
        AutoshardError: an unknown space, or as :func:`search_space`.
    """
    if space not in SPACES:
        raise AutoshardError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    if space == "free":
        return plan_model(config, progress, graph, sg)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    if graph is None:
        graph = trace(config, progress)
        seconds["trace"] = time.perf_counter() - t
    if sg is None:
        t = time.perf_counter()
        sg = strategies(config, graph, progress)
        seconds["strategies"] = time.perf_counter() - t
    t = time.perf_counter()
    best, points = search_space(config, sg, progress)
    seconds["space"] = time.perf_counter() - t
    plan = best.plan
    plan.extra["space"] = {
        "name": space,
        "chosen": best.name,
        "points": [p.to_dict() for p in points],
    }
    status = f"space {space} ({best.name})"
    return unsolved_result(config, graph, sg, plan, seconds, status)
