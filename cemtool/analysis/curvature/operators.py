"""The curvature operators of a language model and their registry (METHODS §6; docs/sharpness.md "Operators").

Every operator is the curvature of the same empirical risk, the token-mean cross entropy
L(w) = (1/N) Σ_t ℓ_t(w) over a fixed evaluation set of N tokens, restricted to a parameter subset w (n
parameters). :class:`~cemtool.analysis.curvature.risk.EmpiricalRisk` holds what they share (evaluation
batches, token-weighted sums, the all-reduce under torchrun, the parameter subset, the dtype copy, the memory
check, L and ∇L); each operator is its subclass and adds only its product ``matvec``:

- ``hessian``: H = ∇²L, exact double backward or the central difference of two gradients (``hvp``), with the
  first-order graphs kept for reuse within a memory budget;
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

from cemtool.analysis.curvature import CARDS, OperatorCard, card, check_operator_options
from cemtool.analysis.curvature.risk import EmpiricalRisk, resolve_dtype
from cemtool.distributed import all_reduce_sum
from cemtool.errors import CemtoolError
from cemtool.memory import available_memory  # the one memory probe (cgroup limit included)
from cemtool.models.lm import lm_loss


def draw_seed(seed: int, sequence: int) -> int:
    """The seed of one sequence's label draws: 32 bits of a hash of (seed, global sequence index) (torch's CPU
    generator keeps only 32 bits of a seed, so seed * 2^32 + index would repeat the draws of every seed)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{sequence}".encode(), digest_size=4).digest(), "little")


class Operator(EmpiricalRisk, ABC):
    """A curvature operator of the empirical risk: the risk's batches, subset and dtype plus a product
    :meth:`matvec` (cemtool.analysis.curvature.protocol). ``card`` says what it is by name (cemtool.analysis.curvature);
    ``takes``: the keyword options of its constructor beyond EmpiricalRisk's (make_operator passes only these)."""

    card: OperatorCard
    takes: tuple[str, ...] = ()

    @property
    def psd(self) -> bool:
        return self.card.psd

    @abstractmethod
    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """A v for a flat (n,) vector, flat (n,) float64, summed over the batches and the ranks."""


