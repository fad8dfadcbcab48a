"""A sharding plan: the chosen strategy of every node, its predicted cost and memory.

Built from a :class:`~autoshard.strategies.graph.StrategyGraph` and one strategy index
per representative node (from the ILP, a baseline, or a preloaded solution). The
cost breakdown re-prices every chosen resharding with the mesh model
(:meth:`autoshard.cost.collectives.CommModel.redistribute_steps`), so the report's numbers add
up to the ILP's objective.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.distributed.tensor import Placement

from autoshard.cost.checkpointing import rerun_takes_gather
from autoshard.cost.collectives import comm_model
from autoshard.cost.liveness import (
    chosen_strategies,
    peak_activation_bytes,
    shard_factor,
)
from autoshard.cost.mesh import MeshSpec
from autoshard.cost.overlap import hidden_seconds
from autoshard.strategies.graph import Strategy, StrategyGraph, bucketed_use, is_gradient_sink
from autoshard.strategies.sharing import share_key
from autoshard.trace.tracer import TensorInfo, TracedGraph

Placements = tuple[Placement, ...]


@dataclass
class BucketedMove:
    """A parameter's gather (``kind`` ``"gather"``) or a gradient's reduction
    (``"gradient"``) that the plan runs: tensor ``t`` from ``src`` to ``dst`` placements,
    ``times`` per pass of the traced graph, a step or one of its micro-batches (once per
    real layer its read stands for, and again per recomputed block whose read gathers its
    own: as the plan counts its collectives); ``node``: the graph node that makes ``t``
    (the parameter, for a gather)."""

    kind: str
    t: TensorInfo
    src: Placements
    dst: Placements
    times: int
    node: str = ""


@dataclass
class Plan:
    """One strategy per node and what it costs.

    Times in seconds, memory in bytes per device. ``comm_s`` and
    ``collectives`` are keyed by collective kind (``all_gather``, ``all_reduce``,
    ``reduce_scatter``, ``all_to_all``).
    """

    name: str
    sg: StrategyGraph
    mesh: MeshSpec
    choice: dict[str, int]
    node_strategy: dict[str, Strategy]
    parameters: dict[str, Placements]
    inputs: dict[str, Placements]
    compute_s: float
    comm_s: dict[str, float]
    collectives: Counter
    param_bytes: float
    activation_bytes: float
    extra: dict = field(default_factory=dict)
    optimizer_s: float = 0.0
    hidden_s: dict[str, float] = field(default_factory=dict)
    step_flops: float = 0.0
    peak_flops: float = 0.0  # one device's peak FLOP/s for the step's dtype (for the MFU)
    collective_steps: Counter = field(default_factory=Counter)  # (phase, kind, mesh dim)
    # of collective_steps, those an op issues itself (the experts' all-to-all exchange), not
    # a resharding of its inputs: they run as planned on every backend
    own_steps: Counter = field(default_factory=Counter)
    # activation checkpointing (autoshard.cost.checkpointing): per traced block and policy
    # the real blocks that recompute, the real block indices, and the seconds they add
    recompute: dict[tuple[int, str], int] = field(default_factory=dict)
    recomputed_blocks: list[int] = field(default_factory=list)
    # real blocks that recompute under the selective policy (autoshard.trace.selective)
    selective_blocks: list[int] = field(default_factory=list)
    recompute_s: float = 0.0
    # the parameter gathers and gradient reductions (autoshard.plan.fsdp_runtime prices
    # what FSDP copies around them)
    bucketed_moves: list[BucketedMove] = field(default_factory=list)
    # the copies FSDP's runtime makes around its collectives, for a plan FSDP runs
    # (autoshard.plan.fsdp_runtime): seconds and bytes per device per step
    fsdp_s: float = 0.0
    fsdp_bytes: float = 0.0
    # a recomputed block reruns its forward up to the last op its backward reads
    # (torch.utils.checkpoint's early stop); False: its whole forward
    checkpoint_early_stop: bool = True
    # micro-batches per step (gradient accumulation, :func:`accumulate`): every time and
    # count above is the whole step's
    grad_accumulation: int = 1

    @property
    def comm_total_s(self) -> float:
        """Seconds of every collective, hidden or not."""
        return sum(self.comm_s.values())

    @property
    def hidden_total_s(self) -> float:
        """Seconds the overlap of communication with compute saves: the communication
        overlapped over ``1 + OVERLAP_SLOWDOWN``, since the compute beside it runs slower
        (:mod:`autoshard.cost.overlap`). Per kind in :attr:`hidden_s`."""
        return sum(self.hidden_s.values())

    @property
    def exposed_s(self) -> dict[str, float]:
        """Seconds per collective kind the step pays for (total less what overlap saves:
        overlapped communication still costs the compute it slows)."""
        return {k: v - self.hidden_s.get(k, 0.0) for k, v in self.comm_s.items()}

    @property
    def step_time_s(self) -> float:
        """Predicted time of one step: compute, the optimizer step, the communication
        not hidden under compute, the recomputed blocks' forward passes and, for a plan
        FSDP runs, its copies around the collectives (:attr:`fsdp_s`)."""
        return (
            self.compute_s
            + self.optimizer_s
            + self.comm_total_s
            - self.hidden_total_s
            + self.recompute_s
            + self.fsdp_s
        )

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation: ``step_flops / (step time * devices * peak_flops)``
        (PaLM, Chowdhery et al. 2022, appendix B), with ``step_flops`` the global FLOPs
        ``FlopCounterMode`` counts for the step; 0 when the peak is unknown."""
        t = self.step_time_s
        if t <= 0 or self.peak_flops <= 0:
            return 0.0
        return self.step_flops / (t * self.mesh.num_devices * self.peak_flops)

    @property
    def memory_bytes(self) -> float:
        return self.param_bytes + self.activation_bytes + sum(self.extra.get("memory", {}).values())

    def memory_by_kind(self) -> dict[str, float]:
        out = {"parameters": self.param_bytes}
        out.update(self.extra.get("memory", {}))
        out["activations"] = self.activation_bytes
        return out


