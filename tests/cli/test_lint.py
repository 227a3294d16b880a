"""The code base stays ruff-clean (configured in pyproject.toml)."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed (pip install -e '.[test]')")
def test_ruff_clean():
    res = subprocess.run(["ruff", "check", "cemtool", "tests", "benchmarks", "research"], cwd=ROOT, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stdout[-3000:]
