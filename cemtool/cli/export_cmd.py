"""cemtool export."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded

FORMATS = ("hf",)


@app.command()
@guarded
def export(
    run: Annotated[Path, typer.Argument(help="run directory (from `cemtool train`)")],
    out: Annotated[Path, typer.Argument(help="directory to write (new or empty; --force to write into a "
                                             "non-empty one)")],
    to: Annotated[str, typer.Option("--to", help="format: hf = a standard Hugging Face directory "
                                                 "(LlamaForCausalLM, or GPT2LMHeadModel for a GPT-2-style baseline)")]
    = "hf",
    checkpoint: Annotated[str, typer.Option(help="final, latest, a step number, or a checkpoint file")] = "final",
    force: Annotated[bool, typer.Option(help="write into a non-empty directory (its files of the same names are "
                                             "replaced)")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Export a run as a model directory that other tools load (transformers, lm-eval-harness, ...)."""
    if to not in FORMATS:
        raise typer.BadParameter(f"unknown format {to!r}: choose one of {', '.join(FORMATS)}", param_hint="--to")
    from cemtool.subject.hf.export import export_hf  # start-up: torch

    res = export_hf(run, out, checkpoint=checkpoint, force=force)
    if json_:
        console.print_json(res)
        return
    console.result(f"exported {res['run']} ({res['arch']}, {res['checkpoint']}, step {res['step']}) as "
                   f"{res['architecture']} to {res['out']}: {', '.join(res['files'])}; logits match the run's to "
                   f"{res['logits_max_abs_diff']:.2g} (fp32, transformers {res['transformers']})")
