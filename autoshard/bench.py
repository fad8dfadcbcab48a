"""``make bench``: seconds per phase, problem sizes and peak memory of ``autoshard solve``.

Per case: the wall time from process start to files written (imports, trace, strategies,
the hand-written plans, the ILP, the solution and sharding map), the phases' seconds, the
ILP's size (variables, rows) and HiGHS's own seconds in LP relaxations and in branch
and bound with its node count, the plan's objective, gap, MFU, and its ratio to the
search's start (the fastest hand-written plan that fits, or the ILP solved without the
overlap savings: at most 1). Beside each case's wall time, its floor: the seconds a
process of its own takes to start and load the case's model file (``model import s``,
:func:`import_floor_s`; once per model file and environment), which no planner of that
file beats on the same machine.

Each case runs in its own process (``python -m autoshard.bench --case NAME``) so that
its peak resident memory is its own. Prints two rich tables (where the seconds go, and
the plans found); ``--json`` prints the rows.

Cases (default H100 cost model, default links, --mip-gap 1%): the forward graph of the
MLP, GPT-2 small (12 layers) and the Llama-2-7B shape (32 layers) on 2x4; training steps
of GPT-2 small with and without layer tying; and the scaling table: the Llama-7B shape
with 2, 8 and 32 layers and the Llama-3-70B shape with 80 layers, on 2x4, 4x8 and 8x8;
bf16-mixed training of GPT-2 small, a 4-layer Qwen2, the Llama-7B shape (2x4, 4x8) and
the Llama-70B shape at torchtitan's batch (the rows issue 29's targets are for);
pipeline stages (``autoshard stages``, training, 8 micro-batches) of GPT-2 small and an
8-layer Llama-7B shape; the mesh search of the Llama-70B shape over 64 GPUs in nodes of
8 with pipeline depths 2 and 4 (``autoshard solve --gpus 64 --gpus-per-node 8 --pp
2,4``), and its 2x4x8 shape alone, over the column cap (``--mesh 2x4x8 --gpus-per-node
8``: a plan lifted from 8x8's, as the search plans it). Each solve case runs as ``solve
--mesh`` does (:func:`autoshard.solver.meshes.plan_mesh`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def _case(
    file: str,
    mesh: str,
    mode: str,
    layers: int | None = None,
    tie: bool = True,
    precision: str = "model",
    memory_budget: float | None = None,
    dtype: str | None = None,
) -> dict:
    env = {"AUTOSHARD_LAYERS": str(layers)} if layers else {}
    return {
        "file": file,
        "mesh": mesh,
        "mode": mode,
        "env": env,
        "tie": tie,
        "precision": precision,
        "memory_budget": memory_budget,
        "dtype": dtype,
    }


# issue 2's table: the forward (inference) graph on 2x4
CASES: dict[str, dict] = {
    "infer mlp 2x4": _case("examples/mlp.py", "2x4", "infer"),
    "infer gpt2-small 2x4": _case("examples/gpt2.py", "2x4", "infer"),
    "infer llama-7b 2x4": _case("examples/llama.py", "2x4", "infer"),
    # training steps (the default mode)
    "train gpt2-small 2x4": _case("examples/gpt2.py", "2x4", "train"),
    "train gpt2-small 2x4 no-tie": _case("examples/gpt2.py", "2x4", "train", tie=False),
}
# issue 5's scaling table: Llama shapes x meshes, training
for _mesh in ("2x4", "4x8", "8x8"):
    for _layers in (2, 8, 32):
        CASES[f"train llama-7b-shape L{_layers} {_mesh}"] = _case(
            "examples/llama.py", _mesh, "train", _layers
        )
    CASES[f"train llama-70b-shape L80 {_mesh}"] = _case("examples/llama70b.py", _mesh, "train")
# issue 12: bf16 mixed precision, FlashAttention; the 70B shape at torchtitan's batch
# (issue 29: the everyday 4-layer Qwen2 and the Llama-7B shape on 4x8 too)
for _name, _file, _mesh in (
    ("gpt2-small", "examples/gpt2.py", "2x4"),
    ("qwen2 L4", "examples/qwen2.py", "2x4"),
    ("llama-7b-shape L32", "examples/llama.py", "2x4"),
    ("llama-7b-shape L32", "examples/llama.py", "4x8"),
    ("llama-70b-shape L80 32x2048", "examples/llama70b_torchtitan.py", "8x8"),
):
    CASES[f"train {_name} {_mesh} bf16-mixed"] = _case(
        _file, _mesh, "train", precision="bf16-mixed"
    )
# issue 12: a budget under what keeping every activation needs: some blocks recompute
CASES["train llama-70b-shape L80 32x2048 8x8 bf16-mixed 26GiB"] = _case(
    "examples/llama70b_torchtitan.py",
    "8x8",
    "train",
    precision="bf16-mixed",
    memory_budget=26 * 2**30,
)
# issue 14: a mixture of experts (Mixtral-8x7B shape): expert parallelism in the search.
# Training 46.7B parameters needs more than 8 H100s hold (16 B per parameter, 87 GiB per
# device before any activation): on 2x4 the forward pass in bf16
CASES["train mixtral-8x7b-shape L32 8x8 bf16-mixed"] = _case(
    "examples/mixtral.py", "8x8", "train", precision="bf16-mixed"
)
CASES["infer mixtral-8x7b-shape L32 2x4 bf16"] = _case(
    "examples/mixtral.py", "2x4", "infer", dtype="bfloat16"
)
# issue 6: pipeline stages, one ILP per candidate stage (training, 8 micro-batches)
CASES["stages gpt2-small 2x4 pp2"] = {**_case("examples/gpt2.py", "2x4", "train"), "pp": 2}
CASES["stages gpt2-small 2x4 pp4"] = {**_case("examples/gpt2.py", "2x4", "train"), "pp": 4}
CASES["stages llama-7b-shape L8 2x4 pp2"] = {
    **_case("examples/llama.py", "2x4", "train", 8),
    "pp": 2,
}
# issue 32: from a GPU count to the plan, the mesh shapes of 64 GPUs in nodes of 8 and
# pipeline depths 2 and 4 (``autoshard solve --gpus 64 --gpus-per-node 8 --pp 2,4``)
CASES["search llama-70b-shape L80 32x2048 64 GPUs 8/node pp2+4 bf16-mixed"] = {
    **_case("examples/llama70b_torchtitan.py", "64", "train", precision="bf16-mixed"),
    "gpus": 64,
    "gpus_per_node": 8,
    "depths": (2, 4),
}
# issue 32: one 3-D shape of it, over the column cap (``autoshard solve --mesh 2x4x8
# --gpus-per-node 8``): 8x8's ILP plan laid onto it and improved, the search's 2x4x8 row
CASES["train llama-70b-shape L80 32x2048 2x4x8 8/node bf16-mixed"] = {
    **_case("examples/llama70b_torchtitan.py", "2x4x8", "train", precision="bf16-mixed"),
    "gpus_per_node": 8,
}


def run_search_case(name: str) -> dict:
    """Search the mesh shapes and pipeline depths of one case (``autoshard solve --gpus
    N --gpus-per-node G --pp ...``) in this process and write the best plan's files."""
    # imported in the case's own process, so that its wall time and memory include them
    from autoshard.cost.mesh import MeshSpec, node_shapes
    from autoshard.pipeline.search import search_shapes_and_depths
    from autoshard.plan.export import write_outputs
    from autoshard.solver.solve import SolveConfig, peak_rss_bytes

    case = CASES[name]
    os.environ.update(case["env"])
    gpus, per_node, depths = case["gpus"], case["gpus_per_node"], list(case["depths"])
    config = SolveConfig(
        model_path=ROOT / case["file"],
        mesh=MeshSpec.from_options(case["mesh"]),
        mode=case["mode"],
        precision=case["precision"],
    )
    meshes = [MeshSpec.on_nodes(s, per_node) for s in node_shapes(gpus, per_node)]
    t0 = time.perf_counter()
    search = search_shapes_and_depths(config, meshes, depths, 8, per_node)
    result = search.best.result
    with tempfile.TemporaryDirectory() as out:  # what a user waits for: files written too
        write_outputs(result.plan, out, "bench", result.config.cost_model(), result.solver_stats())
    total = time.perf_counter() - t0
    best = search.fastest
    ranking = ", ".join(
        f"{r.mesh.shape_str}{f' pp{r.pp}' if r.pp > 1 else ''} "
        + (f"{r.step_time_s:.4g}" if r.planned else f">={r.bound_s:.3g}" if r.bound_s else "-")
        for r in search.rows
    )
    return {
        "case": name,
        "trace_s": round(search.trace_seconds, 3),
        "total_s": round(total, 3),
        "status": f"best {best.mesh.shape_str} ({ranking})",
        "objective_s": best.step_time_s,
        "objective_ms": round(best.step_time_s * 1e3, 4),
        "mfu": best.mfu,
        "memory_bytes": best.memory_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_stages_case(name: str) -> dict:
    """Plan the pipeline stages of one case (``autoshard stages``) in this process."""
    # imported in the case's own process, so that its wall time and memory include them

    from autoshard.cost.mesh import MeshSpec
    from autoshard.pipeline.pricing import layer_map, plan_pipeline
    from autoshard.solver.solve import SolveConfig, peak_rss_bytes, trace

    case = CASES[name]
    os.environ.update(case["env"])
    config = SolveConfig(
        model_path=ROOT / case["file"],
        mesh=MeshSpec.from_options(case["mesh"]),
        mode=case["mode"],
        tie=False,
    )
    t0 = time.perf_counter()
    graph = trace(config)
    trace_s = time.perf_counter() - t0
    layers = layer_map(graph)
    result = plan_pipeline(config, graph, layers, case["pp"], 8)
    total = time.perf_counter() - t0
    step = result.stage_plan.step_time_s
    return {
        "case": name,
        "trace_s": round(trace_s, 3),
        "total_s": round(total, 3),
        "nodes": len(graph.nodes),
        "stage_ilps": result.costs.pricer.ilps,
        "status": f"balance {list(result.stage_plan.balance)}",
        "objective_s": step,
        "objective_ms": round(step * 1e3, 4),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def run_case(name: str) -> dict:
    """Solve one case in this process and return its measurements."""
    # imported in the case's own process, so that its wall time and memory include them
    import torch

    from autoshard.cost.mesh import MeshSpec
    from autoshard.plan.export import write_outputs
    from autoshard.plan.report import experts_summary
    from autoshard.solver.meshes import plan_mesh
    from autoshard.solver.solve import SolveConfig

    case = CASES[name]
    if "pp" in case:
        return run_stages_case(name)
    if "gpus" in case:
        return run_search_case(name)
    os.environ.update(case["env"])
    per_node = case.get("gpus_per_node")  # --gpus-per-node: the mesh laid over such nodes
    shape = tuple(int(d) for d in case["mesh"].split("x"))
    config = SolveConfig(
        model_path=ROOT / case["file"],
        mesh=MeshSpec.from_options(case["mesh"])
        if per_node is None
        else MeshSpec.on_nodes(shape, per_node),
        mode=case["mode"],
        tie=case["tie"],
        precision=case["precision"],
        memory_budget=case.get("memory_budget"),
        dtype=getattr(torch, case["dtype"]) if case.get("dtype") else None,
    )
    result = plan_mesh(config, gpus_per_node=per_node)  # as solve --mesh plans it
    with tempfile.TemporaryDirectory() as out:  # what a user waits for: files written too
        write_outputs(result.plan, out, "bench", config.cost_model(), result.solver_stats())
    st = result.sg.stats
    ilp = result.ilp
    plan = result.plan
    experts = experts_summary(plan)
    return {
        "case": name,
        **{f"{k}_s": round(v, 3) for k, v in result.seconds.items()},
        "nodes": st["nodes"],
        "decision_nodes": st["variables_nodes"],
        "strategies": st["strategies"],
        "ilp_variables": result.ilp.num_variables,
        "ilp_rows": result.ilp.num_constraints,
        **_highs_columns(result.highs),
        "status": result.ilp.status,
        "gap": result.ilp.gap,
        "objective_s": result.ilp.objective_s,
        "objective_ms": round(result.ilp.objective_s * 1e3, 4),
        "mfu": plan.mfu,
        "compute_ms": round((plan.compute_s + plan.optimizer_s) * 1e3, 3),
        "exposed_comm_ms": round((plan.comm_total_s - plan.hidden_total_s) * 1e3, 3),
        "experts": None
        if experts is None
        else ", ".join(f"{m} x{n}" for m, n in experts["modes"]["forward"].items())
        + f"; a2a {experts['all_to_all_s'] * 1e3:.3g} ms",
        "memory_bytes": plan.memory_bytes,
        "recomputed_blocks": len(result.plan.recomputed_blocks),
        "start": ilp.start,
        "vs_start": ilp.objective_s / ilp.start_objective_s if ilp.start_objective_s else None,
        "peak_rss_bytes": result.peak_rss_bytes,
    }


def _highs_columns(highs) -> dict:  # noqa: ANN001
    """HiGHS's own time: its LP relaxations, and branch and bound (relax-and-fix and the
    full MIP, each with its root LP); the rest of "solve s" is autoshard's. None of them
    for a plan lifted over the column cap (its sources' and neighbourhoods' ILPs are in
    its ``sources`` and ``neighbourhoods`` seconds)."""
    if highs is None:
        return {}
    return {
        "compile_s": round(highs.compile_seconds, 3),
        "highs_lp_s": round(highs.lp_seconds, 3),
        "highs_bnb_s": round(highs.mip_seconds, 3),
        "bnb_nodes": highs.nodes,
    }


# issue 29's targets for the wall time from process start to files written (quiet 2-core
# machine), each case optimal or within --mip-gap before any limit
TARGET_WALL_S = {
    "train gpt2-small 2x4": 5.0,
    "train gpt2-small 2x4 bf16-mixed": 5.0,
    "train qwen2 L4 2x4 bf16-mixed": 6.0,
    "train llama-7b-shape L32 2x4 bf16-mixed": 12.0,
    "train llama-7b-shape L32 4x8 bf16-mixed": 20.0,
    "train llama-70b-shape L80 32x2048 8x8 bf16-mixed": 45.0,
    # issue 32: the mesh search of 64 GPUs, pipeline depths included
    "search llama-70b-shape L80 32x2048 64 GPUs 8/node pp2+4 bf16-mixed": 180.0,
}

# the phases a case's wall time splits into: start-up (Python, imports, writing the files)
# is the wall time the phases do not account for
_PHASES = (
    ("start-up", "startup_s"),
    ("trace", "trace_s"),
    ("strategies", "strategies_s"),
    ("hand plans", "hand_plans_s"),
    ("ILP", "ilp_s"),
)


def _account(row: dict) -> None:
    """Adds ``startup_s``, ``ilp_s``, ``target_s`` and ``largest`` (the phase that takes
    the most of the wall time: what stands in the way of the target) to a case's row."""
    row["startup_s"] = round(row["wall_s"] - row["total_s"], 2)
    if "solve_s" in row:
        row["ilp_s"] = round(row.get("ilp_build_s", 0.0) + row["solve_s"], 3)
    elif "sources_s" in row:  # over the cap: its sources' ILPs, lift and neighbourhoods
        row["ilp_s"] = round(row["total_s"] - row["trace_s"] - row["strategies_s"], 3)
    else:  # a stages or search case: everything after the trace is its ILPs and strategies
        row["ilp_s"] = round(row["total_s"] - row.get("trace_s", 0.0), 3)
    row["target_s"] = TARGET_WALL_S.get(row["case"])
    phases = [(label, row[key]) for label, key in _PHASES if isinstance(row.get(key), float)]
    label, seconds = max(phases, key=lambda p: p[1])
    row["largest"] = f"{label} {seconds:.1f} s ({seconds / row['wall_s']:.0%})"


_FLOOR_PROGRAM = (
    "import sys\n"
    "from autoshard.model.model_file import load_model_file\n"
    "load_model_file(sys.argv[1])\n"
)


def import_floor_s(file: str, env: dict[str, str]) -> float:
    """Seconds from process start to the model file loaded, in a process of its own: the
    Python start-up, torch, autoshard's model loader and whatever the file itself imports
    (``transformers``' model code, for the HuggingFace cases). No tool that reads this
    model file plans it sooner on this machine: ``wall s`` less this is what the planner
    itself takes (trace, strategies, the ILP, the report, the files).

    Args:
        file: the model file, relative to the checkout (or absolute).
        env: environment variables laid over this process's for the load.

    Raises:
        click.ClickException: the file did not load (its last line of error output).
    """
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _FLOOR_PROGRAM, str(ROOT / file)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **env},
    )
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise click.ClickException(f"loading {file} failed: {last_error_line(proc)}")
    return took


