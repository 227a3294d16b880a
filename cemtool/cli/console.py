"""The one place that prints: results on stdout, progress and diagnostics on stderr."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from cemtool.errors import CemtoolError
from cemtool.writes import to_json_value

# without a terminal (pipes, files, CI logs) rich would wrap tables at 80 columns; tables are wider than that (and
# :func:`table` widens the console to a table's natural width, so that no row is ever folded)
_WIDTH = None if sys.stdout.isatty() else 200
# under torchrun only rank 0 prints results and progress; errors are printed by every rank (error_line)
QUIET_RANK = int(os.environ.get("RANK", "0") or 0) > 0
out = Console(highlight=False, soft_wrap=True, width=_WIDTH, quiet=QUIET_RANK)
err = Console(stderr=True, highlight=False, soft_wrap=True, quiet=QUIET_RANK)

DEBUG = os.environ.get("CEMTOOL_DEBUG", "") not in ("", "0")


def error_line(e: BaseException) -> None:
    """``Error: <message>`` (and a hint line) on stderr."""
    if isinstance(e, CemtoolError):
        msg = e.message
        hint = e.hint
    else:
        msg, hint = f"internal error ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})", \
            "set CEMTOOL_DEBUG=1 for the traceback and report it"
    # plain write: rich markup must not eat brackets in paths or values
    sys.stderr.write(f"Error: {msg}\n")
    if hint:
        sys.stderr.write(f"Hint: {hint}\n")
    sys.stderr.flush()


def error_line_plain(text: str) -> None:
    """A line on stderr as it is (after an error line: the usage of a command)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def info(msg: str, quiet: bool = False) -> None:
    if not quiet:
        err.print(msg, markup=False)


def result(msg: str) -> None:
    out.print(msg, markup=False)


def print_json(obj: Any) -> None:
    """``obj`` as strict JSON on stdout: numpy/torch values as numbers and lists, NaN and ±inf as null, objects
    JSON does not know as their string (:func:`cemtool.runs.to_json_value`)."""

    sys.stdout.write(json.dumps(to_json_value(obj, unknown_as_str=True), indent=2, allow_nan=False) + "\n")
    sys.stdout.flush()


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    """A table on stdout; every string is shown as it is (plain Text: no rich markup, so brackets in labels such as
    ``baseline[model.mlp_hidden=224]`` survive). A table wider than the terminal (or than 200 columns without one)
    is printed at its natural width, one line per row, never folded into the terminal's width: a terminal wraps
    the long lines, ``less -S`` scrolls them, and a pipe gets whole rows."""
    t = Table(title=None if title is None else Text(title), show_lines=False)
    for c in columns:
        t.add_column(Text(str(c)), overflow="fold", no_wrap=True)
    for r in rows:
        t.add_row(*[Text("" if v is None else str(v)) for v in r])
    natural = out.measure(t, options=out.options.update_width(100_000)).maximum
    width = out.width
    out.width = max(width, natural)  # Console.print(width=) can only narrow
    try:
        out.print(t)
    finally:
        out.width = width


def progress(quiet: bool = False) -> Progress:
    """A rich progress bar on stderr with rate and ETA (disabled when quiet)."""
    return Progress(TextColumn("{task.description}", style="bold", markup=False), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[status]}", markup=False),
                    TimeElapsedColumn(), TextColumn("eta"),
                    TimeRemainingColumn(), console=err, disable=quiet, transient=False)
