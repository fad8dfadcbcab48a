"""Print a solution pickle or a sharding map readably (``autoshard show FILE``).

The kind of file is found from its content (:func:`autoshard.plan.formats.detect_kind`), not
its extension. Solutions load through the restricted unpickler, so showing an untrusted file
is as safe as loading it: a file that references anything but placements is refused.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autoshard.cost.collective_table import COLLECTIVES
from autoshard.cost.mesh import mesh_dims_name, mesh_dims_of
from autoshard.placements import placement_to_str, placements_from_str, short
from autoshard.plan.formats import ShardingMap, detect_kind, load_sharding_map, load_solution
from autoshard.plan.report import format_ranges
from autoshard.units import format_bandwidth, format_bytes, format_seconds

__all__ = ["render"]

_NODE_ROWS = 40  # nodes listed by --nodes before "... and N more"; --all-nodes lifts it


def render(
    path: str | os.PathLike[str],
    console: Console,
    *,
    nodes: bool = False,
    all_nodes: bool = False,
) -> str:
    """Print the solution pickle or sharding map at ``path`` to ``console``.

    A solution shows its summary (model, mesh with each dim's bandwidth and latency, cost
    model, objective, solver status, gap and time), its parameters and inputs with one
    placement column per mesh dim, and its node count by op; ``nodes`` adds a table of each
    node's arg and result placements (the first 40 unless ``all_nodes``). A sharding map
    shows its mesh, parameters, inputs and predictions.

    A stage plan is :func:`render_stage_plan`'s (the pipeline reads its format).

    Returns:
        ``"solution"`` or ``"sharding_map"``: which kind the file was.

    Raises:
        AutoshardError: when the file cannot be read or loaded (see
            :func:`~autoshard.plan.formats.load_solution` and
            :func:`~autoshard.plan.formats.load_sharding_map`).
    """
    kind = detect_kind(path)
    if kind == "sharding_map":
        _render_map(Path(path), load_sharding_map(path), console)
    else:
        _render_solution(Path(path), load_solution(path), console, nodes, all_nodes)
    return kind


# ------------------------------------------------------------------------------------------
# Solutions
# ------------------------------------------------------------------------------------------


def _render_solution(
    path: Path, sol: Mapping[str, Any], console: Console, nodes: bool, all_nodes: bool
) -> None:
    mesh = sol.get("mesh") or {}
    shape = list(mesh.get("shape") or _guess_shape(sol))
    names = list(mesh.get("dim_names") or _default_names(len(shape)))
    mase = sol["format"] == "mase"

    summary = _summary_table(f"Solution  {path}")
    summary.add_row("format", _text(sol["format"] + ("  (a bare MASE node dict)" if mase else "")))
    for key, label in (("model", "model"), ("plan", "plan"), ("autoshard_version", "written by")):
        if key in sol:
            summary.add_row(label, _text(str(sol[key])))
    summary.add_row("mesh", _text(_mesh_text(shape, names) if shape else "unknown"))
    bandwidths, latencies = mesh.get("bandwidth_Bps"), mesh.get("latency_s")
    for i, name in enumerate(names):
        parts = []
        if bandwidths is not None:
            parts.append(format_bandwidth(bandwidths[i]))
        if latencies is not None:
            parts.append(f"latency {format_seconds(latencies[i])}")
        if parts:
            summary.add_row(f"  {name}", _text(", ".join(parts)))
    cost_model = sol.get("cost_model")
    if cost_model:
        summary.add_row("cost model", _text(_cost_model_text(cost_model)))
    if "objective_s" in sol:
        summary.add_row("objective", _text(f"{format_seconds(sol['objective_s'])} per step"))
    solver = sol.get("solver")
    if solver:
        summary.add_row("solver", _text(_solver_text(solver)))
    summary.add_row("nodes", _text(_node_counts(sol["nodes"])))
    console.print(summary)

    if sol.get("parameters"):
        console.print(_placement_table("Parameters", "parameter", sol["parameters"], shape, names))
    elif mase:
        console.print("parameters: none recorded (MASE files hold per-node placements only)")
    if sol.get("inputs"):
        console.print(_placement_table("Inputs", "input", sol["inputs"], shape, names))
    predicted = sol.get("predicted")
    if predicted:
        console.print(_predicted_table(predicted, names))
    if nodes:
        console.print(_nodes_table(sol["nodes"], all_nodes))
    elif mase or not sol.get("parameters"):
        console.print("(run with --nodes to list each node's placements)")


def _guess_shape(sol: Mapping[str, Any]) -> list[int]:
    """No mesh recorded (MASE): the shape is unknown, but its number of dims is not."""
    for node in sol["nodes"].values():
        for part in ("args", "results"):
            for placements in node.get(part, {}).values():
                return [0] * len(placements)
    return []


def _default_names(ndim: int) -> list[str]:
    return [f"dim{i}" for i in range(ndim)]


def _mesh_text(shape: Sequence[int], names: Sequence[str]) -> str:
    """``2x4 (dp=2, tp=4), 8 devices``; sizes unknown (MASE) show as ``?``."""
    if any(s == 0 for s in shape):
        return f"{len(shape)} dims ({', '.join(names)}), sizes not recorded"
    dims = ", ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))
    count = math.prod(shape)
    return f"{'x'.join(map(str, shape))} ({dims}), {count} device{'s' if count != 1 else ''}"


# a solution's cost-model keys, as the options of ``autoshard solve`` that set them
_COST_OPTIONS = {
    "device": "--device",
    "mode": "--mode",
    "dtype": "--dtype",
    "precision": "--precision",
    "reduce_dtype": "--reduce-dtype",
    "memory_budget_bytes": "--memory-budget",
    "input_placement": "--inputs",
    "output_placement": "--outputs",
    "bucket_bytes": "--bucket-size",
    "context_parallel": "--context-parallel",
    "activation_checkpointing": "--activation-checkpointing",
    "optimizer": "--optimizer",
    "fsdp_version": "--fsdp-version",
    "grad_accumulation": "--grad-accumulation",
}
# flags whose value is on or off: the option when on (overlap: its --no- form when off)
_COST_FLAGS = {
    "overlap": ("", "--no-overlap"),
    "share_reshardings": ("--share-reshardings", ""),
    "checkpoint_early_stop": ("", "--no-checkpoint-early-stop"),
}


def _cost_model_text(cost: Mapping[str, Any]) -> str:
    """The cost model as the ``autoshard solve`` options that set it (``--device h100,
    --mode train, --memory-budget 74.5 GiB, ...``; an on/off setting only when it is not
    the default, as its flag); keys no option sets keep their own name."""
    parts, rest = [], {}
    for key, value in cost.items():
        if key == "mesh" or value is None:
            continue
        if key in _COST_FLAGS:
            on, off = _COST_FLAGS[key]
            flag = on if value else off
            if flag:
                parts.append(flag)
        elif key == "context_parallel" and isinstance(value, bool):
            if value:
                parts.append("--context-parallel")
        elif key in _COST_OPTIONS:
            if isinstance(value, Mapping):
                value = value.get("name", "")
            parts.append(f"{_COST_OPTIONS[key]} {_quantity(str(key), value)}")
        else:
            rest[key] = value
    return ", ".join(parts + ([_pairs(rest)] if rest else []))


# the solver statistics' keys as the report words them (keys not listed keep their name)
_SOLVER_LABELS = {
    "objective_s": "objective",
    "num_variables": "variables",
    "num_constraints": "constraints",
    "build_seconds": "build",
    "bound_s": "bound",
    "start": "started from",
    "start_objective_s": "start's step",
    "memory_rounds": "memory rounds",
}
_SOLVER_STATUS = {"within_gap": "within the --mip-gap of the LP bound"}


def _solver_text(solver: Mapping[str, Any]) -> str:
    """``optimal, gap 0.00 %, solved in 1.20 s, variables 769, ...`` (None values skipped;
    the keys worded as the report words them)."""
    status = str(solver.get("status", "unknown status"))
    parts = [_SOLVER_STATUS.get(status, status)]
    gap = solver.get("gap")
    if _is_number(gap):
        parts.append(f"gap {gap * 100:.2f} %")
    time_key = next((k for k in ("solve_time_s", "solve_seconds") if _is_number(solver.get(k))), "")
    if time_key:
        parts.append(f"solved in {format_seconds(solver[time_key])}")
    rest = {k: v for k, v in solver.items() if k not in ("status", "gap", time_key)}
    for key, value in rest.items():
        if value is None or isinstance(value, Mapping):
            continue  # a nested table (the recomputed blocks' counts) is shown elsewhere
        label = _SOLVER_LABELS.get(key, key.replace("_", " "))
        parts.append(f"{label} {_quantity(str(key), value)}")
    return ", ".join(p for p in parts if p)


def _node_counts(nodes: Mapping[str, Any]) -> str:
    """``954 (aten.mm.default 48, aten.add.Tensor 37, ...)``: the five commonest ops."""
    ops = Counter(str(n.get("op")) for n in nodes.values() if "op" in n)
    text = str(len(nodes))
    if ops:
        common = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
        more = len(ops) - 5
        text += f" ({common}{f', and {more} more ops' if more > 0 else ''})"
    return text


def _nodes_table(nodes: Mapping[str, Any], all_nodes: bool) -> Table:
    """Node, op (when recorded), and one line per arg and per result: ``data_in_0  S(0)·R``."""
    with_ops = any("op" in n for n in nodes.values())
    table = Table(title="Nodes", title_justify="left")
    table.add_column("node", overflow="fold")
    if with_ops:
        table.add_column("op", overflow="fold")
    table.add_column("args", overflow="fold")
    table.add_column("results", overflow="fold")
    items = list(nodes.items())
    shown = items if all_nodes else items[:_NODE_ROWS]
    for name, node in shown:
        cells = [_text(name)]
        if with_ops:
            cells.append(_text(str(node.get("op", ""))))
        cells.append(_text(_arg_lines(node.get("args", {}))))
        cells.append(_text(_arg_lines(node.get("results", {}))))
        table.add_row(*cells)
    if len(shown) < len(items):
        table.caption = f"... and {len(items) - len(shown)} more nodes (--all-nodes lists them)"
    return table


def _arg_lines(entries: Mapping[str, Any]) -> str:
    return "\n".join(f"{k}  {short(v)}" for k, v in entries.items())


# ------------------------------------------------------------------------------------------
# Sharding maps
# ------------------------------------------------------------------------------------------


def _render_map(path: Path, smap: ShardingMap, console: Console) -> None:
    names = list(smap.dim_names or _default_names(smap.ndim))
    summary = _summary_table(f"Sharding map  {path}")
    summary.add_row("mesh", _text(_mesh_text(smap.mesh_shape, names)))
    summary.add_row("parameters", _text(str(len(smap.parameters))))
    summary.add_row("inputs", _text(str(len(smap.inputs))))
    for key, value in smap.extra.items():
        summary.add_row(str(key), _text(_extra_text(str(key), value)))
    console.print(summary)
    console.print(
        _placement_table("Parameters", "parameter", smap.parameters, smap.mesh_shape, names)
    )
    if smap.inputs:
        console.print(_placement_table("Inputs", "input", smap.inputs, smap.mesh_shape, names))
    if smap.predicted:
        console.print(_predicted_table(smap.predicted, names))


def _extra_text(key: str, value: Any) -> str:
    """A sharding map's other key, readably: the ``solution`` it names as its file and the
    first 12 hex digits of the plan's SHA-256, any other as :func:`_quantity` shows it."""
    if key == "solution" and isinstance(value, Mapping) and "file" in value:
        return f"{value['file']}, plan sha256 {str(value.get('plan_sha256', ''))[:12]}..."
    return _quantity(key, value)


