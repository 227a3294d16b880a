"""``cemtool sharpness`` as an analysis: its Options, ``measure(subject, options)`` and its reports (METHODS §6).

The measurement of one run: loss and gradient, the extreme Hessian eigenvalues (Lanczos, both ends), the trace
(XTrace, Hutch++, Hutchinson), the spectral density (SLQ), SAM / ASAM / average-case sharpness and loss slices
(:mod:`cemtool.analysis.landscape`), or, with ``per_layer``, λ_max and tr(H) of each layer's block of the Hessian.
:mod:`cemtool.jobs` opens the subject, writes the report and draws the figures.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch

from cemtool.analysis.curvature import CARDS, DEFAULT_OPERATOR, check_operator_options
from cemtool.analysis.curvature.blocks import blocks_of, check_blocks
from cemtool.analysis.curvature.operators import check_hvp_method, check_operator, make_operator
from cemtool.analysis.curvature.protocol import Callback
from cemtool.analysis.curvature.risk import resolve_dtype, select_parameters
from cemtool.analysis.curvature.stationarity import GAP_TOL, NEG_TOL, Standing, certify
from cemtool.analysis.density import Density, slq
from cemtool.analysis.lanczos import Eigenvalues, lanczos
from cemtool.analysis.landscape import (
    Sharpness,
    Slice1D,
    Slice2D,
    asam_sharpness,
    average_sharpness,
    filter_normalized_direction,
    loss_slice_1d,
    loss_slice_2d,
    sam_sharpness,
    worst_case_sharpness,
)
from cemtool.analysis.trace import MIN_HVPS, Trace, hutch_plus_plus, hutchinson, xtrace
from cemtool.errors import CemtoolError
from cemtool.models.capabilities import Capabilities
from cemtool.options import at_least, check_types
from cemtool.report import markdown_table


def tokens_note(requested: int, used: int, windows: int, seq_len: int) -> str:
    """Why the evaluation set holds ``used`` tokens when ``requested`` were asked for (whole windows only)."""
    why = (f"the validation split holds only {windows} windows of {seq_len} tokens"
           if windows < max(1, requested // seq_len) else f"the evaluation set is whole windows of {seq_len} tokens")
    return f"{used:,} evaluation tokens used of {requested:,} requested: {why}"


TRACE_METHODS = {"hutchinson": hutchinson, "hutch++": hutch_plus_plus, "xtrace": xtrace}
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class SharpnessOptions:
    """What to measure and with which budget (the defaults take about a minute on 2 CPU cores for a 4-layer,
    128-wide model on 2k tokens in fp32; see docs/sharpness.md). A budget of 0 skips that measurement."""

    params: str = "all"  # parameter subset (see hessian.select_parameters)
    dtype: str = "fp32"  # HVP dtype: fp32 or fp64 (a converted copy of the model)
    batch_size: int | None = None  # sequences per batch (default: 8192 tokens per batch)
    top_k: int = 5
    bottom_k: int = 1
    lanczos_steps: int = 40  # HVP cap of the extreme-eigenvalue run
    tol: float = 1e-4  # relative eigenvalue error estimate at which a Ritz value counts as converged
    trace_methods: tuple[str, ...] = ("xtrace",)
    trace_hvps: int = 40  # HVPs per trace method
    density_runs: int = 1  # SLQ runs (the first continues the eigenvalue run)
    density_steps: int = 40  # Lanczos steps per SLQ run
    density_sigma: float | None = None  # Gaussian smoothing (default: 1% of the spectral spread)
    sam_rho: float = 0.05
    asam_rho: float = 0.5
    asam_eta: float = 0.01
    ascent_steps: int = 1  # gradient steps of the worst-case measures (1 = first order)
    avg_rho: float = 0.1
    avg_samples: int = 4  # antithetic pairs of the average-case measure (0 skips it; 1 is refused: no standard error)
    landscape: str = "1d"  # 1d | 2d | both | none
    slice_span: float = 1.0
    slice_points: int = 21  # per axis (2-D: at most 11 by default, see slice_points_2d)
    slice_points_2d: int = 11
    seed: int = 0
    device: str | None = None
    graph_memory: float | None = None  # GiB of kept first-order graphs (None: a quarter of the free memory)
    hvp: str = "exact"  # exact (double backward) or fd (central difference of gradients; fp64 only)
    operator: str = DEFAULT_OPERATOR  # hessian | ggn | ef | fisher | a registered one (curvature.operators)
    mc_samples: int = 1  # label draws per token of the Monte-Carlo Fisher (operator fisher)
    gap_tol: float = GAP_TOL  # nats: descent gap at or below which the model counts as stationary (stationarity)
    neg_tol: float = NEG_TOL  # relative negative curvature tolerated at a minimum (stationarity)

    def __post_init__(self):
        bad = [m for m in self.trace_methods if m not in TRACE_METHODS]
        if bad:
            raise CemtoolError(f"unknown trace method {bad[0]!r}", hint=f"use {', '.join(TRACE_METHODS)}")
        if self.landscape not in ("1d", "2d", "both", "none"):
            raise CemtoolError(f"unknown landscape {self.landscape!r}", hint="use 1d, 2d, both or none")
        for name in ("top_k", "bottom_k", "lanczos_steps", "trace_hvps", "density_runs", "density_steps",
                     "avg_samples"):
            if getattr(self, name) < 0:
                raise CemtoolError(f"{name} must be >= 0")
        if self.avg_samples == 1:  # (it was skipped without a word)
            raise CemtoolError("avg_samples=1: the average-case sharpness needs at least 2 antithetic pairs (its "
                               "standard error is over the pairs)", hint="use 2 or more, or 0 to skip it")
        check_hvp_method(self.hvp, resolve_dtype(self.dtype))
        check_operator(self.operator)
        if self.mc_samples < 1:
            raise CemtoolError(f"mc_samples must be >= 1, got {self.mc_samples}")
        check_operator_options(self.operator, hvp=self.hvp, mc_samples=self.mc_samples)
        if self.graph_memory is not None and not (math.isfinite(self.graph_memory) and self.graph_memory >= 0):
            raise CemtoolError(f"graph_memory must be a finite number of GiB >= 0, got {self.graph_memory}")
        for name in ("gap_tol", "neg_tol"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise CemtoolError(f"{name} must be a finite number > 0, got {v}")
        for name in ("tol", "sam_rho", "asam_rho", "asam_eta", "avg_rho", "slice_span"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise CemtoolError(f"{name} must be a finite number >= 0, got {v}")
        if self.density_sigma is not None and not (math.isfinite(self.density_sigma) and self.density_sigma > 0):
            raise CemtoolError(f"density_sigma must be a positive number, got {self.density_sigma}",
                               hint="leave it out for 1% of the spectral spread")
        short = [m for m in self.trace_methods if 0 < self.trace_hvps < MIN_HVPS[m]]
        if short:
            need = max(MIN_HVPS[m] for m in short)
            raise CemtoolError(f"trace_hvps={self.trace_hvps}: {short[0]} needs at least {need} HVPs",
                               hint=f"raise --trace-hvps to {need} or more, or set it to 0 to skip the trace")
        if 0 < self.lanczos_steps < self.top_k + self.bottom_k:
            raise CemtoolError(f"top_k {self.top_k} + bottom_k {self.bottom_k} eigenvalues need at least "
                               f"{self.top_k + self.bottom_k} Lanczos steps, lanczos_steps is {self.lanczos_steps}",
                               hint="raise --lanczos-steps or lower --top-k/--bottom-k")


@dataclass
class SharpnessReport:
    """Every measurement of one `cemtool sharpness` call, with its cost (HVPs, loss/gradient passes, seconds)."""

    options: SharpnessOptions
    tokens: int
    sequences: int
    seq_len: int
    n_params: int  # parameters in the subset (the Hessian's dimension)
    n_model_params: int
    param_names: list[str]
    loss: float
    grad_norm: float
    tokens_requested: int | None = None  # what the caller asked for (``tokens`` is what was used)
    notes: list[str] = field(default_factory=list)  # every change to what was asked, in words
    eigen: Eigenvalues | None = None
    traces: list[Trace] = field(default_factory=list)
    density: Density | None = None
    sharpness: list[Sharpness] = field(default_factory=list)
    slice_1d: Slice1D | None = None
    slice_2d: Slice2D | None = None
    standing: Standing | None = None  # where the model stands: stationary or not (curvature.stationarity)
    hvps: int = 0
    evaluations: int = 0
    gradients: int = 0
    seconds: float = 0.0
    kept_graph_batches: int = 0
    batches: int = 1
    computed_in: str = ""  # the precision the forward computes in (hessian.forward_precision): the bounds' eps
    arch = ""  # the subject's architecture (set by measure; provenance, not a field of the payload)

    def payload(self) -> dict:
        """A JSON-able dict (no tensors)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["options"] = asdict(self.options)
        for key in ("eigen", "density", "slice_1d", "slice_2d"):
            v = out[key]
            out[key] = None if v is None else {f.name: getattr(v, f.name) for f in fields(v)
                                                if f.name not in ("vectors_top", "vectors_bottom", "state")}
        out["standing"] = None if self.standing is None else asdict(self.standing)
        out["traces"] = [asdict(t) for t in self.traces]
        out["sharpness"] = [asdict(s) for s in self.sharpness]
        return out

    def provenance(self) -> dict:
        """What this report adds to its provenance (cemtool.jobs writes it)."""
        return dict(seed=self.options.seed, analysis="sharpness", backend="cemtool", arch=self.arch,
                    tokens=self.tokens, device=self.options.device, seq_len=self.seq_len)

    def rows(self) -> list[dict]:
        """One row per estimate: value, its uncertainty and what it cost (the CSV)."""
        o = self.options
        common = {"tokens": self.tokens, "params": o.params, "n_params": self.n_params, "dtype": o.dtype,
                  "seed": o.seed, "operator": o.operator}
        rows = [dict(quantity="loss", index=0, value=self.loss, uncertainty=None, uncertainty_kind=None,
                     converged=None, hvps=0, evaluations=1, seconds=None, **common),
                dict(quantity="grad_norm", index=0, value=self.grad_norm, uncertainty=None, uncertainty_kind=None,
                     converged=None, hvps=0, evaluations=1, seconds=None, **common)]
        e = self.eigen
        if e is not None:
            for end, vals, res, err, ok in (("lambda_top", e.top, e.top_residual, e.top_error, e.top_converged),
                                            ("lambda_bottom", e.bottom, e.bottom_residual, e.bottom_error,
                                             e.bottom_converged)):
                for i, (v, r, er, c) in enumerate(zip(vals, res, err, ok, strict=True)):
                    rows.append(dict(quantity=end, index=i + 1, value=v, uncertainty=er,
                                     uncertainty_kind="error estimate", residual=r, converged=c, hvps=e.hvps,
                                     evaluations=0, seconds=e.seconds, **common))
        st = self.standing
        if st is not None:
            for q, v, u in (("grad_norm_per_sqrt_n", st.grad_norm_per_sqrt_n, None),
                            ("descent_gap", st.descent_gap, None), ("eigenvalue_ratio", st.lambda_ratio, None),
                            ("negative_mass", st.negative_mass, st.negative_mass_se)):
                rows.append(dict(quantity=q, index=0, value=v, uncertainty=u,
                                 uncertainty_kind="standard error" if u is not None else None, converged=None,
                                 hvps=0, evaluations=0, seconds=None, verdict=st.verdict, **common))
        for t in self.traces:
            rows.append(dict(quantity=f"trace_{t.method}", index=0, value=t.trace, uncertainty=t.se,
                             uncertainty_kind="standard error", converged=None, hvps=t.hvps, evaluations=0,
                             seconds=t.seconds, **common))
            rows.append(dict(quantity=f"trace_per_param_{t.method}", index=0, value=t.per_param,
                             uncertainty=t.per_param_se, uncertainty_kind="standard error", converged=None,
                             hvps=t.hvps, evaluations=0, seconds=t.seconds, **common))
        d = self.density
        if d is not None:
            rows.append(dict(quantity="density_sigma", index=0, value=d.sigma, uncertainty=None,
                             uncertainty_kind=None, converged=None, hvps=d.hvps, evaluations=0, seconds=d.seconds,
                             **common))
        for s in self.sharpness:
            name = s.kind if s.ascent_steps <= 1 else f"{s.kind}_ascent{s.ascent_steps}"
            rows.append(dict(quantity=f"sharpness_{name}", index=0, value=s.value, uncertainty=s.se,
                             uncertainty_kind="standard error" if s.se is not None else None, converged=None,
                             hvps=0, evaluations=s.evaluations + s.gradients, seconds=s.seconds, rho=s.rho,
                             **common))
        return rows


