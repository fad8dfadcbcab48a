"""Load a user's model file and build its model and example inputs.

A model file is a plain Python file that defines two functions::

    def build_model() -> torch.nn.Module: ...
    def example_inputs() -> tuple[torch.Tensor, ...]: ...  # GLOBAL shapes

autoshard calls both under ``with torch.device("meta"):`` for planning (no weights are
allocated) and under a real device in the launcher. See ``docs/model-file.md``.

Every mistake in a model file raises :class:`~autoshard.errors.AutoshardError` with a
one-line message that names the file (and the line, where there is one) and the fix.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import inspect
import os
import sys
import traceback
import types
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import AutoshardError

__all__ = ["LoadedModel", "ModelFile", "instantiate", "load_model_file"]

_BUILD_MODEL_EXAMPLE = "def build_model() -> torch.nn.Module: return MyModel()"
_EXAMPLE_INPUTS_EXAMPLE = (
    "def example_inputs() -> tuple[torch.Tensor, ...]: return (torch.randn(8, 1024),)"
)


@dataclass(frozen=True)
class ModelFile:
    """An imported model file.

    Attributes:
        path: absolute path of the file.
        name: the file stem (``"gpt2"`` for ``examples/gpt2.py``); names the outputs,
            e.g. ``solutions/<name>_<mesh>.pkl``.
        module: the imported module; it defines ``build_model`` and ``example_inputs``.
    """

    path: Path
    name: str
    module: types.ModuleType


@dataclass
class LoadedModel:
    """A model built from a model file, with its example inputs.

    Attributes:
        module: the model, in ``eval()`` mode (dropout off).
        inputs: example inputs with GLOBAL shapes, on the requested device.
        input_names: names of ``module.forward``'s parameters, matched positionally to
            ``inputs`` (same length).
        name: the model file's stem.
        loss_fn: the file's ``loss_fn(output, *inputs) -> scalar tensor`` when it defines
            one, else ``None`` (the default loss, :func:`autoshard.model.loss.default_loss`).
    """

    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    input_names: tuple[str, ...]
    name: str
    loss_fn: Callable[..., torch.Tensor] | None = None


def _show(path: Path) -> str:
    """The path as a user wants to read it: relative to the cwd when under it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # other drive on Windows
        return str(path)
    return str(path) if rel.startswith("..") else rel


def _user_line(exc: BaseException, path: Path) -> int | None:
    """The line of ``path`` nearest to where ``exc`` was raised, if it passed through it."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename and Path(frame.filename).resolve() == path:
            line = frame.lineno
    return line


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line."""
    msg = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


@contextlib.contextmanager
def _importable(path: Path, module_name: str, module: types.ModuleType) -> Iterator[None]:
    """Make the file's directory importable and its module findable, for a while only.

    The module is in ``sys.modules`` under its unique name while the file runs (classes
    and dataclasses defined in it look themselves up there), and removed afterwards.

    Helper modules the file imports from beside it, or from a folder it puts on
    ``sys.path`` itself, are the file's own: they leave ``sys.modules`` when it has run,
    so the next load imports them afresh. A helper that reads the environment when it is
    imported (``AUTOSHARD_LAYERS`` in the examples) then reads this load's environment,
    not the first load's, when one process loads model files more than once.
    """
    directory = str(path.parent)
    paths_before = collections.Counter(sys.path)
    modules_before = set(sys.modules)
    added_path = directory not in sys.path
    if added_path:
        sys.path.insert(0, directory)
    had_module = module_name in sys.modules
    sys.modules[module_name] = module
    try:
        yield
    finally:
        if not had_module:
            sys.modules.pop(module_name, None)
        # a folder the file inserted, again on a repeated load (the count goes up)
        folders = {Path(p).resolve() for p in collections.Counter(sys.path) - paths_before if p}
        folders.add(path.parent)
        for name in set(sys.modules) - modules_before:
            if _defined_in(sys.modules.get(name), folders):
                sys.modules.pop(name, None)
        if added_path:
            with contextlib.suppress(ValueError):
                sys.path.remove(directory)


def _defined_in(module: types.ModuleType | None, folders: set[Path]) -> bool:
    """Whether ``module`` is a plain module file directly inside one of ``folders``."""
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).resolve().parent in folders


