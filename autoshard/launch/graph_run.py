"""Run the plan itself: the traced graph, each node's inputs placed as the plan says.

``autoshard launch`` in its default mode (``--mode plan``) does not let DTensor choose the
placement of activations: it re-traces the model exactly as ``autoshard solve`` did (the
same ATen graph, the same node names; the joint forward/backward graph in training) and
runs that graph with :class:`PlanInterpreter`, a ``torch.fx.Interpreter`` over DTensors,
as meta-pytorch/autoparallel's ``apply_sharding.py`` does:

- before each op, every tensor argument is redistributed to the placements the solution
  chose for that input, one mesh dim at a time in the order the cost model priced
  (:meth:`autoshard.cost.collectives.CommModel.redistribute_path`), so the collectives that
  run are the ones the ILP paid for;
- the op runs under DTensor's dispatch, whose rule, given inputs placed exactly as one of
  its strategies wants, produces that strategy's output; an output that differs from the
  plan's is a *deviation*: counted, named, and redistributed to the plan's placement;
- an op with no DTensor rule (the plan gave it replicated inputs and outputs, as the
  solver's fallback does) runs on each rank's local, full copy;
- an op with a kernel of its own (:mod:`autoshard.strategies.registry`: the fused
  attention ops, the fused experts ops, a model's custom ops) runs that kernel on each
  rank's shards, told the mode of each mesh dim; the experts' exchanges tokens by
  ``all_to_all_single`` where the plan shards experts and tokens on the same mesh dim
  (expert parallelism, :mod:`autoshard.strategies.experts`);
- nodes the plan marks free (factory ops, masks, position ids, buffers) run on plain
  tensors on every rank and enter the DTensor world as ``Replicate``, from which any
  placement is a local slice.

Every graph output is then placed as its sink says: a gradient gets its parameter's
placements (the data-parallel all-reduce or reduce-scatter the plan priced). Collectives
are attributed to the phase of the node that issued them (forward, backward).
"""

from __future__ import annotations

import contextlib
import operator
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor import zeros as dtensor_zeros

from autoshard import _torch_private as tp
from autoshard._torch_private import flatten_mesh_groups, tree_flatten, tree_map, tree_unflatten
from autoshard.cost.collectives import comm_model
from autoshard.cost.mesh import MeshSpec
from autoshard.errors import AutoshardError
from autoshard.launch.check import NO_FLOAT64, run_narrowed
from autoshard.launch.collective_log import CollectiveLog
from autoshard.launch.lowered import PHASE, local_shard
from autoshard.placements import each_whole_on_single, whole_on_single
from autoshard.strategies.registry import KernelContext
from autoshard.strategies.rules import OpRule, op_rule
from autoshard.strategies.strategy import Strategy
from autoshard.trace.rerun_reads import shared_rerun_reads
from autoshard.trace.selective import early_stops, recomputed_ops
from autoshard.trace.tracer import TracedGraph, between_blocks, tensor_arg_nodes

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class NodePlan:
    """What the solution says about one traced node.

    Attributes:
        inputs: per tensor argument (in :func:`tensor_arg_nodes` order), its placements.
        outputs: per tensor output, its placements (``None`` for a non-tensor output).
        free: every rank computes it for itself (no placements).
        fallback: no DTensor rule: replicated inputs and outputs, run on local copies.
        phase: ``forward`` or ``backward``.
    """

    inputs: tuple[Placements, ...] = ()
    outputs: tuple[Placements | None, ...] = ()
    free: bool = False
    fallback: bool = False
    phase: str = "forward"
    # the inputs (indices into ``inputs``) that share their resharding with the other
    # reads of the same tensor, phase and block (autoshard.strategies.sharing)
    shared: frozenset[int] = frozenset()
    # an op rule's choice per mesh dim, where the solution names it (an op that
    # communicates itself: placements alone may not tell its choices apart)
    modes: tuple[str, ...] | None = None
    # the inputs a recomputation reads from its block's backward gathered copy
    # (autoshard.trace.rerun_reads): gathered once for both, counted in the backward
    rerun_gathered: frozenset[int] = frozenset()


