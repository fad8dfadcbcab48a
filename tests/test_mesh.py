"""Mesh model: parsing, validation, and collective / resharding costs against hand arithmetic."""

import itertools
import math
import pickle
from collections import Counter

import dill
import numpy as np
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autoshard.cost.collectives import CommStep, comm_model
from autoshard.cost.mesh import (
    DEFAULT_INTER_NODE_BW,
    DEFAULT_INTER_NODE_LATENCY,
    DEFAULT_INTRA_NODE_BW,
    DEFAULT_INTRA_NODE_LATENCY,
    MeshSpec,
    parse_mesh_shape,
)
from autoshard.errors import AutoshardError
from autoshard.placements import whole_on_single

R, P = Replicate(), Partial()
S0, S1 = Shard(0), Shard(1)

# The mesh of every hand computation below: 2 nodes x 4 GPUs.
#   mesh dim 0 ("dp"): n = 2, bw = 50e9 B/s, alpha = 20e-6 s
#   mesh dim 1 ("tp"): n = 4, bw = 400e9 B/s, alpha = 5e-6 s
MESH = MeshSpec((2, 4), ("dp", "tp"), (50e9, 400e9), (20e-6, 5e-6))
# A 1024 x 1024 fp32 tensor: B = 1024 * 1024 * 4 = 4_194_304 bytes.
SHAPE, ITEMSIZE, B = (1024, 1024), 4, 4_194_304


def approx(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=0)


# --- collectives -----------------------------------------------------------------------------


def test_collectives_on_the_intra_node_dim() -> None:
    # n = 4: all-gather = 3 * (5e-6 + 4_194_304 / (4 * 400e9)) = 3 * (5e-6 + 2.62144e-6)
    assert comm_model(MESH).all_gather(B, 1) == approx(22.86432e-6)
    assert comm_model(MESH).reduce_scatter(B, 1) == approx(22.86432e-6)
    # all-reduce = 2 * 22.86432e-6
    assert comm_model(MESH).all_reduce(B, 1) == approx(45.72864e-6)
    # all-to-all = 3 * (5e-6 + 4_194_304 / (16 * 400e9)) = 3 * (5e-6 + 0.65536e-6)
    assert comm_model(MESH).all_to_all(B, 1) == approx(16.96608e-6)


def test_collectives_on_the_inter_node_dim() -> None:
    # n = 2: all-gather = 1 * (20e-6 + 4_194_304 / (2 * 50e9)) = 20e-6 + 41.94304e-6
    assert comm_model(MESH).all_gather(B, 0) == approx(61.94304e-6)
    assert comm_model(MESH).reduce_scatter(B, 0) == approx(61.94304e-6)
    assert comm_model(MESH).all_reduce(B, 0) == approx(123.88608e-6)
    # all-to-all = 20e-6 + 4_194_304 / (4 * 50e9) = 20e-6 + 20.97152e-6
    assert comm_model(MESH).all_to_all(B, 0) == approx(40.97152e-6)


def test_collectives_on_a_mesh_dim_of_size_one_are_free() -> None:
    mesh = MeshSpec.from_options("1x8")
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all"):
        assert comm_model(mesh).collective(kind, B, 0) == 0.0
    assert comm_model(mesh).redistribute_cost((S0, R), (R, R), SHAPE, ITEMSIZE) == 0.0
    assert comm_model(mesh).redistribute_steps((S0, R), (R, R), SHAPE, ITEMSIZE) == []


def test_collective_argument_errors() -> None:
    with pytest.raises(AutoshardError, match="mesh dim 2 is out of range for the 2x4 mesh"):
        comm_model(MESH).all_gather(B, 2)
    with pytest.raises(AutoshardError, match="unknown collective 'broadcast'"):
        comm_model(MESH).collective("broadcast", B, 0)
    with pytest.raises(AutoshardError, match="-1 bytes"):
        comm_model(MESH).all_reduce(-1, 0)


