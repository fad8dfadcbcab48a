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

    def window(self, kind: str, producer: str, consumer: str) -> int | None:
        """The segment whose compute can hide a use of ``kind`` (``GATHER``: the one
        before the consumer's; ``GRADIENT``: the one after the producer's), or None when
        there is none (the use is on the critical path)."""
        if kind == GATHER:
            s = self.segment.get(consumer)
            return s - 1 if s is not None and s > 0 else None
        if kind == GRADIENT:
            s = self.segment.get(producer)
            return s + 1 if s is not None and s + 1 < len(self.mult) else None
        return None

    def weight(self, window: int, kind: str) -> float:
        """Seconds of window ``window``'s compute one second of hidden communication of
        ``kind`` takes, counted over all the real copies both stand for: each real copy of
        the segment that owns the use hides under one real copy of its neighbour, so a
        use owned by a segment of ``a`` copies under a window of ``m`` copies weighs
        ``m / a``."""
        owner = window + 1 if kind == GATHER else window - 1
        return self.mult[window] / self.mult[owner]


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
