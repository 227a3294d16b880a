"""The run directory: create it (all or nothing), lock it, its meta, metrics and config, list runs.

What the directory holds is in :mod:`cemtool.layout`'s docstring. Checkpoints are :mod:`cemtool.checkpoints`;
every file is written by :mod:`cemtool.writes` (a temporary name and a rename, so a crash never leaves a
half-written file) and read by :mod:`cemtool.fileio`; the model a run holds is opened by :mod:`cemtool.subject`.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import platform
import secrets
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cemtool.architectures import get_arch
from cemtool.config import SCHEMA_VERSION, RunConfig, config_from_run_dict, to_dict
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json, read_jsonl
from cemtool.layout import RUN_FILES, RUN_SUBDIRS, is_hf_dir, is_run
from cemtool.provenance import git_commit, now, versions
from cemtool.writes import (
    _alive,
    atomic_write_json,
    atomic_write_text,
    clean_stale_temps,
    os_error,
    safe_name,
    to_json_value,
)

STATUSES = ("running", "completed", "failed", "interrupted")


# --------------------------------------------------------------------------------------------------------------
# atomic file writes
























# --------------------------------------------------------------------------------------------------------------
# provenance








# --------------------------------------------------------------------------------------------------------------
# the run


def open_lock_file(p: Path) -> int:
    """Open (create) the lock file ``p`` for flock without following links: a planted symlink, hard link or
    special file is refused, never written through. The one way cemtool opens a lock file."""
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CemtoolError(f"{p} is a symbolic link: cemtool does not follow links it did not make",
                               hint="remove the link") from None
        raise os_error(e, p, "lock") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        raise CemtoolError(f"{p} is not a plain file (a link or a special file)", hint="remove it")
    return fd


@dataclass
class Run:
    """A run directory opened for writing (holds its lock) or for reading. ``ident``: the directory's (device,
    inode) when it was opened; every write into the run checks that the path still names that directory."""

    path: Path
    lock_fd: int | None = None
    ident: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.ident is None:
            self.ident = _dir_ident(self.path)

    def check_same(self) -> None:
        """Refuse (before writing) if the path no longer names the directory opened: the run was moved aside
        (``train --force``) or replaced, so whatever was measured belongs to another run."""
        if self.ident is not None and _dir_ident(self.path) != self.ident:
            raise CemtoolError(f"run {self.path} is no longer the run that was opened (moved aside by train --force, "
                               "or replaced): nothing was written into it",
                               hint="measure the run now at this path again if you want its report")

    def _subdir(self, name: str) -> Path:
        self.check_same()
        p = self.path / name
        if p.is_symlink():
            raise CemtoolError(f"{p} is a symbolic link: cemtool does not follow links inside a run directory",
                               hint="replace the link by a real folder")
        return p

    @property
    def checkpoints(self) -> Path:
        return self._subdir("checkpoints")

    @property
    def reports(self) -> Path:
        return self._subdir("reports")

    @property
    def plots(self) -> Path:
        return self._subdir("plots")

    # -- locking ----------------------------------------------------------------------------------------------

    def lock(self, shared: bool = False) -> None:
        """Take the run's lock (released automatically if the process dies): exclusive for a writer (training,
        ``--resume``, ``--force`` before it moves the run aside), ``shared`` for an analysis, which several may hold
        at once but none while a writer holds it. Never waits: a lock held the other way is a one-line error. The
        lock file is opened without following links: a planted ``.lock`` symlink is refused, never written
        through."""
        fd = open_lock_file(self.path / ".lock")
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if shared:
                raise CemtoolError(f"run {self.path} is being written by another process (training)",
                                   hint="measure it once the training has ended") from None
            raise CemtoolError(f"run {self.path} is in use by another process (training, or an analysis reading "
                               "it)", hint="wait for it to finish or stop it") from None
        self.lock_fd = fd
        try:
            self.check_same()  # the run was swapped between opening and locking
        except CemtoolError:
            self.unlock()
            raise
        if shared:
            return
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        for name in RUN_FILES + RUN_SUBDIRS:  # a writer never follows a link planted among the run's files
            if (self.path / name).is_symlink():
                self.unlock()
                raise CemtoolError(f"{self.path / name} is a symbolic link: cemtool does not follow links inside a "
                                   "run directory", hint="replace the link by a real file or folder")
        for d in (self.path, *(self.path / s for s in RUN_SUBDIRS)):
            clean_stale_temps(d)

    def unlock(self) -> None:
        if self.lock_fd is not None:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            os.close(self.lock_fd)
            self.lock_fd = None

    def lock_held(self) -> bool | None:
        """Whether some process (this one included) holds the run's lock; None if that cannot be told."""
        try:
            fd = os.open(self.path / ".lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO never blocks
        except FileNotFoundError:
            return False
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # a planted FIFO or device: not a lock anyone holds
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        finally:
            os.close(fd)  # closing drops the shared lock taken just now
        return False

    def status(self, meta: dict | None = None) -> str:
        """meta.json's status, except that a run marked running whose lock nobody holds (killed with -9, power
        cut) is 'stopped'."""
        meta = self.meta() if meta is None else meta
        status = str(meta.get("status", "?"))
        if status == "running" and self.lock_held() is False:
            return "stopped"
        return status

    # -- files --------------------------------------------------------------------------------------------------

    def config(self) -> RunConfig:
        return config_from_run_dict(read_json(self.path / "config.json", "config file"),
                                    str(self.path / "config.json"))

    def meta(self) -> dict:
        meta = read_json(self.path / "meta.json", "run metadata")
        if not isinstance(meta, dict):
            raise CemtoolError(f"run metadata {self.path / 'meta.json'} is corrupt (not a JSON object)")
        return meta

    def update_meta(self, **changes: Any) -> dict:
        meta = self.meta()
        meta.update(changes)
        self._write_meta(meta)
        return meta

    def mark_resumed(self, device: str, **changes: Any) -> dict:
        """Status running and one more resume: called once the checkpoint has loaded, so that a resume that fails
        leaves meta.json as it was. A session that a process left open (``open_session``: :meth:`record_progress`)
        joins ``sessions`` now, marked ``unended``."""
        meta = _with_unended_session(self.meta(), None)
        meta.update(status="running", resumed=meta.get("resumed", 0) + 1, device=device, **changes)
        self._write_meta(meta)
        return meta

    def record_progress(self, session: dict) -> None:
        """The running session up to a step checkpoint, as meta.json's ``open_session`` (``ended``: now), written
        before the checkpoint is: a process that never reaches :meth:`end_session` (killed with -9, or stopped by an
        error it does not record) is counted by the next one to train the run up to the checkpoint it last began
        (which may not have been saved: the steps after the one a resume starts from are trained again and counted
        again). A left-open session of another process is moved into ``sessions`` first, never overwritten."""
        meta = _with_unended_session(self.meta(), session)
        meta["open_session"] = {**session, "ended": now()}
        self._write_meta(meta)

    def end_session(self, session: dict, status: str, best_effort: bool = False, **changes: Any) -> None:
        """Record the end of one process's training of this run: ``session`` (its ``started``, ``from_step``,
        ``to_step``, ``seconds`` and ``device``) is appended to meta.json's ``sessions`` with its ``ended`` time,
        and ``train_seconds`` becomes the sum over the run's sessions, so a resumed run counts every session's
        training, not only its last (an unended one up to its last checkpoint). A run written before sessions
        were recorded keeps what it knew of its earlier training as one session with unknown start and steps.
        ``best_effort``: a failure to write is ignored (a failing run must not hide its own error behind a full
        disk)."""
        try:
            meta = _with_unended_session(self.meta(), session)
            sessions = [*meta["sessions"], {**session, "ended": now()}]
            meta.update(status=status, ended=sessions[-1]["ended"], sessions=sessions,
                        train_seconds=_seconds(sessions), **changes)
            self._write_meta(meta)
        except (CemtoolError, OSError):
            if not best_effort:
                raise

    def _write_meta(self, meta: dict) -> None:
        self.check_same()
        atomic_write_json(self.path / "meta.json", meta)

    def metrics(self, skipped: list[str] | None = None) -> list[dict]:
        return read_jsonl(self.path / "metrics.jsonl", skipped)

    def append_metrics(self, row: dict) -> None:
        p = self.path / "metrics.jsonl"
        line = (json.dumps(to_json_value(row), allow_nan=False) + "\n").encode("utf-8")  # strict: NaN -> null
        try:
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise CemtoolError(f"{p} is a symbolic link: cemtool does not follow links inside a run directory",
                                   hint="remove the link") from None
            raise os_error(e, p) from None
        try:
            os.write(fd, line)
        except OSError as e:
            raise os_error(e, p) from None
        finally:
            os.close(fd)

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines after ``step`` (a resumed run re-logs them)."""
        rows = [r for r in self.metrics() if r.get("step", 0) <= step]
        text = "".join(json.dumps(to_json_value(r), allow_nan=False) + "\n" for r in rows)
        atomic_write_text(self.path / "metrics.jsonl", text)

    def write_report(self, name: str, obj: Any) -> Path:
        path = self.reports / f"{safe_name(name)}.json"
        atomic_write_json(path, obj)
        return path


def _dir_ident(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the directory ``path`` names (through a link: the run directory may be one)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def lock_for_reading(path: str | Path) -> Run | None:
    """The run at ``path`` with its shared lock taken: what an analysis holds from before it loads the run until
    its reports are written, so that ``train --force`` cannot move the run aside meanwhile. None if ``path`` is
    not a cemtool run directory (a Hugging Face model, ``hf:`` id or missing folder: loading says what it is)."""
    p = Path(path)
    if not p.is_dir() or not is_run(p):
        return None
    run = Run(p)
    run.lock(shared=True)
    return run


def create_run(path: str | Path, cfg: RunConfig, *, force: bool = False, argv: list[str] | None = None,
               device: str = "cpu", extra_meta: dict | None = None, tokenizer: Any = None) -> Run:
    """Make a fresh run directory (locked), with its config.json, meta.json and (given ``tokenizer``)
    tokenizer.json. The files are written into a hidden temporary folder beside it that is renamed into place
    at the end, so that a kill leaves either no run or a complete one. An existing run is refused unless
    ``force``, which moves it aside to ``<name>.replaced-<timestamp>`` (nothing is deleted)."""
    path = Path(path)
    if path.is_symlink() and path.is_dir():
        path = path.resolve()  # --out is a link to a folder: build the run beside the folder it names
    if path.exists() and not path.is_dir():
        raise CemtoolError(f"output path {path} exists and is not a directory")
    probe = None
    if path.exists() and any(path.iterdir()):
        if not is_run(path):
            raise CemtoolError(f"output directory {path} is not empty and is not a cemtool run",
                               hint="choose another --out")
        if not force:
            raise CemtoolError(f"output directory {path} already holds a run",
                               hint="use --resume to continue it, --force to move it aside, or another --out")
        probe = Run(path)
        probe.lock()  # refuse to move a run that is being written or measured; held until it is moved aside
    try:
        return _new_run(path, cfg, move_aside=probe is not None, argv=argv, device=device, extra_meta=extra_meta,
                        tokenizer=tokenizer)
    finally:
        if probe is not None:
            probe.unlock()


def _new_run(path: Path, cfg: RunConfig, *, move_aside: bool, argv: list[str] | None, device: str,
             extra_meta: dict | None, tokenizer: Any) -> Run:
    """create_run's work: the run written into a hidden folder, the old one moved aside, the folder renamed."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise os_error(e, path.parent, "create") from None
    _clean_stale_creations(path)
    tmp = path.with_name(f".{path.name}.creating.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        tmp.mkdir()
    except OSError as e:
        raise os_error(e, path, "create") from None
    run = Run(tmp)
    try:
        run.lock()
        atomic_write_json(tmp / "config.json", to_dict(cfg))
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer.json")

        meta = {"schema_version": SCHEMA_VERSION, "status": "running", "arch": cfg.model.arch,
                "family": get_arch(cfg.model.arch).family, "seed": cfg.seed,
                "created": now(), "started": now(), "ended": None, "argv": argv if argv is not None else sys.argv,
                "device": device, "versions": versions(), "git_commit": git_commit(), "hostname": platform.node(),
                "step": 0}
        meta.update(extra_meta or {})
        atomic_write_json(tmp / "meta.json", meta)
        if move_aside:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            path.rename(path.with_name(f"{path.name}.replaced-{stamp}"))
        _rename_into_place(tmp, path)
    except BaseException:
        run.unlock()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    run.path = path
    return run


def _rename_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished temporary run folder to ``path`` (which must be missing or an empty folder)."""
    try:
        os.rename(tmp, path)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise CemtoolError(f"output directory {path} was filled by another process while the run was created",
                               hint="choose another --out") from None
        raise os_error(e, path, "create") from None


def _clean_stale_creations(path: Path) -> None:
    """Remove the hidden temporary folders of runs whose creation at ``path`` was killed."""
    prefix = f".{path.name}.creating."
    for p in path.parent.iterdir():
        parts = p.name[len(prefix):].split(".")
        if (not p.name.startswith(prefix) or len(parts) != 2 or not parts[0].isdigit() or p.is_symlink()
                or not p.is_dir() or _alive(int(parts[0]))):
            continue
        shutil.rmtree(p, ignore_errors=True)


def open_run(path: str | Path, *, lock: bool = False) -> Run:
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CemtoolError(f"{path} is a file, not a run directory")
    if not path.is_dir():
        raise CemtoolError(f"run directory {path} does not exist")
    if not is_run(path):
        raise CemtoolError(f"{path} is not a cemtool run ("
                           f"{'a Hugging Face model directory' if is_hf_dir(path) else 'no config.json'})")
    run = Run(path)
    if lock:
        run.lock()
    return run


# --------------------------------------------------------------------------------------------------------------
# checkpoints








































def _status(run: Run) -> str:
    try:
        return run.status()
    except CemtoolError:
        return "unknown"


def list_runs(root: str | Path) -> list[dict]:
    """One row per run found under ``root`` (itself a run, or a folder of runs, searched recursively). A run
    marked running whose process is gone shows as 'stopped'; unreadable metric lines are noted in 'notes'."""
    root = Path(root)
    if not root.exists():
        raise CemtoolError(f"{root} does not exist")
    found = [root] if is_run(root) else sorted({p.parent for p in root.rglob("config.json") if is_run(p.parent)})
    rows = []
    for p in found:
        run = Run(p)
        try:
            meta, cfg = run.meta(), run.config()
        except CemtoolError as e:
            rows.append({"run": str(p), "status": f"unreadable: {e.message}"})
            continue
        notes: list[str] = []
        evals = [m for m in run.metrics(notes) if "val_loss" in m]
        status = run.status(meta)
        if status == "stopped":
            notes.insert(0, "meta.json says running but no process holds the run (killed?): resume it with "
                            f"cemtool train --resume {p}")
        rows.append({"run": str(p), "arch": cfg.model.arch, "kind": run_kind(meta),
                     "data": data_name(cfg.data.source), "status": status, "step": meta.get("step"),
                     "val_loss": evals[-1]["val_loss"] if evals else None,
                     "floor": evals[-1].get("val_floor") if evals else None, "seed": cfg.seed, "notes": notes})
    return rows


def run_kind(meta: dict) -> str:
    """What made a run: ``train``, ``fine-tune`` (cemtool forgetting: its validation loss is on the target data) or
    the ``kind`` meta.json records (e.g. an imported model)."""
    kind = meta.get("kind")
    if meta.get("parent") is not None or kind == "forgetting":
        return "fine-tune"
    return kind if isinstance(kind, str) and kind else "train"


def data_name(source: str) -> str:
    """A data source as a short column: a built-in name as it is, a path as its last part."""
    return (Path(source).name or source) if "/" in source else source


def _seconds(sessions: list[dict]) -> float:
    return sum(s.get("seconds") or 0.0 for s in sessions)


def _with_unended_session(meta: dict, own: dict | None) -> dict:
    """``meta`` with its ``sessions`` a list (a run written before sessions were recorded: its last known training
    as one session of unknown start and steps) and its ``open_session`` removed: moved into ``sessions``, marked
    ``unended``, if another process left it (a process that never recorded its end), dropped if it is ``own``'s
    (this process's progress record, the same start, which its newer record or its ended session replaces);
    ``train_seconds`` their sum. A copy: ``meta`` itself is not changed."""
    meta = dict(meta)
    sessions = meta.get("sessions")
    if not isinstance(sessions, list):
        sessions = [] if meta.get("train_seconds") is None else [
            {"started": None, "ended": meta.get("ended"), "from_step": None, "to_step": None,
             "seconds": meta["train_seconds"], "device": meta.get("device")}]
    left = meta.pop("open_session", None)
    if isinstance(left, dict) and (own is None or left.get("started") != own.get("started")):
        sessions = [*sessions, {**left, "unended": True}]
    meta["sessions"] = sessions
    if sessions:
        meta["train_seconds"] = _seconds(sessions)
    return meta
