"""Pretokenised token files, memory-mapped: nanoGPT-style flat ``.bin`` and NumPy ``.npy`` arrays.

- ``name.bin``: raw little-endian token ids and nothing else (what nanoGPT's ``prepare.py`` writes), of
  ``data.token_dtype``: uint16 or uint32; ``auto`` (the default) reads uint16, nanoGPT's, unless the vocabulary
  has over 65,536 ids, which uint16 cannot hold, then uint32.
- ``name.npy``: a one-dimensional NumPy array of integer ids (any other shape is refused, never flattened); its
  dtype comes from its header. Loaded with ``allow_pickle=False``: an object array is refused, nothing is ever
  unpickled.
- a folder holding ``train.bin`` (or ``train.npy``) and optionally ``val.bin`` (``val.npy``), nanoGPT's layout:
  the val file is the validation split; without one the last ``data.val_fraction`` of train is held out.

Nothing is read whole. The files are memory-mapped, and the one full pass, which checks that every id lies in the
vocabulary and hashes the ids (``corpus.sha256``: a resumed run refuses changed data, as for text), reads fixed-size
chunks into one buffer, so memory stays flat in the size of the corpus (``benchmarks/token_memory.py`` measures it).

The vocabulary the ids are checked against: the tokenizer that is given (a run's, when an analysis reloads its
data), else ``data.tokenizer`` as the path of a Hugging Face ``tokenizer.json`` (the one the files were made
with, e.g. GPT-2's), else ``byte`` (256 ids), else (``auto``) ids alone: a tokenizer whose token i is the text
``<i>``, sized max id + 1 (set ``model.vocab_size`` for a larger embedding, e.g. nanoGPT's 50304); an id of
``config.MAX_VOCAB`` or more is refused there (a wrong dtype, or not token ids), as any size field above it is.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from numpy.lib import format as npformat
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from cemtool.config import MAX_VOCAB, DataConfig
from cemtool.data.source import Corpus
from cemtool.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer
from cemtool.errors import CemtoolError
from cemtool.fileio import open_regular, read_json

TOKEN_SUFFIXES = (".bin", ".npy")
SCAN_TOKENS = 1 << 22  # ids per chunk of the vocabulary check (8 MiB of uint16)


def is_token_source(source: str) -> bool:
    """A .bin/.npy file, or a folder holding train.bin or train.npy."""
    p = Path(source).expanduser()  # exists(), not is_file(): a FIFO named train.bin is refused by open_tokens
    if p.exists() and not p.is_dir():
        return p.suffix.lower() in TOKEN_SUFFIXES
    return p.is_dir() and any((p / f"train{s}").exists() for s in TOKEN_SUFFIXES)


def token_files(source: str) -> tuple[Path, Path | None]:
    """(train file, val file or None) of a token source."""
    p = Path(source).expanduser()
    if not p.is_dir():
        return p, None
    for s in TOKEN_SUFFIXES:
        if (p / f"train{s}").exists():
            val = p / f"val{s}"
            return p / f"train{s}", val if val.exists() else None
    raise CemtoolError(f"folder {p} holds neither train.bin nor train.npy")


# --------------------------------------------------------------------------------------------------------------
# one file


def open_tokens(path: Path, token_dtype: str = "uint16") -> tuple[np.ndarray, int]:
    """Memory-map one token file read-only: ((N,) integer ids, byte offset of the first id in the file). Only a
    regular file is opened (:func:`cemtool.fileio.open_regular`); a malformed file is a one-line error."""
    with os.fdopen(open_regular(path, "token file"), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if path.suffix.lower() == ".npy":
            dtype, count, offset = npy_header(path, f, size)
            return map_tokens(path, dtype, offset, count), offset
        head = f.read(len(NPY_MAGIC))
    if head == NPY_MAGIC:
        raise CemtoolError(f"{path} is a NumPy .npy file, not a flat token file", hint="name it .npy")
    dtype = np.dtype(token_dtype).newbyteorder("<")
    if size % dtype.itemsize:
        raise CemtoolError(f"{path} has {size:,} bytes, not a multiple of {dtype.itemsize} ({token_dtype}): it is "
                           f"not a flat {token_dtype} token file",
                           hint="set data.token_dtype to the dtype it was written with (nanoGPT: uint16)")
    if size == 0:
        raise CemtoolError(f"token file {path} is empty")
    return map_tokens(path, dtype, 0, size // dtype.itemsize), 0


NPY_MAGIC = b"\x93NUMPY"


def npy_header(path: Path, f, size: int) -> tuple[np.dtype, int, int]:
    """(dtype, number of ids, offset of the first) from the header of the .npy file ``f``, read with numpy's own
    header parser (a literal, never code); everything that is not a flat integer array wholly present in the file
    is a one-line error: another format (zip/.npz, pickle, text), a header that does not parse, an object or
    non-integer dtype, another shape, fewer bytes than the header promises."""
    def bad(why: str, hint: str = "save it with numpy.save(path, ids) from an integer array") -> CemtoolError:
        return CemtoolError(f"{path} is not a NumPy array of token ids: {why}", hint=hint)

    head = f.read(len(NPY_MAGIC))
    if head != NPY_MAGIC:
        what = ("a zip archive (a .npz?)" if head.startswith(b"PK") else "a pickle" if head[:1] == b"\x80"
                else "no .npy header")
        raise bad(f"{what}", hint="give a .npy written by numpy.save (for a .npz, save its one array with numpy.save)")
    f.seek(0)
    try:
        version = npformat.read_magic(f)
        read = {(1, 0): npformat.read_array_header_1_0, (2, 0): npformat.read_array_header_2_0}.get(version)
        if read is None:
            raise ValueError(f"format version {version[0]}.{version[1]} (cemtool reads 1.0 and 2.0)")
        shape, fortran, dtype = read(f)
    except Exception as e:  # numpy raises ValueError, SyntaxError, tokenize.TokenError... for a malformed header
        raise bad(f"its header does not parse ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"
                  ) from None
    if dtype.hasobject:
        raise bad("it holds Python objects (cemtool never unpickles)")
    if dtype.kind not in "iu":
        raise CemtoolError(f"{path} holds {dtype} values, not integer token ids")
    if len(shape) != 1:
        raise CemtoolError(f"{path} holds an array of shape {shape}, not a flat (N,) array of token ids",
                           hint="save the ids in stream order, e.g. numpy.save(path, ids.reshape(-1))")
    offset, count = f.tell(), shape[0]  # a flat array is the same bytes in C and Fortran order
    if count < 0:
        raise bad(f"its header gives a negative length {count}")
    if offset + count * dtype.itemsize > size:
        raise CemtoolError(f"{path} is shorter than its header says (truncated?): {count:,} ids of {dtype} need "
                           f"{offset + count * dtype.itemsize:,} bytes, the file has {size:,}")
    return dtype, count, offset


def map_tokens(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    """(count,) read-only ids mapped from the file at ``offset``, advised for random access: a window faults in its
    own pages only, without read-ahead, so resident memory follows the windows read, not the size of the file."""
    if count == 0:
        return np.zeros(0, dtype=dtype)
    fd = open_regular(path, "token file")
    try:
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # stays valid after the file is closed
    finally:
        os.close(fd)
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset)


def chunks(path: Path, offset: int, dtype: np.dtype, count: int) -> Iterator[tuple[int, np.ndarray]]:
    """(index of the first id, ids) over a token file, read into one reused buffer, not through the map; the pages
    read are then dropped from the page cache, so that the pass neither stays resident nor fills the cache."""
    buf = np.empty(min(SCAN_TOKENS, max(count, 1)), dtype=dtype)
    with os.fdopen(open_regular(path, "token file"), "rb") as f:
        f.seek(offset)
        done = 0
        while done < count:
            n = min(len(buf), count - done)
            got = f.readinto(buf[:n].view(np.uint8)) // dtype.itemsize
            if got < n:
                raise CemtoolError(f"{path} is shorter than its header says (truncated?)")
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), offset + done * dtype.itemsize, n * dtype.itemsize,
                                 os.POSIX_FADV_DONTNEED)
            yield done, buf[:n]
            done += n


def check_ids(path: Path, arr: np.ndarray, offset: int, limit: int | None, what: str, digest=None) -> int:
    """Read every id once in chunks; refuse negative ids and ids >= ``limit`` (one line naming the first one and
    its position). Returns the largest id; ``digest`` (a hashlib object) is updated with the dtype, count and ids."""
    hi = -1
    if digest is not None:
        digest.update(f"{arr.dtype.str}|{len(arr)}|".encode())
    for start, ids in chunks(path, offset, arr.dtype, len(arr)):
        if digest is not None:
            digest.update(ids.view(np.uint8))
        bad = (ids < 0) | (ids >= limit) if limit is not None else ids < 0
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            where = f"token id {int(ids[i])} at position {start + i:,} of {path}"
            if ids[i] < 0:
                raise CemtoolError(f"{where} is negative", hint="check data.token_dtype")
            raise CemtoolError(f"{where} is outside the vocabulary of {what} (ids 0..{limit - 1})",
                               hint="use the tokenizer the file was made with (data.tokenizer=path/to/"
                                    "tokenizer.json) or check data.token_dtype")
        hi = max(hi, int(ids.max()))
    return hi


# --------------------------------------------------------------------------------------------------------------
# tokenizers for token files


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """Ids alone: token i is the text ``<i>`` (whitespace-separated); any other text encodes to nothing, so a probe
    word is never mistaken for an id."""
    if vocab_size > MAX_VOCAB:
        raise CemtoolError(f"{vocab_size:,} token ids exceed config.MAX_VOCAB = {MAX_VOCAB:,}",
                           hint="check data.token_dtype: are these token ids?")
    vocab = {f"<{i}>": i for i in range(vocab_size)}
    hf = HFTokenizer(models.BPE(vocab, [], ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(hf, "ids")


def hf_tokenizer(path: str | Path) -> Tokenizer:
    """A Hugging Face ``tokenizer.json`` (e.g. GPT-2's) or a cemtool run's tokenizer.json, as a cemtool tokenizer."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CemtoolError(f"tokenizer file {p} does not exist", hint="data.tokenizer takes auto, word, byte, bpe or "
                                                                      "the path of a tokenizer.json")
    data = read_json(p, "tokenizer file")
    if isinstance(data, dict) and "cemtool_kind" in data:
        return load_tokenizer(p)
    try:
        return Tokenizer(HFTokenizer.from_str(json.dumps(data)), "hf")
    except Exception as e:  # tokenizers raises plain Exception
        raise CemtoolError(f"{p} is not a Hugging Face tokenizer.json: {str(e).splitlines()[0][:200]}") from None


