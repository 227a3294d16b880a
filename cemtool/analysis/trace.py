"""tr(H) of an operator with a standard error (METHODS §6): Hutchinson, Hutch++ and XTrace.

Each estimator returns a :class:`Trace` (tr(H), its standard error, and tr(H)/n) from a budget of HVPs with
Rademacher vectors from a seeded generator. Any operator with ``n``, ``matvec`` and ``device``
(:mod:`cemtool.analysis.curvature.protocol`) will do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cemtool.analysis.curvature.protocol import Callback, as_operator
from cemtool.errors import CemtoolError


@dataclass
class Trace:
    """An estimate of tr(H) with its standard error, and the mean eigenvalue tr(H)/n (n = parameters)."""

    method: str
    trace: float
    se: float
    per_param: float
    per_param_se: float
    hvps: int
    seconds: float
    seed: int
    n: int


# the fewest HVPs each estimator can spend (Hutchinson: two samples for a standard error; Hutch++ and XTrace: a
# sketch and its complement, two vectors each); option checks read this before any model is opened
MIN_HVPS = {"hutchinson": 2, "hutch++": 4, "xtrace": 4}


def _rademacher(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randint(0, 2, (n, k), generator=gen, dtype=torch.float64) * 2 - 1).to(device)  # (n, k)


class _CountedHVP:
    """op.hvp in float64, counting the products and reporting the count to ``callback`` after each."""

    def __init__(self, op, callback: Callback | None):
        self.op, self.callback, self.done = op, callback, 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        out = self.op.matvec(v).to(torch.float64)
        self.done += 1
        if self.callback is not None:
            self.callback(self.done)
        return out


def _trace_result(method: str, est: float, se: float, n: int, hvps: int, t0: float, seed: int) -> Trace:
    return Trace(method, est, se, est / n, se / n, hvps, time.perf_counter() - t0, seed, n)


def hutchinson(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """Hutchinson's estimator tr(H) ~ (1/m) sum z_i^T H z_i with Rademacher z_i (Hutchinson 1989);
    standard error = sample std / sqrt(m)."""
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    if hvps < MIN_HVPS["hutchinson"]:
        raise CemtoolError(f"the trace needs at least {MIN_HVPS['hutchinson']} HVPs for a standard error")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    apply = _CountedHVP(op, callback)
    samples = []
    for _ in range(hvps):
        z = _rademacher(op.n, 1, gen, op.device)[:, 0]  # (n,)
        samples.append(float(z @ apply(z)))
    s = np.asarray(samples)
    return _trace_result("hutchinson", float(s.mean()), float(s.std(ddof=1) / math.sqrt(len(s))), op.n, hvps, t0,
                         seed)


def hutch_plus_plus(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """Hutch++ (Meyer, Musco, Musco & Woodruff 2021): with m HVPs, sketch Q = orth(H S) from k = m/3 Rademacher
    columns, take tr(Q^T H Q) exactly (k HVPs) and Hutchinson on the deflated rest (I - QQ^T) H (I - QQ^T) with
    the remaining m - 2k vectors. Unbiased; its standard error is that of the Hutchinson part."""
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    if hvps < MIN_HVPS["hutch++"]:
        raise CemtoolError(f"Hutch++ needs at least {MIN_HVPS['hutch++']} HVPs")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    apply = _CountedHVP(op, callback)
    k = min(hvps // 3, op.n)
    r = hvps - 2 * k
    S = _rademacher(op.n, k, gen, op.device)  # (n, k)
    Y = torch.stack([apply(S[:, i]) for i in range(k)], dim=1)  # (n, k) = H S
    Q, _ = torch.linalg.qr(Y)  # (n, k)
    low = sum(float(Q[:, i] @ apply(Q[:, i])) for i in range(k))  # tr(Q^T H Q)
    samples = []
    for _ in range(r):
        g = _rademacher(op.n, 1, gen, op.device)[:, 0]  # (n,)
        g = g - Q @ (Q.T @ g)  # (I - QQ^T) g
        samples.append(float(g @ apply(g)))
    s = np.asarray(samples)
    se = float(s.std(ddof=1) / math.sqrt(len(s))) if len(s) > 1 else 0.0
    return _trace_result("hutch++", low + float(s.mean()), se, op.n, apply.done, t0, seed)


def _xtrace_jackknife_se(Hs: torch.Tensor, W: torch.Tensor, R: torch.Tensor, wHw: torch.Tensor,
                         S: torch.Tensor) -> float:
    """Jackknife standard error of XTrace over its s exchangeable (omega_j, H omega_j) pairs, without HVPs.

    T_(-j) is XTrace on the s - 1 pairs other than j: the mean over i != j of Hutch++ with sketch orth(Y without
    columns i and j) and test vector omega_i. In the coordinates of Q that sketch is Q (I - N N^T), N an orthonormal
    basis of span(s_i, s_j) (columns of R^{-T}), so every term comes from Hs = Q^T H Q, W = Q^T Omega, R, w^T H w.
    SE^2 = (s-1)/s sum_j (T_(-j) - mean T_(-))^2, which by the Efron-Stein inequality does not underestimate the
    variance on average (the plain std(t_i)/sqrt(s) does: the t_i share their samples)."""
    s = S.shape[1]
    tr_H = float(torch.trace(Hs))
    sHs = (S * (Hs @ S)).sum(0)  # (s,) s_i^T Hs s_i
    C = S.T @ S  # (s, s) cosines between the normals
    t = torch.zeros(s, s, dtype=Hs.dtype)  # t[i, j]: test vector i, sketch without columns i and j
    for i in range(s):
        u = S[:, i]  # (s,)
        c = C[i].clone()
        c[i] = 0.0
        V = (S - u[:, None] * c[None, :]) / (1 - c**2).clamp_min(1e-12).sqrt()[None, :]  # (s, s) column j: v_ij
        low = tr_H - float(sHs[i]) - (V * (Hs @ V)).sum(0)  # (s,) tr of Hs on the sketch without i, j
        a, b = W[:, i], R[:, i]  # (s,) Q^T w_i, Q^T H w_i
        PA = a[:, None] - u[:, None] * (u @ a) - V * (V.T @ a)[None, :]  # (s, s) column j: projected Q^T w_i
        t[i] = low + wHw[i] - 2 * (b @ PA) + (PA * (Hs @ PA)).sum(0)
    t.fill_diagonal_(0.0)
    loo = t.sum(0) / (s - 1)  # (s,) T_(-j)
    return math.sqrt((s - 1) / s * float(((loo - loo.mean()) ** 2).sum()))


def xtrace(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """XTrace (Epperly, Tropp & Webber 2024): the exchangeable form of Hutch++ that uses every HVP both for the
    low-rank sketch and as a test vector. With s = m/2 Rademacher vectors Omega (n, s), Y = H Omega = QR and
    Z = H Q (2s HVPs), estimate i is Hutch++ with sketch Q_(i) = orth(Y without column i) and test vector w_i:

        t_i = tr(Q_(i)^T H Q_(i)) + w_i^T (I - P_i) H (I - P_i) w_i,   P_i = Q_(i) Q_(i)^T,

    each unbiased (Q_(i) does not depend on w_i); t = mean_i t_i. No further HVPs are needed: Q_(i) = Q (I - s_i
    s_i^T) restricted, with s_i the normalised i-th column of R^{-T}, and H Q_(i), w_i^T H Q come from Z and R.
    The standard error is the jackknife over the s pairs (:func:`_xtrace_jackknife_se`; the authors' std(t_i)/
    sqrt(s) is too small because the t_i share samples: RMS error/SE up to 1.7 on real Hessians)."""
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    if hvps < MIN_HVPS["xtrace"]:
        raise CemtoolError(f"XTrace needs at least {MIN_HVPS['xtrace']} HVPs")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    s = min(hvps // 2, op.n)
    apply = _CountedHVP(op, callback)
    Om = _rademacher(op.n, s, gen, op.device)  # (n, s)
    Y = torch.stack([apply(Om[:, i]) for i in range(s)], dim=1)  # (n, s) = H Omega
    Q, R = torch.linalg.qr(Y)  # (n, s), (s, s)
    Z = torch.stack([apply(Q[:, i]) for i in range(s)], dim=1)  # (n, s) = H Q
    d = R.diagonal().abs()
    if float(d.min()) <= 1e-10 * float(d.max()):  # H Omega rank-deficient (H of low rank): no leave-one-out
        # span(Q) contains range(H Omega) = range(H) (almost surely), so tr(Q^T H Q) = tr(H) exactly
        return _trace_result("xtrace", float(torch.trace(Q.T @ Z)), 0.0, op.n, apply.done, t0, seed)
    Hs = (Q.T @ Z).cpu()  # (s, s) = Q^T H Q
    Hs = (Hs + Hs.T) / 2
    W = (Q.T @ Om).cpu()  # (s, s) = Q^T Omega
    R = R.cpu()
    wHw = (Om * Y).sum(0).cpu()  # (s,) w_i^T H w_i
    Rinv_T = torch.linalg.solve_triangular(R, torch.eye(s, dtype=R.dtype), upper=True).T  # (s, s) = R^{-T}
    S = Rinv_T / Rinv_T.norm(dim=0, keepdim=True)  # (s, s) column i: unit normal of span(R without column i)
    PW = W - S * (S * W).sum(0, keepdim=True)  # (s, s) column i: Pi_i w_i, Pi_i = I - s_i s_i^T
    low = float(torch.trace(Hs)) - (S * (Hs @ S)).sum(0)  # (s,) tr(Pi_i Q^T H Q Pi_i)
    rest = wHw - 2 * (R * PW).sum(0) + (PW * (Hs @ PW)).sum(0)  # (s,) w_i^T (I-P_i) H (I-P_i) w_i
    est = float((low + rest).mean())
    return _trace_result("xtrace", est, _xtrace_jackknife_se(Hs, W, R, wHw, S), op.n, apply.done, t0, seed)
