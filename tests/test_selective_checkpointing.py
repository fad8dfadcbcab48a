"""Op-level selective activation checkpointing (autoshard.trace.selective and the
selective policy of autoshard.cost.checkpointing), held against what PyTorch itself does.

The model: a stack of gated residual MLP blocks without biases,
``x + fc2(relu(fc1(x)) * fc3(x))``. Its forward calls ``aten.mm`` three times: ``fc1``
(the 1st, kept by the policy), ``fc3`` (the 2nd, recomputed) and ``fc2`` (the 3rd,
kept). Without checkpointing its backward holds the ReLU's output, ``fc3``'s output and
their product (three b x h tensors); under the policy the block holds ``fc1``'s output
(b x h) and ``fc2``'s (b x d) instead. The references are what PyTorch holds from forward
to backward (every storage an op produced that is still alive, torch's own
``create_selective_checkpoint_contexts`` deciding) and the matmul FLOPs its backward
runs (``FlopCounterMode``), with a policy written here from torchtitan's rule.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import replace

import pytest
import torch
from helpers import block_stack, write_model
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from torch.utils.flop_counter import FlopCounterMode

from autoshard.cost.mesh import MeshSpec
from autoshard.solver.solve import SolveConfig, finish_plan, plan_model, strategies, trace
from autoshard.trace.selective import saved_in_order

B, D, H = 512, 64, 1024

GATED = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h}, bias=False)
        self.fc3 = nn.Linear({d}, {h}, bias=False)
        self.fc2 = nn.Linear({h}, {d}, bias=False)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)) * self.fc3(x))
"""


def _gated(tmp_path, n: int):
    return write_model(tmp_path, block_stack(GATED.format(d=D, h=H), n, B, D), f"gated{n}")


