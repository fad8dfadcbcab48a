"""``autoshard solve --html FILE``: the report as one self-contained HTML page.

What the terminal report says, to look at: the parameters' placements per repeated block
(a grid, one colour per placement), the predicted time split (compute, optimizer,
recomputation, each collective kind exposed and hidden under compute), memory per device
by kind against the budget, and the step time of the ILP's plan beside the hand-written
plans of ``autoshard compare``. The charts are matplotlib PNGs embedded as base64 (no
script, no network: the file opens offline and mails as one attachment).
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from typing import Any

from autoshard.placements import short
from autoshard.plan.plan import Plan
from autoshard.plan.report import activation_rows, split_block
from autoshard.units import format_bandwidth, format_bytes, format_seconds

# one colour per bar of the compare chart: the best plan, the others, a plan over budget
BEST, OTHER, OVER = "#2ca02c", "#1f77b4", "#d62728"
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _figure(rows: int) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # no display: render to a PNG
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * rows + 1.2))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return fig, ax


def time_split_png(plan: Plan) -> str:
    """Horizontal bars, milliseconds per step: compute, optimizer, recompute, then per
    collective kind the exposed part (solid) and the part hidden under compute (light)."""
    items: list[tuple[str, float, float]] = [("compute", plan.compute_s, 0.0)]
    if plan.optimizer_s:
        items.append(("optimizer step", plan.optimizer_s, 0.0))
    if plan.recompute_s:
        items.append(("recompute", plan.recompute_s, 0.0))
    if plan.fsdp_s:
        items.append(("FSDP's copies", plan.fsdp_s, 0.0))
    hidden, exposed = plan.hidden_s, plan.exposed_s
    for kind, total in sorted(plan.comm_s.items()):
        items.append((kind.replace("_", "-"), exposed.get(kind, total), hidden.get(kind, 0.0)))
    fig, ax = _figure(len(items))
    labels = [i[0] for i in items][::-1]
    shown = [i[1] * 1e3 for i in items][::-1]
    under = [i[2] * 1e3 for i in items][::-1]
    ax.barh(labels, shown, color=OTHER, label="on the critical path")
    ax.barh(labels, under, left=shown, color="#aec7e8", label="hidden under compute")
    ax.set_xlabel("ms per step (one device)")
    ax.set_title(f"predicted step {format_seconds(plan.step_time_s)}", loc="left")
    ax.legend(loc="lower right", frameon=False)
    fig.tight_layout()
    return _png(fig)


def memory_png(plan: Plan, budget: float | None) -> str:
    """Bars, GiB per device: each memory kind and the total (the peak of the step), with
    the budget as a dashed line when it is within 5x of the total (else in the title, so
    that the bars stay readable)."""
    kinds = [(k.replace("_", " "), v) for k, v in plan.memory_by_kind().items()]
    kinds.append(("total (peak)", float(plan.memory_bytes)))
    fig, ax = _figure(len(kinds))
    labels = [k for k, _ in kinds][::-1]
    gib = [v / 2**30 for _, v in kinds][::-1]
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(kinds))][::-1]
    ax.barh(labels, gib, color=colours)
    for y, g in enumerate(gib):
        ax.text(g, y, f" {format_bytes(g * 2**30)}", va="center")
    title = f"{format_bytes(plan.memory_bytes)} per device"
    if budget is not None:
        title += f" of a {format_bytes(budget)} budget ({plan.memory_bytes / budget:.1%})"
        if budget <= 5 * plan.memory_bytes:
            ax.axvline(budget / 2**30, color="black", linestyle="--")
            ax.text(budget / 2**30, len(kinds) - 0.5, " budget", va="bottom")
    ax.set_title(title, loc="left")
    ax.set_xlabel("GiB per device")
    fig.tight_layout()
    return _png(fig)


def compare_png(rows: Sequence[Any]) -> str:
    """Step time of each plan (``ComparedPlan`` rows): the best green, one over the memory
    budget red, the others blue; a plan that could not be made is left out."""
    made = [r for r in rows if r.plan is not None]
    fig, ax = _figure(len(made))
    names = [r.name for r in made][::-1]
    times = [r.plan.step_time_s * 1e3 for r in made][::-1]
    colours = [(BEST if r.best else OTHER if r.fits else OVER) for r in made][::-1]
    ax.barh(names, times, color=colours)
    for y, t in enumerate(times):
        ax.text(t, y, f" {t:.3g} ms", va="center")
    ax.set_xlabel("predicted step, ms (red: over the memory budget)")
    fig.tight_layout()
    return _png(fig)


def _grid(plan: Plan) -> str:
    """Placement grid: one row per parameter of a repeated block, one column per block;
    then the parameters outside the blocks."""
    blocks = plan.sg.graph.block_prefixes
    cells: dict[str, dict[int, str]] = {}
    outside: list[tuple[str, str]] = []
    for fqn, ps in sorted(plan.parameters.items()):
        where = split_block(fqn, blocks)
        if where is None:
            outside.append((fqn, short(ps)))
        else:
            cells.setdefault(where[1], {})[where[0]] = short(ps)
    seen = sorted({p for row in cells.values() for p in row.values()} | {p for _, p in outside})
    colour = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(seen)}

    def cell(p: str) -> str:
        return (
            f'<td style="background:{colour[p]}33" title="{html.escape(p)}">{html.escape(p)}</td>'
        )

    out = ['<table class="grid">']
    if cells:
        ids = sorted({b for row in cells.values() for b in row})
        out.append("<tr><th>block parameter</th>" + "".join(f"<th>{b}</th>" for b in ids) + "</tr>")
        for name, row in cells.items():
            tds = "".join(cell(row[b]) if b in row else "<td></td>" for b in ids)
            out.append(f"<tr><th>{html.escape(name)}</th>{tds}</tr>")
    out.append("</table>")
    if outside:
        out.append('<table class="grid"><tr><th>outside the blocks</th><th>placement</th></tr>')
        out += [f"<tr><th>{html.escape(n)}</th>{cell(p)}</tr>" for n, p in outside]
        out.append("</table>")
    return "\n".join(out)


def _gap(gap: float | None) -> str:
    return "n/a" if gap is None or not math.isfinite(gap) else f"{gap:.3%}"


def html_report(result: Any, rows: Sequence[Any] | None = None) -> str:
    """The page for a solve (:class:`~autoshard.solver.solve.SolveResult`) and, when given,
    the ``compare`` rows (:class:`~autoshard.solver.compare.ComparedPlan`)."""
    plan, cfg = result.plan, result.config
    mesh = cfg.mesh
    budget = plan.extra.get("budget")
    links = ", ".join(
        f"{n}={s} ({format_bandwidth(b)}, {format_seconds(a)})"
        for n, s, b, a in zip(mesh.dim_names, mesh.shape, mesh.bandwidth, mesh.latency, strict=True)
    )
    facts = [
        ("model", plan.sg.graph.model_name),
        ("mesh", links),
        ("device", cfg.device.name),
        ("mode", f"{cfg.mode}, precision {cfg.precision}"),
        ("step", f"{format_seconds(plan.step_time_s)} per step, MFU {plan.mfu:.1%}"),
        (
            "memory",
            f"{format_bytes(plan.memory_bytes)} per device"
            + (f" of {format_bytes(budget)}" if budget is not None else ""),
        ),
        ("solver", f"{result.ilp.status}, gap {_gap(result.ilp.gap)}"),
        ("inputs", ", ".join(f"{k} {short(v)}" for k, v in plan.inputs.items())),
    ]
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>autoshard: {html.escape(plan.sg.graph.model_name)} on {mesh.shape_str}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:70em}"
        "table.grid{border-collapse:collapse;margin:1em 0;font-size:90%}"
        "table.grid td,table.grid th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
        "dt{font-weight:bold;float:left;width:6em}dd{margin-left:7em}</style>",
        "</head><body>",
        f"<h1>{html.escape(plan.sg.graph.model_name)} on mesh {mesh.shape_str}</h1>",
        "<dl>" + "".join(f"<dt>{k}</dt><dd>{html.escape(v)}</dd>" for k, v in facts) + "</dl>",
        "<h2>Predicted time per step</h2>",
        f'<img id="time" alt="time split" src="data:image/png;base64,{time_split_png(plan)}">',
        "<h2>Memory per device</h2>",
        f'<img id="memory" alt="memory" src="data:image/png;base64,{memory_png(plan, budget)}">',
    ]
    if rows:
        parts += [
            "<h2>The plan beside hand-written ones</h2>",
            f'<img id="compare" alt="compare" src="data:image/png;base64,{compare_png(rows)}">',
        ]
    parts += ["<h2>Parameter placements</h2>", _grid(plan)]
    activations = activation_rows(plan)
    if activations:
        head = "".join(f"<th>{h}</th>" for h in ("where", "op", "placement", "local shape"))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in activations
        )
        parts += [
            "<h2>Activations of one block (forward)</h2>",
            f'<table class="grid" id="activations"><tr>{head}</tr>{body}</table>',
        ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
