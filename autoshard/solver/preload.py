"""Preload a stored solution onto a freshly traced graph (``autoshard solve --preload``).

A solution file (``autoshard.solution/1``, or a bare MASE node dict) holds, per graph
node, the placements of its tensor arguments (``data_in_<k>``) and results
(``data_out_<k>``). :func:`choice_from_solution` turns them back into one strategy
index per representative node of a :class:`~autoshard.strategies.graph.StrategyGraph`, the
same ``choice`` the ILP returns, so it is priced with the current mesh and device exactly
as a solved plan is (:func:`autoshard.solver.solve.finish_plan`: every memory kind and the
budget).

Matching stored nodes to graph nodes
------------------------------------
Node names of an exported graph are global counters (``addmm_7``), so they shift when
the number of repeated blocks changes: ``mm`` after two GPT-2 blocks is not ``mm``
after four. An ``autoshard.solution/1`` file is therefore matched by *position*: its
nodes are in graph order and carry their op and their block index (``layer``), so the
k-th node of block ``L`` in the file is the k-th node of block ``L`` in the graph, and
the k-th node outside every block is the k-th node outside every block. The op, the
parameter FQN relative to its block and every shape must then agree. A bare MASE dict
has no op, order or block index: its nodes are matched by name, so it must come from
a graph with the same node names.

Filling repeated blocks
-----------------------
Two blocks are *identical* when their node sequences agree in kind, op, module path
relative to the block's prefix (``attn.c_attn``, found from the module tree by
:func:`autoshard.model.blocks.find_block_prefixes`) and shapes. A representative node the
solution lacks takes the strategy of the same node (same position) of the nearest
identical block the solution covers, looking first at lower block indices, so a
solution made for 2 blocks extends to 12 (blocks 2-11 copy block 1). No model-specific
name is used. Stored blocks the model does not have (a 12-block solution on a 2-block
model) are dropped with a note.

Everything else that does not fit is one :class:`~autoshard.errors.AutoshardError`
listing what does not match (at most :data:`MAX_LISTED` entries, then how many more).
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.distributed.tensor import Placement

from autoshard.cost.mesh import MeshSpec
from autoshard.cost.objective import evaluate
from autoshard.errors import AutoshardError
from autoshard.placements import short
from autoshard.plan.formats import load_solution
from autoshard.solver.ilp import ILPResult, solve
from autoshard.solver.options import SolverOptions
from autoshard.solver.restriction import Restriction, restrict, unrestrict_choice
from autoshard.solver.solve import (
    SolveConfig,
    SolveResult,
    finish_plan,
    peak_rss_bytes,
    stored_early_stop,
    strategies,
    trace,
)
from autoshard.strategies.graph import Strategy, StrategyGraph
from autoshard.strategies.rules import op_rule
from autoshard.strategies.strategy import whole_strategy
from autoshard.trace.tracer import NodeInfo, TracedGraph, path_within_block

Placements = tuple[Placement, ...]

MAX_LISTED = 10
"""At most this many mismatches are listed in one error; the rest are counted."""

_OUTSIDE = None  # the "layer" of nodes outside every repeated block


@dataclass
class PreloadResult:
    """A stored solution mapped onto a strategy graph.

    Attributes:
        choice: representative node -> strategy index, complete: usable by
            :func:`autoshard.plan.plan.build_plan` and :func:`autoshard.cost.objective.evaluate`.
        filled: non-free graph nodes (representatives and the nodes merged into them)
            that the solution lacks and that took their strategy from the same node of
            an identical repeated block.
        matched: non-free graph nodes whose placements the solution gives.
        dropped: stored nodes of blocks the model does not have (a solution made for
            more blocks than the model has).
        sources: filled block index -> the block index it was copied from (matched by
            structure: the stored block each graph block was paired with, where the
            indices differ).
        notes: warnings and facts for the report, one line each.
        solved: non-free graph nodes no stored node stands for (matching by structure
            only), chosen by the ILP with every other node fixed as stored.
    """

    choice: dict[str, int]
    filled: int = 0
    matched: int = 0
    dropped: int = 0
    sources: dict[int, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    solved: int = 0


# ------------------------------------------------------------------------------------
# Graph structure: positions and block signatures


@dataclass
class _Layout:
    """Where each graph node sits: (layer or None, index within that layer's nodes)."""

    slot: dict[str, tuple[int | None, int]]
    at: dict[tuple[int | None, int], str]
    identical: dict[int, list[int]]  # layer -> the layers with the same signature (incl. itself)
    prefix: dict[int, str]  # layer -> module FQN of the block
    sizes: dict[int | None, int]  # layer -> how many graph nodes it has


def _relative(path: str | None, prefix: str | None) -> str | None:
    """``path`` relative to the block prefix: ``transformer.h.3.attn`` -> ``attn``."""
    if path is None or prefix is None:
        return path
    if path == prefix:
        return ""
    if path.startswith(prefix + "."):
        return path[len(prefix) + 1 :]
    return path


def _signature(info: NodeInfo, prefix: str | None) -> tuple:
    """What must agree between the same node of two identical blocks."""
    shapes = tuple(t.shape if t is not None else None for t in info.args) + tuple(
        r.shape if r is not None else None for r in info.results
    )
    rel = _relative(info.fqn if info.kind in ("param", "buffer") else info.module_path, prefix)
    return (info.kind, info.op_name, rel, shapes)


def _layout(graph: TracedGraph) -> _Layout:
    prefix = {layer: p for p, layer in graph.block_prefixes.items()}
    slot: dict[str, tuple[int | None, int]] = {}
    at: dict[tuple[int | None, int], str] = {}
    count: dict[int | None, int] = defaultdict(int)
    sigs: dict[int, list[tuple]] = defaultdict(list)
    for name, info in graph.nodes.items():
        key = (info.layer, count[info.layer])
        count[info.layer] += 1
        slot[name] = key
        at[key] = name
        if info.layer is not None:
            sigs[info.layer].append(_signature(info, prefix.get(info.layer)))
    by_sig: dict[tuple, list[int]] = defaultdict(list)
    for layer in sorted(sigs):
        by_sig[tuple(sigs[layer])].append(layer)
    identical = {layer: group for group in by_sig.values() for layer in group}
    return _Layout(slot, at, identical, prefix, dict(count))


# ------------------------------------------------------------------------------------
# Error collection


class _Problems:
    """Mismatches by category, raised together as one capped error."""

    def __init__(self) -> None:
        self.items: dict[str, list[str]] = defaultdict(list)

    def add(self, category: str, text: str) -> None:
        self.items[category].append(text)

    def __bool__(self) -> bool:
        return any(self.items.values())

    def raise_if_any(self, source: str) -> None:
        """Raise one AutoshardError listing at most MAX_LISTED mismatches, then a count."""
        if not self:
            return
        total = sum(len(v) for v in self.items.values())
        lines: list[str] = []
        shown = 0
        for category, texts in self.items.items():
            take = texts[: max(0, MAX_LISTED - shown)]
            if take:
                lines.append(f"{category} ({len(texts)}):")
                lines.extend(f"  {t}" for t in take)
                shown += len(take)
        if total > shown:
            lines.append(f"  ... and {total - shown} more")
        plural = "es" if total != 1 else ""
        raise AutoshardError(
            f"{source} does not fit this model and mesh ({total} mismatch{plural}):\n"
            + "\n".join(lines)
        )


def _fmt(ps: Any) -> str:
    if isinstance(ps, tuple) and all(isinstance(p, Placement) for p in ps):
        return short(ps)
    return repr(ps)


def _fmt_strategy(s: Strategy) -> str:
    ins = ", ".join(_fmt(p) for p in s.inputs)
    outs = ", ".join(_fmt(p) for p in s.outputs if p is not None)
    return f"args ({ins}) -> results ({outs})"


# ------------------------------------------------------------------------------------
# Mesh


def _check_mesh(solution: Mapping[str, Any], mesh: MeshSpec, notes: list[str]) -> None:
    stored = solution.get("mesh")
    if stored is None:
        ndims = {
            len(ps)
            for entry in solution["nodes"].values()
            for part in ("args", "results")
            for ps in entry.get(part, {}).values()
        }
        if ndims and ndims != {mesh.ndim}:
            found = ", ".join(str(n) for n in sorted(ndims))
            raise AutoshardError(
                f"the solution has no mesh and its placements are for {found}-D meshes, "
                f"but this solve's mesh {mesh.shape_str} has {mesh.ndim} dims: "
                f"pass --mesh with {found} dims"
            )
        notes.append(
            f"the solution has no mesh (a bare MASE dict): assumed it was made for this "
            f"{mesh.shape_str} mesh"
        )
        return
    shape = tuple(stored.get("shape", ()))
    if shape != tuple(mesh.shape):
        have = "x".join(map(str, shape))
        raise AutoshardError(
            f"the solution was made for a {have} mesh, but this solve's mesh is "
            f"{mesh.shape_str}: pass --mesh {have}, or solve again without --preload"
        )
    try:
        stored_mesh = MeshSpec.from_dict(stored)
    except AutoshardError:
        return
    if (stored_mesh.bandwidth, stored_mesh.latency) != (mesh.bandwidth, mesh.latency):
        notes.append(
            f"the solution was solved for {stored_mesh.describe()}; it is priced here on "
            f"{mesh.describe()}, where solving again may find a faster plan"
        )


# ------------------------------------------------------------------------------------
# Stored node -> graph node


def _stored_shapes(info: NodeInfo) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for k, t in enumerate(info.args):
        if t is not None:
            out[f"data_in_{k}"] = list(t.shape)
    for k, r in enumerate(info.results):
        if r is not None:
            out[f"data_out_{k}"] = list(r.shape)
    return out


def _match_nodes(
    graph: TracedGraph,
    layout: _Layout,
    nodes: Mapping[str, Mapping[str, Any]],
    problems: _Problems,
) -> tuple[dict[str, tuple[str, Mapping[str, Any]]], int, set[int]]:
    """Graph node -> (stored name, stored entry); stored nodes dropped; stored layers."""
    positional = all("op" in e for e in nodes.values())
    graph_layers = {layer for layer, _ in layout.slot.values() if layer is not None}
    matched: dict[str, tuple[str, Mapping[str, Any]]] = {}
    dropped = 0
    stored_layers: set[int] = set()
    count: dict[int | None, int] = defaultdict(int)
    if positional:
        sizes: dict[int | None, int] = defaultdict(int)
        for entry in nodes.values():
            layer = entry.get("layer", _OUTSIDE)
            sizes[layer if layer is None or type(layer) is int else -1] += 1
        for layer, n in sizes.items():
            have = layout.sizes.get(layer, 0)
            if (layer is None or layer in graph_layers) and n != have:
                where = f"block {layer}" if layer is not None else "outside the repeated blocks"
                problems.add(
                    "parts of different size",
                    f"{where}: {n} nodes in the solution, {have} in the graph",
                )
    for sname, entry in nodes.items():
        if positional:
            layer = entry.get("layer", _OUTSIDE)
            if layer is not None and (type(layer) is not int or layer < 0):
                problems.add(
                    "nodes unknown to the graph",
                    f"{sname!r} has layer {layer!r}; expected a block index (an int >= 0)",
                )
                continue
            key = (layer, count[layer])
            count[layer] += 1
            if layer not in graph_layers and layer is not None:
                if graph_layers:
                    dropped += 1  # a block the model does not have: a different layer count
                else:
                    problems.add(
                        "nodes unknown to the graph",
                        f"{sname!r} ({entry['op']}) belongs to block {layer}, but the model "
                        "has no repeated blocks",
                    )
                continue
            gname = layout.at.get(key)
            if gname is None:
                where = f"block {layer}" if layer is not None else "outside the blocks"
                problems.add(
                    "nodes unknown to the graph",
                    f"{sname!r} ({entry['op']}) is node {key[1]} {where}, which has only "
                    f"{layout.sizes.get(layer, 0)} nodes in the graph",
                )
                continue
            info = graph.nodes[gname]
            if entry["op"] != info.op_name:
                problems.add(
                    "ops that differ",
                    f"{sname!r} is {entry['op']} in the solution, but the graph's node at "
                    f"that place, {gname!r}, is {info.op_name}",
                )
                continue
            target = entry.get("target")
            if target is not None and info.kind in ("param", "buffer", "input"):
                prefix = layout.prefix.get(layer) if layer is not None else None
                if _relative(target, prefix) != _relative(info.fqn, prefix):
                    problems.add(
                        "ops that differ",
                        f"{sname!r} is {info.kind} {target!r} in the solution, but the graph "
                        f"has {info.fqn!r} at that place",
                    )
                    continue
        else:
            if sname not in graph.nodes:
                problems.add(
                    "nodes unknown to the graph",
                    f"{sname!r} (a bare MASE dict is matched by node name)",
                )
                continue
            gname, info = sname, graph.nodes[sname]
        if info.layer is not None:
            stored_layers.add(info.layer)
        if "shapes" in entry:
            want = _stored_shapes(info)
            have = {k: list(v) for k, v in entry["shapes"].items()}
            if have != want:
                diff = [
                    f"{k} {have.get(k)} in the solution, {want.get(k)} in the graph"
                    for k in sorted(set(have) | set(want))
                    if have.get(k) != want.get(k)
                ]
                named = f"{sname!r}" if sname == gname else f"{sname!r} (graph {gname!r})"
                problems.add("shapes that differ", f"{named}: " + "; ".join(diff))
                continue
        matched[gname] = (sname, entry)
    return matched, dropped, stored_layers


def _stored_strategy(
    node: str, sg: StrategyGraph, matched: Mapping[str, tuple[str, Mapping[str, Any]]]
) -> tuple[str, Strategy | str] | None:
    """The strategy the solution gives ``node`` (a node of ``sg.nodes``), if it gives one.

    Returns (stored name, Strategy), (stored name, reason) when the entry is malformed for
    this node, or None when the solution has no placements for it.
    """
    template = sg.nodes[node].strategies[0]
    if node not in sg.graph.nodes:  # an output sink "output.<k>"
        out_name, _, k = node.rpartition(".")
        hit = matched.get(out_name)
        if hit is None:
            return None
        sname, entry = hit
        ps = entry.get("args", {}).get(f"data_in_{k}")
        if ps is None:
            return None
        return f"{sname}.{k}", whole_strategy(Strategy((), (tuple(ps),)), sg.mesh_shape)
    hit = matched.get(node)
    if hit is None:
        return None
    sname, entry = hit
    args, results = entry.get("args", {}), entry.get("results", {})
    if not args and not results:
        return None  # stored as free
    n_in, n_out = len(template.inputs), len(template.outputs)
    want_in = {f"data_in_{k}" for k in range(n_in)}
    want_out = {f"data_out_{k}" for k, p in enumerate(template.outputs) if p is not None}
    if set(args) != want_in or set(results) != want_out:
        return sname, (
            f"has args {sorted(args)} and results {sorted(results)}, but the node has "
            f"args {sorted(want_in)} and results {sorted(want_out)}"
        )
    outputs = tuple(
        tuple(results[f"data_out_{k}"]) if f"data_out_{k}" in results else None
        for k in range(n_out)
    )
    inputs = tuple(tuple(args[f"data_in_{k}"]) for k in range(n_in))
    # as the graph holds it: Replicate on a mesh dim of one device (a solution written
    # before the strategies were so may name a shard there)
    stored = Strategy(outputs, inputs, _stored_collectives(node, sg, entry))
    return sname, whole_strategy(stored, sg.mesh_shape)


def _stored_collectives(node: str, sg: StrategyGraph, entry: Mapping[str, Any]) -> tuple:
    """What the op of ``node`` communicates itself under the rule choices the entry names
    (``"modes"``, written for such ops: choices that place alike, as attention's
    all-gather and ring context parallelism, differ there), or ``()``."""
    modes = entry.get("modes")
    info = sg.graph.nodes[node]
    rule = op_rule(info.target) if modes else None
    if rule is None or rule.collectives is None:
        return ()
    fx = next(n for n in sg.graph.graph_module.graph.nodes if n.name == node)
    return tuple(rule.collectives(fx, info.args, tuple(modes), tuple(sg.mesh_shape)))


def _same(candidate: Strategy, stored: Strategy) -> bool:
    """Whether a strategy of the graph is the stored one: the same placements and, where
    the solution names them, the same in-op collectives (priced seconds aside)."""
    return (
        candidate.outputs == stored.outputs
        and candidate.inputs == stored.inputs
        and (not stored.collectives or candidate.collectives == stored.collectives)
    )


def _index(strategies: list[Strategy], stored: Strategy) -> int:
    """The first of ``strategies`` that is ``stored`` (:func:`_same`).

    Raises:
        StopIteration: none is.
    """
    return next(i for i, c in enumerate(strategies) if _same(c, stored))


# ------------------------------------------------------------------------------------
# The mapping


def _fitting(sg: StrategyGraph, rep: str, given: Mapping[str, Strategy]) -> list[int]:
    """Strategy indices of representative ``rep`` under which every node in ``given`` (it
    and nodes merged into it) has its given strategy."""
    return [
        i
        for i in range(len(sg.nodes[rep].strategies))
        if all(_same(sg.nodes[m].strategies[sg.nodes[m].choice[i]], s) for m, s in given.items())
    ]


def _node_strategy(sg: StrategyGraph, node: str, choice: Mapping[str, int]) -> Strategy:
    ns = sg.nodes[node]
    return ns.strategies[ns.choice[choice[ns.rep]]]


def choice_from_solution(
    sg: StrategyGraph,
    solution: Mapping[str, Any],
    mesh: MeshSpec,
    source: str = "the solution",
    options: SolverOptions | None = None,
) -> PreloadResult:
    """Map a stored solution's placements onto ``sg``: one strategy index per representative.

    Args:
        sg: the strategy graph of the freshly traced model, for ``mesh``.
        solution: what :func:`autoshard.plan.formats.load_solution` returns (an
            ``autoshard.solution/1`` dict, or ``{"format": "mase", "nodes": ...}``).
        mesh: the mesh of this solve; its shape must be the solution's.
        source: how errors name the solution (e.g. its path).

    Each representative takes the strategy whose argument and result placements equal
    its stored entry; nodes merged into it must agree with that strategy. Where the
    representative has no entry, the entries of the nodes merged into it decide. Nodes
    the solution lacks take the strategy of the same node of the nearest identical
    repeated block (see the module docstring). A solution for another number of blocks
    is matched by structure (:func:`_by_structure`); ``options`` bound the ILP that
    then chooses the nodes no stored node stands for.

    Returns:
        A :class:`PreloadResult` whose ``choice`` covers every representative.

    Raises:
        AutoshardError: the mesh shape differs (both shapes named); a bare MASE dict has
            placements for another number of mesh dims; and, listed together (at most
            :data:`MAX_LISTED`, then a count): stored nodes unknown to the graph (beyond
            blocks the model lacks), ops or shapes that differ, stored placements that are
            not a strategy of their node, merged nodes that disagree with their
            representative, and graph nodes that neither the solution nor an identical
            block gives.
    """
    if tuple(sg.mesh_shape) != tuple(mesh.shape):
        raise AutoshardError(
            f"the strategy graph is for a {'x'.join(map(str, sg.mesh_shape))} mesh but the "
            f"mesh given is {mesh.shape_str}"
        )
    if not isinstance(solution, Mapping) or not isinstance(solution.get("nodes"), Mapping):
        raise AutoshardError(f"{source} has no 'nodes': load it with autoshard.plan.formats")
    notes: list[str] = []
    _check_mesh(solution, mesh, notes)
    graph = sg.graph
    stored_model = solution.get("model")
    if stored_model is not None and stored_model != graph.model_name:
        notes.append(
            f"the solution was made for model {stored_model!r}, this is {graph.model_name!r}"
        )

    nodes = solution["nodes"]
    if _other_depth(graph, nodes):
        # another depth: the first, middle and last blocks (and, in training, the glue
        # outside them) are matched by structure, not by position
        return _by_structure(sg, nodes, notes, options)

    layout = _layout(graph)
    problems = _Problems()
    matched, dropped, stored_layers = _match_nodes(graph, layout, nodes, problems)
    problems.raise_if_any(source)

    stored = _stored_strategies(sg, matched, problems)
    problems.raise_if_any(source)

    # 1. representatives the solution gives (their own entry, else their merged nodes')
    choice = _choose_stored(sg, stored, problems)
    problems.raise_if_any(source)

    # 2. fill the rest from the same node of the nearest identical block the solution covers
    filled_reps, sources = _fill_from_twins(sg, layout, stored_layers, choice, problems)
    problems.raise_if_any(source)

    # 3. every node the solution gives must agree with its representative's choice
    _check_agreement(sg, stored, choice, problems)
    problems.raise_if_any(source)

    return _positional_result(sg, layout, stored, choice, filled_reps, sources, dropped, notes)


def _other_depth(graph: TracedGraph, nodes: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether the stored nodes are a positional solution for another set of blocks.

    True when every stored node has an op, both the graph and the solution have repeated
    blocks, every stored block index is an int >= 0, and the two sets of blocks differ.
    """
    graph_blocks = {i.layer for i in graph.nodes.values() if i.layer is not None}
    stored_blocks = {e.get("layer") for e in nodes.values() if e.get("layer") is not None}
    return bool(
        all("op" in e for e in nodes.values())
        and graph_blocks
        and stored_blocks
        and all(type(b) is int and b >= 0 for b in stored_blocks)
        and stored_blocks != graph_blocks
    )


def _stored_strategies(
    sg: StrategyGraph,
    matched: Mapping[str, tuple[str, Mapping[str, Any]]],
    problems: _Problems,
) -> dict[str, tuple[str, Strategy]]:
    """Node of ``sg.nodes`` -> (stored name, Strategy) for every node the solution gives.

    Entries malformed for their node are added to ``problems`` and left out.
    """
    stored: dict[str, tuple[str, Strategy]] = {}
    for name in sg.nodes:
        got = _stored_strategy(name, sg, matched)
        if got is None:
            continue
        sname, s = got
        if isinstance(s, str):
            problems.add("entries that do not fit their node", f"{sname!r} {s}")
        else:
            stored[name] = (sname, s)
    return stored


def _members(sg: StrategyGraph) -> dict[str, list[str]]:
    """Representative -> the nodes of ``sg.nodes`` that follow it (itself included)."""
    members: dict[str, list[str]] = defaultdict(list)
    for name, ns in sg.nodes.items():
        members[ns.rep].append(name)
    return members


def _choose_stored(
    sg: StrategyGraph, stored: Mapping[str, tuple[str, Strategy]], problems: _Problems
) -> dict[str, int]:
    """Representative -> strategy index, for the representatives the solution gives.

    A representative's own entry decides; without one, the entries of the nodes merged
    into it do. Placements that are no strategy of their node are added to ``problems``.
    """
    members = _members(sg)
    choice: dict[str, int] = {}
    for rep in sg.reps:
        ns = sg.nodes[rep]
        if rep in stored:
            sname, s = stored[rep]
            try:
                choice[rep] = _index(ns.strategies, s)
            except StopIteration:
                problems.add(
                    "placements that are not a strategy of their node",
                    f"{sname!r}: {_fmt_strategy(s)} is not one of the "
                    f"{len(ns.strategies)} strategies of {rep!r}",
                )
            continue
        given = [m for m in members[rep] if m in stored]
        if not given:
            continue
        fits = _fitting(sg, rep, {m: stored[m][1] for m in given})
        if fits:
            choice[rep] = fits[0]
        else:
            names = ", ".join(repr(stored[m][0]) for m in given[:3])
            problems.add(
                "placements that are not a strategy of their node",
                f"{names}: no strategy of {rep!r} (which they follow) gives these placements",
            )
    return choice


def _twin(
    sg: StrategyGraph,
    layout: _Layout,
    stored_layers: set[int],
    from_solution: set[str],
    rep: str,
    layer: int,
) -> tuple[int, str] | None:
    """(block, node) of ``rep``'s nearest identical block whose node the solution gives.

    Lower block indices are tried first, nearest first, then higher ones; None when no
    identical block the solution covers gives the node at ``rep``'s position.
    """
    index = layout.slot[rep][1]
    group = [g for g in layout.identical.get(layer, []) if g != layer and g in stored_layers]
    order = sorted((g for g in group if g < layer), reverse=True) + sorted(
        g for g in group if g > layer
    )
    for g in order:
        twin = layout.at[(g, index)]
        if twin in sg.nodes and sg.nodes[twin].rep in from_solution:
            return g, twin
    return None


def _fill_from_twins(
    sg: StrategyGraph,
    layout: _Layout,
    stored_layers: set[int],
    choice: dict[str, int],
    problems: _Problems,
) -> tuple[set[str], dict[int, int]]:
    """(filled representatives, filled block -> source block), adding to ``choice``.

    Every representative ``choice`` lacks takes the strategy of the same node of the
    nearest identical block (:func:`_twin`); those that cannot are added to ``problems``.
    """
    graph = sg.graph
    from_solution = set(choice)
    filled_reps: set[str] = set()
    sources: dict[int, int] = {}
    for rep in sg.reps:
        if rep in choice:
            continue
        info = graph.nodes.get(rep)
        layer = info.layer if info is not None else None
        src = None
        if layer is not None:
            src = _twin(sg, layout, stored_layers, from_solution, rep, layer)
        if src is None:
            where = f"block {layer}" if layer is not None else "outside the repeated blocks"
            why = (
                "and no identical block in the solution has it"
                if layer is not None
                else "and only nodes of repeated blocks can be filled"
            )
            problems.add(
                "nodes the solution lacks",
                f"{rep!r} ({info.op_name if info else 'output'}, {where}) {why}",
            )
            continue
        g, twin = src
        want = _node_strategy(sg, twin, choice)
        try:
            choice[rep] = sg.nodes[rep].strategies.index(want)
        except ValueError:
            problems.add(
                "nodes the solution lacks",
                f"{rep!r} (block {layer}): {_fmt_strategy(want)} of {twin!r} (block {g}) is "
                "not one of its strategies",
            )
            continue
        filled_reps.add(rep)
        sources.setdefault(layer, g)
    return filled_reps, sources


def _check_agreement(
    sg: StrategyGraph,
    stored: Mapping[str, tuple[str, Strategy]],
    choice: Mapping[str, int],
    problems: _Problems,
) -> None:
    """Returns nothing: adds to ``problems`` each stored node that ``choice`` contradicts."""
    for name, (sname, s) in stored.items():
        got = _node_strategy(sg, name, choice)
        if not _same(got, s):
            rep = sg.nodes[name].rep
            problems.add(
                "merged nodes that disagree with their representative",
                f"{sname!r}: stored {_fmt_strategy(s)}, but the choice of {rep!r}, which it "
                f"follows, gives {_fmt_strategy(got)}",
            )


def _positional_result(
    sg: StrategyGraph,
    layout: _Layout,
    stored: Mapping[str, tuple[str, Strategy]],
    choice: dict[str, int],
    filled_reps: set[str],
    sources: dict[int, int],
    dropped: int,
    notes: list[str],
) -> PreloadResult:
    """The :class:`PreloadResult` of a positional match, its counts and notes added."""
    matched_n = sum(1 for n in sg.nodes if n in stored)
    filled = sum(1 for n, ns in sg.nodes.items() if n not in stored and ns.rep in filled_reps)
    if dropped:
        have = "block" if len(layout.identical) == 1 else "blocks"
        notes.append(
            f"{dropped} stored nodes of blocks the model does not have were dropped "
            f"(the model has {len(layout.identical)} {have})"
        )
    if filled:
        by_src: dict[int, list[int]] = defaultdict(list)
        for layer, g in sorted(sources.items()):
            by_src[g].append(layer)
        how = "; ".join(f"{_ranges(layers)} from block {g}" for g, layers in sorted(by_src.items()))
        notes.append(f"{filled} nodes filled from identical repeated blocks ({how})")
    return PreloadResult(
        choice=choice,
        filled=filled,
        matched=matched_n,
        dropped=dropped,
        sources=dict(sorted(sources.items())),
        notes=notes,
    )


# ------------------------------------------------------------------------------------
# Another depth: matching by structure


def _shapes_key(shapes: Mapping[str, Any]) -> tuple:
    return tuple(sorted((k, tuple(v)) for k, v in shapes.items()))


_GraphParts = dict[int | None, list[str]]
_StoredParts = dict[int | None, list[tuple[str, Mapping[str, Any]]]]


@dataclass
class _Pairing:
    """How the graph's parts were paired with the stored parts (see :func:`_pair_parts`)."""

    matched: dict[str, tuple[str, Mapping[str, Any]]]  # graph node -> (stored name, entry)
    sources: dict[int, int]  # graph block -> the stored block it was paired with, if another
    aligned: set[int | None]  # graph parts aligned with a similar, not identical, stored part
    used: set[int | None]  # stored parts some graph part was paired with


def _by_structure(
    sg: StrategyGraph,
    nodes: Mapping[str, Mapping[str, Any]],
    notes: list[str],
    options: SolverOptions | None,
) -> PreloadResult:
    """Map a solution made for another number of blocks (or another depth reduction).

    Node positions shift with depth: a 2-block graph has a first and a last block, a
    12-block one also middle blocks; in training, the backward's glue between blocks
    (gradient sums) and outside them changes too. So each part of the graph (every block,
    and the nodes outside the blocks) is paired with the stored part whose node sequence
    is the same (op, parameter FQN within its block, every shape): the same index
    first, then the nearest. A part with no identical stored part is aligned with the
    most similar one (``difflib.SequenceMatcher`` over those sequences, as ``diff``
    aligns lines): a middle block with a stored last block, say. Nodes paired take the
    stored strategy; every node left over (no counterpart, or stored placements that are
    not a strategy here) is chosen by the ILP with all the others fixed, and counted.

    Raises:
        AutoshardError: the restricted ILP finds no plan (a time limit with no incumbent).
    """
    graph = sg.graph
    g_seq, s_seq = _parts(graph, nodes)
    pairing = _pair_parts(graph, g_seq, s_seq)
    stored, choice, solved = _pin_and_solve(sg, pairing.matched, options)

    dropped = sum(len(entries) for sl, entries in s_seq.items() if sl not in pairing.used)
    _structure_notes(graph, g_seq, s_seq, pairing, solved, dropped, notes)
    filled = sum(1 for n in stored if n in graph.nodes and graph.nodes[n].layer in pairing.sources)
    return PreloadResult(
        choice=choice,
        filled=filled,
        matched=len(stored) - filled,
        dropped=dropped,
        sources=dict(sorted(pairing.sources.items())),
        notes=notes,
        solved=solved,
    )


def _parts(
    graph: TracedGraph, nodes: Mapping[str, Mapping[str, Any]]
) -> tuple[_GraphParts, _StoredParts]:
    """(layer -> graph node names, layer -> (stored name, entry)), each in order."""
    g_seq: _GraphParts = defaultdict(list)
    for name, info in graph.nodes.items():
        g_seq[info.layer].append(name)
    s_seq: _StoredParts = defaultdict(list)
    for sname, entry in nodes.items():
        s_seq[entry.get("layer")].append((sname, entry))
    return g_seq, s_seq


def _pair_parts(graph: TracedGraph, g_seq: _GraphParts, s_seq: _StoredParts) -> _Pairing:
    """The :class:`_Pairing` of every graph part with an identical or the most similar
    stored part (blocks with blocks, the nodes outside them with those outside)."""
    rel = path_within_block(graph.block_prefixes)

    def g_sig(name: str) -> tuple:
        info = graph.nodes[name]
        target = info.fqn if info.kind in ("param", "buffer", "input") else None
        return (info.op_name, rel(target), _shapes_key(_stored_shapes(info)))

    def s_sig(entry: Mapping[str, Any]) -> tuple:
        return (entry["op"], rel(entry.get("target")), _shapes_key(entry.get("shapes", {})))

    g_sigs = {gl: tuple(g_sig(n) for n in names) for gl, names in g_seq.items()}
    s_sigs = {sl: tuple(s_sig(e) for _, e in entries) for sl, entries in s_seq.items()}
    matchers: dict[tuple, difflib.SequenceMatcher] = {}  # (graph sequence, stored layer)

    def matcher(gl: int | None, sl: int | None) -> difflib.SequenceMatcher:
        key = (g_sigs[gl], sl)
        if key not in matchers:
            matchers[key] = difflib.SequenceMatcher(None, g_sigs[gl], s_sigs[sl], autojunk=False)
        return matchers[key]

    pairing = _Pairing({}, {}, set(), set())
    for gl in sorted(g_seq, key=lambda x: -1 if x is None else x):
        cands = [sl for sl in s_seq if (sl is None) == (gl is None)]
        if not cands:
            continue

        def near(sl: int | None, gl: int | None = gl) -> tuple:
            return (sl != gl, abs(sl - gl) if sl is not None and gl is not None else 0, sl or 0)

        exact = [sl for sl in cands if s_sigs[sl] == g_sigs[gl]]
        if exact:
            src = min(exact, key=near)
            pairs = [(i, i) for i in range(len(g_seq[gl]))]
        else:
            src = min(cands, key=lambda sl: (-matcher(gl, sl).ratio(), *near(sl)))
            blocks = matcher(gl, src).get_matching_blocks()
            pairs = [(b.a + k, b.b + k) for b in blocks for k in range(b.size)]
            pairing.aligned.add(gl)
        pairing.used.add(src)
        if gl is not None and src != gl:
            pairing.sources[gl] = src
        for i, j in pairs:
            pairing.matched[g_seq[gl][i]] = s_seq[src][j]
    return pairing


def _pin_and_solve(
    sg: StrategyGraph,
    matched: Mapping[str, tuple[str, Mapping[str, Any]]],
    options: SolverOptions | None,
) -> tuple[dict[str, Strategy], dict[str, int], int]:
    """(node -> stored Strategy, complete choice, how many nodes the ILP chose).

    Representatives are pinned where their nodes' stored strategies agree on one; the
    rest are chosen by the ILP with the pinned ones fixed.
    """
    # stored strategies per node; representatives pinned where their nodes agree
    stored: dict[str, Strategy] = {}
    for name in sg.nodes:
        got = _stored_strategy(name, sg, matched)
        if got is not None and not isinstance(got[1], str):
            stored[name] = got[1]
    members = _members(sg)
    choice: dict[str, int] = {}
    for rep in sg.reps:
        given = {m: stored[m] for m in members[rep] if m in stored}
        fits = _fitting(sg, rep, given) if given else []
        if fits:
            choice[rep] = fits[0]

    open_reps = {r for r in sg.reps if r not in choice}
    solved = sum(1 for ns in sg.nodes.values() if ns.rep in open_reps)
    if open_reps:
        r = Restriction()
        for rep, i in choice.items():
            r.allowed[rep] = np.array([i], dtype=np.int64)
        result = solve(restrict(sg, r), options or SolverOptions())
        choice = unrestrict_choice(r, result.choice)
    return stored, choice, solved


def _structure_notes(
    graph: TracedGraph,
    g_seq: _GraphParts,
    s_seq: _StoredParts,
    pairing: _Pairing,
    solved: int,
    dropped: int,
    notes: list[str],
) -> None:
    """Returns nothing: appends to ``notes`` how the parts were matched by structure."""
    layers = [gl for gl in g_seq if gl is not None]
    n_stored = len([sl for sl in s_seq if sl is not None])
    groups: dict[tuple[int, bool], list[int]] = defaultdict(list)
    for gl in layers:
        groups[(pairing.sources.get(gl, gl), gl in pairing.aligned)].append(gl)
    how = "; ".join(
        f"{_ranges(sorted(gs))} "
        + (f"aligned with stored block {sl}" if approx else f"as stored block {sl}")
        for (sl, approx), gs in sorted(groups.items())
    )
    traced = f" ({len(layers)} traced)" if len(layers) != graph.num_layers else ""
    notes.append(
        f"the solution has {n_stored} blocks and the model {graph.num_layers}{traced}: "
        f"matched by structure ({how})"
    )
    if None in pairing.aligned:
        notes.append("the nodes outside the blocks differ from the solution's: aligned")
    if solved:
        notes.append(
            f"{solved} nodes the solution has no counterpart for were chosen by the ILP "
            "with every other node fixed as stored"
        )
    if dropped:
        notes.append(
            f"{dropped} stored nodes of blocks the model does not have were dropped (no "
            "block of the model was matched with them)"
        )


def _ranges(layers: list[int]) -> str:
    """``[2, 3, 4, 7]`` -> ``"blocks 2-4, 7"``."""
    parts: list[str] = []
    start = prev = layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if x is not None:
            start = prev = x
    return ("block " if len(layers) == 1 else "blocks ") + ", ".join(parts)


# ------------------------------------------------------------------------------------
# The whole preload pipeline (what ``autoshard solve --preload`` runs)


def plan_preloaded(config, solution_path: str | Path, progress=None):
    """Trace and strategise ``config``'s model, then take the plan from a solution file.

    The counterpart of :func:`autoshard.solver.solve.plan_model` without the ILP: returns
    ``(SolveResult, PreloadResult)``; the result's ``ilp`` has status ``"preloaded"``,
    the objective of the preloaded choice (:func:`autoshard.cost.objective.evaluate`), no
    variables and zero solver seconds.

    Raises:
        AutoshardError: the file cannot be loaded safely (see
            :func:`autoshard.plan.formats.load_solution`) or does not fit (see
            :func:`choice_from_solution`).
    """
    solution = load_solution(solution_path)  # fail on a bad file before tracing
    _check_mesh(solution, config.mesh, [])  # and on another mesh shape (its notes come later)
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    graph = trace(config, progress)
    seconds["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    # untied: a stored plan may place each layer differently
    sg = strategies(dataclasses.replace(config, tie=False), graph, progress)
    seconds["strategies"] = time.perf_counter() - t
    t = time.perf_counter()
    try:
        pre = choice_from_solution(
            sg, solution, config.mesh, source=str(solution_path), options=config.solver
        )
    except AutoshardError as exc:  # the same error, with what to do when the offer differs
        hints = [h for h in (_context_parallel_hint(solution, config),) if h is not None]
        hints += _traced_as_hints(solution, config)
        if not hints:
            raise
        raise AutoshardError("\n".join([str(exc), *hints])) from None
    seconds["preload"] = time.perf_counter() - t
    # the blocks the solution recomputes, matched to this graph's traced blocks
    predicted = solution.get("predicted") or {}
    recomputed = predicted.get("recomputed_blocks") or []
    selective = predicted.get("selective_blocks") or []
    ck = sg.checkpointing
    notes = _recomputation_notes(config, solution, ck)
    if ck is not None and ck.blocks and _other_depth(sg.graph, solution["nodes"]):
        recomputed, selective, note = _recompute_by_source(ck, pre.sources, recomputed, selective)
        notes += [note] if note else []
    recompute = ck.counts_of_blocks(recomputed, selective) if ck is not None and ck.blocks else None
    pre.notes.extend(notes)
    ilp = ILPResult(
        choice=pre.choice,
        recompute=recompute or {},
        objective_s=evaluate(sg, pre.choice, recompute),
        status="preloaded",
        gap=0.0,
        num_variables=0,
        num_constraints=0,
        build_seconds=0.0,
        solve_seconds=0.0,
    )
    # priced as a solved plan: every memory kind, the budget, the MFU's peak
    plan = finish_plan(config, sg, pre.choice, "preloaded", recompute)
    seconds["total"] = sum(seconds.values())
    return SolveResult(config, graph, sg, ilp, plan, seconds, peak_rss_bytes()), pre


def _recompute_by_source(
    ck,
    sources: Mapping[int, int],
    recomputed: list[int],
    selective: list[int],  # noqa: ANN001
) -> tuple[list[int], list[int], str | None]:
    """At another depth (matched by structure) each traced block of this graph takes the
    plan of the stored block it was matched with (``sources``, else the block of its own
    index), and so its recomputation: all its real blocks recompute, under the stored
    block's policy, when the stored block's first real block does. Returns the real
    blocks that recompute in full and selectively here, and a note when blocks the
    solution does not name recompute (a 2-block plan recomputing both, preloaded onto 6
    blocks, recomputed 2 of them before)."""
    full, sel = set(recomputed), set(selective)
    out_full: set[int] = set()
    out_sel: set[int] = set()
    for b in ck.blocks:
        stored = sources.get(b.layer, b.layer)
        if stored in full:
            out_full.update(b.real)
        elif stored in sel:  # counts_of_blocks prices it in full where selective is not offered
            out_sel.update(b.real)
    added = sorted((out_full | out_sel) - full - sel)
    note = None
    if added:
        note = (
            f"{_ranges(added)} recompute as the stored blocks they were matched with (the "
            "solution names the blocks of its own depth)"
        )
    return sorted(out_full), sorted(out_sel), note


def _recomputation_notes(config: SolveConfig, solution: Mapping[str, Any], ck) -> list[str]:  # noqa: ANN001
    """What this run prices differently from the recomputation ``solution`` stores
    (``ck``: this graph's :class:`~autoshard.cost.checkpointing.Checkpointing`, or None):
    blocks it recomputes in full where the solution recomputed them selectively (the two
    rerun the same ops here), blocks it cannot recompute at all, and another early stop
    (this run's ``--checkpoint-early-stop`` setting is the one priced and written). Under
    a fixed policy (``--activation-checkpointing full/selective``) the policy decides,
    and only the early stop is compared."""
    predicted = solution.get("predicted") or {}
    recomputed = list(predicted.get("recomputed_blocks") or [])
    selective = list(predicted.get("selective_blocks") or [])
    if not recomputed and not selective:
        return []
    notes = []
    if ck is None or ck.fixed is None:
        offered = ck.offered_blocks() if ck is not None else set()
        as_full = ck.selective_as_full(selective) if ck is not None else []
        if as_full:
            notes.append(
                f"the solution recomputes {_ranges(as_full)} selectively; here their "
                "selective recomputation reruns their whole forward, so they are priced and "
                "written as recomputing in full (the same ops rerun)"
            )
        lost = sorted((set(recomputed) | set(selective)) - offered)
        if lost and ck is None:
            notes.append(
                f"the solution recomputes {_ranges(lost)}; this run offers no recomputation "
                f"of them (--activation-checkpointing {config.activation_checkpointing}), so "
                "they are priced keeping their activations: pass --activation-checkpointing "
                "auto to keep the solution's recomputation"
            )
        elif lost:
            one = len(lost) == 1
            notes.append(
                f"the solution recomputes {_ranges(lost)}, which this model has not (or which "
                f"{'frees' if one else 'free'} nothing here): priced without "
                f"{'its' if one else 'their'} recomputation"
            )
    if ck is None:
        return notes  # nothing recomputes: the early stop prices nothing
    stored = stored_early_stop(solution.get("cost_model") or {}, predicted)
    if stored != config.checkpoint_early_stop:
        how = {
            True: "stops each block's rerun at the last op its backward reads",
            False: "reruns each block's whole forward",
        }
        flag = "--checkpoint-early-stop" if stored else "--no-checkpoint-early-stop"
        notes.append(
            f"the solution's recomputation {how[stored]}; this run's, which "
            f"{how[config.checkpoint_early_stop]}, is priced and written instead: pass "
            f"{flag} to keep the solution's"
        )
    return notes


def _traced_as_hints(solution: Mapping[str, Any], config: SolveConfig) -> list[str]:
    """What to do when ``solution`` was solved with another ``--mode``, ``--precision`` or
    ``--grad-accumulation`` than this solve: each changes the traced graph (a training
    step's backward and optimizer, the casts of mixed precision, the micro-batch's shapes),
    so its nodes match none of this graph's."""
    cost = solution.get("cost_model") or {}
    out = []
    traced_as = (
        ("mode", "--mode"),
        ("precision", "--precision"),
        ("grad_accumulation", "--grad-accumulation"),  # the micro-batch's shapes
    )
    for key, option in traced_as:
        stored, here = cost.get(key), getattr(config, key)
        if key == "grad_accumulation":
            stored = stored if stored is not None else 1
        if stored is not None and stored != here:
            out.append(
                f"the solution was solved with {option} {stored} and this solve traces "
                f"{option} {here}, another graph: pass {option} {stored} to preload it"
            )
    return out


def _context_parallel_hint(solution: Mapping[str, Any], config: SolveConfig) -> str | None:
    """What to do when ``solution`` was solved with context parallelism this solve does not
    offer (its attention strategies are then no strategies of this graph); None otherwise."""
    stored = (solution.get("cost_model") or {}).get("context_parallel") or False
    if stored is False:
        return None
    kind = "all" if stored is True else str(stored)
    offered = dataclasses.replace(config, context_parallel=True if kind == "all" else kind)
    offered = offered.features()
    if offered <= config.features():
        return None
    flag = "--context-parallel" if kind == "all" else f"--context-parallel {kind}"
    api = "True" if kind == "all" else repr(kind)
    return (
        f"the solution shards attention by sequence (it was solved with {flag}): solve "
        f"with {flag} (context_parallel={api} in the Python API) to preload it"
    )
