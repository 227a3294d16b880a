"""Sharpness beyond the spectrum (METHODS §6): worst-case (SAM, adaptive ASAM), average-case adaptive sharpness,
and 1-D / 2-D loss slices along filter-normalised random directions.

All functions take an :class:`cemtool.analysis.hessian.Objective` (the mean token loss over a fixed evaluation set,
as a function of a parameter subset w) and perturb only that subset; the weights are restored exactly afterwards.
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
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from cemtool.analysis import hessian as hs
from cemtool.analysis.hessian import Callback, Density, Eigenvalues, Objective, Trace, lanczos, slq
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


def _scaling(obj: Objective, adaptive: bool, eta: float) -> torch.Tensor:
    """T_w as a flat (n,) vector: |w| + eta (adaptive) or ones."""
    w = obj.parameters_vector()  # (n,)
    return w.abs() + eta if adaptive else torch.ones_like(w)


def worst_case_sharpness(obj: Objective, rho: float = 0.05, *, adaptive: bool = False, eta: float = 0.01,
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


def sam_sharpness(obj: Objective, rho: float = 0.05, ascent_steps: int = 1, **kw) -> Sharpness:
    """SAM rho-sharpness max_{||e|| <= rho} L(w + e) - L(w) (Foret et al. 2021)."""
    return worst_case_sharpness(obj, rho, adaptive=False, ascent_steps=ascent_steps, **kw)


def asam_sharpness(obj: Objective, rho: float = 0.5, eta: float = 0.01, ascent_steps: int = 1, **kw) -> Sharpness:
    """Adaptive worst-case sharpness with T_w = |w| + eta (Kwon et al. 2021)."""
    return worst_case_sharpness(obj, rho, adaptive=True, eta=eta, ascent_steps=ascent_steps, **kw)


def average_sharpness(obj: Objective, rho: float = 0.1, samples: int = 8, *, seed: int = 0,
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


def filter_normalized_direction(obj: Objective, gen: torch.Generator) -> torch.Tensor:
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


def loss_slice_1d(obj: Objective, span: float = 1.0, points: int = 21, *, seed: int = 0,
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


def loss_slice_2d(obj: Objective, span: float = 1.0, points: int = 11, *, seed: int = 0,
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


def tokens_note(requested: int, used: int, windows: int, seq_len: int) -> str:
    """Why the evaluation set holds ``used`` tokens when ``requested`` were asked for (whole windows only)."""
    why = (f"the validation split holds only {windows} windows of {seq_len} tokens"
           if windows < max(1, requested // seq_len) else f"the evaluation set is whole windows of {seq_len} tokens")
    return f"{used:,} evaluation tokens used of {requested:,} requested: {why}"


TRACE_METHODS = {"hutchinson": hs.hutchinson, "hutch++": hs.hutch_plus_plus, "xtrace": hs.xtrace}
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class SharpnessOptions:
    """What to measure and with which budget (the defaults take about a minute on 2 CPU cores for a 4-layer,
    128-wide model on 2k tokens in fp32; see docs/sharpness.md). A budget of 0 skips that measurement."""

    params: str = "all"  # parameter subset (see hessian.select_parameters)
    dtype: str = "fp32"  # HVP dtype: fp32 or fp64 (a converted copy of the model)
    batch_size: int | None = None  # sequences per batch (default: 8192 tokens per batch)
    top_k: int = 5
    bottom_k: int = 1
    lanczos_steps: int = 40  # HVP cap of the extreme-eigenvalue run
    tol: float = 1e-4  # relative eigenvalue error estimate at which a Ritz value counts as converged
    trace_methods: tuple[str, ...] = ("xtrace",)
    trace_hvps: int = 40  # HVPs per trace method
    density_runs: int = 1  # SLQ runs (the first continues the eigenvalue run)
    density_steps: int = 40  # Lanczos steps per SLQ run
    density_sigma: float | None = None  # Gaussian smoothing (default: 1% of the spectral spread)
    sam_rho: float = 0.05
    asam_rho: float = 0.5
    asam_eta: float = 0.01
    ascent_steps: int = 1  # gradient steps of the worst-case measures (1 = first order)
    avg_rho: float = 0.1
    avg_samples: int = 4  # antithetic pairs of the average-case measure
    landscape: str = "1d"  # 1d | 2d | both | none
    slice_span: float = 1.0
    slice_points: int = 21  # per axis (2-D: at most 11 by default, see slice_points_2d)
    slice_points_2d: int = 11
    seed: int = 0
    device: str | None = None
    graph_memory: float | None = None  # GiB of kept first-order graphs (None: a quarter of the free memory)
    hvp: str = "exact"  # exact (double backward) or fd (central difference of gradients; fp64 only)

    def __post_init__(self):
        bad = [m for m in self.trace_methods if m not in TRACE_METHODS]
        if bad:
            raise CemtoolError(f"unknown trace method {bad[0]!r}", hint=f"use {', '.join(TRACE_METHODS)}")
        if self.landscape not in ("1d", "2d", "both", "none"):
            raise CemtoolError(f"unknown landscape {self.landscape!r}", hint="use 1d, 2d, both or none")
        for name in ("top_k", "bottom_k", "lanczos_steps", "trace_hvps", "density_runs", "density_steps",
                     "avg_samples"):
            if getattr(self, name) < 0:
                raise CemtoolError(f"{name} must be >= 0")
        hs.check_hvp_method(self.hvp, hs.resolve_dtype(self.dtype))
        if self.graph_memory is not None and not (math.isfinite(self.graph_memory) and self.graph_memory >= 0):
            raise CemtoolError(f"graph_memory must be a finite number of GiB >= 0, got {self.graph_memory}")
        for name in ("tol", "sam_rho", "asam_rho", "asam_eta", "avg_rho", "slice_span"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise CemtoolError(f"{name} must be a finite number >= 0, got {v}")
        if self.density_sigma is not None and not (math.isfinite(self.density_sigma) and self.density_sigma > 0):
            raise CemtoolError(f"density_sigma must be a positive number, got {self.density_sigma}",
                               hint="leave it out for 1% of the spectral spread")
        if 0 < self.lanczos_steps < self.top_k + self.bottom_k:
            raise CemtoolError(f"top_k {self.top_k} + bottom_k {self.bottom_k} eigenvalues need at least "
                               f"{self.top_k + self.bottom_k} Lanczos steps, lanczos_steps is {self.lanczos_steps}",
                               hint="raise --lanczos-steps or lower --top-k/--bottom-k")


@dataclass
class SharpnessReport:
    """Every measurement of one `cemtool sharpness` call, with its cost (HVPs, loss/gradient passes, seconds)."""

    options: SharpnessOptions
    tokens: int
    sequences: int
    seq_len: int
    n_params: int  # parameters in the subset (the Hessian's dimension)
    n_model_params: int
    param_names: list[str]
    loss: float
    grad_norm: float
    tokens_requested: int | None = None  # what the caller asked for (``tokens`` is what was used)
    notes: list[str] = field(default_factory=list)  # every change to what was asked, in words
    eigen: Eigenvalues | None = None
    traces: list[Trace] = field(default_factory=list)
    density: Density | None = None
    sharpness: list[Sharpness] = field(default_factory=list)
    slice_1d: Slice1D | None = None
    slice_2d: Slice2D | None = None
    hvps: int = 0
    evaluations: int = 0
    gradients: int = 0
    seconds: float = 0.0
    kept_graph_batches: int = 0
    batches: int = 1
    computed_in: str = ""  # the precision the forward computes in (hessian.forward_precision): the bounds' eps

    def payload(self) -> dict:
        """A JSON-able dict (no tensors)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["options"] = asdict(self.options)
        for key in ("eigen", "density", "slice_1d", "slice_2d"):
            v = out[key]
            out[key] = None if v is None else {f.name: getattr(v, f.name) for f in fields(v)
                                                if f.name not in ("vectors_top", "vectors_bottom", "state")}
        out["traces"] = [asdict(t) for t in self.traces]
        out["sharpness"] = [asdict(s) for s in self.sharpness]
        return out

    def rows(self) -> list[dict]:
        """One row per estimate: value, its uncertainty and what it cost (the CSV)."""
        o = self.options
        common = {"tokens": self.tokens, "params": o.params, "n_params": self.n_params, "dtype": o.dtype,
                  "seed": o.seed}
        rows = [dict(quantity="loss", index=0, value=self.loss, uncertainty=None, uncertainty_kind=None,
                     converged=None, hvps=0, evaluations=1, seconds=None, **common),
                dict(quantity="grad_norm", index=0, value=self.grad_norm, uncertainty=None, uncertainty_kind=None,
                     converged=None, hvps=0, evaluations=1, seconds=None, **common)]
        e = self.eigen
        if e is not None:
            for end, vals, res, err, ok in (("lambda_top", e.top, e.top_residual, e.top_error, e.top_converged),
                                            ("lambda_bottom", e.bottom, e.bottom_residual, e.bottom_error,
                                             e.bottom_converged)):
                for i, (v, r, er, c) in enumerate(zip(vals, res, err, ok, strict=True)):
                    rows.append(dict(quantity=end, index=i + 1, value=v, uncertainty=er,
                                     uncertainty_kind="error estimate", residual=r, converged=c, hvps=e.hvps,
                                     evaluations=0, seconds=e.seconds, **common))
        for t in self.traces:
            rows.append(dict(quantity=f"trace_{t.method}", index=0, value=t.trace, uncertainty=t.se,
                             uncertainty_kind="standard error", converged=None, hvps=t.hvps, evaluations=0,
                             seconds=t.seconds, **common))
            rows.append(dict(quantity=f"trace_per_param_{t.method}", index=0, value=t.per_param,
                             uncertainty=t.per_param_se, uncertainty_kind="standard error", converged=None,
                             hvps=t.hvps, evaluations=0, seconds=t.seconds, **common))
        d = self.density
        if d is not None:
            rows.append(dict(quantity="density_sigma", index=0, value=d.sigma, uncertainty=None,
                             uncertainty_kind=None, converged=None, hvps=d.hvps, evaluations=0, seconds=d.seconds,
                             **common))
        for s in self.sharpness:
            name = s.kind if s.ascent_steps <= 1 else f"{s.kind}_ascent{s.ascent_steps}"
            rows.append(dict(quantity=f"sharpness_{name}", index=0, value=s.value, uncertainty=s.se,
                             uncertainty_kind="standard error" if s.se is not None else None, converged=None,
                             hvps=0, evaluations=s.evaluations + s.gradients, seconds=s.seconds, rho=s.rho,
                             **common))
        return rows


