"""Curvature of the loss (METHODS §6): the operator of a language model and its Hessian-vector products.

:class:`Objective` is the operator of a language model: the mean next-token loss over a fixed evaluation set of
N tokens, as a function of a subset of the parameters (:func:`select_parameters`), with ``n`` (its dimension),
``matvec(v) = hvp(v) -> H v`` and ``device`` (the protocol of :mod:`cemtool.analysis.curvature.protocol`, which
also has :class:`DenseOperator`, an explicit symmetric matrix for tests and for checking the estimators); the
GGN and the Fisher operators of :mod:`cemtool.analysis.curvature.operators` are its subclasses. The estimators take
any operator; they are pure functions returning dataclasses, re-exported here:

- :func:`lanczos`  extreme eigenvalues at both ends, with Ritz residuals, error estimates and converged flags
  (:mod:`cemtool.analysis.lanczos`),
- :func:`hutchinson`, :func:`hutch_plus_plus`, :func:`xtrace`  tr(H) with a standard error, and tr(H)/n
  (:mod:`cemtool.analysis.trace`),
- :func:`slq`  the spectral density by stochastic Lanczos quadrature, Gaussian-smoothed with a reported sigma
  (:mod:`cemtool.analysis.density`).

Notation: n = parameters in the subset, N = evaluation tokens, k = requested eigenvalues, m = Lanczos steps.
The Lanczos recurrences (alpha, beta) and the basis are float64 whatever the HVP dtype.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cemtool.analysis.curvature.protocol import Callback, DenseOperator
from cemtool.analysis.density import Density, slq, smooth_density
from cemtool.analysis.lanczos import Eigenvalues, LanczosState, error_estimates, lanczos, lanczos_iterate
from cemtool.analysis.trace import Trace, hutch_plus_plus, hutchinson, xtrace
from cemtool.distributed import all_reduce_sum, shard
from cemtool.errors import CemtoolError
from cemtool.memory import available_memory  # the one memory probe and curvature check (cgroup limit included)
from cemtool.memory import check_curvature_memory as check_memory
from cemtool.models.capabilities import Capabilities
from cemtool.models.layers import attention_impl
from cemtool.models.lm import lm_loss

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
# the operator of a language model


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
    estimators run unchanged (their random vectors come from seeded generators, the same on every rank).
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
        self.n = self.size = sum(self.sizes)

        seq = x.shape[1]
        bs = batch_size or max(1, 8192 // seq)
        self.batch_size = bs
        mine = shard(len(x))  # this rank's sequences (all of them with one process)
        self.first_sequence = mine.start  # the global index of this rank's first sequence
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

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        """The operator's product (the protocol of cemtool.analysis.curvature.protocol): here the Hessian's, H v;
        the operators of cemtool.analysis.curvature.operators replace it with theirs."""
        return self.hvp(v)

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


__all__ = ["Callback", "DenseOperator", "Density", "Eigenvalues", "LanczosState", "Objective", "Trace",
           "available_memory", "check_memory", "error_estimates", "hutch_plus_plus", "hutchinson", "lanczos",
           "lanczos_iterate", "select_parameters", "slq", "smooth_density", "xtrace"]
