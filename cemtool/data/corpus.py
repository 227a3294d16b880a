"""Corpora: token streams with a held-out validation split, and the batches cut from them.

A source name maps to a builder (:func:`register_source`); the built-ins are

- ``grammar``: the probabilistic-grammar corpus (``cemtool.data.grammar``) with its exact entropy floor,
- ``pydoc``: Python's own documentation (``pydoc_data.topics``), real English that ships with every Python,
- ``stdlib`` / ``stdlib-core``: the standard library's source files, with and without its test suites
  (``cemtool.data.stdlib``: 12.2M / 4.6M BPE-1024 tokens on CPython 3.11.7, split by file),
- a path: a ``.txt`` file or a folder of them, tokenized in a streaming pass into a memory-mapped cache.

Later synthetic tasks (associative recall, copying, n-grams on white noise) register further sources.
Windows: training batches are drawn afresh at every step from (seed, step) alone, so a resumed run sees the same
batches, and a distributed run splits the very same global batch across ranks. Corpora whose text is a sequence
of independent sentences give ``starts``: windows then begin at a sentence start, which makes the exact
per-token conditional entropy the true floor of the loss (no window starts mid-sentence).
"""

from __future__ import annotations

import hashlib
import math
import os
import pydoc_data.topics as topics
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

import cemtool.data.synthetic  # noqa: F401  (registers the "ngram" source)
from cemtool.config import DataConfig
from cemtool.data import stdlib
from cemtool.data.grammar import GRAMMAR_VERSION, GRAMMARS
from cemtool.data.source import Corpus, register_source, source_builder, sources
from cemtool.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe, word_tokenizer
from cemtool.data.tokens import hf_tokenizer, is_token_source, is_tokenizer_file, token_corpus
from cemtool.errors import CemtoolError, did_you_mean
from cemtool.fileio import check_regular, open_regular

CHUNK_BYTES = 1 << 20


def bits_per_byte(nats_per_token: float | None, bytes_per_token: float | None) -> float | None:
    """A loss in nats per token as bits per byte of text: comparable across tokenizers. None if either is unknown."""
    if nats_per_token is None or not bytes_per_token or not math.isfinite(nats_per_token):
        return None
    return nats_per_token / (math.log(2) * bytes_per_token)


def run_bits_per_byte(run, nats_per_token: float | None) -> float | None:
    """Bits per byte of a loss measured on a run's validation text; ``run``: a Run or its meta.json dict, whose
    ``bytes_per_token`` training wrote (None for runs from before it did)."""
    meta = run if isinstance(run, dict) else run.meta()
    return bits_per_byte(nats_per_token, meta.get("bytes_per_token"))


def perplexity(nats_per_token: float | None) -> float | None:
    """exp(loss); None when unknown or too large to be a finite number."""
    if nats_per_token is None or not math.isfinite(nats_per_token) or nats_per_token > 700:
        return None
    return math.exp(nats_per_token)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (n, T) int64 for windows beginning at ``starts``."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]  # (n, T+1)
    block = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))  # (n, T+1)
    return block[:, :-1], block[:, 1:]


def batch_starts(corpus: Corpus, seq_len: int, batch_size: int, seed: int, step: int,
                 micro: int = 0) -> np.ndarray:
    """Window starts of the global batch for (seed, step, micro-batch): a pure function, so resume and DDP
    reproduce it exactly."""
    rng = np.random.Generator(np.random.PCG64([seed, step, micro, 0x5EED]))
    if corpus.train_starts is None:
        return rng.integers(0, len(corpus.train) - seq_len - 1, size=batch_size, endpoint=True)
    ok = corpus.train_starts
    ok = ok[: np.searchsorted(ok, len(corpus.train) - seq_len - 1, side="right")]
    return ok[rng.integers(0, len(ok), size=batch_size)]


# --------------------------------------------------------------------------------------------------------------
# sources (registered in cemtool.data.source)


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    """Build the corpus named by ``cfg.source`` (a registered name or a path). ``tokenizer``: reuse a run's."""
    builder = source_builder(cfg.source)
    if builder is not None:
        corpus = builder(cfg, tokenizer)
    elif is_token_source(cfg.source):
        corpus = token_corpus(cfg, tokenizer)
    else:
        corpus = text_corpus(cfg, tokenizer)
    corpus.check_seq_len(cfg.seq_len)
    return corpus


