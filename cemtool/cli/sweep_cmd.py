"""cemtool sweep: train architectures x seeds (x grid points) on the same tokens, analyse each, in one resumable
study folder; pick each architecture's tuned values on a tuning study and compare at them on other seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError, UsageError


class SweepReporter:
    """One line per item and analysis, a progress bar per training (the item's, then its fine-tune's)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.bar = console.progress(quiet)
        self.task = None
        self.stage: dict[str, str] = {}

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def line(self, msg: str) -> None:
        if not self.quiet:
            self.bar.console.print(msg, markup=False)

    def __call__(self, ev: dict) -> None:
        kind, item = ev["kind"], ev["item"]
        if kind == "note":  # said even with --quiet: the study is not what it was
            console.info(f"Note: {ev['text']}")
        elif kind == "item" and ev["status"] == "start":
            self.stage[item] = "train"
            self.line(f"[{ev['index'] + 1}/{ev['total']}] {item}")
        elif kind == "analysis":
            self.stage[item] = ev["analysis"]
            err = f": {ev['error']}" if ev.get("error") else ""
            if ev["status"] != "running":
                self.line(f"  {item} {ev['analysis']}: {ev['status']}{err}")
        elif kind == "start" and not self.quiet:
            name = item if self.stage.get(item) == "train" else f"{item} {self.stage.get(item)}"
            self.task = self.bar.add_task(name, total=ev["total"], completed=ev["step"], status="")
        elif kind == "step" and self.task is not None:
            loss = f"loss {ev['loss']:.4f}" if ev.get("loss") is not None else ""
            self.bar.update(self.task, completed=ev["step"], status=loss)
        elif kind == "end":
            vl = f"val loss {ev['val_loss']:.4f}" if ev.get("val_loss") is not None else ""
            err = f" ({ev['error']})" if ev.get("error") else ""
            stage = self.stage.get(item, "train")
            self.line(f"  {item} {'training' if stage == 'train' else stage}: {ev['status']} at step {ev['step']} "
                      f"{vl}{err}")


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return ""
    return f"{v:.{digits}f}" if isinstance(v, float) else f"{v:,}"


def print_study(manifest: dict, path: Path) -> None:
    plan = manifest["plan"]
    rows = []
    for it in manifest["items"]:
        rows.append([it["name"], it["status"], _fmt(it.get("step")), _fmt(it.get("val_loss")), _fmt(it.get("params")),
                     "" if it.get("flops_per_token") is None else f"{it['flops_per_token']:.3g}",
                     "" if it.get("total_flops") is None else f"{it['total_flops']:.3g}",
                     *[it["analyses"][n]["status"] for n in plan["analyses"]]])
    points = len(manifest["items"]) // max(1, len(plan["archs"]) * len(plan["seeds"]))
    grid = f" x {points} grid points" if plan.get("grid") else ""
    console.table(f"study {path}: {len(plan['archs'])} architectures x {len(plan['seeds'])} seeds{grid}, "
                  f"{plan['tokens']:,} tokens each on {plan['data']}",
                  ["item", "status", "steps", "val loss", "params", "FLOPs/tok", "FLOPs", *plan["analyses"]], rows)
    console.result(f"study: {path / 'study.json'} ({manifest['status']}); compare with: cemtool compare {path}")


def print_selection(selection: dict, tuning: Path, archs: list[str] | tuple | None = None) -> None:
    """Every grid point of every architecture (of ``archs``, default all) with its mean final validation loss; the
    chosen one marked."""
    rows = []
    for arch, a in selection["archs"].items():
        if archs is not None and arch not in archs:
            continue
        chosen = "chosen, at the grid's edge" if a.get("at_edge") else "chosen"
        for key, f in a.get("shortfall", {}).items():
            chosen += f"; the parabola through its neighbours: {key}={f['vertex']:.3g}, {f['gain']:.4f} lower"
        for p in a["points"]:
            point = " ".join(f"{k}={v}" for k, v in p["point"].items())
            rows.append([arch, point, _fmt(p["mean_val_loss"]), _fmt(p["std_val_loss"]), len(p["seeds"]),
                         p["failed"], chosen if p["point"] == a["chosen"] else ""])
    console.table(f"selection on {tuning} (tuning seeds {','.join(map(str, selection['tuning_seeds']))}): "
                  f"{selection['rule']}", ["arch", "point", "mean val loss", "std", "seeds", "failed", ""], rows)
    console.result(f"selection: {tuning / 'selection.json'}")


