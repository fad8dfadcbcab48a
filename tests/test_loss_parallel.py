"""Loss parallelism: cross-entropy over logits sharded by vocabulary
(:mod:`autoshard.strategies.loss_parallel`), priced as counted by hand and launched
against one device."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from helpers import LLAMA_SMALL, ranks, write_model

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import plan_baseline
from autoshard.strategies import loss_parallel as lp
from autoshard.strategies.rules import op_rule

# torchtitan's loss (tests/data/published/run_env.py): the float32 logits' cross-entropy
CE = """
def loss_fn(out, input_ids):
    return torch.nn.functional.cross_entropy(
        out.logits.flatten(0, 1).float(), input_ids.flatten(0, 1)
    )
"""
# LLAMA_SMALL with as many key/value heads as query heads, trained with CE
LLAMA_CE = LLAMA_SMALL.replace("num_key_value_heads=2", "num_key_value_heads=4") + CE
BW = 450e9


def _fsdp_tp(tmp_path, mesh: str):
    from test_hand_counts import _config

    path = write_model(tmp_path, LLAMA_CE, "llama_ce")
    spec = MeshSpec.from_options(mesh, None, intra_node_bw=BW, intra_node_latency=0.0)
    return plan_baseline(_config(path, spec, share_reshardings=True), "fsdp_tp").plan


def _modes(plan, target: str) -> list[tuple[str, ...]]:
    """The rule's choice per mesh dim of each ``target`` op of the plan."""
    fx = {n.name: n for n in plan.sg.graph.graph_module.graph.nodes}
    out = []
    for name, s in plan.node_strategy.items():
        info = plan.sg.graph.nodes.get(name)
        if info is not None and str(info.target) == target:
            out.append(op_rule(info.target).modes(fx[name], info.args, info.results, s))
    return out


@pytest.mark.slow
def test_fsdp_tp_s_cross_entropy_runs_on_the_vocabulary_shards(tmp_path):
    """torchtitan's FSDP + TP with its loss parallelism, on a 2x2 mesh: the LM head is a
    column and its logits stay sharded by vocabulary through the loss (``V`` on the TP
    dim for the four cross-entropy ops, the rows batch-sharded on dp), with no
    all-to-all anywhere. Over TP the forward's log-softmax all-reduces each row's
    maximum and its sum, and the backward's the sum of each row's gradient: one float32
    a row, 8 x 32 tokens over 2 dp ranks, 512 bytes each. The forward's third all-reduce
    over TP is the loss's (a partial sum over the vocabulary blocks)."""
    plan = _fsdp_tp(tmp_path, "2x2")
    ops = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")
    for op in ops:
        assert _modes(plan, f"aten.{op}.default") == [("S0", "V")], op
    own = {
        str(plan.sg.graph.nodes[n].target).split(".")[1]: s.collectives
        for n, s in plan.node_strategy.items()
        if n in plan.sg.graph.nodes and s.collectives
    }
    assert own == {
        "_log_softmax": (("all_reduce", 1, 512.0),) * 2,
        "_log_softmax_backward_data": (("all_reduce", 1, 512.0),),
    }
    steps = plan.collective_steps
    assert not [k for k in steps if k[1] == "all_to_all"], steps
    assert steps[("forward", "all_reduce", 1)] == 2 + 1
    # the backward's: the log-softmax's sum and the five norms' weight gradients
    assert steps[("backward", "all_reduce", 1)] == 1 + 5


