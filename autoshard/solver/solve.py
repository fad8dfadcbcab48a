"""The ``solve`` pipeline: model file -> trace -> strategies -> ILP -> plan.

Each stage takes the previous stage's typed result. :func:`plan_model` is what
the CLI, the benchmark and the tests call; it does not print (progress goes
through the optional ``progress`` callback) and does not write files.
"""

from __future__ import annotations

import copy
import functools
import resource
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import Replicate

from autoshard import interrupt
from autoshard.cost.checkpointing import MODES as CHECKPOINTING_MODES
from autoshard.cost.checkpointing import POLICIES, Checkpointing
from autoshard.cost.collectives import comm_model
from autoshard.cost.devices import DEFAULT_DEVICE, DeviceSpec, get_device
from autoshard.cost.memory import (
    FP32_MASTER_BYTES,
    LiveMemory,
    MemoryModel,
    memory_by_kind,
    peak_by_kind,
)
from autoshard.cost.mesh import DDP_BUCKET_BYTES, MeshSpec
from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.model.model_file import (
    LoadedModel,
    instantiate,
    load_model_file,
    split_microbatches,
)
from autoshard.plan.export import output_stem, write_outputs
from autoshard.plan.fsdp_runtime import (
    add_fsdp_copies,
    fsdp_version_of,
    unsharded_parameter_bytes,
)
from autoshard.plan.plan import Plan, accumulate, build_plan
from autoshard.solver.baselines import (
    hand_plan_starts,
    keeps_gradient_buffer,
    pinned,
    plan_for_algo,
    run_baseline,
)
from autoshard.solver.highs import RSS_UNIT, HighsWork, processes_peak_bytes, tallying
from autoshard.solver.ilp import ILPResult, check_size, sized_as, solve
from autoshard.solver.options import FSDP_VERSIONS, SolverOptions
from autoshard.strategies.graph import (
    OPTIMIZERS,
    Placements,
    StrategyGraph,
    build_strategy_graph,
)
from autoshard.trace.selective import early_stops
from autoshard.trace.tracer import TracedGraph, reduce_depth, trace_model
from autoshard.units import format_bytes

Progress = Callable[[str, int, int], None]


PRECISIONS: dict[str, torch.dtype | None] = {
    "model": None,
    "fp32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "fp16-mixed": torch.float16,
}
"""``--precision``: the dtype the step computes in (``model``: the model's own dtype)."""


CONTEXT_PARALLEL = {
    "all-gather": "context_parallel",
    "ring": "context_parallel_ring",
    "zigzag": "context_parallel_zigzag",
}
"""``--context-parallel``'s exchanges -> the attention choice's feature
(:mod:`autoshard.strategies.attention`: ``S2`` gathers the keys and values, ``S2r`` passes
them around a ring, ``S2z`` around a ring in the zig-zag layout, balanced under a causal
mask)."""


