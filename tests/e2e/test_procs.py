"""tests/procs.py's forked children behave as the fresh interpreters they stand in for: each of these runs the same
command both ways (subprocess against a forked child) where the answer could differ."""

import os
import signal
import subprocess
import sys
import time

import procs
import pytest

PROBE = r"""
import json, os, signal, sys
import torch._dynamo, cemtool.cli.main  # what they print on import, if anything, is on this stderr both ways
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "x": os.environ.get("PROCS_X"),
                  "pid": os.getpid(), "pgid": os.getpgid(0), "stdin": sys.stdin.read(),
                  "sigint": str(signal.getsignal(signal.SIGINT)),
                  "torch_threads": __import__("torch").get_num_threads(),
                  "extra_path": os.environ["PROCS_EXTRA"] in sys.path}))
print("to stderr", file=sys.stderr)
"""


def both(args, env, **kw):
    fresh = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                           **{k: v for k, v in kw.items() if k == "cwd"})
    forked = procs.run(args, env=env, timeout=120, **kw)
    return fresh, forked


def test_a_child_sees_what_a_fresh_interpreter_sees(tmp_path):
    import json

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PROCS_X": "7", "PROCS_EXTRA": str(tmp_path / "lib"),
           "PYTHONPATH": str(tmp_path / "lib")}
    for args in ([sys.executable, str(script), "a", "b"], [sys.executable, "-c", PROBE, "a", "b"]):
        fresh, forked = both(args, env, cwd=str(tmp_path))
        assert fresh.returncode == forked.returncode == 0, (fresh.stderr, forked.stderr)
        a, b = json.loads(fresh.stdout), json.loads(forked.stdout)
        assert len({a["pid"], b["pid"], os.getpid()}) == 3 and a["pgid"] == b["pgid"] == os.getpgid(0)
        for key in ("argv", "path0", "name", "x", "stdin", "sigint", "torch_threads", "extra_path"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert fresh.stderr == forked.stderr == "to stderr\n"


def test_cemtool_reads_its_environment_in_the_child(tmp_path):
    """`python -m cemtool`: the same output both ways, and under RANK=1 (a torchrun rank that is not the first)
    quiet both ways: cemtool reads RANK when it is imported, which each child does itself."""
    for rank in ("0", "1"):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": rank}
        fresh, forked = both([sys.executable, "-m", "cemtool", "archs"], env)
        assert fresh.returncode == forked.returncode == 0, (fresh.stderr, forked.stderr)
        assert (fresh.stdout, fresh.stderr) == (forked.stdout, forked.stderr), rank
        assert ("baseline" in forked.stdout) == (rank == "0")


def test_a_child_keeps_an_ignored_sigint_as_a_started_process_does():
    """Where this process ignores SIGINT (a test run in a shell's background job), a fresh interpreter it starts
    keeps ignoring it, and so does a forked child by default; where it does not, both get Python's handler."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = "import signal; print(signal.getsignal(signal.SIGINT))"
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ignored = both([sys.executable, "-c", code], env)
    finally:
        signal.signal(signal.SIGINT, before)
    handled = both([sys.executable, "-c", code], env)
    assert [p.stdout.strip() for p in ignored] == [str(signal.SIG_IGN)] * 2, ignored
    assert [p.stdout.strip() for p in handled] == [str(signal.default_int_handler)] * 2, handled


def test_exit_statuses_are_the_interpreters(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for code, want in (("pass", 0), ("import sys; sys.exit(3)", 3), ("import sys; sys.exit('Error: no')", 1),
                       ("raise ValueError('boom')", 1), ("raise KeyboardInterrupt", -signal.SIGINT),
                       ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", -signal.SIGTERM)):
        fresh, forked = both([sys.executable, "-c", code], env)
        assert fresh.returncode == forked.returncode == want, (code, fresh.returncode, forked.returncode)
        assert ("Traceback" in fresh.stderr) == ("Traceback" in forked.stderr), code
        assert fresh.stderr.strip().splitlines()[-1:] == forked.stderr.strip().splitlines()[-1:], code
    res = procs.run([sys.executable, "-m", "cemtool", "--help"], env=env)
    assert res.returncode == 0 and "sharpness" in res.stdout


def test_signals_sessions_and_timeouts(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    wait = "import time\nprint('up', flush=True)\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n" \
           "    raise SystemExit(130)\n"
    child = procs.start([sys.executable, "-c", wait], env=env, new_session=True, ignore_sigint=False)
    while "up" not in child.out.read_text():
        time.sleep(0.01)
    assert os.getpgid(child.pid) == child.pid  # its own session and group, as start_new_session gives
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    child.send_signal(signal.SIGINT)
    assert child.wait(timeout=30) == 130
    ignoring = procs.start([sys.executable, "-c", wait], env=env, ignore_sigint=True)
    while "up" not in ignoring.out.read_text():
        time.sleep(0.01)
    ignoring.send_signal(signal.SIGINT)  # ignored, as by a shell's background job
    time.sleep(0.3)
    assert ignoring.poll() is None
    ignoring.kill()
    assert ignoring.wait(timeout=30) == -signal.SIGKILL


def test_a_timed_out_run_kills_its_child():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with pytest.raises(subprocess.TimeoutExpired):
        procs.run([sys.executable, "-c", "import time; time.sleep(60)"], env=env, timeout=0.5)
    last = procs._server.statuses[procs._server.count]  # reaped, not left running
    assert last == -signal.SIGKILL


def test_thread_settings_torch_reads_at_import_are_refused():
    with pytest.raises(ValueError, match="OMP_NUM_THREADS=4"):
        procs.start([sys.executable, "-c", "pass"], env={**os.environ, "OMP_NUM_THREADS": "4"})
    with pytest.raises(ValueError, match="this interpreter"):
        procs.start(["python3", "-c", "pass"])
