"""Op-level selective activation checkpointing: which forward ops of a block keep their
output when the block recomputes the rest.

The policy is torchtitan's "op" selective activation checkpointing
(``torchtitan/distributed/activation_checkpoint.py``, ``_get_custom_policy``; also
Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022, which keeps the expensive matmuls and recomputes the cheap element-wise ops): in
one block's forward pass, in execution order,

* every scaled-dot-product attention kernel's output is saved;
* of the ``aten.mm`` calls, the 1st, 3rd, 5th, ... are saved and the 2nd, 4th, ... are
  recomputed ("save every other matmul": half the matmul outputs' memory);
* every other op is recomputed in the backward pass (``PREFER_RECOMPUTE``), up to the
  last op of the block whose output the block's backward reads: ``torch.utils.checkpoint``'s
  non-reentrant recomputation, which selective checkpointing requires, stops there (its
  "early stop", on by default in torch; torchtitan's config may turn it off, priced with
  ``--no-checkpoint-early-stop``). The ops after it (a block's last projection and residual
  add, whose outputs nothing in the backward reads) do not run again. The same stop ends
  the full policy's recomputation (``torch.utils.checkpoint`` around the whole block):
  :func:`recomputed_ops` gives both.

``aten.addmm`` (a linear layer with a bias, GPT-2's ``Conv1D``) is not on torchtitan's
list, so it is recomputed, as torchtitan would.

The same rule decides what the planner prices (:mod:`autoshard.cost.checkpointing`), what
the launcher's interpreter keeps (:mod:`autoshard.launch.graph_run`) and the policy the
real module runs under (:func:`autoshard._torch_private.checkpoint_block`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

aten = torch.ops.aten

_SDPA_PREFIX = "_scaled_dot_product"


def is_saved_kind(target: Any) -> str | None:
    """``"mm"`` for ``aten.mm`` (saved every other call), ``"attention"`` for an SDPA
    forward kernel (always saved), ``None`` for an op the policy recomputes."""
    if target is aten.mm.default:
        return "mm"
    name = getattr(getattr(target, "overloadpacket", target), "__name__", "")
    if name.startswith(_SDPA_PREFIX) and not name.endswith("_backward"):
        return "attention"
    return None


def saves(kind: str | None, mm_calls: int) -> bool:
    """Whether the policy saves an op of ``kind`` (:func:`is_saved_kind`) whose call is the
    ``mm_calls``-th ``aten.mm`` of its block so far (counting itself, from 1)."""
    if kind == "attention":
        return True
    return kind == "mm" and mm_calls % 2 == 1


def saved_in_order(targets: Iterable[Any]) -> list[bool]:
    """Per op of one block's forward pass, in execution order: whether its output is
    saved (module docstring)."""
    out, mm_calls = [], 0
    for t in targets:
        kind = is_saved_kind(t)
        mm_calls += kind == "mm"
        out.append(saves(kind, mm_calls))
    return out


def saved_ops(graph) -> frozenset[str]:  # noqa: ANN001 - a TracedGraph
    """The forward op nodes of the repeated blocks whose outputs the policy keeps
    (:func:`saved_in_order`, counted per block in graph order)."""
    out = set()
    for names in _forward_by_layer(graph).values():
        flags = saved_in_order(graph.nodes[n].target for n in names)
        out.update(n for n, kept in zip(names, flags, strict=True) if kept)
    return frozenset(out)


def _forward_by_layer(graph) -> dict[int, list[str]]:  # noqa: ANN001 - a TracedGraph
    by_layer: dict[int, list[str]] = {}
    for n, info in graph.nodes.items():
        if info.kind == "op" and info.layer is not None and not info.backward:
            by_layer.setdefault(info.layer, []).append(n)
    return by_layer


EARLY_STOP_KEY = "checkpoint_early_stop"
"""The key of a sharding map's or solution's ``predicted`` that says whether its blocks'
recomputation stops early (:func:`early_stops`)."""


def early_stops(predicted: Mapping[str, Any]) -> dict[str, bool]:
    """Per policy (``"full"``, ``"selective"``), whether a plan file's recomputed blocks
    stop rerunning early (:func:`recomputed_ops`): its ``predicted`` says so
    (:data:`EARLY_STOP_KEY`); a file written before that key is read as it was priced,
    full recomputation rerunning the whole forward and selective recomputation stopping
    early."""
    if EARLY_STOP_KEY in predicted:
        stop = bool(predicted[EARLY_STOP_KEY])
        return {"full": stop, "selective": stop}
    return {"full": False, "selective": True}


def _block_backward(graph, name: str, layer: int) -> bool:  # noqa: ANN001 - a TracedGraph
    """Whether op ``name`` is part of block ``layer``'s own backward: a backward op of the
    layer, but for one of a module outside the repeated blocks. A module after the blocks
    (the final norm) reads the last block's output from outside its checkpoint, and its
    backward ops take the last block's layer only as the glue of
    :func:`autoshard.trace.tracer._attribute_backward_glue` does; autograd's own glue
    (no module) counts."""
    info = graph.nodes[name]
    if not info.backward or info.layer != layer:
        return False
    path = info.module_path
    if path is None:  # autograd's glue, given the layer of what it reads
        return True
    return any(path == p or path.startswith(p + ".") for p in graph.block_prefixes)


def recomputed_ops(  # noqa: ANN001 - a TracedGraph
    graph, policy: str = "selective", early_stop: bool = True
) -> frozenset[str]:
    """The forward op nodes of the repeated blocks (``layer`` set) that a block under
    ``policy`` recomputes: under ``"full"`` every op of its forward, under ``"selective"``
    all but those :func:`saved_in_order` keeps, counted per block in graph order; with
    ``early_stop`` only up to the block's last forward op its own backward reads
    (``torch.utils.checkpoint``'s non-reentrant early stop, module docstring; what another
    block's backward reads, such as the block's output, that block keeps as its input).
    Without it (reentrant checkpointing, as Megatron-LM's, or
    ``torch.utils.checkpoint.set_checkpoint_early_stop(False)``) the whole forward.

    Raises:
        ValueError: ``policy`` is neither ``"full"`` nor ``"selective"``.
    """
    if policy not in ("full", "selective"):
        raise ValueError(f"policy must be 'full' or 'selective', got {policy!r}")
    users = graph.users()
    out = set()
    for layer, names in _forward_by_layer(graph).items():
        if policy == "full":
            flags = [False] * len(names)
        else:
            flags = saved_in_order(graph.nodes[n].target for n in names)
        read = [any(_block_backward(graph, u, layer) for u in users[n]) for n in names]
        end = len(names) - 1
        if early_stop:
            end = max((i for i, r in enumerate(read) if r), default=-1)
        out.update(n for n, kept in zip(names[: end + 1], flags, strict=False) if not kept)
    return frozenset(out)


def context_fn() -> tuple:
    """The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` (and of
    ``checkpoint_wrapper``) that runs a block under this policy: a fresh count of
    ``aten.mm`` calls per forward pass and per recomputation, as torchtitan's does."""
    from torch.utils.checkpoint import (  # noqa: PLC0415 - only where a block is wrapped
        CheckpointPolicy,
        create_selective_checkpoint_contexts,
    )

    calls = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:  # noqa: ANN001, ANN002, ANN003
        kind = is_saved_kind(op)
        mode = "recompute" if ctx.is_recompute else "forward"
        calls[mode] += kind == "mm"
        if saves(kind, calls[mode]):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