def accumulate(plan: Plan, n: int, pass_time: Callable[[float], float] | None = None) -> None:
    """Make ``plan``, built for one micro-batch of a step that accumulates gradients over
    ``n``, the price of that step: each micro-batch runs the forward and backward with
    their collectives (the gradients reduced after each backward, as FSDP runs it under
    Composer and torchtitan), its recomputation and FSDP's copies, so their seconds, bytes,
    counts and FLOPs are ``n`` times one micro-batch's. Memory is one micro-batch's: its
    activations are freed by its backward.

    A parameter's cost in the strategies is, over ``n``, its optimizer step and the
    ``n - 1`` passes that add a micro-batch's gradient to the one kept
    (:func:`~autoshard.strategies.graph.gradient_add_time`), so ``n`` times the plan's
    optimizer seconds hold both: the adds, two reads and a write of the device's gradients
    (``plan.extra["memory"]["gradients"]`` bytes) each, ``pass_time(bytes) -> seconds``,
    move to the compute (``plan.extra["accumulation_bytes"]``; PyTorch's FSDP runs them as
    one ``add_`` per sharded gradient), and the optimizer steps once. A no-op for
    ``n == 1``."""
    if n == 1:
        return
    plan.grad_accumulation = n
    added = (n - 1) * 3 * plan.extra.get("memory", {}).get("gradients", 0.0)
    plan.extra["accumulation_bytes"] = added
    add_s = pass_time(added) if added and pass_time is not None else 0.0
    plan.compute_s = n * plan.compute_s + add_s
    plan.optimizer_s = n * plan.optimizer_s - add_s
    plan.recompute_s *= n
    plan.fsdp_s *= n
    plan.fsdp_bytes *= n
    plan.step_flops *= n
    plan.comm_s = {k: n * v for k, v in plan.comm_s.items()}
    plan.hidden_s = {k: n * v for k, v in plan.hidden_s.items()}
    for counts in (plan.collectives, plan.collective_steps, plan.own_steps):
        for k in counts:
            counts[k] *= n


