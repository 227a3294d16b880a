"""research/scripts/light_copy.py: a study copied without checkpoints continues where it stopped, retraining only what
was cut short, to the same numbers as an uninterrupted study."""

import importlib.util
import json
from pathlib import Path

import pytest

from cemtool.sweep import make_plan, run_sweep

from kit import TINY

TOKENS = 30 * 8 * 16


def light_copy():
    path = Path(__file__).resolve().parents[1] / "scripts" / "light_copy.py"  # research/scripts
    spec = importlib.util.spec_from_file_location("light_copy", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_light_copy_continues_to_the_same_result(tmp_path):
    plan = make_plan("baseline", "0,1", tokens=TOKENS, overrides=TINY, analyses="collapse",
                     options={"collapse": {"tokens": 2048, "per_class": 16}})
    whole = run_sweep(tmp_path / "whole", plan, device="cpu")

    def stop(ev):  # cut the second item short, mid-training
        if ev["item"] == "baseline-s1" and ev["kind"] == "step" and ev["step"] == 12:
            raise KeyboardInterrupt

    src = tmp_path / "runs" / "study"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(src, plan, device="cpu", callback=stop)
    (tmp_path / "runs" / "study.log").write_text("a log beside the study\n")
    assert light_copy().main(["light_copy.py", str(tmp_path / "runs"), str(tmp_path / "kept")]) == 0

    kept = tmp_path / "kept" / "study"
    assert not list(kept.rglob("checkpoints")) and not (kept / "baseline-s1").exists()
    assert (tmp_path / "kept" / "study.log").read_text() == "a log beside the study\n"
    m = json.loads((kept / "study.json").read_text())
    assert [i["status"] for i in m["items"]] == ["completed", "pending"] and m["status"] == "incomplete"
    first = (kept / "baseline-s0" / "metrics.jsonl").read_bytes()
    done = run_sweep(kept, device="cpu")  # continue the copy as planned
    assert done["status"] == "completed" and (kept / "baseline-s0" / "metrics.jsonl").read_bytes() == first
    assert [i["val_loss"] for i in done["items"]] == [i["val_loss"] for i in whole["items"]]
    report = json.loads((kept / "baseline-s1" / "reports" / "collapse.json").read_text())
    assert report["runs"][0]["summary"] == json.loads(
        (tmp_path / "whole" / "baseline-s1" / "reports" / "collapse.json").read_text())["runs"][0]["summary"]


def test_files_beside_the_studies_are_copied_without_weights_and_locks(tmp_path):
    """A saturation sweep's folder (no study.json) sits beside the studies: its reports and run records are kept,
    its checkpoints and lock files are not."""
    src = tmp_path / "runs"
    (src / "study").mkdir(parents=True)
    (src / "study" / "study.json").write_text(json.dumps({"status": "completed", "items": []}))
    run = src / "part" / "saturation" / "runs" / "T16-dh2-s0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "final.safetensors").write_bytes(b"weights")
    (run / ".lock").write_text("")
    (run / "meta.json").write_text("{}")
    (src / "part" / "saturation" / "reports").mkdir()
    (src / "part" / "saturation" / "reports" / "saturation_sweep.json").write_text("{}")
    (src / "part" / "saturation" / "partial.json.tmp").write_text("")
    assert light_copy().main(["light_copy.py", str(src), str(tmp_path / "kept")]) == 0
    kept = sorted(str(p.relative_to(tmp_path / "kept")) for p in (tmp_path / "kept").rglob("*") if p.is_file())
    assert kept == ["part/saturation/reports/saturation_sweep.json", "part/saturation/runs/T16-dh2-s0/meta.json",
                    "study/study.json"]


def test_a_re_planned_comparisons_superseded_runs_are_kept_without_weights(tmp_path):
    """A comparison re-planned after its tuning moved keeps the earlier runs in superseded-*/ (cemtool sweep); the
    light copy keeps them too, for the record, without their checkpoints."""
    src = tmp_path / "runs" / "study"
    old = src / "superseded-2026-12-07T153329" / "baseline-s0"
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "final.safetensors").write_bytes(b"weights")
    (old / "meta.json").write_text("{}")
    (src / "study.json").write_text(json.dumps({"status": "incomplete", "items": []}))
    assert light_copy().main(["light_copy.py", str(tmp_path / "runs"), str(tmp_path / "kept")]) == 0
    kept = tmp_path / "kept" / "study" / "superseded-2026-12-07T153329" / "baseline-s0"
    assert (kept / "meta.json").read_text() == "{}" and not (kept / "checkpoints").exists()
