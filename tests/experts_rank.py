"""One rank of ``tests/test_experts.py``'s 2x2 kernel test: the experts op on a rank's shards
against HuggingFace's experts module on one device.

``torchrun --nproc-per-node 4 tests/experts_rank.py OUT``: every rank makes the same
tokens, routing and experts (float64, one seed), runs HuggingFace's ``MixtralExperts``
eagerly on all of them (output, then gradients), and then computes its own part
under two placements of a 2x2 mesh (dp, ep):

- ``EP·DP``: tokens split over both dims, experts split over ``ep`` and exchanged by
  all-to-all there; expert gradients summed over ``dp`` (its data-parallel reduction);
- ``EPR·DP``: tokens split over ``dp``, experts split over ``ep`` for replicated tokens;
  output and token gradients summed over ``ep`` (the ``Partial``), expert gradients over
  ``dp``.

and ``EP·DP`` again with skewed routing (every slot to expert 0, or to index ``E``, which
HuggingFace skips): half the ranks' experts receive no row. Each rank compares its rows
and its experts with the one-device result; rank 0 writes the largest differences to OUT
(JSON).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from autoshard.trace.experts import Exchange, experts_backward_local, experts_local

T, D, F, E, K = 16, 8, 6, 4, 2  # tokens, hidden, expert intermediate, experts, top-k


def huggingface(x, index, weights, w1, w2, grad):
    """HuggingFace's own experts module, eager on one device: output and gradients."""
    cfg = MixtralConfig(
        hidden_size=D, intermediate_size=F, num_local_experts=E, num_experts_per_tok=K
    )
    experts = MixtralExperts(cfg).double()
    with torch.no_grad():
        experts.gate_up_proj.copy_(w1)
        experts.down_proj.copy_(w2)
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    y = experts(x, index, weights)
    y.backward(grad)
    return y.detach(), x.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    x = torch.randn(T, D, dtype=torch.float64)
    index = torch.randint(0, E, (T, K))
    weights = torch.rand(T, K, dtype=torch.float64)
    w1 = torch.randn(E, 2 * F, D, dtype=torch.float64)
    w2 = torch.randn(E, D, F, dtype=torch.float64)
    grad = torch.randn(T, D, dtype=torch.float64)

    dp, ep = mesh.get_local_rank(0), mesh.get_local_rank(1)
    per = E // 2
    mine = slice(ep * per, (ep + 1) * per)
    worst: dict[str, float] = {}

    def compare(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        worst[name] = max(worst.get(name, 0.0), float((got - want).abs().max()))

    def summed(t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=mesh.get_group(dim))
        return t

    def check(tag: str, route: torch.Tensor, rows: slice, exchange: bool) -> None:
        """Compare this rank's part under one placement with HuggingFace's whole layer.
        ``exchange``: experts split over ep with tokens exchanged there (``EP``); else
        over ep for tokens replicated there (``EPR``: output and token gradients are the
        ``Partial`` sums over ep). Expert gradients are summed over dp (data parallel)."""
        want = huggingface(x, route, weights, w1, w2, grad)
        kw = dict(first_expert=ep * per, num_experts=E)
        if exchange:
            kw["exchange"] = Exchange(mesh.get_group(1), 2, ep)

        def over_ep(t: torch.Tensor) -> torch.Tensor:
            return t if exchange else summed(t, 1)

        local = (x[rows], route[rows], weights[rows], w1[mine], w2[mine])
        out = experts_local(*local, "silu", **kw)
        lx, lw, l1, l2 = experts_backward_local(grad[rows], *local, "silu", **kw)
        compare(f"{tag} output", over_ep(out), want[0][rows])
        compare(f"{tag} token gradient", over_ep(lx), want[1][rows])
        compare(f"{tag} weight gradient", over_ep(lw), want[2][rows])
        compare(f"{tag} expert gradients", summed(l1, 0), want[3][mine])
        compare(f"{tag} expert gradients", summed(l2, 0), want[4][mine])

    quarter = slice((dp * 2 + ep) * T // 4, (dp * 2 + ep + 1) * T // 4)  # dp outer, ep inner
    check("EP·DP", index, quarter, exchange=True)
    check("EPR·DP", index, slice(dp * T // 2, (dp + 1) * T // 2), exchange=False)
    # skewed routing: every slot to expert 0 or to index E (which HuggingFace skips), so
    # the ep=1 ranks' experts receive no row at all
    check("skewed EP·DP", torch.where(torch.rand(T, K) < 0.25, E, 0), quarter, exchange=True)

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, worst)
    if dist.get_rank() == 0:
        merged = {k: max(w[k] for w in every) for k in worst}
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