def build_plan(
    sg: StrategyGraph,
    choice: dict[str, int],
    mesh: MeshSpec,
    name: str = "ilp",
    recompute: dict | None = None,
) -> Plan:
    """Expand a choice per representative into a full :class:`Plan` with its costs.
    ``recompute``: per (traced block's layer, policy), how many real blocks recompute
    (:mod:`autoshard.cost.checkpointing`; ``sg`` must have the decision).

    Raises:
        KeyError: when ``choice`` lacks a representative of ``sg``.
    """
    graph = sg.graph
    node_strategy = chosen_strategies(sg, choice)
    optimizer = sum(  # a parameter's only cost is its AdamW step (strategies.adamw_step_time)
        float(ns.compute_s[ns.choice[choice[ns.rep]]])
        for n, ns in sg.nodes.items()
        if n in graph.nodes and graph.nodes[n].kind == "param"
    )
    compute = sum(float(sg.rep_cost(r)[choice[r]]) for r in sg.reps) - optimizer
    comm: dict[str, float] = defaultdict(float)
    collectives: Counter = Counter()
    steps: Counter = Counter()
    own_steps: Counter = Counter()  # of steps, those ops issue themselves
    # the reshardings a recomputed block's forward reads run again before its backward
    reruns = _reruns(sg, recompute)
    again: dict[tuple, int] = {}  # a shared resharding: reruns of its most rerun reader
    moved: dict[tuple, list] = {}  # (share key, placement): reads that share one resharding
    bucketed: list[BucketedMove] = []  # the parameter gathers and gradient reductions
    shared_move: dict[tuple, BucketedMove] = {}  # (share key, placement): its move
    for producer, consumer, k, t in tensor_uses(sg):
        p = node_strategy[producer].outputs[0]
        q = node_strategy[consumer].inputs[k]
        if p == q:
            continue
        key = shared_read(sg, producer, consumer)
        if key is not None:
            again[(key, q)] = max(again.get((key, q), 0), reruns.get(consumer, 0))
            if (key, q) in moved:
                continue
            moved[(key, q)] = []
        m = graph.mult(consumer)
        item = moved_itemsize(sg, consumer, t)
        rerun = 0 if key is not None else _rerun(sg, node_strategy, reruns, (producer, consumer, k))
        for step in comm_model(mesh).redistribute_steps(
            p, q, t.shape, item, latency_share(sg, mesh, producer, consumer, p, q, t)
        ):
            comm[step.kind] += m * step.seconds
            collectives[step.kind] += m
            steps[(phase_of(sg, consumer), step.kind, step.mesh_dim)] += m
            if key is not None:
                moved[(key, q)].append((step.kind, step.mesh_dim))
            elif rerun:
                steps[("recompute", step.kind, step.mesh_dim)] += rerun
        kind = bucketed_use(graph, sg.nodes, producer, consumer)
        if kind:
            bucketed.append(BucketedMove(kind, t, p, q, m + rerun, producer))
            if key is not None:  # it takes the shared resharding's reruns, below
                shared_move[(key, q)] = bucketed[-1]
    for shared, kinds in moved.items():
        for kind, dim in kinds:
            if again[shared]:
                steps[("recompute", kind, dim)] += again[shared]
        if shared in shared_move:
            shared_move[shared].times += again[shared]
    # what ops communicate themselves (the experts' token exchange) is in their cost
    counts = (comm, collectives, steps, own_steps)
    own, in_op_hidden = _in_op_collectives(graph, node_strategy, mesh, reruns, counts)
    compute -= own
    hidden = _hidden_by_kind(sg, choice, mesh) if sg.overlap else {}
    for kind, seconds in in_op_hidden.items():
        hidden[kind] = hidden.get(kind, 0.0) + seconds

    parameters, inputs, param_bytes = _placed_leaves(graph, node_strategy, mesh)
    return Plan(
        name=name,
        sg=sg,
        mesh=mesh,
        choice=dict(choice),
        node_strategy=node_strategy,
        parameters=parameters,
        inputs=inputs,
        compute_s=compute,
        comm_s=dict(comm),
        collectives=collectives,
        param_bytes=param_bytes,
        activation_bytes=peak_activation_bytes(sg, node_strategy, mesh.shape, recompute),
        optimizer_s=optimizer,
        hidden_s=hidden,
        step_flops=graph.step_flops,
        collective_steps=steps,
        own_steps=own_steps,
        bucketed_moves=bucketed,
        **_recomputation(sg, choice, recompute),
    )


