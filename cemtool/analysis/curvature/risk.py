"""The empirical risk every curvature operator is the curvature of (METHODS §6; docs/sharpness.md "Operators").

:class:`EmpiricalRisk` is the token-mean loss L(w) = (1/N) Σ_t ℓ_t(w) over a fixed evaluation set of N target
tokens, as a function of a parameter subset w of n parameters (:func:`select_parameters`). It is written once and
holds what every operator shares: the evaluation batches (token-weighted sums), the share of the sequences of each
rank and the all-reduce under torchrun, the parameter subset, the dtype copy of the model, the memory check, the
precision the forward really computes in (:func:`forward_precision`), L and ∇L, and exact parameter shifts. It is
not an operator: the operators of :mod:`cemtool.analysis.curvature.operators` are its subclasses and add only
their product ``matvec``.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cemtool.analysis.curvature.blocks import layer_of
from cemtool.distributed import all_reduce_sum, shard
from cemtool.errors import CemtoolError
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


GENERIC = {"blocks", "layer", "hf", "model", "transformer", "weight", "bias"}  # no module a suffix may start at


def _glob(name: str, pattern: str, modules: set[str]) -> bool:
    """``pattern`` matches the whole dotted name, or its trailing components when the pattern starts at a module's
    own name (``experts.*`` matches ``blocks.0.layer.mlp.experts.down_proj``, ``mlp.gate.weight`` the routers);
    a bare word (``weight``), a layer number (``0.*``) or the adapter's wrapper (``layer.*``) matches no suffix, so
    that a typo is refused rather than taken for most of the model."""
    if fnmatch.fnmatchcase(name, pattern):
        return True
    first = pattern.split(".", 1)[0]
    return "." in pattern and first in modules and fnmatch.fnmatchcase(name, "*." + pattern)


def select_parameters(model: nn.Module, spec: str = "all") -> list[tuple[str, nn.Parameter]]:
    """The parameters a curvature measurement is restricted to (shared tensors once, in model order).

    ``spec`` is a comma-separated union of: ``all``; ``layer:N`` (``blocks.N.*``); ``attn`` / ``mlp`` /
    ``embed`` (every parameter with that word in its dotted name: ``blocks.N.attn.*``, ``ln_attn``,
    ``attn_step``...; ``tok_emb``, ``head``...); ``experts`` (a mixture of experts' expert weights: every parameter
    under a module named ``experts``); or a glob on the names (``blocks.*.mlp.up.weight``) or on their trailing
    components (``experts.*``, ``mlp.gate.weight``: the router), or on the model's own names where it has others
    (``model.parameter_aliases()``: a Hugging Face model's ``model.layers.3.mlp.*``, cemtool.subject.hf).
    """
    declared = model if isinstance(model, Capabilities) else None  # any module; a cemtool or HF model says more
    fixed = declared.fixed_parameters() if declared else {}  # coordinates of the model (an export's added zeros)
    named = [(n, p) for n, p in model.named_parameters() if n not in fixed]  # shared parameters appear once
    aliases = declared.parameter_aliases() if declared else {}
    modules = {c for n, _ in named for c in n.split(".")[:-1] if not c.isdigit()} - GENERIC  # where suffixes start
    chosen: set[str] = set()
    for part in [s.strip() for s in spec.split(",") if s.strip()] or [""]:
        if part == "all":
            hit = {n for n, _ in named}
        elif part.startswith("layer:"):
            idx = part[len("layer:"):]
            if not idx.isdigit():
                raise CemtoolError(f"bad parameter selection {part!r}", hint="use layer:N with N an integer")
            hit = {n for n, _ in named if layer_of(n) == int(idx)}
            if not hit:
                layers = sorted({k for n, _ in named if (k := layer_of(n)) is not None})
                raise CemtoolError(f"parameter selection {part!r}: the model has no layer {idx}",
                                   hint=f"layers are {layers[0]}..{layers[-1]}" if layers else None)
        elif part in ("attn", "mlp", "embed"):
            words = {"attn": _ATTN_WORDS, "mlp": _MLP_WORDS, "embed": _EMBED_WORDS}[part]
            hit = {n for n, _ in named if _has_word(n, words)}
        elif part == "experts":
            hit = {n for n, _ in named if "experts" in n.split(".")[:-1]}
        else:
            hit = {n for n, _ in named if any(_glob(name, part, modules) for name in (n, *aliases.get(n, ())))}
        if not hit:
            example = named[min(1, len(named) - 1)][0] if named else "?"
            raise CemtoolError(f"parameter selection {part!r} matches no parameter of the model",
                               hint=f"use all, layer:N, attn, mlp, embed, experts or a glob on names like {example}")
        chosen |= hit
    return [(n, p) for n, p in named if n in chosen]


# --------------------------------------------------------------------------------------------------------------
# the empirical risk


class EmpiricalRisk:
    """The mean token loss L(w) over a fixed evaluation set, as a function of a parameter subset w (METHODS §6).

    L(w) = (1/N) sum over all N target tokens of -log p(token), evaluated in batches of ``batch_size``
    sequences (each batch weighted by its tokens), with the model in eval mode, every attention core on the
    explicit-softmax path (fused kernels have no double backward) and autocast off. ``dtype`` fp64 works on a
    converted copy of the model; fp32 on a model already in fp32 uses the model itself and restores its
    mode and ``requires_grad`` flags in :meth:`close`. Parameter shifts (:meth:`shifted`) are undone exactly.
    ``vectors``: how many n-vectors the caller will hold (Lanczos's basis), for the memory check made before
    anything is copied. Use as a context manager, or call :meth:`close`.

    Under torchrun (a process group of K ranks) each rank evaluates a contiguous share of the sequences; the
    token-weighted float64 sums (loss, gradient, products) are all-reduced, so every rank holds the same result and
    the estimators run unchanged (their random vectors come from seeded generators, the same on every rank).
    Token ids stay on the CPU and go to the device one batch at a time.
    """

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, params: str = "all",
                 dtype: str | torch.dtype = "fp64", device: str | torch.device | None = None,
                 batch_size: int | None = None, vectors: int = 0,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss):
        self.dtype = resolve_dtype(dtype)
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
        # fp64 model): the relative error level of one product (``hvp_eps``, the rounding term of every Lanczos
        # bound) is its eps when that is coarser than the requested dtype's
        self.compute_dtype = forward_precision(self.model, x[:1].to(self.device))
        self.hvp_eps = max(float(torch.finfo(self.dtype).eps), float(torch.finfo(self.compute_dtype).eps))
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
        self.kept_graph_batches = 0  # batches whose graph an operator keeps between products (the Hessian's)
        self.hvps = 0  # operator products so far (Hessian, GGN or Fisher: the estimators' unit of cost)
        self.evaluations = 0  # loss-only passes over the evaluation set
        self.gradients = 0  # gradient passes over the evaluation set
        self.closed = False

    # -- plumbing --------------------------------------------------------------------------------------------------

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """If the model itself was used, restore its train/eval mode and requires_grad."""
        if self.closed:
            return
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
        """Flat (n,) -> one tensor per parameter, in the risk's dtype and device."""
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

    def _logits(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch b's logits (B, T, V), in the risk's dtype, and its targets (B, T), on the device."""
        xb, yb = (t.to(self.device) for t in self.batches[b])
        return self.model(xb).to(self.dtype), yb

    def _batch_loss(self, b: int) -> torch.Tensor:
        logits, yb = self._logits(b)  # (B, T, V), (B, T)
        return self.loss_fn(logits, yb, reduction="sum") / self.tokens  # this batch's share of the mean

    def _sum(self, total: float) -> float:
        """A float summed over the ranks (itself with one process)."""
        return float(all_reduce_sum(torch.tensor([total], dtype=torch.float64, device=self.device))[0])

    # -- L and grad L --------------------------------------------------------------------------------------------

    def loss(self) -> float:
        """L(w): mean token loss over the evaluation set (nats)."""
        total = 0.0
        with self._context(grad=False):
            for b in range(len(self.batches)):
                total += float(self._batch_loss(b))
        self.evaluations += 1
        return self._sum(total)

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

    def _shift_started(self) -> None:
        """Called before the weights move (:meth:`shifted`): a subclass drops what depends on them."""

    @contextmanager
    def shifted(self, delta: torch.Tensor) -> Iterator[None]:
        """Evaluate at w + delta inside the context; the exact w is restored on exit."""
        saved = [p.detach().clone() for p in self.params]
        self._shift_started()
        try:
            with torch.no_grad():
                for p, d in zip(self.params, self.split(delta), strict=True):
                    p.add_(d)
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)


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


__all__ = ["DTYPES", "EmpiricalRisk", "check_memory", "forward_precision", "resolve_dtype", "select_parameters"]