def print_plan(manifest: dict, path: Path) -> None:
    """--dry-run: the runs the study would train, each with the overrides it adds to the plan's."""
    from cemtool.sweep import Plan, item_overrides  # start-up: torch

    plan = Plan.from_dict(manifest["plan"])
    rows = [[it["name"], it["arch"], it["seed"],
             " ".join(item_overrides(plan, it["arch"], it.get("point"))[len(plan.overrides):])]
            for it in manifest["items"]]
    console.table(f"plan for {path}: {plan.tokens:,} tokens per run on {plan.data}",
                  ["run", "arch", "seed", "tuned / grid values"], rows)
    console.result(f"dry run: {len(rows)} runs planned in {path}; nothing trained")


def _plan(archs, seeds, tokens, data, set_, analyses, to, option, grid, tuned, json_: bool):
    """The study plan from the command line: -A options parsed, a tuned plan read from its tuning study."""
    from cemtool.config import merge, parse_override  # start-up: the sweep modules load torch
    from cemtool.sweep import make_plan, plan_from_tuning

    options: dict = {}
    for item in option or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UsageError(f"--analysis-option {item!r} is not of the form analysis.key=value")
        options = merge(options, parse_override(item))
    if tuned is None:
        return make_plan(archs, "0" if seeds is None else seeds, tokens=tokens, data=data or "grammar",
                         overrides=set_ or [], analyses=analyses, target=to, options=options, grid=grid or [])
    # tokens, data and --set default to the tuning study's
    plan, selection, notes = plan_from_tuning(tuned, seeds, archs=archs, tokens=tokens, data=data, overrides=set_,
                                              analyses=analyses, target=to, options=options)
    if not json_:
        print_selection(selection, tuned, plan.archs)
    for note in notes:
        console.info(f"Note: {note}")
    return plan


