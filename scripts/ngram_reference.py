"""N-gram references for a run's corpus: the validation cross-entropy (nats/token) of a unigram and a bigram model.

    python scripts/ngram_reference.py RUN_DIR

The run's own config and tokenizer rebuild its corpus (the same split and token ids as its training). Each
model counts the training tokens with add-k smoothing; k is chosen from K_GRID on a held-out tail of the training
split (its last HOLDOUT share), then the counts of the whole training split are scored on the validation split.
docs/findings.md uses it to say what a loss means on the pydoc text (a model that ends at the bigram's loss has
learned the previous token's statistics and little more)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

K_GRID = (1e-3, 1e-2, 1e-1, 0.5, 1.0)
HOLDOUT = 0.1


def _probs(counts: np.ndarray, k: float) -> np.ndarray:
    """Add-k estimate along the last axis."""
    c = counts + k
    return c / c.sum(axis=-1, keepdims=True)


def unigram_nll(train: np.ndarray, val: np.ndarray, vocab: int, k: float) -> float:
    p = _probs(np.bincount(train, minlength=vocab).astype(np.float64), k)  # (V,)
    return float(-np.mean(np.log(p[val])))


def bigram_nll(train: np.ndarray, val: np.ndarray, vocab: int, k: float) -> float:
    counts = np.zeros((vocab, vocab))  # (V, V): previous token x next token
    np.add.at(counts, (train[:-1], train[1:]), 1.0)
    p = _probs(counts, k)
    return float(-np.mean(np.log(p[val[:-1], val[1:]])))


def reference(train: np.ndarray, val: np.ndarray, vocab: int) -> dict:
    """Both models, each with its k chosen on the training split's held-out tail (never on ``val``)."""
    train, val = np.asarray(train, dtype=np.int64), np.asarray(val, dtype=np.int64)
    cut = int(len(train) * (1 - HOLDOUT))
    out = {"train_tokens": int(len(train)), "val_tokens": int(len(val)), "vocab_size": vocab, "k_grid": list(K_GRID)}
    for name, nll in (("unigram", unigram_nll), ("bigram", bigram_nll)):
        k = min(K_GRID, key=lambda k: nll(train[:cut], train[cut:], vocab, k))
        out[name] = {"k": k, "val_nll": nll(train, val, vocab, k)}
    return out


def main(run_dir: str) -> None:
    from cemtool.config import config_from_run_dict
    from cemtool.data.corpus import load_corpus
    from cemtool.data.tokenizer import load_tokenizer

    run = Path(run_dir)
    cfg = config_from_run_dict(json.loads((run / "config.json").read_text()))
    tok_path = run / "tokenizer.json"
    corpus = load_corpus(cfg.data, load_tokenizer(tok_path) if tok_path.is_file() else None)
    print(json.dumps({"run": str(run), "data": cfg.data.source,
                      **reference(corpus.train, corpus.val, corpus.tokenizer.vocab_size)}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/ngram_reference.py RUN_DIR")
    main(sys.argv[1])
