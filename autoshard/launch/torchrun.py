"""The torchrun command line of a launch (``python -m autoshard.launch.torchrun``: torchrun,
``torch.distributed.run``, with a failed rank said in one line; :func:`main`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.launch.options import RunOptions

_RDZV_OPTIONS = {
    "--standalone",
    "--nnodes",
    "--rdzv-endpoint",
    "--rdzv-backend",
    "--rdzv-id",
    "--rdzv-conf",
    "--master-addr",
    "--master-port",
    "--node-rank",
}


def _option_name(arg: str) -> str:
    """``--nproc_per_node=8`` -> ``--nproc-per-node`` (torchrun takes both spellings)."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg


def _option_value(args: Sequence[str], name: str) -> str | None:
    """The value of torchrun option ``name`` in ``args`` (either spelling, ``=`` or not)."""
    for i, a in enumerate(args):
        if _option_name(a) == name:
            if "=" in a:
                return a.split("=", 1)[1]
            return args[i + 1] if i + 1 < len(args) else None
    return None


MMAP_THRESHOLD = 65536
"""Bytes from which glibc's ``malloc`` serves an allocation by ``mmap`` in a launched
rank (``MALLOC_MMAP_THRESHOLD_``, mallopt(3)). glibc's default threshold is dynamic: it
rises to the size of each freed mmapped block, up to 32 MiB, so most activation buffers
end up in the heap, which fragments and is not given back. Fixed at 64 KiB, a freed
buffer returns to the system at once: GPT-2 small (12 layers, batch 8 x 1024) training on
8 gloo ranks peaked at 2.74 GiB of RSS per rank with it and was killed for memory
(over 3 GiB per rank, 24 GiB in all) without it."""


def rank_environment(base: Mapping[str, str], root: Path, mmap: bool = True) -> dict[str, str]:
    """The environment of torchrun and its ranks: ``base`` with ``root`` (the folder
    holding this ``autoshard`` package) first on ``PYTHONPATH``, so ranks import the same
    autoshard; with ``mmap`` (launches, not ``calibrate``, whose timings it would slow:
    every block of 64 KiB or more is then mapped and unmapped, with its page faults),
    ``MALLOC_MMAP_THRESHOLD_`` = :data:`MMAP_THRESHOLD` unless ``base`` sets it (the
    user's value wins)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    if mmap:
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    return env


def torchrun_argv(
    plan: Path, model: Path, opts: RunOptions, torchrun_args: Sequence[str], n_devices: int
) -> list[str]:
    """The torchrun command line for a launch (:func:`torchrun_prefix` then the rank module).

    Raises:
        AutoshardError: the processes torchrun would start cannot match the mesh.
    """
    argv = torchrun_prefix(torchrun_args, n_devices)
    argv += ["-m", "autoshard.launch", str(plan.resolve()), str(model.resolve())]
    return argv + opts.to_argv()


def torchrun_prefix(torchrun_args: Sequence[str], n_devices: int) -> list[str]:
    """``python -m autoshard.launch.torchrun [OPTIONS]`` (torchrun: :func:`main`) starting
    ``n_devices`` processes.

    Defaults: ``--standalone`` (one node, a free local port) unless ``torchrun_args``
    names a rendezvous or node option; ``--nproc-per-node`` = ``n_devices`` divided by
    ``--nnodes`` (when that is a number) unless given. ``torchrun_args`` come after the
    defaults; the caller appends the program (``-m MODULE ...``).

    Raises:
        AutoshardError: the processes torchrun would start cannot match the mesh.
    """
    names = {_option_name(a) for a in torchrun_args}
    argv = [sys.executable, "-m", "autoshard.launch.torchrun"]
    nnodes_text = _option_value(torchrun_args, "--nnodes")
    nnodes = int(nnodes_text) if nnodes_text and nnodes_text.isdigit() else None
    if "--nproc-per-node" not in names:
        if nnodes is not None and n_devices % nnodes:
            raise AutoshardError(
                f"the mesh has {n_devices} devices, which --nnodes {nnodes} does not divide; "
                "pass --nproc-per-node too, or use another mesh"
            )
        argv += ["--nproc-per-node", str(n_devices // (nnodes or 1))]
    else:
        nproc_text = _option_value(torchrun_args, "--nproc-per-node")
        if nproc_text and nproc_text.isdigit() and int(nproc_text) * (nnodes or 1) != n_devices:
            started = int(nproc_text) * (nnodes or 1)
            raise AutoshardError(
                f"the mesh needs {n_devices} processes but --nproc-per-node "
                f"{nproc_text}{f' x --nnodes {nnodes}' if nnodes else ''} starts {started}"
            )
    if not names & _RDZV_OPTIONS:
        argv.append("--standalone")
    return argv + list(torchrun_args)


def main(argv: Sequence[str] | None = None) -> int:
    """torchrun: ``torch.distributed.run``'s own argument parser and launcher, but a rank
    that fails ends it with one line naming the rank and its exit code (the rank's own
    error is printed above it) instead of the agent's traceback of ``ChildFailedError``.
    Returns torchrun's exit code (1 when a rank failed)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(argv) if argv is not None else None))
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(
            f"torchrun: rank {rank} failed (exit code {failure.exitcode}); its error is above",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