class _Outputs(TorchFunctionMode):
    """Every storage a torch function call produced, weakly (an address the allocator
    reuses is another storage: the weak reference tells them apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                self.refs.append((StorageWeakRef(st), st.nbytes()))
        return out


def _torchtitan_policy():
    """torchtitan's op-level rule, written here from its description (not autoshard's
    code): save every other ``aten.mm`` (the odd calls), recompute everything else."""
    calls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        mode = "recompute" if ctx.is_recompute else "forward"
        if op is torch.ops.aten.mm.default:
            calls[mode] += 1
            if calls[mode] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _torch_step(n: int, how: str, early_stop: bool = True) -> tuple[int, float, float]:
    """One step of the n-block stack in eager PyTorch, each block as ``how`` says (none;
    full: non-reentrant checkpointing, torch's default, which stops its recomputation
    once every tensor the backward saved is back; reentrant: reentrant checkpointing,
    which reruns the whole forward, as Megatron-LM's; selective: non-reentrant, which it
    requires, stopping early or not as ``early_stop`` says): the bytes held from
    the forward to the backward (storages produced in the forward still alive;
    parameters, input and output left out), and the matmul FLOPs of the forward and of
    the backward."""
    torch.manual_seed(0)
    blocks = [
        torch.nn.ModuleDict(
            {
                "fc1": torch.nn.Linear(D, H, bias=False),
                "fc3": torch.nn.Linear(D, H, bias=False),
                "fc2": torch.nn.Linear(H, D, bias=False),
            }
        )
        for _ in range(n)
    ]

    def body(m, x):  # noqa: ANN001
        return m["fc2"](torch.relu(m["fc1"](x)) * m["fc3"](x))

    x = torch.randn(B, D, requires_grad=True)
    track = _Outputs()
    with FlopCounterMode(display=False) as fwd_flops, track:
        y = x
        for m in blocks:
            if how == "none":
                y = y + body(m, y)
            elif how == "full":  # up to the last tensor the backward saved
                y = y + checkpoint(body, m, y, use_reentrant=False)
            elif how == "reentrant":  # the whole forward again, as Megatron-LM recomputes
                y = y + checkpoint(body, m, y, use_reentrant=True)
            else:
                y = y + checkpoint(
                    body,
                    m,
                    y,
                    use_reentrant=False,
                    context_fn=_torchtitan_policy,
                    early_stop=early_stop,
                )
    gc.collect()
    skip = [*(p for m in blocks for p in m.parameters()), x, y]
    skip_ids = {StorageWeakRef(t.untyped_storage()).cdata for t in skip}
    live = {ref.cdata: nbytes for ref, nbytes in track.refs if not ref.expired()}
    held = sum(nbytes for cdata, nbytes in live.items() if cdata not in skip_ids)
    with FlopCounterMode(display=False) as bwd_flops:
        y.sum().backward()
    return held, fwd_flops.get_total_flops(), bwd_flops.get_total_flops()


def test_the_rule_keeps_odd_matmuls_and_attention():
    mm, sdpa = (
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
    relu, addmm = torch.ops.aten.relu.default, torch.ops.aten.addmm.default
    targets = [mm, relu, mm, sdpa, mm, addmm, mm]
    assert saved_in_order(targets) == [True, False, False, True, True, False, False]


@pytest.mark.slow
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "reentrant"])
def test_selective_frees_and_holds_what_pytorch_does(tmp_path, early_stop):
    """Three blocks, no depth reduction. The bytes the selective policy takes off the
    saved activations equal what PyTorch's selective checkpointing takes off what it holds
    between forward and backward; the same for full recomputation. The recomputed
    matmul FLOPs equal the FLOPs PyTorch's backward runs beyond the plain one: with the
    early stop (non-reentrant, torch's default) fc1 and fc3 run again, not fc2, whose
    inputs are saved before it runs; without it (``checkpoint_early_stop=False``, against
    reentrant checkpointing) all three."""
    n = 3
    full = "full" if early_stop else "reentrant"
    held = {how: _torch_step(n, how, early_stop) for how in ("none", full, "selective")}
    held["full"] = held[full]
    by_torch = {how: held["none"][0] - held[how][0] for how in ("full", "selective")}
    assert by_torch["full"] == n * 3 * B * H * 4  # sanity: relu, fc3 and their product
    assert by_torch["selective"] == n * (3 * B * H - B * H - B * D) * 4
    mm = 2 * B * D * H  # one of the three matmuls, forward
    assert held["full"][2] - held["none"][2] == n * (2 if early_stop else 3) * mm
    cfg = SolveConfig(
        model_path=_gated(tmp_path, n),
        mesh=MeshSpec.from_options("1"),
        checkpoint_early_stop=early_stop,
    )
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    ck = sg.checkpointing
    assert [(b.layer, b.policy) for b in ck.blocks] == [
        (t, p) for t in range(n) for p in ("full", "selective")
    ]
    choice = {r: 0 for r in sg.reps}
    keep = finish_plan(cfg, sg, choice, "keep", {})
    for how in ("full", "selective"):
        plan = finish_plan(cfg, sg, choice, how, ck.of_policy(how))
        freed = keep.extra["saved_activations"] - plan.extra["saved_activations"]
        assert freed == by_torch[how], how
        # the recomputation's matmuls: what torch's backward runs beyond the plain one
        extra_flops = held[how][2] - held["none"][2]
        planned = sum(
            graph.nodes[m].counted_flops for b in ck.blocks if b.policy == how for m in b.forward
        )
        assert planned == extra_flops, how
    selective = finish_plan(cfg, sg, choice, "sel", ck.of_policy("selective"))
    full = finish_plan(cfg, sg, choice, "full", ck.full())
    assert selective.selective_blocks == [0, 1, 2] and selective.recomputed_blocks == []
    assert 0 < selective.recompute_s < full.recompute_s
    assert keep.step_time_s < selective.step_time_s < full.step_time_s


@pytest.mark.slow
def test_the_ilp_picks_selective_where_it_fits_for_less_time(tmp_path):
    """Four blocks (traced 0, 1, a block standing for 2, and 3, or as the trace reduces
    them). A budget that one block's selective recomputation meets: the ILP recomputes one
    block selectively (cheaper than in full) and is the cheapest of every count pair that
    fits."""
    cfg = SolveConfig(model_path=_gated(tmp_path, 4), mesh=MeshSpec.from_options("1"))
    keep = plan_model(replace(cfg, activation_checkpointing="none")).plan
    budget = keep.memory_bytes - 0.5 * B * H * 4
    result = plan_model(replace(cfg, memory_budget=budget))
    plan = result.plan
    assert plan.memory_bytes <= budget
    assert len(plan.selective_blocks) == 1 and plan.recomputed_blocks == []
    sg = result.sg
    ck = sg.checkpointing
    layers = sorted({b.layer: len(b.real) for b in ck.blocks}.items())
    best = None
    for ks in itertools.product(
        *[[(f, s) for f in range(m + 1) for s in range(m + 1 - f)] for _, m in layers]
    ):
        counts = {}
        for (layer, _), (f, s) in zip(layers, ks, strict=True):
            counts[(layer, "full")], counts[(layer, "selective")] = f, s
        p = finish_plan(cfg, sg, result.ilp.choice, "try", counts)
        if p.memory_bytes <= budget and (best is None or p.step_time_s < best - 1e-12):
            best = p.step_time_s
    assert plan.step_time_s == pytest.approx(best, rel=1e-9)


def test_mode_selective_recomputes_every_block_selectively(tmp_path):
    cfg = SolveConfig(model_path=_gated(tmp_path, 3), mesh=MeshSpec.from_options("2"))
    plan = plan_model(replace(cfg, activation_checkpointing="selective")).plan
    assert plan.selective_blocks == [0, 1, 2] and plan.recomputed_blocks == []
    full = plan_model(replace(cfg, activation_checkpointing="full")).plan
    assert 0 < plan.recompute_s < full.recompute_s


def test_the_launch_policy_runs_in_pytorch_with_the_plain_gradients():
    """``autoshard.apply``'s wrapper (``checkpoint_block`` with the policy's
    ``context_fn``) on one gated block, in eager PyTorch: torch's selective checkpointing
    accepts the policy (its recomputation finds every op it kept) and the gradients are
    the plain block's. (FlopCounterMode around a wrapped module's backward trips torch's
    own check that the recomputation replays the forward: its module tracker adds ops.)"""
    from autoshard._torch_private import checkpoint_block
    from autoshard.trace.selective import context_fn

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(D, H, bias=False)
            self.fc3 = torch.nn.Linear(D, H, bias=False)
            self.fc2 = torch.nn.Linear(H, D, bias=False)

        def forward(self, x):  # noqa: ANN001
            return x + self.fc2(torch.relu(self.fc1(x)) * self.fc3(x))

    plain = Block()
    wrapped = checkpoint_block(Block(), context_fn)
    wrapped.load_state_dict(plain.state_dict())
    x = torch.randn(B, D)
    for m in (plain, wrapped):
        m(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
