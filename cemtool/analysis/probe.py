"""The linear probe of token separability (METHODS §5): which of k words is the input token at a position, told
from the features there by multinomial logistic regression (float64, L-BFGS, L2 penalty), classes balanced,
stratified k-fold cross-validation; and the classes themselves (words the tokenizer writes as one token at a word
start, with their whole-word counts)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cemtool.distributed import all_gather
from cemtool.errors import CemtoolError

DEFAULT_WORDS = ("is", "are", "was", "were")


@dataclass
class ProbeClasses:
    """The k classes of the probe: each a word and the one token the tokenizer writes for it at a word start.

    ``counts``: whole-word occurrences of each class in the evaluation inputs (the word-start token not followed
    by a token that continues the word); ``continues``: the token ids of the inputs that glue onto the token
    before them (a word's continuation, e.g. ``land`` after `` is``). ``skipped``: why the probe is not run (fewer
    than ``min_count`` occurrences of a class, or no whole-word tokens), else None."""

    names: list[str]
    ids: list[list[int]]
    source: str  # "words" or "frequent"
    note: str = ""
    counts: list[int] = field(default_factory=list)
    min_count: int = 0
    continues: list[int] = field(default_factory=list)
    skipped: str | None = None

    def lookup(self, vocab_size: int) -> torch.Tensor:
        lut = torch.full((vocab_size,), -1, dtype=torch.long)
        for c, ids in enumerate(self.ids):
            lut[torch.tensor(ids, dtype=torch.long)] = c
        return lut

    def whole_words(self, idx: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Class label per position of inputs idx (B, T), -1 where the token is no class or the word goes on in
        the next token. The last position's next token is unknown: kept only when no token continues a word
        (word-level tokenizers)."""
        lab = self.lookup(vocab_size)[idx.cpu()]  # (B, T)
        cont = torch.zeros(vocab_size, dtype=torch.bool)
        cont[torch.tensor(self.continues, dtype=torch.long)] = True
        goes_on = torch.zeros_like(lab, dtype=torch.bool)  # (B, T)
        goes_on[:, :-1] = cont[idx[:, 1:].cpu()]
        goes_on[:, -1] = bool(self.continues)
        return lab.masked_fill(goes_on, -1)

    def report(self) -> dict:
        return {"names": self.names, "ids": self.ids, "source": self.source, "note": self.note,
                "counts": self.counts, "min_per_class": self.min_count, "skipped": self.skipped}


MIN_PER_CLASS = 16  # fewest samples per class the probe accepts (fewer: the probe is skipped, with the counts)


def word_start_id(tokenizer, word: str) -> int | None:
    """The one token the tokenizer writes for ``word`` at a word start, else None: what it makes of " word" (or,
    when that is not one token, of "word"), provided that token does not continue a word
    (:func:`continues_word`). A byte-level BPE's `` is`` (GPT-2's ``Ġis``) qualifies; its bare ``is``, which also
    ends ``th|is``, does not; a SentencePiece-style ``▁is`` does, whichever text gave it."""
    for text in (" " + word, word):
        try:
            ids = tokenizer.encode(text)
        except Exception:  # noqa: BLE001  (a word-level tokenizer without an unknown token raises on new words)
            return None
        if len(ids) == 1:
            return None if continues_word(tokenizer, ids[0]) else int(ids[0])
    return None


def continues_word(tokenizer, i: int) -> bool:
    """Token i glues onto the token before it with no space and starts with a letter or digit: it continues a
    word (decoding it twice gives its text twice, where a word-level tokenizer puts a space between)."""
    text = tokenizer.decode([i])
    return text[:1].isalnum() and tokenizer.decode([i, i]) == text + text


def is_word_token(tokenizer, i: int) -> bool:
    """Token i is a whole word at a word start: its text, stripped, is letters/digits and encodes back to i."""
    word = tokenizer.decode([i]).strip()
    return word.isalnum() and word_start_id(tokenizer, word) == i


def _whole_word_counts(tokens: np.ndarray, continues: set[int], vocab_size: int | None = None) -> np.ndarray:
    """Occurrences per token id in tokens (n, T) that the next token does not continue (last column: kept only
    when no token continues a word)."""
    nxt = np.isin(tokens[:, 1:], list(continues))  # (n, T-1)
    goes_on = np.concatenate([nxt, np.full((len(tokens), 1), bool(continues))], axis=1)  # (n, T)
    return np.bincount(tokens[~goes_on], minlength=vocab_size or int(tokens.max()) + 1)


