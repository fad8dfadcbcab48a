"""Pipeline pricing (``autoshard stages``): layers, each candidate stage priced, the plan.

The model is traced once, on one micro-batch. Its layers are the repeated blocks the tracer
found (``NodeInfo.layer``), or, for a model without repeated blocks, the layers that
:func:`autoshard.pipeline.stages.cluster_layers` builds from the forward ops. For each pipeline
degree ``pp`` the strategy graph of the model on the stage submesh
(:func:`autoshard.pipeline.stages.submesh_shape`) is built once, and each candidate stage (layers
``i..j-1``) is priced by its own intra-op ILP (:mod:`autoshard.pipeline.stage_ilp`): its compute,
resharding and the send/receive of what crosses its boundaries.
:func:`autoshard.pipeline.stages.assign_stages` then picks the contiguous split with the least 1F1B
step time. docs/pipeline-stages.md ("The stages command") gives the cost model and what it
leaves out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from autoshard import __version__, interrupt
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.pipeline.stage_ilp import StagePricer
from autoshard.pipeline.stage_plan import save_stage_plan
from autoshard.pipeline.stages import (
    OpCost,
    StageCost,
    assign_stages,
    cluster_layers,
    even_split,
    even_split_fits,
    pipeline_degrees,
    stage_ranks,
    submesh_shape,
    usable_stages,
)
from autoshard.placements import placements_to_str, whole_on_single
from autoshard.plan.export import output_stem
from autoshard.plan.formats import STAGE_PLAN_FORMAT
from autoshard.plan.plan import build_plan
from autoshard.solver.solve import refuse_pipeline_accumulation, strategies, trace
from autoshard.trace.ops import is_heavy
from autoshard.units import format_bytes, format_seconds

# --------------------------------------------------------------------------------------------
# Layers of a traced graph
# --------------------------------------------------------------------------------------------


@dataclass
class LayerMap:
    """Which layer each graph node belongs to.

    Attributes:
        num_layers: L.
        source: ``"blocks"`` (the model's repeated blocks) or ``"clustering"``
            (:func:`autoshard.pipeline.stages.cluster_layers` over the ops).
        layer_of: node name -> layer index, for every node of the graph. Inputs are in layer 0
            (the first stage receives them); parameters and buffers in the first layer that
            reads them.
        modules: per layer, the module FQNs it holds (the block FQN for blocks; the distinct
            module paths of its ops, in order, for clustered layers).
        first_module: per layer, the FQN where it starts (a split point), or None.
        param_layers: parameter node name -> every layer whose ops read it.
    """

    num_layers: int
    source: str
    layer_of: dict[str, int]
    modules: list[list[str]]
    first_module: list[str | None]
    param_layers: dict[str, set[int]]


def layer_map(graph) -> LayerMap:
    """Assign every node of ``graph`` (a :class:`~autoshard.trace.tracer.TracedGraph`) to a layer.

    With repeated blocks, an op takes its block's index; an op outside every block goes with
    the nearest block before it (ops before the first block go with layer 0, after the last
    block with the last layer). Without blocks, the ops are clustered by
    :func:`autoshard.pipeline.stages.cluster_layers` (number of layers chosen automatically).

    Raises:
        AutoshardError: from the clustering, when the graph has no ops.
    """
    nodes = graph.nodes
    ops = [n for n, info in nodes.items() if info.kind == "op"]
    layer_of: dict[str, int] = {}
    if graph.block_prefixes and any(nodes[n].layer is not None for n in ops):
        source = "blocks"
        ids = sorted(set(graph.block_prefixes.values()))
        index = {b: k for k, b in enumerate(ids)}  # block number -> layer (dense)
        num_layers = len(ids)
        # forward: an op outside every block goes with the block before it; backward
        # (blocks in reverse order): with the block whose backward ran last, so the head's
        # backward goes with the last layer and the embeddings' with layer 0
        current, current_bw = 0, num_layers - 1
        for n in ops:
            info = nodes[n]
            if info.backward:
                if info.layer is not None:
                    current_bw = index[info.layer]
                layer_of[n] = current_bw
            else:
                if info.layer is not None:
                    current = index[info.layer]
                layer_of[n] = current
        by_layer = {index[i]: p for p, i in graph.block_prefixes.items()}
        modules = [[by_layer[k]] for k in range(num_layers)]
        first_module: list[str | None] = [by_layer[k] for k in range(num_layers)]
    else:
        source = "clustering"
        forward = [n for n in ops if not nodes[n].backward]
        if not forward:
            raise AutoshardError(f"{graph.model_name} has no ops to split into pipeline stages")
        pos = {n: k for k, n in enumerate(forward)}
        costs = [
            OpCost(n, nodes[n].flops, is_heavy(nodes[n].target), nodes[n].module_path)
            for n in forward
        ]
        edges = []
        for n in forward:
            for a in dict.fromkeys(nodes[n].arg_nodes):
                if a in pos:
                    size = max((r.nbytes for r in nodes[a].results if r is not None), default=0)
                    edges.append((pos[a], pos[n], size))
        ranges = cluster_layers(costs, edges)
        num_layers = len(ranges)
        modules, first_module = [], []
        module_layer: dict[str, int] = {}
        for k, r in enumerate(ranges):
            for i in r:
                layer_of[forward[i]] = k
                if nodes[forward[i]].module_path:
                    module_layer[nodes[forward[i]].module_path] = k
            paths = [nodes[forward[i]].module_path for i in r]
            modules.append(list(dict.fromkeys(p for p in paths if p)))
            first_module.append(paths[0])
        # a backward op goes with the layer of its module's forward ops; one outside every
        # module with the layer whose backward ran last (the last layer before any)
        current_bw = num_layers - 1
        for n in ops:
            if nodes[n].backward:
                current_bw = module_layer.get(nodes[n].module_path, current_bw)
                layer_of[n] = current_bw

    users = graph.users()
    param_layers: dict[str, set[int]] = {}
    for n, info in nodes.items():
        if info.kind == "output":
            layer_of[n] = num_layers - 1
        elif info.kind == "input":
            layer_of[n] = 0
        elif info.kind == "tangent":  # the loss's seed gradient: where the backward starts
            layer_of[n] = num_layers - 1
        elif info.kind in ("param", "buffer"):
            used = {layer_of[u] for u in users.get(n, []) if u in layer_of}
            used |= {num_layers - 1 for u in users.get(n, []) if nodes[u].kind == "output"}
            layer_of[n] = min(used) if used else 0
            if info.kind == "param":
                param_layers[n] = used or {0}
    return LayerMap(num_layers, source, layer_of, modules, first_module, param_layers)


# --------------------------------------------------------------------------------------------
# Stage costs: one intra-op ILP per candidate stage on the stage submesh
# --------------------------------------------------------------------------------------------


@dataclass
class PipelineCosts:
    """One pipeline degree: its submesh and the per-stage ILPs that price its stages.

    Attributes:
        pp: the pipeline degree.
        mesh: the stage submesh (:func:`autoshard.pipeline.stages.submesh_shape`) as a
            :class:`~autoshard.cost.mesh.MeshSpec`, with the mesh's bandwidths.
        pricer: the :class:`~autoshard.pipeline.stage_ilp.StagePricer` (cached per-stage ILPs).
    """

    pp: int
    mesh: Any
    pricer: Any

    @property
    def submesh(self) -> tuple[int, ...]:
        return self.mesh.shape

    def stage_time(self, i: int, j: int) -> float:
        """Seconds per micro-batch of a stage holding layers i..j-1 (its ILP's objective:
        compute, resharding, the receive of its inputs and the send of its outputs, and in
        training the backward pass and 1/B of its gradient reductions)."""
        return self.pricer.price(i, j).time_s

    def p2p_time(self, i: int, j: int) -> float:
        return self.pricer.price(i, j).p2p_s

    def stage_memory(self, i: int, j: int) -> float:
        """Bytes per device of the stage's plan (parameters, and in training gradients,
        AdamW state and the saved activations of the micro-batches in flight)."""
        return self.pricer.price(i, j).memory_bytes

    def stage_parameters(self, graph, i: int, j: int) -> dict[str, Any]:
        """Parameter FQN (every alias) -> placements of the stage's plan, ``Replicate`` on
        the submesh's size-1 dims (a shard over one device is the whole tensor)."""
        stage, choice = self.pricer.choice(i, j)
        plan = build_plan(stage.sg, choice, self.mesh, name=f"stage {i}..{j - 1}")
        return {name: whole_on_single(ps, self.submesh) for name, ps in plan.parameters.items()}


