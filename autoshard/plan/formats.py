"""Reading and writing autoshard's files: solution pickles and sharding maps.

Two kinds of file leave ``autoshard solve`` (see DESIGN.md, "Outputs"):

- a **solution pickle** (dill, ``solutions/<name>.pkl``): a plain dict of builtins and DTensor
  placements (``Shard``, ``Replicate``, ``Partial``) in the ``autoshard.solution/1`` layout,
  or a bare MASE node dict (node name -> ``{"args": ..., "results": ...}``);
- a **sharding map** (JSON): parameter FQN -> one placement per mesh dim, plus the mesh, the
  inputs' placements and the plan's predictions; what the launcher reads.

Every write is atomic (:func:`atomic_write`): a temporary file in the target's directory,
fsync, then :func:`os.replace`, so a crash or a failing serialiser never leaves a half-written
file behind and the previous file stays as it was.

Safe loading
------------
Solutions are shared between people and machines, and unpickling an arbitrary file runs
arbitrary code: a pickle can name any importable callable (``os.system``,
``subprocess.Popen``, ``builtins.eval``, dill's ``_create_code``) and call it. Every callable
a pickle can reach comes through :meth:`pickle.Unpickler.find_class`, so
:func:`load_solution` overrides it and answers from a fixed table, ``_ADMITTED``, of the
globals that autoshard (and MASE) pickles actually reference, as listed by
``pickletools.dis(dill.dumps(solution))``::

    STACK_GLOBAL 'torch.distributed.tensor.placement_types' 'Shard'    NEWOBJ BUILD {'dim': 0}
    STACK_GLOBAL 'torch.distributed.tensor.placement_types' 'Replicate'
    STACK_GLOBAL 'torch.distributed.tensor.placement_types' 'Partial'  BUILD {'reduce_op': 'sum'}

Builtins (dict, list, tuple, str, int, float, bool, None) need no global at all. Any other
global is refused with an :class:`AutoshardError` naming it, at the moment the unpickler
meets it, which is before any call that could use it.

Even the admitted globals are never handed to the unpickler: it gets inert stand-ins
(``_Stub`` subclasses) that only record the arguments and state the file gives. Real
placements are then built by autoshard itself from checked values
(``Shard(dim)`` with ``dim`` a non-negative int, ``Partial(op)`` with ``op`` a word). This
matters because the torch 2.13 placements are pybind11 objects: ``Partial.__new__`` without
``__init__`` leaves an uninitialised C++ string behind, and a protocol 0/1 pickle of a
placement (``copyreg._reconstructor``) aborts the interpreter.

Older files are admitted the same inert way: placements under their pre-2.5 module path
``torch.distributed._tensor.placement_types`` (including ``_Partial``, whose ``reduce_op``
was a ``ReduceOp.RedOpType`` enum), and ``DTensorSpec`` values, of which only the
``placements`` are kept (the mesh must be ``None``; ``TensorMeta``, ``torch.Size``, dtypes
and dill's namedtuple factory, which a spec drags in, are read into inert stubs and dropped).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import dill
from torch.distributed.tensor import Placement

from autoshard.errors import AutoshardError
from autoshard.placements import placement_from_str, placement_to_str
from autoshard.plan.atomic import atomic_write, atomic_write_text
from autoshard.plan.unpickle import RestrictedUnpickler, Thaw
from autoshard.strategies.optimizer import OPTIMIZERS

__all__ = [
    "MASE_FORMAT",
    "PICKLE_PROTOCOL",
    "SHARDING_MAP_FORMAT",
    "SHARDING_MAP_FORMAT_V1",
    "STAGE_PLAN_FORMAT",
    "SOLUTION_FORMAT",
    "ShardingMap",
    "detect_kind",
    "load_sharding_map",
    "load_solution",
    "loads_solution",
    "save_sharding_map",
    "save_solution",
    "solution_digest",
]

SOLUTION_FORMAT = "autoshard.solution/1"
"""The ``"format"`` tag of a solution pickle written by this autoshard."""

MASE_FORMAT = "mase"
"""The ``"format"`` tag given to a bare MASE node dict once it is loaded (normalised)."""

SHARDING_MAP_FORMAT = "autoshard.sharding_map/2"
"""The ``"format"`` tag of a sharding map written by this autoshard. Version 2 adds
``"solution"`` (the solution pickle the launcher runs, by file name and SHA-256) and the
predicted collectives per phase and mesh dim."""

SHARDING_MAP_FORMAT_V1 = "autoshard.sharding_map/1"
"""Version 1 maps (parameters and inputs only) still load; they launch with DTensor's own
propagation (``--mode propagate``), not the plan."""

STAGE_PLAN_FORMAT = "autoshard.stage_plan/1"
"""The ``"format"`` tag of a pipeline stage plan (``autoshard stages``)."""

PICKLE_PROTOCOL = 4
"""dill's default protocol; placements need protocol >= 2 (lower ones crash the interpreter)."""

