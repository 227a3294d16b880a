"""The built-in ``grammar`` corpus: English-like text from a probabilistic grammar with an exactly known entropy.

The language
------------
Sentences are i.i.d. draws from a probabilistic context-free grammar (PCFG) over a word vocabulary of about
480 words. Every sentence ends with the token ``"."`` and ``"."`` occurs nowhere else, so a stream of
sentences is cut into sentences unambiguously. The default grammar has

- noun phrases: determiner (singular-only ``a/this/every/...``, plural-only ``these/some/many/...`` or
  number-neutral ``the/my/their/...``), up to two adjectives, a singular or plural head noun, and optionally
  *one* post-modifier: a prepositional phrase (``the dog near the big cats``) or a relative clause, either
  subject-relative (``the cats that chase the dog``) or object-relative (``the dogs that the cat chases``);
- verb phrases agreeing in number with their subject's head noun, across all the nested material in between:
  the copula ``is/are/was/were`` (about 6 % of all tokens) with an adjective, predicate noun phrase or
  locative phrase, present/past transitive and intransitive verbs, modals, pre-verbal adverbs, ``not``;
- a main clause, optionally followed by a conjunction and a second clause.

Nesting is bounded: noun phrases carry a depth (the main clause's are at depth 0); a post-modifier of a
depth-``d`` noun phrase contains depth-``d+1`` material, and noun phrases at depth ``MAX_DEPTH`` take no
post-modifier. The language is finite (longest sentence: see ``describe()``), but long sentences are rare.
Word choice within a category (nouns, adjectives, verbs, ...) is Zipf-distributed. Exact statistics of the
default grammar (``describe()``): 483 words, entropy rate 3.183 nats/token, mean sentence length 8.93 tokens,
60 % of the entropy being lexical choice and 40 % (1.26 nats/token) structure.

A second built-in grammar, ``grammar-b`` (:func:`grammar_b`), is the target of forgetting experiments: the same
rules and words (hence the same word tokenizer), with flattened rule probabilities and the Zipf ranking of the
words within each category reversed; entropy rate 3.227 nats/token, mean sentence length 12.32 tokens, and a
unigram distribution at total-variation distance 0.59 from the default's.

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

GRAMMAR_VERSION = 1
EOS = "."
MAX_DEPTH = 2

Rhs = tuple[str, ...]
Rules = Mapping[str, Sequence[tuple[float, Sequence[str]]]]
Lexicon = Mapping[str, Sequence[tuple[str, float]]]

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


# ---------------------------------------------------------------------- grammar analysis


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


# ---------------------------------------------------------------------- the default grammar

_NOUNS = """dog:dogs cat:cats man:men woman:women child:children teacher:teachers bird:birds king:kings
friend:friends girl:girls boy:boys doctor:doctors horse:horses house:houses queen:queens student:students
farmer:farmers tree:trees book:books car:cars mouse:mice river:rivers garden:gardens baby:babies
neighbor:neighbors city:cities table:tables letter:letters soldier:soldiers village:villages fox:foxes
wolf:wolves painter:painters singer:singers writer:writers rabbit:rabbits road:roads boat:boats song:songs
story:stories sailor:sailors pilot:pilots nurse:nurses lawyer:lawyers dancer:dancers hunter:hunters
driver:drivers thief:thieves parent:parents brother:brothers sister:sisters bear:bears lion:lions
tiger:tigers monkey:monkeys bridge:bridges chair:chairs box:boxes park:parks door:doors window:windows
wall:walls picture:pictures hill:hills forest:forests field:fields ship:ships train:trains key:keys
flower:flowers stone:stones ball:balls room:rooms kitchen:kitchens school:schools church:churches
market:markets shop:shops castle:castles lake:lakes"""

_ADJECTIVES = """big small young happy little red tall good quiet black white green strange new dark
brave clever kind gentle lazy busy hungry tired famous rich poor strong weak bright cold warm heavy sad
friendly funny proud calm wild tiny huge pretty nervous curious careful simple slow soft sharp clean dirty
golden silver wooden broken hidden lonely noisy polite rude shy sleepy gray blue mighty"""

_TRANSITIVE = """sees:see:saw likes:like:liked chases:chase:chased knows:know:knew finds:find:found
follows:follow:followed helps:help:helped watches:watch:watched meets:meet:met loves:love:loved
visits:visit:visited calls:call:called hates:hate:hated pushes:push:pushed pulls:pull:pulled
carries:carry:carried catches:catch:caught teaches:teach:taught hears:hear:heard holds:hold:held
admires:admire:admired fears:fear:feared feeds:feed:fed greets:greet:greeted remembers:remember:remembered
paints:paint:painted builds:build:built opens:open:opened kicks:kick:kicked trusts:trust:trusted"""

_INTRANSITIVE = """sleeps:sleep:slept runs:run:ran waits:wait:waited laughs:laugh:laughed smiles:smile:smiled
sings:sing:sang walks:walk:walked dances:dance:danced cries:cry:cried falls:fall:fell jumps:jump:jumped
swims:swim:swam arrives:arrive:arrived leaves:leave:left rests:rest:rested shouts:shout:shouted
whispers:whisper:whispered works:work:worked plays:play:played sits:sit:sat stays:stay:stayed
grows:grow:grew travels:travel:traveled listens:listen:listened returns:return:returned"""

_CLOSED = {
    "DET_SG": "a this every each one another",
    "DET_PL": "these some many those all two few several three both",
    "DET_ANY": "the his my her their our your no",
    "PDET_SG": "a the his my her their our your one",
    "PDET_PL": "the some his my her their our your two these those",
    "PRON_SG": "he she it someone nobody",
    "PRON_PL": "they we you",
    "OBJ_PRON": "him them it us me",
    "PREP": "in near with on from of behind under beside above without inside below around across",
    "LOCPREP": "in near on behind under beside above inside below",
    "ADV": "often never always usually sometimes quickly slowly suddenly quietly rarely finally happily "
           "still soon gladly seldom",
    "INTENS": "very quite rather really too extremely",
    "MODAL": "will can may must should might could would",
    "CONJ": "and but because while although",
}
_ZIPF = {"DET_SG": 1.3, "DET_PL": 1.1, "DET_ANY": 1.6, "PDET_SG": 1.4, "PDET_PL": 1.4, "PRON_SG": 1.0,
         "PRON_PL": 1.0, "OBJ_PRON": 1.0, "PREP": 1.1, "LOCPREP": 1.0, "ADV": 1.0, "INTENS": 1.2,
         "MODAL": 1.0, "CONJ": 1.2}
_OPEN_ZIPF = 1.1


def _zipf(words: Sequence[str], s: float) -> list[tuple[str, float]]:
    return [(w, 1.0 / (k + 1) ** s) for k, w in enumerate(words)]


def _default_lexicon() -> dict[str, list[tuple[str, float]]]:
    nouns = [pair.split(":") for pair in _NOUNS.split()]
    tr = [triple.split(":") for triple in _TRANSITIVE.split()]
    intr = [triple.split(":") for triple in _INTRANSITIVE.split()]
    lex = {
        "N_SG": _zipf([sg for sg, _ in nouns], _OPEN_ZIPF),
        "N_PL": _zipf([pl for _, pl in nouns], _OPEN_ZIPF),
        "ADJ": _zipf(_ADJECTIVES.split(), _OPEN_ZIPF),
        "VTR_SG": _zipf([f[0] for f in tr], _OPEN_ZIPF),
        "VTR_PL": _zipf([f[1] for f in tr], _OPEN_ZIPF),
        "VTR_PAST": _zipf([f[2] for f in tr], _OPEN_ZIPF),
        "VIN_SG": _zipf([f[0] for f in intr], _OPEN_ZIPF),
        "VIN_PL": _zipf([f[1] for f in intr], _OPEN_ZIPF),
        "VIN_PAST": _zipf([f[2] for f in intr], _OPEN_ZIPF),
    }
    lex.update({cat: _zipf(words.split(), _ZIPF[cat]) for cat, words in _CLOSED.items()})
    return lex


_COPULA = {"sg": ("is", "was"), "pl": ("are", "were")}


def _default_rules(max_depth: int) -> dict[str, list[tuple[float, list[str]]]]:
    """Structural rules; ``{n}`` is the number (sg/pl), ``{d}`` the depth, see the module docstring."""
    rules: dict[str, list[tuple[float, list[str]]]] = {}

    def add(lhs: str, *alts: tuple[float, str]) -> None:
        rules[lhs] = [(p, rhs.split()) for p, rhs in alts]

    def subject_then(lhs: str, d: int, vp: str) -> None:
        """``lhs`` -> subject noun phrase at depth d, then ``vp`` (a pattern in {n}) agreeing with its head."""
        sg, pl = vp.format(n="SG"), vp.format(n="PL")
        add(lhs, (0.20, f"DET_SG ADJS N_SG POST_SG{d} {sg}"), (0.14, f"DET_PL ADJS N_PL POST_PL{d} {pl}"),
            (0.46, f"DET_ANY ADJS {lhs}_HEAD"), (0.12, f"PRON_SG {sg}"), (0.08, f"PRON_PL {pl}"))
        add(f"{lhs}_HEAD", (0.55, f"N_SG POST_SG{d} {sg}"), (0.45, f"N_PL POST_PL{d} {pl}"))

    add("S", (1.0, "CLAUSE0 TAIL"))
    add("TAIL", (0.85, "."), (0.15, "CONJ CLAUSE0 ."))
    subject_then("CLAUSE0", 0, "VP_{n}0")
    add("ADJS", (0.3, "ADJ ADJS2"), (0.7, ""))
    add("ADJS2", (0.15, "ADJ"), (0.85, ""))
    add("INTENSOPT", (0.25, "INTENS"), (0.75, ""))
    for n in ("SG", "PL"):
        add(f"GAPVP_{n}", (0.12, f"ADV GAPV_{n}"), (0.88, f"GAPV_{n}"))
        add(f"GAPV_{n}", (0.45, f"VTR_{n}"), (0.40, "VTR_PAST"), (0.15, "MODAL VTR_PL"))
    for d in range(max_depth + 1):
        add(f"NP{d}", (0.22, f"DET_SG ADJS N_SG POST_SG{d}"), (0.15, f"DET_PL ADJS N_PL POST_PL{d}"),
            (0.50, f"DET_ANY ADJS NHEAD{d}"), (0.13, "OBJ_PRON"))
        add(f"NHEAD{d}", (0.55, f"N_SG POST_SG{d}"), (0.45, f"N_PL POST_PL{d}"))
        add(f"INPP{d}", (0.30, f"LOCPREP NP{d}"), (0.70, ""))
        add(f"BAREVP{d}", (0.55, f"VTR_PL NP{d}"), (0.45, f"VIN_PL INPP{d}"))
        for n in ("SG", "PL"):
            pres, past = _COPULA[n.lower()]
            if d < max_depth:
                add(f"POST_{n}{d}", (0.18, f"PREP NP{d + 1}"), (0.12, f"that REL_{n}{d + 1}"), (0.70, ""))
            else:
                add(f"POST_{n}{d}", (1.0, ""))
            if d > 0:
                add(f"REL_{n}{d}", (0.7, f"VP_{n}{d}"), (0.3, f"GAPCL{d}"))
            add(f"VP_{n}{d}", (0.25, f"{pres} COPREST_{n}{d}"), (0.17, f"{past} COPREST_{n}{d}"),
                (0.08, f"MODAL MODREST_{n}{d}"), (0.07, f"ADV LEXVP_{n}{d}"), (0.43, f"LEXVP_{n}{d}"))
            add(f"LEXVP_{n}{d}", (0.30, f"VTR_{n} NP{d}"), (0.25, f"VTR_PAST NP{d}"),
                (0.25, f"VIN_{n} INPP{d}"), (0.20, f"VIN_PAST INPP{d}"))
            add(f"MODREST_{n}{d}", (0.30, f"be COPREST_{n}{d}"), (0.10, f"ADV BAREVP{d}"), (0.60, f"BAREVP{d}"))
            add(f"COPREST_{n}{d}", (0.10, f"not COMP_{n}{d}"), (0.90, f"COMP_{n}{d}"))
            add(f"COMP_{n}{d}", (0.55, "INTENSOPT ADJ"), (0.20, f"PDET_{n} ADJS N_{n} POST_{n}{d}"),
                (0.25, f"LOCPREP NP{d}"))
        if d > 0:
            subject_then(f"GAPCL{d}", d, "GAPVP_{n}")
    return rules


@functools.cache
def default_grammar() -> Grammar:
    """The built-in corpus grammar (cached)."""
    return Grammar("grammar", "S", _default_rules(MAX_DEPTH), _default_lexicon(), info={"max_depth": MAX_DEPTH})


# ---------------------------------------------------------------------- grammar-b (a second distribution)

B_TEMPER = 0.5  # grammar-b's structural rule probabilities are p ** B_TEMPER, renormalised


def _tempered(rules: Rules, power: float) -> dict[str, list[tuple[float, Sequence[str]]]]:
    """Every alternative's probability raised to ``power`` (the Grammar renormalises): < 1 flattens each choice."""
    return {lhs: [(p ** power, rhs) for p, rhs in alts] for lhs, alts in rules.items()}


