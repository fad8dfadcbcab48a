"""Activation checkpointing as a decision (autoshard.cost.checkpointing).

The model: a stack of identical residual MLP blocks, ``x + fc2(relu(fc1(x)))``. Its
backward reads, inside each block, the ReLU's output (b x h, fp32: ``fc2``'s weight
gradient and the ReLU's own backward); the block's input (read by ``fc1``'s weight
gradient) comes from outside the block and stays. So a recomputed block frees exactly
``b * h * 4`` bytes between its forward and its backward: the reference below is what
autograd itself saves (``torch.autograd.graph.saved_tensors_hooks``) with and without
``torch.utils.checkpoint`` around each block.
"""

from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from helpers import LLAMA_SMALL, ROOT, block_stack, write_model
from torch import nn
from torch.distributed.tensor import Replicate
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard._torch_private import checkpoint_block
from autoshard.cost.liveness import activation_sizes, chosen_strategies, liveness
from autoshard.cost.memory import LiveMemory
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import MemoryBudgetError
from autoshard.model.model_file import load_model_file
from autoshard.plan.formats import ShardingMap
from autoshard.plan.styles import StylePlan, _checkpoint_lines, style_plan
from autoshard.solver.solve import SolveConfig, finish_plan, plan_model, strategies, trace
from autoshard.trace.selective import context_fn as sac_context
from autoshard.trace.selective import early_stops


def packet_name(target) -> str:
    return getattr(getattr(target, "overloadpacket", target), "__name__", str(target))


B, D, H = 512, 64, 1024  # the ReLU's output (512 x 1024 fp32, 2 MiB) dominates a block

STACK = """
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear({d}, {h})
        self.fc2 = nn.Linear({h}, {d})

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))
"""


def _stack(tmp_path, n: int):
    return write_model(tmp_path, block_stack(STACK.format(d=D, h=H), n, B, D), f"stack{n}")


def _saved_bytes(n: int, checkpoint: bool) -> int:
    """Bytes of activations autograd saves for the backward of the n-block stack
    (parameters left out; one count per storage)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(D, H), torch.nn.ReLU(), torch.nn.Linear(H, D))
        for _ in range(n)
    )
    params = {p.data_ptr() for p in blocks.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x = torch.randn(B, D)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for blk in blocks:
            if checkpoint:
                x = x + torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = x + blk(x)
    return sum(seen.values())


class _Count(TorchDispatchMode):
    """The aten ops run inside it, by overload packet name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _rerun_by_torch() -> collections.Counter:
    """The aten ops ``torch.utils.checkpoint`` (non-reentrant, torch's default early stop)
    runs again in the backward of one checkpointed ``x + fc2(relu(fc1(x)))`` block: what
    the backward runs with checkpointing, less what it runs without."""

    def block(x, fc1, fc2):
        return x + fc2(torch.relu(fc1(x)))

    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(D, H), nn.Linear(H, D)
    ran = []
    for wrap in (False, True):
        x = torch.randn(B, D, requires_grad=True)
        y = (
            torch.utils.checkpoint.checkpoint(block, x, fc1, fc2, use_reentrant=False)
            if wrap
            else block(x, fc1, fc2)
        )
        with _Count() as count:
            y.sum().backward()
        ran.append(count.ops)
    return ran[1] - ran[0]


