"""The run directory: create, write atomically, lock, checkpoint, load, resume, list.

::

    runs/<name>/
      config.json        resolved RunConfig with "schema_version"
      meta.json          versions, git commit, argv, device, seed, start/end, status
      metrics.jsonl      one JSON object per logged step
      tokenizer.json     the run's tokenizer (every analysis reuses it)
      checkpoints/       step_000500.safetensors (+ optimizer/RNG state), final.safetensors, manifest.json
      reports/ plots/ report.md

Weights and optimizer tensors are stored with safetensors and everything else as JSON: nothing is ever
unpickled. Every file is written to a temporary name and renamed, so a crash never leaves a half-written file;
``manifest.json`` records each checkpoint's SHA-256 so corruption is detected on load.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import secrets
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cemtool.config import SCHEMA_VERSION, RunConfig, config_from_run_dict, to_dict
from cemtool.errors import CemtoolError
from cemtool.fileio import check_regular, read_json, read_jsonl  # noqa: F401 (read_json, read_jsonl: also from here)

if TYPE_CHECKING:  # torch is imported where tensors are handled, so that reading reports (cemtool plot) is fast
    import torch

STATUSES = ("running", "completed", "failed", "interrupted")


# --------------------------------------------------------------------------------------------------------------
# atomic file writes


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``path`` through a new temporary file in the same folder and a rename: a crash leaves the old file or
    the new one, never half of one. The temporary file is created exclusively (a planted symlink is never
    followed) and removed again if writing fails (disk full, read-only folder); the error names the path and the
    cause. A symlinked subfolder of a run directory is refused (see :func:`refuse_symlinked_dirs`)."""
    path = Path(path)
    refuse_symlinked_dirs(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise os_error(e, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise os_error(e, path) from None
        raise


TMP_SUFFIX = ".tmp"
_TMP_PID = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$|^\..+\.tmp(\d+)$")  # new and pre-0.x temporary names


def os_error(e: OSError, path: Path | str, doing: str = "write") -> CemtoolError:
    """An OSError as a one-line user error naming the path and the cause (e.g. 'No space left on device')."""
    cause = e.strerror or str(e) or type(e).__name__
    hint = {errno.ENOSPC: "free some disk space, or write the run elsewhere",
            errno.EROFS: "the folder is on a read-only file system: choose another output folder",
            errno.EACCES: "check the folder's permissions, or choose another output folder",
            errno.EDQUOT: "the disk quota is exhausted"}.get(e.errno)
    return CemtoolError(f"cannot {doing} {path}: {cause}", hint=hint)


def clean_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files that a killed writer left in ``folder`` (its process no longer exists);
    return them."""
    removed = []
    try:
        entries = list(Path(folder).iterdir()) if not Path(folder).is_symlink() else []
    except OSError:
        return removed
    for p in entries:
        m = _TMP_PID.match(p.name)
        if m is None or _alive(int(m.group(1) or m.group(2))):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                continue
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def refuse_symlinked_dirs(path: Path) -> None:
    """Refuse to write ``path`` if one of the folders it lies in is a symbolic link that sits inside a run
    directory (``reports/``, ``checkpoints/``, ``plots/`` ...): a planted link would send writes, and checkpoint
    pruning's deletions, outside the run. The run directory itself may be a link."""
    for d in list(Path(path).parents)[:3]:
        if d.is_symlink() and (is_run(d.parent) or is_hf_dir(d.parent)):  # a model directory holds reports too
            raise CemtoolError(f"{d} is a symbolic link: cemtool does not follow links inside a run directory",
                               hint="replace the link by a real folder")


def safe_name(name: str, what: str = "report name") -> str:
    """``name`` if it is a plain file name that stays inside its folder: letters, digits and ``_ . + = -``, not
    starting with a dot or a dash, at most 100 characters. Every user-given report or figure name goes through
    it (``--name ../../escape`` is refused with a one-line error)."""
    if not isinstance(name, str) or len(name) > 100 or not _SAFE_NAME.fullmatch(name):
        raise CemtoolError(f"{what} {name!r} is not a plain name",
                           hint="use letters, digits and - _ . + = (no path separators, not starting with . or -), "
                                "at most 100 characters")
    return name


_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON (RFC 8259, readable by every parser): NaN and ±inf, also inside numpy or torch
    scalars and arrays, are written as null (see :func:`to_json_value`)."""
    atomic_write_text(path, json.dumps(to_json_value(obj), indent=2, sort_keys=False, allow_nan=False) + "\n")


def to_json_value(o: Any, unknown_as_str: bool = False) -> Any:
    """``o`` as plain JSON values (dict, list, str, int, finite float, bool, None), recursively: numpy/torch
    scalars and arrays become Python numbers and lists, tuples lists, paths strings, and every non-finite float
    None. Other types raise TypeError, or become their ``str`` with ``unknown_as_str`` (what the console prints).
    The one JSON sanitiser (reports, metrics, the console); also usable as ``json.dumps(default=...)``."""
    if o is None or isinstance(o, (str, bool, int)):
        return o
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: to_json_value(v, unknown_as_str) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [to_json_value(v, unknown_as_str) for v in o]
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "tolist"):  # numpy / torch scalars and arrays (a 0-d array's tolist() is a scalar)
        return to_json_value(o.tolist(), unknown_as_str)
    if hasattr(o, "item"):
        return to_json_value(o.item(), unknown_as_str)
    if unknown_as_str:
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# --------------------------------------------------------------------------------------------------------------
# provenance


def versions() -> dict[str, str]:
    import numpy
    import torch

    import cemtool

    out = {"cemtool": cemtool.__version__, "python": platform.python_version(), "torch": torch.__version__,
           "numpy": numpy.__version__, "platform": platform.platform()}
    return out


def git_commit() -> str | None:
    """Commit of the cemtool source tree, if it is a git checkout (with '+dirty' for local changes)."""
    src = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------------------------------------------
# the run


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory: a config.json with ``model_type`` and no ``schema_version``, no meta.json."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file() or (Path(path) / "meta.json").is_file():
        return False
    try:
        data = read_json(cfg, "config file")
    except CemtoolError:
        return False
    return isinstance(data, dict) and "model_type" in data and "schema_version" not in data


def is_run(path: str | Path) -> bool:
    """A cemtool run directory: meta.json, or a config.json that is not a Hugging Face model's (a damaged
    config.json still marks a run, whose reading then says what is wrong). The one run detector: JSON only, no
    torch, so ``cemtool plot`` uses it too."""
    p = Path(path)
    return (p / "meta.json").is_file() or ((p / "config.json").is_file() and not is_hf_dir(p))


RUN_SUBDIRS = ("checkpoints", "reports", "plots", "tensorboard")
RUN_FILES = ("config.json", "meta.json", "metrics.jsonl", "tokenizer.json", "report.md")


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
        self.check_same()
        meta = self.meta()
        meta.update(changes)
        atomic_write_json(self.path / "meta.json", meta)
        return meta

    def mark_resumed(self, device: str, **changes: Any) -> dict:
        """Status running and one more resume: called once the checkpoint has loaded, so that a resume that fails
        leaves meta.json as it was."""
        return self.update_meta(status="running", resumed=self.meta().get("resumed", 0) + 1, device=device,
                                **changes)

    def end_session(self, session: dict, status: str, best_effort: bool = False, **changes: Any) -> None:
        """Record the end of one process's training of this run: ``session`` (its ``started``, ``from_step``,
        ``to_step``, ``seconds`` and ``device``) is appended to meta.json's ``sessions`` with its ``ended`` time,
        and ``train_seconds`` becomes the sum over the run's sessions, so a resumed run counts every session's
        training, not only its last. A run written before sessions were recorded keeps what it knew of its earlier
        training as one session with unknown start and steps. ``best_effort``: a failure to write is ignored (a
        failing run must not hide its own error behind a full disk)."""
        try:
            meta = self.meta()
            sessions = meta.get("sessions")
            if not isinstance(sessions, list):
                sessions = [] if meta.get("train_seconds") is None else [
                    {"started": None, "ended": meta.get("ended"), "from_step": None, "to_step": None,
                     "seconds": meta["train_seconds"], "device": meta.get("device")}]
            sessions = [*sessions, {**session, "ended": now()}]
            total = sum(s.get("seconds") or 0.0 for s in sessions)
            self.update_meta(status=status, ended=sessions[-1]["ended"], sessions=sessions, train_seconds=total,
                             **changes)
        except (CemtoolError, OSError):
            if not best_effort:
                raise

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
        from cemtool.models.registry import get_arch

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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The plain module's state (no compile/DDP prefixes), each shared tensor stored once; plus the aliases."""
    model = getattr(model, "_orig_mod", model)
    model = getattr(model, "module", model)
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().contiguous().cpu()
    return tensors, aliases