# --- resharding ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "src, dst, expected",
    [
        # S(0)R -> RR: all-gather on dim 0 of the full tensor (dim 1 is R): 61.94304e-6
        ((S0, R), (R, R), 61.94304e-6),
        # PR -> RR: all-reduce on dim 0: 2 * 61.94304e-6
        ((P, R), (R, R), 123.88608e-6),
        # RP -> RS(1): reduce-scatter on dim 1 of the full tensor: 22.86432e-6
        ((R, P), (R, S1), 22.86432e-6),
        # S(0)S(1) -> S(1)S(0): mesh dim 0 moves to tensor dim 1, which mesh dim 1 shards
        # after it, so DTensor gathers mesh dim 1 first (nesting, see CommModel._nested):
        #   all-gather on dim 1 of the 512 KiB piece: 3 * (5e-6 + 2_097_152 / (4 * 400e9))
        #                                            = 3 * 6.31072e-6 = 18.93216e-6
        #   all-to-all on dim 0 of 2 MiB: 20e-6 + 4_194_304 / (4 * 50e9) = 40.97152e-6
        #   then a local slice on dim 1. (Two all-to-alls, 41.23 us, is not what runs: the
        #   second finds tensor dim 0 nested under mesh dim 1 and gathers too.)
        ((S0, S1), (S1, S0), 18.93216e-6 + 40.97152e-6),
        # S(0)S(1) -> RR: two all-gathers in sequence, the slow dim first on the 512 KiB
        # piece each device holds, then the fast dim on the tensor that first one grew:
        #   dim 0: 20e-6 + 1_048_576 / (2 * 50e9) = 30.48576e-6
        #   dim 1: 3 * (5e-6 + 4_194_304 / (4 * 400e9)) = 3 * 7.62144e-6 = 22.86432e-6
        # (priced on the source's shards alone, dim 1 saw 2 MiB: under-priced by 3.93 us)
        ((S0, S1), (R, R), 30.48576e-6 + 22.86432e-6),
        # R -> S is a local slice, and nothing to do is free.
        ((R, R), (S0, R), 0.0),
        ((R, R), (S0, S1), 0.0),
        ((S0, P), (S0, P), 0.0),
        # Shard(-1) of a 2-D tensor is Shard(1).
        ((R, Shard(-1)), (R, S1), 0.0),
        # Replicate -> Partial is local (DTensor divides the copy by n for sum): free.
        ((R, R), (P, R), 0.0),
        ((S0, R), (S0, P), 0.0),
        ((R, R), (R, Partial("avg")), 0.0),
        # Shard into Partial, or between reduce ops: impossible.
        ((R, S0), (R, P), math.inf),
        ((Partial("sum"), R), (Partial("avg"), R), math.inf),
    ],
)
def test_redistribute_cost(src, dst, expected) -> None:
    assert comm_model(MESH).redistribute_cost(src, dst, SHAPE, ITEMSIZE) == approx(expected)
    # Again, from the memo, and with a torch.Size shape.
    assert comm_model(MESH).redistribute_cost(src, dst, torch.Size(SHAPE), ITEMSIZE) == approx(
        expected
    )


def test_redistribute_steps_name_each_collective() -> None:
    steps = comm_model(MESH).redistribute_steps((S0, S1), (R, R), SHAPE, ITEMSIZE)
    assert [(s.kind, s.mesh_dim, s.bytes) for s in steps] == [
        ("all_gather", 0, 1_048_576),
        ("all_gather", 1, 4_194_304),
    ]
    assert [s.seconds for s in steps] == [approx(30.48576e-6), approx(22.86432e-6)]
    assert comm_model(MESH).redistribute_steps((P, S0), (S1, S0), SHAPE, ITEMSIZE) == [
        # reduce-scatter on dim 0 of the piece dim 1 left: 4_194_304 / 4 = 1_048_576 B,
        # 20e-6 + 1_048_576 / (2 * 50e9) = 30.48576e-6
        CommStep("reduce_scatter", 0, 1_048_576, pytest.approx(30.48576e-6, rel=1e-12))
    ]
    assert comm_model(MESH).redistribute_steps((R, R), (S0, S1), SHAPE, ITEMSIZE) == []


def test_redistribute_steps_refuse_the_impossible() -> None:
    with pytest.raises(AutoshardError, match=r"mesh dim 1 \(tp\) from S\(0\) to P\(sum\)"):
        comm_model(MESH).redistribute_steps((R, S0), (R, P), SHAPE, ITEMSIZE)


def test_redistribute_cost_accepts_lists_and_numpy_sizes() -> None:
    assert comm_model(MESH).redistribute_cost([S0, R], [R, R], [1024, 1024], 4) == approx(
        61.94304e-6
    )
    shape = tuple(np.array(SHAPE))
    assert comm_model(MESH).redistribute_cost((S0, R), (R, R), shape, np.int64(4)) == approx(
        61.94304e-6
    )


