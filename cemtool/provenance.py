"""What every run and report records of where it came from: the versions, the source commit, the time."""

from __future__ import annotations

import datetime as _dt
import functools
import platform
import subprocess
from pathlib import Path

import cemtool


def versions() -> dict[str, str]:
    import numpy  # start-up: torch, for its version, only when a record is written (cemtool plot reads only)
    import torch


    out = {"cemtool": cemtool.__version__, "python": platform.python_version(), "torch": torch.__version__,
           "numpy": numpy.__version__, "platform": platform.platform()}
    return out


@functools.cache
def git_commit() -> str | None:
    """Commit of the cemtool source tree, if it is a git checkout (with '+dirty' for local changes). Asked once
    per process, the first time a record is written: the code a process runs is what it imported, so later edits to
    the tree do not change it (and a sweep's items do not each pay two git calls)."""
    src = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


__all__ = ["git_commit", "now", "versions"]
