"""Child processes for the end-to-end tests that start several Python processes (the ranks of a distributed
command, a training stopped by a signal): each is forked from one server process per pytest worker that has
imported torch, torch._dynamo (which torch.optim imports with a process's first optimizer) and torch.distributed
once, so that it starts in a fraction of a second instead of the ~3.5 s those imports take on a CPU core.

Each child is a process of its own: its own pid, memory, signals, exit status and file descriptors (ranks talk
over gloo's TCP as torchrun's would). It runs ``python -m MODULE ...``, ``python SCRIPT ...`` or
``python -c CODE ...`` as a fresh interpreter would: ``sys.argv``, ``sys.path[0]`` and PYTHONPATH, ``__main__``,
the environment it is given, stdin from /dev/null, its output to files, and what the server's imports printed on
stderr. cemtool itself is imported by each child, so what cemtool reads from the environment at import (RANK,
CEMTOOL_DEBUG) is the child's. It leaves with SystemExit's status (an uncaught KeyboardInterrupt as SIGINT, as
Python does), after waiting for its threads and running the exit handlers, with its output flushed; what it skips
is the interpreter's final teardown (module and C++ destructors), which cemtool's distributed commands skip too
(cemtool.distributed.exit_process). The environment torch reads at import (the thread counts) is the server's, so
a child with other values is refused. Tests about a fresh interpreter (what an import costs or pulls in, the
real torchrun launcher, a real SIGKILL of `cemtool train`) keep subprocess.Popen. research/scripts/study_gpu.py's
lanes start their sweeps the same way.

    child = start([sys.executable, "-m", "cemtool", "train", ...], env={...})
    out, err = child.communicate(timeout=120)  # child.returncode: as Popen's (-N for signal N)
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

TESTS = Path(__file__).resolve().parent
IMPORT_TIME = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # read once, by the server's import of torch (as 1)


class Child:
    """One forked child: Popen's pid, poll, wait, communicate, send_signal, kill and returncode."""

    def __init__(self, server: Server, pid: int, key: int, out: Path, err: Path, args: list[str]):
        self.server, self.pid, self.key, self.out, self.err, self.args = server, pid, key, out, err, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect(0.0)
            self.returncode = self.server.statuses.get(self.key)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if self.server.dead:
                raise RuntimeError(f"the test process server ended before {self.args} did")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.server.collect(0.05 if left is None else min(0.05, left))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.out.read_text(errors="replace"), self.err.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended, and its status is on the way (as Popen, nothing to do)
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """The forking server (``serve`` in a fresh interpreter) and the replies it sends: a child's pid when it is
    forked, its exit status when it ends."""

    def __init__(self):
        env = {**os.environ, **dict.fromkeys(IMPORT_TIME, "1")}  # the tests' one thread per process
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import procs; procs.serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.tmp = Path(tempfile.mkdtemp(prefix="procs-"))
        self.pending = b""
        self.pids: dict[int, int] = {}
        self.statuses: dict[int, int] = {}
        self.count = 0
        self.dead = False

    def start(self, args: list[str], env: dict[str, str], cwd: str | None, new_session: bool,
              ignore_sigint: bool) -> Child:
        self.count += 1
        key = self.count
        out, err = self.tmp / f"{key}.out", self.tmp / f"{key}.err"
        out.touch()  # readable at once (the child truncates and fills them)
        err.touch()
        request = {"key": key, "argv": args[1:], "env": env, "cwd": cwd or os.getcwd(), "stdout": str(out),
                   "stderr": str(err), "new_session": new_session, "ignore_sigint": ignore_sigint}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while key not in self.pids:
            if self.dead:
                raise RuntimeError(f"the test process server ended (exit {self.proc.wait()})")
            self.collect(1.0)
        return Child(self, self.pids[key], key, out, err, args)

    def collect(self, timeout: float) -> None:
        """Read the replies that have arrived (waiting up to ``timeout`` seconds for the first)."""
        fd = self.proc.stdout.fileno()
        while select.select([fd], [], [], timeout)[0]:
            data = os.read(fd, 65536)
            if not data:  # the server ended (its children die with it: PR_SET_PDEATHSIG)
                self.dead = True
                return
            self.pending += data
            *lines, self.pending = self.pending.split(b"\n")
            for line in lines:
                reply = json.loads(line)
                if "pid" in reply:
                    self.pids[reply["key"]] = reply["pid"]
                else:
                    self.statuses[reply["key"]] = reply["status"]
            timeout = 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server kills the children still running and leaves
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for p in self.tmp.iterdir():
            p.unlink()
        self.tmp.rmdir()


_server: Server | None = None