@pytest.mark.parametrize(
    "src, shape, itemsize, message",
    [
        ((R,), SHAPE, 4, r"are 1 for the 2 mesh dims of the 2x4 mesh"),
        ((Shard(2), R), SHAPE, 4, r"shards tensor dim 2 of a 2-D tensor"),
        ((R, R), SHAPE, 0, r"itemsize 0"),
        ((R, R), (4, -1), 4, r"tensor shape \(4, -1\)"),
        ((R, R), (4, 2.5), 4, r"tensor shape \(4, 2.5\) must hold whole numbers"),
        (("S(0)", R), SHAPE, 4, r"placement 'S\(0\)' is not Shard, Replicate or Partial"),
    ],
)
def test_redistribute_argument_errors(src, shape, itemsize, message) -> None:
    with pytest.raises(AutoshardError, match=message):
        comm_model(MESH).redistribute_cost(src, (R, R), shape, itemsize)


def test_swapping_bandwidths_swaps_the_cheaper_mesh_dim() -> None:
    # 4x4 mesh, equal latencies (5 us), so only bandwidth tells the two mesh dims apart.
    # All-reduce of 4_194_304 B over n = 4: 6 * (5e-6 + 4_194_304 / (4 * bw))
    #   bw = 50e9:  6 * (5e-6 + 20.97152e-6)   = 155.82912e-6
    #   bw = 450e9: 6 * (5e-6 + 2.330168...e-6) = 43.981013...e-6
    slow, fast = 155.82912e-6, 6 * (5e-6 + B / (4 * 450e9))
    lat = dict(intra_node_latency=5e-6, inter_node_latency=5e-6)
    usual = MeshSpec.from_options("4x4", inter_node_bw=50e9, intra_node_bw=450e9, **lat)
    swapped = MeshSpec.from_options("4x4", inter_node_bw=450e9, intra_node_bw=50e9, **lat)
    reduce_on_0, reduce_on_1 = ((P, R), (R, R)), ((R, P), (R, R))
    assert comm_model(usual).redistribute_cost(*reduce_on_0, SHAPE, 4) == approx(slow)
    assert comm_model(usual).redistribute_cost(*reduce_on_1, SHAPE, 4) == approx(fast)
    assert comm_model(swapped).redistribute_cost(*reduce_on_0, SHAPE, 4) == approx(fast)
    assert comm_model(swapped).redistribute_cost(*reduce_on_1, SHAPE, 4) == approx(slow)


# --- shape, defaults, validation -------------------------------------------------------------


@pytest.mark.parametrize(
    "text, shape", [("2x4", (2, 4)), ("8", (8,)), ("2x2x2", (2, 2, 2)), (" 2 X 4 ", (2, 4))]
)
def test_parse_mesh_shape(text: str, shape: tuple[int, ...]) -> None:
    assert parse_mesh_shape(text) == shape


@pytest.mark.parametrize(
    "text, message",
    [
        ("2x", "bad mesh shape '2x'"),
        ("a", "bad mesh shape 'a'"),
        ("", "bad mesh shape ''"),
        ("2x-4", "bad mesh shape '2x-4'"),
        ("1.5x2", "bad mesh shape '1.5x2'"),
        ("0x4", "has size 0 on mesh dim 0"),
        ("2x0", "has size 0 on mesh dim 1"),
        ("99999999999999999999", "has 99,999,999,999,999,999,999 devices: autoshard plans"),
        ("4096x4097", "has 16,781,312 devices"),
    ],
)
def test_parse_mesh_shape_errors(text: str, message: str) -> None:
    with pytest.raises(AutoshardError, match=message):
        parse_mesh_shape(text)


def test_a_mesh_of_the_python_api_has_the_same_device_limit() -> None:
    """``MeshSpec`` itself refuses what ``--mesh`` refuses: an API mesh of 10**20 devices
    reached the fake process group's overflow as a traceback."""
    with pytest.raises(AutoshardError, match="has 100,000,000,000,000,000,000 devices"):
        MeshSpec((10**20,), ("d0",), (1e9,), (1e-6,))
    assert MeshSpec((2**12, 2**12), ("a", "b"), (1e9, 1e9), (1e-6, 1e-6)).num_devices == 2**24


