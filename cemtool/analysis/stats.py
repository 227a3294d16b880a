"""The statistics of a comparison across runs (METHODS §7): Spearman's rank correlation with an exact permutation
p-value for few runs, the Welch t interval of a difference of means, and a group's mean and standard deviation.
"""

from __future__ import annotations

import itertools
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
           "p": None, "n_a": na, "n_b": nb, "note": None}
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
    if any("catastrophic cancellation" in str(w.message) for w in caught):
        out["note"] = "values nearly identical: the interval is unreliable (precision loss)"
    return out


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
            "n": len(values)}
