"""cemtool sharpness: Hessian spectrum, trace, density, sharpness measures and loss slices of a trained run."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.analysis.curvature import DEFAULT_OPERATOR, card, symbol, title
from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError, UsageError
from cemtool.fileio import read_json
from cemtool.writes import safe_name, to_json_value

QUICK = dict(tokens=1024, top_k=3, bottom_k=1, lanczos_steps=20, trace_hvps=20, density_runs=1, density_steps=20,
             avg_samples=2, slice_points=7, slice_points_2d=5)


class StageBar:
    """A rich progress bar with one task per measurement stage."""

    def __init__(self, quiet: bool):
        self.bar = console.progress(quiet)
        self.tasks: dict[str, int] = {}
        self.caps: dict[str, int] = {}  # the total each stage announced first

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def __call__(self, stage: str, done: int, total: int) -> None:
        """A stage that stops before its cap (Lanczos converged) is called with total = done: the bar completes
        there and says so, and its clock stops."""
        if stage not in self.tasks:
            self.tasks[stage] = self.bar.add_task(stage, total=max(total, 1), status="")
            if total == 0:
                self.bar.update(self.tasks[stage], completed=1, status="reused")
                return
        cap = self.caps.setdefault(stage, total)
        early = total < cap  # stopped before its cap: complete the bar at what was done
        self.bar.update(self.tasks[stage], completed=done, total=max(total, 1),
                        status=f"stopped early ({done} of {cap})" if early else "")


def _fmt(v, digits: int = 5) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _pm(v, se) -> str:
    return _fmt(v) if se is None else f"{_fmt(v)} ± {_fmt(se, 2)}"


def _summary(rep, header: str) -> list[list[str]]:
    """Rows of the stdout table: quantity, value (± uncertainty), cost/notes."""
    A = symbol(rep.options.operator)
    rows = [["operator", rep.options.operator, title(rep.options.operator)],
            ["loss (nats/token)", _fmt(rep.loss), f"{rep.tokens:,} tokens"],
            ["‖grad‖", _fmt(rep.grad_norm), ""]]
    st = rep.standing
    if st is not None:
        rows[-1][2] = f"‖g‖/√n = {_fmt(st.grad_norm_per_sqrt_n, 3)}"
        rows.append(["where it stands", st.verdict, st.reason])
        if st.negative_mass is not None:
            rows.append(["mass below 0 (SLQ)", _pm(st.negative_mass, st.negative_mass_se),
                         "fraction of the spectrum" + ("" if st.negative_mass_se is not None else " (1 run: no SE)")])
    e = rep.eigen
    if e is not None:
        for i, (v, r, ok) in enumerate(zip(e.top, e.top_error, e.top_converged, strict=True)):
            rows.append([f"λ_top[{i + 1}]" if i else "λ_max", f"{_fmt(v)} (err ≤~{_fmt(r, 2)})",
                         ("converged" if ok else "NOT converged") + (f", {e.hvps} HVPs" if i == 0 else "")])
        for i, (v, r, ok) in enumerate(zip(e.bottom, e.bottom_error, e.bottom_converged, strict=True)):
            rows.append([f"λ_bottom[{i + 1}]" if i else "λ_min", f"{_fmt(v)} (err ≤~{_fmt(r, 2)})",
                         "converged" if ok else "NOT converged (raise --lanczos-steps)"])
    for t in rep.traces:
        rows.append([f"tr({A}) {t.method}", _pm(t.trace, t.se), f"{t.hvps} products"])
        rows.append([f"tr({A})/n {t.method}", _pm(t.per_param, t.per_param_se), f"n = {t.n:,} parameters"])
    d = rep.density
    if d is not None:
        rows.append(["density (SLQ)", f"{d.runs} run(s) × {d.steps} steps", f"σ = {_fmt(d.sigma, 3)}, "
                     f"{d.hvps} new HVPs"])
    for s in rep.sharpness:
        name = {"sam": "SAM", "asam": "ASAM", "average": "average-case"}[s.kind]
        extra = f"ρ = {s.rho:g}" + (f", η = {s.eta:g}" if s.eta is not None else "")
        if s.ascent_steps > 1:
            name += f" ({s.ascent_steps} ascent steps)"
        if s.samples:
            extra += f", {s.samples} antithetic pairs"
        rows.append([f"sharpness {name}", _pm(s.value, s.se), extra])
    if rep.slice_1d is not None:
        sl = rep.slice_1d
        rows.append(["1-D slice", f"min {_fmt(min(sl.losses))}, max {_fmt(max(sl.losses))}",
                     f"{len(sl.alphas)} points, α ∈ ±{_fmt(max(sl.alphas), 3)}"])
    if rep.slice_2d is not None:
        flat = [v for row in rep.slice_2d.losses for v in row]
        rows.append(["2-D slice", f"min {_fmt(min(flat))}, max {_fmt(max(flat))}",
                     f"{len(rep.slice_2d.alphas)}² points"])
    return rows


def _given(ctx: typer.Context, option: str) -> bool:
    """Was the option (its Python name) given on the command line, rather than left at its default?"""
    source = ctx.get_parameter_source(option)
    return source is not None and source.name != "DEFAULT"


@app.command()
@guarded
def sharpness(
    ctx: typer.Context,
    run: Annotated[Path, typer.Argument(help="a run directory, a Hugging Face model directory, or "
                                             "hf:ORG/NAME[@REVISION]")],
    checkpoint: Annotated[str, typer.Option(help="final, latest, a step number, or a checkpoint file")] = "final",
    data: Annotated[Optional[str], typer.Option(help="evaluation data instead of the run's own: a built-in source, "
                                                "a .txt file/folder or token files, read with the model's tokenizer "
                                                "(Hugging Face models: default pydoc)")] = None,
    tokens: Annotated[int, typer.Option(help="evaluation tokens N (fixed validation windows); λ_max depends on "
                                              "it. Default 2048 (--quick: 1024)")] = 2048,
    batch_size: Annotated[Optional[int], typer.Option(help="sequences per batch (default: 8192 tokens per batch)",
                                                      min=1)] = None,
    graph_memory: Annotated[Optional[float], typer.Option(help="GiB of first-order graphs kept for reuse by the HVPs "
                                                          "(the only memory that grows with --tokens; 0 = none, "
                                                          "recompute each; default a quarter of the free memory)",
                                                          min=0.0)] = None,
    dtype: Annotated[str, typer.Option(help="HVP dtype: fp32 (default) or fp64 (a converted copy of the model)")]
    = "fp32",
    hvp: Annotated[str, typer.Option(help="Hessian-vector products: exact (double backward, default) or fd (central "
                                          "difference of two gradients: a gradient's memory, ~1e-9 relative error; "
                                          "needs --dtype fp64)")] = "exact",
    operator: Annotated[str, typer.Option(help="curvature operator: hessian (default), ggn (generalised Gauss-Newton, "
                                               "PSD), ef (empirical Fisher) or fisher (Monte-Carlo Fisher); see "
                                               "docs/sharpness.md")] = DEFAULT_OPERATOR,
    mc_samples: Annotated[int, typer.Option(help="label draws per token of --operator fisher (seeded by --seed; "
                                                 "default 1)", min=1)] = 1,
    params: Annotated[str, typer.Option(help="parameter subset: all, layer:N, attn, mlp, embed, or a glob on "
                                             "parameter names (comma-separated union); default all")] = "all",
    per_layer: Annotated[bool, typer.Option("--per-layer", help="one table instead: λ_max and tr(H) of each layer's "
                                                                "own block of the Hessian (layer:N, every N)")]
    = False,
    blocks: Annotated[Optional[str], typer.Option(help="one table instead: λ_max and trace of each block of the "
                                                      "operator: layer (= --per-layer), kind (q, k, v, o, mlp-in, "
                                                      "mlp-out, embed, norm per layer) or globs on parameter names "
                                                      "(comma-separated, each one block)")] = None,
    top_k: Annotated[int, typer.Option(help="largest eigenvalues (default 5)", min=0)] = 5,
    bottom_k: Annotated[int, typer.Option(help="smallest eigenvalues (default 1)", min=0)] = 1,
    lanczos_steps: Annotated[int, typer.Option(help="HVP cap of the eigenvalue Lanczos run (default 40)", min=0)]
    = 40,
    tol: Annotated[float, typer.Option(help="relative eigenvalue error at which Lanczos stops (default 1e-4)",
                                       min=0.0)] = 1e-4,
    trace_hvps: Annotated[int, typer.Option(help="HVPs per trace estimate, 0 = skip (default 40)", min=0)] = 40,
    trace_method: Annotated[str, typer.Option(help="xtrace (default), hutch++, hutchinson, or a comma list")]
    = "xtrace",
    density_runs: Annotated[int, typer.Option(help="SLQ runs, 0 = skip (default 1; the first continues the "
                                                   "eigenvalue run)", min=0)] = 1,
    density_steps: Annotated[int, typer.Option(help="Lanczos steps per SLQ run (default 40)", min=1)] = 40,
    density_sigma: Annotated[Optional[float], typer.Option(help="Gaussian smoothing of the density (default 1% of "
                                                                "the spectral spread)")] = None,
    sam_rho: Annotated[float, typer.Option(help="SAM radius ρ, 0 = skip (default 0.05)", min=0.0)] = 0.05,
    asam_rho: Annotated[float, typer.Option(help="adaptive (ASAM) radius, 0 = skip (default 0.5)", min=0.0)] = 0.5,
    asam_eta: Annotated[float, typer.Option(help="ASAM offset η in T_w = |w| + η (default 0.01)", min=0.0)] = 0.01,
    ascent_steps: Annotated[int, typer.Option(help="gradient steps of SAM/ASAM; 1 = first order only (default 1)",
                                              min=1)] = 1,
    avg_rho: Annotated[float, typer.Option(help="average-case adaptive radius, 0 = skip (default 0.1)", min=0.0)]
    = 0.1,
    avg_samples: Annotated[int, typer.Option(help="antithetic pairs of the average-case estimate, at least 2; "
                                                  "0 = skip (default 4)", min=0)] = 4,
    landscape: Annotated[str, typer.Option(help="loss slices: 1d (default), 2d, both, none")] = "1d",
    slice_points: Annotated[Optional[int], typer.Option(help="points per axis (default 21 for 1-D, 11 for 2-D)",
                                                        min=2)] = None,
    slice_span: Annotated[float, typer.Option(help="slice coordinates in [-span, span] (default 1)", min=0.0)]
    = 1.0,
    backend: Annotated[str, typer.Option(help="cemtool (default), or pyhessian to cross-check with PyHessian")]
    = "cemtool",
    seed: Annotated[int, typer.Option(help="seed of every random vector and direction (default 0)")] = 0,
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")] = "auto",
    quick: Annotated[bool, typer.Option("--quick", help="small budgets for the options not given: 1024 tokens, "
                                        "top-3, 20-step Lanczos, 20-HVP trace, 7-point slice")] = False,
    name: Annotated[Optional[str], typer.Option(help="report name (default sharpness, or sharpness-<params> for a "
                                                "subset; sharpness_pyhessian for --backend pyhessian)")] = None,
    plot: Annotated[bool, typer.Option("--plots/--no-plots", help="write figures to plots/ (default on)")] = True,
    no_plot: Annotated[bool, typer.Option("--no-plot", hidden=True, help="old spelling of --no-plots")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Measure the curvature of a trained model's loss: extreme Hessian eigenvalues (Lanczos, both ends), trace,
    spectral density (SLQ), SAM / ASAM / average-case sharpness and loss slices. Writes reports/<name>.json and
    .csv and figures into the run directory; prints a summary with the evaluation token count."""
    from cemtool.analysis.sharpness import check_per_layer  # start-up (torch)
    from cemtool.jobs import run_job  # start-up: torch loads when a command runs, not for --help

    if backend not in ("cemtool", "pyhessian"):
        raise typer.BadParameter("use cemtool or pyhessian", param_hint="--backend")
    if run.is_file():
        raise CemtoolError(f"{run} is a file, not a run directory", hint="pass the directory `cemtool train` made")
    given = dict(tokens=tokens, top_k=top_k, bottom_k=bottom_k, lanczos_steps=lanczos_steps, trace_hvps=trace_hvps,
                 density_runs=density_runs, density_steps=density_steps, avg_samples=avg_samples)
    if quick:  # small budgets for every option not given on the command line; a given one is kept as asked
        given.update({k: v for k, v in QUICK.items() if not _given(ctx, k)})
    if given["tokens"] <= 0:  # the option's own name (sharpness.Options says tokens)
        raise UsageError(f"--tokens must be positive, got {given['tokens']}", hint="the loss is a mean over tokens")
    _check_per_layer_usage(per_layer or blocks is not None, params, backend)
    opts = _options(  # validated before anything is loaded
        **{k: v for k, v in given.items() if k not in ("slice_points", "slice_points_2d")},
        params=params, dtype=dtype, batch_size=batch_size, tol=tol, per_layer=per_layer, blocks=blocks,
        trace_methods=tuple(m.strip() for m in trace_method.split(",") if m.strip()), density_sigma=density_sigma,
        sam_rho=sam_rho, asam_rho=asam_rho, asam_eta=asam_eta, ascent_steps=ascent_steps, avg_rho=avg_rho,
        landscape=landscape, slice_points=slice_points or (QUICK["slice_points"] if quick else 21),
        slice_points_2d=slice_points or (QUICK["slice_points_2d"] if quick else 11), slice_span=slice_span,
        seed=seed, graph_memory=graph_memory, hvp=hvp, operator=operator, mc_samples=mc_samples)
    if opts.block_spec:
        check_per_layer(opts)  # what --per-layer can measure: a plain error (exit 1), before anything is loaded
    if name is not None:
        safe_name(name, "--name")
    if backend == "pyhessian":
        _pyhessian(run, opts, checkpoint=checkpoint, data=data, device=device,
                   name=name or "sharpness_pyhessian", quiet=quiet, json_=json_)
        return

    def announce(subject) -> None:
        x, y = subject.eval_set(opts.tokens)
        console.info(f"{subject.run.path}  arch {subject.arch}  checkpoint {subject.checkpoint.name} (step "
                     f"{subject.step})  N = {y.numel():,} evaluation tokens ({x.shape[0]} windows × {x.shape[1]})  "
                     f"{dtype} on {subject.device}", quiet)

    t0 = time.perf_counter()
    with StageBar(quiet) as bar:
        res = run_job(run, "sharpness", opts, bar, checkpoint=checkpoint, device=device, data=data,
                      report_name=name, plots=plot and not no_plot, on_open=announce)
    if not res.written:  # every rank holds the same results; rank 0 alone writes and prints
        return
    if json_:
        console.print_json(to_json_value(res.payload))  # strict JSON: null for non-finite numbers, as in the report
        return
    if opts.block_spec:
        _print_per_layer(res, time.perf_counter() - t0)
        return
    rep, paths, figures = res.report, res.paths, res.figures
    console.table(f"sharpness of {rep.arch} ({rep.n_params:,} of {rep.n_model_params:,} parameters: {params}) on "
                  f"N = {rep.tokens:,} tokens", ["quantity", "value", "notes"], _summary(rep, ""))
    console.result(f"{rep.hvps} HVPs, {rep.evaluations} loss and {rep.gradients} gradient passes in "
                   f"{rep.seconds:.1f} s; N = {rep.tokens:,} tokens, seed {seed}")
    console.result(f"report: {paths['json']}  table: {paths['csv']}"
                   + (f"  figures: {', '.join(str(p) for p in figures if p.suffix == '.png')}" if figures else ""))
    for note in rep.notes:
        console.result(f"note: {note}")