def test_from_options_defaults_follow_mase() -> None:
    mesh = MeshSpec.from_options("2x4")
    assert mesh.dim_names == ("dp", "tp")
    assert mesh.bandwidth == (DEFAULT_INTER_NODE_BW, DEFAULT_INTRA_NODE_BW) == (47e9, 370e9)
    assert mesh.latency == (DEFAULT_INTER_NODE_LATENCY, DEFAULT_INTRA_NODE_LATENCY)
    assert (mesh.ndim, mesh.num_devices, mesh.size(0), mesh.size(1)) == (2, 8, 2, 4)
    one_node = MeshSpec.from_options("8")
    assert one_node.dim_names == ("d0",)
    assert one_node.bandwidth == (370e9,) and one_node.latency == (5e-6,)
    cube = MeshSpec.from_options((2, 2, 2), dim_names="pp,dp,tp", intra_node_bw=100e9)
    assert cube.dim_names == ("pp", "dp", "tp")
    assert cube.bandwidth == (47e9, 100e9, 100e9)
    assert MeshSpec.from_options("2x2x2").dim_names == ("d0", "d1", "d2")


def test_describe() -> None:
    assert MeshSpec.from_options("2x4").describe() == (
        "2x4 mesh (8 devices): dp=2 at 47.0 GB/s, 20.0 us; tp=4 at 370 GB/s, 5.00 us"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (((), (), (), ()), r"mesh shape \(\) is empty"),
        (((2, 0), ("a", "b"), (1.0, 1.0), (0.0, 0.0)), r"size 0 on mesh dim 1"),
        (((2, 4), ("dp",), (1.0, 1.0), (0.0, 0.0)), r"\(2, 4\) has 2 dims but dim_names"),
        (((2, 4), ("dp", "tp"), (1.0,), (0.0, 0.0)), r"has 2 dims but bandwidth \(1.0,\) has 1"),
        (((2, 4), ("dp", "tp"), (1.0, 1.0), (0.0,)), r"has 2 dims but latency"),
        (((2, 4), ("dp", "dp"), (1.0, 1.0), (0.0, 0.0)), r"repeat 'dp' \(mesh dims 0 and 1\)"),
        (((2, 4), ("dp", "t p"), (1.0, 1.0), (0.0, 0.0)), r"mesh dim 1 name 't p'"),
        (((2, 4), ("dp", "tp"), (1.0, 0.0), (0.0, 0.0)), r"bandwidth of mesh dim 1 \(tp\) is 0.0"),
        (((2, 4), ("dp", "tp"), (math.inf, 1.0), (0.0, 0.0)), r"mesh dim 0 \(dp\) is inf"),
        (((2, 4), ("dp", "tp"), (1.0, 1.0), (-1e-6, 0.0)), r"latency of mesh dim 0 \(dp\) is"),
    ],
)
def test_meshspec_validation_names_the_numbers(args, message) -> None:
    with pytest.raises(AutoshardError, match=message):
        MeshSpec(*args)


def test_size_of_a_missing_mesh_dim() -> None:
    with pytest.raises(AutoshardError, match=r"mesh dim 2 is out of range.*0\.\.1"):
        MESH.size(2)


def test_dict_round_trip() -> None:
    data = MESH.to_dict()
    assert data == {
        "shape": [2, 4],
        "dim_names": ["dp", "tp"],
        "bandwidth_Bps": [50e9, 400e9],
        "latency_s": [20e-6, 5e-6],
    }
    assert MeshSpec.from_dict(data) == MESH
    with pytest.raises(AutoshardError, match=r"missing keys \['latency_s'\]"):
        MeshSpec.from_dict({k: v for k, v in data.items() if k != "latency_s"})
    with pytest.raises(AutoshardError, match=r"unknown keys \['extra'\]"):
        MeshSpec.from_dict({**data, "extra": 1})
    with pytest.raises(AutoshardError, match="is a list, not a mapping"):
        MeshSpec.from_dict([2, 4])


@pytest.mark.parametrize("module", [pickle, dill])
def test_pickles_without_its_cost_memo(module) -> None:
    comm_model(MESH).redistribute_cost((S0, R), (R, R), SHAPE, 4)
    copy = module.loads(module.dumps(MESH))
    assert copy == MESH and hash(copy) == hash(MESH)
    assert comm_model(copy).redistribute_cost((P, R), (R, R), SHAPE, 4) == approx(123.88608e-6)


