"""Where the model stands (METHODS §6; docs/sharpness.md "Where the model stands"): the certificate in every
sharpness report, and the one rule that may call a point a minimum.

Measured: the gradient norm ‖g‖ and ‖g‖/√n; λ_min/λ_max with the Lanczos error bounds; the spectral mass below
zero from the SLQ density (mean over its runs, with the standard error across runs when there are two or more);
the total trace beside tr/n and n.

The rule [decision: documented thresholds, options of the sharpness analysis]:

- **stationary** when the *descent gap* Δ = ‖g‖² / (2 λ_max) is at most ``gap_tol`` nats (default 1e-3). For a
  loss whose curvature is at most λ_max along the way, one gradient step of size 1/λ_max lowers it by at least Δ,
  and L − L* ≥ Δ (the smoothness bound f − f* ≥ ‖∇f‖²/2L): a model with Δ above the tolerance still has that much
  loss to lose by descent, whatever its spectrum says. Equivalently ‖g‖ ≤ √(2 λ_max · gap_tol). λ_max ≤ 0 (no
  positive curvature measured) is never stationary by this rule.
- Of a stationary point, the **Hessian** says more: a **minimum** (to the measured precision) when
  λ_min ≥ −max(err(λ_min), ``neg_tol`` · λ_max) (no negative curvature beyond its error bound and a relative
  tolerance, default 1e-3); a **saddle** otherwise. A positive semi-definite operator (GGN, Fisher) cannot tell a
  minimum from a saddle, so under it a stationary point is only "stationary".
- Without λ_max (no Lanczos run) nothing is certified: the verdict is "unknown".

The words "minimum" and "flatter minimum" belong in a report only under the verdict "minimum".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GAP_TOL = 1e-3  # nats: the descent gap at or below which a point counts as stationary
NEG_TOL = 1e-3  # λ_min/λ_max above -NEG_TOL (or within its error bound) counts as no negative curvature
VERDICTS = ("minimum", "saddle", "stationary", "not stationary", "unknown")


@dataclass
class Standing:
    """The certificate of one measurement (all None where the measurement was not made)."""

    verdict: str  # one of VERDICTS
    reason: str  # the rule's numbers, in words
    grad_norm: float
    grad_norm_per_sqrt_n: float
    descent_gap: float | None  # ‖g‖² / (2 λ_max), nats
    gap_tol: float
    lambda_ratio: float | None  # λ_min / λ_max
    lambda_min_error: float | None
    neg_tol: float
    negative_mass: float | None  # SLQ density mass below zero (fraction of the spectrum)
    negative_mass_se: float | None  # its standard error across the SLQ runs (None with one run)
    trace: float | None  # total trace (the first trace estimate), with n beside it
    trace_per_param: float | None
    n: int
    operator: str


def negative_mass(nodes: list[list[float]], weights: list[list[float]]) -> tuple[float, float | None]:
    """Mean over SLQ runs of the quadrature weight on negative nodes, and its standard error across runs."""
    per_run = np.array([sum(w for t, w in zip(ns, ws, strict=True) if t < 0) for ns, ws in
                        zip(nodes, weights, strict=True)])
    se = float(per_run.std(ddof=1) / math.sqrt(len(per_run))) if len(per_run) > 1 else None
    return float(per_run.mean()), se


def certify(*, grad_norm: float, n: int, operator: str, psd: bool, lambda_max: float | None,
            lambda_min: float | None, lambda_min_error: float | None, density=None, trace=None,
            gap_tol: float = GAP_TOL, neg_tol: float = NEG_TOL) -> Standing:
    """The standing of a model from its measured gradient norm, extreme eigenvalues (with λ_min's error bound),
    SLQ density and trace (the rule in this module's docstring)."""
    ratio = lambda_min / lambda_max if lambda_min is not None and lambda_max not in (None, 0.0) else None
    mass, mass_se = negative_mass(density.nodes, density.weights) if density is not None else (None, None)
    gap = grad_norm ** 2 / (2 * lambda_max) if lambda_max is not None and lambda_max > 0 else None
    if lambda_max is None:
        verdict, reason = "unknown", "no λ_max measured (Lanczos skipped): nothing certified"
    elif gap is None:
        verdict, reason = "not stationary", f"λ_max = {lambda_max:.3g} ≤ 0: no positive curvature measured"
    elif gap > gap_tol:
        verdict = "not stationary"
        reason = (f"descent gap ‖g‖²/(2 λ_max) = {gap:.3g} nats > {gap_tol:g} (‖g‖ = {grad_norm:.3g} > "
                  f"√(2 λ_max · {gap_tol:g}) = {math.sqrt(2 * lambda_max * gap_tol):.3g})")
    elif psd or lambda_min is None:
        verdict = "stationary"
        reason = (f"descent gap {gap:.3g} nats ≤ {gap_tol:g}; " +
                  (f"the {operator} is PSD: it cannot tell a minimum from a saddle" if psd else
                   "no λ_min measured: minimum or saddle not decided"))
    else:
        bound = max(lambda_min_error or 0.0, neg_tol * lambda_max)
        minimum = lambda_min >= -bound
        verdict = "minimum" if minimum else "saddle"
        reason = (f"descent gap {gap:.3g} nats ≤ {gap_tol:g}; λ_min = {lambda_min:.3g} "
                  f"{'≥' if minimum else '<'} −{bound:.3g} (max of its error bound and {neg_tol:g} λ_max)")
    return Standing(verdict, reason, grad_norm, grad_norm / math.sqrt(max(n, 1)), gap, gap_tol, ratio,
                    lambda_min_error, neg_tol, mass, mass_se, trace.trace if trace is not None else None,
                    trace.per_param if trace is not None else None, n, operator)


__all__ = ["GAP_TOL", "NEG_TOL", "VERDICTS", "Standing", "certify", "negative_mass"]