def _in_op_collectives(
    graph: TracedGraph,
    node_strategy: dict[str, Strategy],
    mesh: MeshSpec,
    reruns: dict[str, int],
    counts: tuple[dict, Counter, Counter, Counter],
) -> tuple[float, dict[str, float]]:
    """Add what ops communicate themselves (an op rule's collectives) to ``counts``
    (seconds and calls by kind, steps by (phase, kind, mesh dim), the op-issued steps);
    returns the seconds the ops' costs hold for them (:attr:`Strategy.own_s`, what their
    compute leaves exposed) and, per kind, the seconds their compute hides (a ring's
    passes), split over the kinds in proportion to their seconds."""
    comm, collectives, steps, own_steps = counts
    own, hidden = 0.0, defaultdict(float)
    cm = comm_model(mesh)
    for n, s in node_strategy.items():
        info = graph.nodes.get(n)
        if info is None or not s.collectives:
            continue
        m = graph.mult(n)
        phase = "backward" if info.backward else "forward"
        seconds = [cm.collective(kind, nbytes, dim) for kind, dim, nbytes in s.collectives]
        own += m * s.own_s
        covered = sum(seconds) - s.own_s
        for (kind, dim, _), t in zip(s.collectives, seconds, strict=True):
            comm[kind] += m * t
            if covered > 0:
                hidden[kind] += m * covered * t / sum(seconds)
            collectives[kind] += m
            steps[(phase, kind, dim)] += m
            own_steps[(phase, kind, dim)] += m
            if reruns.get(n):
                steps[("recompute", kind, dim)] += reruns[n]
                own_steps[("recompute", kind, dim)] += reruns[n]
    return own, dict(hidden)


def _placed_leaves(
    graph: TracedGraph, node_strategy: dict[str, Strategy], mesh: MeshSpec
) -> tuple[dict[str, Placements], dict[str, Placements], float]:
    """Each parameter's placements under every name it has (tied aliases included), each
    user input's, and the parameters' bytes on one device (an alias counted once)."""
    parameters: dict[str, Placements] = {}
    inputs: dict[str, Placements] = {}
    param_bytes = 0.0
    for n, info in graph.nodes.items():
        if n not in node_strategy:  # a pipeline stage's graph holds part of the model
            continue
        if info.kind == "param":
            ps = node_strategy[n].outputs[0]
            names = graph.param_names.get(info.fqn)
            if names is None:  # a tied alias whose owner was indexed under another name
                names = next((v for v in graph.param_names.values() if info.fqn in v), [info.fqn])
            if not any(a in parameters for a in names):
                param_bytes += graph.mult(n) * info.results[0].nbytes / shard_factor(ps, mesh.shape)
            for alias in names:
                parameters[alias] = ps
        elif info.kind == "input":
            inputs[info.fqn] = node_strategy[n].outputs[0]
    return parameters, inputs, param_bytes


def _rerun(
    sg: StrategyGraph, node_strategy: dict[str, Strategy], reruns: dict[str, int], use: tuple
) -> int:
    """How many times a recomputation runs the resharding of ``use`` (producer, consumer,
    input index) again: its reader's reruns (:func:`_reruns`), unless the rerun read takes
    the backward's gather (:func:`autoshard.cost.checkpointing.rerun_takes_gather`). A
    shared resharding takes its most rerun reader's instead (:func:`build_plan`)."""
    producer, consumer, k = use
    if not reruns.get(consumer) or rerun_takes_gather(sg, node_strategy, producer, consumer, k):
        return 0
    return reruns[consumer]


def _reruns(sg: StrategyGraph, recompute: dict | None) -> dict[str, int]:
    """Per forward op node, how many times a recomputation runs it again (the real blocks
    of its traced block that recompute under a policy that recomputes it)."""
    ck = sg.checkpointing
    if ck is None or not ck.blocks:
        return {}
    counts = ck.counts(recompute)
    out: dict[str, int] = {}
    for b in ck.blocks:
        if counts[b.key]:
            for n in b.forward:
                out[n] = out.get(n, 0) + counts[b.key]
    return out


