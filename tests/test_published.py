"""Published training runs, each priced by autoshard with the run's own plan (issue 28,
item 6). docs/validation.md, "Published runs", shows the table these rows make.

Each :class:`Run` is one row of a public table: the source (repository, path and commit,
or the paper), the throughput it reports and the arithmetic that turns it into seconds per
step, the model (``tests/data/published``), the mesh and the hand plan that names the run's
parallelism (``fsdp``: FSDP / ZeRO-3 over every device; ``ddp``; ``megatron``: Megatron TP
on the last mesh dim, data parallel on the first; ``fsdp_tp``: torchtitan's FSDP + TP), the
activation checkpointing it ran, and the links where the source names them.

What is held:

- every row's step time is its source's throughput, worked here (tokens per step and GPU
  over tokens per second and GPU, or the paper's FLOPs over its FLOP/s);
- each row priced by ``autoshard compare --plans PLAN`` at the device's datasheet: the
  prediction is within 20% of the measured step for the rows listed in ``WITHIN``, and
  outside it for every other row, with the cause docs/validation.md names: a change that
  brings such a row within 20% fails here until it is moved to ``WITHIN``;
- every row priced again at the rates such a GPU achieved (:data:`ACHIEVED`): an H100 row
  at the rates one H100 lent to this project reached (``--device h100-measured``), an A100
  row at published A100 benchmarks' rates (``--device a100-measured``), each with its
  links at the bus bandwidth NCCL reaches on them; held the same way
  (``WITHIN_MEASURED``);
- where the source names a GPU or kernels other than the preset's, a one-GPU profile in
  place of ``--device`` (``Run.datasheet_profile``, ``Run.achieved_profile``: torchtitan's
  2.4 TB/s HBM2e H100s, FlashAttention-2 or the first FlashAttention's attention); an FSDP
  row priced with FSDP's one collective per block (``Run.bucket_bytes``, ``--bucket-size``);
- rows run with torchtitan's *selective* activation checkpointing are priced with it
  (``--activation-checkpointing selective``: op-level, keep attention and every other
  matmul);
- docs/validation.md shows every row as priced now.

The prices are computed in the test process from the command's own options (one trace per
row); one test holds the command's printed JSON equal to them.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field

import pytest
from helpers import ROOT, autoshard_cli, cli_config, environment

from autoshard.solver.compare import compare_plans
from autoshard.solver.solve import strategies, trace

TORCHTITAN_A100 = (
    "pytorch/torchtitan docs/performance.md @157a12c562288b3bccb077003a97f18a4ca657aa: "
    "64 A100 80GB, FSDP2 (torchtitan's default mixed precision: bf16 parameters, fp32 "
    "reduction)"
)
TORCHTITAN_H100 = (
    "pytorch/torchtitan docs/performance.md @d4c86e3758a84cf23e2e879ab3c995cba9d5e410, "
    "Table 1: Grand Teton H100 (96 GB HBM2e, 500 W), NVLink, 400 Gb/s RDMA per GPU"
)
TORCHTITAN_405B = (
    "pytorch/torchtitan docs/performance.md @3faaa1a0dee68ce028400e3dafd1735d152cb4f8: "
    "128 H100, FSDP 16 x TP 8, local batch 2, full AC"
)
MOSAICML = (
    "mosaicml/llm-foundry scripts/train/benchmarking/README.md "
    "@8c8dd48f72168c5d51e2f7b151595892a8fba43d: Composer FSDP (FULL_SHARD), FlashAttention"
)
MEGATRON = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "(SC'21), Table 1 (NVIDIA/Megatron-LM README, images/cases_april2021.png "
    "@50a4b5fa0280a160cc1b03a1c15faddbc1b1da9a): Selene, DGX A100 80GB, full recomputation; "
    "its rows are quoted in paraphrase (size, hidden, layers, tensor-parallel size, GPUs, "
    "batch, TFLOP/s per GPU, % of peak)"
)
# DGX A100 (the Megatron paper's Selene; assumed for torchtitan's A100 cluster, which its
# doc does not describe): NVLink 3, 600 GB/s per GPU both ways together; one 200 Gb/s HDR
# InfiniBand adapter per GPU (NVIDIA DGX A100 datasheet)
DGX_A100_LINKS = ("--intra-node-bw", "300GB/s", "--inter-node-bw", "25GB/s")
# the same links at the bus bandwidth NCCL's all-reduce reaches on them (nccl-tests):
# about 230 GB/s over NVLink 3 inside a DGX A100 (NVIDIA/nccl-tests issue #149, the NCCL
# maintainer, 2023-07-05: 234.9 GB/s at 16 GB) and 192 GB/s per node of 8 GPUs across
# DGX A100 nodes, 24 GB/s a GPU's rail (NVIDIA/nccl issue #812, 2023-03-31, ring)
DGX_A100_NCCL_LINKS = ("--intra-node-bw", "230GB/s", "--inter-node-bw", "24GB/s")
# an H100 node's links at their line rates (NVLink 4, 450 GB/s each way; a 400 Gb/s NIC
# per GPU, 50 GB/s: NVIDIA's H100 and ConnectX-7 datasheets), and at the bus bandwidth NCCL
# reaches on them, autoshard's default links (autoshard/cost/mesh.py, with the sources):
# 370 GB/s over NVLink 4 for every collective but the NVLink SHARP all-reduce (the NCCL
# maintainer, NVIDIA/nccl-tests issue #212, 2024-05-06), 47 GB/s a 400 Gb/s NIC (46-48:
# NVIDIA's NCCL team, NVIDIA/nccl-tests issue #290, 2025-03-03)
H100_LINKS = ("--intra-node-bw", "450GB/s", "--inter-node-bw", "50GB/s")
H100_NCCL_LINKS = ("--intra-node-bw", "370GB/s", "--inter-node-bw", "47GB/s")
NCCL_LINKS = {
    DGX_A100_LINKS: DGX_A100_NCCL_LINKS,
    DGX_A100_LINKS[:2]: DGX_A100_NCCL_LINKS[:2],
    H100_LINKS: H100_NCCL_LINKS,
}
"""A row's link options (at their line rates) -> the same links at NCCL's bus bandwidth."""
ACHIEVED = {"a100": "a100-measured", "h100": "h100-measured"}
"""Per row's GPU, the preset of the rates such a GPU achieved: published benchmarks of an
A100 (autoshard/cost/measured/a100.json), one H100 lent to this project (h100.json)."""

FA2_H100 = "tests/data/h100b/profile_fa2.json"
"""The second H100's profile (h100-measured's rates) with FlashAttention-2's published H100
figure for causal attention in place of the cuDNN attention torch 2.11 ran there
(``python scripts/attention_profile.py tests/data/h100b/profile.json --out`` this file): the
kernel ``scaled_dot_product_attention`` picked on an H100 in the torch torchtitan's Tables
1 and 3 name (``1963fc8``, 2024-12-23), after cuDNN attention was made opt-in
(pytorch/pytorch#138522, 2024-10-22; #142132: a nightly of 2024-12-04 ran SDPA at 329
TFLOP/s where cuDNN reached 631)."""

TRITON_H100 = "tests/data/h100b/profile_fa1.json"
TRITON_A100 = "tests/data/published/profiles/a100_fa1.json"
"""llm-foundry's Triton FlashAttention (``attn_impl: triton``, the default of
``submit_benchmarks.py`` in the sweep that made the MosaicML 8-GPU rows, ``b2a43a1``),
priced at the first FlashAttention's published rates on each GPU, an upper bound: the
kernel's author writes that it runs forward plus backward "slightly slower than CUDA" (the
FlashAttention of then). ``python scripts/attention_profile.py
tests/data/h100b/profile.json --kernel fa1 --out`` the H100 file (the second H100's rates
otherwise), ``--device a100-measured --gpu a100 --kernel fa1`` the A100 one
(a100-measured's rates otherwise)."""

HBM2E = "torchtitan's Grand Teton H100: 96GB HBM2e, 2.4 TB/s, 500 W (d4c86e3)"
HBM2E_405B = (
    "its footnote 1 (3faaa1a): HBM2e based lower TDP SXM H100(95GB), the part of Tables 1 "
    "and 3: priced at their 2.4 TB/s and 96 GB (d4c86e3)"
)
FA2_H100_HBM2E = "tests/data/h100b/profile_fa2_hbm2e.json"
""":data:`FA2_H100` on the H100 torchtitan's Tables 1 and 3 ran on: "96GB HBM2e with 2.4
TB/sec peak memory bandwidth", "the default 500W power limit" (``docs/performance.md`` at
``d4c86e3``), where the measured H100 has 80 GB of HBM3 at 3.35 TB/s and 700 W
(``python scripts/memory_part_profile.py tests/data/h100b/profile_fa2.json --measured-peak
3.35TB/s --peak 2.4TB/s --memory 96GB --out`` this file): its copy and elementwise
bandwidths times 2.4 / 3.35, its matmul and attention rates the 700 W part's (the source:
the part's peak FLOP/s lies "between SXM and NVL", value unknown)."""
H100_HBM2E = "tests/data/h100b/profile_hbm2e.json"
"""The measured H100's own profile (``h100-measured``'s rates, its measured attention) on
that part, written the same way from ``tests/data/h100b/profile.json``: the 405B row's
GPU. Its source names the part in its footnote 1 (``docs/performance.md`` at
``3faaa1a``): "HBM2e based lower TDP SXM H100(95GB)", whose peak FLOP/s is "between SXM
and NVL", the words of Tables 1 and 3's footnote; it names no torch version, so its
attention stays the measured H100's."""
DATASHEET_HBM2E = "tests/data/h100b/datasheet_hbm2e.json"
"""``--device h100``'s datasheet with that part's 2.4 TB/s and 96 GB (``python
scripts/memory_part_profile.py --device h100 --peak 2.4TB/s --memory 96GB --out`` this
file): the datasheet column of the rows that ran on it."""


@dataclass(frozen=True)
class Run:
    """One published run. ``tokens`` per step and GPU over ``per_gpu_rate`` tokens per
    second and GPU is the measured step (the paper's rows: FLOPs per step over the
    aggregate FLOP/s, ``flops`` and ``per_gpu_rate`` in FLOP/s per GPU)."""

    id: str
    source: str
    quote: str
    model: str  # "llama" or "gpt": tests/data/published/<model>.py
    env: dict[str, str]
    gpus: int
    mesh: str
    plan: str
    device: str
    checkpointing: str  # none, full, or selective (torchtitan's op-level policy)
    per_gpu_rate: float
    tokens: float = 0.0
    flops: float = 0.0
    options: tuple[str, ...] = ()
    notes: str = ""
    # the memory the source reports: torchtitan's Memory(GiB) is the caching allocator's
    # peak reserved bytes (torchtitan/metrics.py at d4c86e3), not the peak allocated
    memory_gib: float | None = field(default=None)
    # its recomputation reruns each block's whole forward: Megatron-LM's checkpoint is a
    # reentrant torch.autograd.Function (megatron/mpu/random.py, CheckpointFunction: its
    # backward calls the layer's forward again on the detached inputs), priced with
    # --no-checkpoint-early-stop; torchtitan's (checkpoint_wrapper, non-reentrant) stops
    # early, torch's default
    reentrant: bool = False
    # the achieved rates as the run's software reached them, where its source names a
    # software whose kernels differ from the measured preset's (a one-GPU --profile in
    # place of ACHIEVED's --device)
    achieved_profile: str | None = None
    # the datasheet of the run's GPU where it is not the preset's (a --profile in place of
    # --device h100 or a100): a part with another memory than the preset's
    datasheet_profile: str | None = None
    # FSDP's collective: one all-gather and one reduce-scatter per wrapped block (FSDP2's
    # fully_shard per transformer block, FSDP1's flat parameter per block), priced as one
    # bucket of the block's bfloat16 parameters per device (--bucket-size): each weight pays
    # its share of one collective's latency (test_an_fsdp_row_s_bucket_is_one_block)
    bucket_bytes: int | None = None
    # the AdamW implementation the run stepped with (--optimizer): torchtitan builds
    # torch.optim.AdamW with foreach (train.py at 157a12c: ``foreach=True``; optimizer.py
    # at 3faaa1a: ``"foreach": not fused``, fused off by default); Megatron-LM apex's
    # FusedAdam, one kernel; MosaicML's sweeps step with Composer's DecoupledAdamW
    # (llm-foundry's yamls/pretrain/mpt-7b.yaml and mpt-13b.yaml at b2a43a1 and 5e85bd6:
    # ``name: decoupled_adamw``, ``weight_decay: 0.0``), a loop over the parameters
    # whose eight passes per element at no weight decay move the 80 bytes foreach's do
    # (tests/test_optimizer.py counts both)
    optimizer: str = "adamw-fused"
    # the FSDP that ran it (--fsdp-version): torchtitan's fully_shard (FSDP2); Composer
    # wraps torch's FullyShardedDataParallel (FSDP1): their copies around the collectives
    # differ (autoshard.plan.fsdp_runtime)
    fsdp_version: int = 2
    # micro-batches per step (--grad-accumulation): the run's global batch in that many
    # forward and backward passes, FSDP gathering and reducing in each (Composer runs no
    # no_sync under FSDP: composer/trainer/trainer.py at v0.16.4, ``_train_microbatches``),
    # one optimizer step
    grad_accumulation: int = 1

    @property
    def measured_s(self) -> float:
        if self.flops:
            return self.flops / (self.per_gpu_rate * self.gpus)
        return self.tokens / self.per_gpu_rate


def _model_env(name: str, batch: int, seq: int) -> dict[str, str]:
    return {"AUTOSHARD_MODEL": name, "AUTOSHARD_BATCH": str(batch), "AUTOSHARD_SEQ": str(seq)}


def _megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. 3: FLOPs per iteration with full recomputation,
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``."""
    b, s, n, h, v = batch, seq, layers, hidden, vocab
    return 96 * b * s * n * h**2 * (1 + s / (6 * h) + v / (16 * n * h))


RUNS = [
    Run(
        "torchtitan-llama3-8b-64xa100",
        TORCHTITAN_A100,
        "| 8B | 1 | selective op | 2973 | 58.2% |",
        "llama",
        _model_env("llama3_8b", 64, 8192),
        64,
        "8x8",
        "fsdp",
        "a100",
        "selective",
        2973,
        tokens=8192,
        options=DGX_A100_LINKS,
        bucket_bytes=436_224_000,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama3-70b-64xa100",
        TORCHTITAN_A100,
        "| 70B | 1 | full | 331 | 51.7% |",
        "llama",
        _model_env("llama3_70b", 64, 8192),
        64,
        "8x8",
        "fsdp",
        "a100",
        "full",
        331,
        tokens=8192,
        options=DGX_A100_LINKS,
        bucket_bytes=1_711_308_800,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama2-13b-64xa100",
        TORCHTITAN_A100,
        "| 13B | 2 | none | 2162 | 61.1% |",
        "llama",
        _model_env("llama2_13b", 128, 4096),
        64,
        "8x8",
        "fsdp",
        "a100",
        "none",
        2162,
        tokens=2 * 4096,
        options=DGX_A100_LINKS,
        bucket_bytes=634_408_960,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama2-70b-64xa100",
        TORCHTITAN_A100,
        "| 70B | 2 | full | 353 |",
        "llama",
        _model_env("llama2_70b", 128, 4096),
        64,
        "8x8",
        "fsdp",
        "a100",
        "full",
        353,
        tokens=2 * 4096,
        options=DGX_A100_LINKS,
        bucket_bytes=1_711_308_800,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama3.1-8b-8xh100",
        TORCHTITAN_H100,
        "| FSDP | 5,762 | 82.4 | (local batch 2, selective AC)",
        "llama",
        _model_env("llama3_8b", 16, 8192),
        8,
        "8",
        "fsdp",
        "h100",
        "selective",
        5762,
        tokens=2 * 8192,
        memory_gib=82.4,
        options=H100_LINKS,
        achieved_profile=FA2_H100_HBM2E,
        datasheet_profile=DATASHEET_HBM2E,
        notes=HBM2E,
        bucket_bytes=436_224_000,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama3.1-8b-128xh100",
        TORCHTITAN_H100,
        "Table 3, 128 GPUs: | FSDP | 5,605 | 67.0 | (local batch 2, selective AC)",
        "llama",
        _model_env("llama3_8b", 256, 8192),
        128,
        "16x8",
        "fsdp",
        "h100",
        "selective",
        5605,
        tokens=2 * 8192,
        memory_gib=67.0,
        options=H100_LINKS,
        achieved_profile=FA2_H100_HBM2E,
        datasheet_profile=DATASHEET_HBM2E,
        notes=HBM2E,
        bucket_bytes=436_224_000,
        optimizer="adamw-foreach",
    ),
    Run(
        "torchtitan-llama3.1-405b-128xh100",
        TORCHTITAN_405B,
        "| 405B | 2 | full | 109 | 29.0% | None",
        "llama",
        _model_env("llama3_405b", 32, 8192),
        128,
        "16x8",
        "fsdp_tp",
        "h100",
        "full",
        109,
        tokens=2 * 8192 / 8,  # a TP group of 8 shares its 2 x 8192 tokens; WPS is per GPU
        options=H100_LINKS,
        achieved_profile=H100_HBM2E,
        datasheet_profile=DATASHEET_HBM2E,
        notes=HBM2E_405B,
        bucket_bytes=796_925_952,
        optimizer="adamw-foreach",
    ),
    Run(
        "mosaicml-mpt-7b-8xh100",
        MOSAICML,
        "| 7b | 2048 | 8 | h100_80gb | ... | False | 6 | 48 | ... | 85144 |",
        "gpt",
        _model_env("mpt_7b", 48, 2048),
        8,
        "8",
        "fsdp",
        "h100",
        "none",
        85144 / 8,
        tokens=6 * 2048,
        options=H100_LINKS,
        bucket_bytes=402_759_680,
        achieved_profile=TRITON_H100,
        fsdp_version=1,
        optimizer="adamw-foreach",  # Composer's DecoupledAdamW: 80 bytes
    ),
    Run(
        "mosaicml-mpt-13b-8xh100",
        MOSAICML,
        "| 13b | 2048 | 8 | h100_80gb | ... | False | 2 | 16 | ... | 38336 |",
        "gpt",
        _model_env("mpt_13b", 16, 2048),
        8,
        "8",
        "fsdp",
        "h100",
        "none",
        38336 / 8,
        tokens=2 * 2048,
        options=H100_LINKS,
        bucket_bytes=629_278_720,
        achieved_profile=TRITON_H100,
        fsdp_version=1,
        optimizer="adamw-foreach",  # Composer's DecoupledAdamW: 80 bytes
    ),
    Run(
        "mosaicml-mpt-7b-512xh100",
        MOSAICML,
        "| 7b | 2048 | 512 | h100_80gb | ... | 6 | 1 | 3072 | ... | 4951479 | 9670 | ... | False |"
        " (its large-scale table)",
        "gpt",
        _model_env("mpt_7b", 3072, 2048),
        512,
        "64x8",  # FSDP1 FULL_SHARD over all 512 ranks: one ring over the flattened mesh
        "fsdp",
        "h100",
        "none",
        4951479 / 512,
        tokens=6 * 2048,
        options=H100_LINKS,
        # its sweep (llm-foundry 5e85bd6) installed flash-attn 2.4.2 (.[gpu-flash2]) and ran
        # attn_impl flash: FlashAttention-2
        achieved_profile=FA2_H100,
        notes="the 8-GPU row's model and micro-batch on 64 nodes; the source names no links",
        bucket_bytes=402_759_680,
        fsdp_version=1,
        optimizer="adamw-foreach",  # Composer's DecoupledAdamW: 80 bytes
    ),
    Run(
        "mosaicml-mpt-7b-8xa100",
        MOSAICML,
        "| 7b | 2048 | 8 | a100_80gb | ... | False | 6 | 96 | ... | 37130 | (2 micro-batches)",
        "gpt",
        _model_env("mpt_7b", 96, 2048),
        8,
        "8",
        "fsdp",
        "a100",
        "none",
        37130 / 8,
        tokens=12 * 2048,
        options=DGX_A100_LINKS[:2],
        notes="two micro-batches of 6 per GPU, gradients accumulated",
        bucket_bytes=402_759_680,
        achieved_profile=TRITON_A100,
        fsdp_version=1,
        optimizer="adamw-foreach",  # Composer's DecoupledAdamW: 80 bytes
        grad_accumulation=2,  # the table's micro-batch 6 of its 12 per GPU
    ),
    Run(
        "megatron-gpt-1.7b-32xa100",
        MEGATRON,
        "1.7B: hidden 2304, 24 layers, TP 1, 32 GPUs, batch 512, 137 TFLOP/s (44%)",
        "gpt",
        _model_env("gpt_1.7b", 512, 2048),
        32,
        "4x8",
        "ddp",
        "a100",
        "full",
        137e12,
        flops=_megatron_flops(512, 2048, 24, 2304, 51200),
        options=DGX_A100_LINKS,
        reentrant=True,
    ),
    Run(
        "megatron-gpt-3.6b-64xa100",
        MEGATRON,
        "3.6B: hidden 3072, 30 layers, TP 2, 64 GPUs, batch 512, 138 TFLOP/s (44%)",
        "gpt",
        _model_env("gpt_3.6b", 512, 2048),
        64,
        "32x2",
        "megatron",
        "a100",
        "full",
        138e12,
        flops=_megatron_flops(512, 2048, 30, 3072, 51200),
        options=DGX_A100_LINKS,
        reentrant=True,
    ),
    Run(
        "megatron-gpt-7.5b-128xa100",
        MEGATRON,
        "7.5B: hidden 4096, 36 layers, TP 4, 128 GPUs, batch 512, 142 TFLOP/s (46%)",
        "gpt",
        _model_env("gpt_7.5b", 512, 2048),
        128,
        "32x4",
        "megatron",
        "a100",
        "full",
        142e12,
        flops=_megatron_flops(512, 2048, 36, 4096, 51200),
        options=DGX_A100_LINKS,
        reentrant=True,
    ),
    Run(
        "megatron-gpt-18.4b-256xa100",
        MEGATRON,
        "18.4B: hidden 6144, 40 layers, TP 8, 256 GPUs, batch 1024, 135 TFLOP/s (43%)",
        "gpt",
        _model_env("gpt_18.4b", 1024, 2048),
        256,
        "32x8",
        "megatron",
        "a100",
        "full",
        135e12,
        flops=_megatron_flops(1024, 2048, 40, 6144, 51200),
        options=DGX_A100_LINKS,
        reentrant=True,
    ),
]
BY_ID = {r.id: r for r in RUNS}

# rows whose datasheet price is within 20% of the measured step now; every other row is a
# strict expected failure, its cause in docs/validation.md
# (the four A100 torchtitan rows left it, 24-29% under, once FSDP's gathers and
# reductions over both mesh dims were priced as one ring over the flattened group, as
# FSDP2 runs them: their agreement rested on gathers priced at 7.3x what that ring moves)
# (the 64-A100 Llama-3 8B row came back within it, -18%, once overlapped compute was priced
# 18.9% slower: Lee et al., arXiv 2507.03114)
# (the Megatron 1.7B row left it, -22%, once the GPT rows' GELU ran as one kernel, as
# Megatron-LM fuses it: the datasheet price is a roofline, and the row then sat at 1.09x of
# it at the achieved rates, 1.06x since the A100's matmuls run at their sustained rate)
# (the 64-A100 Llama-3 8B row left it again, -21%, once a ring over nodes paid the
# network's latency only between nodes, NCCL's ring model; the 512-H100 MPT-7B row, +10%,
# came in with it; it left again, -31%, once FSDP paid one collective's latency per block)
WITHIN = frozenset(
    {
        # 19.7% under since FSDP2's copies are priced (2.16 -> 2.21 s against 2.76)
        "torchtitan-llama3-8b-64xa100",
        "megatron-gpt-3.6b-64xa100",
        "megatron-gpt-7.5b-128xa100",
        "megatron-gpt-18.4b-256xa100",
    }
)
# the same at the rates such a GPU achieved (:data:`ACHIEVED`): every A100 row, two H100
# rows (405B since its links are priced at NCCL's bus bandwidth, as the A100 rows' are;
# MPT-7B on 8); the 8-GPU MPT
# rows left it (1.25x, 1.39x) once their GELU ran as one kernel, as MPT's ``nn.GELU``
# does: their agreement rested on HuggingFace's unfused ``gelu_new``; MPT-7B on 512 left
# it (0.88x -> 1.28x) once FSDP paid one collective's latency per block, not per weight;
# MPT-7B on 8 H100 and on 8 A100 came back (1.17x, 1.15x) once their attention was priced
# at FlashAttention's rates, an upper bound for the Triton kernel they ran; MPT-13B not
# (1.31x); torchtitan's Llama-3.1 8B on 8 H100 came in (1.25x -> 1.24x, 2.27 -> 2.29 s
# against 2.84: 19.4% under) once its AdamW was priced as the foreach implementation
# torchtitan builds (--optimizer adamw-foreach); the last three came in once the copies
# FSDP makes around its collectives were priced (autoshard.plan.fsdp_runtime: FSDP2's for
# torchtitan, FSDP1's for Composer): Llama-3.1 8B on 128 H100 (1.28x -> 1.25x, 19.96%
# under), MPT-13B on 8 H100 (1.31x -> 1.15x), MPT-7B on 512 H100 (1.28x -> 1.23x); the
# 405B row left it (1.13x -> 1.36x) once its plan was priced as torchtitan runs it: each
# block's input gathered once for its q, k and v (--share-reshardings) and a linear's
# flatten reading its input gathered, not resharded by an all-to-all (docs/validation.md);
# 1.30x on the HBM2e H100 its source's footnote names (2026-12-07, fifth sitting)
WITHIN_MEASURED = frozenset(
    {
        "torchtitan-llama3.1-8b-128xh100",
        "mosaicml-mpt-13b-8xh100",
        "mosaicml-mpt-7b-512xh100",
        "torchtitan-llama3.1-8b-8xh100",
        "mosaicml-mpt-7b-8xh100",
        "mosaicml-mpt-7b-8xa100",
        "torchtitan-llama3-8b-64xa100",
        "torchtitan-llama3-70b-64xa100",
        "torchtitan-llama2-13b-64xa100",
        "torchtitan-llama2-70b-64xa100",
        "megatron-gpt-1.7b-32xa100",
        "megatron-gpt-3.6b-64xa100",
        "megatron-gpt-7.5b-128xa100",
        "megatron-gpt-18.4b-256xa100",
    }
)
BAR = 0.20


def price(run: Run, checkpointing: str, device: str | None = None) -> dict:
    """``autoshard compare --plans PLAN --json``'s row for the run's own plan, at the
    device's datasheet (or at ``device``), computed in this process: the command's options
    parsed by the command itself, the model traced once per row (a trace reads neither the
    device nor the recomputation), the strategies and the plan per mode and device.
    :func:`test_the_command_prints_the_price_the_tests_hold` holds one row equal to the
    command's output."""
    return _price(run.id, checkpointing, device)


def _compare_args(run: Run, checkpointing: str, device: str | None) -> list[str]:
    args = ["compare", f"tests/data/published/{run.model}.py", "--mesh", run.mesh]
    args += ["--plans", run.plan, "--precision", "bf16-mixed"]
    if device in ACHIEVED.values() and run.achieved_profile:
        args += ["--profile", run.achieved_profile]
    elif device is None and run.datasheet_profile:
        args += ["--profile", run.datasheet_profile]
    else:
        args += ["--device", device or run.device]
    args += ["--activation-checkpointing", checkpointing]
    args += ["--no-checkpoint-early-stop"] if run.reentrant else []
    args += ["--bucket-size", f"{run.bucket_bytes}B"] if run.bucket_bytes else []
    args += ["--optimizer", run.optimizer] if run.optimizer != "adamw-fused" else []
    args += ["--fsdp-version", str(run.fsdp_version)] if run.fsdp_version != 2 else []
    args += ["--grad-accumulation", str(run.grad_accumulation)] if run.grad_accumulation > 1 else []
    # every system moves a tensor once per placement its readers want: torchtitan's
    # PrepareModuleInput gathers a block's input once for q, k and v, Megatron-LM
    # all-reduces a norm's input gradient once for its two reads (issue 28, item 3)
    args += ["--share-reshardings"]
    return [*args, *_links(run, device), "--json"]


def _links(run: Run, device: str | None) -> tuple[str, ...]:
    """The run's options (its links at their line rates, the datasheet's); at the achieved
    rates its links at NCCL's bus bandwidth in place of them: an A100 row's DGX links
    (:data:`DGX_A100_NCCL_LINKS`), an H100 row's (:data:`H100_NCCL_LINKS`)."""
    if device not in ACHIEVED.values():
        return run.options
    assert run.options in NCCL_LINKS, f"{run.id}: a row names its links at their line rates"
    return NCCL_LINKS[run.options]


@functools.cache
def _traced(run_id: str):
    run = BY_ID[run_id]
    with environment(**run.env):
        return trace(cli_config(*_compare_args(run, _modes(run)[0], None)))


@functools.cache
def _price(run_id: str, checkpointing: str, device: str | None) -> dict:
    run = BY_ID[run_id]
    config = cli_config(*_compare_args(run, checkpointing, device))
    with environment(**run.env):
        (row,) = compare_plans(config, strategies(config, _traced(run_id)), (run.plan,))
    return json.loads(json.dumps(row.to_dict()))  # as --json prints it


def _modes(run: Run) -> tuple[str, ...]:
    return (run.checkpointing,)


def test_every_row_is_its_source_s_throughput_worked_to_seconds():
    """The step times, worked by hand from the sources' numbers."""
    assert len(RUNS) >= 8 and len({r.source.split(" ")[0] for r in RUNS}) >= 3
    by = {r.id: r.measured_s for r in RUNS}
    assert by["torchtitan-llama3-8b-64xa100"] == pytest.approx(2.7554, abs=1e-4)
    assert by["torchtitan-llama3.1-8b-8xh100"] == pytest.approx(2.8434, abs=1e-4)
    assert by["torchtitan-llama3.1-405b-128xh100"] == pytest.approx(18.789, abs=1e-3)
    assert by["mosaicml-mpt-7b-8xh100"] == pytest.approx(1.1546, abs=1e-4)
    assert by["megatron-gpt-1.7b-32xa100"] == pytest.approx(3.528, abs=1e-3)
    assert by["mosaicml-mpt-7b-512xh100"] == pytest.approx(1.2706, abs=1e-4)
    assert {r.gpus for r in RUNS} >= {8, 64, 128, 256, 512}
    assert {r.device for r in RUNS} == {"a100", "h100"}
    assert WITHIN <= set(BY_ID)
    for r in RUNS:  # a mesh of the run's size, from the run's own model file
        assert math.prod(map(int, r.mesh.split("x"))) == r.gpus, r.id
        assert (ROOT / f"tests/data/published/{r.model}.py").exists()


def _held(run: Run, device: str | None, within: frozenset[str]) -> None:
    """The run's price at ``device`` against its measured step: within 20% for the rows of
    ``within``, outside it for the others (a change that brings one within fails here until
    the row moves to ``within``: the strict expected failure this was)."""
    step = price(run, run.checkpointing, device)["step_time_s"]
    inside = step == pytest.approx(run.measured_s, rel=BAR)
    expected = "within" if run.id in within else "outside (docs/validation.md says why)"
    assert inside == (run.id in within), (
        f"{run.id} at {device or run.device}: {step:.2f} s against {run.measured_s:.2f} s "
        f"measured, expected {expected} 20%"
    )


def _shown(run: Run) -> None:
    """docs/validation.md's row of ``run`` shows the prices it gets now (two decimals), at
    the datasheet and at the rates such a GPU achieved (:data:`ACHIEVED`)."""
    text = (ROOT / "docs/validation.md").read_text()
    line = next((s for s in text.splitlines() if f"| {run.id} |" in s), None)
    assert line is not None, run.id
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    assert cells[4] == f"{run.measured_s:.2f}", (run.id, cells)
    # the datasheet's price in column 6, the achieved rates' in column 9
    devices = {5: None, 8: ACHIEVED[run.device]}
    for column, device in devices.items():
        prices = [price(run, m, device)["step_time_s"] for m in _modes(run)]
        shown = [float(x) for x in re.findall(r"\d+\.\d\d", cells[column])]
        assert shown == [round(p, 2) for p in prices], (run.id, device, cells[column])
    memory = price(run, run.checkpointing, ACHIEVED[run.device])["memory_bytes"] / 2**30
    assert cells[12] == f"{memory:.1f}", (run.id, cells[12])  # predicted GiB
    if run.memory_gib is not None:  # the run's published memory: within 20% of it
        assert memory == pytest.approx(run.memory_gib, rel=BAR), (run.id, memory)


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS, ids=[r.id for r in RUNS])
def test_a_published_step_priced_with_its_own_plan(run: Run):
    """The run's own plan priced at the device's datasheet, and again at the rates such a
    GPU achieved (an H100 row at the rates one H100 SXM reached: matmuls by size,
    attention, copy, ``--device h100-measured``; an A100 row at published A100 benchmarks'
    GEMM, attention and copy rates, ``--device a100-measured``; each with NCCL's bus
    bandwidth on its links; torchtitan's 8B H100 rows on their GPUs' 2.4 TB/s HBM2e, and
    still priced under their measured steps: those are 500 W parts whose peak FLOP/s the
    source does not know), each held to the measured step (within
    20% for the rows of ``WITHIN`` / ``WITHIN_MEASURED``, outside for the others); and
    docs/validation.md's table shows the prices and the predicted memory, which is within
    20% of the memory the run published, where it did (torchtitan's two 8B H100 rows, its
    peak reserved GiB). One test per row: its trace is made once, in one process, for
    every price of the row."""
    _shown(run)
    _held(run, None, WITHIN)
    _held(run, ACHIEVED[run.device], WITHIN_MEASURED)