def render_stage_plan(
    path: Path, plan: Any, predicted: Sequence[Mapping[str, float]], console: Console
) -> None:
    """A stage plan (``plan``: loaded and validated by
    :func:`autoshard.pipeline.stage_plan.load_stage_plan`), with each stage's
    ``predicted`` entry from the file (``time_s``, ``p2p_s``, ``memory_bytes``): its mesh,
    depth and micro-batches, one row per stage (its blocks, ranks, submesh and
    predictions) and each stage's parameter placements on its submesh."""
    names = list(plan.dim_names)
    summary = _summary_table(f"Stage plan  {path}")
    summary.add_row("model", _text(plan.model))
    summary.add_row("mesh", _text(_mesh_text(plan.mesh_shape, names)))
    summary.add_row("pipeline", _text(f"{plan.pp} stages, {plan.microbatches} micro-batches"))
    if plan.step_time_s is not None:
        summary.add_row("predicted step", _text(format_seconds(plan.step_time_s)))
    console.print(summary)
    table = Table(title="Stages")
    for col in ("stage", "blocks", "ranks", "submesh", "time", "send/recv", "memory"):
        table.add_column(col, justify="right" if col in ("time", "send/recv", "memory") else "left")
    for stage, entry in zip(plan.stages, predicted, strict=False):
        paths = stage.module_paths
        blocks = paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}" if paths else "-"
        table.add_row(
            str(stage.index),
            blocks,
            ",".join(map(str, stage.ranks)),
            "x".join(map(str, stage.submesh)),
            *(format_seconds(entry[k]) if k in entry else "-" for k in ("time_s", "p2p_s")),
            format_bytes(entry["memory_bytes"]) if "memory_bytes" in entry else "-",
        )
    console.print(table)
    for stage in plan.stages:
        title = f"Stage {stage.index} parameters (on its {'x'.join(map(str, stage.submesh))})"
        params = {k: placements_from_str(v) for k, v in stage.parameters.items()}
        console.print(_placement_table(title, "parameter", params, stage.submesh, names))


