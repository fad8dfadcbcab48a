"""The plan a launch runs, and what ran compared with what the plan predicted.

:func:`prepare_program` finds the solution a version-2 sharding map points to, traces the
model exactly as ``autoshard solve`` did and pairs the two
(:func:`autoshard.launch.graph_run.program_from_solution`); ``autoshard launch`` calls it
before it starts any rank, so a plan the launcher cannot run is refused in one line.
:func:`report_observed` prints step 1's collectives per phase, kind and mesh dim beside the
plan's prediction and says whether they agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from autoshard.cost.collective_table import COLLECTIVES
from autoshard.cost.mesh import (
    MeshSpec,
    mesh_dims_json,
    mesh_dims_name,
    mesh_dims_of,
    mesh_dims_tuple,
)
from autoshard.errors import AutoshardError
from autoshard.launch.check import say
from autoshard.launch.graph_run import GraphProgram, program_from_solution
from autoshard.launch.options import RunOptions
from autoshard.launch.plan_steps import PlanStepResult
from autoshard.model.model_file import ModelFile, instantiate
from autoshard.plan.formats import ShardingMap, load_solution
from autoshard.trace.tracer import reduce_depth, trace_model

PHASES = ("forward", "recompute", "backward", "optimizer")

GLOO_SUBSTITUTES = {"all_to_all": "all_gather"}
"""Collectives gloo lacks and what DTensor runs instead on CPU: ``shard_dim_alltoall``
falls back to an all-gather and a local chunk (``torch.distributed.tensor._collective_utils``)."""


def refuse_accumulation(cost: Mapping[str, Any], name: str) -> None:
    """Refuse a solution solved with ``--grad-accumulation`` > 1 (its ``cost_model``,
    named ``name``): the launcher runs one batch per step, in every ``--mode``.

    Raises:
        AutoshardError: such a solution.
    """
    accumulation = int(cost.get("grad_accumulation", 1))
    if accumulation > 1:
        raise AutoshardError(
            f"{name} was solved with --grad-accumulation {accumulation}, which the launcher "
            "does not run (it runs one batch per step): solve without it, with "
            "example_inputs() giving one micro-batch, to launch the plan"
        )


def check_launchable(smap: ShardingMap) -> None:
    """Refuse, before any rank starts and in every ``--mode``, a map whose solution the
    launcher cannot run as priced (:func:`refuse_accumulation`).

    Raises:
        AutoshardError: as :func:`refuse_accumulation`.
    """
    path = smap.solution_path()
    if path is not None:
        refuse_accumulation(load_solution(path).get("cost_model") or {}, path.name)


def prepare_program(
    smap: ShardingMap, mf: ModelFile, opts: RunOptions, announce: bool = False
) -> GraphProgram | None:
    """The plan to run for ``smap``, or ``None`` when it runs DTensor's propagation (a
    version-1 map names no solution; ``announce`` says so once).

    Raises:
        AutoshardError: the solution is missing or changed, was solved for the other mode
            (``--train`` needs a ``--mode train`` plan and the reverse), accumulates
            gradients over micro-batches (``--grad-accumulation``), or does not describe
            the graph the model traces to.
    """
    path = smap.solution_path()
    if path is None:
        if announce:
            say(
                f"note: {smap.source} ({smap.format}) names no solution, so this launch runs "
                "DTensor's own propagation from the parameters' and inputs' placements, not "
                "the plan; solve again to run the plan"
            )
        return None
    solution = load_solution(path)
    cost: Mapping[str, Any] = solution.get("cost_model") or {}
    solved = str(cost.get("mode", "infer"))
    if opts.train != (solved == "train"):
        want = "--mode train" if opts.train else "--mode infer"
        raise AutoshardError(
            f"{path.name} was solved for {'training' if solved == 'train' else 'inference'} "
            f"but this launch {'trains' if opts.train else 'runs forward only'}; solve with "
            f"{want} (or launch {'without' if solved == 'infer' else 'with'} --train)"
        )
    refuse_accumulation(cost, path.name)
    mesh = MeshSpec.from_dict(solution["mesh"])
    check_map_matches_solution(smap, solution, path.name)
    cast = _cast_of(cost.get("dtype"))
    precision = str(cost.get("precision", "model"))
    if precision == "fp16-mixed" and not opts.check:
        raise AutoshardError(
            f"{path.name} was solved with --precision fp16-mixed, which needs a loss scaler the "
            "launcher does not have (fp16 gradients underflow); solve with bf16-mixed, or "
            "launch with --check (float64)"
        )
    mixed = precision.endswith("-mixed")
    reduce = _cast_of(cost.get("reduce_dtype", "float32")) if mixed else None

    def with_cast(program: GraphProgram) -> GraphProgram:
        program.dtype = cast
        program.reduce_dtype = reduce
        return program

    merge = bool(cost.get("share_reshardings"))
    graph = trace_for_launch(mf, solved, cost.get("dtype"), merge_views=merge)
    sol_nodes = solution.get("nodes") or {}
    if all(n in sol_nodes for n in graph.nodes):
        return with_cast(program_from_solution(graph, solution, mesh))
    # solved on a depth-reduced trace (layer tying, more than 4 blocks): run the whole
    # model, each block with the plan of the traced block that stands for it
    reduced = trace_for_launch(mf, solved, cost.get("dtype"), reduce=True, merge_views=merge)
    if reduced.depth is None or not all(n in sol_nodes for n in reduced.nodes):
        return program_from_solution(graph, solution, mesh)  # raises, naming the nodes
    return with_cast(program_from_solution(graph, solution, mesh, reduced=reduced))


def _cast_of(dtype: object) -> torch.dtype | None:
    """The dtype a solve's ``cost_model["dtype"]`` names (``"model"``: none)."""
    if isinstance(dtype, str) and dtype not in ("", "model"):
        cast = getattr(torch, dtype, None)
        if isinstance(cast, torch.dtype):
            return cast
    return None


