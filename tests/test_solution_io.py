"""Tests for autoshard.plan.formats: atomic writes, safe solution loading, sharding maps."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import time
from pathlib import Path

import dill
import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from autoshard.errors import AutoshardError
from autoshard.plan import formats as solution_io
from autoshard.plan.atomic import atomic_write, atomic_write_bytes, atomic_write_text
from autoshard.plan.formats import (
    ShardingMap,
    detect_kind,
    load_sharding_map,
    load_solution,
    save_sharding_map,
    save_solution,
)


def make_solution() -> dict:
    """A small autoshard.solution/1 dict on a 2x4 mesh."""
    return {
        "format": "autoshard.solution/1",
        "autoshard_version": "0.1.0",
        "model": "mlp",
        "mesh": {
            "shape": [2, 4],
            "dim_names": ["dp", "tp"],
            "bandwidth_Bps": [5e10, 4.5e11],
            "latency_s": [1e-5, 5e-6],
        },
        "cost_model": {"device": "h100", "mode": "infer"},
        "nodes": {
            "mm": {
                "op": "aten.mm.default",
                "args": {
                    "data_in_0": (Shard(0), Replicate()),
                    "data_in_1": (Replicate(), Shard(1)),
                },
                "results": {"data_out_0": (Shard(0), Shard(1))},
                "shapes": {
                    "data_in_0": [8, 768],
                    "data_in_1": [768, 3072],
                    "data_out_0": [8, 3072],
                },
            },
            "sum": {
                "op": "aten.sum.default",
                "args": {"data_in_0": (Shard(0), Partial("sum"))},
                "results": {"data_out_0": (Partial("avg"), Replicate())},
                "shapes": {"data_in_0": [8, 3072], "data_out_0": []},
            },
        },
        "parameters": {"fc1.weight": (Replicate(), Shard(0)), "fc1.bias": (Replicate(), Shard(0))},
        "inputs": {"x": (Shard(0), Replicate())},
        "objective_s": 0.0123,
        "solver": {"status": "optimal", "gap": 0.0, "solve_time_s": 1.2},
    }


def make_map() -> dict:
    return {
        "format": "autoshard.sharding_map/1",
        "mesh": {"shape": [2, 4], "dim_names": ["dp", "tp"]},
        "parameters": {
            "transformer.h.0.mlp.c_fc.weight": ["R", "S(1)"],
            "transformer.h.0.attn.c_attn.bias": ["R", "S(0)"],
        },
        "inputs": {"input_ids": ["S(0)", "R"]},
        "predicted": {"step_time_s": 0.0123, "collectives": {"all_reduce": 2}},
    }


def only_file(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------------------------------
# Atomic writes
# ------------------------------------------------------------------------------------------


def test_atomic_write_creates_replaces_and_creates_parents(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "dir" / "f.txt"
    atomic_write_text(target, "first")
    assert target.read_text() == "first"
    atomic_write_bytes(target, b"second")
    assert target.read_bytes() == b"second"
    assert only_file(target.parent) == ["f.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_write_keeps_the_mode_of_a_replaced_file(tmp_path: Path) -> None:
    target = tmp_path / "f.txt"
    target.write_text("old")
    target.chmod(0o600)
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o600


def test_atomic_write_failing_writer_leaves_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    target.write_bytes(b"old contents")

    def half_then_fail(f) -> None:
        f.write(b"half of the new")
        raise ValueError("serialiser broke")

    with pytest.raises(ValueError, match="serialiser broke"):
        atomic_write(target, half_then_fail)
    assert target.read_bytes() == b"old contents"
    assert only_file(tmp_path) == ["f.bin"]


def test_save_solution_failing_serialisation_leaves_target_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "s.pkl"
    save_solution(target, make_solution())
    before = target.read_bytes()

    def broken_dump(obj, f, protocol=None) -> None:
        f.write(dill.dumps(obj)[:20])
        raise pickle.PicklingError("disk full halfway")

    monkeypatch.setattr(solution_io.dill, "dump", broken_dump)
    changed = make_solution()
    changed["objective_s"] = 99.0
    with pytest.raises(pickle.PicklingError):
        save_solution(target, changed)
    assert target.read_bytes() == before
    assert only_file(tmp_path) == ["s.pkl"]


def test_atomic_write_failing_rename_is_an_error_and_leaves_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "m.json"
    target.write_text("old")

    def refuse(src, dst) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(solution_io.os, "replace", refuse)
    with pytest.raises(AutoshardError, match=r"cannot write .*m\.json: Permission denied"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert only_file(tmp_path) == ["m.json"]


def test_atomic_write_into_a_file_as_directory_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(AutoshardError, match="cannot write") as err:
        atomic_write_text(tmp_path / "plain" / "f.txt", "y")
    assert f"{tmp_path / 'plain'} is a file, not a folder" in str(err.value)  # not "File exists"
    with pytest.raises(AutoshardError, match="plain is a file, not a folder"):
        atomic_write_text(tmp_path / "plain" / "deeper" / "f.txt", "y")


# ------------------------------------------------------------------------------------------
# Solutions: round trips
# ------------------------------------------------------------------------------------------


def test_solution_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "s.pkl"
    solution = make_solution()
    save_solution(path, solution)
    loaded = load_solution(path)
    assert loaded == solution
    assert loaded["nodes"]["sum"]["results"]["data_out_0"] == (Partial("avg"), Replicate())
    assert type(loaded["parameters"]["fc1.weight"][1]) is Shard
    # The file is an ordinary dill pickle: dill itself reads it back the same.
    assert dill.loads(path.read_bytes()) == solution


def test_save_solution_normalises_placement_lists_to_tuples(tmp_path: Path) -> None:
    solution = make_solution()
    solution["parameters"]["fc1.weight"] = [Replicate(), Shard(0)]
    save_solution(tmp_path / "s.pkl", solution)
    assert solution["parameters"]["fc1.weight"] == [Replicate(), Shard(0)]  # caller's untouched
    assert load_solution(tmp_path / "s.pkl")["parameters"]["fc1.weight"] == (Replicate(), Shard(0))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda s: s["nodes"]["mm"]["shapes"].__setitem__("data_in_0", torch.Size([8, 768])),
            r"\['nodes'\]\['mm'\]\['shapes'\]\['data_in_0'\] is a Size",
        ),
        (lambda s: s.__setitem__("extra", {1, 2}), r"\['extra'\] is a set"),
        (lambda s: s.__setitem__("extra", torch.zeros(2)), r"\['extra'\] is a Tensor"),
        (
            lambda s: s["parameters"].__setitem__("w", (Shard(0),)),
            "parameter 'w' has 1 placement but the mesh has 2 dims",
        ),
        (lambda s: s.pop("format"), "not a dict with a 'format'"),
        (lambda s: s.__setitem__("format", "autoshard.solution/0"), "reads 'autoshard.solution/1'"),
        (lambda s: s["mesh"].__setitem__("shape", [2, 0]), r"mesh shape is \[2, 0\]"),
    ],
)
def test_save_solution_refuses_what_it_could_not_load(tmp_path: Path, edit, message: str) -> None:
    solution = make_solution()
    edit(solution)
    with pytest.raises(AutoshardError, match=message):
        save_solution(tmp_path / "s.pkl", solution)
    assert not (tmp_path / "s.pkl").exists()


# ------------------------------------------------------------------------------------------
# Solutions: malicious pickles
# ------------------------------------------------------------------------------------------


class _Payload:
    """Pickles as ``func(*args)``: what an attacker puts in a shared solution file."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _wrapped(payload: object) -> dict:
    """The payload hidden inside an otherwise plausible solution."""
    solution = make_solution()
    solution["model"] = payload
    return solution


