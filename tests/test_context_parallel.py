"""Context parallelism (``--context-parallel``): attention sharded by sequence, its keys
and values all-gathered over the mesh dim in the forward and again in the backward, their
gradients reduce-scattered (torchtitan's all-gather CP, Llama 3's: Grattafiori et al.
2024, section 3.3.2).

Independent references: the ring all-gather and reduce-scatter formulas worked by hand
(NCCL tests, PERFORMANCE.md: ``(n - 1) (alpha + B / (n bw))`` each), the counts a launch
sees, and a single-device run in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ROOT, autoshard_cli, ranks
from test_launch_plan import LOWERED_OK, STEP2_OK, assert_runs_the_plan
from torch.distributed.tensor import Replicate, Shard

import autoshard
from autoshard.cost.collective_table import collective
from autoshard.cost.mesh import DEFAULT_INTRA_NODE_BW, DEFAULT_INTRA_NODE_LATENCY
from autoshard.model.model_file import instantiate, load_model_file
from autoshard.plan.report import in_op_line, in_op_summary
from autoshard.strategies.rules import op_rule
from autoshard.trace.attention import FLASH_BACKWARD, FLASH_FORWARD
from autoshard.trace.tracer import TensorInfo

MODEL = ROOT / "tests" / "data" / "long_llama.py"
FORWARD, BACKWARD = str(FLASH_FORWARD), str(FLASH_BACKWARD)


def _solve(monkeypatch, batch: int, seq: int, **options):
    """The 2-layer, 4-head Llama of ``MODEL`` on 8 devices (one node), bf16 mixed."""
    monkeypatch.setenv("AUTOSHARD_BATCH", str(batch))
    monkeypatch.setenv("AUTOSHARD_SEQ", str(seq))
    monkeypatch.setenv("AUTOSHARD_HEADS", "4")
    loaded = instantiate(load_model_file(MODEL), device="meta")
    return autoshard.solve(loaded.module, loaded.inputs, "8", precision="bf16-mixed", **options)


def _ring(n: int, nbytes: float) -> float:
    """One ring all-gather or reduce-scatter of ``nbytes`` (the whole) on ``n`` devices."""
    alpha, bw = DEFAULT_INTRA_NODE_LATENCY, DEFAULT_INTRA_NODE_BW
    return (n - 1) * (alpha + nbytes / (n * bw))


Q = TensorInfo((2, 4, 64, 8), torch.float32)  # [B, H, S, D] of the pricing tests
LSE = TensorInfo((2, 4, 64), torch.float32)
RATE = 32.768e9  # FLOP/s: a 16 x 16 block of Q's shapes forward is 2 us


def _node(target, causal: bool = True):
    """A stand-in for a traced attention node: ``is_causal`` where the op has it."""
    at = 7 if target is FLASH_BACKWARD else 4
    return type("Node", (), {"target": target, "args": (None,) * at + (causal,), "kwargs": {}})()


def _matmul_rate(flops, nbytes, dtype, kind, per=None):
    """``compute_time`` at :data:`RATE`; a split sequence's kernel is blockwise or masked,
    never priced at the calibrated causal rate."""
    assert kind == "matmul"
    return flops / RATE


@pytest.mark.slow
def test_one_long_sequence_is_split_by_sequence_and_many_short_ones_by_batch(monkeypatch):
    """One sequence of 32,768 tokens and 4 heads on 8 devices: batch and heads split
    attention 4 ways at most, the sequence 8 ways, and the search takes it. Per layer the
    forward gathers the keys and the values (``[1, 4, S, 64]`` bf16 each), the backward
    gathers them again and reduce-scatters their gradients: 4 all-gathers in the forward,
    4 and 4 reduce-scatters in the backward over the 2 layers. Eight sequences of 2,048:
    the batch splits 8 ways with nothing to exchange, and no attention is split by
    sequence."""
    long = _solve(monkeypatch, 1, 32768, context_parallel="all-gather")
    one = _ring(8, 1 * 4 * 32768 * 64 * 2)
    assert in_op_summary(long.plan) == {
        FORWARD: {
            "nodes": 2,
            "modes": {"d0: S2": 2},
            "collectives": {"all_gather": 4},
            "seconds": pytest.approx(4 * one, rel=1e-12),
            "exposed_seconds": pytest.approx(4 * one, rel=1e-12),
        },
        BACKWARD: {
            "nodes": 2,
            "modes": {"d0: S2": 2},
            "collectives": {"all_gather": 4, "reduce_scatter": 4},
            "seconds": pytest.approx(8 * one, rel=1e-12),
            "exposed_seconds": pytest.approx(8 * one, rel=1e-12),
        },
    }
    without = _solve(monkeypatch, 1, 32768)
    assert in_op_summary(without.plan) == {}
    assert long.plan.step_time_s < without.plan.step_time_s
    short = _solve(monkeypatch, 8, 2048, context_parallel=True)  # either exchange
    assert in_op_summary(short.plan) == {}


def test_the_sequence_split_is_offered_only_when_asked_and_only_without_a_mask():
    """On a 2 x 4 mesh: batch on dim 0, sequence on dim 1 gathers on dim 1 the keys and
    values of half the batch; no strategy shards the sequence on two dims, and none with
    an attention mask (a mask's rows would need the query's offset)."""
    rule = op_rule(FLASH_FORWARD)
    q = TensorInfo((2, 4, 64, 8), torch.float32)
    lse = TensorInfo((2, 4, 64), torch.float32)
    node = type("Node", (), {"target": FLASH_FORWARD, "args": (), "kwargs": {}})()
    plain = rule.generate(node, [q, q, q], [q, lse], (2, 4))
    assert not any(Shard(2) in s.inputs[0] for s in plain)
    cp = rule.generate(node, [q, q, q], [q, lse], (2, 4), frozenset({"context_parallel"}))
    split = [s for s in cp if Shard(2) in s.inputs[0]]
    assert all(s.inputs[0].count(Shard(2)) == 1 for s in split)
    (batch_seq,) = [s for s in split if s.inputs[0] == (Shard(0), Shard(2))]
    half = float(1 * 4 * 64 * 8 * 4)  # [B/2, H, S, D] fp32, gathered whole in S on dim 1
    assert batch_seq.collectives == (("all_gather", 1, half), ("all_gather", 1, half))
    assert batch_seq.outputs == ((Shard(0), Shard(2)), (Shard(0), Shard(2)))
    # one sequence: the batch split is replication, so its pair with the sequence split is
    # one strategy, with the whole batch's bytes (not a second one priced at 0 bytes)
    one = TensorInfo((1, 4, 64, 8), torch.float32)
    lse1 = TensorInfo((1, 4, 64), torch.float32)
    cp1 = rule.generate(node, [one] * 3, [one, lse1], (2, 4), frozenset({"context_parallel"}))
    seq_on_1 = [s for s in set(cp1) if s.inputs[0] == (Replicate(), Shard(2))]
    assert [s.collectives for s in seq_on_1] == [(("all_gather", 1, 8192.0),) * 2]
    masked = rule.generate(node, [q, q, q, q], [q, lse], (2, 4), frozenset({"context_parallel"}))
    assert not any(Shard(2) in s.inputs[0] for s in masked)


@pytest.mark.slow
@pytest.mark.parametrize(
    "exchange, mode, counts, seq",
    [
        ("all-gather", "S2", {"all_gather": 4}, 512),  # keys and values, 2 layers
        ("ring", "S2r", {"send_recv": 6}, 512),  # 3 passes a layer, 2 layers
        ("zigzag", "S2z", {"send_recv": 10}, 2048),  # moved in, 3 passes, moved back
    ],
)
def test_a_context_parallel_plan_launches_on_4_gloo_ranks_like_one_device(
    tmp_path: Path, exchange: str, mode: str, counts: dict, seq: int
):
    """One sequence of 512 tokens (2048 for the zig-zag, whose moves in and out pay
    back only where attention is a larger share of the step), one head, 4 ranks, links of
    10 ns: the sequence split is the only way to spread attention, and the plan takes
    it. All-gather: each rank attends its queries to the gathered keys under a causal mask
    offset by its block; the
    gradients of the keys and values are reduce-scattered. Ring: each rank attends its
    queries to the key/value blocks passed to it (skipping later ranks' blocks), and the
    blocks' gradients travel home around the ring. Zig-zag: the ring on chunks ``j`` and
    ``7 - j`` of 8, moved there and back in the op. Collectives seen equal the plan's per
    phase, kind and mesh dim (the in-op ones among them: send/recvs in the collective log,
    which CommDebugMode does not count), the lowered step records them, and loss,
    gradients and parameters equal one device's in float64."""
    env = {"AUTOSHARD_SEQ": str(seq), "AUTOSHARD_HEADS": "1", "AUTOSHARD_BATCH": "1"}
    args = ["solve", str(MODEL), "--mesh", "4", "--intra-node-latency", "10ns"]
    out = autoshard_cli(
        *args, "--context-parallel", exchange, "--out", str(tmp_path), "--json", **env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    in_op = json.loads(out.stdout)["in_op_collectives"]
    assert in_op[FORWARD]["modes"] == {f"d0: {mode}": 2}, in_op
    assert in_op[FORWARD]["collectives"] == counts, in_op
    plan = next(tmp_path.glob("*.json"))
    run = ranks(4, str(plan), str(MODEL), "--train", "--check", "--steps", "2", **env)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert_runs_the_plan(run.stdout)
    assert LOWERED_OK in run.stdout and STEP2_OK.search(run.stdout), run.stdout


def test_a_sequence_split_is_priced_as_the_masked_kernel_it_runs():
    """4 devices, 64 tokens: a device's 16 queries against the 64 gathered keys, the FLOPs
    ``FlopCounterMode``'s formula gives for those shapes (forward ``4 B H S_q S_k D``), at the
    matmul rate: the kernel runs with an explicit mask, so never at a calibrated causal
    attention rate, which the unsplit causal op gets."""
    rule = op_rule(FLASH_FORWARD)
    q = TensorInfo((2, 4, 64, 8), torch.float32)
    lse = TensorInfo((2, 4, 64), torch.float32)
    node = type(
        "Node", (), {"target": FLASH_FORWARD, "args": (None,) * 4 + (True,), "kwargs": {}}
    )()
    info = type("Info", (), {"args": [q, q, q], "results": [q, lse]})()
    seen = []

    def compute_time(flops, nbytes, dtype, kind, per=None):
        seen.append((kind, flops))
        return 0.0

    strategies = rule.generate(node, [q] * 3, [q, lse], (4,), frozenset({"context_parallel"}))
    by_mode = {rule.modes(node, [q] * 3, [q, lse], s): s for s in strategies}
    for mode in (("R",), ("S2",)):
        rule.compute_cost(node, info, by_mode[mode], (4,), compute_time)
    assert seen == [
        ("attention_forward", 4 * 2 * 4 * 64 * 64 * 8),
        ("matmul", 4 * 2 * 4 * 16 * 64 * 8),
    ]


def test_a_ring_is_priced_block_by_block_its_passes_exposed_by_hand():
    """4 devices, causal attention over 64 tokens ([2, 4, 64, 8] fp32), links of 0.5 us
    and 8.192 GB/s, compute at 32.768 GFLOP/s. A device's block of 16 queries against 16
    keys is ``4 B H 16 16 D`` FLOPs forward (``FlopCounterMode``'s formula for the
    shapes), 2 us; the last device computes its own block (half of it masked, 1 us),
    then 3 whole ones: 7 us. Each pass sends a device's key and value blocks (8 KiB): 1.5
    us. Forward: 3 passes; backward (``sdpa_backward_flop_count`` for the block, 2.5x the
    forward's): 3 key/value passes and 4 gradient passes. None hidden: the kernel waits
    for each pass before the next block (no rule ``hidden``)."""
    from torch.utils.flop_counter import sdpa_backward_flop_count

    rule, back = op_rule(FLASH_FORWARD), op_rule(FLASH_BACKWARD)
    q, lse, rate, compute_time = Q, LSE, RATE, _matmul_rate
    fwd, bwd = _node(FLASH_FORWARD), _node(FLASH_BACKWARD)
    feature = frozenset({"context_parallel_ring"})
    (ring,) = [s for s in rule.generate(fwd, [q] * 3, [q, lse], (4,), feature) if s.collectives]
    kv = 2 * (2 * 4 * 64 * 8 * 4.0)  # key and value, whole in the sequence
    assert ring.collectives == (("send_recv", 0, kv),) * 3
    assert rule.modes(fwd, [q] * 3, [q, lse], ring, (4,)) == ("S2r",)
    with pytest.raises(ValueError, match="no choice of its rule on mesh"):
        rule.modes(fwd, [q] * 3, [q, lse], ring, (2,))  # 3 passes is no ring of 2 devices
    info = type("Info", (), {"args": [q] * 3, "results": [q, lse]})()
    c = 4 * 2 * 4 * 16 * 16 * 8 / rate
    assert c == pytest.approx(2e-6, rel=1e-12)
    assert rule.compute_cost(fwd, info, ring, (4,), compute_time) == pytest.approx(3.5 * c)
    assert rule.hidden is None and back.hidden is None

    six = [q, q, q, q, q, lse]  # grad_out, query, key, value, out, logsumexp
    (ring_b,) = [s for s in back.generate(bwd, six, [q, q, q], (4,), feature) if s.collectives]
    assert ring_b.collectives == (("send_recv", 0, kv),) * 7
    info_b = type("Info", (), {"args": six, "results": [q, q, q]})()
    block = (2, 4, 16, 8)
    cb = sdpa_backward_flop_count(block, block, block, block) / rate
    assert cb == pytest.approx(2.5 * c, rel=1e-12)
    assert back.compute_cost(bwd, info_b, ring_b, (4,), compute_time) == pytest.approx(3.5 * cb)


def test_a_zigzag_ring_is_priced_half_a_block_a_step_by_hand():
    """The shapes, links and rate of the test above, the zig-zag layout: every device
    holds chunks ``j`` and ``7 - j`` of 8, so each step it computes half a block (two of
    its four chunk pairs, or the diagonal's halves and one pair): 4 steps of 1 us
    forward, against the plain ring's 7 us. Around the ring's passes, one send/recv moves
    the query, key and value half-blocks into the layout (12 KiB a device: 2 us) and one
    moves the output and log-sum-exp back (4.5 KiB: 1.0625 us). Backward:
    in go the output's gradient, query, key, value, output and log-sum-exp, back the three
    gradients; each of its 4 steps is half a backward block. Offered only for causal
    attention over ``2n`` equal chunks."""
    rule, back = op_rule(FLASH_FORWARD), op_rule(FLASH_BACKWARD)
    q, lse, rate, compute_time = Q, LSE, RATE, _matmul_rate
    fwd, bwd = _node(FLASH_FORWARD), _node(FLASH_BACKWARD)
    feature = frozenset({"context_parallel_zigzag"})
    (zz,) = [s for s in rule.generate(fwd, [q] * 3, [q, lse], (4,), feature) if s.collectives]
    kv = 2 * (2 * 4 * 64 * 8 * 4.0)
    qkv, out_lse = 3 * 2 * 4 * 64 * 8 * 4.0, 2 * 4 * 64 * 8 * 4.0 + 2 * 4 * 64 * 4.0
    assert zz.collectives == (
        ("send_recv", 0, qkv),
        *(("send_recv", 0, kv),) * 3,
        ("send_recv", 0, out_lse),
    )
    assert rule.modes(fwd, [q] * 3, [q, lse], zz, (4,)) == ("S2z",)
    info = type("Info", (), {"args": [q] * 3, "results": [q, lse]})()
    c = 4 * 2 * 4 * 16 * 16 * 8 / rate  # one device's queries against one device's keys
    assert rule.compute_cost(fwd, info, zz, (4,), compute_time) == pytest.approx(2 * c)
    send_recv = collective("send_recv")  # the table's row prices each entry
    priced = [send_recv.seconds(4, 0.5e-6, 8.192e9, b) for _, _, b in zz.collectives]
    assert priced == pytest.approx([2e-6, 1.5e-6, 1.5e-6, 1.5e-6, 1.0625e-6], rel=1e-12)

    six = [q, q, q, q, q, lse]
    (zz_b,) = [s for s in back.generate(bwd, six, [q, q, q], (4,), feature) if s.collectives]
    assert zz_b.collectives == (
        ("send_recv", 0, 5 * 2 * 4 * 64 * 8 * 4.0 + 2 * 4 * 64 * 4.0),
        *(("send_recv", 0, kv),) * 7,
        ("send_recv", 0, qkv),
    )
    info_b = type("Info", (), {"args": six, "results": [q, q, q]})()
    cb = 2.5 * c  # sdpa_backward_flop_count of a block, 2.5x the forward's
    assert back.compute_cost(bwd, info_b, zz_b, (4,), compute_time) == pytest.approx(2 * cb)

    full = _node(FLASH_FORWARD, causal=False)
    assert not [s for s in rule.generate(full, [q] * 3, [q, lse], (4,), feature) if s.collectives]
    odd = TensorInfo((2, 4, 36, 8), torch.float32)  # 36 tokens: 4 blocks, not 8 chunks
    odd_lse = TensorInfo((2, 4, 36), torch.float32)
    assert not [
        s for s in rule.generate(fwd, [odd] * 3, [odd, odd_lse], (4,), feature) if s.collectives
    ]


@pytest.mark.slow
def test_the_ring_is_taken_for_one_long_sequence_its_passes_exposed(monkeypatch):
    """The long sequence of the test above: with the ring offered, the search takes it (it
    skips the blocks a causal mask hides), 7 passes a layer forward and 15 backward on 8
    devices, all their seconds exposed (the kernel waits for each pass), and a step
    faster than the all-gather's plan. The zig-zag ring, whose devices share the causal
    work evenly, makes a faster step still; with every exchange offered the search takes
    it at least for the backward (2.5 times the forward's work, so the balance saves most
    there: 17 send/recvs an op), for a step no slower than either ring alone (forward and
    backward may choose apart: both place every tensor alike)."""
    ring = _solve(monkeypatch, 1, 32768, context_parallel="ring")
    summary = in_op_summary(ring.plan)
    assert summary[FORWARD]["modes"] == {"d0: S2r": 2}
    assert summary[FORWARD]["collectives"] == {"send_recv": 14}
    assert summary[BACKWARD]["collectives"] == {"send_recv": 30}
    for e in summary.values():  # the kernel waits for each pass: none hidden
        assert e["seconds"] > 0
        assert e["exposed_seconds"] == pytest.approx(e["seconds"], rel=1e-12)
    line = in_op_line(ring.plan)
    assert "14 send/recvs (7 an op)" in line and "30 send/recvs (15 an op)" in line, line
    assert "hidden under the op" not in line, line
    gathered = _solve(monkeypatch, 1, 32768, context_parallel="all-gather")
    assert ring.plan.step_time_s < gathered.plan.step_time_s
    zigzag = _solve(monkeypatch, 1, 32768, context_parallel="zigzag")
    summary = in_op_summary(zigzag.plan)
    assert summary[FORWARD]["modes"] == {"d0: S2z": 2}
    assert summary[FORWARD]["collectives"] == {"send_recv": 18}
    assert summary[BACKWARD]["collectives"] == {"send_recv": 34}
    assert zigzag.plan.step_time_s < ring.plan.step_time_s
    best = _solve(monkeypatch, 1, 32768, context_parallel=True)
    assert in_op_summary(best.plan)[BACKWARD]["modes"] == {"d0: S2z": 2}
    assert best.plan.step_time_s <= zigzag.plan.step_time_s * (1 + 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize(
    "exchange, mode, seq",
    [("all-gather", "S2", 512), ("ring", "S2r", 512), ("zigzag", "S2z", 2048)],
)
def test_a_preloaded_solution_keeps_its_exchange(
    tmp_path: Path, exchange: str, mode: str, seq: int
):
    """The two exchanges place every tensor alike; the solution names the one it took
    (``"modes"``), and a solve preloaded from it under ``--context-parallel`` (both
    offered) keeps it, at the same predicted step. Preloaded without
    ``--context-parallel``, the error says which flag to give."""
    env = {"AUTOSHARD_SEQ": str(seq), "AUTOSHARD_HEADS": "1", "AUTOSHARD_BATCH": "1"}
    args = ["solve", str(MODEL), "--mesh", "4", "--intra-node-latency", "10ns", "--json"]
    first = autoshard_cli(*args, "--context-parallel", exchange, "--out", str(tmp_path), **env)
    assert first.returncode == 0, first.stderr[-3000:]
    solution = next(tmp_path.glob("*.pkl"))
    again = autoshard_cli(
        *args, "--context-parallel", "--preload", str(solution), "--out", str(tmp_path / "b"), **env
    )
    assert again.returncode == 0, again.stderr[-3000:]
    before, after = json.loads(first.stdout), json.loads(again.stdout)
    assert after["in_op_collectives"][FORWARD]["modes"] == {f"d0: {mode}": 2}
    assert after["time_s"]["step"] == pytest.approx(before["time_s"]["step"], rel=1e-12)
    if exchange == "ring":  # preloaded where context parallelism is not offered: what to do
        bare = autoshard_cli(*args, "--preload", str(solution), "--out", str(tmp_path / "c"), **env)
        assert bare.returncode != 0
        assert "solve with --context-parallel ring (context_parallel='ring'" in bare.stderr


_REGISTRY_SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch._C._distributed_c10d import _get_work_registry_size
from autoshard.strategies.registry import KernelContext

dist.init_process_group("gloo")
n, me = dist.get_world_size(), dist.get_rank()
ctx = KernelContext(("S2r",), init_device_mesh("cpu", (n,)))
x = [torch.full((1024,), float(me)), torch.ones(1024)]
for _ in range(40):
    x = ctx.shift(x, 0)
    got = ctx.exchange([(x[0], (me + 1) % n, 7)], [(x[0], (me - 1) % n, 7)], 0)
assert x[0][0].item() == me and got[0][0].item() == (me - 1) % n, (x[0][0], got[0][0])
left = _get_work_registry_size()
assert left == 0, f"rank {me}: {left} collective works left registered"
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_passing_blocks_around_the_ring_holds_no_buffer_once_waited(tmp_path: Path):
    """40 ring passes and 40 tagged exchanges on 2 gloo ranks (what a ring attention
    does per layer and step): each arrives from the right rank, and torch's registry of
    unwaited collective work is empty after them. With torch's
    ``_c10d_functional.batch_p2p_ops`` it held one entry per call, with its buffers,
    until the process ended (80 here; every key/value block a training run passes)."""
    script = tmp_path / "ring_registry.py"
    script.write_text(_REGISTRY_SCRIPT)
    run = ranks(2, str(script))
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]


def test_on_two_devices_each_zigzag_move_sends_half_a_block():
    """On 2 devices the plain split holds chunks (0, 1) and (2, 3), the zig-zag (0, 3) and
    (1, 2): each device keeps one half and sends the other, so a move costs half the
    local block (on 4 devices device 1 sends both of its chunks 2 and 3: the whole)."""
    rule, q, lse, fwd = op_rule(FLASH_FORWARD), Q, LSE, _node(FLASH_FORWARD)
    feature = frozenset({"context_parallel_zigzag"})
    (zz,) = [s for s in rule.generate(fwd, [q] * 3, [q, lse], (2,), feature) if s.collectives]
    qkv = 3 * 2 * 4 * 64 * 8 * 4.0
    assert zz.collectives[0] == ("send_recv", 0, qkv / 2)
    (zz4,) = [s for s in rule.generate(fwd, [q] * 3, [q, lse], (4,), feature) if s.collectives]
    assert zz4.collectives[0] == ("send_recv", 0, qkv)
