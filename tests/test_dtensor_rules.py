"""The rules autoshard gives DTensor where stage plans and ``--mode propagate`` let it place
activations (``autoshard/launch/dtensor_rules.py``), in one process on a fake process group
of 2 ranks (this process is rank 0). Where values are compared, nothing is communicated:
every input is a shard or a replica rank 0 holds, and rank 0's local results are compared
with the same slice of the single-device result (an independent reference: PyTorch's own
SDPA, its autograd and reshape on whole tensors)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from autoshard import _torch_private as tp
from autoshard.launch.dtensor_rules import (
    embedding_reduced_once,
    register_launch_rules,
    view_with_contiguous_local,
)

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def qkv(batch: int = 2, heads: int = 4, kv_heads: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, 16, 8, generator=g, dtype=torch.float64)
    k = torch.randn(batch, kv_heads, 16, 8, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv_heads, 16, 8, generator=g, dtype=torch.float64)
    return q, k, v


def test_grouped_query_attention_sharded_by_heads_equals_one_device() -> None:
    """4 query heads, 2 key/value heads on 2 ranks: rank 0 holds query heads 0-1, which
    read key/value head 0; the rule keeps them together (heads sharded, no exchange), and
    rank 0's output is heads 0-1 of the whole attention with ``enable_gqa``; its backward
    gives heads 0-1 of the query's gradient and head 0 of the key's and value's."""
    register_launch_rules()
    q, k, v = qkv()
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*whole, is_causal=True, enable_gqa=True)
    grad_out = torch.randn_like(out_ref)
    out_ref.backward(grad_out)
    with tp.fake_mesh((2,)) as mesh:

        def place(t: torch.Tensor, p: object) -> DTensor:
            return DTensor.from_local(t, mesh, [p], run_check=False)

        qd = place(q[:, :2].contiguous(), Shard(1))
        kd, vd = place(k, Replicate()), place(v, Replicate())
        out, lse = FLASH(qd, kd, vd, 0.0, True)
        assert out.placements == (Shard(1),)
        torch.testing.assert_close(out.to_local(), out_ref[:, :2], rtol=1e-12, atol=1e-12)
        grads = FLASH_BACKWARD(
            place(grad_out[:, :2].contiguous(), Shard(1)), qd, kd, vd, out, lse, 0.0, True
        )
        assert [g.placements for g in grads] == [(Shard(1),)] * 3
        for got, ref, heads in zip(grads, whole, (2, 1, 1), strict=True):
            torch.testing.assert_close(got.to_local(), ref.grad[:, :heads], rtol=1e-12, atol=1e-12)