# ------------------------------------------------------------------------------------------
# Shared pieces
# ------------------------------------------------------------------------------------------


def _summary_table(title: str) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    return table


def _placement_table(
    title: str,
    what: str,
    entries: Mapping[str, Sequence[Any]],
    shape: Sequence[int],
    names: Sequence[str],
) -> Table:
    """One row per entry, one placement column per mesh dim (headed ``dp (2)``), in
    natural order (``layers.2`` before ``layers.10``). Entries that differ only in their
    first numeric path component (the layer index) and have the same placements share a
    row: ``layers.<0-31>.attention.wq.weight``."""
    table = Table(title=f"{title} ({len(entries)})", title_justify="left")
    table.add_column(what, overflow="fold")
    for name, size in zip(names, shape, strict=True):
        table.add_column(f"{name} ({size})" if size else name, justify="center")
    for key, placements in fold_layers(entries):
        table.add_row(_text(key), *(_text(placement_to_str(p)) for p in placements))
    return table


def natural_key(key: str) -> list:
    """Sort key that orders ``layers.2`` before ``layers.10``."""
    return [int(t) if t.isdecimal() else t for t in re.split(r"(\d+)", key)]


def fold_layers(entries: Mapping[str, Sequence[Any]]) -> list[tuple[str, tuple]]:
    """``(name, placements)`` rows: names equal but for their first all-digit dotted
    component, with equal placements, folded into ``prefix.<ranges>.suffix``; rows in
    natural order of their first name."""
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for key, placements in entries.items():
        parts = key.split(".")
        i = next((j for j, part in enumerate(parts) if part.isdecimal()), None)
        template = tuple(parts[:i] + ["*"] + parts[i + 1 :]) if i is not None else (key,)
        number = int(parts[i]) if i is not None else -1
        groups.setdefault((template, tuple(placements)), []).append((number, key))
    rows: list[tuple[str, tuple, str]] = []  # (shown name, placements, first real name)
    for (template, placements), members in groups.items():
        members.sort()
        if len(members) == 1:
            rows.append((members[0][1], placements, members[0][1]))
            continue
        ranges = format_ranges(n for n, _ in members)
        shown = ".".join(f"<{ranges}>" if t == "*" else t for t in template)
        rows.append((shown, placements, members[0][1]))
    rows.sort(key=lambda r: natural_key(r[2]))
    return [(name, placements) for name, placements, _ in rows]


