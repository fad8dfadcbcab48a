"""``autoshard solve --html``: the report as a page, and its charts as they render
(issue 15, item 3). No browser here: the charts are PNGs the page embeds, decoded and
measured pixel by pixel."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, autoshard_cli, write_mlp

from autoshard.cost.mesh import MeshSpec
from autoshard.plan.html import BEST, OTHER, OVER, html_report
from autoshard.solver.compare import compare_plans
from autoshard.solver.solve import SolveConfig, plan_model


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: dict[str, np.ndarray] = {}
        self.cells: list[str] = []  # the parameter grid's placements
        self.activations: list[str] = []  # the cells of the activation table
        self._td = False
        self._table = None

    def handle_starttag(self, tag, attrs):  # noqa: ANN001
        a = dict(attrs)
        if tag == "img":
            import matplotlib.image

            data = re.fullmatch(r"data:image/png;base64,(.+)", a["src"]).group(1)
            self.images[a["id"]] = matplotlib.image.imread(io.BytesIO(base64.b64decode(data)))
        if tag == "table":
            self._table = a.get("id")
        self._td = tag == "td"

    def handle_data(self, data):  # noqa: ANN001
        if self._td:
            (self.activations if self._table == "activations" else self.cells).append(data)
            self._td = False


def _bars(img: np.ndarray, colours: tuple[str, ...]) -> list[int]:
    """Lengths in pixels of the horizontal bars of these colours that start at the axis
    (the leftmost such pixel; a legend's patch starts elsewhere), top to bottom."""
    rgb = img[..., :3]
    hit = np.zeros(rgb.shape[:2], dtype=bool)
    for c in colours:
        want = np.array([int(c[i : i + 2], 16) / 255 for i in (1, 3, 5)])
        hit |= np.abs(rgb - want).max(axis=-1) < 0.02
    cols = np.nonzero(hit.any(axis=0))[0]
    if len(cols) == 0:
        return []
    x0 = cols[0]

    def run_from_axis(row: np.ndarray) -> int:
        seg = row[x0:]
        return len(seg) if seg.all() else int(np.argmin(seg))

    per_row = [run_from_axis(row) if row[x0] else 0 for row in hit]
    bars, run = [], 0
    for n in [*per_row, 0]:
        if n:
            run = max(run, n)
        elif run:
            bars.append(run)
            run = 0
    return bars


def test_the_compare_chart_draws_each_plans_step_time_to_scale(tmp_path: Path):
    """The MLP (training, 2x2): each plan's bar, measured in the rendered PNG, is as long
    as its predicted step time says, relative to the others (within 2 pixels); the ILP's
    is the green one (the fastest that fits)."""
    cfg = SolveConfig(
        model_path=write_mlp(tmp_path, 64, 1024, 4096), mesh=MeshSpec.from_options("2x2")
    )
    result = plan_model(cfg)
    rows = compare_plans(cfg, result.sg)
    page = _Page()
    page.feed(html_report(result, rows))
    assert set(page.images) == {"time", "memory", "compare"}
    made = [r for r in rows if r.plan is not None]
    bars = _bars(page.images["compare"], (BEST, OTHER, OVER))
    assert len(bars) == len(made)
    times = [r.plan.step_time_s for r in made]
    scale = max(bars) / max(times)
    for r, length in zip(made, bars, strict=True):
        assert length == pytest.approx(r.plan.step_time_s * scale, abs=2), r.name
    assert _bars(page.images["compare"], (BEST,)) == [bars[0]]  # the ILP's, on top
    assert made[0].name == "ilp" and made[0].best
    # the time split: the parts on the critical path (dark), to scale, longest first
    plan = result.plan
    exposed = [plan.compute_s, plan.optimizer_s, *plan.exposed_s.values()]
    drawn = sorted(_bars(page.images["time"], (OTHER,)), reverse=True)
    scale = drawn[0] / max(exposed)
    want = sorted((x * scale for x in exposed if x * scale >= 3), reverse=True)
    assert drawn[: len(want)] == pytest.approx(want, abs=2)


@pytest.mark.slow
def test_solve_html_writes_one_self_contained_page(tmp_path: Path):
    """`autoshard solve --html` on a 4-block GPT-2: no script, no link out; the three
    charts decode; the grid has one placement cell per weight of each of the 4 blocks."""
    page_path = tmp_path / "report.html"
    out = autoshard_cli(
        "solve",
        str(ROOT / "examples/gpt2.py"),
        "--mesh",
        "2x4",
        "--out",
        str(tmp_path),
        "--html",
        str(page_path),
        "-q",
        AUTOSHARD_LAYERS="4",
    )
    assert out.returncode == 0, out.stderr
    assert str(page_path) in out.stdout.splitlines()
    text = page_path.read_text()
    assert "<script" not in text and "http" not in text
    page = _Page()
    page.feed(text)
    assert {k: v.ndim for k, v in page.images.items()} == {"time": 3, "memory": 3, "compare": 3}
    assert all(img.shape[0] > 100 and img.shape[1] > 500 for img in page.images.values())
    # 12 weights and biases per GPT-2 block x 4 blocks; outside: wte, wpe, ln_f's weight
    # and bias, and the LM head (tied to wte)
    assert len(page.cells) == 12 * 4 + 5
    assert all(re.fullmatch(r"[RSP()\d·]+|S\(\d\)·.*", c) for c in page.cells), page.cells[:5]
    # the activations of one block: four cells a row, every matmul of the block named
    rows = [page.activations[i : i + 4] for i in range(0, len(page.activations), 4)]
    assert {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"} <= {r[0] for r in rows}
