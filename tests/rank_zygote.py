"""A warm parent for the test suite's multi-rank runs: it imports torch, DTensor, pipelining,
transformers and autoshard's launch once, then forks the ranks of each run.

Each rank of ``torchrun --standalone --nproc-per-node N -m autoshard.launch ...`` spends
7.5 s (idle 2-core machine, ``python -c "import autoshard.launch.rank"``) importing before
its first line of work, and the ranks of one launch share the machine's two cores, so an
8-rank launch of a small model took half a minute before it ran a step. A forked rank
starts with those modules loaded. Each run has a leader, forked first, which traces the
model once as every rank of a ``--mode plan`` launch would (:func:`_prime`): its ranks,
forked from it, take that trace instead of tracing eight times side by side. What differs
from torchrun is how the processes start and that one trace: each is a process of its own
with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), joins gloo through ``env://`` as
under torchrun, and runs the same module or script as ``__main__``; all write to one stdout
and one stderr, as torchrun's children inherit its own; when one fails the others are
stopped (SIGTERM), as torchrun's agent does, and the run's exit code is 1, as torchrun's.
tests/test_launch.py keeps real torchrun for the launches whose subject is the launcher
itself (version-1 maps, which trace nothing, and a world-size error); the documented
commands of tests/test_docs_commands.py start their ranks here too. The one launch whose
ranks trace for themselves is ``prime=False``'s (tests/test_launch_plan.py's
``nn.TransformerEncoder``).

Protocol (one JSON object per line): the test process writes ``{"nproc", "argv", "env",
"cwd", "timeout", "prime"}`` on this process's stdin (``argv`` is what follows torchrun's
own options: ``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``; ``prime`` false has each rank
trace for itself); this process answers ``{"rc", "stdout", "stderr", "timed_out",
"warm_up_error"}`` on its stdout.
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import transformers  # noqa: F401

import autoshard.launch.pipeline  # noqa: F401
import autoshard.launch.rank  # noqa: F401

torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 sets it for torchrun's ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(argv: list[str], env: dict[str, str], cwd: str, out: int, err: int) -> None:
    """The child: torchrun's environment, the run's folder and files, then the program."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:  # what the interpreter does with it at the top level
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - reported, as the interpreter would: the
        # traceback on stderr and exit code 1. Left to propagate, it would unwind into
        # the parent's request loop in this forked child.
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(request: dict) -> dict:
    """Fork a leader for the run and wait for its answer: the leader traces the launch's
    model once (:func:`_prime`), then forks the ranks (:func:`_run_ranks`), which inherit
    the trace; this process stays as it was for the next run."""
    read, write = os.pipe()
    deadline = time.monotonic() + float(request["timeout"])  # priming included, as torchrun's
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the leader
        global _REPLY_FD
        os.close(read)
        os.setpgid(0, 0)  # its ranks in its process group, which a stuck run loses whole
        _REPLY_FD = write
        try:
            reply = _lead(request, deadline, parent)
        except Exception:  # noqa: BLE001 - the leader's own failure, reported as the reply
            reply = {"rc": 1, "stdout": "", "stderr": traceback.format_exc(), "timed_out": False}
        with os.fdopen(write, "wb") as pipe:
            pipe.write(json.dumps(reply).encode())
        os._exit(0)
    os.close(write)
    chunks, deadline = [], deadline + LEADER_GRACE_S
    stuck = False
    while True:
        ready, _, _ = select.select([read], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:  # the leader itself is stuck (its ranks have their own deadline)
            _signal_group(pid, signal.SIGKILL)
            stuck = True
            break
        chunk = os.read(read, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    try:
        reply = json.loads(b"".join(chunks)) if chunks and not stuck else None
    except ValueError:  # a reply cut short
        reply = None
    if reply is None:
        return {
            "rc": 1,
            "stdout": "",
            "stderr": "rank_zygote: the run's leader gave no whole answer\n",
            "timed_out": stuck,
        }
    return reply


LEADER_GRACE_S = 30.0
"""Seconds past the run's deadline after which its leader is killed (its ranks' deadline
is the run's: the leader stops them then and answers)."""

_REPLY_FD: int | None = None
"""In a leader, its end of the reply pipe, which its ranks close at once: the zygote reads
the reply to the end of the pipe, which no rank or descendant of one may hold open."""


def _lead(request: dict, deadline: float, parent: int) -> dict:
    """The leader: the run's environment and folder, the shared trace, then the ranks."""
    # as rank 0 sees it, before its process group exists (no process joins that port);
    # each rank sets its own environment after the fork
    os.environ.clear()
    os.environ.update(request["env"], **_torchrun_env(0, int(request["nproc"]), _free_port()))
    os.chdir(request["cwd"])
    failed = _prime(request["argv"]) if request.get("prime", True) else None
    return {**_run_ranks(request, _free_port(), deadline, parent), "warm_up_error": failed}


def _torchrun_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """What torchrun --standalone sets for one of ``nproc`` local ranks."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def _prime(argv: list[str]) -> str | None:
    """Trace the model as each rank of ``autoshard.launch PLAN MODEL --mode plan`` would
    (:func:`autoshard.launch.observed.prepare_program`), and keep each trace for one use
    per process: the forked ranks take their copy instead of tracing again. On two cores
    an 8-rank launch traced eight times side by side (7.6 s of CPU each for a 2-layer
    Llama) and loaded the model's HuggingFace modules eight times.

    Anything else (a pipeline stage plan, DTensor propagation, arguments the rank command
    refuses, a plan or model that fails to load or trace) is left to the ranks, which
    do it themselves and report what goes wrong: this is a warm-up, not a check. It runs
    with rank 0's torchrun variables, before any process group, and its output goes
    nowhere, so that what a test reads is what the ranks printed (a warning the model
    code gives once per process, given here, is not given again by the ranks).

    Returns:
        None, or the error that stopped the warm-up (``"TypeError: ..."``), which the
        reply carries: :func:`helpers.ranks` warns when the ranks then succeeded, since
        a warm-up that fails where the ranks do not has stopped sharing the trace."""
    if argv[:2] != ["-m", "autoshard.launch"]:
        return None
    from autoshard.launch import observed
    from autoshard.launch.options import RunOptions
    from autoshard.launch.rank import rank_command
    from autoshard.model.model_file import load_model_file
    from autoshard.pipeline.stage_plan import is_stage_plan
    from autoshard.plan.formats import load_sharding_map

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    traced: dict[str, list] = {}
    real = observed.trace_for_launch
    signature = inspect.signature(real)

    def key(*args, **kwargs) -> str:
        # every argument as called, defaults filled in; the model file by its path
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return repr({k: str(v.path) if k == "mf" else v for k, v in bound.arguments.items()})

    def keeping(*args, **kwargs):
        graph = real(*args, **kwargs)
        traced.setdefault(key(*args, **kwargs), []).append(graph)
        return graph

    def serving(*args, **kwargs):
        held = traced.get(key(*args, **kwargs))
        if held:
            return held.pop()  # each process's copy once: a second call traces anew
        return real(*args, **kwargs)

    failed: str | None = None
    try:
        with rank_command.make_context("autoshard.launch", list(argv[2:])) as ctx:
            params = dict(ctx.params)
        plan, model = params.pop("plan"), params.pop("model")
        opts = RunOptions(**params)
        if opts.mode == "plan" and not is_stage_plan(plan):
            observed.trace_for_launch = keeping
            observed.prepare_program(load_sharding_map(plan), load_model_file(model), opts)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the ranks meet it again and
        # say it; the reply reports it (see Returns)
        traced.clear()
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
        observed.trace_for_launch = serving if traced else real
    return failed


def _run_ranks(request: dict, port: int, deadline: float, parent: int) -> dict:
    """Fork ``nproc`` ranks of ``argv`` and wait for them until ``deadline`` (see the
    module's docstring); a zygote gone (``parent`` no longer this process's parent: the
    test session ended or was stopped) stops them and this leader at once."""
    nproc = int(request["nproc"])
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pids = {}
        for rank in range(nproc):
            env = {**request["env"], **_torchrun_env(rank, nproc, port)}
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                if _REPLY_FD is not None:
                    os.close(_REPLY_FD)
                _rank(request["argv"], env, request["cwd"], out.fileno(), err.fileno())
            pids[pid] = rank
        codes: dict[int, int] = {}
        first_failed: int | None = None
        timed_out = False
        while len(codes) < nproc:
            if os.getppid() != parent:
                for other, r in pids.items():
                    if r not in codes:
                        _signal(other, signal.SIGKILL)
                os._exit(1)
            if time.monotonic() > deadline:
                timed_out = True
                break
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
                continue
            codes[pids[pid]] = os.waitstatus_to_exitcode(status)
            if codes[pids[pid]] != 0 and first_failed is None:
                first_failed = pids[pid]  # torchrun's agent stops the other workers
                for other, r in pids.items():
                    if r not in codes:
                        _signal(other, signal.SIGTERM)
        for pid, rank in pids.items():  # past the deadline: nothing is left running
            if rank not in codes:
                _signal(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        if first_failed is not None:
            err.seek(0, os.SEEK_END)
            line = f"\nrank {first_failed} failed first, exit code {codes[first_failed]}\n"
            err.write(line.encode())
        out.seek(0)
        err.seek(0)
        return {
            "rc": 1 if first_failed is not None or timed_out else 0,
            "stdout": out.read().decode(errors="replace"),
            "stderr": err.read().decode(errors="replace"),
            "timed_out": timed_out,
        }


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")  # the ranks' fd 1 is their own output file
    print("ready", file=protocol, flush=True)
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), file=protocol, flush=True)


if __name__ == "__main__":
    main()
