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
    y, gx, gw, g1, g2 = huggingface(x, index, weights, w1, w2, grad)

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

    # EP·DP: 4 token chunks (dp outer, ep inner), each rank's experts exchanged over ep
    rows = slice((dp * 2 + ep) * T // 4, (dp * 2 + ep + 1) * T // 4)
    kw = dict(first_expert=ep * per, num_experts=E, exchange=Exchange(mesh.get_group(1), 2, ep))
    local = (x[rows], index[rows], weights[rows], w1[mine], w2[mine])
    compare("EP·DP output", experts_local(*local, "silu", **kw), y[rows])
    lx, lw, l1, l2 = experts_backward_local(grad[rows], *local, "silu", **kw)
    compare("EP·DP token gradient", lx, gx[rows])
    compare("EP·DP weight gradient", lw, gw[rows])
    compare("EP·DP expert gradients", summed(l1, 0), g1[mine])
    compare("EP·DP expert gradients", summed(l2, 0), g2[mine])

    # EPR·DP: 2 token chunks over dp, replicated over ep; the sum over ep is the output
    rows = slice(dp * T // 2, (dp + 1) * T // 2)
    kw = dict(first_expert=ep * per, num_experts=E)
    local = (x[rows], index[rows], weights[rows], w1[mine], w2[mine])
    compare("EPR·DP output", summed(experts_local(*local, "silu", **kw), 1), y[rows])
    lx, lw, l1, l2 = experts_backward_local(grad[rows], *local, "silu", **kw)
    compare("EPR·DP token gradient", summed(lx, 1), gx[rows])
    compare("EPR·DP weight gradient", summed(lw, 1), gw[rows])
    compare("EPR·DP expert gradients", summed(l1, 0), g1[mine])
    compare("EPR·DP expert gradients", summed(l2, 0), g2[mine])

    # skewed routing: every slot to expert 0 or to index E (which HuggingFace skips), so
    # the ep=1 ranks' experts receive no row at all
    skewed = torch.where(torch.rand(T, K) < 0.25, E, 0)
    y, gx, gw, g1, g2 = huggingface(x, skewed, weights, w1, w2, grad)
    rows = slice((dp * 2 + ep) * T // 4, (dp * 2 + ep + 1) * T // 4)
    kw = dict(first_expert=ep * per, num_experts=E, exchange=Exchange(mesh.get_group(1), 2, ep))
    local = (x[rows], skewed[rows], weights[rows], w1[mine], w2[mine])
    compare("skewed EP·DP output", experts_local(*local, "silu", **kw), y[rows])
    lx, lw, l1, l2 = experts_backward_local(grad[rows], *local, "silu", **kw)
    compare("skewed EP·DP token gradient", lx, gx[rows])
    compare("skewed EP·DP weight gradient", lw, gw[rows])
    compare("skewed EP·DP expert gradients", summed(l1, 0), g1[mine])
    compare("skewed EP·DP expert gradients", summed(l2, 0), g2[mine])

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, worst)
    if dist.get_rank() == 0:
        merged = {k: max(w[k] for w in every) for k in worst}
        with open(out, "w") as f:
            json.dump(merged, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
