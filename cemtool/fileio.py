"""Reading the files of runs, studies, configs, reports and token data: regular files only, bounded.

The one way cemtool opens a file it reads (docs/reliability.md, "Reading files"):

- :func:`open_regular` opens without blocking (``O_NONBLOCK``: a FIFO planted as ``meta.json`` would otherwise
  wait for a writer for ever) and refuses, with one line, anything ``fstat`` does not call a regular file (a
  FIFO, socket, device or folder);
- :func:`read_bytes` reads such a file whole, at most ``MAX_FILE_BYTES``;
- :func:`loads_json` parses JSON nested at most ``MAX_DEPTH`` levels (counted on the text before parsing, so a
  100,000-level file is refused without recursing); :func:`loads_toml` the same for TOML;
- :func:`read_json` and :func:`read_jsonl` combine them (a .jsonl line is at most ``MAX_LINE_BYTES``; a bad line
  is skipped with a note).

Depends on nothing of cemtool but its errors, so that ``config``, ``runs`` and ``data`` all use it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from itertools import accumulate
from pathlib import Path
from typing import Any

from cemtool.errors import CemtoolError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_FILE_BYTES = 256 << 20  # a JSON/TOML file read whole (a large tokenizer.json is tens of MiB)
MAX_LINE_BYTES = 1 << 20  # one line of a .jsonl file
MAX_DEPTH = 100  # nesting of [] and {} in a parsed file (cemtool's own files nest less than 20)


class DepthError(ValueError):
    """Text nested deeper than MAX_DEPTH (a ValueError, as a JSON syntax error is)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def open_regular(path: str | Path, what: str = "file") -> int:
    """A read-only file descriptor of ``path`` if it is a regular file (a link to one is followed). Never blocks:
    a FIFO, socket, device or folder is refused with a one-line CemtoolError naming the path. A missing file
    raises FileNotFoundError (the caller says what that means); any other OSError is a one-line error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CemtoolError(f"cannot read {what} {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CemtoolError(f"{what} {path} is {_kind(mode)}, not a regular file: cemtool reads only regular files",
                           hint="remove it, or replace it by the file it should be")
    return fd


def check_regular(path: str | Path, what: str = "file") -> None:
    """Refuse ``path`` unless it is a regular file (see :func:`open_regular`), before a library opens it by name
    (safetensors, a memory map)."""
    os.close(open_regular(path, what))


def read_bytes(path: str | Path, what: str = "file", limit: int | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (default MAX_FILE_BYTES): a larger file is a
    one-line error, not read."""
    limit = MAX_FILE_BYTES if limit is None else limit
    fd = open_regular(path, what)
    try:
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(limit + 1)
    except OSError as e:
        raise CemtoolError(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > limit:
        raise CemtoolError(f"{what} {path} is larger than {limit:,} bytes: not read",
                           hint="is it the file it should be?")
    return data


# --------------------------------------------------------------------------------------------------------------
# bounded parsing

_TOML_SKIP = re.compile(rb'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|\'[^\'\n]*\'|#[^\n]*')
_PLAIN_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_DELTA = tuple(1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256))


def _json_outside_strings(data: bytes) -> bytes:
    """The JSON text outside its strings: once escaped backslashes and quotes are dropped, every other quote
    delimits a string (linear; an unterminated string's brackets count, in text json.loads refuses anyway)."""
    return _PLAIN_STRING.sub(b"", data.replace(b"\\\\", b"").replace(b'\\"', b""))


def _toml_outside_strings(data: bytes) -> bytes:
    return _TOML_SKIP.sub(b"", data)


def nesting(data: bytes, outside=_json_outside_strings) -> int:
    """How deeply [] and {} nest in ``data`` outside its strings (``outside``: JSON's or TOML's rule), without
    parsing it. At most MAX_DEPTH brackets in all are returned as their number (a bound: enough to know the limit
    holds)."""
    brackets = outside(data).translate(None, _NOT_BRACKET)
    if len(brackets) <= MAX_DEPTH:
        return len(brackets)
    if len(brackets) > _CHUNK:  # many brackets: the running sum in numpy, chunk by chunk (flat memory)
        return _numpy_nesting(brackets)
    return max(accumulate(map(_DELTA.__getitem__, brackets)), default=0)


