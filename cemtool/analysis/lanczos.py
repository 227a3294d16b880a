"""Extreme eigenvalues of an operator by Lanczos with full reorthogonalisation (METHODS §6).

:func:`lanczos` returns the top-k and bottom-k eigenvalues (:class:`Eigenvalues`) with Ritz residuals, error
estimates and converged flags; :func:`lanczos_iterate` runs the recurrence (:class:`LanczosState`), which can be
continued (the extreme-eigenvalue run doubles as an SLQ run, :mod:`cemtool.analysis.density`). Any operator with
``n``, ``matvec`` and ``device`` (:mod:`cemtool.analysis.curvature.protocol`) will do.

Notation: n = the operator's dimension, k = requested eigenvalues, m = Lanczos steps. The recurrences (alpha,
beta) and the basis are float64 whatever the HVP dtype.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from cemtool.analysis.curvature.protocol import Callback, as_operator
from cemtool.errors import CemtoolError


def _orthogonalize(w: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Full reorthogonalisation against the rows of Q (j, n): classical Gram-Schmidt twice ("twice is enough")."""
    if Q.shape[0] == 0:
        return w
    for _ in range(2):
        w = w - Q.T @ (Q @ w)  # (n,)
    return w


def _random_unit(n: int, gen: torch.Generator, device: torch.device, rademacher: bool = False) -> torch.Tensor:
    v = (torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1) if rademacher \
        else torch.randn(n, generator=gen, dtype=torch.float64)
    return (v / v.norm()).to(device)  # (n,)


