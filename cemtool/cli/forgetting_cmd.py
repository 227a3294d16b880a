"""cemtool forgetting: fine-tune a trained run on a second corpus and measure forgetting and plasticity."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded, hold_run
from cemtool.cli.train_cmd import ProgressReporter


def _f(v, digits: int = 4) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def print_report(rep: dict) -> None:
    """The before/after table, forgetting and plasticity (stdout)."""
    b, a = rep["before"], rep["after"]
    src, tgt = rep["source"], rep["target"]
    rows = [[f"source ({src['data']})", _f(b["source_loss"]), _f(a["source_loss"]),
             f"{a['source_loss'] - b['source_loss']:+.4f}", _f(src["floor"]), f"{src['eval_tokens']:,}"],
            [f"target ({tgt['data']})", _f(b["target_loss"]), _f(a["target_loss"]),
             f"{a['target_loss'] - b['target_loss']:+.4f}", _f(tgt["floor"]), f"{tgt['eval_tokens']:,}"]]
    r = rep["recipe"]
    console.table(f"fine-tune of {src['arch']} ({src['run']}) for {r['steps']} steps: validation loss (nats/token)",
                  ["data", "before", "after", "change", "floor", "eval tokens"], rows)
    console.result(f"forgetting {rep['forgetting']:+.4f}   plasticity {rep['plasticity']:+.4f}   "
                   f"({len(rep['curve'])} curve points, every {r['eval_every']} steps)")
    console.result(f"recipe: AdamW lr {r['lr']:g}, betas {r['beta1']}/{r['beta2']}, wd {r['weight_decay']:g}, "
                   f"{r['warmup_steps']} warmup steps, {r['schedule']} to {r['min_lr_ratio']:g}x, clip "
                   f"{r['grad_clip']:g}, {r['tokens_per_step']:,} tokens/step")


@app.command()
@guarded
def forgetting(
    run: Annotated[Path, typer.Argument(help="the trained source run (only read, never modified), a Hugging Face "
                                             "model directory or hf:ORG/NAME[@REVISION]")],
    to: Annotated[str, typer.Option("--to", help="target data: grammar-b (for grammar runs), pydoc or a .txt "
                                                 "file/folder (for byte/BPE text runs)")],
    data: Annotated[Optional[str], typer.Option(help="the source data A whose loss is followed: default the run's "
                                                "own; pydoc for a Hugging Face model (read with its tokenizer)")]
    = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="the new fine-tune run directory; default "
                                                "<run>-ft-<target> beside the source")] = None,
    steps: Annotated[Optional[int], typer.Option(help="fine-tuning steps; default min(1000, ceil(source steps "
                                                      "/ 4))", min=1)] = None,
    warmup: Annotated[Optional[int], typer.Option(help="warmup steps; default 5% of the steps (reference 50 of "
                                                       "1000)", min=0)] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="evaluate both losses every K steps; default "
                                                           "ceil(steps / 20)", min=1)] = None,
    step_fraction: Annotated[float, typer.Option(help="default steps = ceil(this x source steps), capped at 1000 "
                                                      "(0.03: the TMM paper's ~3% of the pretraining tokens)",
                                                 min=0.0, max=1.0)] = 0.25,
    lr: Annotated[float, typer.Option(help="peak learning rate (reference 1e-4)", min=0.0)] = 1e-4,
    lr_scale: Annotated[Optional[float], typer.Option(help="peak lr = this x the source run's train.lr, instead of "
                                                           "--lr", min=0.0)] = None,
    beta1: Annotated[float, typer.Option(help="AdamW beta1 (reference 0.9)", min=0.0, max=1.0)] = 0.9,
    beta2: Annotated[float, typer.Option(help="AdamW beta2 (reference 0.95)", min=0.0, max=1.0)] = 0.95,
    weight_decay: Annotated[float, typer.Option(help="AdamW weight decay (reference 0.01)", min=0.0)] = 0.01,
    min_lr_ratio: Annotated[float, typer.Option(help="cosine floor as a fraction of lr (reference 0.1)", min=0.0,
                                                max=1.0)] = 0.1,
    grad_clip: Annotated[float, typer.Option(help="gradient-norm clip, 0 = off (reference 1.0)", min=0.0)] = 1.0,
    eval_tokens: Annotated[Optional[int], typer.Option(help="validation tokens per evaluation, each corpus; "
                                                            "default the source run's train.eval_tokens", min=1)]
    = None,
    checkpoint: Annotated[str, typer.Option(help="source checkpoint: final, latest, a step number or a file")]
    = "final",
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")] = "auto",
    resume: Annotated[bool, typer.Option(help="continue an interrupted fine-tune in --out (same options)")]
    = False,
    force: Annotated[bool, typer.Option(help="if --out already holds a run, move it aside and start anew")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Fine-tune RUN on other data with one fixed recipe (METHODS §7) and report forgetting = L_source(after) -
    L_source(before) and plasticity = L_target(before) - L_target(after), with both curves. Writes a NEW run
    (meta.json "parent" = RUN) holding reports/forgetting.json and .csv. Under torchrun the fine-tune trains
    data-parallel and the evaluations are sharded; rank 0 alone writes and prints."""
    from cemtool.distributed import init_distributed  # start-up: torch
    from cemtool.forgetting import Options, fine_tune  # start-up: torch
    from cemtool.train import pick_device  # start-up: torch

    if resume and force:
        raise typer.BadParameter("--resume continues --out, --force replaces it: choose one", param_hint="--force")
    dev = pick_device(device)
    main = init_distributed(dev).main
    quiet = quiet or not main
    opts = Options(steps=steps, warmup_steps=warmup, eval_every=eval_every, eval_tokens=eval_tokens,
                   checkpoint=checkpoint, step_fraction=step_fraction, lr_scale=lr_scale, lr=lr, beta1=beta1,
                   beta2=beta2, weight_decay=weight_decay,
                   min_lr_ratio=min_lr_ratio, grad_clip=grad_clip)  # the fine-tune's own checks (forgetting.Options)
    hold_run(run)  # shared: train --force cannot move the source run aside while it is fine-tuned from
    with ProgressReporter(quiet) as rep:
        def progress(ev: dict) -> None:
            rep(ev)
            if ev["kind"] == "source_eval" and not quiet:
                rep.bar.console.print(f"step {ev['step']:>6}  source val {ev['source_loss']:.4f}", markup=False)

        payload = fine_tune(run, to, out, data=data, **opts.schedule(), recipe=opts.recipe(), device=dev,
                            resume=resume, force=force, callback=progress, argv=sys.argv)
    if not main:  # every rank holds the same report; rank 0 alone prints
        return
    if json_:
        console.print_json(payload)
        return
    print_report(payload)
    console.result(f"report: {Path(payload['provenance']['run']) / 'reports' / 'forgetting.json'} (+ .csv)")