def measure_sharpness(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      options: SharpnessOptions | None = None, progress: Progress | None = None, *,
                      tokens_requested: int | None = None) -> SharpnessReport:
    """Curvature and sharpness of ``model`` on the evaluation set (x, y): (sequences, tokens) int64.

    Runs, as the options ask: the loss and gradient; extreme eigenvalues (Lanczos); the trace (each method in
    ``trace_methods``); the spectral density (SLQ, its first run continuing the eigenvalue run); SAM, ASAM and
    average-case sharpness; loss slices. The model is left exactly as it was (mode, dtype, weights).
    ``tokens_requested``: the token count the caller asked for, recorded with a note when x, y hold another.
    ``progress(stage, done, total)``: a stage that ends before its cap (Lanczos converged early) is reported
    once more with total = done, so a bar completes at what was done.
    """
    o = options or SharpnessOptions()
    t0 = time.perf_counter()
    last: dict[str, tuple[int, int]] = {}  # stage -> (done, total)

    def stage(name: str, total: int) -> Callback:
        last[name] = (0, total)
        if progress is not None:
            progress(name, 0, total)

        def cb(done: int) -> None:
            last[name] = (done, total)
            if progress is not None:
                progress(name, done, total)
        return cb

    def end(name: str) -> None:
        done, total = last[name]
        if progress is not None and 0 < done < total:
            progress(name, done, done)

    vectors = max(o.lanczos_steps, o.density_steps) + (o.trace_hvps if o.trace_methods else 0)
    budget = None if o.graph_memory is None else int(o.graph_memory * 2**30)
    with Objective(model, x, y, params=o.params, dtype=o.dtype, device=o.device, batch_size=o.batch_size,
                   graph_budget=budget, vectors=vectors, hvp=o.hvp) as obj:
        cb = stage("loss and gradient", 1)
        loss0, g = obj.gradient()
        cb(1)
        rep = SharpnessReport(o, obj.tokens, int(x.shape[0]), int(x.shape[1]), obj.n,
                              sum(p.numel() for p in obj.model.parameters()), list(obj.names), loss0,
                              float(g.norm()), batches=obj.n_batches, tokens_requested=tokens_requested)
        if tokens_requested is not None and tokens_requested != obj.tokens:
            rep.notes.append(tokens_note(tokens_requested, obj.tokens, int(x.shape[0]), int(x.shape[1])))
        rep.computed_in = str(obj.compute_dtype).removeprefix("torch.")
        if obj.compute_dtype != obj.dtype:
            rep.notes.append(f"the forward computes partly in {rep.computed_in} (--dtype {o.dtype}): error bounds "
                             f"use {rep.computed_in}'s rounding (eps {torch.finfo(obj.compute_dtype).eps:.3g})")
        fixed = [(n, p) for n, p in model.named_parameters() if getattr(p, "fixed", None)]
        if fixed:
            rep.notes.append(f"{sum(p.numel() for _, p in fixed):,} parameters in {len(fixed)} tensors left out "
                             f"({fixed[0][1].fixed}): {fixed[0][0]}{', ...' if len(fixed) > 1 else ''}")
        if o.top_k + o.bottom_k > 0 and o.lanczos_steps > 0:
            name = "eigenvalues (Lanczos)"
            rep.eigen = lanczos(obj, o.top_k, o.bottom_k, max_steps=o.lanczos_steps, tol=o.tol, seed=o.seed,
                                callback=stage(name, min(o.lanczos_steps, obj.n)))
            end(name)
        for method in o.trace_methods if o.trace_hvps > 0 else ():
            name = f"trace ({method})"
            rep.traces.append(TRACE_METHODS[method](obj, o.trace_hvps, seed=o.seed + 1,
                                                    callback=stage(name, o.trace_hvps)))
            end(name)
        if o.density_runs > 0 and o.density_steps > 0:
            reuse = [rep.eigen.state] if rep.eigen is not None and rep.eigen.state is not None else []
            total = o.density_runs * min(o.density_steps, obj.n) - sum(min(s.steps, o.density_steps) for s in reuse)
            rep.density = slq(obj, o.density_runs, o.density_steps, seed=o.seed + 2, sigma=o.density_sigma,
                              reuse=reuse, callback=stage("spectral density (SLQ)", max(total, 0)))
            end("spectral density (SLQ)")
        if rep.eigen is not None:
            rep.eigen.state = None  # release the basis
        rep.kept_graph_batches = obj._n_kept
        hv = obj.hvps
        base = (loss0, g)
        if o.sam_rho > 0:
            rep.sharpness.append(sam_sharpness(obj, o.sam_rho, 1, base=base, callback=stage("SAM", 1)))
            if o.ascent_steps > 1:
                rep.sharpness.append(sam_sharpness(obj, o.sam_rho, o.ascent_steps, base=base,
                                                   callback=stage("SAM ascent", o.ascent_steps + 1)))
        if o.asam_rho > 0:
            rep.sharpness.append(asam_sharpness(obj, o.asam_rho, o.asam_eta, 1, base=base, callback=stage("ASAM", 1)))
            if o.ascent_steps > 1:
                rep.sharpness.append(asam_sharpness(obj, o.asam_rho, o.asam_eta, o.ascent_steps, base=base,
                                                    callback=stage("ASAM ascent", o.ascent_steps + 1)))
        if o.avg_rho > 0 and o.avg_samples >= 2:
            rep.sharpness.append(average_sharpness(obj, o.avg_rho, o.avg_samples, seed=o.seed + 3, loss0=loss0,
                                                   callback=stage("average-case sharpness", o.avg_samples)))
        if o.landscape in ("1d", "both"):
            rep.slice_1d = loss_slice_1d(obj, o.slice_span, o.slice_points, seed=o.seed + 4,
                                         callback=stage("1-D loss slice", o.slice_points))
        if o.landscape in ("2d", "both"):
            rep.slice_2d = loss_slice_2d(obj, o.slice_span, o.slice_points_2d, seed=o.seed + 5,
                                         callback=stage("2-D loss slice", o.slice_points_2d ** 2))
        rep.hvps, rep.evaluations, rep.gradients = hv, obj.evaluations, obj.gradients
    rep.seconds = time.perf_counter() - t0
    return rep


