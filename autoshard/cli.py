"""The ``autoshard`` command line (click).

Every user error is an :class:`~autoshard.errors.AutoshardError`: printed as one
line ``error: ...`` with exit code 2; ``--debug`` shows the traceback as well.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from autoshard import __version__
from autoshard.devices import DEFAULT_DEVICE, DEVICES, get_device
from autoshard.errors import AutoshardError
from autoshard.ilp import SolverOptions
from autoshard.mesh import (
    DEFAULT_INTER_NODE_BW,
    DEFAULT_INTER_NODE_LATENCY,
    DEFAULT_INTRA_NODE_BW,
    DEFAULT_INTRA_NODE_LATENCY,
    MeshSpec,
)
from autoshard.solve import DDP_BUCKET_BYTES, SolveConfig
from autoshard.units import (
    BandwidthType,
    BytesType,
    DurationType,
    format_bandwidth,
    format_seconds,
)


class _Group(click.Group):
    """Turns :class:`AutoshardError` into one line and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except AutoshardError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autoshard")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Find how to shard a PyTorch model across a mesh of GPUs.

    \b
    Workflows (docs/ has each in full):
      autoshard solve examples/gpt2.py --mesh 2x4        plan, print, write solutions/
      autoshard show solutions/gpt2_2x4.json             read a plan back
      autoshard launch solutions/gpt2_2x4.json examples/gpt2.py --check
                                                         run it sharded under torchrun
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


