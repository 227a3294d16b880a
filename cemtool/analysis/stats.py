"""The statistics of a comparison across runs (METHODS §7): Spearman's rank correlation with an exact permutation
p-value for few runs, the Welch t interval of a difference of means with its minimum detectable effect, Holm's
adjustment of a family of p-values, and a group's mean and standard deviation.
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
    rx, ry = stats.rankdata(x), stats.rankdata(y)
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
    from scipy import optimize, stats  # start-up: ~0.75 s

    if n_a < 2 or n_b < 2:
        return None
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha} and {power}")
    va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0
    df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
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
