"""The command line: one-line errors with exit code 2, and an end-to-end solve of GPT-2."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from autoshard.cli.main import main
from autoshard.plan.formats import load_sharding_map, load_solution

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None):
    return CliRunner().invoke(main, list(args), env=env)


@pytest.mark.parametrize(
    "args, message",
    [
        (["solve", "nope.py", "--mesh", "2x4"], "nope.py"),
        (["solve", "examples/mlp.py", "--mesh", "2x"], "2x"),
        (["solve", "examples/mlp.py", "--mesh", "0x4"], "0x4"),
        (["solve", "examples/mlp.py", "--mesh", "4", "--mesh-dim-names", "a,b"], "a"),
        (["solve", "examples/mlp.py", "--mesh", "4", "--time-limit", "0"], "time-limit"),
        # the flag alone before the model file: click reads the file as its kind
        (
            ["solve", "--context-parallel", "examples/mlp.py", "--mesh", "4"],
            "give the flag after the model file",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = _run(*args)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert any(message in ln for ln in lines), result.output
    assert "Traceback" not in result.output


def test_model_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n")
    result = _run("solve", str(bad), "--mesh", "2")
    assert result.exit_code == 2
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and "bad.py" in last and "example_inputs" in last
    assert "Traceback" not in result.output


def test_bad_bandwidth_unit_is_a_usage_error():
    result = _run("solve", "examples/mlp.py", "--mesh", "4", "--intra-node-bw", "450")
    assert result.exit_code == 2
    assert "450" in result.output


def test_help_teaches():
    result = _run("solve", "--help")
    assert result.exit_code == 0
    for word in ("--mesh", "--inter-node-bw", "build_model", "Examples"):
        assert word in result.output


@pytest.mark.slow
def test_solve_gpt2_two_layers_end_to_end(tmp_path, monkeypatch):
    """The real CLI path on HuggingFace GPT-2 with 2 layers: files written, every
    parameter (tied ones under each name) in the map, one placement per mesh dim."""
    monkeypatch.chdir(ROOT)
    env = dict(os.environ, AUTOSHARD_LAYERS="2")
    result = _run("solve", "examples/gpt2.py", "--mesh", "2x4", "--out", str(tmp_path), env=env)
    assert result.exit_code == 0, result.output
    assert "solver: HiGHS" in result.output and "compute" in result.output
    smap = load_sharding_map(tmp_path / "gpt2_2x4.json")
    assert smap.mesh_shape == (2, 4)
    raw = json.loads((tmp_path / "gpt2_2x4.json").read_text())
    assert raw["format"] == "autoshard.sharding_map/2"
    assert raw["solution"]["file"] == "gpt2_2x4.pkl"
    assert set(raw["inputs"]) == {"input_ids"}

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2))
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(smap.parameters) == names
    assert "lm_head.weight" in names and "transformer.wte.weight" in names
    assert smap.parameters["lm_head.weight"] == smap.parameters["transformer.wte.weight"]
    assert all(len(ps) == 2 for ps in smap.parameters.values())
    sol = load_solution(tmp_path / "gpt2_2x4.pkl")
    assert sol["format"] == "autoshard.solution/1"
    assert sol["mesh"]["shape"] == [2, 4]
    assert sol["solver"]["status"] in ("optimal", "within_gap")
    assert sol["objective_s"] == pytest.approx(raw["predicted"]["step_time_s"])
    # the map says which device its predictions are for: the launcher prints it
    assert raw["predicted"]["device"] == sol["cost_model"]["device"]["name"] == "h100-measured"


def test_a_failed_solve_keeps_the_previous_solution(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    good = _run("solve", "examples/mlp.py", "--mesh", "4", "--out", str(tmp_path))
    assert good.exit_code == 0, good.output
    before = (tmp_path / "mlp_4.json").read_bytes()
    bad = _run(
        "solve", "examples/mlp.py", "--mesh", "4", "--out", str(tmp_path), "--time-limit", "-1"
    )
    assert bad.exit_code == 2
    assert (tmp_path / "mlp_4.json").read_bytes() == before


def test_preload_through_the_cli_reproduces_the_plan(tmp_path, monkeypatch):
    """solve, then solve --preload the written pickle: same sharding map, no ILP."""
    monkeypatch.chdir(ROOT)
    first = _run("solve", "examples/mlp.py", "--mesh", "2x2", "--out", str(tmp_path / "a"))
    assert first.exit_code == 0, first.output
    again = _run(
        "solve",
        "examples/mlp.py",
        "--mesh",
        "2x2",
        "--out",
        str(tmp_path / "b"),
        "--preload",
        str(tmp_path / "a" / "mlp_2x2.pkl"),
    )
    assert again.exit_code == 0, again.output
    assert "preloaded" in again.output
    a = json.loads((tmp_path / "a" / "mlp_2x2.json").read_text())
    b = json.loads((tmp_path / "b" / "mlp_2x2.json").read_text())
    assert a["parameters"] == b["parameters"] and a["inputs"] == b["inputs"]
    assert a["predicted"]["step_time_s"] == pytest.approx(b["predicted"]["step_time_s"])
    wrong_mesh = _run(
        "solve",
        "examples/mlp.py",
        "--mesh",
        "4",
        "--out",
        str(tmp_path / "c"),
        "--preload",
        str(tmp_path / "a" / "mlp_2x2.pkl"),
    )
    assert wrong_mesh.exit_code == 2 and "2x2" in wrong_mesh.output


def _solve_until(marker: str, tmp_path, extra_wait: float):
    """Start a piped `autoshard solve` of the 8-layer Llama shape, wait for a progress line
    containing ``marker`` (plus ``extra_wait`` seconds), then press Ctrl-C."""
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "AUTOSHARD_LAYERS": "8"}
    cmd = [sys.executable, "-m", "autoshard.cli", "solve", "examples/llama.py", "--mesh", "2x4"]
    proc = subprocess.Popen(
        [*cmd, "--out", str(tmp_path / "out"), "--time-limit", "300"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a suite started in the background of a shell without job control inherits an
        # ignored SIGINT, which autoshard (rightly) keeps ignoring: give the child Ctrl-C
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = []
    for line in proc.stderr:
        seen.append(line.rstrip("\n"))
        if marker in line:
            break
    assert any(marker in s for s in seen), seen
    time.sleep(extra_wait)
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read().splitlines()
    rc = proc.wait(timeout=60)
    return rc, rest, time.perf_counter() - t0


@pytest.mark.slow
@pytest.mark.parametrize(
    "marker, wait", [("tracing", 0.5), ("solving the ILP", 4.0)], ids=["trace", "HiGHS"]
)
def test_ctrl_c_exits_130_with_one_line_and_writes_nothing(tmp_path, marker, wait):
    """Ctrl-C while tracing, and inside HiGHS (the 8-layer ILP runs about a minute): exit
    130 within seconds, one line, no traceback, no file written."""
    rc, rest, seconds = _solve_until(marker, tmp_path, wait)
    assert rc == 130, rest
    # the solve's periodic progress line may land between the marker and the signal (it
    # prints every Progress.EVERY_S on a pipe): progress, not part of the interruption
    progress = re.compile(r"^solving the ILP \(HiGHS\): \d+ s, ")
    rest = [line for line in rest if not progress.match(line)]
    assert rest == ["interrupted (Ctrl-C): nothing was written"], rest
    assert seconds < 15, f"took {seconds:.1f} s to stop"
    out = tmp_path / "out"  # never created: nothing was written
    assert not out.exists() or not any(p.suffix in (".pkl", ".json") for p in out.iterdir())


def test_a_failing_preload_never_overwrites_its_source(tmp_path):
    """--preload X --out <X's folder> would replace X with the new solve: refused first."""
    result = CliRunner().invoke(
        main, ["solve", str(ROOT / "examples" / "mlp.py"), "--mesh", "2x2", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    stored = tmp_path / "mlp_2x2.pkl"
    before = stored.read_bytes()
    args = ["solve", str(ROOT / "examples" / "mlp.py"), "--mesh", "2x2"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path), "--preload", str(stored)])
    assert result.exit_code == 2
    assert "is the --preload file" in result.output
    assert stored.read_bytes() == before


