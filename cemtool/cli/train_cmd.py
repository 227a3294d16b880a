"""cemtool train."""

from __future__ import annotations

import datetime as dt
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.config import resolve
from cemtool.errors import CemtoolError


class ProgressReporter:
    """Renders the training loop's events: a progress bar with loss, tokens/s and ETA, eval lines."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = console.progress(quiet)
        self.task = None
        self.floor = None
        self.t_rate: float | None = None
        self.tok_rate = 0
        self.rate: float | None = None

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def __call__(self, ev: dict) -> None:
        if ev["kind"] == "note":  # e.g. a corrupt checkpoint skipped on resume: shown even when quiet
            console.info(f"note: {ev['message']}")
        if ev["kind"] == "resume":  # where a resumed run continues: shown even when quiet
            console.info(f"resuming from step {ev['step']} ({ev['checkpoint']})" if ev["checkpoint"] else
                         "resuming from step 0: the run has no step checkpoint yet")
        if self.quiet:
            return
        kind = ev["kind"]
        if kind == "start":
            self.floor = ev.get("floor")
            p = ev["params"]
            floor = f", corpus floor {self.floor:.4f} nats/token" if self.floor is not None else ""
            self.bar.console.print(f"{p['total']:,} parameters ({p['non_embedding']:,} non-embedding) on "
                                   f"{ev['device']} x{ev['world']}; evaluating on {ev['eval_tokens']:,} "
                                   f"tokens{floor}", markup=False)
            self.task = self.bar.add_task("train", total=ev["total"], completed=ev["step"], status="")
        elif kind == "step" and self.task is not None:
            now = time.perf_counter()
            if self.t_rate is None or now - self.t_rate > 2.0:  # tokens/s over the last ~2 s
                if self.t_rate is not None:
                    self.rate = (ev["tokens"] - self.tok_rate) / (now - self.t_rate)
                self.t_rate, self.tok_rate = now, ev["tokens"]
            rate = f"{self.rate:,.0f} tok/s" if self.rate else "… tok/s"
            loss = f"loss {ev['loss']:.4f}  " if ev.get("loss") is not None else ""
            self.bar.update(self.task, completed=ev["step"], status=f"{loss}lr {ev['lr']:.2e}  {rate}")
        elif kind == "eval":
            gap = f"  gap {ev['val_gap']:+.4f}" if ev.get("val_gap") is not None else ""
            floor = f"  floor {ev['val_floor']:.4f}" if ev.get("val_floor") is not None else ""
            bpb = f"  ({ev['val_bpb']:.4f} bits/byte)" if ev.get("val_bpb") is not None else ""
            self.bar.console.print(f"step {ev['step']:>6}  val {ev['val_loss']:.4f}{bpb}{floor}{gap}  "
                                   f"epoch {ev['epochs']:.3g}", markup=False)
        elif kind == "curvature":  # train.curvature_every
            self.bar.console.print(curvature_line(ev), markup=False)


def curvature_line(ev: dict) -> str:
    """One line per curvature measurement: λ_max against 2/η (and Adam's preconditioned λ_max against its threshold)."""
    def num(key: str) -> str:
        return f"{ev[key]:.4g}" if isinstance(ev.get(key), (int, float)) else "n/a"

    line = f"step {ev['step']:>6}  λ_max {num('lambda_max')} (2/η {num('threshold_2_over_lr')})"
    if not ev.get("lambda_max_converged", True):
        line += f" not converged in {ev.get('lanczos_steps')} steps"
    if "lambda_max_lr_scaled" in ev:  # per-group rates: the sharpness 2/η bounds
        line += f"  λ_max(M½HM½) {num('lambda_max_lr_scaled')} (rates ×{'/'.join(f'{m:g}' for m in ev['lr_mults'])})"
    if "lambda_max_precond" in ev:
        line += f"  λ_max(P⁻¹H) {num('lambda_max_precond')} (Adam's threshold {num('threshold_adaptive')})"
    if "trace" in ev:
        line += f"  tr(H) {num('trace')} ± {num('trace_se')}"
    return line


def default_out(arch: str, seed: int) -> Path:
    return Path("runs") / f"{arch}-s{seed}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


class TrainCommand(TyperCommand):
    """``train``'s help lists the data sources registered in :mod:`cemtool.data.corpus` (filled in when the help is
    shown: importing the sources needs torch, which other commands' start-up should not pay for)."""

    def format_help(self, ctx, formatter):
        from cemtool.data.corpus import sources  # start-up: torch, only when this help is printed

        for p in self.params:
            if p.name == "data":
                p.help = (f"{', '.join(repr(s) for s in sources())} (a registered source; default 'grammar'), a "
                          ".txt file / folder of .txt files, or token files (.bin, .npy, a folder with train.bin and "
                          "val.bin)")
        return super().format_help(ctx, formatter)


@app.command(cls=TrainCommand)
@guarded
def train(
    arch: Annotated[Optional[str], typer.Option("--arch", "-a", help="architecture (see `cemtool archs`); "
                                                 "default baseline")] = None,
    data: Annotated[Optional[str], typer.Option("--data", "-d", help="a registered source (see --help), a .txt "
                                                "file / folder of .txt files, or token files (.bin, .npy, a folder "
                                                "with train.bin and val.bin)")] = None,
    config: Annotated[Optional[list[Path]], typer.Option("--config", "-c", help="TOML or JSON config file; "
                                                          "repeatable: composed in order, a later file overriding "
                                                          "an earlier one key by key")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="override: section.key=value "
                                                      "(repeatable), e.g. train.max_steps=500")] = None,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="run directory; default "
                                                "runs/<arch>-s<seed>-<time>")] = None,
    seed: Annotated[Optional[int], typer.Option(help="seed of init and batch order (default 0)")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")] = "auto",
    resume: Annotated[Optional[Path], typer.Option(help="continue this killed/interrupted run from its newest "
                                                   "checkpoint")] = None,
    force: Annotated[bool, typer.Option(help="if --out already holds a run, move it aside and start anew")] = False,
    match_params: Annotated[Optional[str], typer.Option(help="resize this architecture's width (and MLP width) to "
                                                         "the non-embedding parameters of an arch or run")] = None,
    match_flops: Annotated[Optional[str], typer.Option(help="resize to the training FLOPs/token of an arch or run")]
    = None,
    allow_data_change: Annotated[bool, typer.Option(help="with --resume: continue even though the run's data files "
                                                    "changed since it started")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Train a language model and write a self-describing run directory."""
    from cemtool.data.corpus import load_corpus  # start-up: torch loads when the command runs, not for --help
    from cemtool.start import start_or_resume
    from cemtool.tblog import check_log_to  # start-up: loaded when the command runs (docs/performance.md)
    from cemtool.train import pick_device  # start-up: torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    quiet = quiet or rank != 0
    dev = pick_device(device)
    if allow_data_change and resume is None:
        raise typer.BadParameter("only applies with --resume", param_hint="--allow-data-change")
    if resume is not None:
        if arch or data or config or set_ or seed is not None or out or force or match_params or match_flops:
            raise typer.BadParameter("--resume continues a run as configured; it takes no other config options",
                                     param_hint="--resume")
        what, corpus, extra = resume, None, None
    else:
        cfg = resolve(arch=arch, file=config, overrides=set_ or [], seed=seed, data_source=data)
        check_log_to(cfg.train.log_to)  # before the run is created
        if config and len(config) > 1:
            console.info(f"config: composed {' then '.join(map(str, config))} (a later file overrides an earlier "
                         f"one key by key; --set overrides them all)", quiet)
        if world > 1 and out is None:
            raise CemtoolError("under torchrun give --out so that every process agrees on the run directory")
        out = out or default_out(cfg.model.arch, cfg.seed)
        corpus = load_corpus(cfg.data)
        if match_params or match_flops:
            cfg = _matched(cfg, corpus, arch, config, set_, seed, data, match_params, match_flops, quiet)
        what, extra = cfg, {"world_size": world, "config_files": [str(c) for c in config or []]}

    def started(run, how: str) -> None:
        if run is not None and how == "new":
            console.info(f"run directory: {run.path}", quiet)

    with ProgressReporter(quiet) as rep:
        st = start_or_resume(what, out, device=dev, existing="replace" if force else "error", corpus=corpus,
                             extra_meta=extra, callback=rep, allow_data_change=allow_data_change, on_start=started)
    res, writer = st.result, st.run
    code = (143 if res.signal == "SIGTERM" else 130) if res.status == "interrupted" else 0  # 128 + the signal
    if rank != 0:
        if code:
            raise typer.Exit(code)
        return
    summary = {"run": str(writer.path), "status": res.status, "step": res.step, "tokens": res.tokens,
               "val_loss": res.val_loss, "val_bpb": res.val_bpb, "val_floor": res.val_floor,
               "gap": None if res.val_floor is None or res.val_loss is None else res.val_loss - res.val_floor,
               "seconds": round(res.seconds, 2)}
    if json_:
        console.print_json(summary)
    else:
        gap = f", floor {res.val_floor:.4f}, gap {summary['gap']:+.4f}" if res.val_floor is not None else ""
        vl = f"{res.val_loss:.4f}" if res.val_loss is not None else "n/a"
        vl += f" ({res.val_bpb:.4f} bits/byte)" if res.val_bpb is not None else ""
        console.result(f"{res.status}: {writer.path}  step {res.step}  val loss {vl}{gap}  "
                       f"({res.seconds:.1f} s)")
    if res.status == "interrupted":
        console.info(interrupted_line(res, writer.path))
        raise typer.Exit(code)


def _matched(cfg, corpus, arch, config, set_, seed, data, match_params, match_flops, quiet: bool):
    """--match-params / --match-flops: this architecture resized to the target's size, as a config."""
    from cemtool.analysis.compute import match_width, target_size  # start-up: torch

    by, ref = ("params", match_params) if match_params else ("flops", match_flops)
    target = target_size(ref, set_ or [], corpus.tokenizer.vocab_size, cfg.data.seq_len)
    best = match_width(target, by, cfg.model.arch, set_ or [])
    cfg = resolve(arch=arch, file=config, overrides=[*(set_ or []), *best["overrides"]], seed=seed, data_source=data)
    console.info(f"matched {by} of {ref}: {' '.join(best['overrides'])} ({best['rel_error']:+.2%})", quiet)
    return cfg


def interrupted_line(res, path: Path) -> str:
    """Where an interrupted run stands: the step it stopped at, its newest checkpoint, where --resume continues."""
    by = f" by {res.signal}" if res.signal else ""
    if res.resume_step is None:
        return (f"interrupted{by} at step {res.step}, before the first step checkpoint: cemtool train --resume "
                f"{path} starts from step 0")
    kept = f"checkpoint step_{res.resume_step:06d} written" if res.resume_step == res.step else \
        f"the newest checkpoint is step_{res.resume_step:06d}"
    return f"interrupted{by} at step {res.step}: {kept}; cemtool train --resume {path} continues from step " \
           f"{res.resume_step}"