def _check_per_layer_usage(per_layer: bool, params: str, backend: str) -> None:
    if per_layer and params != "all":
        raise typer.BadParameter("--per-layer and --blocks measure every block in turn; leave out --params",
                                 param_hint="--per-layer")
    if per_layer and backend != "cemtool":
        raise typer.BadParameter("--per-layer and --blocks are cemtool's own measurement", param_hint="--backend")


def _print_per_layer(res, seconds: float) -> None:
    """--per-layer: the table of each layer's λ_max and tr(H)."""
    layers, opts, A = res.report.layers, res.report.options, symbol(res.report.options.operator)
    rows = [[r.block or str(r.layer), f"{r.n_params:,}",
             "" if r.lambda_max is None else f"{_fmt(r.lambda_max)} (err ≤~{_fmt(r.lambda_max_error, 2)})",
             "" if r.lambda_max_converged is None else ("yes" if r.lambda_max_converged else "NOT converged"),
             _pm(r.trace, r.trace_se) if r.trace is not None else "",
             _pm(r.trace_per_param, r.trace_per_param_se) if r.trace is not None else "",
             f"{r.lanczos_hvps} + {r.trace_hvps}"] for r in layers]
    what = "per-layer" if res.report.blocks == "layer" else f"per-block ({res.report.blocks})"
    console.table(f"{what} curvature ({opts.operator}) of {res.report.arch} on N = {res.report.tokens:,} tokens "
                  f"(trace: {layers[0].trace_method or 'skipped'}, ± standard error)",
                  ["block", "parameters", "λ_max", "converged", f"tr({A})", f"tr({A})/n", "products"], rows)
    console.result(f"{len(layers)} blocks in {seconds:.1f} s; seed {opts.seed}")
    console.result(f"report: {res.paths['json']}  table: {res.paths['csv']}, {res.paths['md']}")


