"""The terminal report of a plan (rich): per-layer placements, cost split, memory, solver."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autoshard.cost.collective_table import COLLECTIVES
from autoshard.cost.overlap import OVERLAP_SLOWDOWN
from autoshard.placements import placements_to_str, short
from autoshard.plan.plan import Plan
from autoshard.strategies.strategy import local_shape
from autoshard.trace.experts import EXPERT_OPS, EXPERTS_FORWARD
from autoshard.trace.ops import is_heavy, is_view
from autoshard.trace.tracer import path_within_block
from autoshard.units import format_bandwidth, format_bytes, format_seconds


def format_ranges(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    xs = sorted(set(layers))
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}" if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def split_block(fqn: str, blocks: dict[str, int]) -> tuple[int, str] | None:
    """``(block index, name inside the block)`` of a parameter FQN, or None outside the
    repeated blocks."""
    prefix = next((p for p in blocks if fqn.startswith(p + ".")), None)
    return None if prefix is None else (blocks[prefix], fqn[len(prefix) + 1 :])


def layer_table(plan: Plan) -> Table:
    """Placements of every weight, repeated blocks folded: one row per weight of a block."""
    graph = plan.sg.graph
    blocks = graph.block_prefixes
    dims = " · ".join(plan.mesh.dim_names)
    table = Table(title=f"Plan: parameter placements (mesh dims {dims})", show_lines=False)
    # names wrap rather than being cut with an ellipsis on a narrow terminal
    table.add_column("parameter", overflow="fold")
    table.add_column("layers", overflow="fold")
    table.add_column("placement", style="bold", no_wrap=True)
    table.add_column("shape", style="dim", overflow="fold")
    shapes = {n.fqn: n.results[0].shape for n in graph.nodes.values() if n.kind == "param"}
    for owner, names in graph.param_names.items():
        for alias in names:
            shapes.setdefault(alias, shapes.get(owner))
    # (parameter path inside the block, placement) -> layers holding it, and one real FQN
    rows: dict[tuple[str, str], tuple[list[int], str]] = {}
    for fqn, ps in plan.parameters.items():
        where = split_block(fqn, blocks)
        if where is None:
            table.add_row(fqn, "", short(ps), str(shapes.get(fqn, "")))
            continue
        layers, _ = rows.setdefault((where[1], short(ps)), ([], fqn))
        layers.append(where[0])
    for (sub, ps), (layers, example) in rows.items():
        table.add_row(f"<block>.{sub}", format_ranges(layers), ps, str(shapes.get(example, "")))
    return table


def activation_rows(plan: Plan) -> list[tuple[str, str, str, str]] | None:
    """How one block's activations are placed (the forward pass of the first traced block):
    the residual stream that enters it, the output of every heavy op inside it (matmuls,
    attention: the attention and MLP interiors) and what leaves it. Rows ``(where, op,
    placement, local shape)``: the shape one device holds. None for a model without
    repeated blocks."""
    graph = plan.sg.graph
    layers = [i.layer for i in graph.nodes.values() if i.layer is not None and not i.backward]
    if not layers:
        return None
    first = min(layers)
    inside = [
        n for n, i in graph.nodes.items() if i.layer == first and not i.backward and i.kind == "op"
    ]
    members = set(inside)
    within = path_within_block(graph.block_prefixes)
    mesh_shape = plan.mesh.shape
    rows: list[tuple[str, str, str, str]] = []

    def add(where: str, node: str, what: str) -> None:
        strategy = plan.node_strategy.get(node)
        result = graph.nodes[node].results[0] if graph.nodes[node].results else None
        if strategy is None or result is None or strategy.outputs[0] is None:
            return
        ps = strategy.outputs[0]
        rows.append((where, what, short(ps), str(local_shape(result.shape, ps, mesh_shape))))

    def op(node: str) -> str:
        name = graph.nodes[node].op_name.removeprefix("aten.").removesuffix(".default")
        return "attention (SDPA)" if name.startswith("_scaled_dot_product") else name

    # activations made outside the block and read inside it (the residual stream), and
    # those made inside and read by a forward op outside (what leaves it); views skipped
    entering: dict[str, None] = {}
    read_outside: set[str] = set()
    for n, info in graph.nodes.items():
        if info.backward or info.kind != "op":
            continue
        if n in members:
            entering.update(
                (a, None)
                for a in info.arg_nodes
                if a not in members
                and graph.nodes.get(a) is not None
                and graph.nodes[a].kind in ("op", "input")
            )
        else:
            read_outside.update(a for a in info.arg_nodes if a in members)
    for a in entering:
        if not is_view(graph.nodes[a].target):
            add("block input", a, op(a))
    for n in inside:
        info = graph.nodes[n]
        if is_heavy(info.target):
            add(within(info.module_path) or "", n, op(n))
    for n in inside:
        if n in read_outside and not is_view(graph.nodes[n].target):
            add("block output", n, op(n))
    return rows


def activation_table(plan: Plan) -> Table | None:
    """:func:`activation_rows` as a table (None without repeated blocks)."""
    rows = activation_rows(plan)
    if rows is None:
        return None
    dims = " · ".join(plan.mesh.dim_names)
    table = Table(title=f"Plan: activations of one block, forward (mesh dims {dims})")
    table.add_column("where", overflow="fold")
    table.add_column("op", overflow="fold")
    table.add_column("placement", style="bold", no_wrap=True)
    table.add_column("local shape", style="dim", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _block_plans(plan: Plan) -> dict[int, tuple]:
    """Block index -> its parameters' placements (within-block name, placement), sorted."""
    out: dict[int, list] = {}
    for fqn, ps in plan.parameters.items():
        where = split_block(fqn, plan.sg.graph.block_prefixes)
        if where is not None:
            out.setdefault(where[0], []).append((where[1], short(ps)))
    return {b: tuple(sorted(v)) for b, v in out.items()}


