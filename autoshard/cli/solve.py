"""``autoshard solve``: plan a model and write the solution and the sharding map."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource
from rich.console import Console

from autoshard import interrupt
from autoshard.cli.options import (
    MESH_LINK_KEYS,
    NonEmptyPath,
    Progress,
    check_out_folder,
    check_writable_file,
    config_from_options,
    mesh_options,
    plan_options,
    refuse_overwriting_preload,
    report_console,
)
from autoshard.cost.mesh import MAX_DEVICES, MeshSpec, respects_nodes
from autoshard.errors import AutoshardError
from autoshard.solver.options import MESH_SEARCH_COLUMNS


@click.command("solve")
@click.argument("model_file", type=NonEmptyPath())
@mesh_options(mesh_required=False)
@click.option(
    "--gpus",
    type=click.IntRange(min=1, max=MAX_DEVICES),
    default=None,
    metavar="N",
    help="In place of --mesh: try every mesh shape of N GPUs that respects the node boundary "
    "(1-3 dims; a dim inside a node or across nodes, never half of each), plan each, print "
    "them ranked and write the fastest. A shape whose ILP has over "
    f"{MESH_SEARCH_COLUMNS:,} columns (a 3-D mesh, often) is searched in torchtitan's space "
    "instead (as --space torchtitan), and also gets the ILP plan of a shape with one dim "
    "fewer laid onto it (8x8's on 4x2x8: the same layout on two dims); its row says which "
    "is faster, after the ILP over the lifted plan's neighbourhoods (each pair of mesh dims "
    "free, the third kept) has improved it.",
)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    metavar="K",
    help="Devices per node. With --gpus: the shapes tried respect it. With --mesh: the "
    "mesh's ranks are laid row-major over nodes of K (as --gpus lays each shape it tries), "
    "so each mesh dim gets the links it has there: --mesh 4x2x8 --gpus-per-node 8 is the "
    "4x2x8 row of --gpus 64 (dims 0 and 1 across nodes); without it, --mesh puts dim 0 "
    "across nodes and the rest inside one. Mesh dims inside a node get --intra-node-bw, "
    "dims across nodes --inter-node-bw.",
)
@click.option(
    "--pp",
    "pp_depths",
    default=None,
    metavar="DEPTHS",
    help="With --gpus: also try these pipeline depths, e.g. 2,4: for each, the layers split "
    "into that many stages over the leading dim of a mesh shape (across nodes first), each "
    "stage planned on its submesh (as autoshard stages runs it, a 1F1B schedule), ranked "
    "with the shapes. When a pipeline is fastest, its stage plan is written beside the "
    "best plan without stages.",
)
@click.option(
    "--microbatches",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="With --pp: micro-batches per step (the example batch split along dim 0).",
)
@click.option(
    "--max-columns",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help=f"The most columns an ILP is solved whole with (default {MESH_SEARCH_COLUMNS:,}; "
    "with --gpus, per shape). A larger one (a 3-D mesh of a large model, often: the "
    "Llama-70B shape on 2x4x8 has 2.9 million columns, and its whole ILP had not ended "
    "after 77 minutes on 2 cores) is planned as --gpus plans such a shape: the ILP plan of "
    "each shape with one dim fewer laid onto it and improved over its neighbourhoods, or "
    "torchtitan's space, the faster; the report says which. Raise it to solve the whole "
    "ILP anyway.",
)
@plan_options
@click.option(
    "--out",
    "out_dir",
    type=NonEmptyPath(),
    default=Path("solutions"),
    show_default=True,
    help="Folder for <model>_<mesh>.pkl and .json.",
)
@click.option(
    "--algo",
    type=click.Choice(["ilp", "replicate", "ddp", "fsdp", "megatron", "megatron_sp", "fsdp_tp"]),
    default="ilp",
    show_default=True,
    help="ilp: the optimal plan; the others export a hand-written-style plan (data parallel, "
    "ZeRO-3, Megatron tensor parallel on the last mesh dim) priced by the same cost model.",
)
@click.option(
    "--space",
    type=click.Choice(["free", "torchtitan"]),
    default="free",
    show_default=True,
    help="free: every DTensor strategy of every op (the ILP). torchtitan: only plans FSDP2 "
    "and parallelize_module express (each mesh dim DDP, FSDP or Megatron tensor parallel "
    "on the last one; every block checkpointed or none), each priced as DTensor runs it; "
    "the fastest that fits is written, and `autoshard export` turns it into torchtitan "
    "code with no difference from the plan.",
)
@click.option(
    "--preload",
    type=NonEmptyPath(),
    default=None,
    metavar="FILE",
    help="Skip the ILP: take the plan from a solution pickle (autoshard's or MASE's), "
    "filling missing layers from an identical block. Loading never runs code from FILE.",
)
@click.option("-q", "--quiet", is_flag=True, help="Print only the files written.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the report as JSON on stdout (stable keys: docs/formats.md); the "
    "readable report goes to stderr.",
)
@click.option(
    "--html",
    "html_path",
    type=NonEmptyPath(),
    default=None,
    metavar="FILE",
    help="Also write the report as one self-contained HTML page: placements per block, "
    "the time split, memory against the budget, the plan beside the hand-written ones.",
)
def solve_command(
    model_file,
    out_dir,
    algo,
    space,
    preload,
    quiet,
    as_json,
    html_path,
    gpus,
    gpus_per_node,
    pp_depths,
    microbatches,
    max_columns,
    **opts,
) -> None:
    """Plan how to shard MODEL_FILE on a device mesh, and write the plan.

    MODEL_FILE is a Python file defining build_model() and example_inputs() (global
    shapes); see docs/model-file.md. autoshard traces it on the meta device (no
    weights), gives every op its DTensor strategies, prices them with the mesh's
    bandwidths and latencies and the device's roofline, and solves an ILP for the
    fastest plan. It writes OUT/<model>_<mesh>.pkl (the solution, preloadable) and
    OUT/<model>_<mesh>.json (the sharding map the launcher reads).

    \b
    Examples:
      autoshard solve examples/gpt2.py --mesh 2x4
      autoshard solve examples/llama.py --mesh 2x4 --inter-node-bw 25GB/s
      autoshard solve examples/mlp.py --mesh 4 --inputs replicate
      autoshard solve examples/gpt2.py --mesh 2x4 --preload solutions/gpt2_2x4.pkl --out /tmp/p
      autoshard solve examples/gpt2.py --mesh 2x4 --json > report.json
      autoshard solve examples/mlp.py --gpus 16 --gpus-per-node 8
      autoshard solve examples/gpt2.py --gpus 16 --pp 2,4
      autoshard solve examples/llama.py --mesh 2x4 --space torchtitan
    """
    # heavy (torch, HiGHS): only once the command runs
    from autoshard.plan.export import output_stem
    from autoshard.solver.meshes import plan_mesh

    console = report_console(stderr=as_json, quiet=quiet)
    # before any work: a solve's result is never lost to --out
    check_out_folder(out_dir, "<model>_<mesh>.pkl and .json")
    if html_path is not None:
        check_writable_file(html_path, "--html")
    if space != "free" and (algo != "ilp" or preload is not None):
        given = "--algo" if algo != "ilp" else "--preload"
        raise AutoshardError(
            f"--space {space} searches its own plans; drop {given} (or --space {space})"
        )
    if algo != "ilp" and preload is not None:
        raise AutoshardError(
            f"--preload takes its plan from the file and --algo {algo} builds one: give one "
            "of the two"
        )
    depths = _depths(pp_depths, gpus)
    free_ilp = algo == "ilp" and preload is None and space == "free"
    _refuse_unused(
        ("--microbatches", "microbatches", depths), ("--max-columns", "max_columns", free_ilp)
    )
    meshes = _meshes_of_gpus(gpus, gpus_per_node, algo, preload, opts)
    config = config_from_options(model_file, opts)
    if max_columns is not None:
        config = replace(config, solver=replace(config.solver, max_columns=max_columns))
    if not meshes and _given("gpus_per_node"):
        config = replace(config, mesh=mesh_on_nodes(config.mesh, gpus_per_node, opts))
    if meshes:  # the files are named after the best mesh once it is known
        with Progress(Console(stderr=True, quiet=quiet), config.grad_accumulation) as progress:
            from autoshard.pipeline.search import search_shapes_and_depths  # heavy, as above

            search = search_shapes_and_depths(
                config, meshes, depths, microbatches, gpus_per_node, progress, space
            )
        result = search.best.result
        config = result.config
        _print_meshes(Console(stderr=as_json, quiet=quiet), search, gpus, gpus_per_node)
        # named after the search that planned the best row (torchtitan's space, where the
        # free ILP of its shape was over the mesh search's cap)
        suffix = "" if search.best.space == "free" else search.best.space
        stem = output_stem(Path(model_file).resolve().stem, config.mesh.shape, suffix)
        if search.fastest.stages is not None:
            _write_stages(search.fastest, model_file, out_dir, console)
        return _write_and_report(result, out_dir, stem, [], console, html_path, as_json, quiet)
    mesh = config.mesh
    # the model is named after its file: the output names are known before any work
    # the outputs are named after the model file (its target, when a link), as the traced
    # graph is (model_file.load_model_file): known before any work
    suffix = algo if algo != "ilp" else space if space != "free" else ""
    stem = output_stem(Path(model_file).resolve().stem, mesh.shape, suffix)
    refuse_overwriting_preload(preload, out_dir, stem)
    notes: list[str] = []
    with Progress(Console(stderr=True, quiet=quiet), config.grad_accumulation) as progress:
        if preload is not None:
            from autoshard.solver.preload import plan_preloaded  # heavy, as above

            result, pre = plan_preloaded(config, preload, progress)
            notes = list(pre.notes)
        elif algo != "ilp":
            from autoshard.solver.solve import plan_baseline  # heavy, as above

            result = plan_baseline(config, algo, progress)
            notes = list(result.plan.extra.get("notes", []))
        elif space != "free":
            from autoshard.solver.space import plan_space  # heavy, as above

            result = plan_space(config, space, progress)
            notes = list(result.plan.extra.get("notes", []))
        else:
            node = gpus_per_node if _given("gpus_per_node") else None
            result = plan_mesh(config, progress, node)
            notes = list(result.plan.extra.get("notes", []))  # over the cap: how, and why
    _write_and_report(result, out_dir, stem, notes, console, html_path, as_json, quiet)


def _write_and_report(result, out_dir, stem, notes, console, html_path, as_json, quiet) -> None:  # noqa: ANN001
    """Write the plan's two files, then print its report (a SolveResult)."""
    from autoshard.plan.export import write_outputs
    from autoshard.plan.report import ReportFacts

    interrupt.check()  # a Ctrl-C some library swallowed still stops the write
    config = result.config
    files = write_outputs(result.plan, out_dir, stem, config.cost_model(), result.solver_stats())
    # the plan is on disk before the report prices anything: a failure in the report (as
    # block_differences' KeyError was) loses no work and says which files hold the plan
    with _naming_written(files):
        facts = ReportFacts.of(result.plan)  # priced once for the terminal and --json
        _report(console, result, files, facts, notes, html_path, as_json, quiet)