def _predicted_table(predicted: Mapping[str, Any], dim_names: Sequence[str]) -> Table:
    table = _summary_table("Predicted")
    for key, value in predicted.items():
        if key == "collective_steps" and isinstance(value, list):
            text = _collective_steps_text(value, dim_names)
        elif key in ("recomputed_blocks", "selective_blocks") and isinstance(value, list):
            text = format_ranges(int(b) for b in value) if value else "none"
        elif key == "mfu" and _is_number(value):
            text = f"{value:.1%}"
        elif isinstance(value, Mapping) and key != "memory_bytes":  # by collective kind
            titled = {
                (COLLECTIVES[k].title if k in COLLECTIVES else k): v for k, v in value.items()
            }
            text = _quantity(str(key), titled)
        else:
            text = _quantity(str(key), value)
        table.add_row(_PREDICTED_LABELS.get(str(key), str(key)), _text(text))
    return table


# the sharding map's and the solution's ``predicted`` keys, as the table names them
_PREDICTED_LABELS = {
    "step_time_s": "step time",
    "compute_s": "compute",
    "optimizer_s": "optimizer step",
    "recompute_s": "recompute",
    "fsdp_s": "FSDP's copies",
    "recomputed_blocks": "recomputed blocks",
    "selective_blocks": "selectively recomputed blocks",
    "comm_s": "communication",
    "hidden_s": "hidden under compute",
    "collectives": "collectives",
    "collective_steps": "per phase and mesh dim",
    "memory_bytes": "memory per device",
    "flops": "FLOPs per step",
    "mfu": "MFU",
    "device": "priced for",
}


