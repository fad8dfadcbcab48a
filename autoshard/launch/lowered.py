"""The plan's step lowered to a graph on local tensors, with its collectives explicit.

:class:`~autoshard.launch.graph_run.PlanInterpreter` runs the plan on DTensors: every op
goes through DTensor's dispatch (sharding propagation, redistribution) in Python, each
step again. As meta-pytorch/autoparallel's ``apply_sharding.py`` does, step 1 runs that
interpreter once under ``make_fx`` (``torch.fx.experimental.proxy_tensor``, real tensors):
what DTensor does underneath is recorded as plain ATen ops on each rank's local shards
and the functional collectives its redistributions issue
(``_c10d_functional.all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``,
``all_to_all_single``, each followed by ``wait_tensor``). Step 1's values are the real
run's; steps 2..N call the recorded graph (:class:`LoweredStep`) on the local shards of
the same placeholders, with no DTensor dispatch.

With ``--check``, step 2 also runs on DTensors on the same placeholders and the two
must agree (a value the recording froze, or a collective the graph lost, shows there).

Each collective node carries the phase it was issued in (``forward``, ``backward``,
``recompute``: ``node.meta["custom"]["phase"]``, set by the interpreter through
``torch.fx.traceback.annotate``), so the lowered graph's collectives can be counted per
phase, kind and mesh dim (:meth:`LoweredStep.collectives`) and compared with the plan's
prediction, as step 1's are.

Not lowered: a graph holding an op whose rule is not ``lowerable``
(:mod:`autoshard.strategies.registry`): the fused experts ops
(:mod:`autoshard.trace.experts`), whose token exchange sends as many rows to each rank as
the routing of that step says, which a recorded graph would freeze at step 1's counts;
such a program runs the interpreter at every step (:func:`lowerable` says why).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.fx.experimental.proxy_tensor import make_fx

from autoshard.errors import AutoshardError
from autoshard.launch.collective_log import collective_kind, group_dims
from autoshard.strategies.rules import op_rule

PHASE = "phase"
"""The key of ``node.meta["custom"]`` that holds a lowered node's phase."""


@dataclass(frozen=True)
class _Spec:
    """How a local tensor sits in its global DTensor."""

    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> _Spec | None:
        if not isinstance(value, DTensor):
            return None
        return cls(tuple(value.placements), value.shape, tuple(value.stride()))


def local_shard(value: Any) -> Any:
    """``value``'s local tensor when it is a DTensor, else ``value`` itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def _wrap(value: Any, spec: _Spec | None, mesh: DeviceMesh) -> Any:
    if spec is None or not isinstance(value, torch.Tensor):
        return value
    return DTensor.from_local(
        value, mesh, list(spec.placements), run_check=False, shape=spec.shape, stride=spec.stride
    )


def lowerable(graph: torch.fx.Graph) -> str | None:
    """``None`` when ``graph`` (the traced graph a program runs) can be lowered, else why
    not (one line)."""
    held = Counter(
        str(n.target)
        for n in graph.nodes
        if n.op == "call_function"
        and (rule := op_rule(n.target)) is not None
        and not rule.lowerable
    )
    if held:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(held.items()))
        return (
            f"{ops}: what these ops send depends on each step's values (the experts' "
            "routing), which a recorded graph would freeze"
        )
    return None


@dataclass
class LoweredStep:
    """One step of the plan as a graph on local tensors (module docstring).

    Attributes:
        graph_module: the recorded graph: the placeholders' local shards in, the outputs'
            local shards out.
        inputs, outputs: per placeholder / output, how its local shard sits in its
            DTensor (``None``: a plain tensor or a non-tensor).
        mesh: the device mesh the collectives run on.
    """

    graph_module: torch.fx.GraphModule
    inputs: list[_Spec | None]
    outputs: list[_Spec | None]
    mesh: DeviceMesh

    def __call__(self, values: Sequence[Any]) -> list[Any]:
        """The outputs (DTensors placed as in step 1) for ``values``, the placeholders of
        a later step.

        Raises:
            AutoshardError: a placeholder is not placed as it was when the graph was
                recorded (the graph's local shapes would not fit it).
        """
        for k, (value, spec) in enumerate(zip(values, self.inputs, strict=True)):
            if _Spec.of(value) != spec:
                raise AutoshardError(
                    f"placeholder {k} is {_Spec.of(value)}, but the lowered step was recorded "
                    f"for {spec}; run without lowering (--no-lower)"
                )
        with torch.no_grad():
            outs = self.graph_module(*[local_shard(v) for v in values])
        return [_wrap(o, s, self.mesh) for o, s in zip(outs, self.outputs, strict=True)]

    def collectives(self) -> Counter:
        """The recorded graph's collectives, ``(phase, kind, mesh dim) -> count`` (mesh
        dim ``-1``: a group that is not one of the mesh's dims)."""
        dims = group_dims(self.mesh)
        counts: Counter = Counter()
        for node in self.graph_module.graph.nodes:
            kind = collective_kind(node.target) if node.op == "call_function" else None
            if kind is None:
                continue
            group = next((a for a in node.args if isinstance(a, str) and a in dims), None)
            phase = node.meta.get("custom", {}).get(PHASE, "unknown")
            counts[(phase, kind, dims[group] if group else -1)] += 1
        return counts

    @property
    def num_ops(self) -> int:
        """Call nodes in the recorded graph."""
        return sum(1 for n in self.graph_module.graph.nodes if n.op == "call_function")


def drop_collective(step: LoweredStep, kind: str) -> bool:
    """A planted fault (``AUTOSHARD_FAULT=lowered-drop:all_reduce``, see
    :class:`autoshard.launch.graph_run.Fault`): the lowered graph's first collective of
    ``kind`` is cut out, its input standing for its result; False when it has none.

    Raises:
        AutoshardError: ``kind`` changes its input's shape (only ``all_reduce`` keeps it).
    """
    if kind != "all_reduce":
        raise AutoshardError(f"only an all_reduce can be cut from a lowered graph, not {kind}")
    graph = step.graph_module.graph
    for node in graph.nodes:
        if node.op == "call_function" and collective_kind(node.target) == kind:
            for wait in list(node.users):
                wait.replace_all_uses_with(node.args[0])
                graph.erase_node(wait)
            graph.erase_node(node)
            step.graph_module.recompile()
            return True
    return False


def lower(
    run: Callable[[list[Any]], list[Any]], values: Sequence[Any], mesh: DeviceMesh
) -> tuple[list[Any], LoweredStep]:
    """Run ``run(values)`` (one step of the interpreter: placeholders in, outputs out)
    for real under ``make_fx``; return its outputs and the :class:`LoweredStep` recorded.

    The interpreter marks each collective's phase with ``torch.fx.traceback.annotate``;
    ``preserve_node_meta`` carries the marks onto the recorded nodes.
    """
    specs = [_Spec.of(v) for v in values]
    ran: dict[str, list[Any]] = {}

    def step(*local: torch.Tensor) -> list[Any]:
        outs = run([_wrap(x, s, mesh) for x, s in zip(local, specs, strict=True)])
        ran["outs"] = outs
        return [local_shard(o) for o in outs]

    local = [local_shard(v).detach() if isinstance(v, torch.Tensor) else v for v in values]
    with fx_traceback.preserve_node_meta(), torch.no_grad():
        graph_module = make_fx(step)(*local)
    outs = ran["outs"]
    return outs, LoweredStep(graph_module, specs, [_Spec.of(o) for o in outs], mesh)