def start(args: list[str], env: dict[str, str] | None = None, cwd: str | None = None, new_session: bool = False,
          ignore_sigint: bool | None = None) -> Child:
    """``args`` = [sys.executable, "-m", MODULE | SCRIPT | "-c", CODE, ...] as a forked child with ``env``
    (default: this process's), in its own session with ``new_session`` (as Popen's start_new_session), SIGINT
    ignored with ``ignore_sigint`` (as a shell's background job). By default the child ignores SIGINT where this
    process does, as a process it started would (an ignored signal is the one disposition exec keeps): so under a
    test run started in a shell's background."""
    global _server
    if ignore_sigint is None:
        ignore_sigint = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    env = dict(os.environ if env is None else env)
    if args[0] != sys.executable:
        raise ValueError(f"a child runs this interpreter's Python, not {args[0]}")
    for key in IMPORT_TIME:
        if env.get(key, "1" if key != "OMP_NUM_THREADS" else None) != "1":
            raise ValueError(f"{key}={env.get(key)}: torch reads it when it is imported, and the server imported "
                             "it as 1; start a fresh process (subprocess.Popen) instead")
    if _server is None or _server.dead or _server.proc.poll() is not None:
        _server = Server()
        atexit.register(_server.close)
    return _server.start(args, env, cwd, new_session, ignore_sigint)


def ranks(args: list[str], world: int, env: dict[str, str] | None = None) -> list[Child]:
    """``args`` in ``world`` children with the environment torchrun gives its workers (one node, a free port on
    127.0.0.1), without its launcher: rank r is the r-th child."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    base = dict(os.environ if env is None else env)
    return [start(args, {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "LOCAL_RANK": str(r),
                         "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}) for r in range(world)]


def run(args: list[str], env: dict[str, str] | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """``start`` and wait: subprocess.run(args, capture_output=True, text=True)'s result."""
    child = start(args, env, **kw)
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:  # as subprocess.run: the child is killed (its whole group in its own session)
        try:
            if kw.get("new_session"):
                os.killpg(child.pid, signal.SIGKILL)
            else:
                child.kill()
        except ProcessLookupError:
            pass
        child.wait()
        raise
    return subprocess.CompletedProcess(args, child.returncode, out, err)


# ----------------------------------------------------------------------------------------------------------------
# the server side


def serve() -> None:
    """Import once, then for each request line fork a child that runs it; answer {"key", "pid"} when forked and
    {"key", "status"} (as Popen's returncode) when it ends. When the requests end, the children left are killed."""
    saved = os.dup(2)
    with tempfile.TemporaryFile() as said:  # what the imports print on stderr: each child prints it again
        os.dup2(said.fileno(), 2)
        try:
            import torch._dynamo  # noqa: F401  (torch.optim imports it with a process's first optimizer: ~1.4 s)
            import torch.distributed  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        said.seek(0)
        global _IMPORT_STDERR
        _IMPORT_STDERR = said.read()
    sys.path.remove(str(TESTS))  # put there to import this module: a child's sys.path is the interpreter's own
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the test run is pytest's; each child resets it
    children: dict[int, int] = {}
    pending = b""
    stdin_open = True
    while stdin_open or children:
        if stdin_open and select.select([0], [], [], 0.01)[0]:
            data = os.read(0, 65536)
            if not data:
                stdin_open = False
                for pid in children:
                    _kill(pid)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)  # never returns
                children[pid] = request["key"]
                _reply({"key": request["key"], "pid": pid})
        elif not stdin_open:
            time.sleep(0.01)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _reply({"key": children.pop(pid), "status": os.waitstatus_to_exitcode(status)})


_IMPORT_STDERR = b""


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reply(obj: dict) -> None:
    os.write(1, (json.dumps(obj) + "\n").encode())


def _child(request: dict) -> None:
    """In the forked child: become the requested interpreter run, then leave with its status."""
    code = 1
    try:
        _die_with_the_server()
        if request["new_session"]:
            os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN if request["ignore_sigint"] else signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[1:1] = extra  # as the interpreter reads PYTHONPATH at its start (after sys.path[0])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, flags, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.write(2, _IMPORT_STDERR)
        code = _exit_status(_run, request["argv"])
        import atexit as exits
        import threading

        threading._shutdown()  # as the interpreter does at its end: wait for the threads that are not daemons,
        exits._run_exitfuncs()  # then the exit handlers (cemtool.distributed registers one)
    except BaseException:  # noqa: BLE001  (whatever failed, the child leaves here and says why)
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code == INTERRUPTED:  # Python ends an uncaught KeyboardInterrupt by SIGINT, so its status is -2
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


INTERRUPTED = -signal.SIGINT  # _exit_status's code for an uncaught KeyboardInterrupt


def _die_with_the_server() -> None:
    """Linux: SIGKILL this child when the server ends, so that no child outlives a crashed or killed server."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the server kills its children when its requests end
        pass


def _exit_status(fn, argv: list[str]) -> int:
    """The status the interpreter would leave with after running ``fn(argv)``: 0, SystemExit's code, or 1 after
    an uncaught exception's traceback."""
    try:
        fn(argv)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        return INTERRUPTED
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        return 1


def _run(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        sys.argv = list(argv)
        sys.path[0] = str(Path(argv[0]).resolve().parent)
        runpy.run_path(argv[0], run_name="__main__")
