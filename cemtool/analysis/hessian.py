"""Curvature of the loss (METHODS §6): Hessian-vector products, Lanczos, Hutchinson/Hutch++ and SLQ.

Everything here works on an *operator*: an object with ``n`` (its dimension), ``hvp(v) -> H v`` and ``device``.
:class:`Objective` is the operator of a language model: the mean next-token loss over a fixed evaluation set of
N tokens, as a function of a subset of the parameters. :class:`DenseOperator` wraps an explicit symmetric matrix
(for tests and for checking the estimators). The estimators are pure functions returning dataclasses:

- :func:`lanczos`  extreme eigenvalues at both ends, with Ritz residuals, error estimates and converged flags,
- :func:`hutchinson`, :func:`hutch_plus_plus`, :func:`xtrace`  tr(H) with a standard error, and tr(H)/n,
- :func:`slq`  the spectral density by stochastic Lanczos quadrature, Gaussian-smoothed with a reported sigma.

Notation: n = parameters in the subset, N = evaluation tokens, k = requested eigenvalues, m = Lanczos steps.
The Lanczos recurrences (alpha, beta) and the basis are float64 whatever the HVP dtype.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from cemtool.distributed import all_reduce_sum, shard
from cemtool.errors import CemtoolError
from cemtool.memory import available_memory  # the one memory probe and curvature check (cgroup limit included)
from cemtool.memory import check_curvature_memory as check_memory
from cemtool.models.capabilities import Capabilities
from cemtool.models.layers import attention_impl
from cemtool.models.lm import lm_loss

Callback = Callable[[int], None]  # called with the number of units (HVPs, evaluations) done so far

DTYPES = {"fp64": torch.float64, "float64": torch.float64, "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float64):
            raise CemtoolError(f"curvature needs fp32 or fp64, not {dtype}")
        return dtype
    if dtype not in DTYPES:
        raise CemtoolError(f"unknown dtype {dtype!r}", hint="use fp64 or fp32")
    return DTYPES[dtype]


# --------------------------------------------------------------------------------------------------------------
# parameter subsets

_ATTN_WORDS = {"attn", "attention"}
_MLP_WORDS = {"mlp", "ffn"}
_EMBED_WORDS = {"emb", "embed", "embedding", "head"}


def _has_word(name: str, words: set[str]) -> bool:
    """Does a dotted name have a component, or an '_'-separated word of one, in ``words``?"""
    return any(w in words for part in name.split(".") for w in part.split("_"))


def select_parameters(model: nn.Module, spec: str = "all") -> list[tuple[str, nn.Parameter]]:
    """The parameters a curvature measurement is restricted to (shared tensors once, in model order).

    ``spec`` is a comma-separated union of: ``all``; ``layer:N`` (``blocks.N.*``); ``attn`` / ``mlp`` /
    ``embed`` (every parameter with that word in its dotted name: ``blocks.N.attn.*``, ``ln_attn``,
    ``attn_step``...; ``tok_emb``, ``head``...); or a glob on the names (``blocks.*.mlp.up.weight``), or on the
    model's own names where it has others (``model.parameter_aliases()``: a Hugging Face model's
    ``model.layers.3.mlp.*``, cemtool.subject.hf).
    """
    declared = model if isinstance(model, Capabilities) else None  # any module; a cemtool or HF model says more
    fixed = declared.fixed_parameters() if declared else {}  # coordinates of the model (an export's added zeros)
    named = [(n, p) for n, p in model.named_parameters() if n not in fixed]  # shared parameters appear once
    aliases = declared.parameter_aliases() if declared else {}
    chosen: set[str] = set()
    for part in [s.strip() for s in spec.split(",") if s.strip()] or [""]:
        if part == "all":
            hit = {n for n, _ in named}
        elif part.startswith("layer:"):
            idx = part[len("layer:"):]
            if not idx.isdigit():
                raise CemtoolError(f"bad parameter selection {part!r}", hint="use layer:N with N an integer")
            hit = {n for n, _ in named if n.startswith(f"blocks.{int(idx)}.")}
            if not hit:
                layers = sorted({int(m.group(1)) for n, _ in named if (m := re.match(r"blocks\.(\d+)\.", n))})
                raise CemtoolError(f"parameter selection {part!r}: the model has no layer {idx}",
                                   hint=f"layers are {layers[0]}..{layers[-1]}" if layers else None)
        elif part in ("attn", "mlp", "embed"):
            words = {"attn": _ATTN_WORDS, "mlp": _MLP_WORDS, "embed": _EMBED_WORDS}[part]
            hit = {n for n, _ in named if _has_word(n, words)}
        else:
            hit = {n for n, _ in named if fnmatch.fnmatchcase(n, part) or
                   any(fnmatch.fnmatchcase(a, part) for a in aliases.get(n, ()))}
        if not hit:
            example = named[min(1, len(named) - 1)][0] if named else "?"
            raise CemtoolError(f"parameter selection {part!r} matches no parameter of the model",
                               hint=f"use all, layer:N, attn, mlp, embed or a glob on names like {example}")
        chosen |= hit
    return [(n, p) for n, p in named if n in chosen]


# --------------------------------------------------------------------------------------------------------------
# operators


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


class Objective:
    """The mean token loss L(w) over a fixed evaluation set, as a function of a parameter subset w (METHODS §6).

    L(w) = (1/N) sum over all N target tokens of -log p(token), evaluated in batches of ``batch_size``
    sequences (each batch weighted by its tokens), with the model in eval mode, every attention core on the
    explicit-softmax path (fused kernels have no double backward) and autocast off. ``dtype`` fp64 works on a
    converted copy of the model; fp32 on a model already in fp32 uses the model itself and restores its
    mode and ``requires_grad`` flags in :meth:`close`. Parameter shifts (:meth:`shifted`) are undone exactly.

    ``hvp``: how H v is computed [decision: measured, docs/performance.md]. 'exact' (default): reverse over reverse,
    the gradient of (grad L . v), exact to rounding. 'fd': the central difference of two exact gradients,
    (grad L(w + h v) - grad L(w - h v)) / 2h with h = FD_STEP / |v| — a gradient's memory (no second-order graph)
    and two gradients' time, with an error of order h^2 |v|^2 (third derivatives) plus rounding u / h; float64
    only, where it is about 1e-9 relative (in float32 the shifted weights would keep only ~3 digits of h v).

    ``keep_graph``: keep each batch's first-order gradient graph (``create_graph=True``) and differentiate it
    again for every HVP ('auto': as many batches as fit in ``graph_budget`` bytes, default a quarter of the free
    memory; True: all; False: none). Kept graphs are the only memory that grows with N (up to that budget).
    Use as a context manager, or call :meth:`close`.

    Under torchrun (a process group of K ranks) each rank evaluates a contiguous share of the sequences; the
    token-weighted float64 sums (loss, gradient, H v) are all-reduced, so every rank holds the same result and the
    estimators above run unchanged (their random vectors come from seeded generators, the same on every rank).
    Token ids stay on the CPU and go to the device one batch at a time.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, params: str = "all",
                 dtype: str | torch.dtype = "fp64", device: str | torch.device | None = None,
                 batch_size: int | None = None, keep_graph: bool | str = "auto", graph_budget: int | None = None,
                 vectors: int = 0, hvp: str = "exact",
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss):
        self.dtype = resolve_dtype(dtype)
        check_hvp_method(hvp, self.dtype)
        self.hvp_method = hvp
        # the relative error level of one product, in the Lanczos rounding term: float eps, or for the central
        # difference its truncation scale (h |v|)^2 ~ 4e-11 (measured errors 6e-11 to 8e-11, times the term's
        # max(sqrt(n), 10) factor: a conservative bound)
        self.hvp_eps = FD_STEP ** 2 if hvp == "fd" else float(torch.finfo(self.dtype).eps)
        first = next(iter(model.parameters()), None)
        if first is None:
            raise CemtoolError("the model has no parameters")
        self.device = torch.device(device) if device is not None else first.device
        if self.device.type == "mps" and self.dtype == torch.float64:
            raise CemtoolError("MPS has no float64", hint="use --dtype fp32 or --device cpu")
        if x.ndim != 2 or x.shape != y.shape:
            raise CemtoolError(f"evaluation inputs and targets must both be (sequences, tokens), got "
                               f"{tuple(x.shape)} and {tuple(y.shape)}")
        if y.numel() == 0:
            raise CemtoolError("the evaluation set has zero tokens", hint="use --tokens > 0 (at least one window)")
        self.tokens = int(y.numel())  # N over all ranks: every batch's loss is its sum / N
        self.loss_fn = loss_fn
        self.names = [n for n, _ in select_parameters(model, params)]  # validate before copying anything
        wanted = set(self.names)
        n_sub = sum(p.numel() for n, p in model.named_parameters() if n in wanted)
        check_memory(model, n_sub, self.dtype, self.device, vectors)

        same = first.dtype == self.dtype and first.device == self.device and \
            all(p.dtype == self.dtype for p in model.parameters())
        self.model = model if same else copy.deepcopy(model).to(device=self.device, dtype=self.dtype)
        self._owned = not same
        self._was_training = model.training
        self._requires_grad = {id(p): p.requires_grad for p in self.model.parameters()}
        self.model.eval()
        self.params = [p for n, p in self.model.named_parameters() if n in wanted]
        for p in self.params:
            p.requires_grad_(True)
        # the precision the forward really computes in (transformers keeps softmax and RMSNorm in float32 in an
        # fp64 model): the rounding term of every bound uses its eps, not the requested dtype's
        self.compute_dtype = forward_precision(self.model, x[:1].to(self.device))
        if torch.finfo(self.compute_dtype).eps > self.hvp_eps:
            self.hvp_eps = float(torch.finfo(self.compute_dtype).eps)
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.n = sum(self.sizes)

        seq = x.shape[1]
        bs = batch_size or max(1, 8192 // seq)
        self.batch_size = bs
        mine = shard(len(x))  # this rank's sequences (all of them with one process)
        x, y = x[mine.start:mine.stop].cpu(), y[mine.start:mine.stop].cpu()
        self.batches = [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]  # on the CPU until used
        self.n_batches = int(all_reduce_sum(torch.tensor([float(len(self.batches))], dtype=torch.float64))[0])
        self.keep_graph = keep_graph
        if graph_budget is not None and graph_budget < 0:
            raise CemtoolError(f"the kept-graph memory budget must be >= 0 bytes, got {graph_budget}")
        self.graph_budget = graph_budget
        self._graphs: list[list[torch.Tensor | None]] | None = None  # kept first-order graphs (None: not planned)
        self._n_kept = 0  # how many batches keep their graph
        self.hvps = 0  # Hessian-vector products so far
        self.evaluations = 0  # loss-only passes over the evaluation set
        self.gradients = 0  # gradient passes over the evaluation set
        self.closed = False

    # -- plumbing --------------------------------------------------------------------------------------------------

    def __enter__(self) -> Objective:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop kept graphs; if the model itself was used, restore its train/eval mode and requires_grad."""
        if self.closed:
            return
        self._graphs = None
        if not self._owned:
            for p in self.model.parameters():
                p.requires_grad_(self._requires_grad.get(id(p), p.requires_grad))
            self.model.train(self._was_training)
        self.closed = True

    @contextmanager
    def _context(self, grad: bool) -> Iterator[None]:
        """Explicit attention, autocast off, grad mode as asked: all restored on exit."""
        with ExitStack() as stack:
            stack.enter_context(attention_impl("explicit"))
            if self.device.type in ("cpu", "cuda"):
                stack.enter_context(torch.autocast(device_type=self.device.type, enabled=False))
            stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
            yield

    def split(self, v: torch.Tensor) -> list[torch.Tensor]:
        """Flat (n,) -> one tensor per parameter, in the objective's dtype and device."""
        v = v.to(device=self.device, dtype=self.dtype)
        return [t.view(s) for t, s in zip(torch.split(v, self.sizes), self.shapes, strict=True)]

    def flat(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """One tensor per parameter (None = 0) -> flat (n,) float64."""
        parts = []
        for t, size in zip(tensors, self.sizes, strict=True):
            if t is None:
                parts.append(torch.zeros(size, dtype=torch.float64, device=self.device))
            else:
                parts.append(t.detach().reshape(-1).to(torch.float64))
        return torch.cat(parts)  # (n,)

    def parameters_vector(self) -> torch.Tensor:
        """The current parameter subset w, flat (n,) float64."""
        return self.flat(list(self.params))

    def _batch_loss(self, b: int) -> torch.Tensor:
        xb, yb = (t.to(self.device) for t in self.batches[b])
        logits = self.model(xb)  # (B, T, V)
        return self.loss_fn(logits, yb, reduction="sum") / self.tokens  # this batch's share of the mean

    # -- L, grad L, H v ------------------------------------------------------------------------------------------

    def loss(self) -> float:
        """L(w): mean token loss over the evaluation set (nats)."""
        total = 0.0
        with self._context(grad=False):
            for b in range(len(self.batches)):
                total += float(self._batch_loss(b))
        self.evaluations += 1
        return self._sum(total)

    def _sum(self, total: float) -> float:
        """A float summed over the ranks (itself with one process)."""
        return float(all_reduce_sum(torch.tensor([total], dtype=torch.float64, device=self.device))[0])

    def gradient(self) -> tuple[float, torch.Tensor]:
        """(L(w), grad L(w) flat (n,) float64)."""
        self.gradients += 1
        return self._gradient()

    def _gradient(self) -> tuple[float, torch.Tensor]:
        """(L(w), grad L(w)) summed over the batches and ranks, not counted as a gradient pass."""
        total, g = 0.0, torch.zeros(self.n, dtype=torch.float64, device=self.device)
        with self._context(grad=True):
            for b in range(len(self.batches)):
                loss = self._batch_loss(b)
                g += self.flat(list(torch.autograd.grad(loss, self.params, allow_unused=True)))
                total += float(loss.detach())
        return self._sum(total), all_reduce_sum(g)

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
            self._n_kept = self._plan_graphs()
            self._graphs = self._graphs or []
        if b < self._n_kept:
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

    @contextmanager
    def shifted(self, delta: torch.Tensor) -> Iterator[None]:
        """Evaluate at w + delta inside the context; the exact w is restored on exit (kept graphs dropped)."""
        saved = [p.detach().clone() for p in self.params]
        self._graphs = None
        try:
            with torch.no_grad():
                for p, d in zip(self.params, self.split(delta), strict=True):
                    p.add_(d)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)


HVP_METHODS = ("exact", "fd")
@torch.no_grad()
def forward_precision(model: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The least precise floating dtype among every intermediate tensor of one forward pass on ``x`` (a dtype
    audit of each operation's output, TorchDispatchMode): the precision the model really computes in, whatever
    its parameters' dtype (a transformers Llama computes softmax and RMSNorm in float32 in an fp64 model)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    seen: set[torch.dtype] = set()

    class Audit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            seen.update(t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
            return out

    with Audit():
        model(x)
    first = next(iter(model.parameters()))
    return max(seen or {first.dtype}, key=lambda d: torch.finfo(d).eps)


FD_STEP = float(torch.finfo(torch.float64).eps) ** (1 / 3)  # |h v| of the central difference: ~6e-6


def check_hvp_method(method: str, dtype: torch.dtype) -> None:
    """An HVP method by name; 'fd' needs float64."""
    if method not in HVP_METHODS:
        raise CemtoolError(f"unknown HVP method {method!r}", hint=f"use {' or '.join(HVP_METHODS)}")
    if method == "fd" and dtype != torch.float64:
        raise CemtoolError("the central-difference HVP (--hvp fd) needs --dtype fp64: in fp32 the shifted weights "
                           "keep only about 3 digits of the step", hint="add --dtype fp64, or use --hvp exact")


# --------------------------------------------------------------------------------------------------------------
# Lanczos


def _orthogonalize(w: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """Full reorthogonalisation against the rows of Q (j, n): classical Gram-Schmidt twice ("twice is enough")."""
    if Q.shape[0] == 0:
        return w
    for _ in range(2):
        w = w - Q.T @ (Q @ w)  # (n,)
    return w


def _random_unit(n: int, gen: torch.Generator, device: torch.device, rademacher: bool = False) -> torch.Tensor:
    v = (torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1) if rademacher \
        else torch.randn(n, generator=gen, dtype=torch.float64)
    return (v / v.norm()).to(device)  # (n,)


@dataclass
class LanczosState:
    """The Lanczos recurrence so far: T_m = tridiag(beta, alpha, beta), the orthonormal basis Q (n, m) and the next
    basis vector, so that a run can be continued (the extreme-eigenvalue run doubles as an SLQ run)."""

    next_q: torch.Tensor
    alpha: list[float] = field(default_factory=list)
    beta: list[float] = field(default_factory=list)  # beta[j] couples q_j and q_{j+1} (0 after a restart)
    rows: torch.Tensor | None = None  # (capacity, n) storage of the basis; rows[:steps] are q_0 .. q_{m-1}
    residual_norm: float = 0.0  # beta_m: norm of the last residual (the Ritz residual factor)
    scale: float = 0.0  # running estimate of ||H|| for the breakdown test
    restarts: list[int] = field(default_factory=list)  # steps after which an invariant subspace was found

    @property
    def steps(self) -> int:
        return len(self.alpha)

    @property
    def basis(self) -> torch.Tensor:
        """The orthonormal basis so far, one vector per row: (m, n) float64 (a view)."""
        if self.rows is None:
            return self.next_q.new_zeros(0, self.next_q.numel())
        return self.rows[: self.steps]

    def _store(self, q: torch.Tensor, capacity: int) -> None:
        j = self.steps
        if self.rows is None or j >= self.rows.shape[0]:  # grow the storage geometrically, up to ``capacity``
            grown = q.new_empty(max(min(capacity, max(16, 2 * j)), j + 1), q.numel())
            if self.rows is not None:
                grown[:j] = self.rows[:j]
            self.rows = grown
        self.rows[j] = q

    def tridiagonal(self, m: int | None = None) -> np.ndarray:
        m = len(self.alpha) if m is None else m
        T = np.diag(np.asarray(self.alpha[:m], dtype=np.float64))
        if m > 1:
            off = np.asarray(self.beta[: m - 1], dtype=np.float64)
            T += np.diag(off, 1) + np.diag(off, -1)
        return T

    def ritz(self, m: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """After m steps (default all): Ritz values (ascending), eigenvectors S of T_m and residual norms
        |beta_m s_{m,i}| = ||H y_i - theta_i y_i||."""
        m = len(self.alpha) if m is None else m
        theta, S = np.linalg.eigh(self.tridiagonal(m))
        return theta, S, np.abs(self.beta[m - 1] * S[-1, :])


def lanczos_iterate(op, v0: torch.Tensor | None, steps: int, gen: torch.Generator,
                    stop: Callable[[LanczosState], bool] | None = None, callback: Callback | None = None,
                    state: LanczosState | None = None) -> LanczosState:
    """Run Lanczos with full reorthogonalisation until ``steps`` steps in all (float64 basis and recurrence),
    from v0 or continuing ``state``.

    On breakdown (an invariant subspace is found, beta ~ 0) it continues from a fresh random vector orthogonal
    to the basis, recording beta = 0, so T_m stays exact for the space explored. ``stop(state)`` ends early.
    ``callback`` gets the number of steps taken in this call.
    """
    st = state if state is not None else LanczosState(next_q=v0.to(torch.float64) / v0.norm())
    done = 0
    while st.steps < min(steps, op.n):
        q = st.next_q
        st._store(q, min(steps, op.n))
        w = op.hvp(q).to(torch.float64)  # (n,)
        a = float(q @ w)
        w = _orthogonalize(w, st.rows[: st.steps + 1])  # removes alpha q_j, beta q_{j-1} and rounding drift
        b = float(w.norm())
        st.alpha.append(a)
        st.scale = max(st.scale, abs(a) + b)
        done += 1
        if callback is not None:
            callback(done)
        if b <= 1e-12 * max(st.scale, 1e-300) and st.steps < op.n:  # invariant subspace: restart
            st.beta.append(0.0)
            st.restarts.append(st.steps)
            q = _orthogonalize(_random_unit(op.n, gen, w.device), st.basis)  # basis now includes q_j
            st.next_q = q / q.norm()
        else:
            st.beta.append(b)
            st.next_q = w / b if b > 0 else w
        st.residual_norm = st.beta[-1]
        if stop is not None and stop(st):
            break
    return st


def error_estimates(theta: np.ndarray, residual: np.ndarray) -> np.ndarray:
    """Eigenvalue error estimate of each Ritz value: min(r_i, r_i^2 / gap_i) (Kato-Temple), with gap_i the
    distance to the nearest other Ritz value less its residual. r_i alone is a rigorous bound (some eigenvalue
    of H lies within r_i of theta_i); the r^2/gap form assumes no eigenvalue is hiding between Ritz values."""
    out = residual.copy()
    if len(theta) < 2:
        return out
    for i in range(len(theta)):
        others = np.delete(np.arange(len(theta)), i)
        gap = np.min(np.abs(theta[others] - theta[i]) - residual[others])
        if gap > 0:
            out[i] = min(residual[i], residual[i] ** 2 / gap)
    return out


@dataclass
class Eigenvalues:
    """Extreme eigenvalues of H by Lanczos. ``top`` descending, ``bottom`` ascending; for each:

    - ``*_residual``: a bound in the working precision on the distance from theta to an eigenvalue of H: the Ritz
      residual of the recurrence |beta_m s_m| (exact arithmetic: some eigenvalue lies within it) plus the rounding
      term max(sqrt(n), 10) eps ||H|| of the HVP (``rounding``; ||H|| ~ max(|theta| + r); eps is the operator's
      ``hvp_eps`` when it has one: the central difference's error level), without which an fp32
      residual such as 1e-24 would claim far more than fp32 HVPs can deliver;
    - ``*_error``: the Kato-Temple error estimate min(r, r^2/gap), never below ``rounding``;
    - ``*_converged``: the estimate <= tol * max(|theta|, 1e-3 max|theta|), or at the HVP rounding level 10 eps
      max|theta| (the stopping rule)."""

    top: list[float]
    top_residual: list[float]
    top_error: list[float]
    top_converged: list[bool]
    bottom: list[float]
    bottom_residual: list[float]
    bottom_error: list[float]
    bottom_converged: list[bool]
    ritz_values: list[float]  # every Ritz value of the final T_m (ascending)
    rounding: float  # sqrt(n) eps ||H||: the HVP rounding term included in every residual and error
    steps: int
    hvps: int
    seconds: float
    tol: float
    seed: int
    n: int
    vectors_top: torch.Tensor | None = field(default=None, repr=False)  # (n, k_top) Ritz vectors if asked for
    vectors_bottom: torch.Tensor | None = field(default=None, repr=False)
    state: LanczosState | None = field(default=None, repr=False)  # to continue the run (e.g. as an SLQ run)

    @property
    def converged(self) -> bool:
        return all(self.top_converged) and all(self.bottom_converged)

    @property
    def lambda_max(self) -> float:
        return self.top[0] if self.top else max(self.ritz_values)

    @property
    def lambda_min(self) -> float:
        return self.bottom[0] if self.bottom else min(self.ritz_values)


def _select(theta: np.ndarray, residual: np.ndarray, k_top: int, k_bottom: int, tol: float, eps: float, n: int):
    """Residual bounds and error estimates in the working precision (both include the rounding term sqrt(n) eps
    ||H||), converged flags (the raw estimate at tol, or at the rounding level 10 eps max|theta|), the rounding term
    and the indices of the top-k (descending) and bottom-k (ascending) Ritz values."""
    raw = error_estimates(theta, residual)
    scale = max(float(np.max(np.abs(theta))), 1e-300)
    rounding = max(math.sqrt(n), 10.0) * eps * float(np.max(np.abs(theta) + residual))
    ok = (raw <= tol * np.maximum(np.abs(theta), 1e-3 * scale)) | (raw <= 10 * eps * scale)
    bound, err = residual + rounding, np.maximum(raw, rounding)
    m = len(theta)
    top = list(range(m - 1, max(m - 1 - k_top, -1), -1))
    bottom = list(range(0, min(k_bottom, m)))
    return bound, err, ok, rounding, top, bottom


def lanczos(op, k_top: int = 5, k_bottom: int = 1, *, max_steps: int = 80, tol: float = 1e-4, seed: int = 0,
            min_steps: int | None = None, return_vectors: bool = False,
            callback: Callback | None = None, v0: torch.Tensor | None = None) -> Eigenvalues:
    """Top-k and bottom-k eigenvalues of the operator by Lanczos with full reorthogonalisation.

    Both ends come from one Krylov space (the Hessian is indefinite: the most negative eigenvalue matters, and
    λ_max is the largest *algebraic* eigenvalue, not the largest in magnitude as power iteration finds).
    Stops when every requested Ritz value has converged (see :class:`Eigenvalues`) or after ``max_steps`` HVPs.
    The start vector is a normalised Rademacher vector from ``seed`` (isotropic, so the run can continue as an
    SLQ run), or ``v0`` when given (n,) (a warm start, e.g. the previous top Ritz vector; not isotropic). If the steps
    taken are fewer than k, fewer values are returned.
    """
    if k_top < 0 or k_bottom < 0 or k_top + k_bottom == 0:
        raise CemtoolError("ask for at least one eigenvalue (top-k or bottom-k)")
    if k_top + k_bottom > max_steps:  # fewer Ritz values than asked: the "top" would include the bottom
        raise CemtoolError(f"{k_top} top and {k_bottom} bottom eigenvalues need at least {k_top + k_bottom} Lanczos "
                           f"steps, the cap is {max_steps}", hint="raise the step cap or ask for fewer eigenvalues")
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    need = min(op.n, max(k_top, k_bottom) + 1 if min_steps is None else min_steps)
    eps = getattr(op, "hvp_eps", None) or torch.finfo(getattr(op, "dtype", torch.float64)).eps

    def converged(st: LanczosState) -> bool:
        # after an invariant subspace, the fresh block must be explored too (it finds repeated eigenvalues)
        if st.steps < need + (st.restarts[-1] if st.restarts else 0):
            return False
        if st.steps >= op.n:
            return True
        theta, _, res = st.ritz()
        _, _, ok, _, top, bottom = _select(theta, res, k_top, k_bottom, tol, eps, op.n)
        return len(top) >= min(k_top, op.n) and bool(ok[top + bottom].all())

    if v0 is not None and (v0.shape != (op.n,) or not bool(torch.isfinite(v0).all()) or float(v0.norm()) == 0):
        raise CemtoolError(f"the Lanczos start vector must be a finite non-zero vector of {op.n} entries")
    start = v0.to(device=op.device, dtype=torch.float64) if v0 is not None else \
        _random_unit(op.n, gen, op.device, rademacher=True)
    st = lanczos_iterate(op, start, max_steps, gen, converged, callback)
    theta, S, res = st.ritz()
    bound, err, ok, rounding, top, bottom = _select(theta, res, k_top, k_bottom, tol, eps, op.n)
    if st.steps >= op.n:  # the whole space: Ritz values are eigenvalues up to rounding
        ok[:] = True
    vt = vb = None
    if return_vectors:
        Q = st.basis.T  # (n, m)
        Sd = torch.from_numpy(S).to(Q.device)  # (m, m)
        vt, vb = Q @ Sd[:, top], Q @ Sd[:, bottom]  # (n, k)
    return Eigenvalues(
        top=[float(theta[i]) for i in top], top_residual=[float(bound[i]) for i in top],
        top_error=[float(err[i]) for i in top], top_converged=[bool(ok[i]) for i in top],
        bottom=[float(theta[i]) for i in bottom], bottom_residual=[float(bound[i]) for i in bottom],
        bottom_error=[float(err[i]) for i in bottom], bottom_converged=[bool(ok[i]) for i in bottom],
        ritz_values=[float(t) for t in theta], rounding=rounding, steps=st.steps, hvps=st.steps,
        seconds=time.perf_counter() - t0, tol=tol, seed=seed, n=op.n, vectors_top=vt, vectors_bottom=vb, state=st)


# --------------------------------------------------------------------------------------------------------------
# trace


@dataclass
class Trace:
    """An estimate of tr(H) with its standard error, and the mean eigenvalue tr(H)/n (n = parameters)."""

    method: str
    trace: float
    se: float
    per_param: float
    per_param_se: float
    hvps: int
    seconds: float
    seed: int
    n: int


def _rademacher(n: int, k: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return (torch.randint(0, 2, (n, k), generator=gen, dtype=torch.float64) * 2 - 1).to(device)  # (n, k)


class _CountedHVP:
    """op.hvp in float64, counting the products and reporting the count to ``callback`` after each."""

    def __init__(self, op, callback: Callback | None):
        self.op, self.callback, self.done = op, callback, 0

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        out = self.op.hvp(v).to(torch.float64)
        self.done += 1
        if self.callback is not None:
            self.callback(self.done)
        return out


def _trace_result(method: str, est: float, se: float, n: int, hvps: int, t0: float, seed: int) -> Trace:
    return Trace(method, est, se, est / n, se / n, hvps, time.perf_counter() - t0, seed, n)


def hutchinson(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """Hutchinson's estimator tr(H) ~ (1/m) sum z_i^T H z_i with Rademacher z_i (Hutchinson 1989);
    standard error = sample std / sqrt(m)."""
    if hvps < 2:
        raise CemtoolError("the trace needs at least 2 HVPs for a standard error")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    apply = _CountedHVP(op, callback)
    samples = []
    for _ in range(hvps):
        z = _rademacher(op.n, 1, gen, op.device)[:, 0]  # (n,)
        samples.append(float(z @ apply(z)))
    s = np.asarray(samples)
    return _trace_result("hutchinson", float(s.mean()), float(s.std(ddof=1) / math.sqrt(len(s))), op.n, hvps, t0,
                         seed)


def hutch_plus_plus(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """Hutch++ (Meyer, Musco, Musco & Woodruff 2021): with m HVPs, sketch Q = orth(H S) from k = m/3 Rademacher
    columns, take tr(Q^T H Q) exactly (k HVPs) and Hutchinson on the deflated rest (I - QQ^T) H (I - QQ^T) with
    the remaining m - 2k vectors. Unbiased; its standard error is that of the Hutchinson part."""
    if hvps < 4:
        raise CemtoolError("Hutch++ needs at least 4 HVPs")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    apply = _CountedHVP(op, callback)
    k = min(hvps // 3, op.n)
    r = hvps - 2 * k
    S = _rademacher(op.n, k, gen, op.device)  # (n, k)
    Y = torch.stack([apply(S[:, i]) for i in range(k)], dim=1)  # (n, k) = H S
    Q, _ = torch.linalg.qr(Y)  # (n, k)
    low = sum(float(Q[:, i] @ apply(Q[:, i])) for i in range(k))  # tr(Q^T H Q)
    samples = []
    for _ in range(r):
        g = _rademacher(op.n, 1, gen, op.device)[:, 0]  # (n,)
        g = g - Q @ (Q.T @ g)  # (I - QQ^T) g
        samples.append(float(g @ apply(g)))
    s = np.asarray(samples)
    se = float(s.std(ddof=1) / math.sqrt(len(s))) if len(s) > 1 else 0.0
    return _trace_result("hutch++", low + float(s.mean()), se, op.n, apply.done, t0, seed)


def _xtrace_jackknife_se(Hs: torch.Tensor, W: torch.Tensor, R: torch.Tensor, wHw: torch.Tensor,
                         S: torch.Tensor) -> float:
    """Jackknife standard error of XTrace over its s exchangeable (omega_j, H omega_j) pairs, without HVPs.

    T_(-j) is XTrace on the s - 1 pairs other than j: the mean over i != j of Hutch++ with sketch orth(Y without
    columns i and j) and test vector omega_i. In the coordinates of Q that sketch is Q (I - N N^T), N an orthonormal
    basis of span(s_i, s_j) (columns of R^{-T}), so every term comes from Hs = Q^T H Q, W = Q^T Omega, R, w^T H w.
    SE^2 = (s-1)/s sum_j (T_(-j) - mean T_(-))^2, which by the Efron-Stein inequality does not underestimate the
    variance on average (the plain std(t_i)/sqrt(s) does: the t_i share their samples)."""
    s = S.shape[1]
    tr_H = float(torch.trace(Hs))
    sHs = (S * (Hs @ S)).sum(0)  # (s,) s_i^T Hs s_i
    C = S.T @ S  # (s, s) cosines between the normals
    t = torch.zeros(s, s, dtype=Hs.dtype)  # t[i, j]: test vector i, sketch without columns i and j
    for i in range(s):
        u = S[:, i]  # (s,)
        c = C[i].clone()
        c[i] = 0.0
        V = (S - u[:, None] * c[None, :]) / (1 - c**2).clamp_min(1e-12).sqrt()[None, :]  # (s, s) column j: v_ij
        low = tr_H - float(sHs[i]) - (V * (Hs @ V)).sum(0)  # (s,) tr of Hs on the sketch without i, j
        a, b = W[:, i], R[:, i]  # (s,) Q^T w_i, Q^T H w_i
        PA = a[:, None] - u[:, None] * (u @ a) - V * (V.T @ a)[None, :]  # (s, s) column j: projected Q^T w_i
        t[i] = low + wHw[i] - 2 * (b @ PA) + (PA * (Hs @ PA)).sum(0)
    t.fill_diagonal_(0.0)
    loo = t.sum(0) / (s - 1)  # (s,) T_(-j)
    return math.sqrt((s - 1) / s * float(((loo - loo.mean()) ** 2).sum()))


def xtrace(op, hvps: int = 100, *, seed: int = 0, callback: Callback | None = None) -> Trace:
    """XTrace (Epperly, Tropp & Webber 2024): the exchangeable form of Hutch++ that uses every HVP both for the
    low-rank sketch and as a test vector. With s = m/2 Rademacher vectors Omega (n, s), Y = H Omega = QR and
    Z = H Q (2s HVPs), estimate i is Hutch++ with sketch Q_(i) = orth(Y without column i) and test vector w_i:

        t_i = tr(Q_(i)^T H Q_(i)) + w_i^T (I - P_i) H (I - P_i) w_i,   P_i = Q_(i) Q_(i)^T,

    each unbiased (Q_(i) does not depend on w_i); t = mean_i t_i. No further HVPs are needed: Q_(i) = Q (I - s_i
    s_i^T) restricted, with s_i the normalised i-th column of R^{-T}, and H Q_(i), w_i^T H Q come from Z and R.
    The standard error is the jackknife over the s pairs (:func:`_xtrace_jackknife_se`; the authors' std(t_i)/
    sqrt(s) is too small because the t_i share samples: RMS error/SE up to 1.7 on real Hessians)."""
    if hvps < 4:
        raise CemtoolError("XTrace needs at least 4 HVPs")
    t0, gen = time.perf_counter(), torch.Generator().manual_seed(seed)
    s = min(hvps // 2, op.n)
    apply = _CountedHVP(op, callback)
    Om = _rademacher(op.n, s, gen, op.device)  # (n, s)
    Y = torch.stack([apply(Om[:, i]) for i in range(s)], dim=1)  # (n, s) = H Omega
    Q, R = torch.linalg.qr(Y)  # (n, s), (s, s)
    Z = torch.stack([apply(Q[:, i]) for i in range(s)], dim=1)  # (n, s) = H Q
    d = R.diagonal().abs()
    if float(d.min()) <= 1e-10 * float(d.max()):  # H Omega rank-deficient (H of low rank): no leave-one-out
        # span(Q) contains range(H Omega) = range(H) (almost surely), so tr(Q^T H Q) = tr(H) exactly
        return _trace_result("xtrace", float(torch.trace(Q.T @ Z)), 0.0, op.n, apply.done, t0, seed)
    Hs = (Q.T @ Z).cpu()  # (s, s) = Q^T H Q
    Hs = (Hs + Hs.T) / 2
    W = (Q.T @ Om).cpu()  # (s, s) = Q^T Omega
    R = R.cpu()
    wHw = (Om * Y).sum(0).cpu()  # (s,) w_i^T H w_i
    Rinv_T = torch.linalg.solve_triangular(R, torch.eye(s, dtype=R.dtype), upper=True).T  # (s, s) = R^{-T}
    S = Rinv_T / Rinv_T.norm(dim=0, keepdim=True)  # (s, s) column i: unit normal of span(R without column i)
    PW = W - S * (S * W).sum(0, keepdim=True)  # (s, s) column i: Pi_i w_i, Pi_i = I - s_i s_i^T
    low = float(torch.trace(Hs)) - (S * (Hs @ S)).sum(0)  # (s,) tr(Pi_i Q^T H Q Pi_i)
    rest = wHw - 2 * (R * PW).sum(0) + (PW * (Hs @ PW)).sum(0)  # (s,) w_i^T (I-P_i) H (I-P_i) w_i
    est = float((low + rest).mean())
    return _trace_result("xtrace", est, _xtrace_jackknife_se(Hs, W, R, wHw, S), op.n, apply.done, t0, seed)


# --------------------------------------------------------------------------------------------------------------
# spectral density


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


__all__ = ["DenseOperator", "Density", "Eigenvalues", "Objective", "Trace", "available_memory", "check_memory",
           "hutch_plus_plus", "hutchinson", "lanczos", "lanczos_iterate", "select_parameters",
           "slq", "smooth_density", "xtrace"]