def measure_sharpness(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                      options: SharpnessOptions | None = None, progress: Progress | None = None, *,
                      tokens_requested: int | None = None) -> SharpnessReport:
    """Curvature and sharpness of ``model`` on the evaluation set (x, y): (sequences, tokens) int64.

    Runs, as the options ask: the loss and gradient; extreme eigenvalues (Lanczos); the trace (each method in
    ``trace_methods``); the spectral density (SLQ, its first run continuing the eigenvalue run); SAM, ASAM and
    average-case sharpness; loss slices. The model is left exactly as it was (mode, dtype, weights).
    ``tokens_requested``: the token count the caller asked for, recorded with a note when x, y hold another.
    ``progress(stage, done, total)``: a stage that ends before its cap (Lanczos converged early) is reported
    once more with total = done, so a bar completes at what was done.
    """
    o = options or SharpnessOptions()
    t0 = time.perf_counter()
    last: dict[str, tuple[int, int]] = {}  # stage -> (done, total)

    def stage(name: str, total: int) -> Callback:
        last[name] = (0, total)
        if progress is not None:
            progress(name, 0, total)

        def cb(done: int) -> None:
            last[name] = (done, total)
            if progress is not None:
                progress(name, done, total)
        return cb

    def end(name: str) -> None:
        done, total = last[name]
        if progress is not None and 0 < done < total:
            progress(name, done, done)

    vectors = max(o.lanczos_steps, o.density_steps) + (o.trace_hvps if o.trace_methods else 0)
    budget = None if o.graph_memory is None else int(o.graph_memory * 2**30)
    with make_operator(o.operator, model, x, y, params=o.params, dtype=o.dtype, device=o.device,
                       batch_size=o.batch_size, graph_budget=budget, vectors=vectors, hvp=o.hvp,
                       mc_samples=o.mc_samples, seed=o.seed) as obj:
        cb = stage("loss and gradient", 1)
        loss0, g = obj.gradient()
        cb(1)
        rep = SharpnessReport(o, obj.tokens, int(x.shape[0]), int(x.shape[1]), obj.n,
                              sum(p.numel() for p in obj.model.parameters()), list(obj.names), loss0,
                              float(g.norm()), batches=obj.n_batches, tokens_requested=tokens_requested)
        if tokens_requested is not None and tokens_requested != obj.tokens:
            rep.notes.append(tokens_note(tokens_requested, obj.tokens, int(x.shape[0]), int(x.shape[1])))
        rep.computed_in = str(obj.compute_dtype).removeprefix("torch.")
        if obj.compute_dtype != obj.dtype:
            rep.notes.append(f"the forward computes partly in {rep.computed_in} (--dtype {o.dtype}): error bounds "
                             f"use {rep.computed_in}'s rounding (eps {torch.finfo(obj.compute_dtype).eps:.3g})")
        fixed = model.fixed_parameters() if isinstance(model, Capabilities) else {}
        if fixed:
            sizes, (first, why) = dict(model.named_parameters()), next(iter(fixed.items()))
            rep.notes.append(f"{sum(sizes[n].numel() for n in fixed):,} parameters in {len(fixed)} tensors left "
                             f"out ({why}): {first}{', ...' if len(fixed) > 1 else ''}")
        if o.top_k + o.bottom_k > 0 and o.lanczos_steps > 0:
            name = "eigenvalues (Lanczos)"
            rep.eigen = lanczos(obj, o.top_k, o.bottom_k, max_steps=o.lanczos_steps, tol=o.tol, seed=o.seed,
                                callback=stage(name, min(o.lanczos_steps, obj.n)))
            end(name)
        for method in o.trace_methods if o.trace_hvps > 0 else ():
            name = f"trace ({method})"
            rep.traces.append(TRACE_METHODS[method](obj, o.trace_hvps, seed=o.seed + 1,
                                                    callback=stage(name, o.trace_hvps)))
            end(name)
        if o.density_runs > 0 and o.density_steps > 0:
            reuse = [rep.eigen.state] if rep.eigen is not None and rep.eigen.state is not None else []
            total = o.density_runs * min(o.density_steps, obj.n) - sum(min(s.steps, o.density_steps) for s in reuse)
            rep.density = slq(obj, o.density_runs, o.density_steps, seed=o.seed + 2, sigma=o.density_sigma,
                              reuse=reuse, callback=stage("spectral density (SLQ)", max(total, 0)))
            end("spectral density (SLQ)")
        e = rep.eigen
        rep.standing = certify(
            grad_norm=rep.grad_norm, n=obj.n, operator=o.operator, psd=obj.psd,
            lambda_max=e.lambda_max if e is not None and e.top else None,
            lambda_min=e.bottom[0] if e is not None and e.bottom else None,
            lambda_min_error=e.bottom_error[0] if e is not None and e.bottom else None, density=rep.density,
            trace=rep.traces[0] if rep.traces else None, gap_tol=o.gap_tol, neg_tol=o.neg_tol)
        if rep.eigen is not None:
            rep.eigen.state = None  # release the basis
        rep.kept_graph_batches = obj.kept_graph_batches
        hv = obj.hvps
        base = (loss0, g)
        if o.sam_rho > 0:
            rep.sharpness.append(sam_sharpness(obj, o.sam_rho, 1, base=base, callback=stage("SAM", 1)))
            if o.ascent_steps > 1:
                rep.sharpness.append(sam_sharpness(obj, o.sam_rho, o.ascent_steps, base=base,
                                                   callback=stage("SAM ascent", o.ascent_steps + 1)))
        if o.asam_rho > 0:
            rep.sharpness.append(asam_sharpness(obj, o.asam_rho, o.asam_eta, 1, base=base, callback=stage("ASAM", 1)))
            if o.ascent_steps > 1:
                rep.sharpness.append(asam_sharpness(obj, o.asam_rho, o.asam_eta, o.ascent_steps, base=base,
                                                    callback=stage("ASAM ascent", o.ascent_steps + 1)))
        if o.avg_rho > 0 and o.avg_samples >= 2:
            rep.sharpness.append(average_sharpness(obj, o.avg_rho, o.avg_samples, seed=o.seed + 3, loss0=loss0,
                                                   callback=stage("average-case sharpness", o.avg_samples)))
        if o.landscape in ("1d", "both"):
            rep.slice_1d = loss_slice_1d(obj, o.slice_span, o.slice_points, seed=o.seed + 4,
                                         callback=stage("1-D loss slice", o.slice_points))
        if o.landscape in ("2d", "both"):
            rep.slice_2d = loss_slice_2d(obj, o.slice_span, o.slice_points_2d, seed=o.seed + 5,
                                         callback=stage("2-D loss slice", o.slice_points_2d ** 2))
        rep.hvps, rep.evaluations, rep.gradients = hv, obj.evaluations, obj.gradients
    rep.seconds = time.perf_counter() - t0
    return rep