def _planned_addmms(tmp_path, early_stop: bool, policy: str = "full") -> int:
    """The ``aten.addmm`` calls one block of the two-block residual MLP stack reruns under
    ``policy``, as the planner prices it."""
    cfg = SolveConfig(
        model_path=_stack(tmp_path, 2),
        mesh=MeshSpec.from_options("1"),
        checkpoint_early_stop=early_stop,
        activation_checkpointing=policy,
    )
    graph = trace(cfg)
    ck = strategies(cfg, graph).checkpointing
    (block, *_) = [b for b in ck.blocks if b.policy == policy]
    return sum(packet_name(graph.nodes[n].target) == "addmm" for n in block.forward)


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_launch_wrapper_reruns_what_the_plan_prices(tmp_path, early_stop):
    """``autoshard.apply``'s wrapper (``checkpoint_block``, torch's ``checkpoint_wrapper``)
    on one ``x + fc2(relu(fc1(x)))`` block reruns the matmuls the plan prices for the
    block: with the early stop fc1 alone, without it fc1 and fc2 (torch's own
    ``early_stop=False``)."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D))
    ran = []
    for wrapped in (block, checkpoint_block(copy.deepcopy(block), early_stop=early_stop)):
        x = torch.randn(B, D, requires_grad=True)
        y = x + wrapped(x)
        with _Count() as count:
            y.sum().backward()
        ran.append(count.ops)
    planned = _planned_addmms(tmp_path, early_stop)
    assert (ran[1] - ran[0])["addmm"] == planned == (1 if early_stop else 2)


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("early_stop", [True, False])
def test_the_exported_checkpointing_reruns_what_the_plan_prices(tmp_path, early_stop, policy):
    """The lines ``autoshard export --format torchtitan`` writes for a plan recomputing
    every block (in full, or selectively: torchtitan's rule saves no ``addmm``), run on a
    two-block stack: each block's backward reruns the matmuls the plan prices (fc1 alone
    with the early stop, fc1 and fc2 without)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: PLC0415
        checkpoint_wrapper,
    )

    sp = StylePlan(tp_dim=None, blocks=["layers.0", "layers.1"], container="layers")
    setattr(sp, "recompute" if policy == "full" else "selective", list(sp.blocks))
    sp.early_stop = {"full": early_stop, "selective": early_stop}
    body = "\n".join(_checkpoint_lines(sp))
    namespace = {"checkpoint_wrapper": checkpoint_wrapper, "sac_context": sac_context}
    exec(f"def parallelize(model):\n{body}\n", namespace)  # noqa: S102 - our own export
    torch.manual_seed(0)
    stack = nn.Module()
    stack.layers = nn.ModuleList(
        nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, D)) for _ in range(2)
    )
    ran = []
    for wrap in (False, True):
        model = copy.deepcopy(stack)
        if wrap:
            namespace["parallelize"](model)
        y = torch.randn(B, D, requires_grad=True)
        for layer in model.layers:
            y = y + layer(y)
        with _Count() as count:
            y.sum().backward()
        ran.append(count.ops)
    planned = _planned_addmms(tmp_path, early_stop, policy)
    assert (ran[1] - ran[0])["addmm"] == 2 * planned == 2 * (1 if early_stop else 2)


def test_the_export_gives_each_policy_its_own_early_stop():
    """A map recomputing one block in full without the early stop and one selectively with
    it (an old map's reading, :func:`early_stops`): the exported lines pass
    ``early_stop=False`` to the full block's wrapper only."""
    sp = StylePlan(tp_dim=None, blocks=["layers.0", "layers.1"], container="layers")
    sp.recompute, sp.selective = ["layers.0"], ["layers.1"]
    sp.early_stop = {"full": False, "selective": True}
    lines = _checkpoint_lines(sp)
    full = [line for line in lines if "checkpoint_wrapper(model.get_submodule(name)" in line]
    selective = [line for line in lines if "context_fn=sac_context" in line]
    assert len(full) == 1 and full[0].endswith("early_stop=False)")
    assert len(selective) == 1 and "early_stop" not in selective[0]
    sp.early_stop = {"full": True, "selective": False}
    lines = _checkpoint_lines(sp)
    assert sum("early_stop=False" in line for line in lines) == 1
    assert any("context_fn=sac_context, early_stop=False" in line for line in lines)


def test_a_file_without_the_early_stop_reads_as_it_was_priced(tmp_path):
    """A map or solution written before ``checkpoint_early_stop`` was priced with full
    recomputation rerunning the whole forward and selective recomputation stopping
    early: every reader takes it so. A new file's value round-trips through the
    solution's cost model."""
    assert early_stops({}) == {"full": False, "selective": True}
    assert early_stops({"checkpoint_early_stop": True}) == {"full": True, "selective": True}
    cfg = SolveConfig(
        model_path=_stack(tmp_path, 2), mesh=MeshSpec.from_options("1"), checkpoint_early_stop=False
    )
    solution = {"cost_model": cfg.cost_model(), "mesh": cfg.mesh.to_dict()}
    assert SolveConfig.from_solution(cfg.model_path, solution).checkpoint_early_stop is False
    del solution["cost_model"]["checkpoint_early_stop"]
    for predicted, stop in (({"recomputed_blocks": [0]}, False), ({"selective_blocks": [0]}, True)):
        solution["predicted"] = predicted
        assert SolveConfig.from_solution(cfg.model_path, solution).checkpoint_early_stop is stop
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))
    params = {n: (Replicate(),) for n, _ in model.named_parameters()}
    for predicted, stops in (
        ({"recomputed_blocks": [0]}, {"full": False, "selective": True}),
        (
            {"recomputed_blocks": [0], "checkpoint_early_stop": True},
            {"full": True, "selective": True},
        ),
    ):
        sp = style_plan(model, ShardingMap((1,), None, params, predicted=predicted))
        assert sp.recompute == ["layers.0"] and sp.early_stop == stops