def _recomputation(sg: StrategyGraph, choice: dict[str, int], recompute) -> dict:
    """The :class:`Plan` fields of activation checkpointing (empty without it)."""
    ck = sg.checkpointing
    if ck is None or not ck.blocks:
        return {}
    return {
        "recompute": ck.counts(recompute),
        "recomputed_blocks": ck.recomputed_blocks(recompute),
        "selective_blocks": ck.selective_blocks(recompute),
        "recompute_s": ck.seconds(sg, choice, recompute),
        "checkpoint_early_stop": sg.early_stop,
    }


def shared_read(sg: StrategyGraph, producer: str, consumer: str) -> tuple | None:
    """The key under which ``consumer``'s read of ``producer`` shares its resharding with
    the other reads of that key wanting the same placement
    (:func:`autoshard.strategies.sharing.share_key`), or ``None`` (it pays its own, or
    ``sg`` prices every read)."""
    if not sg.share_reads:
        return None
    return share_key(
        sg.graph, consumer, producer, bucketed_use(sg.graph, sg.nodes, producer, consumer)
    )


def phase_of(sg: StrategyGraph, consumer: str) -> str:
    """``backward`` for a backward op or a gradient output sink, else ``forward``: the
    phase in which the resharding of a tensor ``consumer`` reads runs."""
    info = sg.graph.nodes.get(consumer)
    if info is not None:
        return "backward" if info.backward else "forward"
    return "backward" if is_gradient_sink(sg.graph, consumer) else "forward"


def moved_itemsize(sg: StrategyGraph, consumer: str, t: TensorInfo) -> int:
    """Bytes per element a resharding into ``consumer`` moves: a gradient is reduced in
    the reduce dtype (mixed precision: fp32, ``sg.reduce_itemsize``), else the tensor's."""
    if sg.reduce_itemsize and is_gradient_sink(sg.graph, consumer):
        return sg.reduce_itemsize
    return t.itemsize


def latency_share(
    sg: StrategyGraph, mesh: MeshSpec, producer: str, consumer: str, p, q, t: TensorInfo
) -> float:
    """The latency share of a resharding: a bucketed collective's share of its bucket
    (:func:`autoshard.strategies.graph.bucketed_use`), else 1."""
    if sg.bucket_bytes > 0 and bucketed_use(sg.graph, sg.nodes, producer, consumer):
        item = moved_itemsize(sg, consumer, t)
        return comm_model(mesh).bucket_share(p, q, t.shape, item, sg.bucket_bytes)
    return 1.0


def _hidden_by_kind(sg: StrategyGraph, choice: dict[str, int], mesh: MeshSpec) -> dict[str, float]:
    """Seconds hidden per collective kind: each overlappable edge's hidden seconds
    (:func:`autoshard.cost.overlap.hidden_seconds`) split over its collectives in proportion
    to their seconds (the steps of its first tensor)."""
    out: dict[str, float] = defaultdict(float)
    for i, z in hidden_seconds(sg, choice).hidden_s.items():
        if z <= 0:
            continue
        e = sg.edges[i]
        p = e.src_placements[e.src_groups[choice[e.src]]]
        q = e.dst_placements[e.dst_groups[choice[e.dst]]]
        t = e.members[0]
        item = moved_itemsize(sg, e.consumer, t)
        share = comm_model(mesh).bucket_share(p, q, t.shape, item, sg.bucket_bytes)
        steps = comm_model(mesh).redistribute_steps(p, q, t.shape, item, share)
        total = sum(st.seconds for st in steps)
        for st in steps:
            out[st.kind] += z * st.seconds / total if total > 0 else 0.0
    return dict(out)


def tensor_uses(sg: StrategyGraph):
    """Every (producer, consumer, input index, tensor) whose placement the plan decides.

    Producers that are free (computed locally in any placement) are skipped; model
    outputs appear under their sink names (``output.<k>``).
    """
    for name, info in sg.graph.nodes.items():
        if info.kind == "op" and name in sg.nodes:
            for k, (a, t) in enumerate(zip(info.arg_nodes, info.args, strict=True)):
                if a not in sg.free and a in sg.nodes:
                    yield a, name, k, t
        elif info.kind == "output":
            for k, (a, t) in enumerate(zip(info.arg_nodes, info.args, strict=True)):
                sink = f"{name}.{k}"
                if sink in sg.nodes and a not in sg.free:
                    yield a, sink, 0, t