def block_differences(plan: Plan) -> list[str]:
    """Why a repeated block is planned unlike most blocks: one line per such group.

    The blocks whose parameters are placed as most blocks are is the usual plan; for each
    other group, its first block is given the usual plan (each of its nodes the strategy
    of the same node, aligned by op, parameter name and shapes, of the nearest usual
    block) and the step is priced again (:func:`autoshard.cost.objective.evaluate`): the
    difference is what the block's own plan saves. Nodes with no counterpart, or whose
    counterpart's strategy is not one of theirs, keep their own.
    """
    import difflib

    from autoshard.cost.objective import evaluate

    sg, graph = plan.sg, plan.sg.graph
    plans = _block_plans(plan)
    by_plan: dict[tuple, list[int]] = {}
    for b, key in sorted(plans.items()):
        by_plan.setdefault(key, []).append(b)
    if len(by_plan) < 2:
        return []
    usual = max(by_plan.values(), key=len)
    seq: dict[int, list[str]] = {}
    for name, info in graph.nodes.items():
        if info.layer is not None:
            seq.setdefault(info.layer, []).append(name)
    # a depth-reduced graph (autoshard.trace.tracer.reduce_depth) traces one block for many:
    # every block is compared through the traced block that stands for it
    traced = {b: b for b in seq}
    if graph.depth is not None:
        traced = {j: sf[0] for sf in graph.depth.stands_for for j in sf if sf[0] in seq}

    within_block = path_within_block(graph.block_prefixes)

    def sig(name: str) -> tuple:
        info = graph.nodes[name]
        within = within_block(info.fqn if info.kind == "param" else info.module_path)
        shapes = tuple(t.shape if t is not None else None for t in (*info.args, *info.results))
        return (info.op_name, within, shapes)

    base = evaluate(sg, plan.choice)
    lines = []
    for blocks in by_plan.values():
        if blocks is usual:
            continue
        which = ("block " if len(blocks) == 1 else "blocks ") + format_ranges(blocks)
        others = ("block " if len(usual) == 1 else "blocks ") + format_ranges(usual)
        of_others = f"the plan of {others}"
        b = next((traced[k] for k in blocks if k in traced), None)
        twins = [u for u in usual if u in traced and traced[u] != b]
        if b is None or not twins:
            lines.append(f"{which} planned unlike {others} (no traced pair of blocks to price)")
            continue
        m = traced[min(twins, key=lambda u: abs(u - b))]
        a_sig, m_sig = [sig(n) for n in seq[b]], [sig(n) for n in seq[m]]
        sm = difflib.SequenceMatcher(None, a_sig, m_sig, autojunk=False)
        choice = dict(plan.choice)
        for blk in sm.get_matching_blocks():
            for k in range(blk.size):
                node, twin = seq[b][blk.a + k], seq[m][blk.b + k]
                ns = sg.nodes.get(node)
                if ns is None or ns.rep != node or twin not in plan.node_strategy:
                    continue
                want = plan.node_strategy[twin]
                if want in ns.strategies:
                    choice[node] = ns.strategies.index(want)
        delta = (evaluate(sg, choice) - base) * plan.grad_accumulation  # the step's
        if not math.isfinite(delta):
            why = (
                f"{of_others} does not join this block's neighbours here (no priced "
                "redistribution between them), so it cannot be compared"
            )
        elif abs(delta) <= 1e-9 * max(base, 1e-12):
            why = f"{of_others} there would cost the same (the two are equally fast here)"
        elif delta > 0:
            why = f"{of_others} there would add {format_seconds(delta)} to the step"
        else:
            why = (
                f"{of_others} there would be {format_seconds(-delta)} faster: the solver "
                "stopped within its gap, or the memory budget chose this"
            )
        lines.append(f"{which} planned unlike {others}: {why}")
    return lines