def load_model_file(path: str | os.PathLike[str]) -> ModelFile:
    """Import a model file under a unique module name.

    The file's directory is importable while it runs, so it may import helper modules
    beside it. Nothing is built yet: call :func:`instantiate` for that.

    Raises:
        AutoshardError: the file is missing, a directory or not ``.py``; it fails to
            import (syntax error or an exception; the message gives the line); or it
            lacks a callable ``build_model`` or ``example_inputs``.
    """
    given = Path(path)
    resolved = given.expanduser().resolve()
    show = _show(resolved)
    if not resolved.exists():
        raise AutoshardError(
            f"{show}: model file not found; pass the path of a .py file that defines "
            "build_model() and example_inputs()"
        )
    if resolved.is_dir():
        raise AutoshardError(
            f"{show}: is a directory, not a model file; pass the path of a .py file that "
            "defines build_model() and example_inputs()"
        )
    if resolved.suffix != ".py":
        raise AutoshardError(
            f"{show}: a model file must be a Python file ending in .py; pass a .py file "
            "that defines build_model() and example_inputs()"
        )

    module_name = f"_autoshard_model_{resolved.stem}_{uuid.uuid4().hex[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    if spec is None or spec.loader is None:  # pragma: no cover - .py files always load
        raise AutoshardError(f"{show}: cannot be imported as a Python file; check its name")
    module = importlib.util.module_from_spec(spec)
    try:
        with _importable(resolved, module_name, module):
            spec.loader.exec_module(module)
    except SyntaxError as exc:
        where = _show(Path(exc.filename).resolve()) if exc.filename else show
        line = f":{exc.lineno}" if exc.lineno else ""
        note = "" if where == show else f" (imported by {show})"
        raise AutoshardError(
            f"{where}{line}: {type(exc).__name__}: {exc.msg}{note}; fix the file"
        ) from exc
    except (Exception, SystemExit) as exc:
        line = _user_line(exc, resolved)
        at = f":{line}" if line is not None else ""
        raise AutoshardError(
            f"{show}{at}: {_one_line(exc)} (while importing the model file; fix the file)"
        ) from exc

    for fn, example in (
        ("build_model", _BUILD_MODEL_EXAMPLE),
        ("example_inputs", _EXAMPLE_INPUTS_EXAMPLE),
    ):
        value = getattr(module, fn, None)
        if value is None:
            raise AutoshardError(f"{show}: does not define {fn}(); add it, e.g. `{example}`")
        if not callable(value):
            raise AutoshardError(
                f"{show}: {fn} is a {type(value).__name__}, not a function; "
                f"define it as a function, e.g. `{example}`"
            )
    loss = getattr(module, "loss_fn", None)
    if loss is not None and not callable(loss):
        raise AutoshardError(
            f"{show}: loss_fn is a {type(loss).__name__}, not a function; define it as "
            "`def loss_fn(output, *inputs) -> torch.Tensor` (a scalar), or remove it"
        )
    return ModelFile(path=resolved, name=resolved.stem, module=module)


def _call(mf: ModelFile, fn: str, device: torch.device) -> Any:
    """Call ``mf.module.<fn>()`` under ``device``; turn its exceptions into AutoshardError."""
    func: Callable[[], Any] = getattr(mf.module, fn)
    show = _show(mf.path)
    try:
        with _importable(mf.path, mf.module.__name__, mf.module), torch.device(device):
            return func()
    except (Exception, SystemExit) as exc:
        line = _user_line(exc, mf.path)
        at = f":{line}" if line is not None else ""
        hint = f"on device {device}; fix {fn}"
        if "CUDA" in str(exc):
            hint = (
                f"on device {device}: drop .cuda(), .to(device) and device= from {fn}(); "
                "autoshard makes every tensor on the device it plans or runs on"
            )
        raise AutoshardError(f"{show}{at}: {fn}() raised {_one_line(exc)} ({hint})") from exc