@dataclass(frozen=True)
class SolveConfig:
    """What to plan and how.

    ``input_placement``: ``"free"`` lets the ILP choose the inputs' placements;
    ``"replicate"`` fixes every input to ``Replicate`` on every mesh dim.
    ``output_placement``: likewise for the outputs (``"free"`` still forbids
    ``Partial``: the plan always pays to reduce outputs).

    The Python API builds it too: each error names the option both ways, as the command
    line spells it and as this field (``--memory-budget (memory_budget) ...``).

    Raises:
        AutoshardError: an option out of its range, or two that contradict each other.
    """

    model_path: Path
    mesh: MeshSpec
    device: DeviceSpec = field(default_factory=lambda: get_device(DEFAULT_DEVICE))
    input_placement: str = "free"
    output_placement: str = "free"
    solver: SolverOptions = field(default_factory=SolverOptions)
    mode: str = "train"
    dtype: torch.dtype | None = None
    memory_budget: float | None = None
    tie: bool = True
    bucket_bytes: float = DDP_BUCKET_BYTES
    overlap: bool = True
    # reads of one tensor in one phase and block that want one placement pay one
    # resharding (autoshard.strategies.sharing); off: each read pays its own
    share_reshardings: bool = False
    # attention may also be sharded by sequence (context parallelism,
    # autoshard.strategies.attention): True (the keys and values all-gathered or passed
    # around a ring, plain or zig-zag, whichever is fastest), "all-gather", "ring" or
    # "zigzag" (that one only); off (False): by batch or heads only
    context_parallel: bool | str = False
    precision: str = "model"
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpointing: str = "auto"
    # a recomputed block reruns its forward up to the last op its backward reads, as
    # non-reentrant torch.utils.checkpoint does (its early stop); False: its whole forward,
    # as reentrant checkpointing (Megatron-LM's) does (autoshard.trace.selective)
    checkpoint_early_stop: bool = True
    # the AdamW implementation each parameter's step is priced as
    # (autoshard.strategies.graph.OPTIMIZERS): PyTorch's fused kernel, or its foreach one
    optimizer: str = "adamw-fused"
    # which FSDP runs the plans FSDP runs (autoshard.solver.options.FSDP_VERSIONS):
    # 2, fully_shard (torchtitan's), or 1, FullyShardedDataParallel; their copies differ
    fsdp_version: int = 2
    # gradient accumulation: each step runs this many micro-batches (the example inputs
    # split along dim 0), forward and backward with their collectives each, and one
    # optimizer step (as Composer's and torchtitan's FSDP run it: the gradients reduced
    # after every micro-batch's backward)
    grad_accumulation: int = 1
    # a model built in Python (autoshard.api.solve) instead of model_path's file; traced
    # on a copy, since tracing may cast it and cut its repeated blocks
    model: LoadedModel | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.grad_accumulation, int) and self.grad_accumulation >= 1):
            raise AutoshardError(
                "--grad-accumulation (grad_accumulation) must be a whole number of "
                f"micro-batches, 1 or more, got {self.grad_accumulation!r}"
            )
        if self.mode == "infer" and self.grad_accumulation > 1:
            raise AutoshardError(
                f"--grad-accumulation (grad_accumulation) {self.grad_accumulation} accumulates "
                "gradients over micro-batches, which --mode infer has not: drop it, or plan "
                "--mode train"
            )
        if self.fsdp_version not in FSDP_VERSIONS:
            raise AutoshardError(
                f"--fsdp-version (fsdp_version) must be one of "
                f"{', '.join(map(str, FSDP_VERSIONS))}, got {self.fsdp_version!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise AutoshardError(
                f"--optimizer (optimizer) must be one of {', '.join(OPTIMIZERS)}, "
                f"got {self.optimizer!r}"
            )
        if self.precision not in PRECISIONS:
            raise AutoshardError(
                f"--precision (precision) must be one of {', '.join(PRECISIONS)}, "
                f"got {self.precision!r}"
            )
        if self.reduce_dtype != torch.float32 and not self.mixed:
            raise AutoshardError(
                "--reduce-dtype (reduce_dtype) applies to mixed precision only: add --precision "
                "bf16-mixed (precision='bf16-mixed')"
            )
        if self.dtype is not None and self.precision != "model":
            raise AutoshardError(
                f"--dtype (dtype) casts the whole step and --precision {self.precision} "
                "(precision) sets it too: give one of them"
            )
        if self.activation_checkpointing not in CHECKPOINTING_MODES:
            raise AutoshardError(
                "--activation-checkpointing (activation_checkpointing) must be one of "
                f"{', '.join(CHECKPOINTING_MODES)}, got {self.activation_checkpointing!r}"
            )
        if self.mode == "infer" and self.activation_checkpointing in ("full", "selective"):
            raise AutoshardError(
                f"--activation-checkpointing (activation_checkpointing) "
                f"{self.activation_checkpointing} recomputes blocks in a training step's "
                "backward pass, which --mode infer has not: drop it, or plan --mode train"
            )
        if self.context_parallel not in (False, True) + tuple(CONTEXT_PARALLEL):
            raise AutoshardError(
                "--context-parallel (context_parallel) must be one of "
                f"{', '.join(CONTEXT_PARALLEL)} (or true: all), got {self.context_parallel!r}"
            )
        if self.mode not in ("train", "infer"):
            raise AutoshardError(f"--mode (mode) must be train or infer, got {self.mode!r}")
        if not self.bucket_bytes >= 0:
            raise AutoshardError(
                f"--bucket-size (bucket_bytes) must be >= 0 bytes, got {self.bucket_bytes}"
            )
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise AutoshardError(
                "--memory-budget (memory_budget) must be a positive size, e.g. 70GiB, got "
                f"{self.memory_budget}"
            )
        for what, value in (("input", self.input_placement), ("output", self.output_placement)):
            if value not in ("free", "replicate"):
                raise AutoshardError(
                    f"--{what}-placement ({what}_placement) must be 'free' or 'replicate', "
                    f"got {value!r}"
                )

    def features(self) -> frozenset[str]:
        """The op rules' optional choices the search offers
        (:attr:`autoshard.strategies.registry.DimChoice.feature`)."""
        if self.context_parallel is True:
            return frozenset(CONTEXT_PARALLEL.values())
        if self.context_parallel:
            return frozenset({CONTEXT_PARALLEL[self.context_parallel]})
        return frozenset()

    def budget(self) -> float:
        """Memory budget per device (bytes): ``memory_budget`` or the device's capacity."""
        return float(self.memory_budget or self.device.memory_bytes)

    @property
    def cast(self) -> torch.dtype | None:
        """What parameters and floating inputs are cast to while tracing: ``dtype``, or the
        compute dtype of ``precision`` (``None``: the model's own)."""
        return self.dtype if self.dtype is not None else PRECISIONS[self.precision]

    @property
    def mixed(self) -> bool:
        """Mixed precision: half-precision compute, fp32 master weights and moments."""
        return self.precision.endswith("-mixed")

    def compute_dtype(self, graph: TracedGraph) -> torch.dtype:
        """The dtype the step computes in: the cast when there is one, else the first
        floating-point parameter's (float32 when there is none)."""
        if self.cast is not None:
            return self.cast
        for info in graph.nodes.values():
            if info.kind == "param" and info.results[0].dtype.is_floating_point:
                return info.results[0].dtype
        return torch.float32

    def memory_model(self, plan: str | None = None) -> MemoryModel:
        """What the step keeps (:class:`MemoryModel`): its gradients freed after every
        optimizer step, as autoshard's launcher runs a plan, unless it accumulates them over
        micro-batches or the plan named ``plan`` runs on a system that keeps them
        (:func:`~autoshard.solver.baselines.keeps_gradient_buffer`)."""
        kept = self.grad_accumulation > 1 or (plan is not None and keeps_gradient_buffer(plan))
        return MemoryModel(self.mode, self.mixed, freed_gradients=not kept)

    @classmethod
    def from_solution(cls, model_path: Path, solution: dict[str, Any]) -> SolveConfig:
        """The config a solution was solved with (its ``mesh`` and ``cost_model``), for
        ``model_path``: the inverse of :meth:`cost_model` but for ``tie`` and the solver's
        options, which it does not record (the defaults).

        Raises:
            AutoshardError: the solution lacks its mesh or cost model (a MASE pickle).
        """
        cost = solution.get("cost_model")
        if not cost or "mesh" not in solution:
            raise AutoshardError(
                "the solution names no cost model (a MASE pickle?): solve again with autoshard"
            )
        dtype = cost.get("dtype", "model")
        precision = cost.get("precision", "model")
        if precision != "model":
            dtype = "model"  # the precision's compute dtype, not a cast of its own
        return cls(
            model_path=model_path,
            mesh=MeshSpec.from_dict(solution["mesh"]),
            device=DeviceSpec.from_dict(cost["device"]),
            input_placement=cost.get("input_placement", "free"),
            output_placement=cost.get("output_placement", "free"),
            mode=cost.get("mode", "train"),
            dtype=None if dtype == "model" else getattr(torch, dtype),
            precision=precision,
            reduce_dtype=getattr(torch, cost.get("reduce_dtype", "float32")),
            memory_budget=cost.get("memory_budget_bytes"),
            bucket_bytes=cost.get("bucket_bytes", DDP_BUCKET_BYTES),
            overlap=cost.get("overlap", True),
            share_reshardings=cost.get("share_reshardings", False),
            context_parallel=cost.get("context_parallel", False),
            activation_checkpointing=_stored_checkpointing(cost),
            checkpoint_early_stop=stored_early_stop(cost, solution.get("predicted") or {}),
            optimizer=cost.get("optimizer", "adamw-fused"),  # written before it was an option
            fsdp_version=cost.get("fsdp_version", 2),
            grad_accumulation=int(cost.get("grad_accumulation", 1)),
        )

    def cost_model(self) -> dict[str, Any]:
        """The cost-model parameters, as plain builtins for the solution file."""
        return {
            "device": self.device.to_dict(),
            "mode": self.mode,
            "dtype": str(self.cast).removeprefix("torch.") if self.cast else "model",
            "precision": self.precision,
            "reduce_dtype": str(self.reduce_dtype).removeprefix("torch."),
            "memory_budget_bytes": self.budget(),
            "input_placement": self.input_placement,
            "output_placement": self.output_placement,
            "bucket_bytes": self.bucket_bytes,
            "overlap": self.overlap,
            "share_reshardings": self.share_reshardings,
            "context_parallel": self.context_parallel,
            "activation_checkpointing": self.activation_checkpointing,
            "checkpoint_early_stop": self.checkpoint_early_stop,
            "optimizer": self.optimizer,
            "fsdp_version": self.fsdp_version,
            "grad_accumulation": self.grad_accumulation,
            "mesh": self.mesh.to_dict(),
        }