def _payloads(marker: Path) -> dict[str, object]:
    """Real attacks, each of which creates ``marker`` when unpickled without restriction."""
    touch = f"touch {marker}"
    lam = lambda: os.system(touch)  # noqa: E731  (dill pickles a lambda by value)
    return {
        "os.system": _Payload(os.system, touch),
        "subprocess.Popen": _Payload(subprocess.Popen, ["touch", str(marker)]),
        "builtins.eval": _Payload(eval, f"__import__('os').system({touch!r})"),
        "dill lambda": _Payload(lam),
    }


def _expected_global(name: str) -> str:
    return {
        "os.system": f"{os.system.__module__}.system",
        "subprocess.Popen": "subprocess.Popen",
        "builtins.eval": "builtins.eval",
        "dill lambda": "dill._dill._create_",
    }[name]


@pytest.mark.parametrize(
    ("pickler", "attack"),
    [
        (pickler, attack)
        for pickler in ("pickle", "dill")
        for attack in ("os.system", "subprocess.Popen", "builtins.eval", "dill lambda")
        if (pickler, attack) != ("pickle", "dill lambda")  # pickle cannot serialise a lambda
    ],
)
def test_malicious_pickle_is_refused_and_never_runs(
    tmp_path: Path, pickler: str, attack: str
) -> None:
    module = dill if pickler == "dill" else pickle

    # Control: the same kind of payload really runs when loaded without restriction.
    control = tmp_path / "control-ran"
    ran = module.loads(module.dumps(_wrapped(_payloads(control)[attack])))["model"]
    if isinstance(ran, subprocess.Popen):
        ran.wait()
    assert control.exists(), "the control payload should have run"

    marker = tmp_path / "attack-ran"
    path = tmp_path / "solution.pkl"
    path.write_bytes(module.dumps(_wrapped(_payloads(marker)[attack])))
    with pytest.raises(AutoshardError) as info:
        load_solution(path)
    message = str(info.value)
    assert message.startswith(f"refusing to load {path}: it references {_expected_global(attack)}")
    assert "solutions may only contain placements and builtins" in message
    time.sleep(0.05)
    assert not marker.exists()