def _links_profile(path) -> bool:  # noqa: ANN001
    """A ``--profile`` that sets links (measured on a mesh of several devices), which one
    mesh shape only has: not for ``--gpus``. A one-device profile sets the device only."""
    if path is None:
        return False
    from autoshard.calibrate import load_profile

    return not load_profile(path).device_only


def _meshes_of_gpus(gpus, gpus_per_node, algo, preload, opts) -> list:  # noqa: ANN001
    """The meshes ``--gpus`` stands for (empty without it); ``opts["mesh_shape"]`` is set
    to the 1-D mesh of ``gpus`` then, for the config's other options.

    Raises:
        click.UsageError: neither --mesh nor --gpus.
        AutoshardError: --gpus with an option that plans one given mesh (--mesh, --algo,
            --preload, a --profile of several devices' links, --mesh-dim-names).
    """
    if gpus is None:
        if opts["mesh_shape"] is None:
            raise click.UsageError(
                "Missing option '--mesh' (or --gpus N: every mesh shape of N GPUs)"
            )
        return []
    given = [
        flag
        for flag, on in (
            ("--mesh", opts["mesh_shape"] is not None),
            ("--algo", algo != "ilp"),
            ("--preload", preload is not None),
            ("--profile", _links_profile(opts.get("profile_path"))),
            ("--mesh-dim-names", opts.get("mesh_dim_names") is not None),
        )
        if on
    ]
    if given:
        raise AutoshardError(
            f"--gpus tries every mesh shape with the ILP; drop {', '.join(given)} (or give "
            "--mesh SHAPE instead of --gpus)"
        )
    from autoshard.cost.mesh import MeshSpec, node_shapes

    links = {k: opts[k] for k in MESH_LINK_KEYS}
    meshes = [
        MeshSpec.on_nodes(s, gpus_per_node, **links) for s in node_shapes(gpus, gpus_per_node)
    ]
    opts["mesh_shape"] = str(gpus)
    return meshes