def _stored_checkpointing(cost: Mapping[str, Any]) -> str:
    """A solution's ``--activation-checkpointing``; an inference solution's is ``auto``
    whatever it stored (a file written before full/selective were refused beside
    ``--mode infer``, where they meant nothing)."""
    stored = cost.get("activation_checkpointing", "auto")
    return "auto" if cost.get("mode", "train") == "infer" else stored


def stored_early_stop(cost: Mapping[str, Any], predicted: Mapping[str, Any]) -> bool:
    """A solution's ``checkpoint_early_stop``; one written before it as it was priced
    (:func:`autoshard.trace.selective.early_stops`: full recomputation the whole forward,
    selective recomputation stopping early; a file with both takes the full policy's)."""
    if "checkpoint_early_stop" in cost:
        return bool(cost["checkpoint_early_stop"])
    stops = early_stops(predicted)
    return stops["full"] if predicted.get("recomputed_blocks") else stops["selective"]


@dataclass
class SolveResult:
    """Everything a solve produced, with the seconds each phase took."""

    config: SolveConfig
    graph: TracedGraph
    sg: StrategyGraph
    ilp: ILPResult
    plan: Plan
    seconds: dict[str, float]
    peak_rss_bytes: int
    highs: HighsWork | None = None  # what HiGHS did in the ILP's search (plan_model)
    # every mesh tried when a GPU count chose this one (autoshard.solver.meshes.MeshSearch)
    meshes: Any = None

    def save(self, out_dir: str | Path = "solutions") -> tuple[Path, Path]:
        """Write the solution pickle and the sharding map into ``out_dir`` (created), named
        as ``autoshard solve`` names them (``<model>_<mesh>.pkl`` / ``.json``); returns the
        two paths.

        Raises:
            AutoshardError: the folder or a file cannot be written.
        """
        stem = output_stem(self.sg.graph.model_name, self.config.mesh.shape, "")
        pkl, smap = write_outputs(
            self.plan, Path(out_dir), stem, self.config.cost_model(), self.solver_stats()
        )
        return Path(pkl), Path(smap)

    def solver_stats(self) -> dict[str, Any]:
        """Solver statistics as plain builtins (for the solution file and the report); the
        objective, its bound and the start's for the step: the ILP prices one of
        ``--grad-accumulation``'s micro-batches, each parameter with its share of the
        optimizer step, so the step is ``n`` times it."""
        d = self.ilp.stats()
        d.pop("algo")
        n = self.config.grad_accumulation
        for key in ("objective_s", "bound_s", "start_objective_s"):
            if n > 1 and isinstance(d.get(key), (int, float)):
                d[key] = d[key] * n
        return d


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (bytes; Linux reports KiB), plus, where
    a mesh search ran HiGHS in processes of its own, the sum of their peaks
    (:func:`autoshard.solver.highs.processes_peak_bytes`): an upper bound on what the
    machine held at once."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RSS_UNIT
    return own + processes_peak_bytes()