@dataclass
class GraphProgram:
    """A traced graph with the solution's placement for every node and output.

    Attributes:
        graph: the graph traced at launch (same names as the solve's).
        nodes: node name -> :class:`NodePlan` (ops, placeholders).
        sinks: per graph output, the placements the plan gives it (``None``: free).
        grad_of: per graph output, the parameter FQN it is the gradient of, else ``None``.
        mesh: the mesh the plan was solved for (its links order multi-dim reshardings).
        dtype: the floating dtype the solve cast the model to (``--dtype``), else ``None``.
        reduce_dtype: mixed precision (``--precision bf16-mixed``): the parameters stay in
            fp32 (the master weights AdamW steps), the step computes with them cast to
            ``dtype``, and each gradient is cast to ``reduce_dtype`` before its reduction
            (the sink's placement); ``None`` for a pure cast or none.
    """

    graph: TracedGraph
    nodes: dict[str, NodePlan]
    sinks: list[Placements | None]
    grad_of: list[str | None]
    mesh: MeshSpec
    dtype: torch.dtype | None = None  # the solve's --dtype cast, which the launch repeats
    reduce_dtype: torch.dtype | None = None  # mixed precision: gradients reduced in this
    # real repeated blocks whose forward reruns before their backward (activation
    # checkpointing, autoshard.cost.checkpointing): their activations are not kept
    recompute: frozenset[int] = frozenset()
    # real repeated blocks that rerun only the ops selective checkpointing recomputes
    # (autoshard.trace.selective); the outputs it keeps stay from forward to backward
    selective: frozenset[int] = frozenset()
    # per policy ("full", "selective"): a recomputed block reruns its forward up to the last
    # op its backward reads (torch.utils.checkpoint's early stop); False: its whole forward
    early_stop: Mapping[str, bool] = field(
        default_factory=lambda: {"full": True, "selective": True}
    )


def _placements(entry: Mapping[str, Any], key: str, n: int, prefix: str) -> tuple:
    got = entry.get(key) or {}
    return tuple(tuple(got[f"{prefix}{k}"]) if f"{prefix}{k}" in got else None for k in range(n))


def depth_names(full: TracedGraph, reduced: TracedGraph) -> dict[str, str]:
    """Each node of ``full`` -> the node of ``reduced`` (traced with
    :func:`autoshard.trace.tracer.reduce_depth`) that stands for it.

    Nodes are matched by position: the k-th node of real block ``j`` is the k-th node of
    the traced block that stands for ``j``; the k-th op the model's own forward runs
    between block ``j`` and the next (:func:`~autoshard.trace.tracer.between_blocks`: a
    residual add around the blocks) is the k-th after that traced block; the k-th other
    node outside every block is the k-th such. Nodes without a partner are left out (the
    caller reports them).
    """
    depth = reduced.depth
    if depth is None:
        return {}
    stands = {j: t for t, real in enumerate(depth.stands_for) for j in real}
    firsts = [real[0] for real in depth.stands_for]  # reduced layers carry real first indices

    def groups(graph: TracedGraph) -> dict[Any, list[str]]:
        gaps = between_blocks(graph)
        out: dict[Any, list[str]] = {}
        for name, info in graph.nodes.items():
            if info.kind != "output":
                key = ("after", gaps[name]) if name in gaps else info.layer
                out.setdefault(key, []).append(name)
        return out

    def standing(key: Any) -> Any:  # a real block's key -> its traced block's
        if key is None:
            return None
        if isinstance(key, tuple):
            return ("after", firsts[stands[key[1]]])
        return firsts[stands[key]]

    theirs = groups(reduced)
    names: dict[str, str] = {}
    for key, members in groups(full).items():
        for a, b in zip(members, theirs.get(standing(key), []), strict=False):
            names[a] = b
    return names


def program_from_solution(
    graph: TracedGraph,
    solution: Mapping[str, Any],
    mesh: MeshSpec,
    reduced: TracedGraph | None = None,
) -> GraphProgram:
    """Pair the graph traced at launch with the solution's per-node placements.

    ``reduced``: when the solution was solved on a depth-reduced trace (layer tying on a
    model of more than 4 blocks), that trace; each node of ``graph`` then takes the plan
    of the node standing for it (:func:`depth_names`).

    Raises:
        AutoshardError: the solution does not describe this graph (another model, another
            mode, another depth or another torch): one line naming how many nodes differ
            and the first few.
    """
    sol_nodes: Mapping[str, Any] = solution.get("nodes") or {}
    alias = depth_names(graph, reduced) if reduced is not None else {}
    nodes, missing, changed = _node_plans(graph, sol_nodes, alias, reduced)
    extra = [n for n in sol_nodes if n not in graph.nodes] if reduced is None else []
    if missing or changed or extra:
        raise _mismatch(missing, extra, changed)
    sinks, grad_of = _output_sinks(graph, sol_nodes, alias, reduced, nodes)
    # a mesh dim of one device holds every tensor whole, whatever the solver chose there
    nodes = {name: _whole_on_single(plan, mesh.shape) for name, plan in nodes.items()}
    sinks = list(each_whole_on_single(sinks, mesh.shape))
    predicted = solution.get("predicted") or {}
    recompute = frozenset(int(b) for b in predicted.get("recomputed_blocks") or ())
    selective = frozenset(int(b) for b in predicted.get("selective_blocks") or ())
    early_stop = early_stops(predicted)  # per policy; a file from before it as priced
    return GraphProgram(
        graph,
        nodes,
        sinks,
        grad_of,
        mesh,
        recompute=recompute,
        selective=selective,
        early_stop=early_stop,
    )