def _given(key: str) -> bool:
    """Whether option ``key`` (click's keyword) was given on the command line."""
    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE


def mesh_on_nodes(mesh: MeshSpec, gpus_per_node: int, opts: dict) -> MeshSpec:
    """``--mesh``'s shape laid over nodes of ``gpus_per_node`` devices, ranks row-major (as
    ``init_device_mesh`` and ``--gpus`` lay them): a dim whose groups lie inside one node
    gets the intra-node links, any other the inter-node links
    (:meth:`~autoshard.cost.mesh.MeshSpec.on_nodes`); ``--mesh-dim-names`` are kept.

    Raises:
        AutoshardError: a ``--profile`` that sets links (it names each dim's links
            itself), a mesh of more than one node whose devices are not a whole number
            of nodes, or a mesh dim split between a node and the network
            (:func:`~autoshard.cost.mesh.respects_nodes`, as ``--gpus``'s shapes).
    """
    if _links_profile(opts.get("profile_path")):
        raise AutoshardError(
            "--profile sets each mesh dim's links as measured; drop --gpus-per-node"
        )
    n = math.prod(mesh.shape)
    if n > gpus_per_node and n % gpus_per_node:
        raise AutoshardError(
            f"--mesh {'x'.join(map(str, mesh.shape))} has {n} devices, not a whole number of "
            f"nodes of --gpus-per-node {gpus_per_node}: give a mesh of a multiple of "
            f"{gpus_per_node} devices, or the node size the cluster has"
        )
    if not respects_nodes(mesh.shape, gpus_per_node):
        raise AutoshardError(
            f"--mesh {'x'.join(map(str, mesh.shape))} over nodes of --gpus-per-node "
            f"{gpus_per_node} splits a mesh dim between a node and the network (each dim must "
            "lie inside a node or span whole nodes, as --gpus's shapes do): see the shapes "
            f"--gpus {n} --gpus-per-node {gpus_per_node} tries"
        )
    links = {k: opts[k] for k in MESH_LINK_KEYS}
    laid = MeshSpec.on_nodes(mesh.shape, gpus_per_node, **links)
    return replace(laid, dim_names=mesh.dim_names)