def _reranked(lexicon: Lexicon) -> dict[str, list[tuple[str, float]]]:
    """The Zipf ranking reversed within every word category: the k-th most frequent word takes the weight of the
    k-th rarest (the set of words, hence the vocabulary and its ids, is unchanged)."""
    return {cat: [(w, wt) for (w, _), (_, wt) in zip(words, reversed(words), strict=True)]
            for cat, words in lexicon.items()}


@functools.cache
def grammar_b() -> Grammar:
    """The built-in ``grammar-b`` corpus, the target of forgetting experiments (METHODS §7) for models trained on
    ``grammar``: the same rules and the same words (so the same word tokenizer and token ids), but another
    distribution. Structural choices are flattened (each rule probability p -> p ** 0.5, renormalised: more
    adjectives, modifiers, relative clauses, modals) and the Zipf ranking of the words within every category is
    reversed (the rarest noun becomes the most frequent, ...). Its rules are those of the default grammar, so it is
    strong LL(1) too and its entropy floor is exact (``describe()``)."""
    return Grammar("grammar-b", "S", _tempered(_default_rules(MAX_DEPTH), B_TEMPER), _reranked(_default_lexicon()),
                   info={"max_depth": MAX_DEPTH, "derived_from": "grammar", "rule_temper": B_TEMPER,
                         "lexicon": "Zipf ranking reversed within each category"})