def test_selective_recomputation_asked_for_recomputes_what_full_would(tmp_path):
    """On a block where the selective policy reruns what the full one does (torchtitan's
    rule saves no ``addmm``, and both stop before fc2), ``--activation-checkpointing
    selective`` still recomputes every block, selectively: the ILP's choice (auto) offers
    only the full policy for it, one name for one recomputation."""
    cfg = SolveConfig(
        model_path=_stack(tmp_path, 3),
        mesh=MeshSpec.from_options("1"),
        activation_checkpointing="selective",
    )
    plan = plan_model(cfg).plan
    assert plan.selective_blocks == [0, 1, 2] and plan.recomputed_blocks == []
    full = plan_model(replace(cfg, activation_checkpointing="full")).plan
    assert plan.recompute_s == pytest.approx(full.recompute_s) and plan.recompute_s > 0
    auto = strategies(replace(cfg, activation_checkpointing="auto"), trace(cfg)).checkpointing
    assert {b.policy for b in auto.blocks} == {"full"}


@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "whole-forward"])
def test_a_llama_block_reruns_what_torch_reruns(tmp_path, early_stop):
    """HuggingFace's Llama (2 layers), each decoder layer under torch's own
    ``checkpoint_wrapper`` (non-reentrant, torchtitan's full AC): the ops its backward runs
    beyond the plain backward are what autoshard's full policy reruns, counted by aten op
    for the matmuls, the attention kernel and the activation, in the plan's recomputed
    blocks. With the early stop, each block's forward up to its MLP's gate and up
    projections, not its down projection (its inputs are saved before it runs) nor the
    residual add; the last block's output, which the final norm reads from outside the
    checkpoint, is not recomputed either. Without it (torch's ``early_stop=False``,
    ``checkpoint_early_stop=False``) every forward op, 7 matmuls a block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: PLC0415
        checkpoint_wrapper,
    )

    path = write_model(tmp_path, LLAMA_SMALL, "llama_small")
    loaded = load_model_file(path)
    ran = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = loaded.module.build_model()
        if wrap:
            layers = model.model.layers
            for i in range(len(layers)):
                layers[i] = checkpoint_wrapper(layers[i], early_stop=early_stop)
        (ids,) = loaded.module.example_inputs()
        loss = model(ids).logits.float().mean()
        with _Count() as count:
            loss.backward()
        ran.append(count.ops)
    by_torch = ran[1] - ran[0]
    cfg = SolveConfig(
        model_path=path,
        mesh=MeshSpec.from_options("1"),
        checkpoint_early_stop=early_stop,
        activation_checkpointing="full",
    )
    graph = trace(cfg)
    blocks = [b for b in strategies(cfg, graph).checkpointing.blocks if b.policy == "full"]
    assert [b.layer for b in blocks] == [0, 1]
    planned = collections.Counter(
        packet_name(graph.nodes[n].target) for b in blocks for n in b.forward
    )
    kinds = ("mm", "silu", "_scaled_dot_product_flash_attention_for_cpu")
    assert {k: planned[k] for k in kinds} == {k: by_torch[k] for k in kinds}
    assert planned["mm"] == 2 * (6 if early_stop else 7)


def test_a_recomputed_block_frees_what_autograd_saves_inside_it(tmp_path):
    """Three blocks (no depth reduction): recomputing all of them frees, between forward
    and backward, what checkpointing frees in autograd: 3 x (512 x 1024 x 4 B) = 6 MiB."""
    n = 3
    freed_by_torch = _saved_bytes(n, False) - _saved_bytes(n, True)
    assert freed_by_torch == n * B * H * 4
    cfg = SolveConfig(model_path=_stack(tmp_path, n), mesh=MeshSpec.from_options("1"))
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    ck = sg.checkpointing
    assert [b.real for b in ck.blocks if b.policy == "full"] == [(0,), (1,), (2,)]
    choice = {r: 0 for r in sg.reps}
    keep = finish_plan(cfg, sg, choice, "keep", {})
    full = finish_plan(cfg, sg, choice, "full", ck.full())
    saved_keep = keep.extra["saved_activations"]
    assert saved_keep - full.extra["saved_activations"] == freed_by_torch
    # at every point of the step whole ReLU outputs are freed: all three between the last
    # forward and the first backward of a block; none in the first block's forward
    live = LiveMemory(sg, cfg.memory_model())
    freed = live.per_point(choice, {}) - live.per_point(choice, ck.full())
    assert set(np.round(freed / (B * H * 4), 9)) == {0.0, 1.0, 2.0, 3.0}
    assert full.activation_bytes < keep.activation_bytes
    assert full.recomputed_blocks == [0, 1, 2]
    # the time: three more forward passes of a block up to its early stop, as torch runs
    # them: fc1 and the ReLU, not fc2 (its inputs are saved before it runs) nor the add
    full_blocks = [b for b in ck.blocks if b.policy == "full"]
    one = ck.forward_seconds(sg, full_blocks[1], choice)
    assert full.recompute_s == pytest.approx(3 * one)
    assert full.step_time_s - keep.step_time_s == pytest.approx(3 * one)
    rerun = collections.Counter(packet_name(graph.nodes[n].target) for n in full_blocks[1].forward)
    by_torch = _rerun_by_torch()
    assert rerun["addmm"] == by_torch["addmm"] == 1
    assert rerun["relu"] == by_torch["relu"] == 1
    assert rerun["add"] == by_torch["add"] == 0
    roofline = sum(
        float(sg.nodes[n].compute_s[0])
        for n in full_blocks[1].forward
        if packet_name(graph.nodes[n].target) == "addmm"
    )
    assert roofline < one  # the matmul and, besides, the ReLU


@pytest.mark.slow
def test_a_budget_forces_checkpointing_on_some_blocks_and_not_others(tmp_path):
    """Eight blocks, traced as 0, 1, a middle block standing for 2-6, and 7. With a budget
    2.5 ReLU outputs under what keeping everything peaks at, three blocks must recompute
    (each frees one ReLU output at the peak, the start of the backward), and no more: each
    costs time. The ILP's counts are the cheapest of every count pair that fits."""
    cfg = SolveConfig(model_path=_stack(tmp_path, 8), mesh=MeshSpec.from_options("1"))
    keep = plan_model(replace(cfg, activation_checkpointing="none")).plan
    budget = keep.memory_bytes - 2.5 * B * H * 4
    with pytest.raises(MemoryBudgetError):
        plan_model(replace(cfg, activation_checkpointing="none", memory_budget=budget))
    result = plan_model(replace(cfg, activation_checkpointing="full", memory_budget=budget))
    assert len(result.plan.recomputed_blocks) == 8  # every block, as asked
    result = plan_model(replace(cfg, memory_budget=budget))
    plan = result.plan
    # the full policy stops before fc2 (its inputs are saved before it runs) as torch's
    # checkpoint does, so it reruns what the selective policy would (torchtitan's rule
    # saves no addmm): selective is the full policy under another name and is not offered
    assert len(plan.recomputed_blocks) == 3 and plan.selective_blocks == []
    assert plan.memory_bytes <= budget
    assert plan.step_time_s > keep.step_time_s
    # every count of the four traced blocks: the cheapest that fits is the ILP's
    sg = result.sg
    ck = sg.checkpointing
    assert {b.policy for b in ck.blocks} == {"full"}
    sizes = {b.layer: len(b.real) for b in ck.blocks}
    assert list(sizes.values()) == [1, 1, 5, 1]
    live, choice = LiveMemory(sg, cfg.memory_model()), result.ilp.choice
    best = None
    for ks in itertools.product(*[range(m + 1) for m in sizes.values()]):
        counts = {(layer, "full"): k for layer, k in zip(sizes, ks, strict=True)}
        if live.per_point(choice, counts).max() > budget * (1 + 1e-9):
            continue
        step = evaluate(sg, choice, counts)
        if best is None or step < best - 1e-12:
            best = step
    assert evaluate(sg, choice, result.ilp.recompute) == pytest.approx(best, rel=1e-9)


