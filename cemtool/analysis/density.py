"""The spectral density of an operator by stochastic Lanczos quadrature (METHODS §6).

:func:`slq` returns a :class:`Density`: Gaussian-smoothed with a reported sigma, from independent Lanczos runs
(:mod:`cemtool.analysis.lanczos`; a run already made for the extreme eigenvalues can be continued as one of them).
Any operator with ``n``, ``matvec`` and ``device`` (:mod:`cemtool.analysis.curvature.protocol`) will do.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from cemtool.analysis.curvature.protocol import Callback, as_operator
from cemtool.analysis.lanczos import LanczosState, _random_unit, lanczos_iterate
from cemtool.errors import CemtoolError


@dataclass
class Density:
    """Spectral density by stochastic Lanczos quadrature (Ubaru, Chen & Saad 2017; Ghorbani, Krishnan & Xiao
    2019): per run, the Ritz values (nodes) of m Lanczos steps from a normalised Rademacher vector and the squared
    first components of their eigenvectors (weights, summing to 1). The density is the run-average of Gaussians of
    width ``sigma`` at the nodes, on ``grid``; it integrates to 1 (it is the density of eigenvalues / n).
    It is not a trace estimate: n sum_j w_j theta_j of a run is one Hutchinson sample (11-33% off from one run on
    real Hessians); use :func:`xtrace` for tr(H)."""

    nodes: list[list[float]]
    weights: list[list[float]]
    grid: list[float]
    density: list[float]
    sigma: float
    runs: int
    steps: int
    hvps: int
    seconds: float
    seed: int
    n: int


def smooth_density(nodes: np.ndarray, weights: np.ndarray, grid: np.ndarray, sigma: float) -> np.ndarray:
    """sum_j w_j N(grid; node_j, sigma^2) (nodes, weights flat; weights sum to the mass)."""
    z = (grid[:, None] - nodes[None, :]) / sigma  # (G, J)
    return (np.exp(-0.5 * z**2) * weights[None, :]).sum(1) / (sigma * math.sqrt(2 * math.pi))


def slq(op, runs: int = 3, steps: int = 80, *, seed: int = 0, sigma: float | None = None, sigma_frac: float = 0.01,
        grid_points: int = 1000, reuse: list[LanczosState] | tuple = (), callback: Callback | None = None) -> Density:
    """Stochastic Lanczos quadrature: ``runs`` independent Lanczos runs of ``steps`` HVPs each.

    ``reuse``: Lanczos runs already made from isotropic random starts (e.g. ``lanczos(...).state``); each is
    continued to ``steps`` and counted as one of the ``runs`` (``hvps`` counts only the new HVPs).
    ``sigma`` defaults to ``sigma_frac`` times the spread of the nodes."""
    op = as_operator(op)  # a dense (n, n) tensor is an operator too
    if runs < 1 or steps < 1:
        raise CemtoolError("the density needs at least one run of one step")
    if sigma is not None and not (math.isfinite(sigma) and sigma > 0):
        raise CemtoolError(f"the density smoothing sigma must be a positive number, got {sigma}")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    nodes, weights, done = [], [], 0
    starts = list(reuse)[:runs] + [None] * max(0, runs - len(reuse))
    for state in starts:
        base = done

        def cb(j: int, base: int = base) -> None:
            if callback is not None:
                callback(base + j)

        v0 = None if state is not None else _random_unit(op.n, gen, op.device, rademacher=True)
        before = state.steps if state is not None else 0
        st = lanczos_iterate(op, v0, steps, gen, callback=cb, state=state)
        done += st.steps - before
        theta, S, _ = st.ritz(min(steps, st.steps))
        nodes.append(theta.tolist())
        # first components of the eigenvectors of T; after a restart only the first block carries the start vector
        weights.append((S[0, :] ** 2).tolist())
    flat_n, flat_w = np.concatenate(nodes), np.concatenate(weights) / runs
    lo, hi = float(flat_n.min()), float(flat_n.max())
    sig = sigma if sigma is not None else sigma_frac * max(hi - lo, 1e-12 * max(abs(lo), abs(hi), 1.0))
    grid = np.linspace(lo - 5 * sig, hi + 5 * sig, grid_points)
    dens = smooth_density(flat_n, flat_w, grid, sig)
    return Density(nodes, weights, grid.tolist(), dens.tolist(), sig, runs, steps, done, time.perf_counter() - t0,
                   seed, op.n)