def trace_for_launch(
    mf: ModelFile, mode: str, dtype: object = None, reduce: bool = False, merge_views: bool = False
):
    """The model traced on meta as ``autoshard solve`` traces it (same node names); with
    ``reduce``, depth-reduced as a solve with layer tying does (:func:`reduce_depth`); with
    ``merge_views``, identical views merged as a solve with ``--share-reshardings`` does.

    Raises:
        AutoshardError: as :func:`autoshard.trace.tracer.trace_model`.
    """
    loaded = instantiate(mf, device="meta")
    depth = reduce_depth(loaded.module) if reduce else None
    cast = _cast_of(dtype)
    if cast is not None:
        loaded.module.to(cast)
        loaded.inputs = tuple(x.to(cast) if x.is_floating_point() else x for x in loaded.inputs)
    return trace_model(loaded, mode, depth, merge_views=merge_views)


def check_map_matches_solution(smap: ShardingMap, solution: Mapping[str, Any], name: str) -> None:
    """The map's mesh, parameter and input placements are its solution's.

    Raises:
        AutoshardError: they differ (a hand-edited map): one line naming the first.
    """
    if tuple(smap.mesh_shape) != tuple(solution["mesh"]["shape"]):
        raise AutoshardError(
            f"{smap.source} has mesh {smap.mesh_text} but its solution {name} was solved for "
            f"{'x'.join(map(str, solution['mesh']['shape']))}; solve again"
        )
    for kind, mine, theirs in (
        ("parameter", smap.parameters, solution.get("parameters") or {}),
        ("input", smap.inputs, solution.get("inputs") or {}),
    ):
        for key, ps in mine.items():
            if key in theirs and tuple(theirs[key]) != tuple(ps):
                raise AutoshardError(
                    f"{smap.source} places {kind} {key} as {list(map(str, ps))} but its "
                    f"solution {name} as {list(map(str, theirs[key]))}: the launch runs the "
                    "solution, so solve again rather than edit the map (or use --mode "
                    "propagate)"
                )


