"""autoshard's public Python API: what the command line does, as functions.

On a model you built (docs/python.md):

    import autoshard
    result = autoshard.solve(model, (input_ids,), mesh="2x4")
    result.plan.parameters                 # FQN -> placements, one per mesh dim
    autoshard.save(result, "solutions")    # the solution pickle and the sharding map

On a model file, as the CLI does:

    from autoshard.api import MeshSpec, SolveConfig, plan_mesh, write_outputs

    config = SolveConfig(model_path=Path("examples/gpt2.py"), mesh=MeshSpec.from_options("2x4"))
    result = plan_mesh(config)             # trace, strategies, hand-written plans, the ILP
                                           # (over the column cap: a lifted plan, improved)
    print(result.plan.step_time_s)         # predicted seconds per step
    write_outputs(result.plan, Path("solutions"), "gpt2_2x4", config.cost_model(),
                  result.solver_stats())   # the solution pickle and the sharding map

Everything here is imported from the package that owns it (docs/architecture.md); names
not listed in ``__all__`` are internal and may change.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from autoshard.calibrate import load_profile
from autoshard.cost.collectives import CommModel, comm_model
from autoshard.cost.devices import DEFAULT_DEVICE, DEVICES, DeviceSpec, get_device
from autoshard.cost.mesh import MeshSpec, node_shapes, parse_mesh_shape, respects_nodes
from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.launch.apply import Applied, apply
from autoshard.model.model_file import loaded_from_module
from autoshard.pipeline.pricing import StagesResult, layer_map, plan_pipeline
from autoshard.pipeline.search import search_shapes_and_depths
from autoshard.plan.export import write_outputs
from autoshard.plan.formats import load_sharding_map, load_solution
from autoshard.plan.plan import Plan
from autoshard.solver.baselines import TWO_D_ONLY
from autoshard.solver.compare import ComparedPlan, compare_plans
from autoshard.solver.meshes import MeshSearch, plan_mesh
from autoshard.solver.options import COMPARED, SolverOptions
from autoshard.solver.preload import plan_preloaded
from autoshard.solver.solve import (
    SolveConfig,
    SolveResult,
    plan_baseline,
    plan_model,
    strategies,
    trace,
)
from autoshard.solver.space import plan_space

__all__ = [
    "DEVICES",
    "Applied",
    "AutoshardError",
    "ComparedPlan",
    "CommModel",
    "DeviceSpec",
    "MemoryBudgetError",
    "MeshSearch",
    "MeshSpec",
    "Plan",
    "PlanOptions",
    "SolveConfig",
    "SolveResult",
    "SolverOptions",
    "StagesResult",
    "apply",
    "comm_model",
    "compare",
    "compare_plans",
    "get_device",
    "load_sharding_map",
    "load_solution",
    "plan_baseline",
    "plan_mesh",
    "plan_model",
    "plan_pipeline",
    "plan_preloaded",
    "save",
    "solve",
    "stages",
    "write_outputs",
]


@dataclass(frozen=True)
class PlanOptions:
    """The options :func:`solve`, :func:`compare` and :func:`stages` share: each takes them
    as keywords (``autoshard.solve(model, x, mode="infer")``) or as one value
    (``options=PlanOptions(mode="infer")``; keywords given beside it replace its fields).

    Attributes:
        mode: ``"train"`` (one step: forward, backward, AdamW) or ``"infer"``.
        device: a name from :data:`DEVICES` (``"h100"``, ``"a100"``, ...); default
            :data:`~autoshard.cost.devices.DEFAULT_DEVICE`, an H100 at the rates one reached.
        memory_budget: bytes per device (default: the device's memory less a margin).
        precision: ``"model"``, ``"fp32"``, ``"bf16-mixed"`` or ``"fp16-mixed"``.
        time_limit: wall-clock seconds for the ILP search (default: none; the search
            stops at :class:`SolverOptions`'s work limit, the same plan on every run).
        solver: the search's options (:class:`SolverOptions`: work limit, MIP gap);
            ``time_limit``, when given, replaces its wall-clock limit.
        tie: one plan for identical middle blocks (fast); ``False`` plans each block
            (``stages`` always does).
        loss_fn: ``loss_fn(output, *inputs) -> scalar`` for training (default: the mean
            of the first floating output, as for a model file without one).
        name: the model's name in reports and file names (default: its class name).
        share_reshardings: reads of one tensor in one phase and block that want the same
            placement pay one resharding (``--share-reshardings``; docs/cost-model.md).
        context_parallel: attention may also be sharded by sequence
            (``--context-parallel``; :mod:`autoshard.strategies.attention`): ``True``
            (its keys and values all-gathered or passed around a ring, plain or in the
            zig-zag layout, whichever the search finds fastest), ``"all-gather"``,
            ``"ring"`` or ``"zigzag"`` (that exchange only).
        profile: a profile from ``autoshard calibrate`` (docs/calibrate.md): its measured
            links and device replace the datasheet's (``mesh`` must then be the shape it
            was measured on, given as a string, and ``device`` is not read). A profile of
            one device (``calibrate --mesh 1``) replaces the device only, on any mesh and
            with ``gpus=``.
        checkpoint_early_stop: a recomputed block reruns its forward only up to the last
            op its backward reads, as non-reentrant ``torch.utils.checkpoint`` does
            (``--checkpoint-early-stop``, the default); ``False``: its whole forward, as
            reentrant checkpointing (Megatron-LM's) runs it.
        optimizer: the AdamW implementation each parameter's step is priced as
            (``--optimizer``): ``"adamw-fused"`` (one kernel, the default) or
            ``"adamw-foreach"`` (PyTorch's foreach passes, torchtitan's default).
        fsdp_version: the FSDP that runs the ``fsdp`` and ``fsdp_tp`` plans
            (``--fsdp-version``; :mod:`autoshard.plan.fsdp_runtime`): ``2``
            (``fully_shard``, the default) or ``1`` (``FullyShardedDataParallel``); their
            price adds the copies it makes around each collective.
        grad_accumulation: micro-batches per step (``--grad-accumulation``): the inputs
            split into that many along dim 0, each with its forward, backward and
            collectives, then one optimizer step; memory is one micro-batch's.
    """

    mode: str = "train"
    device: str = DEFAULT_DEVICE
    memory_budget: float | None = None
    precision: str = "model"
    time_limit: float | None = None
    solver: SolverOptions | None = None
    tie: bool = True
    loss_fn: Any = None
    name: str | None = None
    profile: str | Path | None = None
    share_reshardings: bool = False
    context_parallel: bool | str = False
    checkpoint_early_stop: bool = True
    optimizer: str = "adamw-fused"
    fsdp_version: int = 2
    grad_accumulation: int = 1


def _options(where: str, options: PlanOptions | None, keywords: dict[str, Any]) -> PlanOptions:
    """``options`` with ``keywords`` in place of its fields.

    Raises:
        TypeError: a keyword that is no :class:`PlanOptions` field (Python's error for an
            unknown keyword argument), naming the ones there are.
    """
    names = [f.name for f in fields(PlanOptions)]
    unknown = sorted(set(keywords) - set(names))
    if unknown:
        raise TypeError(
            f"autoshard.{where}() got unknown option(s) {', '.join(unknown)}; "
            f"the options are {', '.join(names)} (autoshard.api.PlanOptions)"
        )
    return replace(options or PlanOptions(), **keywords)


def solve(
    model: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...] | torch.Tensor,
    mesh: str | MeshSpec | None = None,
    *,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
    pp: Sequence[int] = (),
    microbatches: int = 8,
    space: str = "free",
    options: PlanOptions | None = None,
    **keywords: Any,
) -> SolveResult:
    """Plan ``model`` (built in Python, best on the meta device: ``with
    torch.device("meta"): model = ...``) for ``example_inputs`` (global shapes) on ``mesh``:
    the same trace, strategies, cost model and ILP as ``autoshard solve``.

    The model is traced on a copy (tracing may cast it and cut its repeated blocks), so a
    model with real weights is copied once; yours is left as it was, but in ``eval()``
    mode.

    Args:
        model: the ``nn.Module``; its ``forward`` takes ``example_inputs`` positionally.
        example_inputs: tensors with the global batch's shapes (a single tensor is fine).
        mesh: ``"2x4"`` (the default links, :mod:`autoshard.cost.mesh`: the last dim inside a
            node) or a :class:`MeshSpec`;
            default ``"2x4"`` unless ``gpus`` is given. A mesh whose ILP has more than
            ``solver.max_columns`` columns (default
            :data:`~autoshard.solver.options.MESH_SEARCH_COLUMNS`) is planned as ``gpus``
            plans such a shape (:func:`autoshard.solver.meshes.plan_mesh`).
        gpus: in place of ``mesh``: plan every mesh shape of this many GPUs that respects
            the node boundary (:func:`autoshard.cost.mesh.node_shapes`) and return the
            fastest; ``result.meshes`` ranks them all (``.rows``: mesh, plan or error).
        gpus_per_node: devices per node (a dim inside a node gets the intra-node links,
            one across nodes the inter-node links): with ``gpus`` (default 8), of every
            shape tried; with ``mesh`` given as a shape (``"4x2x8"``), the mesh's ranks
            laid over such nodes as ``gpus`` lays that shape (``--mesh 4x2x8
            --gpus-per-node 8``); with a :class:`MeshSpec`, the nodes it was laid over
            (its links are its own). Without it, ``mesh`` keeps dim 0 across nodes and
            the rest inside one.
        pp: with ``gpus``: pipeline depths (each 2 or more) ranked beside the mesh
            shapes (``--pp 2,4``; :mod:`autoshard.pipeline.search`): each a stage plan
            over the leading dims of a shape, a 1F1B schedule of ``microbatches`` (a
            deep model's layers split as torchtitan splits them, a shallow one's
            searched as :func:`stages` searches them). The returned plan stays the
            fastest without stages; ``result.meshes.fastest`` is the fastest row, and a
            pipeline's row holds its stage plan (``.stages.stage_plan``; ``.pp`` its
            depth), or, skipped because its stages' LP bounds cannot beat the best
            plan, that bound (``.bound_s``).
        microbatches: with ``pp``: micro-batches per step (they must divide the batch).
        space: ``"free"`` (the ILP over every DTensor strategy) or ``"torchtitan"`` (the
            fastest plan FSDP2 and ``parallelize_module`` express, which
            :func:`autoshard.apply` and ``autoshard export`` run as planned;
            :mod:`autoshard.solver.space`).
        options, keywords: the planning options, :class:`PlanOptions` (``mode``,
            ``device``, ``memory_budget``, ``precision``, ``time_limit``, ``solver``,
            ``tie``, ``loss_fn``, ``name``, ``profile``).

    Returns:
        A :class:`SolveResult`: ``.plan`` (placements by FQN in ``.parameters``, the time
        split, ``.memory_by_kind()``, ``.mfu``), ``.ilp`` (status, gap), ``.seconds``.

    Raises:
        AutoshardError: bad inputs, an untraceable model, no plan within the budget, both
            ``mesh`` and ``gpus`` (or ``gpus`` with a profile of several devices),
            ``pp`` without ``gpus`` or with a depth below 2, an unknown space.
        TypeError: an unknown keyword.
    """
    opts = _options("solve", options, keywords)
    links_profile = opts.profile is not None and not load_profile(opts.profile).device_only
    if gpus is not None and (mesh is not None or links_profile):
        given = "mesh" if mesh is not None else "profile"
        raise AutoshardError(f"gpus= tries every mesh shape with the default links; drop {given}=")
    if pp and gpus is None:
        raise AutoshardError(
            "pp= tries pipeline depths beside the mesh shapes of gpus=: give gpus= (for "
            "one mesh, use autoshard.stages)"
        )
    if any(d < 2 for d in pp):  # before the search, not after it
        raise AutoshardError(f"pp={tuple(pp)}: each pipeline depth must be >= 2")
    if gpus is None and gpus_per_node is not None and links_profile:
        raise AutoshardError("profile= sets each mesh dim's links as measured; drop gpus_per_node=")
    if isinstance(mesh, str) and gpus_per_node is not None:
        mesh = _on_nodes(parse_mesh_shape(mesh), gpus_per_node)
    config = _config(model, example_inputs, str(gpus) if gpus else (mesh or "2x4"), opts)
    if gpus is not None:
        per_node = 8 if gpus_per_node is None else gpus_per_node
        shapes = node_shapes(gpus, per_node)
        meshes = [MeshSpec.on_nodes(shape, per_node) for shape in shapes]
        depths = list(dict.fromkeys(pp))
        search = search_shapes_and_depths(
            config, meshes, depths, microbatches, per_node, space=space
        )
        return search.best.result
    if space == "free":  # over the column cap: planned as the mesh search plans it
        return plan_mesh(config, gpus_per_node=gpus_per_node)
    return plan_space(config, space)


def _on_nodes(shape: tuple[int, ...], gpus_per_node: int) -> MeshSpec:
    """``shape`` laid row-major over nodes of ``gpus_per_node`` (as ``solve --mesh SHAPE
    --gpus-per-node K``).

    Raises:
        AutoshardError: not a whole number of nodes, or a dim split between a node and
            the network (:func:`~autoshard.cost.mesh.respects_nodes`).
    """
    n = math.prod(shape)
    if (n > gpus_per_node and n % gpus_per_node) or not respects_nodes(shape, gpus_per_node):
        raise AutoshardError(
            f"mesh {'x'.join(map(str, shape))} over nodes of gpus_per_node={gpus_per_node} "
            "is not whole nodes, or splits a mesh dim between a node and the network: give "
            "a shape whose every dim lies inside a node or across whole nodes"
        )
    return MeshSpec.on_nodes(shape, gpus_per_node)


def _config(model, example_inputs, mesh, opts: PlanOptions) -> SolveConfig:  # noqa: ANN001
    """The :class:`SolveConfig` of a module built in Python (what :func:`solve` takes)."""
    loaded = loaded_from_module(model, example_inputs, opts.name, opts.loss_fn)
    if opts.profile is not None:
        measured = load_profile(opts.profile)
        chip = measured.device_spec()
        if measured.device_only:  # one device measured: its rates, the mesh's own links
            spec = mesh if isinstance(mesh, MeshSpec) else MeshSpec.from_options(mesh)
        elif not isinstance(mesh, str):
            raise AutoshardError(
                'with profile=, give mesh as its shape ("2x4"): the profile sets the links'
            )
        else:
            spec = measured.mesh(parse_mesh_shape(mesh))
    else:
        spec = mesh if isinstance(mesh, MeshSpec) else MeshSpec.from_options(mesh)
        chip = get_device(opts.device)
    solver = opts.solver or SolverOptions()
    if opts.time_limit is not None:
        solver = replace(solver, time_limit_s=opts.time_limit)
    return SolveConfig(
        model_path=Path(f"<{loaded.name}>"),
        mesh=spec,
        device=chip,
        solver=solver,
        mode=opts.mode,
        memory_budget=opts.memory_budget,
        tie=opts.tie,
        precision=opts.precision,
        share_reshardings=opts.share_reshardings,
        context_parallel=opts.context_parallel,
        checkpoint_early_stop=opts.checkpoint_early_stop,
        optimizer=opts.optimizer,
        fsdp_version=opts.fsdp_version,
        grad_accumulation=opts.grad_accumulation,
        model=loaded,
    )


def compare(
    model: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...] | torch.Tensor,
    mesh: str | MeshSpec = "2x4",
    *,
    plans: tuple[str, ...] | str | None = None,
    options: PlanOptions | None = None,
    **keywords: Any,
) -> list[ComparedPlan]:
    """The ILP's plan beside the hand-written ones (``autoshard compare``) for a module
    built in Python; the options are :func:`solve`'s (:class:`PlanOptions`).

    Args:
        plans: which, a sequence or ``"ilp,ddp"`` (default: ``ilp``, ``replicate``,
            ``ddp``, ``fsdp``, ``megatron``, ``megatron_sp``, on a mesh of 2+ dims
            ``fsdp_tp``, and ``torchtitan``: the fastest plan of that space).

    Returns:
        One :class:`ComparedPlan` per plan, in that order: ``.plan`` (or ``.error``),
        ``.fits`` the memory budget, ``.best`` the fastest that fits.

    Raises:
        AutoshardError: bad inputs or an unknown plan name.
        TypeError: an unknown keyword.
    """
    config = _config(model, example_inputs, mesh, _options("compare", options, keywords))
    if plans is None:
        plans = tuple(a for a in COMPARED if config.mesh.ndim > 1 or a not in TWO_D_ONLY)
    elif isinstance(plans, str):  # "ilp,ddp", as the command line takes it
        plans = tuple(a.strip() for a in plans.split(",") if a.strip())
    return compare_plans(config, strategies(config, trace(config)), tuple(plans))


def stages(
    model: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...] | torch.Tensor,
    mesh: str | MeshSpec = "2x2x2",
    *,
    pp: int = 2,
    microbatches: int = 8,
    options: PlanOptions | None = None,
    **keywords: Any,
) -> StagesResult:
    """Pipeline stages (``autoshard stages --pp PP``) for a module built in Python: the
    layers split into ``pp`` stages over the leading mesh dims, each stage with its
    intra-op plan on the submesh, for a 1F1B schedule of ``microbatches``; the options
    are :func:`solve`'s (:class:`PlanOptions`; every block is planned: ``tie`` is not read).

    Returns:
        A :class:`StagesResult`: ``.stage_plan`` (``.stages``, ``.step_time_s``) and
        ``.costs`` (the per-layer pricing).

    Raises:
        AutoshardError: bad inputs, a ``pp`` that does not split the mesh or exceeds the
            layers, no split within the memory budget.
        TypeError: an unknown keyword.
    """
    opts = replace(_options("stages", options, keywords), tie=False)
    config = _config(model, example_inputs, mesh, opts)
    config = replace(config, activation_checkpointing="none")  # as `autoshard stages`
    graph = trace(config, microbatches=microbatches)
    return plan_pipeline(config, graph, layer_map(graph), pp, microbatches, opts.memory_budget)


def save(result: SolveResult, out_dir: str | Path = "solutions") -> tuple[Path, Path]:
    """Write ``result``'s solution pickle and sharding map into ``out_dir`` (created), as
    ``autoshard solve`` names them (``<model>_<mesh>.pkl`` / ``.json``); returns the two
    paths. ``autoshard launch`` runs the map with a model file for the same model; the
    same as ``result.save(out_dir)``."""
    return result.save(out_dir)