@pytest.mark.slow
def test_the_vocabulary_parallel_loss_launches_as_planned_and_trains_like_one_device(tmp_path):
    """The plan above launched on 4 gloo ranks: each cross-entropy op runs its kernel on
    the vocabulary shards, the collectives seen equal the prediction, and two training
    steps match one device (loss, gradients and parameters)."""
    from test_launch_plan import assert_runs_the_plan, solve

    model = write_model(tmp_path, LLAMA_CE, "llama_ce")
    plan = solve(model, tmp_path, "2x2", "--algo", "fsdp_tp")
    out = ranks(4, str(plan), str(model), "--train", "--check", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert_runs_the_plan(out.stdout)


class _Ranks:
    """``n`` ranks of one mesh dim (``V``) simulated by threads: each all-reduce waits for
    every rank's tensor and returns their sum (or maximum), as the collective would."""

    def __init__(self, n: int) -> None:
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n)

    def context(self, rank: int) -> SimpleNamespace:
        def reduce(x: torch.Tensor, dim: int, how) -> torch.Tensor:
            assert dim == 0
            self.slots[rank] = x
            self.barrier.wait()
            out = how(torch.stack(self.slots), 0)
            self.barrier.wait()
            return out

        return SimpleNamespace(
            modes=("V",),
            rank=lambda dim: rank,
            size=lambda dim: self.n,
            all_reduce=lambda x, dim: reduce(x, dim, torch.sum),
            all_reduce_max=lambda x, dim: reduce(x, dim, lambda t, d: t.amax(d)),
        )

    def run(self, kernel, target, per_rank: list[list]) -> list:
        """``kernel`` on each rank's arguments, the results in rank order."""
        out: list = [None] * self.n

        def one(r: int) -> None:
            out[r] = kernel(target, per_rank[r], {}, self.context(r))

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_each_vocabulary_kernel_on_4_ranks_equals_aten_on_the_whole_tensor(dtype):
    """Each ``V`` kernel on 4 simulated ranks (the classes split in 4 blocks), against
    ATen on the whole tensor: the log-softmax (over the last dim and over dim 0) and its
    backward, concatenated; the loss, summed over the ranks (its ``Partial``), for each
    reduction, with targets equal to ``ignore_index`` (-100 and 3); its ``total_weight``,
    the same on every rank; and its gradient, concatenated. Exact in float64; in
    bfloat16 as close as ATen's own float32 reduction rounds (the kernels reduce in
    float32, as ATen does: in bfloat16 they were up to 0.12 off in 64 x 4096 logits).
    A target out of range fails, as in ATen."""
    aten, ranks, n = torch.ops.aten, _Ranks(4), 4
    # bfloat16: within one unit in the last place of ATen's (its float32 result rounded),
    # or half a unit at 1, the scale of the backward's operands, where it cancels to ~0
    exact = dict(rtol=0, atol=1e-12) if dtype == torch.float64 else dict(rtol=2**-7, atol=2**-8)
    torch.manual_seed(0)
    for dim in (1, 0):
        x = (torch.randn(64, 4096) * 5).to(dtype)
        x = x if dim == 1 else x.t().contiguous()
        ref = aten._log_softmax(x, dim, False)
        outs = ranks.run(lp._log_softmax_kernel, None, [[c, dim, False] for c in x.chunk(n, dim)])
        torch.testing.assert_close(torch.cat(outs, dim), ref, **exact)
        grad = torch.randn_like(ref)
        want = aten._log_softmax_backward_data(grad, ref, dim, dtype)
        pieces = zip(grad.chunk(n, dim), ref.chunk(n, dim), strict=True)
        outs = ranks.run(
            lp._log_softmax_backward_kernel, None, [[g, o, dim, dtype] for g, o in pieces]
        )
        torch.testing.assert_close(torch.cat(outs, dim), want, **exact)
    logp = aten._log_softmax(torch.randn(6, 12), 1, False).to(dtype)
    for ignore in (-100, 3):
        labels = torch.tensor([0, ignore, 11, 5, ignore, 7])
        for reduction in (0, 1, 2):
            loss, total = aten.nll_loss_forward(logp, labels, None, reduction, ignore)
            args = [[c, labels, None, reduction, ignore] for c in logp.chunk(n, 1)]
            outs = ranks.run(lp._nll_forward_kernel, None, args)
            summed = sum(o[0].double() for o in outs).to(dtype)
            torch.testing.assert_close(summed, loss, **exact)
            assert all(torch.equal(o[1], total) for o in outs), (reduction, outs)
            seed = torch.randn(6).to(dtype) if reduction == 0 else torch.tensor(1.7, dtype=dtype)
            want = aten.nll_loss_backward(seed, logp, labels, None, reduction, ignore, total)
            args = [[seed, c, labels, None, reduction, ignore, total] for c in logp.chunk(n, 1)]
            outs = ranks.run(lp._nll_backward_kernel, None, args)
            torch.testing.assert_close(torch.cat(outs, 1), want, rtol=0, atol=0)
    first = [logp.chunk(n, 1)[0], torch.tensor([12] * 6), None, 1, -100]  # 12 classes
    with pytest.raises(RuntimeError, match="a target is out of bounds"):
        lp._nll_forward_kernel(None, first, {}, ranks.context(0))


def test_a_scalar_log_softmax_is_only_replicated():
    """``_log_softmax`` of a 0-d tensor (which torch accepts) has one choice, ``R``: no
    dim to shard, and no error working out the softmax dim."""
    node = SimpleNamespace(target=torch.ops.aten._log_softmax.default, args=(None, 0, False))
    choices = lp.log_softmax_choices(node, [SimpleNamespace(shape=())], [None])
    assert [c.name for c in choices] == ["R"]
