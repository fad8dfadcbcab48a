"""Write a one-GPU profile whose causal attention runs at FlashAttention-2's published
H100 rates, everything else kept from a measured profile.

    python scripts/fa2_profile.py tests/data/h100b/profile.json --out h100_fa2.json
    autoshard compare tests/data/published/gpt.py --mesh 8 --plans fsdp \\
        --precision bf16-mixed --profile h100_fa2.json --json

The second H100 lent to this project (``tests/data/h100b``, PyTorch 2.11) ran causal
``scaled_dot_product_attention`` at 557 TFLOP/s forward at 8k tokens (on the causal
count), the rate of cuDNN's and FlashAttention-3's kernels; FlashAttention-2 reaches 333
there (Shah et al., "FlashAttention-3", arXiv 2407.08608, its H100 forward figure, causal,
head dim 128). Published H100 runs of 2023 and 2024 ran FlashAttention-2 or older kernels
(docs/validation.md, "The attention kernel the H100 runs ran"); this profile prices their
attention as they ran it.

The rates are FlashAttention-2's forward plus backward on an H100 80GB SXM5, causal, head
dim 128 (``Dao-AILab/flash-attention`` ``assets/flash2_h100_fwd_bwd_benchmark.png`` at
``4f285b35``, panel d): 163, 221, 265, 294, 308 and 328 TFLOP/s at 512 to 16k tokens, 16k
tokens a batch, 16 heads. The figure counts a causal forward as ``4 b s^2 h d / 2`` and its
backward as 2.5 times the forward (``benchmarks/benchmark_flash_attention.py``). PyTorch's
count, which a profile's attention rates use, counts the whole score matrix: twice the
figure's rate. The figure times the forward and the backward together, so both keep that
one rate (as ``autoshard/cost/measured/a100.json`` does with the A100 panel of the same
release). float16 takes bfloat16's points (one tensor-core peak).

Reads and writes JSON only; imports nothing from autoshard.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# tokens per sequence -> TFLOP/s on the figure's causal count (panel d, typed from it)
FA2_H100_CAUSAL_D128 = {512: 163, 1024: 221, 2048: 265, 4096: 294, 8192: 308, 16384: 328}
TOKENS_PER_BATCH, HEADS, HEAD_DIM = 16384, 16, 128  # the figure's benchmark setting
FORWARD_BACKWARD_OVER_FORWARD = 3.5  # PyTorch's count: the backward twice and a half the forward


def fa2_points(dtype: str) -> list[dict]:
    """The figure's points as a profile's ``compute.attention`` entries of ``dtype``."""
    points = []
    for seq, tflops in FA2_H100_CAUSAL_D128.items():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path, help="a one-GPU profile (calibrate --mesh 1)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the new one")
    args = parser.parse_args()
    profile = json.loads(args.profile.read_text())
    if profile.get("world_size") != 1:
        parser.error(f"{args.profile} is not a one-GPU profile (calibrate --mesh 1)")
    kept = [  # every point but the causal bf16/fp16 ones, which the figure replaces
        a
        for a in profile["compute"]["attention"]
        if a["dtype"] not in ("bfloat16", "float16") or not a.get("causal")
    ]
    profile["compute"]["attention"] = kept + fa2_points("bfloat16") + fa2_points("float16")
    profile["source_attention"] = (
        "FlashAttention-2, H100 80GB SXM5, causal, head dim 128, forward + backward: "
        "Dao-AILab/flash-attention assets/flash2_h100_fwd_bwd_benchmark.png @4f285b35, panel d"
    )
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    tmp.replace(args.out)  # atomic: --out is the whole new profile or left as it was
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
