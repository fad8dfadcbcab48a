"""Every command the README and docs/*.md show in a ``sh`` code block runs, and ends well.

Each documented file's commands run in order (a later one reads what an earlier one wrote,
``show solutions/gpt2_2x4.json`` after the solve) in a fresh folder holding the bundled
``examples/`` and ``cli.py``, with the commands as written: ``autoshard``,
``.venv/bin/autoshard``, ``.venv/bin/python`` and ``torchrun`` name this environment's
programs. ``autoshard`` commands that start no ranks (``solve``, ``compare``, ``stages``,
``show``, ``export``) run in the test's own process, as ``helpers.autoshard_cli`` runs them
(the console script's ``main``, with the command's environment and folder): each would
spend 9.5 s importing torch, transformers and autoshard again in a process of its own.
``autoshard launch`` runs there too, and it and a documented ``torchrun --standalone
--nproc-per-node N`` start their ranks forked from a warm parent (``helpers.ranks``,
tests/rank_zygote.py: the same processes, environment and program as torchrun's, without
7.5 s of imports in each); tests/test_launch.py runs ``autoshard launch`` with the real
torchrun.
``make run``, which the fresh-clone check runs, and ``python cli.py`` run the programs
themselves. A command fails the test on a non-zero exit or a Python traceback anywhere
in its output. Blocks that show output, a synopsis or a multi-node run are marked ``text``
(or carry no language) and are not run; the two ``make`` targets are checked apart
(``make run`` is the GPT-2 solve the README also lists, ``make test`` is this suite).

``python tests/test_docs_commands.py`` runs them all and prints each command's wall time.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import IN_PROCESS, autoshard_cli, warm_torchrun

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# make targets: what they run, checked against the Makefile (not run again here)
MAKE_TARGETS = {
    "make run": "autoshard solve examples/gpt2.py --mesh 2x4",  # also a README command
    "make test": None,  # this suite
}

# files whose commands take minutes here (measured: see the closing note of issue 27)
SLOW = {"README.md", "docs/calibrate.md", "docs/launch.md", "docs/preload.md"}

COMMAND_TIMEOUT_S = 1500

WORK_LIMIT = "2"
"""The ILP's ``--work-limit`` given to a documented ``solve`` / ``compare`` / ``stages`` that
sets no limit (the default is 200): a plan stopped at its limit takes the same report path
(the README's Llama solve crashed there, issue 27) in a fraction of the time, and, unlike
the wall-clock ``--time-limit 20`` this test gave before, whatever else runs beside it (with
two pytest-xdist workers the README's 70B solve found no plan within 20 s). At 2 the
README's three large solves still stop at the limit with a plan (Llama h200 2x4, 70B 8x8,
70B torchtitan bf16 8x8: 14, 13 and 12 s here, against 31, 23 and 19 s at 5), each on the
plan of the search's start without overlap (an ILP's: 278 ms, 750 ms and 1.29 s; at 5 the
first two end on that start too, the torchtitan shape's search reaches 1.23 s), with the
same report lines (the Llama's block planned unlike the others included), their gap "n/a"
(HiGHS has no bound yet) where at 5 it was a percentage."""


@dataclass(frozen=True)
class DocCommand:
    """One command of a ``sh`` block: its file (relative to the checkout), line, text."""

    doc: str
    line: int
    text: str


def doc_commands(path: Path) -> list[DocCommand]:
    """The commands of ``path``'s ``sh`` / ``bash`` / ``shell`` code blocks, in order:
    continuation lines (``\\``) joined, comments and blank lines dropped."""
    out: list[DocCommand] = []
    lines = path.read_text().splitlines()
    rel = path.relative_to(ROOT).as_posix()
    in_block = run_block = False
    pending, start = "", 0
    for i, line in enumerate(lines, 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence:
            if in_block and pending:
                raise AssertionError(f"{rel}:{start}: a command ends in a line continuation")
            run_block = not in_block and fence.group(1) in ("sh", "bash", "shell")
            in_block = not in_block
            continue
        if not (in_block and run_block):
            continue
        text = re.sub(r"(^|\s)#.*$", "", line).strip()
        if not text:
            continue
        if not pending:
            start = i
        if text.endswith("\\"):
            pending += text[:-1].rstrip() + " "
            continue
        out.append(DocCommand(rel, start, pending + text))
        pending = ""
    return out


def all_commands() -> list[DocCommand]:
    return [c for doc in DOCS for c in doc_commands(doc)]


def argv(command: str) -> tuple[dict[str, str], list[str]]:
    """The environment assignments and the argument list of one documented command, its
    programs resolved to this environment's."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    program = words[0]
    if program.startswith(".venv/bin/"):
        program = program[len(".venv/bin/") :]
    if program in ("autoshard", "torchrun", "python"):
        words[0] = str(BIN / program)
    else:
        raise AssertionError(f"a documented command runs {program!r}: teach this test to run it")
    searches = program == "autoshard" and words[1] in ("solve", "compare", "stages")
    limits = ("--time-limit", "--work-limit", "--preload")
    if searches and not any(w in words for w in limits):
        words += ["--work-limit", WORK_LIMIT]
    return env, words


def workdir(tmp: Path) -> Path:
    """A folder as a checkout's root looks to a user: examples/ and cli.py."""
    shutil.copytree(ROOT / "examples", tmp / "examples")
    shutil.copy(ROOT / "cli.py", tmp / "cli.py")
    return tmp


def run_command(cmd: DocCommand, cwd: Path) -> tuple[float, str]:
    """Run one documented command in ``cwd``; its wall seconds and output.

    Raises:
        AssertionError: a non-zero exit or a traceback in the output.
    """
    extra, words = argv(cmd.text)
    t = time.perf_counter()
    done = None
    if Path(words[0]).name == "autoshard" and words[1] in IN_PROCESS:
        done = autoshard_cli(*words[1:], cwd=cwd, **extra, COLUMNS="100")
    elif Path(words[0]).name == "torchrun":
        done = warm_torchrun(words, cwd, {**extra, "COLUMNS": "100"})
    if done is None:
        done = subprocess.run(
            words,
            cwd=cwd,
            env={**os.environ, **extra, "COLUMNS": "100"},
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
    seconds = time.perf_counter() - t
    output = done.stdout + done.stderr
    where = f"{cmd.doc}:{cmd.line}: `{cmd.text}`"
    assert done.returncode == 0, f"{where} exited {done.returncode}:\n{output[-4000:]}"
    assert "Traceback (most recent call last)" not in output, f"{where}:\n{output[-4000:]}"
    return seconds, output


def _docs_with_commands() -> list[str]:
    return [
        d.relative_to(ROOT).as_posix()
        for d in DOCS
        if any(c.text not in MAKE_TARGETS for c in doc_commands(d))
    ]


@pytest.mark.parametrize(
    "doc",
    [
        pytest.param(d, marks=[pytest.mark.slow] if d in SLOW else [], id=d)
        for d in _docs_with_commands()
    ],
)
def test_every_documented_command_runs(doc: str, tmp_path: Path) -> None:
    cwd = workdir(tmp_path)
    for cmd in doc_commands(ROOT / doc):
        if cmd.text in MAKE_TARGETS:
            continue
        run_command(cmd, cwd)


def test_the_make_targets_the_readme_shows_are_the_makefile_s() -> None:
    """``make run`` is the README's first solve (run by the README's test above); ``make
    test`` is pytest; both exist in the Makefile with the recipe named."""
    makefile = (ROOT / "Makefile").read_text()
    readme = {c.text for c in doc_commands(ROOT / "README.md")}
    assert set(MAKE_TARGETS) <= readme
    recipe = re.search(r"^run:.*\n\t(.+)$", makefile, re.M).group(1)
    assert recipe == "$(BIN)/" + MAKE_TARGETS["make run"]
    assert f".venv/bin/{MAKE_TARGETS['make run']}" in readme
    assert re.search(r"^test:.*\n\t\$\(BIN\)/python -m pytest", makefile, re.M)


def test_the_parser_finds_commands_and_skips_output() -> None:
    """Known lines of the docs: a README solve, a continued preload command joined, and
    the launch page's sample output (an unmarked block) left out."""
    texts = [c.text for c in all_commands()]
    mlp = "examples/mlp.py --mesh 4 --inputs replicate --outputs replicate"
    assert f".venv/bin/autoshard solve {mlp}" in texts
    assert (
        "autoshard solve examples/gpt2.py --mesh 2x4 "
        "--preload solutions/small/gpt2_2x4.pkl --out solutions/full"
    ) in texts
    assert not any(t.startswith("autoshard launch: ") for t in texts)
    assert not any("MODEL_FILE" in t or "node0.example" in t for t in texts)


if __name__ == "__main__":  # the timing table of the closing note
    import tempfile

    only = sys.argv[1:]
    for doc in _docs_with_commands():
        if only and doc not in only:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            cwd = workdir(Path(tmp))
            for cmd in doc_commands(ROOT / doc):
                if cmd.text in MAKE_TARGETS:
                    continue
                try:
                    seconds, _ = run_command(cmd, cwd)
                    print(f"| {doc}:{cmd.line} | `{cmd.text}` | {seconds:.1f} s |", flush=True)
                except AssertionError as exc:
                    print(f"| {doc}:{cmd.line} | `{cmd.text}` | FAILED: {exc} |", flush=True)


def help_first_steps() -> list[DocCommand]:
    """The commands under "First steps" in ``autoshard --help``, in order."""
    from click.testing import CliRunner

    from autoshard.cli.main import main

    text = CliRunner().invoke(main, ["--help"]).output
    section = text.split("First steps", 1)[1].split("Then real models", 1)[0]
    return [
        DocCommand("autoshard --help", i, line.strip().split("  ")[0])
        for i, line in enumerate(section.splitlines())
        if line.strip().startswith("autoshard ")
    ]


@pytest.mark.slow  # its launch starts 4 torchrun ranks
def test_the_first_steps_autoshard_help_suggests_run(tmp_path: Path) -> None:
    """Item 5 of issue 27: what ``--help`` suggests first is the MLP, and it runs here."""
    steps = help_first_steps()
    assert len(steps) == 5 and all("examples/mlp.py" in c.text or "mlp_4" in c.text for c in steps)
    cwd = workdir(tmp_path)
    for cmd in steps:
        run_command(cmd, cwd)
