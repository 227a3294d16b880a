"""What a corpus is, and the registry of named sources that build one.

:class:`Corpus` is what every source returns: the built-ins of :mod:`cemtool.data.corpus` (grammar, pydoc, text
files), token files (:mod:`cemtool.data.tokens`) and the synthetic tasks (:mod:`cemtool.data.synthetic`, which
registers ``ngram``); :func:`cemtool.data.corpus.load_corpus` picks the builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cemtool.config import DataConfig
from cemtool.data.tokenizer import Tokenizer
from cemtool.errors import CemtoolError


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

    def bytes_per_token(self, starts: np.ndarray, seq_len: int) -> float | None:
        """Mean UTF-8 bytes per target token of these validation windows (what turns their loss into bits per
        byte). A token's bytes are those it decodes to; for word-level vocabularies (grammar, ngram) a word counts
        its bytes plus one separator, the convention of their decoded text (words joined by single spaces).
        None for a tokenizer of bare ids (token files without a tokenizer), whose bytes are unknown."""
        idx = starts[:, None] + 1 + np.arange(seq_len)[None, :]  # (n, T) target positions
        targets = np.asarray(self.val[idx])  # (n, T)
        table = self.tokenizer.token_bytes()
        if table is not None:
            return float(table[targets].mean())
        if self.tokenizer.kind == "ids":
            return None
        return sum(len(self.tokenizer.decode(row.tolist()).encode("utf-8")) for row in targets) / targets.size

    def floor(self, starts: np.ndarray, seq_len: int) -> float | None:
        """Exact mean -log p of the target tokens of the given validation windows (the loss no model can beat)."""
        if self.val_nll is None:
            return None
        idx = starts[:, None] + 1 + np.arange(seq_len)[None, :]  # (n, T) target positions
        return float(self.val_nll[idx].mean())


SourceBuilder = Callable[[DataConfig, "Tokenizer | None"], Corpus]
_SOURCES: dict[str, SourceBuilder] = {}


def register_source(name: str, builder: SourceBuilder) -> None:
    _SOURCES[name] = builder


def source_builder(name: str) -> SourceBuilder | None:
    """The builder registered under ``name``, or None."""
    return _SOURCES.get(name)


def sources() -> list[str]:
    return sorted(_SOURCES)


__all__ = ["Corpus", "SourceBuilder", "register_source", "source_builder", "sources"]
