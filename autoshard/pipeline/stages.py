"""Pipeline stages: cluster ops into layers, then group layers into pipeline stages.

Two dynamic programs on plain data, independent of the tracer (docs/pipeline-stages.md has
the recurrences, their complexity and their sources):

* :func:`cluster_layers` - Alpa's *layer construction* (Zheng et al., "Alpa: Automating
  Inter- and Intra-Operator Parallelism for Distributed Deep Learning", OSDI 2022, and
  ``alpa/pipeline_parallel/layer_construction.py``): split a topologically ordered op
  sequence into ``L`` contiguous layers whose FLOPs are at most ``(1 + eps)`` times the mean
  and which hold at least a few heavy (matmul/conv) ops each, minimising the largest number of
  activation bytes that cross a layer boundary.
* :func:`assign_stages` - the inter-operator pass of Alpa (Sec. 5) and the slicing DP of
  TeraPipe (Li et al., ICML 2021): split ``L`` layers into ``S`` contiguous pipeline stages
  minimising the 1F1B step time ``sum(t_s) + (B - 1) * max(t_s)`` (DAPPLE, Fan et al.,
  PPoPP 2021) by enumerating the bottleneck stage time and solving a min-sum DP under each
  threshold.

and the mesh arithmetic of a pipeline degree: :func:`pipeline_degrees`,
:func:`submesh_shape`, :func:`stage_ranks`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.units import format_bytes

__all__ = [
    "DEFAULT_EPS",
    "DEFAULT_MIN_HEAVY_OPS",
    "OpCost",
    "StageCost",
    "StagePlan",
    "assign_stages",
    "cluster_layers",
    "even_split",
    "even_split_fits",
    "crossing_bytes",
    "pipeline_degrees",
    "pipeline_step_time",
    "stage_ranks",
    "submesh_shape",
    "usable_stages",
    "validate_balance",
]

DEFAULT_EPS = 0.6
"""Alpa's default FLOPs imbalance tolerance: a layer may hold 1.6x the mean FLOPs."""

DEFAULT_MIN_HEAVY_OPS = 3
"""Alpa's ``LAYER_HEAVY_OP_LOWER_BOUND``: heavy ops per layer when ``min_heavy_ops=None``."""

# Relative slack on the per-layer FLOPs cap, so that a layer whose FLOPs equal the cap up to
# float rounding (identical blocks with eps=0) is accepted.
_FLOPS_RTOL = 1e-9
# Relative tolerance below which two step times count as equal (the smaller bottleneck wins).
_TIME_RTOL = 1e-12
# Thresholds in the stage DP's first batch; later batches double, up to _BATCH_ELEMENTS
# float64 elements (K thresholds x (L + 1)^2, 16 MiB).
_FIRST_BATCH = 8
_BATCH_ELEMENTS = 2**21


# --------------------------------------------------------------------------------------------
# Layer clustering
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCost:
    """One op of a topologically ordered graph, as the layer clustering sees it.

    Attributes:
        name: the op's node name (used in error messages).
        flops: floating-point operations of the op (forward, or forward+backward: any one
            consistent measure; only ratios matter). Finite and >= 0.
        heavy: True for matmul/conv-like ops (``mm``, ``addmm``, ``bmm``, ``convolution``...):
            the ops whose sharding matters and which every layer must contain.
        module_path: FQN of the innermost module that called the op (``transformer.h.3.attn``),
            or None for ops outside any submodule.
    """

    name: str
    flops: float
    heavy: bool = False
    module_path: str | None = None


