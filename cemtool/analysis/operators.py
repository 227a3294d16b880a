"""The operator protocol of the curvature estimators (METHODS §6), and an explicit matrix as an operator.

An *operator* is any object with ``n`` (its dimension), ``hvp(v) -> H v`` for a flat (n,) vector and ``device``;
where it has them, ``dtype`` and ``hvp_eps`` (the relative error level of one product) set the rounding term of the
Lanczos bounds. :class:`cemtool.analysis.hessian.Objective` is the operator of a language model;
:class:`DenseOperator` wraps an explicit symmetric matrix (for tests and for checking the estimators). The
estimators take any operator: :mod:`cemtool.analysis.lanczos`, :mod:`cemtool.analysis.trace` and
:mod:`cemtool.analysis.density`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Callback = Callable[[int], None]  # called with the number of units (HVPs, evaluations) done so far


class DenseOperator:
    """An explicit symmetric matrix as an operator (ground truth for tests)."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix.to(torch.float64)  # (n, n)
        self.n = matrix.shape[0]
        self.device = matrix.device
        self.dtype = torch.float64
        self.hvps = 0

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        self.hvps += 1
        return self.matrix @ v.to(torch.float64)  # (n,)