_CHUNK = 1 << 22


def _numpy_nesting(brackets: bytes) -> int:
    # start-up: numpy (about 45 ms) loads only for a file with very many brackets (config loads this module)
    import numpy as np

    delta, ids = np.array(_DELTA, dtype=np.int8), np.frombuffer(brackets, np.uint8)
    top = level = 0
    for i in range(0, len(ids), _CHUNK):
        run = np.cumsum(delta[ids[i:i + _CHUNK]], dtype=np.int64) + level
        top, level = max(top, int(run.max())), int(run[-1])
    return top


def _check_depth(data: bytes, outside) -> None:
    if nesting(data, outside) > MAX_DEPTH:
        raise DepthError(f"nested deeper than {MAX_DEPTH} levels")


def loads_json(data: str | bytes) -> Any:
    """json.loads of a str or of UTF-8 bytes, refusing text nested deeper than MAX_DEPTH (DepthError) before
    parsing it. Raises ValueError (JSONDecodeError, DepthError, UnicodeDecodeError) for anything else."""
    raw, text = (data.encode("utf-8", "surrogatepass"), data) if isinstance(data, str) else (data, data.decode())
    _check_depth(raw, _json_outside_strings)
    try:
        return json.loads(text)
    except RecursionError:  # not reached below MAX_DEPTH; kept so that no parse can end in a RecursionError
        raise DepthError(f"nested deeper than {MAX_DEPTH} levels") from None


def loads_toml(text: str) -> Any:
    """tomllib.loads with the same depth bound (arrays and inline tables; tomllib recurses into them)."""
    _check_depth(text.encode("utf-8", "surrogatepass"), _toml_outside_strings)
    try:
        return tomllib.loads(text)
    except RecursionError:
        raise DepthError(f"nested deeper than {MAX_DEPTH} levels") from None


def _why(e: Exception) -> str:
    return str(e).splitlines()[0][:120] if str(e) else type(e).__name__


def read_json(path: str | Path, what: str) -> Any:
    """The JSON value of a regular file of at most MAX_FILE_BYTES, nested at most MAX_DEPTH: one-line errors for a
    missing, special, oversized, non-UTF-8, malformed or too deeply nested file."""
    try:
        data = read_bytes(path, what)
    except FileNotFoundError:
        raise CemtoolError(f"{what} {path} is missing") from None
    try:
        return loads_json(data)
    except ValueError as e:  # JSONDecodeError, DepthError, UnicodeDecodeError
        raise CemtoolError(f"{what} {path} is corrupt ({_why(e)})") from None


def read_jsonl(path: str | Path, skipped: list[str] | None = None) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line; [] if the file does not exist. A line that is not a JSON
    object (cut by a kill, garbage, invalid UTF-8, nested too deeply, longer than MAX_LINE_BYTES) is skipped, with
    a note appended to ``skipped`` if given. A path that is not a regular file is an error, or with ``skipped``
    given a note and no rows (so that one planted FIFO does not hide every other run of a listing)."""
    p = Path(path)
    try:
        fd = open_regular(p, "file")
    except FileNotFoundError:
        return []
    except CemtoolError as e:
        if skipped is None:
            raise
        skipped.append(f"{p.name} skipped ({e.message})")
        return []
    rows = []
    with os.fdopen(fd, "rb") as f:
        i = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            i += 1
            why = None
            if len(raw) > MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):  # the rest of the long line
                    raw = f.readline(MAX_LINE_BYTES)
                row, why = None, f"longer than {MAX_LINE_BYTES:,} bytes"
            elif not raw.strip():
                continue
            else:
                row, why = _parse_line(raw)
            if isinstance(row, dict):
                rows.append(row)
            elif skipped is not None:
                skipped.append(f"{p.name} line {i} skipped ({why})")
    return rows


def _parse_line(raw: bytes) -> tuple[Any, str]:
    try:
        return loads_json(raw), "not a JSON object"
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except DepthError as e:
        return None, str(e)
    except json.JSONDecodeError:
        return None, "not JSON"
