"""The ``solve`` pipeline: model file -> trace -> strategies -> ILP -> plan.

Each stage takes the previous stage's typed result. :func:`plan_model` is what
the CLI, the benchmark and the tests call; it does not print (progress goes
through the optional ``progress`` callback) and does not write files.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.tensor import Replicate

from autoshard.devices import DEFAULT_DEVICE, DeviceSpec, get_device
from autoshard.errors import AutoshardError
from autoshard.ilp import ILPResult, SolverOptions, solve
from autoshard.mesh import MeshSpec
from autoshard.model_file import instantiate, load_model_file
from autoshard.plan import Plan, build_plan
from autoshard.strategies import StrategyGraph, build_strategy_graph
from autoshard.trace import TracedGraph, trace_model

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class SolveConfig:
    """What to plan and how.

    ``input_placement``: ``"free"`` lets the ILP choose the inputs' placements;
    ``"replicate"`` fixes every input to ``Replicate`` on every mesh dim.
    ``output_placement``: likewise for the outputs (``"free"`` still forbids
    ``Partial``: the plan always pays to reduce outputs).
    """

    model_path: Path
    mesh: MeshSpec
    device: DeviceSpec = field(default_factory=lambda: get_device(DEFAULT_DEVICE))
    input_placement: str = "free"
    output_placement: str = "free"
    solver: SolverOptions = field(default_factory=SolverOptions)

    def __post_init__(self) -> None:
        for what, value in (("input", self.input_placement), ("output", self.output_placement)):
            if value not in ("free", "replicate"):
                raise AutoshardError(
                    f"{what} placement must be 'free' or 'replicate', got {value!r}"
                )

    def cost_model(self) -> dict[str, Any]:
        """The cost-model parameters, as plain builtins for the solution file."""
        return {
            "device": self.device.to_dict(),
            "mode": "infer",
            "input_placement": self.input_placement,
            "output_placement": self.output_placement,
            "mesh": self.mesh.to_dict(),
        }


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

    def solver_stats(self) -> dict[str, Any]:
        """Solver statistics as plain builtins (for the solution file and the report)."""
        d = asdict(self.ilp)
        d.pop("choice")
        return d


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (bytes; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trace(config: SolveConfig, progress: Progress | None = None) -> TracedGraph:
    """Load the model file, build it on meta, trace and annotate it."""
    if progress:
        progress("trace", 0, 1)
    loaded = instantiate(load_model_file(config.model_path), device="meta")
    graph = trace_model(loaded)
    if progress:
        progress("trace", 1, 1)
    return graph


def strategies(
    config: SolveConfig, graph: TracedGraph, progress: Progress | None = None
) -> StrategyGraph:
    """Generate, cost and shrink the strategies of ``graph`` for ``config``'s mesh and device."""
    rep = (Replicate(),) * config.mesh.ndim
    return build_strategy_graph(
        graph,
        config.mesh.shape,
        compute_time=config.device.compute_time,
        redistribute_cost=config.mesh.redistribute_cost,
        fixed_inputs=rep if config.input_placement == "replicate" else None,
        fixed_outputs=rep if config.output_placement == "replicate" else None,
        progress=(lambda d, t: progress("strategies", d, t)) if progress else None,
    )


def plan_model(config: SolveConfig, progress: Progress | None = None) -> SolveResult:
    """Run the whole pipeline and return the optimal plan with its statistics.

    Raises:
        AutoshardError: a bad model file, an untraceable model, an infeasible ILP.
    """
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    graph = trace(config, progress)
    seconds["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    sg = strategies(config, graph, progress)
    seconds["strategies"] = time.perf_counter() - t
    if progress:
        progress("solve", 0, 1)
    result = solve(sg, config.solver)
    if progress:
        progress("solve", 1, 1)
    seconds["ilp_build"] = result.build_seconds
    seconds["solve"] = result.solve_seconds
    plan = build_plan(sg, result.choice, config.mesh, name="ilp")
    seconds["total"] = sum(seconds.values())
    return SolveResult(config, graph, sg, result, plan, seconds, peak_rss_bytes())
