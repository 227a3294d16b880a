"""Representation collapse (METHODS §5): matrix entropy, linear separability, effective rank, cosine similarity
and attention statistics, per layer (and per head where defined), streamed over an evaluation set.

The measures
------------
- **Matrix-based Rényi entropy** of a sequence's token features X (T x D): z-score every feature over all
  evaluation tokens (float64), take the Gram matrix K = X Xᵀ, p = eig(K) / tr(K) (eigenvalues clamped >= 0),
  ``S_alpha = log(sum p^alpha) / (1 - alpha)``; alpha -> 1 is the Shannon entropy ``-sum p log p``. An identity
  Gram gives log T (no collapse), a rank-1 Gram 0 (every token the same direction). Reported as mean, std and
  standard error over sequences, for the values (all heads concatenated, and each head alone) and for the hidden
  states (``resid_post``). Features with zero variance are set to 0 after centring [decision: avoids 0/0].
- **Token separability**: a linear probe, multinomial logistic regression fitted in float64 with L-BFGS and an L2
  penalty, tells which of k words is the input token at a position from the features there; classes balanced
  (each truncated to the rarest class's count), stratified k-fold cross-validation, mean ± std over folds beside
  chance 1/k.
- **Effective rank** (Roy & Vetterli 2007): ``exp(H(p))`` with ``p = sigma / sum(sigma)`` the normalised singular
  values of the (raw, uncentred) token-feature matrix; per sequence (T x D) and over all evaluation tokens
  (from the streamed D x D second-moment matrix).
- **Mean pairwise cosine similarity** between the token states of a sequence (pairs i != j), raw features.
- **Attention statistics** per layer, head and query position t (context t + 1 keys): row entropy, entropy /
  log(t + 1), maximum probability, share of rows whose maximum exceeds 0.9, and the logit spread of the row
  (max - min and std of the logits, recovered as differences of log-probabilities; a row whose smallest probability
  underflowed gives a lower bound, flagged by ``logit_underflow``).

Everything is streamed: pass 1 accumulates feature moments, second-moment matrices, per-sequence ranks/cosines,
attention sums and a bounded sample of probe features; pass 2 re-runs the model and computes the entropies of the
z-scored features. Memory is bounded by the batch, the probe sample cap and D x D per layer, not by the number of
evaluation tokens. A hook point that fires several times per forward (recursive CEM steps) is read at its last
firing.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from cemtool.distributed import all_gather, all_reduce_sum, shard
from cemtool.errors import CemtoolError
from cemtool.models.capture import capture, hook_points

DEFAULT_WORDS = ("is", "are", "was", "were")
ABOVE = 0.9  # a row "saturates" when its largest probability exceeds this


# --------------------------------------------------------------------------------------------------------------
# spectra: entropy, effective rank, cosine


def clean_spectrum(eigs: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of a PSD matrix with rounding noise removed: negatives and those below m * eps * max (the
    numerical-rank threshold) set to 0. Orders alpha < 1 would otherwise count noise eigenvalues (~1e-16)."""
    eigs = eigs.double().clamp_min(0.0)
    tol = eigs.shape[-1] * torch.finfo(torch.float64).eps * eigs.amax(-1, keepdim=True)
    return torch.where(eigs > tol, eigs, torch.zeros_like(eigs))


