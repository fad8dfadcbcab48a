"""Trace a model into a core-ATen graph on the meta device and annotate every node.

``torch.export.export`` on the meta device (no weights allocated), then
``run_decompositions()`` to core ATen (``addmm``, ``bmm``, ``view``,
``native_layer_norm``, ...), which is what DTensor has sharding rules for.

Each node gets MASE-style metadata (:class:`NodeInfo`): per tensor argument and
result its shape, dtype and bytes; the FLOPs of the op; the module path (FQN) it
came from; and the index of the repeated block (layer) it belongs to. Repeated
blocks are found from the module tree (a container whose children are named
``0, 1, 2, ...`` and share one class) and checked against the graph (each block
must trace to the same op sequence); no model-specific names are used.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import math
import operator
import os
import re
import sysconfig
import time
import traceback
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import flop_registry

from autoshard import _torch_private as tp
from autoshard.errors import AutoshardError
from autoshard.model.blocks import find_block_prefixes
from autoshard.model.loss import loss_function
from autoshard.model.model_file import LoadedModel
from autoshard.trace.attention import FLASH_FORWARD, FLASH_OPS, flash_attention_traced, flash_flops
from autoshard.trace.batchnorm import batch_norm_traced
from autoshard.trace.experts import experts_traced
from autoshard.trace.ops import is_view


@dataclass(frozen=True)
class TensorInfo:
    """Shape (global), dtype and size in bytes of one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass
class NodeInfo:
    """MASE-style metadata of one graph node.

    ``args``: one :class:`TensorInfo` per tensor argument (flattened order of
    ``args`` then ``kwargs``); ``arg_nodes`` the producing node names, same order.
    ``results``: one per output (``None`` for a non-tensor output).
    ``flops``: floating-point operations of the whole (unsharded) op (:func:`op_flops`);
    ``counted_flops``: the part ``FlopCounterMode`` counts (matmul-like ops, else 0).
    ``kind``: ``param``, ``buffer``, ``input``, ``tangent`` (the loss's seed gradient in
    a joint graph), ``op`` or ``output``.
    """

    name: str
    kind: str
    target: Any
    args: list[TensorInfo] = field(default_factory=list)
    arg_nodes: list[str] = field(default_factory=list)
    results: list[TensorInfo | None] = field(default_factory=list)
    flops: float = 0.0
    counted_flops: float = 0.0
    module_path: str | None = None
    layer: int | None = None
    fqn: str | None = None  # parameter/buffer FQN or user-input name
    backward: bool = False  # part of the backward pass (joint graph)
    grad_of: list[str | None] = field(default_factory=list)  # output node: per arg

    @property
    def op_name(self) -> str:
        return str(self.target) if self.kind == "op" else self.kind


@dataclass
class TracedGraph:
    """A traced, annotated graph.

    ``nodes`` is in topological order. ``param_names``: parameter FQN -> every name
    under which the model holds that tensor (tied weights appear once in the graph).
    """

    model_name: str
    graph_module: torch.fx.GraphModule
    nodes: dict[str, NodeInfo]
    input_names: tuple[str, ...]
    param_names: dict[str, list[str]]
    block_prefixes: dict[str, int]
    num_layers: int
    trace_seconds: float
    mode: str = "infer"
    multiplicity: dict[str, int] = field(default_factory=dict)
    depth: DepthReduction | None = None
    # which activations are live where (autoshard.cost.liveness.liveness), computed once
    liveness: Any = field(default=None, repr=False, compare=False)

    def mult(self, node: str) -> int:
        """How many real nodes ``node`` stands for (1 unless the depth was reduced)."""
        if node in self.nodes:
            return self.multiplicity.get(node, 1)
        base, _, k = node.rpartition(".")  # an output sink "output.<k>": its producer's
        out = self.nodes.get(base)
        if out is not None and k.isdigit() and int(k) < len(out.arg_nodes):
            return self.multiplicity.get(out.arg_nodes[int(k)], 1)
        return 1

    @property
    def step_flops(self) -> float:
        """Global FLOPs of the traced step (forward, plus backward in training) as
        ``torch.utils.flop_counter.FlopCounterMode`` counts them: matmul-like ops only,
        each node times the real nodes it stands for (:meth:`mult`)."""
        return float(sum(i.counted_flops * self.mult(n) for n, i in self.nodes.items()))

    def saved_for_backward(self) -> list[str]:
        """Forward op outputs a backward op reads, in graph order (empty in inference).

        They stay live from the forward pass to the backward pass.
        """
        saved = set()
        for info in self.nodes.values():
            if info.kind == "op" and info.backward:
                saved.update(
                    a
                    for a in info.arg_nodes
                    if self.nodes[a].kind == "op" and not self.nodes[a].backward
                )
        return [n for n in self.nodes if n in saved]

    def param_gradients(self) -> dict[str, str]:
        """Parameter FQN (as traced, one per parameter node) -> the node that is its
        gradient: the training graph's output names each gradient (``NodeInfo.grad_of``)
        by one of :meth:`traced_names`. A parameter that gets none is absent
        (:meth:`frozen_params`); empty in inference."""
        out = next((i for i in reversed(self.nodes.values()) if i.kind == "output"), None)
        if out is None:
            return {}
        grads = {p: a for a, p in zip(out.arg_nodes, out.grad_of, strict=False) if p is not None}
        found = {}
        for info in self.nodes.values():
            if info.kind == "param":
                grad = next((grads[a] for a in self.traced_names(info.fqn) if a in grads), None)
                if grad is not None:
                    found[info.fqn] = grad
        return found

    def frozen_params(self) -> frozenset[str]:
        """The parameter nodes of a training graph that get no gradient (``requires_grad``
        off: a frozen layer, a LoRA's base weights): no gradient to keep or reduce, and
        ``torch.optim.AdamW`` keeps no state for them and skips them in its step. Empty
        in inference. A tied parameter is trained when any of its names gets one."""
        if self.mode != "train":
            return frozenset()
        grads = self.param_gradients()
        return frozenset(
            n for n, i in self.nodes.items() if i.kind == "param" and i.fqn not in grads
        )

    def traced_names(self, fqn: str) -> list[str]:
        """The names the graph may give parameter ``fqn``'s tensor (its output names a
        gradient by one): ``fqn`` itself, then its tied aliases. A depth-reduced graph's
        aliases of a block parameter are the real blocks' names it stands for, which may
        be other traced blocks' names: those are left out."""
        names = self.param_names.get(fqn, ())
        if self.depth is not None:
            head = self.depth.prefix + "." if self.depth.prefix else ""
            names = [
                a
                for a in names
                if not (a.startswith(head) and a.removeprefix(head).split(".", 1)[0].isdigit())
            ]
        return [fqn, *(a for a in names if a != fqn)]

    def users(self) -> dict[str, list[str]]:
        """Node name -> names of the nodes that read it."""
        out: dict[str, list[str]] = defaultdict(list)
        for info in self.nodes.values():
            for a in dict.fromkeys(info.arg_nodes):
                out[a].append(info.name)
        return out


