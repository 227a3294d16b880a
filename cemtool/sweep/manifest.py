"""A study directory on disk: :class:`Study`, its manifest study.json (made from a plan, opened, validated whole on
every read, saved by one process or shared by the workers of --jobs) and the changes a re-planned study makes to
it (a grid or its seeds extended in place, a comparison retuned)."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
from dataclasses import replace
from pathlib import Path

from cemtool.config import parse_override
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json
from cemtool.models.registry import get_arch
from cemtool.provenance import now
from cemtool.runs import Run, open_lock_file
from cemtool.sweep.options import _whole, analysis_names
from cemtool.sweep.plan import MAX_RUN_NAME, Plan, parse_grid, plan_items
from cemtool.writes import atomic_write_json

SCHEMA_VERSION = 1


# --------------------------------------------------------------------------------------------------------------
# the study


class Study:
    """A study directory: its plan, its manifest (study.json) and the runner."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.plan = Plan.from_dict(manifest["plan"])
        self.notes: list[str] = []  # what opening it changed (a grid extension), for the caller to say
        self.owned: set[str] | None = None  # a worker of --jobs: the items it writes (None: the whole manifest)
        self.retune: tuple[Plan, list[str], list[int]] | None = None  # a re-planned comparison (and the seeds it
        # adds), for run_sweep to apply

    def save(self) -> None:
        self.manifest["updated"] = now()
        if self.owned is None:
            atomic_write_json(self.path / "study.json", self.manifest)
        else:
            self.sync(write=True)

    def sync(self, write: bool = False, status: str | None = None) -> None:
        """The shared manifest of --jobs: under the manifest lock, read study.json, keep this worker's own items from
        memory (the same dicts) and the others' from the file; write the result back if ``write`` (or a new
        ``status`` is given: the sweep's, while workers may still be writing)."""
        fd = open_lock_file(self.path / ".manifest.lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            disk = read_manifest(self.path / "study.json")
            mine = {it["name"]: it for it in self.manifest["items"] if it["name"] in (self.owned or ())}
            disk["items"] = [mine.get(it["name"], it) for it in disk["items"]]
            if status is not None:
                disk.update(status=status, updated=now())
            elif write:
                disk["updated"] = self.manifest["updated"]
            if write or status is not None:
                atomic_write_json(self.path / "study.json", disk)
            self.manifest = disk
        finally:
            os.close(fd)  # closing releases the lock

    def item(self, name: str) -> dict:
        return next(it for it in self.manifest["items"] if it["name"] == name)


def new_manifest(plan: Plan) -> dict:
    items = plan_items(plan)
    return {"schema_version": SCHEMA_VERSION, "kind": "cemtool-study", "created": now(), "updated": now(),
            "status": "running", "plan": plan.to_dict(), "items": items}


def open_study(out: str | Path, plan: Plan | None = None) -> Study:
    """The study in ``out``: an existing one (its stored plan must equal ``plan`` if given) or a new one."""
    out = Path(out)
    path = out / "study.json"
    if path.exists():
        manifest = read_manifest(path)
        stored = Plan.from_dict(manifest["plan"])
        if plan is not None and plan.tuned_from != stored.tuned_from and _same_study(plan.tuned_from,
                                                                                    stored.tuned_from, out):
            plan = replace(plan, tuned_from=stored.tuned_from)  # the same tuning study, named another way
        if plan is not None and plan != stored:
            added = study_extension(stored, plan)
            if added == {}:  # the same values, listed in another order: the same study
                return Study(out, manifest)
            retuned = retuned_archs(stored, plan)
            if retuned:  # applied by run_sweep once it holds the study's lock, the added seeds after it
                study = Study(out, manifest)
                study.retune = (replace(plan, seeds=stored.seeds), retuned,
                                [x for x in plan.seeds if x not in stored.seeds])
                return study
            if added is None:
                diff = [k for k in stored.to_dict() if stored.to_dict()[k] != plan.to_dict()[k]]
                raise CemtoolError(f"{out} holds a study planned with other settings ({', '.join(diff)} differ)",
                                   hint=f"use another --out, or `cemtool sweep --resume {out}` to continue it as "
                                        f"planned (a --grid may only add values, --seeds only add seeds)")
            return _extend(Study(out, manifest), plan, added)
        return Study(out, manifest)
    if plan is None:
        raise CemtoolError(f"{out} holds no study (no study.json)")
    check_new_study_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    return Study(out, new_manifest(plan))


def check_new_study_dir(out: Path) -> None:
    """A new study goes into a folder that does not exist yet or is empty."""
    if out.exists() and (not out.is_dir() or any(p.name != ".lock" for p in out.iterdir())):
        raise CemtoolError(f"{out} exists and is not a study directory", hint="choose another --out")


def _same_study(given: str | None, stored: str | None, out: Path) -> bool:
    """Whether ``given`` (a --tuned path, from the current folder) names the tuning study stored as ``stored`` (as
    it was given then: from the folder the study was started in, which may not be this one, so also tried from
    the study's own folder and its parents)."""
    if given is None or stored is None:
        return False
    here = Path(given).expanduser()
    for base in [Path.cwd(), *Path(out).resolve().parents]:  # an absolute ``stored`` is itself from any base
        try:
            if os.path.samefile(here, base / stored):
                return True
        except OSError:
            continue
    return False


STUDY_STATUSES = ("running", "completed", "incomplete", "interrupted")
ITEM_STATUSES = ("pending", "running", "completed", "failed", "interrupted")  # of an item and of its analyses
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")  # what item_name makes: a folder name inside the study
_WHOLE_FIELDS = ("step", "tokens", "params", "non_embedding")  # of an item: a whole number >= 0 or null
_REAL_FIELDS = ("val_loss", "val_floor", "seconds", "flops_per_token", "flops_forward_per_token", "total_flops")
_PLAN_TYPES = {"archs": "a list of architecture names", "seeds": "a list of whole numbers",
               "tokens": "a whole number >= 1", "data": "a string", "overrides": "a list of strings",
               "analyses": f"a list of analyses ({', '.join(analysis_names())})", "target": "a string or null",
               "options": "an object of objects, one per analysis", "grid": "a list of strings",
               "arch_overrides": "an object of lists of strings", "tuned_from": "a string or null"}


def read_manifest(path: Path) -> dict:
    """study.json, validated whole (:func:`check_manifest`): what every reader of a study goes through."""
    manifest = read_json(path, "study manifest")
    check_manifest(manifest, path)
    return manifest


def _strs(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


def _plan_ok(key: str, v) -> bool:
    return {"archs": lambda: _strs(v) and bool(v), "seeds": lambda: isinstance(v, list) and bool(v)
            and all(map(_whole, v)), "tokens": lambda: _whole(v) and v >= 1, "data": lambda: isinstance(v, str),
            "overrides": lambda: _strs(v), "analyses": lambda: _strs(v) and all(a in analysis_names() for a in v),
            "target": lambda: v is None or isinstance(v, str), "tuned_from": lambda: v is None or isinstance(v, str),
            "options": lambda: isinstance(v, dict) and all(isinstance(o, dict) for o in v.values()),
            "grid": lambda: _strs(v), "arch_overrides": lambda: isinstance(v, dict) and all(map(_strs, v.values()))
            }[key]()


def _number_ok(v, whole: bool) -> bool:
    if v is None:
        return True
    if whole:
        return _whole(v) and v >= 0
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_manifest(manifest, path: Path) -> None:
    """study.json as cemtool writes it, or one line naming the field that is not (a hand-edited or truncated file
    is not a traceback, and nothing is written from it): every field's type, statuses from the known sets, known
    architectures, run names that are plain folder names inside the study, finite numbers."""
    def bad(why: str) -> CemtoolError:
        return CemtoolError(f"{path} is not a valid study manifest ({why})",
                            hint="restore it, or start the study afresh in another --out")

    if not isinstance(manifest, dict) or manifest.get("kind") != "cemtool-study":
        raise bad("not a cemtool-study object")
    version = manifest.get("schema_version", 0)
    if not _whole(version):
        raise bad(f"schema_version {version!r} is not a whole number")
    if version > SCHEMA_VERSION:
        raise CemtoolError(f"{path} was written by a newer cemtool (study schema {version}, this one reads "
                           f"{SCHEMA_VERSION})", hint="upgrade cemtool")
    if manifest.get("status", "running") not in STUDY_STATUSES:
        raise bad(f"status {manifest.get('status')!r} is not one of {', '.join(STUDY_STATUSES)}")
    for key in ("created", "updated"):
        if not isinstance(manifest.get(key), (str, type(None))):
            raise bad(f"{key} {manifest.get(key)!r} is not a time")
    plan = manifest.get("plan")
    if not isinstance(plan, dict):
        raise bad("no plan")
    for key in ("archs", "seeds", "tokens"):
        if key not in plan:
            raise bad(f"plan.{key} is missing")
    for key, what in _PLAN_TYPES.items():
        if key in plan and not _plan_ok(key, plan[key]):
            raise bad(f"plan.{key} {_short(plan[key])} is not {what}")
    for a in plan["archs"]:
        try:
            get_arch(a)
        except CemtoolError:
            raise bad(f"plan.archs: unknown architecture {a!r}") from None
    items = manifest.get("items")
    if not isinstance(items, list):
        raise bad("no list of items")
    seen: set[str] = set()
    for k, it in enumerate(items):
        _check_item(it, f"items[{k}]", plan, seen, bad)


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_item(it, where: str, plan: dict, seen: set[str], bad) -> None:
    if not isinstance(it, dict):
        raise bad(f"{where} is not an object")
    for key, types in (("name", str), ("arch", str), ("run", str), ("status", str), ("analyses", dict)):
        if not isinstance(it.get(key), types):
            raise bad(f"{where}.{key} is missing or not a {'string' if types is str else 'object'}")
    for key in ("name", "run"):
        if len(it[key]) > MAX_RUN_NAME or not _RUN_NAME.fullmatch(it[key]):
            raise bad(f"{where}.{key} {_short(it[key])} is not a plain folder name inside the study")
    if it["name"] in seen:
        raise bad(f"{where}.name {it['name']!r} is given twice")
    seen.add(it["name"])
    if it["arch"] not in plan["archs"]:
        raise bad(f"{where}.arch {it['arch']!r} is not among plan.archs")
    if not _whole(it.get("seed")):
        raise bad(f"{where}.seed {_short(it.get('seed'))} is not a whole number")
    if it["status"] not in ITEM_STATUSES:
        raise bad(f"{where}.status {_short(it['status'])} is not one of {', '.join(ITEM_STATUSES)}")
    if not isinstance(it.get("error"), (str, type(None))):
        raise bad(f"{where}.error is not a string or null")
    point = it.get("point", {})
    if not isinstance(point, dict) or not all(isinstance(v, str) for v in point.values()):
        raise bad(f"{where}.point is not an object of strings")
    for key in (*_WHOLE_FIELDS, *_REAL_FIELDS):
        if not _number_ok(it.get(key), key in _WHOLE_FIELDS):
            raise bad(f"{where}.{key} {_short(it.get(key))} is not a "
                      f"{'whole number >= 0' if key in _WHOLE_FIELDS else 'finite number'} or null")
    for name, a in it["analyses"].items():
        at = f"{where}.analyses.{name}"
        if name not in analysis_names():
            raise bad(f"{at}: unknown analysis (known: {', '.join(analysis_names())})")
        if not isinstance(a, dict) or a.get("status") not in ITEM_STATUSES:
            raise bad(f"{at}.status {_short(a.get('status') if isinstance(a, dict) else a)} is not one of "
                      f"{', '.join(ITEM_STATUSES)}")
        for key in ("report", "error", "run"):
            if not isinstance(a.get(key), (str, type(None))):
                raise bad(f"{at}.{key} is not a string or null")
        if a.get("run") is not None and (len(a["run"]) > 255 or not _RUN_NAME.fullmatch(a["run"])):
            raise bad(f"{at}.run {_short(a['run'])} is not a plain folder name inside the study")
        if not _number_ok(a.get("seconds"), False):
            raise bad(f"{at}.seconds {_short(a.get('seconds'))} is not a finite number or null")


def _value(key: str, v: str) -> str:
    """A grid value as parsed (so that 1e-2 and 0.01 are the same value)."""
    return json.dumps(parse_override(f"{key}={v}"), sort_keys=True)


def study_extension(stored: Plan, plan: Plan) -> dict | None:
    """What ``plan`` adds to ``stored`` when it is otherwise the same plan: more values of its grid keys (same keys
    in the same order, every stored value kept) and/or more seeds (every stored seed kept), as
    {"grid": {key: [value, ...]}, "seeds": [seed, ...]} (the parts that add nothing left out); {} when it lists
    the same values and seeds in another order; None when it is not such an extension."""
    if replace(plan, grid=stored.grid, seeds=stored.seeds) != stored or not set(stored.seeds) <= set(plan.seeds):
        return None
    added: dict = {}
    seeds = [s for s in plan.seeds if s not in stored.seeds]
    if seeds:
        added["seeds"] = seeds
    if plan.grid != stored.grid:
        old, new = parse_grid(stored.grid), parse_grid(plan.grid)
        if [k for k, _ in old] != [k for k, _ in new]:
            return None
        grid: dict[str, list[str]] = {}
        for (key, before), (_, after) in zip(old, new, strict=True):
            have, given = {_value(key, v) for v in before}, {_value(key, v) for v in after}
            if not have <= given:
                return None
            extra = [v for v in after if _value(key, v) not in have]
            if extra:
                grid[key] = extra
        if grid:
            added["grid"] = grid
    return added


def retuned_archs(stored: Plan, plan: Plan) -> list[str] | None:
    """The architectures whose tuned values differ when ``plan`` is ``stored`` re-planned from the same tuning study
    after its choice changed (its grid was extended), and nothing else differs but more seeds; None otherwise."""
    if stored.tuned_from is None or not set(stored.seeds) <= set(plan.seeds) \
            or replace(plan, arch_overrides=stored.arch_overrides, seeds=stored.seeds) != stored:
        return None  # (more seeds, or the same in another order, are allowed: run_sweep adds them after)
    changed = [a for a in stored.archs if stored.arch_overrides.get(a) != plan.arch_overrides.get(a)]
    return changed or None


def _retune(study: Study, plan: Plan, archs: list[str], seeds: list[int] | tuple = ()) -> Study:
    """Continue a comparison study whose tuning study now chooses other values for ``archs``: their runs (and
    fine-tunes) move, whole, to ``superseded-<time>/`` inside the study and their items start afresh at the new
    values; every other architecture's runs are kept. Recorded in study.json (``retuned``) and said in
    ``study.notes``. Called with the study's lock held; refused, before anything moves, while a run of those
    architectures is locked by another process or is a symbolic link. ``seeds``: comparison seeds the same command
    adds, appended after the re-planning (:func:`_extend`)."""
    stamp = now().replace(":", "")[:17]
    aside = next(p for k in range(1000) if not (p := study.path / f"superseded-{stamp}{f'-{k}' if k else ''}").exists())
    fresh = {it["name"]: it for it in new_manifest(plan)["items"]}
    redo = [k for k, item in enumerate(study.manifest["items"]) if item["arch"] in archs]
    dirs = []  # each item's run and its fine-tunes
    for k in redo:
        item = study.manifest["items"][k]
        dirs += [item["run"], *(a["run"] for a in item.get("analyses", {}).values() if a.get("run"))]
    for name in dirs:  # every check before anything moves
        src = study.path / name
        _not_a_link(src)
        if src.exists() and Run(src).lock_held() is not False:
            raise CemtoolError(f"run {src} is in use by another process (or its lock cannot be read)",
                               hint="wait for it to finish")
    moved = []
    for name in dirs:
        if (study.path / name).exists():
            aside.mkdir(exist_ok=True)
            (study.path / name).rename(aside / name)
            moved.append(name)
    for k in redo:
        study.manifest["items"][k] = fresh[study.manifest["items"][k]["name"]]
    change = {a: {"from": study.plan.arch_overrides.get(a), "to": plan.arch_overrides.get(a)} for a in archs}
    study.manifest.setdefault("retuned", []).append(
        {"at": now(), "archs": change, "superseded": aside.name if moved else None, "runs_moved": moved})
    study.manifest["plan"] = plan.to_dict()
    study.plan = plan
    what = "; ".join(f"{a} {' '.join(c['from'] or [])} -> {' '.join(c['to'] or [])}" for a, c in change.items())
    study.notes.append(f"the tuning study now chooses other values ({what}): those architectures are trained again "
                       f"at them" + (f"; their {len(moved)} earlier run folder(s) moved to {aside}" if moved else "")
                       + "; every other architecture's runs are kept")
    study.retune = None
    study.save()  # at once: the moved runs are recorded before anything else can fail
    if seeds:  # more comparison seeds asked for in the same command: an extension of the re-planned study
        _extend(study, replace(plan, seeds=(*plan.seeds, *seeds)), {"seeds": list(seeds)})
    return study


def _extend(study: Study, plan: Plan, added: dict) -> Study:
    """Extend a study in place (``added``: :func:`study_extension`'s): the runs of the added grid values and seeds
    are appended (pending), every run already planned is kept, and the extension is recorded in study.json
    (``extensions``) and said in ``study.notes``. The stored values keep their spelling (the runs' names and
    points carry it) and the stored seeds their order; the added ones follow them."""
    grid_added, seeds_added = added.get("grid", {}), added.get("seeds", [])
    grid = tuple(f"{k}={','.join(values + grid_added.get(k, []))}" for k, values in parse_grid(study.plan.grid))
    plan = replace(plan, grid=grid, seeds=(*study.plan.seeds, *seeds_added))
    names = {it["name"] for it in study.manifest["items"]}
    fresh = [it for it in new_manifest(plan)["items"] if it["name"] not in names]
    study.manifest["items"] += fresh
    study.manifest.setdefault("extensions", []).append(
        {"at": now(), "grid_before": list(study.plan.grid), "grid": list(grid), "added": grid_added,
         "seeds_before": list(study.plan.seeds), "seeds_added": seeds_added, "runs_added": len(fresh)})
    study.manifest["plan"] = plan.to_dict()
    study.plan = plan
    what = "; ".join([*(f"{k} + {', '.join(v)}" for k, v in grid_added.items()),
                      *([f"seeds + {', '.join(map(str, seeds_added))}"] if seeds_added else [])])
    study.notes.append(f"extending the study ({what}): {len(fresh)} new run(s); the {len(names)} planned "
                       f"before are kept (finished ones are not redone)")
    return study


def _not_a_link(path: Path) -> None:
    """A study's folders are its own: one that is a symbolic link (made by someone else) is refused, not followed
    to wherever it points."""
    if path.is_symlink():
        raise CemtoolError(f"{path} is a symbolic link: cemtool does not follow links it did not make",
                           hint="remove the link; the study makes the folder itself")