# --------------------------------------------------------------------------------------------------------------
# per layer: `cemtool sharpness --per-layer`


@dataclass
class LayerCurvature:
    """λ_max and trace of one block A_SS of the operator (S = a parameter block, curvature.blocks: a layer's
    ``blocks.<layer>.*``, one tensor kind of a layer, or a glob)."""

    layer: int | None  # None: a block outside the layers (embeddings, final norm) or a glob
    params: str  # the selection: layer:N, or the block's parameter names
    n_params: int
    n_params: int
    lambda_max: float | None
    lambda_max_error: float | None  # Kato-Temple error estimate (hessian.Eigenvalues)
    lambda_max_converged: bool | None
    lanczos_hvps: int
    trace: float | None
    trace_se: float | None  # standard error
    trace_per_param: float | None
    trace_per_param_se: float | None
    trace_method: str | None
    trace_hvps: int
    seconds: float
    block: str = ""  # the table's row label: "layer 3", "layer 3: q", "outside layers: embed", or the glob
    kind: str | None = None  # the tensor kind (--blocks kind), None for a layer or a glob


def model_layers(model: torch.nn.Module) -> list[int]:
    """The block indices N of the model's parameters ``blocks.N.*`` (what ``layer:N`` selects), ascending."""
    found = {int(m.group(1)) for n, _ in model.named_parameters() if (m := re.match(r"blocks\.(\d+)\.", n))}
    if not found:
        raise CemtoolError("the model has no layers (no parameters named blocks.N.*)")
    return sorted(found)