def test_an_unwritable_out_is_refused_before_any_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = CliRunner().invoke(
        main, ["solve", "no-such-model.py", "--mesh", "2x2", "--out", str(blocker / "sub")]
    )
    # the --out error comes first: the missing model file is never even opened
    assert result.exit_code == 2
    assert result.output.startswith("error: cannot write to --out"), result.output


@pytest.mark.slow
def test_option_errors_are_one_line_like_every_other_error():
    """click's own usage errors (a missing or bad option) in autoshard's one-line form."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "autoshard.cli", "solve", "examples/mlp.py"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "error: Missing option '--mesh' (or --gpus N: every mesh shape of N GPUs); "
        "see `autoshard solve --help`"
    ], out.stderr
    cmd += ["--mesh", "2x2", "--mode", "foo"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1
    assert out.stderr.startswith("error: Invalid value for '--mode'"), out.stderr


@pytest.mark.parametrize("command", ["compare", "stages", "calibrate"])
def test_a_missing_mesh_is_a_usage_error_in_every_command_that_needs_one(command):
    """``--mesh`` is required by these commands; with click 8.5 an explicit ``default=None``
    beside ``required=True`` silently let a missing ``--mesh`` through to a TypeError."""
    args = [command] if command == "calibrate" else [command, str(ROOT / "examples" / "mlp.py")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Missing option '--mesh'" in result.output, result.output


def test_show_on_a_model_file_says_it_is_not_a_plan_file():
    result = CliRunner().invoke(main, ["show", str(ROOT / "examples" / "mlp.py")])
    assert result.exit_code == 2
    assert "is not a plan file: it is text" in result.output, result.output


def test_the_report_says_how_much_of_the_batch_each_device_loads(tmp_path):
    """A user reading `input_ids: R·R` must learn that every rank loads the global batch."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard

    from autoshard.cost.mesh import MeshSpec
    from autoshard.plan.report import inputs_line

    mesh = MeshSpec.from_options("2x4")
    plan = SimpleNamespace(mesh=mesh, inputs={"input_ids": (Shard(0), Replicate())})
    assert inputs_line(plan) == "inputs: input_ids S(0)·R (each device loads 1/2 of it)"
    plan.inputs = {"x": (Shard(0), Shard(1)), "y": (Replicate(), Replicate())}
    assert inputs_line(plan) == (
        "inputs: x S(0)·S(1) (each device loads 1/8 of it); "
        "y R·R (each device loads the whole global tensor)"
    )
    plan.inputs = {"input_ids": (Replicate(), Shard(0))}
    assert inputs_line(plan, {"input_ids": (3, 128)}) == (
        "inputs: input_ids (3, 128) R·S(0) (each device loads 1/4 of it, (1, 128); its dim 0 "
        "(3) is smaller than the 8 devices)"
    )
    # the global batch and sequence length, and what one device holds of them
    plan.inputs = {"input_ids": (Shard(0), Shard(1))}
    assert inputs_line(plan, {"input_ids": (8, 1024)}) == (
        "inputs: input_ids (8, 1024) S(0)·S(1) (each device loads 1/8 of it, (4, 256))"
    )
    args = ["solve", str(ROOT / "examples" / "mlp.py"), "--mesh", "2x2", "--inputs", "replicate"]
    out = CliRunner().invoke(main, [*args, "--out", str(tmp_path)])
    assert "compute dtype float32" in out.output
    # examples/mlp.py: x of global shape (BATCH, D_MODEL) = (64, 1024)
    assert "inputs: x (64, 1024) R·R (each device loads the whole global tensor)" in out.output