def probe_classes(tokenizer, tokens: np.ndarray | torch.Tensor, words: Sequence[str] | None = None, k: int = 4,
                  vocab_size: int | None = None, min_count: int = MIN_PER_CLASS) -> ProbeClasses:
    """The words to probe, as whole words at a word start (:func:`word_start_id`), counted in ``tokens`` (the
    evaluation inputs (n, T)): ``words`` if given (skipped, with a note, when one occurs fewer than ``min_count``
    times), else is/are/was/were when each is a word-start token occurring ``min_count`` times, else the k most
    frequent whole-word tokens occurring that often (skipped when fewer than 2 are)."""
    t = np.asarray(tokens)
    t = t.reshape(1, -1) if t.ndim == 1 else t  # (n, T)
    continues = sorted(i for i in np.unique(t).tolist() if continues_word(tokenizer, i))
    counts = _whole_word_counts(t, set(continues), vocab_size)
    count = lambda i: int(counts[i]) if i is not None and i < len(counts) else 0  # noqa: E731

    if words is not None:  # an empty list is refused, never taken as "the default words"
        if len(words) < 2:
            raise CemtoolError("the probe needs at least 2 words")
        bad = [w for w in words if not w or any(ch.isspace() for ch in w)]
        if bad:
            raise CemtoolError(f"probe word(s) {', '.join(map(repr, bad))} are empty or hold spaces")
        ids = [word_start_id(tokenizer, w) for w in words]
        missing = [w for w, i in zip(words, ids, strict=True) if i is None]
        if missing:
            raise CemtoolError(f"probe word(s) {', '.join(map(repr, missing))} are not single tokens of this run's "
                               f"{tokenizer.kind} tokenizer at a word start (what it makes of ' word')",
                               hint="choose other --words, or leave them out for the most frequent whole words")
        c = ProbeClasses(list(words), [[i] for i in ids], "words", counts=[count(i) for i in ids],
                         min_count=min_count, continues=continues)
        if min(c.counts) < min_count:
            c.skipped = (f"a probe class occurs fewer than {min_count} times as a whole word in the evaluation "
                         f"tokens ({_counts_text(c)}); evaluate more tokens or choose other --words")
        return c
    if tokenizer.kind == "ids":  # token ids without a tokenizer (cemtool.data.tokens.id_tokenizer): no words
        return ProbeClasses(list(DEFAULT_WORDS), [[] for _ in DEFAULT_WORDS], "words", min_count=min_count,
                            skipped="the data are token ids without a tokenizer, so there are no words to probe")
    ids = [word_start_id(tokenizer, w) for w in DEFAULT_WORDS]
    default = ProbeClasses(list(DEFAULT_WORDS), [[i] if i is not None else [] for i in ids], "words",
                           counts=[count(i) for i in ids], min_count=min_count, continues=continues)
    if min(default.counts) >= min_count:
        return default
    if k < 2:
        raise CemtoolError("the probe needs k >= 2 classes")
    why = (f"{'/'.join(DEFAULT_WORDS)} do not each occur {min_count} times as whole words of this {tokenizer.kind} "
           f"tokenizer ({_counts_text(default)})")
    top = []
    for i in np.argsort(-counts, kind="stable"):
        if counts[i] < min_count or len(top) == k:
            break
        if is_word_token(tokenizer, int(i)):
            top.append(int(i))
    if len(top) < 2:
        default.skipped = f"{why}, and fewer than 2 other whole-word tokens do; evaluate more tokens"
        return default
    return ProbeClasses([tokenizer.decode([i]).strip() for i in top], [[i] for i in top], "frequent",
                        note=f"{why}: the {len(top)} most frequent whole words instead", counts=[count(i) for i in top],
                        min_count=min_count, continues=continues)


def _counts_text(c: ProbeClasses) -> str:
    return ", ".join(f"{n!r}: {m}" for n, m in zip(c.names, c.counts, strict=True))


