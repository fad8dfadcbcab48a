"""Atomic file writes: a temporary file in the target's folder, fsync, then
:func:`os.replace`, so a crash or a failing serialiser never leaves a half-written file and
the previous file stays as it was (every file autoshard writes goes through here)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from autoshard.errors import AutoshardError

# ------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], object]) -> None:
    """Create or replace ``path`` with what ``write(f)`` writes to a binary file ``f``, atomically.

    ``write`` streams into a temporary file in the same directory; the file is flushed,
    fsynced and renamed over ``path`` with :func:`os.replace`. Missing parent directories are
    created. A new file gets the usual permissions (0666 minus the umask); a replaced file
    keeps its own.

    Raises:
        AutoshardError: when the directory or file cannot be written (the message names the
            path and the OS error).
        Exception: whatever ``write`` raises, unchanged.

    In every failure ``path`` is left exactly as it was and the temporary file is removed.
    """
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as e:
        blocker = next((p for p in target.parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise AutoshardError(
                f"cannot write {target}: {blocker} is a file, not a folder; pick another path"
            ) from e
        raise AutoshardError(
            f"cannot write {target}: {e.strerror or e}; check the directory exists and is writable"
        ) from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.chmod(tmp_name, _mode_for(target))
        os.replace(tmp_name, target)
    except BaseException as e:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise AutoshardError(f"cannot write {target}: {e.strerror or e}") from e
        raise
    _fsync_dir(target.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Create or replace ``path`` with ``data``, atomically; see :func:`atomic_write`.

    Raises:
        AutoshardError: when the file cannot be written; ``path`` is then unchanged.
    """
    atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Create or replace ``path`` with ``text`` encoded as UTF-8, atomically.

    Raises:
        AutoshardError: when the file cannot be written; ``path`` is then unchanged.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


def _mode_for(target: Path) -> int:
    """Permission bits for the new file: the old file's, else 0666 minus the umask."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (POSIX); silently skipped where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