def refuse_pipeline_accumulation(config: SolveConfig) -> None:
    """Refuse ``--grad-accumulation`` where a pipeline is planned: its schedule splits the
    batch into its own micro-batches (``--microbatches``) and accumulates over them.

    Raises:
        AutoshardError: ``config.grad_accumulation`` > 1.
    """
    if config.grad_accumulation > 1:
        raise AutoshardError(
            f"--grad-accumulation {config.grad_accumulation} does not apply to a pipeline: its "
            "schedule splits the batch into --microbatches and accumulates over them; drop "
            "--grad-accumulation (or --pp)"
        )


def trace(
    config: SolveConfig,
    progress: Progress | None = None,
    microbatches: int = 1,
    stage_bounds: Callable[[int], Sequence[int] | None] | None = None,
) -> TracedGraph:
    """Load the model file, build it on meta, trace and annotate it.

    With ``microbatches`` > 1 (a pipeline's) or ``config.grad_accumulation`` > 1 the graph
    is that of one micro-batch: every example input split into that many chunks along dim 0
    (as a pipeline schedule, or a training loop accumulating gradients, splits the batch).
    With ``stage_bounds`` (the boundaries of a pipeline split of the model's ``L``
    repeated blocks, from ``L``; or ``None``: every block) the blocks are traced reduced
    within each stage (:func:`~autoshard.trace.tracer.reduce_depth`), whatever
    ``config.tie`` says.

    Raises:
        AutoshardError: a bad model file, an untraceable model, a batch the micro-batches
            do not divide, stage boundaries that do not split the blocks, a pipeline's
            micro-batches beside gradient accumulation.
    """
    if progress:
        progress("trace", 0, 1)
    if config.model is not None:
        given = config.model
        loaded = LoadedModel(
            copy.deepcopy(given.module), given.inputs, given.input_names, given.name, given.loss_fn
        )
    else:
        loaded = instantiate(load_model_file(config.model_path), device="meta")
    if microbatches > 1 or stage_bounds is not None:
        refuse_pipeline_accumulation(config)
    split = max(microbatches, config.grad_accumulation)
    if split > 1:
        option = "--microbatches" if microbatches > 1 else "--grad-accumulation"
        loaded.inputs = split_microbatches(loaded.inputs, split, loaded.input_names, option)[0]
    # identical middle blocks get one plan: trace one for all of them (see reduce_depth)
    if stage_bounds is not None:
        depth = reduce_depth(loaded.module, bounds=stage_bounds)
    else:
        depth = reduce_depth(loaded.module) if config.tie else None
    if config.cast is not None:
        loaded.module.to(config.cast)
        loaded.inputs = tuple(
            x.to(config.cast) if x.is_floating_point() else x for x in loaded.inputs
        )
    graph = trace_model(loaded, config.mode, depth, merge_views=config.share_reshardings)
    if progress:
        progress("trace", 1, 1)
    return graph