def _tensor_info(value: Any) -> TensorInfo | None:
    if isinstance(value, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in value.shape), value.dtype)
    return None


def _is_node(x: Any) -> bool:
    return isinstance(x, torch.fx.Node)


def tensor_arg_nodes(node: torch.fx.Node) -> list[torch.fx.Node]:
    """Tensor-valued argument nodes of ``node``, flattened (args then kwargs)."""
    leaves, _ = torch.utils._pytree.tree_flatten((list(node.args), dict(node.kwargs)))
    return [x for x in leaves if _is_node(x) and isinstance(x.meta.get("val"), torch.Tensor)]


def counted_flops(node: torch.fx.Node, args: list[TensorInfo], results: list[TensorInfo | None]):
    """FLOPs of ``node`` as ``torch.utils.flop_counter.FlopCounterMode`` counts them, on the
    given (global or local) shapes; ``None`` for an op the counter does not count.

    The counter's own formula (``flop_registry``, keyed by overload packet: mm, addmm, bmm,
    baddbmm, convolution and its backward, the SDPA variants and their backwards; the fused
    attention ops of :mod:`autoshard.trace.attention` as it counts the CUDA flash kernel) is
    called the way the counter calls it: the node's arguments with each tensor argument
    replaced by a meta tensor of the given shape, and ``out_val`` the result(s). 2 FLOPs
    per multiply-add.

    Args:
        node: the graph node (its non-tensor arguments: strides, flags, ...).
        args: one :class:`TensorInfo` per tensor argument, in :func:`tensor_arg_nodes` order.
        results: one per output (``None`` for a non-tensor output).

    Raises:
        Any error the formula raises: a formula that cannot price an op is a bug here
        (it once priced every matmul at one FLOP per element), never a fallback.
    """
    if node.target in FLASH_OPS:
        return flash_flops(node.target, [a.shape for a in args])
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet)
    if formula is None:
        return None
    tensors = iter(torch.empty(a.shape, dtype=a.dtype, device="meta") for a in args)
    wanted = {id(n) for n in tensor_arg_nodes(node)}

    def arg(x: Any) -> Any:
        if _is_node(x):
            return next(tensors) if id(x) in wanted else x.meta.get("val")
        return x

    call_args, call_kwargs = torch.utils._pytree.tree_map(
        arg, (tuple(node.args), dict(node.kwargs))
    )
    outs = [
        None if r is None else torch.empty(r.shape, dtype=r.dtype, device="meta") for r in results
    ]
    out_val = outs[0] if not isinstance(node.meta.get("val"), (tuple, list)) else tuple(outs)
    return float(formula(*call_args, out_val=out_val, **call_kwargs))


def op_flops(
    node: torch.fx.Node, args: list[TensorInfo], results: list[TensorInfo | None]
) -> float:
    """FLOPs of one op on the given (global or local) shapes.

    Ops ``FlopCounterMode`` counts (matmul-like) use its formulas (:func:`counted_flops`).
    Every other op counts one FLOP per output element, or per input element when that is
    larger (reductions): a common approximation for memory-bound ops, whose roofline time
    is set by their bytes anyway.
    """
    counted = counted_flops(node, args, results)
    if counted is not None:
        return counted
    out_elems = sum(r.numel for r in results if r is not None)
    in_elems = max((a.numel for a in args), default=0)
    return float(max(out_elems, in_elems))


_aten = torch.ops.aten