# --------------------------------------------------------------------------------------------------------------
# per layer: `cemtool sharpness --per-layer`


@dataclass
class LayerCurvature:
    """λ_max and tr(H) of one layer's block H_SS of the Hessian (S = the parameters ``blocks.<layer>.*``)."""

    layer: int
    params: str  # the selection, layer:N
    n_params: int
    lambda_max: float | None
    lambda_max_error: float | None  # Kato-Temple error estimate (hessian.Eigenvalues)
    lambda_max_converged: bool | None
    lanczos_hvps: int
    trace: float | None
    trace_se: float | None  # standard error
    trace_per_param: float | None
    trace_per_param_se: float | None
    trace_method: str | None
    trace_hvps: int
    seconds: float


def model_layers(model: torch.nn.Module) -> list[int]:
    """The block indices N of the model's parameters ``blocks.N.*`` (what ``layer:N`` selects), ascending."""
    found = {int(m.group(1)) for n, _ in model.named_parameters() if (m := re.match(r"blocks\.(\d+)\.", n))}
    if not found:
        raise CemtoolError("the model has no layers (no parameters named blocks.N.*)")
    return sorted(found)


def check_per_layer(o: SharpnessOptions) -> None:
    """What --per-layer measures: λ_max (lanczos_steps HVPs) and one trace method (trace_hvps), one layer at a
    time; the other measurements of the options are not made."""
    if len(o.trace_methods) > 1:
        raise CemtoolError("--per-layer takes one --trace-method", hint="e.g. --trace-method xtrace")
    if o.lanczos_steps == 0 and (o.trace_hvps == 0 or not o.trace_methods):
        raise CemtoolError("--per-layer with --lanczos-steps 0 and --trace-hvps 0 has nothing to measure")


