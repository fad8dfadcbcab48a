"""Memory per device: what a plan keeps, by kind, and the ILP's linear memory row.

Per parameter element on one device (its local shard):

* parameter: ``itemsize`` bytes;
* gradient (training): ``itemsize`` bytes, with the parameter's placement;
* AdamW state (training): two fp32 moments, 8 bytes, plus an fp32 master copy,
  4 bytes, when parameters are not fp32 (mixed precision; Rajbhandari et al.,
  "ZeRO", SC'20, section 3.1: 2 + 2 + 12 bytes per parameter for fp16 Adam).

Gradients: a step that frees its gradients after the optimizer step
(``zero_grad(set_to_none=True)``, PyTorch's default since 2.0, as torchtitan and autoshard's
launcher run it) holds each gradient, at its parameter's placement, from the op that makes
it (the point after it) to the step's end (:func:`gradient_held`), and none at the turn
from forward to backward, where activations peak. PyTorch's
``FSDPMemTracker`` finds no gradient at the peak of such a step
(``tests/test_fsdp_runtime.py``). The op's own output (a partial sum before its
reduction) is an activation, live until its last reader
(:func:`~autoshard.cost.liveness.last_uses`). A step whose gradients persist holds them
all, all the time (:attr:`MemoryModel.freed_gradients` false): gradient accumulation, a
pipeline's micro-batches, DDP's buckets and Megatron-LM's ``main_grad`` buffer.

Activations: which tensors are live at each point of the graph order does not depend
on the plan, only their local sizes do, so the bytes live at one point are linear in the
strategies (:class:`autoshard.cost.liveness.Liveness`). The report's memory is the peak over
the points of the live activations and gradients (:func:`peak_by_kind`) plus the
parameters, optimizer state and persistent gradients; :class:`LiveMemory` gives the same as
ILP budget rows, one per point, so a plan that satisfies every row fits exactly what the
report shows.
There are too many points to hand the ILP all of them: it starts from the point where
the live set is largest in bytes when every tensor is cut as finely as it can be (in
training, the turn from forward to backward), and the driver adds the points a plan
overflows (:func:`autoshard.solver.solve.solve_within_memory`). :func:`memory_rows` (the
saved activations of the turn, plus the inputs) is kept for the pipeline's per-stage ILPs:
there the budget holds at the turn only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from autoshard.cost.checkpointing import columns
from autoshard.cost.liveness import (
    activation_sizes,
    chosen_strategies,
    getitem_sources,
    liveness,
    local_bytes,
    view_base,
)
from autoshard.strategies.graph import StrategyGraph

FP32_MOMENTS_BYTES = 8  # AdamW exp_avg + exp_avg_sq, fp32
FP32_MASTER_BYTES = 4  # fp32 master weights of a mixed-precision step


@dataclass(frozen=True)
class MemoryModel:
    """What a training step keeps per parameter element, in bytes beyond the parameter.

    ``mixed``: mixed precision (``--precision bf16-mixed``): the parameters the step
    computes with in their (half) dtype, an fp32 master copy, its fp32 gradient (the
    gradient is reduced in the reduce dtype, then kept as the master's, as FSDP2's
    ``MixedPrecisionPolicy`` and torchtitan do) and fp32 AdamW moments. Per bf16 parameter
    element: 2 + 4 + 4 + 8 bytes. Otherwise every tensor of the step is in the
    parameter's dtype, as ``torch.optim.AdamW`` keeps it: parameter, gradient and two
    moments (fp32: 4 + 4 + 8 bytes; a ``--dtype bfloat16`` cast: 2 + 2 + 4).
    """

    mode: str = "train"
    mixed: bool = False
    freed_gradients: bool = True

    @property
    def gradients_per_point(self) -> bool:
        """Whether gradients are held from the op that makes each (training, freed after
        every optimizer step: the module docstring) rather than for the whole step."""
        return self.mode == "train" and self.freed_gradients

    def per_param_factors(self, dtype: torch.dtype) -> dict[str, float]:
        """Bytes per byte of local parameter the step keeps, by kind (``parameters`` is
        1): every gradient element counted, held or not at the peak."""
        if self.mode != "train":
            return {"parameters": 1.0}
        item = dtype.itemsize
        if not self.mixed:
            return {"parameters": 1.0, "gradients": 1.0, "optimizer_state": 2.0}
        return {
            "parameters": 1.0,
            "gradients": FP32_MASTER_BYTES / item,
            "optimizer_state": (FP32_MOMENTS_BYTES + FP32_MASTER_BYTES) / item,
        }

    def held_factors(self, dtype: torch.dtype) -> dict[str, float]:
        """:meth:`per_param_factors` of what is held the whole step: without the gradients
        where they are held per point (:attr:`gradients_per_point`)."""
        factors = self.per_param_factors(dtype)
        if self.gradients_per_point:
            factors.pop("gradients", None)
        return factors

    def frozen_factors(self, dtype: torch.dtype) -> dict[str, float]:
        """:meth:`per_param_factors` of a parameter that gets no gradient
        (:meth:`~autoshard.trace.tracer.TracedGraph.frozen_params`): no gradient and no
        AdamW moments (``torch.optim.AdamW`` makes a parameter's state at its first step
        with a gradient); in mixed precision the fp32 copy it is stored as stays
        (``frozen_fp32_copies``: no optimizer state, but held as a trained parameter's
        master copy is)."""
        if self.mode != "train" or not self.mixed:
            return {"parameters": 1.0}
        return {"parameters": 1.0, "frozen_fp32_copies": FP32_MASTER_BYTES / dtype.itemsize}

    def kept(self, dtype: torch.dtype, frozen: bool, held: bool = False) -> dict[str, float]:
        """Bytes per byte of local parameter, by kind: :meth:`frozen_factors` for a
        frozen parameter, else :meth:`held_factors` (``held``) or
        :meth:`per_param_factors`."""
        if frozen:
            return self.frozen_factors(dtype)
        return self.held_factors(dtype) if held else self.per_param_factors(dtype)

    def gradient_factor(self, dtype: torch.dtype) -> float:
        """Bytes per byte of local parameter of its gradient where it is held per point,
        from the op that makes it (:attr:`gradients_per_point`; the gradients of
        :meth:`per_param_factors`); 0 where it is held the whole step."""
        if not self.gradients_per_point:
            return 0.0
        return self.per_param_factors(dtype).get("gradients", 0.0)


def _canonical_params(sg: StrategyGraph):
    """Parameter placeholder nodes, one per distinct tensor.

    A tied parameter may appear under several names in the graph; only the name
    ``graph.param_names`` keys it by counts. (Tied *layers* share variables but not
    tensors: each layer's parameters count.)
    """
    owners = sg.graph.param_names
    for name, info in sg.graph.nodes.items():
        if info.kind == "param" and name in sg.nodes and info.fqn in owners:
            yield name, info


def saved_for_backward(sg: StrategyGraph) -> list[str]:
    """Activations live at the turn from forward to backward: the forward outputs the
    backward pass reads, plus the user inputs (training; empty in inference).

    Each storage counts once: a view the backward reads (a ``view`` flattening a linear's
    input, a ``t`` of a weight) stands for the tensor it aliases (the first non-view op
    down its chain; one output of a multi-output op, read through ``getitem``, is its own
    tensor), and a parameter's view is no activation. Until 2026-12-07 (seventh sitting)
    every view counted beside its base: a two-block Llama's saved activations were priced
    at 7.62 MB where PyTorch's autograd saves 4.87 MB (``tests/test_train.py``)."""
    graph = sg.graph
    if graph.mode != "train":
        return []
    picked = getitem_sources(graph)
    saved = {view_base(graph, n, picked) for n in graph.saved_for_backward()}
    saved |= {n for n, i in graph.nodes.items() if i.kind == "input"}
    return [
        n
        for n in graph.nodes
        if n in saved and n in sg.nodes and graph.nodes[n].kind not in ("param", "buffer")
    ]


def memory_rows(
    sg: StrategyGraph, model: MemoryModel, activation_copies: float = 1.0
) -> dict[str, np.ndarray]:
    """Bytes per device of each representative's strategies (the ILP's budget row).

    ``activation_copies``: how many micro-batches' saved activations are kept at once
    (1 for a plain step; a 1F1B pipeline stage keeps up to the pipeline degree). Every
    gradient counts (:meth:`MemoryModel.per_param_factors`): a pipeline's stage accumulates
    them over its micro-batches.

    Returns rep name -> array over its strategies; reps that keep nothing are absent.
    """
    rows = _param_rows(sg, lambda t, frozen: sum(model.kept(t.dtype, frozen).values()))
    for name in saved_for_backward(sg):
        _add_row(sg, rows, name, 0, activation_copies)
    return rows


def _add_row(sg: StrategyGraph, rows: dict[str, np.ndarray], node: str, index: int, scale: float):
    """Add ``scale`` times node's output ``index``'s local bytes under each strategy of its
    representative to ``rows[rep]``."""
    ns = sg.nodes[node]
    rep = sg.nodes[ns.rep]
    t = sg.graph.nodes[node].results[index]
    if t is None:
        return
    mesh = sg.mesh_shape
    vals = np.array(
        [
            local_bytes(t, ns.strategies[ns.choice[i]].outputs[index], mesh)
            for i in range(len(rep.strategies))
        ]
    )
    rows[ns.rep] = rows.get(ns.rep, 0) + scale * sg.graph.mult(node) * vals


def _param_rows(sg: StrategyGraph, factor) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Per representative, its parameters' local bytes under each strategy times
    ``factor(TensorInfo, frozen)`` (bytes kept per byte of parameter; ``frozen``: it gets
    no gradient)."""
    rows: dict[str, np.ndarray] = {}
    frozen = sg.graph.frozen_params()
    for name, info in _canonical_params(sg):
        _add_row(sg, rows, name, 0, factor(info.results[0], name in frozen))
    return rows


def memory_by_kind(
    sg: StrategyGraph,
    choice: dict[str, int],
    model: MemoryModel,
    recompute: dict | None = None,
) -> dict:
    """Bytes per device by kind (parameters, every gradient, optimizer state, saved
    activations: those the recomputed blocks free are not saved): the step's totals,
    held or not at its peak (:func:`peak_by_kind` gives the gradients held there)."""
    out: dict[str, float] = {}
    mesh = sg.mesh_shape
    frozen = sg.graph.frozen_params()
    for name, info in _canonical_params(sg):
        ns = sg.nodes[name]
        ps = ns.strategies[ns.choice[choice[ns.rep]]].outputs[0]
        b = sg.graph.mult(name) * local_bytes(info.results[0], ps, mesh)
        for kind, f in model.kept(info.results[0].dtype, name in frozen).items():
            out[kind] = out.get(kind, 0.0) + f * b
    saved = 0.0
    for name in saved_for_backward(sg):
        ns = sg.nodes[name]
        ps = ns.strategies[ns.choice[choice[ns.rep]]].outputs[0]
        saved += sg.graph.mult(name) * local_bytes(sg.graph.nodes[name].results[0], ps, mesh)
    if sg.graph.mode == "train":
        if columns(sg) is not None:
            ck = sg.checkpointing
            saved -= ck.saved_bytes(sg, chosen_strategies(sg, choice), recompute)
        out["saved_activations"] = saved
    return out


def ilp_row(sg: StrategyGraph, rows: dict[str, np.ndarray]) -> np.ndarray:
    """The rows concatenated in the ILP's variable order (``sg.reps``)."""
    parts = [rows[r] if r in rows else np.zeros(len(sg.nodes[r].strategies)) for r in sg.reps]
    return np.concatenate(parts) if parts else np.zeros(0)


class LiveMemory:
    """Bytes per device at each point of the step as ILP budget rows (module docstring).

    Row ``k`` over the ILP's ``x`` (``sg.reps`` order): the parameters and optimizer state
    of each strategy (:meth:`MemoryModel.held_factors`), plus the local bytes of every
    activation live at point ``k`` (:class:`autoshard.cost.liveness.Liveness`) and of every
    gradient made by then (:func:`gradient_held`). Under a plan, the largest
    row equals :attr:`autoshard.plan.plan.Plan.memory_bytes` of the plan
    :func:`autoshard.solver.solve.finish_plan` builds.
    """

    def __init__(self, sg: StrategyGraph, model: MemoryModel) -> None:
        self.sg = sg
        self.live = liveness(sg.graph)
        self.params = ilp_row(
            sg, _param_rows(sg, lambda t, frozen: sum(model.kept(t.dtype, frozen, True).values()))
        )
        offsets, pos = {}, 0
        for r in sg.reps:
            offsets[r] = pos
            pos += len(sg.nodes[r].strategies)
        self.offsets = offsets
        # gradient g's bytes over x, and the position from which each is held
        made, held = gradient_held(sg, model)
        grows, gcols, gvals = [], [], []
        for g, (rep, vals) in enumerate(held):
            grows += [g] * len(vals)
            gcols += range(offsets[rep], offsets[rep] + len(vals))
            gvals += list(vals)
        self.gradients = sp.csr_matrix((gvals, (grows, gcols)), shape=(len(held), pos))
        self.made = made
        # activation j's bytes over x: one entry per strategy of its representative
        rows, cols, vals = [], [], []
        mesh = sg.mesh_shape
        for j, n in enumerate(self.live.nodes):
            ns = sg.nodes.get(n)
            if ns is None:  # free: the launcher makes it, the plan keeps nothing
                continue
            results = sg.graph.nodes[n].results
            for i, c in enumerate(ns.choice):
                outs = ns.strategies[c].outputs
                b = sum(
                    local_bytes(r, ps, mesh)
                    for r, ps in zip(results, outs, strict=False)
                    if r is not None
                )
                rows.append(j)
                cols.append(offsets[ns.rep] + i)
                vals.append(b * self.live.scale[j])
        self.bytes = sp.csr_matrix((vals, (rows, cols)), shape=(len(self.live.nodes), pos))

    def rows(self, points) -> np.ndarray:  # noqa: ANN001 - indices into the points
        """Budget rows of ``points``: shape ``(len(points), n_x)``, bytes; with the
        checkpointing decision (:mod:`autoshard.cost.checkpointing`) its columns follow,
        the bytes recomputation frees at each point, negative."""
        points = list(points)
        act = (self.live.points[points] @ self.bytes).toarray() + self.params[None, :]
        act += (self._held(points) @ self.gradients).toarray()
        cols = columns(self.sg)
        if cols is None:
            return act
        return np.hstack([act, cols.memory_rows(points)])

    def per_point(self, choice: dict[str, int], recompute: dict | None = None) -> np.ndarray:
        """Bytes per device at every point under ``choice`` (a strategy per representative)
        and ``recompute`` ((layer, policy) -> real blocks that recompute)."""
        x = np.zeros(self.bytes.shape[1])
        for r, c in choice.items():
            x[self.offsets[r] + c] = 1.0
        used = self.live.points @ (self.bytes @ x) + float(self.params @ x)
        used = used + held_sum(self.live.positions, self.made, self.gradients @ x)
        if columns(self.sg) is not None:
            ck = self.sg.checkpointing
            used = used - ck.freed(self.sg, chosen_strategies(self.sg, choice), recompute)
        return used

    def _held(self, points) -> sp.csr_matrix:  # noqa: ANN001 - indices into the points
        """0/1, ``(len(points), gradients)``: whether gradient ``g`` is held at each point."""
        return sp.csr_matrix(held_at(self.live.positions[list(points)], self.made))

    def first_points(self, k: int = 1) -> list[int]:
        """The ``k`` points with the most bytes live when every activation and gradient
        takes its smallest strategy: the budget rows to start from."""
        if self.live.points.shape[0] == 0:
            return []
        least = self.live.points @ _least_per_row(self.bytes)
        least = least + held_sum(self.live.positions, self.made, _least_per_row(self.gradients))
        return [int(i) for i in np.argsort(-least, kind="stable")[:k]]


def _least_per_row(m: sp.csr_matrix) -> np.ndarray:
    """Per row of ``m`` (bytes over a representative's strategies), its least entry."""
    b = m.tocsr()
    least = np.zeros(b.shape[0])
    has = np.diff(b.indptr) > 0
    if b.nnz:
        least[has] = np.minimum.reduceat(b.data, b.indptr[:-1][has])
    return least


def gradient_held(
    sg: StrategyGraph, model: MemoryModel
) -> tuple[np.ndarray, list[tuple[str, np.ndarray]]]:
    """The gradients held per point (:meth:`MemoryModel.gradient_factor`): the position in
    graph order after which each is held, and its bytes per device over its
    representative's strategies, ``(rep, array)``, at the parameter's placement.

    A gradient is held from the point after the op that makes it (at that op's own point
    its output is an activation, :func:`~autoshard.cost.liveness.last_uses`), a tied
    parameter's under whichever of its names the graph's output gives it. In a
    depth-reduced graph, a traced block's parameter stands for ``mult`` blocks' (one
    :attr:`~autoshard.trace.tracer.TracedGraph.mult` each): one gradient is held from its
    op, the other ``mult - 1`` from the end of the block's backward, where the liveness
    frees the saved activations of the blocks it stands for. A parameter without a
    gradient (read only through ``.detach()``) has none."""
    graph = sg.graph
    grads = graph.param_gradients()
    pos = {n: i for i, n in enumerate(graph.nodes)}
    ends: dict[int, int] = {}  # a block's layer -> its backward's last position
    for n, i in graph.nodes.items():
        if i.kind == "op" and i.backward and i.layer is not None:
            ends[i.layer] = pos[n]
    made: list[int] = []
    held: list[tuple[str, np.ndarray]] = []
    for name, info in _canonical_params(sg):
        factor = model.gradient_factor(info.results[0].dtype)
        grad = grads.get(info.fqn)
        if not factor or grad is None:
            continue
        rows: dict[str, np.ndarray] = {}
        _add_row(sg, rows, name, 0, factor)
        ((rep, vals),) = rows.items()
        m = graph.mult(name)
        if m > 1 and info.layer in ends:
            made += [pos[grad], max(pos[grad], ends[info.layer])]
            held += [(rep, vals / m), (rep, vals * (m - 1) / m)]
        else:
            made.append(pos[grad])
            held.append((rep, vals))
    return np.array(made, dtype=np.int64), held


def held_at(positions: np.ndarray, made: np.ndarray) -> np.ndarray:
    """0/1, ``(len(positions), len(made))``: whether a gradient made at position ``made[g]``
    (:func:`gradient_held`) is held at a point at ``positions[k]``: from the point after
    its op."""
    return (positions[:, None] > made[None, :]).astype(float)


def held_sum(positions: np.ndarray, made: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per point at ``positions[k]``, the sum of ``values[g]`` over the gradients held there
    (:func:`held_at`'s rows times ``values``, without its dense points x gradients matrix:
    a trace of every block has thousands of each)."""
    if len(made) == 0:
        return np.zeros(len(positions))
    order = np.argsort(made, kind="stable")
    total = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=float)[order])])
    return total[np.searchsorted(made[order], positions, side="left")]


def peak_by_kind(
    sg: StrategyGraph, choice: dict[str, int], model: MemoryModel, recompute: dict | None = None
) -> tuple[float, float]:
    """``(activations, gradients)``: bytes per device at the point of the step where the
    two together peak, when gradients are held per point
    (:attr:`MemoryModel.gradients_per_point`; the module docstring): the live activations,
    less what the blocks ``recompute`` names free, and the gradients made by then
    (:func:`gradient_held`). With the parameters and the optimizer state, their sum is the
    largest of :meth:`LiveMemory.per_point`."""
    live = liveness(sg.graph)
    if live.points.shape[0] == 0:
        return 0.0, 0.0
    node_strategy = chosen_strategies(sg, choice)
    act = live.points @ activation_sizes(sg, node_strategy, sg.mesh_shape)
    if columns(sg) is not None:
        act = act - sg.checkpointing.freed(sg, node_strategy, recompute)
    made, held = gradient_held(sg, model)
    local = np.array([vals[choice[rep]] for rep, vals in held])
    grads = held_sum(live.positions, made, local)
    k = int(np.argmax(act + grads))
    return float(act[k]), float(grads[k])
