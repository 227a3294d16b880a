"""PyHessian (Yao, Gholami, Keutzer & Mahoney 2020) on a cemtool model, for cross-checking (METHODS §6).

PyHessian 0.1 expects an image classifier; the adapters below let it measure a language model on exactly the
evaluation tokens and parameter subset cemtool uses, without touching the caller's model:

- criterion: ``lm_loss`` on (B, T, V) logits (mean over tokens; every batch has the same number of tokens, so
  PyHessian's per-sequence batch weighting equals cemtool's per-token weighting);
- a deep copy of the model in the requested dtype and device, in eval mode (PyHessian leaves a gradient graph in
  ``.grad`` and mutates vectors in place); PyHessian draws its random vectors in the default dtype, so that is set
  to the model's dtype while it runs; its ``cuda`` flag follows the device;
- the explicit-softmax attention path (fused kernels have no double backward);
- ``requires_grad`` off for parameters outside the subset and for parameters the loss does not reach
  (PyHessian turns a missing gradient into the float 0., which autograd rejects);
- HVPs are counted by wrapping PyHessian's ``hessian_vector_product`` / ``dataloader_hv_product``;
- ``density()`` calls ``torch.eig``, removed from torch in 2.0: with ``eig_shim`` a stand-in built on
  ``torch.linalg.eigh`` (T is symmetric) is installed for that call only; without it the crash is reported.

A failure inside PyHessian is caught and returned as a message in the result, never raised. PyHessian itself is an
optional dependency (``pip install "cemtool[pyhessian]"``), imported only when it is run.
"""

from __future__ import annotations

import copy
import importlib
import math
import time
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from importlib import metadata

import numpy as np
import torch
from torch import nn

from cemtool.analysis.curvature.risk import resolve_dtype, select_parameters
from cemtool.analysis.density import smooth_density
from cemtool.analysis.sharpness import tokens_note
from cemtool.errors import CemtoolError
from cemtool.models.layers import attention_impl
from cemtool.models.lm import lm_loss


@dataclass
class PyHessianResult:
    """What PyHessian reported. ``errors`` maps a step (eigenvalues, trace, density) to PyHessian's failure."""

    version: str
    eigenvalues: list[float] = field(default_factory=list)  # power iteration with deflation, in its order
    eigen_hvps: int = 0
    eigen_seconds: float = 0.0
    trace: float | None = None  # mean of its Hutchinson samples
    trace_se: float | None = None
    trace_samples: int = 0
    trace_hvps: int = 0
    trace_seconds: float = 0.0
    density_nodes: list[list[float]] = field(default_factory=list)
    density_weights: list[list[float]] = field(default_factory=list)
    density_grid: list[float] = field(default_factory=list)
    density: list[float] = field(default_factory=list)
    density_sigma: float | None = None
    density_hvps: int = 0
    density_seconds: float = 0.0
    density_note: str | None = None
    errors: dict[str, str] = field(default_factory=dict)
    n: int = 0
    tokens: int = 0


MISSING = '--backend pyhessian needs PyHessian: pip install "cemtool[pyhessian]"'


def require_pyhessian():
    """PyHessian's package, its ``hessian`` module and its version; a CemtoolError naming the extra to install
    when it is missing (the CLI calls this before it loads the model)."""
    try:
        # optional dependency (the "pyhessian" extra), imported only when asked for
        pyhessian = importlib.import_module("pyhessian")
        ph = importlib.import_module("pyhessian.hessian")  # the module (the package attribute is the class)
    except ImportError:
        raise CemtoolError(MISSING) from None
    try:
        ver = metadata.version("pyhessian")
    except Exception:  # noqa: BLE001 - metadata is optional
        ver = "unknown"
    return pyhessian, ph, ver


def _eig_shim(T: torch.Tensor, eigenvectors: bool = False):
    """torch.eig's old interface (eigenvalues as (n, 2) real/imaginary pairs) for a symmetric matrix."""
    vals, vecs = torch.linalg.eigh(T)
    pairs = torch.stack([vals, torch.zeros_like(vals)], dim=1)  # (n, 2)
    return pairs, (vecs if eigenvectors else torch.empty(0))


def _eig_removed() -> bool:
    """torch 2.x keeps a torch.eig that only raises 'removed'."""
    try:
        torch.eig(torch.eye(1))
    except (AttributeError, RuntimeError):
        return True
    return False


@contextmanager
def _patched(obj, name: str, value) -> Iterator[None]:
    had = hasattr(obj, name)
    old = getattr(obj, name, None)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _failure(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}"