def measure_per_layer(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, options: SharpnessOptions,
                      progress: Progress | None = None) -> list[LayerCurvature]:
    """For each layer N, λ_max (Lanczos, top 1) and tr(H) (``options.trace_methods[0]``, with its standard error)
    of the Hessian restricted to ``layer:N`` (the block H_SS, see Objective), on the evaluation set (x, y). The same
    seeds for every layer; budgets ``lanczos_steps`` and ``trace_hvps`` per layer (0 skips)."""
    o = options
    check_per_layer(o)
    method = o.trace_methods[0] if o.trace_methods and o.trace_hvps > 0 else None
    budget = None if o.graph_memory is None else int(o.graph_memory * 2**30)
    out = []
    for layer in model_layers(model):
        t0 = time.perf_counter()
        sel = f"layer:{layer}"
        with Objective(model, x, y, params=sel, dtype=o.dtype, device=o.device, batch_size=o.batch_size,
                       graph_budget=budget, vectors=max(o.lanczos_steps, o.trace_hvps), hvp=o.hvp) as obj:
            eig = tr = None
            if o.lanczos_steps > 0:
                name, total = f"layer {layer}: λ_max (Lanczos)", min(o.lanczos_steps, obj.n)
                eig = lanczos(obj, 1, 0, max_steps=o.lanczos_steps, tol=o.tol, seed=o.seed,
                              callback=_stage_callback(progress, name, total))
                if progress is not None and eig.hvps < total:
                    progress(name, eig.hvps, eig.hvps)  # stopped early: the bar completes at what was done
            if method is not None:
                tr = TRACE_METHODS[method](obj, o.trace_hvps, seed=o.seed + 1,
                                           callback=_stage_callback(progress, f"layer {layer}: trace ({method})",
                                                                    o.trace_hvps))
            out.append(LayerCurvature(
                layer, sel, obj.n, eig.lambda_max if eig else None, eig.top_error[0] if eig else None,
                eig.top_converged[0] if eig else None, eig.hvps if eig else 0, tr.trace if tr else None,
                tr.se if tr else None, tr.per_param if tr else None, tr.per_param_se if tr else None, method,
                tr.hvps if tr else 0, time.perf_counter() - t0))
    return out