def crossing_bytes(num_ops: int, edges: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """Bytes that cross each possible cut of an op sequence.

    Cut ``c`` (``0 <= c <= num_ops``) lies between op ``c - 1`` and op ``c``. The bytes
    crossing it are the sum, over distinct tensors, of the bytes of every tensor produced
    before ``c`` and consumed at or after ``c``. A tensor is identified by its producer: a
    producer with several consumers is counted once, and if its edges disagree on the size
    (a tuple output read through ``getitem``) the largest size is used. Cuts 0 and
    ``num_ops`` are the graph's ends and cross nothing.

    Computed with a difference array in O(num_ops + len(edges)).

    Args:
        num_ops: n, the number of ops.
        edges: (producer index, consumer index, bytes of the tensor), producer < consumer.
            Pass only activations: graph inputs and parameters are not ops and do not cross
            cuts.

    Returns:
        int64 array of shape (num_ops + 1,), bytes per cut.

    Raises:
        AutoshardError: for an index out of range, an edge that does not go forward
            (ops not in topological order) or negative bytes.
    """
    last_use = np.full(num_ops, -1, dtype=np.int64)
    size = np.zeros(num_ops, dtype=np.int64)
    for k, edge in enumerate(edges):
        try:
            p, c, nbytes = (int(x) for x in edge)
        except (TypeError, ValueError):
            raise AutoshardError(
                f"edge {k} is {edge!r}: give (producer index, consumer index, bytes) integers"
            ) from None
        if not (0 <= p < num_ops and 0 <= c < num_ops):
            raise AutoshardError(
                f"edge {k} ({p} -> {c}) names an op outside 0..{num_ops - 1}: "
                f"index the ops list you passed"
            )
        if p >= c:
            raise AutoshardError(
                f"edge {k} ({p} -> {c}) does not go forward: pass the ops in topological "
                f"order (every producer before its consumers)"
            )
        if nbytes < 0:
            raise AutoshardError(f"edge {k} ({p} -> {c}) has {nbytes} bytes: sizes must be >= 0")
        last_use[p] = max(last_use[p], c)
        size[p] = max(size[p], nbytes)
    diff = np.zeros(num_ops + 2, dtype=np.int64)
    used = np.nonzero(last_use >= 0)[0]
    # Tensor of producer p crosses cuts p+1 .. last_use[p].
    np.add.at(diff, used + 1, size[used])
    np.add.at(diff, last_use[used] + 1, -size[used])
    return np.cumsum(diff[: num_ops + 1])


class _Windows:
    """Range-minimum queries over a fixed set of index windows ``[lo_b, hi_b]``, by a sparse
    table (Bender & Farach-Colton, "The LCA problem revisited", LATIN 2000).

    The windows are fixed for a whole DP while the keys change every round, so the query
    geometry (level and the two covering blocks of each window) is computed once and only the
    levels that the longest window needs are built: O(m log w) numpy work per round for m keys
    and windows of length at most w. Ties go to the smaller index.
    """

    def __init__(self, lo: np.ndarray, hi: np.ndarray) -> None:
        self.valid = lo <= hi
        length = np.where(self.valid, hi - lo + 1, 1)
        k = np.floor(np.log2(length)).astype(np.int64)
        # log2 of an exact power of two may round either way: repair both directions.
        k += (1 << (k + 1)) <= length
        k -= (1 << k) > length
        self.level = k
        self.left = np.where(self.valid, lo, 0)
        self.right = np.where(self.valid, hi - (1 << k) + 1, 0)
        self.levels = int(k.max(initial=0)) + 1

    def min(self, values: np.ndarray) -> np.ndarray:
        """Least value in each window; inf for an empty window."""
        table = np.full((self.levels, len(values)), math.inf)
        table[0] = values
        for k in range(1, self.levels):
            half = 1 << (k - 1)
            width = len(values) - (1 << k) + 1
            table[k, :width] = np.minimum(table[k - 1, :width], table[k - 1, half : half + width])
        best = np.minimum(table[self.level, self.left], table[self.level, self.right])
        return np.where(self.valid, best, math.inf)

    def argmin(self, key0: np.ndarray, key1: np.ndarray) -> np.ndarray:
        """Index of the lexicographically least (key0, key1) in each window; -1 if empty."""

        def le(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return (key0[a] < key0[b]) | ((key0[a] == key0[b]) & (key1[a] <= key1[b]))

        m = len(key0)
        table = np.zeros((self.levels, m), dtype=np.int64)
        table[0] = np.arange(m)
        for k in range(1, self.levels):
            half = 1 << (k - 1)
            width = m - (1 << k) + 1
            left = table[k - 1, :width]
            right = table[k - 1, half : half + width]
            table[k, :width] = np.where(le(left, right), left, right)
        a = table[self.level, self.left]
        b = table[self.level, self.right]
        return np.where(self.valid, np.where(le(a, b), a, b), -1)


@dataclass(frozen=True)
class _ClusterProblem:
    """Validated arrays of one clustering problem (internal)."""

    n: int
    prefix_flops: np.ndarray  # (n + 1,) float64
    prefix_heavy: np.ndarray  # (n + 1,) int64
    cut_bytes: np.ndarray  # (n + 1,) float64; inf where a cut is not allowed
    names: tuple[str, ...]

    @property
    def total_flops(self) -> float:
        return float(self.prefix_flops[-1])

    @property
    def total_heavy(self) -> int:
        return int(self.prefix_heavy[-1])

    def windows(self, num_layers: int, eps: float, min_heavy: int) -> _Windows:
        """For each layer end b = 1..n, the interval [lo, hi] of admissible layer starts a.

        ``flops(a, b) <= cap`` holds for a >= lo and ``heavy(a, b) >= min_heavy`` for a <= hi;
        both bounds are nondecreasing in b because the prefix sums are.
        """
        cap = (1.0 + eps) * self.total_flops / num_layers
        pf, ph = self.prefix_flops, self.prefix_heavy
        lo = np.searchsorted(pf, pf[1:] - cap * (1.0 + _FLOPS_RTOL), side="left")
        hi = np.searchsorted(ph, ph[1:] - min_heavy, side="right") - 1
        hi = np.minimum(hi, np.arange(self.n))  # a <= b - 1: layers are nonempty
        return _Windows(lo, hi)


def _min_max_cut(prob: _ClusterProblem, num_layers: int, win: _Windows) -> float:
    """Phase 1: the least achievable largest crossing over the L - 1 internal cuts (inf if none).

    dp_q(b) = min over a in [lo(b), hi(b)] of max(dp_{q-1}(a), w(a)), w(0) = 0.
    """
    n = prob.n
    dp = np.full(n + 1, math.inf)
    dp[0] = 0.0
    for _ in range(num_layers):
        dp = np.concatenate([[math.inf], win.min(np.maximum(dp, prob.cut_bytes))])
    return float(dp[n])


def _min_sum_cuts(
    prob: _ClusterProblem, num_layers: int, win: _Windows, max_cut: float
) -> list[int]:
    """Phase 2: layer boundaries [0, b_1, ..., n] with every cut <= max_cut, minimising
    (sum of crossing bytes, sum of |F(b_k) - k * F / L|) lexicographically.

    The second key is the distance of each cut's cumulative FLOPs from the ideal even split;
    both keys are additive over cuts, so the lexicographic DP is exact.
    """
    n = prob.n
    w = np.where(prob.cut_bytes <= max_cut, prob.cut_bytes, math.inf)
    mean = prob.total_flops / num_layers
    cost = np.full(n + 1, math.inf)
    dev = np.full(n + 1, math.inf)
    cost[0] = dev[0] = 0.0
    argmins = []
    for q in range(1, num_layers + 1):
        # Candidate start a of layer q closes cut number q - 1 (a = 0 when q = 1).
        g_cost = cost + w
        g_dev = dev + np.abs(prob.prefix_flops - (q - 1) * mean)
        g_cost[0] = cost[0]
        g_dev[0] = dev[0]
        g_dev[~np.isfinite(g_cost)] = math.inf
        arg = win.argmin(g_cost, g_dev)
        cost = np.full(n + 1, math.inf)
        dev = np.full(n + 1, math.inf)
        ok = arg >= 0
        cost[1:][ok] = g_cost[arg[ok]]
        dev[1:][ok] = g_dev[arg[ok]]
        argmins.append(arg)
    bounds = [n]
    for q in range(num_layers, 0, -1):
        bounds.append(int(argmins[q - 1][bounds[-1] - 1]))
    bounds.reverse()
    assert bounds[0] == 0 and all(a < b for a, b in pairwise(bounds))
    return bounds


def _cluster_problem(
    ops: Sequence[OpCost],
    edges: Sequence[tuple[int, int, int]],
    allowed_cuts: Collection[int] | None,
) -> _ClusterProblem:
    n = len(ops)
    if n == 0:
        raise AutoshardError("cannot cluster an empty op sequence into layers: pass the ops")
    flops = np.empty(n, dtype=np.float64)
    heavy = np.empty(n, dtype=np.int64)
    for k, op in enumerate(ops):
        f = float(op.flops)
        if not (math.isfinite(f) and f >= 0):
            raise AutoshardError(
                f"op {k} ({op.name}) has flops={op.flops}: give a finite value >= 0"
            )
        flops[k] = f
        heavy[k] = 1 if op.heavy else 0
    cut = crossing_bytes(n, edges).astype(np.float64)
    if allowed_cuts is not None:
        mask = np.zeros(n + 1, dtype=bool)
        for c in allowed_cuts:
            if not 0 < int(c) < n:
                raise AutoshardError(
                    f"allowed cut {c} is not between two ops: cuts lie in 1..{n - 1} "
                    f"(cut c separates op c-1 from op c)"
                )
            mask[int(c)] = True
        mask[0] = mask[n] = True
        cut[~mask] = math.inf
    return _ClusterProblem(
        n=n,
        prefix_flops=np.concatenate([[0.0], np.cumsum(flops)]),
        prefix_heavy=np.concatenate([[0], np.cumsum(heavy)]),
        cut_bytes=cut,
        names=tuple(op.name for op in ops),
    )


def _heavy_bound(prob: _ClusterProblem, num_layers: int, min_heavy_ops: int | None) -> int:
    """Alpa's rule when min_heavy_ops is None: 3 per layer, fewer if the graph has too few."""
    if min_heavy_ops is None:
        return min(DEFAULT_MIN_HEAVY_OPS, prob.total_heavy // num_layers)
    return min_heavy_ops


def _why_infeasible(
    prob: _ClusterProblem, num_layers: int, eps: float, min_heavy: int, allowed: bool
) -> str:
    """One-line reason why no clustering into num_layers layers exists, and what to change."""
    n, total = prob.n, prob.total_flops
    head = f"cannot cluster {n} ops into {num_layers} layers"
    if num_layers > n:
        return f"{head}: each layer needs an op; use at most {n} layers"
    if prob.total_heavy < num_layers * min_heavy:
        return (
            f"{head}: the graph has {prob.total_heavy} heavy (matmul/conv) ops, fewer than "
            f"{num_layers} layers x min_heavy_ops={min_heavy}; use at most "
            f"{prob.total_heavy // max(min_heavy, 1)} layers or lower min_heavy_ops"
        )
    if allowed:
        n_allowed = int(np.isfinite(prob.cut_bytes[1:n]).sum())
        if n_allowed < num_layers - 1:
            return (
                f"{head}: only {n_allowed} cuts are allowed and {num_layers} layers need "
                f"{num_layers - 1}; use at most {n_allowed + 1} layers or allow more cuts"
            )
    cap = (1.0 + eps) * total / num_layers
    flops = np.diff(prob.prefix_flops)
    big = int(np.argmax(flops))
    if flops[big] > cap * (1.0 + _FLOPS_RTOL):
        most = int(math.floor((1.0 + eps) * total / flops[big] * (1.0 + _FLOPS_RTOL)))
        need = flops[big] * num_layers / total - 1.0
        return (
            f"{head}: op {big} ({prob.names[big]}) alone has {flops[big]:.4g} FLOPs, more than "
            f"the per-layer cap (1 + eps) x mean = {cap:.4g}; use at most {most} layers or "
            f"eps >= {need:.3g}"
        )
    return (
        f"{head} with at most (1 + eps) x mean = {cap:.4g} FLOPs and at least {min_heavy} heavy "
        f"ops per layer{' at the allowed cuts' if allowed else ''}; use fewer layers or a "
        f"larger eps (now {eps})"
    )


def cluster_layers(
    ops: Sequence[OpCost],
    edges: Sequence[tuple[int, int, int]],
    num_layers: int | None = None,
    eps: float = DEFAULT_EPS,
    min_heavy_ops: int | None = None,
    *,
    allowed_cuts: Collection[int] | None = None,
    max_layers: int | None = None,
    layer_eps: float = 0.0,
) -> list[range]:
    """Group a topologically ordered op sequence into contiguous layers (Alpa's layer
    construction, solved exactly).

    A clustering into L layers is admissible when every layer holds at most
    ``(1 + eps) * total_flops / L`` FLOPs and at least ``min_heavy_ops`` heavy ops. Among
    admissible clusterings it minimises, lexicographically: (1) the largest crossing bytes
    over the L - 1 boundaries (:func:`crossing_bytes`), (2) the sum of crossing bytes, (3) the
    sum over boundaries k of ``|cumulative FLOPs at boundary k - k * total / L|`` (so that
    among equal cuts the most even split wins). Phase 1 is a min-max DP, phases 2-3 a min-sum
    DP restricted to cuts not above the phase-1 optimum; each transition takes the best start
    over a window of starts whose ends move monotonically, found with a sparse-table range
    minimum. Time O(L * n log n), memory O(L * n) for n ops (docs/pipeline-stages.md).

    Source: Alpa (Zheng et al., OSDI 2022), ``cluster_jaxpr_by_cost`` and
    ``search_layer_num`` in ``alpa/pipeline_parallel/layer_construction.py``. Alpa's DP is
    O(n^2 L) and its tie-break is not exact; this one is.

    Args:
        ops: the n ops in topological order. Cluster the forward graph: in a joint
            forward+backward graph every saved activation crosses every cut between its
            forward and backward uses.
        edges: (producer index, consumer index, bytes) per activation edge.
        num_layers: L; None chooses it like Alpa's ``search_layer_num``: the largest L in
            2..L_max whose least largest crossing is at most ``(1 + layer_eps)`` times that of
            L = 2, found by doubling L from 2 and then bisecting (exact when that cost grows
            with L, a heuristic otherwise, as in Alpa). L_max is the number of heavy ops
            divided by the heavy-op bound (n when the bound is 0), capped by ``max_layers``.
            When L = 2 is not admissible, or L_max < 2, one layer is returned. Each probe of L
            costs O(L n log n): cap it with ``max_layers`` when heavy ops number thousands.
        eps: FLOPs imbalance tolerance (Alpa's default 0.6), >= 0.
        min_heavy_ops: heavy ops per layer, >= 0. None (default) is Alpa's rule: 3, lowered to
            ``heavy_ops // L`` when the graph has fewer than 3 per layer.
        allowed_cuts: if given, the only cuts a boundary may use (cut c separates op c - 1
            from op c), e.g. the starts of top-level module calls, so that boundaries map to
            module FQNs.
        max_layers: upper bound on the automatically chosen L (ignored when num_layers is
            given).
        layer_eps: slack of the automatic L search (Alpa's ``layer_eps``), >= 0.

    Returns:
        L contiguous ranges of op indices covering ``range(n)`` in order.

    Raises:
        AutoshardError: for invalid arguments, or when no admissible clustering into
            ``num_layers`` layers exists (the message says which constraint binds and how to
            relax it: fewer layers, a larger eps, a lower min_heavy_ops).
    """
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise AutoshardError(f"eps={eps} is not a tolerance: give a number >= 0, e.g. 0.6")
    if min_heavy_ops is not None and (not isinstance(min_heavy_ops, int) or min_heavy_ops < 0):
        raise AutoshardError(f"min_heavy_ops={min_heavy_ops}: give an integer >= 0, or None")
    if num_layers is not None and (not isinstance(num_layers, int) or num_layers < 1):
        raise AutoshardError(f"num_layers={num_layers}: give an integer >= 1, or None for auto")
    if max_layers is not None and (not isinstance(max_layers, int) or max_layers < 1):
        raise AutoshardError(f"max_layers={max_layers}: give an integer >= 1, or None")
    if not (math.isfinite(layer_eps) and layer_eps >= 0):
        raise AutoshardError(f"layer_eps={layer_eps}: give a number >= 0")
    prob = _cluster_problem(ops, edges, allowed_cuts)
    n = prob.n

    def best_max_cut(num: int) -> float:
        h = _heavy_bound(prob, num, min_heavy_ops)
        if num > n or prob.total_heavy < num * h:
            return math.inf
        return _min_max_cut(prob, num, prob.windows(num, eps, h))

    if num_layers is None:
        h3 = DEFAULT_MIN_HEAVY_OPS if min_heavy_ops is None else min_heavy_ops
        l_max = prob.total_heavy // h3 if h3 > 0 else n
        l_max = min(l_max, n, max_layers if max_layers is not None else n)
        base = best_max_cut(2) if l_max >= 2 else math.inf
        if not math.isfinite(base):
            return [range(0, n)]
        limit = base * (1.0 + layer_eps)
        # Exponential search then bisection: each probe of L costs O(L) DP rounds, so probing
        # upwards from 2 keeps the work near the answer rather than near l_max.
        good, bad = 2, l_max + 1
        while 2 * good < bad:
            if best_max_cut(2 * good) <= limit:
                good *= 2
            else:
                bad = 2 * good
                break
        while bad - good > 1:
            mid = (good + bad) // 2
            if best_max_cut(mid) <= limit:
                good = mid
            else:
                bad = mid
        num_layers = good

    h = _heavy_bound(prob, num_layers, min_heavy_ops)
    opt = best_max_cut(num_layers)
    if not math.isfinite(opt):
        raise AutoshardError(_why_infeasible(prob, num_layers, eps, h, allowed_cuts is not None))
    bounds = _min_sum_cuts(prob, num_layers, prob.windows(num_layers, eps, h), opt)
    return [range(a, b) for a, b in pairwise(bounds)]


# --------------------------------------------------------------------------------------------
# Stage assignment
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageCost:
    """What one candidate stage costs, as the caller's per-stage ILP reports it.

    Attributes:
        time_s: seconds per micro-batch (forward + backward when training) on the stage's
            submesh, including the send/receive of its boundary activations; ``math.inf``
            marks a stage that cannot run (its ILP is infeasible).
        memory_bytes: peak bytes per device of the stage (parameters, gradients, optimizer
            state and the activations 1F1B keeps in flight).
    """

    time_s: float
    memory_bytes: float


def pipeline_step_time(stage_times_s: Sequence[float], microbatches: int) -> float:
    """1F1B (and GPipe) step time ``sum(t_s) + (B - 1) * max(t_s)``, in seconds.

    The first micro-batch walks through all stages (``sum``); the other ``B - 1`` leave at the
    pace of the slowest stage. Source: Alpa (OSDI 2022, Sec. 5), TeraPipe (ICML 2021), DAPPLE
    (PPoPP 2021).

    Args:
        stage_times_s: per-stage time per micro-batch, seconds, >= 0.
        microbatches: B >= 1.
    """
    return float(sum(stage_times_s) + (microbatches - 1) * max(stage_times_s))


@dataclass(frozen=True)
class StagePlan:
    """Contiguous layers per pipeline stage and what the stages cost.

    Attributes:
        boundaries: S + 1 layer indices ``0 = b_0 < b_1 < ... < b_S = L``; stage s holds layers
            ``b_s .. b_{s+1} - 1``.
        balance: layers per stage (fairscale's ``balance`` list), ``b_{s+1} - b_s``.
        stage_times_s: per-stage time per micro-batch, seconds.
        stage_memory_bytes: per-stage peak memory per device, bytes.
        microbatches: B, micro-batches per step.
        step_time_s: predicted 1F1B step time, seconds (:func:`pipeline_step_time`).
        stage_cost_calls: how many times ``stage_cost`` was evaluated.

    Raises:
        AutoshardError: (on construction) when the fields disagree with each other.
    """

    boundaries: tuple[int, ...]
    balance: tuple[int, ...]
    stage_times_s: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    microbatches: int
    step_time_s: float
    stage_cost_calls: int = 0

    def __post_init__(self) -> None:
        b = self.boundaries
        if len(b) < 2 or b[0] != 0 or any(x >= y for x, y in pairwise(b)):
            raise AutoshardError(
                f"stage boundaries {list(b)} must rise strictly from 0 to the number of layers"
            )
        if list(self.balance) != [y - x for x, y in pairwise(b)]:
            raise AutoshardError(
                f"balance {list(self.balance)} does not match boundaries {list(b)}"
            )
        s = len(self.balance)
        if len(self.stage_times_s) != s or len(self.stage_memory_bytes) != s:
            raise AutoshardError(
                f"{s} stages but {len(self.stage_times_s)} stage times and "
                f"{len(self.stage_memory_bytes)} stage memories"
            )

    @property
    def num_stages(self) -> int:
        """S, the pipeline degree."""
        return len(self.balance)

    @property
    def num_layers(self) -> int:
        """L, the layers split among the stages."""
        return self.boundaries[-1]

    @property
    def layer_ranges(self) -> list[range]:
        """Per stage, the range of layer indices it holds."""
        return [range(a, b) for a, b in pairwise(self.boundaries)]

    @property
    def bottleneck_s(self) -> float:
        """The slowest stage's time per micro-batch, seconds."""
        return max(self.stage_times_s)


def validate_balance(balance: Sequence[int], num_layers: int) -> None:
    """Check a user-given ``balance`` (layers per stage, fairscale's list).

    Raises:
        AutoshardError: when the entries do not sum to ``num_layers`` or one is not a
            positive integer.
    """
    if any(not isinstance(x, int) or x <= 0 for x in balance) or not balance:
        raise AutoshardError(
            f"all balance numbers must be positive integers (balance: {list(balance)})"
        )
    if sum(balance) != num_layers:
        raise AutoshardError(
            f"the model and the sum of balance have different lengths (layers: {num_layers}, "
            f"sum of balance: {sum(balance)})"
        )


def even_split_fits(num_layers: int, num_stages: int) -> bool:
    """Whether :func:`even_split` leaves no stage empty: its last stage holds the fewest
    layers, ``(L + 2) // S - 1``, so ``L + 2 >= 2 S`` (one stage: always)."""
    return num_stages == 1 or num_layers + 2 >= 2 * num_stages


def even_split(num_layers: int, num_stages: int) -> list[int]:
    """Stage boundaries ``0 = b_0 < ... < b_S = L`` of torchtitan's default pipeline split:
    the embedding and the output head each weigh as one layer, the ``L + 2`` weighted
    layers are dealt evenly, the first ``(L + 2) mod S`` stages one more, and the first
    and last stages give back the embedding's and the head's weight. 80 layers into 2
    stages: 40 and 40; into 4: 20, 21, 20, 19. Source: ``generate_llm_fqn_per_model_part``
    (``input_weight = output_weight = 1``) in ``torchtitan/distributed/pipeline_parallel.py``.

    Raises:
        AutoshardError: fewer than 1 stage, or a stage left without a layer (too many
            stages for the layers).
    """
    if num_stages < 1:
        raise AutoshardError(f"num_stages={num_stages}: a pipeline needs at least 1 stage")
    weighted = num_layers + 2
    per, extra = divmod(weighted, num_stages)
    sizes = [per + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[0] -= 1
    sizes[-1] -= 1
    if num_stages == 1:
        sizes = [num_layers]
    if any(n < 1 for n in sizes):
        raise AutoshardError(
            f"an even split of {num_layers} layers (the embedding and the head weighing one "
            f"each) into {num_stages} stages leaves a stage without a layer ({sizes}): use "
            f"fewer stages"
        )
    return [0, *itertools.accumulate(sizes)]


def usable_stages(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Every (i, j) that is some stage of some split of L layers into S nonempty stages.

    Stage k (0-based) starts at i = 0 iff k = 0 and ends at j = L iff k = S - 1; it needs
    i >= k layers before it and L - j >= S - 1 - k after it.
    """
    L, S = num_layers, num_stages
    pairs = set()
    for k in range(S):
        starts = [0] if k == 0 else range(k, L - (S - k) + 1)
        for i in starts:
            ends = [L] if k == S - 1 else range(i + 1, L - (S - 1 - k) + 1)
            pairs.update((i, j) for j in ends)
    return sorted(pairs)


def _min_sum_under(
    feasible_time: np.ndarray, thresholds: np.ndarray, num_stages: int
) -> list[list[int] | None]:
    """Per threshold T, the split with the least sum of stage times among those whose every
    stage time <= T (its boundaries), or None if there is none.

    dp_s(j) = min over i of dp_{s-1}(i) + t(i, j), for K thresholds at once: O(K S L^2) numpy
    work in S vectorised steps.
    """
    L = feasible_time.shape[0] - 1
    K = len(thresholds)
    # Laid out [k, j, i] so that the minimum over the start i runs along contiguous memory.
    t_ji = feasible_time.T[None]
    m = np.where(t_ji <= thresholds[:, None, None], t_ji, math.inf)
    dp = np.full((K, L + 1), math.inf)
    dp[:, 0] = 0.0
    args = []
    for _ in range(num_stages):
        cand = dp[:, None, :] + m
        arg = np.argmin(cand, axis=2)
        dp = np.take_along_axis(cand, arg[:, :, None], axis=2)[:, :, 0]
        args.append(arg)
    out: list[list[int] | None] = []
    for k in range(K):
        if not math.isfinite(dp[k, L]):
            out.append(None)
            continue
        bounds = [L]
        for s in range(num_stages - 1, -1, -1):
            bounds.append(int(args[s][k, bounds[-1]]))
        out.append(bounds[::-1])
    return out


def _least_bottleneck(cost: np.ndarray, num_stages: int) -> float:
    """min over splits of the largest stage cost: dp_s(j) = min_i max(dp_{s-1}(i), c(i, j))."""
    L = cost.shape[0] - 1
    dp = np.full(L + 1, math.inf)
    dp[0] = 0.0
    for _ in range(num_stages):
        dp = np.min(np.maximum(dp[:, None], cost), axis=0)
    return float(dp[L])


def assign_stages(
    num_layers: int,
    num_stages: int,
    microbatches: int,
    stage_cost: Callable[[int, int], StageCost],
    memory_budget: float | None = None,
    split: Sequence[int] | None = None,
) -> StagePlan:
    """Split L layers into S contiguous pipeline stages minimising the 1F1B step time.

    Minimises ``sum_s t_s + (B - 1) * max_s t_s`` over splits ``0 = b_0 < ... < b_S = L`` with
    ``t_s = stage_cost(b_s, b_{s+1}).time_s`` and every stage's ``memory_bytes <=
    memory_budget``. Exact: for each candidate bottleneck T (each distinct stage time, in
    increasing order) a DP finds the least ``sum t_s`` with every ``t_s <= T``; the best
    ``sum + (B - 1) * max`` over all T is optimal. The scan starts at the least achievable
    bottleneck (a min-max DP) and stops once ``max(B T, least_sum + (B - 1) T)`` reaches the
    best step time found, ``least_sum`` being the least sum of any split: no split whose
    bottleneck is >= T can beat it. Ties go to the smaller bottleneck. Time O(K S L^2) for the
    K thresholds scanned (K <= L (L + 1) / 2; with additive stage times K is about 1).
    Source: the inter-operator DP of Alpa (Zheng et al., OSDI 2022, Sec. 5) and TeraPipe (Li et
    al., ICML 2021); the step-time model is DAPPLE's 1F1B (Fan et al., PPoPP 2021).

    ``stage_cost(i, j)`` (layers ``i .. j - 1``) is called once per stage that occurs in some
    split of L layers into S nonempty stages - ``2 (L - 1)`` pairs for S = 2, L for S = L, at
    most ``L (L + 1) / 2`` in general - and never twice for the same pair.

    Args:
        num_layers: L >= 1.
        num_stages: S, 1 <= S <= L.
        microbatches: B >= 1.
        stage_cost: (i, j) -> :class:`StageCost` of a stage holding layers i..j-1 on its
            submesh (:func:`submesh_shape`).
        memory_budget: bytes per device, or None for no limit.
        split: boundaries ``0 = b_0 < ... < b_S = L`` of the one split to price (its S
            stages are the only ones ``stage_cost`` is called for, e.g.
            :func:`even_split`), or None to search every split.

    Returns:
        The optimal :class:`StagePlan` (with ``split``: that split, priced).

    Raises:
        AutoshardError: for S < 1, S > L, B < 1, a bad budget or a bad ``StageCost``; when no
            split fits the memory budget (naming the smallest largest-stage memory any split
            reaches); when every split has a stage whose time is infinite.
    """
    for what, value, least in (("num_layers", num_layers, 1), ("microbatches", microbatches, 1)):
        if not isinstance(value, int) or value < least:
            raise AutoshardError(f"{what}={value}: give an integer >= {least}")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise AutoshardError(
            f"num_stages={num_stages}: a pipeline needs at least 1 stage (pp >= 1)"
        )
    if num_stages > num_layers:
        raise AutoshardError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages: use at most "
            f"{num_layers} stages, or cluster the model into more layers"
        )
    if memory_budget is not None and not (memory_budget > 0):
        raise AutoshardError(f"memory_budget={memory_budget}: give bytes per device > 0, or None")

    L, S, B = num_layers, num_stages, microbatches
    time = np.full((L + 1, L + 1), math.inf)
    mem = np.full((L + 1, L + 1), math.inf)
    if split is None:
        pairs = usable_stages(L, S)
    else:
        b = [int(x) for x in split]
        if len(b) != S + 1 or b[0] != 0 or b[-1] != L or any(x >= y for x, y in pairwise(b)):
            raise AutoshardError(
                f"split {list(split)}: give {S + 1} boundaries rising strictly from 0 to {L}"
            )
        pairs = list(pairwise(b))
    for i, j in pairs:
        c = stage_cost(i, j)
        if not isinstance(c, StageCost):
            raise AutoshardError(
                f"stage_cost({i}, {j}) returned {type(c).__name__}: return a StageCost"
            )
        if math.isnan(c.time_s) or c.time_s < 0:
            raise AutoshardError(f"stage_cost({i}, {j}) gave time {c.time_s} s: need >= 0 (or inf)")
        if not (math.isfinite(c.memory_bytes) and c.memory_bytes >= 0):
            raise AutoshardError(
                f"stage_cost({i}, {j}) gave memory {c.memory_bytes} bytes: need finite >= 0"
            )
        time[i, j] = c.time_s
        mem[i, j] = c.memory_bytes

    runnable = np.isfinite(time)
    fits = runnable if memory_budget is None else runnable & (mem <= memory_budget)
    feasible_time = np.where(fits, time, math.inf)
    least_time = _least_bottleneck(feasible_time, S)
    if not math.isfinite(least_time):
        if not math.isfinite(_least_bottleneck(np.where(runnable, 0.0, math.inf), S)):
            which = f"every split of {L} layers" if split is None else f"the split {b}"
            raise AutoshardError(
                f"{which} into {S} stages has a stage that cannot run "
                f"(stage_cost gave an infinite time): try another number of stages or a "
                f"larger submesh"
            )
        least_mem = _least_bottleneck(np.where(runnable, mem, math.inf), S)
        if split is None:
            which = f"no split of {L} layers into {S} stages fits"
            needs = "the best split needs"
        else:
            which = f"the split {b} of {L} layers into {S} stages does not fit"
            needs = "it needs"
        raise AutoshardError(
            f"{which} the memory budget of {format_bytes(memory_budget)} per device; "
            f"{needs} {format_bytes(least_mem)} on its fullest stage: raise the budget, use "
            f"more stages or more devices per stage"
        )

    # A split whose bottleneck is >= T takes at least lower(T) = max(B T, least_sum + (B - 1) T)
    # (its sum is >= T and >= the least sum of any split), so thresholds are scanned upwards
    # from least_time (below it no split exists) in growing batches until lower(T) reaches
    # the best step time found.
    (unconstrained,) = _min_sum_under(feasible_time, np.array([math.inf]), S)
    assert unconstrained is not None
    least_sum = sum(float(time[a, b]) for a, b in pairwise(unconstrained))
    thresholds = np.unique(feasible_time[np.isfinite(feasible_time)])
    thresholds = thresholds[thresholds >= least_time]
    max_batch = max(1, _BATCH_ELEMENTS // (L + 1) ** 2)
    best: tuple[float, list[int]] | None = None  # (step time, boundaries)
    start, batch = 0, min(_FIRST_BATCH, max_batch)
    while start < len(thresholds):
        chunk = thresholds[start : start + batch]
        start += len(chunk)
        batch = min(2 * batch, max_batch)
        if best is not None:
            lower = np.maximum(B * chunk, least_sum + (B - 1) * chunk)
            chunk = chunk[lower < best[0] * (1 - _TIME_RTOL)]
            if len(chunk) == 0:
                break
        for bounds in _min_sum_under(feasible_time, chunk, S):
            if bounds is None:
                continue
            step = pipeline_step_time([float(time[a, b]) for a, b in pairwise(bounds)], B)
            if best is None or step < best[0] * (1 - _TIME_RTOL):
                best = (step, bounds)
    assert best is not None
    step, bounds = best
    return StagePlan(
        boundaries=tuple(bounds),
        balance=tuple(b - a for a, b in pairwise(bounds)),
        stage_times_s=tuple(float(time[a, b]) for a, b in pairwise(bounds)),
        stage_memory_bytes=tuple(float(mem[a, b]) for a, b in pairwise(bounds)),
        microbatches=B,
        step_time_s=step,
        stage_cost_calls=len(pairs),
    )


# --------------------------------------------------------------------------------------------
# Pipeline degree and submeshes
# --------------------------------------------------------------------------------------------


def _mesh_text(mesh_shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in mesh_shape)


def _check_mesh(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(mesh_shape)
    if not shape or any(not isinstance(d, int) or d < 1 for d in shape):
        raise AutoshardError(
            f"mesh shape {list(shape)} is not a mesh: give positive integer dims, e.g. 2x4"
        )
    return shape


def submesh_shape(mesh_shape: Sequence[int], pp: int) -> tuple[int, ...]:
    """Shape of the submesh each of ``pp`` pipeline stages gets.

    Stages split the mesh along its leading dims: stage s takes the s-th of ``pp`` equal,
    contiguous blocks of the row-major rank order (:func:`stage_ranks`). That block is a
    submesh exactly when ``pp = shape[0] * ... * shape[k-1] * f`` with ``f`` dividing
    ``shape[k]``; the submesh keeps every mesh dim (so placements and per-dim bandwidths keep
    their meaning), with size 1 on dims ``0..k-1`` and ``shape[k] // f`` on dim k. E.g. 2x4:
    pp=2 -> (1, 4) (one node per stage), pp=4 -> (1, 2), pp=8 -> (1, 1). Pipelining across
    dim 0 (inter-node) first is the usual choice: only boundary activations cross nodes.

    Raises:
        AutoshardError: for a bad mesh shape, pp < 1, or a pp that does not split the mesh
            along its leading dims (the message lists the degrees that do).
    """
    shape = _check_mesh(mesh_shape)
    if not isinstance(pp, int) or pp < 1:
        raise AutoshardError(f"pipeline degree pp={pp}: give an integer >= 1")
    rest = pp
    out = list(shape)
    for k, d in enumerate(shape):
        if rest == 1:
            break
        if rest % d == 0:
            out[k] = 1
            rest //= d
        elif d % rest == 0:
            out[k] = d // rest
            rest = 1
        else:
            break
    if rest != 1:
        raise AutoshardError(
            f"pipeline degree pp={pp} does not split mesh {_mesh_text(shape)} into equal "
            f"submeshes along its leading dims; use one of {pipeline_degrees(shape)}"
        )
    return tuple(out)


def pipeline_degrees(mesh_shape: Sequence[int]) -> list[int]:
    """The pipeline degrees a mesh admits, ascending (see :func:`submesh_shape`).

    ``pp = shape[0] * ... * shape[k-1] * f`` for a divisor ``f`` of ``shape[k]``: for 2x4 that
    is [1, 2, 4, 8]; for 3x4 it is [1, 3, 6, 12] (pp=2 would split a row of the 3-row mesh).

    Raises:
        AutoshardError: for a bad mesh shape.
    """
    shape = _check_mesh(mesh_shape)
    degrees = {1}
    lead = 1
    for d in shape:
        degrees.update(lead * f for f in range(1, d + 1) if d % f == 0)
        lead *= d
    return sorted(degrees)


def stage_ranks(mesh_shape: Sequence[int], pp: int, stage: int) -> range:
    """Global ranks of stage ``stage`` (0-based), in row-major order of the mesh.

    They form a submesh of :func:`submesh_shape` ``(mesh_shape, pp)`` when reshaped; e.g. mesh
    2x4, pp=4, stage 1 -> ranks 2, 3 (mesh[0, 2:4]).

    Raises:
        AutoshardError: as :func:`submesh_shape`, or for a stage outside 0..pp-1.
    """
    sub = submesh_shape(mesh_shape, pp)
    if not isinstance(stage, int) or not 0 <= stage < pp:
        raise AutoshardError(f"stage {stage} does not exist: pp={pp} has stages 0..{pp - 1}")
    size = math.prod(sub)
    return range(stage * size, (stage + 1) * size)