def cost_table(plan: Plan) -> Table:
    """Predicted step time split into compute, the optimizer step and each collective
    kind (its total, what hiding it under compute saves, and the rest, exposed: a
    collective overlapped whole still costs ``OVERLAP_SLOWDOWN`` of its seconds over ``1 +
    OVERLAP_SLOWDOWN``, the compute it slows; :mod:`autoshard.cost.overlap`). A step that
    accumulates gradients (:attr:`Plan.grad_accumulation`) counts every micro-batch."""
    title = "Predicted time per step (one device)"
    if plan.grad_accumulation > 1:
        title += f": {plan.grad_accumulation} micro-batches, one optimizer step"
    table = Table(title=title)
    table.add_column("part")
    table.add_column("time", justify="right")
    table.add_column("hidden", justify="right")
    table.add_column("exposed", justify="right")
    table.add_column("count", justify="right")
    table.add_row("compute (roofline)", format_seconds(plan.compute_s), "", "", "")
    if plan.optimizer_s:
        table.add_row("optimizer step (AdamW)", format_seconds(plan.optimizer_s), "", "", "")
    if plan.recompute_s:
        table.add_row(_recompute_label(plan), format_seconds(plan.recompute_s), "", "", "")
    if plan.fsdp_s:
        table.add_row(
            f"FSDP's copies ({format_bytes(plan.fsdp_bytes)})",
            format_seconds(plan.fsdp_s),
            "",
            "",
            "",
        )
    exposed = plan.exposed_s
    for kind, c in COLLECTIVES.items():
        if kind in plan.comm_s or plan.collectives.get(kind):
            table.add_row(
                c.title,
                format_seconds(plan.comm_s.get(kind, 0.0)),
                format_seconds(plan.hidden_s.get(kind, 0.0)),
                format_seconds(exposed.get(kind, 0.0)),
                str(plan.collectives.get(kind, 0)),
            )
    table.add_row(
        "[bold]step[/bold]", f"[bold]{format_seconds(plan.step_time_s)}[/bold]", "", "", ""
    )
    if plan.hidden_total_s > 0:
        table.caption = (
            f"hidden: what overlapping with compute saves; the compute beside a collective "
            f"runs {OVERLAP_SLOWDOWN:.1%} slower (Lee et al., arXiv 2507.03114)"
        )
    return table


def inputs_line(plan: Plan, shapes: dict[str, tuple] | None = None) -> str:
    """Each input's placement and what it means for the data loader: how much of the
    global batch every device loads; with ``shapes`` (global shape per input: the global
    batch and, for token ids, the sequence length) also the global and the local shape,
    and a batch smaller than the mesh is said, since it cannot be split over every
    device."""
    parts = []
    devices = plan.mesh.num_devices
    for name, ps in plan.inputs.items():
        pieces = 1
        for n, p in zip(plan.mesh.shape, ps, strict=True):
            pieces *= n if p.is_shard() else 1
        share = "the whole global tensor" if pieces == 1 else f"1/{pieces} of it"
        shape = (shapes or {}).get(name)
        if shape and pieces > 1:
            share += f", {local_shape(shape, ps, plan.mesh.shape)}"
        if shape and shape[0] < devices:
            share += f"; its dim 0 ({shape[0]}) is smaller than the {devices} devices"
        shown = f"{name} {tuple(shape)}" if shape else name
        parts.append(f"{shown} {short(ps)} (each device loads {share})")
    return "inputs: " + "; ".join(parts) if parts else "inputs: none"


def flops_line(plan: Plan) -> str:
    """The step's FLOPs and the MFU they imply, one line; an MFU over 100% says why it can
    be (FlopCounterMode counts a causal attention's whole ``S x S`` product, as PaLM's MFU
    does, while FlashAttention and the rings of context parallelism skip the masked
    blocks: at long sequences the step does much less than the count)."""
    line = (
        f"step: {plan.step_flops:.3g} FLOPs (matmul-like, as FlopCounterMode counts them); "
        f"MFU {plan.mfu:.1%} of {plan.peak_flops / 1e12:.4g} TFLOP/s x {plan.mesh.num_devices} "
        "devices"
    )
    if plan.mfu > 1:
        line += (
            " (over 100%: the count has each causal attention's whole S x S product, and "
            "the kernels skip its masked half)"
        )
    return line


def checkpointing_line(plan: Plan, mode: str = "auto") -> str | None:
    """Which repeated blocks recompute in the backward pass (activation checkpointing,
    :mod:`autoshard.cost.checkpointing`) and what it costs; None without the decision."""
    ck = plan.sg.checkpointing
    if ck is None or not ck.blocks:
        return None
    total = len({i for b in ck.blocks for i in b.real})
    blocks = plan.recomputed_blocks
    selective = list(plan.selective_blocks)
    if not blocks and not selective:
        why = "the plan fits without" if mode == "auto" else "--activation-checkpointing none"
        return f"activation checkpointing: no block recomputes ({why})"
    parts = []
    if blocks:
        parts.append(f"{len(blocks)} of {total} blocks recompute in full ({_ranges(blocks)})")
    if selective:
        parts.append(
            f"{len(selective)} of {total} selectively, keeping attention and every other "
            f"matmul ({_ranges(selective)})"
        )
    return (
        f"activation checkpointing ({mode}): {'; '.join(parts)}, "
        f"+{format_seconds(plan.recompute_s)} per step"
    )