def is_tokenizer_file(name: str) -> bool:
    return name.lower().endswith(".json")


def _named_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """The tokenizer data.tokenizer names for token files; None = ids alone (auto)."""
    if is_tokenizer_file(cfg.tokenizer):
        return hf_tokenizer(cfg.tokenizer)
    if cfg.tokenizer == "byte":
        return byte_tokenizer()
    if cfg.tokenizer == "auto":
        return None
    raise CemtoolError(f"data.tokenizer={cfg.tokenizer} does not apply to pretokenised token files",
                       hint="use auto (ids alone), byte, or the tokenizer.json the files were made with")


# --------------------------------------------------------------------------------------------------------------
# the corpus


def bin_dtype(cfg: DataConfig, vocab: int | None) -> tuple[str, str]:
    """(dtype of .bin files, why): data.token_dtype, or under auto uint16 unless the vocabulary has over 65,536
    ids (which uint16 cannot hold), then uint32."""
    if cfg.token_dtype != "auto":
        return cfg.token_dtype, "data.token_dtype"
    if vocab is not None and vocab > 1 << 16:
        return "uint32", f"auto: the vocabulary has {vocab:,} ids"
    return "uint16", "auto: nanoGPT's uint16"


def token_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None, vocab_size: int | None = None):
    """The corpus of a token source. ``tokenizer``: reuse a run's; ``vocab_size``: check the ids against this
    (a model's vocabulary) instead of the tokenizer's."""
    tok = tokenizer or _named_tokenizer(cfg)
    limit = vocab_size or (tok.vocab_size if tok is not None else None)
    what = f"size {limit}" if vocab_size else f"the {tok.kind} tokenizer" if tok is not None else ""
    dtype, dtype_from = bin_dtype(cfg, limit)
    if limit is None:  # ids alone: the vocabulary is max id + 1, bounded like any size field
        limit, what = MAX_VOCAB, f"ids alone, at most config.MAX_VOCAB = {MAX_VOCAB:,} ids"
    train_f, val_f = token_files(cfg.source)
    files = {"train": (train_f, *open_tokens(train_f, dtype))}
    if val_f is not None:
        files["val"] = (val_f, *open_tokens(val_f, dtype))
    digest = hashlib.sha256()  # the corpus hash a resumed run compares (as for text)
    hi = max(check_ids(path, arr, offset, limit, what, digest) for path, arr, offset in files.values())
    if tok is None:
        tok = id_tokenizer(hi + 1)
    train = files["train"][1]
    if val_f is not None:
        val = files["val"][1]
    elif len(train) < 2:
        raise CemtoolError(f"token file {train_f} holds fewer than 2 tokens")
    else:  # the end of the stream, as for text
        n_val = max(1, int(round(len(train) * cfg.val_fraction)))
        train, val = train[:-n_val], train[-n_val:]
    root = Path(cfg.source).expanduser()
    fmt = train_f.suffix.lower().lstrip(".")
    info = {"source": str(root.resolve()), "format": fmt, "dtype": str(train.dtype),
            "dtype_from": dtype_from if fmt == "bin" else "the .npy header", "train_file": str(train_f.resolve()),
            "val_file": str(val_f.resolve()) if val_f is not None else None,
            "val_split": "val file" if val_f is not None else f"last {cfg.val_fraction:g} of train",
            "tokens": int(len(train) + len(val)), "train_tokens": int(len(train)), "val_tokens": int(len(val)),
            "max_token_id": hi, "sha256": digest.hexdigest(), "tokenizer": tok.kind, "vocab_size": tok.vocab_size}
    return Corpus(root.name, tok, train, val, info=info)
