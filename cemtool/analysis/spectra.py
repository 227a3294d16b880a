"""Spectral measures of a token-feature matrix (METHODS §5): matrix-based Rényi entropy of its Gram matrix,
effective rank (Roy & Vetterli 2007) and mean pairwise cosine similarity."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clean_spectrum(eigs: torch.Tensor) -> torch.Tensor:
    """Eigenvalues of a PSD matrix with rounding noise removed: negatives and those below m * eps * max (the
    numerical-rank threshold) set to 0. Orders alpha < 1 would otherwise count noise eigenvalues (~1e-16)."""
    eigs = eigs.double().clamp_min(0.0)
    tol = eigs.shape[-1] * torch.finfo(torch.float64).eps * eigs.amax(-1, keepdim=True)
    return torch.where(eigs > tol, eigs, torch.zeros_like(eigs))


def gram_eigenvalues(X: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (clamped >= 0) of the Gram matrix X Xᵀ of X (..., T, D), via the smaller of X Xᵀ and XᵀX (same
    nonzero spectrum); float64; (..., min(T, D))."""
    X = X.double()
    G = X @ X.transpose(-2, -1) if X.shape[-2] <= X.shape[-1] else X.transpose(-2, -1) @ X  # (..., m, m)
    return clean_spectrum(torch.linalg.eigvalsh(G))


def renyi_entropy(eigs: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Rényi entropy of p = eigs / sum(eigs) along the last axis; alpha == 1 is Shannon (nats)."""
    if alpha <= 0:
        raise ValueError("the Rényi order alpha must be > 0")
    eigs = clean_spectrum(eigs)
    p = eigs / eigs.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)  # (..., m)
    if abs(alpha - 1.0) < 1e-12:
        return torch.special.entr(p).sum(-1)  # -sum p log p, with 0 log 0 = 0
    return torch.log((p.pow(alpha) * (p > 0)).sum(-1)) / (1.0 - alpha)


def gram_entropy(K: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Matrix-based Rényi entropy of a positive semi-definite Gram matrix K (..., T, T)."""
    return renyi_entropy(torch.linalg.eigvalsh(K.double()), alpha)


def matrix_entropy(X: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Rényi entropy of the Gram matrix of X (..., T, D) (features already z-scored); (...,)."""
    return renyi_entropy(gram_eigenvalues(X), alpha)


def effective_rank_from_singular(s: torch.Tensor) -> torch.Tensor:
    """Roy & Vetterli's effective rank exp(H(s / sum s)) of singular values s (..., m)."""
    s = s.double().clamp_min(0.0)
    p = s / s.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.exp(torch.special.entr(p).sum(-1))


def effective_rank(X: torch.Tensor) -> torch.Tensor:
    """Effective rank of each matrix X (..., T, D)."""
    return effective_rank_from_singular(gram_eigenvalues(X).sqrt())


def mean_pairwise_cosine(X: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over ordered pairs i != j of the rows of X (..., T, D); (...,)."""
    U = F.normalize(X.double(), dim=-1)  # (..., T, D)
    T = U.shape[-2]
    if T < 2:
        return torch.full(U.shape[:-2], float("nan"), dtype=torch.float64)
    total = (U.sum(-2) ** 2).sum(-1)  # (...,) = sum_ij cos_ij
    diag = (U * U).sum((-2, -1))  # (...,) = T (0 for zero rows)
    return (total - diag) / (T * (T - 1))


#


__all__ = ["clean_spectrum", "effective_rank", "effective_rank_from_singular", "gram_eigenvalues", "gram_entropy",
           "matrix_entropy", "mean_pairwise_cosine", "renyi_entropy"]
