"""Time a real training step of a model file on one GPU: what ``autoshard solve --mesh 1``
predicts, measured.

    python scripts/measure_step.py examples/llama.py --precision bf16-mixed --out step.json

The step is the one autoshard prices for ``--mode train`` on one device: the model file's
``build_model()`` and ``example_inputs()``, its ``loss_fn`` (else autoshard's default: a
HuggingFace output's own ``loss``, else the mean of the logits in float32), backward, and
``torch.optim.AdamW``, fused by default (``--adamw fused``: one kernel reads the parameter,
gradient and both moments and writes the parameter and moments, the 28 bytes per fp32
element autoshard prices; torchtitan's default). ``--adamw foreach`` is PyTorch's default
for CUDA tensors, a dozen passes over the same tensors.

``--precision fp32`` trains the model in float32 with TF32 matmuls (the float32 peak the
device presets use). ``--precision bf16-mixed`` computes with bfloat16 parameters and steps
an fp32 master copy (2 + 4 + 4 + 8 bytes per parameter, as autoshard's memory model counts
them): each step casts the bf16 gradients to the masters' fp32 ``.grad``, runs AdamW on the
masters and copies them back into the bf16 parameters.

It prints and writes (``--out``, JSON) the median over ``--steps`` timed steps of the
forward, backward, optimizer (cast, AdamW, copy back) and whole step, in seconds, CUDA
events; the step's FLOPs as ``torch.utils.flop_counter.FlopCounterMode`` counts them (the
count autoshard's report gives) and the MFU against ``--peak-tflops``; the peak memory
allocated; and with ``--profile FILE`` the GPU time per ATen op of one step
(``torch.profiler``), largest first.

Needs CUDA and the model file's imports (torch, transformers); it imports nothing from
autoshard, so it runs with whatever torch the GPU machine has.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def load_model_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def default_loss(out, *inputs):
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    t = out if isinstance(out, torch.Tensor) else out.logits
    return t.float().mean() if t.dtype.itemsize < 4 else t.mean()


class Mark:
    """A point in the step: a CUDA event on a GPU (the GPU's own clock), else the wall
    clock."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.t = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.t = time.perf_counter()

    def seconds_to(self, other: Mark) -> float:
        if self.event is not None:
            return self.event.elapsed_time(other.event) / 1e3
        return other.t - self.t


def _selective_op():
    """torchtitan's op-level selective activation checkpointing
    (``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``): save the
    outputs of the attention kernels and of every other ``mm``, recompute everything else.
    The ``mm`` count is kept apart for the forward and for the recomputation, so both make
    the same choices."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten.mm.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
        aten.max.default,
    }
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            counts[mode] += 1
        keep = func in save and not (func == aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_file", type=Path)
    ap.add_argument("--precision", choices=("fp32", "bf16-mixed"), default="fp32")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=989.5, help="for the MFU (H100 bf16)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--adamw", choices=("fused", "foreach"), default="fused")
    ap.add_argument("--device", default="cuda", help="cpu only to try the script itself")
    ap.add_argument(
        "--checkpointing",
        choices=("none", "full", "selective-op"),
        default="none",
        help="full: recompute every decoder layer in the backward (HuggingFace's "
        "gradient_checkpointing_enable, non-reentrant), as --activation-checkpointing full; "
        "selective-op: torchtitan's op-level selective AC in every layer (keep the outputs "
        "of attention and of every other matmul, recompute the rest)",
    )
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    mod = load_model_file(args.model_file)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    with dev:
        model = mod.build_model()
    model.train()
    if args.checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif args.checkpointing == "selective-op":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": _selective_op}
        )
    inputs = mod.example_inputs()
    if isinstance(inputs, dict):
        kwargs, inputs = {k: v.to(dev) for k, v in inputs.items()}, ()
    else:
        kwargs, inputs = {}, tuple(x.to(dev) for x in inputs)
    loss_fn = getattr(mod, "loss_fn", None) or default_loss
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    if args.precision == "bf16-mixed":
        model.to(torch.bfloat16)
        masters = [p.detach().float().clone() for p in params]
    else:
        masters = None
    fused = args.adamw == "fused"
    opt = torch.optim.AdamW(masters or params, lr=1e-4, fused=fused, foreach=not fused)

    def forward():
        return loss_fn(model(*inputs, **kwargs), *inputs)

    def optimizer_step():
        if masters is not None:
            for m, p in zip(masters, params, strict=True):
                m.grad = p.grad.float()
        opt.step()
        if masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)

    from torch.utils.flop_counter import FlopCounterMode

    flops_error = None
    try:
        with FlopCounterMode(display=False) as counter:
            forward().backward()
        flops = counter.get_total_flops()
    except AssertionError as e:  # torch 2.11's sdpa count refuses grouped-query (enable_gqa)
        flops, flops_error = None, f"FlopCounterMode: {e}"
        print(f"no FLOP count: {flops_error}", file=sys.stderr)
    model.zero_grad(set_to_none=True)

    times = {"forward": [], "backward": [], "optimizer": [], "step": []}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.warmup + args.steps):
        ev = [Mark(cuda) for _ in range(4)]
        ev[0].record()
        loss = forward()
        ev[1].record()
        loss.backward()
        ev[2].record()
        optimizer_step()
        ev[3].record()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times["forward"].append(ev[0].seconds_to(ev[1]))
            times["backward"].append(ev[1].seconds_to(ev[2]))
            times["optimizer"].append(ev[2].seconds_to(ev[3]))
            times["step"].append(ev[0].seconds_to(ev[3]))
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model_file": str(args.model_file),
        "precision": args.precision,
        "adamw": args.adamw,
        "checkpointing": args.checkpointing,
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "torch": torch.__version__,
        "parameters": n_params,
        "environment": {k: v for k, v in os.environ.items() if k.startswith("AUTOSHARD_")},
        "seconds": median,
        "flops": flops,
        "flops_error": flops_error,
        "mfu": flops / median["step"] / (args.peak_tflops * 1e12) if flops else None,
        "peak_memory_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
    }
    if args.profile is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            forward().backward()
            optimizer_step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)
        args.profile.write_text(table)
    line = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in median.items())
    print(
        f"{args.model_file} {args.precision} (AdamW {args.adamw}) on {result['device']}: {line}; "
        + (
            f"{flops:.3e} FLOPs, MFU {result['mfu']:.1%} of {args.peak_tflops} TFLOP/s; "
            if flops
            else ""
        )
        + f"peak memory {result['peak_memory_allocated_bytes'] / 2**30:.2f} GiB"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
