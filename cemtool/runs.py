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
import fcntl
import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cemtool.config import SCHEMA_VERSION, RunConfig, config_from_run_dict, to_dict
from cemtool.errors import CemtoolError

if TYPE_CHECKING:  # torch is imported where tensors are handled, so that reading reports (cemtool plot) is fast
    import torch

STATUSES = ("running", "completed", "failed", "interrupted")


# --------------------------------------------------------------------------------------------------------------
# atomic file writes


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_jsonl(path: str | Path) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line (a line cut by a kill, or not an object, is skipped); [] if
    the file does not exist."""
    p = Path(path)
    if not p.exists():
        return []
    rows = []
    for line in p.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CemtoolError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CemtoolError(f"{what} {path} is corrupt ({str(e)[:120]})") from None


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


def is_run(path: Path) -> bool:
    return (Path(path) / "config.json").is_file() or (Path(path) / "meta.json").is_file()


@dataclass
class Run:
    """A run directory opened for writing (holds its lock) or for reading."""

    path: Path
    lock_fd: int | None = None

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def reports(self) -> Path:
        return self.path / "reports"

    @property
    def plots(self) -> Path:
        return self.path / "plots"

    # -- locking ----------------------------------------------------------------------------------------------

    def lock(self) -> None:
        """Take the run's exclusive lock (released automatically if the process dies)."""
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise CemtoolError(f"run {self.path} is in use by another process",
                               hint="wait for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.lock_fd = fd

    def unlock(self) -> None:
        if self.lock_fd is not None:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            os.close(self.lock_fd)
            self.lock_fd = None

    # -- files --------------------------------------------------------------------------------------------------

    def config(self) -> RunConfig:
        return config_from_run_dict(read_json(self.path / "config.json", "config file"),
                                    str(self.path / "config.json"))

    def meta(self) -> dict:
        return read_json(self.path / "meta.json", "run metadata")

    def update_meta(self, **changes: Any) -> dict:
        meta = self.meta()
        meta.update(changes)
        atomic_write_json(self.path / "meta.json", meta)
        return meta

    def metrics(self) -> list[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def append_metrics(self, row: dict) -> None:
        with open(self.path / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=_json_default) + "\n")
            f.flush()

    def truncate_metrics(self, step: int) -> None:
        """Drop metric lines after ``step`` (a resumed run re-logs them)."""
        rows = [r for r in self.metrics() if r.get("step", 0) <= step]
        atomic_write_text(self.path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))

    def write_report(self, name: str, obj: Any) -> Path:
        path = self.reports / f"{name}.json"
        atomic_write_json(path, obj)
        return path


