"""Shared helpers for the tests: tiny model files written on the fly."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import subprocess
import sys
import types
import unittest.mock
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

MLP_TEMPLATE = """
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h})
        self.act = nn.{act}()
        self.fc2 = nn.Linear({h}, {d})

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))

def build_model():
    return MLP()

def example_inputs():
    return (torch.randn({b}, {d}),)
"""


MSE_TEMPLATE = """
import torch
from torch import nn

class MLPRegression(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h})
        self.act = nn.ReLU()
        self.fc2 = nn.Linear({h}, {d})

    def forward(self, x, y):
        return ((self.fc2(self.act(self.fc1(x))) - y) ** 2).mean()

def build_model():
    return MLPRegression()

def example_inputs():
    return (torch.randn({b}, {d}), torch.randn({b}, {d}))
"""


def write_mlp(tmp_path: Path, b: int, d: int, h: int, act: str = "ReLU", name: str = "mlp") -> Path:
    """A 2-layer MLP model file: Linear(d, h) -> act -> Linear(h, d), input (b, d)."""
    path = tmp_path / f"{name}.py"
    path.write_text(MLP_TEMPLATE.format(b=b, d=d, h=h, act=act))
    return path


def write_mlp_mse(tmp_path: Path, b: int, d: int, h: int, name: str = "mlp_mse") -> Path:
    """Alpa's test MLP: Linear(d, h) -> ReLU -> Linear(h, d) with the MSE loss against a
    target inside ``forward``; inputs x and y, both (b, d); the output is the scalar loss.

    Unlike a loss that is linear in the output (the mean), MSE needs the output whole
    before squaring it, so a row-parallel matmul's Partial output must be reduced."""
    path = tmp_path / f"{name}.py"
    path.write_text(MSE_TEMPLATE.format(b=b, d=d, h=h))
    return path


GPT2_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt2.py"

GPT2_SHORT_TEMPLATE = '''"""examples/gpt2.py's GPT-2 with input_ids of shape ({batch}, {seq})."""
import importlib.util

import torch

_spec = importlib.util.spec_from_file_location("_gpt2_example", {example!r})
_gpt2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_gpt2)
build_model = _gpt2.build_model


def example_inputs():
    return (torch.randint(0, 50257, ({batch}, {seq})),)
'''


def write_gpt2_short(tmp_path: Path, batch: int, seq: int = 32) -> Path:
    """examples/gpt2.py's model (``AUTOSHARD_LAYERS`` layers) with a short batch of
    token ids, (batch, seq)."""
    path = tmp_path / "gpt2_short.py"
    path.write_text(GPT2_SHORT_TEMPLATE.format(batch=batch, seq=seq, example=str(GPT2_EXAMPLE)))
    return path


ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_TIMEOUT_S = 300


