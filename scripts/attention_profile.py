"""Write a one-GPU profile whose causal attention runs at a FlashAttention kernel's
published rates, everything else kept from a measured profile (or a measured preset).

    python scripts/attention_profile.py tests/data/h100b/profile.json --out h100_fa2.json
    python scripts/attention_profile.py tests/data/h100b/profile.json --kernel fa1 \\
        --out h100_fa1.json
    python scripts/attention_profile.py --device a100-measured --gpu a100 --kernel fa1 \\
        --out a100_fa1.json
    autoshard compare tests/data/published/gpt.py --mesh 8 --plans fsdp \\
        --precision bf16-mixed --profile h100_fa2.json --json

The second H100 lent to this project (``tests/data/h100b``, PyTorch 2.11) ran causal
``scaled_dot_product_attention`` at 557 TFLOP/s forward at 8k tokens (on the causal
count), the rate of cuDNN's and FlashAttention-3's kernels; FlashAttention-2 reaches 333
there (Shah et al., "FlashAttention-3", arXiv 2407.08608, its H100 forward figure, causal,
head dim 128). Published runs of 2023 and 2024 ran FlashAttention-2 or older kernels
(docs/validation.md, "The attention kernel the H100 runs ran"); such a profile prices
their attention as they ran it.

The rates are forward plus backward, causal, head dim 128, from FlashAttention-2's
release figures (``Dao-AILab/flash-attention`` ``assets/flash2_h100_fwd_bwd_benchmark.png``
and ``assets/flash2_a100_fwd_bwd_benchmark.png`` at ``4f285b35``, panel d, typed from
them), at 512 to 16k tokens, 16k tokens a batch, 16 heads:

* ``fa2``: FlashAttention-2 (H100 SXM5: 163, 221, 265, 294, 308, 328 TFLOP/s; A100 SXM4
  80GB: 99, 133, 155, 173, 182, 189);
* ``fa1``: FlashAttention, the first CUDA kernel, the figures' "FlashAttention" series
  (H100: 98, 109, 108, 126, 135, 137; A100: 55, 62, 69, 76, 80, 83). It also stands for
  llm-foundry's Triton kernel (``llmfoundry/models/layers/flash_attn_triton.py``, a copy
  of ``flash_attn/flash_attn_triton.py`` at ``eff9fe6``), whose author writes in its
  docstring: "Overall Triton forward + backward is slightly slower than CUDA forward +
  backward" (the CUDA kernel of then: FlashAttention); no figure times that kernel. Its
  author tested it on the A100 only ("This implementation has only been tested on
  A100"): there its rate is at most this one; on the H100 that is assumed.

The figures count a causal forward as ``4 b s^2 h d / 2`` and its backward as 2.5 times the
forward (``benchmarks/benchmark_flash_attention.py``). PyTorch's count, which a profile's
attention rates use, counts the whole score matrix: twice the figure's rate. The figures
time the forward and the backward together, so both keep that one rate (as
``autoshard/cost/measured/a100.json`` does with the A100 panel's FlashAttention-2).
float16 takes bfloat16's points (one tensor-core peak).

``--device NAME-measured`` starts from a measured preset's file
(``autoshard/cost/measured/NAME.json``) in place of a profile: its matmul, attention and
copy rates, the preset's datasheet peaks and memory.

Writes the new profile atomically.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout: autoshard's presets

from autoshard.calibrate import PROFILE_FORMAT  # noqa: E402
from autoshard.cost.devices import DEVICES, MEASURED_DIR  # noqa: E402

# (GPU, kernel) -> tokens per sequence -> TFLOP/s on the figure's causal count (panel d)
FIGURES = {
    ("h100", "fa2"): {512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328},
    ("h100", "fa1"): {512: 98, 1024: 109, 2048: 108, 4096: 126, 8192: 135, 16384: 137},
    ("a100", "fa2"): {512: 99, 1024: 133, 2048: 155, 4096: 173, 8192: 182, 16384: 189},
    ("a100", "fa1"): {512: 55, 1024: 62, 2048: 69, 4096: 76, 8192: 80, 16384: 83},
}
SOURCES = {
    "h100": "H100 80GB SXM5: Dao-AILab/flash-attention assets/flash2_h100_fwd_bwd_benchmark.png",
    "a100": "A100 80GB SXM4: Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png",
}
KERNELS = {"fa2": "FlashAttention-2", "fa1": "FlashAttention (the first CUDA kernel)"}
TOKENS_PER_BATCH, HEADS, HEAD_DIM = 16384, 16, 128  # the figures' benchmark setting
FORWARD_BACKWARD_OVER_FORWARD = 3.5  # PyTorch's count: the backward twice and a half the forward


def figure_points(dtype: str, gpu: str = "h100", kernel: str = "fa2") -> list[dict]:
    """The figure's points as a profile's ``compute.attention`` entries of ``dtype``."""
    points = []
    for seq, tflops in FIGURES[gpu, kernel].items():
        batch = TOKENS_PER_BATCH // seq
        flops = 4 * batch * HEADS * seq * seq * HEAD_DIM  # PyTorch's count: the whole matrix
        rate = 2 * tflops * 1e12
        points.append(
            {
                "dtype": dtype,
                "batch": batch,
                "heads": HEADS,
                "seq": seq,
                "head_dim": HEAD_DIM,
                "causal": True,
                "seconds_forward": flops / rate,
                "seconds_forward_backward": FORWARD_BACKWARD_OVER_FORWARD * flops / rate,
                "flops_forward": flops,
                "flops_forward_backward": FORWARD_BACKWARD_OVER_FORWARD * flops,
                "flops_per_s_forward": rate,
                "flops_per_s_forward_backward": rate,
            }
        )
    return points


def one_gpu_profile(device: str, compute: dict, **extra) -> dict:
    """A profile of one GPU (format :data:`PROFILE_FORMAT`, a mesh of one, no link timed)
    holding ``compute`` (its ``peak_flops``, ``matmuls``, ``attention``,
    ``memory_bandwidth_Bps`` and ``memory_bytes``), ``extra`` fields beside."""
    link = {"dim": 0, "name": "d0", "size": 1, "samples": [], "latency_s": None}
    return {
        "format": PROFILE_FORMAT,
        "device": device,
        "backend": "nccl",
        "world_size": 1,
        "mesh": {"shape": [1], "dim_names": ["d0"]},
        "links": [link | {"bandwidth_Bps": None, "residual": None}],
        "compute": compute,
        **extra,
    }


def source_arguments(parser: argparse.ArgumentParser, device_help: str) -> None:
    """A profile script's arguments: what it starts from (a one-GPU profile, or
    ``--device``, which ``device_help`` describes) and ``--out``."""
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "profile", nargs="?", type=Path, help="a one-GPU profile (calibrate --mesh 1)"
    )
    what.add_argument("--device", help=device_help)
    parser.add_argument("--out", type=Path, required=True, help="where to write the new one")


def read_one_gpu(parser: argparse.ArgumentParser, path: Path) -> dict:
    """The profile at ``path``; a usage error unless it is of one GPU."""
    profile = json.loads(path.read_text())
    if profile.get("world_size") != 1:
        parser.error(f"{path} is not a one-GPU profile (calibrate --mesh 1)")
    return profile


def write_profile(profile: dict, out: Path) -> None:
    """Write ``profile`` to ``out`` atomically: ``out`` is the whole new profile or is left
    as it was."""
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(out)
    print(f"wrote {out}")


def preset_profile(name: str) -> dict:
    """A one-GPU profile holding measured preset ``name``'s rates (``a100-measured``): its
    file's matmuls, attention and copy bandwidth, the datasheet's peaks and memory."""
    base = name.removesuffix("-measured")
    d = json.loads((MEASURED_DIR / f"{base}.json").read_text())
    spec = DEVICES[base]
    compute = {
        "peak_flops": dict(spec.peak_flops),
        "matmuls": d["matmuls"],
        "attention": d["attention"],
        "memory_bandwidth_Bps": d["memory_bandwidth_Bps"],
        "memory_bytes": spec.memory_bytes,
    }
    device = f"{name}: {d.get('measured_on', '')}"
    return one_gpu_profile(device, compute, torch=d.get("torch"), source=d.get("source"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source_arguments(parser, "a measured preset to start from, e.g. a100-measured")
    parser.add_argument(
        "--gpu",
        choices=sorted(SOURCES),
        help="whose figure (default: --device's GPU, else h100)",
    )
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="fa2", help="which series")
    args = parser.parse_args()
    if args.device:
        if not args.device.endswith("-measured") or args.device not in DEVICES:
            parser.error(f"--device {args.device}: name a measured preset, e.g. a100-measured")
        gpu = args.device.removesuffix("-measured")
        if args.gpu not in (None, gpu):
            parser.error(f"--gpu {args.gpu} with --device {args.device}: one GPU's figure")
        args.gpu = gpu
        profile = preset_profile(args.device)
    else:
        profile = read_one_gpu(parser, args.profile)
        args.gpu = args.gpu or "h100"
    kept = [  # every point but the causal bf16/fp16 ones, which the figure replaces
        a
        for a in profile["compute"]["attention"]
        if a["dtype"] not in ("bfloat16", "float16") or not a.get("causal")
    ]
    figure = [figure_points(t, args.gpu, args.kernel) for t in ("bfloat16", "float16")]
    profile["compute"]["attention"] = kept + figure[0] + figure[1]
    profile["source_attention"] = (
        f"{KERNELS[args.kernel]}, {SOURCES[args.gpu]} @4f285b35, panel d "
        "(causal, head dim 128, forward + backward)"
    )
    write_profile(profile, args.out)


if __name__ == "__main__":
    main()
