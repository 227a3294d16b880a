"""The built-in ``ngram`` source: an n-gram rule over white-noise tokens, with an exactly known loss floor.

The saturation experiments of METHODS §4 need a task where attention must *extract* information from the
context: the next token is a fixed function of the previous ``n - 1`` tokens, and the tokens themselves are white
noise. As a token stream (one next-token loss everywhere) this is:

- a "sentence" is ``L = data.seq_len + 1`` tokens (exactly one training window);
- its first ``n - 1`` tokens are i.i.d. uniform over the ``V`` symbols;
- every later token ``x_t`` is, with probability ``1 - eps``, the rule's output ``f(x_{t-n+1}, ..., x_{t-1})``,
  and with probability ``eps`` a fresh uniform symbol (the noise keeps the inputs white: see below).

The rule is a random table drawn from ``data.seed``: ``f(a_1, ..., a_{n-1}) = perm[a_2 .. a_{n-1}][a_1]``, one
random permutation of the symbols per value of the ``n - 2`` most recent context tokens. Because ``f`` is a
bijection in its oldest argument, the uniform distribution on ``(n-1)``-tuples is stationary (the transition
matrix is doubly stochastic), so **any ``n - 1`` consecutive tokens are i.i.d. uniform** — white noise, exactly —
while the ``n``-th is (almost) determined by them. To predict ``x_t`` a model must fetch ``x_{t-n+1} ..
x_{t-2}`` from earlier positions (``x_{t-1}`` is its own input): attention has to find them among ``T``
distractors, which is what the saturation sweep varies.

Exact floor. Given its sentence prefix, a token's conditional law is known in closed form:
``p = 1/V`` for the first ``n - 1`` tokens, and ``p(x_t) = 1 - eps + eps/V`` if ``x_t`` is the rule's output,
``eps/V`` otherwise. ``Corpus.val_nll`` holds ``-log p`` of every validation token, windows start at sentence
starts, so the trainer's floor is exact; ``Corpus.entropy_rate`` is the stream's rate
``((n-1) log V + (L-n+1) h) / L`` with the per-token rule entropy
``h = -(1-eps+eps/V) log(1-eps+eps/V) - (V-1) (eps/V) log(eps/V)`` (``info["rule_entropy"]``).

DataConfig has no fields for the task's shape, so it is set by the module constants below (recorded in
``Corpus.info``); ``data.seed`` draws the rule and the tokens, ``data.train_tokens`` / ``data.val_tokens`` set the
sizes (whole sentences), ``data.seq_len`` the sentence length. :func:`ngram_corpus` takes other shapes directly;
the source ``ngram4`` is the same task with a 4-gram rule (n = 4: 64 rule rows of 8), the allocation paper's shape.
"""

from __future__ import annotations

import math

import numpy as np

from cemtool.config import DataConfig
from cemtool.data.source import Corpus, register_source
from cemtool.data.tokenizer import Tokenizer, word_tokenizer
from cemtool.errors import CemtoolError

SYNTHETIC_VERSION = 1
NGRAM_VOCAB = 8  # V: symbols of the white noise
NGRAM_ORDER = 3  # n: the next token is a function of the previous n - 1 tokens
NGRAM_NOISE = 0.1  # eps: probability that a token is fresh noise instead of the rule's output


def rule_entropy(vocab: int, noise: float) -> float:
    """Entropy (nats) of a rule-governed token given its full context: the floor per token."""
    hit = 1.0 - noise + noise / vocab
    miss = noise / vocab
    h = -hit * math.log(hit)
    if miss > 0:
        h -= (vocab - 1) * miss * math.log(miss)
    return h


def ngram_rule(vocab: int, order: int, seed: int) -> np.ndarray:
    """The rule table (V^(n-2), V): row c is a random permutation; f(a_1, ..., a_{n-1}) = table[c][a_1] with
    c = the base-V number of (a_2, ..., a_{n-1})."""
    rng = np.random.Generator(np.random.PCG64([seed, 0x6E6772]))
    rows = vocab ** (order - 2)
    return np.stack([rng.permutation(vocab) for _ in range(rows)]).astype(np.int64)  # (V^(n-2), V)


def apply_rule(table: np.ndarray, context: np.ndarray, vocab: int) -> np.ndarray:
    """f of each row of ``context`` (S, n-1), oldest token first -> (S,)."""
    c = np.zeros(len(context), dtype=np.int64)
    for j in range(1, context.shape[1]):
        c = c * vocab + context[:, j]
    return table[c, context[:, 0]]


