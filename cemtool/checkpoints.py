"""Checkpoints of a run: safetensors weights (+ optimizer and RNG state) with a JSON header, a SHA-256 manifest,
loading them into a model, restoring training, finding one by name (final, latest, a step, a file).

Weights and optimizer tensors are stored with safetensors and everything else as JSON: nothing is ever unpickled.
``manifest.json`` records each checkpoint's SHA-256 so corruption is detected on load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save

from cemtool.config import SCHEMA_VERSION
from cemtool.errors import CemtoolError
from cemtool.fileio import check_regular, read_json
from cemtool.runs import Run, _status
from cemtool.tensorfile import read_header
from cemtool.writes import atomic_write_bytes, atomic_write_json


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
