"""autoshard's public Python API: what the command line does, as functions.

    from autoshard.api import MeshSpec, SolveConfig, plan_model, write_outputs

    config = SolveConfig(model_path=Path("examples/gpt2.py"), mesh=MeshSpec.from_options("2x4"))
    result = plan_model(config)            # trace, strategies, hand-written plans, the ILP
    print(result.plan.step_time_s)         # predicted seconds per step
    write_outputs(result.plan, Path("solutions"), "gpt2_2x4", config.cost_model(),
                  result.solver_stats())   # the solution pickle and the sharding map

Everything here is imported from the package that owns it (docs/architecture.md); names
not listed in ``__all__`` are internal and may change.
"""

from __future__ import annotations

from autoshard.cost.collectives import CommModel, comm_model
from autoshard.cost.devices import DEVICES, DeviceSpec, get_device
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.pipeline.pricing import plan_pipeline
from autoshard.plan.export import write_outputs
from autoshard.plan.formats import load_sharding_map, load_solution
from autoshard.plan.plan import Plan
from autoshard.solver.compare import compare_plans
from autoshard.solver.options import SolverOptions
from autoshard.solver.preload import plan_preloaded
from autoshard.solver.solve import SolveConfig, SolveResult, plan_baseline, plan_model

__all__ = [
    "DEVICES",
    "AutoshardError",
    "CommModel",
    "DeviceSpec",
    "MemoryBudgetError",
    "MeshSpec",
    "Plan",
    "SolveConfig",
    "SolveResult",
    "SolverOptions",
    "comm_model",
    "compare_plans",
    "get_device",
    "load_sharding_map",
    "load_solution",
    "plan_baseline",
    "plan_model",
    "plan_pipeline",
    "plan_preloaded",
    "write_outputs",
]
