"""Corpora: token streams with a held-out validation split, and the batches cut from them.

A source name maps to a builder (:func:`register_source`); the built-ins are

- ``grammar``: the probabilistic-grammar corpus (``cemtool.data.grammar``) with its exact entropy floor,
- ``pydoc``: Python's own documentation (``pydoc_data.topics``), real English that ships with every Python,
- a path: a ``.txt`` file or a folder of them, tokenized in a streaming pass into a memory-mapped cache.

Later synthetic tasks (associative recall, copying, n-grams on white noise) register further sources.
Windows: training batches are drawn afresh at every step from (seed, step) alone, so a resumed run sees the same
batches, and a distributed run splits the very same global batch across ranks. Corpora whose text is a sequence
of independent sentences give ``starts``: windows then begin at a sentence start, which makes the exact
per-token conditional entropy the true floor of the loss (no window starts mid-sentence).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from cemtool.config import DataConfig
from cemtool.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe, word_tokenizer
from cemtool.errors import CemtoolError

CHUNK_BYTES = 1 << 20


@dataclass
class Corpus:
    name: str
    tokenizer: Tokenizer
    train: np.ndarray  # (N_train,) integer token ids (possibly a read-only memmap)
    val: np.ndarray  # (N_val,)
    train_starts: np.ndarray | None = None  # allowed window starts (sentence starts), None = anywhere
    val_starts: np.ndarray | None = None
    val_nll: np.ndarray | None = None  # (N_val,) exact -log p(token | its sentence prefix), nats, if known
    entropy_rate: float | None = None  # exact nats/token of the source, if known
    info: dict = field(default_factory=dict)  # provenance: source, sizes, tokenizer, generator version

    def check_seq_len(self, seq_len: int) -> None:
        for split, arr in (("training", self.train), ("validation", self.val)):
            if len(arr) < seq_len + 1:
                raise CemtoolError(f"data.seq_len={seq_len} is larger than the {split} data ({len(arr)} tokens)",
                                   hint="use a shorter data.seq_len or more data")

    def eval_windows(self, seq_len: int, n_tokens: int) -> np.ndarray:
        """Fixed, non-overlapping validation window starts covering about ``n_tokens`` target tokens."""
        n = max(1, n_tokens // seq_len)
        if self.val_starts is None:
            last = len(self.val) - seq_len - 1
            stride = seq_len
            starts = np.arange(0, last + 1, stride)
        else:
            ok = self.val_starts[self.val_starts <= len(self.val) - seq_len - 1]
            starts, end = [], -1
            for s in ok:  # greedy non-overlapping
                if s >= end:
                    starts.append(s)
                    end = s + seq_len + 1
                    if len(starts) >= n:
                        break
            starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 0:
            raise CemtoolError(f"the validation split is too small for windows of {seq_len} tokens")
        return starts[:n].astype(np.int64)

    def floor(self, starts: np.ndarray, seq_len: int) -> float | None:
        """Exact mean -log p of the target tokens of the given validation windows (the loss no model can beat)."""
        if self.val_nll is None:
            return None
        idx = starts[:, None] + 1 + np.arange(seq_len)[None, :]  # (n, T) target positions
        return float(self.val_nll[idx].mean())


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
# sources

SourceBuilder = Callable[[DataConfig, "Tokenizer | None"], Corpus]
_SOURCES: dict[str, SourceBuilder] = {}


def register_source(name: str, builder: SourceBuilder) -> None:
    _SOURCES[name] = builder


def sources() -> list[str]:
    return sorted(_SOURCES)


def load_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None) -> Corpus:
    """Build the corpus named by ``cfg.source`` (a registered name or a path). ``tokenizer``: reuse a run's."""
    from cemtool.data.tokens import is_token_source, token_corpus

    if cfg.source in _SOURCES:
        corpus = _SOURCES[cfg.source](cfg, tokenizer)
    elif is_token_source(cfg.source):
        corpus = token_corpus(cfg, tokenizer)
    else:
        corpus = text_corpus(cfg, tokenizer)
    corpus.check_seq_len(cfg.seq_len)
    return corpus


