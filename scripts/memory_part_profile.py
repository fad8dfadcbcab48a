"""Write a one-GPU profile of a GPU built with another memory part than the one measured:
every rate of the measured profile kept, its memory bandwidths scaled by the ratio of the
two parts' peak bandwidths, its memory capacity the other part's.

    python scripts/memory_part_profile.py tests/data/h100b/profile_fa2.json \\
        --measured-peak 3.35TB/s --peak 2.4TB/s --memory 96GB \\
        --out tests/data/h100b/profile_fa2_hbm2e.json
    python scripts/memory_part_profile.py --device h100 --peak 2.4TB/s --memory 96GB \\
        --out tests/data/h100b/datasheet_hbm2e.json

torchtitan's H100 runs of 2024-12 (``docs/performance.md`` at ``d4c86e3``, Tables 1 and 3)
ran on Grand Teton hosts whose "H100 GPU is equipped with 96GB HBM2e with 2.4 TB/sec peak
memory bandwidth", at "the default 500W power limit". The H100 SXM measured for this
project (``tests/data/h100b``: NVIDIA H100 80GB HBM3, 700 W) has 3.35 TB/s of peak
bandwidth (NVIDIA's H100 datasheet) and copied at 2.94 TB/s. A memory-bound kernel is
assumed to reach the same share of either part's peak, so each bandwidth of the profile
is scaled by ``peak / measured_peak``.

The matmul and attention rates are kept: the source says the lower power limit puts the
part's peak FLOP/s "between SXM and NVL" and that "we don't know its exact value"
(its footnote 2). Kept at the 700 W part's, they err fast.

With ``--device`` in place of a profile, the profile holds that preset's datasheet
(autoshard's ``DEVICES``: its dense peaks, no measured rates) with the other part's
bandwidth and capacity: the datasheet column of such a run.

Writes the new profile atomically; reads and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: autoshard's presets and units
sys.path.insert(0, str(ROOT / "scripts"))

from attention_profile import (  # noqa: E402
    one_gpu_profile,
    read_one_gpu,
    source_arguments,
    write_profile,
)

from autoshard.cost.devices import get_device  # noqa: E402
from autoshard.units import parse_bandwidth, parse_bytes  # noqa: E402

BANDWIDTHS = ("memory_bandwidth_Bps", "elementwise_bandwidth_Bps")
"""A profile's memory-bound rates (``compute``): the copy and the elementwise kernels."""


def datasheet_profile(name: str) -> dict:
    """A one-GPU profile holding preset ``name``'s datasheet: its peaks, its bandwidth and
    capacity, no timed matmul or attention (so every op is priced at the peaks)."""
    spec = get_device(name)
    compute = {
        "peak_flops": dict(spec.peak_flops),
        "matmuls": [],
        "attention": [],
        "memory_bandwidth_Bps": spec.memory_bandwidth,
        "memory_bytes": spec.memory_bytes,
    }
    return one_gpu_profile(f"{spec.name} datasheet", compute, torch=None)


def on_part(profile: dict, measured_peak: float, peak: float, memory: int, source: str) -> dict:
    """``profile`` with its memory bandwidths times ``peak / measured_peak`` (bytes/s
    both) and ``memory`` bytes of capacity; ``source`` is recorded as ``source_memory``."""
    out = json.loads(json.dumps(profile))
    compute = out["compute"]
    for key in BANDWIDTHS:
        if key in compute:
            compute[key] *= peak / measured_peak
    compute["memory_bytes"] = memory
    out["source_memory"] = source
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source_arguments(parser, "a preset whose datasheet to start from, e.g. h100")
    parser.add_argument(
        "--measured-peak",
        type=parse_bandwidth,
        help="the measured GPU's peak memory bandwidth (with a profile), e.g. 3.35TB/s",
    )
    parser.add_argument("--peak", type=parse_bandwidth, required=True, help="the other part's")
    parser.add_argument("--memory", type=parse_bytes, required=True, help="its capacity, e.g. 96GB")
    parser.add_argument("--source", default="torchtitan docs/performance.md @d4c86e3")
    args = parser.parse_args()
    if args.device:
        if args.measured_peak is not None:
            parser.error("--measured-peak is the profile's GPU's; --device takes its datasheet's")
        profile = datasheet_profile(args.device)
        measured_peak = profile["compute"]["memory_bandwidth_Bps"]
    else:
        profile = read_one_gpu(parser, args.profile)
        if args.measured_peak is None:
            parser.error("--measured-peak: the measured GPU's datasheet bandwidth is needed")
        measured_peak = args.measured_peak
    source = f"{args.source}: {args.peak / 1e12:g} TB/s peak, {args.memory / 1e9:g} GB"
    out = on_part(profile, measured_peak, args.peak, args.memory, source)
    write_profile(out, args.out)


if __name__ == "__main__":
    main()
