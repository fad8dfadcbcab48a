"""A warm parent for the test suite's multi-rank runs: it imports torch, DTensor,
pipelining, transformers and autoshard's launch once, then forks the ranks of each run.

Each rank of ``torchrun --standalone --nproc-per-node N -m autoshard.launch ...`` spends
7.5 s (idle 2-core machine, ``python -c "import autoshard.launch.rank"``) importing before
its first line of work, and the ranks of one launch share the machine's two cores, so
an 8-rank launch of a small model took half a minute before it ran a step. A forked rank
starts with those modules loaded. What differs from torchrun is only how the processes
start: each is a process of its own with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``),
joins gloo through ``env://`` as under torchrun, and runs the same module or script as
``__main__``; all write to one stdout and one stderr, as torchrun's children inherit
its own; when one fails the others are stopped (SIGTERM), as torchrun's agent does, and
the run's exit code is 1, as torchrun's. The suite keeps real torchrun for the launches
whose subject is the launcher itself (tests/test_launch.py's ``autoshard launch``
commands, the documented commands of tests/test_docs_commands.py).

Protocol (one JSON object per line): the test process writes ``{"nproc", "argv", "env",
"cwd", "timeout"}`` on this process's stdin (``argv`` is what follows torchrun's own
options: ``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``); this process answers ``{"rc",
"stdout", "stderr", "timed_out"}`` on its stdout.
"""

from __future__ import annotations

import json
import os
import runpy
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
    """Fork ``nproc`` ranks of ``argv`` and wait for them (see the module's docstring)."""
    nproc = int(request["nproc"])
    port = _free_port()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pids = {}
        for rank in range(nproc):
            env = dict(request["env"])
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                ROLE_RANK=str(rank),
                WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc),
                ROLE_WORLD_SIZE=str(nproc),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                _rank(request["argv"], env, request["cwd"], out.fileno(), err.fileno())
            pids[pid] = rank
        deadline = time.monotonic() + float(request["timeout"])
        codes: dict[int, int] = {}
        first_failed: int | None = None
        timed_out = False
        while len(codes) < nproc:
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


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w")  # the ranks' fd 1 is their own output file
    print("ready", file=protocol, flush=True)
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), file=protocol, flush=True)


if __name__ == "__main__":
    main()