def _grammar(cfg: DataConfig, tokenizer: Tokenizer | None, name: str = "grammar") -> Corpus:
    if cfg.tokenizer not in ("auto", "word"):
        raise CemtoolError(f"data.tokenizer={cfg.tokenizer!r} does not apply to the {name} corpus",
                           hint="it has its own word vocabulary; use data.tokenizer=auto or word")
    g = GRAMMARS[name]()
    ids = {w: i for i, w in enumerate(g.vocab)}
    if tokenizer is not None and (tokenizer.kind != "word" or tokenizer.hf.get_vocab() != ids):
        raise CemtoolError(f"the {name} corpus cannot be read with this {tokenizer.kind} tokenizer: its token ids "
                           f"are the grammar's own word vocabulary",
                           hint="use a run trained on a grammar corpus (word tokenizer)")
    tok = tokenizer or word_tokenizer(g.vocab)
    train = g.sample(cfg.train_tokens, seed=2 * cfg.seed)
    val = g.sample(cfg.val_tokens, seed=2 * cfg.seed + 1)
    info = {"source": name, "grammar": g.describe(), "grammar_version": GRAMMAR_VERSION,
            "train_tokens": int(len(train.tokens)), "val_tokens": int(len(val.tokens)), "tokenizer": "word"}
    return Corpus(name, tok, train.tokens, val.tokens, train.sentence_starts, val.sentence_starts,
                  val.nll, g.entropy_rate(), info)


def _pydoc_text() -> str:
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _split(ids: np.ndarray, frac: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(round(len(ids) * frac)))
    return ids[:-n_val], ids[-n_val:]