def _options(**options):
    """The measurement's options, every one from the command line: a value they refuse is a usage error (exit 2)."""
    from cemtool.analysis.sharpness import Options  # start-up (torch)

    try:
        return Options(**options)
    except UsageError:
        raise
    except CemtoolError as e:
        raise UsageError(e.message, hint=e.hint) from None


def _pyhessian(run: Path, opts, *, checkpoint: str, data: str | None, device: str, name: str, quiet: bool,
               json_: bool) -> None:
    """--backend pyhessian: PyHessian's eigenvalues(), trace() and density() on the same model and tokens (the
    cross-check backend, the analysis sharpness_pyhessian: reports/sharpness_pyhessian.json), beside cemtool's own
    report of the same tokens and parameters when there is one."""
    from cemtool.analysis.pyhessian_backend import require_pyhessian, steps_of  # optional dependency: PyHessian
    from cemtool.analysis.sharpness import report_name  # start-up (torch)
    from cemtool.jobs import run_job  # start-up: torch

    if not card(opts.operator).pyhessian:
        raise UsageError(f"--operator {opts.operator} is cemtool's own; PyHessian computes Hessian products only",
                         hint="drop --operator, or use --backend cemtool")
    if opts.hvp != "exact":
        raise UsageError("--hvp fd is cemtool's own HVP; PyHessian computes its products by double backward",
                         hint="drop --hvp, or use --backend cemtool")
    if opts.top_k + opts.trace_hvps + opts.density_runs == 0:
        raise UsageError("--backend pyhessian with --top-k 0, --trace-hvps 0 and --density-runs 0 has nothing "
                         "to measure")
    require_pyhessian()  # an optional extra: say which one before the model is loaded
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise CemtoolError("--backend pyhessian runs in one process", hint="run it without torchrun")

    def announce(subject) -> None:
        console.info(f"running PyHessian ({', '.join(steps_of(opts))}; power iteration, Hutchinson with its own "
                     "stopping rule, SLQ)", quiet)

    job = run_job(run, "sharpness_pyhessian", opts, checkpoint=checkpoint, device=device, data=data,
                  report_name=name, plots=False, on_open=announce)
    res, payload, paths, seconds, params = job.report.result, job.payload, job.paths, job.report.seconds, opts.params
    if json_:
        console.print_json(to_json_value(payload))
        return
    ours = None
    mine = job.subject.reports / f"{report_name(replace(opts, per_layer=False))}.json"
    if mine.exists():
        rep = read_json(mine, "report")
        if rep.get("tokens") == res.tokens and rep.get("options", {}).get("params") == params:
            ours = rep
    cols = ["quantity", "PyHessian", "HVPs"] + (["cemtool (reports)", "HVPs "] if ours else [])
    table = []
    for i, v in enumerate(res.eigenvalues):
        row = [f"eigenvalue {i + 1} (power iteration)", _fmt(v), str(res.eigen_hvps) if i == 0 else ""]
        if ours:
            top = (ours.get("eigen") or {}).get("top") or []
            row += [_fmt(top[i]) if i < len(top) else "", str(ours["eigen"]["hvps"]) if i == 0 and top else ""]
        table.append(row)
    if res.trace is not None:
        row = ["tr(H) Hutchinson", _pm(res.trace, res.trace_se), str(res.trace_hvps)]
        if ours and ours.get("traces"):
            t = ours["traces"][0]
            row += [f"{_pm(t['trace'], t['se'])} ({t['method']})", str(t["hvps"])]
        table.append(row)
    if res.density_nodes:
        table.append(["density (SLQ)", f"{len(res.density_nodes)} run(s)", str(res.density_hvps)]
                     + (["", ""] if ours else []))
    console.table(f"PyHessian {res.version} on N = {res.tokens:,} tokens ({res.n:,} parameters: {params})", cols,
                  table)
    for step, msg in res.errors.items():
        console.result(f"PyHessian {step}() failed: {msg}")
    if res.density_note:
        console.result(f"note: {res.density_note}")
    console.result(f"report: {paths['json']}  ({seconds:.1f} s; N = {res.tokens:,} tokens)")
    for note in payload["notes"]:
        console.result(f"note: {note}")