def create_run(path: str | Path, cfg: RunConfig, *, force: bool = False, argv: list[str] | None = None,
               device: str = "cpu", extra_meta: dict | None = None) -> Run:
    """Make a fresh run directory (locked). An existing run is refused unless ``force``, which moves it aside
    to ``<name>.replaced-<timestamp>`` (nothing is deleted)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CemtoolError(f"output path {path} exists and is not a directory")
    if path.exists() and any(path.iterdir()):
        if not is_run(path):
            raise CemtoolError(f"output directory {path} is not empty and is not a cemtool run",
                               hint="choose another --out")
        if not force:
            raise CemtoolError(f"output directory {path} already holds a run",
                               hint="use --resume to continue it, --force to move it aside, or another --out")
        probe = Run(path)
        probe.lock()  # refuse to move a run that is being written
        probe.unlock()
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        path.rename(path.with_name(f"{path.name}.replaced-{stamp}"))
    path.mkdir(parents=True, exist_ok=True)
    run = Run(path)
    run.lock()
    atomic_write_json(path / "config.json", to_dict(cfg))
    from cemtool.models.registry import get_arch

    meta = {"schema_version": SCHEMA_VERSION, "status": "running", "arch": cfg.model.arch,
            "family": get_arch(cfg.model.arch).family, "seed": cfg.seed,
            "created": now(), "started": now(), "ended": None, "argv": argv if argv is not None else sys.argv,
            "device": device, "versions": versions(), "git_commit": git_commit(), "hostname": platform.node(),
            "step": 0}
    meta.update(extra_meta or {})
    atomic_write_json(path / "meta.json", meta)
    return run


def open_run(path: str | Path, *, lock: bool = False) -> Run:
    path = Path(path)
    if not path.is_dir():
        raise CemtoolError(f"run directory {path} does not exist")
    if not is_run(path):
        raise CemtoolError(f"{path} is not a cemtool run (no config.json)")
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
                    optimizer: torch.optim.Optimizer | None = None, state: dict | None = None) -> Path:
    """Write checkpoints/<name>.safetensors atomically: weights ('model.*'), optimizer tensors ('optim.*'),
    the torch RNG state, and a JSON header (step, aliases, optimizer skeleton, training state)."""
    import torch
    from safetensors.torch import save

    weights, aliases = model_tensors(model)
    tensors = {f"model.{k}": v for k, v in weights.items()}
    header: dict[str, Any] = {"step": step, "aliases": aliases, "schema_version": SCHEMA_VERSION,
                              "state": state or {}}
    if optimizer is not None:
        header["optimizer"] = _flatten(optimizer.state_dict(), "optim", tensors)
        tensors["rng.torch"] = torch.get_rng_state()
    path = run.checkpoints / f"{name}.safetensors"
    atomic_write_bytes(path, save(tensors, metadata={"cemtool": json.dumps(header)}))
    manifest_path = run.checkpoints / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    manifest[path.name] = {"step": step, "sha256": _sha256(path), "bytes": path.stat().st_size}
    atomic_write_json(manifest_path, manifest)
    return path


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


def read_checkpoint(path: str | Path, manifest: dict | None = None) -> Checkpoint:
    """Read and verify a cemtool safetensors checkpoint; never unpickles."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise CemtoolError(f"checkpoint {path} does not exist")
    _refuse_pickle(path)
    if manifest and path.name in manifest and manifest[path.name].get("sha256") != _sha256(path):
        raise CemtoolError(f"checkpoint {path} is corrupted (checksum mismatch)",
                           hint="use an earlier checkpoint or retrain")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(meta["cemtool"])
    except Exception as e:  # safetensors raises several types for a bad header or a short file
        raise CemtoolError(f"checkpoint {path} is corrupted or truncated ({str(e).splitlines()[0][:120]})",
                           hint="use an earlier checkpoint or retrain") from None
    weights = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    for alias, target in header.get("aliases", {}).items():
        weights[alias] = weights[target]
    return Checkpoint(path, int(header.get("step", 0)), weights, header, tensors)


def load_weights(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    try:
        model.load_state_dict(ckpt.weights, strict=True)
    except RuntimeError as e:
        raise CemtoolError(f"checkpoint {ckpt.path} does not fit the configured model: "
                           f"{str(e).splitlines()[1].strip()[:160] if len(str(e).splitlines()) > 1 else e}") from None


def manifest(run: Run) -> dict:
    p = run.checkpoints / "manifest.json"
    return read_json(p, "checkpoint manifest") if p.exists() else {}


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
        return run.meta().get("status", "?")
    except CemtoolError:
        return "unknown"


@dataclass
class LoadedRun:
    model: torch.nn.Module
    config: RunConfig
    tokenizer: Any
    run: Run
    checkpoint: Path
    step: int


def load_run(path: str | Path, checkpoint: str | int = "final", device: str | torch.device = "cpu") -> LoadedRun:
    """Model (eval mode), config and tokenizer of a run: what every analysis command starts from."""
    from cemtool.data.tokenizer import load_tokenizer
    from cemtool.models.registry import build_model

    run = open_run(path)
    cfg = run.config()
    tok = load_tokenizer(run.path / "tokenizer.json")
    ckpt = read_checkpoint(find_checkpoint(run, checkpoint), manifest(run))
    model = build_model(cfg.model)
    load_weights(model, ckpt)
    model.to(device).eval()
    return LoadedRun(model, cfg, tok, run, ckpt.path, ckpt.step)


def list_runs(root: str | Path) -> list[dict]:
    """One row per run found under ``root`` (itself a run, or a folder of runs, searched recursively)."""
    root = Path(root)
    if not root.exists():
        raise CemtoolError(f"{root} does not exist")
    found = [root] if is_run(root) else sorted({p.parent for p in root.rglob("config.json")})
    rows = []
    for p in found:
        run = Run(p)
        try:
            meta, cfg = run.meta(), run.config()
        except CemtoolError as e:
            rows.append({"run": str(p), "status": f"unreadable: {e.message}"})
            continue
        evals = [m for m in run.metrics() if "val_loss" in m]
        rows.append({"run": str(p), "arch": cfg.model.arch, "status": meta.get("status"),
                     "step": meta.get("step"), "val_loss": evals[-1]["val_loss"] if evals else None,
                     "floor": evals[-1].get("val_floor") if evals else None, "seed": cfg.seed})
    return rows
