"""The scheduler of --jobs: worker processes (spawned, so CUDA works in each) that claim the study's items by file
locks, train and analyse them and share study.json; the parent reports their progress and stops them on Ctrl-C or
SIGTERM."""

from __future__ import annotations

import ctypes
import fcntl
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import torch

from cemtool.errors import CemtoolError
from cemtool.runs import open_lock_file
from cemtool.sweep.items import Callback, _do_item, _finished
from cemtool.sweep.manifest import Study, _not_a_link, read_manifest
from cemtool.writes import os_error

# -- parallel workers (--jobs) -------------------------------------------------------------------------------------

def _run_workers(study: Study, asked: str | torch.device | None, dev: torch.device, jobs: int,
                 callback: Callback | None, corpora: dict) -> Study:
    """Train the study's items in ``jobs`` worker processes (spawned, so CUDA works in each).

    - Items the manifest already counts as finished go through the serial path here first: a missing report is
      made again, a config that no longer matches is refused, exactly as without --jobs.
    - A worker claims an item by an flock on ``.claims/<item>`` (released if it dies), trains and analyses it as
      the serial runner does (the same seed and batches), and writes only its own items into study.json, under
      ``.manifest.lock``. An item is tried once per sweep: the worker marks its claim file with this sweep's id
      when it is done with it, failed or not.
    - Each worker runs torch with (usable cores // workers) threads unless OMP_NUM_THREADS is set. On CUDA asked
      as ``auto`` or ``cuda`` the workers go round the visible GPUs. Each run checks its memory against what is
      free when it starts, so the workers' runs already started count.
    - Ctrl-C (when this process takes it) or SIGTERM stops the workers, which mark their items interrupted; a
      worker also stops when this process dies (Linux: a parent-death signal).

    Returns the study as the workers left it."""
    for item in study.manifest["items"]:  # the serial path's checks of finished items
        if _finished(item):
            def emit(ev: dict, name: str = item["name"]) -> None:
                if callback is not None:
                    callback({**ev, "item": name})

            _do_item(study, item, dev, corpora, emit)
    todo = [it["name"] for it in study.manifest["items"] if not _finished(it)]
    n = min(jobs, len(todo))
    claims = study.path / ".claims"
    _not_a_link(claims)
    claims.mkdir(exist_ok=True)
    devices = [dev] * n
    if dev.type == "cuda" and (asked is None or str(asked) in ("auto", "cuda")) and torch.cuda.device_count() > 1:
        devices = [torch.device("cuda", k % torch.cuda.device_count()) for k in range(n)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = None if os.environ.get("OMP_NUM_THREADS") else max(1, cores // max(1, n))
    if callback is not None:
        said = f"{n} workers" + (f" (--jobs {jobs}, but only {len(todo)} items are left)" if n < jobs else "")
        if n:
            said += f" on {', '.join(sorted({str(d) for d in devices}))}"
            said += f", {threads} torch thread(s) each" if threads else ", torch threads from OMP_NUM_THREADS"
        callback({"kind": "note", "item": None, "text": said})
    if n == 0:
        return study
    sweep_id = uuid.uuid4().hex
    ctx = mp.get_context("spawn")
    own_sigint = signal.getsignal(signal.SIGINT)
    takes_ctrl_c = own_sigint is not signal.SIG_IGN  # a background job of a script ignores it: so do its workers
    procs = [ctx.Process(target=_worker, args=(str(study.path), str(devices[k]), threads, sweep_id, os.getpid(),
                                               takes_ctrl_c), name=f"cemtool-sweep-worker-{k}") for k in range(n)]
    started: list = []

    def stop(signum, frame):  # SIGTERM to this process: stop the workers the way Ctrl-C does
        raise KeyboardInterrupt

    own_sigterm = signal.signal(signal.SIGTERM, stop)
    seen: dict[str, tuple] = {}
    try:
        study = _progress(study, seen, None)  # the states before the workers start
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the workers while they start (no traceback)
        for p in procs:
            p.start()
            started.append(p)
        signal.signal(signal.SIGINT, own_sigint)
        while any(p.is_alive() for p in started):
            time.sleep(1.0)
            study = _progress(study, seen, callback)
    except BaseException:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up is not cut short by a second signal
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for p in started:
            if p.is_alive():
                p.terminate()  # SIGTERM: the worker marks its item interrupted and exits
        for p in started:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
                p.join()
        study.sync(status="interrupted")
        raise
    finally:
        signal.signal(signal.SIGTERM, own_sigterm)
        signal.signal(signal.SIGINT, own_sigint)
    study = _progress(study, seen, callback)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise CemtoolError(f"{len(bad)} of {n} sweep workers stopped with an error (exit codes "
                           f"{', '.join(map(str, bad))}; their messages are above)",
                           hint="rerun the same command to continue the study")
    return study


def _progress(study: Study, seen: dict, callback: Callback | None) -> Study:
    """Reread study.json (as the workers leave it) and tell the callback what changed since the last look: an
    item's start ("item" event), its end ("end", with its step, loss and error) and its analyses' ends."""
    study.sync()
    items = study.manifest["items"]
    for index, it in enumerate(items):
        state = (it["status"], tuple(a["status"] for a in it["analyses"].values()))
        old, seen[it["name"]] = seen.get(it["name"]), state
        if callback is None or old is None or old == state:
            continue
        if it["status"] != old[0] and it["status"] == "running":
            callback({"kind": "item", "item": it["name"], "index": index, "total": len(items), "status": "start"})
        elif it["status"] != old[0] and it["status"] in ("completed", "failed", "interrupted"):
            callback({"kind": "end", "item": it["name"], "status": it["status"], "step": it.get("step"),
                      "val_loss": it.get("val_loss"), "error": it.get("error")})
        for (name, a), was in zip(it["analyses"].items(), old[1], strict=True):
            if a["status"] != was and a["status"] in ("completed", "failed"):
                callback({"kind": "analysis", "item": it["name"], "analysis": name, "status": a["status"],
                          "error": a.get("error")})
    return study


def _worker(path: str, device: str, threads: int | None, sweep_id: str, parent: int, takes_ctrl_c: bool) -> None:
    """One worker process of :func:`_run_workers` (the spawn target): one line on stderr for an error, never a
    traceback (CEMTOOL_DEBUG=1 shows it)."""
    def stop(signum, frame):  # stop once: a second signal must not cut short the saving of the item's state
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if takes_ctrl_c else signal.SIG_IGN)
    try:  # Linux: a SIGTERM when the parent dies (a kill -9 of the sweep leaves no worker behind)
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if threads:
        torch.set_num_threads(threads)
    try:
        _work(Path(path), torch.device(device), sweep_id, parent)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001
        if os.environ.get("CEMTOOL_DEBUG", "") not in ("", "0"):
            raise
        if isinstance(e, OSError):
            e = os_error(e, e.filename or path, "use")
        msg = (f"{e.message}\n" + (f"Hint: {e.hint}\n" if e.hint else "")) if isinstance(e, CemtoolError) else \
            f"sweep worker: internal error ({type(e).__name__}: {e})\n"
        sys.stderr.write(f"Error: {msg}")
        sys.exit(1)


def _work(path: Path, dev: torch.device, sweep_id: str, parent: int) -> None:
    """Claim, train and analyse items until none is left to this sweep."""
    study = Study(path, read_manifest(path / "study.json"))
    study.owned = set()
    corpora: dict[str, object] = {}
    for name in [it["name"] for it in study.manifest["items"]]:
        if os.getppid() != parent:
            raise KeyboardInterrupt  # the sweep that started this worker is gone
        fd = open_lock_file(path / ".claims" / name)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another worker has it
            if os.pread(fd, 64, 0).decode(errors="replace").strip() == sweep_id:
                continue  # done (or failed) in this sweep already
            try:
                study.sync()
                item = study.item(name)
                if not _finished(item):
                    study.owned.add(name)
                    _do_item(study, item, dev, corpora, lambda ev: None)
            finally:  # tried once per sweep, whatever happened
                os.ftruncate(fd, 0)
                os.pwrite(fd, sweep_id.encode(), 0)
        finally:
            study.owned.discard(name)
            os.close(fd)