@pytest.mark.slow
def test_parameter_names_wrap_instead_of_being_cut_on_a_narrow_terminal(tmp_path):
    """At 60 columns Llama's `<block>.self_attn.q_proj.weight` used to end in an ellipsis."""
    args = ["solve", str(ROOT / "examples" / "llama.py"), "--mesh", "2x4", "--mode", "infer"]
    env = {"COLUMNS": "60", "AUTOSHARD_LAYERS": "2"}
    out = CliRunner(env=env).invoke(main, [*args, "--out", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "<block>.self_at" in out.output  # the parameter table is there
    assert "…" not in out.output  # rich's ellipsis: a cut name


@pytest.mark.slow
def test_an_untraceable_model_is_one_line_naming_the_users_line(tmp_path):
    """Data-dependent control flow: torch prints its graph twice and a warning (about 28
    lines) before raising; autoshard says one line that points at the user's `if`."""

    model = tmp_path / "branchy.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Branchy(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(16, 16)\n\n"
        "    def forward(self, x):\n"
        "        y = self.fc(x)\n"
        "        if y.sum() > 0:\n"
        "            return y * 2\n"
        "        return y\n\n\n"
        "def build_model():\n    return Branchy()\n\n\n"
        "def example_inputs():\n    return (torch.randn(8, 16),)\n"
    )
    lines = _solve_error_lines(model, tmp_path)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: ") and f"{model}:12" in lines[0], lines[0]


def test_a_failed_solve_creates_no_output_folder(tmp_path):
    out = tmp_path / "new" / "plans"
    result = CliRunner().invoke(
        main, ["solve", "no-such-model.py", "--mesh", "2x2", "--out", str(out)]
    )
    assert result.exit_code == 2
    assert not (tmp_path / "new").exists()


def test_a_symlinked_model_file_never_overwrites_its_preload_source(tmp_path):
    """The outputs are named after the file the link points to (mlp), not the link (m)."""
    link = tmp_path / "m.py"
    link.symlink_to(ROOT / "examples" / "mlp.py")
    out = tmp_path / "out"
    solved = CliRunner().invoke(main, ["solve", str(link), "--mesh", "4", "--out", str(out)])
    assert solved.exit_code == 0, solved.output
    stored = out / "mlp_4.pkl"
    before = stored.read_bytes()
    args = ["solve", str(link), "--mesh", "4", "--out", str(out), "--preload", str(stored)]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "is the --preload file" in again.output
    assert stored.read_bytes() == before


def test_bare_autoshard_prints_its_help_not_an_error():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "autoshard.cli"], cwd=ROOT, capture_output=True, text=True
    )
    text = out.stdout + out.stderr
    assert text.startswith("Usage: autoshard"), text
    assert "error:" not in text