_SOLUTION_FORMATS = (SOLUTION_FORMAT, MASE_FORMAT)


def loads_solution(data: bytes, source: str = "the solution") -> dict[str, Any]:
    """Load a solution from pickle bytes, safely; ``source`` names it in errors.

    See :func:`load_solution` for what is returned and raised.
    """
    if not data.strip():
        raise AutoshardError(f"{source} is empty; re-run `autoshard solve` to write it again")
    head = data.lstrip()[:1]
    if head in (b"{", b"["):
        hint = _json_hint(data)
        if hint is not None:
            raise AutoshardError(f"{source} {hint}")
    stream = io.BytesIO(data)
    try:
        raw = RestrictedUnpickler(stream, source).load()
    except AutoshardError:
        raise
    except RecursionError:
        raise AutoshardError(f"{source} is nested too deeply to be a solution") from None
    except Exception as e:  # pickle raises many types on bad bytes: all mean "corrupt"
        if _is_text(data):  # a model file, a log, a README: not a damaged plan
            raise AutoshardError(
                f"{source} is not a plan file: it is text, neither a solution pickle nor a "
                "sharding map (JSON); give the .pkl or .json that `autoshard solve` writes"
            ) from None
        reason = str(e) or type(e).__name__
        raise AutoshardError(
            f"{source} is truncated or corrupt ({reason}); copy it again or re-run "
            "`autoshard solve`"
        ) from e
    if stream.tell() != len(data):
        raise AutoshardError(
            f"{source} is corrupt: {len(data) - stream.tell()} bytes follow the end of the "
            "pickle; copy it again or re-run `autoshard solve`"
        )
    try:
        obj = Thaw(f"{source} is not a valid solution:")(raw)
    except RecursionError:
        raise AutoshardError(f"{source} is nested too deeply to be a solution") from None
    return _normalise_solution(obj, source)


def _is_text(data: bytes) -> bool:
    """UTF-8 text without control bytes other than whitespace (a pickle of protocol 2 or
    more starts with the byte 0x80, and protocol 0 pickles load before this is asked)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\n\r\t\f" for c in text)


def load_solution(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a solution pickle without running any code from it.

    Returns the ``autoshard.solution/1`` dict (see the module docstring) with every
    placement sequence as a tuple of real ``Shard``/``Replicate``/``Partial`` objects, one per
    mesh dim. A bare MASE node dict comes back wrapped as ``{"format": "mase", "nodes": ...}``;
    MASE's ``DTensorSpec`` values come back as their placements.

    Raises:
        AutoshardError: the file cannot be read; it is empty, truncated or corrupt; it is
            JSON (e.g. a sharding map); it references any global other than the placement
            classes (the message names the global, and nothing from the file has run); it is
            not a solution (e.g. a list), has an unknown ``"format"`` (the message names the
            expected one), or its entries are malformed (the message names the entry).
    """
    p = Path(path)
    return loads_solution(_read_bytes(p), str(p))


