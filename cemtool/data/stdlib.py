"""The ``stdlib`` and ``stdlib-core`` sources: the Python standard library's own source files, real code and
docstrings that ship offline with every CPython (METHODS: a real-text source large enough for 20 tokens per
parameter at one epoch).

- ``stdlib``: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (the test suites included), outside
  ``site-packages``/``dist-packages`` (what is installed there is not the standard library) and ``__pycache__``.
  On CPython 3.11.7: 1,790 files, 31.5 MB, about 12.2M tokens at a 1,024-token BPE.
- ``stdlib-core``: the same without the test suites (folders named ``test``, ``tests``, ``idle_test``): 734 files,
  12.1 MB, about 4.6M tokens at a 1,024-token BPE. Distributions that strip ``test`` give both the same files.

The split is by file, not by byte offset: a file is held out when the first 8 hex digits of the SHA-256 of its
path (relative to the library, POSIX form) read as an integer fall below ``val_fraction`` of 16**8. Validation is
then a random sample of modules from the same distribution, the same on every machine with the same files (the
end of a sorted file list would hold out ``xml``, ``zipfile`` and ``zoneinfo`` only). A file that is not UTF-8 text
(CPython's own tests of source encodings: 4 files on 3.11.7) is left out and named in the corpus info
(``skipped``), never silently. The text changes between Python versions: ``info`` carries the version, the file
count and a SHA-256 of the corpus, so numbers are comparable where those agree. The builder (tokenizing into the
memory-mapped cache) is in :mod:`cemtool.data.corpus`, beside the other text sources.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

from cemtool.errors import CemtoolError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
HASH_SPACE = 16 ** 8


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def library_files(root: Path, tests: bool) -> list[Path]:
    """The library's ``*.py`` regular files in sorted order (symbolic links and excluded folders left out)."""
    skip = EXCLUDED_DIRS if tests else EXCLUDED_DIRS | TEST_DIRS
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if set(rel.parts[:-1]) & skip or p.is_symlink() or not p.is_file():
            continue
        out.append(p)
    return out


def held_out(rel: str, val_fraction: float) -> bool:
    """Whether the file at library-relative path ``rel`` is in the validation split."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) < val_fraction * HASH_SPACE


def read_library(root: Path, files: list[Path], val_fraction: float) -> tuple[dict[str, list[str]], dict]:
    """The texts of each split and the corpus facts (counts, bytes, SHA-256 over names, sizes and bytes)."""
    texts: dict[str, list[str]] = {"train": [], "val": []}
    h = hashlib.sha256()
    skipped, sizes = [], {"train": 0, "val": 0}
    for f in files:
        rel = f.relative_to(root).as_posix()
        raw = f.read_bytes()
        try:
            if b"\x00" in raw:
                raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        h.update(f"{rel}\0{len(raw)}\0".encode() + raw)
        split = "val" if held_out(rel, val_fraction) else "train"
        texts[split].append(text)
        sizes[split] += len(raw)
    if not texts["train"] or not texts["val"]:
        raise CemtoolError(f"the standard library at {root} has too few readable .py files for a train/validation "
                           f"split ({len(texts['train'])} / {len(texts['val'])})",
                           hint="use data.source=pydoc or a text folder")
    info = {"python": platform.python_version(), "root": str(root), "sha256": h.hexdigest(),
            "files": {k: len(v) for k, v in texts.items()}, "bytes": sizes, "skipped": skipped}
    return texts, info
