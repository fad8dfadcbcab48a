"""The options a calibration's command and its ranks share (sizes, iterations, names)."""

from __future__ import annotations

import click

from autoshard.cost.mesh import MeshSpec
from autoshard.units import BytesType, DurationType

SIZE_OPTIONS = [
    click.option(
        "--min-size",
        "min_bytes",
        type=BytesType(),
        default=16 * 2**10,
        show_default="16KiB",
        help="Smallest tensor timed per collective (in full, before the split).",
    ),
    click.option(
        "--max-size",
        "max_bytes",
        type=BytesType(),
        default=4 * 2**20,
        show_default="4MiB",
        help="Largest tensor timed per collective; on GPUs use 256MiB or more, so that "
        "bandwidth, not latency, sets the largest times.",
    ),
    click.option(
        "--iters",
        type=click.IntRange(1, 1000),
        default=5,
        show_default=True,
        help="Timed runs per size (the median counts; the slowest rank's).",
    ),
    click.option(
        "--sustain",
        type=DurationType(),
        default=0.0,
        show_default="0s",
        help="Time each matmul and attention sample over this long of back-to-back calls, "
        "after as long a warm-up, so the GPU reaches its power limit and its clock settles, "
        "as in a training step (e.g. 2s: the sustained rate, mamf-finder's MSMF). 0 times "
        "samples of about 2 ms: the boost-clock burst, faster than a step sustains. With "
        "2s, use --iters 3 (some 6 minutes on a GPU, counted from its windows).",
    ),
]


def with_options(options):
    def wrap(f):
        for opt in reversed(options):
            f = opt(f)
        return f

    return wrap


def mesh_dim_names_of(mesh_text: str, text: str | None) -> tuple[str, ...]:
    """The mesh dims' names (validated as ``solve`` validates them)."""
    return MeshSpec.from_options(mesh_text, text.split(",") if text else None).dim_names
