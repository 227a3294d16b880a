"""cemtool plot: every figure and report.md from saved runs and reports (nothing is recomputed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError
from cemtool.layout import is_hf_dir, is_run


@app.command()
@guarded
def plot(
    paths: Annotated[list[Path], typer.Argument(help="a run directory, or a folder of runs (a sweep, a study, "
                                                "`cemtool demo`'s output); several runs: drawn together into --out")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="with several paths: the folder of the "
                                                "combined figures and report.md (required then)")] = None,
    each_run: Annotated[bool, typer.Option("--each-run/--no-each-run", help="also redraw every run's own figures "
                                           "and report.md (default on)")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the report.md path(s)")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the written files as JSON")] = False,
    formats: Annotated[str, typer.Option("--format", help="figure formats, comma-separated: png, pdf, svg (PNG is "
                                         "always written: report.md shows it)")] = "png,svg",
    size: Annotated[Optional[str], typer.Option("--size", help="size preset: column (3.5 in wide, 7 pt), page "
                                                "(7 in, 8 pt) or slide (10 in, 12 pt); default: each figure's "
                                                "own size")] = None,
) -> None:
    """Draw every figure a run or sweep's saved reports support, as PNG and SVG (or --format) under plots/, and
    write report.md (the figures with their numbers). Reads metrics.jsonl, config.json, meta.json and
    reports/*.json only: it works on a run whose checkpoints were deleted, and never loads a model."""
    from cemtool.plots.style import check_size, output, parse_formats  # start-up: matplotlib

    try:
        exts = parse_formats(formats)
        check_size(size)
    except CemtoolError as e:
        raise typer.BadParameter(f"{e.message} ({e.hint})", param_hint="--format" if "format" in e.message
                                 else "--size") from None
    with output(exts, size):
        _plot(paths, out, each_run, quiet, json_, exts)


def _plot(paths: list[Path], out: Path | None, each_run: bool, quiet: bool, json_: bool, exts: tuple[str, ...]):
    from cemtool.plots.render import render_all, render_sweep  # start-up: matplotlib

    problems: list[str] = []
    if len(paths) == 1:
        if out is not None:
            raise typer.BadParameter("--out is for several paths; one run or sweep is drawn into itself",
                                     param_hint="--out")
        written = render_all(paths[0], problems, each_run=each_run)
    else:
        if out is None:
            raise typer.BadParameter("several paths are drawn together into one folder: give --out",
                                     param_hint="--out")
        for p in paths:
            if not p.is_dir():
                raise CemtoolError(f"{p} does not exist or is not a directory")
            if not is_run(p):
                what = "a Hugging Face model directory" if is_hf_dir(p) else "no config.json"
                raise CemtoolError(f"{p} is not a cemtool run ({what})",
                                   hint="several paths must be runs; plot a sweep folder on its own")
        if out.exists() and not out.is_dir():
            raise CemtoolError(f"--out {out} exists and is not a directory")
        if is_run(out) or is_hf_dir(out):
            raise CemtoolError(f"--out {out} is a run or model directory",
                               hint="choose a new folder for the combined report")
        out.mkdir(parents=True, exist_ok=True)
        written = render_sweep(out, list(paths), each_run=each_run, problems=problems,
                               title=f"Comparison of {len(paths)} runs")
    figures = [p for p in written if p.suffix == ".png"]
    reports = [p for p in written if p.name == "report.md"]
    others = [e for e in exts if e != "png"]
    if json_:
        console.print_json({"figures": [str(p) for p in figures], "formats": list(exts),
                            **{e: [str(p.with_suffix(f".{e}")) for p in figures] for e in others},
                            "reports": [str(p) for p in reports], "problems": problems})
    else:
        also = f"  (+ {', '.join('.' + e for e in others)})" if others else ""
        if not quiet:
            for p in figures:
                console.result(f"figure  {p}{also}")
        for p in reports:
            console.result(f"report  {p}")
        if not quiet:
            console.result(f"{len(figures)} figures ({' + '.join(e.upper() for e in exts)}), {len(reports)} report.md")
    if problems:
        more = f" (and {len(problems) - 1} more: see report.md)" if len(problems) > 1 else ""
        raise CemtoolError(problems[0] + more, hint="every other figure and report.md was written")
