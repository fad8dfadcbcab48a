"""Which tensor uses can hide under compute, and under which compute.

Two kinds of resharding run on a communication stream of their own beside the compute,
as PyTorch DDP reduces gradient buckets and FSDP prefetches parameters: a ``GRADIENT``
reduction (the use of a gradient output) and a parameter ``GATHER`` (a parameter
resharded for an op). Each hides under the compute of one neighbouring *segment* of the
step, as real schedules run them:

* FSDP prefetches the parameters of the next block while the current one computes
  (FSDP2 prefetches one block in the backward by default, and in the forward with
  ``FSDPModule.set_modules_to_forward_prefetch``; Zhao et al., "PyTorch FSDP", VLDB 2023,
  "backward prefetching" and "forward prefetching"): a gather for an op of segment ``s``
  hides under segment ``s - 1``.
* DDP launches a bucket's all-reduce when its gradients are ready and the backward pass
  goes on (Li et al., "PyTorch Distributed", VLDB 2020, section 3.2.3); FSDP's
  reduce-scatter likewise: a reduction of a gradient produced in segment ``s`` hides
  under segment ``s + 1``. A gradient of the last segment (the embedding's, in a
  language model) stays exposed, as does a gather for the first.

A segment traced once for ``m`` real copies (the middle blocks) is its own neighbour for
``m - 1`` of them: copy ``k`` hides under copy ``k - 1`` of the same block
(:meth:`Schedule.windows`).

Segments (:func:`schedule`), in execution order: for a model with repeated blocks, each
block's forward and each block's backward is one segment, the ops of a phase before its
first block and after its last block one segment each (embedding; final norm, head and
loss), and an op outside the blocks between two of them joins the block before it (in the
backward the tracer already gives most such ops the block whose tensors they combine, so
the embedding's backward is part of block 0's). For a
model without blocks, each module that holds parameters starts a segment (``fc1``,
``fc2``), and the ops after it join it. :mod:`autoshard.cost.overlap` prices the hiding.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.trace.tracer import TracedGraph

GRADIENT = "gradient"
GATHER = "gather"


@dataclass(frozen=True)
class Schedule:
    """The step's segments in execution order (module docstring).

    ``segment``: op node -> index of its segment. ``mult``: per segment, how many real
    copies of it the traced segment stands for (a middle block traced once for ``L - 3``
    real ones: ``L - 3``; 1 elsewhere). ``labels``: per segment, its name in words.
    """

    segment: dict[str, int]
    mult: tuple[int, ...]
    labels: tuple[str, ...]

    def windows(self, kind: str, producer: str, consumer: str) -> list[tuple[int, int, float]]:
        """Where a use of ``kind`` hides: ``(window, owner, share)`` per part of it, the
        ``share`` of its real reads that hide under segment ``window``'s compute; ``owner``
        is the segment whose copies make the use (``GATHER``: the consumer's; ``GRADIENT``:
        the producer's). ``[]`` when nothing can hide (a gather for the first segment, a
        gradient of the last: the critical path).

        Each real copy of the owner hides under the real copy that runs next to it:
        a gather under the one before, a reduction under the one after. For an owner of
        ``m`` copies (a middle block traced once for ``m`` real ones) that neighbour is
        another copy of the owner itself for ``m - 1`` of them, and the neighbouring
        segment for one: share ``(m - 1) / m`` under the owner's own window and ``1 / m``
        under the neighbour's (the neighbouring segment's compute hides one copy, not
        ``m``)."""
        if kind not in (GATHER, GRADIENT):
            return []
        s = self.segment.get(consumer if kind == GATHER else producer)
        if s is None:
            return []
        m = self.mult[s]
        out = []
        n = s - 1 if kind == GATHER else s + 1
        if 0 <= n < len(self.mult):
            out.append((n, s, 1.0 / m))
        if m > 1:
            out.append((s, s, (m - 1) / m))
        return out

    def hosts(self, window: int, owner: int) -> float:
        """The share of segment ``window``'s real copies under which the uses that segment
        ``owner`` makes (of one kind) hide: ``(m - 1) / m`` of its own (copy ``k`` hides
        copy ``k + 1``'s gathers, or copy ``k - 1``'s reductions), ``1 / m`` of a
        neighbour's (one copy runs beside it), ``m = mult[window]``."""
        m = self.mult[window]
        return (m - 1) / m if window == owner else 1.0 / m


def schedule(graph: TracedGraph) -> Schedule:
    """The segments of ``graph`` (module docstring), cached on the graph."""
    cached = graph.__dict__.get("_schedule")
    if cached is not None:
        return cached
    ops = [(n, i) for n, i in graph.nodes.items() if i.kind == "op"]
    blocks = any(i.layer is not None for _, i in ops)
    keys = _block_keys(ops) if blocks else _module_keys(graph, ops)
    order: dict[tuple, int] = {}
    segment: dict[str, int] = {}
    mult: list[int] = []
    for (name, _), key in zip(ops, keys, strict=True):
        s = order.setdefault(key, len(order))
        if s == len(mult):
            mult.append(1)
        segment[name] = s
        mult[s] = max(mult[s], graph.mult(name))
    labels = tuple(_label(k) for k in order)
    out = Schedule(segment, tuple(mult), labels)
    graph.__dict__["_schedule"] = out
    return out


def _block_keys(ops: list) -> list[tuple]:
    """Segment keys of a model with repeated blocks: (phase, "block", layer), or
    (phase, "head") / (phase, "tail") outside the blocks' span of that phase."""
    keys: list[tuple] = [()] * len(ops)
    for phase in (False, True):
        idx = [k for k, (_, i) in enumerate(ops) if i.backward == phase]
        layered = [k for k in idx if ops[k][1].layer is not None]
        current: tuple = (phase, "head")
        for k in idx:
            layer = ops[k][1].layer
            if layer is not None:
                current = (phase, "block", layer)
            elif not layered or k < layered[0]:
                current = (phase, "head")
            elif k > layered[-1]:
                current = (phase, "tail")
            keys[k] = current
    return keys


def _module_keys(graph: TracedGraph, ops: list) -> list[tuple]:
    """Segment keys of a model without repeated blocks: a run of ops of one module that
    holds parameters starts a segment (a module called twice, apart, gets two); any other
    op joins the segment before it in its phase."""
    owners = {fqn.rpartition(".")[0] for names in graph.param_names.values() for fqn in names}
    owners |= {fqn.rpartition(".")[0] for fqn in graph.param_names}
    owners.discard("")  # a parameter of the root module: no module of its own to segment by
    keys: list[tuple] = []
    current: tuple | None = None
    runs = 0
    for _, i in ops:
        if i.module_path is not None and i.module_path in owners:
            if current is None or current[:3] != (i.backward, "module", i.module_path):
                runs += 1
                current = (i.backward, "module", i.module_path, runs)
        elif current is None or current[0] != i.backward:
            runs += 1
            current = (i.backward, "head", runs)
        keys.append(current)
    return keys


def _label(key: tuple) -> str:
    phase = "backward" if key[0] else "forward"
    if key[1] == "block":
        return f"{phase} block {key[2]}"
    if key[1] == "module":
        return f"{phase} {key[2]}"
    return f"{phase} ({'start' if key[1] == 'head' else 'end'})"