def _short(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _call_global(module: str, name: str, form: str) -> bytes:
    """A minimal pickle that calls ``module.name()`` when loaded without restriction."""
    if form == "GLOBAL":  # protocol 2: GLOBAL, EMPTY_TUPLE, REDUCE, STOP
        return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b")R."
    if form == "STACK_GLOBAL":  # protocol 4
        return b"\x80\x04" + _short(module) + _short(name) + b"\x93)R."
    return b"(i" + f"{module}\n{name}\n".encode() + b"."  # protocol 0: MARK, INST, STOP


@pytest.mark.parametrize("form", ["GLOBAL", "STACK_GLOBAL", "INST"])
@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("posix", "system"),
        ("subprocess", "Popen"),
        ("builtins", "eval"),
        ("builtins", "exec"),
        ("builtins", "getattr"),
        ("builtins", "__import__"),
        ("dill._dill", "_create_code"),
        ("dill._dill", "_create_function"),
        ("dill._dill", "_load_type"),
        ("dill._dill", "_import_module"),
        ("dill._dill", "_get_attr"),
        ("copyreg", "_reconstructor"),
        ("torch", "load"),
        ("torch.distributed.tensor.placement_types", "_StridedShard"),
        ("torch.distributed.tensor.placement_types", "Placement"),
        ("torch.distributed.device_mesh", "DeviceMesh"),
    ],
)
def test_any_other_global_is_refused_by_name(
    tmp_path: Path, module: str, name: str, form: str
) -> None:
    path = tmp_path / "x.pkl"
    path.write_bytes(_call_global(module, name, form))
    with pytest.raises(AutoshardError, match=f"it references {module}.{name}, which autoshard"):
        load_solution(path)


def test_refusal_comes_before_earlier_admitted_objects_are_used(tmp_path: Path) -> None:
    # A real solution followed, inside the same dict, by a call to builtins.getattr.
    solution = make_solution()
    solution["solver"]["status"] = _Payload(getattr, "abc", "upper")
    path = tmp_path / "s.pkl"
    path.write_bytes(dill.dumps(solution))
    with pytest.raises(AutoshardError, match="builtins.getattr"):
        load_solution(path)


# ------------------------------------------------------------------------------------------
# Solutions: damaged files and non-solutions
# ------------------------------------------------------------------------------------------


def test_truncated_solution_is_a_clear_error(tmp_path: Path) -> None:
    good = tmp_path / "good.pkl"
    save_solution(good, make_solution())
    data = good.read_bytes()
    path = tmp_path / "cut.pkl"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(AutoshardError, match=r"cut\.pkl is truncated or corrupt"):
        load_solution(path)


