"""``autoshard stages``: split a model into pipeline stages, each with its intra-op plan."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import click
from rich.console import Console

from autoshard.cli.options import (
    NonEmptyPath,
    Progress,
    check_out_folder,
    mesh_and_device,
    mesh_options,
    report_console,
    step_options,
)
from autoshard.errors import AutoshardError
from autoshard.solver.options import WORK_LIMIT, SolverOptions
from autoshard.units import BytesType


def stages_options(f):
    """The arguments and options of ``autoshard stages``."""
    f = click.option("-q", "--quiet", is_flag=True, help="Print only the file written.")(f)
    f = click.option(
        "--out",
        "out_dir",
        type=NonEmptyPath(),
        default=Path("solutions"),
        show_default=True,
        help="Folder for <model>_<mesh>_pp<k>.stages.json.",
    )(f)
    f = click.option(
        "--time-limit",
        type=float,
        default=None,
        help="Wall-clock seconds HiGHS may search per stage ILP (default: none; each MIP "
        "stops at --work-limit). When it stops a search, the plan may differ on a busier "
        "machine.",
    )(f)
    f = click.option(
        "--work-limit",
        type=click.IntRange(min=1),
        default=WORK_LIMIT,
        show_default=True,
        help="Work units each MIP solve may take (HiGHS's limit checks: it counts work, not "
        "seconds, so the same plan on every run).",
    )(f)
    f = click.option(
        "--memory-budget",
        type=BytesType(),
        default=None,
        help="Bytes per device a stage's plan may take (parameters, gradients, AdamW state, "
        "activations of the micro-batches in flight), e.g. 40GiB "
        "(default: the device's memory).",
    )(f)
    f = click.option(
        "--microbatches",
        type=int,
        default=8,
        show_default=True,
        help="Micro-batches per step (B in the 1F1B step time sum(t) + (B - 1) max(t)); "
        "example_inputs() is the global batch, split into B chunks along dim 0.",
    )(f)
    f = click.option(
        "--split",
        "split_rule",
        type=click.Choice(["search", "torchtitan"]),
        default="search",
        show_default=True,
        help="search: every split of the layers, each candidate stage its own ILP (every "
        "layer traced); torchtitan: only the split torchtitan runs (the embedding and the "
        "head weigh one layer each, the rest dealt evenly), one ILP per stage on a reduced "
        "trace: minutes for an 80-layer model where search takes hours.",
    )(f)
    f = click.option(
        "--pp",
        "pp_text",
        default="auto",
        show_default=True,
        metavar="N|auto",
        help="Pipeline degree (stages); auto tries every degree the mesh admits.",
    )(f)
    for opt in reversed(step_options()):
        f = opt(f)
    f = mesh_options(f)
    return click.argument("model_file", type=NonEmptyPath())(f)


@click.command("stages")
@stages_options
@click.pass_context
def stages_command(
    ctx: click.Context,
    model_file,
    mesh_shape,
    mesh_dim_names,
    intra_node_bw,
    inter_node_bw,
    intra_node_latency,
    inter_node_latency,
    device_name,
    profile_path,
    mode,
    dtype_name,
    precision,
    reduce_dtype_name,
    activation_checkpointing,
    checkpoint_early_stop,
    optimizer,
    pp_text,
    split_rule,
    microbatches,
    memory_budget,
    time_limit,
    work_limit,
    out_dir,
    quiet,
) -> None:
    """Split MODEL_FILE into pipeline stages over the mesh, each with its intra-op plan.

    The layers are the model's repeated blocks (or, without them, clusters of ops). For a
    pipeline degree PP each stage gets a submesh of MESH / PP devices (split along the
    leading mesh dims); one intra-op ILP on that submesh prices every layer, and the
    contiguous split of layers with the least 1F1B step time sum(t) + (B - 1) max(t) wins.
    Writes OUT/<model>_<mesh>_pp<k>.stages.json (docs/pipeline-stages.md).

    \b
    Examples:
      autoshard stages examples/gpt2.py --mesh 2x2x2 --pp 2 --microbatches 8
      autoshard stages examples/gpt2.py --mesh 2x4 --pp auto
      autoshard stages examples/llama70b.py --mesh 8x8 --pp 4 --split torchtitan
    """
    import torch  # heavy: only once the command runs

    from autoshard.pipeline.pricing import run_stages
    from autoshard.solver.solve import SolveConfig

    try:
        # before any work: the stage plan is never lost to --out
        check_out_folder(out_dir, "<model>_<mesh>_pp<k>.stages.json")
        mesh, device = mesh_and_device(
            {
                "mesh_shape": mesh_shape,
                "mesh_dim_names": mesh_dim_names,
                "intra_node_bw": intra_node_bw,
                "inter_node_bw": inter_node_bw,
                "intra_node_latency": intra_node_latency,
                "inter_node_latency": inter_node_latency,
                "device_name": device_name,
                "profile_path": profile_path,
            }
        )
        if activation_checkpointing == "full":
            raise AutoshardError(
                "--activation-checkpointing full is not priced for pipeline stages (each "
                "stage keeps its micro-batches' activations); use solve or compare, or drop it"
            )
        config = SolveConfig(
            model_path=model_file,
            mesh=mesh,
            device=device,
            solver=SolverOptions(time_limit_s=time_limit, work_limit=work_limit),
            mode=mode,
            dtype=getattr(torch, dtype_name) if dtype_name else None,
            precision=precision,
            reduce_dtype=getattr(torch, reduce_dtype_name),
            memory_budget=memory_budget,
            tie=False,  # every layer traced: stages are cut between real layers
            activation_checkpointing="none",  # a stage's budget holds at its turn only
            checkpoint_early_stop=checkpoint_early_stop,
            optimizer=optimizer,
        )
        budget = memory_budget if memory_budget is not None else device.memory_bytes
        log = Console(stderr=True, quiet=quiet)
        with Progress(log):  # each stage ILP's incumbent, bound and gap as it runs
            path, _ = run_stages(
                config,
                pp_text,
                microbatches,
                budget,
                out_dir,
                report_console(quiet=quiet),
                log,
                split_rule,
            )
    except AutoshardError as exc:
        root = ctx.find_root()
        if root.obj and root.obj.get("debug"):
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if quiet:
        click.echo(str(path))