def prepare_model(model: nn.Module, x: torch.Tensor, y: torch.Tensor, params: str, dtype: torch.dtype,
                  device: torch.device) -> nn.Module:
    """A copy of the model in eval mode whose trainable parameters are exactly the subset the loss reaches."""
    work = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    wanted = {n for n, _ in select_parameters(work, params)}
    for n, p in work.named_parameters():
        p.requires_grad_(n in wanted)
    live = [p for p in work.parameters() if p.requires_grad]
    with attention_impl("explicit"), torch.enable_grad():
        loss = lm_loss(work(x[:1].to(device)), y[:1].to(device))
        grads = torch.autograd.grad(loss, live, allow_unused=True)
    for p, g in zip(live, grads, strict=True):
        if g is None:
            p.requires_grad_(False)
    return work


def run_pyhessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, params: str = "all",
                  dtype: str | torch.dtype = "fp32", device: str | torch.device | None = None,
                  batch_size: int | None = None, top_k: int = 5, max_iter: int = 100, tol: float = 1e-3,
                  trace_iter: int = 100, trace_tol: float = 1e-3, density_runs: int = 1, density_steps: int = 100,
                  density_sigma_frac: float = 0.01, eig_shim: bool = True, seed: int = 0,
                  steps: tuple[str, ...] = ("eigenvalues", "trace", "density")) -> PyHessianResult:
    """Run PyHessian's eigenvalues(top_n), trace() and density() on the model and evaluation tokens.

    One batch (``batch_size`` >= sequences): PyHessian's single-batch mode, which keeps the gradient graph;
    several: its dataloader mode (recomputes the graph per HVP). PyHessian's own defaults for iterations and
    tolerances. Its random vectors come from the global torch RNG, seeded with ``seed`` here.
    """
    _, ph, ver = require_pyhessian()
    dt = resolve_dtype(dtype)
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if y.numel() == 0:
        raise CemtoolError("the evaluation set has zero tokens")
    work = prepare_model(model, x, y, params, dt, dev)
    res = PyHessianResult(version=ver, n=sum(p.numel() for p in work.parameters() if p.requires_grad),
                          tokens=int(y.numel()))
    bs = batch_size or len(x)
    single = bs >= len(x)
    criterion = lambda logits, targets: lm_loss(logits, targets)  # noqa: E731  (B, T, V) logits -> mean nats

    counter = {"hvps": 0}
    original_hvp = ph.hessian_vector_product

    def counting_hvp(gradsH, params_, v):
        counter["hvps"] += 1
        return original_hvp(gradsH, params_, v)

    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")  # PyHessian's own
        stack.enter_context(attention_impl("explicit"))
        stack.enter_context(_default_dtype(dt))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_patched(ph, "hessian_vector_product", counting_hvp))
        if dev.type == "cuda":
            stack.enter_context(torch.cuda.device(dev))
        torch.manual_seed(seed)
        try:
            if single:
                H = ph.hessian(work, criterion, data=(x.to(dev), y.to(dev)), cuda=dev.type == "cuda")
            else:
                loader = [(x[i:i + bs].to(dev), y[i:i + bs].to(dev)) for i in range(0, len(x), bs)]
                H = ph.hessian(work, criterion, dataloader=loader, cuda=dev.type == "cuda")
                original_loader_hvp = H.dataloader_hv_product

                def counting_loader_hvp(v):
                    counter["hvps"] += 1
                    return original_loader_hvp(v)

                H.dataloader_hv_product = counting_loader_hvp
        except Exception as e:  # noqa: BLE001 - PyHessian's failure is a result, not a cemtool crash
            res.errors["setup"] = _failure(e)
            return res

        if "eigenvalues" in steps:
            counter["hvps"], t0 = 0, time.perf_counter()
            try:
                vals, _ = H.eigenvalues(maxIter=max_iter, tol=tol, top_n=top_k)
                res.eigenvalues = [float(v) for v in vals]
            except Exception as e:  # noqa: BLE001
                res.errors["eigenvalues"] = _failure(e)
            res.eigen_hvps, res.eigen_seconds = counter["hvps"], time.perf_counter() - t0

        if "trace" in steps:
            counter["hvps"], t0 = 0, time.perf_counter()
            try:
                samples = np.asarray(H.trace(maxIter=trace_iter, tol=trace_tol), dtype=np.float64)
                res.trace = float(samples.mean())
                res.trace_samples = len(samples)
                res.trace_se = float(samples.std(ddof=1) / math.sqrt(len(samples))) if len(samples) > 1 else None
            except Exception as e:  # noqa: BLE001
                res.errors["trace"] = _failure(e)
            res.trace_hvps, res.trace_seconds = counter["hvps"], time.perf_counter() - t0

        if "density" in steps:
            counter["hvps"], t0 = 0, time.perf_counter()
            try:
                with ExitStack() as inner:
                    if eig_shim and _eig_removed():
                        inner.enter_context(_patched(torch, "eig", _eig_shim))
                        res.density_note = "torch.eig (removed in torch 2.0) replaced by a torch.linalg.eigh shim"
                    nodes, weights = H.density(iter=density_steps, n_v=density_runs)
                res.density_nodes = [[float(t) for t in run] for run in nodes]
                res.density_weights = [[float(w) for w in run] for run in weights]
                flat_n = np.concatenate([np.asarray(r) for r in res.density_nodes])
                flat_w = np.concatenate([np.asarray(r) for r in res.density_weights]) / len(res.density_nodes)
                lo, hi = float(flat_n.min()), float(flat_n.max())
                sig = density_sigma_frac * max(hi - lo, 1e-12)
                grid = np.linspace(lo - 5 * sig, hi + 5 * sig, 1000)
                res.density_grid, res.density_sigma = grid.tolist(), sig
                res.density = smooth_density(flat_n, flat_w, grid, sig).tolist()
            except Exception as e:  # noqa: BLE001
                res.errors["density"] = _failure(e)
            res.density_hvps, res.density_seconds = counter["hvps"], time.perf_counter() - t0
    work.zero_grad(set_to_none=True)
    return res