def price_pipeline(
    config, graph, layers: LayerMap, pp: int, microbatches: int = 1
) -> PipelineCosts:
    """Build the strategy graph of the model on the stage submesh of ``pp``, ready to price
    any stage by its own ILP (:class:`~autoshard.pipeline.stage_ilp.StagePricer`).

    Raises:
        AutoshardError: a pp that does not split the mesh, more stages than layers.
    """
    mesh = config.mesh
    sub = submesh_shape(mesh.shape, pp)
    _check_stages(pp, layers)  # before the strategies: a cheap refusal
    sub_mesh = MeshSpec(sub, mesh.dim_names, mesh.bandwidth, mesh.latency)
    # untied: every layer's nodes are its own, so a stage can be cut out of the graph
    sub_config = replace(config, mesh=sub_mesh, tie=False)
    sg = strategies(sub_config, graph)
    in_flight = min(pp, microbatches) if graph.mode == "train" else 1
    pricer = StagePricer(
        sub_config,
        sg,
        layers.layer_of,
        layers.param_layers,
        layers.num_layers,
        microbatches,
        in_flight,
    )
    return PipelineCosts(pp, sub_mesh, pricer)


# --------------------------------------------------------------------------------------------
# Stage plans
# --------------------------------------------------------------------------------------------