@pytest.mark.parametrize(
    "mesh_shape, bandwidth",
    [
        ((2, 2), (50e9, 400e9)),
        ((2, 2), (400e9, 50e9)),
        ((2, 2, 2), (25e9, 100e9, 400e9)),
        ((1, 2), (50e9, 400e9)),
        ((2, 1, 2), (25e9, 100e9, 400e9)),
    ],
)
def test_every_priced_resharding_is_what_dtensor_runs(mesh_shape, bandwidth) -> None:
    """For every pair of placements of a 2-D tensor, the collectives priced for the
    resharding (kind and mesh dim, in any order) are the ones DTensor's own redistribute
    planner issues when the launcher walks ``redistribute_path`` one step at a time, on a
    mesh whose groups of dims are flattened as the launcher flattens them: like
    collectives over several mesh dims run as one over their group (DTensor's own
    ``_optimize_transform_infos``), keyed by the group. An independent reference: torch's
    planner and optimizer, not autoshard's. Two shapes, large enough that one ring over a
    group is chosen wherever it moves fewer bytes over the slow links: one every group
    splits evenly, and one (6006 rows) that no group of more than 2 devices splits
    evenly, where DTensor keeps a reduce-scatter over several dims as one per dim. On a
    mesh with a dim of one device the launcher holds every tensor whole there
    (``whole_on_single``), as here: without it, DTensor's order of nested shards made
    about half of these reshardings gather and shard again (1,564 of 2,744 on 1x2x2)."""
    from autoshard import _torch_private as tp

    def kind(a, b):
        if a == b or (a.is_replicate() and not b.is_replicate()):
            return None  # a local slice, or Replicate -> Partial
        if a.is_partial():
            return "all_reduce" if b.is_replicate() else "reduce_scatter"
        return "all_gather" if b.is_replicate() else "all_to_all"

    names = tuple(f"d{i}" for i in range(len(mesh_shape)))
    model = comm_model(MeshSpec(mesh_shape, names, bandwidth, (1e-6,) * len(mesh_shape)))
    options = [R, P, S0, S1]
    checked, merged = 0, 0
    with tp.fake_mesh(mesh_shape, names) as mesh:
        tp.flatten_mesh_groups(mesh)
        for shape, src in itertools.product(
            ((8192, 8192), (6006, 8192)), itertools.product(options, repeat=len(mesh_shape))
        ):
            for dst in itertools.product(options, repeat=len(mesh_shape)):
                if math.isinf(model.redistribute_cost(src, dst, shape, 4)):
                    continue
                priced = Counter(
                    (s.kind, s.mesh_dim) for s in model.redistribute_steps(src, dst, shape, 4)
                )
                ran: Counter = Counter()
                current = whole_on_single(src, mesh_shape)
                for step in model.redistribute_path(src, dst, shape):
                    step = whole_on_single(step, mesh_shape)
                    for dim, a, b in tp.dtensor_transform_steps(mesh, current, step, shape):
                        if kind(a, b):
                            ran[(kind(a, b), dim)] += 1
                    current = step
                assert ran == priced, (src, dst, shape)
                checked += 1
                merged += any(isinstance(dim, tuple) for _, dim in priced)
    # a slow outer dim gains from the flattened ring (its links crossed by several rings at
    # once); a slow inner dim does not, and keeps one collective per dim
    assert checked > 200
    if 1 not in mesh_shape:
        assert merged > 10 if bandwidth[0] < bandwidth[-1] else merged == 0


def test_the_step_memo_renames_tensor_dims_without_changing_a_step() -> None:
    """``CommModel._candidates`` memoises the step search up to a renaming of tensor dims,
    keyed by ``_pick`` with a dim's divisor only where a reduce-scatter may land;
    for 4,000 pairs of placement codes of a 4-D tensor on a 3-D mesh of three link speeds
    (seeded), each tensor dim with a divisor of the 64 devices drawn at random (whether a
    flattened reduce-scatter splits it evenly), the steps equal the search run on the
    codes as they are."""
    import random

    model = comm_model(MeshSpec((8, 4, 2), ("a", "b", "c"), (25e9, 100e9, 400e9), (1e-5,) * 3))
    codes = [-1, "sum", 0, 1, 2, 3]
    rng = random.Random(0)
    renamed = 0
    for _ in range(4000):
        s = tuple(rng.choice(codes) for _ in range(3))
        d = tuple(rng.choice(codes) for _ in range(3))
        used = max((c for c in s + d if isinstance(c, int)), default=-1)
        ndim = rng.randint(max(used + 1, 1), 4)  # a tensor with every dim the codes name
        form = (ndim, tuple(rng.choice((1, 2, 8, 64)) for _ in range(ndim)))
        key, _ = model._pick(s, d, (*form, 1 << 20))  # divisors kept where a scatter lands
        assert model._candidates(s, d, key) == model._sequence_uncached(s, d, form), (s, d, form)
        renamed += any(isinstance(c, int) and c >= 0 for c in s + d)
    assert renamed > 3000