def test_every_truncation_point_is_an_autoshard_error(tmp_path: Path) -> None:
    good = tmp_path / "good.pkl"
    save_solution(good, make_solution())
    data = good.read_bytes()
    for cut in range(1, len(data), 7):
        with pytest.raises(AutoshardError):
            solution_io.loads_solution(data[:cut], "cut")


def test_corrupt_and_padded_bytes_are_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.pkl"
    path.write_bytes(b"\x80\x04\x95" + b"\xde\xad\xbe\xef" * 8)
    with pytest.raises(AutoshardError, match="is truncated or corrupt"):
        load_solution(path)
    path.write_bytes(b"certainly not a pickle")  # text: not a damaged plan, not a plan at all
    with pytest.raises(AutoshardError, match="is not a plan file: it is text"):
        load_solution(path)
    save_solution(path, make_solution())
    path.write_bytes(path.read_bytes() + b"garbage")
    with pytest.raises(AutoshardError, match="7 bytes follow the end of the pickle"):
        load_solution(path)


@pytest.mark.parametrize("content", [b"", b"  \n"])
def test_empty_file_is_a_clear_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "e.pkl"
    path.write_bytes(content)
    with pytest.raises(AutoshardError, match=r"e\.pkl is empty"):
        load_solution(path)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AutoshardError, match="cannot read .*nope.pkl: No such file"):
        load_solution(tmp_path / "nope.pkl")


def test_json_passed_as_a_pickle(tmp_path: Path) -> None:
    path = tmp_path / "plan.pkl"
    path.write_text(json.dumps(make_map()))
    with pytest.raises(AutoshardError, match="is a sharding map \\(JSON\\), not a solution pickle"):
        load_solution(path)
    path.write_text('{"hello": 1}')
    with pytest.raises(AutoshardError, match="is a JSON file, not a solution pickle"):
        load_solution(path)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([1, 2, 3], "holds a list, not an autoshard solution"),
        ("text", "holds a str, not an autoshard solution"),
        ({}, "holds an empty dict, not a solution"),
        ({"a": 1}, "its entry 'a' is not a MASE node"),
        ({"mm": {"args": {}, "op": "x"}}, "its entry 'mm' is not a MASE node"),
        ({"format": "autoshard.solution/2", "nodes": {}}, "reads 'autoshard.solution/1'"),
        ({"format": 1, "nodes": {}}, "has format 1; this autoshard reads 'autoshard.solution/1'"),
        ({"format": "autoshard.solution/1"}, "has no 'nodes'"),
        ({"format": "autoshard.solution/1", "nodes": []}, "'nodes' is a list; expected a dict"),
        ({"format": "mase", "nodes": {}, "x": {1, 2}}, r"\['x'\] is a set"),
        ({"format": "mase", "nodes": {}, "x": b"ab"}, r"\['x'\] is a bytes"),
        (
            {"format": "mase", "nodes": {"mm": {"args": {"a": ["R", "S(0)"]}}}},
            r"node 'mm' arg 'a' is \['R', 'S\(0\)'\]; expected one placement per mesh dim",
        ),
        (
            {
                "format": "mase",
                "nodes": {
                    "a": {"args": {"x": (Shard(0), Replicate())}},
                    "b": {"results": {"y": (Shard(0),)}},
                },
            },
            "node 'b' result 'y' has 1 placement but the mesh has 2 dims",
        ),
        ({"format": "mase", "nodes": {}, "x": Shard(-1)}, "is a Shard with dim -1"),
        ({"format": "mase", "nodes": {}, "x": Partial("a b")}, "is a Partial with reduce_op"),
    ],
)
def test_not_a_solution(tmp_path: Path, obj: object, message: str) -> None:
    path = tmp_path / "x.pkl"
    path.write_bytes(dill.dumps(obj))
    with pytest.raises(AutoshardError, match=message):
        load_solution(path)


