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
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from cemtool.analysis.collapse_rows import layer_summary, report_rows
from cemtool.analysis.probe import (
    DEFAULT_WORDS,
    MIN_PER_CLASS,
    ProbeClasses,
    ProbeSample,
    probe_accuracy,
    probe_classes,
    word_start_id,
)
from cemtool.analysis.routing import lime_routing, routing_rows, stream_rows, stream_scalars
from cemtool.analysis.spectra import (
    clean_spectrum,
    effective_rank,
    effective_rank_from_singular,
    gram_eigenvalues,
    gram_entropy,
    matrix_entropy,
    mean_pairwise_cosine,
    renyi_entropy,
)
from cemtool.distributed import all_reduce_sum, shard
from cemtool.errors import CemtoolError
from cemtool.models.capture import capture, hook_points
from cemtool.options import at_least, check_types

ABOVE = 0.9  # a row "saturates" when its largest probability exceeds this


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


def kv_groups(att: dict, kv: int | None) -> None:
    """Grouped- or multi-query attention (``kv`` key-value heads, fewer than the query heads: e.g. a Llama loaded
    by cemtool.subject.hf, see Capabilities.attention_layers): add ``per_kv_head``, each key-value head's statistics
    averaged over the query heads that read it (query head h reads key-value head h // (H / kv)), and ``kv_head``
    to each query head's row."""
    H = len(att["per_head"])
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
# the report


@dataclass
class LayerPoints:
    """Which capture points a layer offers."""

    values: str | None
    hidden: str | None
    pattern: str | None
    routing: str | None
    router: str | None = None  # a mixture of experts' router logits (B, T, E)
    chosen: str | None = None  # and the experts it chose (B, T, k)


def layer_points(model: torch.nn.Module) -> dict[int, LayerPoints]:
    names = set(hook_points(model))
    layers = sorted({int(m.group(1)) for n in names if (m := re.match(r"blocks\.(\d+)\.", n))})

    def get(i: int, suffix: str) -> str | None:
        n = f"blocks.{i}.{suffix}"
        return n if n in names else None

    return {i: LayerPoints(get(i, "attn.v"), get(i, "resid_post"), get(i, "attn.pattern"), get(i, "lime.weights"),
                           get(i, "moe.router_logits"), get(i, "moe.experts"))
            for i in layers}


def router_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, E) router logits -> (B,) each sequence's mean entropy (nats) of the router's softmax over experts."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # (B, T, E)
    return -(logp.exp() * logp).sum(-1).mean(-1)  # (B,)


def expert_load(counts: torch.Tensor, top_k: int) -> dict:
    """The fraction of token slots (tokens x k) each expert received, and the load's entropy (nats; its maximum,
    log E, when every expert gets the same share)."""
    total = float(counts.sum())
    frac = counts.double() / max(total, 1.0)  # (E,)
    nz = frac[frac > 0]
    H = float(-(nz * nz.log()).sum())
    E = counts.numel()
    return {"experts": E, "top_k": top_k, "tokens": int(total) // max(top_k, 1), "fraction": frac.tolist(),
            "entropy": H, "entropy_max": math.log(E), "entropy_normalised": H / math.log(E) if E > 1 else None,
            "max_fraction": float(frac.max()), "unused": int((counts == 0).sum())}


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
        if name.endswith(".moe.router_logits"):
            return router_entropy(x)  # (B,)
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
    expert_counts: torch.Tensor | None = None  # (E,) token slots per expert (mixture of experts)

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
        if a.expert_counts is not None:
            a.expert_counts = all_reduce_sum(a.expert_counts.contiguous())
    for name in sorted(routed):
        total = all_reduce_sum(torch.as_tensor(routed[name][0], dtype=torch.float64).contiguous())
        tokens = all_reduce_sum(torch.tensor([float(routed[name][1])], dtype=torch.float64))
        routed[name] = [total, int(tokens[0])]