@pytest.mark.slow
def test_the_command_prints_the_price_the_tests_hold():
    """``autoshard compare ... --json`` (the command docs/validation.md names) prints the
    row :func:`price` computes, for the 8-GPU MPT-7B rows: the H100 row at the datasheet,
    the A100 row at the achieved rates (its links at NCCL's bus bandwidth)."""
    h100, a100 = BY_ID["mosaicml-mpt-7b-8xh100"], BY_ID["mosaicml-mpt-7b-8xa100"]
    for run, device in ((h100, None), (a100, ACHIEVED[a100.device])):
        out = autoshard_cli(*_compare_args(run, run.checkpointing, device), **run.env)
        assert out.returncode == 0, out.stderr[-2000:]
        (printed,) = json.loads(out.stdout)["plans"]
        assert printed == price(run, run.checkpointing, device)


@pytest.mark.parametrize("model", ["mpt_7b", "gpt_1.7b"])
def test_a_gpt_row_s_mlp_runs_its_gelu_as_one_kernel(model: str):
    """The MPT and Megatron rows' MLP activation is one ``aten.gelu`` each way, as the
    systems run it (Megatron-LM's fused ``bias_gelu``, MPT's ``nn.GELU``), not
    HuggingFace's GPT-2 default ``gelu_new``, whose eight elementwise ops were 19% of
    MPT-7B's priced compute (docs/validation.md, "The MLP's activation as the systems ran
    it"): one block, traced as a row is."""
    env = {"AUTOSHARD_MODEL": model, "AUTOSHARD_LAYERS": "1"}
    env |= {"AUTOSHARD_BATCH": "1", "AUTOSHARD_SEQ": "64"}
    args = ("solve", "tests/data/published/gpt.py", "--mesh", "1", "--mode", "train")
    with environment(**env):
        graph = trace(cli_config(*args, "--precision", "bf16-mixed")).graph_module.graph
    ops = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert ops.count("aten.gelu.default") == 1 and ops.count("aten.gelu_backward.default") == 1
    assert not [op for op in ops if op.startswith(("aten.tanh", "aten.pow"))], ops