def test_mismatched_placement_count_names_the_node(tmp_path: Path) -> None:
    solution = make_solution()
    path = tmp_path / "s.pkl"
    solution["nodes"]["mm"]["args"]["data_in_1"] = (Replicate(), Shard(1), Replicate())
    path.write_bytes(dill.dumps(solution))
    with pytest.raises(
        AutoshardError, match="node 'mm' arg 'data_in_1' has 3 placements but the mesh has 2 dims"
    ):
        load_solution(path)


def test_reference_cycle_is_refused(tmp_path: Path) -> None:
    loop: list = []
    loop.append(loop)
    path = tmp_path / "s.pkl"
    path.write_bytes(pickle.dumps({"format": "mase", "nodes": {}, "x": loop}))
    with pytest.raises(AutoshardError, match="reference cycle"):
        load_solution(path)


def test_shared_references_are_walked_once(tmp_path: Path) -> None:
    # 2**80 leaves if expanded; the memo makes it 80 lists.
    level: object = [Shard(0)]
    for _ in range(80):
        level = [level, level]
    path = tmp_path / "s.pkl"
    path.write_bytes(pickle.dumps({"format": "mase", "nodes": {}, "x": level}))
    start = time.monotonic()
    loaded = load_solution(path)
    assert time.monotonic() - start < 1.0
    deepest = loaded["x"]
    for _ in range(80):
        assert deepest[0] is deepest[1]
        deepest = deepest[0]
    assert deepest == [Shard(0)]


# ------------------------------------------------------------------------------------------
# Solutions: MASE files
# ------------------------------------------------------------------------------------------

MASE_NODES = {
    "transformer_h_0_mlp_c_fc": {
        "args": {"data_in_0": (Shard(0), Replicate()), "weight": (Replicate(), Shard(1))},
        "results": {"data_out_0": (Shard(0), Shard(1))},
    },
    "transformer_h_0_mlp_c_proj": {
        "args": {"data_in_0": (Shard(0), Shard(1))},
        "results": {"data_out_0": (Shard(0), Partial("sum"))},
    },
}


@pytest.mark.parametrize("module", [pickle, dill])
def test_bare_mase_dict_loads_wrapped(tmp_path: Path, module) -> None:
    path = tmp_path / "ilp_solution.pkl"
    path.write_bytes(module.dumps(MASE_NODES))
    assert load_solution(path) == {"format": "mase", "nodes": MASE_NODES}


@pytest.mark.parametrize("module", [pickle, dill])
def test_mase_dtensor_specs_load_as_their_placements(tmp_path: Path, module) -> None:
    def spec(*placements):
        meta = TensorMeta(torch.Size([8, 768]), (768, 1), torch.float32)
        return DTensorSpec(mesh=None, placements=placements, tensor_meta=meta)

    nodes = {
        "mm": {
            "args": {"data_in_0": spec(Shard(0), Replicate())},
            "results": {"data_out_0": spec(Shard(0), Partial("avg"))},
        }
    }
    path = tmp_path / "ilp_solution.pkl"
    path.write_bytes(module.dumps(nodes))
    loaded = load_solution(path)
    assert loaded["nodes"]["mm"]["args"]["data_in_0"] == (Shard(0), Replicate())
    assert loaded["nodes"]["mm"]["results"]["data_out_0"] == (Shard(0), Partial("avg"))


def test_tensor_metadata_outside_a_spec_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.pkl"
    path.write_bytes(dill.dumps({"format": "mase", "nodes": {}, "shape": torch.Size([2])}))
    with pytest.raises(AutoshardError, match=r"\['shape'\] holds tensor metadata outside"):
        load_solution(path)


def _global4(module: str, name: str) -> bytes:
    return _short(module) + _short(name) + b"\x93"  # STACK_GLOBAL