def gram_eigenvalues(X: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (clamped >= 0) of the Gram matrix X Xᵀ of X (..., T, D), via the smaller of X Xᵀ and XᵀX (same
    nonzero spectrum); float64; (..., min(T, D))."""
    X = X.double()
    G = X @ X.transpose(-2, -1) if X.shape[-2] <= X.shape[-1] else X.transpose(-2, -1) @ X  # (..., m, m)
    return clean_spectrum(torch.linalg.eigvalsh(G))


def renyi_entropy(eigs: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Rényi entropy of p = eigs / sum(eigs) along the last axis; alpha == 1 is Shannon (nats)."""
    if alpha <= 0:
        raise ValueError("the Rényi order alpha must be > 0")
    eigs = clean_spectrum(eigs)
    p = eigs / eigs.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # (..., m)
    if abs(alpha - 1.0) < 1e-12:
        return torch.special.entr(p).sum(-1)  # -sum p log p, with 0 log 0 = 0
    return torch.log((p.pow(alpha) * (p > 0)).sum(-1)) / (1.0 - alpha)


def gram_entropy(K: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Matrix-based Rényi entropy of a positive semi-definite Gram matrix K (..., T, T)."""
    return renyi_entropy(torch.linalg.eigvalsh(K.double()), alpha)


def matrix_entropy(X: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Rényi entropy of the Gram matrix of X (..., T, D) (features already z-scored); (...,)."""
    return renyi_entropy(gram_eigenvalues(X), alpha)


def effective_rank_from_singular(s: torch.Tensor) -> torch.Tensor:
    """Roy & Vetterli's effective rank exp(H(s / sum s)) of singular values s (..., m)."""
    s = s.double().clamp_min(0.0)
    p = s / s.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.exp(torch.special.entr(p).sum(-1))


def effective_rank(X: torch.Tensor) -> torch.Tensor:
    """Effective rank of each matrix X (..., T, D)."""
    return effective_rank_from_singular(gram_eigenvalues(X).sqrt())


def mean_pairwise_cosine(X: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over ordered pairs i != j of the rows of X (..., T, D); (...,)."""
    U = F.normalize(X.double(), dim=-1)  # (..., T, D)
    T = U.shape[-2]
    if T < 2:
        return torch.full(U.shape[:-2], float("nan"), dtype=torch.float64)
    total = (U.sum(-2) ** 2).sum(-1)  # (...,) = sum_ij cos_ij
    diag = (U * U).sum((-2, -1))  # (...,) = T (0 for zero rows)
    return (total - diag) / (T * (T - 1))


# --------------------------------------------------------------------------------------------------------------
# streaming accumulators


class Moments:
    """Per-feature mean and standard deviation over all tokens, accumulated in float64."""

    def __init__(self, dim: int):
        self.n = 0
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.sumsq = torch.zeros(dim, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # (N, D)
        self.n += x.shape[0]
        self.sum += x.sum(0)
        self.sumsq += (x * x).sum(0)

    def mean_std(self) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.sum / max(self.n, 1)
        var = (self.sumsq / max(self.n, 1) - mean * mean).clamp_min(0.0)
        std = var.sqrt()
        return mean, torch.where(std > 1e-12 * (1 + mean.abs()), std, torch.full_like(std, math.inf))

    def zscore(self, x: torch.Tensor) -> torch.Tensor:
        """(x - mean) / std; zero-variance features become 0."""
        mean, std = self.mean_std()
        return (x.double() - mean) / std

    def all_reduce(self) -> None:
        """Sum the counts and sums over the ranks (nothing with one process)."""
        n = all_reduce_sum(torch.tensor([float(self.n)], dtype=torch.float64))
        self.n = int(n[0])
        all_reduce_sum(self.sum)
        all_reduce_sum(self.sumsq)


class Scalars:
    """Mean, std and standard error of a stream of per-sequence values."""

    def __init__(self) -> None:
        self.n, self.sum, self.sumsq = 0, 0.0, 0.0

    def update(self, v: torch.Tensor) -> None:
        v = v.double().reshape(-1)
        v = v[torch.isfinite(v)]
        self.n += v.numel()
        self.sum += float(v.sum())
        self.sumsq += float((v * v).sum())

    def all_reduce(self) -> None:
        """Sum the counts and sums over the ranks (nothing with one process)."""
        t = all_reduce_sum(torch.tensor([float(self.n), self.sum, self.sumsq], dtype=torch.float64))
        self.n, self.sum, self.sumsq = int(t[0]), float(t[1]), float(t[2])

    def summary(self) -> dict:
        if self.n == 0:
            return {"mean": None, "std": None, "se": None, "n": 0}
        mean = self.sum / self.n
        var = max(self.sumsq / self.n - mean * mean, 0.0) * self.n / max(self.n - 1, 1)
        std = math.sqrt(var)
        return {"mean": mean, "std": std, "se": std / math.sqrt(self.n), "n": self.n}


def attention_row_stats(probs: torch.Tensor) -> torch.Tensor:
    """Per-row statistics of causal attention probabilities (B, H, T, T), summed over the batch: (6, H, T) float64
    rows = entropy, max probability, [max > 0.9], logit range (max - min over keys j <= t), logit std,
    [smallest probability underflowed]."""
    p = probs.double()
    T = p.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=p.device).tril()  # (T, T) keys j <= t
    ent = torch.special.entr(p).sum(-1)  # (B, H, T)
    mx = p.amax(-1)  # (B, H, T)
    tiny = torch.finfo(probs.dtype).tiny
    logp = torch.log(p.clamp_min(tiny))  # (B, H, T, T); logits up to a per-row constant
    lo = logp.masked_fill(~causal, math.inf).amin(-1)  # (B, H, T)
    width = causal.sum(-1).double()  # (T,) keys per row
    mean = (logp * causal).sum(-1) / width  # (B, H, T)
    var = (((logp - mean[..., None]) ** 2) * causal).sum(-1) / width  # (B, H, T)
    under = ((p <= tiny) & causal).any(-1)  # (B, H, T)
    stats = torch.stack([ent, mx, (mx > ABOVE).double(), logp.amax(-1) - lo, var.sqrt(), under.double()])
    return stats.sum(1)  # (6, H, T)


ATTN_FIELDS = ("entropy", "max_prob", "share_above_0.9", "logit_range", "logit_std", "logit_underflow")


def summarise_attention(sums: torch.Tensor, n_seq: int) -> dict:
    """Turn summed row statistics (6, H, T) over n_seq sequences into per-head curves over query position and
    their averages; entropy_norm = entropy / log(t + 1) (undefined at t = 0, where there is one key)."""
    mean = (sums / max(n_seq, 1)).numpy()  # (6, H, T)
    H, T = mean.shape[1], mean.shape[2]
    log_ctx = np.log(np.arange(1, T + 1, dtype=np.float64))  # (T,)
    norm = np.full((H, T), np.nan)
    norm[:, 1:] = mean[0][:, 1:] / log_ctx[1:]
    curves = {f: mean[i] for i, f in enumerate(ATTN_FIELDS)}
    curves["entropy_norm"] = norm
    heads = []
    for h in range(H):
        row = {"head": h}
        for f, c in curves.items():
            v = c[h, 1:] if f == "entropy_norm" else c[h]
            row[f] = float(np.nanmean(v)) if np.isfinite(v).any() else None
        heads.append(row)
    return {"per_head": heads, "curves": {f: _jsonable(c) for f, c in curves.items()},
            "context_length": list(range(1, T + 1))}


def kv_groups(att: dict, attn: torch.nn.Module | None) -> None:
    """Grouped- or multi-query attention (an attention module with ``n_kv_head`` < its query heads, e.g. a Llama
    loaded by cemtool.subject.hf): add ``per_kv_head``, each key-value head's statistics averaged over the query heads
    that read it (query head h reads key-value head h // (H / n_kv_head)), and ``kv_head`` to each query head's row."""
    H, kv = len(att["per_head"]), getattr(attn, "n_kv_head", None)
    if not kv or kv >= H or H % kv:
        return
    group = H // kv
    for row in att["per_head"]:
        row["kv_head"] = row["head"] // group
    att["per_kv_head"] = []
    for g in range(kv):
        rows = att["per_head"][g * group:(g + 1) * group]
        out = {"kv_head": g, "query_heads": [r["head"] for r in rows]}
        for f in rows[0]:
            if f not in ("head", "kv_head"):
                vals = [r[f] for r in rows if r[f] is not None]
                out[f] = float(np.mean(vals)) if vals else None
        att["per_kv_head"].append(out)


def _jsonable(a: np.ndarray) -> list:
    return [[None if not np.isfinite(v) else float(v) for v in row] for row in np.asarray(a)]


# --------------------------------------------------------------------------------------------------------------
# the linear probe


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
    """A bounded, balanced sample of (features, label) at positions whose input token is one of the classes."""

    def __init__(self, classes: ProbeClasses, vocab_size: int, per_class: int):
        self.classes, self.vocab_size = classes, vocab_size
        self.k, self.per_class = len(classes.names), per_class
        self.counts = [0] * self.k
        self.labels: list[torch.Tensor] = []
        self.features: dict[str, list[torch.Tensor]] = {}

    def select(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(batch, position) indices to keep from inputs idx (B, T), and their labels."""
        lab = self.classes.whole_words(idx, self.vocab_size)  # (B, T)
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


# --------------------------------------------------------------------------------------------------------------
# the report


@dataclass
class LayerPoints:
    """Which capture points a layer offers."""

    values: str | None
    hidden: str | None
    pattern: str | None
    routing: str | None


def layer_points(model: torch.nn.Module) -> dict[int, LayerPoints]:
    names = set(hook_points(model))
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))})

    def get(i: int, suffix: str) -> str | None:
        n = f"blocks.{i}.{suffix}"
        return n if n in names else None

    return {i: LayerPoints(get(i, "attn.v"), get(i, "resid_post"), get(i, "attn.pattern"), get(i, "lime.weights"))
            for i in layers}


def _values_concat(v: torch.Tensor) -> torch.Tensor:
    B, H, T, dh = v.shape
    return v.permute(0, 2, 1, 3).reshape(B, T, H * dh)  # (B, T, H*d_h)


def _batches(inputs: torch.Tensor, batch_size: int) -> Iterable[torch.Tensor]:
    for i in range(0, len(inputs), batch_size):
        yield inputs[i:i + batch_size]


def _transform(patterns: set[str], routing: set[str],
               routed: dict[str, list]) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
    """Reduce attention patterns to row statistics as they are captured; add per-token routing mixes
    (B, T, H, S) into ``routed[name] = [sum (H, S), tokens]`` and store nothing (a static router's weights are
    parameters, reported from the model itself)."""
    def f(name: str, x: torch.Tensor) -> torch.Tensor | None:
        if name in patterns:
            return attention_row_stats(x)  # (6, H, T)
        if name in routing:
            if x.dim() == 4:
                s = routed.setdefault(name, [0, 0])
                s[0] = s[0] + x.double().sum((0, 1)).cpu()  # (H, S)
                s[1] += x.shape[0] * x.shape[1]
            return None
        return x
    return f


@dataclass
class _Layer:
    """Pass-1 and pass-2 accumulators of one layer."""

    moments: dict[str, Moments] = field(default_factory=dict)
    second: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Scalars] = field(default_factory=dict)
    attn: torch.Tensor | None = None
    heads: int = 0

    def stat(self, key: str) -> Scalars:
        return self.scalars.setdefault(key, Scalars())


def _reduce_ranks(acc: dict[int, _Layer], routed: dict[str, list]) -> None:
    """Sum the sufficient statistics of every rank (Gram matrices, per-sequence sums, attention rows, routing
    mixes), in the same order on every rank; nothing with one process."""
    for i in sorted(acc):
        a = acc[i]
        for kind in sorted(a.second):
            a.second[kind] = all_reduce_sum(a.second[kind].contiguous())
        for key in sorted(a.scalars):
            a.scalars[key].all_reduce()
        if a.attn is not None:
            a.attn = all_reduce_sum(a.attn.double().contiguous()).to(a.attn.dtype)
    for name in sorted(routed):
        total = all_reduce_sum(torch.as_tensor(routed[name][0], dtype=torch.float64).contiguous())
        tokens = all_reduce_sum(torch.tensor([float(routed[name][1])], dtype=torch.float64))
        routed[name] = [total, int(tokens[0])]


@torch.no_grad()
def collapse_report(model: torch.nn.Module, inputs: torch.Tensor, *, alpha: float = 0.5,
                    classes: ProbeClasses | None = None, folds: int = 5, per_class: int = 256,
                    batch_size: int = 16, seed: int = 0, weight_decay: float = 1e-3, probe_iters: int = 200,
                    device: str | torch.device = "cpu",
                    progress: Callable[[str, int, int], None] | None = None) -> dict:
    """All collapse measures of ``model`` on evaluation inputs (n, T) (token ids), keyed by layer and head.

    Returns a JSON-able dict: ``layers`` (one entry per block with ``values``, ``hidden``, ``probe``, ``attention``
    and, for per-token routers, ``routing_mean``), the probe classes, and token/sequence counts. A measure that
    does not apply to this architecture is the string ``"not applicable: <why>"``.
    """
    if alpha <= 0:
        raise CemtoolError(f"alpha={alpha} is not a valid Rényi order (must be > 0)")
    if folds < 2:
        raise CemtoolError(f"folds={folds}: cross-validation needs at least 2 folds")
    model.eval()
    inputs = inputs.long()
    points = layer_points(model)
    if not points:
        raise CemtoolError("the model has no blocks.<i>.* hook points to measure")
    V = model.cfg.vocab_size if hasattr(model, "cfg") else int(inputs.max()) + 1
    patterns = {p.pattern for p in points.values() if p.pattern}
    routing = {p.routing for p in points.values() if p.routing}
    names1 = [n for p in points.values() for n in (p.values, p.hidden, p.pattern, p.routing) if n]
    names2 = [n for p in points.values() for n in (p.values, p.hidden) if n]
    acc = {i: _Layer() for i in points}
    routed: dict[str, list] = {}
    if classes is not None and not classes.skipped and per_class < classes.min_count:
        raise CemtoolError(f"per_class={per_class} is below the probe's minimum of {classes.min_count} samples per "
                           f"class")
    sample = ProbeSample(classes, V, per_class) if classes is not None and not classes.skipped else None
    mine = shard(len(inputs))  # under torchrun: this rank's contiguous share of the sequences
    local = inputs[mine.start:mine.stop]
    n_batches = math.ceil(len(local) / batch_size)

    # pass 1: moments, second moments, per-sequence rank and cosine, attention rows, probe sample
    with capture(model, names1, transform=_transform(patterns, routing, routed)) as cache:
        for bi, x in enumerate(_batches(local, batch_size)):
            cache.clear()
            model(x.to(device))
            sel = sample.select(x) if sample is not None else None
            for i, p in points.items():
                a = acc[i]
                feats = {}
                if p.values and p.values in cache:
                    v = cache[p.values]  # (B, H, T, d_h)
                    a.heads = v.shape[1]
                    feats["values"] = _values_concat(v).double()  # (B, T, H*d_h)
                if p.hidden and p.hidden in cache:
                    feats["hidden"] = cache[p.hidden].double()  # (B, T, d)
                for kind, X in feats.items():
                    a.moments.setdefault(kind, Moments(X.shape[-1])).update(X)
                    flat = X.reshape(-1, X.shape[-1])
                    a.second[kind] = a.second.get(kind, 0) + flat.T @ flat  # (D, D)
                    a.stat(f"{kind}.erank_seq").update(effective_rank(X))
                    a.stat(f"{kind}.cosine").update(mean_pairwise_cosine(X))
                    if sel is not None:
                        sample.add(f"{i}.{kind}", X[sel[0], sel[1]])
                if p.pattern and p.pattern in cache:
                    s = cache[p.pattern]  # (6, H, T)
                    a.attn = s if a.attn is None else a.attn + s
            if progress:
                progress("pass 1", bi + 1, n_batches)
    for i in sorted(acc):  # pass 2 z-scores with the moments of all tokens
        for kind in sorted(acc[i].moments):
            acc[i].moments[kind].all_reduce()

    # pass 2: entropies of the z-scored features
    with capture(model, names2) as cache:
        for bi, x in enumerate(_batches(local, batch_size)):
            cache.clear()
            model(x.to(device))
            for i, p in points.items():
                a = acc[i]
                for kind, name in (("values", p.values), ("hidden", p.hidden)):
                    if not name or name not in cache:
                        continue
                    X = cache[name]
                    X = _values_concat(X) if kind == "values" else X
                    Z = a.moments[kind].zscore(X)  # (B, T, D)
                    a.stat(f"{kind}.entropy").update(matrix_entropy(Z, alpha))
                    if kind == "values":
                        dh = Z.shape[-1] // a.heads
                        for h in range(a.heads):
                            a.stat(f"values.entropy.head{h}").update(matrix_entropy(Z[..., h * dh:(h + 1) * dh],
                                                                                    alpha))
            if progress:
                progress("pass 2", bi + 1, n_batches)
    _reduce_ranks(acc, routed)

    # probes
    if sample is not None:
        sample.merge_ranks()
    probe_feats, probe_y, m = sample.balanced() if sample is not None else ({}, None, 0)
    probe_note = None
    if classes is None:
        probe_note = "not applicable: no probe classes given"
    elif classes.skipped:
        probe_note = f"not applicable: {classes.skipped}"
    elif m < max(folds, classes.min_count):
        counts = ", ".join(f"{n!r}: {c}" for n, c in zip(classes.names, sample.counts, strict=True))
        probe_note = (f"not applicable: too few whole-word samples for the probe (at least "
                      f"{max(folds, classes.min_count)} per class; {counts}); evaluate more tokens")
    n_seq, T = inputs.shape
    layers = []
    for i, p in points.items():
        a = acc[i]
        entry: dict = {"layer": i}
        for kind, name in (("values", p.values), ("hidden", p.hidden)):
            if name is None or kind not in a.moments:
                point = "attn.v" if kind == "values" else "resid_post"
                entry[kind] = f"not applicable: this architecture has no hook point blocks.{i}.{point}"
                continue
            evals = clean_spectrum(torch.linalg.eigvalsh(a.second[kind]))
            d: dict = {"dim": int(a.moments[kind].sum.numel()),
                       "entropy": a.stat(f"{kind}.entropy").summary(),
                       "erank_seq": a.stat(f"{kind}.erank_seq").summary(),
                       "erank_all": float(effective_rank_from_singular(evals.sqrt())),
                       "cosine": a.stat(f"{kind}.cosine").summary()}
            if kind == "values":
                d["heads"] = a.heads
                d["entropy_per_head"] = [a.stat(f"values.entropy.head{h}").summary() for h in range(a.heads)]
            entry[kind] = d
        probe: dict = {}
        for kind in ("values", "hidden"):
            key = f"{i}.{kind}"
            if probe_note is not None:
                probe[kind] = probe_note
            elif key not in probe_feats:
                probe[kind] = f"not applicable: no {kind} at layer {i}"
            else:
                probe[kind] = probe_accuracy(probe_feats[key], probe_y, len(classes.names), folds=folds, seed=seed,
                                             weight_decay=weight_decay, max_iter=probe_iters)
        entry["probe"] = probe
        entry["attention"] = summarise_attention(a.attn, n_seq) if a.attn is not None else \
            f"not applicable: no hook point blocks.{i}.attn.pattern"
        if a.attn is not None and hasattr(model, "blocks"):
            kv_groups(entry["attention"], getattr(model.blocks[i], "attn", None))
        if p.routing in routed:
            total, tokens = routed[p.routing]
            entry["routing_mean"] = (total / max(tokens, 1)).tolist()  # (H, S) the mix averaged over tokens
        layers.append(entry)
    return {"measure": "collapse", "alpha": alpha, "sequences": n_seq, "seq_len": T, "tokens": n_seq * T,
            "probe_classes": None if classes is None else {**classes.report(), "per_class": m, "folds": folds,
                                                           "weight_decay": weight_decay},
            "layers": layers}


# --------------------------------------------------------------------------------------------------------------
# flat rows (CSV) and the change across depth


def _num(v) -> float | None:
    return v if isinstance(v, (int, float)) else None


def report_rows(report: dict, run: str = "", arch: str = "") -> list[dict]:
    """Long-format rows: one per (layer, head, measure) with mean, std, se, n."""
    rows = []

    def add(layer, head, measure, mean, std=None, se=None, n=None):
        rows.append({"run": run, "arch": arch, "layer": layer, "head": head, "measure": measure, "mean": mean,
                     "std": std, "se": se, "n": n})

    prev: dict[str, float] = {}
    for e in report["layers"]:
        i = e["layer"]
        for kind in ("values", "hidden"):
            d = e[kind]
            if isinstance(d, str):
                add(i, None, f"{kind}.entropy", d)
                continue
            for m in ("entropy", "erank_seq", "cosine"):
                s = d[m]
                add(i, None, f"{kind}.{m}", s["mean"], s["std"], s["se"], s["n"])
            add(i, None, f"{kind}.erank_all", d["erank_all"])
            for m in ("entropy", "erank_all", "cosine"):
                cur = d[m]["mean"] if isinstance(d[m], dict) else d[m]
                key = f"{kind}.{m}"
                if key in prev and cur is not None and prev[key] is not None:
                    add(i, None, f"{key}.change", cur - prev[key])
                prev[key] = cur
            for h, s in enumerate(d.get("entropy_per_head", [])):
                add(i, h, f"{kind}.entropy", s["mean"], s["std"], s["se"], s["n"])
        for kind, pr in e["probe"].items():
            if isinstance(pr, str):
                add(i, None, f"probe.{kind}", pr)
            else:
                add(i, None, f"probe.{kind}", pr["accuracy"], pr["std"], pr["se"], pr["n"])
                add(i, None, f"probe.{kind}.chance", pr["chance"])
        att = e["attention"]
        if isinstance(att, str):
            add(i, None, "attention.entropy", att)
        else:
            for hrow in att["per_head"]:
                for f in ("entropy", "entropy_norm", "max_prob", "share_above_0.9", "logit_range"):
                    add(i, hrow["head"], f"attention.{f}", hrow[f])
    return rows


def layer_summary(report: dict) -> list[dict]:
    """One row per layer with the headline numbers (for the stdout table and comparisons)."""
    out = []
    for e in report["layers"]:
        row: dict = {"layer": e["layer"]}
        for kind, short in (("values", "v"), ("hidden", "h")):
            d = e[kind]
            row[f"{short}_entropy"] = d["entropy"]["mean"] if isinstance(d, dict) else None
            row[f"{short}_entropy_se"] = d["entropy"]["se"] if isinstance(d, dict) else None
            row[f"{short}_erank"] = d["erank_all"] if isinstance(d, dict) else None
            row[f"{short}_cosine"] = d["cosine"]["mean"] if isinstance(d, dict) else None
            pr = e["probe"][kind]
            row[f"probe_{short}"] = pr["accuracy"] if isinstance(pr, dict) else None
            row[f"probe_{short}_std"] = pr["std"] if isinstance(pr, dict) else None
        att = e["attention"]
        if isinstance(att, dict):
            heads = att["per_head"]
            row["attn_entropy_norm"] = _mean([h["entropy_norm"] for h in heads])
            row["attn_max_prob"] = _mean([h["max_prob"] for h in heads])
        else:
            row["attn_entropy_norm"] = row["attn_max_prob"] = None
        out.append(row)
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if _num(x) is not None]
    return float(np.mean(xs)) if xs else None


__all__ = ["DEFAULT_WORDS", "MIN_PER_CLASS", "Moments", "ProbeClasses", "attention_row_stats", "collapse_report",
           "effective_rank", "effective_rank_from_singular", "fit_logistic", "gram_eigenvalues", "gram_entropy",
           "layer_summary", "matrix_entropy", "mean_pairwise_cosine", "probe_accuracy", "probe_classes",
           "renyi_entropy", "report_rows", "summarise_attention", "word_start_id"]


def measure_run(path, *, label: str | None = None, checkpoint: str = "final", data: str | None = None,
                tokens: int = 16384,
                seq_len: int | None = None, batch_size: int = 16, alpha: float = 0.5, words: list[str] | None = None,
                k: int = 4, folds: int = 5, per_class: int = 256, min_per_class: int = MIN_PER_CLASS, seed: int = 0,
                device: torch.device | str = "cpu",
                progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Load a run, measure it on its validation windows, return the per-run payload (what
    reports/collapse.json holds under ``runs[0]``): collapse measures, per-layer summary, LIMe routing and
    momentum-stream scalars (each "not applicable" where the architecture has none). The defaults are
    ``cemtool collapse-report``'s; ``label`` defaults to the run folder's name. ``path``: anything
    :func:`cemtool.subject.open_subject` loads; ``data``: evaluation data instead of the run's own."""
    import cemtool.data.synthetic  # noqa: F401  (registers the ngram source)
    from cemtool.analysis.routing import lime_routing, stream_scalars
    from cemtool.data.corpus import load_corpus, windows
    from cemtool.subject import open_subject

    loaded = open_subject(path, checkpoint=checkpoint, device=device, data=data)
    cfg = loaded.config
    T = seq_len or cfg.data.seq_len
    if T > cfg.model.max_seq_len:
        raise CemtoolError(f"--seq-len {T} is longer than the model's max_seq_len {cfg.model.max_seq_len}")
    if tokens < T:
        raise CemtoolError(f"--tokens {tokens} is fewer than one window of {T} tokens")
    corpus = load_corpus(cfg.data, tokenizer=loaded.tokenizer)
    starts = corpus.eval_windows(T, tokens)
    x, _ = windows(corpus.val, starts, T)  # (n, T)
    classes = probe_classes(loaded.tokenizer, x.numpy(), words, k, cfg.model.vocab_size, min_count=min_per_class)
    report = collapse_report(loaded.model, x, alpha=alpha, classes=classes, folds=folds, per_class=per_class,
                             batch_size=batch_size, seed=seed, device=device, progress=progress)
    mean_mix = {e["layer"]: e["routing_mean"] for e in report["layers"] if "routing_mean" in e}
    return {"label": label or loaded.run.path.name, "run": str(loaded.run.path), "arch": cfg.model.arch,
            "checkpoint": str(loaded.checkpoint),
            "step": loaded.step, "collapse": report, "summary": layer_summary(report),
            "routing": lime_routing(loaded.model, mean_mix), "stream_scalars": stream_scalars(loaded.model)}


def all_rows(payload: dict) -> list[dict]:
    """CSV rows of a collapse payload: measures, routing and stream scalars of every run."""
    from cemtool.analysis.routing import routing_rows, stream_rows

    rows = []
    for r in payload["runs"]:
        rows += report_rows(r["collapse"], r["label"], r["arch"])
        rows += routing_rows(r["routing"], r["label"], r["arch"])
        rows += stream_rows(r["stream_scalars"], r["label"], r["arch"])
    return rows