@dataclass
class LanczosState:
    """The Lanczos recurrence so far: T_m = tridiag(beta, alpha, beta), the orthonormal basis Q (n, m) and the next
    basis vector, so that a run can be continued (the extreme-eigenvalue run doubles as an SLQ run)."""

    next_q: torch.Tensor
    alpha: list[float] = field(default_factory=list)
    beta: list[float] = field(default_factory=list)  # beta[j] couples q_j and q_{j+1} (0 after a restart)
    rows: torch.Tensor | None = None  # (capacity, n) storage of the basis; rows[:steps] are q_0 .. q_{m-1}
    residual_norm: float = 0.0  # beta_m: norm of the last residual (the Ritz residual factor)
    scale: float = 0.0  # running estimate of ||H|| for the breakdown test
    restarts: list[int] = field(default_factory=list)  # steps after which an invariant subspace was found

    @property
    def steps(self) -> int:
        return len(self.alpha)

    @property
    def basis(self) -> torch.Tensor:
        """The orthonormal basis so far, one vector per row: (m, n) float64 (a view)."""
        if self.rows is None:
            return self.next_q.new_zeros(0, self.next_q.numel())
        return self.rows[: self.steps]

    def _store(self, q: torch.Tensor, capacity: int) -> None:
        j = self.steps
        if self.rows is None or j >= self.rows.shape[0]:  # grow the storage geometrically, up to ``capacity``
            grown = q.new_empty(max(min(capacity, max(16, 2 * j)), j + 1), q.numel())
            if self.rows is not None:
                grown[:j] = self.rows[:j]
            self.rows = grown
        self.rows[j] = q

    def tridiagonal(self, m: int | None = None) -> np.ndarray:
        m = len(self.alpha) if m is None else m
        T = np.diag(np.asarray(self.alpha[:m], dtype=np.float64))
        if m > 1:
            off = np.asarray(self.beta[: m - 1], dtype=np.float64)
            T += np.diag(off, 1) + np.diag(off, -1)
        return T

    def ritz(self, m: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """After m steps (default all): Ritz values (ascending), eigenvectors S of T_m and residual norms
        |beta_m s_{m,i}| = ||H y_i - theta_i y_i||."""
        m = len(self.alpha) if m is None else m
        theta, S = np.linalg.eigh(self.tridiagonal(m))
        return theta, S, np.abs(self.beta[m - 1] * S[-1, :])


def lanczos_iterate(op, v0: torch.Tensor | None, steps: int, gen: torch.Generator,
                    stop: Callable[[LanczosState], bool] | None = None, callback: Callback | None = None,
                    state: LanczosState | None = None) -> LanczosState:
    """Run Lanczos with full reorthogonalisation until ``steps`` steps in all (float64 basis and recurrence),
    from v0 or continuing ``state``.

    On breakdown (an invariant subspace is found, beta ~ 0) it continues from a fresh random vector orthogonal
    to the basis, recording beta = 0, so T_m stays exact for the space explored. ``stop(state)`` ends early.
    ``callback`` gets the number of steps taken in this call.
    """
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    st = state if state is not None else LanczosState(next_q=v0.to(torch.float64) / v0.norm())
    done = 0
    while st.steps < min(steps, op.n):
        q = st.next_q
        st._store(q, min(steps, op.n))
        w = op.matvec(q).to(torch.float64)  # (n,)
        a = float(q @ w)
        w = _orthogonalize(w, st.rows[: st.steps + 1])  # removes alpha q_j, beta q_{j-1} and rounding drift
        b = float(w.norm())
        st.alpha.append(a)
        st.scale = max(st.scale, abs(a) + b)
        done += 1
        if callback is not None:
            callback(done)
        if b <= 1e-12 * max(st.scale, 1e-300) and st.steps < op.n:  # invariant subspace: restart
            st.beta.append(0.0)
            st.restarts.append(st.steps)
            q = _orthogonalize(_random_unit(op.n, gen, w.device), st.basis)  # basis now includes q_j
            st.next_q = q / q.norm()
        else:
            st.beta.append(b)
            st.next_q = w / b if b > 0 else w
        st.residual_norm = st.beta[-1]
        if stop is not None and stop(st):
            break
    return st


def error_estimates(theta: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Eigenvalue error estimate of each Ritz value: min(r_i, r_i^2 / gap_i) (Kato-Temple), with gap_i the
    distance to the nearest other Ritz value less its residual. r_i alone is a rigorous bound (some eigenvalue
    of H lies within r_i of theta_i); the r^2/gap form assumes no eigenvalue is hiding between Ritz values."""
    out = residual.copy()
    if len(theta) < 2:
        return out
    for i in range(len(theta)):
        others = np.delete(np.arange(len(theta)), i)
        gap = np.min(np.abs(theta[others] - theta[i]) - residual[others])
        if gap > 0:
            out[i] = min(residual[i], residual[i] ** 2 / gap)
    return out


@dataclass
class Eigenvalues:
    """Extreme eigenvalues of H by Lanczos. ``top`` descending, ``bottom`` ascending; for each:

    - ``*_residual``: a bound in the working precision on the distance from theta to an eigenvalue of H: the Ritz
      residual of the recurrence |beta_m s_m| (exact arithmetic: some eigenvalue lies within it) plus the rounding
      term max(sqrt(n), 10) eps ||H|| of the HVP (``rounding``; ||H|| ~ max(|theta| + r); eps is the operator's
      ``hvp_eps`` when it has one: the central difference's error level), without which an fp32
      residual such as 1e-24 would claim far more than fp32 HVPs can deliver;
    - ``*_error``: the Kato-Temple error estimate min(r, r^2/gap), never below ``rounding``;
    - ``*_converged``: the estimate <= tol * max(|theta|, 1e-3 max|theta|), or at the HVP rounding level 10 eps
      max|theta| (the stopping rule)."""

    top: list[float]
    top_residual: list[float]
    top_error: list[float]
    top_converged: list[bool]
    bottom: list[float]
    bottom_residual: list[float]
    bottom_error: list[float]
    bottom_converged: list[bool]
    ritz_values: list[float]  # every Ritz value of the final T_m (ascending)
    rounding: float  # sqrt(n) eps ||H||: the HVP rounding term included in every residual and error
    steps: int
    hvps: int
    seconds: float
    tol: float
    seed: int
    n: int
    vectors_top: torch.Tensor | None = field(default=None, repr=False)  # (n, k_top) Ritz vectors if asked for
    vectors_bottom: torch.Tensor | None = field(default=None, repr=False)
    state: LanczosState | None = field(default=None, repr=False)  # to continue the run (e.g. as an SLQ run)

    @property
    def converged(self) -> bool:
        return all(self.top_converged) and all(self.bottom_converged)

    @property
    def lambda_max(self) -> float:
        return self.top[0] if self.top else max(self.ritz_values)

    @property
    def lambda_min(self) -> float:
        return self.bottom[0] if self.bottom else min(self.ritz_values)


def _select(theta: np.ndarray, residual: np.ndarray, k_top: int, k_bottom: int, tol: float, eps: float, n: int):
    """Residual bounds and error estimates in the working precision (both include the rounding term sqrt(n) eps
    ||H||), converged flags (the raw estimate at tol, or at the rounding level 10 eps max|theta|), the rounding term
    and the indices of the top-k (descending) and bottom-k (ascending) Ritz values."""
    raw = error_estimates(theta, residual)
    scale = max(float(np.max(np.abs(theta))), 1e-300)
    rounding = max(math.sqrt(n), 10.0) * eps * float(np.max(np.abs(theta) + residual))
    ok = (raw <= tol * np.maximum(np.abs(theta), 1e-3 * scale)) | (raw <= 10 * eps * scale)
    bound, err = residual + rounding, np.maximum(raw, rounding)
    m = len(theta)
    top = list(range(m - 1, max(m - 1 - k_top, -1), -1))
    bottom = list(range(0, min(k_bottom, m)))
    return bound, err, ok, rounding, top, bottom


def lanczos(op, k_top: int = 5, k_bottom: int = 1, *, max_steps: int = 80, tol: float = 1e-4, seed: int = 0,
            min_steps: int | None = None, return_vectors: bool = False,
            callback: Callback | None = None, v0: torch.Tensor | None = None) -> Eigenvalues:
    """Top-k and bottom-k eigenvalues of the operator by Lanczos with full reorthogonalisation.

    Both ends come from one Krylov space (the Hessian is indefinite: the most negative eigenvalue matters, and
    λ_max is the largest *algebraic* eigenvalue, not the largest in magnitude as power iteration finds).
    Stops when every requested Ritz value has converged (see :class:`Eigenvalues`) or after ``max_steps`` HVPs.
    The start vector is a normalised Rademacher vector from ``seed`` (isotropic, so the run can continue as an
    SLQ run), or ``v0`` when given (n,) (a warm start, e.g. the previous top Ritz vector; not isotropic). If the steps
    taken are fewer than k, fewer values are returned.
    """
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    if k_top < 0 or k_bottom < 0 or k_top + k_bottom == 0:
        raise CemtoolError("ask for at least one eigenvalue (top-k or bottom-k)")
    if k_top + k_bottom > max_steps:  # fewer Ritz values than asked: the "top" would include the bottom
        raise CemtoolError(f"{k_top} top and {k_bottom} bottom eigenvalues need at least {k_top + k_bottom} Lanczos "
                           f"steps, the cap is {max_steps}", hint="raise the step cap or ask for fewer eigenvalues")
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    need = min(op.n, max(k_top, k_bottom) + 1 if min_steps is None else min_steps)
    eps = getattr(op, "hvp_eps", None) or torch.finfo(getattr(op, "dtype", torch.float64)).eps

    def converged(st: LanczosState) -> bool:
        # after an invariant subspace, the fresh block must be explored too (it finds repeated eigenvalues)
        if st.steps < need + (st.restarts[-1] if st.restarts else 0):
            return False
        if st.steps >= op.n:
            return True
        theta, _, res = st.ritz()
        _, _, ok, _, top, bottom = _select(theta, res, k_top, k_bottom, tol, eps, op.n)
        return len(top) >= min(k_top, op.n) and bool(ok[top + bottom].all())

    if v0 is not None and (v0.shape != (op.n,) or not bool(torch.isfinite(v0).all()) or float(v0.norm()) == 0):
        raise CemtoolError(f"the Lanczos start vector must be a finite non-zero vector of {op.n} entries")
    start = v0.to(device=op.device, dtype=torch.float64) if v0 is not None else \
        _random_unit(op.n, gen, op.device, rademacher=True)
    st = lanczos_iterate(op, start, max_steps, gen, converged, callback)
    theta, S, res = st.ritz()
    bound, err, ok, rounding, top, bottom = _select(theta, res, k_top, k_bottom, tol, eps, op.n)
    if st.steps >= op.n:  # the whole space: Ritz values are eigenvalues up to rounding
        ok[:] = True
    vt = vb = None
    if return_vectors:
        Q = st.basis.T  # (n, m)
        Sd = torch.from_numpy(S).to(Q.device)  # (m, m)
        vt, vb = Q @ Sd[:, top], Q @ Sd[:, bottom]  # (n, k)
    return Eigenvalues(
        top=[float(theta[i]) for i in top], top_residual=[float(bound[i]) for i in top],
        top_error=[float(err[i]) for i in top], top_converged=[bool(ok[i]) for i in top],
        bottom=[float(theta[i]) for i in bottom], bottom_residual=[float(bound[i]) for i in bottom],
        bottom_error=[float(err[i]) for i in bottom], bottom_converged=[bool(ok[i]) for i in bottom],
        ritz_values=[float(t) for t in theta], rounding=rounding, steps=st.steps, hvps=st.steps,
        seconds=time.perf_counter() - t0, tol=tol, seed=seed, n=op.n, vectors_top=vt, vectors_bottom=vb, state=st)
