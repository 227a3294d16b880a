"""cemtool demo: the main job in one command, in one process, on the built-in corpus.

Two contrasting architectures (by default the pre-norm ``baseline`` and the triple-momentum stream ``tmm``) x two
seeds are trained on the same tokens of the grammar corpus (exact entropy floor), then each run gets the
analyses at small settings (sharpness with the spectral density and loss slices, the Hessian of each layer's
parameters, collapse report, forgetting on ``grammar-b``), the runs are compared, and every figure and report.md
is drawn. Each step is a call of the Python function behind the corresponding command:

    1. train + sharpness + collapse + forgetting   cemtool.sweep.run_sweep          (cemtool sweep)
    2. curvature per layer                         jobs.run_job(RUN, "sharpness", ...)  (sharpness --params layer:N)
    3. compare                                     analysis.compare.compare, compare_tables.write_compare
    4. plot                                        plots.render.render_all            (cemtool plot)

The output folder is a study directory: running the demo again there continues it (finished steps are reused).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.cli.compare_cmd import print_compare
from cemtool.cli.sweep_cmd import SweepReporter
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json

# The settings, passed explicitly (sized so that the whole demo takes < 5 min on 2 CPU cores; see docs/demo.md).
FULL = {
    "archs": "baseline,tmm", "seeds": "0,1", "tokens": 400 * 32 * 64,  # 400 steps of 32 x 64 tokens
    "overrides": ["model.d_model=64", "model.n_layer=2", "model.n_head=4", "data.seq_len=64", "train.batch_size=32",
                  "train.warmup_steps=20", "train.eval_every=50", "train.eval_tokens=8192", "train.log_every=10",
                  "data.train_tokens=1000000", "data.val_tokens=32768"],
    "sharpness": {"tokens": 2048, "top_k": 3, "bottom_k": 1, "lanczos_steps": 40, "trace_hvps": 40,
                  "density_runs": 1, "density_steps": 30, "avg_samples": 2, "landscape": "both",
                  "slice_points": 11, "slice_points_2d": 7},
    "layers": {"tokens": 2048, "top_k": 1, "bottom_k": 1, "lanczos_steps": 30, "trace_hvps": 20,
               "density_runs": 0, "sam_rho": 0.0, "asam_rho": 0.0, "avg_rho": 0.0, "landscape": "none"},
    "collapse": {"tokens": 4096, "per_class": 64, "folds": 5, "batch_size": 16},  # enough of is/are/was/were
    "forgetting": {"steps": 30, "eval_every": 5, "eval_tokens": 4096},
}
QUICK = {
    "archs": "baseline,tmm", "seeds": "0,1", "tokens": 24 * 8 * 16,
    "overrides": ["model.d_model=16", "model.n_layer=2", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
                  "train.warmup_steps=3", "train.eval_every=12", "train.eval_tokens=256", "train.log_every=4",
                  "data.train_tokens=20000", "data.val_tokens=4000"],
    "sharpness": {"tokens": 128, "top_k": 2, "bottom_k": 1, "lanczos_steps": 8, "trace_hvps": 4,
                  "density_runs": 1, "density_steps": 8, "avg_samples": 2, "landscape": "both",
                  "slice_points": 5, "slice_points_2d": 3},
    "layers": {"tokens": 128, "top_k": 1, "bottom_k": 1, "lanczos_steps": 6, "trace_hvps": 4, "density_runs": 0,
               "sam_rho": 0.0, "asam_rho": 0.0, "avg_rho": 0.0, "landscape": "none"},
    "collapse": {"tokens": 256, "per_class": 16, "folds": 2, "batch_size": 16},
    "forgetting": {"steps": 6, "eval_every": 3, "eval_tokens": 256},
}


class Clock:
    """Wall-clock and CPU (process) seconds of each step; ``reused`` marks a step whose results were all there
    already (a demo run again on its folder), so that its time is not taken for the time the work takes."""

    def __init__(self):
        self.steps: list[dict] = []
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()

    def step(self, name: str, fn, *args, reused: bool = False, **kwargs):
        w, c = time.perf_counter(), time.process_time()
        result = fn(*args, **kwargs)
        self.steps.append({"step": name, "wall_s": time.perf_counter() - w, "cpu_s": time.process_time() - c,
                           "reused": reused})
        return result

    def total(self) -> dict:
        return {"wall_s": time.perf_counter() - self.wall0, "cpu_s": time.process_time() - self.cpu0}


# --------------------------------------------------------------------------------------------------------------
# the steps (each a call of another command's Python function)


def demo_plan(settings: dict, archs: str, seeds: str):
    """The study plan: every run trains on the same tokens; sharpness, collapse and forgetting at small settings."""
    from cemtool.sweep import make_plan  # start-up: torch

    return make_plan(archs, seeds, tokens=settings["tokens"], data="grammar", overrides=settings["overrides"],
                     analyses="sharpness,collapse,forgetting", target="grammar-b",
                     options={k: settings[k] for k in ("sharpness", "collapse", "forgetting")})


def study_step(out: Path, plan, device: str, quiet: bool) -> dict:
    """Train every architecture x seed and run its analyses (``cemtool sweep``)."""
    from cemtool.sweep import run_sweep  # start-up: torch

    with SweepReporter(quiet) as rep:
        manifest = run_sweep(out, plan, device=device, callback=rep)
    failed = [f"{it['name']}: {it['error']}" for it in manifest["items"] if it["status"] == "failed"]
    failed += [f"{it['name']} {n}: {a['error']}" for it in manifest["items"] for n, a in it["analyses"].items()
               if a["status"] == "failed"]
    if failed:
        raise CemtoolError(f"{len(failed)} part(s) of the demo failed; first: {failed[0]}",
                           hint=f"see {out / 'study.json'}; rerun the demo to retry them")
    return manifest


def layer_sharpness(run: Path, layer: int, options: dict, device: str) -> Path:
    """``cemtool sharpness RUN --params layer:N`` at the given settings -> reports/sharpness-layer-N.json (an
    existing report is kept, as the study keeps its own)."""
    from cemtool.analysis.sharpness import Options  # start-up: torch loads when the demo runs
    from cemtool.jobs import run_job

    name = f"sharpness-layer-{layer}"
    path = run / "reports" / f"{name}.json"
    if path.exists():
        return path
    res = run_job(run, "sharpness", Options(params=f"layer:{layer}", **options), device=device, report_name=name,
                  plots=False, provenance_extra={"command": "demo"}, hold=False)
    return res.paths["json"]


def layers_step(out: Path, manifest: dict, options: dict, device: str, quiet: bool) -> list[Path]:
    from cemtool.runs import open_run  # start-up: loaded when the command runs (docs/performance.md)

    written = []
    for it in manifest["items"]:
        run = out / it["run"]
        n_layer = open_run(run).config().model.n_layer
        for layer in range(n_layer):
            written.append(layer_sharpness(run, layer, options, device))
        console.info(f"  {it['name']} curvature per layer: {n_layer} layers", quiet)
    return written


def compare_step(out: Path) -> dict:
    """``cemtool compare OUT``: the table over architectures, correlations, pairwise differences."""
    from cemtool.analysis.compare import compare  # start-up: torch
    from cemtool.analysis.compare_tables import write_compare  # start-up: torch

    payload = compare([out])
    write_compare(payload, out)
    return payload


def plot_step(out: Path, each_run: bool = True) -> tuple[list[Path], list[str]]:
    """``cemtool plot OUT`` (``--no-each-run`` when not ``each_run``): every figure and report.md."""
    from cemtool.plots.render import render_all  # start-up: matplotlib

    problems: list[str] = []
    return render_all(out, problems, each_run=each_run), problems


def timed_steps(steps: list[dict], previous: dict | None) -> list[dict]:
    """This session's steps, a reused one (its results were there already) replaced by the time it took in the
    session that did the work (``previous``: the demo.json written then), with this session's seconds beside it
    (``rerun_wall_s``)."""
    done = {st["step"]: st for st in (previous or {}).get("steps") or [] if isinstance(st, dict)
            and isinstance(st.get("wall_s"), (int, float))}
    out = []
    for st in steps:
        before = done.get(st["step"])
        if st.get("reused") and before is not None:
            out.append({**before, "reused": True, "rerun_wall_s": st["wall_s"],
                        "measured": before.get("measured") or (previous.get("provenance") or {}).get("created")})
        else:
            out.append(st)
    return out


def write_timing(out: Path, clock: Clock, settings: dict, quick: bool) -> Path:
    """reports/demo.json: the seconds of each step and in all. A step this session reused keeps the seconds of the
    session that did it (:func:`timed_steps`); ``total`` is then their sum, and ``this_session`` what this session
    took."""
    import torch  # start-up: torch

    from cemtool.report import provenance, write_report  # start-up: loaded when the command runs (docs/performance.md)

    path = out / "reports" / "demo.json"
    try:
        previous = read_json(path, "demo timing") if path.is_file() else None
    except CemtoolError:
        previous = None
    steps = timed_steps(clock.steps, previous if isinstance(previous, dict) else None)
    session = clock.total()
    total = session
    if any(st.get("reused") for st in steps):
        total = {k: sum(st[k] for st in steps) for k in ("wall_s", "cpu_s")}
    payload = {"provenance": provenance(out, command="demo", quick=quick), "threads": torch.get_num_threads(),
               "cpu_count": os.cpu_count(), "steps": steps, "total": total, "this_session": session,
               "settings": settings}
    return write_report(out / "reports", "demo", payload)["json"]


def all_done(out: Path, plan) -> bool:
    """Every item of the demo's study (and its analyses) finished before this session: the study step reuses it."""
    from cemtool.sweep import open_study  # start-up: torch

    items = open_study(out, plan).manifest["items"]
    return bool(items) and all(it["status"] == "completed" and all(a["status"] == "completed"
                                                                   for a in it["analyses"].values()) for it in items)


