"""``python -m autoshard.cli``: the ``autoshard`` command."""

from autoshard.cli.main import entry

entry()