@dataclass
class StagesResult:
    """The chosen stage plan of one pipeline degree and how it was priced."""

    costs: PipelineCosts
    stage_plan: Any  # autoshard.pipeline.stages.StagePlan


def plan_pipeline(
    config,
    graph,
    layers: LayerMap,
    pp: int,
    microbatches: int,
    memory_budget: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    split: Sequence[int] | None = None,
    costs: PipelineCosts | None = None,
) -> StagesResult:
    """Price degree ``pp`` (:func:`price_pipeline`) and split the layers into ``pp`` stages.
    ``progress(done, total)``: called before each candidate stage is priced and once at the
    end (``total``: the stages of every split,
    :func:`~autoshard.pipeline.stages.usable_stages`; a stage structurally equal to one
    priced before costs no ILP). ``split``: price only that split's stages (boundaries
    ``0 = b_0 < ... < b_pp = L``, :func:`~autoshard.pipeline.stages.assign_stages`).
    ``costs``: this degree's :func:`price_pipeline`, when the caller built it already.

    Raises:
        AutoshardError: a pp that does not split the mesh, more stages than layers, an
            infeasible ILP, no split within the memory budget.
    """
    submesh_shape(config.mesh.shape, pp)  # a bad pp fails before any ILP
    refuse_pipeline_accumulation(config)
    _check_stages(pp, layers)
    if costs is None:
        costs = price_pipeline(config, graph, layers, pp, microbatches)
    total = len(usable_stages(layers.num_layers, pp)) if split is None else pp
    done = 0

    def stage_cost(i: int, j: int) -> StageCost:
        nonlocal done
        if progress is not None:
            progress(done, total)
        done += 1
        return StageCost(costs.stage_time(i, j), costs.stage_memory(i, j))

    sp = assign_stages(
        layers.num_layers,
        pp,
        microbatches,
        stage_cost,
        # stages over the budget carry time 0 (see StagePrice): always filter by memory
        memory_budget=memory_budget if memory_budget is not None else config.budget(),
        split=split,
    )
    if progress is not None:
        progress(total, total)
    return StagesResult(costs, sp)


def _check_stages(pp: int, layers: LayerMap) -> None:
    if pp > layers.num_layers:
        n = layers.num_layers
        one = n == 1
        what = {
            ("blocks", True): "repeated block",
            ("blocks", False): "repeated blocks",
            ("clustered", True): "layer (clustered)",
            ("clustered", False): "layers (clustered)",
        }["blocks" if layers.source == "blocks" else "clustered", one]
        fewer = "it cannot be split into stages" if one else f"use --pp {n} or fewer"
        raise AutoshardError(
            f"cannot split {n} layer{'' if one else 's'} into {pp} pipeline stages: the model "
            f"has {n} {what}; {fewer}"
        )


def tied_across_stages(graph, layers: LayerMap, boundaries) -> list[str]:
    """Parameter FQNs (keys of ``graph.param_names``) read by more than one stage."""
    bounds = list(boundaries)

    def stage(layer: int) -> int:
        return max(s for s in range(len(bounds) - 1) if bounds[s] <= layer)

    out = []
    for n, used in layers.param_layers.items():
        if len({stage(k) for k in used}) > 1:
            fqn = graph.nodes[n].fqn
            owner = (
                fqn
                if fqn in graph.param_names
                else next((k for k, v in graph.param_names.items() if fqn in v), fqn)
            )
            out.append(owner)
    return sorted(set(out))