GRAMMARS = {"grammar": default_grammar, "grammar-b": grammar_b}  # data source name -> grammar


@functools.cache
def tiny_grammar() -> Grammar:
    """A tiny grammar with a finite language (138 sentences over 17 words) for exhaustive tests.

    It has agreement, an optional adjective whose absence is predicted from FOLLOW, and an optional
    prepositional phrase, so every mechanism of the default grammar is exercised.
    """
    rules = {
        "S": [(0.6, ["DET_SG", "N_SG", "PP", "VP_SG", "."]), (0.4, ["some", "N_PL", "PP", "VP_PL", "."])],
        "PP": [(0.25, ["near", "the", "N_PL"]), (0.75, [])],
        "VP_SG": [(0.5, ["is", "ADJOPT"]), (0.2, ["was", "ADJ"]), (0.3, ["sleeps"])],
        "VP_PL": [(0.7, ["are", "ADJOPT"]), (0.3, ["were", "ADJ"])],
        "ADJOPT": [(0.6, ["ADJ"]), (0.4, [])],
    }
    lexicon = {"DET_SG": [("a", 0.7), ("the", 0.3)], "N_SG": [("dog", 0.5), ("cat", 0.5)],
               "N_PL": [("dogs", 0.6), ("cats", 0.4)], "ADJ": [("big", 0.5), ("tall", 0.3), ("red", 0.2)]}
    return Grammar("tiny", "S", rules, lexicon, info={"max_depth": 1})