def test_an_ignored_sigint_stays_ignored():
    """A background job of a non-interactive shell ignores SIGINT; autoshard keeps it so.
    Otherwise SIGINT is routed inside the block, and after it the handler is as it was."""
    import signal

    from autoshard import interrupt

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with interrupt.installed():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with interrupt.installed():
            assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_that_a_finaliser_swallowed_is_silent_and_stops_the_next_step():
    """The one CI failure of 933a794: SIGINT landed in a finaliser (regex's ``__del__``
    during tracing), Python printed "Exception ignored ... KeyboardInterrupt" and the solve
    ran on for 304 s. Planted here: the interruption is recorded, the unraisable-exception
    hook that prints such reports never sees it (while another report still reaches it),
    and the next progress step raises it again; after the block nothing stays recorded and
    the hook and handler are as they were."""
    import signal
    import sys

    from rich.console import Console

    from autoshard import interrupt
    from autoshard.cli.options import Progress

    class Finaliser:
        def __init__(self, sig: bool):
            self.sig = sig

        def __del__(self):
            if self.sig:
                signal.raise_signal(signal.SIGINT)  # the handler runs inside this finaliser
            else:
                raise ValueError("a finaliser's own fault")

    reported = []
    handler, hook = signal.getsignal(signal.SIGINT), sys.unraisablehook
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)

        def recorder(unraisable) -> None:  # what Python would print
            reported.append(unraisable.exc_type)

        sys.unraisablehook = recorder
        with interrupt.installed():
            Finaliser(sig=True)  # dropped at once: its __del__ runs here
            assert interrupt.requested()  # the program ran on past the swallowed exception
            Finaliser(sig=False)
            assert reported == [ValueError]  # ... and only the other fault was reported
            with pytest.raises(KeyboardInterrupt):
                Progress(Console(stderr=True))("strategies", 0, 10)
        assert not interrupt.requested()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert sys.unraisablehook is recorder
    finally:
        signal.signal(signal.SIGINT, handler)
        sys.unraisablehook = hook


