"""Run every snippet of the docs for real and record how long each took (docs/snippet_times.json).

A snippet is a fenced ```python or ```bash block of README.md, docs/*.md, research/README.md or research/docs/*.md.
The snippets of one page run in order in one fresh temporary folder (a later block may use what an earlier one made,
e.g. a run directory), the Python blocks in one shared namespace, the shell blocks with bash. A snippet's time is
the smaller of its wall-clock and its CPU time (on a shared machine the first grows with the others' load; the
second is what one idle core would take, so at most that on two; the snippets run on one thread, since two threads
on a loaded machine spin-wait and inflate the CPU time), and it is stopped after TIMEOUT seconds of CPU time; a
snippet that needs what this machine cannot give (a GPU, the network, the test suite) is listed in NOT_RUN with the
reason and not run.

The line right after each block states its time, ``(~N s on 2 idle cores)``, or why it has none,
``(not timed: REASON)``; tests/e2e/test_docs.py checks every such claim against the records written here.

    nice -n 19 python scripts/doc_snippets.py                     # every page, all at once
    nice -n 19 python scripts/doc_snippets.py --page docs/api.md  # one page; the other records are kept
    python scripts/doc_snippets.py --write-docs                   # put the recorded times beside the blocks
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "snippet_times.json"
LANGS = ("python", "bash")
FENCE = re.compile(r"^```(\w*)\s*$")
CLAIM = re.compile(r"^\((?:~(\d+) s on 2 idle cores|not timed: ([^)]+))\)$")
TIMEOUT = 60.0  # seconds of CPU time per snippet (per process of a shell block)
WALL = 15  # a block is stopped after WALL x TIMEOUT seconds of wall-clock time in any case

# Snippets not run here: a pattern found in the block, and what it needs that a CPU-only, offline machine lacks.
NOT_RUN = [
    (r"^pip install", "installs packages, needs the network"),
    (r"hf:|~/models/", "needs a Hugging Face model: the network or a local copy"),
    (r"--device cuda|scripts/study_gpu\.sh", "needs a CUDA GPU"),
    (r"~/|my_texts/|owt/", "needs your own data"),
    (r"\bRUN(_[AB])?\b", "a summary: RUN stands for your run directory"),
]


@dataclass(frozen=True)
class Snippet:
    page: str      # path relative to the repository root
    index: int     # 1-based among the page's python and bash blocks
    lang: str
    line: int      # 1-based line of the opening fence
    end: int       # 1-based line of the closing fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.page}#{self.index}"

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.code.encode()).hexdigest()[:16]

    def not_run(self) -> str | None:
        """Why this snippet is not run (NOT_RUN), or None."""
        return next((why for pattern, why in NOT_RUN if re.search(pattern, self.code, re.M)), None)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, every docs page, and the research study's README and pages."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "research" / "README.md",
            *sorted((root / "research" / "docs").glob("*.md"))]


def extract(path: Path, root: Path = ROOT) -> list[Snippet]:
    """The python and bash blocks of one Markdown page, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Snippet] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].startswith("```"):
            j += 1
        if m.group(1) in LANGS:
            out.append(Snippet(str(path.relative_to(root)), len(out) + 1, m.group(1), i + 1, j + 1,
                               "\n".join(lines[i + 1:j]) + "\n"))
        i = j + 1
    return out


def all_snippets(root: Path = ROOT) -> list[Snippet]:
    return [s for p in pages(root) for s in extract(p, root)]


def claim_line(record: dict | None) -> str:
    """The line that goes right after a block, from its record."""
    if record is None:
        return "(not timed: not measured yet)"
    if record["status"] == "ok":
        return f"(~{max(1, round(record['seconds']))} s on 2 idle cores)"
    return f"(not timed: {record['reason']})"


def load_records(path: Path = RECORDS) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


# --- running -------------------------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def cpu_seconds() -> float:
    """CPU time of this process and of every child it waited for (user + system)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_python(code: str, namespace: dict, timeout: float) -> None:
    """exec one Python block in the page's namespace, stopped after ``timeout`` seconds of CPU time (SIGPROF: the
    wall time of a shared machine depends on the others' load)."""
    old = signal.signal(signal.SIGPROF, _alarm)
    signal.setitimer(signal.ITIMER_PROF, timeout)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "<snippet>", "exec"), namespace)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, old)


def _cpu_limit(seconds: float):
    def limit() -> None:  # in the child: every process of the block gets at most this much CPU time (SIGXCPU)
        resource.setrlimit(resource.RLIMIT_CPU, (int(seconds), int(seconds) + 5))
    return limit