def _recompute_label(plan: Plan) -> str:
    """The breakdown's row title of the recomputation: how many blocks, which policy."""
    full = len(plan.recomputed_blocks)
    selective = len(plan.selective_blocks)
    if not selective:
        return f"recompute ({full} blocks' forward)"
    if not full:
        return f"recompute ({selective} blocks, selective)"
    return f"recompute ({full} blocks' forward, {selective} selective)"


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ", ".join(out)


def memory_table(plan: Plan, budget: float | None = None) -> Table:
    """Predicted bytes per device, by kind, against the budget."""
    budget = plan.extra.get("budget", budget)
    table = Table(title="Predicted memory per device")
    table.add_column("kind")
    table.add_column("bytes", justify="right")
    labels = {"activations": "activations (live at the peak)"}
    if plan.extra.get("gradients_per_point"):  # freed each step: those made by the peak
        labels["gradients"] = "gradients (held at the peak; freed after each step)"
    for kind, b in plan.memory_by_kind().items():
        table.add_row(labels.get(kind, kind.replace("_", " ")), format_bytes(b))
    total = f"[bold]{format_bytes(plan.memory_bytes)}[/bold]"
    if budget is not None:
        fits = plan.memory_bytes <= budget
        total += f" of {format_bytes(budget)}" + ("" if fits else " [red](over budget)[/red]")
    table.add_row("[bold]total[/bold]", total)
    return table


def fallback_costs(plan: Plan) -> dict[str, tuple[int, float]]:
    """Op -> (nodes, seconds per step) of every op that fell back to ``Replicate`` (no
    sharding rule): its compute, whole on every device, plus the resharding of its inputs
    into ``Replicate`` (priced as :func:`autoshard.plan.plan.build_plan` prices each
    tensor, before any of it hides under compute), times the blocks a traced block
    stands for."""
    from autoshard.cost.collectives import comm_model
    from autoshard.plan.plan import latency_share, moved_itemsize, tensor_uses

    sg, graph = plan.sg, plan.sg.graph
    fallen = {n for n, ns in sg.nodes.items() if ns.fallback and n in graph.nodes}
    out: dict[str, tuple[int, float]] = {}
    for n in fallen:
        ns = sg.nodes[n]
        op = str(graph.nodes[n].target)
        count, secs = out.get(op, (0, 0.0))
        own = float(ns.compute_s[ns.choice[plan.choice[ns.rep]]])
        out[op] = (count + graph.mult(n), secs + graph.mult(n) * own)
    comm = comm_model(plan.mesh)
    for producer, consumer, k, t in tensor_uses(sg):
        if consumer not in fallen:
            continue
        p = plan.node_strategy[producer].outputs[0]
        q = plan.node_strategy[consumer].inputs[k]
        if p == q:
            continue
        item = moved_itemsize(sg, consumer, t)
        share = latency_share(sg, plan.mesh, producer, consumer, p, q, t)
        moved = sum(s.seconds for s in comm.redistribute_steps(p, q, t.shape, item, share))
        op = str(graph.nodes[consumer].target)
        count, secs = out[op]
        out[op] = (count, secs + graph.mult(consumer) * moved)
    n = plan.grad_accumulation  # the graph is one of the step's micro-batches
    return {op: (count, n * secs) for op, (count, secs) in out.items()}


def _busy_s(plan: Plan) -> float:
    """Seconds of compute, the optimizer step and every collective, before overlap: what a
    fallback's share is of."""
    return plan.compute_s + plan.optimizer_s + plan.comm_total_s + plan.recompute_s + plan.fsdp_s


@dataclass
class ReportFacts:
    """What the report derives from a plan by pricing it again, computed once for both the
    terminal and ``--json``: :func:`fallback_costs` and :func:`block_differences`."""

    fallbacks: dict[str, tuple[int, float]]
    differences: list[str]

    @classmethod
    def of(cls, plan: Plan) -> ReportFacts:
        return cls(fallback_costs(plan), block_differences(plan))


def fallback_line(plan: Plan, costs: dict[str, tuple[int, float]] | None = None) -> str | None:
    """``replicate fallback (no sharding rule): op xN (time, share of the step), ...``, or
    None when no op fell back. ``costs``: :func:`fallback_costs` when already computed."""
    costs = fallback_costs(plan) if costs is None else costs
    if not costs:
        return None
    busy = _busy_s(plan)
    items = ", ".join(
        f"{op} x{n} ({format_seconds(secs)}, {secs / busy:.1%} of compute and communication)"
        for op, (n, secs) in sorted(costs.items(), key=lambda kv: -kv[1][1])
    )
    return (
        f"replicate fallback (no sharding rule; computed whole on every device, inputs "
        f"gathered): {items}"
    )


MODE_NAMES = {
    "R": "replicated",
    "DP": "data parallel",
    "EP": "expert parallel (all-to-all)",
    "EPR": "experts split, tokens replicated",
}
"""How the report names :data:`autoshard.strategies.experts.MODES`."""