def fit_logistic(X: torch.Tensor, y: torch.Tensor, k: int, weight_decay: float = 1e-3,
                 max_iter: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Multinomial logistic regression (float64, L-BFGS): minimise mean CE(X W + b, y) + wd/2 |W|^2."""
    X = X.double()
    W = torch.zeros(X.shape[1], k, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(k, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1.0, max_iter=max_iter, tolerance_grad=1e-9, tolerance_change=1e-12,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(X @ W + b, y) + 0.5 * weight_decay * (W * W).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return W.detach(), b.detach()


def stratified_folds(y: torch.Tensor, folds: int, seed: int) -> torch.Tensor:
    """Fold index per sample: each class shuffled (seeded) and dealt round-robin."""
    g = torch.Generator().manual_seed(seed)
    fold = torch.empty_like(y)
    for c in torch.unique(y):
        idx = torch.nonzero(y == c).squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        fold[idx] = torch.arange(len(idx)) % folds
    return fold


def probe_accuracy(X: torch.Tensor, y: torch.Tensor, k: int | None = None, *, folds: int = 5, seed: int = 0,
                   weight_decay: float = 1e-3, max_iter: int = 200) -> dict:
    """k-fold cross-validated accuracy of a linear probe; features standardised on each training fold."""
    X, y = X.double(), y.long()
    k = k or int(y.max()) + 1
    fold = stratified_folds(y, folds, seed)
    accs = []
    for f in range(folds):
        tr, te = fold != f, fold == f
        mu, sd = X[tr].mean(0), X[tr].std(0).clamp_min(1e-12)
        W, b = fit_logistic((X[tr] - mu) / sd, y[tr], k, weight_decay, max_iter)
        pred = (((X[te] - mu) / sd) @ W + b).argmax(-1)
        accs.append(float((pred == y[te]).double().mean()))
    a = np.asarray(accs)
    std = float(a.std(ddof=1)) if folds > 1 else 0.0
    return {"accuracy": float(a.mean()), "std": std, "se": std / math.sqrt(folds), "folds": accs,
            "chance": 1.0 / k, "n": int(len(y)), "k": k}


class ProbeSample:
    """A bounded, balanced sample of (features, label) at positions whose input token (or, with ``lag``, the token
    ``lag`` positions earlier) is one of the classes."""

    def __init__(self, classes: ProbeClasses, vocab_size: int, per_class: int, lag: int = 0):
        self.classes, self.vocab_size, self.lag = classes, vocab_size, lag
        self.k, self.per_class = len(classes.names), per_class
        self.counts = [0] * self.k
        self.labels: list[torch.Tensor] = []
        self.features: dict[str, list[torch.Tensor]] = {}

    def select(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch, position) indices to keep from inputs idx (B, T), and their labels: the class of the token at
        the position (``lag`` 0), or of the token ``lag`` positions before it (a context probe: the features at t
        asked which word was at t - lag; the first ``lag`` positions have none)."""
        lab = self.classes.whole_words(idx, self.vocab_size)  # (B, T)
        if self.lag:
            lab = torch.cat([torch.full_like(lab[:, :self.lag], -1), lab[:, :-self.lag]], dim=1)  # (B, T)
        keep_b, keep_t, keep_y = [], [], []
        for c in range(self.k):
            room = self.per_class - self.counts[c]
            if room <= 0:
                continue
            pos = torch.nonzero(lab == c)[:room]  # (n, 2)
            self.counts[c] += len(pos)
            keep_b.append(pos[:, 0])
            keep_t.append(pos[:, 1])
            keep_y.append(torch.full((len(pos),), c, dtype=torch.long))
        if not keep_b or sum(len(b) for b in keep_b) == 0:
            return None
        self.labels.append(torch.cat(keep_y))
        return torch.cat(keep_b), torch.cat(keep_t)

    def add(self, name: str, feats: torch.Tensor) -> None:
        self.features.setdefault(name, []).append(feats.float().cpu())

    def merge_ranks(self) -> None:
        """Gather every rank's sample (each drawn from its contiguous shard, in order) and keep the first
        ``per_class`` of each class in rank order: the sample one process would have drawn."""
        parts = all_gather((self.labels, self.features))
        if len(parts) == 1:
            return
        labels = [t for lab, _ in parts for t in lab]
        if not labels:
            return
        y = torch.cat(labels)
        keep = torch.zeros(len(y), dtype=torch.bool)
        for c in range(self.k):
            keep[torch.nonzero(y == c).squeeze(1)[:self.per_class]] = True
        self.counts = [int((y[keep] == c).sum()) for c in range(self.k)]
        self.labels = [y[keep]]
        names = dict.fromkeys(n for _, f in parts for n in f)  # a rank that found no class adds nothing
        self.features = {n: [torch.cat([t for _, f in parts for t in f.get(n, [])])[keep]] for n in names}

    def balanced(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
        """Features per name and labels, each class truncated to the rarest class's count m; returns m.
        Samples are ordered by class, in evaluation order within a class (whatever the batching)."""
        if not self.labels:
            return {}, torch.zeros(0, dtype=torch.long), 0
        y = torch.cat(self.labels)
        m = min(self.counts)
        keep = torch.cat([torch.nonzero(y == c).squeeze(1)[:m] for c in range(self.k)])  # (k m,) class by class
        return {n: torch.cat(f)[keep] for n, f in self.features.items()}, y[keep], m


__all__ = ["DEFAULT_WORDS", "MIN_PER_CLASS", "ProbeClasses", "ProbeSample", "continues_word", "fit_logistic",
           "is_word_token", "probe_accuracy", "probe_classes", "stratified_folds", "word_start_id"]