def test_a_batch_sharded_query_keeps_its_shard_beside_a_2d_mask() -> None:
    """A 2-D ``[L, S]`` mask broadcasts over batch and heads: a batch-sharded query stays
    sharded (no all-gather) and rank 0's output is the whole attention's batch row 0."""
    register_launch_rules()
    q, k, v = qkv(heads=2, kv_heads=2)
    mask = torch.randn(16, 16, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with tp.fake_mesh((2,)) as mesh:
        qd, kd, vd = (
            DTensor.from_local(t[:1], mesh, [Shard(0)], run_check=False) for t in (q, k, v)
        )
        with implicit_replication():  # a plain mask, as the stages and propagate meet it
            out, _ = FLASH(qd, kd, vd, 0.0, False, attn_mask=mask)
        assert out.placements == (Shard(0),)
        torch.testing.assert_close(out.to_local(), ref[:1], rtol=1e-12, atol=1e-12)


def test_the_decision_is_not_reused_for_another_mask() -> None:
    """DTensor caches a sharding decision per op and args; the rule reads the mask's
    shape, so a batch-sized mask after a broadcast one must not reuse the batch shard
    (its shard would not line up: "shape '[1, 1, 16, 16]' is invalid ...")."""
    register_launch_rules()
    q, k, v = qkv(heads=2, kv_heads=2)
    with tp.fake_mesh((2,)) as mesh:
        qd, kd, vd = (
            DTensor.from_local(t[:1], mesh, [Shard(0)], run_check=False) for t in (q, k, v)
        )
        with implicit_replication():
            broadcast = torch.zeros(1, 1, 16, 16, dtype=torch.float64)
            out, _ = FLASH(qd, kd, vd, 0.0, False, attn_mask=broadcast)
            assert out.placements == (Shard(0),)
            batch_sized = torch.zeros(2, 1, 16, 16, dtype=torch.float64)
            out, _ = FLASH(qd, kd, vd, 0.0, False, attn_mask=batch_sized)
            assert out.placements != (Shard(0),)


@pytest.mark.parametrize(
    "global_stride, local_layout",
    [
        # global contiguous; the shard laid out as the transpose of a contiguous (2, 2, 3, 5)
        (None, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        # global dims 0 and 1 swapped in memory (dims 2, 3 still merge); the same shard
        ((20, 40, 5, 1), lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        # global contiguous; the shard a strided slice (not dense)
        (None, lambda t: t),
    ],
)
def test_reshape_of_a_shard_laid_out_unlike_its_global_tensor(global_stride, local_layout) -> None:
    """A DTensor whose shard is not laid out as its global tensor (what a layout-following
    kernel gives after a redistribution): DTensor's reshape views the shard and fails; the
    stage graphs' reshape copies it first and gives rank 0's slice of the whole reshape."""
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)
    stride = global_stride or x.stride()
    local = local_layout(x[:, :, :2])  # rank 0's half of dim 2
    reshape = torch.ops.aten.reshape.default
    with tp.fake_mesh((2,)) as mesh:
        xd = DTensor.from_local(
            local, mesh, [Shard(2)], run_check=False, shape=x.shape, stride=stride
        )
        want = x.reshape(2, 3, 20)[:, :, :10]
        out = view_with_contiguous_local(reshape)(xd, [2, 3, -1])
        assert out.placements == (Shard(2),)
        torch.testing.assert_close(out.to_local(), want)


def test_dtensor_alone_fails_on_such_a_shard() -> None:
    """Why the copy is needed (torch 2.13): the first case above without it."""
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)
    local = x[:, :, :2].transpose(1, 2).contiguous().transpose(1, 2)
    with tp.fake_mesh((2,)) as mesh:
        xd = DTensor.from_local(
            local, mesh, [Shard(2)], run_check=False, shape=x.shape, stride=x.stride()
        )
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            torch.ops.aten.reshape.default(xd, [2, 3, -1])


def test_hf_grouped_matmul_column_and_row_parallel_equal_one_device() -> None:
    """HuggingFace's experts matmul (``transformers::grouped_mm_fallback``: rows grouped by
    expert, each group times its expert's weight) and its backward, with the weight split
    as Megatron splits a matmul, on 2 ranks, against autograd of the op on whole tensors.
    Column-parallel (output dim N): rank 0's columns of the product and of the weight's
    gradient, and a ``Partial`` input gradient whose two halves add up to the whole.
    Row-parallel (input dim K): a ``Partial`` product whose halves add up to the whole,
    and rank 0's rows of both gradients. Rank 1's halves are computed here from the whole
    tensors."""
    import transformers.integrations.moe  # noqa: F401  (defines the ops)

    from autoshard.launch.dtensor_rules import register_transformers_grouped_mm_rules

    assert register_transformers_grouped_mm_rules()
    op = torch.ops.transformers.grouped_mm_fallback.default
    op_backward = torch.ops.transformers.grouped_mm_fallback_backward.default
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64)  # 10 rows, K = 6
    w = torch.randn(3, 6, 4, generator=g, dtype=torch.float64)  # 3 experts, N = 4
    offs = torch.tensor([3, 3, 10])  # expert 1 gets no row
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    whole = op(xr, wr, offs)
    grad_out = torch.randn_like(whole)
    whole.backward(grad_out)
    whole = whole.detach()

    def c(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous()

    with tp.fake_mesh((2,)) as mesh:

        def place(t: torch.Tensor, p: object) -> DTensor:
            return DTensor.from_local(c(t), mesh, [p], run_check=False)

        xd, od, gd = place(x, Replicate()), place(offs, Replicate()), place(grad_out, Replicate())
        # column-parallel
        wd = place(w[:, :, :2], Shard(2))
        col = op(xd, wd, od)
        assert col.placements == (Shard(1),)
        torch.testing.assert_close(col.to_local(), whole[:, :2])
        gx, gw = op_backward(xd, wd, od, place(grad_out[:, :2], Shard(1)))
        assert (gx.placements, gw.placements) == ((Partial(),), (Shard(2),))
        torch.testing.assert_close(gw.to_local(), wr.grad[:, :, :2])
        gx_other, _ = op_backward(x, c(w[:, :, 2:]), offs, c(grad_out[:, 2:]))
        torch.testing.assert_close(gx.to_local() + gx_other, xr.grad)
        # row-parallel
        xk, wk = place(x[:, :3], Shard(1)), place(w[:, :3], Shard(1))
        row = op(xk, wk, od)
        assert row.placements == (Partial(),)
        torch.testing.assert_close(row.to_local() + op(c(x[:, 3:]), c(w[:, 3:]), offs), whole)
        gx, gw = op_backward(xk, wk, od, gd)
        assert (gx.placements, gw.placements) == ((Shard(1),), (Shard(1),))
        torch.testing.assert_close(gx.to_local(), xr.grad[:, :3])
        torch.testing.assert_close(gw.to_local(), wr.grad[:, :3])


EMBEDDING = torch.ops.aten.embedding.default


def _vocab_sharded_lookup(mesh) -> tuple[DTensor, DTensor, torch.Tensor]:
    """A 10-row table sharded by rows on 2 ranks (rank 0 holds rows 0-4) and ids from both
    halves; the reference is rank 0's part of the lookup before the sum: its rows, zeros
    for the other rank's (a fake process group's all-reduce leaves the local value)."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(10, 4, generator=g, dtype=torch.float64)
    ids = torch.tensor([[1, 7, 4], [9, 0, 5]])
    weight = DTensor.from_local(table[:5].clone(), mesh, [Shard(0)], run_check=False)
    rows = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
    ref = F.embedding(ids, table) * (ids < 5).unsqueeze(-1)
    return weight, rows, ref


def test_a_vocab_sharded_embedding_read_twice_fails_in_dtensor_alone() -> None:
    """The planted fault: DTensor reduces the embedding's masked pending sum in each
    consumer, and the second finds the mask released (a decoder's residual stream)."""
    with tp.fake_mesh((2,)) as mesh:
        weight, rows, _ = _vocab_sharded_lookup(mesh)
        out = EMBEDDING(weight, rows)
        assert tp.is_mask_partial(out.placements[0])
        out + 1.0  # noqa: B018 - the first consumer reduces it
        with pytest.raises(AssertionError):
            out * 2.0  # noqa: B018


def test_a_vocab_sharded_embedding_is_reduced_once_for_every_consumer() -> None:
    with tp.fake_mesh((2,)) as mesh:
        weight, rows, ref = _vocab_sharded_lookup(mesh)
        out = embedding_reduced_once(EMBEDDING)(weight, rows)
        assert out.placements == (Replicate(),)
        torch.testing.assert_close((out + 1.0).to_local(), ref + 1.0, rtol=0, atol=0)
        torch.testing.assert_close((out * 2.0).to_local(), ref * 2.0, rtol=0, atol=0)
        # any other placement, and a plain tensor, pass unchanged
        whole = DTensor.from_local(torch.zeros(10, 4), mesh, [Replicate()], run_check=False)
        assert embedding_reduced_once(EMBEDDING)(whole, rows).placements == (Replicate(),)
        plain = embedding_reduced_once(EMBEDDING)(torch.zeros(10, 4), rows.to_local())
        assert not isinstance(plain, DTensor)


def test_launch_rules_do_not_change_what_the_planner_sees() -> None:
    """A rule the launcher gives DTensor (here, the experts matmul's, registered by the
    test above or now) is not one of PyTorch's for the planner: an unfused experts matmul
    stays a replicated fallback whether or not this process launched anything."""
    import transformers.integrations.moe  # noqa: F401

    from autoshard.launch.dtensor_rules import register_transformers_grouped_mm_rules

    assert register_transformers_grouped_mm_rules()
    assert not tp.has_rule(torch.ops.transformers.grouped_mm_fallback.default)
    assert tp.has_rule(torch.ops.aten.mm.default)