def test_full_recomputes_every_block_and_none_keeps_them(tmp_path):
    cfg = SolveConfig(model_path=_stack(tmp_path, 3), mesh=MeshSpec.from_options("2"))
    full = plan_model(replace(cfg, activation_checkpointing="full")).plan
    none = plan_model(replace(cfg, activation_checkpointing="none")).plan
    auto = plan_model(cfg).plan
    assert full.recomputed_blocks == [0, 1, 2] and full.recompute_s > 0
    assert none.recomputed_blocks == [] and none.sg.checkpointing is None
    assert auto.recomputed_blocks == []  # it fits: recomputing only costs time
    assert auto.step_time_s == pytest.approx(none.step_time_s, rel=1e-9)


@pytest.mark.slow
def test_a_traced_middle_block_keeps_as_much_at_the_turn_as_the_blocks_it_stands_for(
    monkeypatch,
):
    """GPT-2 with 6 blocks, traced once whole (--no-tie) and once depth-reduced (blocks
    0, 1, a middle block standing for 2-4, and 5): at the turn from forward to backward
    the bytes live are the same, every block keeping what its backward reads, also what
    it reads only through a view (GELU's tanh, attention's transposed inputs). Counting
    only the tensors the backward reads directly gave the reduced trace 4358 MiB against
    the whole one's 4934."""
    monkeypatch.setenv("AUTOSHARD_LAYERS", "6")
    cfg = SolveConfig(
        model_path=ROOT / "examples" / "gpt2.py",
        mesh=MeshSpec.from_options("1"),
        activation_checkpointing="none",
    )
    at_turn = []
    for tie in (True, False):
        c = replace(cfg, tie=tie)
        graph = trace(c)
        sg = strategies(c, graph)
        live = liveness(graph)
        sizes = activation_sizes(sg, chosen_strategies(sg, {r: 0 for r in sg.reps}), (1,))
        turn = next(i for i, info in enumerate(graph.nodes.values()) if info.backward)
        point = int(np.searchsorted(live.positions, turn))
        at_turn.append(float((live.points @ sizes)[point]))
    assert graph.depth is None  # the second trace is whole
    assert at_turn[0] == pytest.approx(at_turn[1], rel=1e-12)


