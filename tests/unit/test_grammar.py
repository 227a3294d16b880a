"""Tests for the probabilistic-grammar corpus and its exact entropy floor (``cemtool.data.grammar``)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict

import numpy as np
import pytest

from cemtool.data.grammar import GRAMMAR_VERSION, Grammar, GrammarSample, default_grammar, tiny_grammar

COPULA_FLIP = {"is": "are", "are": "is", "was": "were", "were": "was"}


def enumerate_language(g: Grammar) -> dict[tuple[str, ...], float]:
    """Every sentence of a finite grammar with its probability, by brute-force expansion of ``g.productions``
    (independent of the library's parser, LL(1) tables, linear systems and sampler). Fails on ambiguity."""

    def expand(symbols: tuple[str, ...]) -> list[tuple[tuple[str, ...], float]]:
        if not symbols:
            return [((), 1.0)]
        head, rest = symbols[0], symbols[1:]
        if head not in g.productions:
            return [((head, *words), p) for words, p in expand(rest)]
        return [(words, p * q) for rhs, p in g.productions[head] for words, q in expand(tuple(rhs) + rest)]

    language: dict[tuple[str, ...], float] = {}
    for words, p in expand((g.start,)):
        assert words not in language, f"ambiguous: {words}"
        language[words] = p
    return language


def split_sentences(sample: GrammarSample) -> list[tuple[int, int]]:
    ends = list(sample.sentence_starts[1:]) + [len(sample.tokens)]
    return list(zip(sample.sentence_starts.tolist(), [int(e) for e in ends]))


@pytest.fixture(scope="module")
def tiny() -> tuple[Grammar, dict[tuple[str, ...], float]]:
    g = tiny_grammar()
    return g, enumerate_language(g)


@pytest.fixture(scope="module")
def big_sample() -> GrammarSample:
    return default_grammar().sample(300_000, seed=123)


# ---------------------------------------------------------------------- tiny grammar, exhaustively


def test_tiny_entropy_rate_equals_exhaustive_enumeration(tiny):
    g, lang = tiny
    probs = np.array(list(lang.values()))
    lengths = np.array([len(s) for s in lang])
    assert len(lang) == 138
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-12)
    entropy = math.fsum(-probs * np.log(probs))
    mean_len = math.fsum(probs * lengths)
    assert g.sentence_entropy() == pytest.approx(entropy, rel=1e-12, abs=1e-12)
    assert g.mean_sentence_length() == pytest.approx(mean_len, rel=1e-12, abs=1e-12)
    assert g.entropy_rate() == pytest.approx(entropy / mean_len, rel=1e-12, abs=1e-12)


def test_tiny_sentence_logprob_matches_enumeration(tiny):
    g, lang = tiny
    for sentence, p in lang.items():
        assert g.sentence_logprob(list(sentence)) == pytest.approx(math.log(p), abs=1e-12)
        assert g.sentence_logprob(list(sentence[:-1])) == -math.inf          # no "."
        assert g.sentence_logprob([*sentence, "."]) == -math.inf             # trailing junk
    for bad in (["a", "dog", "are", "."], ["some", "dog", "is", "."], ["a", "dog", "is", "big", "big", "."],
                ["a", "dog", "was", "."], ["a", "unicorn", "is", "."], [], ["."]):
        assert g.sentence_logprob(bad) == -math.inf


def test_tiny_per_token_nll_is_the_exact_conditional(tiny):
    g, lang = tiny
    prefix_mass: dict[tuple[str, ...], float] = defaultdict(float)
    for sentence, p in lang.items():
        for t in range(len(sentence) + 1):
            prefix_mass[sentence[:t]] += p
    sample = g.sample(3000, seed=7)
    for a, b in split_sentences(sample):
        words = tuple(g.decode(sample.tokens[a:b]))
        assert words in lang
        for t in range(len(words)):
            exact = -math.log(prefix_mass[words[:t + 1]] / prefix_mass[words[:t]])
            assert sample.nll[a + t] == pytest.approx(exact, abs=1e-12)