def _grammar(cfg: DataConfig, tokenizer: Tokenizer | None, name: str = "grammar") -> Corpus:
    from cemtool.data.grammar import GRAMMAR_VERSION, GRAMMARS

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
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def _split(ids: np.ndarray, frac: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(1, int(round(len(ids) * frac)))
    return ids[:-n_val], ids[-n_val:]


def _text_tokenizer(cfg: DataConfig, chunks: Callable[[], Iterator[str]], tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is not None:
        return tokenizer
    from cemtool.data.tokens import hf_tokenizer, is_tokenizer_file

    if is_tokenizer_file(cfg.tokenizer):
        return hf_tokenizer(cfg.tokenizer)
    kind = "bpe" if cfg.tokenizer == "auto" else cfg.tokenizer
    if kind == "word":
        raise CemtoolError("data.tokenizer=word is only for the grammar corpus", hint="use byte or bpe for text")
    return byte_tokenizer() if kind == "byte" else train_bpe(chunks(), cfg.bpe_vocab_size)


def _pydoc(cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    text = _pydoc_text()
    tok = _text_tokenizer(cfg, lambda: iter([text[i:i + CHUNK_BYTES] for i in range(0, len(text), CHUNK_BYTES)]),
                          tokenizer)
    ids = np.asarray(tok.encode(text), dtype=np.uint16 if tok.vocab_size <= 65535 else np.int32)
    train, val = _split(ids, cfg.val_fraction)
    info = {"source": "pydoc", "characters": len(text), "tokens": int(len(ids)), "tokenizer": tok.kind,
            "vocab_size": tok.vocab_size}
    return Corpus("pydoc", tok, train, val, info=info)


register_source("grammar", _grammar)
register_source("grammar-b", lambda cfg, tok: _grammar(cfg, tok, "grammar-b"))
register_source("pydoc", _pydoc)


# --------------------------------------------------------------------------------------------------------------
# user text: streamed, validated, memory-mapped


def text_files(source: str) -> list[Path]:
    p = Path(source).expanduser()
    if not p.exists():
        raise CemtoolError(f"data source {source!r} is neither a built-in source ({', '.join(sources())}) "
                           f"nor an existing file or folder")
    files = sorted(p.rglob("*.txt")) if p.is_dir() else [p]
    if not files:
        raise CemtoolError(f"folder {p} holds no .txt files")
    return files


def iter_text(files: list[Path]) -> Iterator[str]:
    """Stream the files as UTF-8 text chunks (about 1 MiB, cut at line ends); reject binary and non-UTF-8."""
    for f in files:
        with open(f, "rb") as fh:
            offset, carry = 0, b""
            while True:
                raw = fh.read(CHUNK_BYTES)
                if not raw:
                    break
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


def cache_dir() -> Path:
    d = Path(os.environ.get("CEMTOOL_CACHE", Path.home() / ".cache" / "cemtool"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def text_corpus(cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    files = text_files(cfg.source)
    sizes = [f.stat().st_size for f in files]
    if sum(sizes) == 0:
        raise CemtoolError(f"data source {cfg.source} is empty")
    for f in files:  # validate everything before training a tokenizer on it
        for _ in iter_text([f]):
            pass
    tok = _text_tokenizer(cfg, lambda: iter_text(files), tokenizer)
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.int32
    key = hashlib.sha256()
    for f, s in zip(files, sizes, strict=False):
        key.update(f"{f.resolve()}|{s}|{f.stat().st_mtime_ns}".encode())
    key.update(tok.to_json().encode())
    path = cache_dir() / f"tokens-{key.hexdigest()[:24]}.bin"
    if not path.exists():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        n = 0
        with open(tmp, "wb") as out:
            for chunk in iter_text(files):
                ids = np.asarray(tok.encode(chunk), dtype=dtype)
                out.write(ids.tobytes())
                n += len(ids)
        os.replace(tmp, path)
    ids = np.memmap(path, dtype=dtype, mode="r")
    if len(ids) < 2:
        raise CemtoolError(f"data source {cfg.source} holds fewer than 2 tokens")
    train, val = _split(ids, cfg.val_fraction)
    info = {"source": str(Path(cfg.source).resolve()), "files": len(files), "bytes": int(sum(sizes)),
            "tokens": int(len(ids)), "tokenizer": tok.kind, "vocab_size": tok.vocab_size, "cache": str(path)}
    return Corpus(Path(cfg.source).name, tok, train, val, info=info)


__all__ = ["Corpus", "batch_starts", "load_corpus", "load_tokenizer", "register_source", "sources", "windows"]

import cemtool.data.synthetic  # noqa: E402,F401  (registers the "ngram" source)
