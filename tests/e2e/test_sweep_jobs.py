"""`cemtool sweep --jobs N`: items trained by N worker processes give the same numbers as one at a time, and a
SIGTERM to the sweep stops its workers (no process left behind), after which the study resumes to the same
numbers."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import procs
import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.sweep import make_plan, run_sweep

from kit import TINY, set_args

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TOKENS = 30 * 8 * 16  # TINY: 30 steps of 8 x 16 tokens
ARCHS, SEEDS = "baseline,tmm", "0,1"
COLLAPSE = ["-A", "collapse.tokens=2048", "-A", "collapse.per_class=16", "-A", "collapse.folds=2"]  # (2 folds: 2 of
# the 5 probe fits a report costs; equal numbers both ways are the point here)


def sweep_cmd(out: Path, *extra: str, seeds: str = SEEDS) -> list[str]:
    args = [sys.executable, "-m", "cemtool", "sweep", "--archs", ARCHS, "--seeds", seeds, "--tokens", str(TOKENS),
            "--analyses", "collapse", *COLLAPSE, "--out", str(out), "--device", "cpu", *extra]
    return args + set_args(*TINY)


def manifest(out: Path) -> dict:
    return json.loads((out / "study.json").read_text())


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (from /proc)."""
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.add(int(stat.parent.name))
    return kids


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "study"
    plan = make_plan(ARCHS, SEEDS, tokens=TOKENS, overrides=TINY, analyses="collapse",
                     options={"collapse": {"tokens": 2048, "per_class": 16, "folds": 2}})
    return out, run_sweep(out, plan, device="cpu")


def test_jobs_give_the_numbers_of_one_at_a_time(serial, tmp_path):
    serial_dir, serial = serial
    out = tmp_path / "study"
    res = procs.run(sweep_cmd(out, "--jobs", "2"), env=ENV, timeout=600)  # forked (tests/procs.py); its workers:
    # multiprocessing's spawn, fresh interpreters
    assert res.returncode == 0, res.stderr
    assert "2 workers on cpu" in res.stdout + res.stderr
    assert (res.stdout + res.stderr).count("training: completed at step 30") == 4  # every end, from study.json
    m = manifest(out)
    assert m["status"] == "completed"
    assert [i["name"] for i in m["items"]] == [i["name"] for i in serial["items"]]
    assert [i["val_loss"] for i in m["items"]] == [i["val_loss"] for i in serial["items"]]  # bit for bit
    for it, ref in zip(m["items"], serial["items"], strict=True):
        assert it["status"] == "completed" and it["step"] == 30 and it["params"] == ref["params"]
        assert it["analyses"]["collapse"]["status"] == "completed"
        got, want = (json.loads((d / it["run"] / "reports" / "collapse.json").read_text())["runs"][0]["collapse"]
                     for d in (out, serial_dir))
        assert got == want  # the analyses too
    assert sorted(p.name for p in (out / ".claims").iterdir()) == sorted(i["name"] for i in m["items"])
    # a rerun with workers finds nothing to do and says so, but checks the finished items as a serial rerun does:
    # a report that went missing is made again
    (out / "tmm-s1" / "reports" / "collapse.json").unlink()
    again = procs.run(sweep_cmd(out, "--jobs", "2", "-q"), env=ENV, timeout=300)
    assert again.returncode == 0, again.stderr
    assert "0 workers" in again.stdout + again.stderr
    assert (out / "tmm-s1" / "reports" / "collapse.json").exists()
    assert [i["val_loss"] for i in manifest(out)["items"]] == [i["val_loss"] for i in m["items"]]