def strategies(
    config: SolveConfig, graph: TracedGraph, progress: Progress | None = None
) -> StrategyGraph:
    """Generate, cost and shrink the strategies of ``graph`` for ``config``'s mesh and device."""
    rep = (Replicate(),) * config.mesh.ndim
    bucket = config.bucket_bytes if config.mode == "train" else 0.0
    sg = build_strategy_graph(
        graph,
        config.mesh.shape,
        compute_time=config.device.compute_time,
        redistribute_costs=comm_model(config.mesh).redistribute_costs,
        fixed_inputs=rep if config.input_placement == "replicate" else None,
        fixed_outputs=rep if config.output_placement == "replicate" else None,
        tie=config.tie,
        progress=(lambda d, t: progress("strategies", d, t)) if progress else None,
        bucketed_costs=functools.partial(
            comm_model(config.mesh).bucketed_costs, bucket_bytes=bucket
        ),
        reduce_itemsize=config.reduce_dtype.itemsize if config.mixed else None,
        collective_cost=comm_model(config.mesh).collective,
        share_reads=config.share_reshardings,
        features=config.features(),
        early_stop=config.checkpoint_early_stop,
        optimizer=config.optimizer,
        grad_accumulation=config.grad_accumulation,
        grad_itemsize=FP32_MASTER_BYTES if config.mixed else None,
    )
    sg.bucket_bytes = bucket
    sg.overlap = config.overlap and config.mode == "train"
    if config.mode == "train" and config.activation_checkpointing != "none":
        mode = config.activation_checkpointing
        sg.checkpointing = Checkpointing(sg, fixed=mode if mode in POLICIES else None)
    return sg