def experts_summary(plan: Plan) -> dict | None:
    """How the plan places the fused experts ops (:mod:`autoshard.strategies.experts`), or
    None when the model has none: per phase, ``"dp: expert parallel (all-to-all), tp:
    replicated"``-style descriptions -> the real layers planned so; the number of experts
    per layer; and the token exchange's all-to-alls per step and their seconds (priced
    under uniform routing)."""
    from autoshard.cost.collectives import comm_model
    from autoshard.strategies.experts import modes_of

    graph = plan.sg.graph
    comm = comm_model(plan.mesh)
    phases: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
    codes: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}
    count, seconds, experts = 0, 0.0, 0
    for n, s in plan.node_strategy.items():
        info = graph.nodes.get(n)
        if info is None or info.target not in EXPERT_OPS:
            continue
        m = graph.mult(n)
        modes = modes_of(info.target, s)
        text = ", ".join(
            f"{d}: {MODE_NAMES[mode]}" for d, mode in zip(plan.mesh.dim_names, modes, strict=True)
        )
        phase = "forward" if info.target is EXPERTS_FORWARD else "backward"
        phases[phase][text] += m
        codes[phase]["·".join(modes)] += m
        experts = info.args[3 if phase == "forward" else 4].shape[0]
        for kind, dim, nbytes in s.collectives:
            count += m
            seconds += m * comm.collective(kind, nbytes, dim)
    if not phases["forward"]:
        return None
    return {
        "experts": experts,
        "forward": dict(phases["forward"]),
        "backward": dict(phases["backward"]),
        "modes": {k: dict(v) for k, v in codes.items()},
        "all_to_all_count": count * plan.grad_accumulation,  # every micro-batch's
        "all_to_all_s": seconds * plan.grad_accumulation,
    }


def experts_line(plan: Plan, summary: dict | None = None) -> str | None:
    """``experts (E per layer): forward <dim: mode, ...> (layers), ...; token exchange N
    all-to-alls, T per step`` or None without experts."""
    summary = experts_summary(plan) if summary is None else summary
    if summary is None:
        return None

    def phase(name: str) -> str:
        return "; ".join(f"{text} ({n} layers)" for text, n in summary[name].items())

    out = f"experts ({summary['experts']} per layer): forward {phase('forward')}"
    if summary["backward"]:
        out += f"; backward {phase('backward')}"
    if summary["all_to_all_count"]:
        out += (
            f"; token exchange: {summary['all_to_all_count']} all-to-alls, "
            f"{format_seconds(summary['all_to_all_s'])} per step (uniform routing assumed)"
        )
    return out


def in_op_summary(plan: Plan) -> dict[str, dict]:
    """What ops communicate inside themselves in ``plan`` (an op rule's collectives,
    :mod:`autoshard.strategies.registry`: the experts' token exchange, a model's own op's),
    by op: the real nodes (``nodes``), the mode of each mesh dim their strategies choose
    (``modes``: ``"d0: S0"``-style text -> real nodes), the collectives by kind per step
    (``collectives``), their seconds per step (``seconds``) and of those the seconds the
    ops' own compute does not hide (``exposed_seconds``: all but a ring's)."""
    from autoshard.cost.collectives import comm_model
    from autoshard.strategies.rules import op_rule

    graph = plan.sg.graph
    fx_nodes = {x.name: x for x in graph.graph_module.graph.nodes}
    comm = comm_model(plan.mesh)
    out: dict[str, dict] = {}
    for n, s in plan.node_strategy.items():
        info = graph.nodes.get(n)
        if info is None or not s.collectives:
            continue
        rule = op_rule(info.target)
        m = graph.mult(n)
        entry = out.setdefault(
            str(info.target),
            {
                "nodes": 0,
                "modes": Counter(),
                "collectives": Counter(),
                "seconds": 0.0,
                "exposed_seconds": 0.0,
            },
        )
        entry["nodes"] += m
        if rule is not None and rule.per_dim is not None:
            modes = rule.modes(fx_nodes[n], info.args, info.results, s, plan.mesh.shape)
            text = ", ".join(
                f"{d}: {mode}" for d, mode in zip(plan.mesh.dim_names, modes, strict=True)
            )
            entry["modes"][text] += m
        for kind, dim, nbytes in s.collectives:
            entry["collectives"][kind] += m
            entry["seconds"] += m * comm.collective(kind, nbytes, dim)
        entry["exposed_seconds"] += m * s.own_s
    micro = plan.grad_accumulation  # every micro-batch's
    for e in out.values():
        e["collectives"] = Counter({k: micro * v for k, v in e["collectives"].items()})
        e["seconds"] *= micro
        e["exposed_seconds"] *= micro
    return {
        op: {**e, "modes": dict(e["modes"]), "collectives": dict(e["collectives"])}
        for op, e in sorted(out.items())
    }