def test_the_users_line_is_found_under_a_folder_named_autoshard(tmp_path):
    """A clone at ~/autoshard/ holds the user's files too: only autoshard's own package,
    Python and installed packages are left out of the error's location."""
    from autoshard.trace.tracer import _library_file

    assert not _library_file(str(tmp_path / "autoshard" / "examples" / "bad.py"))
    assert _library_file(str(ROOT / "autoshard" / "trace" / "tracer.py"))
    assert _library_file(__import__("torch").__file__)
    assert _library_file(__import__("json").__file__)


@pytest.mark.slow
def test_solve_json_prints_the_report_as_json_on_stdout(tmp_path):
    """`solve --json`: stdout is one JSON document (the readable report on stderr) whose
    numbers are the solution file's: step time, placements, memory kinds summing to the
    total (issue 15, item 4). And no third party's banner on either stream: highspy 1.16
    prints "Running HiGHS ..." from C++ when a solver is made, and a solve's terminal shows
    autoshard's report only (issue 13, item 5)."""
    import json
    import subprocess
    import sys

    from autoshard.placements import placements_to_str
    from autoshard.plan.formats import load_solution

    cmd = [sys.executable, "-m", "autoshard.cli", "solve", "examples/mlp.py", "--mesh", "2x2"]
    out = subprocess.run(
        [*cmd, "--json", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert "Predicted time per step" in out.stderr  # the readable report, kept off stdout
    assert "solver: HiGHS" in out.stderr
    text = out.stdout + out.stderr
    assert "Running HiGHS" not in text and "Copyright" not in text, text
    assert report["format"] == "autoshard.report/1"
    solution = load_solution(tmp_path / "mlp_2x2.pkl")
    assert report["time_s"]["step"] == pytest.approx(solution["objective_s"], rel=1e-12)
    assert report["plan"]["parameters"] == {
        k: placements_to_str(v) for k, v in solution["parameters"].items()
    }
    memory = report["memory_bytes"]
    parts = ("parameters", "gradients", "optimizer_state", "activations")
    assert memory["total"] == pytest.approx(sum(memory[k] for k in parts), rel=1e-12)
    assert report["fits"] is True and memory["total"] <= memory["budget"]
    assert report["solver"]["status"] in ("optimal", "within_gap")
    assert set(report["time_s"]["collectives"]) <= {
        "all_gather",
        "all_reduce",
        "reduce_scatter",
        "all_to_all",
    }
    assert report["files"] == [str(tmp_path / "mlp_2x2.pkl"), str(tmp_path / "mlp_2x2.json")]
    quiet = subprocess.run(
        [*cmd, "--json", "-q", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    assert json.loads(quiet.stdout)["time_s"]["step"] == report["time_s"]["step"]


@pytest.mark.slow
def test_a_shape_error_in_the_model_is_one_line(tmp_path):
    """A matmul of mismatched shapes: torch's fake kernel logs its 20-line traceback at
    ERROR level before the export raises; only autoshard's one line reaches the terminal."""

    model = tmp_path / "bad.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "class Bad(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(16, 32)\n\n"
        "    def forward(self, x):\n"
        "        return self.fc(x.sum(1, keepdim=True))\n\n\n"
        "def build_model():\n    return Bad()\n\n\n"
        "def example_inputs():\n    return (torch.randn(8, 16),)\n"
    )
    lines = _solve_error_lines(model, tmp_path)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines


def _solve_error_lines(model: Path, tmp_path: Path) -> list[str]:
    """`autoshard solve MODEL --mesh 2x2` in a subprocess that must fail with exit code 2
    and print nothing on stdout: its stderr lines, less the tracing progress lines."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "autoshard.cli", "solve", str(model), "--mesh", "2x2"]
    out = subprocess.run(
        [*cmd, "--out", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    return [line for line in out.stderr.splitlines() if not line.startswith("tracing")]


def test_a_report_that_fails_keeps_the_plan_and_names_its_files(tmp_path, monkeypatch):
    """Issue 27: the plan is written before the report prices anything, so a planted
    failure in the block comparison (the README's KeyError) loses no work: both files
    exist, load, and the failure first names them."""
    import autoshard.plan.report as report

    def planted(plan):
        raise KeyError(30)

    monkeypatch.setattr(report, "block_differences", planted)
    out = tmp_path / "out"
    result = _run("solve", str(ROOT / "examples" / "mlp.py"), "--mesh", "4", "--out", str(out))
    assert isinstance(result.exception, KeyError)
    pkl, js = out / "mlp_4.pkl", out / "mlp_4.json"
    assert f"the plan was written before this failure: {pkl}, {js}" in result.output
    assert load_sharding_map(js).parameters and load_solution(pkl)


def test_a_report_that_fails_after_writing_names_the_files_it_wrote(tmp_path, monkeypatch):
    """Issue 27: a failure once the plan is written (here a planted one in printing the
    report) first says which files hold the plan; both exist and load."""
    import autoshard.plan.report as report

    def planted(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(report, "print_report", planted)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["solve", str(ROOT / "examples" / "mlp.py"), "--mesh", "4", "--out", str(out)]
    )
    assert isinstance(result.exception, RuntimeError)
    pkl, js = out / "mlp_4.pkl", out / "mlp_4.json"
    assert f"the plan was written before this failure: {pkl}, {js}" in result.output
    assert load_sharding_map(js).parameters and load_solution(pkl)


def test_cli_py_without_the_dependencies_says_which_interpreter_to_use():
    """Issue 27: ``python cli.py`` run by an interpreter without autoshard's dependencies
    (here this one with its site-packages cut off, ``-S``) is one line, exit 2, naming
    the interpreter to use instead of a ModuleNotFoundError traceback."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-S", str(ROOT / "cli.py"), "solve", "examples/mlp.py", "--mesh", "4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "has no module" in lines[0] and "cli.py ...`" in lines[0], lines[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["solve", "examples/mlp.py", "--mesh", "2", "--out", ""],
            "Invalid value for '--out': is empty",
        ),
        (
            ["solve", "examples/mlp.py", "--mesh", "4", "--preload", "x.pkl", "--algo", "ddp"],
            "--preload takes its plan from the file and --algo ddp builds one",
        ),
        (["solve", "examples/mlp.py", "--mesh", "2", "--html", "{tmp}"], "is a folder"),
        (
            ["solve", "examples/mlp.py", "--mesh", "2", "--html", "{tmp}/afile/x.html"],
            "cannot write to --html {tmp}/afile",
        ),
        (
            ["launch", "no-plan.json", "examples/mlp.py", "--json", "{tmp}/afile/r.json"],
            "cannot write to --json {tmp}/afile",
        ),
        (
            ["solve", "examples/mlp.py", "--mesh", "2x2", "--mesh-dim-names", "a"],
            "--mesh-dim-names a gives 1 name(s) but --mesh 2x2 has 2 dims: give one name per "
            "dim, e.g. --mesh-dim-names dp,tp",
        ),
        (
            ["export", "examples/mlp.py", "{tmp}/mlp_2.json"],
            "the plan comes first: autoshard export {tmp}/mlp_2.json examples/mlp.py",
        ),
        (
            ["solve", "examples/mlp.py", "--mesh", "2", "--out", "{tmp}/plan.pkl"],
            "--out {tmp}/plan.pkl looks like a file name, but --out is the folder that gets",
        ),
        (
            ["stages", "examples/gpt2.py", "--mesh", "2x2", "--pp", "2", "--out", "{tmp}/s.json"],
            "--out {tmp}/s.json looks like a file name",
        ),
        (
            ["solve", "examples/mlp.py", "--gpus", "4", "--microbatches", "4"],
            "--microbatches applies with --gpus N --pp DEPTHS only",
        ),
        (
            ["solve", "examples/mlp.py", "--mesh", "2", "--mode", "infer"]
            + ["--activation-checkpointing", "selective"],
            "selective recomputes blocks in a training step's backward pass",
        ),
    ],
    ids=[
        "empty-out",
        "preload-and-algo",
        "html-folder",
        "html-under-a-file",
        "launch-json",
        "dim-names-one-short",
        "export-arguments-swapped",
        "out-named-like-a-file",
        "stages-out-named-like-a-file",
        "microbatches-alone",
        "checkpointing-in-inference",
    ],
)
def test_an_option_that_cannot_work_is_refused_before_any_work(tmp_path, args, message):
    """Found by trying the commands as a new user: each of these used to run the whole
    solve or launch first (or, for --preload with --algo, to write the preloaded plan
    under --algo's name), or to write into the current folder without a word."""
    (tmp_path / "afile").write_text("a file, not a folder")
    out = tmp_path / "out"
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if args[0] == "solve" and "--out" not in args:
        args += ["--out", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert message.replace("{tmp}", str(tmp_path)) in result.output, result.output
    assert "tracing" not in result.output and "running:" not in result.output
    assert not out.exists()


def test_compare_names_each_plan_once_and_says_when_none_fits():
    """``--plans ddp,ddp`` prints ddp once; ``--plans ,`` is refused; with a budget no plan
    fits, the star marks the fastest of all and the legend says none fits (it read
    "fastest that fits" over two rows marked ``fits no``)."""
    mlp = str(ROOT / "examples" / "mlp.py")
    base = ["compare", mlp, "--mesh", "4", "--memory-budget", "1KiB"]
    run = CliRunner().invoke(main, [*base, "--plans", "ddp,megatron,ddp"])
    assert run.exit_code == 0, run.output
    rows = [line.split()[0] for line in run.stdout.splitlines() if line.strip().startswith("ddp")]
    assert len(rows) == 3, run.stdout  # one row in each of the three tables
    assert "* fastest (none fits in 1.00 KiB)" in run.stdout
    assert "fastest that fits" not in run.stdout
    empty = CliRunner().invoke(main, [*base, "--plans", ","])
    assert empty.exit_code == 2 and "--plans names no plan" in empty.output


def test_a_one_layer_model_is_no_pipeline_in_good_english(tmp_path):
    """``stages --pp 2`` on the MLP (one clustered layer) said "1 layers ... use --pp 1
    or fewer"."""
    mlp = str(ROOT / "examples" / "mlp.py")
    run = CliRunner().invoke(
        main, ["stages", mlp, "--mesh", "2", "--pp", "2", "--out", str(tmp_path)]
    )
    assert run.exit_code == 2, run.output
    assert run.output.strip().splitlines()[-1] == (
        "error: cannot split 1 layer into 2 pipeline stages: the model has 1 layer "
        "(clustered); it cannot be split into stages"
    )