def save_solution(path: str | os.PathLike[str], solution: Mapping[str, Any]) -> None:
    """Write ``solution`` as a dill pickle, atomically, after checking it can be loaded back.

    ``solution`` must be an ``autoshard.solution/1`` dict (or ``"format": "mase"``) made only
    of dict, list, tuple, str, int, float, bool, None and exact ``Shard``/``Replicate``/
    ``Partial`` placements; placement sequences hold one placement per mesh dim.

    Raises:
        AutoshardError: when ``solution`` holds anything else (the message gives the path
            inside the dict, e.g. ``['nodes']['mm']['shapes']['x'] is a Size``) or breaks the
            layout; ``path`` is then not touched. Also when the file cannot be written.
    """
    prefix = "cannot save the solution:"
    if not isinstance(solution, Mapping) or "format" not in solution:
        raise AutoshardError(f"{prefix} it is not a dict with a 'format' ({SOLUTION_FORMAT!r})")
    try:
        normalised = _normalise_solution(Thaw(prefix)(solution), "the solution to save", prefix)
    except RecursionError:
        raise AutoshardError(f"{prefix} it is nested too deeply") from None
    atomic_write(path, lambda f: dill.dump(normalised, f, protocol=PICKLE_PROTOCOL))


def _json_hint(data: bytes) -> str | None:
    """Why JSON bytes are not a solution pickle, or None when they do not parse as JSON."""
    try:
        parsed = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    if isinstance(parsed, dict) and parsed.get("format") in (
        SHARDING_MAP_FORMAT,
        SHARDING_MAP_FORMAT_V1,
    ):
        return (
            "is a sharding map (JSON), not a solution pickle; pass the .pkl that "
            "`autoshard solve` wrote beside it"
        )
    return "is a JSON file, not a solution pickle; pass the .pkl that `autoshard solve` wrote"


# ------------------------------------------------------------------------------------------
# Solution layout
# ------------------------------------------------------------------------------------------


def _normalise_solution(obj: object, source: str, prefix: str | None = None) -> dict[str, Any]:
    """Check the solution layout; wrap a bare MASE node dict. ``obj`` is already thawed.

    Messages start with ``prefix``, by default ``"<source> is not a valid solution:"``.
    """
    if type(obj) is not dict:
        raise AutoshardError(
            f"{source} holds a {type(obj).__name__}, not an autoshard solution (a dict with "
            f"'format': '{SOLUTION_FORMAT}', or a MASE dict of node -> args/results)"
        )
    if "format" not in obj:
        obj = {"format": MASE_FORMAT, "nodes": _bare_mase_nodes(obj, source)}
    fmt = obj["format"]
    if fmt not in _SOLUTION_FORMATS:
        raise AutoshardError(
            f"{source} has format {fmt!r}; this autoshard reads {SOLUTION_FORMAT!r} (or a bare "
            "MASE node dict): re-run `autoshard solve` with this version"
        )
    bad = _Layout(prefix or f"{source} is not a valid solution:")
    if "nodes" not in obj:
        raise bad("has no 'nodes'")
    mesh = obj.get("mesh")
    ndim = bad.mesh(mesh) if mesh is not None else None
    nodes = bad.mapping(obj["nodes"], "'nodes'")
    for name, node in nodes.items():
        where = f"node {name!r}"
        if type(node) is not dict:
            raise bad(f"{where} is a {type(node).__name__}; expected a dict with args/results")
        for part in ("args", "results"):
            entries = bad.mapping(node.get(part, {}), f"{where} {part!r}")
            for arg, placements in entries.items():
                label = f"{where} {'arg' if part == 'args' else 'result'} {arg!r}"
                node[part][arg] = bad.placements(placements, label, ndim)
                ndim = len(node[part][arg])
        if "shapes" in node:
            for arg, shape in bad.mapping(node["shapes"], f"{where} 'shapes'").items():
                if type(shape) not in (list, tuple) or not all(
                    type(s) is int and s >= 0 for s in shape
                ):
                    raise bad(f"{where} shape of {arg!r} is {shape!r}; expected a list of ints")
    for section in ("parameters", "inputs"):
        for key, placements in bad.mapping(obj.get(section, {}), repr(section)).items():
            obj[section][key] = bad.placements(placements, f"{section[:-1]} {key!r}", ndim)
            ndim = len(obj[section][key])
    for number in ("objective_s",):
        if number in obj and type(obj[number]) not in (int, float):
            raise bad(f"{number!r} is {obj[number]!r}; expected a number of seconds")
    for section in ("cost_model", "solver"):
        if section in obj:
            bad.mapping(obj[section], repr(section))
    return obj


