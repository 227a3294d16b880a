"""The operator protocol of the curvature estimators (METHODS §6), and an explicit matrix as an operator.

An *operator* is a symmetric linear map on flat parameter vectors: any object with ``n`` (its dimension, also
``size``), ``matvec(v) -> A v`` for a flat (n,) vector and ``device``; where it has them, ``dtype`` and ``hvp_eps``
(the relative error level of one product) set the rounding term of the Lanczos bounds, and ``matmat(V) -> A V``
multiplies the columns of an (n, k) block at once. The operators of a language model (the Hessian, the GGN, the
empirical and the Monte-Carlo Fisher) are in :mod:`cemtool.analysis.curvature.operators`; :class:`DenseOperator`
wraps an explicit symmetric matrix (ground truth for tests, and a check of the estimators), and
:func:`as_operator` accepts a dense tensor wherever an operator is asked for (the curvlinops shape). The
estimators take any operator: :mod:`cemtool.analysis.lanczos`, :mod:`cemtool.analysis.trace` and
:mod:`cemtool.analysis.density`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

Callback = Callable[[int], None]  # called with the number of units (products, evaluations) done so far


@runtime_checkable
class Operator(Protocol):
    """What every estimator asks of an operator: its dimension n, its device and A v for a flat (n,) vector."""

    n: int
    device: torch.device

    def matvec(self, v: torch.Tensor) -> torch.Tensor:  # (n,) -> (n,) float64
        ...


def matmat(op: Operator, V: torch.Tensor) -> torch.Tensor:
    """A V for an (n, k) block: the operator's own ``matmat`` where it has one, else one ``matvec`` per column."""
    own = getattr(op, "matmat", None)  # optional part of the protocol: an operator may multiply blocks at once
    if own is not None:
        return own(V)
    return torch.stack([op.matvec(V[:, j]) for j in range(V.shape[1])], dim=1)  # (n, k)


class DenseOperator:
    """An explicit symmetric matrix as an operator (ground truth for tests)."""

    def __init__(self, matrix: torch.Tensor):
        if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
            raise ValueError(f"an operator's matrix must be square, got {tuple(matrix.shape)}")
        self.matrix = matrix.to(torch.float64)  # (n, n)
        self.n = self.size = matrix.shape[0]
        self.device = matrix.device
        self.dtype = torch.float64
        self.hvps = 0  # products so far

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self.hvps += 1
        return self.matrix @ v.to(torch.float64)  # (n,)

    def matmat(self, V: torch.Tensor) -> torch.Tensor:
        self.hvps += V.shape[1]
        return self.matrix @ V.to(torch.float64)  # (n, k)


def as_operator(op) -> Operator:
    """An operator as it is, or a dense symmetric (n, n) tensor wrapped as one."""
    return DenseOperator(op) if isinstance(op, torch.Tensor) else op
