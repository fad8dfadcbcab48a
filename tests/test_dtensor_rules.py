"""The rules autoshard gives DTensor where stage plans and ``--mode propagate`` let it place
activations (``autoshard/launch/dtensor_rules.py``),
in one process on a fake process group of 2 ranks (rank 0). Nothing here communicates:
every input is a shard or a replica each rank holds, and rank 0's local results are
compared with the same slice of the single-device result (an independent reference:
PyTorch's own SDPA and reshape on whole tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoshard import _torch_private as tp
from autoshard.launch.dtensor_rules import (
    register_cpu_flash_attention_rules,
    view_with_contiguous_local,
)


def test_grouped_query_attention_sharded_by_heads_equals_one_device() -> None:
    """4 query heads, 2 key/value heads on 2 ranks: rank 0 holds query heads 0-1, which
    read key/value head 0; the rule keeps them together (heads sharded, no exchange), and
    rank 0's output is heads 0-1 of the whole attention with ``enable_gqa``."""
    register_cpu_flash_attention_rules()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 16, 8, generator=g, dtype=torch.float64)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with tp.fake_mesh((2,)) as mesh:
        qd = DTensor.from_local(q[:, :2].contiguous(), mesh, [Shard(1)], run_check=False)
        kd = DTensor.from_local(k, mesh, [Replicate()], run_check=False)
        vd = DTensor.from_local(v, mesh, [Replicate()], run_check=False)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qd, kd, vd, 0.0, True)
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(out.to_local(), whole[:, :2], rtol=1e-12, atol=1e-12)


def test_reshape_of_a_shard_laid_out_unlike_its_global_tensor() -> None:
    """A DTensor whose global strides say contiguous while its shard is a strided slice
    (what a layout-following kernel gives after a redistribution): DTensor's reshape views
    the shard and fails; the stage graphs' reshape copies it first and gives rank 0's slice
    of the whole reshape."""
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)
    # rank 0's half of dim 2, laid out as the transpose of a contiguous (2, 2, 3, 5)
    local = x[:, :, :2].transpose(1, 2).contiguous().transpose(1, 2)
    reshape = torch.ops.aten.reshape.default
    with tp.fake_mesh((2,)) as mesh:
        xd = DTensor.from_local(
            local, mesh, [Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
        )
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            reshape(xd, [2, 3, -1])
        out = view_with_contiguous_local(reshape)(xd, [2, 3, -1])
        assert out.placements == (Shard(2),)
        torch.testing.assert_close(out.to_local(), x.reshape(2, 3, 20)[:, :, :10])
