"""The Adam-preconditioned operator (METHODS §6; docs/train.md "curvature tracking"): the curvature of the step Adam
takes, D^{1/2} A D^{1/2} for the operator A of :mod:`cemtool.analysis.curvature.operators` and the diagonal
D = P^{-1} that AdamW divides its momentum by; its λ_max is the preconditioned sharpness λ_max(P^{-1} A) whose
stability threshold is (2 + 2 β1) / ((1 - β1) η) (Cohen et al. 2022)."""

from __future__ import annotations

import torch
from torch import nn


def adam_preconditioner(optimizer, named: list[tuple[str, nn.Parameter]]) -> tuple[torch.Tensor | None, str | None]:
    """D = P^{-1} flat (n,) float64 over the parameters ``named`` (in order): lr_mult / ((1 - β1^t)(sqrt(v_t /
    (1 - β2^t)) + eps)), from the AdamW state; 0 for a parameter no group holds (frozen: it takes no step, as in
    :func:`lr_multipliers`). (None, why) when a trained parameter has no Adam state (before the first step, or a
    parameter trained by another optimizer)."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    parts = []
    for name, p in named:
        g, st = groups.get(id(p)), optimizer.state.get(p, {})
        if g is None:
            parts.append(torch.zeros(p.numel(), dtype=torch.float64, device=p.device))  # (numel,)
            continue
        if "betas" not in g or "exp_avg_sq" not in st:
            return None, f"{name} has no Adam state" + (" yet" if g is not None and "betas" in g else "")
        b1, b2 = g["betas"]
        t = float(st["step"])
        v_hat = st["exp_avg_sq"].detach().to(torch.float64) / (1 - b2**t)
        P = (1 - b1**t) * (v_hat.sqrt() + g["eps"])  # what AdamW divides its momentum buffer by
        parts.append((g.get("lr_mult", 1.0) / P).reshape(-1))
    return torch.cat(parts), None  # (n,)


def lr_multipliers(optimizer, named: list[tuple[str, nn.Parameter]]) -> tuple[torch.Tensor | None, list[float]]:
    """M flat (n,) float64 over the parameters ``named`` (in order): each one's group ``lr_mult``, the rate of its
    update over the schedule's η (0 for a parameter no group holds: it takes no step), and the distinct multipliers
    in increasing order. (None, [1.0]) when every multiplier is 1: then gradient descent's stability threshold for
    λ_max of the Hessian itself is 2/η. Otherwise, on the quadratic model, gradient descent with per-group rates
    η M oscillates out along a direction of positive curvature iff λ_max(M^{1/2} H M^{1/2}) > 2/η (I - η M H is
    similar to I - η M^{1/2} H M^{1/2}; the same algebra as Adam's preconditioner, with M for P^{-1}; a direction
    of negative curvature grows at any η, as for 2/η itself)."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    mults = [float(groups[id(p)].get("lr_mult", 1.0)) if id(p) in groups else 0.0 for _, p in named]
    distinct = sorted(set(mults))
    if distinct == [1.0]:
        return None, distinct
    return torch.cat([torch.full((p.numel(),), m, dtype=torch.float64) for m, (_, p) in zip(mults, named,
                                                                                          strict=True)]), distinct


class Preconditioned:
    """The operator D^{1/2} H D^{1/2} (symmetric, same eigenvalues as D H) for a positive diagonal D, flat (n,)."""

    def __init__(self, op, D: torch.Tensor):
        self.op, self.n, self.device, self.dtype = op, op.n, op.device, op.dtype
        self.half = D.to(device=op.device, dtype=torch.float64).sqrt()  # (n,)

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        return self.half * self.op.matvec(self.half * v.to(torch.float64))  # (n,)


__all__ = ["Preconditioned", "adam_preconditioner", "lr_multipliers"]