def run_bash(code: str, timeout: float) -> None:
    """One shell block with bash -e, `cemtool` being this checkout's CLI; each of its processes is stopped after
    ``timeout`` seconds of CPU time, the whole block after WALL times that of wall-clock time."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: a command left running cannot block the read
        proc = subprocess.Popen(["bash", "-e", "-c", code], env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_cpu_limit(timeout))
        try:
            code_ = proc.wait(timeout=WALL * timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: cemtool, torchrun and its workers
            proc.wait()
        if code_ in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            raise _Timeout()
        if code_ != 0:
            log.seek(0)
            tail = log.read().strip().splitlines()[-1:] or [""]
            raise RuntimeError(f"exit {code_}: {tail[0][:200]}")


def measure_page(page: str, timeout: float) -> dict:
    """Run one page's snippets in order in a fresh folder; the records by snippet id."""
    records: dict = {}
    namespace: dict = {"__name__": "__snippet__"}
    with tempfile.TemporaryDirectory(prefix="snippets-") as tmp:
        os.chdir(tmp)
        for name in ("benchmarks", "scripts", "research"):  # commands the docs give from the repository root
            os.symlink(ROOT / name, name)
        for s in extract(ROOT / page):
            rec = {"page": s.page, "line": s.line, "lang": s.lang, "digest": s.digest,
                   "load_before": round(os.getloadavg()[0], 2)}
            why = s.not_run()
            if why:
                records[s.id] = {**rec, "status": "not run", "reason": why}
                continue
            t0, c0 = time.perf_counter(), cpu_seconds()
            try:
                (run_python(s.code, namespace, timeout) if s.lang == "python" else run_bash(s.code, timeout))
                rec.update(status="ok")
            except (_Timeout, subprocess.TimeoutExpired):
                rec.update(status="timeout", reason=f"over {timeout:.0f} s of CPU time, stopped")
            except BaseException as e:  # noqa: BLE001 - a failing snippet is recorded, not raised
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
                stopped = [k for k, v in records.items() if v["status"] == "timeout"]
                if stopped:  # it may need what the stopped block would have made
                    rec.update(status="after timeout", reason=f"runs after {stopped[0]}, which was stopped", error=why)
                else:
                    rec.update(status="failed", reason=why)
            wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            # on a shared machine the wall time grows with the load, the CPU time does not: the smaller of the two
            # estimates the time on 2 idle cores
            rec.update(wall=round(wall, 2), cpu=round(cpu, 2), seconds=round(min(wall, cpu), 2))
            records[s.id] = rec
            print(f"{s.id:28s} {rec['status']:8s} {rec['seconds']:8.1f} s  {rec.get('reason', '')}", flush=True)
        os.chdir(ROOT)
    return records


def _child(page: str, timeout: float) -> None:
    """Measure one page in this (fresh) process; the records as JSON on the last line of stdout."""
    sys.path.insert(0, str(ROOT))
    print(json.dumps(measure_page(page, timeout)))


def measure(selected: list[str], timeout: float, path: Path = RECORDS) -> dict:
    """Measure the selected pages, each in its own process and all at once (a snippet's time is its CPU time, so
    the pages need not wait for each other), and merge the records into ``path``."""
    records = load_records(path)
    # one thread: two threads on a loaded machine spin-wait and inflate the CPU time; one thread's time is what
    # one idle core takes, at most that on two
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = {page: subprocess.Popen([sys.executable, __file__, "--child", page, "--timeout", str(timeout)], env=env,
                                    stdout=subprocess.PIPE, text=True) for page in selected}
    for page, proc in procs.items():
        lines = proc.communicate()[0].strip().splitlines()
        for line in lines[:-1]:
            print(line)
        got = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
        records = {k: v for k, v in records.items() if v["page"] != page} | got
        path.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n", encoding="utf-8")
    return records


def write_docs(records: dict, root: Path = ROOT) -> list[str]:
    """Put (or replace) the claim line right after every block; the pages changed."""
    changed = []
    for p in pages(root):
        lines = p.read_text(encoding="utf-8").splitlines()
        for s in reversed(extract(p, root)):
            rec = records.get(s.id)
            line = claim_line(rec if rec and rec["digest"] == s.digest else None)
            if s.end < len(lines) and CLAIM.match(lines[s.end]):
                lines[s.end] = line
            else:
                lines[s.end:s.end] = [line] + ([""] if s.end < len(lines) and lines[s.end].strip() else [])
        text = "\n".join(lines) + "\n"
        if text != p.read_text(encoding="utf-8"):
            p.write_text(text, encoding="utf-8")
            changed.append(str(p.relative_to(root)))
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page", action="append", help="only this page (repeatable), e.g. docs/api.md")
    ap.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per snippet")
    ap.add_argument("--write-docs", action="store_true", help="only write the recorded times into the docs")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        _child(a.child, a.timeout)
        return 0
    if a.write_docs:
        print("\n".join(write_docs(load_records())) or "no page changed")
        return 0
    if os.nice(0) < 19:
        os.nice(19 - os.nice(0))
    selected = a.page or [str(p.relative_to(ROOT)) for p in pages() if extract(p)]
    t0 = time.perf_counter()
    records = measure(selected, a.timeout)
    bad = [k for k, v in records.items() if v["status"] in ("failed", "timeout")]
    print(f"{len(records)} snippets, {len(bad)} failed or timed out ({time.perf_counter() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
