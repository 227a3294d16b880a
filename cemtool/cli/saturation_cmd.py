"""cemtool saturation: softmax saturation and head allocation (METHODS §4).

``cemtool saturation sweep``  trains small models over head sizes at a fixed budget and over sequence lengths;
``cemtool saturation RUN``    (short for ``cemtool saturation analyze RUN``) truncates a trained model's heads.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
from typer.core import TyperGroup

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError, UsageError
from cemtool.options import as_cli


class _RunOrCommand(TyperGroup):
    """``cemtool saturation RUN ...`` means ``cemtool saturation analyze RUN ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["analyze", *args]
        return super().parse_args(ctx, args)


sat_app = typer.Typer(cls=_RunOrCommand, no_args_is_help=True,
                      help="Softmax saturation (METHODS §4): `cemtool saturation sweep` trains over head sizes and "
                           "sequence lengths; `cemtool saturation RUN` truncates a trained run's heads to rank r "
                           "and writes allocation advice.")
app.add_typer(sat_app, name="saturation")


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=what) from None
    if not vals:
        raise typer.BadParameter("give at least one value", param_hint=what)
    return vals


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a comma-separated list of numbers") from None
    if not vals or not all(0 < v < 100 and v == v for v in vals):
        raise UsageError(f"{what} {text!r}: give learning rates in (0, 100)")
    return sorted(set(vals))


# --------------------------------------------------------------------------------------------------------------
# trained-model mode


