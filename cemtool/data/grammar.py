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

A third, ``grammar-hard`` (:func:`grammar_hard`), nests the same rules to depth 4 with grammar-b's flattened
rule probabilities, for studies long enough that the default saturates; entropy rate 3.240 nats/token, mean
sentence length 12.79 tokens (longest 170).

Why these statistics are exact (the grammar is strong LL(1); the entropy rate solves linear systems):
:mod:`cemtool.data.pcfg`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from cemtool.data.pcfg import GRAMMAR_VERSION, Grammar, GrammarSample  # noqa: F401  (re-exported)
from cemtool.data.pcfg_analysis import EOS, Lexicon, Rules  # noqa: F401  (EOS re-exported)

MAX_DEPTH = 2


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


HARD_DEPTH = 4  # grammar-hard's nesting bound (the default grammar's: MAX_DEPTH = 2)
HARD_TEMPER = 0.5  # and its structural rule probabilities p ** 0.5, as grammar-b's


@functools.cache
def grammar_hard() -> Grammar:
    """The built-in ``grammar-hard`` corpus, for runs long enough that the default grammar saturates (at 1M tokens
    a 4-layer baseline is within 0.04 nats of its floor): the default grammar's rules nested to depth 4 instead
    of 2 and flattened like grammar-b's (p -> p ** 0.5: post-modifiers and relative clauses about twice as often),
    so number agreement spans more nested material and sentences are longer; the same words and Zipf lexicon (the
    same word tokenizer). Strong LL(1) like the default (checked at construction), hence an exact floor."""
    return Grammar("grammar-hard", "S", _tempered(_default_rules(HARD_DEPTH), HARD_TEMPER), _default_lexicon(),
                   info={"max_depth": HARD_DEPTH, "derived_from": "grammar", "rule_temper": HARD_TEMPER})


GRAMMARS = {"grammar": default_grammar, "grammar-b": grammar_b, "grammar-hard": grammar_hard}  # source -> grammar


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
