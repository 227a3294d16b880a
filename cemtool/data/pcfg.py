"""A strong-LL(1) probabilistic grammar with exactly known statistics: :class:`Grammar` builds, checks, parses and
samples one; the built-in ``grammar`` corpus is one (:mod:`cemtool.data.grammar`, where its language is described).
The checks and the exact moments are in :mod:`cemtool.data.pcfg_analysis`.

Exactness
---------
The grammar is *strong LL(1)* at the word level, and this is verified when a :class:`Grammar` is built: for every
nonterminal the sets of words that can come next under its alternatives (FIRST of the alternative, plus the
nonterminal's FOLLOW set if the alternative can derive the empty string) are pairwise disjoint. Consequences:

1. The grammar is unambiguous: every sentence has exactly one derivation, so
   ``log P(sentence) = sum of the log-probabilities of the rules of its derivation``, which a predictive
   parser computes (:meth:`Grammar.sentence_logprob`), returning ``-inf`` for strings outside the language.
2. Generation is a deterministic stack machine: after any prefix the stack is unique, and from a given stack
   each possible next word is reached by exactly one sequence of rule choices. Hence the exact conditional
   ``p(w_t | w_<t of the sentence)`` is the product of the probabilities of the choices made since the previous
   word, which :meth:`Grammar.sample` records per token. Per sentence these sum to ``-log P(sentence)``; the
   probability of ending the sentence is carried by the final ``"."``.

The entropy rate is computed analytically. With ``M[A, B]`` the expected number of ``B`` in one expansion of
``A`` (spectral radius < 1 is checked, so derivations terminate), the expected derivation entropies satisfy
``H(A) = h(A) + sum_B M[A, B] H(B)`` with ``h(A) = -sum_r p_r log p_r`` the entropy of the choice at ``A``, and
the expected lengths ``L(A) = t(A) + sum_B M[A, B] L(B)`` with ``t(A)`` the expected number of words written
directly by ``A``'s rule. Both are linear systems. Since derivations and sentences correspond 1:1,
``E[-log P(S)] = H(start)``; sentences are i.i.d., so by the renewal-reward theorem the per-token entropy rate of
the concatenated stream is ``H(start) / L(start)`` nats/token, counting ``"."``. A model that sees every
sentence from its start can do no better; for windows aligned to sentence starts, the first token of a window
is context, and the per-token ``nll`` of the sampled targets is the exact floor.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from cemtool.data.pcfg_analysis import (
    Lexicon,
    Rules,
    _check_symbols,
    _length_distribution,
    _Moments,
    _normalise,
    _predict_table,
)

GRAMMAR_VERSION = 1

# Sentences per sampling batch. Fixed so that samples are prefix-consistent across lengths; changing it changes
# every sample, so bump GRAMMAR_VERSION with it.
_BATCH = 8192


@dataclass(frozen=True)
class GrammarSample:
    """A whole number of sampled sentences.

    ``tokens``: (N,) int32 ids into :attr:`Grammar.vocab`, each sentence ending with ``"."``;
    ``nll``: (N,) float64 exact ``-log p(tokens[i] | previous tokens of its sentence)`` in nats;
    ``sentence_starts``: (S,) int64 index of each sentence's first token.
    """

    tokens: np.ndarray
    nll: np.ndarray
    sentence_starts: np.ndarray


class Grammar:
    """A strong-LL(1) PCFG whose sentences end with ``"."``; see the module docstring.

    ``rules``: nonterminal -> [(probability, right-hand side)]; ``lexicon``: word category (a nonterminal whose
    rules each write one word) -> [(word, weight)]. Probabilities/weights are normalised per nonterminal.
    Nonterminal names are upper-case; any other symbol is a word (so a misspelt nonterminal is an error).
    Raises ``ValueError`` if the grammar is not strong LL(1), leaks probability, or misplaces ``"."``.
    """

    def __init__(self, name: str, start: str, rules: Rules, lexicon: Lexicon,
                 info: Mapping[str, object] | None = None) -> None:
        self.name = name
        self.start = start
        self.info = dict(info or {})
        self.categories = list(lexicon)
        self.productions = _normalise(rules, lexicon)
        self.vocab = _check_symbols(self.productions, start)
        self._word_id = {w: i for i, w in enumerate(self.vocab)}
        self._predict = _predict_table(self.productions, start, self._word_id)
        self._moments = _Moments(self.productions, self._word_id)
        self._compile_sampler()

    # ------------------------------------------------------------------ analytic quantities
    def entropy_rate(self) -> float:
        """Exact entropy rate of the stream of i.i.d. sentences, nats/token (``"."`` counted)."""
        return self.sentence_entropy() / self.mean_sentence_length()

    def sentence_entropy(self) -> float:
        """Exact ``E[-log P(sentence)]`` in nats."""
        return float(self._moments.entropy[self.start])

    def mean_sentence_length(self) -> float:
        """Exact expected sentence length in tokens, ``"."`` included."""
        return float(self._moments.length[self.start])

    def unigram(self) -> np.ndarray:
        """Exact long-run frequency of each vocab word in the stream, shape (V,), sums to 1."""
        return self._moments.terminal_counts[self.start] / self.mean_sentence_length()

    def length_distribution(self) -> np.ndarray:
        """Exact ``P(len = k)`` for ``k = 0..max length``; ``ValueError`` if the grammar is recursive (the built-in
        grammars are not: their languages are finite)."""
        return _length_distribution(self.productions, self.start)

    def describe(self) -> dict:
        """JSON-able summary of the grammar and its exact statistics."""
        uni = self.unigram()
        cop = sum(uni[self._word_id[w]] for w in ("is", "are", "was", "were") if w in self._word_id)
        out = {
            "name": self.name, "version": GRAMMAR_VERSION, "vocab_size": len(self.vocab),
            "entropy_rate_nats_per_token": self.entropy_rate(),
            "sentence_entropy_nats": self.sentence_entropy(),
            "mean_sentence_length": self.mean_sentence_length(),
            "copula_token_fraction": float(cop),
            "n_nonterminals": len(self.productions) - len(self.categories),
            "n_word_categories": len(self.categories),
            "n_rules": sum(len(a) for a in self.productions.values()),
        }
        try:
            lengths = self.length_distribution()
        except ValueError:                        # a recursive grammar: lengths are unbounded
            lengths = None
        if lengths is not None:
            out.update({"max_sentence_length": len(lengths) - 1,
                        "p_sentence_longer_than_64": float(lengths[65:].sum()),
                        "p_sentence_longer_than_128": float(lengths[129:].sum())})
        return {**out, **self.info}

    # ------------------------------------------------------------------ parsing
    def sentence_logprob(self, words: Sequence[str]) -> float:
        """Exact ``log P(sentence)`` by predictive (LL(1)) parsing; ``-inf`` if not in the language."""
        ids = [self._word_id.get(w, -1) for w in words]
        end = len(self.vocab)
        stack = [self.start]
        pos, logp = 0, 0.0
        while stack:
            sym = stack.pop()
            look = ids[pos] if pos < len(ids) else end
            alts = self.productions.get(sym)
            if alts is None:                      # a word
                if look != self._word_id[sym]:
                    return -math.inf
                pos += 1
                continue
            k = self._predict[sym].get(look)
            if k is None:
                return -math.inf
            rhs, p = alts[k]
            logp += math.log(p)
            stack.extend(reversed(rhs))
        return logp if pos == len(ids) else -math.inf

    def decode(self, ids: Sequence[int] | np.ndarray) -> list[str]:
        """Token ids -> words."""
        return [self.vocab[int(i)] for i in ids]

    # ------------------------------------------------------------------ sampling
    def sample(self, n_tokens: int, seed: int) -> GrammarSample:
        """Whole sentences until at least ``n_tokens`` tokens (the first sentence end at/after ``n_tokens``).

        Deterministic in ``seed``; a sample is a prefix of any longer sample with the same seed (sentences are
        made in fixed-size batches, batch ``b`` seeded by ``(seed, b)``).
        """
        if n_tokens < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        toks, nlls, lens = [], [], []
        total = 0
        for b in itertools.count():
            if total >= n_tokens:
                break
            rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(b,))))
            t, v, n = self._sample_batch(rng)
            toks.append(t)
            nlls.append(v)
            lens.append(n)
            total += len(t)
        lengths = np.concatenate(lens) if lens else np.zeros(0, dtype=np.int64)
        ends = np.cumsum(lengths)
        n_sent = int(np.searchsorted(ends, n_tokens, side="left")) + 1 if n_tokens > 0 else 0
        n_tok = int(ends[n_sent - 1]) if n_sent else 0
        tokens = np.concatenate(toks)[:n_tok] if toks else np.zeros(0, dtype=np.int32)
        nll = np.concatenate(nlls)[:n_tok] if nlls else np.zeros(0)
        starts = np.concatenate([[0], ends[:n_sent - 1]]).astype(np.int64) if n_sent else np.zeros(0, np.int64)
        return GrammarSample(tokens.astype(np.int32), nll.astype(np.float64), starts)

    def _compile_sampler(self) -> None:
        """Tables for the vectorised stack machine.

        Symbol ids: words ``< V``, word-category slots ``V..V+C-1`` (both "emitted"), then the structural
        nonterminals that have a choice (``>= nt0``); single-alternative nonterminals are inlined.
        """
        v, cats = len(self.vocab), self.categories
        choice = [a for a in self.productions if a not in cats and len(self.productions[a]) > 1]
        ids = {w: i for i, w in enumerate(self.vocab)}
        ids.update({c: v + j for j, c in enumerate(cats)})
        ids.update({a: v + len(cats) + j for j, a in enumerate(choice)})

        @functools.cache
        def flat(sym: str) -> tuple[int, ...]:
            alts = self.productions.get(sym)
            if alts is not None and sym not in cats and len(alts) == 1:
                return tuple(i for s in alts[0][0] for i in flat(s))
            return (ids[sym],)

        alts = [[(tuple(reversed([i for s in rhs for i in flat(s)])), p) for rhs, p in self.productions[a]]
                for a in choice]
        n_alt = max((len(x) for x in alts), default=1)
        self._nt0 = v + len(cats)
        self._init = np.array(list(reversed(flat(self.start))), dtype=np.int32)
        self._cum = np.full((len(choice), max(n_alt - 1, 1)), np.inf)
        self._alt_start = np.zeros(len(choice), dtype=np.int64)
        rhs_flat: list[int] = []
        rhs_off, rhs_len, cost = [], [], []
        for j, x in enumerate(alts):
            self._alt_start[j] = len(cost)
            self._cum[j, :len(x) - 1] = np.cumsum([p for _, p in x])[:-1]
            for r, p in x:
                rhs_off.append(len(rhs_flat))
                rhs_len.append(len(r))
                rhs_flat.extend(r)
                cost.append(-math.log(p))
        self._rhs_flat = np.array(rhs_flat + [0], dtype=np.int32)
        self._rhs_off = np.array(rhs_off, dtype=np.int64)
        self._rhs_len = np.array(rhs_len, dtype=np.int64)
        self._cost = np.array(cost)
        self._lex = []
        for c in cats:
            words = self.productions[c]
            self._lex.append((np.array([ids[rhs[0]] for rhs, _ in words], dtype=np.int32),
                              np.cumsum([p for _, p in words])[:-1],
                              np.array([-math.log(p) for _, p in words])))

    def _sample_batch(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_BATCH`` sentences: flat tokens, flat exact nll, and the sentence lengths."""
        slots, nll, lengths = self._run_stacks(_BATCH, rng)
        return self._fill_words(slots, nll, rng), nll, lengths

    def _run_stacks(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run ``n`` stack machines in lock-step: each step pops every unfinished sentence's top symbol and
        either emits it (word or category slot, with the cost of the choices made since the last emission) or
        expands it by a random alternative. Returns flat slots, their costs, and the sentence lengths."""
        nt0, init = self._nt0, self._init
        width = max(64, 2 * len(init))
        stack = np.zeros((n, width), dtype=np.int32)
        stack[:, :len(init)] = init
        stack = stack.ravel()
        rows = np.arange(n)                      # unfinished sentences, and their state:
        sp = np.full(n, len(init), dtype=np.int64)
        acc = np.zeros(n)
        log_rows, log_slots, log_cost = [], [], []
        while rows.size:
            sp -= 1
            top = stack[rows * width + sp]
            emit = top < nt0
            log_rows.append(rows[emit])
            log_slots.append(top[emit])
            log_cost.append(acc[emit])
            acc[emit] = 0.0
            ex = np.flatnonzero(~emit)
            j = top[ex] - nt0
            k = self._alt_start[j] + (rng.random(ex.size)[:, None] >= self._cum[j]).sum(axis=1)
            acc[ex] += self._cost[k]
            length = self._rhs_len[k]
            if ex.size and int((sp[ex] + length).max()) > width:
                stack = np.concatenate([stack.reshape(n, width), np.zeros((n, width), np.int32)], 1).ravel()
                width *= 2
            owner = np.repeat(np.arange(ex.size), length)
            offs = np.arange(owner.size) - np.repeat(np.cumsum(length) - length, length)
            stack[(rows[ex] * width + sp[ex])[owner] + offs] = self._rhs_flat[self._rhs_off[k][owner] + offs]
            sp[ex] += length
            alive = sp > 0
            if not alive.all():
                rows, sp, acc = rows[alive], sp[alive], acc[alive]
        all_rows = np.concatenate(log_rows)
        order = np.argsort(all_rows, kind="stable")
        return (np.concatenate(log_slots)[order], np.concatenate(log_cost)[order],
                np.bincount(all_rows, minlength=n).astype(np.int64))

    def _fill_words(self, slots: np.ndarray, nll: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Replace category slots by words drawn in bulk, adding each word's ``-log p(word | category)``."""
        v = len(self.vocab)
        tokens = slots.copy()
        where = np.flatnonzero(slots >= v)
        u = rng.random(len(where))
        cats = slots[where] - v
        for c, (words, cum, costs) in enumerate(self._lex):
            sel = cats == c
            k = np.searchsorted(cum, u[sel], side="right")
            pos = where[sel]
            tokens[pos] = words[k]
            nll[pos] += costs[k]
        return tokens
