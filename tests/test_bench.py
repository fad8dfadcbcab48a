"""The bench's floor per case (``autoshard.bench.import_floor_s``): the seconds a fresh
process takes to load the case's model file, which the bench prints beside the case's wall
time and its target."""

from __future__ import annotations

import click
import pytest
from helpers import ROOT

from autoshard.bench import import_floor_s


@pytest.mark.slow  # two fresh interpreters
def test_the_floor_loads_the_model_file_and_fails_loudly_on_one_that_does_not_load(tmp_path):
    # the file is really loaded: its own import runs in the floor's process
    marker = tmp_path / "loaded"
    model = tmp_path / "model.py"
    model.write_text(
        (ROOT / "examples" / "mlp.py").read_text()
        + f"\nimport pathlib\npathlib.Path({str(marker)!r}).write_text('yes')\n"
    )
    import_floor_s(str(model), {})
    assert marker.read_text() == "yes"
    broken = tmp_path / "broken.py"
    broken.write_text("import os\n\nraise RuntimeError('no such model')\n")
    with pytest.raises(
        click.ClickException,
        match=r"broken\.py failed: .*broken\.py:3: RuntimeError: no such model",
    ):
        import_floor_s(str(broken), {})