def rank_env(**extra: str) -> dict[str, str]:
    """The environment of torchrun's ranks: one thread each, this checkout importable."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def torchrun(nproc: int, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N -m autoshard.launch ARGS``, captured:
    the real torchrun, for the tests whose subject is how a launch starts. The others run
    their ranks with :func:`ranks` (the same processes, forked from a warm parent)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(nproc), "-m", "autoshard.launch", *args]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=_launch_env(env),
        capture_output=True,
        text=True,
        timeout=TORCHRUN_TIMEOUT_S,
    )


def _launch_env(env: dict[str, str]) -> dict[str, str]:
    from autoshard.launch.torchrun import MMAP_THRESHOLD

    # the ranks' allocator as `autoshard launch` sets it (rank_environment)
    return rank_env(**{"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), **env})


RANKS_ALLOWED = True
"""False while a test not marked ``slow`` runs (tests/conftest.py): :func:`ranks` then
refuses, as a torchrun started by such a test is refused."""

_zygote: subprocess.Popen[str] | None = None


def _warm_parent() -> subprocess.Popen[str]:
    """The running tests/rank_zygote.py of this test process, started on first use."""
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "rank_zygote.py")],
            cwd=ROOT,
            env=_launch_env({}),  # read at its start: malloc's threshold, one thread
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert _zygote.stdout is not None
        ready = _zygote.stdout.readline()
        assert ready.strip() == "ready", f"tests/rank_zygote.py did not start: {ready!r}"
        atexit.register(_zygote.kill)
    return _zygote


def ranks(
    nproc: int, *argv: str, cwd: Path = ROOT, prime: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    """``nproc`` ranks of ``argv`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``, what follows
    torchrun's options; a bare plan and model mean ``-m autoshard.launch``), as
    ``torchrun --standalone --nproc-per-node N`` runs them from ``cwd`` with ``env``
    added, captured; forked from tests/rank_zygote.py, which has imported torch, DTensor
    and autoshard once (its docstring says what differs from torchrun: how each process
    starts, and that the ranks of a ``--mode plan`` launch take one trace of the model
    made before them; ``prime=False``: each rank traces for itself, as under torchrun).

    Raises:
        AssertionError: called from a test not marked ``slow``.
        subprocess.TimeoutExpired: the ranks ran past :data:`TORCHRUN_TIMEOUT_S`.
    """
    if not RANKS_ALLOWED:
        raise AssertionError("a test that starts ranks must be marked @pytest.mark.slow")
    if argv[0] != "-m" and not argv[0].endswith(".py"):
        argv = ("-m", "autoshard.launch", *argv)
    request = {
        "nproc": nproc,
        "argv": list(argv),
        "env": _launch_env(env),
        "cwd": str(cwd),
        "timeout": TORCHRUN_TIMEOUT_S,
        "prime": prime,
    }
    zygote = _warm_parent()
    assert zygote.stdin is not None and zygote.stdout is not None
    zygote.stdin.write(json.dumps(request) + "\n")
    zygote.stdin.flush()
    reply = json.loads(zygote.stdout.readline())
    cmd = ["ranks", str(nproc), *argv]
    if reply.get("warm_up_error") and reply["rc"] == 0:
        # the ranks did what the warm-up could not: it no longer shares the trace
        warnings.warn(
            f"rank_zygote's warm-up failed ({reply['warm_up_error']}) where the ranks "
            "succeeded: each rank traced for itself",
            stacklevel=2,
        )
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired(cmd, TORCHRUN_TIMEOUT_S, reply["stdout"], reply["stderr"])
    return subprocess.CompletedProcess(cmd, reply["rc"], reply["stdout"], reply["stderr"])


@contextlib.contextmanager
def environment(**env: str) -> Iterator[None]:
    """Within the block, ``env`` is set in ``os.environ``; after it, the environment is
    what it was, whatever the block set (``autoshard -v`` sets a variable of its own)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


IN_PROCESS = frozenset({"solve", "compare", "stages", "show", "export", "launch", "calibrate"})
"""The commands :func:`autoshard_cli` runs in the test's own process. ``launch`` checks
the plan here, ``calibrate`` its options, and each starts its ranks with :func:`ranks` in
place of torchrun (:func:`warm_torchrun`); tests/test_launch.py runs the real ``launch``,
torchrun included."""


def autoshard_cli(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    """``autoshard ARGS`` run from ``cwd`` with ``env`` (extra environment variables),
    captured: its exit code, stdout and stderr.

    The commands of :data:`IN_PROCESS` run in this process through click's ``CliRunner``
    (``autoshard.cli.main.main``, what the console script calls), with ``env`` set and the
    working folder changed for the call and both restored after it. A subprocess would
    spend 9.5 s importing torch, transformers and autoshard again before its first line of
    work (``import torch, transformers; import autoshard.solver.solve``, idle 2-core
    machine, 2026-11-28). An exception the command did not turn into its one-line error comes back
    as exit code 1 with its traceback in stderr, as from a process. ``launch`` and
    ``calibrate`` start their ranks forked from a warm parent (:func:`warm_torchrun`)."""
    if args and args[0] in IN_PROCESS:
        return _in_process(args, cwd, env)
    return subprocess.run(
        [sys.executable, "-m", "autoshard.cli", *args],
        cwd=cwd,
        env=rank_env(**env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def cli_config(*args: str):
    """The ``SolveConfig`` that ``autoshard ARGS`` (``solve``, ``compare``) would plan with:
    the command's own click parser and defaults, then ``config_from_options``, as the
    command does before its first line of work."""
    from autoshard.cli.main import main
    from autoshard.cli.options import config_from_options

    command = main.commands[args[0]]
    params = command.make_context(args[0], list(args[1:])).params
    return config_from_options(ROOT / params.pop("model_file"), params)


def _in_process(args: tuple[str, ...], cwd: Path, env: dict[str, str]):
    import traceback

    from click.testing import CliRunner

    import autoshard.cli.calibrate
    import autoshard.cli.launch
    from autoshard.cli.main import main

    here = os.getcwd()
    shim = types.SimpleNamespace(run=_torchrun_shim)  # the commands' subprocess module
    with (
        environment(**env),
        unittest.mock.patch.object(autoshard.cli.launch, "subprocess", shim),
        unittest.mock.patch.object(autoshard.cli.calibrate, "subprocess", shim),
    ):
        os.chdir(cwd)
        try:
            result = CliRunner().invoke(main, list(args), prog_name="autoshard")
        finally:
            os.chdir(here)
    stderr = result.stderr
    if result.exc_info is not None and not isinstance(result.exc_info[1], SystemExit):
        stderr += "".join(traceback.format_exception(*result.exc_info))
    argv = ["autoshard", *args]
    return subprocess.CompletedProcess(argv, result.exit_code, result.stdout, stderr)


def warm_torchrun(
    argv: Sequence[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess[str] | None:
    """``torchrun --standalone --nproc-per-node N PROGRAM...`` (or ``python -m
    torch.distributed.run`` with those options) run with :func:`ranks`; ``None`` for any
    other command line (another torchrun option: run it for real)."""
    words = list(argv)
    if words[:3] in (
        [sys.executable, "-m", "torch.distributed.run"],
        [sys.executable, "-m", "autoshard.launch.torchrun"],
    ):
        words = words[3:]
    elif Path(words[0]).name == "torchrun":
        words = words[1:]
    else:
        return None
    nproc = None
    while words and words[0].startswith("--"):
        option = words.pop(0).replace("_", "-")
        if option == "--standalone":
            continue
        if option.startswith("--nproc-per-node=") and option.split("=", 1)[1].isdigit():
            nproc = int(option.split("=", 1)[1])
        elif option == "--nproc-per-node" and words and words[0].isdigit():
            nproc = int(words.pop(0))
        else:
            return None
    if nproc is None or not words:
        return None
    return ranks(nproc, *words, cwd=cwd, **env)


def _torchrun_shim(argv: Sequence[str], env: dict[str, str] | None = None, check: bool = False):
    """``subprocess.run`` as ``autoshard launch`` and ``calibrate`` call it, its torchrun run by
    :func:`warm_torchrun` with the output written where the command's would go."""
    done = warm_torchrun(argv, Path.cwd(), dict(env or os.environ))
    if done is None:
        return subprocess.run(argv, env=env, check=check)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done


def number(pattern: str, text: str) -> float:
    """The float that ``pattern``'s first group matches in ``text`` (asserted present)."""
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text}"
    return float(m.group(1))


CHECK_OUTPUT = (
    r"check: (?:loss|output)(?: of step 1)? vs single device \(float64\), error relative "
    r"to its scale (\S+)"
)
CHECK_GRADS = r"gradients of step 1: worst relative error (\S+)"
CHECK_PARAMS = r"parameters after 1 optimizer step: worst relative error (\S+)"


def assert_checked(
    out: str, output: float, grads: float | None = None, params: float | None = None
) -> None:
    """A ``--check`` run's report: the output's (and with ``grads``/``params``, step 1's
    gradients' and parameters') error relative to its scale at most the given bound, and
    nothing beyond tolerance."""
    assert number(CHECK_OUTPUT, out) <= output
    if grads is not None:
        assert number(CHECK_GRADS, out) <= grads
    if params is not None:
        assert number(CHECK_PARAMS, out) <= params
    assert "FAILED" not in out


GPT2_DEFAULT = """
\"\"\"GPT-2 as anyone writes it: a default-style config (KV cache on, default attention).\"\"\"
import torch
from transformers import GPT2Config, GPT2LMHeadModel


def build_model():
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1024, n_positions=128)
    )


def example_inputs():
    return (torch.randint(0, 1024, (8, 32)),)
"""

LLAMA_SMALL = """
\"\"\"A 2-layer Llama, default attention and cache settings.\"\"\"
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model():
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=128,
        )
    )


def example_inputs():
    return (torch.randint(0, 512, (8, 32)),)
"""

BERT_SMALL = """
\"\"\"A 2-layer BERT encoder with its default config otherwise.\"\"\"
import torch
from transformers import BertConfig, BertModel


def build_model():
    return BertModel(
        BertConfig(
            hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=256, vocab_size=512, max_position_embeddings=64,
        )
    )


def example_inputs():
    return (torch.randint(0, 512, (8, 32)),)
"""


NORMED_STACK_TEMPLATE = """
import torch
from torch import nn


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm({d}), nn.Linear({d}, {h}), nn.ReLU(), nn.Linear({h}, {d}))
            for _ in range({blocks})
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)  # the residual in the model's own forward, around the block
        return x


def build_model():
    model = Stack()
    for block in list(model.blocks)[{frozen}]:
        block.requires_grad_(False)  # frozen, as a fine-tune freezes layers
    return model


def example_inputs():
    return (torch.randn({rows}, {d}),)
"""


def normed_stack(
    blocks: int = 3, rows: int = 4096, d: int = 256, h: int = 1024, frozen: str = "0:0"
) -> str:
    """A model file: ``blocks`` pre-norm residual blocks (LayerNorm, Linear(d, h), ReLU,
    Linear(h, d)), the residual add in the model's own ``forward``; input (rows, d); the
    blocks of the slice ``frozen`` (``"2:7"``) frozen, none by default."""
    return NORMED_STACK_TEMPLATE.format(blocks=blocks, rows=rows, d=d, h=h, frozen=frozen)


def eager(text: str) -> tuple:
    """The model file ``text`` built as it runs eagerly: ``(build_model(),
    example_inputs())``, seeded."""
    import torch  # noqa: PLC0415 - the ranks' helpers here import no torch

    scope: dict = {}
    exec(compile(text, "<model file>", "exec"), scope)  # noqa: S102 - the tests' own text
    torch.manual_seed(0)
    return scope["build_model"](), scope["example_inputs"]()


def write_model(tmp_path: Path, text: str, name: str) -> Path:
    """``text`` as the model file ``<tmp_path>/<name>.py``."""
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


MIXTRAL_SMALL = """
\"\"\"A 2-layer Mixtral-style mixture of experts (4 experts, top-2).\"\"\"
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build_model():
    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2, vocab_size=256, max_position_embeddings=64,
        )
    )


def example_inputs():
    return (torch.randint(0, 256, (8, 16)),)
"""


def block_stack(block: str, n: int, b: int, d: int) -> str:
    """A model file: ``n`` copies of the ``Block`` class that ``block`` defines (source,
    with ``torch`` and ``nn`` imported) applied in turn to an input of shape ``(b, d)``;
    the stack's ``layers`` are its repeated blocks."""
    return f"""
import torch
from torch import nn

{block.strip()}

class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range({n})])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

def build_model():
    return Stack()

def example_inputs():
    return (torch.randn({b}, {d}),)
"""