def stage_plan_dict(
    graph, layers: LayerMap, result: StagesResult, mesh, tried: dict[int, Any] | None = None
) -> dict[str, Any]:
    """The stage plan file's content (format ``autoshard.stage_plan/1``, docs/formats.md)."""
    sp, costs = result.stage_plan, result.costs
    bounds = list(sp.boundaries)
    stages = []
    for s, (i, j) in enumerate(zip(bounds, bounds[1:], strict=False)):
        params = {k: placements_to_str(v) for k, v in costs.stage_parameters(graph, i, j).items()}
        stages.append(
            {
                "layers": [i, j],
                "module_paths": [m for k in range(i, j) for m in layers.modules[k]],
                "split_points": [layers.first_module[j]]
                if j < layers.num_layers and layers.first_module[j]
                else [],
                "predicted": {
                    "time_s": costs.stage_time(i, j),
                    "p2p_s": costs.p2p_time(i, j),
                    "memory_bytes": costs.stage_memory(i, j),
                },
                "submesh": list(costs.submesh),
                "ranks": list(stage_ranks(mesh.shape, costs.pp, s)),
                "parameters": dict(sorted(params.items())),
            }
        )
    out: dict[str, Any] = {
        "format": STAGE_PLAN_FORMAT,
        "autoshard_version": __version__,
        "model": graph.model_name,
        "mesh": mesh.to_dict(),
        "pp": costs.pp,
        "microbatches": sp.microbatches,
        "layers": {"count": layers.num_layers, "source": layers.source},
        "balance": list(sp.balance),
        "stages": stages,
        "tied_weights_across_stages": tied_across_stages(graph, layers, bounds),
        "step_time_s": sp.step_time_s,
    }
    if graph.mode == "train":  # the AdamW the stages were priced with, which launch builds
        out["optimizer"] = costs.pricer.sg.optimizer
    if tried:
        out["degrees"] = {
            str(k): (v.stage_plan.step_time_s if isinstance(v, StagesResult) else str(v))
            for k, v in sorted(tried.items())
        }
    return out


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _span(paths: list[str]) -> str:
    if not paths:
        return "-"
    return paths[0] if len(paths) == 1 else f"{paths[0]} .. {paths[-1]}"


