"""The curvature operators of a language model and their registry (METHODS §6; docs/sharpness.md "Operators").

Every operator is the curvature of the same empirical risk, the token-mean cross entropy
L(w) = (1/N) Σ_t ℓ_t(w) over a fixed evaluation set of N tokens, restricted to a parameter subset w (n
parameters). :class:`~cemtool.analysis.hessian.Objective` holds what they share (evaluation batches,
token-weighted sums, the all-reduce under torchrun, the parameter subset, the dtype copy, the graph budget) and is
the Hessian operator; the others are its subclasses and replace only the product ``matvec``:

- ``hessian``: H = ∇²L, exact double backward or the central difference of two gradients (``hvp``);
- ``ggn``: the generalised Gauss-Newton G = (1/N) Σ_t J_tᵀ (diag p_t − p_t p_tᵀ) J_t, with J_t the Jacobian of
  token t's logits and p_t its softmax: the Hessian with the model's second derivatives dropped, positive
  semi-definite; for softmax cross entropy it is also the Fisher of the model's predictive distribution;
- ``ef``: the empirical Fisher (1/N) Σ_t g_t g_tᵀ, g_t = ∇ℓ_t the gradient of token t's loss at its observed
  label [decision: per token, not per sequence: the token is the unit the risk averages over];
- ``fisher``: the Monte-Carlo Fisher (1/(N S)) Σ_s Σ_t ĝ_ts ĝ_tsᵀ, ĝ_ts the gradient of token t's loss at a
  label ŷ_ts sampled from the model's p_t (S = ``mc_samples`` draws per token, seeded per (seed, sequence), so
  that K processes draw what one does); its expectation over the draws is G.

The three Jacobian operators compute A = M_f J_f products for an output f of the model (the logits, or the
per-token losses) without forming J: J v is the derivative in u of the vector-Jacobian product Jᵀu (reverse over
reverse), then Jᵀ (M J v) is one more backward pass.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from cemtool.analysis.curvature import OPERATOR_NAMES, SYMBOLS
from cemtool.analysis.hessian import Objective
from cemtool.distributed import all_reduce_sum
from cemtool.errors import CemtoolError
from cemtool.models.lm import lm_loss


def draw_seed(seed: int, sequence: int) -> int:
    """The seed of one sequence's label draws: 32 bits of a hash of (seed, global sequence index) (torch's CPU
    generator keeps only 32 bits of a seed, so seed * 2^32 + index would repeat the draws of every seed)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{sequence}".encode(), digest_size=4).digest(), "little")