@torch.no_grad()
def collapse_report(model: torch.nn.Module, inputs: torch.Tensor, *, alpha: float = 0.5,
                    classes: ProbeClasses | None = None, folds: int = 5, per_class: int = 256,
                    batch_size: int = 16, seed: int = 0, weight_decay: float = 1e-3, probe_iters: int = 200,
                    lag: int = 0, device: str | torch.device = "cpu",
                    progress: Callable[[str, int, int], None] | None = None) -> dict:
    """All collapse measures of ``model`` on evaluation inputs (n, T) (token ids), keyed by layer and head.

    Returns a JSON-able dict: ``layers`` (one entry per block with ``values``, ``hidden``, ``probe``, ``attention``
    and, for per-token routers, ``routing_mean``; for a mixture of experts' layer ``experts``: the fraction of
    token slots each expert received, that load's entropy, and the router's mean entropy with its standard error
    over sequences), the probe classes, and token/sequence counts. A measure that
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
    V = model.cfg.vocab_size
    kv_heads = {a.layer: a.kv_heads for a in model.attention_layers()[0]}
    patterns = {p.pattern for p in points.values() if p.pattern}
    routing = {p.routing for p in points.values() if p.routing}
    names1 = [n for p in points.values() for n in (p.values, p.hidden, p.pattern, p.routing, p.router, p.chosen) if n]
    names2 = [n for p in points.values() for n in (p.values, p.hidden) if n]
    acc = {i: _Layer() for i in points}
    routed: dict[str, list] = {}
    if classes is not None and not classes.skipped and per_class < classes.min_count:
        raise CemtoolError(f"per_class={per_class} is below the probe's minimum of {classes.min_count} samples per "
                           f"class")
    if not 0 <= lag < inputs.shape[1]:
        raise CemtoolError(f"probe lag {lag}: must be >= 0 and shorter than the windows ({inputs.shape[1]} tokens)")
    sample = ProbeSample(classes, V, per_class, lag) if classes is not None and not classes.skipped else None
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
                if p.router and p.router in cache:
                    a.stat("router.entropy").update(cache[p.router])  # (B,) per-sequence means
                if p.chosen and p.chosen in cache:
                    E = model.experts(i)[0]
                    n = torch.bincount(cache[p.chosen].reshape(-1), minlength=E).double()  # (E,)
                    a.expert_counts = n if a.expert_counts is None else a.expert_counts + n
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
                    if kind == "values":  # every head's Gram spectrum in one batched call
                        B, T, D = Z.shape
                        heads = Z.view(B, T, a.heads, D // a.heads).transpose(1, 2)  # (B, H, T, d_h)
                        per_head = matrix_entropy(heads, alpha)  # (B, H)
                        for h in range(a.heads):
                            a.stat(f"values.entropy.head{h}").update(per_head[:, h])
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
        if a.attn is not None:
            kv_groups(entry["attention"], kv_heads.get(i))
        if p.routing in routed:
            total, tokens = routed[p.routing]
            entry["routing_mean"] = (total / max(tokens, 1)).tolist()  # (H, S) the mix averaged over tokens
        if a.expert_counts is not None:
            E, k = model.experts(i)
            router = a.stat("router.entropy").summary()  # over sequences: each one's mean over its tokens
            entry["experts"] = {**expert_load(a.expert_counts, k),
                                "router_entropy": {**router, "max": math.log(E), "unit": "nats"}}
        layers.append(entry)
    return {"measure": "collapse", "alpha": alpha, "sequences": n_seq, "seq_len": T, "tokens": n_seq * T,
            "probe_classes": None if classes is None else {**classes.report(), "per_class": m, "folds": folds,
                                                           "weight_decay": weight_decay, "lag": lag},
            "layers": layers}




@dataclass(frozen=True)
class Options:
    """What ``cemtool collapse-report`` measures with: evaluation tokens (whole windows of ``seq_len``, default the
    run's), windows per forward pass, the Rényi order, and the probe (words, or the k most frequent whole words;
    folds, samples per class, the fewest whole-word samples per class, the fold seed, and its target's lag)."""

    tokens: int = 16384
    seq_len: int | None = None
    batch_size: int = 16
    alpha: float = 0.5
    words: tuple[str, ...] | None = None
    k: int = 4
    folds: int = 5
    per_class: int = 256
    min_per_class: int = MIN_PER_CLASS
    seed: int = 0
    lag: int = 0  # the probe's target: the word lag positions back (0: the input token; 1: a context probe)

    def __post_init__(self):
        check_types(self, "collapse")
        if not self.alpha > 0:
            raise CemtoolError(f"collapse.alpha={self.alpha}: not a valid Rényi order (must be > 0)")
        at_least(self, "collapse", tokens=1, batch_size=1, folds=2, per_class=2, k=2, min_per_class=2, seed=0,
                 seq_len=2, lag=0)
        if self.per_class < self.min_per_class:
            raise CemtoolError(f"collapse.per_class={self.per_class}: below min_per_class {self.min_per_class}")
        if self.words is not None and not any(w.strip() for w in self.words):
            raise CemtoolError("collapse.words=(): empty: give at least 2 words, or leave it out for the default")


@dataclass
class CollapseReport:
    """One subject's collapse report: what reports/collapse.json holds under ``runs[0]``."""

    run: dict
    options: Options
    extra: dict = field(default_factory=dict)  # the caller's options as recorded (checkpoint, data)

    def payload(self) -> dict:
        return {"runs": [self.run]}

    def rows(self) -> list[dict]:
        return all_rows(self.payload())

    def provenance(self) -> dict:
        return dict(seed=self.options.seed, checkpoint=self.run["checkpoint"], step=self.run["step"],
                    command="collapse-report", options={**self.extra, **options_dict(self.options)})


def options_dict(o: Options) -> dict:
    """The options as a report records them (words as a list)."""
    d = asdict(o)
    d["words"] = list(o.words) if o.words is not None else None
    return d


def measure(subject, options: Options | None = None, progress: Callable[[str, int, int], None] | None = None
            ) -> CollapseReport:
    """Collapse measures, per-layer summary, LIMe routing and momentum-stream scalars of a subject on its
    validation windows (each "not applicable" where the architecture has none)."""
    o = options or Options()
    why = subject.model.inside_blocks()
    if why is not None:
        raise CemtoolError(f"collapse-report reads inside the blocks: {why}",
                           hint="sharpness and forgetting take any causal LM")
    cfg = subject.config
    T = o.seq_len or cfg.data.seq_len
    if T > cfg.model.max_seq_len:
        raise CemtoolError(f"--seq-len {T} is longer than the model's max_seq_len {cfg.model.max_seq_len}")
    if o.tokens < T:
        raise CemtoolError(f"--tokens {o.tokens} is fewer than one window of {T} tokens")
    x, _ = subject.eval_set(o.tokens, T)  # (n, T)
    words = list(o.words) if o.words is not None else None
    classes = probe_classes(subject.tokenizer, x.numpy(), words, o.k, cfg.model.vocab_size,
                            min_count=o.min_per_class)
    report = collapse_report(subject.model, x, alpha=o.alpha, classes=classes, folds=o.folds,
                             per_class=o.per_class, batch_size=o.batch_size, seed=o.seed, lag=o.lag,
                             device=subject.device, progress=progress)
    mean_mix = {e["layer"]: e["routing_mean"] for e in report["layers"] if "routing_mean" in e}
    run = {"label": subject.label, "run": str(subject.run.path), "arch": cfg.model.arch,
           "checkpoint": str(subject.checkpoint), "step": subject.step, "collapse": report,
           "summary": layer_summary(report), "routing": lime_routing(subject.model, mean_mix),
           "stream_scalars": stream_scalars(subject.model)}
    return CollapseReport(run, o, {"checkpoint": subject.checkpoint_asked, "data": subject.data_asked})


def all_rows(payload: dict) -> list[dict]:
    """CSV rows of a collapse payload: measures, routing and stream scalars of every run."""
    rows = []
    for r in payload["runs"]:
        rows += report_rows(r["collapse"], r["label"], r["arch"])
        rows += routing_rows(r["routing"], r["label"], r["arch"])
        rows += stream_rows(r["stream_scalars"], r["label"], r["arch"])
    return rows


__all__ = ["ATTN_FIELDS", "DEFAULT_WORDS", "MIN_PER_CLASS", "CollapseReport", "Moments", "Options", "ProbeClasses",
           "all_rows", "attention_row_stats", "clean_spectrum", "collapse_report", "effective_rank",
           "effective_rank_from_singular", "gram_eigenvalues", "gram_entropy", "kv_groups", "layer_summary",
           "matrix_entropy", "mean_pairwise_cosine", "measure", "options_dict", "probe_accuracy", "probe_classes",
           "renyi_entropy", "report_rows", "summarise_attention", "word_start_id"]