def finish_plan(
    config: SolveConfig,
    sg: StrategyGraph,
    choice: dict[str, int],
    name: str,
    recompute: dict[int, int] | None = None,
) -> Plan:
    """:func:`build_plan` plus the training memory kinds and the budget check.
    ``recompute``: real blocks that recompute per traced block's layer (none when absent,
    every one under ``--activation-checkpointing full``). A plan FSDP runs
    (:func:`~autoshard.plan.fsdp_runtime.fsdp_version_of`) in training adds the copies
    that version makes around its collectives, and holds the parameters FSDP keeps
    gathered at the peak (:func:`~autoshard.plan.fsdp_runtime.unsharded_parameter_bytes`).
    With ``config.grad_accumulation`` > 1 the
    plan, built for one micro-batch, is the price of the step's micro-batches and its one
    optimizer step (:func:`~autoshard.plan.plan.accumulate`)."""
    plan = build_plan(sg, choice, config.mesh, name=name, recompute=recompute)
    dtype = config.compute_dtype(sg.graph)
    plan.peak_flops = config.device.peak(dtype)
    version = fsdp_version_of(name, config.fsdp_version)
    if config.mode == "train" and version is not None:
        add_fsdp_copies(plan, version, config.device.compute_time, dtype)
    model = config.memory_model(name)
    mem = memory_by_kind(sg, choice, model, recompute)
    kinds = ("gradients", "optimizer_state", "frozen_fp32_copies")
    plan.extra["memory"] = {k: mem[k] for k in kinds if k in mem}
    if model.gradients_per_point:  # the gradients held at the peak, not all of them
        plan.activation_bytes, held = peak_by_kind(sg, choice, model, recompute)
        plan.extra["memory"]["gradients"] = held
        plan.extra["gradients_per_point"] = True
    if config.mode == "train" and version is not None:  # what FSDP holds gathered
        plan.extra["memory"]["unsharded_parameters"] = unsharded_parameter_bytes(plan)
    accumulate(plan, config.grad_accumulation, lambda b: config.device.compute_time(0.0, b, dtype))
    plan.extra["saved_activations"] = mem.get("saved_activations")
    plan.extra["budget"] = config.budget()
    return plan