def test_pre_2_5_torch_placements_load(tmp_path: Path) -> None:
    """MASE-era pickles: ``torch.distributed._tensor.placement_types`` and ``_Partial`` whose
    reduce_op is a ``ReduceOp.RedOpType`` enum (1 = AVG), hand-assembled opcode by opcode."""
    old = "torch.distributed._tensor.placement_types"
    shard = _global4(old, "Shard") + b")\x81}" + _short("dim") + b"K\x01sb"  # NEWOBJ, BUILD
    red_op = _global4("torch._C._distributed_c10d", "ReduceOp.RedOpType") + b")\x81K\x01b"
    partial = _global4(old, "_Partial") + b")\x81}" + _short("reduce_op") + red_op + b"sb"
    replicate = _global4(old, "Replicate") + b")\x81"  # no BUILD: an empty dataclass
    data = (
        b"\x80\x04}"
        + _short("mm")
        + b"}"
        + _short("args")
        + b"}"
        + _short("a")
        + shard
        + partial
        + replicate
        + b"\x87sss."  # TUPLE3, SETITEM x3, STOP
    )
    path = tmp_path / "old.pkl"
    path.write_bytes(data)
    loaded = load_solution(path)
    assert loaded["nodes"]["mm"]["args"]["a"] == (Shard(1), Partial("avg"), Replicate())


def test_protocol_0_placements_are_refused_not_crashed(tmp_path: Path) -> None:
    # Protocol 0/1 would need copyreg._reconstructor, which aborts the interpreter on
    # pybind11 placements; it is refused by name instead.
    data = (
        b"ccopyreg\n_reconstructor\n(ctorch.distributed.tensor.placement_types\nShard\n"
        b"c__builtin__\nobject\nNtR."
    )
    path = tmp_path / "p0.pkl"
    path.write_bytes(data)
    with pytest.raises(AutoshardError, match="copyreg._reconstructor"):
        load_solution(path)


# ------------------------------------------------------------------------------------------
# Sharding maps
# ------------------------------------------------------------------------------------------


def test_sharding_map_round_trip_and_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "solutions" / "gpt2_2x4.json"
    save_sharding_map(path, make_map())
    text = path.read_text()
    assert json.loads(text) == {
        **make_map(),
        "parameters": dict(sorted(make_map()["parameters"].items())),
    }
    assert '    "transformer.h.0.mlp.c_fc.weight": ["R", "S(1)"]' in text.splitlines()
    names = list(json.loads(text)["parameters"])
    assert names == sorted(names)

    smap = load_sharding_map(path)
    assert smap.mesh_shape == (2, 4)
    assert smap.dim_names == ("dp", "tp")
    assert smap.world_size == 8
    assert smap.parameters["transformer.h.0.mlp.c_fc.weight"] == (Replicate(), Shard(1))
    assert smap.inputs == {"input_ids": (Shard(0), Replicate())}
    assert smap.predicted == {"step_time_s": 0.0123, "collectives": {"all_reduce": 2}}
    assert ShardingMap.from_dict(smap.to_dict()) == smap
    save_sharding_map(path, smap)
    assert path.read_text() == text


def test_sharding_map_accepts_placement_objects_and_keeps_extra_keys(tmp_path: Path) -> None:
    data = make_map()
    data["parameters"]["w"] = [Partial("sum"), Shard(0)]
    data["model"] = "gpt2"
    path = tmp_path / "m.json"
    save_sharding_map(path, data)
    smap = load_sharding_map(path)
    assert smap.parameters["w"] == (Partial("sum"), Shard(0))
    assert json.loads(path.read_text())["parameters"]["w"] == ["P(sum)", "S(0)"]
    assert smap.extra == {"model": "gpt2"}
    assert smap.to_dict()["model"] == "gpt2"


def test_sharding_map_without_names_or_optional_sections() -> None:
    smap = ShardingMap.from_dict(
        {"format": "autoshard.sharding_map/1", "mesh": {"shape": [8]}, "parameters": {"w": ["R"]}}
    )
    assert smap.dim_names is None
    assert smap.inputs == {} and smap.predicted == {}
    assert smap.to_dict() == {
        "format": "autoshard.sharding_map/1",
        "mesh": {"shape": [8]},
        "parameters": {"w": ["R"]},
        "inputs": {},
    }


