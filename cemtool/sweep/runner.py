"""run_sweep: run (or continue) a study under its lock, one item after another or in --jobs worker processes, and
leave study.json saying how it ended."""

from __future__ import annotations

from pathlib import Path

import torch

from cemtool.errors import CemtoolError
from cemtool.runs import Run
from cemtool.sweep.items import Callback, _do_item, _finished
from cemtool.sweep.manifest import Study, _retune, open_study
from cemtool.sweep.plan import Plan
from cemtool.sweep.workers import _run_workers
from cemtool.train import pick_device


def run_sweep(out: str | Path, plan: Plan | None = None, *, device: str | torch.device | None = None,
              callback: Callback | None = None, jobs: int = 1) -> dict:
    """Run (or continue) the study in ``out`` and return its manifest. ``plan`` None: continue as stored.

    ``callback`` receives the training loop's events with ``item`` added, and ``{"kind": "item", "item", "index",
    "total", "status"}`` / ``{"kind": "analysis", "item", "analysis", "status", "error"}``. Ctrl-C (or an
    interrupted training) marks the item interrupted, saves the manifest and raises KeyboardInterrupt.

    ``jobs`` > 1: that many worker processes share the items (see :func:`_run_workers`); the callback then gets
    the item and analysis events (not the training steps), read from the manifest as the workers write it."""
    if not isinstance(jobs, int) or jobs < 1:
        raise CemtoolError(f"--jobs must be a whole number >= 1, not {jobs!r}")
    study = open_study(out, plan)
    dev = device if isinstance(device, torch.device) else pick_device(device)
    lock = Run(study.path)  # the run-directory lock, on the study directory
    lock.lock()
    try:  # read again under the lock: what another process wrote before it let go stays (an extension or
        # re-plan is made on that); refused now (that process changed the plan), nothing of ours is written
        if (study.path / "study.json").exists():
            study = open_study(out, plan)
    except BaseException:
        lock.unlock()
        raise
    corpora: dict[str, object] = {}
    try:
        if study.retune is not None:
            _retune(study, *study.retune)
        for note in study.notes:
            if callback is not None:
                callback({"kind": "note", "item": None, "text": note})
        study.manifest["status"] = "running"
        study.save()
        if jobs > 1:
            study = _run_workers(study, device, dev, jobs, callback, corpora)
        else:
            items = study.manifest["items"]
            for index, item in enumerate(items):
                def emit(ev: dict, name: str = item["name"]) -> None:
                    if callback is not None:
                        callback({**ev, "item": name})

                emit({"kind": "item", "index": index, "total": len(items), "status": "start"})
                _do_item(study, item, dev, corpora, emit)
                emit({"kind": "item", "index": index, "total": len(items), "status": item["status"]})
        study.manifest["status"] = "completed" if all(_finished(it) for it in study.manifest["items"]) \
            else "incomplete"
        study.save()
    except KeyboardInterrupt:
        raise  # the item and the study are marked interrupted where it was caught
    except BaseException as e:
        if study.owned is None and study.manifest.get("status") == "running":
            _stopped_by(study, e)
        raise
    finally:
        lock.unlock()
    return study.manifest


def _stopped_by(study: Study, error: BaseException) -> None:
    """An error ended the sweep: what was running is marked failed with it, and the study incomplete (so that
    study.json does not say running for a sweep that is gone). Best effort: the error itself is what matters."""
    what = error.message if isinstance(error, CemtoolError) else f"internal error ({type(error).__name__}: {error})"
    for item in study.manifest["items"]:
        for entry in [item, *item.get("analyses", {}).values()]:
            if entry.get("status") == "running":
                entry.update(status="failed", error=what[:300])
    study.manifest["status"] = "incomplete"
    try:
        study.save()
    except (CemtoolError, OSError):
        pass