class Hessian(Operator):
    """The Hessian H = ∇²L of the empirical risk (indefinite away from a minimum).

    ``hvp``: how H v is computed [decision: measured, docs/performance.md]. 'exact' (default): reverse over reverse,
    the gradient of (grad L . v), exact to rounding. 'fd': the central difference of two exact gradients,
    (grad L(w + h v) - grad L(w - h v)) / 2h with h = FD_STEP / |v| — a gradient's memory (no second-order graph)
    and two gradients' time, with an error of order h^2 |v|^2 (third derivatives) plus rounding u / h; float64
    only, where it is about 1e-9 relative (in float32 the shifted weights would keep only ~3 digits of h v).

    ``keep_graph``: keep each batch's first-order gradient graph (``create_graph=True``) and differentiate it
    again for every HVP ('auto': as many batches as fit in ``graph_budget`` bytes, default a quarter of the free
    memory; True: all; False: none). Kept graphs are the only memory that grows with N (up to that budget).
    """

    card = CARDS["hessian"]
    takes = ("hvp", "keep_graph", "graph_budget")

    def __init__(self, model, x, y, *, hvp: str = "exact", keep_graph: bool | str = "auto",
                 graph_budget: int | None = None, **kw):
        check_hvp_method(hvp, resolve_dtype(kw.get("dtype", "fp64")))
        if graph_budget is not None and graph_budget < 0:
            raise CemtoolError(f"the kept-graph memory budget must be >= 0 bytes, got {graph_budget}")
        super().__init__(model, x, y, **kw)
        self.hvp_method = hvp
        if hvp == "fd":  # its truncation scale (h |v|)^2 ~ 4e-11 (measured errors 6e-11 to 8e-11, times the
            self.hvp_eps = max(self.hvp_eps, FD_STEP ** 2)  # bound's max(sqrt(n), 10) factor: conservative)
        self.keep_graph, self.graph_budget = keep_graph, graph_budget
        self._graphs: list[list[torch.Tensor | None]] | None = None  # kept first-order graphs (None: not planned)

    def close(self) -> None:
        """Drop kept graphs, then restore the model (EmpiricalRisk.close)."""
        self._graphs = None
        super().close()

    def _shift_started(self) -> None:
        self._graphs = None  # kept graphs belong to the old weights

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """The operator's product (cemtool.analysis.curvature.protocol): H v."""
        return self.hvp(v)

    def _first_order_graph(self, b: int) -> list[torch.Tensor | None]:
        loss = self._batch_loss(b)
        return list(torch.autograd.grad(loss, self.params, create_graph=True, allow_unused=True))

    def _plan_graphs(self) -> int:
        """How many batches keep their gradient graph (measured on the first batch)."""
        if self.keep_graph is False:
            return 0
        if self.keep_graph is True:
            return len(self.batches)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except RuntimeError:  # tensors without storage (e.g. wrapped subclasses)
                pass
            return t

        with self._context(grad=True), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            graph = self._first_order_graph(0)
        per_batch = 2 * sum(seen.values()) + 8 * self.n  # x2: the double-backward graph
        budget = self.graph_budget
        if budget is None:
            budget = 0.25 * (available_memory(self.device) or 4 * 2**30)  # unknown: assume 4 GiB free
        keep = min(len(self.batches), int(budget // max(per_batch, 1)))
        self._graphs = [graph] if keep else []
        return keep

    def _graph(self, b: int) -> tuple[list[torch.Tensor | None], bool]:
        """The first-order gradient graph of batch b and whether it is kept for reuse."""
        if self._graphs is None:
            self.kept_graph_batches = self._plan_graphs()
            self._graphs = self._graphs or []
        if b < self.kept_graph_batches:
            if b >= len(self._graphs):
                self._graphs.append(self._first_order_graph(b))
            return self._graphs[b], True
        return self._first_order_graph(b), False

    def hvp(self, v: torch.Tensor) -> torch.Tensor:
        """H v for a flat (n,) vector, returned flat (n,) float64 (H of the parameter subset only)."""
        if self.hvp_method == "fd":
            return self._hvp_central_difference(v)
        vs = self.split(v)
        out = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        with self._context(grad=True):
            for b in range(len(self.batches)):
                grads, kept = self._graph(b)
                live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
                if not live:
                    continue
                hv = torch.autograd.grad([grads[i] for i in live], self.params, [vs[i] for i in live],
                                         retain_graph=kept, allow_unused=True)
                out += self.flat(list(hv))
        self.hvps += 1
        return all_reduce_sum(out)

    def _hvp_central_difference(self, v: torch.Tensor) -> torch.Tensor:
        """(grad L(w + h v) - grad L(w - h v)) / 2h, h = FD_STEP / |v|: no second-order graph is ever built."""
        norm = float(v.norm())
        if norm == 0.0:
            self.hvps += 1
            return torch.zeros(self.n, dtype=torch.float64, device=self.device)
        h = FD_STEP / norm
        grads = []
        for sign in (1.0, -1.0):
            with self.shifted(sign * h * v):
                grads.append(self._gradient()[1])  # (n,) float64, summed over the ranks: part of one HVP
        self.hvps += 1
        return (grads[0] - grads[1]) / (2.0 * h)


class JacobianOperator(Operator):
    """Jᵀ M J for the Jacobian J of a per-token output f of the model (subclasses: :meth:`outputs`, :meth:`middle`)
    and the token-mean cross entropy of the evaluation set. A Jacobian product keeps no graph between products."""

    def __init__(self, model, x, y, **kw):
        if kw.get("loss_fn", lm_loss) is not lm_loss:
            raise CemtoolError(f"the {self.card.name} operator is defined for the next-token cross entropy only")
        super().__init__(model, x, y, **kw)

    @abstractmethod
    def outputs(self, b: int, logits: torch.Tensor) -> torch.Tensor:
        """The output f of batch b whose Jacobian the operator uses."""

    @abstractmethod
    def middle(self, b: int, f: torch.Tensor, jv: torch.Tensor) -> torch.Tensor:
        """M (J v) for batch b, already divided by the token count N (and the draws S)."""

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

    card = CARDS["ggn"]

    def outputs(self, b, logits):
        return logits  # (B, T, V)

    def middle(self, b, f, jv):
        p = torch.softmax(f, dim=-1)  # (B, T, V)
        return (p * jv - p * (p * jv).sum(-1, keepdim=True)) / self.tokens  # (diag p - p p^T) J v / N


class EmpiricalFisher(JacobianOperator):
    """The empirical Fisher: the token mean of g_t g_tᵀ at the observed labels."""

    card = CARDS["ef"]

    def outputs(self, b, logits):
        yb = self.batches[b][1].to(self.device)
        return F.cross_entropy(logits.flatten(0, 1), yb.reshape(-1), reduction="none")  # (B*T,) per-token losses

    def middle(self, b, f, jv):
        return jv / self.tokens  # (B*T,)


class MCFisher(JacobianOperator):
    """The Monte-Carlo Fisher: g gᵀ at labels sampled from the model, ``mc_samples`` draws per token, seeded."""

    card = CARDS["fisher"]
    takes = ("mc_samples", "seed")

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


HVP_METHODS = ("exact", "fd")
FD_STEP = float(torch.finfo(torch.float64).eps) ** (1 / 3)  # |h v| of the central difference: ~6e-6


def check_hvp_method(method: str, dtype: torch.dtype) -> None:
    """An HVP method by name; 'fd' needs float64."""
    if method not in HVP_METHODS:
        raise CemtoolError(f"unknown HVP method {method!r}", hint=f"use {' or '.join(HVP_METHODS)}")
    if method == "fd" and dtype != torch.float64:
        raise CemtoolError("the central-difference HVP (--hvp fd) needs --dtype fp64: in fp32 the shifted weights "
                           "keep only about 3 digits of the step", hint="add --dtype fp64, or use --hvp exact")


OPERATORS: dict[str, type[Operator]] = {}  # the registry: name -> class (its card: CARDS[name])


def register_operator(cls: type[Operator]) -> type[Operator]:
    """Register an operator class under its card's name (its card joins CARDS, so the CLI, reports, compare and
    plots know it); usable as a class decorator. Re-registering a name replaces it."""
    if not (isinstance(cls, type) and issubclass(cls, Operator) and isinstance(getattr(cls, "card", None),
                                                                          OperatorCard)):
        raise CemtoolError(f"{cls!r} is not an Operator subclass with a card")
    CARDS[cls.card.name] = cls.card
    OPERATORS[cls.card.name] = cls
    return cls


for _cls in (Hessian, GGN, EmpiricalFisher, MCFisher):
    register_operator(_cls)


def check_operator(name: str) -> None:
    card(name)
    if name not in OPERATORS:  # a card without a class: a report of an operator this install does not have
        raise CemtoolError(f"the {name} operator is not available here", hint=f"use {', '.join(OPERATORS)}")


# options every operator is given by make_operator's callers that only some use: dropped for the others (they
# change resources or draws, not what is computed); a semantic option (CARDS' options) is refused instead
RESOURCE_HINTS = ("keep_graph", "graph_budget", "seed")


def make_operator(name: str, model, x, y, **kw) -> Operator:
    """The operator ``name`` of ``model`` on the evaluation set (x, y). Keywords: EmpiricalRisk's, and each
    operator's own (``takes``: the Hessian's ``hvp``, ``keep_graph``, ``graph_budget``; the Monte-Carlo Fisher's
    ``mc_samples``, ``seed``). Another operator's resource hints are dropped; its semantic options at a value other
    than their default are refused (cemtool.analysis.curvature.check_operator_options)."""
    check_operator(name)
    cls = OPERATORS[name]
    foreign = {k: v for k, v in kw.items() if k not in cls.takes and any(k in c.takes for c in OPERATORS.values())}
    check_operator_options(name, **{k: v for k, v in foreign.items() if k not in RESOURCE_HINTS})
    return cls(model, x, y, **{k: v for k, v in kw.items() if k not in foreign})


__all__ = ["FD_STEP", "GGN", "HVP_METHODS", "OPERATORS", "RESOURCE_HINTS", "EmpiricalFisher", "Hessian",
           "JacobianOperator", "MCFisher", "Operator", "check_hvp_method", "check_operator", "make_operator",
           "register_operator"]