def predicted_steps(smap: ShardingMap) -> Counter:
    """The map's ``predicted.collective_steps`` as ``(phase, kind, mesh dim) -> count``."""
    out: Counter = Counter()
    for row in smap.predicted.get("collective_steps") or []:
        out[(str(row["phase"]), str(row["kind"]), mesh_dims_of(row["mesh_dim"]))] += int(
            row["count"]
        )
    return out


def observed_rows(result: PlanStepResult, smap: ShardingMap, device: torch.device) -> list:
    """Step 1's collectives beside the prediction, one dict per (phase, kind, mesh dim):
    ``{"phase", "kind", "mesh_dim", "mesh_dim_name", "seen", "predicted"}`` (``--json``)."""
    expected = _expected(smap, device)
    seen = result.observed
    names = smap.dim_names or tuple(str(i) for i in range(smap.ndim))
    keys = sorted(
        set(expected) | set(seen),
        key=lambda k: (PHASES.index(k[0]), k[1], mesh_dims_tuple(k[2])),
    )
    return [
        {
            "phase": ph,
            "kind": kind,
            "mesh_dim": mesh_dims_json(dim),
            "mesh_dim_name": mesh_dims_name(dim, names),
            "seen": seen[(ph, kind, dim)],
            "predicted": expected[(ph, kind, dim)],
        }
        for ph, kind, dim in keys
    ]


def _expected(smap: ShardingMap, device: torch.device) -> Counter:
    """The prediction with gloo's substitutes applied on CPU, to reshardings only (an op's
    own exchange, a row marked ``in_op``, calls ``all_to_all_single`` itself)."""
    subst: dict[str, str] = GLOO_SUBSTITUTES if device.type == "cpu" else {}
    expected: Counter = Counter()
    for row in smap.predicted.get("collective_steps") or []:
        kind = str(row["kind"])
        kind = kind if row.get("in_op") else subst.get(kind, kind)
        expected[(str(row["phase"]), kind, mesh_dims_of(row["mesh_dim"]))] += int(row["count"])
    return expected


def report_observed(
    result: PlanStepResult, smap: ShardingMap, device: torch.device, opts: RunOptions
) -> bool:
    """Print step 1's collectives beside the plan's; True when they agree.

    On CPU, gloo's substitutes (:data:`GLOO_SUBSTITUTES`) are applied to the prediction
    and named. The per-mesh-dim log and CommDebugMode must also agree on the totals by
    kind.
    """
    subst: dict[str, str] = GLOO_SUBSTITUTES if device.type == "cpu" else {}
    rows = observed_rows(result, smap, device)
    if rows:
        say("collectives of step 1, per phase and mesh dim     seen  predicted")
        for r in rows:
            mark = "" if r["seen"] == r["predicted"] else "  <- differs"
            say(
                f"  {r['phase']:<10}{r['kind']:<16}{r['mesh_dim_name'] or '?':<20}"
                f"{r['seen']:>9}{r['predicted']:>11}{mark}"
            )
    else:
        say("collectives of step 1: none; predicted: none")
    seen = result.observed
    used = sorted(
        {
            str(r["kind"])
            for r in smap.predicted.get("collective_steps") or []
            if r["count"] and not r.get("in_op") and r["kind"] in subst
        }
    )
    if used:
        say(
            "note: gloo has no "
            + ", ".join(used)
            + "; DTensor runs "
            + ", ".join(subst[k] for k in used)
            + " instead on CPU, and the prediction is read so"
        )
    totals: Counter = Counter()
    for (_, kind, _), n in seen.items():
        if kind not in COLLECTIVES or COLLECTIVES[kind].comm_debug:  # not send/recv
            totals[kind] += n
    debug = Counter(result.comm_debug)
    agree = all(r["seen"] == r["predicted"] for r in rows)
    consistent = +totals == +debug
    if not consistent:
        say(
            f"check: CommDebugMode counted {dict(+debug)} but the per-mesh-dim log "
            f"{dict(+totals)}: a collective escaped one of them"
        )
    if result.deviations:
        items = ", ".join(f"{op} ({n})" for op, n in result.deviations.most_common(5))
        say(
            f"note: {sum(result.deviations.values())} op output(s) came out of DTensor placed "
            f"otherwise than planned and were moved to the plan's placement: {items}"
        )
    if result.substitutions:
        items = ", ".join(f"{k} ({n})" for k, n in result.substitutions.items())
        say(f"note: kernels this device lacks, run another way: {items}")
    lowered = report_lowered(result, smap, device, opts)
    if opts.check:
        say(
            "check: collectives "
            + (
                "equal the plan's prediction ok"
                if agree and consistent
                else "differ from the plan's prediction FAILED"
            )
        )
    return agree and consistent and lowered


