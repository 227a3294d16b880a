"""N-gram references for a run's corpus: the validation cross-entropy (nats/token) of a unigram and a bigram model.

    python research/scripts/ngram_reference.py RUN_DIR

The run's own config and tokenizer rebuild its corpus (the same split and token ids as its training). Each
model counts the training tokens with add-k smoothing; k is chosen from K_GRID on a held-out tail of the training
split (its last HOLDOUT share), then the counts of the whole training split are scored on the validation split.
research/docs/findings.md uses it to say what a loss means on the pydoc text (a model that ends at the bigram's loss has
learned the previous token's statistics and little more)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

K_GRID = (1e-3, 1e-2, 1e-1, 0.5, 1.0)
HOLDOUT = 0.1


def unigram_nll(train: np.ndarray, val: np.ndarray, vocab: int, k: float) -> float:
    counts = np.bincount(train, minlength=vocab)  # (V,)
    return float(-np.mean(np.log((counts[val] + k) / (len(train) + k * vocab))))


def bigram_nll(train: np.ndarray, val: np.ndarray, vocab: int, k: float) -> float:
    """Only the pairs that occur are counted (no V x V table: a 50k vocabulary would need 20 GB)."""
    pairs, counts = np.unique(train[:-1] * vocab + train[1:], return_counts=True)  # sorted pair codes
    prev = np.bincount(train[:-1], minlength=vocab)  # (V,) times each token is followed by another
    q = val[:-1] * vocab + val[1:]
    at = np.minimum(np.searchsorted(pairs, q), len(pairs) - 1)
    c = np.where(pairs[at] == q, counts[at], 0)  # count of each validation pair in training
    return float(-np.mean(np.log((c + k) / (prev[val[:-1]] + k * vocab))))


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
        sys.exit("usage: python research/scripts/ngram_reference.py RUN_DIR")
    main(sys.argv[1])