def _stage_callback(progress: Progress | None, name: str, total: int) -> Callback:
    if progress is not None:
        progress(name, 0, total)
    return lambda done: progress(name, done, total) if progress is not None else None


PER_LAYER_COLUMNS = ["layer", "n_params", "lambda_max", "lambda_max_error", "lambda_max_converged", "trace",
                     "trace_se", "trace_per_param", "trace_per_param_se", "trace_method", "lanczos_hvps",
                     "trace_hvps", "seconds"]


def write_per_layer_report(loaded, layers: list[LayerCurvature], options: SharpnessOptions, *, tokens: int,
                           name: str, seq_len: int, device: str) -> tuple[dict, dict]:
    """reports/<name>.json (provenance, options, one entry per layer), .csv and .md (the table)."""
    from cemtool.report import markdown_table, provenance, write_report
    from cemtool.runs import atomic_write_text

    rows = [{c: getattr(r, c) for c in PER_LAYER_COLUMNS} for r in layers]
    payload = {"provenance": provenance(loaded.run.path, seed=options.seed, checkpoint=loaded.checkpoint.name,
                                        step=loaded.step, analysis="sharpness_per_layer", backend="cemtool",
                                        arch=loaded.config.model.arch, tokens=tokens, device=device,
                                        seq_len=seq_len),
               "options": asdict(options), "tokens": tokens, "seq_len": seq_len,
               "layers": [asdict(r) for r in layers]}
    paths = write_report(loaded.run.reports, name, payload, rows)
    paths["md"] = loaded.run.reports / f"{name}.md"
    atomic_write_text(paths["md"], f"# Per-layer curvature ({tokens:,} tokens, seed {options.seed})\n\n"
                      + markdown_table(rows, PER_LAYER_COLUMNS))
    return payload, paths


