"""The statistics of a comparison across runs (METHODS §7): Spearman's rank correlation with an exact permutation
p-value for few runs, the Welch t interval of a difference of means with its minimum detectable effect, Holm's
adjustment of a family of p-values, a group's mean and standard deviation, the Welch equivalence test (TOST),
Spearman's partial correlation given covariates, a two-level (architectures, then seeds) bootstrap, and a
curve's value at a matched abscissa (forgetting at matched plasticity).
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np

EXACT_MAX_N = 9  # Spearman p-values by exact permutation up to this many runs (9! = 362,880 permutations)


def spearman(x: list[float], y: list[float]) -> dict:
    """Spearman's rho (``scipy.stats.spearmanr``) and its two-sided p-value: exact (all permutations of the
    ranks) for n <= 9, where scipy's t approximation is poor, else scipy's. rho None below 3 points or for
    constant input."""
    from scipy import stats  # start-up: ~0.75 s; the comparison's tables (report.md, the CLI) need none

    n = len(x)
    if n < 3:
        return {"rho": None, "p": None, "p_method": None, "n": n, "note": "needs at least 3 runs with both values"}
    if len(set(x)) == 1 or len(set(y)) == 1:
        return {"rho": None, "p": None, "p_method": None, "n": n, "note": "one variable is constant"}
    res = stats.spearmanr(x, y)
    rho = float(res.statistic)
    if n > EXACT_MAX_N:
        return {"rho": rho, "p": float(res.pvalue), "p_method": "t approximation", "n": n, "note": None}
    rx, ry = average_ranks(x), average_ranks(y)
    perms = np.array(list(itertools.permutations(range(n))))  # (n!, n)
    ryp = ry[perms] - ry.mean()  # (n!, n)
    rhos = ryp @ (rx - rx.mean()) / (np.linalg.norm(rx - rx.mean()) * np.linalg.norm(ry - ry.mean()))  # (n!,)
    p = float(np.mean(np.abs(rhos) >= abs(rho) - 1e-12))
    return {"rho": rho, "p": p, "p_method": "exact permutation", "n": n, "note": None}


def welch(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """mean(a) - mean(b) with its Welch t confidence interval at ``level`` and the test's p-value."""
    from scipy import stats  # start-up: ~0.75 s; the comparison's tables (report.md, the CLI) need none

    na, nb = len(a), len(b)
    out = {"diff": float(np.mean(a) - np.mean(b)) if na and nb else None, "lo": None, "hi": None, "df": None,
           "p": None, "n_a": na, "n_b": nb, "note": None, "mde": None}
    if na < 2 or nb < 2:
        out["note"] = "needs at least 2 runs per architecture"
        return out
    if np.var(a) == 0 and np.var(b) == 0:
        out.update(lo=out["diff"], hi=out["diff"], note="no variance within either architecture")
        return out
    with warnings.catch_warnings(record=True) as caught:  # scipy warns (to stderr) on nearly identical values
        warnings.simplefilter("always")
        res = stats.ttest_ind(a, b, equal_var=False)
        ci = res.confidence_interval(confidence_level=level)
    out.update(lo=float(ci.low), hi=float(ci.high), df=float(res.df), p=float(res.pvalue))
    if out["lo"] <= 0 <= out["hi"]:  # unresolved: say what effect it could have seen (80% power, same alpha)
        out["mde"] = welch_mde(float(np.std(a, ddof=1)), na, float(np.std(b, ddof=1)), nb, alpha=1 - level)
    if any("catastrophic cancellation" in str(w.message) for w in caught):
        out["note"] = "values nearly identical: the interval is unreliable (precision loss)"
    return out


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (controls the family-wise error rate; Holm 1979):
    sorted ascending, p_(i) * (m - i + 1), made monotone, capped at 1; m counts the p-values that exist (None stays
    None: a comparison that could not be tested is not in the family)."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    m = len(idx)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def welch_mde(sd_a: float, n_a: int, sd_b: float, n_b: int, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The minimum detectable effect of a two-sided Welch test at ``alpha`` with ``power``: the true difference of
    means that the test detects with that probability, given the groups' observed standard deviations and sizes.
    Solved exactly on the noncentral t: with SE = sqrt(sd_a²/n_a + sd_b²/n_b), df by Welch–Satterthwaite and
    t_c = t_{1-α/2, df}, the δ where P(T > t_c) + P(T < -t_c) = power for T ~ nct(df, δ/SE) (the approximation
    (t_c + t_power)·SE is 4% low at df = 2). None below 2 runs per group."""

    if n_a < 2 or n_b < 2:
        return None
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha} and {power}")
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
    return t_mde(se, df, alpha, power)


def t_mde(se: float, df: float, alpha: float = 0.05, power: float = 0.8) -> float:
    """The minimum detectable effect of a two-sided t test with standard error ``se`` on ``df`` degrees of
    freedom (:func:`welch_mde`'s solve; a paired or one-sample test: se = sd / sqrt(n), df = n - 1)."""
    from scipy import optimize, stats  # start-up: ~0.75 s

    if se == 0:
        return 0.0
    t_c = stats.t.ppf(1 - alpha / 2, df)

    def shortfall(nc: float) -> float:
        lower = float(stats.nct.cdf(-t_c, df, nc))  # the wrong-sign rejections: NaN in scipy once below ~1e-300
        return float(stats.nct.sf(t_c, df, nc)) + (lower if math.isfinite(lower) else 0.0) - power

    guess = float(t_c + stats.t.ppf(power, df))  # the usual approximation: a little low, so the root lies above
    return float(optimize.brentq(shortfall, 0.0, 2 * guess, xtol=1e-12)) * se


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
            "n": len(values)}


