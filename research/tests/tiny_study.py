"""The tiny GPU study of research/tests/test_study_gpu.py (research/scripts/study_gpu.sh --tiny on two CPU lanes):
--estimate-only, then the whole study, then the command again on one lane (a rerun, which must retrain nothing), in
one folder. It takes minutes of CPU, so research/tests/conftest.py starts
it in the background as soon as the collected tests include one that needs it, and it runs beside the rest of the
suite; the test module's `tiny` fixture waits for it (or runs it then, if nothing started it)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "research" / "scripts"
SCRIPT = ["bash", str(SCRIPTS / "study_gpu.sh")]
TINY = ["--device", "cpu", "--tiny"]


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


def run(*args, stdin=subprocess.DEVNULL, session: bool = False, on_start=None) -> subprocess.CompletedProcess:
    """study_gpu.sh ARGS, its output captured; ``session``: in its own process group (so that the whole of it can
    be stopped), ``on_start(proc)`` told the process once it runs."""
    proc = subprocess.Popen([*SCRIPT, *args], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), cwd=ROOT, start_new_session=session)
    if on_start is not None:
        on_start(proc)
    stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def meta_mtimes(out: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in out.rglob("meta.json")}


def study_dirs(out: Path) -> list[Path]:
    return sorted(p.parent for part in ("main", "muon") for p in (out / part).rglob("study.json"))


class TinyStudy:
    """The study in a thread: ``start()`` returns at once, ``result()`` waits and returns {"out", "res",
    "estimate_only", "rerun"} (the rerun: its result and the meta.json times before it), or raises what went
    wrong."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="study-gpu-"))
        self.out = self.tmp / "s"
        self.proc: subprocess.Popen | None = None
        self.stopped = False
        self.value: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._work, daemon=True)

    def start(self) -> TinyStudy:
        self.thread.start()
        return self

    def _script(self, *args) -> subprocess.CompletedProcess:
        """study_gpu.sh ARGS in its own process group (so that stop() ends all of it)."""
        return run(*args, session=True, on_start=lambda proc: setattr(self, "proc", proc))

    def _work(self) -> None:
        try:
            est = self._script(*TINY, "--estimate-only", "--budget-minutes", "15", "--out", str(self.out))
            assert est.returncode == 0, est.stdout + est.stderr
            estimate_only = {"res": est, "studies": study_dirs(self.out), "runs": meta_mtimes(self.out)}
            if self.stopped:
                return
            whole = [*TINY, "--yes", "--gpus", "2", "--out", str(self.out)]
            res = self._script(*whole)
            log = self.out / "study.log"
            assert res.returncode == 0, res.stdout + res.stderr + (log.read_text() if log.exists() else "")
            before = meta_mtimes(self.out)
            again = [*TINY, "--yes", "--gpus", "1", "--out", str(self.out)]  # one lane: one server to start, for
            # a rerun that finds every sweep done
            rerun = {"before": before, "res": self._script(*again) if not self.stopped else None}
            self.value = {"out": self.out, "res": res, "estimate_only": estimate_only, "rerun": rerun}
        except BaseException as e:  # handed to the test that waits
            self.error = e

    def result(self) -> dict:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value

    def stop(self) -> None:
        """End the study if it still runs (the session ended first) and remove its folder."""
        self.stopped = True
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
        self.thread.join(timeout=60)
        shutil.rmtree(self.tmp, ignore_errors=True)