def test_sigterm_stops_the_workers_and_the_study_resumes(serial, tmp_path):
    serial = serial[1]
    out = tmp_path / "study"
    # 12 items of about a second each: after the first ends there is work left for both workers well past the
    # Ctrl-C's grace time below (with 4 items a worker could finish its last one in that time and exit as it should)
    seeds = "0,1,2,3,4,5"
    cmd = sweep_cmd(out, "--jobs", "2", "-q", seeds=seeds)
    # started as a script's background job is: SIGINT ignored, in its own process group (forked: tests/procs.py)
    proc = procs.start(cmd, env=ENV, new_session=True, ignore_sigint=True)
    deadline, workers, tracker = time.time() + 300, set(), set()
    while True:
        assert proc.poll() is None, f"the sweep ended before it could be stopped: {proc.communicate()[1]}"
        assert time.time() < deadline, "no item completed"
        # named by what they run: a worker runs multiprocessing's spawn_main, the resource tracker its own main;
        # any other child (a git call, a child between fork and exec) is neither
        for p in children(proc.pid):
            line = cmdline(p)
            if "spawn_main" in line:
                workers.add(p)
            elif "resource_tracker" in line:
                tracker.add(p)
        try:
            done = [i for i in manifest(out)["items"] if i["status"] == "completed"]
        except (FileNotFoundError, json.JSONDecodeError):
            done = []
        if done and len(workers) >= 2:
            break
        time.sleep(0.05)
    assert len(workers) == 2
    os.killpg(proc.pid, signal.SIGINT)  # a Ctrl-C the sweep ignores is ignored by its workers too
    time.sleep(1.5)
    assert proc.poll() is None and all(alive(p) for p in workers | tracker)  # every worker (and the tracker) runs
    assert "interrupted" not in {i["status"] for i in manifest(out)["items"]}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    assert "interrupted" in proc.communicate()[1]
    assert not [p for p in workers if alive(p)]  # the sweep joined them
    deadline = time.time() + 10  # the tracker exits when it sees its pipe close, just after the sweep
    while [p for p in tracker if alive(p)] and time.time() < deadline:
        time.sleep(0.05)
    assert not [p for p in tracker if alive(p)]  # nothing outlives the sweep
    m = manifest(out)
    assert m["status"] == "interrupted"
    assert {i["status"] for i in m["items"]} <= {"completed", "interrupted", "pending"}
    assert "running" not in {i["status"] for i in m["items"]}
    assert "pending" in {i["status"] for i in m["items"]}  # stopped with work left, as meant
    # resumed by the same command in this process, one item at a time (workers restarting are the test above)
    at = cmd.index("--jobs")
    res = CliRunner().invoke(app, cmd[3:at] + cmd[at + 2:])
    assert res.exit_code == 0, res.output
    m = manifest(out)
    assert m["status"] == "completed" and len(m["items"]) == 12
    got = {i["name"]: i["val_loss"] for i in m["items"]}
    assert {i["name"]: got[i["name"]] for i in serial["items"]} == {i["name"]: i["val_loss"] for i in serial["items"]}


def test_bad_jobs_is_a_usage_error(tmp_path):
    res = procs.run(sweep_cmd(tmp_path / "s", "--jobs", "0"), env=ENV, timeout=120)
    assert res.returncode == 2 and "--jobs" in res.stderr and "Traceback" not in res.stderr


def test_sweep_measures_the_operator_it_is_told(tmp_path):
    """`sweep -A sharpness.operator=ggn`: each item's sharpness report is of the GGN (recorded in its options, PSD
    verdict), and the study's comparison names the operator beside its curvature columns. In this process (the
    workers' processes are the tests above)."""
    out = tmp_path / "study"
    args = ["sweep", "--archs", "baseline", "--seeds", "0", "--tokens",
            str(TOKENS), "--analyses", "sharpness", "-A", "sharpness.operator=ggn", "-A", "sharpness.tokens=128",
            "-A", "sharpness.top_k=1", "-A", "sharpness.bottom_k=0", "-A", "sharpness.lanczos_steps=8",
            "-A", "sharpness.trace_hvps=4", "-A", "sharpness.density_runs=0", "-A", "sharpness.landscape=none",
            "--out", str(out), "--device", "cpu", *set_args(*TINY)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    reps = list(out.rglob("reports/sharpness*.json"))
    assert len(reps) == 1, reps
    rep = json.loads(reps[0].read_text())
    assert rep["options"]["operator"] == "ggn" and rep["eigen"]["top"][0] > 0
    res = CliRunner().invoke(app, ["compare", str(out)])
    assert res.exit_code == 0, res.output
    compare = json.loads((out / "reports" / "compare.json").read_text())
    assert compare["curvature_operator"] == "ggn" and compare["metrics"]["trace_per_param"] == "tr(G)/n"
    assert "tr(G)/n vs forgetting" in res.stdout and "tr(H)" not in res.stdout  # no Hessian label on a GGN
    assert "of the ggn operator" in res.stdout
