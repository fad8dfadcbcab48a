"""Test tiers: ``make test-fast`` runs ``-m "not slow"``; every test that starts torchrun
(or ``python -m torch.distributed.run``) must be marked ``slow``, and so must every test
that runs ranks with ``helpers.ranks``.

A test left unmarked that starts one fails at once with a message naming the marker, so
the fast tier never grows a multi-process launch by accident.
"""

from __future__ import annotations

import subprocess

import pytest

_LAUNCHERS = ("torchrun", "torch.distributed.run")  # autoshard.launch.torchrun holds the first
_RANK_COMMANDS = ("launch", "calibrate")  # autoshard's commands that start torchrun


def _starts_ranks(args: object) -> bool:
    words = [str(args)] if isinstance(args, (str, bytes)) else [str(w) for w in args or []]
    if any(name in w for w in words for name in _LAUNCHERS):
        return True
    autoshard = any(w.endswith("autoshard") or w.startswith("autoshard.") for w in words)
    return autoshard and any(w in _RANK_COMMANDS for w in words)


@pytest.fixture(autouse=True)
def _torchrun_only_in_slow_tests(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        return
    import helpers

    monkeypatch.setattr(helpers, "RANKS_ALLOWED", False)  # helpers.ranks: forked ranks
    real = subprocess.Popen._execute_child  # the class itself stays as it is

    def guarded(self, args, *a, **kw):
        if _starts_ranks(args):
            raise AssertionError(
                f"{request.node.nodeid} starts torchrun: mark it @pytest.mark.slow "
                "(make test-fast leaves multi-process launches out)"
            )
        return real(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)


def pytest_collection_modifyitems(config, items):
    """Longest first: the documented commands (the README's alone take 10-20 minutes), then
    the other ``slow`` tests, then the rest, each group in file order. pytest-xdist's
    worksteal hands each worker a contiguous share and lets an idle one take from the end
    of another's: the long tests start at once, the many short ones fill in around them,
    and a run never ends with one worker finishing a long test alone."""

    def rank(item) -> int:
        if item.get_closest_marker("slow") is None:
            return 2
        return 0 if item.nodeid.startswith("tests/test_docs_commands.py") else 1

    items.sort(key=rank)


# --- one trace per model, options and environment in each test process --------------
#
# Half of the fast tier's time was torch.export tracing small models again (320 of its
# 655 CPU seconds, measured by wrapping trace in a plugin), often one model text that
# each test writes to its own tmp_path. A trace depends only on what
# :func:`autoshard.solver.solve.trace` reads: the model file's name and text and those of
# the files beside it (helpers it imports, configs it reads), the environment (a model
# file may read any variable), ``sys.path`` and the config's mode, tie, cast and view
# merging. Those are the key; each caller gets its own deep copy (0.06 s for GPT-2), so
# a test that edits its graph leaves the next one's alone. A test that monkeypatches
# anything but the environment traces afresh (a patch may change what the tracer does),
# and so does a fixture, whose patches this cannot see.

_TRACES: dict = {}
_CURRENT: dict = {}
# what the autouse fixture above patches in every fast test: nothing the tracer reads
_HARMLESS_PATCHES = ("helpers", "subprocess")


def _patched_beyond_environment() -> bool:
    """Whether the running test may have patched what the tracer reads: outside a test's
    call (a fixture's setup, which may patch by other means) it is assumed so."""
    item = _CURRENT.get("item")
    if item is None:
        return True
    mp = item.funcargs.get("monkeypatch")
    if mp is None:
        return False
    import os

    # pytest's MonkeyPatch keeps its undo lists in these attributes; without them the
    # cache cannot tell what a test patched, so it is not used
    if not (hasattr(mp, "_setattr") and hasattr(mp, "_setitem")):
        return True
    for obj, _name, _old in mp._setattr:
        owner = getattr(obj, "__module__", None) or getattr(obj, "__name__", "")
        if str(owner).split(".")[0] not in _HARMLESS_PATCHES:
            return True
    return any(d is not os.environ for d, _k, _v in mp._setitem)


def _trace_key(config, microbatches: int):
    import hashlib
    import os
    import sys
    from pathlib import Path

    if config.model is not None:  # a module built in Python: no file to key on
        return None
    path = Path(config.model_path).resolve()
    if not path.is_file():
        return None
    # every file beside it, not only its .py helpers: a model may read a config it holds
    beside = sorted(p for p in path.parent.iterdir() if p.is_file())
    files = tuple((p.name, hashlib.sha1(p.read_bytes()).hexdigest()) for p in beside)
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"))
    cast = str(config.cast)
    return (
        path.name,  # not its folder: many tests write one model text to their own tmp_path
        files,
        env,
        tuple(sys.path),
        config.mode,
        config.tie,
        cast,
        config.share_reshardings,
        microbatches,
    )


def _memoized_trace(trace):
    import copy
    import functools

    @functools.wraps(trace)
    def cached(config, progress=None, microbatches: int = 1, stage_bounds=None):
        # a pipeline's per-stage reduction depends on its bounds function: traced afresh
        if stage_bounds is not None or _patched_beyond_environment():
            return trace(config, progress, microbatches, stage_bounds)
        key = _trace_key(config, microbatches)
        if key is None:
            return trace(config, progress, microbatches)
        graph = _TRACES.get(key)
        if graph is None:
            graph = _TRACES[key] = trace(config, None, microbatches)
        if progress:
            progress("trace", 0, 1)
            progress("trace", 1, 1)
        return copy.deepcopy(graph)

    return cached


def pytest_configure(config):
    """In each process that runs tests (not xdist's controller), ``trace`` remembers."""
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        return
    from autoshard.solver import solve

    solve.trace = _memoized_trace(solve.trace)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    _CURRENT["item"] = item
    try:
        return (yield)
    finally:
        _CURRENT.pop("item", None)