# --------------------------------------------------------------------------------------------------------------
# as an analysis: sharpness --backend pyhessian (cemtool.jobs runs it and writes reports/sharpness_pyhessian.json)


def steps_of(o) -> tuple[str, ...]:
    """What PyHessian is asked for: a budget of 0 skips, as with cemtool."""
    return tuple(s for s, on in (("eigenvalues", o.top_k > 0), ("trace", o.trace_hvps > 0),
                                 ("density", o.density_runs > 0)) if on)


@dataclass
class PyHessianReport:
    """PyHessian's eigenvalues(), trace() and density() on a subject's evaluation tokens."""

    result: PyHessianResult
    options: object  # the sharpness Options (params, dtype, budgets, seed)
    steps: tuple[str, ...]
    seconds: float
    device: str
    notes: list[str] = field(default_factory=list)

    def payload(self) -> dict:
        o = self.options
        return {"params": o.params, "dtype": o.dtype, "seconds": self.seconds, "steps": list(self.steps),
                "tokens_requested": o.tokens, "notes": list(self.notes), **asdict(self.result)}

    def rows(self) -> list[dict]:
        r, seed = self.result, self.options.seed
        rows = [{"quantity": "lambda_power_iteration", "index": i + 1, "value": v, "hvps": r.eigen_hvps,
                 "seconds": r.eigen_seconds, "tokens": r.tokens, "seed": seed} for i, v in enumerate(r.eigenvalues)]
        if r.trace is not None:
            rows.append({"quantity": "trace_hutchinson", "index": 0, "value": r.trace, "uncertainty": r.trace_se,
                         "hvps": r.trace_hvps, "seconds": r.trace_seconds, "tokens": r.tokens, "seed": seed})
        return rows

    def provenance(self) -> dict:
        return dict(seed=self.options.seed, analysis="sharpness", backend="pyhessian", pyhessian=self.result.version,
                    tokens=self.result.tokens, device=self.device)


def measure(subject, options, progress=None) -> PyHessianReport:
    """The PyHessian cross-check of a subject on its first ``options.tokens`` evaluation tokens (one process)."""
    o = options
    x, y = subject.eval_set(o.tokens)  # (n, T)
    steps = steps_of(o)
    t0 = time.perf_counter()
    device = torch.device(subject.device)
    res = run_pyhessian(subject.model, x, y, params=o.params, dtype=o.dtype, device=device, batch_size=o.batch_size,
                        top_k=max(o.top_k, 1), density_runs=max(o.density_runs, 1),
                        density_steps=o.density_steps, seed=o.seed, steps=steps)
    notes = [tokens_note(o.tokens, res.tokens, int(x.shape[0]), int(x.shape[1]))] if o.tokens != res.tokens else []
    return PyHessianReport(res, o, steps, time.perf_counter() - t0, str(device), notes)


__all__ = ["MISSING", "PyHessianReport", "PyHessianResult", "measure", "prepare_model", "require_pyhessian",
           "run_pyhessian", "steps_of"]