def _module_path(node: torch.fx.Node, strip: str = "") -> str | None:
    """FQN of the innermost module the node came from (backward nodes: their forward's)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    if not isinstance(path, str):
        return None
    if strip and (path == strip or path.startswith(strip + ".")):
        path = path[len(strip) + 1 :]
    return path or None


def _grad_of_outputs(node: torch.fx.Node, grad_of: list[str | None] | None) -> list[str | None]:
    """Per tensor argument of the output node, the parameter it is the gradient of."""
    if grad_of is None:
        return []
    leaves, _ = torch.utils._pytree.tree_flatten(list(node.args))
    out = []
    for i, x in enumerate(leaves):
        if _is_node(x):
            out.append(grad_of[i] if i < len(grad_of) else None)
    return out


def path_within_block(block_prefixes: Iterable[str]) -> Callable[[str | None], str | None]:
    """A function taking a module path or FQN to its part inside its repeated block, for
    any block index: ``transformer.h.7.attn.c_attn.weight`` -> ``attn.c_attn.weight``,
    ``transformer.h.7`` -> ``""``; other paths unchanged. A depth-reduced graph names its
    traced blocks ``h.0``-``h.3`` while they stand for other indices, and a stored
    solution may come from another depth, so the index is never compared."""
    some = next(iter(block_prefixes), None)
    if some is None:
        return lambda path: path
    container = some.rsplit(".", 1)[0] if "." in some else ""
    head = re.compile(rf"^{re.escape(container)}\.\d+(\.|$)" if container else r"^\d+(\.|$)")
    return lambda path: head.sub("", path) if path else path


def _layer_of(path: str | None, blocks: dict[str, int], pattern: re.Pattern | None) -> int | None:
    if not path or pattern is None:
        return None
    m = pattern.match(path)
    return blocks.get(m.group(1)) if m else None


@dataclass(frozen=True)
class DepthReduction:
    """A model traced with fewer repeated blocks than it has.

    ``stands_for[i]``: the real block indices traced block ``i`` stands for. The
    traced blocks are the first two, one middle block standing for all the others but
    the last, and the last: ``[0], [1], [2..L-2], [L-1]`` (the same within each pipeline
    stage when :func:`reduce_depth` is given stage boundaries). ``prefix``: the
    container's FQN (e.g. ``transformer.h``); ``num_blocks``: ``L``.
    """

    prefix: str
    num_blocks: int
    stands_for: tuple[tuple[int, ...], ...]

    def real_names(self, fqn: str) -> list[str]:
        """Every real FQN a traced FQN stands for (itself outside the blocks)."""
        head = self.prefix + "." if self.prefix else ""
        if not fqn.startswith(head):
            return [fqn]
        index, _, rest = fqn[len(head) :].partition(".")
        if not index.isdigit() or int(index) >= len(self.stands_for):
            return [fqn]
        tail = "." + rest if rest else ""
        return [f"{head}{j}{tail}" for j in self.stands_for[int(index)]]


def _reduced_groups(start: int, end: int, alike: Sequence[Any]) -> list[tuple[int, ...]]:
    """The traced blocks of blocks ``start..end-1``: the first two, one middle block
    standing for each run of middle blocks alike (``alike[j]``, :func:`_block_signature`:
    one run when they all are; a run's last block its own when the block after it is not
    alike), and the last (each its own when 4 or fewer)."""
    if end - start <= 4:
        return [(j,) for j in range(start, end)]
    runs: list[list[int]] = []
    for j in range(start + 2, end - 1):
        if runs and alike[j] == alike[runs[-1][0]]:
            runs[-1].append(j)
        else:
            runs.append([j])
    groups: list[tuple[int, ...]] = [(start,), (start + 1,)]
    for run in runs:
        # the ops between a traced block and the next stand for those after each block of
        # its run: when the block after the run differs, the last boundary does too
        if len(run) > 1 and alike[run[-1] + 1] != alike[run[0]]:
            groups += [tuple(run[:-1]), (run[-1],)]
        else:
            groups.append(tuple(run))
    return [*groups, (end - 1,)]


def _block_signature(block: torch.nn.Module) -> tuple:
    """What must agree for one traced block to stand for another: its class, and each
    parameter's and buffer's name, shape, dtype and (parameters) whether it gets a
    gradient. A frozen block (``requires_grad_(False)``) has no weight gradients, no
    optimizer step and no state: a trainable one traced in its place priced them away."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()
    )
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers())
    return (type(block), params, buffers)