def _whole_on_single(plan: NodePlan, mesh_shape: Sequence[int]) -> NodePlan:
    """``plan`` with ``Replicate`` on the mesh dims of one device
    (:func:`autoshard.placements.whole_on_single`)."""
    if plan.free:
        return plan
    return replace(
        plan,
        inputs=each_whole_on_single(plan.inputs, mesh_shape),
        outputs=each_whole_on_single(plan.outputs, mesh_shape),
    )


def _node_plans(
    graph: TracedGraph,
    sol_nodes: Mapping[str, Any],
    alias: Mapping[str, str],
    reduced: TracedGraph | None,
) -> tuple[dict[str, NodePlan], list[str], list[str]]:
    """Each traced node's plan from its solution entry (its stand-in's, through ``alias``,
    on a depth-reduced solve), with the traced nodes the solution lacks and those whose
    entry no longer fits (``name (why)``)."""
    nodes: dict[str, NodePlan] = {}
    missing: list[str] = []
    changed: list[str] = []
    for name, info in graph.nodes.items():
        if info.kind == "output":
            continue
        entry = sol_nodes.get(alias.get(name, name) if reduced is not None else name)
        if reduced is not None and name not in alias:
            entry = None
        if entry is None:
            missing.append(name)
            continue
        if info.kind == "op" and entry.get("op") != info.op_name:
            changed.append(f"{name} ({entry.get('op')} -> {info.op_name})")
            continue
        planned_shape = (entry.get("shapes") or {}).get("data_out_0")
        traced = info.results[0] if info.results else None
        if (
            planned_shape is not None
            and traced is not None
            and (tuple(planned_shape) != tuple(traced.shape))
        ):
            changed.append(f"{name} (shape {tuple(planned_shape)} -> {tuple(traced.shape)})")
            continue
        phase = "backward" if info.backward else "forward"
        if entry.get("free") or info.kind == "buffer":
            nodes[name] = NodePlan(free=True, phase=phase)
            continue
        ins = _placements(entry, "args", len(info.args), "data_in_")
        outs = _placements(entry, "results", len(info.results), "data_out_")
        if info.kind == "op" and any(p is None for p in ins):
            changed.append(f"{name} (inputs without placements)")
            continue
        nodes[name] = NodePlan(
            inputs=ins,
            outputs=outs,
            fallback=bool(entry.get("fallback")),
            phase=phase,
            shared=frozenset(int(k) for k in entry.get("shared") or ()),
            modes=tuple(entry["modes"]) if entry.get("modes") else None,
            rerun_gathered=frozenset(int(k) for k in entry.get("rerun_gathered") or ()),
        )
    return nodes, missing, changed