def check_per_layer(o: SharpnessOptions) -> None:
    """What --per-layer measures: λ_max (lanczos_steps HVPs) and one trace method (trace_hvps), one layer at a
    time; the other measurements of the options are not made."""
    if len(o.trace_methods) > 1:
        raise CemtoolError("--per-layer takes one --trace-method", hint="e.g. --trace-method xtrace")
    if o.lanczos_steps == 0 and (o.trace_hvps == 0 or not o.trace_methods):
        raise CemtoolError("--per-layer with --lanczos-steps 0 and --trace-hvps 0 has nothing to measure")


def measure_per_layer(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, options: SharpnessOptions,
                      progress: Progress | None = None, blocks: str = "layer") -> list[LayerCurvature]:
    """For each parameter block (``blocks``: layer, kind or globs, curvature.blocks), λ_max (Lanczos, top 1) and
    the trace (``options.trace_methods[0]``, with its standard error) of the operator restricted to that block (the
    block A_SS, see Hessian), on the evaluation set (x, y). The same seeds for every block; budgets
    ``lanczos_steps`` and ``trace_hvps`` per block (0 skips)."""
    o = options
    check_per_layer(o)
    method = o.trace_methods[0] if o.trace_methods and o.trace_hvps > 0 else None
    budget = None if o.graph_memory is None else int(o.graph_memory * 2**30)
    out = []
    for blk in blocks_of(select_parameters(model, "all"), blocks):
        t0 = time.perf_counter()
        sel = f"layer:{blk.layer}" if blocks == "layer" else blk.spec
        with make_operator(o.operator, model, x, y, params=sel, dtype=o.dtype, device=o.device,
                           batch_size=o.batch_size, graph_budget=budget, vectors=max(o.lanczos_steps, o.trace_hvps),
                           hvp=o.hvp, mc_samples=o.mc_samples, seed=o.seed) as obj:
            eig = tr = None
            if o.lanczos_steps > 0:
                name, total = f"{blk.label}: λ_max (Lanczos)", min(o.lanczos_steps, obj.n)
                eig = lanczos(obj, 1, 0, max_steps=o.lanczos_steps, tol=o.tol, seed=o.seed,
                              callback=_stage_callback(progress, name, total))
                if progress is not None and eig.hvps < total:
                    progress(name, eig.hvps, eig.hvps)  # stopped early: the bar completes at what was done
            if method is not None:
                tr = TRACE_METHODS[method](obj, o.trace_hvps, seed=o.seed + 1,
                                           callback=_stage_callback(progress, f"{blk.label}: trace ({method})",
                                                                    o.trace_hvps))
            out.append(LayerCurvature(
                blk.layer, sel if blocks == "layer" else blk.label, obj.n, eig.lambda_max if eig else None,
                eig.top_error[0] if eig else None, eig.top_converged[0] if eig else None, eig.hvps if eig else 0,
                tr.trace if tr else None, tr.se if tr else None, tr.per_param if tr else None,
                tr.per_param_se if tr else None, method, tr.hvps if tr else 0, time.perf_counter() - t0,
                block=blk.label, kind=blk.kind))
    return out