def test_tiny_length_distribution_and_unigram(tiny):
    g, lang = tiny
    dist = g.length_distribution()
    expected = np.zeros(len(dist))
    counts = np.zeros(len(g.vocab))
    for sentence, p in lang.items():
        expected[len(sentence)] += p
        for w in sentence:
            counts[g.vocab.index(w)] += p
    np.testing.assert_allclose(dist, expected, atol=1e-12)
    np.testing.assert_allclose(g.unigram(), counts / counts.sum(), atol=1e-12)


# ---------------------------------------------------------------------- grammar validation


@pytest.mark.parametrize("rules, lexicon, message", [
    ({"S": [(0.5, ["the", "dog", "."]), (0.5, ["the", "cat", "."])]}, {}, "LL"),          # same first word
    ({"S": [(1.0, ["ADJS", "N", "."])], "ADJS": [(0.5, ["N"]), (0.5, [])]},
     {"N": [("dog", 1.0)]}, "LL"),                                                          # FIRST vs FOLLOW
    ({"S": [(1.0, ["dog", ".", "barks", "."])]}, {}, "sentence"),                          # "." inside
    ({"S": [(0.5, ["dog", "."]), (0.5, ["dog2"])]}, {}, "end"),                             # no final "."
    ({"S": [(1.0, ["A", "."])], "A": [(0.6, ["x", "A", "A"]), (0.4, ["y"])]}, {}, "subcritical"),
    ({"S": [(1.0, ["NOUN", "."])]}, {"N": [("dog", 1.0)]}, "neither"),                      # misspelt name
])
def test_invalid_grammars_are_rejected(rules, lexicon, message):
    with pytest.raises(ValueError, match=message):
        Grammar("bad", "S", rules, lexicon)


# ---------------------------------------------------------------------- the default grammar


def test_default_grammar_vocab_and_summary():
    g = default_grammar()
    assert default_grammar() is g
    assert len(set(g.vocab)) == len(g.vocab) >= 200
    assert {"is", "are", "was", "were", "."} <= set(g.vocab)
    assert all(w and not any(c.isspace() for c in w) for w in g.vocab)
    for category in ("N_SG", "N_PL", "ADJ"):          # "a" is a determiner: no "a old dog"
        assert all(rhs[0][0] not in "aeiou" for rhs, _ in g.productions[category])
    info = json.loads(json.dumps(g.describe()))
    assert info["version"] == GRAMMAR_VERSION
    assert info["vocab_size"] == len(g.vocab)
    assert info["entropy_rate_nats_per_token"] == pytest.approx(g.entropy_rate())
    assert 2.0 < g.entropy_rate() < 3.5
    assert 8.0 < g.mean_sentence_length() < 15.0
    assert info["p_sentence_longer_than_64"] < 1e-9
    assert g.length_distribution() @ np.arange(info["max_sentence_length"] + 1) == pytest.approx(
        g.mean_sentence_length(), rel=1e-12)
    assert g.unigram().sum() == pytest.approx(1.0, abs=1e-12)


