"""Loading a solution pickle without running its code: a :class:`pickle.Unpickler`
whose ``find_class`` answers from a fixed table of inert stand-ins (:class:`RestrictedUnpickler`,
the table ``_ADMITTED``), then :class:`Thaw` turning the stand-ins into checked values
(builtins and DTensor placements). Why and how: :mod:`autoshard.plan.formats`, "Safe
loading"."""

from __future__ import annotations

import pickle
import re
from typing import IO, Any

import torch
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autoshard.errors import AutoshardError
from autoshard.placements import placement_from_str

# ------------------------------------------------------------------------------------------
# Solution pickles: inert stand-ins for the admitted globals
# ------------------------------------------------------------------------------------------


class _Stub:
    """An inert stand-in for a class a solution pickle names: it records, it never runs.

    The unpickler builds it with NEWOBJ (``__new__``), REDUCE (a call) or BUILD
    (``__setstate__``); all three only store their arguments. ``_thaw`` turns stubs into
    real values afterwards, checking every field.
    """

    what = "object"

    def __new__(cls, *args: object, **kwargs: object) -> _Stub:
        self = object.__new__(cls)
        self.args = args
        self.kwargs = kwargs
        self.state: object = None
        return self

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        self.state = state

    def field(self, name: str, position: int) -> object:
        """A constructor field from BUILD state, keyword or positional argument; else None."""
        if isinstance(self.state, dict) and name in self.state:
            return self.state[name]
        if name in self.kwargs:
            return self.kwargs[name]
        if len(self.args) > position:
            return self.args[position]
        return None


class _ShardStub(_Stub):
    what = "Shard"


class _ReplicateStub(_Stub):
    what = "Replicate"


class _PartialStub(_Stub):
    what = "Partial"


class _ReduceOpStub(_Stub):
    """``ReduceOp.RedOpType`` (pybind11 enum, pickled as NEWOBJ + BUILD <int>): old ``_Partial``."""

    what = "ReduceOp"


class _SpecStub(_Stub):
    """A ``DTensorSpec`` (MASE): only its placements are kept; its mesh must be None."""

    what = "DTensorSpec"


class _DroppedStub(_Stub):
    """What a ``DTensorSpec`` drags in (``TensorMeta``, ``torch.Size``, a dtype): discarded."""

    what = "tensor metadata"


def _namedtuple_stub(*args: object, **kwargs: object) -> type[_DroppedStub]:
    """Stand-in for ``dill._dill._create_namedtuple``: the "class" it makes is inert."""
    return _DroppedStub


_DTYPE_NAMES = sorted(n for n, v in vars(torch).items() if isinstance(v, torch.dtype))

# (module, qualified name) as written in the pickle -> what the unpickler gets instead.
_ADMITTED: dict[tuple[str, str], object] = {
    ("torch.distributed.tensor.placement_types", "Shard"): _ShardStub,
    ("torch.distributed.tensor.placement_types", "Replicate"): _ReplicateStub,
    ("torch.distributed.tensor.placement_types", "Partial"): _PartialStub,
    # torch < 2.5 (MASE's era): the same classes under the private package; _Partial <= 2.3.
    ("torch.distributed._tensor.placement_types", "Shard"): _ShardStub,
    ("torch.distributed._tensor.placement_types", "Replicate"): _ReplicateStub,
    ("torch.distributed._tensor.placement_types", "Partial"): _PartialStub,
    ("torch.distributed._tensor.placement_types", "_Partial"): _PartialStub,
    ("torch._C._distributed_c10d", "ReduceOp.RedOpType"): _ReduceOpStub,
    # DTensorSpec and its entourage, across its three homes (2.2-2.3, 2.4, 2.5+).
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"): _SpecStub,
    ("torch.distributed._tensor._dtensor_spec", "DTensorSpec"): _SpecStub,
    ("torch.distributed._tensor.placement_types", "DTensorSpec"): _SpecStub,
    ("torch.distributed.tensor._dtensor_spec", "TensorMeta"): _DroppedStub,
    ("torch.distributed._tensor._dtensor_spec", "TensorMeta"): _DroppedStub,
    ("torch.distributed._tensor.placement_types", "TensorMeta"): _DroppedStub,
    ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"): _DroppedStub,
    ("torch", "Size"): _DroppedStub,
    ("dill._dill", "_create_namedtuple"): _namedtuple_stub,
    **{("torch", name): _DroppedStub() for name in _DTYPE_NAMES},
}

