"""The ``autoshard`` command line (click): the group and its commands, registered here.

Every user error is an :class:`~autoshard.errors.AutoshardError`: printed as one
line ``error: ...`` with exit code 2; ``--debug`` shows the traceback as well. Ctrl-C at
any point prints one line and exits 130, having written nothing.

The command modules import only click, rich and autoshard's light modules (options,
units, the mesh and device tables) at import time; each command imports torch, HiGHS and
the pipeline when it runs, so that ``autoshard --help`` answers at once.
"""

from __future__ import annotations

import os
import sys
import traceback

import click

from autoshard import __version__, interrupt
from autoshard.cli.calibrate import calibrate_command
from autoshard.cli.compare import compare_command
from autoshard.cli.export import export_command
from autoshard.cli.launch import launch_command
from autoshard.cli.show import show_command
from autoshard.cli.solve import solve_command
from autoshard.cli.stages import stages_command
from autoshard.errors import AutoshardError


class _Group(click.Group):
    """Turns :class:`AutoshardError` into one line and exit code 2, and Ctrl-C into one
    line and exit code 130 (the shell's code for SIGINT)."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **kw):
        """click's standalone mode, with option errors in the one-line form of every other
        error (``error: ...; see `autoshard solve --help```) instead of click's four."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **kw)
        try:
            code = super().main(args, prog_name, complete_var, False, **kw)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `autoshard`: the help
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            hint = f"; see `{exc.ctx.command_path} --help`" if exc.ctx is not None else ""
            click.echo(f"error: {exc.format_message().rstrip('.')}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:  # Ctrl-C while click itself runs (prompts, parsing)
            click.echo("interrupted (Ctrl-C): nothing was written", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: click.Context):
        with interrupt.installed():
            try:
                return super().invoke(ctx)
            except AutoshardError as exc:
                if ctx.obj and ctx.obj.get("debug"):
                    traceback.print_exc()
                click.echo(f"error: {exc}", err=True)
                sys.exit(2)
            except KeyboardInterrupt:
                click.echo("interrupted (Ctrl-C): nothing was written", err=True)
                sys.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="autoshard")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.option(
    "-v", "--verbose", is_flag=True, help="Show torch's own warnings, logs and graph dumps."
)
@click.pass_context
def main(ctx: click.Context, debug: bool, verbose: bool) -> None:
    """Find how to shard a PyTorch model across a mesh of GPUs.

    \b
    First steps (5 s each on 2 cores, the 4-process launch 30 s; docs/ has the rest):
      autoshard solve examples/mlp.py --mesh 4           plan, print, write solutions/
      autoshard show solutions/mlp_4.json                read the plan back
      autoshard launch solutions/mlp_4.json examples/mlp.py --train --check
                                                         run it on 4 CPU ranks, check it
      autoshard solve examples/mlp.py --mesh 4 --algo megatron
      autoshard export solutions/mlp_4_megatron.json examples/mlp.py
                                                         a hand plan as torchtitan styles
    Then real models (15-30 s each on 2 cores):
      autoshard solve examples/gpt2.py --mesh 2x4        HuggingFace GPT-2 small, 2x4
      autoshard compare examples/gpt2.py --mesh 2x4      the ILP beside DDP/FSDP/Megatron
      autoshard calibrate --mesh 2x4                     measure links; solve --profile
    """
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug
    if verbose:  # read by the tracer (autoshard.trace.tracer._quiet_torch), in any process
        os.environ["AUTOSHARD_VERBOSE"] = "1"


def entry() -> None:
    """The ``autoshard`` console script: :func:`main`, then a hard exit.

    Python's teardown frees every object of the traced graph, the strategies and torch
    (about 1.9 s of a GPT-2 solve's 14.6 s on 2 cores); by the time a command returns its
    files are written, fsynced and renamed, so the process flushes stdout and stderr and
    leaves with ``os._exit``, as mypy's ``hard_exit`` does. In-process callers (tests,
    ``CliRunner``) use :func:`main`, which exits normally.
    """
    try:
        main(prog_name="autoshard")  # also under `python -m autoshard.cli`
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


main.add_command(solve_command, "solve")
main.add_command(show_command, "show")
main.add_command(compare_command, "compare")
main.add_command(stages_command, "stages")
main.add_command(launch_command, "launch")
main.add_command(calibrate_command, "calibrate")
main.add_command(export_command, "export")


if __name__ == "__main__":  # pragma: no cover
    entry()
