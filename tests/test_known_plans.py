"""Plans whose optimum is known by hand (Alpa's golden cases, inference).

Linear layers trace to ``t(W)`` and ``addmm(b, x, t(W))``; ``nn.Linear``'s weight is
``[out_features, in_features]``, so column parallel (Megatron's first GEMM) shards the
weight's dim 0 and row parallel (the second GEMM) its dim 1.
"""

from __future__ import annotations

import pytest
from helpers import write_mlp
from torch.distributed.tensor import Replicate, Shard

from autoshard.cost.devices import get_device
from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import SolveConfig, plan_model

R = Replicate()


def _solve(path, mesh, inputs="free", outputs="free"):
    return plan_model(
        SolveConfig(
            model_path=path,
            mesh=mesh,
            input_placement=inputs,
            output_placement=outputs,
            mode="infer",
            device=get_device("h100"),  # the hand objectives are the datasheet's roofline
        )
    )


def test_mlp_with_free_inputs_is_data_parallel(tmp_path):
    """A large batch through a small MLP: splitting the batch costs no communication and
    divides every op's work by 4; any sharded weight would need a collective."""
    path = write_mlp(tmp_path, b=4096, d=1024, h=4096)
    result = _solve(path, MeshSpec.from_options("4"))
    plan = result.plan
    # the batch is split: x arrives split, or whole and sliced locally (free) by fc1
    assert plan.node_strategy["addmm"].inputs[1] == (Shard(0),)
    assert all(ps == (R,) for ps in plan.parameters.values()), plan.parameters
    assert plan.comm_total_s == 0.0 and not plan.collectives
    assert result.ilp.objective_s == pytest.approx(plan.compute_s, rel=1e-9)


def test_mlp_with_replicated_inputs_is_megatron_with_the_hand_objective(tmp_path):
    """Inputs and outputs replicated, hidden 32x the model width, 1-D mesh of 4, 1 us latency.

    Megatron (fc1 column parallel, fc2 row parallel, one all-reduce of the output)
    beats data parallel (every device reads all 256 MiB of weights: ~4x the compute) and
    column-column (an all-gather of the 2 MiB hidden activation plus one of the output).

    Hand objective, H100 roofline in fp32 (TF32 peak F, memory bandwidth M), b=16,
    d=1024, h=32768, n=4, 4-byte floats; each op costs max(flops / F, bytes / M):
      t(W1)   a view of the local [h/4, d] shard: 0
      addmm(b1, x, W1t) -> [b, h/4]:       flops 2*b*d*h/4,  bytes 4*(b*d + d*h/4 + h/4 + b*h/4)
      relu    [b, h/4]:                    flops b*h/4,      bytes 2*4*b*h/4
      t(W2)   a view of the local [d, h/4] shard: 0
      addmm(b2, g, W2t) -> partial [b, d]: flops 2*b*h/4*d,  bytes 4*(b*h/4 + h/4*d + d + b*d)
      all-reduce of the [b, d] output on n=4: 2*(n-1)*(alpha + 4*b*d/(n*bw))
    """
    b, d, h, n = 16, 1024, 32768, 4
    path = write_mlp(tmp_path, b=b, d=d, h=h)
    mesh = MeshSpec.from_options("4", intra_node_latency=1e-6)
    result = _solve(path, mesh, inputs="replicate", outputs="replicate")
    plan = result.plan
    assert plan.parameters["fc1.weight"] == (Shard(0),)
    # the bias is stored whole or split: either way fc1 reads its slice (slicing is free)
    assert plan.node_strategy["addmm"].inputs[0] == (Shard(0),)
    assert plan.parameters["fc2.weight"] == (Shard(1),)
    assert plan.parameters["fc2.bias"] == (R,)
    assert dict(plan.collectives) == {"all_reduce": 1}

    dev = get_device("h100")
    import torch

    F, M = dev.peak(torch.float32), dev.memory_bandwidth

    def op(flops, nbytes):
        return max(flops / F, nbytes / M)

    hl = h // n
    compute = (
        op(2 * b * d * hl, 4 * (b * d + d * hl + hl + b * hl))
        + op(b * hl, 2 * 4 * b * hl)
        + op(2 * b * hl * d, 4 * (b * hl + hl * d + d + b * d))
    )
    all_reduce = 2 * (n - 1) * (1e-6 + 4 * b * d / (n * mesh.bandwidth[0]))
    assert plan.compute_s == pytest.approx(compute, rel=1e-9)
    assert plan.comm_s == {"all_reduce": pytest.approx(all_reduce, rel=1e-9)}
    assert result.ilp.objective_s == pytest.approx(compute + all_reduce, rel=1e-9)
    assert result.ilp.status == "optimal" and result.ilp.gap == 0.0


def test_users_bandwidths_move_the_plan_between_mesh_dims(tmp_path):
    """The Megatron MLP on a 2x2 mesh, one dim fast (450 GB/s, 1 us), one slow (1 GB/s,
    20 us): tensor parallelism goes on the fast dim only (an all-reduce of the 64 KiB
    output on the slow dim costs 2 * (20 us + 32 us) = 104 us, more than the 19 us of
    weight reads a further split saves). Swapping the dims' numbers mirrors the plan."""
    path = write_mlp(tmp_path, b=16, d=1024, h=32768)
    fast, slow = (450e9, 1e-6), (1e9, 20e-6)

    def plan_for(dim0, dim1):
        mesh = MeshSpec((2, 2), ("a", "b"), (dim0[0], dim1[0]), (dim0[1], dim1[1]))
        return _solve(path, mesh, inputs="replicate", outputs="replicate").plan

    p01 = plan_for(slow, fast)
    p10 = plan_for(fast, slow)
    w = "fc1.weight"
    assert p01.parameters[w] != p10.parameters[w]
    assert p01.parameters[w] == (R, Shard(0))  # fast dim 1 carries the column split
    assert p10.parameters[w] == (Shard(0), R)  # fast dim 0 carries it after the swap
    for name, ps in p01.parameters.items():
        assert p10.parameters[name] == tuple(reversed(ps)), name
