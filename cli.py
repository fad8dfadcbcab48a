"""Run the autoshard CLI from a checkout: ``python cli.py solve examples/mlp.py --mesh 2x2``.

Run by an interpreter that lacks autoshard's dependencies (a system ``python`` outside
``.venv``), it says so in one line, with the interpreter to use, and exits 2.
"""

import os
import sys
from pathlib import Path


def _missing_dependency() -> str | None:
    """The first of autoshard's dependencies this interpreter cannot import, else None."""
    import importlib.util

    for name in ("click", "rich", "torch", "highspy", "dill", "numpy", "scipy", "transformers"):
        if importlib.util.find_spec(name) is None:
            return name
    return None


if __name__ == "__main__":
    missing = _missing_dependency()
    if missing is not None:
        here = Path(__file__).resolve().parent
        venv = here / ".venv" / "bin" / "python"
        if venv.exists():
            use = f"use `{os.path.relpath(venv)} {os.path.relpath(__file__)} ...`"
        else:
            use = f"run `make install` in {here}, then `.venv/bin/python cli.py ...`"
        print(
            f"error: {sys.executable} has no module {missing!r} (autoshard's dependencies are "
            f"not installed for it): {use}",
            file=sys.stderr,
        )
        sys.exit(2)
    from autoshard.cli.main import entry

    entry()