def _refuse_unused(*options: tuple) -> None:
    """Refuse an option given on the command line where what it qualifies is absent
    (``--microbatches`` without ``--pp``), as ``--pp`` without ``--gpus`` is: it would be
    ignored without a word.

    Raises:
        AutoshardError: such an option. Each of ``options`` is ``(flag, click's keyword,
            the value of what it qualifies: falsy when absent)``.
    """
    needs = {
        "--microbatches": "--gpus N --pp DEPTHS",
        "--max-columns": "the ILP (not with --algo, --preload or --space torchtitan)",
    }
    for flag, key, qualified in options:
        if not qualified and _given(key):
            raise AutoshardError(
                f"{flag} applies with {needs[flag]} only: add it, or drop {flag} (it would be "
                "ignored)"
            )


def _depths(text: str | None, gpus: int | None) -> list[int]:
    """``--pp 2,4`` as a list (empty without it).

    Raises:
        AutoshardError: --pp without --gpus, or a depth that is not an integer of 2 or more.
    """
    if text is None:
        return []
    if gpus is None:
        raise AutoshardError(
            "--pp tries pipeline depths beside the mesh shapes of --gpus: add --gpus N "
            "(for one mesh, use autoshard stages --pp)"
        )
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or any(d < 2 for d in depths):
        raise AutoshardError(f"--pp {text!r}: give pipeline depths of 2 or more, e.g. 2,4")
    return list(dict.fromkeys(depths))