@app.command()
@guarded
def sweep(
    archs: Annotated[Optional[str], typer.Option(help="comma-separated architectures, e.g. baseline,tmm,lime")]
    = None,
    seeds: Annotated[Optional[str], typer.Option(help="comma-separated seeds (default 0)")] = None,
    tokens: Annotated[Optional[int], typer.Option(help="training tokens of every run (sets train.max_tokens); "
                                                       "default what the first architecture's config trains on")]
    = None,
    data: Annotated[Optional[str], typer.Option("--data", "-d", help="training data of every run: grammar "
                                                "(default; with --tuned the tuning study's), pydoc, or a .txt file "
                                                "/ folder")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="config override for every run "
                                                      "(repeatable), e.g. model.d_model=64")] = None,
    analyses: Annotated[str, typer.Option(help="comma-separated analyses after training: sharpness, collapse, "
                                               "forgetting (default none)")] = "",
    to: Annotated[Optional[str], typer.Option("--to", help="forgetting target data (default grammar-b for grammar "
                                                           "runs; required for text runs)")] = None,
    option: Annotated[Optional[list[str]], typer.Option("--analysis-option", "-A", help="analysis.key=value for "
                                                        "an analysis (repeatable), e.g. sharpness.tokens=1024, "
                                                        "collapse.per_class=64, forgetting.steps=200")] = None,
    grid: Annotated[Optional[list[str]], typer.Option("--grid", "-g", help="key=v1,v2,... trains every value of a "
                                                      "config field, each parsed like --set (repeatable: the "
                                                      "product of the grids), e.g. train.lr=1e-3,3e-3,1e-2")] = None,
    tuned: Annotated[Optional[Path], typer.Option("--tuned", help="a finished --grid study: pick each "
                                                  "architecture's best point there (lowest mean final val loss; "
                                                  "written to its selection.json) and train at it on --seeds, "
                                                  "which must differ from the tuning seeds")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the runs the study would train (and, with "
                                                            "--tuned, write the selection); train nothing")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="the study directory (rerunning the same "
                                                "command there continues it; with more --grid values or more "
                                                "--seeds it extends it, keeping every run)")] = None,
    resume: Annotated[Optional[Path], typer.Option(help="continue the study in this directory as it was planned")]
    = None,
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")] = "auto",
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, max=512, help="train this many items at once, "
                                      "each in its own process (on CUDA they share the GPU, or go round the "
                                      "GPUs); each run's numbers are those it gets alone with the same torch "
                                      "threads")] = 1,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print study.json")] = False,
) -> None:
    """Train every architecture x seed (x grid point) on the same number of tokens (reporting parameters,
    FLOPs/token and total FLOPs), run the chosen analyses on each, and keep it all in one study directory with a
    study.json manifest. Interrupted (Ctrl-C, a kill), it continues where it stopped when run again: completed
    runs and existing reports are skipped, unfinished runs resume from their last checkpoint.
    Tuning: a --grid study on tuning seeds, then --tuned DIR on other seeds trains each architecture at its best
    grid point."""
    from cemtool.sweep import check_new_study_dir, new_manifest, open_study, plan_notes, run_sweep  # start-up: torch

    if resume is not None:
        if archs or seeds or tokens or set_ or analyses or to or option or out or grid or tuned or dry_run \
                or data is not None:
            raise typer.BadParameter("--resume continues a study as planned; it takes no plan options",
                                     param_hint="--resume")
        plan, path = None, resume
    else:
        if tuned is not None and grid:
            raise typer.BadParameter("--tuned trains at the values chosen on a grid study; it takes no --grid",
                                     param_hint="--tuned")
        if tuned is not None and seeds is None:
            raise typer.BadParameter("give the comparison seeds, disjoint from the tuning seeds, e.g. --seeds 0,1,2",
                                     param_hint="--seeds")
        if archs is None and tuned is None:
            raise typer.BadParameter("give the architectures, e.g. --archs baseline,tmm,lime", param_hint="--archs")
        if out is None:
            raise typer.BadParameter("give the study directory, e.g. --out runs/study", param_hint="--out")
        plan = _plan(archs, seeds, tokens, data, set_, analyses, to, option, grid, tuned, json_)
        for note in plan_notes(plan):
            console.info(f"Note: {note}")
        path = out
        if dry_run:  # what the real run would refuse, refused here too (nothing is written)
            if (path / "study.json").exists():
                for note in open_study(path, plan).notes:
                    console.info(f"Note: {note}")
            else:
                check_new_study_dir(path)
            if json_:
                console.print_json(new_manifest(plan))
            else:
                print_plan(new_manifest(plan), path)
            return
    from cemtool.train import pick_device  # start-up: torch

    pick_device(device)  # an unavailable device is refused before the study folder is made
    with SweepReporter(quiet) as rep:
        manifest = run_sweep(path, plan, device=device, callback=rep, jobs=jobs)
    if json_:
        console.print_json(manifest)
    else:
        print_study(manifest, path)
    failed = [f"{it['name']}: {it['error']}" for it in manifest["items"] if it["status"] == "failed"]
    failed += [f"{it['name']} {n}: {a['error']}" for it in manifest["items"] for n, a in it["analyses"].items()
               if a["status"] == "failed"]
    if failed:
        raise CemtoolError(f"{len(failed)} part(s) of the study failed; first: {failed[0]}",
                           hint="see study.json; rerun the same command to retry them")