def _describe(value: object) -> str:
    """A short description of a returned value, for error messages."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"a {type(value).__name__} of ({kinds}{more})"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _forward_inputs(module: torch.nn.Module) -> tuple[list[str], str | None, list[str]]:
    """forward()'s positional parameter names, its ``*args`` name, and required names."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return [], "args", []
    positional: list[str] = []
    var: str | None = None
    required: list[str] = []
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
            if p.default is p.empty:
                required.append(p.name)
        elif p.kind is p.VAR_POSITIONAL:
            var = p.name
        elif p.kind is p.KEYWORD_ONLY and p.default is p.empty:
            required.append(p.name)
    return positional, var, required


def instantiate(mf: ModelFile, device: str | torch.device = "meta") -> LoadedModel:
    """Build the model and its example inputs under ``with torch.device(device):``.

    On ``"meta"`` (the default, for planning) no memory is allocated for weights. The
    module is put in ``eval()`` mode (dropout off). Inputs keep their GLOBAL shapes.

    Raises:
        AutoshardError: ``build_model()`` or ``example_inputs()`` raises or returns the
            wrong type (an ``nn.Module``; a non-empty tuple or list of tensors), on
            ``"meta"`` a model with a parameter on another device (made at import time),
            or ``forward()`` cannot take the inputs (too many, or a required one missing).
    """
    dev = torch.device(device)
    show = _show(mf.path)

    module = _call(mf, "build_model", dev)
    if not isinstance(module, torch.nn.Module):
        raise AutoshardError(
            f"{show}: build_model() returned {_describe(module)}, not a torch.nn.Module; "
            f"return the model, e.g. `{_BUILD_MODEL_EXAMPLE}`"
        )
    module.eval()
    if dev.type == "meta":
        made = next(((n, p.device) for n, p in module.named_parameters() if not p.is_meta), None)
        if made is not None:
            raise AutoshardError(
                f"{show}: build_model() returned a model whose parameter {made[0]} is on "
                f"{made[1]}, not the meta device autoshard plans on: create the model inside "
                "build_model() (a module made at import time, or moved there, stays where it "
                "was made)"
            )

    raw = _call(mf, "example_inputs", dev)
    keywords = None
    if isinstance(raw, Mapping) and raw:
        keywords = _keyword_names(module, raw, show, "example_inputs()")
        raw = tuple(raw.values())
    if isinstance(raw, torch.Tensor):
        raise AutoshardError(
            f"{show}: example_inputs() returned a single Tensor of shape "
            f"{tuple(raw.shape)}; return a tuple of tensors, e.g. `return (x,)`"
        )
    if not isinstance(raw, (tuple, list)) or not raw:
        what = "an empty " + type(raw).__name__ if isinstance(raw, (tuple, list)) else None
        raise AutoshardError(
            f"{show}: example_inputs() returned {what or _describe(raw)}; return a "
            f"non-empty tuple of tensors, e.g. `{_EXAMPLE_INPUTS_EXAMPLE}`"
        )
    for i, item in enumerate(raw):
        if not isinstance(item, torch.Tensor):
            raise AutoshardError(
                f"{show}: example_inputs() returned {_describe(raw)}: item {i} is a "
                f"{type(item).__name__}, not a torch.Tensor; return only tensors, "
                "positionally in forward()'s order"
            )
    moved = []
    for i, t in enumerate(raw):
        try:
            moved.append(t if t.device == dev else t.to(dev))
        except (RuntimeError, NotImplementedError) as exc:
            raise AutoshardError(
                f"{show}: example_inputs() made input {i} on {t.device}, which cannot move "
                f"to {dev} ({_one_line(exc)}); create it without an explicit device="
            ) from exc
    inputs = _unaliased(moved)
    if keywords is not None:
        names = by_keyword(module, keywords)
    else:
        names = _input_names(module, inputs, show, "example_inputs()")
    return LoadedModel(
        module=module,
        inputs=inputs,
        input_names=names,
        name=mf.name,
        loss_fn=getattr(mf.module, "loss_fn", None),
    )