def layers_done(out: Path, manifest: dict) -> bool:
    from cemtool.runs import open_run  # start-up: loaded when the command runs (docs/performance.md)

    return all((out / it["run"] / "reports" / f"sharpness-layer-{k}.json").exists()
               for it in manifest["items"] for k in range(open_run(out / it["run"]).config().model.n_layer))


# --------------------------------------------------------------------------------------------------------------
# the command


@app.command()
@guarded
def demo(
    out: Annotated[Path, typer.Option("--out", "-o", help="the demo's folder (a study directory; running the demo "
                                      "again there continues it)")] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option("--quick", help="tiny settings (width 16, 24 steps) and only the demo "
                                        "folder's own figures (not each run's): a smoke test")] = False,
    archs: Annotated[Optional[str], typer.Option(help="comma-separated architectures to contrast (default "
                                                 "baseline,tmm)")] = None,
    seeds: Annotated[Optional[str], typer.Option(help="comma-separated seeds (default 0,1)")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")] = "auto",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
) -> None:
    """Train two contrasting architectures (2 seeds each) on the built-in grammar corpus, measure sharpness,
    curvature per layer, representation collapse and forgetting at small settings, compare them and draw every
    figure; under 5 minutes on 2 CPU cores (docs/demo.md). Prints where report.md is."""
    settings = dict(QUICK if quick else FULL)
    settings["archs"] = archs or settings["archs"]
    settings["seeds"] = seeds or settings["seeds"]
    if out.exists() and not out.is_dir():
        raise CemtoolError(f"--out {out} exists and is not a directory", hint="choose another --out")
    from cemtool.sweep import open_study  # start-up: torch
    from cemtool.train import pick_device  # start-up: torch

    pick_device(device)  # an unavailable device is refused before the demo says anything or creates its folder
    clock = Clock()
    plan = demo_plan(settings, settings["archs"], settings["seeds"])
    open_study(out, plan)  # refuses a folder that is not this demo's study before any work starts
    console.info(f"demo folder: {out} ({len(plan.archs)} architectures x {len(plan.seeds)} seeds, {plan.tokens:,} "
                 f"tokens each on the grammar corpus)", quiet)
    console.info("step 1/4: train, sharpness, collapse report, forgetting (cemtool sweep)", quiet)
    manifest = clock.step("train + sharpness + collapse + forgetting", study_step, out, plan, device, quiet,
                          reused=all_done(out, plan))
    console.info("step 2/4: curvature per layer (cemtool sharpness --params layer:N)", quiet)
    clock.step("curvature per layer", layers_step, out, manifest, settings["layers"], device, quiet,
               reused=layers_done(out, manifest))
    console.info("step 3/4: compare (cemtool compare)", quiet)
    payload = clock.step("compare", compare_step, out)
    write_timing(out, clock, settings, quick)
    console.info("step 4/4: figures and report.md (cemtool plot)", quiet)
    written, problems = clock.step("plot", plot_step, out, not quick)  # --quick: the demo folder's figures only
    timing = write_timing(out, clock, settings, quick)
    print_compare(payload)
    total = clock.total()
    reused = [st["step"] for st in clock.steps if st["reused"]]
    if reused:
        console.result(f"reused from an earlier run of the demo in {out}: {'; '.join(reused)} (their times in "
                       f"report.md are those of the run that did them)")
    figures = [p for p in written if p.suffix == ".png"]
    console.result(f"{len(figures)} figures (PNG + SVG) and {sum(p.name == 'report.md' for p in written)} report.md "
                   f"files; timing in {timing}")
    console.result(f"demo took {total['wall_s']:.0f} s wall clock, {total['cpu_s']:.0f} s CPU")
    console.result(f"report: {out / 'report.md'}")
    if problems:
        raise CemtoolError(f"some figures could not be drawn: {problems[0]}", hint="see the Notes of report.md")
