"""Test tiers: ``make test-fast`` runs ``-m "not slow"``; every test that starts torchrun
(or ``python -m torch.distributed.run``) must be marked ``slow``, and so must every test
that runs ranks with ``helpers.ranks``.

A test left unmarked that starts one fails at once with a message naming the marker, so
the fast tier never grows a multi-process launch by accident.
"""

from __future__ import annotations

import subprocess

import pytest

_LAUNCHERS = ("torchrun", "torch.distributed.run")
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