def _bare_mase_nodes(obj: dict[Any, Any], source: str) -> dict[Any, Any]:
    """A MASE export: node name -> {"args": {...}, "results": {...}} and nothing else."""
    if not obj:
        raise AutoshardError(f"{source} holds an empty dict, not a solution")
    for name, node in obj.items():
        if type(node) is not dict or not set(node) <= {"args", "results"} or not node:
            raise AutoshardError(
                f"{source} is not a solution: it has no 'format' and its entry {name!r} is not a "
                "MASE node ({'args': ..., 'results': ...})"
            )
    return obj


class _Layout:
    """Checks of the solution layout; each failure is an AutoshardError naming the entry."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, message: str) -> AutoshardError:
        return AutoshardError(f"{self.prefix} {message}")

    def mapping(self, value: object, where: str) -> dict[Any, Any]:
        if type(value) is not dict:
            raise self(f"{where} is a {type(value).__name__}; expected a dict")
        return value

    def mesh(self, mesh: object) -> int:
        mesh = self.mapping(mesh, "'mesh'")
        shape = mesh.get("shape")
        if (
            type(shape) not in (list, tuple)
            or not shape
            or not all(type(s) is int and s > 0 for s in shape)
        ):
            raise self(f"mesh shape is {shape!r}; expected a list of positive ints, e.g. [2, 4]")
        for key, ok in (
            ("dim_names", lambda v: type(v) is str),
            ("bandwidth_Bps", lambda v: _is_number(v) and v > 0),
            ("latency_s", lambda v: _is_number(v) and v >= 0),
        ):
            values = mesh.get(key)
            if values is None:
                continue
            if type(values) not in (list, tuple) or len(values) != len(shape):
                raise self(f"mesh {key} is {values!r}; expected one per mesh dim ({len(shape)})")
            if not all(ok(v) for v in values):
                raise self(f"mesh {key} is {values!r}; a value is of the wrong kind or range")
        return len(shape)

    def placements(self, value: object, where: str, ndim: int | None) -> tuple[Placement, ...]:
        """The placements as a tuple, checked to number ``ndim`` (any when None)."""
        if type(value) not in (list, tuple) or not all(isinstance(p, Placement) for p in value):
            raise self(f"{where} is {value!r}; expected one placement per mesh dim")
        if not value:
            raise self(f"{where} has no placements; expected one per mesh dim")
        if ndim is not None and len(value) != ndim:
            raise self(
                f"{where} has {_count(len(value), 'placement')} but the mesh has "
                f"{_count(ndim, 'dim')}; expected one per mesh dim"
            )
        return tuple(value)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _is_number(v: object) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


# ------------------------------------------------------------------------------------------
# Sharding maps
# ------------------------------------------------------------------------------------------

_MAP_KEYS = ("format", "mesh", "parameters", "inputs", "predicted")


@dataclass(frozen=True)
class ShardingMap:
    """A sharding map: the mesh and one placement per mesh dim for each parameter and input.

    Attributes:
        mesh_shape: devices along each mesh dim, e.g. ``(2, 4)``; positive ints.
        dim_names: one name per mesh dim (e.g. ``("dp", "tp")``), or None when the map names
            none.
        parameters: parameter FQN -> placements, one per mesh dim.
        inputs: input name -> placements, one per mesh dim.
        predicted: the plan's predictions (``step_time_s`` in seconds, ``collectives``: kind
            -> count, ...); free-form, may be empty.
        extra: any other top-level keys of the file, kept so that a round trip loses nothing.
        source: names the map in error messages (the file path when loaded from one).

    Raises:
        AutoshardError: on construction, when the mesh shape is not positive ints, the dim
            names do not match it, or an entry does not have exactly one placement per mesh
            dim (the message names the entry and both counts).
    """

    mesh_shape: tuple[int, ...]
    dim_names: tuple[str, ...] | None
    parameters: dict[str, tuple[Placement, ...]]
    inputs: dict[str, tuple[Placement, ...]] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = field(default="sharding map", compare=False, repr=False)
    format: str = SHARDING_MAP_FORMAT

    def __post_init__(self) -> None:
        src = self.source
        shape = self.mesh_shape
        if (
            not isinstance(shape, tuple)
            or not shape
            or not all(type(s) is int and s > 0 for s in shape)
        ):
            raise AutoshardError(
                f"{src}: mesh shape {list(shape) if isinstance(shape, Sequence) else shape!r} "
                "must be a list of positive ints, e.g. [2, 4]"
            )
        names = self.dim_names
        if names is not None:
            if not isinstance(names, tuple) or not all(isinstance(n, str) and n for n in names):
                raise AutoshardError(f"{src}: mesh dim_names {names!r} must be non-empty strings")
            if len(names) != len(shape):
                raise AutoshardError(
                    f"{src}: mesh has {len(shape)} dims ({self.mesh_text}) but "
                    f"{len(names)} dim_names {list(names)}; give one name per mesh dim"
                )
            if len(set(names)) != len(names):
                raise AutoshardError(f"{src}: mesh dim_names {list(names)} repeat a name")
        for kind, entries in (("parameter", self.parameters), ("input", self.inputs)):
            for name, placements in entries.items():
                if not isinstance(name, str) or not name:
                    raise AutoshardError(f"{src}: {kind} name {name!r} must be a non-empty string")
                if not isinstance(placements, tuple) or not all(
                    isinstance(p, Placement) for p in placements
                ):
                    raise AutoshardError(
                        f"{src}: {kind} {name!r} has {placements!r}; expected a tuple of placements"
                    )
                if len(placements) != len(shape):
                    raise AutoshardError(
                        f"{src}: {kind} {name!r} has {_count(len(placements), 'placement')} "
                        f"but the mesh ({self.mesh_text}) has {_count(len(shape), 'dim')}; give "
                        "one placement per mesh dim"
                    )
        _check_predicted(self.predicted, src)

    @property
    def ndim(self) -> int:
        """Number of mesh dims."""
        return len(self.mesh_shape)

    @property
    def world_size(self) -> int:
        """Number of devices in the mesh (product of ``mesh_shape``)."""
        return math.prod(self.mesh_shape)

    @property
    def mesh_text(self) -> str:
        """The mesh shape as the CLI writes it, e.g. ``"2x4"``."""
        return "x".join(str(s) for s in self.mesh_shape)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready dict (placements as text, parameters sorted by FQN).

        ``ShardingMap.from_dict(m.to_dict()) == m`` for every map ``m``.
        """
        mesh: dict[str, Any] = {"shape": list(self.mesh_shape)}
        if self.dim_names is not None:
            mesh["dim_names"] = list(self.dim_names)
        out: dict[str, Any] = {
            "format": self.format,
            "mesh": mesh,
            "parameters": {
                k: [placement_to_str(p) for p in self.parameters[k]]
                for k in sorted(self.parameters)
            },
            "inputs": {k: [placement_to_str(p) for p in v] for k, v in self.inputs.items()},
        }
        if self.predicted:
            out["predicted"] = self.predicted
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "sharding map") -> ShardingMap:
        """Build and validate a map from its JSON dict; placements may be text or objects.

        Raises:
            AutoshardError: on a missing or unknown ``"format"`` (naming the expected one), a
                bad mesh, an entry without exactly one placement per mesh dim, or a placement
                that does not parse (the message names the entry).
        """
        if not isinstance(data, Mapping):
            raise AutoshardError(
                f"{source} holds a JSON {_json_type(data)}, not a sharding map (an object with "
                f"'format': '{SHARDING_MAP_FORMAT}')"
            )
        fmt = data.get("format")
        if fmt not in (SHARDING_MAP_FORMAT, SHARDING_MAP_FORMAT_V1):
            found = "no 'format'" if fmt is None else f"format {fmt!r}"
            raise AutoshardError(
                f"{source} has {found}; expected {SHARDING_MAP_FORMAT!r}: write it with "
                "`autoshard solve` (or add the tag)"
            )
        mesh = data.get("mesh")
        if not isinstance(mesh, Mapping) or "shape" not in mesh:
            raise AutoshardError(
                f'{source}: missing mesh; expected "mesh": {{"shape": [2, 4], '
                '"dim_names": ["dp", "tp"]}'
            )
        shape, names = mesh["shape"], mesh.get("dim_names")
        if not isinstance(shape, list):
            raise AutoshardError(
                f"{source}: mesh shape {shape!r} must be a list of positive ints, e.g. [2, 4]"
            )
        if names is not None and not isinstance(names, list):
            raise AutoshardError(f"{source}: mesh dim_names {names!r} must be a list of strings")
        if "parameters" not in data:
            raise AutoshardError(f"{source}: missing 'parameters' (FQN -> placements)")
        predicted = data.get("predicted", {})
        if not isinstance(predicted, Mapping):
            raise AutoshardError(f"{source}: 'predicted' must be an object, not {predicted!r}")
        return cls(
            mesh_shape=tuple(shape),
            dim_names=None if names is None else tuple(names),
            parameters=_parse_entries(data["parameters"], "parameter", source),
            inputs=_parse_entries(data.get("inputs", {}), "input", source),
            predicted=dict(predicted),
            extra={k: v for k, v in data.items() if k not in _MAP_KEYS},
            source=source,
            format=str(fmt),
        )

    def solution_path(self) -> Path | None:
        """The solution pickle a version-2 map points to (beside the map), else ``None``.

        Raises:
            AutoshardError: the map names a solution that is missing or whose SHA-256
                differs (the solution was rewritten after the map).
        """
        ref = self.extra.get("solution")
        if self.format == SHARDING_MAP_FORMAT_V1 or not isinstance(ref, Mapping):
            return None
        name = ref.get("file")
        if not isinstance(name, str) or not name or "/" in name or "\\" in name:
            raise AutoshardError(
                f"{self.source}: 'solution.file' must be a file name, got {name!r}"
            )
        path = Path(self.source).parent / name
        if not path.is_file():
            raise AutoshardError(
                f"{self.source} runs the solution {name}, which is not beside it; copy both "
                "files together (or solve again)"
            )
        want = ref.get("plan_sha256")
        if isinstance(want, str) and solution_digest(load_solution(path)) != want:
            raise AutoshardError(
                f"{path} is not the solution {self.source} was written with (its plan's "
                "SHA-256 differs); solve again so that the map and the solution match"
            )
        return path


