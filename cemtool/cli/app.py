"""The Typer application object every command module registers on."""

import typer

app = typer.Typer(
    name="cemtool",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Train small language models of several Transformer layer families and measure them.",
    context_settings={"help_option_names": ["-h", "--help"]},
)