def reduce_depth(
    module: torch.nn.Module,
    keep: int = 4,
    bounds: Callable[[int], Sequence[int] | None] | None = None,
) -> DepthReduction | None:
    """Keep blocks 0, 1, 2 and L-1 of the model's repeated blocks (in place).

    Identical middle blocks cost the same and get the same plan, so one traced middle
    block stands for all of them; its costs are counted ``L - 3`` times (see
    :attr:`TracedGraph.multiplicity`). Middle blocks that differ (:func:`_block_signature`:
    some frozen, others trained) get one traced block per run of alike ones. Returns
    ``None`` (and changes nothing) when the model has at most ``keep`` blocks or its
    blocks are not an ``nn.ModuleList`` / ``nn.Sequential``.

    ``bounds(L)``: pipeline stage boundaries ``0 = b_0 < ... < b_S = L`` over the ``L``
    blocks (or ``None``: trace every block); each stage is then reduced on its own (its
    first two blocks, one middle block for the rest but its last, its last), so that no
    traced block stands for blocks of two stages and a stage is cut out of the graph
    whole (:func:`autoshard.pipeline.search.pipeline_rows`). ``None`` when no stage has
    more than 4 blocks.

    Raises:
        AutoshardError: ``bounds`` that do not split ``0..L`` into nonempty stages.
    """
    blocks = find_block_prefixes(module)
    n = len(blocks)
    if n == 0 or (bounds is None and n <= keep):
        return None
    prefix = next(iter(blocks)).rpartition(".")[0]
    container = module.get_submodule(prefix) if prefix else module
    if type(container) not in (torch.nn.ModuleList, torch.nn.Sequential):
        return None
    given = None if bounds is None else bounds(n)
    if bounds is not None and given is None:  # no split of these blocks: trace them all
        return None
    cuts = [0, n] if given is None else [int(b) for b in given]
    if cuts[0] != 0 or cuts[-1] != n or any(a >= b for a, b in itertools.pairwise(cuts)):
        raise AutoshardError(
            f"stage boundaries {cuts} do not split the {n} repeated blocks into "
            f"nonempty stages (0 = b_0 < ... < b_S = {n})"
        )
    # alike: the same signature, and gradients flowing into its input or not (a trained
    # block before it: the first trained block after frozen ones makes no input gradient)
    alike, upstream = [], False
    for j in range(n):
        alike.append((_block_signature(container[j]), upstream))
        upstream = upstream or any(q.requires_grad for q in container[j].parameters())
    stands_for = tuple(g for a, b in itertools.pairwise(cuts) for g in _reduced_groups(a, b, alike))
    if len(stands_for) == n:  # every block traced: nothing to reduce
        return None
    kept = [g[0] for g in stands_for]
    smaller = (
        type(container)(*[container[i] for i in kept])
        if isinstance(container, torch.nn.Sequential)
        else torch.nn.ModuleList([container[i] for i in kept])
    )
    parent_path, _, attr = prefix.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    setattr(parent, attr, smaller)
    return DepthReduction(prefix, n, stands_for)