def test_the_mean_errors_docs_validation_states_are_its_table_s():
    """The mean absolute errors and within-20% counts docs/validation.md states, worked
    here from its table's two-decimal values (measured, datasheet price, achieved-rates
    price), one row per run of :data:`RUNS`."""
    text = (ROOT / "docs/validation.md").read_text()
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in BY_ID:
            rows.append((float(cells[4]), float(cells[5]), float(cells[8])))
    assert len(rows) == len(RUNS)
    prose = " ".join(text.split())
    for column, words in ((1, "at the datasheet"), (2, "at the achieved rates")):
        errors = [abs(r[column] - r[0]) / r[0] for r in rows]
        mean = 100 * sum(errors) / len(errors)
        within = sum(e <= BAR for e in errors)
        assert f"{mean:.1f}% {words}" in prose, (words, mean)
        assert f"{mean:.1f}% {words}, {within} of the {len(rows)}" in prose, (words, within)


@pytest.mark.parametrize(
    "run", [r for r in RUNS if r.plan in ("fsdp", "fsdp_tp")], ids=lambda r: r.id
)
def test_an_fsdp_row_s_bucket_is_one_block(run: Run):
    """An FSDP row's collectives are priced per wrapped block, as FSDP runs them: FSDP2
    (torchtitan) gathers each ``fully_shard``-ed transformer block in one all-gather and
    reduces it in one reduce-scatter; Composer's FSDP1 (MosaicML) one flat parameter per
    block. Its ``--bucket-size`` is one block's parameters in bfloat16 on one device
    (torchtitan's FSDP+TP: a tensor-parallel rank's share, 1/8), counted here by PyTorch
    on the row's own model file built on the meta device: not by autoshard."""
    import importlib.util

    import torch

    assert run.bucket_bytes, f"{run.id}: an FSDP row prices FSDP's per-block collectives"
    with environment(**run.env, AUTOSHARD_LAYERS="1"):
        path = ROOT / f"tests/data/published/{run.model}.py"
        spec = importlib.util.spec_from_file_location(f"published_{run.model}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        with torch.device("meta"):
            model = module.build_model()
    (block,) = [m for name, m in model.named_modules() if name.endswith(("h.0", "layers.0"))]
    tp = int(run.mesh.split("x")[-1]) if run.plan == "fsdp_tp" else 1
    assert run.bucket_bytes * tp == 2 * sum(p.numel() for p in block.parameters())