def _welch_se_df(a: list[float], b: list[float]) -> tuple[float, float]:
    va, vb = float(np.var(a, ddof=1)) / len(a), float(np.var(b, ddof=1)) / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if se > 0 else math.inf
    return se, df


def tost(a: list[float], b: list[float], margin: float, level: float = 0.95) -> dict:
    """Welch two one-sided tests (Schuirmann 1987) of equivalence within ``margin``: H0 |mean_a - mean_b| >= margin
    against |mean_a - mean_b| < margin. p = max(p of diff > -margin, p of diff < +margin), each a one-sided Welch t
    test at the Welch–Satterthwaite df; ``equivalent`` when p < 1 - level, i.e. when the 1 - 2(1 - level) interval
    (``lo90``, ``hi90`` at the default level) lies inside (-margin, +margin). None values below 2 runs per group."""
    from scipy import stats  # start-up: ~0.75 s

    if not margin > 0:
        raise ValueError(f"the equivalence margin must be > 0, got {margin}")
    out = {"margin": margin, "p_tost": None, "equivalent": None, "lo90": None, "hi90": None}
    if len(a) < 2 or len(b) < 2:
        return out
    d = float(np.mean(a) - np.mean(b))
    se, df = _welch_se_df(a, b)
    alpha = 1 - level
    if se == 0:
        inside = abs(d) < margin
        return {**out, "p_tost": 0.0 if inside else 1.0, "equivalent": inside, "lo90": d, "hi90": d}
    p_low = float(stats.t.sf((d + margin) / se, df))  # H0: diff <= -margin
    p_high = float(stats.t.cdf((d - margin) / se, df))  # H0: diff >= +margin
    half = float(stats.t.ppf(1 - alpha, df)) * se
    p = max(p_low, p_high)
    return {**out, "p_tost": p, "equivalent": p < alpha, "lo90": d - half, "hi90": d + half}


def partial_spearman(x: list[float], y: list[float], covariates: dict[str, list[float]]) -> dict:
    """Spearman's partial correlation of x and y given the covariates: the Pearson correlation of the residuals of
    rank(x) and rank(y) after least squares on [1, rank(c) for each covariate]; two-sided p from t =
    r sqrt(df / (1 - r²)) with df = n - 2 - k (k covariates). With one covariate it equals
    (r_xy - r_xz r_yz) / sqrt((1 - r_xz²)(1 - r_yz²)) on the ranks. None below k + 3 points."""
    from scipy import stats  # start-up: ~0.75 s

    n, k = len(x), len(covariates)
    out = {"rho": None, "p": None, "n": n, "given": sorted(covariates), "df": None, "note": None}
    if n < k + 3:
        return {**out, "note": f"needs at least {k + 3} points for {k} covariate(s)"}
    design = np.column_stack([np.ones(n), *[average_ranks(covariates[c]) for c in sorted(covariates)]])  # (n, 1 + k)

    def residual(v):
        r = average_ranks(v)
        coef, *_ = np.linalg.lstsq(design, r, rcond=None)
        return r - design @ coef  # (n,)

    rx, ry = residual(x), residual(y)
    if np.allclose(rx, 0) or np.allclose(ry, 0):
        return {**out, "note": "a variable is explained entirely by the covariates"}
    r = float(np.dot(rx, ry) / (np.linalg.norm(rx) * np.linalg.norm(ry)))
    df = n - 2 - k
    t = r * math.sqrt(df / max(1e-300, 1 - r * r))
    return {**out, "rho": r, "p": float(2 * stats.t.sf(abs(t), df)), "df": df}