def _write_stages(row, model_file, out_dir: Path, console: Console) -> None:  # noqa: ANN001
    """Write the fastest row's stage plan (a pipeline's) as ``autoshard stages`` does."""
    from autoshard.pipeline.search import stage_file
    from autoshard.plan.export import output_stem

    stem = output_stem(Path(model_file).resolve().stem, row.mesh.shape, "")
    path = Path(out_dir) / f"{stem}_pp{row.pp}.stages.json"
    stage_file(row, path)
    console.print(
        f"fastest: {'x'.join(map(str, row.mesh.shape))} with pp={row.pp}: wrote its stage plan "
        f"{path} (autoshard stages --pp {row.pp} writes this format"
        f"{', searching every split' if row.note else ', the same plan'}); the plan without "
        "stages follows"
    )


def _mesh_row(row, gpus_per_node: int) -> dict:  # noqa: ANN001 - a solver.meshes.MeshRow
    """One row of ``--gpus`` in the JSON report (seconds, bytes; ``None`` without a plan)."""
    from autoshard.cost.mesh import inside_node

    return {
        "mesh": list(row.mesh.shape),
        "pp": row.pp,
        "inside_node": inside_node(row.mesh.shape, gpus_per_node),
        "bandwidth_Bps": list(row.mesh.bandwidth),
        "step_time_s": float(row.step_time_s) if row.planned else None,
        "mfu": float(row.mfu) if row.planned else None,
        "memory_bytes": float(row.memory_bytes) if row.planned else None,
        "error": row.error,
        "space": row.space,
        "note": row.note,
        "bound_s": row.bound_s,  # a skipped row: a lower bound on its step
        # the shape whose ILP plan is laid onto this one (autoshard.solver.lifting), or None
        "lifted_from": list(row.lifted_from) if row.lifted_from is not None else None,
    }


def _print_meshes(console: Console, search, gpus: int, gpus_per_node: int) -> None:  # noqa: ANN001
    """The ranked table of ``--gpus``: one row per mesh shape tried."""
    from rich.table import Table

    from autoshard.cost.mesh import inside_node
    from autoshard.units import format_bytes, format_seconds

    table = Table(title=f"mesh shapes of {gpus} GPUs, {gpus_per_node} per node (fastest first)")
    for col in ("mesh", "pp", "links", "step", "MFU", "memory/device", "solve", "search"):
        table.add_column(col, justify="left" if col in ("mesh", "links", "search") else "right")
    for row in search.rows:
        mesh = "x".join(map(str, row.mesh.shape))
        inside = inside_node(row.mesh.shape, gpus_per_node)
        links = " x ".join("node" if x else "network" for x in inside)
        if not row.planned and row.bound_s is not None:  # skipped: cannot beat the best
            step = f">= {format_seconds(row.bound_s)}"
            table.add_row(mesh, str(row.pp), links, step, "", "", "", "skipped", style="dim")
            continue
        if not row.planned:
            table.add_row(mesh, str(row.pp), links, "no plan", "", "", "", "", style="dim")
            continue
        table.add_row(
            mesh,
            str(row.pp),
            links,
            format_seconds(row.step_time_s),
            f"{100 * row.mfu:.1f}%",
            format_bytes(row.memory_bytes),
            f"{row.solve_seconds:.1f} s",
            _search_cell(row),
        )
    console.print(table)
    for row in search.rows:
        if row.note is not None and row.pp > 1:
            shape = "x".join(map(str, row.mesh.shape))
            console.print(f"note: {shape} with pp={row.pp}: {row.note}")
        elif row.lifted_from is not None:  # the note says which plan and why
            console.print(f"note: {'x'.join(map(str, row.mesh.shape))}: {row.note}")
        elif row.note is not None:
            console.print(
                f"note: {'x'.join(map(str, row.mesh.shape))} is planned in {row.space}'s space "
                f"(what FSDP2 and parallelize_module express, as --space {row.space}): {row.note}"
            )
        if not row.planned:
            pp = f" with pp={row.pp}" if row.pp > 1 else ""
            has = "is" if row.bound_s is not None else "has no plan:"
            console.print(f"note: {'x'.join(map(str, row.mesh.shape))}{pp} {has} {row.error}")
    shapes = sum(r.pp == 1 for r in search.rows)
    staged = "; the pipeline depths traced apart" if shapes < len(search.rows) else ""
    skipped = sum(r.bound_s is not None for r in search.rows)
    if skipped:
        staged += f"; {skipped} skipped by a lower bound"
    console.print(
        f"best: {'x'.join(map(str, search.best.mesh.shape))} (one trace, "
        f"{search.trace_seconds:.1f} s, for all {shapes} shapes{staged})"
    )


