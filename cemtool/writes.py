"""Writing the files of runs, studies and reports: atomically (a temporary file and a rename), never through a
symbolic link inside a run directory, under checked names, as strict JSON (null for non-finite numbers).

Reading is :mod:`cemtool.fileio`; what a run directory is, :mod:`cemtool.layout`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any

from cemtool.errors import CemtoolError
from cemtool.layout import is_hf_dir, is_run


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` through a new temporary file in the same folder and a rename: a crash leaves the old file or
    the new one, never half of one. The temporary file is created exclusively (a planted symlink is never
    followed) and removed again if writing fails (disk full, read-only folder); the error names the path and the
    cause. A symlinked subfolder of a run directory is refused (see :func:`refuse_symlinked_dirs`)."""
    path = Path(path)
    refuse_symlinked_dirs(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise os_error(e, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if flush_to_disk():
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise os_error(e, path) from None
        raise


TMP_SUFFIX = ".tmp"


def flush_to_disk() -> bool:
    """Whether a write waits for its bytes to reach the disk (fsync) before the rename: yes unless
    ``CEMTOOL_FSYNC=0``. Without it the rename still makes a write atomic against a crash or a kill of the process
    (the old file or the new one); only a power cut or a kernel crash may then leave a file empty or short. The
    test suite sets it (tests/kit.py): no test can cut the power, and its ~3,000 writes waited ~8 ms each for the
    disk of the development machine."""
    return os.environ.get("CEMTOOL_FSYNC", "1") != "0"


_TMP_PID = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$|^\..+\.tmp(\d+)$")  # new and pre-0.x temporary names


def os_error(e: OSError, path: Path | str, doing: str = "write") -> CemtoolError:
    """An OSError as a one-line user error naming the path and the cause (e.g. 'No space left on device')."""
    cause = e.strerror or str(e) or type(e).__name__
    hint = {errno.ENOSPC: "free some disk space, or write the run elsewhere",
            errno.EROFS: "the folder is on a read-only file system: choose another output folder",
            errno.EACCES: "check the folder's permissions, or choose another output folder",
            errno.EDQUOT: "the disk quota is exhausted"}.get(e.errno)
    return CemtoolError(f"cannot {doing} {path}: {cause}", hint=hint)


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files that a killed writer left in ``folder`` (its process no longer exists);
    return them."""
    removed = []
    try:
        entries = list(Path(folder).iterdir()) if not Path(folder).is_symlink() else []
    except OSError:
        return removed
    for p in entries:
        m = _TMP_PID.match(p.name)
        if m is None or _alive(int(m.group(1) or m.group(2))):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                continue
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def refuse_symlinked_dirs(path: Path) -> None:
    """Refuse to write ``path`` if one of the folders it lies in is a symbolic link that sits inside a run
    directory (``reports/``, ``checkpoints/``, ``plots/`` ...): a planted link would send writes, and checkpoint
    pruning's deletions, outside the run. The run directory itself may be a link."""
    for d in list(Path(path).parents)[:3]:
        if d.is_symlink() and (is_run(d.parent) or is_hf_dir(d.parent)):  # a model directory holds reports too
            raise CemtoolError(f"{d} is a symbolic link: cemtool does not follow links inside a run directory",
                               hint="replace the link by a real folder")


def safe_name(name: str, what: str = "report name") -> str:
    """``name`` if it is a plain file name that stays inside its folder: letters, digits and ``_ . + = -``, not
    starting with a dot or a dash, at most 100 characters. Every user-given report or figure name goes through
    it (``--name ../../escape`` is refused with a one-line error)."""
    if not isinstance(name, str) or len(name) > 100 or not _SAFE_NAME.fullmatch(name):
        raise CemtoolError(f"{what} {name!r} is not a plain name",
                           hint="use letters, digits and - _ . + = (no path separators, not starting with . or -), "
                                "at most 100 characters")
    return name


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON (RFC 8259, readable by every parser): NaN and ±inf, also inside numpy or torch
    scalars and arrays, are written as null (see :func:`to_json_value`)."""
    atomic_write_text(path, json.dumps(to_json_value(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def to_json_value(o: Any, unknown_as_str: bool = False) -> Any:
    """``o`` as plain JSON values (dict, list, str, int, finite float, bool, None), recursively: numpy/torch
    scalars and arrays become Python numbers and lists, tuples lists, paths strings, and every non-finite float
    None. Other types raise TypeError, or become their ``str`` with ``unknown_as_str`` (what the console prints).
    The one JSON sanitiser (reports, metrics, the console); also usable as ``json.dumps(default=...)``."""
    if o is None or isinstance(o, (str, bool, int)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: to_json_value(v, unknown_as_str) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_json_value(v, unknown_as_str) for v in o]
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # numpy / torch scalars and arrays (a 0-d array's tolist() is a scalar)
        return to_json_value(o.tolist(), unknown_as_str)
    if hasattr(o, "item"):
        return to_json_value(o.item(), unknown_as_str)
    if unknown_as_str:
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


__all__ = ["TMP_SUFFIX", "atomic_write_bytes", "atomic_write_json", "atomic_write_text", "clean_stale_temps",
           "os_error", "refuse_symlinked_dirs", "safe_name", "to_json_value"]