def test_no_plan_fits_even_recomputing_so_the_error_names_the_least_memory(tmp_path):
    """A budget nothing meets: the error says what the least plan needs. Keeping every
    activation (``none``), that is the plan that keeps everything (one device, one plan);
    with recomputation allowed (``auto``) it is at most the plan recomputing every block,
    and below the other: the least-memory program with the checkpointing columns, whose
    bytes once left HiGHS calling it infeasible."""
    cfg = SolveConfig(model_path=_stack(tmp_path, 8), mesh=MeshSpec.from_options("1"))
    full = plan_model(replace(cfg, activation_checkpointing="full")).plan
    keep = plan_model(replace(cfg, activation_checkpointing="none")).plan
    with pytest.raises(MemoryBudgetError) as none:
        plan_model(replace(cfg, activation_checkpointing="none", memory_budget=1000.0))
    with pytest.raises(MemoryBudgetError) as auto:
        plan_model(replace(cfg, memory_budget=1000.0))
    assert none.value.least_bytes == pytest.approx(keep.memory_bytes, rel=1e-6)
    # the least over every plan that may recompute: no more than the time-optimal plan
    # recomputing every block, and under keeping everything
    assert auto.value.least_bytes <= full.memory_bytes * (1 + 1e-9)
    assert auto.value.least_bytes < none.value.least_bytes