_DIGEST_KEYS = ("model", "mesh", "cost_model", "nodes", "parameters", "inputs")


def solution_digest(solution: Mapping[str, Any]) -> str:
    """SHA-256 of what a solution plans: its model, mesh, cost model, nodes, parameters and
    inputs, as canonical JSON (sorted keys, placements as text). Solver statistics (wall
    times) are left out, so two solves of one model digest alike and write byte-identical
    sharding maps, while any changed placement changes the digest."""

    def plain(x: Any) -> Any:
        if isinstance(x, Placement):
            return placement_to_str(x)
        if isinstance(x, Mapping):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    body = {k: plain(solution.get(k)) for k in _DIGEST_KEYS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _parse_entries(entries: object, kind: str, source: str) -> dict[str, tuple[Placement, ...]]:
    """``{name: ["R", "S(1)"]}`` (text or Placement objects) -> placement tuples."""
    if not isinstance(entries, Mapping):
        raise AutoshardError(f"{source}: '{kind}s' must be an object of name -> placements")
    out: dict[str, tuple[Placement, ...]] = {}
    for name, texts in entries.items():
        if not isinstance(texts, (list, tuple)):
            raise AutoshardError(
                f"{source}: {kind} {name!r} has {texts!r}; expected a list of placements such "
                'as ["R", "S(0)"], one per mesh dim'
            )
        parsed = []
        for t in texts:
            if isinstance(t, Placement):
                placement_to_str(t)  # refuses kinds with no text form
                parsed.append(t)
            elif isinstance(t, str):
                try:
                    parsed.append(placement_from_str(t))
                except AutoshardError as e:
                    raise AutoshardError(f"{source}: {kind} {name!r}: {e}") from None
            else:
                raise AutoshardError(
                    f"{source}: {kind} {name!r} has placement {t!r}; write R, S(<dim>) or P(<op>)"
                )
        out[name] = tuple(parsed)
    return out


def _check_predicted(predicted: object, source: str) -> None:
    if not isinstance(predicted, Mapping):
        raise AutoshardError(f"{source}: 'predicted' must be an object, not {predicted!r}")
    for key, value in predicted.items():
        values = value.values() if isinstance(value, Mapping) else [value]
        seconds = isinstance(key, str) and key.endswith("_s")
        if seconds and not all(_is_number(v) and v >= 0 for v in values):
            raise AutoshardError(
                f"{source}: predicted {key!r} is {value!r}; expected seconds >= 0 (a number, "
                "or an object of numbers)"
            )
    device = predicted.get("device")
    if device is not None and not isinstance(device, str):
        raise AutoshardError(f"{source}: predicted 'device' is {device!r}; expected a name")
    optimizer = predicted.get("optimizer", OPTIMIZERS[0])
    if optimizer not in OPTIMIZERS:
        raise AutoshardError(
            f"{source}: predicted 'optimizer' is {optimizer!r}; expected one of "
            f"{', '.join(OPTIMIZERS)} (solve again with autoshard)"
        )
    collectives = predicted.get("collectives", {})
    if not isinstance(collectives, Mapping) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in collectives.items()
    ):
        raise AutoshardError(
            f"{source}: predicted collectives {collectives!r} must map a collective to a count, "
            'e.g. {"all_reduce": 2}'
        )