def in_op_line(
    plan: Plan | None, summary: dict | None = None, skip: Iterable[str] = ()
) -> str | None:
    """``collectives inside ops: OP xN (d0: S0): K all-reduces (K/N an op), T per step
    (H hidden under the op); ...`` or None when no op communicates itself; ``skip``: ops
    a line of their own reports (the experts', :func:`experts_line`)."""
    summary = in_op_summary(plan) if summary is None else summary
    summary = {op: e for op, e in summary.items() if op not in set(skip)}
    if not summary:
        return None
    parts = []
    for op, e in summary.items():
        modes = "; ".join(f"{text} x{k}" for text, k in e["modes"].items())
        each = e["nodes"] > 1 and all(k % e["nodes"] == 0 for k in e["collectives"].values())
        kinds = ", ".join(
            f"{k} {COLLECTIVES[kind].title}{'s' if k != 1 else ''}"
            + (f" ({k // e['nodes']} an op)" if each else "")
            for kind, k in sorted(e["collectives"].items())
        )
        where = f" ({modes})" if modes else ""
        hidden = e["seconds"] - e["exposed_seconds"]
        under = f" ({format_seconds(hidden)} hidden under the op)" if hidden > 1e-15 else ""
        parts.append(
            f"{op} x{e['nodes']}{where}: {kinds}, {format_seconds(e['seconds'])} per step{under}"
        )
    return "collectives inside ops: " + "; ".join(parts)


REPORT_FORMAT = "autoshard.report/1"


def report_dict(
    result, files: tuple = (), notes: Iterable[str] = (), facts: ReportFacts | None = None
) -> dict:
    """The report of a solve (:class:`autoshard.solver.solve.SolveResult`) as plain JSON
    data, for ``autoshard solve --json`` (keys in docs/formats.md, "Solve report").

    Seconds (``time_s``, ``seconds``) and bytes (``memory_bytes``) are per device and per
    step as the terminal report prints them; a number that is not finite (an unknown gap)
    is ``null``.
    """
    import math

    plan, cfg, sg = result.plan, result.config, result.sg
    facts = facts or ReportFacts.of(plan)
    hidden, exposed = plan.hidden_s, plan.exposed_s
    memory = {k: float(v) for k, v in plan.memory_by_kind().items()}
    memory["total"] = float(plan.memory_bytes)
    budget = plan.extra.get("budget")
    memory["budget"] = float(budget) if budget is not None else None

    def clean(x):  # noqa: ANN001, ANN202 - JSON builtins
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if hasattr(x, "item") and not isinstance(x, (str, bytes)):
            x = x.item()  # a numpy scalar
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return str(x)

    return clean(
        {
            "format": REPORT_FORMAT,
            "model": sg.graph.model_name,
            "mesh": cfg.mesh.to_dict(),
            "device": cfg.device.name,
            "mode": cfg.mode,
            "precision": cfg.precision,
            "grad_accumulation": cfg.grad_accumulation,
            "compute_dtype": str(cfg.compute_dtype(sg.graph)).removeprefix("torch."),
            "plan": {
                "name": plan.name,
                "parameters": {k: placements_to_str(v) for k, v in sorted(plan.parameters.items())},
                "inputs": {k: placements_to_str(v) for k, v in plan.inputs.items()},
            },
            "time_s": {
                "step": plan.step_time_s,
                "compute": plan.compute_s,
                "optimizer": plan.optimizer_s,
                "recompute": plan.recompute_s,
                "fsdp_copies": plan.fsdp_s,
                "collectives": {
                    kind: {
                        "total": total,
                        "hidden": hidden.get(kind, 0.0),
                        "exposed": exposed.get(kind, total),
                        "count": int(plan.collectives.get(kind, 0)),
                    }
                    for kind, total in sorted(plan.comm_s.items())
                },
            },
            "activation_checkpointing": {
                "mode": cfg.activation_checkpointing,
                "recomputed_blocks": list(plan.recomputed_blocks),
                "selective_blocks": list(plan.selective_blocks),
            },
            "step_flops": plan.step_flops,
            "mfu": plan.mfu,
            "memory_bytes": memory,
            "fits": budget is None or plan.memory_bytes <= budget,
            "solver": result.solver_stats(),
            "seconds": dict(result.seconds),
            "peak_rss_bytes": result.peak_rss_bytes,
            "files": [str(f) for f in files],
            "fallbacks": {
                op: {"nodes": n, "seconds": secs, "share": secs / _busy_s(plan)}
                for op, (n, secs) in facts.fallbacks.items()
            },
            "experts": experts_summary(plan),
            "in_op_collectives": in_op_summary(plan),
            "space": plan.extra.get("space"),
            "notes": [*facts.differences, *notes],
        }
    )


