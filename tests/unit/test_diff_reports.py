"""scripts/diff_reports.py, the check that two output trees hold the same numbers, can fail: a changed number, a
missing report or a new key is found; a changed time, version or temporary folder is not."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "diff_reports.py"
spec = importlib.util.spec_from_file_location("diff_reports", SCRIPT)
dr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dr)


def tree(root: Path, loss: float = 3.25, seconds: float = 1.0, run: str = "/tmp/cemtool-samples.ab12/r",
         extra: dict | None = None) -> Path:
    (root / "reports").mkdir(parents=True)
    report = {"provenance": {"run": run, "versions": {"torch": "2.13"}, "created": "2026-12-03T07:00:00+00:00"},
              "loss": loss, "seconds": seconds, "eigen": {"top": [1.5, 0.5]}, **(extra or {})}
    (root / "reports" / "sharpness.json").write_text(json.dumps(report))
    (root / "reports" / "sharpness.csv").write_text(f"quantity,value,seconds\nloss,{loss},{seconds}\n")
    (root / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": loss, "wall_s": seconds}) + "\n")
    return root


def test_the_same_numbers_pass_whatever_the_times_versions_and_folders(tmp_path, capsys):
    a = tree(tmp_path / "a")
    b = tree(tmp_path / "b", seconds=9.0, run="/tmp/cemtool-samples.zz99/r")
    assert dr.main([str(a), str(b)]) == 0


def test_a_changed_number_a_missing_file_and_a_new_key_are_found(tmp_path, capsys):
    a = tree(tmp_path / "a")
    assert dr.main([str(a), str(tree(tmp_path / "b", loss=3.2500001))]) == 1
    assert "loss: 3.25 -> 3.2500001" in capsys.readouterr().out
    assert dr.main([str(a), str(tree(tmp_path / "c", loss=3.2500001)), "--tol", "1e-6"]) == 0  # within the tolerance
    d = tree(tmp_path / "d")
    (d / "metrics.jsonl").unlink()
    assert dr.main([str(a), str(d)]) == 1 and "missing" in capsys.readouterr().out
    assert dr.main([str(a), str(tree(tmp_path / "e", extra={"notes": []}))]) == 1
    assert "notes: only in new" in capsys.readouterr().out