def _search_cell(row) -> str:  # noqa: ANN001 - a MeshRow
    """What planned a row of the ``--gpus`` table."""
    if row.pp > 1:
        return "stages"
    if row.lifted_from is not None:
        better = ", improved" if row.result.plan.extra["lifted"]["improved"]["improved"] else ""
        return f"{'x'.join(map(str, row.lifted_from))} ILP, lifted{better}"
    return "ILP" if row.space == "free" else f"{row.space} space"


@contextlib.contextmanager
def _naming_written(files: list[Path]):
    """Any failure once the plan is written first says which files hold it, then goes on
    (the traceback, or the one-line error, follows)."""
    try:
        yield
    except (Exception, KeyboardInterrupt):
        written = ", ".join(str(f) for f in files)
        click.echo(f"the plan was written before this failure: {written}", err=True)
        raise


def _report(console, result, files, facts, notes, html_path, as_json, quiet) -> None:  # noqa: ANN001
    """The terminal report, the notes, the HTML page and the JSON document of a solve."""
    from autoshard.plan.report import print_report, report_dict

    print_report(console, result, files, facts)
    for note in notes:
        console.print(f"note: {note}")
    if html_path is not None:
        _write_html(html_path, result)
        console.print(f"wrote {html_path}")
    if as_json:  # stdout is the JSON document alone, with or without --quiet
        import json

        report = report_dict(result, files, notes, facts)
        if result.meshes is not None:  # --gpus: every mesh tried, fastest first
            per_node = result.meshes.gpus_per_node
            report["meshes"] = [_mesh_row(row, per_node) for row in result.meshes.rows]
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    elif quiet:
        click.echo("\n".join(str(f) for f in (*files, *([html_path] if html_path else []))))


def _write_html(path: Path, result) -> None:  # noqa: ANN001 - a SolveResult
    """The HTML report, with the hand-written plans priced on the solve's own graph."""
    # heavy (torch, matplotlib): only once the command runs
    from autoshard.plan.atomic import atomic_write_text
    from autoshard.plan.html import html_report
    from autoshard.solver.baselines import TWO_D_ONLY
    from autoshard.solver.compare import ComparedPlan, compare_plans, mark_best
    from autoshard.solver.options import BASELINES

    config, plan = result.config, result.plan
    names = [
        b for b in BASELINES if b != plan.name and (config.mesh.ndim > 1 or b not in TWO_D_ONLY)
    ]
    budget = config.budget()
    rows = [ComparedPlan(plan.name, plan, fits=plan.memory_bytes <= budget)]
    rows += compare_plans(config, result.sg, tuple(names))
    mark_best(rows)
    atomic_write_text(path, html_report(result, rows))