def write_sharpness_report(loaded, rep: SharpnessReport, *, name: str = "sharpness", seq_len: int,
                           device: str, **extra) -> tuple[dict, dict]:
    """Write ``reports/<name>.json`` and ``.csv`` of a measured run with its provenance (run, checkpoint, step,
    seed, architecture, token count, device); ``extra`` adds provenance fields (e.g. command="sweep").
    Returns (payload, paths). The one place a sharpness report is assembled: command, sweep and demo call it."""
    from cemtool.report import provenance, write_report

    payload = {"provenance": provenance(loaded.run.path, seed=rep.options.seed, checkpoint=loaded.checkpoint.name,
                                        step=loaded.step, analysis="sharpness", backend="cemtool",
                                        arch=loaded.config.model.arch, tokens=rep.tokens, device=device,
                                        seq_len=seq_len, **extra),
               **rep.payload()}
    return payload, write_report(loaded.run.reports, name, payload, rep.rows())


__all__ = ["LayerCurvature", "Sharpness", "SharpnessOptions", "SharpnessReport", "Slice1D", "Slice2D",
           "asam_sharpness", "average_sharpness", "filter_normalized_direction", "loss_slice_1d", "loss_slice_2d",
           "measure_per_layer", "measure_sharpness", "sam_sharpness", "worst_case_sharpness"]
