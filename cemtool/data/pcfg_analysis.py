"""The analysis of a probabilistic grammar (:class:`cemtool.data.pcfg.Grammar`, whose docstring says why it is
exact): rules and lexicon normalised, the symbols checked, the strong-LL(1) predict table (FIRST and FOLLOW sets,
pairwise disjoint), and the exact moments by linear systems (expected derivation entropies, lengths and word
counts) and the sentence-length distribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

EOS = "."

Rhs = tuple[str, ...]
Rules = Mapping[str, Sequence[tuple[float, Sequence[str]]]]
Lexicon = Mapping[str, Sequence[tuple[str, float]]]


def _normalise(rules: Rules, lexicon: Lexicon) -> dict[str, tuple[tuple[Rhs, float], ...]]:
    """Merge rules and lexicon into nonterminal -> ((rhs, probability), ...), probabilities summing to 1."""
    out: dict[str, tuple[tuple[Rhs, float], ...]] = {}
    for cat, words in lexicon.items():
        if cat in rules:
            raise ValueError(f"{cat!r} is both a rule and a word category")
        if len({w for w, _ in words}) != len(words):
            raise ValueError(f"word category {cat!r} lists a word twice")
        out[cat] = _normalised_alts(cat, [(wt, (w,)) for w, wt in words])
    for lhs, alts in rules.items():
        out[lhs] = _normalised_alts(lhs, [(p, tuple(rhs)) for p, rhs in alts])
    return out


def _normalised_alts(lhs: str, alts: list[tuple[float, Rhs]]) -> tuple[tuple[Rhs, float], ...]:
    if not alts or any(not (p > 0 and math.isfinite(p)) for p, _ in alts):
        raise ValueError(f"{lhs!r} needs alternatives with positive finite probabilities")
    total = math.fsum(p for p, _ in alts)
    return tuple((rhs, p / total) for p, rhs in alts)


def _is_nonterminal_name(sym: str) -> bool:
    return sym[:1].isupper()


def _check_symbols(prods: Mapping[str, tuple[tuple[Rhs, float], ...]], start: str) -> list[str]:
    """Validate names and reachability; return the sorted vocabulary."""
    if start not in prods:
        raise ValueError(f"start symbol {start!r} has no rules")
    words: set[str] = set()
    reached, todo = {start}, [start]
    while todo:
        for rhs, _ in prods[todo.pop()]:
            for s in rhs:
                if s in prods:
                    if s not in reached:
                        reached.add(s)
                        todo.append(s)
                elif _is_nonterminal_name(s) or not s or any(ch.isspace() for ch in s):
                    raise ValueError(f"symbol {s!r} is neither a defined nonterminal nor a valid word")
                else:
                    words.add(s)
    unreached = set(prods) - reached
    if unreached:
        raise ValueError(f"nonterminals unreachable from {start!r}: {sorted(unreached)}")
    if EOS not in words:
        raise ValueError(f"the grammar never writes the sentence end {EOS!r}")
    return sorted(words)


def _predict_table(prods: Mapping[str, tuple[tuple[Rhs, float], ...]], start: str,
                   word_id: Mapping[str, int]) -> dict[str, dict[int, int]]:
    """Strong-LL(1) predict table: nonterminal -> {next word id (V = end of input) -> alternative index}.

    Sets of words are int bitmasks. Raises ``ValueError`` on a conflict, or if ``"."`` can be followed by
    anything or anything but ``"."`` can end a sentence.
    """
    end_bit = 1 << len(word_id)

    def first_of(sym: str) -> int:
        return first[sym] if sym in prods else 1 << word_id[sym]

    nullable: set[str] = set()
    first = dict.fromkeys(prods, 0)
    changed = True
    while changed:
        changed = False
        for a, alts in prods.items():
            for rhs, _ in alts:
                f, null = _seq_first(rhs, first_of, nullable)
                if f | first[a] != first[a]:
                    first[a] |= f
                    changed = True
                if null and a not in nullable:
                    nullable.add(a)
                    changed = True

    follow: dict[str, int] = {start: end_bit}
    changed = True
    while changed:
        changed = False
        for a, alts in prods.items():
            for rhs, _ in alts:
                trailer = follow.get(a, 0)
                for s in reversed(rhs):
                    old = follow.get(s, 0)
                    if old | trailer != old:
                        follow[s] = old | trailer
                        changed = True
                    trailer = trailer | first_of(s) if s in nullable else first_of(s)

    if follow.get(EOS) != end_bit:
        raise ValueError(f"{EOS!r} must end every sentence and occur nowhere else")
    if any(follow.get(w, 0) & end_bit for w in word_id if w != EOS):
        raise ValueError(f"every sentence must end with {EOS!r}")

    table: dict[str, dict[int, int]] = {}
    conflicts = []
    for a, alts in prods.items():
        seen = 0
        table[a] = {}
        for k, (rhs, _) in enumerate(alts):
            f, null = _seq_first(rhs, first_of, nullable)
            pred = f | (follow.get(a, 0) if null else 0)
            if pred & seen:
                conflicts.append(a)
            seen |= pred
            table[a].update(dict.fromkeys(_bits(pred), k))
    if conflicts:
        raise ValueError(f"grammar is not strong LL(1); conflicts at {sorted(set(conflicts))}")
    return table


def _seq_first(rhs: Rhs, first_of, nullable: set[str]) -> tuple[int, bool]:
    """FIRST set (bitmask) of a symbol sequence and whether it can derive the empty string."""
    f = 0
    for s in rhs:
        f |= first_of(s)
        if s not in nullable:
            return f, False
    return f, True


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class _Moments:
    """Exact expected derivation entropy, length and word counts per nonterminal (linear systems)."""

    def __init__(self, prods: Mapping[str, tuple[tuple[Rhs, float], ...]], word_id: Mapping[str, int]) -> None:
        names = list(prods)
        index = {a: i for i, a in enumerate(names)}
        n, v = len(names), len(word_id)
        m = np.zeros((n, n))
        h = np.zeros(n)
        counts = np.zeros((n, v))
        for a, alts in prods.items():
            i = index[a]
            for rhs, p in alts:
                h[i] -= p * math.log(p)
                for s in rhs:
                    if s in index:
                        m[i, index[s]] += p
                    else:
                        counts[i, word_id[s]] += p
        radius = float(np.max(np.abs(np.linalg.eigvals(m)))) if n else 0.0
        if radius >= 1.0 - 1e-9:
            raise ValueError(f"grammar is not subcritical (spectral radius {radius:.6f}); derivations may not end")
        system = np.eye(n) - m
        ent = np.linalg.solve(system, h)
        cnt = np.linalg.solve(system, counts)
        self.entropy = {a: ent[index[a]] for a in names}
        self.terminal_counts = {a: cnt[index[a]] for a in names}
        self.length = {a: cnt[index[a]].sum() for a in names}


def _length_distribution(prods: Mapping[str, tuple[tuple[Rhs, float], ...]], start: str) -> np.ndarray:
    """``P(len = k)`` of the strings derived from ``start``; requires a non-recursive grammar."""
    memo: dict[str, np.ndarray] = {}
    active: set[str] = set()

    def dist(sym: str) -> np.ndarray:
        if sym not in prods:
            return np.array([0.0, 1.0])
        if sym in memo:
            return memo[sym]
        if sym in active:
            raise ValueError("length_distribution needs a non-recursive grammar")
        active.add(sym)
        total = np.zeros(1)
        for rhs, p in prods[sym]:
            d = np.ones(1)
            for s in rhs:
                d = np.convolve(d, dist(s))
            if len(d) > len(total):
                total = np.pad(total, (0, len(d) - len(total)))
            total[:len(d)] += p * d
        active.discard(sym)
        memo[sym] = total
        return total

    return dist(start)
