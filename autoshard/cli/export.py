"""``autoshard export --format torchtitan``: a plan as ``parallelize_module`` styles and FSDP2."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from autoshard.cli.options import NonEmptyPath
from autoshard.errors import AutoshardError


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan", type=NonEmptyPath())
@click.argument("model_file", type=NonEmptyPath())
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["torchtitan"]),
    default="torchtitan",
    show_default=True,
    help="torchtitan: a parallelize(model) function with parallelize_module's "
    "ColwiseParallel/RowwiseParallel plan and FSDP2 fully_shard per block.",
)
@click.option(
    "--out",
    type=NonEmptyPath(),
    default=None,
    help="Write the Python to this file (default: stdout; the notes go to stderr).",
)
@click.option(
    "--no-price",
    is_flag=True,
    help="Skip pricing the styles (a trace of MODEL_FILE and DTensor's propagation).",
)
def export_command(plan: Path, model_file: Path, fmt: str, out: Path | None, no_price: bool):
    """Write the sharding map PLAN for MODEL_FILE as torchtitan users write plans: a
    parallelize(model) function (parallelize_module styles on the tensor-parallel mesh dim,
    fully_shard on the data-parallel one, one FSDP2 group per repeated block). In Python,
    autoshard.apply(model, PLAN) does the same to your model (docs/python.md).

    Styles fix the parameters; DTensor's propagation places the activations. The notes
    list every parameter the styles place otherwise than the plan, and price the styles
    with the plan's own cost model beside the plan's predicted step.

    \b
    Example:
      autoshard solve examples/llama.py --mesh 2x4 --algo megatron
      autoshard export solutions/llama_2x4_megatron.json examples/llama.py --out tp.py
    """
    # heavy (torch): only once the command runs
    from autoshard.cost.mesh import default_dim_names
    from autoshard.model.model_file import instantiate, load_model_file
    from autoshard.plan.atomic import atomic_write_text
    from autoshard.plan.formats import load_sharding_map, load_solution
    from autoshard.plan.styles import COLWISE, style_plan, torchtitan_code
    from autoshard.units import format_seconds

    del fmt  # one format so far
    if plan.suffix == ".py" and model_file.suffix in (".json", ".pkl"):
        raise AutoshardError(
            f"the plan comes first: autoshard export {model_file} {plan} (PLAN is the "
            "sharding map .json, MODEL_FILE the .py)"
        )
    smap = load_sharding_map(plan)
    mf = load_model_file(model_file)
    sp = style_plan(instantiate(mf, device="meta").module, smap)
    names = smap.dim_names or default_dim_names(len(smap.mesh_shape))
    code = torchtitan_code(sp, smap.mesh_shape, names)
    if out is None:
        sys.stdout.write(code)
    else:
        atomic_write_text(out, code)
        click.echo(f"wrote {out}", err=True)
    for why in sp.unrunnable:
        click.echo(f"warning: these styles cannot run on the model's own code: {why}", err=True)
    for name, planned, applied in sp.differences:
        click.echo(f"note: {name}: the plan places it {planned}, the styles {applied}", err=True)
    if no_price:
        return
    solution = smap.solution_path()
    predicted = smap.predicted.get("step_time_s")
    if solution is None or predicted is None:
        click.echo(f"note: {plan} names no solution: the styles are not priced", err=True)
        return
    from autoshard.solver.solve import SolveConfig, plan_pinned

    gathered = frozenset(sp.dp_shard)  # FSDP gathers each parameter before its use
    try:
        config = SolveConfig.from_solution(mf.path, load_solution(solution))
        styled = plan_pinned(
            config,
            sp.placements,
            dict(smap.inputs),
            gathered,
            "torchtitan",
            {m: "column" if style == COLWISE else "row" for m, (style, _) in sp.tp.items()},
            sp.tp_dim,
        )
    except AutoshardError as exc:
        click.echo(f"note: the styles could not be priced ({exc})", err=True)
        return
    for note in styled.plan.extra.get("notes", []):
        click.echo(f"note: pricing the styles: {note}", err=True)
    step = styled.plan.step_time_s
    click.echo(
        f"predicted step: the plan {format_seconds(predicted)}; these styles "
        f"{format_seconds(step)} ({(step / predicted - 1) * 100:+.1f}%: the styles fix the "
        "parameters, DTensor's propagation the activations)",
        err=True,
    )