def _mismatch(missing: list[str], extra: list[str], changed: list[str]) -> AutoshardError:
    """The one-line error for a solution that does not describe the traced graph."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} traced node(s) the solution lacks ({', '.join(missing[:3])})")
    if extra:
        parts.append(f"{len(extra)} solution node(s) not traced ({', '.join(extra[:3])})")
    if changed:
        parts.append(f"{len(changed)} changed ({', '.join(changed[:3])})")
    return AutoshardError(
        "the solution does not describe the graph traced at launch: "
        + "; ".join(parts)
        + ". Solve again for this model file (with --no-tie when its repeated blocks "
        "do not all trace alike)"
    )


def _output_sinks(
    graph: TracedGraph,
    sol_nodes: Mapping[str, Any],
    alias: Mapping[str, str],
    reduced: TracedGraph | None,
    nodes: Mapping[str, NodePlan],
) -> tuple[list[Placements | None], list[str | None]]:
    """The placements each graph output is planned to leave in (its sink) and the
    parameter each output is the gradient of (``None`` where none)."""
    out_info = next(i for i in graph.nodes.values() if i.kind == "output")
    out_entry = (sol_nodes.get(out_info.name) or {}).get("args") or {}
    index = {k: k for k in range(len(out_info.arg_nodes))}
    if reduced is not None:  # output k of the full graph -> the output of its stand-in
        red_out = next(i for i in reduced.nodes.values() if i.kind == "output")
        where = {a: k for k, a in enumerate(red_out.arg_nodes)}
        index = {k: where.get(alias.get(a, ""), -1) for k, a in enumerate(out_info.arg_nodes)}
    sinks = [
        tuple(out_entry[f"data_in_{index[k]}"]) if f"data_in_{index[k]}" in out_entry else None
        for k in range(len(out_info.arg_nodes))
    ]
    grad_of = [
        out_info.grad_of[k] if k < len(out_info.grad_of) else None
        for k in range(len(out_info.arg_nodes))
    ]
    # a gradient every rank computes for itself (from free nodes only, e.g. a bias's under
    # a mean loss) has no sink in the plan: it takes its parameter's placements, locally
    param_out = {
        graph.nodes[n].fqn: p.outputs[0]
        for n, p in nodes.items()
        if graph.nodes[n].kind == "param" and p.outputs
    }
    for k, owner in enumerate(grad_of):
        if sinks[k] is None and owner is not None:
            names = graph.param_names.get(owner, [owner])
            sinks[k] = next((param_out[a] for a in (owner, *names) if a in param_out), None)
    return sinks, grad_of


@dataclass
class RunLog:
    """What one run of the graph did.

    Attributes:
        collectives: (phase, kind, mesh dim) -> count, as :class:`CollectiveLog` saw them.
        deviations: op name -> how often DTensor's output placement differed from the plan.
        substitutions: kernels the device lacks, run another way (see
            :meth:`PlanInterpreter._substitute`) -> how often.
    """

    collectives: Counter = field(default_factory=Counter)
    deviations: Counter = field(default_factory=Counter)
    substitutions: Counter = field(default_factory=Counter)


@dataclass
class Fault:
    """A fault planted on purpose, to show that ``launch --check`` catches it; read from
    ``AUTOSHARD_FAULT`` (tests set it; nothing else should):

    - ``drop:<kind>``: the first redistribution step of that collective kind
      (``all_reduce``, ``all_gather``, ``reduce_scatter``) is relabelled without
      communicating, as if the collective were forgotten;
    - ``grad:<fqn>:<factor>``: that parameter's gradient is multiplied by ``factor``
      (``2``, ``-1``, ``1.01``) before the optimizer step;
    - ``lowered-drop:all_reduce``: the first all-reduce is cut from the lowered graph
      (:func:`autoshard.launch.lowered.drop_collective`) once it is recorded; step 1 ran
      it, steps 2..N do not;
    - ``lowered-stale:all``: steps 2..N call the lowered graph on step 1's placeholders,
      as if the recording had frozen the parameters it read.
    """

    drop: str | None = None
    grad: tuple[str, float] | None = None
    lowered_drop: str | None = None
    lowered_stale: bool = False
    dropped: int = 0

    @classmethod
    def from_env(cls) -> Fault:
        text = os.environ.get("AUTOSHARD_FAULT", "").strip()
        if not text:
            return cls()
        kind, _, rest = text.partition(":")
        if kind == "drop" and rest:
            return cls(drop=rest)
        if kind == "lowered-drop" and rest == "all_reduce":  # keeps its input's shape
            return cls(lowered_drop=rest)
        if kind == "lowered-stale" and rest == "all":
            return cls(lowered_stale=True)
        if kind == "grad" and rest.count(":") >= 1:
            fqn, _, factor = rest.rpartition(":")
            try:
                return cls(grad=(fqn, float(factor)))
            except ValueError:
                pass
        raise AutoshardError(
            f"AUTOSHARD_FAULT={text!r}: use drop:<collective kind>, grad:<parameter>:<factor> "
            "lowered-drop:all_reduce or lowered-stale:all"
        )

    def drops(self, src: Sequence[Placement], dst: Sequence[Placement]) -> bool:
        """Whether to skip this single-dim step (the first of the chosen kind only)."""
        if self.drop is None or self.dropped:
            return False
        kinds = {
            ("partial", "replicate"): "all_reduce",
            ("shard", "replicate"): "all_gather",
            ("partial", "shard"): "reduce_scatter",
        }
        for a, b in zip(src, dst, strict=True):
            if a != b and kinds.get((_kind(a), _kind(b))) == self.drop:
                self.dropped += 1
                return True
        return False


def plant_gradient_fault(module: torch.nn.Module) -> None:
    """Apply ``AUTOSHARD_FAULT=grad:<fqn>:<factor>`` to ``module``'s gradients (a planted
    fault, see :class:`Fault`); nothing when it is unset."""
    fault = Fault.from_env().grad
    if fault is None:
        return
    for name, p in module.named_parameters(remove_duplicate=False):
        if name == fault[0] and p.grad is not None:
            p.grad = p.grad * fault[1]


def _kind(p: Placement) -> str:
    return "partial" if p.is_partial() else "shard" if p.is_shard() else "replicate"


ZEROS_OPS = {
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.zeros_like.default,
}
"""Ops whose output is zeros whatever their input: given any placement the plan asks for
without communication (DTensor's rule may pick another)."""


def _zeros_placed(value: DTensor, want: Placements) -> DTensor:
    """Zeros of ``value``'s global shape and dtype, placed ``want`` (a ``Partial`` of zeros
    is zeros), made locally."""
    plain = [Replicate() if p.is_partial() else p for p in want]
    local = dtensor_zeros(
        value.shape, device_mesh=value.device_mesh, placements=plain, dtype=value.dtype
    ).to_local()
    return DTensor.from_local(
        local,
        value.device_mesh,
        list(want),
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _has_float64(args: Any) -> bool:
    leaves, _ = tree_flatten(args)
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.float64 for x in leaves)


def _relabelled(value: DTensor, placements: Placements) -> DTensor:
    """``value``'s local tensor as a DTensor placed ``placements``: no communication."""
    return DTensor.from_local(
        value.to_local(),
        value.device_mesh,
        list(placements),
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _replicate(mesh: DeviceMesh) -> list[Placement]:
    return [Replicate()] * mesh.ndim


class PlanInterpreter(torch.fx.Interpreter):
    """Runs a :class:`GraphProgram` on DTensors (see the module docstring).

    Args:
        program: the graph and its plan.
        mesh: the live device mesh (same shape as the plan's).
        device: where free nodes (factory ops) create their tensors.
        dtype_map: dtypes replaced in every op's arguments (``--check`` runs in float64:
            ``{torch.float32: torch.float64}``).
        log: collects collectives and deviations; a fresh one when ``None``.
    """

    def __init__(
        self,
        program: GraphProgram,
        mesh: DeviceMesh,
        device: torch.device,
        dtype_map: Mapping[torch.dtype, torch.dtype] | None = None,
        log: RunLog | None = None,
    ) -> None:
        super().__init__(program.graph.graph_module, garbage_collect_values=True)
        self.program = program
        self.mesh = mesh
        self.device = device
        self.dtype_map = dict(dtype_map or {})
        self.log = log if log is not None else RunLog()
        self.comm = comm_model(program.mesh)
        # one collective over several mesh dims where the plan priced one (CommModel._merged)
        flatten_mesh_groups(mesh)
        self._collectives = CollectiveLog(mesh)
        self.fault = Fault.from_env()
        # reads that share a resharding: (producer, phase, layer) -> target -> (the
        # value moved, its moved copy), dropped after the group's last reader
        self._moved: dict[tuple, dict[tuple, tuple[Any, DTensor]]] = {}
        self._last_reader = _last_shared_readers(program)
        self._modes: dict[str, tuple[str, ...]] = {}  # a kernel op's mode per mesh dim
        self._phase_override: str | None = None
        self._drop_at, self._rerun_at, self._needed, reread = _recomputation(
            self.module.graph, program
        )
        # a recomputation's gather its backward reads too: backward read -> the pair, and
        # the gathered copies waiting for it (forward producer -> copy)
        self._back_reads = (
            {p.backward: p for p in shared_rerun_reads(program.graph).values()}
            if program.recompute or program.selective
            else {}
        )
        self._gathered: dict[str, DTensor] = {}
        self._fx_nodes = {n.name: n for n in self.module.graph.nodes}
        if reread:  # what a rerun reads from outside its block lives until it reran
            order = {n: i for i, n in enumerate(self.module.graph.nodes)}
            last = {d: node for node, dying in self.user_to_last_uses.items() for d in dying}
            for d, until in reread.items():
                if d in last:
                    self.user_to_last_uses[last[d]].remove(d)
                    until = max(until, last[d], key=order.__getitem__)
                self.user_to_last_uses.setdefault(until, []).append(d)

    # -- placing values ----------------------------------------------------------------

    def place(self, value: Any, target: Placements, phase: str) -> DTensor:
        """``value`` (a DTensor, or a plain tensor every rank holds in full) redistributed
        to ``target`` along the cost model's path, one mesh dim per step."""
        if not isinstance(value, DTensor):
            value = DTensor.from_local(value, self.mesh, _replicate(self.mesh), run_check=False)
        src = tuple(value.placements)
        if src == tuple(target):
            return value
        path = self.comm.redistribute_path(src, tuple(target), tuple(value.shape))
        with self._phase(phase):
            for step in path:
                if self.fault.drops(value.placements, step):
                    # a planted fault (AUTOSHARD_FAULT=drop:<kind>): relabel, skip the collective
                    value = _relabelled(value, step)
                    continue
                value = tp.redistribute_step(value, step)
        return value

    def _whole(self, value: DTensor) -> DTensor:
        """``value`` relabelled ``Replicate`` on the mesh dims of one device, where DTensor's
        rule for an op chose a shard or a partial sum (the same local tensor: no
        communication; :func:`autoshard.placements.whole_on_single`). Every placement the
        plan asks for is whole there already (:func:`program_from_solution`), and so are
        the weights and inputs as placed (``spmd``)."""
        if 1 not in self.mesh.shape:
            return value
        src = tuple(value.placements)
        whole = whole_on_single(src, self.mesh.shape)
        return value if whole == src else _relabelled(value, whole)

    def _place_shared(self, value: Any, target: Placements, key: tuple) -> Any:
        """:meth:`place` for a read that shares its resharding: the copy an earlier reader
        of the same tensor, phase and block moved to ``target`` (one collective for all)."""
        moved = self._moved.setdefault(key, {})
        hit = moved.get(tuple(target))
        if hit is not None and hit[0] is value:
            return hit[1]
        placed = self.place(value, target, key[1])
        moved[tuple(target)] = (value, placed)
        return placed

    def _gather_for_backward(self, producer: str, value: Any, target: Placements) -> DTensor:
        """A recomputation's read that takes its block's backward gather
        (:mod:`autoshard.trace.rerun_reads`): moved once, counted in the backward, and kept
        for the backward's read of it."""
        placed = self.place(value, target, "backward")
        self._gathered[producer] = placed
        return placed

    def _from_gathered(
        self, producer: str, consumer: str, k: int, target: Placements
    ) -> DTensor | None:
        """The backward's read ``(producer, consumer, k)`` from the copy its block's
        recomputation gathered, or ``None`` when none waits for it: the chain of one-input
        ops from the gathered tensor to ``producer`` replayed on the gathered copy (replicated,
        or under FSDP + TP sharded over tp, its shard moved by DTensor's own ``t`` rule:
        no communication; any would be counted and fail the observed == predicted check).

        Raises:
            AutoshardError: the replayed tensor is not placed as the plan wants (a bug).
        """
        if not self._gathered:  # the common case: no recomputation's copy waits
            return None
        pair = self._back_reads.get((producer, consumer, k))
        if pair is None or pair.forward[0] not in self._gathered:
            return None
        value = self._gathered.pop(pair.forward[0])
        with self._phase("backward"):
            for name in reversed(pair.chain):
                node = self._fx_nodes[name]
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda _, v=value: v)
                value = node.target(*self._local_args(args), **self._local_args(kwargs))
        if tuple(value.placements) != tuple(target):
            raise AutoshardError(
                f"{consumer} reads {producer} from its recomputation's gathered copy as "
                f"{tuple(value.placements)}, not the plan's {tuple(target)}: a launcher bug"
            )
        return value

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        # the mark rides on the nodes make_fx records (autoshard.launch.lowered)
        with fx_traceback.annotate({PHASE: phase}), self._collectives:
            yield
        for (kind, dim), n in self._collectives.take().items():
            self.log.collectives[(phase, kind, dim)] += n

    def _local_args(self, value: Any) -> Any:
        """Devices and dtypes of an op's non-tensor arguments as this run wants them."""

        def fix(x: Any) -> Any:
            if isinstance(x, torch.device) and x.type == "meta":
                return self.device
            if isinstance(x, torch.dtype):
                return self.dtype_map.get(x, x)
            return x

        return tree_map(fix, value)

    # -- running nodes -----------------------------------------------------------------

    def run_node(self, n: torch.fx.Node) -> Any:
        for dropped in self._drop_at.get(n, ()):  # a recomputed block's forward is over
            self.env.pop(dropped, None)
        if self._rerun_at.get(n):  # its backward starts: its forward runs again first
            self._rerun(self._rerun_at[n])
        return self._run_node(n)

    def _phase_of(self, plan: NodePlan) -> str:
        """The phase a node's collectives count in (``recompute`` while rerunning)."""
        return self._phase_override or plan.phase

    def _rerun(self, forward: list[torch.fx.Node]) -> None:
        """Run a recomputed block's forward nodes again (collectives in the ``recompute``
        phase) and keep what its backward reads."""
        self._phase_override = "recompute"
        try:
            for f in forward:
                self.env[f] = self._run_node(f)
        finally:
            self._phase_override = None
        for f in forward:
            if f not in self._needed:
                self.env.pop(f, None)

    def _run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        if n.target is operator.getitem:
            return args[0][args[1]]
        plan = self.program.nodes.get(n.name)
        args, kwargs = self._local_args((args, kwargs))
        if plan is None or plan.free:
            # computed by every rank for itself; a free node that reads a DTensor returns
            # nothing (an assertion on dtype or device): it checks the local tensor
            return n.target(*tree_map(local_shard, args), **tree_map(local_shard, kwargs))
        # place every tensor argument as the plan says, in tensor_arg_nodes order
        node_leaves, _ = tree_flatten((list(n.args), dict(n.kwargs)))
        leaves, spec = tree_flatten((list(args), dict(kwargs)))
        tensor_nodes = {id(x) for x in tensor_arg_nodes(n)}
        k = 0
        phase = self._phase_of(plan)
        layer = (
            self.program.graph.nodes[n.name].layer if n.name in self.program.graph.nodes else None
        )
        for i, x in enumerate(node_leaves):
            if isinstance(x, torch.fx.Node) and id(x) in tensor_nodes:
                derived = self._from_gathered(x.name, n.name, k, plan.inputs[k])
                if derived is not None:
                    leaves[i] = derived
                elif self._phase_override == "recompute" and k in plan.rerun_gathered:
                    leaves[i] = self._gather_for_backward(x.name, leaves[i], plan.inputs[k])
                elif k in plan.shared:
                    leaves[i] = self._place_shared(leaves[i], plan.inputs[k], (x, phase, layer))
                else:
                    leaves[i] = self.place(leaves[i], plan.inputs[k], phase)
                k += 1
        for x in self._last_reader.get(n, ()):
            self._moved.pop((x, phase, layer), None)
        args_list, kwargs = tree_unflatten(leaves, spec)
        back = self._substitute(n, args_list)
        if plan.fallback:
            out = self._run_local(n, args_list, kwargs)
        elif (rule := op_rule(n.target)) is not None and rule.kernel is not None:
            with self._phase(self._phase_of(plan)):
                out = self._run_kernel(n, rule, args_list, kwargs, plan)
        elif n.target in NO_FLOAT64 and self.dtype_map and _has_float64(args_list):
            with self._phase(self._phase_of(plan)):
                out = run_narrowed(n.target, args_list, kwargs, self.log.substitutions)
        else:
            with self._phase(self._phase_of(plan)):
                out = n.target(*args_list, **kwargs)
        if back is not None:
            out = out.to(back)
        return self._settle(n, out, plan)

    def _substitute(self, n: torch.fx.Node, args: list) -> torch.dtype | None:
        """A kernel the device lacks for a dtype the trace (on meta) chose: CPU has no
        integer ``histc`` (HuggingFace's MoE routing counts tokens per expert with it and
        picks the integer form off CPU). The count runs on floats, exact below 2**24, and
        comes back in the traced dtype; each use is counted in
        :attr:`RunLog.substitutions`. Returns the dtype to cast the output back to."""
        if (
            n.target is torch.ops.aten.histc.default
            and self.device.type == "cpu"
            and isinstance(args[0], torch.Tensor)
            and not args[0].dtype.is_floating_point
        ):
            dtype = args[0].dtype
            args[0] = args[0].to(torch.float32)
            self.log.substitutions[f"{n.target} on {dtype} (CPU): float32"] += 1
            return dtype
        return None

    def _run_local(self, n: torch.fx.Node, args: list, kwargs: dict) -> Any:
        """An op with no DTensor rule, on each rank's full local copy (all replicated)."""

        out = n.target(*tree_map(local_shard, args), **tree_map(local_shard, kwargs))

        def wrap(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, self.mesh, _replicate(self.mesh), run_check=False)
            return x

        return tree_map(wrap, out)

    def _run_kernel(
        self, n: torch.fx.Node, rule: OpRule, args: list, kwargs: dict, plan: NodePlan
    ) -> Any:
        """An op with a kernel of its own (:attr:`autoshard.strategies.registry.OpRule.kernel`:
        the fused attention and experts ops, a model's custom ops) on this rank's shards,
        told the mode its strategy gives each mesh dim; the results placed as planned."""
        modes = plan.modes or self._modes.get(n.name)
        if modes is None:  # the plan fixes them: worked out once, not every step
            info = self.program.graph.nodes[n.name]
            strategy = Strategy(tuple(plan.outputs), tuple(plan.inputs))
            try:
                modes = rule.modes(n, info.args, info.results, strategy)
            except ValueError as e:
                raise AutoshardError(f"{n.name}: {e} (solve again)") from e
            self._modes[n.name] = modes
        ctx = KernelContext(modes, self.mesh)
        out = rule.kernel(n.target, tree_map(local_shard, args), tree_map(local_shard, kwargs), ctx)
        many = isinstance(out, (tuple, list))
        outs = list(out) if many else [out]
        metas = n.meta["val"] if many else [n.meta["val"]]
        placed = [
            DTensor.from_local(
                x, self.mesh, list(want), run_check=False, shape=meta.shape, stride=meta.stride()
            )
            if isinstance(x, torch.Tensor) and want is not None
            else x
            for x, want, meta in zip(outs, plan.outputs, metas, strict=True)
        ]
        return tuple(placed) if many else placed[0]

    def _settle(self, n: torch.fx.Node, out: Any, plan: NodePlan) -> Any:
        """Each DTensor output on the plan's placements (a deviation when it is not)."""
        many = isinstance(out, (tuple, list))
        outs = list(out) if many else [out]
        for k, (value, want) in enumerate(zip(outs, plan.outputs, strict=False)):
            if want is None or not isinstance(value, DTensor):
                continue
            outs[k] = value = self._whole(value)
            if tuple(value.placements) != tuple(want):
                if n.target in ZEROS_OPS:
                    # zeros are zeros under any placement: made as planned, locally
                    outs[k] = _zeros_placed(value, want)
                    continue
                self.log.deviations[str(n.target)] += 1
                outs[k] = self.place(value, want, self._phase_of(plan))
        if not many:
            return outs[0]
        return type(out)(outs) if isinstance(out, tuple) else outs

    def run_values(self, placeholders: Sequence[Any]) -> list[Any]:
        """:meth:`run_program` on a sequence (what :func:`autoshard.launch.lowered.lower`
        calls)."""
        return self.run_program(*placeholders)

    def run_program(self, *placeholders: Any) -> list[Any]:
        """Run the graph on ``placeholders`` (in graph order); every output placed per its
        sink (:attr:`GraphProgram.sinks`), gradients in the backward phase."""
        with torch.no_grad():
            outs = self.run(*placeholders)
        out_node = next(n for n in self.module.graph.nodes if n.op == "output")
        node_leaves, _ = tree_flatten(list(out_node.args))
        flat, _ = tree_flatten(outs)
        values = [v for x, v in zip(node_leaves, flat, strict=True) if isinstance(x, torch.fx.Node)]
        placed = []
        for k, value in enumerate(values):
            want = self.program.sinks[k]
            phase = "backward" if self.program.grad_of[k] is not None else "forward"
            if want is None or not isinstance(value, torch.Tensor):
                placed.append(value)
                continue
            reduce = self.program.reduce_dtype
            if reduce is not None and self.program.grad_of[k] is not None:
                value = value.to(self.dtype_map.get(reduce, reduce))  # mixed: reduce in fp32
            with torch.no_grad():
                placed.append(self.place(value, want, phase))
        return placed


def _last_shared_readers(program: GraphProgram) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Per node, the producers whose shared reads (:attr:`NodePlan.shared`) in its phase
    and block it is the last to make: after it, their moved copies are dropped."""
    last: dict[tuple, torch.fx.Node] = {}
    for n in program.graph.graph_module.graph.nodes:
        plan = program.nodes.get(n.name)
        if n.op != "call_function" or plan is None or not plan.shared:
            continue
        info = program.graph.nodes.get(n.name)
        layer = info.layer if info is not None else None
        for k, x in enumerate(tensor_arg_nodes(n)):
            if k in plan.shared:
                last[(x, plan.phase, layer)] = n
    out: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for (x, _, _), n in last.items():
        out.setdefault(n, []).append(x)
    return out


def _recomputation(graph: torch.fx.Graph, program: GraphProgram) -> tuple[dict, dict, set, dict]:
    """For the blocks ``program.recompute`` and ``program.selective`` name: the node before
    which each block's forward values that nothing outside it reads are dropped (the one
    after its last forward node), the node before which its forward reruns (its first
    backward node) with the nodes to rerun, the nodes read from its backward on (kept after
    a rerun), and what a rerun reads from outside its block -> the latest first backward
    node that rereads it (it must live until then). A selective block keeps the outputs
    :func:`autoshard.trace.selective.recomputed_ops` leaves out, and reruns the rest; a
    fully recomputed block reruns its forward up to its early stop (that function's
    ``"full"`` set), as ``torch.utils.checkpoint`` does, or (``program.early_stop`` off for
    its policy) the whole of it."""
    if not program.recompute and not program.selective:
        return {}, {}, set(), {}
    stop = program.early_stop
    full = recomputed_ops(program.graph, "full", stop["full"]) if program.recompute else ()
    rerun = (
        recomputed_ops(program.graph, "selective", stop["selective"]) if program.selective else ()
    )
    infos = program.graph.nodes
    order = list(graph.nodes)
    layer_of = {n: infos[n.name].layer if n.name in infos else None for n in order}
    position = {n: i for i, n in enumerate(order)}
    drop_at: dict = {}
    rerun_at: dict = {}
    needed: set = set()
    reread: dict = {}
    for b in sorted(program.recompute | program.selective):
        whole = [
            n
            for n in order
            if n.op == "call_function" and layer_of[n] == b and not infos[n.name].backward
        ]
        forward = [n for n in whole if n.name in (full if b in program.recompute else rerun)]
        backward = [
            n
            for n in order
            if n.op == "call_function" and layer_of[n] == b and infos[n.name].backward
        ]
        if not forward or not backward:
            continue
        inside = set(forward)
        outside_read = {
            n for n in forward if any(u not in inside and layer_of[u] != b for u in n.users)
        }
        after = order[order.index(whole[-1]) + 1]  # the block's forward is over
        drop_at.setdefault(after, []).extend(n for n in forward if n not in outside_read)
        rerun_at[backward[0]] = forward
        for a in {a for f in forward for a in f.all_input_nodes if a not in inside}:
            reread[a] = max(reread.get(a, backward[0]), backward[0], key=position.__getitem__)
        # kept after the rerun: what is read from the block's backward on (a block output
        # the next block's backward read earlier is not kept again)
        start = position[backward[0]]
        needed |= {n for n in forward if any(position[u] >= start for u in n.users)}
    return drop_at, rerun_at, needed, reread