def graph_and_strategies(
    config: SolveConfig, progress: Progress | None, seconds: dict[str, float]
) -> tuple[TracedGraph, StrategyGraph]:
    """Trace and generate strategies, timing each into ``seconds``."""
    t = time.perf_counter()
    graph = trace(config, progress)
    seconds["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    sg = strategies(config, graph, progress)
    seconds["strategies"] = time.perf_counter() - t
    return graph, sg


def plan_model(
    config: SolveConfig,
    progress: Progress | None = None,
    graph: TracedGraph | None = None,
    sg: StrategyGraph | None = None,
) -> SolveResult:
    """Run the whole pipeline and return the optimal plan with its statistics.

    ``graph``: ``config``'s model already traced (:func:`trace`; a trace does not depend
    on the mesh), to plan it on another mesh without tracing again; ``sg``: its
    strategies on ``config.mesh`` already built (with ``graph``; their seconds are the
    caller's to count).

    Raises:
        AutoshardError: a bad model file, an untraceable model, an infeasible ILP.
    """
    seconds: dict[str, float] = {}
    if graph is None:
        graph, sg = graph_and_strategies(config, progress, seconds)
    elif sg is None:
        t = time.perf_counter()
        sg = strategies(config, graph, progress)
        seconds["strategies"] = time.perf_counter() - t
    check_size(sg, config.solver, config.mesh)  # before the hand plans' work
    if progress:
        progress("solve", 0, 1)
    t = time.perf_counter()
    starts, _ = hand_plan_starts(sg, config.mesh)  # the ILP is never above a hand plan
    seconds["hand_plans"] = time.perf_counter() - t
    with tallying() as work:
        result = solve_within_memory(sg, config, starts)
    if progress:
        progress("solve", 1, 1)
    seconds["ilp_build"] = result.build_seconds
    seconds["solve"] = result.solve_seconds
    plan = finish_plan(config, sg, result.choice, "ilp", result.recompute)
    seconds["total"] = sum(seconds.values())
    return SolveResult(config, graph, sg, result, plan, seconds, peak_rss_bytes(), work)


BINDING = 0.98
"""``--activation-checkpointing auto`` decides only when the plan that keeps every
activation needs more than this share of the budget (or no such plan fits)."""

NO_RECOMPUTE_START = "ILP without recomputation"

MEMORY_ROUNDS = 12
"""At most this many solves add budget rows (points of the step) a plan overflowed."""

ROWS_PER_ROUND = 4
"""Points added per round: the plan's worst overflowing points, largest first."""


def solve_within_memory(
    sg: StrategyGraph, config: SolveConfig, starts: dict[str, dict[str, int]]
) -> ILPResult:
    """The ILP under the memory budget at every point of the step (lazy rows).

    The liveness rows (:class:`autoshard.cost.memory.LiveMemory`) are too many to give
    HiGHS at once; it starts from the point with the most bytes live at the finest
    sharding, and each plan that overflows the budget at some point gets that point's
    row (its :data:`ROWS_PER_ROUND` worst) and is solved again, within what is left of
    the time limit. Every row is exact, so the plan returned fits the budget at every
    point: its reported memory (:attr:`autoshard.plan.plan.Plan.memory_bytes`) is at most
    the budget. ``ILPResult.memory_rounds`` counts the solves.

    Raises:
        AutoshardError: as :func:`autoshard.solver.ilp.solve` (``MemoryBudgetError`` when
            no plan fits), or no plan fits after :data:`MEMORY_ROUNDS` solves.
    """
    ck = sg.checkpointing
    if ck is not None and ck.blocks and ck.fixed is None:
        # auto: recomputing only costs time, so it can only help where memory binds. Solve
        # without the decision first (its columns, thousands on a large mesh, enlarge the
        # search for nothing where memory does not bind); when that plan is within
        # BINDING of the budget, or none fits, solve again with it, from that plan.
        t0 = time.perf_counter()
        plain = replace(sg, checkpointing=None)
        try:
            first = solve_within_memory(plain, config, starts)
        except MemoryBudgetError:
            first = None
        if first is not None:
            used = LiveMemory(plain, config.memory_model()).per_point(first.choice).max()
            if used < BINDING * config.budget():
                return first
            starts = {**starts, NO_RECOMPUTE_START: first.choice}
        config = replace(config, solver=config.solver.after(time.perf_counter() - t0))
        result = _full_then_selective(sg, config, starts)
        return replace(result, solve_seconds=time.perf_counter() - t0 - result.build_seconds)
    return _solve_rows(sg, config, starts)


FULL_RECOMPUTE_START = "ILP recomputing in full only"


def _full_then_selective(
    sg: StrategyGraph, config: SolveConfig, starts: dict[str, dict[str, int]]
) -> ILPResult:
    """The checkpointing decision with the full policy alone, then (when the graph has
    selective blocks too) with both, from that plan. For one plan, recomputing in full
    frees what selective recomputation frees and more, and holds nothing: when no plan
    fits with the full policy, none fits with both, and the error (its least memory) is
    the full policy's, without the larger program. The cheaper of the two plans is
    returned (the second search may stop within its gap above the first)."""
    ck = sg.checkpointing
    full = ck.only("full")
    if len(full.blocks) == len(ck.blocks):
        return _solve_rows(sg, config, starts)
    t0 = time.perf_counter()
    first = _solve_rows(replace(sg, checkpointing=full), config, starts)
    config = replace(config, solver=config.solver.after(time.perf_counter() - t0))
    both = sized_as(_solve_rows(sg, config, {**starts, FULL_RECOMPUTE_START: first.choice}), first)
    return both if both.objective_s <= first.objective_s else first


def _solve_rows(
    sg: StrategyGraph, config: SolveConfig, starts: dict[str, dict[str, int]]
) -> ILPResult:
    """:func:`solve_within_memory` on ``sg`` as it is (its checkpointing decision
    included)."""
    live = LiveMemory(sg, config.memory_model())
    budget = config.budget()
    points = live.first_points()
    rows = live.rows(points) if points else live.params[None, :]
    t0 = time.perf_counter()
    options = config.solver
    sized: ILPResult | None = None  # the last round that built the program
    for rounds in range(1, MEMORY_ROUNDS + 1):
        interrupt.check()  # Ctrl-C, or the mesh search's thread failed
        result = sized = sized_as(solve(sg, options, memory=(rows, budget), starts=starts), sized)
        used = live.per_point(result.choice, result.recompute)
        over = [int(k) for k in np.argsort(-used, kind="stable") if used[k] > budget * (1 + 1e-9)]
        if any(k in points for k in over):  # a row it was given: never a plan that overflows
            raise AutoshardError(
                f"the ILP returned a plan over the memory budget of {format_bytes(budget)} at a "
                "point it was constrained at (solver tolerance); raise --memory-budget a little"
            )
        over = over[:ROWS_PER_ROUND]
        if not over:
            spent = time.perf_counter() - t0 - result.build_seconds
            return replace(result, memory_rounds=rounds, solve_seconds=spent)
        points += over
        rows = np.vstack([rows, live.rows(over)])
        options = config.solver.after(time.perf_counter() - t0)
    raise AutoshardError(
        f"after {MEMORY_ROUNDS} solves the plan still overflows the memory budget of "
        f"{format_bytes(budget)} per device at {len(over)} more point(s) of the step; raise "
        "--memory-budget"
    )


def plan_pinned(
    config: SolveConfig,
    parameters: dict[str, Placements],
    inputs: dict[str, Placements],
    gathered_dims: frozenset[int] = frozenset(),
    name: str = "pinned",
    tp_styles: dict[str, str] | None = None,
    tp_dim: int | None = None,
) -> SolveResult:
    """The plan DTensor's propagation makes from these parameter and input placements
    (:func:`autoshard.solver.baselines.pinned`; ``tp_styles`` module FQN -> ``"column"``
    / ``"row"`` on mesh dim ``tp_dim``), priced as a solve: what hand-written
    ``parallelize_module`` styles and FSDP2 groups run (``autoshard export``).

    Raises:
        AutoshardError: no plan of the family (an op whose inputs cannot be resharded).
    """
    seconds: dict[str, float] = {}
    graph, sg = graph_and_strategies(config, None, seconds)
    t = time.perf_counter()
    pins = pinned(sg, parameters, inputs, gathered_dims, tp_styles, tp_dim)
    found = run_baseline(sg, name, config.mesh, config.solver, pins=pins)
    plan = finish_plan(config, sg, found.choice, name)
    plan.extra.setdefault("notes", []).extend(found.notes)
    seconds["baseline"] = time.perf_counter() - t
    return unsolved_result(config, graph, sg, plan, seconds, f"pinned {name}")


def unsolved_result(
    config: SolveConfig,
    graph: TracedGraph,
    sg: StrategyGraph,
    plan: Plan,
    seconds: dict[str, float],
    status: str,
) -> SolveResult:
    """A :class:`SolveResult` for a plan made without the ILP (a baseline, pinned styles);
    its objective is the ILP's, one of ``--grad-accumulation``'s micro-batches (the step
    over them, :meth:`SolveResult.solver_stats`)."""
    seconds["total"] = sum(seconds.values())
    ilp = ILPResult(
        choice=plan.choice,
        objective_s=plan.step_time_s / config.grad_accumulation,
        status=status,
        gap=0.0,
        num_variables=0,
        num_constraints=0,
        build_seconds=0.0,
        solve_seconds=0.0,
    )
    return SolveResult(config, graph, sg, ilp, plan, seconds, peak_rss_bytes())


def plan_baseline(config: SolveConfig, algo: str, progress: Progress | None = None) -> SolveResult:
    """A hand-written-style plan (``replicate``, ``ddp``, ``fsdp``, ``megatron``,
    ``megatron_sp``) on the same graph and cost model, for ``solve --algo``.

    Raises:
        AutoshardError: an unknown ``algo`` (the message lists them).
    """
    seconds: dict[str, float] = {}
    graph, sg = graph_and_strategies(config, progress, seconds)
    t = time.perf_counter()
    plan, stats = plan_for_algo(
        sg,
        algo,
        config.mesh,
        config.solver,
        finish=lambda g, c, n: finish_plan(config, g, c, n),
    )
    seconds["baseline"] = time.perf_counter() - t
    return unsolved_result(config, graph, sg, plan, seconds, f"baseline {algo}")