def last_error_line(proc: subprocess.CompletedProcess) -> str:
    """The last line a finished process wrote to its (captured) stderr, or ``?``."""
    text = proc.stderr.strip()
    return text.splitlines()[-1] if text else "?"


@click.command()
@click.option("--case", "case", default=None, help="Run one case in this process (internal).")
@click.option("--only", default=None, help="Comma-separated case names to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def main(case: str | None, only: str | None, as_json: bool) -> None:
    """Benchmark autoshard solve on the bundled models (see docs/performance.md)."""
    if case:
        click.echo(json.dumps(run_case(case)))
        # as the autoshard command does (cli.main.entry): no interpreter teardown
        sys.stdout.flush()
        os._exit(0)
    names = only.split(",") if only else list(CASES)
    rows = []
    floors: dict[tuple, float | None] = {}
    console = Console(width=220)
    # progress on stderr, so that --json prints JSON alone on stdout
    progress = Console(width=220, stderr=True)
    for name in names:
        progress.print(f"[dim]running {name} ...[/dim]")
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "autoshard.bench", "--case", name],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        wall = time.perf_counter() - t0  # process start (imports) to files written
        if proc.returncode != 0:
            progress.print(f"[red]{name} failed:[/red] {last_error_line(proc)}")
            continue
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["wall_s"] = round(wall, 2)
        file, env = CASES[name]["file"], CASES[name]["env"]
        key = (file, tuple(sorted(env.items())))
        if key not in floors:  # once per model file and environment
            try:
                floors[key] = round(import_floor_s(file, env), 2)
            except click.ClickException as exc:  # the case ran: keep its row, say why
                progress.print(f"[red]{name}: no floor:[/red] {exc.message}")
                floors[key] = None
        row["floor_s"] = floors[key]
        _account(row)
        rows.append(row)
        progress.print(
            f"[dim]{name}: wall {wall:.1f} s (model import {row['floor_s']} s; largest: "
            f"{row['largest']}), {row['status']}, "
            f"objective {row['objective_ms']} ms, "
            f"peak {row['peak_rss_bytes'] / 2**30:.2f} GiB[/dim]"
        )
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    # two tables, so that each fits a terminal: where the seconds go, and what was found
    timing = [
        ("case", "case"),
        ("wall s", "wall_s"),
        ("target s", "target_s"),
        ("model import s", "floor_s"),
        ("start-up s", "startup_s"),
        ("trace s", "trace_s"),
        ("strategies s", "strategies_s"),
        ("ILP build s", "ilp_build_s"),
        ("solve s", "solve_s"),
        ("largest", "largest"),
        ("cvxpy s", "compile_s"),
        ("HiGHS LP s", "highs_lp_s"),
        ("HiGHS B&B s", "highs_bnb_s"),
        ("B&B nodes", "bnb_nodes"),
        ("stage ILPs", "stage_ilps"),
        ("ILP variables", "ilp_variables"),
        ("ILP rows", "ilp_rows"),
        ("peak memory", "peak_rss_bytes"),
    ]
    found = [
        ("case", "case"),
        ("status", "status"),
        ("gap", "gap"),
        ("objective ms", "objective_ms"),
        ("MFU", "mfu"),
        ("compute ms", "compute_ms"),
        ("exposed comm ms", "exposed_comm_ms"),
        ("vs start", "vs_start"),
        ("plan memory/device", "memory_bytes"),
        ("recomputed blocks", "recomputed_blocks"),
        ("nodes", "nodes"),
        ("decision nodes", "decision_nodes"),
        ("strategies", "strategies"),
        ("experts (forward modes per mesh dim)", "experts"),
    ]
    for title, cols in (
        ("autoshard solve: seconds and sizes (H100 cost model, 2 CPU cores)", timing),
        ("autoshard solve: the plans found", found),
    ):
        console.print(_table(title, cols, rows))


def _table(title: str, cols: list[tuple[str, str]], rows: list[dict]) -> Table:
    """One rich table of ``rows``, a column per ``(title, key)`` of ``cols``."""
    table = Table(title=title)
    for heading, _ in cols:
        left = heading in ("case", "status", "largest") or heading.startswith("experts")
        table.add_column(heading, justify="left" if left else "right")
    for row in rows:
        cells = []
        for _, key in cols:
            v = row.get(key)
            if key in ("peak_rss_bytes", "memory_bytes") and v is not None:
                cells.append(f"{v / 2**30:.2f} GiB")
            elif key == "vs_start" and isinstance(v, float):
                cells.append(f"{v:.3f}x")
            elif key in ("gap", "mfu") and isinstance(v, float):
                cells.append(f"{v:.3%}")
            elif isinstance(v, float):
                cells.append(f"{v:.2f}" if key.endswith("_s") else f"{v:.6g}")
            else:
                cells.append("-" if v is None else str(v))
        table.add_row(*cells)
    return table


if __name__ == "__main__":
    main()