def print_report(
    console: Console, result, files: tuple | None = None, facts: ReportFacts | None = None
) -> None:
    """The full report of a solve (:class:`autoshard.solver.solve.SolveResult`)."""
    plan, cfg, ilp, sg = result.plan, result.config, result.ilp, result.sg
    facts = facts or ReportFacts.of(plan)
    mesh = cfg.mesh
    dims = ", ".join(
        f"{n}={s} ({format_bandwidth(bw)}, {format_seconds(lat)})"
        for n, s, bw, lat in zip(
            mesh.dim_names, mesh.shape, mesh.bandwidth, mesh.latency, strict=True
        )
    )
    console.print(
        f"[bold]{sg.graph.model_name}[/bold] on mesh {mesh.shape_str} ({escape(dims)}), "
        f"device {cfg.device.name}, mode {cfg.mode}, compute dtype "
        f"{str(cfg.compute_dtype(sg.graph)).removeprefix('torch.')}"
        + (
            f", precision {cfg.precision} (fp32 master weights and AdamW moments, gradients "
            f"reduced in {str(cfg.reduce_dtype).removeprefix('torch.')})"
            if cfg.mixed
            else ""
        )
        + (f", optimizer {cfg.optimizer}" if cfg.mode == "train" else "")
    )
    st = sg.stats
    console.print(
        f"graph: {st['nodes']} nodes, {sg.graph.num_layers} repeated layers; "
        f"{st['variables_nodes']} decision nodes after merging {st['merged']} follow ops and "
        f"{st['free']} free ops; {st['strategies']} strategies, {st['edges']} edges"
    )
    depth = sg.graph.depth
    if depth is not None or sg.tied_layers:
        parts = []
        if depth is not None:
            traced = [
                str(g[0]) if len(g) == 1 else f"{g[0]} (standing for {g[0]}-{g[-1]})"
                for g in depth.stands_for
            ]
            listed = ", ".join(traced[:-1]) + " and " + traced[-1]
            parts.append(f"traced blocks {listed} of {depth.num_blocks}")
        if sg.tied_layers:
            layers = "layer shares" if sg.tied_layers == 1 else "layers share"
            parts.append(f"{sg.tied_layers} traced {layers} the first one's variables")
        console.print("repeated layers: " + "; ".join(parts) + " (--no-tie to solve each)")
    fell = fallback_line(plan, facts.fallbacks)
    if fell is not None:
        console.print(f"[yellow]{escape(fell)}[/yellow]")
    console.print(layer_table(plan))
    activations = activation_table(plan)
    if activations is not None:
        console.print(activations)
    experts = experts_line(plan)
    skip = () if experts is None else {str(op) for op in EXPERT_OPS}
    for line in (experts, in_op_line(plan, skip=skip)):
        if line is not None:
            console.print(line, highlight=False)
    for line in facts.differences:
        console.print(line, highlight=False)
    shapes = {
        info.fqn: tuple(info.results[0].shape)
        for info in sg.graph.nodes.values()
        if info.kind == "input" and info.results and info.results[0] is not None
    }
    console.print(inputs_line(plan, shapes), highlight=False)
    console.print(cost_table(plan))
    console.print(flops_line(plan))
    ckpt = checkpointing_line(plan, cfg.activation_checkpointing)
    if ckpt is not None:
        console.print(ckpt, highlight=False)
    console.print(memory_table(plan))
    _print_search(console, plan, ilp)
    secs = result.seconds

    console.print(
        "time: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items())
        + f"; peak memory {format_bytes(result.peak_rss_bytes)}"
    )
    if files:
        console.print("wrote " + " and ".join(str(f) for f in files))


def lifted_line(lifted: dict, step_s: float, micro_batches: int = 1) -> str:
    """A plan the mesh search laid from a shape with one dim fewer
    (:mod:`autoshard.solver.lifting`): its whole ILP did not run on this mesh; which ILP
    the plan is, how that search ended and what the plan takes there and here; when the
    search improved it (:mod:`autoshard.solver.neighbourhood`), each neighbourhood's ILP,
    how it ended and the step after it (the neighbourhoods' objectives, one of
    ``micro_batches``'s, times it)."""
    source = "x".join(map(str, lifted["from"]))
    m = lifted["split_dim"]
    status = lifted["source_status"]
    gap = lifted["source_gap"]
    ended = "optimal" if status == "optimal" else STOPPED_BY.get(status, status)
    if status == "within_gap":
        ended = "within the --mip-gap of the LP bound"
    gap_text = "" if gap != gap else f", gap {gap:.2%}"
    improved = lifted.get("improved")
    tried_any = improved is not None and improved["skipped"] is None
    solver = "no whole ILP" if tried_any else "none"  # its neighbourhoods' ILPs ran here
    line = (
        f"solver: {solver} on this mesh (its ILP is over the column cap, --max-columns); "
        f"{source}'s ILP plan ({ended}{gap_text}; "
        f"{format_seconds(lifted['source_step_s'])} there), "
        f"laid onto it with {source}'s dim {m} split into dims {m} and {m + 1}"
    )
    if improved is None:
        return f"{line}: {format_seconds(step_s)} here"
    if not tried_any:
        return f"{line}: {format_seconds(step_s)} here, not improved ({improved['skipped']})"
    tried = "; ".join(
        f"dims {','.join(map(str, s['free']))} free: {_neighbourhood_ended(s['status'])}, "
        f"{format_seconds(s['step_s'] * micro_batches)}"
        for s in improved["steps"]
    )
    ended = format_seconds(step_s) if improved["improved"] else "nothing faster"
    before = format_seconds(improved["before_s"] * micro_batches)
    return (
        f"{line}: {before} here; then the ILP over its "
        f"neighbourhoods (the other dims' placements kept), each from the best so far "
        f"({tried}): {ended}"
    )