def _collective_steps_text(rows: Sequence[Mapping[str, Any]], dim_names: Sequence[str]) -> str:
    """``forward: all-gather on dp x1, all-reduce on tp x1; backward: ...``: the plan's
    collectives per phase, by kind and the mesh dim they run on (``in op`` for those an
    op issues itself, such as the experts' token exchange)."""
    phases: dict[str, list[str]] = {}
    for r in rows:
        dim = mesh_dims_of(r.get("mesh_dim", -1))
        where = mesh_dims_name(dim, dim_names) or f"dim {dim}"
        kind = COLLECTIVES[r["kind"]].title if r.get("kind") in COLLECTIVES else str(r.get("kind"))
        own = " in op" if r.get("in_op") else ""
        phases.setdefault(str(r.get("phase")), []).append(f"{kind} on {where}{own} x{r['count']}")
    return "; ".join(f"{ph}: {', '.join(parts)}" for ph, parts in phases.items()) or "none"


def _quantity(key: str, value: Any) -> str:
    """A value with its unit, read from the key's suffix (``_s``, ``_seconds``, ``_bytes``)."""
    if isinstance(value, Mapping):
        if key == "collectives":
            return ", ".join(f"{k} x{v}" for k, v in value.items()) or "none"
        return ", ".join(f"{k} {_quantity(key, v)}" for k, v in value.items()) or "none"
    if _is_number(value):
        if key.endswith(("_s", "_seconds")):
            return format_seconds(value)
        if key.endswith("_bytes"):
            return format_bytes(value)
        if isinstance(value, float):
            return f"{value:.4g}"
    return str(value)


def _pairs(mapping: Mapping[str, Any], skip: Sequence[str] = ()) -> str:
    """``key value, ...`` with units; None values and ``skip`` keys left out, and a nested
    object (e.g. a device spec) shown by its ``name``."""
    parts = []
    for key, value in mapping.items():
        if key in skip or value is None:
            continue
        if isinstance(value, Mapping):
            if "name" not in value:
                continue
            value = value["name"]
        parts.append(f"{key} {_quantity(str(key), value)}")
    return ", ".join(parts)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text(value: str) -> Text:
    """Plain text: FQNs and placements such as ``[0]`` are never read as rich markup."""
    return Text(value)
