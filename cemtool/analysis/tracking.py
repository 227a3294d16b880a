"""Curvature during training (METHODS §6; ``train.curvature_every``): λ_max of the loss Hessian, optionally the
preconditioned λ_max of Adam's update and a trace estimate, every N optimizer steps, against the stability thresholds.

The measurement reuses :mod:`cemtool.analysis.curvature`: the
:class:`~cemtool.analysis.curvature.operators.Hessian` of a fixed evaluation batch (the first validation windows,
as ``cemtool sharpness --tokens N`` takes them; eval mode, fp32, explicit attention), its Adam-preconditioned form
(:mod:`cemtool.analysis.curvature.preconditioned`), :func:`~cemtool.analysis.lanczos.lanczos` for λ_max and
:func:`~cemtool.analysis.trace.xtrace` for tr(H). What the tracker adds:

- a **warm start**: each Lanczos run starts from the previous top Ritz vector plus an equal-norm Rademacher vector
  (so that an eigenvalue that overtook the previous top is still in the Krylov space), drawn from a generator
  seeded by (seed, step) alone: the training RNG is never touched, and a resumed run, which restores the previous
  vector from its checkpoint (:meth:`CurvatureTracker.state`), measures exactly what the uninterrupted run did;
- **torchrun**: the Hessian shards the batch over the ranks and all-reduces every HVP, so every rank runs the
  same measurement (and holds the same warm start); rank 0 writes the row;
- the **preconditioned sharpness** λ_max(P^{-1} H) = λ_max(P^{-1/2} H P^{-1/2}) of Adam(W), with P the diagonal
  by which torch's AdamW divides its momentum buffer: P = (1 - β1^t)(sqrt(v_t / (1 - β2^t)) + eps) / lr_mult
  (both bias corrections and each group's learning-rate multiplier folded in, so that η P^{-1} is exactly the
  update's step per coordinate; decoupled weight decay left out). Its stability threshold is
  (2 + 2 β1) / ((1 - β1) η) (Cohen et al. 2022, "Adaptive gradient methods at the edge of stability",
  arXiv:2207.14484: 38/η at β1 = 0.9), beside 2/η for λ_max of plain gradient descent (Cohen et al. 2021).

Measurements are pure functions of the weights, the optimizer state and (seed, step, previous vector): they change
neither the weights, nor the optimizer state, nor any RNG.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from cemtool.analysis.curvature.operators import Hessian
from cemtool.analysis.curvature.preconditioned import Preconditioned, adam_preconditioner, lr_multipliers
from cemtool.analysis.curvature.risk import select_parameters
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.trace import xtrace
from cemtool.data.corpus import windows
from cemtool.distributed import shard
from cemtool.errors import CemtoolError
from cemtool.models.registry import get_arch

TOL = 1e-4  # relative eigenvalue error estimate at which λ_max counts as converged (as `cemtool sharpness`)
STATE_KEYS = ("curvature.v", "curvature.v_precond")  # warm-start vectors in a checkpoint (runs.save_checkpoint extra)


def check_params(model: nn.Module, spec: str) -> int:
    """The number of parameters a subset spec selects; a one-line error naming the spec if it matches nothing
    (works on a model built on the meta device: only names and shapes are read)."""
    try:
        chosen = select_parameters(model, spec)
    except CemtoolError as e:
        raise CemtoolError(f"train.curvature_params: {e.message}", hint=e.hint) from None
    return sum(p.numel() for _, p in chosen)


def threshold_gd(lr: float) -> float | None:
    """2/η: λ_max above it makes gradient descent at rate η unstable along the top eigenvector."""
    return 2.0 / lr if lr > 0 else None


def threshold_adam(lr: float, beta1: float) -> float | None:
    """(2 + 2 β1) / ((1 - β1) η): the stability threshold of the preconditioned sharpness of Adam (Cohen et al.
    2022; 38/η at β1 = 0.9)."""
    return (2.0 + 2.0 * beta1) / ((1.0 - beta1) * lr) if lr > 0 and beta1 < 1 else None


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass
class CurvatureTracker:
    """λ_max (and optionally P^{-1}H's λ_max and tr(H)) of the loss on a fixed batch (x, y): (S, T) int64.

    ``params``: the parameter subset (hessian.select_parameters); ``max_steps``: the Lanczos cap; ``trace_hvps``:
    XTrace's HVPs (0 = no trace); ``precond``: also the preconditioned sharpness of Adam; ``seed``: with the step,
    seeds every random vector. ``v``/``v_precond``: the previous top Ritz vectors (warm starts)."""

    x: torch.Tensor
    y: torch.Tensor
    params: str = "all"
    max_steps: int = 20
    trace_hvps: int = 0
    precond: bool = False
    seed: int = 0
    tol: float = TOL
    v: torch.Tensor | None = field(default=None, repr=False)
    v_precond: torch.Tensor | None = field(default=None, repr=False)

    def check(self, model: nn.Module) -> int:
        """Validate the subset against the model (one-line error); returns its parameter count."""
        return check_params(model, self.params)

    # -- warm start, stored in checkpoints ---------------------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """The warm-start vectors, for a checkpoint (restored by :meth:`load_state`)."""
        out = {}
        for key, v in zip(STATE_KEYS, (self.v, self.v_precond), strict=True):
            if v is not None:
                out[key] = v.detach().cpu()
        return out

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore the warm-start vectors from a checkpoint's tensors (``extra.`` prefix or not); none is fine."""
        def get(key: str) -> torch.Tensor | None:
            t = tensors.get(f"extra.{key}", tensors.get(key))
            return None if t is None else t.to(torch.float64)
        self.v, self.v_precond = get(STATE_KEYS[0]), get(STATE_KEYS[1])

    def _start(self, previous: torch.Tensor | None, n: int, gen: torch.Generator) -> torch.Tensor | None:
        """previous/|previous| + r/|r| with r Rademacher from ``gen``, or None (a cold start) without a usable
        previous vector (first measurement, another subset size, or non-finite)."""
        r = (torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(n)  # (n,) unit
        if previous is None or previous.numel() != n or not bool(torch.isfinite(previous).all()) \
                or float(previous.norm()) == 0:
            return r
        return previous.to(torch.float64).cpu() / previous.norm() + r  # (n,)

    # -- one measurement ----------------------------------------------------------------------------------------

    def measure(self, model: nn.Module, optimizer=None, *, step: int, lr: float, beta1: float = 0.9,
                optimizer_name: str = "adamw") -> dict:
        """One metrics row: λ_max (+ convergence, steps), tr(H) ± SE, λ_max(P^{-1}H), the learning rate η of
        the next update and the thresholds 2/η and (2 + 2 β1)/((1 - β1) η), and the seconds it took. Non-finite
        values are null. ``optimizer_name`` (train.optimizer): under muon 2/η is null, with a ``threshold_note``,
        since η (AdamW's base rate) does not set Muon's stability threshold. Where the measured parameters' groups
        take other multiples of η (``lr_mult``), also λ_max(M^{1/2} H M^{1/2}), the sharpness 2/η bounds for them
        (:meth:`_lr_scaled`). The model is left exactly as it was (weights, mode, requires_grad)."""
        t0 = time.perf_counter()
        seed = (int(self.seed) << 32) + int(step)  # < 2^64: seed < 2^32, step < 2^32
        row: dict = {"kind": "curvature", "step": step, "lr": lr, "threshold_2_over_lr": threshold_gd(lr),
                     "curvature_tokens": int(self.y.numel())}
        if optimizer_name == "muon":
            row.update(threshold_2_over_lr=None,
                       threshold_note="train.optimizer=muon: 2/η of AdamW's base rate is not Muon's stability "
                                      "threshold (the blocks' matrices take orthogonalized steps at train.muon_lr)")
        if self.precond:
            row["threshold_adaptive"] = threshold_adam(lr, beta1)
        named = select_parameters(model, self.params)
        if not all(bool(torch.isfinite(p).all()) for _, p in named):
            row.update(lambda_max=None, lambda_max_converged=False, lanczos_steps=0,
                       note="non-finite weights: nothing measured", curvature_seconds=time.perf_counter() - t0)
            return row
        with Hessian(model, self.x, self.y, params=self.params, dtype="fp32",
                       vectors=self.max_steps + self.trace_hvps) as obj:
            gen = torch.Generator().manual_seed(seed)
            eig = lanczos(obj, k_top=1, k_bottom=0, max_steps=self.max_steps, tol=self.tol, seed=seed,
                          v0=self._start(self.v, obj.n, gen), return_vectors=True)
            self.v = eig.vectors_top[:, 0].detach().cpu()
            row.update(lambda_max=_finite(eig.lambda_max), lambda_max_converged=bool(eig.top_converged[0]),
                       lambda_max_error=_finite(eig.top_error[0]), lanczos_steps=eig.steps, params_n=obj.n)
            if self.trace_hvps:
                tr = xtrace(obj, hvps=self.trace_hvps, seed=seed)
                row.update(trace=_finite(tr.trace), trace_se=_finite(tr.se), trace_hvps=tr.hvps)
            if self.precond:
                D, why = adam_preconditioner(optimizer, named) if optimizer is not None else (None, "no optimizer")
                if D is None:
                    row.update(lambda_max_precond=None, note=f"no preconditioned sharpness: {why}")
                else:
                    pe = lanczos(Preconditioned(obj, D), k_top=1, k_bottom=0, max_steps=self.max_steps,
                                 tol=self.tol, seed=seed, v0=self._start(self.v_precond, obj.n, gen),
                                 return_vectors=True)
                    self.v_precond = pe.vectors_top[:, 0].detach().cpu()
                    row.update(lambda_max_precond=_finite(pe.lambda_max),
                               lambda_max_precond_converged=bool(pe.top_converged[0]),
                               lanczos_steps_precond=pe.steps)
            if optimizer is not None and optimizer_name != "muon":
                self._lr_scaled(obj, optimizer, named, seed, row)
        row["curvature_seconds"] = time.perf_counter() - t0
        return row

    def _lr_scaled(self, obj, optimizer, named, seed: int, row: dict) -> None:
        """Where the measured parameters do not all take the schedule's rate (a group's lr_mult, e.g. LIMe's routers
        at 10x), the sharpness 2/η bounds: λ_max(M^{1/2} H M^{1/2}) with M the multipliers (cold-started from
        ``seed`` alone, so a resumed run measures it alike without a stored vector), and the distinct multipliers."""
        M, mults = lr_multipliers(optimizer, named)
        if M is None:
            return
        e = lanczos(Preconditioned(obj, M), k_top=1, k_bottom=0, max_steps=self.max_steps, tol=self.tol, seed=seed)
        row.update(lr_mults=mults, lambda_max_lr_scaled=_finite(e.lambda_max),
                   lambda_max_lr_scaled_converged=bool(e.top_converged[0]), lanczos_steps_lr_scaled=e.steps)


def tracker_for(cfg, corpus, model: nn.Module) -> CurvatureTracker:
    """The tracker a run config's ``train.curvature_*`` settings describe, on the first validation windows of
    ``corpus`` covering ``train.curvature_tokens`` (those ``cemtool sharpness --tokens N`` takes), its subset
    checked against ``model`` (a one-line error before any training step)."""
    t, T = cfg.train, cfg.data.seq_len
    x, y = windows(corpus.val, corpus.eval_windows(T, t.curvature_tokens), T)  # (S, T) each
    shard(len(x), f"curvature windows of {T} tokens (train.curvature_tokens={t.curvature_tokens})")  # K ranks: K+
    tracker = CurvatureTracker(x, y, params=t.curvature_params, max_steps=t.curvature_steps,
                               trace_hvps=t.curvature_trace, precond=t.curvature_precond, seed=cfg.seed)
    tracker.check(model)
    return tracker


def check_run_config(cfg) -> None:
    """At config time (before any run directory exists): the subset must match parameters of the configured
    model (built on the meta device, which allocates nothing), and under torchrun (WORLD_SIZE) every rank needs
    at least one window of the batch."""
    t = cfg.train
    if not t.curvature_every:
        return
    if t.curvature_tokens < cfg.data.seq_len:  # the batch is whole windows: fewer tokens would silently become one
        raise CemtoolError(f"train.curvature_tokens={t.curvature_tokens} is less than one window of "
                           f"data.seq_len={cfg.data.seq_len} tokens",
                           hint=f"set train.curvature_tokens to at least {cfg.data.seq_len} (whole windows are used)")
    world, windows = int(os.environ.get("WORLD_SIZE", "1")), t.curvature_tokens // cfg.data.seq_len
    if windows < world:
        raise CemtoolError(f"train.curvature_tokens={t.curvature_tokens} makes {windows} window(s) of "
                           f"data.seq_len={cfg.data.seq_len} tokens for {world} processes: every rank needs one",
                           hint=f"raise train.curvature_tokens to at least {world * cfg.data.seq_len}")
    with torch.device("meta"):
        model = get_arch(cfg.model.arch).build(cfg.model)
    check_params(model, cfg.train.curvature_params)


__all__ = ["CurvatureTracker", "Preconditioned", "adam_preconditioner", "check_params", "check_run_config",
           "threshold_adam", "threshold_gd", "tracker_for"]