def _flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Replace tensors in a nested structure by {'__tensor__': key}; return the JSON-able skeleton."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = prefix
        tensors[key] = obj.detach().contiguous().cpu()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {"__dict__": [[_key(k), _flatten(v, f"{prefix}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, f"{prefix}.{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _key(k: Any) -> Any:
    return {"__int__": k} if isinstance(k, int) else k


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict) and "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if isinstance(obj, dict) and "__tuple__" in obj:
        return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
    if isinstance(obj, dict) and "__dict__" in obj:
        return {(k["__int__"] if isinstance(k, dict) else k): _unflatten(v, tensors) for k, v in obj["__dict__"]}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def save_checkpoint(run: Run, name: str, model: torch.nn.Module, *, step: int,
                    optimizer: torch.optim.Optimizer | None = None, state: dict | None = None,
                    extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write checkpoints/<name>.safetensors atomically: weights ('model.*'), optimizer tensors ('optim.*'),
    the torch RNG state, a JSON header (step, aliases, optimizer skeleton, training state) and the SHA-256 of
    header and tensors ('cemtool_sha256'), so that the file verifies on its own; manifest.json also records the
    file's SHA-256. ``extra``: more tensors a resume needs (e.g. the curvature tracker's warm start), stored as
    'extra.<key>'."""
    import torch
    from safetensors.torch import save

    weights, aliases = model_tensors(model)
    tensors = {f"model.{k}": v for k, v in weights.items()}
    tensors.update({f"extra.{k}": v.detach().cpu().contiguous() for k, v in (extra or {}).items()})
    header: dict[str, Any] = {"step": step, "aliases": aliases, "schema_version": SCHEMA_VERSION,
                              "state": state or {}}
    if optimizer is not None:
        header["optimizer"] = _flatten(optimizer.state_dict(), "optim", tensors)
        tensors["rng.torch"] = torch.get_rng_state()
    header_json = json.dumps(header)
    metadata = {"cemtool": header_json, "cemtool_sha256": _content_sha256(header_json, tensors)}
    path = run.checkpoints / f"{name}.safetensors"
    atomic_write_bytes(path, save(tensors, metadata=metadata))
    manifest_path = run.checkpoints / "manifest.json"
    try:
        entries = manifest(run)
    except CemtoolError:  # a corrupt manifest is rewritten: every checkpoint also carries its own hash
        entries = {}
    entries[path.name] = {"step": step, "sha256": _sha256(path), "bytes": path.stat().st_size}
    atomic_write_json(manifest_path, entries)
    return path


def _content_sha256(header_json: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the header and of every tensor's name, dtype, shape and bytes (in name order): what a
    checkpoint means, independent of how safetensors lays it out."""
    import torch

    h = hashlib.sha256(header_json.encode("utf-8"))
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(f"\0{k}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _refuse_pickle(path: Path) -> None:
    with open(path, "rb") as f:
        head = f.read(9)
    if head[8:9] == b"{":  # safetensors: a little-endian u64 header length, then the JSON header
        return
    if head[:1] == b"\x80" or head[:2] == b"PK":
        raise CemtoolError(f"{path} looks like a pickle/torch.save file: cemtool never unpickles files",
                           hint="checkpoints must be safetensors written by cemtool")


@dataclass
class Checkpoint:
    path: Path
    step: int
    weights: dict[str, torch.Tensor]
    header: dict
    tensors: dict[str, torch.Tensor]

    def optimizer_state(self) -> dict | None:
        if "optimizer" not in self.header:
            return None
        return _unflatten(self.header["optimizer"], self.tensors)

    @property
    def tokens(self) -> int:
        return self.header.get("state", {}).get("tokens", 0)


def read_checkpoint(path: str | Path, manifest: dict | None = None) -> Checkpoint:
    """Read and verify a cemtool safetensors checkpoint (the manifest's SHA-256 if it lists the file, the file's
    own 'cemtool_sha256', and a well-formed header); never unpickles."""
    from safetensors import safe_open

    from cemtool.tensorfile import read_header

    path = Path(path)
    if not path.exists():
        raise CemtoolError(f"checkpoint {path} does not exist")
    check_regular(path, "checkpoint")
    _refuse_pickle(path)
    if manifest and path.name in manifest and manifest[path.name].get("sha256") != _sha256(path):
        raise CemtoolError(f"checkpoint {path} is corrupted (checksum mismatch)",
                           hint="use an earlier checkpoint or retrain")
    try:
        read_header(path)  # the whole layout, checked from the header before safetensors parses it
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(meta["cemtool"])
    except Exception as e:  # safetensors raises several types for a bad header or a short file
        raise CemtoolError(f"checkpoint {path} is corrupted or truncated ({str(e).splitlines()[0][:120]})",
                           hint="use an earlier checkpoint or retrain") from None
    if "cemtool_sha256" in meta and meta["cemtool_sha256"] != _content_sha256(meta["cemtool"], tensors):
        raise CemtoolError(f"checkpoint {path} is corrupted (checksum mismatch)",
                           hint="use an earlier checkpoint or retrain")
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    _check_header(path, header, weights, tensors)
    for alias, target in header.get("aliases", {}).items():
        weights[alias] = weights[target]
    return Checkpoint(path, header.get("step", 0), weights, header, tensors)


def _check_header(path: Path, header: Any, weights: dict, tensors: dict) -> None:
    """A hand-written or damaged header (no object, a step that is not a whole number, aliases or optimizer
    entries naming tensors the file lacks) is a one-line error, not a crash later."""
    def bad(what: str) -> CemtoolError:
        return CemtoolError(f"checkpoint {path} has an invalid header ({what})",
                            hint="use an earlier checkpoint or retrain")

    if not isinstance(header, dict):
        raise bad("not a JSON object")
    step = header.get("step", 0)
    if type(step) is not int or step < 0:
        raise bad(f"step {step!r} is not a whole number >= 0")
    aliases = header.get("aliases", {})
    if not isinstance(aliases, dict) or any(not isinstance(t, str) or t not in weights for t in aliases.values()):
        raise bad("an alias names a tensor the file does not hold")
    state = header.get("state", {})
    if not isinstance(state, dict) or type(state.get("tokens", 0)) is not int:
        raise bad("training state is not an object with a whole number of tokens")
    if "optimizer" in header:
        try:
            opt = _unflatten(header["optimizer"], tensors)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise bad("the optimizer state names tensors the file does not hold") from None
        if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) \
                or not isinstance(opt.get("param_groups"), list):
            raise bad("the optimizer state is not an optimizer state_dict")
    rng = tensors.get("rng.torch")
    if rng is not None and (str(rng.dtype) != "torch.uint8" or rng.dim() != 1):
        raise bad("the RNG state is not a byte vector")


def load_weights(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    try:
        model.load_state_dict(ckpt.weights, strict=True)
    except RuntimeError as e:
        raise CemtoolError(f"checkpoint {ckpt.path} does not fit the configured model: "
                           f"{str(e).splitlines()[1].strip()[:160] if len(str(e).splitlines()) > 1 else e}") from None


def check_fits(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Refuse, before anything is restored, a step checkpoint that does not fit the model and optimizer being
    resumed: every weight must have the model's name, shape and dtype; the optimizer state the live optimizer's
    groups and parameter counts, every tensor of a parameter's state that parameter's shape and dtype (or be a
    floating scalar, like AdamW's step), the same state names for every parameter of one optimizer; the RNG state
    the length of torch's. A forged file (a wrong-shaped tensor under a recomputed checksum) is then skipped on
    resume like a corrupt one, instead of crashing half-way through loading."""
    import torch

    def bad(what: str) -> CemtoolError:
        return CemtoolError(f"checkpoint {ckpt.path} does not fit the configured model and optimizer ({what})",
                            hint="use an earlier checkpoint or retrain")

    plain = getattr(model, "_orig_mod", model)
    live = getattr(plain, "module", plain).state_dict()  # no compile/DDP prefixes, as model_tensors
    if set(live) != set(ckpt.weights):
        odd = sorted(set(live) ^ set(ckpt.weights))
        raise bad(f"weights {', '.join(odd[:3])} missing or unexpected")
    for k, t in live.items():
        w = ckpt.weights[k]
        if w.shape != t.shape or w.dtype != t.dtype:
            raise bad(f"weight {k} is {w.dtype} {tuple(w.shape)}, the model's {t.dtype} {tuple(t.shape)}")
    rng = ckpt.tensors.get("rng.torch")
    if rng is not None and rng.numel() != torch.get_rng_state().numel():
        raise bad(f"the RNG state has {rng.numel()} bytes, torch's {torch.get_rng_state().numel()}")
    state = ckpt.optimizer_state()
    if optimizer is not None and state is not None:
        why = _optimizer_misfit(state, optimizer)
        if why:
            raise bad(why)


def _optimizer_misfit(state: dict, optimizer: torch.optim.Optimizer) -> str | None:
    """Why a saved optimizer state_dict cannot be loaded into ``optimizer`` (None if it can): see check_fits."""
    import torch

    saved, mine = state["param_groups"], optimizer.state_dict()["param_groups"]
    if len(saved) != len(mine) or any(
            not isinstance(g, dict) or not isinstance(g.get("params"), list) or len(g["params"]) != len(m["params"])
            or g.get("optimizer") != m.get("optimizer") for g, m in zip(saved, mine, strict=False)):
        return "its parameter groups are not this optimizer's"
    params = [p for g in optimizer.param_groups for p in g["params"]]  # torch pairs them with the saved ids in order
    owner = [m.get("optimizer") for m in mine for _ in m["params"]]
    index = {i: n for n, i in enumerate(i for g in saved for i in g["params"])}
    names: dict = {}
    for i, entry in state["state"].items():
        if i not in index or not isinstance(entry, dict):
            return f"optimizer state {i!r} names no parameter"
        n = index[i]
        if names.setdefault(owner[n], set(entry)) != set(entry):
            return f"parameter {i}'s optimizer state holds {sorted(entry)}, another's {sorted(names[owner[n]])}"
        for key, v in entry.items():
            if isinstance(v, torch.Tensor) and not (v.dim() == 0 and v.is_floating_point()) \
                    and (v.shape != params[n].shape or v.dtype != params[n].dtype):
                return (f"optimizer {key} of parameter {i} is {v.dtype} {tuple(v.shape)}, the parameter "
                        f"{params[n].dtype} {tuple(params[n].shape)}")
    return None


def restore_training(ckpt: Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a step checkpoint's weights, optimizer state and RNG state for resuming (checked first by
    :func:`check_fits`, so that a checkpoint that does not fit leaves model and optimizer untouched); one-line
    errors."""
    import torch

    check_fits(ckpt, model, optimizer)
    load_weights(model, ckpt)
    state = ckpt.optimizer_state()
    try:
        if state is not None:
            optimizer.load_state_dict(state)
        if "rng.torch" in ckpt.tensors:
            torch.set_rng_state(ckpt.tensors["rng.torch"])
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CemtoolError(f"checkpoint {ckpt.path}: its optimizer or RNG state does not fit the configured "
                           f"model ({str(e).splitlines()[0][:120]})", hint="use an earlier checkpoint") from None


def resume_checkpoint(run: Run, set_aside: bool = True, fits: Callable[[Checkpoint], None] | None = None
                      ) -> tuple[Checkpoint | None, list[str]]:
    """The newest step checkpoint that verifies (and, given ``fits``, passes it: e.g. :func:`check_fits` against
    the model being resumed), and a note for each newer one skipped (corrupt, truncated, not cemtool's, forged);
    with ``set_aside`` (the one writing process) those are renamed to ``<name>.corrupt`` (kept, but no longer taken
    for checkpoints, nor pruned in place of good ones). (None, []) if the run has no step checkpoint; an error if
    none of them verifies."""
    try:
        entries = manifest(run)
        notes = []
    except CemtoolError as e:
        entries, notes = {}, [f"{e.message}: checking each checkpoint's own hash instead"]
    steps = step_checkpoints(run)
    errors: list[tuple[Path, str]] = []
    for path in reversed(steps):
        try:
            ckpt = read_checkpoint(path, entries)
            if fits is not None:
                fits(ckpt)
        except CemtoolError as e:
            errors.append((path, e.message))
            continue
        for bad, why in errors:
            if set_aside:
                bad.rename(bad.with_name(bad.name + ".corrupt"))
            notes.append(f"resuming from {path.name}: skipped {bad.name} ({why}; kept as {bad.name}.corrupt)")
        return ckpt, notes
    if not steps:
        return None, notes
    raise CemtoolError(errors[0][1], hint=f"none of the {len(steps)} step checkpoint(s) verifies; start the run "
                                       "anew with --force")


def manifest(run: Run) -> dict:
    p = run.checkpoints / "manifest.json"
    entries = read_json(p, "checkpoint manifest") if p.exists() else {}
    if not isinstance(entries, dict):
        raise CemtoolError(f"checkpoint manifest {p} is corrupt (not a JSON object)")
    return entries


def step_checkpoints(run: Run) -> list[Path]:
    return sorted(run.checkpoints.glob("step_*.safetensors"))


def find_checkpoint(run: Run, which: str | int = "final") -> Path:
    """'final', 'latest' (newest step checkpoint, else final), a step number, or a file path."""
    if isinstance(which, int) or (isinstance(which, str) and which.isdigit()):
        p = run.checkpoints / f"step_{int(which):06d}.safetensors"
    elif which == "latest":
        steps = step_checkpoints(run)
        p = steps[-1] if steps else run.checkpoints / "final.safetensors"
    elif which == "final":
        p = run.checkpoints / "final.safetensors"
        if not p.exists():
            status = _status(run)
            raise CemtoolError(f"run {run.path} has no final checkpoint (status: {status})",
                               hint="use checkpoint='latest' or resume the run")
    else:
        p = Path(which)
        if not p.is_absolute() and not p.exists():
            p = run.checkpoints / which
    if not p.exists():
        raise CemtoolError(f"checkpoint {p} does not exist")
    return p


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