# RedOpType values (torch.distributed.ReduceOp.RedOpType) -> Partial's reduce_op text.
_REDUCE_OPS = {0: "sum", 1: "avg", 2: "product", 3: "min", 4: "max"}


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` whose globals come only from ``_ADMITTED`` (as stubs)."""

    def __init__(self, file: IO[bytes], source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ADMITTED[(module, name)]
        except (KeyError, TypeError):
            raise AutoshardError(
                f"refusing to load {self.source}: it references {module}.{name}, which "
                "autoshard never writes; solutions may only contain placements and builtins"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise AutoshardError(
            f"refusing to load {self.source}: it uses a persistent id ({pid!r}), which "
            "autoshard never writes; solutions may only contain placements and builtins"
        )


# ------------------------------------------------------------------------------------------
# Solution pickles: from stubs to checked values
# ------------------------------------------------------------------------------------------

_SCALARS = (str, int, float, bool, type(None))
_ALLOWED_TEXT = "dicts, lists, tuples, str, int, float, bool, None and Shard/Replicate/Partial"
_IN_PROGRESS = object()


class Thaw:
    """Turn a freshly unpickled object graph into builtins + real placements, checking types.

    Shared references are converted once (memo by id), so a pickle that shares one list
    many times cannot make this walk exponential; a reference cycle is an error.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.memo: dict[int, object] = {}

    def fail(self, where: str, message: str) -> AutoshardError:
        return AutoshardError(f"{self.prefix} {where} {message}")

    def __call__(self, obj: object, where: str = "the top level") -> object:
        if type(obj) in _SCALARS:
            return obj
        key = id(obj)
        done = self.memo.get(key)
        if done is _IN_PROGRESS:
            raise self.fail(where, "refers back to itself (a reference cycle)")
        if done is not None:
            return done
        self.memo[key] = _IN_PROGRESS
        result = self._convert(obj, where)
        self.memo[key] = result
        return result

    def _convert(self, obj: object, where: str) -> object:
        kind = type(obj)
        if kind in (Shard, Replicate, Partial):  # only when saving: the unpickler makes stubs
            return obj
        if kind is dict:
            out: dict[object, object] = {}
            for k, v in obj.items():
                if type(k) not in _SCALARS:
                    raise self.fail(where, f"has a key of type {type(k).__name__}")
                out[k] = self(v, f"{where}[{k!r}]" if where != "the top level" else f"[{k!r}]")
            return out
        if kind is list or kind is tuple:
            items = [self(v, f"{where}[{i}]") for i, v in enumerate(obj)]
            return items if kind is list else tuple(items)
        if isinstance(obj, _Stub):
            return self._placement_or_spec(obj, where)
        if isinstance(obj, type) and issubclass(obj, _Stub):
            raise self.fail(where, f"is the class {obj.what} itself, not a value")
        raise self.fail(where, f"is a {kind.__name__}; solutions may only hold {_ALLOWED_TEXT}")

    def _placement_or_spec(self, stub: _Stub, where: str) -> object:
        if isinstance(stub, _ShardStub):
            dim = stub.field("dim", 0)
            if type(dim) is not int or dim < 0:
                raise self.fail(where, f"is a Shard with dim {dim!r}; expected an int >= 0")
            return Shard(dim)
        if isinstance(stub, _ReplicateStub):
            return Replicate()
        if isinstance(stub, _PartialStub):
            op = stub.field("reduce_op", 0)
            if op is None:
                op = "sum"
            if isinstance(op, _ReduceOpStub):
                op = _REDUCE_OPS.get(op.state if type(op.state) is int else -1, op.state)
            if type(op) is not str or not re.fullmatch(r"\w+", op):
                raise self.fail(where, f"is a Partial with reduce_op {op!r}; expected e.g. 'sum'")
            return placement_from_str(f"P({op})")
        if isinstance(stub, _SpecStub):
            mesh = stub.field("mesh", 0)
            if mesh is not None:
                raise self.fail(where, "is a DTensorSpec with a mesh; autoshard reads mesh=None")
            placements = self(stub.field("placements", 1), f"{where}.placements")
            if type(placements) not in (tuple, list) or not all(
                isinstance(p, Placement) for p in placements
            ):
                raise self.fail(where, "is a DTensorSpec whose placements are not placements")
            return tuple(placements)
        raise self.fail(where, f"holds {stub.what} outside a DTensorSpec")
