"""The one runner (cemtool.jobs): a new analysis, registered in a test without touching any other module, runs
through run_job, from `cemtool sweep --analyses toy -A toy.x=1`, and under torchrun in two processes as in one."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool import jobs
from cemtool.errors import CemtoolError

from kit import TINY, set_args

# the toy analysis: the mean next-token loss of the subject on its first `tokens` evaluation tokens, times x;
# sharded over the ranks and all-reduced, as a real analysis is
TOY = '''
from dataclasses import dataclass

import torch

from cemtool import jobs
from cemtool.distributed import all_reduce_sum, shard
from cemtool.models.lm import lm_loss
from cemtool.options import at_least, check_types


@dataclass(frozen=True)
class ToyOptions:
    x: int = 0
    tokens: int = 64

    def __post_init__(self):
        check_types(self, "toy")
        at_least(self, "toy", x=0, tokens=1)


@dataclass
class ToyReport:
    x: int
    tokens: int
    loss: float

    def payload(self):
        return {"x": self.x, "tokens": self.tokens, "loss": self.loss, "scaled": self.x * self.loss}

    def rows(self):
        return [{"x": self.x, "loss": self.loss}]

    def provenance(self):
        return {"analysis": "toy", "tokens": self.tokens}


def measure(subject, o, progress=None):
    x, y = subject.eval_set(o.tokens)  # (n, T)
    mine = shard(x.shape[0])
    with torch.no_grad():
        logits = subject.model(x[mine.start:mine.stop])
        total = lm_loss(logits, y[mine.start:mine.stop], reduction="sum").double().reshape(1)
    count = torch.tensor([float(y[mine.start:mine.stop].numel())], dtype=torch.float64)
    all_reduce_sum(total), all_reduce_sum(count)
    return ToyReport(o.x, int(y.numel()), float(total / count))


jobs.register(jobs.Analysis("toy", ToyOptions, measure, lambda o: "toy"))
'''


@pytest.fixture
def toy():
    ns: dict = {"__name__": "toy"}
    exec(compile(TOY, "toy.py", "exec"), ns)
    yield ns
    jobs.ANALYSES.pop("toy", None)


def test_a_registered_analysis_runs_through_run_job(toy, tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    res = jobs.run_job(run, "toy", {"x": 3}, device="cpu")
    report = json.loads((run / "reports" / "toy.json").read_text())
    assert res.written and report["x"] == 3 and report["scaled"] == pytest.approx(3 * report["loss"])
    assert report["provenance"]["run"] == str(run) and report["provenance"]["analysis"] == "toy"
    assert report["provenance"]["step"] == res.subject.step and report["tokens"] == 64
    assert (run / "reports" / "toy.csv").read_text().splitlines()[0] == "x,loss"
    with pytest.raises(CemtoolError, match=r"toy.x=-1: must be a whole number >= 0"):  # the Options check
        jobs.run_job(run, "toy", {"x": -1})
    with pytest.raises(CemtoolError, match="unknown toy option 'y'"):
        jobs.run_job(run, "toy", {"y": 1})
    with pytest.raises(CemtoolError, match="unknown analysis 'nosuch'"):
        jobs.run_job(run, "nosuch")


def test_a_registered_analysis_runs_from_sweep(toy, tmp_path):
    from cemtool.cli.main import app

    sets = set_args(*TINY)
    out = tmp_path / "study"
    bad = CliRunner().invoke(app, ["sweep", "--archs", "baseline", "--tokens", str(30 * 8 * 16), *sets, "--out",
                                   str(out), "--analyses", "toy", "-A", "toy.x=-2", "-q"])
    assert bad.exit_code != 0 and "toy.x=-2" in bad.output and not out.exists()  # refused before training
    res = CliRunner().invoke(app, ["sweep", "--archs", "baseline", "--tokens", str(30 * 8 * 16), *sets, "--out",
                                   str(out), "--analyses", "toy", "-A", "toy.x=1", "-q"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "study.json").read_text())
    [item] = manifest["items"]
    assert item["analyses"]["toy"]["status"] == "completed"
    report = json.loads((out / item["run"] / "reports" / "toy.json").read_text())
    assert report["x"] == 1 and report["loss"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_registered_analysis_in_two_processes_equals_one(toy, tiny_run, tmp_path):
    """Under torchrun (2 ranks, gloo) the toy's report (rank 0 writes it) equals one process's, to
    float32 summation order (each rank sums its shard)."""
    one, two = tmp_path / "one", tmp_path / "two"
    shutil.copytree(tiny_run, one)
    shutil.copytree(tiny_run, two)
    jobs.run_job(one, "toy", {"x": 2}, device="cpu")
    script = tmp_path / "worker.py"
    script.write_text(TOY + f"\njobs.run_job({str(two)!r}, 'toy', {{'x': 2}}, device='cpu')\n"
                      "from cemtool.distributed import exit_process\nexit_process(0)\n")  # as a command leaves
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CEMTOOL_DIST_TIMEOUT": "30",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), str(script)], env=env, text=True, capture_output=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads((one / "reports" / "toy.json").read_text())
    b = json.loads((two / "reports" / "toy.json").read_text())
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-6) and b["tokens"] == a["tokens"]