def _unaliased(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The inputs, each its own tensor: one tensor given twice (``labels`` = the
    ``input_ids`` object) is copied. The trace would otherwise read both from one
    placeholder, while the launcher makes every named input on its own (a plan that read
    the token ids as labels differed from one device by 0.4% in the loss)."""
    out: list[torch.Tensor] = []
    for t in inputs:
        shared = any(t is u or (t.untyped_storage() is u.untyped_storage()) for u in out)
        out.append(t.clone() if shared else t)
    return tuple(out)


def _keyword_names(module: torch.nn.Module, raw: Mapping, show: str, what: str) -> tuple[str, ...]:
    """The keys of ``example_inputs()``'s dict, checked against ``forward()``.

    Raises:
        AutoshardError: a key that is not a parameter of ``forward()`` (which takes no
            ``**kwargs``), a value that is not a tensor, or a required parameter missing.
    """
    cls = type(module).__name__
    params = inspect.signature(module.forward).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key, value in raw.items():
        if not isinstance(key, str) or (key not in params and not var_kw):
            raise AutoshardError(
                f"{show}: {what} returned a dict with key {key!r}, which is not a parameter of "
                f"{cls}.forward() ({', '.join(params) or 'none'}); use its parameter names"
            )
        if not isinstance(value, torch.Tensor):
            raise AutoshardError(
                f"{show}: {what}[{key!r}] is {_describe(value)}, not a torch.Tensor; return "
                "only tensors (a flag belongs in build_model())"
            )
    missing = [
        n
        for n, p in params.items()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in raw
    ]
    if missing:
        raise AutoshardError(
            f"{show}: {cls}.forward() requires {', '.join(missing)}, which {what}'s dict lacks"
        )
    return tuple(raw)


_KEYWORDS = "_autoshard_keyword_inputs"
_INNER_FORWARD = "_autoshard_inner_forward"


def _forward_by_keyword(self: torch.nn.Module, *tensors: torch.Tensor):
    """``forward()`` taking the inputs positionally, in the order of the model file's dict,
    and passing them to the model's own ``forward`` by keyword: one patched onto the
    instance before (accelerate's or PEFT's hooks) if there was one, else its class's."""
    inputs = dict(zip(getattr(self, _KEYWORDS), tensors, strict=True))
    inner = self.__dict__.get(_INNER_FORWARD)
    return inner(**inputs) if inner is not None else type(self).forward(self, **inputs)


def by_keyword(module: torch.nn.Module, names: Sequence[str]) -> tuple[str, ...]:
    """Make ``module`` take its inputs positionally in the order of ``names`` (the keys of
    ``example_inputs()``'s dict) and pass them to its ``forward`` by keyword, so that
    tracing, the sharding map (inputs named by key) and the launcher see one positional
    step, and ``loss_fn(output, *inputs)`` gets them in the dict's order. A bound method on
    the instance: a deep copy of the module binds to the copy. A ``forward`` already set on
    the instance is kept and called. Returns ``names``."""
    setattr(module, _KEYWORDS, tuple(names))
    own = module.__dict__.get("forward")
    if own is not None and getattr(own, "__func__", None) is not _forward_by_keyword:
        setattr(module, _INNER_FORWARD, own)  # a hook's forward, not this adapter again
    module.forward = types.MethodType(_forward_by_keyword, module)
    return tuple(names)


def _input_names(
    module: torch.nn.Module, inputs: Sequence[torch.Tensor], show: str, what: str
) -> tuple[str, ...]:
    """``forward()``'s parameter names for ``inputs``, positionally (``*args`` extras as
    ``<name>_<i>``).

    Raises:
        AutoshardError: more inputs than ``forward()`` takes, or a required one missing.
    """
    positional, var, required = _forward_inputs(module)
    cls = type(module).__name__
    if len(inputs) > len(positional) and var is None:
        raise AutoshardError(
            f"{show}: {what} returned {len(inputs)} tensors but "
            f"{cls}.forward() takes {len(positional)} positional input(s) "
            f"({', '.join(positional) or 'none'}); return at most {len(positional)}"
        )
    missing = [n for n in required if n not in positional[: len(inputs)]]
    if missing:
        raise AutoshardError(
            f"{show}: {cls}.forward() requires {', '.join(missing)} but {what} returned "
            f"only {len(inputs)} tensor(s); return one tensor per required input"
        )
    names = positional[: len(inputs)]
    kinds = _non_tensor_parameters(module, names)
    for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        if kind is not None:
            raise AutoshardError(
                f"{show}: {what}'s input {i + 1} (shape {tuple(inputs[i].shape)}) binds to "
                f"{cls}.forward()'s parameter {name!r}, which takes {kind}, not a tensor: inputs "
                "are passed positionally; return only the leading tensor inputs, or wrap the "
                "model in a module whose forward() takes them in order (docs/model-file.md)"
            )
    names += [f"{var}_{i}" for i in range(len(inputs) - len(names))]
    return tuple(names)


def _non_tensor_parameters(module: torch.nn.Module, names: Sequence[str]) -> list[str | None]:
    """Per name, what forward()'s annotation says the parameter takes when that cannot be a
    tensor (a KV cache, a flag), else None. HF's GPT-2 takes ``past_key_values`` second:
    ``(input_ids, attention_mask)`` bound the mask to the cache and failed deep in tracing."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return [None] * len(names)
    out: list[str | None] = []
    for name in names:
        note = params[name].annotation
        text = note if isinstance(note, str) else getattr(note, "__name__", None) or str(note)
        if note is params[name].empty or "Tensor" in text:
            out.append(None)
        elif "Cache" in text:
            out.append("a KV cache")
        elif text in ("bool", "Optional[bool]", "typing.Optional[bool]", "bool | None"):
            out.append("a flag")
        else:
            out.append(None)
    return out


def loaded_from_module(
    module: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    name: str | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
) -> LoadedModel:
    """A model built in Python (on the meta device, or real) and its example inputs
    (global shapes), as a model file would give them: what ``autoshard.solve`` plans.

    The module is put in ``eval()`` mode (dropout off); ``name`` defaults to its class
    name; ``loss_fn(output, *inputs)`` as a model file's (default: the mean of the first
    floating output). Inputs of a module with parameters or buffers on meta are moved to
    meta (only their shapes and dtypes are read).

    Raises:
        AutoshardError: ``module`` is not an ``nn.Module``, the inputs are not a non-empty
            sequence of tensors, or ``forward()`` cannot take them.
    """
    show = name or type(module).__name__
    if not isinstance(module, torch.nn.Module):
        raise AutoshardError(f"the model must be a torch.nn.Module, not {_describe(module)}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else ()
    if not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise AutoshardError(
            f"{show}: example_inputs must be a non-empty tuple of tensors (global shapes), "
            f"got {_describe(example_inputs)}"
        )
    module.eval()
    if any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        # planning needs shapes only; a module built on meta traces with meta inputs (real
        # ones beside meta buffers fail the trace: "found at least two devices")
        inputs = tuple(x.to("meta") for x in inputs)
    inputs = _unaliased(inputs)
    return LoadedModel(
        module=module,
        inputs=inputs,
        input_names=_input_names(module, inputs, show, "example_inputs"),
        name=name or type(module).__name__,
        loss_fn=loss_fn,
    )


def split_microbatches(
    inputs: Sequence[torch.Tensor],
    n: int,
    names: Sequence[str] | None = None,
    option: str = "--microbatches",
) -> list[tuple[torch.Tensor, ...]]:
    """The global batch as ``n`` micro-batches: every input split into ``n`` equal chunks
    along dim 0, as the pipeline schedules split it (``torch.tensor_split``); ``option``:
    the command-line option that set ``n``, for the error.

    Raises:
        AutoshardError: ``n < 1``, an input without dims, or a dim 0 that ``n`` does not
            divide (the message names the input and both numbers).
    """
    if n < 1:
        raise AutoshardError(f"micro-batches must be at least 1, got {n}")
    names = list(names) if names is not None else [f"input {i}" for i in range(len(inputs))]
    for name, x in zip(names, inputs, strict=True):
        if x.dim() == 0 or x.shape[0] % n:
            size = "no dims" if x.dim() == 0 else f"batch size {x.shape[0]} (dim 0)"
            raise AutoshardError(
                f"{name} of shape {tuple(x.shape)} has {size}, which {n} micro-batches do not "
                f"divide; give example_inputs() a batch that is a multiple of {n}, or plan "
                f"with another {option}"
            )
    chunks = [x.tensor_split(n) for x in inputs]
    return [tuple(c[i] for c in chunks) for i in range(n)]