def lowered_report(result: PlanStepResult, smap: ShardingMap, device: torch.device) -> dict:
    """What the lowered step holds (:mod:`autoshard.launch.lowered`), for ``--json``:
    ``{"ops", "collectives": [{"phase", "kind", "mesh_dim", "count", "predicted"}],
    "agree", "step2_error"}``, or ``{"not_lowered": why}``."""
    step = result.lowered
    if step is None:
        return {"not_lowered": result.not_lowered}
    expected = Counter(
        {k: n for k, n in _expected(smap, device).items() if k[0] != "optimizer" and n}
    )
    graph = step.collectives()
    keys = sorted(
        set(graph) | set(expected),
        key=lambda k: (PHASES.index(k[0]), k[1], mesh_dims_tuple(k[2])),
    )
    return {
        "ops": step.num_ops,
        "collectives": [
            {
                "phase": ph,
                "kind": kind,
                "mesh_dim": mesh_dims_json(dim),
                "count": graph[(ph, kind, dim)],
                "predicted": expected[(ph, kind, dim)],
            }
            for ph, kind, dim in keys
        ],
        "agree": +graph == expected,
        "step2_error": result.step2_error,
    }


def report_lowered(
    result: PlanStepResult, smap: ShardingMap, device: torch.device, opts: RunOptions
) -> bool:
    """Say whether step 1 was lowered and whether the lowered graph's collectives (per
    phase, kind and mesh dim; the optimizer's are outside it) are the plan's and whether
    step 2 from it gave what the DTensor run gave (``--check``); True when they agree (or
    it was not lowered)."""
    info = lowered_report(result, smap, device)
    if "not_lowered" in info:
        why = info["not_lowered"]
        if opts.lower and opts.steps > 1:
            say(f"not lowered: {why}; every step ran on DTensors")
        return True
    total = sum(r["count"] for r in info["collectives"])
    later = "step 2" if opts.steps == 2 else f"steps 2-{opts.steps}"  # lowered: 2 or more
    say(
        f"lowered: step 1 recorded (make_fx) as {info['ops']} ops on local tensors with "
        f"{total} collective(s); {later} ran it"
    )
    error = result.step2_error
    counts_ok = info["agree"]
    values_ok = error is None or error <= opts.rtol
    if error is not None:
        say(
            f"check: step 2 from the lowered graph vs on DTensors (same inputs): worst "
            f"relative error {error:.3g} over every output (rtol {opts.rtol:g}) "
            + ("ok" if error <= opts.rtol else "FAILED")
        )
    if not info["agree"]:
        for r in info["collectives"]:
            if r["count"] != r["predicted"]:
                dims = mesh_dims_tuple(mesh_dims_of(r["mesh_dim"]))
                say(
                    f"  lowered graph: {r['phase']} {r['kind']} on mesh dim "
                    f"{'+'.join(map(str, dims))}: {r['count']}, predicted {r['predicted']}"
                    "  <- differs"
                )
    if opts.check:
        say(
            "check: the lowered graph's collectives "
            + ("equal the plan's prediction ok" if counts_ok else "differ from the plan's FAILED")
        )
    return counts_ok and values_ok