def sample_sentences(table: np.ndarray, n_sent: int, length: int, vocab: int, order: int, noise: float,
                     seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens (S, L) and their exact -log p given the sentence prefix (S, L), generated column by column."""
    rng = np.random.Generator(np.random.PCG64(seed))
    tokens = np.empty((n_sent, length), dtype=np.int64)
    nll = np.empty((n_sent, length), dtype=np.float64)
    head = min(order - 1, length)
    tokens[:, :head] = rng.integers(0, vocab, size=(n_sent, head))
    nll[:, :head] = math.log(vocab)
    hit, miss = -math.log(1.0 - noise + noise / vocab), -math.log(noise / vocab) if noise > 0 else math.inf
    for t in range(head, length):
        rule = apply_rule(table, tokens[:, t - order + 1:t], vocab)  # (S,)
        fresh = rng.random(n_sent) < noise
        tokens[:, t] = np.where(fresh, rng.integers(0, vocab, size=n_sent), rule)
        nll[:, t] = np.where(tokens[:, t] == rule, hit, miss)
    return tokens, nll


def ngram_corpus(cfg: DataConfig, tokenizer: Tokenizer | None = None, *, vocab: int = NGRAM_VOCAB,
                 order: int = NGRAM_ORDER, noise: float = NGRAM_NOISE) -> Corpus:
    """The n-gram-over-white-noise corpus for ``cfg`` (see the module docstring)."""
    if cfg.tokenizer not in ("auto", "word"):
        raise CemtoolError(f"data.tokenizer={cfg.tokenizer!r} does not apply to the ngram source",
                           hint="it has its own symbol vocabulary; use data.tokenizer=auto or word")
    if order < 2 or vocab < 2 or not 0.0 <= noise <= 1.0:
        raise CemtoolError(f"ngram task needs order >= 2, vocab >= 2 and 0 <= noise <= 1 (got {order}, {vocab}, "
                           f"{noise})")
    symbols = [f"s{i}" for i in range(vocab)]
    tok = tokenizer or word_tokenizer(symbols)
    if tokenizer is not None and [tokenizer.token_to_id(s) for s in symbols] != list(range(vocab)):
        raise CemtoolError("the given tokenizer is not the ngram source's symbol vocabulary")
    length = cfg.seq_len + 1
    table = ngram_rule(vocab, order, cfg.seed)
    splits = {}
    for split, n_tokens, stream in (("train", cfg.train_tokens, 0), ("val", cfg.val_tokens, 1)):
        n_sent = max(1, n_tokens // length)
        tokens, nll = sample_sentences(table, n_sent, length, vocab, order, noise, seed=cfg.seed * 2 + stream)
        starts = np.arange(n_sent, dtype=np.int64) * length
        splits[split] = (tokens.reshape(-1).astype(np.uint16), nll.reshape(-1), starts)
    h = rule_entropy(vocab, noise)
    k = min(order - 1, length)
    rate = (k * math.log(vocab) + (length - k) * h) / length
    info = {"source": "ngram", "generator_version": SYNTHETIC_VERSION, "vocab": vocab, "order": order,
            "noise": noise, "sentence_length": length, "rule_entropy": h, "train_tokens": len(splits["train"][0]),
            "val_tokens": len(splits["val"][0]), "tokenizer": "word"}
    return Corpus("ngram", tok, splits["train"][0], splits["val"][0], splits["train"][2], splits["val"][2],
                  splits["val"][1], rate, info)


def _ngram(cfg: DataConfig, tokenizer: Tokenizer | None) -> Corpus:
    return ngram_corpus(cfg, tokenizer)


register_source("ngram", _ngram)
# the allocation paper's own shape: a 4-gram rule (each token a function of the 3 before it), the same 8 symbols
# and noise; the Corpus is named ngram4 so that runs and reports tell the two tasks apart
register_source("ngram4", lambda cfg, tok: _renamed(ngram_corpus(cfg, tok, order=4), "ngram4"))


def _renamed(c: Corpus, name: str) -> Corpus:
    c.name = name
    c.info["source"] = name
    return c

__all__ = ["NGRAM_NOISE", "NGRAM_ORDER", "NGRAM_VOCAB", "apply_rule", "ngram_corpus", "ngram_rule", "rule_entropy"]
