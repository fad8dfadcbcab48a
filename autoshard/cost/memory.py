"""Memory per device: what a plan keeps, by kind, and the ILP's linear memory row.

Per parameter element on one device (its local shard):

* parameter: ``itemsize`` bytes;
* gradient (training): ``itemsize`` bytes, with the parameter's placement;
* AdamW state (training): two fp32 moments, 8 bytes, plus an fp32 master copy,
  4 bytes, when parameters are not fp32 (mixed precision; Rajbhandari et al.,
  "ZeRO", SC'20, section 3.1: 2 + 2 + 12 bytes per parameter for fp16 Adam).

Activations: which tensors are live at each point of the graph order does not depend
on the plan, only their local sizes do, so the bytes live at one point are linear in the
strategies (:class:`autoshard.cost.liveness.Liveness`). The report's memory is the peak over
the points (:func:`autoshard.cost.liveness.peak_activation_bytes`) plus the parameters,
gradients and optimizer state; :class:`LiveMemory` gives the same as ILP budget rows,
one per point, so a plan that satisfies every row fits exactly what the report shows.
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
from autoshard.cost.liveness import chosen_strategies, liveness, local_bytes
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

    def per_param_factors(self, dtype: torch.dtype) -> dict[str, float]:
        """Bytes kept per byte of local parameter, by kind (``parameters`` is 1)."""
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
    backward pass reads, plus the user inputs (training; empty in inference)."""
    graph = sg.graph
    if graph.mode != "train":
        return []
    saved = set(graph.saved_for_backward())
    saved |= {n for n, i in graph.nodes.items() if i.kind == "input"}
    return [n for n in graph.nodes if n in saved and n in sg.nodes]


def memory_rows(
    sg: StrategyGraph, model: MemoryModel, activation_copies: float = 1.0
) -> dict[str, np.ndarray]:
    """Bytes per device of each representative's strategies (the ILP's budget row).

    ``activation_copies``: how many micro-batches' saved activations are kept at once
    (1 for a plain step; a 1F1B pipeline stage keeps up to the pipeline degree).

    Returns rep name -> array over its strategies; reps that keep nothing are absent.
    """
    rows: dict[str, np.ndarray] = {}
    mesh = sg.mesh_shape

    def add(node: str, index: int, scale: float) -> None:
        ns = sg.nodes[node]
        rep = sg.nodes[ns.rep]
        info = sg.graph.nodes[node]
        t = info.results[index]
        if t is None:
            return
        vals = np.array(
            [
                local_bytes(t, ns.strategies[ns.choice[i]].outputs[index], mesh)
                for i in range(len(rep.strategies))
            ]
        )
        rows[ns.rep] = rows.get(ns.rep, 0) + scale * sg.graph.mult(node) * vals

    for name, info in _canonical_params(sg):
        factor = sum(model.per_param_factors(info.results[0].dtype).values())
        add(name, 0, factor)
    for name in saved_for_backward(sg):
        add(name, 0, activation_copies)
    return rows


def memory_by_kind(
    sg: StrategyGraph,
    choice: dict[str, int],
    model: MemoryModel,
    recompute: dict | None = None,
) -> dict:
    """Bytes per device by kind (parameters, gradients, optimizer state, saved
    activations: those the recomputed blocks free are not saved)."""
    out: dict[str, float] = {}
    mesh = sg.mesh_shape
    for name, info in _canonical_params(sg):
        ns = sg.nodes[name]
        ps = ns.strategies[ns.choice[choice[ns.rep]]].outputs[0]
        b = sg.graph.mult(name) * local_bytes(info.results[0], ps, mesh)
        for kind, f in model.per_param_factors(info.results[0].dtype).items():
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

    Row ``k`` over the ILP's ``x`` (``sg.reps`` order): the parameters, gradients and
    optimizer state of each strategy, plus the local bytes of every activation live at
    point ``k`` (:class:`autoshard.cost.liveness.Liveness`). Under a plan, the largest row
    equals :attr:`autoshard.plan.plan.Plan.memory_bytes` of the plan
    :func:`autoshard.solver.solve.finish_plan` builds.
    """

    def __init__(self, sg: StrategyGraph, model: MemoryModel) -> None:
        self.sg = sg
        self.live = liveness(sg.graph)
        self.params = ilp_row(sg, _param_rows(sg, model))
        offsets, pos = {}, 0
        for r in sg.reps:
            offsets[r] = pos
            pos += len(sg.nodes[r].strategies)
        self.offsets = offsets
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
        act = (self.live.points[list(points)] @ self.bytes).toarray() + self.params[None, :]
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
        if columns(self.sg) is not None:
            ck = self.sg.checkpointing
            used = used - ck.freed(self.sg, chosen_strategies(self.sg, choice), recompute)
        return used

    def first_points(self, k: int = 1) -> list[int]:
        """The ``k`` points with the most bytes live when every activation takes its
        smallest strategy: the budget rows to start from."""
        if self.live.points.shape[0] == 0:
            return []
        b = self.bytes.tocsr()
        least = np.zeros(b.shape[0])
        has = np.diff(b.indptr) > 0
        if b.nnz:
            least[has] = np.minimum.reduceat(b.data, b.indptr[:-1][has])
        return [int(i) for i in np.argsort(-(self.live.points @ least), kind="stable")[:k]]


def _param_rows(sg: StrategyGraph, model: MemoryModel) -> dict[str, np.ndarray]:
    """:func:`memory_rows` of the parameters alone (with their gradients and optimizer
    state)."""
    return memory_rows(sg, model, activation_copies=0.0)
