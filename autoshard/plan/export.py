"""Export a plan: the solution pickle (MASE's per-node layout) and the sharding map (JSON).

Both formats are described in docs/formats.md. Writes are atomic
(:func:`autoshard.plan.atomic.atomic_write`): a failed solve never overwrites a
good solution, and a crash mid-write leaves the old file intact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoshard import __version__
from autoshard.cost.checkpointing import rerun_takes_gather
from autoshard.cost.mesh import mesh_dims_json, mesh_dims_tuple
from autoshard.errors import AutoshardError
from autoshard.placements import placements_to_str
from autoshard.plan.formats import (
    SHARDING_MAP_FORMAT,
    SOLUTION_FORMAT,
    load_solution,
    save_sharding_map,
    save_solution,
    solution_digest,
)
from autoshard.plan.plan import Plan, shared_read


def output_stem(model_name: str, mesh_shape: tuple[int, ...], suffix: str = "") -> str:
    """``<model>_<mesh>`` (e.g. ``gpt2_2x4``), plus ``_<suffix>`` for non-ILP plans."""
    stem = f"{model_name}_{'x'.join(map(str, mesh_shape))}"
    return f"{stem}_{suffix}" if suffix else stem


WALL_CLOCK_KEYS = ("build_seconds", "solve_seconds")
"""Solver statistics measured by the clock, which a written solution leaves out."""


def _modes(plan: Plan, name: str, s: Any) -> list[str] | None:
    """The op rule's choice per mesh dim of node ``name`` under strategy ``s`` when its op
    communicates itself, else None."""
    if not s.collectives:
        return None
    from autoshard.strategies.rules import op_rule

    info = plan.sg.graph.nodes[name]
    rule = op_rule(info.target)
    if rule is None or rule.per_dim is None:
        return None
    node = plan.sg.graph.graph_module.graph.find_nodes(op="call_function", target=info.target)
    fx = next(n for n in node if n.name == name)
    return list(rule.modes(fx, info.args, info.results, s, plan.mesh.shape))


def solution_dict(plan: Plan, cost_model: dict[str, Any], solver: dict[str, Any]) -> dict[str, Any]:
    """The solution as plain builtins and placements (see docs/formats.md).

    ``nodes`` maps every graph node to ``{"op", "args": {"data_in_<k>": placements},
    "results": {"data_out_<k>": placements}, "shapes": {...}}``; nodes that any device
    computes for itself (masks, position ids, factory ops) are marked ``"free": True``
    and carry no placements; ``"shared": [k, ...]`` lists the inputs whose resharding is
    shared with the other reads of the same tensor, phase and block
    (:mod:`autoshard.strategies.sharing`; the launcher moves it once);
    ``"rerun_gathered": [k, ...]`` the inputs a recomputed block's forward reads from its
    backward's gathered copy (:mod:`autoshard.trace.rerun_reads`); ``"modes"``: for an
    op that communicates itself (an op rule's collectives), its rule's choice per mesh dim,
    which placements alone may not tell (attention's all-gather and ring context
    parallelism place alike; the launch runs the named one). ``solver`` keeps
    what the search found, not how long it took (:data:`WALL_CLOCK_KEYS` are left out):
    the same input writes the same bytes, however busy the machine (issue 29); the report
    prints the seconds.
    """
    graph = plan.sg.graph
    recomputes = bool(plan.recomputed_blocks or plan.selective_blocks)
    nodes: dict[str, Any] = {}
    for name, info in graph.nodes.items():
        entry: dict[str, Any] = {"op": info.op_name, "args": {}, "results": {}, "shapes": {}}
        for k, t in enumerate(info.args):
            if t is not None:
                entry["shapes"][f"data_in_{k}"] = list(t.shape)
        for k, r in enumerate(info.results):
            if r is not None:
                entry["shapes"][f"data_out_{k}"] = list(r.shape)
        if info.kind == "output":
            for k in range(len(info.arg_nodes)):
                s = plan.node_strategy.get(f"{name}.{k}")
                if s is not None:
                    entry["args"][f"data_in_{k}"] = tuple(s.inputs[0])
        elif name in plan.node_strategy:
            s = plan.node_strategy[name]
            for k, ps in enumerate(s.inputs):
                entry["args"][f"data_in_{k}"] = tuple(ps)
            for k, ps in enumerate(s.outputs):
                if ps is not None:
                    entry["results"][f"data_out_{k}"] = tuple(ps)
            shared = [
                k
                for k, a in enumerate(info.arg_nodes)
                if a in plan.sg.nodes
                and a not in plan.sg.free
                and shared_read(plan.sg, a, name) is not None
            ]
            if shared:  # reads that share one resharding (autoshard.strategies.sharing)
                entry["shared"] = shared
            rerun = [
                k
                for k, a in enumerate(info.arg_nodes)
                if recomputes and rerun_takes_gather(plan.sg, plan.node_strategy, a, name, k)
            ]
            if rerun:  # a recomputation's reads of the backward's gather (rerun_reads)
                entry["rerun_gathered"] = rerun
            modes = _modes(plan, name, s)
            if modes is not None:
                entry["modes"] = modes
        else:
            entry["free"] = True
        ns = plan.sg.nodes.get(name)
        if ns is not None and ns.fallback:
            entry["fallback"] = True  # no DTensor rule: replicated, run on local copies
        if info.fqn:
            entry["target"] = info.fqn
        if info.layer is not None:
            entry["layer"] = info.layer
        nodes[name] = entry
    return {
        "format": SOLUTION_FORMAT,
        "autoshard_version": __version__,
        "model": graph.model_name,
        "plan": plan.name,
        "mesh": plan.mesh.to_dict(),
        "cost_model": dict(cost_model),
        "nodes": nodes,
        "parameters": {k: tuple(v) for k, v in plan.parameters.items()},
        "inputs": {k: tuple(v) for k, v in plan.inputs.items()},
        "objective_s": float(plan.step_time_s),
        "predicted": predicted(plan),
        "solver": {k: v for k, v in solver.items() if k not in WALL_CLOCK_KEYS},
    }


def predicted(plan: Plan) -> dict[str, Any]:
    """The plan's predictions as plain numbers (seconds, bytes, collective counts);
    ``selective_blocks`` only when some block recomputes under the selective policy."""
    out = {
        "step_time_s": float(plan.step_time_s),
        "compute_s": float(plan.compute_s),
        "optimizer_s": float(plan.optimizer_s),
        "recompute_s": float(plan.recompute_s),
        **({"fsdp_s": float(plan.fsdp_s)} if plan.fsdp_s else {}),
        "recomputed_blocks": [int(b) for b in plan.recomputed_blocks],
        "comm_s": {k: float(v) for k, v in sorted(plan.comm_s.items())},
        "hidden_s": {k: float(v) for k, v in sorted(plan.hidden_s.items())},
        "collectives": dict(sorted(plan.collectives.items())),
        "collective_steps": collective_steps(plan),
        "memory_bytes": {k: float(v) for k, v in plan.memory_by_kind().items()},
        "flops": float(plan.step_flops),
        "mfu": float(plan.mfu),
        # micro-batches per step (gradient accumulation): every count above is the step's
        **({"grad_accumulation": plan.grad_accumulation} if plan.grad_accumulation > 1 else {}),
    }
    return {**out, **_optimizer_key(plan), **_recomputation_keys(plan)}


def _optimizer_key(plan: Plan) -> dict[str, str]:
    """``{"optimizer": ...}`` in training: the AdamW implementation the step was priced
    with, which the launch builds (a map without it launches the fused kernel)."""
    return {"optimizer": plan.sg.optimizer} if plan.sg.graph.mode == "train" else {}


def _recomputation_keys(plan: Plan) -> dict[str, Any]:
    """``{"selective_blocks": [...]}`` when some block recomputes selectively, and
    ``checkpoint_early_stop`` when some block recomputes (how far its forward reruns:
    :func:`autoshard.trace.selective.recomputed_ops`), else ``{}`` (maps and solutions
    without them read as before: :func:`autoshard.trace.selective.early_stops`)."""
    blocks = plan.selective_blocks
    out: dict[str, Any] = {"selective_blocks": [int(b) for b in blocks]} if blocks else {}
    if blocks or plan.recomputed_blocks:
        out["checkpoint_early_stop"] = bool(plan.checkpoint_early_stop)
    return out


def collective_steps(plan: Plan) -> list[dict[str, Any]]:
    """The plan's collectives per phase, kind and mesh dim, as the launcher checks them:
    ``[{"phase": "backward", "kind": "all_reduce", "mesh_dim": 0, "count": 4}, ...]``;
    those an op issues itself (the experts' token exchange) in rows of their own marked
    ``"in_op": true``."""
    rows = []
    for (ph, kind, dim), n in sorted(
        plan.collective_steps.items(), key=lambda kv: (*kv[0][:2], mesh_dims_tuple(kv[0][2]))
    ):
        own = plan.own_steps.get((ph, kind, dim), 0)
        row = {"phase": ph, "kind": kind, "mesh_dim": mesh_dims_json(dim)}
        if n - own:
            rows.append({**row, "count": int(n - own)})
        if own:
            rows.append({**row, "count": int(own), "in_op": True})
    return rows


def sharding_map_dict(
    plan: Plan, solution: Path | None = None, device: str | None = None
) -> dict[str, Any]:
    """The sharding map: every parameter FQN and input name -> one placement per mesh dim;
    with ``solution`` (the pickle written beside it) also its name and SHA-256, which
    ``autoshard launch`` runs; with ``device`` the name of the device the predictions are
    for (``calibrated`` for a profile's), which the launcher prints beside its measure."""
    out = {
        "format": SHARDING_MAP_FORMAT,
        "mesh": {"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.dim_names)},
        "parameters": {k: placements_to_str(v) for k, v in sorted(plan.parameters.items())},
        "inputs": {k: placements_to_str(v) for k, v in plan.inputs.items()},
        "predicted": {
            "step_time_s": float(plan.step_time_s),
            "collectives": dict(sorted(plan.collectives.items())),
            "flops": float(plan.step_flops),
            "mfu": float(plan.mfu),
            "collective_steps": collective_steps(plan),
            "recomputed_blocks": [int(b) for b in plan.recomputed_blocks],
            **({"grad_accumulation": plan.grad_accumulation} if plan.grad_accumulation > 1 else {}),
            **_optimizer_key(plan),
            **_recomputation_keys(plan),
        },
    }
    if device is not None:
        out["predicted"]["device"] = device
    if solution is not None:
        digest = solution_digest(load_solution(solution))
        out["solution"] = {"file": solution.name, "plan_sha256": digest}
    return out


def write_outputs(
    plan: Plan,
    out_dir: str | Path,
    stem: str,
    cost_model: dict[str, Any],
    solver: dict[str, Any],
) -> tuple[Path, Path]:
    """Write ``<out_dir>/<stem>.pkl`` and ``<out_dir>/<stem>.json`` atomically.

    Raises:
        AutoshardError: when the folder cannot be created or written.
    """
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutoshardError(f"cannot create the output folder {out}: {exc.strerror}") from exc
    pkl, js = out / f"{stem}.pkl", out / f"{stem}.json"
    save_solution(pkl, solution_dict(plan, cost_model, solver))
    device = (cost_model.get("device") or {}).get("name")
    save_sharding_map(js, sharding_map_dict(plan, pkl, device))
    return pkl, js
