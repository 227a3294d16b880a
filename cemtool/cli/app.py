"""The Typer application object every command module registers on, and the options of every command (before the
command's name: ``cemtool --threads 2 sharpness ...``)."""

import sys
from typing import Annotated, Optional

import typer

from cemtool.cli.common import guarded_call
from cemtool.cli.console import info
from cemtool.threads import apply

app = typer.Typer(
    name="cemtool",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Train small language models of several Transformer layer families and measure them.",
    context_settings={"help_option_names": ["-h", "--help"]},
)


LIGHT = ("runs", "config", "plot")  # commands that never run torch: no thread decision, no note


@app.callback()
def common_options(
    ctx: typer.Context,
    threads: Annotated[Optional[int], typer.Option(
        "--threads", min=1, help="CPU threads for torch (default: CEMTOOL_THREADS, else OMP_NUM_THREADS, else one "
                                 "per core, fewer when the load average leaves fewer cores free; "
                                 "docs/performance.md)")] = None,
) -> None:
    """Train small language models of several Transformer layer families and measure them."""
    if threads is None and (ctx.invoked_subcommand in LIGHT or {"-h", "--help"} & set(sys.argv[1:])):
        return  # (a command's own arguments are not in ctx here)
    note = guarded_call(apply, threads)
    if note:
        info(f"note: {note}")