def _stage_callback(progress: Progress | None, name: str, total: int) -> Callback:
    if progress is not None:
        progress(name, 0, total)
    return lambda done: progress(name, done, total) if progress is not None else None


PER_LAYER_COLUMNS = ["block", "layer", "kind", "n_params", "lambda_max", "lambda_max_error", "lambda_max_converged",
                     "trace", "trace_se", "trace_per_param", "trace_per_param_se", "trace_method", "lanczos_hvps",
                     "trace_hvps", "seconds"]


# --------------------------------------------------------------------------------------------------------------
# the analysis: Options and measure(subject, options)


@dataclass(frozen=True)
class Options(SharpnessOptions):
    """Everything ``cemtool sharpness`` measures with: the measurement's options (SharpnessOptions) and the
    evaluation tokens N (fixed validation windows; λ_max depends on N), and ``per_layer`` (one table: λ_max and
    tr(H) of each layer's block instead). ``device`` is the subject's (left None here)."""

    tokens: int = 2048
    per_layer: bool = False
    blocks: str | None = None  # layer | kind | globs: one table of the blocks' λ_max and trace (per_layer = layer)

    def __post_init__(self):
        check_types(self, "sharpness")
        at_least(self, "sharpness", tokens=1)  # the loss is a mean over tokens
        super().__post_init__()
        if self.per_layer and self.params != "all":
            raise CemtoolError("per_layer measures every layer:N in turn; leave out params (--params)")
        if self.blocks is not None:
            check_blocks(self.blocks)
            if self.per_layer and self.blocks != "layer":
                raise CemtoolError("per_layer is blocks=layer; give one of them")
            if self.params != "all":
                raise CemtoolError("blocks divide every parameter into groups; leave out params (--params)")

    @property
    def block_spec(self) -> str | None:
        """The blocks measured one at a time (None: the whole selection at once)."""
        return "layer" if self.per_layer else self.blocks

    def measurement(self, device: str) -> SharpnessOptions:
        """The options as the measurement (and its report's ``options``) records them."""
        return SharpnessOptions(**{f.name: getattr(self, f.name) for f in fields(SharpnessOptions)
                                   if f.name != "device"}, device=device)


