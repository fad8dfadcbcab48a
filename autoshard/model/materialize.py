"""Materialise a model file's model with real, deterministic weights.

The launcher needs the same weights on every rank (each rank then keeps its shard) and
in the single-device reference of ``--check``. Building the model straight on a real
device would run the model's own initialisation with whatever the random state is, on
every rank, for the whole model; building it on the meta device loses the buffers that
``__init__`` *computes* (rotary ``inv_freq``, position-id ranges, causal masks), because
on meta they have no values.

So autoshard builds in two phases:

1. **Skeleton.** ``build_model()`` runs under ``torch.device("cpu")`` while
   ``nn.Module.register_parameter`` is patched to move every parameter to the meta
   device as it is registered (the approach of ``accelerate.init_empty_weights(
   include_buffers=False)``). Parameters cost no memory and their initialisers run on
   meta (free); buffers, and any other tensor ``__init__`` computes, are real and exact.
2. **Initialise, one unit at a time** (:func:`init_units`: the parameters outside the
   repeated blocks, then each block). A unit's meta parameters are replaced by empty
   tensors on the target device (tied parameters stay one object), filled with NaN as a
   sentinel, and initialised by the model's own code under the unit's seed
   (:func:`unit_seed`) while every other parameter is on meta:
   HuggingFace models (``transformers.PreTrainedModel``) by ``init_weights()`` (their
   ``_init_weights``, which also re-ties weights and recomputes rotary buffers); other
   modules by ``reset_parameters()`` (or ``_reset_parameters()``), children before
   parents, as ``nn.Module.apply`` visits them. Elements no initialiser wrote (still
   NaN) get a documented fallback: normal(0, 0.02) for tensors of two or more dims,
   ones for vectors and scalars; their names are reported.

A launch rank keeps only its shard of each unit before the next one is made
(``place``), so it never holds the whole model (issue 16: eight ranks of GPT-2 small
each held all 124 M parameters). The same seed on the same device type gives
bit-identical weights on every rank and in the reference run, placed or not. Inputs
are synthesised from ``example_inputs()``'s shapes and dtypes with their own seeded
generator (:func:`make_inputs`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.model.blocks import find_block_prefixes
from autoshard.model.model_file import LoadedModel, ModelFile, instantiate

__all__ = [
    "DEFAULT_TOKEN_RANGE",
    "FALLBACK_STD",
    "Materialized",
    "ParameterPlacer",
    "build_skeleton",
    "init_parameters",
    "init_units",
    "make_inputs",
    "materialize",
    "params_on_meta",
    "unit_seed",
]

FALLBACK_STD = 0.02
"""Standard deviation of the fallback init for uninitialised matrices (HF's default)."""

DEFAULT_TOKEN_RANGE = 100
"""Integer inputs are drawn from ``[0, DEFAULT_TOKEN_RANGE)`` when the model has no
``config.vocab_size``."""


@dataclass
class Materialized:
    """A model with real weights and synthetic inputs, ready to run.

    Attributes:
        loaded: the model (real parameters and buffers on ``device``, ``eval()`` mode)
            and the synthetic inputs (global shapes, on ``device``).
        fallback_init: FQNs of parameters that the model's own initialisers left (partly)
            unwritten and that got the fallback init; empty for well-behaved models.
    """

    loaded: LoadedModel
    fallback_init: tuple[str, ...] = field(default_factory=tuple)


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Within this context, every parameter a module registers moves to the meta device.

    Buffers and other tensors stay where they were created. A parameter that is already
    on meta is registered as is, so ``a.weight = b.weight`` keeps the two tied.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is None or param.is_meta:
            return
        if type(param) is nn.Parameter:
            moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        else:  # a Parameter subclass: rebuild it the way accelerate does
            kwargs = dict(param.__dict__)
            kwargs["requires_grad"] = param.requires_grad
            moved = type(param)(param.detach().to("meta"), **kwargs)
        module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def build_skeleton(mf: ModelFile, seed: int = 0) -> LoadedModel:
    """Build the model with parameters on meta and buffers real, on the CPU.

    ``torch.manual_seed(seed)`` runs first, so anything ``build_model()`` creates for real
    (buffers, tensors it does not register as parameters) is the same on every rank.
    The returned inputs are ``example_inputs()``'s, on the CPU; only their shapes and
    dtypes are used (see :func:`make_inputs`).

    Raises:
        AutoshardError: as :func:`autoshard.model.model_file.instantiate`.
    """
    torch.manual_seed(seed)
    with params_on_meta():
        return instantiate(mf, device="cpu")


def _is_hf_model(module: nn.Module) -> bool:
    """True for a ``transformers.PreTrainedModel`` (without importing transformers)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
        for c in type(module).__mro__
    )


def _clear_hf_flags(module: nn.Module) -> None:
    """Forget HF's ``_is_hf_initialized`` marks, set while the skeleton was built on meta.

    Left in place, they make ``init_weights()`` skip every module it already "initialised".
    """
    for obj in [*module.modules(), *module.parameters(), *module.buffers()]:
        if "_is_hf_initialized" in getattr(obj, "__dict__", {}):
            del obj.__dict__["_is_hf_initialized"]


def _run_initialisers(module: nn.Module, path: str = "") -> None:
    """Children first, then ``module``: HF ``init_weights()`` or ``reset_parameters()``."""
    if _is_hf_model(module):
        _clear_hf_flags(module)
        _call_init(module, "init_weights", path)
        return
    for name, child in module.named_children():
        _run_initialisers(child, f"{path}.{name}" if path else name)
    for fn in ("reset_parameters", "_reset_parameters"):
        if callable(getattr(module, fn, None)):
            _call_init(module, fn, path)
            break


def _call_init(module: nn.Module, fn: str, path: str) -> None:
    """``module.<fn>()`` under no_grad; its exceptions become an AutoshardError."""
    try:
        with torch.no_grad():
            getattr(module, fn)()
    except Exception as exc:  # noqa: BLE001 - user code: report it on one line
        where = path or "the model"
        msg = " ".join(str(exc).split())
        raise AutoshardError(
            f"{where} ({type(module).__name__}).{fn}() raised {type(exc).__name__}: {msg} "
            "while initialising weights; fix the model's initialiser"
        ) from exc


ParameterPlacer = Callable[[str, nn.Parameter], nn.Parameter]
"""``place(fqn, full)`` -> the parameter a rank keeps (its shard), for :func:`init_parameters`."""


def init_units(module: nn.Module) -> list[str]:
    """The units :func:`init_parameters` initialises one at a time, by module prefix, in
    order: ``""`` (every parameter outside the repeated blocks: embeddings, final norm,
    head), then each repeated block (:func:`autoshard.model.blocks.find_block_prefixes`)
    by index. A model without repeated blocks is one unit. Unit ``k`` is seeded with
    :func:`unit_seed` ``(seed, k)``.
    """

    blocks = find_block_prefixes(module)
    return [""] + sorted(blocks, key=blocks.__getitem__)


def unit_seed(seed: int, unit: int) -> int:
    """The seed of unit ``unit`` (:func:`init_units`): ``seed`` for unit 0 (a model without
    blocks initialises as ``torch.manual_seed(seed)`` then its initialisers), else a 63-bit
    mix of the two."""
    if unit == 0:
        return seed
    return (seed * 1_000_003 + unit * 7_919) % (2**63 - 1)


def init_parameters(
    module: nn.Module,
    seed: int,
    device: str | torch.device = "cpu",
    place: ParameterPlacer | None = None,
) -> list[str]:
    """Give every meta parameter real storage on ``device`` and initialise it, seeded,
    one unit (:func:`init_units`) at a time.

    For each unit: its parameters become real (NaN-filled) while every other parameter
    is on meta, ``torch.manual_seed(unit_seed(seed, k))`` runs, then the model's
    own initialisers over the whole model (on meta, the other units' writes are free and
    draw nothing from the random state); elements left NaN get the fallback; then
    ``place`` (when given) turns each full parameter into what this process keeps, and
    the full tensor is dropped before the next unit. So a rank holds at most one unit
    in full (GPT-2 small: the embeddings, 157 MB in fp32) beside its shards, and the
    values are the same with or without ``place`` (the single-device reference of
    ``--check`` calls this without it).

    Parameters already real (a model file that registers them by hand) keep their
    values; buffers move to ``device``. Tied parameters stay tied (one ``Parameter``,
    placed once).

    Args:
        module: a skeleton from :func:`build_skeleton` (modified in place).
        seed: the launch's seed (see :func:`unit_seed`).
        device: where the parameters live, e.g. ``"cpu"`` or ``"cuda:0"``.
        place: ``place(fqn, full_parameter) -> parameter`` (e.g. a DTensor parameter
            holding this rank's shard); ``None`` keeps the full parameters.

    Returns:
        FQNs of parameters that got the fallback init (see the module docstring).

    Raises:
        AutoshardError: a buffer is still on meta, or an initialiser raised.
    """
    dev = torch.device(device)
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for name, b in list(mod._buffers.items()):
            if b is None:
                continue
            if b.is_meta:
                fqn = f"{mod_name}.{name}" if mod_name else name
                raise AutoshardError(
                    f"buffer {fqn} of shape {tuple(b.shape)} was created on the meta device, "
                    "so it has no values; create it without device='meta' in the model file"
                )
            if b.device != dev:
                mod._buffers[name] = b.to(dev)

    # every parameter slot, and each tensor's first name (tied slots share one tensor)
    slots: list[tuple[nn.Module, str, nn.Parameter]] = []
    first: dict[int, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=True):
        for name, p in mod._parameters.items():
            if p is not None:
                slots.append((mod, name, p))
                first.setdefault(id(p), f"{mod_name}.{name}" if mod_name else name)
    skeleton = {id(p): p for _, _, p in slots}
    parked = {i: _on_meta(p) for i, p in skeleton.items()}  # what other units see
    for mod, name, p in slots:
        mod._parameters[name] = parked[id(p)]

    units = init_units(module)
    unit_of = {
        i: next((k for k, pre in enumerate(units) if pre and fqn.startswith(pre + ".")), 0)
        for i, fqn in first.items()
    }

    done: dict[int, nn.Parameter] = {}
    fallback: list[str] = []
    for k in range(len(units)):
        members = [i for i in skeleton if unit_of[i] == k]
        if not members:
            continue
        live: dict[int, nn.Parameter] = {}
        for i in members:
            p = skeleton[i]
            if p.is_meta:
                data = torch.empty(p.shape, dtype=p.dtype, device=dev)
                if data.is_floating_point() or data.is_complex():
                    data.fill_(math.nan)
                else:
                    data.zero_()
            else:
                data = p.detach().to(dev)
            live[i] = nn.Parameter(data, requires_grad=p.requires_grad)
        for mod, name, p in slots:
            if id(p) in live:
                mod._parameters[name] = live[id(p)]
        torch.manual_seed(unit_seed(seed, k))
        _run_initialisers(module)
        for mod, name, p in slots:  # what the initialisers left in this unit's slots
            if id(p) in live:
                live[id(p)] = mod._parameters[name]
                mod._parameters[name] = parked[id(p)]
        for i in members:
            full = live.pop(i)
            if _fill_holes(full):
                fallback.append(first[i])
            done[i] = place(first[i], full) if place is not None else full
            del full
    for mod, name, p in slots:
        mod._parameters[name] = done[id(p)]
    return sorted(fallback)


def _on_meta(p: nn.Parameter) -> nn.Parameter:
    """``p`` itself when on meta, else a meta parameter of its shape and dtype."""
    if p.is_meta:
        return p
    return nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)


def _fill_holes(p: torch.Tensor) -> bool:
    """Elements no initialiser wrote (NaN) get the fallback init; True when any did."""
    if not (p.is_floating_point() or p.is_complex()):
        return False
    with torch.no_grad():
        holes = torch.isnan(p)
        if not bool(holes.any()):
            return False
        fill = torch.empty_like(p)
        if p.dim() >= 2:
            fill.normal_(0.0, FALLBACK_STD)
        else:
            fill.fill_(1.0)
        p.copy_(torch.where(holes, fill, p))
    return True


def _vocab_size(module: nn.Module) -> int | None:
    """``module.config.vocab_size`` (or its text config's) when the model has one."""
    config = getattr(module, "config", None)
    if config is None:
        return None
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and callable(getattr(config, "get_text_config", None)):
        vocab = getattr(config.get_text_config(), "vocab_size", None)
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else None


def make_inputs(
    loaded: LoadedModel, seed: int, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Synthetic inputs with the shapes and dtypes of ``loaded.inputs``, seeded.

    Drawn on the CPU from ``torch.Generator().manual_seed(seed)`` (so every device type
    gets the same values), then moved to ``device``:

    - floating point: standard normal;
    - bool: fair coin;
    - integers named like a mask (``*mask*``): all ones; ``*token_type*``: zeros;
      ``position_ids``: ``0, 1, ...`` along the last dim;
    - other integers (token ids): uniform in ``[0, config.vocab_size)`` when the model
      has a config with a vocabulary size, else ``[0, DEFAULT_TOKEN_RANGE)``.
    """
    gen = torch.Generator().manual_seed(seed)
    high = _vocab_size(loaded.module) or DEFAULT_TOKEN_RANGE
    out: list[torch.Tensor] = []
    for name, t in zip(loaded.input_names, loaded.inputs, strict=True):
        shape, dtype = tuple(t.shape), t.dtype
        if dtype.is_floating_point or dtype.is_complex:
            x = torch.randn(shape, generator=gen, dtype=dtype)
        elif dtype == torch.bool:
            x = torch.randint(0, 2, shape, generator=gen).bool()
        elif "mask" in name:
            x = torch.ones(shape, dtype=dtype)
        elif "token_type" in name:
            x = torch.zeros(shape, dtype=dtype)
        elif name == "position_ids" and shape:
            x = torch.arange(shape[-1], dtype=dtype).expand(shape).contiguous()
        else:
            x = torch.randint(0, high, shape, generator=gen, dtype=dtype)
        out.append(x.to(device))
    return tuple(out)


def materialize(mf: ModelFile, seed: int = 0, device: str | torch.device = "cpu") -> Materialized:
    """Build ``mf``'s model with seeded weights and seeded synthetic inputs on ``device``.

    Deterministic: the same ``mf``, ``seed`` and device type give bit-identical
    parameters, buffers and inputs in every process. Memory: the whole model, once,
    on ``device``.

    Raises:
        AutoshardError: from the model file, a meta buffer, or a failing initialiser.
    """
    skeleton = build_skeleton(mf, seed)
    fallback = init_parameters(skeleton.module, seed, device)
    inputs = make_inputs(skeleton, seed, device)
    loaded = LoadedModel(
        module=skeleton.module.eval(),
        inputs=inputs,
        input_names=skeleton.input_names,
        name=skeleton.name,
        loss_fn=skeleton.loss_fn,
    )
    return Materialized(loaded=loaded, fallback_init=tuple(fallback))