def _text_tokenizer(cfg: DataConfig, chunks: Callable[[], Iterator[str]], tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is not None:
        return tokenizer
    if is_tokenizer_file(cfg.tokenizer):
        return hf_tokenizer(cfg.tokenizer)
    kind = "bpe" if cfg.tokenizer == "auto" else cfg.tokenizer
    if kind == "word":
        raise CemtoolError("data.tokenizer=word is only for the grammar corpus", hint="use byte or bpe for text")
    return byte_tokenizer() if kind == "byte" else train_bpe(chunks(), cfg.bpe_vocab_size)


def _pydoc(cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    """Split in the text like a text corpus (the last val_fraction of the bytes); BPE sees the training text only."""
    raw = _pydoc_text().encode("utf-8")
    pieces = dict(split_text(iter([raw.decode("utf-8")]), val_cut(len(raw), cfg.val_fraction)))
    text = pieces.get("train", "")
    tok = _text_tokenizer(cfg, lambda: iter([text[i:i + CHUNK_BYTES] for i in range(0, len(text), CHUNK_BYTES)]),
                          tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    train, val = (np.asarray(tok.encode(pieces.get(split, "")), dtype=dtype) for split in ("train", "val"))
    info = {"source": "pydoc", "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
            "tokens": int(len(train) + len(val)), "tokenizer": tok.kind, "vocab_size": tok.vocab_size}
    return Corpus("pydoc", tok, train, val, info=info)


register_source("grammar", _grammar)
register_source("grammar-b", lambda cfg, tok: _grammar(cfg, tok, "grammar-b"))
register_source("grammar-hard", lambda cfg, tok: _grammar(cfg, tok, "grammar-hard"))
register_source("pydoc", _pydoc)


def _stdlib_source(cfg: DataConfig, tokenizer: Tokenizer | None, tests: bool) -> Corpus:
    name = "stdlib" if tests else "stdlib-core"
    root = stdlib.stdlib_root()
    texts, info = stdlib.read_library(root, stdlib.library_files(root, tests), cfg.val_fraction)
    tok = _text_tokenizer(cfg, lambda: iter(texts["train"]), tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    key = hashlib.sha256(f"{name}|{info['sha256']}|{cfg.val_fraction!r}|".encode()
                         + tok.to_json().encode()).hexdigest()[:24]
    paths = {split: cache_dir() / f"tokens-{key}.{split}.bin" for split in ("train", "val")}
    if not all(p.exists() for p in paths.values()):
        for split, p in paths.items():  # each file's tokens, one file after another (a document boundary is a
            tmp = p.with_suffix(f".tmp{os.getpid()}")  # file boundary; no separator token is added)
            try:
                with open(tmp, "wb") as out:
                    for text in texts[split]:
                        out.write(np.asarray(tok.encode(text), dtype=dtype).tobytes())
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            os.replace(tmp, p)
    train, val = (_memmap(paths[split], dtype) for split in ("train", "val"))
    info.update({"source": name, "train_tokens": int(len(train)), "val_tokens": int(len(val)),
                 "tokens": int(len(train) + len(val)), "tokenizer": tok.kind, "vocab_size": tok.vocab_size,
                 "cache": str(paths["train"])})
    return Corpus(name, tok, train, val, info=info)


register_source("stdlib", lambda cfg, tok: _stdlib_source(cfg, tok, tests=True))
register_source("stdlib-core", lambda cfg, tok: _stdlib_source(cfg, tok, tests=False))


# --------------------------------------------------------------------------------------------------------------
# user text: streamed, validated, memory-mapped


def text_files(source: str) -> list[Path]:
    """The .txt files of a source (a file, or a folder searched recursively, in sorted order). A broken symbolic
    link or anything that is not a regular file is refused with one line (nothing is skipped silently)."""
    p = Path(source).expanduser()
    if not p.exists():
        kind = "a broken symbolic link" if p.is_symlink() else "neither a built-in source " \
            f"({', '.join(sources())}) nor an existing file or folder"
        raise CemtoolError(f"data source {source!r} is {kind}",
                           hint=None if p.is_symlink() else did_you_mean(source, sources()))
    files = sorted(p.rglob("*.txt")) if p.is_dir() else [p]
    for f in files:
        if f.is_symlink() and not f.exists():
            raise CemtoolError(f"{f} in data folder {p} is a broken symbolic link (to {os.readlink(f)})",
                               hint="remove it or restore its target")
        if not f.is_file():
            raise CemtoolError(f"{f} in data folder {p} is not a regular file", hint="remove or rename it")
    if not files:
        raise CemtoolError(f"folder {p} holds no .txt files")
    return files


def iter_text(files: list[Path], hasher=None) -> Iterator[str]:
    """Stream the files as UTF-8 text chunks (about 1 MiB, cut at line ends); reject binary and non-UTF-8.
    ``hasher`` (a hashlib object), if given, is fed every raw byte read."""
    for f in files:
        try:
            fh = os.fdopen(open_regular(f, "data file"), "rb")
        except OSError as e:
            raise CemtoolError(f"cannot read {f}: {e.strerror}") from None
        with fh:
            offset, carry = 0, b""
            while True:
                raw = fh.read(CHUNK_BYTES)
                if not raw:
                    break
                if hasher is not None:
                    hasher.update(raw)
                if b"\x00" in raw:
                    at = offset + len(carry) + raw.index(b"\x00")
                    raise CemtoolError(f"{f} looks binary (NUL byte at offset {at})", hint="give a UTF-8 text file")
                data = carry + raw
                cut = data.rfind(b"\n") + 1 if len(raw) == CHUNK_BYTES else len(data)
                if cut == 0:
                    cut = len(data)
                chunk, carry = data[:cut], data[cut:]
                try:
                    yield chunk.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CemtoolError(f"{f} is not UTF-8 text (invalid byte at offset {offset + e.start})",
                                       hint="convert it, e.g. iconv -t utf-8") from None
                offset += len(chunk)
            if carry:
                try:
                    yield carry.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise CemtoolError(f"{f} is not UTF-8 text (invalid byte at offset {offset + e.start})") from None


def corpus_hash(files: list[Path], root: Path) -> str:
    """SHA-256 of the corpus as training reads it: each file's name (relative to the source), size and bytes, in
    order. Also validates every file (UTF-8, no NUL bytes) in the same streaming pass."""
    h = hashlib.sha256()
    for f in files:
        name = f.relative_to(root).as_posix() if root.is_dir() else f.name
        h.update(f"{name}\0{f.stat().st_size}\0".encode())
        for _ in iter_text([f], hasher=h):
            pass
    return h.hexdigest()


def split_text(chunks: Iterator[str], cut: int) -> Iterator[tuple[str, str]]:
    """("train" | "val", text) pieces of a chunk stream: the first ``cut`` bytes (moved forward to the next
    character boundary) are training text, the rest validation text."""
    offset = 0
    for chunk in chunks:
        raw = chunk.encode("utf-8")
        if offset + len(raw) <= cut:
            yield "train", chunk
        elif offset >= cut:
            yield "val", chunk
        else:
            k = cut - offset
            while k < len(raw) and (raw[k] & 0xC0) == 0x80:  # a UTF-8 continuation byte: not a boundary
                k += 1
            if k:
                yield "train", raw[:k].decode("utf-8")
            if k < len(raw):
                yield "val", raw[k:].decode("utf-8")
        offset += len(raw)


def val_cut(n_bytes: int, frac: float) -> int:
    """Bytes of training text: the last ``frac`` of the text (at least one byte) is held out."""
    return n_bytes - max(1, int(round(n_bytes * frac)))


def cache_dir() -> Path:
    d = Path(os.environ.get("CEMTOOL_CACHE", Path.home() / ".cache" / "cemtool"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def text_corpus(cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    """A text file or folder. The split is made in the text, before tokenizing: the last ``val_fraction`` of the
    bytes (cut at a character boundary) is validation, and a BPE tokenizer is trained on the training text only.
    Each split is tokenized once into a memory-mapped cache keyed by the corpus hash, split and tokenizer."""
    files = text_files(cfg.source)
    root = Path(cfg.source).expanduser()
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) == 0:
        raise CemtoolError(f"data source {cfg.source} is empty")
    digest = corpus_hash(files, root)  # validates everything before a tokenizer is trained on it
    cut = val_cut(sum(sizes), cfg.val_fraction)
    tok = _text_tokenizer(cfg, lambda: (t for split, t in split_text(iter_text(files), cut) if split == "train"),
                          tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    key = hashlib.sha256(f"{digest}|{cut}|".encode() + tok.to_json().encode()).hexdigest()[:24]
    paths = {split: cache_dir() / f"tokens-{key}.{split}.bin" for split in ("train", "val")}
    if not all(p.exists() for p in paths.values()):
        tmps = {split: p.with_suffix(f".tmp{os.getpid()}") for split, p in paths.items()}
        try:
            with open(tmps["train"], "wb") as out_train, open(tmps["val"], "wb") as out_val:
                outs = {"train": out_train, "val": out_val}
                for split, text in split_text(iter_text(files), cut):
                    outs[split].write(np.asarray(tok.encode(text), dtype=dtype).tobytes())
        except BaseException:
            for t in tmps.values():
                t.unlink(missing_ok=True)
            raise
        for split in ("val", "train"):
            os.replace(tmps[split], paths[split])
    train, val = (_memmap(paths[split], dtype) for split in ("train", "val"))
    if len(train) + len(val) < 2:
        raise CemtoolError(f"data source {cfg.source} holds fewer than 2 tokens")
    info = {"source": str(root.resolve()), "files": len(files), "bytes": int(sum(sizes)), "sha256": digest,
            "train_bytes": cut, "val_bytes": int(sum(sizes)) - cut, "tokens": int(len(train) + len(val)),
            "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "cache": str(paths["train"])}
    return Corpus(Path(cfg.source).name, tok, train, val, info=info)


def _memmap(path: Path, dtype) -> np.ndarray:
    """A read-only memory map of a token file (an empty file gives an empty array: np.memmap refuses those)."""
    check_regular(path, "token cache file")
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


__all__ = ["Corpus", "batch_starts", "bits_per_byte", "load_corpus", "load_tokenizer", "perplexity",
           "register_source", "run_bits_per_byte", "sources", "windows"]