def hierarchical_bootstrap(groups: dict[str, list[tuple[float, float]]], statistic, n_boot: int = 2000,
                           seed: int = 0, level: float = 0.95, strata: dict[str, str] | None = None) -> dict:
    """A two-level bootstrap for statistics over groups (architectures) of paired runs (x, y): each replicate
    draws the groups with replacement, then each drawn group's runs with replacement, and applies
    ``statistic(list of (mean x, mean y) per drawn group)``. Returns the percentile interval at ``level``, the
    replicates' standard deviation and how many replicates gave no value (a constant input). Resampling the
    architectures is what makes the interval an architecture-level one: the seeds of one architecture are not
    independent evidence about the relation across architectures (Saravanan et al. 2020). ``strata`` (group ->
    stratum): groups are drawn within their stratum, as many as it holds (a main effect: the groups with a factor
    and those without it stay two samples of their own sizes)."""
    rng = np.random.default_rng(seed)
    names = sorted(groups)
    arrays = [np.asarray(groups[g], dtype=float) for g in names]  # each (n_g, 2)
    layers = {}
    for i, g in enumerate(names):
        layers.setdefault((strata or {}).get(g), []).append(i)
    values = []
    for _ in range(n_boot):
        means = []
        drawn = [members[j] for members in layers.values()
                 for j in rng.integers(0, len(members), size=len(members))]
        for gi in drawn:
            runs = arrays[gi]
            pick = runs[rng.integers(0, len(runs), size=len(runs))]  # (n_g, 2)
            means.append(pick.mean(axis=0))
        v = statistic(means)
        if v is not None and math.isfinite(v):
            values.append(v)
    if not values:
        return {"lo": None, "hi": None, "se": None, "n_boot": n_boot, "undefined": n_boot, "seed": seed}
    lo, hi = np.quantile(values, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"lo": float(lo), "hi": float(hi), "se": float(np.std(values, ddof=1)) if len(values) > 1 else None,
            "n_boot": n_boot, "undefined": n_boot - len(values), "seed": seed}


def average_ranks(a) -> np.ndarray:
    """1-based ranks of a 1-d sequence, tied values given the average of their ranks (scipy.stats.rankdata's
    default, to the bit: each is a sum of whole numbers over their count), without scipy's per-call overhead (a
    bootstrap ranks thousands of short arrays)."""
    a = np.asarray(a, dtype=float)
    ranks = np.empty(len(a))
    ranks[np.argsort(a, kind="stable")] = np.arange(1, len(a) + 1)
    _, tie = np.unique(a, return_inverse=True)  # (n,) the index of each value's tie group
    return (np.bincount(tie, ranks) / np.bincount(tie))[tie]


def spearman_of_means(means) -> float | None:
    """Spearman's rho over (x, y) pairs of group means: the Pearson correlation of their average ranks (what
    scipy.stats.spearmanr computes); None when either is constant (a bootstrap replicate that drew one
    architecture only)."""
    m = np.asarray(means, dtype=float)
    if len(m) < 3 or np.ptp(m[:, 0]) == 0 or np.ptp(m[:, 1]) == 0:
        return None
    rx, ry = average_ranks(m[:, 0]), average_ranks(m[:, 1])
    dx, dy = rx - rx.mean(), ry - ry.mean()
    return float(np.clip(np.dot(dx, dy) / math.sqrt(np.dot(dx, dx) * np.dot(dy, dy)), -1.0, 1.0))


def at_matched(curve: list[tuple[float, float]], level: float) -> float | None:
    """y at the first point where x reaches ``level`` along a curve of (x, y) points in order (linear between the
    two points around the crossing): forgetting at a given plasticity on one fine-tune's curve. None if the curve
    never reaches it."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x0 >= level:
            return float(y0)
        if x1 >= level:
            return float(y0 + (y1 - y0) * (level - x0) / (x1 - x0))
    if curve and curve[-1][0] >= level:
        return float(curve[-1][1])
    return None