def _mesh_options(f):
    options = [
        click.option(
            "--mesh",
            "mesh_shape",
            required=True,
            metavar="SHAPE",
            help="Devices per mesh dim, e.g. 8, 2x4, 2x2x2. Dim 0 is inter-node when there "
            "are two or more dims (MASE's convention); the rest are intra-node.",
        ),
        click.option(
            "--mesh-dim-names",
            default=None,
            metavar="NAMES",
            help="Comma-separated names of the mesh dims, e.g. dp,tp (default: dp,tp for 2 "
            "dims, d0,d1,... otherwise).",
        ),
        click.option(
            "--intra-node-bw",
            type=BandwidthType(),
            default=DEFAULT_INTRA_NODE_BW,
            show_default=format_bandwidth(DEFAULT_INTRA_NODE_BW),
            help="Bandwidth of intra-node mesh dims, each way per device (H100 NVLink 4).",
        ),
        click.option(
            "--inter-node-bw",
            type=BandwidthType(),
            default=DEFAULT_INTER_NODE_BW,
            show_default=format_bandwidth(DEFAULT_INTER_NODE_BW),
            help="Bandwidth of the inter-node mesh dim (one 400 Gb/s NIC per GPU).",
        ),
        click.option(
            "--intra-node-latency",
            type=DurationType(),
            default=DEFAULT_INTRA_NODE_LATENCY,
            show_default=format_seconds(DEFAULT_INTRA_NODE_LATENCY),
            help="Latency (alpha) of one collective step on intra-node dims.",
        ),
        click.option(
            "--inter-node-latency",
            type=DurationType(),
            default=DEFAULT_INTER_NODE_LATENCY,
            show_default=format_seconds(DEFAULT_INTER_NODE_LATENCY),
            help="Latency (alpha) of one collective step on the inter-node dim.",
        ),
        click.option(
            "--device",
            "device_name",
            default=DEFAULT_DEVICE,
            show_default=True,
            type=click.Choice(sorted(DEVICES), case_sensitive=False),
            help="GPU whose peak FLOP/s and memory bandwidth price compute (roofline).",
        ),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


def mesh_from_options(
    mesh_shape, mesh_dim_names, intra_node_bw, inter_node_bw, intra_node_latency, inter_node_latency
) -> MeshSpec:
    """Build the :class:`MeshSpec` from the CLI's mesh options."""
    names = mesh_dim_names.split(",") if mesh_dim_names else None
    return MeshSpec.from_options(
        mesh_shape,
        names,
        intra_node_bw=intra_node_bw,
        inter_node_bw=inter_node_bw,
        intra_node_latency=intra_node_latency,
        inter_node_latency=inter_node_latency,
    )


def step_options() -> list:
    """``--mode`` and ``--dtype``: what one step is (shared by solve, compare and stages)."""
    return [
        click.option(
            "--mode",
            type=click.Choice(["train", "infer"]),
            default="train",
            show_default=True,
            help="train: cost a training step (forward + backward from the joint graph, gradient "
            "reductions, AdamW memory); infer: the forward pass only.",
        ),
        click.option(
            "--dtype",
            "dtype_name",
            type=click.Choice(["float32", "bfloat16", "float16"]),
            default=None,
            help="Cast parameters and floating inputs to this dtype (default: the model's).",
        ),
    ]


def _plan_options(f):
    """The options that say what plan to find (shared by ``solve`` and ``compare``)."""
    options = [
        click.option(
            "--inputs",
            "input_placement",
            type=click.Choice(["free", "replicate"]),
            default="free",
            show_default=True,
            help="free: the ILP chooses the inputs' placements; replicate: every input starts "
            "replicated on every device.",
        ),
        click.option(
            "--outputs",
            "output_placement",
            type=click.Choice(["free", "replicate"]),
            default="free",
            show_default=True,
            help="free: outputs may end sharded (never Partial: the plan pays to reduce them); "
            "replicate: every device ends with the whole output.",
        ),
        click.option(
            "--time-limit",
            type=float,
            default=120.0,
            show_default=True,
            help="Seconds HiGHS may search (LP, relax-and-fix and MIP together); when hit, the "
            "best plan found is written with its gap.",
        ),
        click.option(
            "--mip-gap",
            type=float,
            default=1e-2,
            show_default=True,
            help="Relative optimality gap accepted (the report shows the plan's gap to the LP "
            "bound); 0 proves optimality, which can take minutes on large models.",
        ),
        *step_options(),
        click.option(
            "--memory-budget",
            type=BytesType(),
            default=None,
            metavar="BYTES",
            help="Memory per device the plan must fit, e.g. 40GiB "
            "(default: the device's capacity).",
        ),
        click.option(
            "--bucket-size",
            "bucket_bytes",
            type=BytesType(),
            default=DDP_BUCKET_BYTES,
            show_default="25MiB, DDP's bucket_cap_mb",
            metavar="BYTES",
            help="Gradient reductions and parameter all-gathers go in buckets of this size "
            "(training): each tensor pays its share of one collective's latency; 0 gives every "
            "tensor its own collective.",
        ),
        click.option(
            "--no-overlap",
            is_flag=True,
            help="Price every collective on the critical path; by default gradient reductions "
            "hide under the backward compute still to run and parameter all-gathers under the "
            "compute before their use (training).",
        ),
        click.option(
            "--no-tie",
            is_flag=True,
            help="Trace every repeated layer and give each its own variables (slower); by default "
            "identical layers share one plan and one traced middle block stands for all of them.",
        ),
    ]
    for opt in reversed(options):
        f = opt(f)
    return f


_MESH_KEYS = (
    "mesh_shape",
    "mesh_dim_names",
    "intra_node_bw",
    "inter_node_bw",
    "intra_node_latency",
    "inter_node_latency",
)


def config_from_options(model_file: Path, opts: dict) -> SolveConfig:
    """The :class:`SolveConfig` of the mesh and planning options (click's keyword names).

    Raises:
        AutoshardError: a bad mesh, unit or option value.
    """
    mesh = mesh_from_options(*(opts[k] for k in _MESH_KEYS))
    return SolveConfig(
        model_path=model_file,
        mesh=mesh,
        device=get_device(opts["device_name"]),
        input_placement=opts["input_placement"],
        output_placement=opts["output_placement"],
        solver=SolverOptions(time_limit_s=opts["time_limit"], mip_gap=opts["mip_gap"]),
        mode=opts["mode"],
        dtype=getattr(torch, opts["dtype_name"]) if opts["dtype_name"] else None,
        memory_budget=opts["memory_budget"],
        tie=not opts["no_tie"],
        bucket_bytes=opts["bucket_bytes"],
        overlap=not opts["no_overlap"],
    )


class _Progress:
    """rich progress for the long phases: trace, strategies, solve."""

    LABELS = {
        "trace": "tracing (torch.export, meta device)",
        "strategies": "generating strategies",
        "solve": "solving the ILP (HiGHS)",
    }

    def __init__(self, console: Console) -> None:
        self.bar = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[str, int] = {}

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase not in self.tasks:
            self.tasks[phase] = self.bar.add_task(self.LABELS.get(phase, phase), total=total)
        self.bar.update(self.tasks[phase], completed=done, total=total)


@main.command()
@click.argument("model_file", type=click.Path(path_type=Path))
@_mesh_options
@_plan_options
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=Path("solutions"),
    show_default=True,
    help="Folder for <model>_<mesh>.pkl and .json.",
)
@click.option(
    "--algo",
    type=click.Choice(["ilp", "replicate", "ddp", "fsdp", "megatron", "megatron_sp"]),
    default="ilp",
    show_default=True,
    help="ilp: the optimal plan; the others export a hand-written-style plan (data parallel, "
    "ZeRO-3, Megatron tensor parallel on the last mesh dim) priced by the same cost model.",
)
@click.option(
    "--preload",
    type=click.Path(path_type=Path),
    default=None,
    metavar="FILE",
    help="Skip the ILP: take the plan from a solution pickle (autoshard's or MASE's), "
    "filling missing layers from an identical block. Loading never runs code from FILE.",
)
@click.option("-q", "--quiet", is_flag=True, help="Print only the files written.")
def solve(model_file, out_dir, algo, preload, quiet, **opts) -> None:
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
    """
    from autoshard.export import output_stem, write_outputs
    from autoshard.report import print_report
    from autoshard.solve import plan_model

    console = Console(stderr=False, quiet=quiet)
    config = config_from_options(model_file, opts)
    mesh = config.mesh
    notes: list[str] = []
    with _Progress(Console(stderr=True, quiet=quiet)) as progress:
        if preload is not None:
            from autoshard.preload import plan_preloaded

            result, pre = plan_preloaded(config, preload, progress)
            notes = list(pre.notes)
        elif algo != "ilp":
            from autoshard.solve import plan_baseline

            result = plan_baseline(config, algo, progress)
            notes = list(result.plan.extra.get("notes", []))
        else:
            result = plan_model(config, progress)
    stem = output_stem(result.graph.model_name, mesh.shape, "" if algo == "ilp" else algo)
    files = write_outputs(result.plan, out_dir, stem, config.cost_model(), result.solver_stats())
    print_report(console, result, files)
    for note in notes:
        console.print(f"note: {note}")
    if quiet:
        click.echo("\n".join(str(f) for f in files))


def _register_optional() -> None:
    """Commands living in their own modules."""
    import importlib

    for module, attr, name in (
        ("autoshard.show", "show_command", "show"),
        ("autoshard.launch", "launch_command", "launch"),
        ("autoshard.stages_cli", "stages_command", "stages"),
        ("autoshard.compare", "compare_command", "compare"),
    ):
        try:
            main.add_command(getattr(importlib.import_module(module), attr), name)
        except (ImportError, AttributeError):  # pragma: no cover - module not there yet
            pass


_register_optional()


if __name__ == "__main__":  # pragma: no cover
    main()