def _edit(**changes) -> dict:
    data = make_map()
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_edit(format=None), "m.json has no 'format'; expected 'autoshard.sharding_map/2'"),
        (_edit(format="autoshard.sharding_map/7"), "has format 'autoshard.sharding_map/7'"),
        (_edit(mesh=None), "missing mesh"),
        (_edit(mesh={"shape": [2, 0]}), r"mesh shape \[2, 0\] must be a list of positive ints"),
        (_edit(mesh={"shape": [2, -4]}), "must be a list of positive ints"),
        (_edit(mesh={"shape": [2, "4"]}), "must be a list of positive ints"),
        (_edit(mesh={"shape": [True, 4]}), "must be a list of positive ints"),
        (_edit(mesh={"shape": []}), "must be a list of positive ints"),
        (_edit(mesh={"shape": "2x4"}), "must be a list of positive ints"),
        (
            _edit(mesh={"shape": [2, 4], "dim_names": ["dp"]}),
            r"mesh has 2 dims \(2x4\) but 1 dim_names",
        ),
        (_edit(mesh={"shape": [2, 4], "dim_names": ["a", "a"]}), "repeat a name"),
        (
            _edit(parameters={"lm_head.weight": ["R", "S(0)", "R"]}),
            r"parameter 'lm_head.weight' has 3 placements but the mesh \(2x4\) has 2 dims",
        ),
        (
            _edit(parameters={"lm_head.weight": ["R"]}),
            r"parameter 'lm_head.weight' has 1 placement but the mesh \(2x4\) has 2 dims",
        ),
        (
            _edit(inputs={"input_ids": ["S(0)"]}),
            "input 'input_ids' has 1 placement but the mesh",
        ),
        (_edit(parameters={"w": ["R", "Shard(0)"]}), r"parameter 'w': bad placement 'Shard\(0\)'"),
        (_edit(parameters={"w": "R,S(0)"}), "parameter 'w' has 'R,S\\(0\\)'; expected a list"),
        (_edit(parameters={"w": ["R", 0]}), "parameter 'w' has placement 0"),
        (_edit(parameters=None), "missing 'parameters'"),
        (_edit(parameters=["w"]), "'parameters' must be an object"),
        (_edit(predicted={"step_time_s": -1}), "predicted 'step_time_s' is -1"),
        (_edit(predicted={"collectives": {"all_reduce": 1.5}}), "predicted collectives"),
        (_edit(predicted=[1]), "'predicted' must be an object"),
    ],
)
def test_sharding_map_validation(tmp_path: Path, data: dict, message: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=message):
        load_sharding_map(path)
    # The same check guards writing: nothing is written.
    out = tmp_path / "out.json"
    with pytest.raises(AutoshardError):
        save_sharding_map(out, data)
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (
            b'{"format": "autoshard.sharding_map/1",\n "mesh": }',
            "is not valid JSON \\(line 2 column",
        ),
        (b"[1, 2]", "holds a JSON array, not a sharding map"),
        (b"\xff\xfe\x00garbage", "is not a text file"),
        (pickle.dumps({"a": 1}), "is a pickle, not a sharding map"),
    ],
)
def test_sharding_map_bad_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(content)
    with pytest.raises(AutoshardError, match=message):
        load_sharding_map(path)


def test_sharding_map_constructor_validates() -> None:
    with pytest.raises(AutoshardError, match="parameter 'w' has 1 placement"):
        ShardingMap(mesh_shape=(2, 4), dim_names=None, parameters={"w": (Replicate(),)})
    with pytest.raises(AutoshardError, match="mesh shape"):
        ShardingMap(mesh_shape=(0,), dim_names=None, parameters={})


def test_save_sharding_map_refuses_non_finite_numbers(tmp_path: Path) -> None:
    data = make_map()
    data["predicted"]["memory_bytes"] = float("nan")
    with pytest.raises(AutoshardError, match="cannot save the sharding map"):
        save_sharding_map(tmp_path / "m.json", data)
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------------------------------
# Kind detection
# ------------------------------------------------------------------------------------------


def test_detect_kind_reads_content_not_extension(tmp_path: Path) -> None:
    pkl_named_json = tmp_path / "really_a_pickle.json"
    save_solution(pkl_named_json, make_solution())
    json_named_pkl = tmp_path / "really_a_map.pkl"
    save_sharding_map(json_named_pkl, make_map())
    assert detect_kind(pkl_named_json) == "solution"
    assert detect_kind(json_named_pkl) == "sharding_map"
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(AutoshardError, match="is empty"):
        detect_kind(tmp_path / "empty")