class JacobianOperator(Objective, ABC):
    """Jᵀ M J for the Jacobian J of a per-token output f of the model (subclasses: :meth:`outputs`, :meth:`middle`)
    and the token-mean cross entropy of the evaluation set."""

    name = "jacobian"

    def __init__(self, model, x, y, **kw):
        if kw.get("hvp", "exact") != "exact":
            raise CemtoolError(f"--hvp {kw['hvp']} is a Hessian product; the {self.name} operator has its own",
                               hint="drop --hvp, or use --operator hessian")
        if kw.get("loss_fn", lm_loss) is not lm_loss:
            raise CemtoolError(f"the {self.name} operator is defined for the next-token cross entropy only")
        super().__init__(model, x, y, **kw)

    @abstractmethod
    def outputs(self, b: int, logits: torch.Tensor) -> torch.Tensor:
        """The output f of batch b whose Jacobian the operator uses."""

    @abstractmethod
    def middle(self, b: int, f: torch.Tensor, jv: torch.Tensor) -> torch.Tensor:
        """M (J v) for batch b, already divided by the token count N (and the draws S)."""

    def _logits(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        xb, yb = (t.to(self.device) for t in self.batches[b])
        logits = self.model(xb)  # (B, T, V)
        return logits.to(self.dtype), yb

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """Jᵀ M J v for a flat (n,) vector, flat (n,) float64, summed over the batches and the ranks."""
        vs = self.split(v)
        out = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        with self._context(grad=True):
            for b in range(len(self.batches)):
                f = self.outputs(b, self._logits(b)[0])
                u = torch.zeros_like(f, requires_grad=True)  # J^T u is linear in u: d/du (J^T u . v) = J v
                jtu = torch.autograd.grad(f, self.params, u, create_graph=True, allow_unused=True)
                live = [i for i, g in enumerate(jtu) if g is not None and g.requires_grad]
                if not live:
                    continue
                jv, = torch.autograd.grad([jtu[i] for i in live], u, [vs[i] for i in live], retain_graph=True)
                w = self.middle(b, f.detach(), jv.detach())  # (shape of f)
                out += self.flat(list(torch.autograd.grad(f, self.params, w, allow_unused=True)))
        self.hvps += 1
        return all_reduce_sum(out)


class GGN(JacobianOperator):
    """The generalised Gauss-Newton of the token-mean cross entropy over the logits (PSD)."""

    name = "ggn"

    def outputs(self, b, logits):
        return logits  # (B, T, V)

    def middle(self, b, f, jv):
        p = torch.softmax(f, dim=-1)  # (B, T, V)
        return (p * jv - p * (p * jv).sum(-1, keepdim=True)) / self.tokens  # (diag p - p p^T) J v / N


class EmpiricalFisher(JacobianOperator):
    """The empirical Fisher: the token mean of g_t g_tᵀ at the observed labels."""

    name = "ef"

    def outputs(self, b, logits):
        yb = self.batches[b][1].to(self.device)
        return F.cross_entropy(logits.flatten(0, 1), yb.reshape(-1), reduction="none")  # (B*T,) per-token losses

    def middle(self, b, f, jv):
        return jv / self.tokens  # (B*T,)


class MCFisher(JacobianOperator):
    """The Monte-Carlo Fisher: g gᵀ at labels sampled from the model, ``mc_samples`` draws per token, seeded."""

    name = "fisher"

    def __init__(self, model, x, y, *, mc_samples: int = 1, seed: int = 0, **kw):
        if not (isinstance(mc_samples, int) and mc_samples >= 1):
            raise CemtoolError(f"mc_samples must be an integer >= 1, got {mc_samples!r}")
        super().__init__(model, x, y, **kw)
        self.mc_samples, self.seed = mc_samples, seed
        self.labels = [self._draw(b) for b in range(len(self.batches))]  # (B, T, S) int64 per batch, fixed

    @torch.no_grad()
    def _draw(self, b: int) -> torch.Tensor:
        """Labels ŷ ~ p_t for batch b: for each sequence, S uniform draws from a generator of (seed, its global
        index) pushed through the inverse CDF of each token's p_t (float64, on the CPU)."""
        with self._context(grad=False):
            p = torch.softmax(self._logits(b)[0].to(torch.float64), dim=-1).cpu()  # (B, T, V)
        cdf = p.cumsum(-1)  # (B, T, V)
        start = self.first_sequence + sum(len(xb) for xb, _ in self.batches[:b])
        out = []
        for i in range(p.shape[0]):
            gen = torch.Generator().manual_seed(draw_seed(self.seed, start + i))
            u = torch.rand(p.shape[1], self.mc_samples, generator=gen, dtype=torch.float64)  # (T, S)
            u = u * cdf[i, :, -1:]  # the CDF's own total (1 up to rounding)
            out.append(torch.searchsorted(cdf[i].contiguous(), u).clamp_(max=p.shape[-1] - 1))  # (T, S)
        return torch.stack(out).to(self.device)  # (B, T, S)

    def outputs(self, b, logits):
        logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
        return -logp.gather(-1, self.labels[b])  # (B, T, S) losses at the sampled labels

    def middle(self, b, f, jv):
        return jv / (self.tokens * self.mc_samples)  # (B, T, S)


OPERATORS: dict[str, type[Objective]] = {"hessian": Objective, "ggn": GGN, "ef": EmpiricalFisher, "fisher": MCFisher}
PSD = {"ggn", "ef", "fisher"}  # positive semi-definite by construction
assert OPERATORS.keys() == OPERATOR_NAMES.keys() == SYMBOLS.keys()  # one list of operators


def check_operator(name: str) -> None:
    if name not in OPERATORS:
        raise CemtoolError(f"unknown curvature operator {name!r}", hint=f"use {', '.join(OPERATORS)}")


def make_operator(name: str, model, x, y, *, mc_samples: int = 1, seed: int = 0, **kw) -> Objective:
    """The operator ``name`` of ``model`` on the evaluation set (x, y) (keywords: those of Objective; the
    Monte-Carlo Fisher also takes ``mc_samples`` and ``seed``)."""
    check_operator(name)
    if name == "fisher":
        return MCFisher(model, x, y, mc_samples=mc_samples, seed=seed, **kw)
    return OPERATORS[name](model, x, y, **kw)


__all__ = ["GGN", "OPERATORS", "PSD", "EmpiricalFisher", "JacobianOperator", "MCFisher", "check_operator",
           "make_operator"]