def _neighbourhood_ended(status: str) -> str:
    """How one neighbourhood's ILP ended, in words (its work limit is the search's own,
    :data:`autoshard.solver.neighbourhood.NEIGHBOURHOOD_WORK`, not ``--work-limit``)."""
    if status == "work_limit":
        return "stopped at the neighbourhood's work limit"
    if status == "within_gap":
        return "within the --mip-gap"
    return STOPPED_BY.get(status, status)


def space_lines(space: dict, budget: float | None) -> list[str]:
    """A search space's points (``plan.extra["space"]``, from ``solve --space``): each
    one's step time, memory and whether it fits, or why it has no plan; the chosen one
    marked ``*``."""
    lines = [
        f"solver: none, the {space['name']} space's {len(space['points'])} points each priced "
        "by DTensor's propagation from their styles (* the fastest that fits):"
    ]
    for p in space["points"]:
        mark = "*" if p["name"] == space["chosen"] else " "
        if p["step_time_s"] is None:
            lines.append(f"  {mark} {p['name']:<11} -  {p['error']}")
            continue
        fits = "fits" if p["fits"] else f"over {format_bytes(budget or 0.0)}"
        lines.append(
            f"  {mark} {p['name']:<11} {format_seconds(p['step_time_s']):>9}  "
            f"{format_bytes(p['memory_bytes']):>10}  {fits}"
        )
    return lines


STOPPED_BY = {
    "work_limit": "stopped at --work-limit (the same plan on every run)",
    "iteration_limit": "stopped at the LP's iteration limit (the same plan on every run)",
    "time_limit": "stopped at --time-limit (a wall-clock limit: a busier machine may stop "
    "on another plan)",
    "stopped": "stopped by HiGHS before a proof",
}
"""How the report names each limit a search can stop at (an ILP status)."""


def _print_search(console: Console, plan: Plan, ilp) -> None:
    """How the plan was found: the hand-written plan asked for, the preloaded plan, the
    torchtitan space's points, the lifted plan, or the ILP's search and its status."""
    gap = "n/a" if ilp.gap != ilp.gap else f"{ilp.gap:.2%}"
    status = ilp.status
    if status.startswith("baseline"):
        console.print(
            f"solver: none, {status} plan; predicted {format_seconds(plan.step_time_s)} "
            "(compare with the ILP: autoshard compare)"
        )
    elif status == "preloaded":
        console.print(
            f"solver: none, plan preloaded; objective "
            f"{format_seconds(ilp.objective_s * plan.grad_accumulation)}"
        )
    elif "space" in plan.extra:
        for line in space_lines(plan.extra["space"], plan.extra.get("budget")):
            console.print(line, highlight=False)
    elif "lifted" in plan.extra:
        lifted = lifted_line(plan.extra["lifted"], plan.step_time_s, plan.grad_accumulation)
        console.print(lifted, highlight=False)
    else:
        if status == "within_gap":
            status = "within the --mip-gap of the LP bound"
        elif status != "optimal":
            why = STOPPED_BY.get(status, status)
            status = f"[yellow]{why}: best plan found, not proven optimal[/yellow]"
        _solver_line(console, ilp, status, gap, plan.grad_accumulation)


def _solver_line(console: Console, ilp, status: str, gap: str, micro_batches: int = 1) -> None:
    """The search's line; the ILP prices one of ``micro_batches`` (gradient accumulation,
    each with its share of the optimizer step), its objective shown for the step."""
    console.print(
        f"solver: HiGHS {status}, objective {format_seconds(ilp.objective_s * micro_batches)}, "
        f"gap {gap}, "
        f"{ilp.num_variables} variables, {ilp.num_constraints} constraints, "
        f"build {ilp.build_seconds:.2f} s, solve {ilp.solve_seconds:.2f} s"
        + (
            f" ({ilp.memory_rounds} solves, each adding the memory rows of the points of the "
            "step the last plan overflowed)"
            if ilp.memory_rounds > 1
            else ""
        )
    )
    console.print(start_line(ilp, micro_batches))


def start_line(ilp, micro_batches: int = 1) -> str:
    """Which hand-written plan the search started from and what it gained over it (its
    objective for the step of ``micro_batches``)."""
    if ilp.start is None:
        return "started from no plan (no hand-written plan fits the memory budget)"
    name = ilp.start if " " in ilp.start else f"the {ilp.start} plan"
    base = f"started from {name} ({format_seconds(ilp.start_objective_s * micro_batches)})"
    if ilp.objective_s >= ilp.start_objective_s:
        return base + ": the search found nothing faster, the plan is that one"
    gain = 1 - ilp.objective_s / ilp.start_objective_s
    return base + f": the search gained {gain:.1%}"
