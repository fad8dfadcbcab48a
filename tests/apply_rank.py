"""One rank of ``tests/test_apply.py``: a user's own training step on ``autoshard.apply``.

``torchrun --nproc-per-node 8 tests/apply_rank.py MAP MODEL OUT [EXPORTED]``: every rank
builds the model with one seed (float64, or ``APPLY_RANK_DTYPE``; in eval mode: no
dropout), keeps a single-device copy as the reference, applies the plan (with
``EXPORTED``: calls the ``parallelize(model, device_type)`` that ``autoshard export``
wrote instead), trains one AdamW step on its part of the batch, and compares the loss,
every gradient and every parameter after the step with the reference's. Rank 0 writes
OUT (JSON).
"""

import copy
import json
import os
import runpy
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autoshard
from autoshard.model.loss import default_loss
from autoshard.model.model_file import load_model_file
from autoshard.plan.formats import load_sharding_map

WRAPPED = "_checkpoint_wrapped_module."  # what checkpoint_wrapper adds to its names


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch_shard(smap, inputs: tuple) -> tuple:
    """This rank's part of each input: the batch split over the mesh dims the map shards
    it on (``S(0)``), nested outer dim first as DTensor splits it; ranks laid out as
    ``torch.arange(world).reshape(mesh_shape)`` (``init_device_mesh``)."""
    shape = smap.mesh_shape
    coordinate = [int(c) for c in torch.unravel_index(torch.tensor(dist.get_rank()), shape)]
    out = []
    for x, ps in zip(inputs, smap.inputs.values(), strict=False):
        n, r = 1, 0
        for d, p in enumerate(ps):
            if str(p) == "S(0)":
                n, r = n * shape[d], r * shape[d] + coordinate[d]
        out.append(x[r * len(x) // n : (r + 1) * len(x) // n])
    return tuple(out) + tuple(inputs[len(out) :])


def main(plan: str, model_file: str, out: str, exported: str | None = None) -> None:
    dist.init_process_group("gloo")
    mf = load_model_file(model_file)
    torch.manual_seed(0)
    # float64 unless the model's kernels refuse it (HF's grouped_mm experts take float32)
    dtype = getattr(torch, os.environ.get("APPLY_RANK_DTYPE", "float64"))
    # eval(): dropout draws other numbers on each rank (GPT-2's default config has it)
    model = mf.module.build_model().to(dtype).eval()
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in mf.module.example_inputs())
    ref = copy.deepcopy(model)
    if exported is None:
        applied = autoshard.apply(model, plan)
        local = applied.local_inputs(*inputs)
        differences = applied.styles.differences
    else:  # the user's copy of the exported function; the batch split as the map says
        runpy.run_path(exported)["parallelize"](model, device_type="cpu")
        local = batch_shard(load_sharding_map(plan), inputs)
        differences = []

    # a checkpointed block's parameters, named from the root, pass through its wrapper
    named = {n.replace(WRAPPED, ""): p for n, p in model.named_parameters()}
    # AdamW's first step is lr * g / (|g| + eps): its slope in g is at most lr / eps, so a
    # gradient that float32 rounds differently when summed in another order (a relative 5e-7
    # of the largest gradient on the Mixtral plan, whose smallest gradients are 1e-11) moves
    # its step by up to lr / eps times that rounding. torch's eps of 1e-8 turned a 3.5e-7
    # gradient error into a 1.1e-4 parameter one on one CPU; eps 1e-5 bounds the slope at
    # 1e3 (measured: 8.2e-6). float64 keeps torch's default.
    eps = 1e-8 if dtype == torch.float64 else 1e-5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=eps)
    loss = default_loss(model(*local), *local)
    loss.backward()
    grads = {n: full(p.grad).clone() for n, p in named.items()}
    opt.step()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=eps)
    ref_loss = default_loss(ref(*inputs), *inputs)
    ref_loss.backward()
    ref_opt.step()

    # the data-parallel ranks' local losses average to the global one
    seen = full(loss).detach().clone()
    dist.all_reduce(seen)
    seen /= dist.get_world_size()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    ref_params = dict(ref.named_parameters())
    report = {
        "loss": rel(seen, ref_loss.detach()),
        "grads": max(rel(g, ref_params[n].grad) for n, g in grads.items()),
        "params": max(rel(full(p.data), ref_params[n].data) for n, p in named.items()),
        "dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
        "placements": {
            n: [str(x) for x in p.placements] for n, p in named.items() if isinstance(p, DTensor)
        },
        "checkpointed": sorted(
            n for n, m in model.named_modules() if type(m).__name__.endswith("CheckpointWrapper")
        ),
        "differences": differences,
    }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