def _json_type(value: object) -> str:
    return {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def save_sharding_map(path: str | os.PathLike[str], smap: Mapping[str, Any] | ShardingMap) -> None:
    """Write a sharding map as JSON, atomically, after validating it.

    ``smap`` is a :class:`ShardingMap` or its dict (placements as text or Placement objects).
    The file is indented by 2 with parameters sorted by FQN and each placement list on one line
    (``"fc.weight": ["R", "S(1)"]``), so maps diff well.

    Raises:
        AutoshardError: when the map does not validate (see :meth:`ShardingMap.from_dict`) or
            holds a non-finite number; ``path`` is then not touched. Also when the file cannot
            be written.
    """
    if not isinstance(smap, ShardingMap):
        smap = ShardingMap.from_dict(smap, "the sharding map to save")
    try:
        text = _dump_json(smap.to_dict()) + "\n"
    except (TypeError, ValueError) as e:
        raise AutoshardError(f"cannot save the sharding map: {e}") from e
    atomic_write_text(path, text)


def load_sharding_map(path: str | os.PathLike[str]) -> ShardingMap:
    """Read and validate a sharding map (JSON) written by :func:`save_sharding_map`.

    Raises:
        AutoshardError: the file cannot be read; it is empty; it is a pickle or not JSON
            (the message gives line and column); or the map does not validate (see
            :meth:`ShardingMap.from_dict`; messages start with the path).
    """
    p = Path(path)
    data = _read_bytes(p)
    if not data.strip():
        raise AutoshardError(f"{p} is empty; expected a sharding map (JSON)")
    if data[:1] == b"\x80":
        raise AutoshardError(
            f"{p} is a pickle, not a sharding map (JSON); pass the .json that `autoshard solve` "
            "wrote, or see this file with `autoshard show`"
        )
    try:
        parsed = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise AutoshardError(f"{p} is not a text file, so not a sharding map ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise AutoshardError(
            f"{p} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})"
        ) from e
    return ShardingMap.from_dict(parsed, str(p))


def _dump_json(obj: object, indent: int = 0) -> str:
    """JSON with nested objects indented by 2 and lists of scalars kept on one line."""
    pad = " " * indent
    if isinstance(obj, Mapping) and obj:
        items = [
            f"{pad}  {json.dumps(str(k))}: {_dump_json(v, indent + 2)}" for k, v in obj.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in obj):
        items = [f"{pad}  {_dump_json(v, indent + 2)}" for v in obj]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(obj, allow_nan=False)


# ------------------------------------------------------------------------------------------
# Either kind
# ------------------------------------------------------------------------------------------


def detect_kind(path: str | os.PathLike[str]) -> Literal["solution", "sharding_map"]:
    """Which kind of autoshard file ``path`` is, from its content (not its extension).

    JSON text (first non-blank byte ``{``) is a sharding map; anything else is treated as a
    solution pickle, which its loader then checks.

    Raises:
        AutoshardError: when the file cannot be read or is empty.
    """
    p = Path(path)
    data = _read_bytes(p)
    if not data.strip():
        raise AutoshardError(f"{p} is empty; expected a solution pickle or a sharding map")
    return "sharding_map" if data.lstrip()[:1] == b"{" else "solution"


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise AutoshardError(f"cannot read {path}: {e.strerror or e}") from e