@pytest.mark.slow
def test_a_llama_no_budget_fits_gets_the_least_memory_not_a_solver_error(monkeypatch):
    """The 7B Llama shape cut to 2 layers on 2x4 under 1 GiB per device: whatever it
    recomputes, no plan fits. The error is the budget's, with the least memory of any plan
    (recomputation included: no more than without it), not "HiGHS found no plan at all",
    which the least-memory program's bytes (1e9, of both signs) once made HiGHS say. The
    2x4 mesh is what shows it: with the bytes unscaled (planted in ``ilp._least_memory``)
    this test fails, and on a 1-D mesh of 4 it does not."""
    monkeypatch.setenv("AUTOSHARD_LAYERS", "2")
    cfg = SolveConfig(
        model_path=ROOT / "examples" / "llama.py",
        mesh=MeshSpec.from_options("2x4"),
        memory_budget=2.0**30,
    )
    with pytest.raises(MemoryBudgetError) as none:
        plan_model(replace(cfg, activation_checkpointing="none"))
    with pytest.raises(MemoryBudgetError) as auto:
        plan_model(cfg)
    assert 2**30 < auto.value.least_bytes <= none.value.least_bytes


def test_compare_shows_the_recomputation_its_step_adds(tmp_path):
    """``compare`` prices a step as compute + recompute + optimizer + exposed collectives
    (+ FSDP's copies for the plans FSDP runs, shown with the collectives and in the
    compute column): its JSON gives each part and they add up to the step, and its table
    shows the recomputation in its own column (it used to leave it out of both, so the parts it
    printed did not add up to the step it printed)."""
    import json

    from click.testing import CliRunner

    from autoshard.cli.main import main

    model = str(_stack(tmp_path, 3))
    args = ["compare", model, "--mesh", "2x2"]
    args += ["--activation-checkpointing", "full"]
    out = CliRunner().invoke(main, [*args, "--json"])
    assert out.exit_code == 0, out.output
    for row in json.loads(out.stdout)["plans"]:
        parts = row["compute_s"] + row["recompute_s"] + row["optimizer_s"] + row["fsdp_s"]
        assert (row["fsdp_s"] > 0) == (row["name"] in ("fsdp", "fsdp_tp")), row["name"]
        parts += sum(row["comm_s"].values()) - sum(row["hidden_s"].values())
        assert row["recompute_s"] > 0.01 * row["compute_s"], row["name"]
        assert row["step_time_s"] == pytest.approx(parts, rel=1e-12), row["name"]
    table = CliRunner().invoke(main, args, env={"COLUMNS": "80"})  # a narrow terminal's
    assert table.exit_code == 0, table.output
    assert "step = compute + recomp. + optim. + exposed" in table.stdout
    header = next(line for line in table.stdout.splitlines() if " step " in line)
    assert header.split() == "plan step compute recomp. optim. exposed MFU memory fits".split()
    assert "\u2026" not in table.stdout  # each row whole within 80 columns
    none = CliRunner().invoke(main, [*args[:-1], "none"])
    assert "step = compute + optim. + exposed" in none.output


def _preloaded(tmp_path, solved: SolveConfig, again: SolveConfig):
    """Solve ``solved``, write its solution, preload it under ``again``: (the solved
    plan, the preloaded plan, the preload's notes)."""
    from autoshard.plan.export import write_outputs
    from autoshard.solver.preload import plan_preloaded

    result = plan_model(solved)
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    pkl, _ = write_outputs(result.plan, out, "stack", solved.cost_model(), result.solver_stats())
    res, pre = plan_preloaded(again, pkl)
    return result.plan, res.plan, pre.notes


