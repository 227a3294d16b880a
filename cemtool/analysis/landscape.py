"""Sharpness beyond the spectrum (METHODS §6): worst-case (SAM, adaptive ASAM), average-case adaptive sharpness,
and 1-D / 2-D loss slices along filter-normalised random directions.

All functions take an :class:`cemtool.analysis.curvature.risk.EmpiricalRisk` (the mean token loss over a fixed
evaluation set, as a function of a parameter subset w) and perturb only that subset; the weights are restored
exactly afterwards.
Notation: L(w) the loss, g = grad L(w), rho the radius, T_w the adaptive scaling.

- SAM rho-sharpness (Foret et al. 2021):  max_{||e|| <= rho} L(w + e) - L(w). First order: e = rho g / ||g||.
- Adaptive worst-case (ASAM, Kwon et al. 2021): max_{||T_w^{-1} e|| <= rho} L(w + e) - L(w), T_w = |w| + eta.
  First order: e = rho T_w^2 g / ||T_w g||. SAM is the case T_w = I.
- Ascent steps: K steps of projected normalised gradient ascent in u = T_w^{-1} e, step 2 rho / K from u = 0,
  u <- P_rho(u + (2 rho / K) T_w g(w + T_w u) / ||T_w g(w + T_w u)||), so K = 1 is the first-order point. The value
  reported is the largest loss met (also counting the first-order point): a lower bound on the true maximum.
- Average-case adaptive sharpness (Andriushchenko et al. 2023): E_d[L(w + d)] - L(w), d = rho |w| * z,
  z ~ N(0, I), estimated with antithetic pairs (L(w + d) + L(w - d)) / 2 - L(w), which cancels the first-order term
  (same expectation, lower variance); standard error over the pairs.
- Loss slices (Li et al. 2018): L(w + a d1) and L(w + a d1 + b d2) with d random Gaussian, each output row of every
  matrix (rows of weights, of embeddings) rescaled to the norm of that row of w; biases and 1-D parameters
  (norm gains, scalars) get zero. The 2-D directions are independent draws (nearly orthogonal in high dimension).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cemtool.analysis.curvature.protocol import Callback
from cemtool.analysis.curvature.risk import EmpiricalRisk
from cemtool.errors import CemtoolError


@dataclass
class Sharpness:
    """One sharpness estimate: ``value`` = perturbed loss - loss (nats), with its standard error (average-case)."""

    kind: str  # sam | asam | average
    rho: float
    value: float
    se: float | None
    loss: float
    perturbed_loss: float
    ascent_steps: int  # 1 = first order
    first_order: float | None  # worst-case: the first-order value (equal to value when ascent_steps == 1)
    eta: float | None  # adaptive offset of T_w (asam)
    samples: int | None  # antithetic pairs (average)
    evaluations: int  # loss passes over the evaluation set
    gradients: int  # gradient passes
    seconds: float
    seed: int | None
    n: int
    tokens: int


def _scaling(obj: EmpiricalRisk, adaptive: bool, eta: float) -> torch.Tensor:
    """T_w as a flat (n,) vector: |w| + eta (adaptive) or ones."""
    w = obj.parameters_vector()  # (n,)
    return w.abs() + eta if adaptive else torch.ones_like(w)


def worst_case_sharpness(obj: EmpiricalRisk, rho: float = 0.05, *, adaptive: bool = False, eta: float = 0.01,
                         ascent_steps: int = 1, base: tuple[float, torch.Tensor] | None = None,
                         callback: Callback | None = None) -> Sharpness:
    """max_{||T_w^{-1} e|| <= rho} L(w + e) - L(w) (SAM when not adaptive), first order or with ascent steps.
    ``base``: (L(w), grad L(w)) if already computed."""
    if rho <= 0:
        raise CemtoolError(f"the sharpness radius must be positive, got {rho}")
    if ascent_steps < 1:
        raise CemtoolError("ascent_steps counts gradient steps and must be >= 1 (1 = first order)")
    t0 = time.perf_counter()
    ev0, gr0 = obj.evaluations, obj.gradients
    loss0, g = base if base is not None else obj.gradient()
    T = _scaling(obj, adaptive, eta)  # (n,)

    def unit(grad: torch.Tensor) -> torch.Tensor:
        tg = T * grad  # (n,) gradient in u-coordinates
        nrm = float(tg.norm())
        if nrm == 0.0:
            raise CemtoolError("the gradient is zero on the chosen parameters: worst-case sharpness is undefined")
        return tg / nrm

    first_u = rho * unit(g)
    with obj.shifted(T * first_u):
        first = obj.loss()
    done = 1
    if callback is not None:
        callback(done)
    best = first
    if ascent_steps > 1:
        u, step, gu = torch.zeros_like(g), 2 * rho / ascent_steps, g
        for k in range(ascent_steps):
            u = u + step * unit(gu)
            if float(u.norm()) > rho:
                u = u * (rho / float(u.norm()))  # project onto the ball
            if k + 1 < ascent_steps:
                with obj.shifted(T * u):
                    lu, gu = obj.gradient()
            else:
                with obj.shifted(T * u):
                    lu = obj.loss()
            best = max(best, lu)
            done += 1
            if callback is not None:
                callback(done)
    return Sharpness("asam" if adaptive else "sam", rho, best - loss0, None, loss0, best, ascent_steps,
                     first - loss0, eta if adaptive else None, None, obj.evaluations - ev0, obj.gradients - gr0,
                     time.perf_counter() - t0, None, obj.n, obj.tokens)


def sam_sharpness(obj: EmpiricalRisk, rho: float = 0.05, ascent_steps: int = 1, **kw) -> Sharpness:
    """SAM rho-sharpness max_{||e|| <= rho} L(w + e) - L(w) (Foret et al. 2021)."""
    return worst_case_sharpness(obj, rho, adaptive=False, ascent_steps=ascent_steps, **kw)


def asam_sharpness(obj: EmpiricalRisk, rho: float = 0.5, eta: float = 0.01, ascent_steps: int = 1, **kw) -> Sharpness:
    """Adaptive worst-case sharpness with T_w = |w| + eta (Kwon et al. 2021)."""
    return worst_case_sharpness(obj, rho, adaptive=True, eta=eta, ascent_steps=ascent_steps, **kw)


def average_sharpness(obj: EmpiricalRisk, rho: float = 0.1, samples: int = 8, *, seed: int = 0,
                      loss0: float | None = None, callback: Callback | None = None) -> Sharpness:
    """Average-case adaptive sharpness E[L(w + rho |w| * z)] - L(w), z ~ N(0, I) (Andriushchenko et al. 2023),
    from ``samples`` antithetic pairs; standard error over the pairs."""
    if rho <= 0 or samples < 2:
        raise CemtoolError("average-case sharpness needs rho > 0 and at least 2 samples")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    ev0 = obj.evaluations
    loss0 = obj.loss() if loss0 is None else loss0
    scale = rho * obj.parameters_vector().abs()  # (n,)
    vals, perturbed = [], []
    for i in range(samples):
        d = scale * torch.randn(obj.n, generator=gen, dtype=torch.float64).to(scale.device)  # (n,)
        pair = []
        for sign in (1.0, -1.0):
            with obj.shifted(sign * d):
                pair.append(obj.loss())
        perturbed.append(sum(pair) / 2)
        vals.append(sum(pair) / 2 - loss0)
        if callback is not None:
            callback(i + 1)
    v = np.asarray(vals)
    return Sharpness("average", rho, float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), loss0,
                     float(np.mean(perturbed)), 0, None, None, samples, obj.evaluations - ev0, 0,
                     time.perf_counter() - t0, seed, obj.n, obj.tokens)


# --------------------------------------------------------------------------------------------------------------
# loss slices


def filter_normalized_direction(obj: EmpiricalRisk, gen: torch.Generator) -> torch.Tensor:
    """A Gaussian direction, flat (n,), with each output row of each >= 2-D parameter rescaled to the norm of the
    same row of w (Li et al. 2018); 1-D parameters get zero."""
    parts = []
    for p in obj.params:
        if p.dim() < 2:
            parts.append(torch.zeros(p.numel(), dtype=torch.float64))
            continue
        w = p.detach().to("cpu", torch.float64).reshape(p.shape[0], -1)  # (rows, fan_in)
        d = torch.randn(w.shape, generator=gen, dtype=torch.float64)  # (rows, fan_in)
        d = d * (w.norm(dim=1, keepdim=True) / d.norm(dim=1, keepdim=True).clamp_min(1e-12))
        parts.append(d.reshape(-1))
    out = torch.cat(parts).to(obj.device)  # (n,)
    if float(out.norm()) == 0.0:
        raise CemtoolError("the chosen parameters are all 1-D (or zero): filter-normalised directions are zero",
                           hint="select matrices with --params, or use --landscape none")
    return out


@dataclass
class Slice1D:
    """L(w + alpha d) on a grid of alpha, d filter-normalised (alpha = 1 moves every row by its own norm)."""

    alphas: list[float]
    losses: list[float]
    loss: float
    seed: int
    evaluations: int
    seconds: float
    n: int
    tokens: int


@dataclass
class Slice2D:
    """L(w + alpha d1 + beta d2); ``losses[i][j]`` is at (alphas[i], betas[j])."""

    alphas: list[float]
    betas: list[float]
    losses: list[list[float]]
    loss: float
    seed: int
    evaluations: int
    seconds: float
    n: int
    tokens: int


def _grid(span: float, points: int) -> np.ndarray:
    if points < 2 or span <= 0:
        raise CemtoolError("a loss slice needs at least 2 points and a positive span")
    g = np.linspace(-span, span, points)
    if points % 2:  # put exactly 0 in the middle
        g[points // 2] = 0.0
    return g


def loss_slice_1d(obj: EmpiricalRisk, span: float = 1.0, points: int = 21, *, seed: int = 0,
                  callback: Callback | None = None) -> Slice1D:
    """The loss along one filter-normalised random direction, alpha in [-span, span]."""
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    ev0 = obj.evaluations
    d = filter_normalized_direction(obj, gen)
    alphas = _grid(span, points)
    losses = []
    for i, a in enumerate(alphas):
        with obj.shifted(float(a) * d):
            losses.append(obj.loss())
        if callback is not None:
            callback(i + 1)
    loss0 = losses[points // 2] if points % 2 else obj.loss()
    return Slice1D(alphas.tolist(), losses, loss0, seed, obj.evaluations - ev0, time.perf_counter() - t0, obj.n,
                   obj.tokens)


def loss_slice_2d(obj: EmpiricalRisk, span: float = 1.0, points: int = 11, *, seed: int = 0,
                  callback: Callback | None = None) -> Slice2D:
    """The loss on the plane of two filter-normalised random directions, both coordinates in [-span, span]."""
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    ev0 = obj.evaluations
    d1, d2 = filter_normalized_direction(obj, gen), filter_normalized_direction(obj, gen)
    grid = _grid(span, points)
    losses = [[0.0] * points for _ in range(points)]
    for i, a in enumerate(grid):
        for j, b in enumerate(grid):
            with obj.shifted(float(a) * d1 + float(b) * d2):
                losses[i][j] = obj.loss()
            if callback is not None:
                callback(i * points + j + 1)
    loss0 = losses[points // 2][points // 2] if points % 2 else obj.loss()
    return Slice2D(grid.tolist(), grid.tolist(), losses, loss0, seed, obj.evaluations - ev0,
                   time.perf_counter() - t0, obj.n, obj.tokens)


# --------------------------------------------------------------------------------------------------------------
# everything at once: what `cemtool sharpness` runs


__all__ = ["Sharpness", "Slice1D", "Slice2D", "asam_sharpness", "average_sharpness", "filter_normalized_direction",
           "loss_slice_1d", "loss_slice_2d", "sam_sharpness", "worst_case_sharpness"]
