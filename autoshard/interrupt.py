"""Ctrl-C that is never lost.

Python raises :class:`KeyboardInterrupt` wherever the main thread happens to be; when that is
a finaliser or a weakref callback (torch has both), the exception is printed as "ignored"
and the program runs on. Inside :func:`installed`, SIGINT also records itself (and such a
swallowed interruption is kept off the screen: it is not an error), and :func:`check`
raises again where it matters: at every progress step and HiGHS poll, so the work stops
within seconds, and before any file is written, so an interrupted solve never writes a
solution (``autoshard`` exits 130).

Work started on another thread (the mesh search's ILPs) stops the same way when the
thread that started it fails (:func:`stoppable`): :func:`check` raises :class:`Stopped`
there once the starter has set its event.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import signal
import sys
import threading
from collections.abc import Callable, Iterator

__all__ = ["Stopped", "check", "installed", "requested", "stoppable"]

_requested = False
_stop: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "autoshard_stop", default=None
)


class Stopped(Exception):  # noqa: N818 - what happened, as KeyboardInterrupt says it
    """The work was stopped by the thread that started it (:func:`stoppable`), which has
    failed and raises its own error: nothing to report."""


def _on_sigint(signum: int, frame: object) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


def _quiet_unraisable(hook: Callable, unraisable) -> None:  # noqa: ANN001 - UnraisableHookArgs
    """``hook``, Python's report of an exception it could not raise (in a finaliser),
    except a recorded Ctrl-C: :func:`check` raises that one again at the next step."""
    if _requested and unraisable.exc_type is KeyboardInterrupt:
        return
    hook(unraisable)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Within the block, SIGINT is recorded for :func:`requested` and :func:`check` and a
    Ctrl-C swallowed by a finaliser is not printed; after it, SIGINT's handler and
    ``sys.unraisablehook`` are what they were and nothing stays recorded (a caller that goes
    on, as a test's ``CliRunner`` does, is never stopped by a Ctrl-C already handled).

    Main thread only (elsewhere the block runs as it is: Python lets only the main thread
    set signal handlers); an ignored SIGINT (a background job of a non-interactive shell)
    stays ignored.
    """
    global _requested
    _requested = False
    previous = signal.getsignal(signal.SIGINT)
    main = threading.current_thread() is threading.main_thread()
    routed = main and previous in (signal.default_int_handler, _on_sigint)
    hook = sys.unraisablehook
    quiet = functools.partial(_quiet_unraisable, hook)  # wraps the hook of this moment
    if routed:
        signal.signal(signal.SIGINT, _on_sigint)
        sys.unraisablehook = quiet
    try:
        yield
    finally:
        _requested = False
        if routed:
            signal.signal(signal.SIGINT, previous)
            if sys.unraisablehook is quiet:  # another library's own hook since then stays
                sys.unraisablehook = hook


def requested() -> bool:
    """Whether Ctrl-C was pressed inside the current :func:`installed` block."""
    return _requested


@contextlib.contextmanager
def stoppable(event: threading.Event) -> Iterator[None]:
    """Within the block, work that runs in a copy of this context
    (``contextvars.copy_context().run``, on another thread) stops at its next
    :func:`check` once ``event`` is set: the starter sets it when it fails, so that its
    worker does not run on unseen."""
    token = _stop.set(event)
    try:
        yield
    finally:
        _stop.reset(token)


def check() -> None:
    """Raise :class:`KeyboardInterrupt` if Ctrl-C was pressed, even if a library swallowed
    the first one; :class:`Stopped` if the thread that started this work has failed
    (:func:`stoppable`)."""
    if _requested:
        raise KeyboardInterrupt
    stop = _stop.get()
    if stop is not None and stop.is_set():
        raise Stopped("stopped: the work that started this one failed")
