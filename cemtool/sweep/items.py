"""What one item of a study does: train its run (or continue or skip it) and record its compute (parameters and
FLOPs, the numbers ``cemtool compare`` reports), then run each chosen analysis unless its report exists, writing
the report the analysis' own command would write."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from cemtool.analysis.compute import run_compute
from cemtool.errors import CemtoolError
from cemtool.forgetting import clear_partial_run, fine_tune, target_slug
from cemtool.jobs import run_job
from cemtool.start import start_or_resume
from cemtool.sweep.manifest import Study, _not_a_link
from cemtool.sweep.options import analysis_options
from cemtool.sweep.plan import Plan, item_config

Callback = Callable[[dict], None]


# --------------------------------------------------------------------------------------------------------------
# the analyses (each writes the report an analysis command would write)


def _report_path(study: Path, item: dict, name: str, plan: Plan) -> tuple[Path, Path | None]:
    """(report file, fine-tune run dir or None) of one analysis of one item."""
    run = study / item["run"]
    if name == "forgetting":
        ft = study / f"{item['run']}-ft-{target_slug(plan.target)}"
        return ft / "reports" / "forgetting.json", ft
    return run / "reports" / f"{name}.json", None


def _measure(name: str, run_path: Path, options: dict, device: torch.device) -> None:
    """A registered analysis of one item, through the one runner (no figures: the study's plot step draws them)."""
    checkpoint, opts = analysis_options(name, options)
    run_job(run_path, name, opts, checkpoint=checkpoint, device=device, report_name=name, plots=False,
            provenance_extra={"command": "sweep"} if name == "sharpness" else None, hold=False)


def _forgetting(run_path: Path, options: dict, device: torch.device, emit: Callback, target: str,
                out: Path) -> None:
    _, o = analysis_options("forgetting", options)
    fine_tune(run_path, target, out, recipe=o.recipe(), device=device, resume=True, callback=emit, **o.schedule())


def _finished(item: dict) -> bool:
    return item["status"] == "completed" and all(a["status"] == "completed" for a in item["analyses"].values())


def _do_item(study: Study, item: dict, dev: torch.device, corpora: dict, emit: Callback) -> None:
    """Train one item (or continue or skip it), then run its analyses; a Ctrl-C marks it interrupted."""
    try:
        _train_item(study, item, dev, corpora, emit)
        if item["status"] == "completed":
            for name in study.plan.analyses:
                _analyse(study, item, name, dev, emit)
    except KeyboardInterrupt:
        if item["status"] == "running":
            item["status"] = "interrupted"
        for a in item.get("analyses", {}).values():
            if a["status"] == "running":
                a["status"] = "interrupted"
        if study.owned is None:
            study.manifest["status"] = "interrupted"
        study.save()
        raise


def _train_item(study: Study, item: dict, dev: torch.device, corpora: dict, emit: Callback) -> None:
    """Train one item, or continue it, or skip it if completed; record its compute."""
    plan, path = study.plan, study.path / item["run"]
    _not_a_link(path)
    cfg = item_config(plan, item["arch"], item["seed"], item.get("point"))
    clear_partial_run(path)
    began: list[str] = []

    def running(run, how: str) -> None:  # created or locked: the study records it before the first step
        began.append(how)
        item.update(status="running", error=None)
        study.save()

    try:
        st = start_or_resume(cfg, path, device=dev, existing="resume", corpora=corpora, callback=emit,
                             extra_meta={"study": str(study.path.resolve()), "item": item["name"]}, on_start=running)
    except CemtoolError as e:
        if not began:  # before training: the study itself is wrong (another run in the item's folder)
            raise
        item.update(status="failed", error=e.message)
        study.save()
        return
    if st.result is not None and st.result.status != "completed":
        raise KeyboardInterrupt  # train() caught a Ctrl-C and kept its last checkpoint
    run, cfg = st.run, st.config
    meta = run.meta()
    item.update(status="completed", error=None, step=meta.get("step"), tokens=meta.get("tokens"),
                val_loss=meta.get("val_loss"), val_floor=meta.get("val_floor"), seconds=meta.get("train_seconds"))
    if "flops_per_token" not in item:
        item.update(run_compute(cfg))
        item["total_flops"] = item["flops_per_token"] * (item["tokens"] or 0)
    study.save()


def _analyse(study: Study, item: dict, name: str, dev: torch.device, emit: Callback) -> None:
    """Run one analysis of one item unless its report exists."""
    plan = study.plan
    report, ft = _report_path(study.path, item, name, plan)
    entry = item["analyses"].setdefault(name, {"status": "pending", "report": None, "error": None})
    if ft is not None:
        _not_a_link(ft)
        entry["run"] = ft.name
    if report.exists():
        if entry["status"] != "completed":
            entry.update(status="completed", report=str(report.relative_to(study.path)), error=None)
            study.save()
        emit({"kind": "analysis", "analysis": name, "status": "skipped", "error": None})
        return
    entry.update(status="running", error=None)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "running", "error": None})
    t0 = time.perf_counter()
    run_path, options = study.path / item["run"], plan.options.get(name, {})
    try:
        if name == "forgetting":
            _forgetting(run_path, options, dev, emit, plan.target, ft)
        else:
            _measure(name, run_path, options, dev)
    except CemtoolError as e:
        entry.update(status="failed", error=e.message, seconds=time.perf_counter() - t0)
        study.save()
        emit({"kind": "analysis", "analysis": name, "status": "failed", "error": e.message})
        return
    entry.update(status="completed", report=str(report.relative_to(study.path)), error=None,
                 seconds=time.perf_counter() - t0)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "completed", "error": None})