def test_sample_structure_and_determinism():
    g = default_grammar()
    s = g.sample(20_000, seed=5)
    dot = g.vocab.index(".")
    assert s.tokens.dtype == np.int32 and s.nll.dtype == np.float64 and s.sentence_starts.dtype == np.int64
    assert s.tokens.shape == s.nll.shape
    assert len(s.tokens) >= 20_000 and s.sentence_starts[-1] < 20_000    # stops at the first end at/after n
    assert s.tokens.min() >= 0 and s.tokens.max() < len(g.vocab)
    assert s.sentence_starts[0] == 0 and np.all(np.diff(s.sentence_starts) > 0)
    assert np.array_equal(np.flatnonzero(s.tokens == dot) + 1, np.append(s.sentence_starts[1:], len(s.tokens)))
    assert np.all(np.isfinite(s.nll)) and np.all(s.nll >= 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tokens = s.tokens  # type: ignore[misc]

    same = g.sample(20_000, seed=5)
    for field in ("tokens", "nll", "sentence_starts"):
        assert np.array_equal(getattr(s, field), getattr(same, field))
    other = g.sample(20_000, seed=6)
    assert not np.array_equal(s.tokens[:1000], other.tokens[:1000])
    short = g.sample(777, seed=5)                                         # prefix-consistent
    assert np.array_equal(short.tokens, s.tokens[:len(short.tokens)])
    assert np.array_equal(short.nll, s.nll[:len(short.nll)])
    empty = g.sample(0, seed=5)
    assert len(empty.tokens) == len(empty.nll) == len(empty.sentence_starts) == 0


def test_per_token_nll_sums_to_sentence_logprob(big_sample):
    g = default_grammar()
    for a, b in split_sentences(big_sample)[:1500]:
        words = g.decode(big_sample.tokens[a:b])
        assert big_sample.nll[a:b].sum() == pytest.approx(-g.sentence_logprob(words), abs=1e-9)


def test_monte_carlo_agrees_with_exact_entropy_rate(big_sample):
    g = default_grammar()
    spans = split_sentences(big_sample)
    starts = np.array([a for a, _ in spans])
    nll = np.add.reduceat(big_sample.nll, starts)
    lengths = np.array([b - a for a, b in spans], dtype=float)
    rate = nll.sum() / lengths.sum()                           # ratio estimator; delta-method standard error
    se = np.std(nll - rate * lengths, ddof=1) / math.sqrt(len(spans)) / lengths.mean()
    assert abs(rate - g.entropy_rate()) < 4 * se
    se_len = np.std(lengths, ddof=1) / math.sqrt(len(spans))
    assert abs(lengths.mean() - g.mean_sentence_length()) < 4 * se_len


def test_copulas_agree_with_their_subjects(big_sample):
    g = default_grammar()
    n_flipped = 0
    for a, b in split_sentences(big_sample)[:4000]:
        words = g.decode(big_sample.tokens[a:b])
        for i, w in enumerate(words):
            if w in COPULA_FLIP:
                flipped = [*words[:i], COPULA_FLIP[w], *words[i + 1:]]
                assert g.sentence_logprob(flipped) == -math.inf, " ".join(flipped)
                tense = {"is": "was", "was": "is", "are": "were", "were": "are"}[w]
                assert g.sentence_logprob([*words[:i], tense, *words[i + 1:]]) > -math.inf
                n_flipped += 1
    assert n_flipped > 1000


@pytest.mark.parametrize("good, bad", [
    ("the dog near the cats is big .", "the dog near the cats are big ."),
    ("the dogs near the cat were happy .", "the dogs near the cat was happy ."),
    ("the dogs that the cat chases are big .", "the dogs that the cat chases is big ."),
    ("the dogs that the cat chases are big .", "the dogs that the cat chase are big ."),
    ("the cat that chases the dogs was happy .", "the cat that chases the dogs were happy ."),
    ("they are the teachers .", "they are a teacher ."),
])
def test_agreement_across_nested_phrases(good, bad):
    g = default_grammar()
    assert g.sentence_logprob(good.split()) > -math.inf
    assert g.sentence_logprob(bad.split()) == -math.inf


def test_grammar_hard_is_deeper_with_an_exact_floor():
    """grammar-hard: the default's words, nested to depth 4 with flattened rules; agreement holds across four
    levels of nesting (a sentence the default grammar cannot produce), and Monte Carlo agrees with its exact
    entropy rate."""
    from cemtool.data.grammar import grammar_hard

    g, d = grammar_hard(), default_grammar()
    assert g.vocab == d.vocab and g.describe()["max_depth"] == 4
    assert g.entropy_rate() > d.entropy_rate() and g.mean_sentence_length() > d.mean_sentence_length()
    deep = "the dog near the cat near the bird near the man near the king is big ."
    assert g.sentence_logprob(deep.split()) > -math.inf and d.sentence_logprob(deep.split()) == -math.inf
    assert g.sentence_logprob(deep.replace(" is ", " are ").split()) == -math.inf  # agreement across the nesting
    sample = g.sample(60_000, seed=3)
    spans = split_sentences(sample)
    starts = np.array([a for a, _ in spans])
    nll = np.add.reduceat(sample.nll, starts)
    lengths = np.array([b - a for a, b in spans], dtype=float)
    rate = nll.sum() / lengths.sum()
    se = np.std(nll - rate * lengths, ddof=1) / math.sqrt(len(spans)) / lengths.mean()
    assert abs(rate - g.entropy_rate()) < 4 * se
