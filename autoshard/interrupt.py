"""Ctrl-C that is never lost.

Python raises :class:`KeyboardInterrupt` wherever the main thread happens to be; when that is
a finaliser or a weakref callback (torch has both), the exception is printed as "ignored"
and the program runs on. :func:`install` makes SIGINT also record itself (and keeps such a
swallowed interruption off the screen: it is not an error), and :func:`check` raises again
where it matters: at every progress step and HiGHS poll, so the work stops within seconds,
and before any file is written, so an interrupted solve never writes a solution
(``autoshard`` exits 130).
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["check", "install", "requested"]

_requested = False


def _on_sigint(signum: int, frame: object) -> None:
    global _requested
    _requested = True
    raise KeyboardInterrupt


def install() -> None:
    """Route SIGINT through :func:`requested`'s record (main thread only; elsewhere a no-op,
    since Python lets only the main thread set signal handlers)."""
    global _requested
    _requested = False
    main = threading.current_thread() is threading.main_thread()
    # an ignored SIGINT (a background job of a non-interactive shell) stays ignored
    if main and signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _on_sigint):
        signal.signal(signal.SIGINT, _on_sigint)
        if sys.unraisablehook is not _quiet_unraisable:
            global _unraisable
            _unraisable = sys.unraisablehook
            sys.unraisablehook = _quiet_unraisable


_unraisable = sys.unraisablehook


def _quiet_unraisable(unraisable) -> None:  # noqa: ANN001 - sys.UnraisableHookArgs
    """Python's report of an exception it could not raise (in a finaliser), except our own
    Ctrl-C: that one is recorded, and :func:`check` raises it again at the next step."""
    if _requested and unraisable.exc_type is KeyboardInterrupt:
        return
    _unraisable(unraisable)


def requested() -> bool:
    """Whether Ctrl-C was pressed since :func:`install`."""
    return _requested


def check() -> None:
    """Raise :class:`KeyboardInterrupt` if Ctrl-C was pressed, even if a library swallowed
    the first one."""
    if _requested:
        raise KeyboardInterrupt