class _LossWrapper(torch.nn.Module):
    """The model plus its training loss (:mod:`autoshard.model.loss`: the model file's
    ``loss_fn``, else the mean of the first floating-point output), for the joint graph.
    The launcher runs the same graph, and its ``--check`` reference the same loss."""

    def __init__(self, model: torch.nn.Module, loss_fn=None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_function(loss_fn)

    def forward(self, *args):
        return self.loss_fn(self.model(*args), *args)


_LIBRARY_DIRS = tuple(
    str(Path(d).resolve())
    for d in {
        *(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        str(Path(__file__).resolve().parents[1]),  # autoshard itself
    }
    if d
)


def _library_file(path: str) -> bool:
    """A file of Python, an installed package or autoshard itself: not the user's code."""
    resolved = str(Path(path).resolve())
    return (
        "site-packages" in path
        or "dist-packages" in path
        or any(resolved.startswith(d + os.sep) for d in _LIBRARY_DIRS)
    )


def _export_error(loaded: LoadedModel, exc: Exception, what: str) -> AutoshardError:
    """One line: what failed, torch's first line, and the user's own line when torch's
    message names it (the innermost frame outside site-packages and autoshard)."""
    if isinstance(exc, AutoshardError):  # autoshard's own message says what to do
        return exc
    text = str(exc).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next((line for line in lines if not line.startswith("def ")), type(exc).__name__)
    frames = [
        (path, line)
        for path, line in re.findall(r'File "([^"]+)", line (\d+)', text)
        if not _library_file(path)
    ]
    where = f" at {frames[-1][0]}:{frames[-1][1]}" if frames else ""
    hint = (
        "make the model traceable: no data-dependent Python control flow; see "
        "docs/model-file.md, 'Tracing'"
    )
    eager = _raises_eagerly(loaded, type(exc), first)
    if eager is not None:
        where = where or eager
        hint = (
            "the model raises the same on its example inputs without tracing: check "
            "example_inputs() against build_model()"
        )
    return AutoshardError(
        f"{what} could not trace {loaded.name}{where}: {type(exc).__name__}: {first} ({hint})"
    )


# what a model's own forward raises on inputs it cannot take (a shape that does not fit,
# a wrong dtype, a missing key): the errors torch.export passes on unchanged
_MODEL_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AssertionError)


def _raises_eagerly(loaded: LoadedModel, kind: type, first: str) -> str | None:
    """Whether the model, run as it is on its example inputs (no tracing, no gradients),
    raises ``kind`` with the first line ``first``: the export failed on the model's own
    error, not on something tracing refuses. Returns None when it does not, else where
    it raised (``" at FILE:LINE"``, the innermost frame of the user's code, or ``""``).
    Only an export error of :data:`_MODEL_ERRORS` is tried (torch's own tracing errors,
    such as a guard on data-dependent values, are not the model's); the eager run's
    errors of those kinds are compared with it, any other propagates."""
    if not issubclass(kind, _MODEL_ERRORS):
        return None
    try:
        with torch.no_grad(), _quiet_torch():
            loaded.module(*loaded.inputs)
    except _MODEL_ERRORS as exc:  # compared with the export's error: a diagnosis
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        if not (isinstance(exc, kind) and lines and lines[0] == first):
            return None
        frames = [
            f for f in traceback.extract_tb(exc.__traceback__) if not _library_file(f.filename)
        ]
        return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return None


@contextlib.contextmanager
def _quiet_torch():
    """torch's warnings, logs and graph dumps during export stay off the terminal unless
    ``AUTOSHARD_VERBOSE`` is set (``autoshard -v``): a failed export prints its graph twice
    and a log warning before raising, about 30 lines before autoshard's one; a shape error
    in the model logs a 20-line traceback at ERROR level."""
    if os.environ.get("AUTOSHARD_VERBOSE"):
        yield
        return
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]
    loggers = [lg for lg in loggers if lg.name.startswith("torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        # above ERROR too: a failed export logs the fake kernel's traceback at ERROR
        # (20 lines) before raising, and autoshard reports that error in one line
        lg.setLevel(logging.CRITICAL + 1)
    try:
        sink = io.StringIO()
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


# core ATen, but the fused attention op stays one op (autoshard.trace.attention)
_DECOMPOSITIONS = torch.export.default_decompositions()
_DECOMPOSITIONS.pop(FLASH_FORWARD, None)


def _export_inference(loaded: LoadedModel):
    """Forward graph: ``torch.export`` + core-ATen decompositions."""
    try:
        with _quiet_torch(), flash_attention_traced(loaded.input_names):
            ep = torch.export.export(loaded.module, loaded.inputs)
            ep = ep.run_decompositions(_DECOMPOSITIONS)
    except Exception as exc:  # torch raises many types here
        raise _export_error(loaded, exc, "torch.export") from exc
    sig = ep.graph_signature
    kinds: dict[str, tuple[str, str]] = {}
    user_inputs = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    for spec in sig.input_specs:
        if spec.kind == InputKind.PARAMETER:
            kinds[spec.arg.name] = ("param", spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kinds[spec.arg.name] = ("buffer", spec.target)
    labels = []
    for i, spec in enumerate(user_inputs):
        label = loaded.input_names[i] if i < len(loaded.input_names) else spec.arg.name
        kinds[spec.arg.name] = ("input", label)
        labels.append(label)
    return ep.graph_module, kinds, tuple(labels), None, lambda: None


def _export_joint(loaded: LoadedModel):
    """Joint forward+backward graph of one training step (see DESIGN.md).

    ``torch.export`` first (HF models fail in the joint export directly), then
    ``aot_export_joint_with_descriptors`` on ``ep.module()``; its placeholders and
    outputs carry descriptors pairing parameters with their gradients. Returns a
    closer for the joint export's context, to call once annotation is done.
    """
    stack = contextlib.ExitStack()
    try:
        with _quiet_torch(), flash_attention_traced(loaded.input_names):
            ep = torch.export.export(_LossWrapper(loaded.module, loaded.loss_fn), loaded.inputs)
            # the CompositeImplicitAutograd ops, decomposed (see the function's doc)
            ep = ep.run_decompositions(dict(tp.composite_implicit_decompositions()))
            joint = tp.export_joint(stack, ep.module(), loaded.inputs)
    except Exception as exc:
        stack.close()
        raise _export_error(loaded, exc, "the joint forward/backward export") from exc
    gm = joint.graph_module
    kinds: dict[str, tuple[str, str]] = {}
    labels = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        kind, target = tp.describe_input(node)
        if kind == "param" or kind == "buffer":
            kinds[node.name] = (kind, target.removeprefix("model."))
        elif kind == "input":
            i = int(target)
            label = loaded.input_names[i] if i < len(loaded.input_names) else node.name
            kinds[node.name] = ("input", label)
            labels.append(label)
        else:  # the loss's seed gradient (ones): a leaf of the graph, not a constant
            kinds[node.name] = ("tangent", node.name)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grad_of = [
        (g.removeprefix("model.") if g is not None else None) for g in tp.describe_outputs(out)
    ]
    try:
        _check_gradients(gm, kinds, out, loaded.name)
    except AutoshardError:
        stack.close()
        raise
    return gm, kinds, tuple(labels), grad_of, stack.close


def _check_gradients(gm: torch.fx.GraphModule, kinds: dict, out: torch.fx.Node, name: str) -> None:
    """The joint graph is a whole training step: the loss's seed gradient is read. A
    parameter the forward reads may have no gradient for a faithful reason (read only
    through ``.detach()`` or an ``argmax``), so those are named in the error, not an error
    by themselves.

    Raises:
        AutoshardError: the trace lost gradients (an op whose backward torch traced as
            undefined on the meta device; see
            :func:`autoshard._torch_private.composite_implicit_decompositions`).
    """
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    unread = [n.name for n in holders if kinds[n.name][0] == "tangent" and not n.users]
    if not unread:  # a parameter may lose its gradient faithfully (.detach(), argmax)
        return
    values = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    missing = {
        g.removeprefix("model.")
        for g, v in zip(tp.describe_outputs(out), values, strict=False)
        if g is not None and v is None
    }
    lost = sorted(
        kinds[n.name][1]
        for n in holders
        if kinds[n.name][0] == "param" and n.users and kinds[n.name][1] in missing
    )
    what = ", ".join(lost[:3]) + (", ..." if len(lost) > 3 else "")
    raise AutoshardError(
        f"the training graph of {name} lost gradients: the loss's seed gradient is never read; "
        + (f"{len(lost)} parameters ({what}) get none; " if lost else "")
        + "an op in the loss or the model has no traced backward on the meta device: "
        "report it with the model file (docs/model-file.md, 'Tracing')"
    )


@contextlib.contextmanager
def kv_cache_off(module: torch.nn.Module):
    """A HuggingFace model's KV cache off (``config.use_cache``), then as it was: the
    module's own config and those of the modules it holds (a user's wrapper that calls an
    HF model with ``labels=``).

    A step over a whole batch reads no KV cache. A model built with its default config
    (``use_cache=True``) would return a ``DynamicCache``, which ``torch.export`` cannot
    flatten, and in training trace the cache's concatenation onto an empty meta tensor:
    the cache is off while tracing, as HF's own training mode turns it off.
    """
    # the model itself or one it wraps (a module whose forward calls HF's with labels=)
    configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
    changed = []
    try:
        for config in configs.values():
            if getattr(config, "use_cache", False) is True:
                config.use_cache = False
                changed.append(config)
        yield
    finally:
        for config in changed:
            config.use_cache = True


def trace_model(
    loaded: LoadedModel,
    mode: str = "infer",
    depth: DepthReduction | None = None,
    merge_views: bool = False,
) -> TracedGraph:
    """Trace ``loaded.module`` on its inputs (meta device) and annotate the graph.

    ``mode="infer"``: the forward graph in core ATen. ``mode="train"``: the joint
    forward+backward graph of one step, loss = mean of the first output; its
    output node's ``grad_of`` names the parameter each gradient output belongs to.
    Dropout is off in both; batch norm normalises with the batch's statistics in
    training and the running ones in inference, in plain ops
    (:mod:`autoshard.trace.batchnorm`). ``merge_views``: a matmul that reads a transposed
    tensor also read as it is reads it as it is (:func:`read_untransposed`), and
    identical views of one tensor in one block and phase become one node
    (:func:`merge_duplicate_views`; a plan that shares reshardings,
    ``--share-reshardings``, is traced so at solve and at launch).

    Raises:
        AutoshardError: when the model cannot be traced (torch's first line and what
            to try), or ``mode`` is unknown.
    """
    if mode not in ("infer", "train"):
        raise AutoshardError(f"mode must be 'train' or 'infer', got {mode!r}")
    t0 = time.perf_counter()
    export = _export_joint if mode == "train" else _export_inference
    with (
        kv_cache_off(loaded.module),
        batch_norm_traced(loaded.module, mode == "train"),
        experts_traced(loaded.module),
    ):
        gm, placeholder_kind, input_labels, grad_of, close = export(loaded)
    cut_view_round_trips(gm)
    if merge_views:
        read_untransposed(gm, _layer_function(loaded, mode))
        merge_duplicate_views(gm, _layer_function(loaded, mode))
    try:
        graph = _annotate(loaded, gm, placeholder_kind, input_labels, grad_of, mode, t0)
    finally:
        close()
    if depth is not None:
        _expand_depth(graph, depth)
    return graph


def merge_duplicate_views(
    gm: torch.fx.GraphModule, layer_of: Callable[[torch.fx.Node], Any] = lambda _n: None
) -> int:
    """Keep one of several identical views of one tensor (same op, same arguments, same
    block by ``layer_of``, same phase):
    each ``nn.Linear`` flattens its input itself, so the query, key and value projections
    of one norm's output read three ``view`` nodes of it, which would each pay its own
    resharding (a sequence-parallel all-gather) where one tensor moved once serves all
    three (:mod:`autoshard.strategies.sharing`), as a compiled graph's common
    subexpression elimination makes it. A view allocates and computes nothing, so the
    step is the same. Returns how many nodes were merged."""
    seen: dict[tuple, torch.fx.Node] = {}
    merged = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not is_view(node.target):
            continue
        key = (
            node.target,
            _hashable(node.args),
            _hashable(node.kwargs),
            layer_of(node),
            node.meta.get("partitioner_tag"),
        )
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            gm.graph.erase_node(node)
            merged += 1
    if merged:
        gm.recompile()
    return merged


def read_untransposed(
    gm: torch.fx.GraphModule, layer_of: Callable[[torch.fx.Node], Any] = lambda _n: None
) -> int:
    """``mm(t(a), b)`` becomes ``t(mm(t(b), a))`` (the same product: ``a^T b = (b^T a)^T``)
    where another op of the same block and phase (``layer_of``, the node's
    ``partitioner_tag``) reads ``a`` as it is and none reads ``b`` so, and the product is
    only read transposed (a linear layer's weight gradient).

    A linear layer's backward reads its output gradient ``g`` twice: transposed for the
    weight gradient (``mm(t(g), x)``) and as it is for the input gradient (``mm(g, W)``).
    Under sequence parallelism both want ``g`` gathered over the tokens, and two reads of
    two tensors (``t(g)`` and ``g``) pay two all-gathers where Megatron-LM gathers ``g`` once
    (Korthikanti et al., 2022). Read as it is by both matmuls, ``g`` is one tensor moved once
    for both (:mod:`autoshard.strategies.sharing`). A transpose computes nothing, and the
    two matmuls do the same multiplications. The transposes of the product now make a
    contiguous tensor of it; every node after them gets its traced value (shape and
    strides) again from its inputs', so the launch builds each tensor with the layout it
    has. Returns how many matmuls were rewritten."""
    t, mm = torch.ops.aten.t.default, torch.ops.aten.mm.default

    def where(n: torch.fx.Node) -> tuple:
        return layer_of(n), n.meta.get("partitioner_tag")

    def read_as_is(x: torch.fx.Node, node: torch.fx.Node, left: torch.fx.Node) -> bool:
        return any(
            u not in (left, node) and u.target is not t and where(u) == where(node) for u in x.users
        )

    done = 0
    changed: set[torch.fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not mm or len(node.args) != 2:
            continue
        left, right = node.args
        if not (isinstance(left, torch.fx.Node) and left.target is t):
            continue
        (a,) = left.args
        if not isinstance(a, torch.fx.Node) or not isinstance(right, torch.fx.Node):
            continue
        if not read_as_is(a, node, left) or read_as_is(right, node, left):
            continue  # nothing to share, or the rewrite would split b's reads instead
        users = list(node.users)
        if not users or any(u.target is not t for u in users):
            continue  # only read transposed: its readers get the layout it had
        with gm.graph.inserting_before(node):
            right_t = gm.graph.call_function(t, (right,))
            product = gm.graph.call_function(mm, (right_t, a))
            back = gm.graph.call_function(t, (product,))
        for new in (right_t, product, back):
            new.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        right_t.meta["val"] = right.meta["val"].t()
        product.meta["val"] = mm(right_t.meta["val"], a.meta["val"])
        back.meta["val"] = product.meta["val"].t()
        node.replace_all_uses_with(back)
        gm.graph.erase_node(node)
        if not left.users:
            gm.graph.erase_node(left)
        changed.update(users)
        done += 1
    if done:
        _revalue(gm, changed)
        gm.recompile()
    return done


def _revalue(gm: torch.fx.GraphModule, changed: set[torch.fx.Node]) -> None:
    """Trace again the value (a fake tensor: shape, dtype, strides) of every node in
    ``changed`` and of every op that reads one whose value changed, in graph order, from
    its inputs' values."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node not in changed and not any(n in changed for n in node.all_input_nodes):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
        val = node.target(*args, **kwargs)
        old = node.meta.get("val")
        node.meta["val"] = val
        if isinstance(old, torch.Tensor) and isinstance(val, torch.Tensor):
            if (old.shape, old.stride()) == (val.shape, val.stride()):
                changed.discard(node)
                continue
        changed.add(node)


_RESHAPES = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def cut_view_round_trips(gm: torch.fx.GraphModule) -> int:
    """Read ``x`` itself where a graph views ``x`` to another shape and then back to
    ``x``'s own shape, dtype and strides (the same values: a view computes nothing).

    A HuggingFace causal LM returns its logits unflattened from the head's matmul,
    ``(B S, V) -> (B, S, V)``, and a training loss flattens them again for the
    cross-entropy. DTensor's view rule cannot carry the tokens split over two mesh dims
    through that pair (the batch over one dim and the sequence over the other, which the
    flat form holds as ``S(0)`` on both), so every plan placed the loss's ``(tokens,
    vocab)`` tensors split over one mesh dim only: 62.6 GiB each per device for
    Llama-3-8B at 8 x 131,072 tokens on 8 x 8, where no plan fit. Applied at every trace
    (solve, launch, stages), so a plan and its launch see one graph. Returns how many
    views were cut."""
    cut = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        middle = node.args[0]
        if not isinstance(middle, torch.fx.Node) or middle.target not in _RESHAPES:
            continue
        source = middle.args[0]
        a = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        b = node.meta.get("val")
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            continue
        if (a.shape, a.dtype, a.stride()) != (b.shape, b.dtype, b.stride()):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
        cut += 1
    if cut:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return cut


def _hashable(x: Any) -> Any:
    """``x`` (node arguments) as a hashable key: nodes by identity."""
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, *map(_hashable, x))
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    if isinstance(x, torch.fx.Node):
        return ("node", id(x))
    return (type(x).__name__, repr(x))


def _expand_depth(graph: TracedGraph, depth: DepthReduction) -> None:
    """Multiplicities and real names for a graph traced with :func:`reduce_depth`."""
    graph.depth = depth
    real_first = {i: sf[0] for i, sf in enumerate(depth.stands_for)}
    for name, m in _forward_glue(graph, depth).items():
        graph.multiplicity[name] = m
    for name, info in graph.nodes.items():
        if info.layer is not None:
            m = len(depth.stands_for[info.layer])
            if m != 1:
                graph.multiplicity[name] = m
            info.layer = real_first[info.layer]
    graph.param_names = {
        owner: [real for n in names for real in depth.real_names(n)]
        for owner, names in graph.param_names.items()
    }
    head = depth.prefix + "." if depth.prefix else ""
    graph.block_prefixes = {f"{head}{j}": j for j in range(depth.num_blocks)}
    graph.num_layers = depth.num_blocks


def _forward_glue(graph: TracedGraph, depth: DepthReduction) -> dict[str, int]:
    """Forward glue (:func:`between_blocks`) after a traced block that stands for more than
    one -> how many real boundaries it stands for: one per block that block stands for.
    Their outputs are the next blocks' inputs, each kept for its block's backward, so a
    middle block standing for five has five of them live at the turn to the backward;
    counted once, the reduced trace held four residual streams too few (an eight-block
    pre-norm stack: 212.25 MiB of activations at its peak, where the trace of every block
    holds 228.25). Backward glue takes a block's layer (:func:`_attribute_backward_glue`)."""
    return {
        n: len(depth.stands_for[b])
        for n, b in between_blocks(graph).items()
        if len(depth.stands_for[b]) > 1
    }


def between_blocks(graph: TracedGraph) -> dict[str, int]:
    """Forward ops outside every block that run between block ``b``'s forward and the next
    block's (a residual ``x = x + block(x)`` written in the model's own ``forward``, around
    the blocks rather than inside them) -> ``b``, the layer the graph gives the block
    before them (traced or real indices, as the graph holds them). Ops before the first
    block or after the last are not between blocks."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    layers: list[int] = []  # in the order their forwards start
    for n, info in graph.nodes.items():
        if info.kind == "op" and info.layer is not None and not info.backward:
            if info.layer not in first:
                layers.append(info.layer)
            first.setdefault(info.layer, order[n])
            last[info.layer] = order[n]
    following = dict(itertools.pairwise(layers))
    out, block = {}, None  # the block whose forward ran last, in graph order
    for n, info in graph.nodes.items():
        if info.kind != "op" or info.backward:
            continue
        if info.layer is not None:
            block = info.layer
        elif block in following and last[block] < order[n] < first[following[block]]:
            out[n] = block
    return out


def _attribute_backward_glue(gm: torch.fx.GraphModule, nodes: dict[str, NodeInfo]) -> None:
    """Give backward ops that autograd adds outside any module (gradient accumulation
    ``add``s, ``getitem``s of backward ops) the layer of the tensors they combine, so
    that a layer's cost includes them (which matters when one traced block stands for
    many, :func:`reduce_depth`). Graph order makes one pass enough."""
    for node in gm.graph.nodes:
        info = nodes.get(node.name)
        if info is None or info.kind != "op" or info.layer is not None or not info.backward:
            continue
        if node.target is operator.getitem:
            src = nodes.get(node.args[0].name)
            layers = {src.layer} if src is not None and src.layer is not None else set()
        else:
            layers = {nodes[a].layer for a in info.arg_nodes if nodes[a].layer is not None}
        if layers:
            # between two blocks (a residual gradient summed across a block boundary):
            # the earlier block, the one the backward pass is entering. The sums form a
            # chain from the last block down, so the later block would hand its index to
            # every sum below it; with the earlier one each of the L - 1 boundaries counts
            # once, in the block where the pipeline stage holding it runs it
            info.layer = min(layers)


def _blocks(loaded: LoadedModel) -> tuple[dict[str, int], re.Pattern | None]:
    """The model's repeated blocks (prefix -> index) and a pattern matching a path inside
    one of them (the longest prefix first)."""
    blocks = find_block_prefixes(loaded.module)
    pattern = (
        re.compile(
            "^("
            + "|".join(re.escape(p) for p in sorted(blocks, key=len, reverse=True))
            + r")(\.|$)"
        )
        if blocks
        else None
    )
    return blocks, pattern


def _layer_function(loaded: LoadedModel, mode: str) -> Callable[[torch.fx.Node], int | None]:
    """An op node's block index as :func:`_annotate` finds it (``None`` outside blocks)."""
    blocks, pattern = _blocks(loaded)
    strip = "model" if mode == "train" else ""
    return lambda node: _layer_of(_module_path(node, strip=strip), blocks, pattern)


def _annotate(loaded, gm, placeholder_kind, input_labels, grad_of, mode, t0) -> TracedGraph:
    blocks, pattern = _blocks(loaded)

    nodes: dict[str, NodeInfo] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            kind, fqn = placeholder_kind.get(node.name, ("input", node.name))
            res = [_tensor_info(node.meta.get("val"))]
            layer = _layer_of(fqn, blocks, pattern) if kind != "input" else None
            nodes[node.name] = NodeInfo(
                node.name,
                kind,
                None,
                results=res,
                fqn=fqn,
                layer=layer,
                module_path=fqn.rsplit(".", 1)[0] if kind != "input" and "." in fqn else None,
            )
        elif node.op == "call_function":
            arg_nodes = tensor_arg_nodes(node)
            args = [_tensor_info(a.meta["val"]) for a in arg_nodes]
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)):
                results = [_tensor_info(v) for v in val]
            else:
                results = [_tensor_info(val)]
            path = _module_path(node, strip="model" if mode == "train" else "")
            phase = node.meta.get("partitioner_tag")
            info = NodeInfo(
                node.name,
                "op",
                node.target,
                args=args,
                arg_nodes=[a.name for a in arg_nodes],
                results=results,
                module_path=path,
                layer=_layer_of(path, blocks, pattern),
                backward=phase == "is_backward",
            )
            counted = counted_flops(node, args, results)
            info.counted_flops = counted or 0.0
            info.flops = counted if counted is not None else op_flops(node, args, results)
            nodes[node.name] = info
        elif node.op == "output":
            leaves, _ = torch.utils._pytree.tree_flatten(list(node.args))
            outs = [x for x in leaves if _is_node(x)]
            nodes[node.name] = NodeInfo(
                node.name,
                "output",
                None,
                args=[_tensor_info(x.meta.get("val")) for x in outs],
                arg_nodes=[x.name for x in outs],
                grad_of=_grad_of_outputs(node, grad_of),
            )

    _attribute_backward_glue(gm, nodes)

    param_names: dict[str, list[str]] = {}
    by_id: dict[int, list[str]] = defaultdict(list)
    for fqn, p in loaded.module.named_parameters(remove_duplicate=False):
        by_id[id(p)].append(fqn)
    for names in by_id.values():
        param_names[names[0]] = names
    # the graph names a tied parameter by one of its FQNs: index every alias
    graph_params = {n.fqn for n in nodes.values() if n.kind == "param"}
    for names in list(param_names.values()):
        owner = next((n for n in names if n in graph_params), names[0])
        for n in names:
            param_names.pop(n, None)
        param_names[owner] = names

    layers = {n.layer for n in nodes.values() if n.layer is not None}
    return TracedGraph(
        model_name=loaded.name,
        graph_module=gm,
        nodes=nodes,
        input_names=input_labels,
        param_names=param_names,
        block_prefixes=blocks,
        num_layers=len(layers),
        trace_seconds=time.perf_counter() - t0,
        mode=mode,
    )