def _slug(params: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", params).strip("-") or "subset"


def report_name(o: Options) -> str:
    """sharpness, sharpness-<params> for a subset, sharpness-per-layer for the per-layer table; another operator
    than the Hessian adds its name (sharpness-ggn, sharpness-ggn-per-layer, ...), so that reports of different
    operators never overwrite each other."""
    base = CARDS[o.operator].report
    if o.block_spec == "layer":
        return f"{base}-per-layer"
    if o.block_spec is not None:
        return f"{base}-blocks-{_slug(o.block_spec)}"
    return base if o.params == "all" else f"{base}-{_slug(o.params)}"


@dataclass
class PerLayerReport:
    """The per-layer table of one subject (``--per-layer``)."""

    options: SharpnessOptions
    layers: list[LayerCurvature]
    tokens: int
    seq_len: int
    arch: str
    seconds: float = 0.0

    blocks: str = "layer"

    def payload(self) -> dict:
        """``layers``: one row per block (a layer's, with --per-layer or blocks=layer)."""
        return {"options": asdict(self.options), "tokens": self.tokens, "seq_len": self.seq_len,
                "blocks": self.blocks, "layers": [asdict(r) for r in self.layers]}

    def rows(self) -> list[dict]:
        return [{c: getattr(r, c) for c in PER_LAYER_COLUMNS} for r in self.layers]

    def provenance(self) -> dict:
        return dict(seed=self.options.seed, analysis="sharpness_per_layer", backend="cemtool", arch=self.arch,
                    tokens=self.tokens, device=self.options.device, seq_len=self.seq_len)

    def files(self) -> dict[str, str]:
        what = "Per-layer" if self.blocks == "layer" else f"Per-block ({self.blocks})"
        return {".md": f"# {what} curvature, {self.options.operator} ({self.tokens:,} tokens, seed "
                       f"{self.options.seed})\n\n"
                       + markdown_table(self.rows(), PER_LAYER_COLUMNS)}


def measure(subject, options: Options | None = None, progress: Progress | None = None
            ) -> SharpnessReport | PerLayerReport:
    """The sharpness analysis of a subject (:class:`cemtool.subject.Subject`) on its first ``options.tokens``
    evaluation tokens: a SharpnessReport, or with ``per_layer`` a PerLayerReport."""
    o = options or Options()
    x, y = subject.eval_set(o.tokens)  # (n, T) inputs and targets
    m = o.measurement(subject.device)
    if o.block_spec is not None:
        t0 = time.perf_counter()
        layers = measure_per_layer(subject.model, x, y, m, progress=progress, blocks=o.block_spec)
        return PerLayerReport(m, layers, int(y.numel()), int(x.shape[1]), subject.arch, time.perf_counter() - t0,
                              blocks=o.block_spec)
    rep = measure_sharpness(subject.model, x, y, m, progress=progress, tokens_requested=o.tokens)
    rep.arch = subject.arch
    return rep


__all__ = ["LayerCurvature", "Options", "PerLayerReport", "Sharpness", "SharpnessOptions", "SharpnessReport",
           "Slice1D", "Slice2D", "asam_sharpness", "average_sharpness", "filter_normalized_direction",
           "loss_slice_1d", "loss_slice_2d", "measure", "measure_per_layer", "measure_sharpness", "report_name",
           "sam_sharpness", "worst_case_sharpness"]
