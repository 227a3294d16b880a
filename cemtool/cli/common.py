"""Shared CLI plumbing: error guarding and option types."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import typer
from typer.exceptions import TyperException

from cemtool.cli.console import DEBUG, error_line, error_line_plain
from cemtool.errors import CemtoolError, UsageError


def guarded(fn: Callable) -> Callable:
    """Turn cemtool errors into one line and exit 1; usage errors stay Click's (exit 2), and so does a bad option
    value cemtool refuses itself (:class:`cemtool.errors.UsageError`: one line, exit 2); Ctrl-C exits 130.
    An OSError that reaches here (a file that cannot be read or written) is a user error too: one line naming the
    path and the cause."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        held = len(_HELD)
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, TyperException):  # usage errors: Click's message, exit 2
            raise
        except CemtoolError as e:
            error_line(e)
            if isinstance(e, UsageError):
                usage_line(getattr(fn, "command_name", fn.__name__.replace("_", "-")))
                raise typer.Exit(2) from None
            raise typer.Exit(1) from None
        except OSError as e:
            if DEBUG:
                raise
            error_line(os_error_line(e))
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            error_line(CemtoolError("interrupted"))
            raise typer.Exit(130) from None
        except Exception as e:
            if DEBUG:
                raise
            error_line(e)
            raise typer.Exit(1) from None
        finally:
            while len(_HELD) > held:  # the shared locks this command took (hold_run)
                _HELD.pop().unlock()

    return wrapper


def usage_line(command: str) -> None:
    """After a :class:`UsageError`'s line: where the command's usage is, as Click's usage errors say."""
    cmd = f"cemtool {command}" if command else "cemtool"
    error_line_plain(f"Usage: {cmd} [OPTIONS] ...  (`{cmd} -h` lists them)")


def os_error_line(e: OSError) -> CemtoolError:
    """'<cause>: <path>' for an OSError, e.g. 'No space left on device: runs/x/meta.json'."""
    cause = e.strerror or str(e) or type(e).__name__
    where = f": {e.filename}" if e.filename else ""
    return CemtoolError(f"{cause}{where}" + (f" -> {e.filename2}" if e.filename2 else ""))


_HELD: list = []  # the runs whose shared lock a running command holds (see hold_run)


def hold_run(path: Any) -> None:
    """An analysis takes the run's shared lock before loading it and holds it until the command ends (released by
    :func:`guarded`): several analyses may read a run at once, but ``train --force`` cannot move it aside
    meanwhile (refused), and a run being trained is not measured (refused too). Nothing for a path that is not a
    cemtool run (a Hugging Face model)."""
    from cemtool.runs import lock_for_reading  # start-up: loaded when the command runs (docs/performance.md)

    run = lock_for_reading(path)
    if run is not None:
        _HELD.append(run)


def guarded_call(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with :func:`guarded`'s error handling, for the app's own options (outside any
    command: a usage error names ``cemtool -h``)."""
    def call() -> Any:
        return fn(*args, **kwargs)

    call.command_name = ""  # type: ignore[attr-defined]
    return guarded(call)()
