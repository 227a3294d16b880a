"""scripts/gpu_check.sh runs end to end on a CPU (--device cpu --tiny --budget 2 --profile): every row ok, the table,
the JSON and the profile written."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--device", "cpu", "--tiny", "--no-compile",
                        "--budget", "2", "--archs", "baseline", "--profile", "--out", str(tmp_path / "gc")],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads((tmp_path / "gc" / "gpu_check.json").read_text())
    assert [r["arch"] for r in res["train"]] == ["baseline"]  # the other archs: same code path, run by hand
    for r in res["train"]:  # trained for its 2 timed seconds, then stopped by SIGTERM (its checkpoint kept)
        assert r["rc"] == 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["params"] > 0
        assert r["timed_s"] >= 2 and r["to_first_step_s"] > 0
    assert (tmp_path / "gc" / "profile.txt").read_text().count("aten::mm") >= 1
    sharp = [r for r in res["analyses"] if r["analysis"] == "sharpness"]
    assert len(sharp) == 1 and all(r["rc"] == 0 and r["lambda_max"] is not None for r in sharp)
    assert all(r["ok"] and r["max_abs_diff"] < 1e-4 for r in res["attention"])
    assert res["failures"] == [] and "| baseline |" in (tmp_path / "gc" / "gpu_check.md").read_text()