def print_stages(console: Console, data: dict[str, Any], path: Path | None = None) -> None:
    """Stages side by side: one column per stage."""
    stages = data["stages"]
    table = Table(
        title=f"{data['model']} on {'x'.join(map(str, data['mesh']['shape']))}: "
        f"pp={data['pp']}, {data['microbatches']} micro-batches, "
        f"{data['layers']['count']} layers ({data['layers']['source']})"
    )
    table.add_column("", style="bold")
    for s in range(len(stages)):
        table.add_column(f"stage {s}", justify="right")
    rows = [
        ("layers", [f"{a}..{b - 1} ({b - a})" for a, b in (st["layers"] for st in stages)]),
        ("modules", [_span(st["module_paths"]) for st in stages]),
        ("split point", [", ".join(st["split_points"]) or "-" for st in stages]),
        ("submesh", ["x".join(map(str, st["submesh"])) for st in stages]),
        ("ranks", [f"{st['ranks'][0]}..{st['ranks'][-1]}" for st in stages]),
        ("time / micro-batch", [format_seconds(st["predicted"]["time_s"]) for st in stages]),
        ("  of which send/recv", [format_seconds(st["predicted"]["p2p_s"]) for st in stages]),
        ("memory / device", [format_bytes(st["predicted"]["memory_bytes"]) for st in stages]),
    ]
    for label, cells in rows:
        table.add_row(label, *cells)
    console.print(table)
    if "degrees" in data:
        tried = ", ".join(
            f"pp={k}: " + (format_seconds(v) if isinstance(v, float) else v)
            for k, v in data["degrees"].items()
        )
        console.print(f"pipeline degrees tried: {tried}")
    console.print(
        f"balance {data['balance']}, predicted step time {format_seconds(data['step_time_s'])}"
    )
    if data["tied_weights_across_stages"]:
        console.print(
            "parameters held by several stages: " + ", ".join(data["tied_weights_across_stages"])
        )
    if path is not None:
        console.print(f"wrote {path}")


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def _parse_pp(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        pp = int(text)
    except ValueError:
        raise AutoshardError(f"--pp {text!r}: give a pipeline degree (an integer) or auto") from (
            None
        )
    if pp < 1:
        raise AutoshardError(f"--pp {pp}: a pipeline needs at least 1 stage")
    return pp


def run_stages(
    config,
    pp_text: str,
    microbatches: int,
    memory_budget: float | None,
    out_dir: Path,
    console: Console,
    log: Console,
    split_rule: str = "search",
) -> tuple[Path, dict[str, Any]]:
    """Trace, price each candidate degree, pick the fastest, write and print the stage plan.

    ``split_rule``: ``"search"`` prices every split of the layers (every layer traced);
    ``"torchtitan"`` prices only torchtitan's split of each degree
    (:func:`~autoshard.pipeline.stages.even_split`), one ILP per stage, on one trace
    reduced within each segment between those splits' boundaries
    (:func:`~autoshard.trace.tracer.reduce_depth`), as ``solve --gpus --pp`` prices a
    deep model's depths.
    """
    if microbatches < 1:
        raise AutoshardError(f"--microbatches {microbatches}: give an integer >= 1")
    if split_rule not in ("search", "torchtitan"):
        raise AutoshardError(f"--split {split_rule!r}: choose search or torchtitan")
    mesh = config.mesh
    pp = _parse_pp(pp_text)
    if pp is not None:
        submesh_shape(mesh.shape, pp)  # fail fast, before tracing
    log.print(f"tracing {config.model_path} (meta device)")
    candidates = [pp] if pp is not None else pipeline_degrees(mesh.shape)

    def union(n: int) -> list[int] | None:  # the cuts of every degree's torchtitan split
        cuts = {c for d in candidates if even_split_fits(n, d) for c in even_split(n, d)}
        return sorted(cuts) or None

    bounds = union if split_rule == "torchtitan" else None
    graph = trace(config, microbatches=microbatches, stage_bounds=bounds)
    layers = layer_map(graph)
    log.print(f"{layers.num_layers} layers ({layers.source})")
    tried: dict[int, Any] = {}
    degrees = (
        [pp]
        if pp is not None
        else [d for d in pipeline_degrees(mesh.shape) if d <= layers.num_layers]
    )
    best = None
    for d in degrees:
        t0 = time.perf_counter()
        log.print(
            f"pp={d}: one intra-op ILP per candidate stage on submesh "
            f"{'x'.join(map(str, submesh_shape(mesh.shape, d)))}"
        )
        try:
            split = even_split(layers.num_layers, d) if split_rule == "torchtitan" else None
            r = plan_pipeline(config, graph, layers, d, microbatches, memory_budget, split=split)
        except AutoshardError as exc:
            if pp is not None:
                raise
            tried[d] = f"infeasible ({exc})"
            continue
        log.print(
            f"pp={d}: {r.costs.pricer.ilps} stage ILPs ({r.stage_plan.stage_cost_calls} stages "
            f"priced) in {time.perf_counter() - t0:.1f} s"
        )
        tried[d] = r
        if best is None or r.stage_plan.step_time_s < best.stage_plan.step_time_s * (1 - 1e-12):
            best = r
    if best is None:
        raise AutoshardError(
            "no pipeline degree of mesh "
            f"{mesh.shape_str} gives a feasible stage plan: "
            + "; ".join(f"pp={k}: {v}" for k, v in tried.items())
        )
    if pp is not None:
        tried = {}
    data = stage_plan_dict(graph, layers, best, mesh, tried or None)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise AutoshardError(f"cannot create the output folder {out}: {exc.strerror}") from exc
    path = out / f"{output_stem(graph.model_name, mesh.shape)}_pp{best.costs.pp}.stages.json"
    interrupt.check()  # a Ctrl-C some library swallowed still stops the write
    save_stage_plan(path, data)
    print_stages(console, data, path)
    return path, data


__all__ = [
    "STAGE_PLAN_FORMAT",
    "LayerMap",
    "PipelineCosts",
    "StagesResult",
    "layer_map",
    "plan_pipeline",
    "price_pipeline",
    "print_stages",
    "stage_plan_dict",
    "tied_across_stages",
]