@sat_app.command("analyze")
@guarded
def analyze(
    run: Annotated[Path, typer.Argument(help="a run directory, a Hugging Face model directory, or "
                                             "hf:ORG/NAME[@REVISION]")],
    checkpoint: Annotated[str, typer.Option(help="final, latest, a step number or a file")] = "final",
    data: Annotated[Optional[str], typer.Option(help="evaluation data instead of the run's own: a built-in source, "
                                                "a .txt file/folder or token files, read with the model's tokenizer "
                                                "(Hugging Face models: default pydoc)")] = None,
    tokens: Annotated[int, typer.Option(help="evaluation tokens from the validation split (whole windows)")] = 8192,
    ranks: Annotated[Optional[str], typer.Option(help="comma-separated ranks r; default 0, powers of two, d_h")]
    = None,
    basis: Annotated[str, typer.Option(help="factors of the score form: auto, weights or data (see docs)")]
    = "auto",
    tolerance: Annotated[float, typer.Option(help="loss increase (nats) a layer may take at its tolerated rank")]
    = 0.01,
    per_head: Annotated[bool, typer.Option("--per-head/--layers-only", help="also truncate one head at a time")]
    = True,
    batch_size: Annotated[int, typer.Option(help="windows per forward pass")] = 32,
    name: Annotated[str, typer.Option(help="report name: reports/<name>.json and reports/<name>_advice.toml; "
                                      "analyses under other settings keep their own names")] = "saturation",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps")] = "auto",
    no_plots: Annotated[bool, typer.Option("--no-plots", help="skip the figures")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the per-layer result as JSON")] = False,
) -> None:
    """Truncate every head's W_Q W_Kᵀ to rank r, record the loss increase, the logit spread vs context length,
    which layers tolerate low rank, and a per-layer (heads, head_dims) schedule at the same budget."""
    from cemtool.analysis.saturation import Options  # start-up: torch loads when the command runs
    from cemtool.jobs import run_job

    rank_list = _ints(ranks, "--ranks") if ranks else None
    try:
        opts = Options(tokens=tokens, ranks=tuple(rank_list) if rank_list else None, basis=basis,
                       tolerance=tolerance, per_head=per_head, batch_size=batch_size)
    except CemtoolError as e:
        message, flag = as_cli(e.message, Options, "saturation")
        raise typer.BadParameter(message, param_hint=flag or "--ranks") from None
    with console.progress(quiet) as bar:
        tasks: list = []  # the bar's task, added once the model is open (an error before it prints alone)

        def progress(stage: str, done: int, total: int) -> None:
            if not tasks:
                tasks.append(bar.add_task("truncation", total=None, status=""))
            bar.update(tasks[0], completed=done, total=total, status=stage)

        res = run_job(run, "saturation", opts, progress,
                      checkpoint=checkpoint, device=device, data=data, report_name=name, plots=not no_plots,
                      provenance_extra={"name": name})
    if not res.written:  # every rank holds the same results; rank 0 alone writes and prints
        return
    result, advice, paths = res.report.result, res.report.advice, res.paths
    advice_path, replaced = paths.get("advice.toml"), res.replaced
    if json_:
        console.print_json({"base_loss": result["base_loss"], "layers": [
            {k: e[k] for k in ("layer", "heads", "head_dim", "truncation", "basis", "ranks", "layer_loss_increase",
                               "tolerated_rank")} for e in result["layers"]], "advice": advice})
        return
    all_ranks = sorted({r for e in result["layers"] for r in e["ranks"]})
    body = []
    for e in result["layers"]:
        inc = dict(zip(e["ranks"], e["layer_loss_increase"], strict=True))
        body.append([e["layer"], f"{e['heads']}x{e['head_dim']}", *[f"{inc[r]:+.4f}" if r in inc else ""
                                                                    for r in all_ranks], e["tolerated_rank"]])
    console.table(f"loss increase (nats) when every head of a layer is truncated to rank r; base loss "
                  f"{result['base_loss']:.4f} on {result['tokens']:,} tokens",
                  ["layer", "H x d_h", *[f"r={r}" for r in all_ranks], "tolerated r"], body)
    kinds = sorted({f"{e['truncation']} / basis {e['basis']}" for e in result["layers"]})
    console.result(f"truncation: {'; '.join(kinds)}; tolerated r = smallest rank within {tolerance} nats")
    for k, why in result["not_applicable"].items():
        console.result(f"layer {k}: {why}" if k.isdigit() else why)
    if advice["applicable"]:
        console.result(f"advice (budget {advice['budget']} -> {advice['new_budget']}): heads {advice['heads']}, "
                       f"head_dims {advice['head_dims']}  ->  {advice_path}: this run's config with only the "
                       f"allocation changed (cemtool train --config {advice_path})")
    else:
        console.result(f"advice: {advice['why']}")
    console.result(f"wrote {paths['json']} (+ .csv)")
    if replaced:
        console.result(f"note: {replaced}")


# --------------------------------------------------------------------------------------------------------------
# experiment mode


def _print_sweep(summary: list[dict], spec) -> None:
    """The sweep's table (loss ± s.e., floor and gain per doubling, per T and d_h) and its saturation points."""
    body = []
    for s in summary:
        for pt in s["points"]:
            g = pt.get("gain_per_doubling")
            body.append([s["seq_len"], pt["head_dim"], spec.heads or spec.budget // pt["head_dim"],
                         f"{pt['loss']:.4f}" + (f" ± {pt['se']:.4f}" if pt["se"] is not None else ""),
                         "-" if pt["floor"] is None else f"{pt['floor']:.4f}", "-" if g is None else f"{g:+.4f}"])
    at = f"H = {spec.heads} heads" if spec.heads else f"budget H*d_h = {spec.budget}"
    console.table(f"final validation loss vs head size at {at} ({spec.data}, {spec.steps} steps, "
                  f"{len(spec.seeds)} seed(s))", ["T", "d_h", "H", "loss ± s.e.", "floor", "gain/doubling"], body)
    for s in summary:
        sat = s["saturation_head_dim"]
        console.result(f"T = {s['seq_len']}: " + (f"saturates at d_h = {sat} (no larger d_h gains {spec.threshold} "
                                                  f"nats per doubling)" if sat else
                                                  f"no saturation within the grid (a larger d_h still gains >= "
                                                  f"{spec.threshold} nats per doubling)"))


@sat_app.command("sweep")
@guarded
def sweep(
    head_dims: Annotated[str, typer.Option(help="comma-separated head sizes d_h (each divides the budget)")]
    = "2,4,8,16",
    budget: Annotated[Optional[int], typer.Option(help="attention budget H*d_h per layer (H = budget / d_h); "
                                                       "default 16 unless --heads")] = None,
    heads: Annotated[Optional[int], typer.Option(help="a fixed head count H for every d_h instead of a fixed "
                                                      "budget (the budget H*d_h then grows with d_h)")] = None,
    seq_lens: Annotated[str, typer.Option(help="comma-separated sequence lengths T")] = "16,64",
    seeds: Annotated[str, typer.Option(help="comma-separated training seeds")] = "0,1",
    steps: Annotated[int, typer.Option(help="optimizer steps per model")] = 300,
    d_model: Annotated[int, typer.Option(help="model width")] = 32,
    n_layer: Annotated[int, typer.Option(help="layers")] = 1,
    lr: Annotated[float, typer.Option(help="peak learning rate")] = 1e-2,
    lrs: Annotated[Optional[str], typer.Option(help="comma-separated learning rates: tune one per (T, d_h) on "
                                                    "--tune-seeds (lowest mean final loss), then train --seeds at "
                                                    "it (instead of --lr)")] = None,
    tune_seeds: Annotated[str, typer.Option("--tune-seeds", help="seeds of the lr tuning (disjoint from --seeds)")]
    = "100,101",
    batch_tokens: Annotated[int, typer.Option(help="tokens per step (batch = this / T, the same for every T)")]
    = 1024,
    data: Annotated[str, typer.Option(help="'ngram' (built-in n-gram rule over white noise) or any data source")]
    = "ngram",
    arch: Annotated[str, typer.Option(help="architecture trained at every grid point")] = "baseline",
    train_tokens: Annotated[int, typer.Option(help="training tokens generated (synthetic sources)")] = 200_000,
    eval_tokens: Annotated[int, typer.Option(help="validation tokens of the final loss")] = 4096,
    threshold: Annotated[float, typer.Option(help="gain per doubling of d_h (nats) below which d_h saturates")]
    = 0.01,
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="extra config override for every "
                                                      "model, e.g. model.pos=learned")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="sweep folder; default "
                                                "runs/saturation-sweep-<time>")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps")] = "auto",
    no_plots: Annotated[bool, typer.Option("--no-plots", help="skip the figure")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Train over head sizes at a fixed budget H*d_h and over sequence lengths; loss vs d_h per T, the gain per
    doubling of d_h and the saturation point. Completed grid points in --out are reused (resume)."""
    import cemtool.data.synthetic  # noqa: F401  (start-up: registers the ngram source; torch loads when it runs)
    from cemtool.report import write_report  # start-up: loaded when the command runs (docs/performance.md)
    from cemtool.saturation_sweep import SweepSpec, run_sweep  # start-up: torch
    from cemtool.train import pick_device  # start-up: torch

    for name, v in (("--budget", budget), ("--heads", heads), ("--steps", steps), ("--d-model", d_model),
                    ("--n-layer", n_layer), ("--batch-tokens", batch_tokens), ("--eval-tokens", eval_tokens)):
        if v is not None and v < 1:
            raise typer.BadParameter(f"{v} must be >= 1", param_hint=name)
    if not threshold >= 0:
        raise typer.BadParameter(f"{threshold} must be >= 0", param_hint="--threshold")
    spec = SweepSpec(_ints(head_dims, "--head-dims"), _ints(seq_lens, "--seq-lens"), _ints(seeds, "--seeds"),
                     budget=budget, heads=heads, steps=steps, d_model=d_model, n_layer=n_layer, lr=lr,
                     lrs=_floats(lrs, "--lrs") if lrs else None,
                     tune_seeds=_ints(tune_seeds, "--tune-seeds") if lrs else [], batch_tokens=batch_tokens,
                     data=data, arch=arch, train_tokens=train_tokens, eval_tokens=eval_tokens, threshold=threshold,
                     extra=list(set_ or []))
    points, tune = spec.grids()
    root = out or Path("runs") / f"saturation-sweep-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if root.exists() and not root.is_dir():
        raise CemtoolError(f"--out {root} exists and is not a directory")
    console.info(f"sweep folder: {root} ({len(tune)} tuning + {len(points)} models)" if tune else
                 f"sweep folder: {root} ({len(points)} models)", quiet)
    with console.progress(quiet) as bar:
        task = bar.add_task("sweep", total=(len(points) + len(tune)) * steps, status="")
        payload = run_sweep(spec, root, pick_device(device),
                            progress=lambda done, total, status: bar.update(task, completed=done, status=status))
    paths = write_report(root / "reports", "saturation_sweep", payload, payload["results"])
    if not no_plots:
        from cemtool.plots.saturation import plot_sweep  # start-up: matplotlib

        plot_sweep(payload, root / "plots")
    if json_:
        console.print_json(payload["summary"])
        return
    _print_sweep(payload["summary"], spec)
    console.result(f"wrote {paths['json']} (+ .csv)")