@pytest.mark.slow
def test_a_preloaded_recomputation_is_kept_or_its_change_is_said(tmp_path):
    """Preloading a plan keeps the blocks it recomputes, and says so where this run
    prices them otherwise: a selective recomputation this graph offers only in full (the
    same ops rerun: the price equals the solution's), no recomputation offered at all, or
    another early stop. Before, the first two dropped the recomputation without a word
    (a 3-block plan recomputing every block selectively came back recomputing none)."""
    cfg = SolveConfig(model_path=_stack(tmp_path, 3), mesh=MeshSpec.from_options("2"))
    full = replace(cfg, activation_checkpointing="full")
    solved, kept, notes = _preloaded(tmp_path, full, cfg)
    assert solved.recomputed_blocks == kept.recomputed_blocks == [0, 1, 2]
    assert kept.recompute_s == pytest.approx(solved.recompute_s, rel=1e-12) and notes == []

    # solved selectively; here (auto) the selective block is the full one: priced as full
    selective = replace(cfg, activation_checkpointing="selective")
    solved, moved, notes = _preloaded(tmp_path, selective, cfg)
    assert solved.selective_blocks == [0, 1, 2] and solved.recomputed_blocks == []
    assert moved.recomputed_blocks == [0, 1, 2] and moved.selective_blocks == []
    assert moved.recompute_s == pytest.approx(solved.recompute_s, rel=1e-12)
    assert moved.activation_bytes == pytest.approx(solved.activation_bytes, rel=1e-12)
    assert [n for n in notes if "selectively" in n] == [
        "the solution recomputes blocks 0-2 selectively; here their selective recomputation "
        "reruns their whole forward, so they are priced and written as recomputing in full "
        "(the same ops rerun)"
    ]

    # this run offers none: priced keeping the activations, and said
    solved, none, notes = _preloaded(tmp_path, full, replace(cfg, activation_checkpointing="none"))
    assert none.recomputed_blocks == [] and none.recompute_s == 0
    assert none.activation_bytes > solved.activation_bytes
    lost = "the solution recomputes blocks 0-2; this run offers no recomputation of them"
    assert any(n.startswith(lost) for n in notes), notes

    # a shallower model: the solution's last block is not in it (the run is auto already)
    shallow = replace(cfg, model_path=_stack(tmp_path, 2))
    _, fewer, notes = _preloaded(tmp_path, full, shallow)
    assert fewer.recomputed_blocks == [0, 1]
    assert [n for n in notes if "recomputes block" in n] == [
        "the solution recomputes block 2, which this model has not (or which frees nothing "
        "here): priced without its recomputation"
    ]

    # a deeper model: each block recomputes as the stored block it was matched with
    deep = replace(cfg, model_path=_stack(tmp_path, 6))
    _, deeper, notes = _preloaded(tmp_path, full, deep)
    assert deeper.recomputed_blocks == [0, 1, 2, 3, 4, 5]
    assert "blocks 3-5 recompute as the stored blocks they were matched with" in " ".join(notes)
    # solved selectively, onto the deeper model that offers only full for such blocks
    _, deeper, _ = _preloaded(tmp_path, selective, deep)
    assert deeper.recomputed_blocks == [0, 1, 2, 3, 4, 5] and deeper.selective_blocks == []

    # another early stop: this run's is priced (the rerun reaches fc2: more seconds)
    solved, whole, notes = _preloaded(tmp_path, full, replace(cfg, checkpoint_early_stop=False))
    assert whole.recomputed_blocks == [0, 1, 2] and whole.recompute_s > solved.recompute_s
    assert [n for n in notes if "early" in n or "whole forward" in n] == [
        "the solution's recomputation stops each block's rerun at the last op its backward "
        "reads; this run's, which reruns each block's whole forward, is priced and written "
        "instead: pass --checkpoint-early-stop to keep the solution's"
    ]


@pytest.mark.slow
def test_a_post_norm_block_keeps_its_output_the_next_block_reads(monkeypatch):
    """BERT's blocks are post-norm: each ends in a layer norm whose output the next block
    reads (``native_layer_norm_2``, ``_4``, ``_6`` for blocks 0-2; ``_1``, ``_3``, ``_5``
    normalise the attention's output inside each block). Recomputing a block frees its
    inner norm's output and keeps its last: a layer norm returns a tuple read through
    ``getitem``, and the readers through ``getitem`` count. Before (2026-12-07, sixth
    sitting) each block was credited with freeing its output too, the next block's input."""
    monkeypatch.setenv("AUTOSHARD_LAYERS", "3")
    cfg = SolveConfig(
        model_path=ROOT / "examples" / "bert.py",
        mesh=MeshSpec.from_options("1"),
        activation_checkpointing="full",
        tie=False,
    )
    graph = trace(cfg)
    sg = strategies(cfg, graph)
    live = liveness(graph)
    for block in sg.checkpointing.blocks:
        t = block.key[0]
        norms = sorted(n for n in (live.nodes[j] for j in block.saved) if "layer_norm" in n)
        assert norms == [f"native_layer_norm_{2 * t + 1}"], (block.key, norms)
