"""The study runner: architectures x seeds trained on the same number of tokens, then analysed, in one resumable
study directory (``cemtool sweep``).

Every item (one architecture, one seed) is trained by ``cemtool.train.train`` with ``train.max_tokens`` set to the
study's token budget, so all items see the same tokens (and, for one seed, the same batches); its parameters,
training FLOPs per token (forward + backward, ``cemtool.models.lm.flops_per_token``) and total FLOPs (that times
the tokens trained) are recorded. Then the chosen analyses run on it, through their Python APIs:

- ``sharpness``: ``cemtool.analysis.sharpness.measure_sharpness`` -> ``<item>/reports/sharpness.json`` (the same
  payload as ``cemtool sharpness``; options: ``tokens`` and the SharpnessOptions fields),
- ``collapse``: the measurement of ``cemtool collapse-report`` -> ``<item>/reports/collapse.json`` (options: its
  ``tokens``, ``batch_size``, ``alpha``, ``words``, ``k``, ``folds``, ``per_class``, ``seed``, ...),
- ``forgetting``: ``cemtool.forgetting.fine_tune`` -> a fine-tune run ``<item>-ft-<target>`` beside the
  item, holding ``reports/forgetting.json`` (options: ``steps``, ``warmup_steps``, ``eval_every``,
  ``eval_tokens``, ``checkpoint`` and the Recipe fields ``lr``, ``beta1``, ...).

Grids: ``grid=("train.lr=1e-3,3e-3", ...)`` (``--grid``) trains every architecture x seed x grid point (the product
of all grids); each value is a ``--set`` override, and the item's name carries its point
(``<arch>-lr=3e-3-s<seed>``). :func:`select` picks each architecture's best point on such a tuning study (lowest
mean final validation loss over its seeds), writes ``selection.json`` into it with every point's results, and a
comparison study planned with ``arch_overrides`` (``--tuned DIR``) trains each architecture at its chosen values
on seeds disjoint from the tuning seeds (an overlap is refused).

Resuming: running the same sweep again (or ``cemtool sweep --resume DIR``) continues where it stopped. A
completed run is skipped; a run left ``running``/``interrupted``/``failed`` (a killed process, Ctrl-C) continues
from its newest step checkpoint (``train(..., resume=True)``); an analysis whose report exists is skipped; an
interrupted fine-tune resumes the same way. Nothing completed is redone or rewritten. The study directory is
locked while a sweep runs in it.

``study.json`` (written atomically after every change; paths relative to the study directory)::

    {
      "schema_version": 1, "kind": "cemtool-study", "created", "updated",
      "status": "running" | "completed" | "incomplete" | "interrupted",
      "plan": {"archs": [...], "seeds": [...], "tokens": int, "data": str, "overrides": ["k=v", ...],
               "analyses": [...], "target": str | null, "options": {analysis: {key: value}},
               "grid": ["key=v1,v2", ...], "arch_overrides": {arch: ["k=v", ...]}, "tuned_from": str | null},
      "items": [{
        "name": "<arch>-s<seed>" (with a grid "<arch>-<key>=<value>...-s<seed>"), "arch", "seed", "run": name,
        "point": {key: value} (with a grid),
        "status": "pending" | "running" | "completed" | "failed" | "interrupted", "error": str | null,
        "step", "tokens", "val_loss", "val_floor", "seconds",
        "params", "non_embedding", "flops_per_token", "flops_forward_per_token", "total_flops",
        "analyses": {"sharpness": {"status", "report", "error", "seconds"},
                     "collapse": {...}, "forgetting": {..., "run": "<arch>-s<seed>-ft-<target>"}}
      }, ...]
    }
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from cemtool.config import RunConfig, is_section, parse_override, resolve, to_dict
from cemtool.config import replace as replace_config
from cemtool.errors import CemtoolError, UsageError, did_you_mean, known_hint
from cemtool.runs import Run, atomic_write_json, create_run, is_run, now, open_lock_file, open_run, read_json

Callback = Callable[[dict], None]
SCHEMA_VERSION = 1
ANALYSES = ("sharpness", "collapse", "forgetting")
COLLAPSE_DEFAULTS = {"checkpoint": "final", "tokens": 16384, "seq_len": None, "batch_size": 16, "alpha": 0.5,
                     "words": None, "k": 4, "folds": 5, "per_class": 256, "min_per_class": 16,
                     "seed": 0}  # cemtool collapse-report's
RESERVED = {"seed": "--seeds", "train.max_tokens": "--tokens", "model.arch": "--archs", "data.source": "--data",
            "schema_version": None}  # set by the sweep: refused in --set and --grid
# a grid over it would train one config (every run trains --tokens tokens); in --set, a value that does not give
# --tokens tokens is noted (plan_notes)
STEPS_KEY = "train.max_steps"
MAX_RUNS = 10_000  # runs in one study (each is a folder; the plan resolves every one before anything starts)
MAX_RUN_NAME = 150  # characters of a run folder's name (a fine-tune's and the temporary names add to it)
SELECTION = "selection.json"
FORGETTING_KEYS = {"steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint", "lr", "beta1", "beta2",
                   "weight_decay", "min_lr_ratio", "grad_clip"}


# --------------------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Plan:
    """What a study trains and measures; stored in study.json and compared on resume."""

    archs: tuple[str, ...]
    seeds: tuple[int, ...]
    tokens: int
    data: str = "grammar"
    overrides: tuple[str, ...] = ()
    analyses: tuple[str, ...] = ()
    target: str | None = None
    options: dict = field(default_factory=dict)
    grid: tuple[str, ...] = ()
    arch_overrides: dict = field(default_factory=dict)
    tuned_from: str | None = None

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def _split_list(value: str | list | tuple, what: str, plural: str) -> list[str]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else [str(s).strip() for s in value]
    items = [s for s in items if s]
    if not items:
        raise UsageError(f"no {plural} given", hint="list at least one, comma-separated")
    dup = sorted({s for s in items if items.count(s) > 1})
    if dup:
        raise UsageError(f"{what} {dup[0]!r} is listed twice")
    return items


def parse_seeds(seeds: str | list) -> list[int]:
    seed_strs = _split_list(seeds, "seed", "seeds")
    try:
        seeds = [int(s) for s in seed_strs]
    except ValueError:
        raise UsageError(f"seeds must be integers, got {','.join(seed_strs)}") from None
    dup = sorted({s for s in seeds if seeds.count(s) > 1})
    if dup:
        raise UsageError(f"seed {dup[0]} is listed twice")
    return seeds


def item_config(plan: Plan, arch: str, seed: int, point: dict | None = None) -> RunConfig:
    """The resolved config of one item (before the data fill in vocab_size / max_seq_len): the plan's overrides,
    then the architecture's tuned values, then the item's grid point."""
    return resolve(arch=arch, overrides=[*item_overrides(plan, arch, point), f"train.max_tokens={plan.tokens}"],
                   seed=seed, data_source=plan.data)


def item_overrides(plan: Plan, arch: str, point: dict | None = None) -> list[str]:
    return [*plan.overrides, *plan.arch_overrides.get(arch, []), *[f"{k}={v}" for k, v in (point or {}).items()]]


# --------------------------------------------------------------------------------------------------------------
# grids


def _override_key(item: str) -> str:
    return item.split("=", 1)[0].strip()


def _split_values(raw: str) -> list[str]:
    """'1e-3,3e-3' -> ['1e-3', '3e-3']; commas inside brackets stay ('[2,4],[4,2]' -> ['[2,4]', '[4,2]'])."""
    out, depth, cur = [], 0, ""
    for ch in raw:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [v for v in [*out, cur.strip()] if v]


def parse_grid(grid: tuple[str, ...] | list[str]) -> list[tuple[str, list[str]]]:
    """['train.lr=1e-3,3e-3', ...] -> [('train.lr', ['1e-3', '3e-3']), ...] (values as given: each is parsed like
    a --set override). A key given twice, a value given twice, no values, or a key set by a sweep option is
    refused."""
    out: list[tuple[str, list[str]]] = []
    for item in grid:
        if "=" not in item or not _override_key(item):
            raise UsageError(f"--grid {item!r} is not of the form key=v1,v2,...",
                               hint="e.g. --grid train.lr=1e-3,3e-3")
        key, raw = _override_key(item), item.split("=", 1)[1]
        if key in RESERVED or key == STEPS_KEY:
            use = "--tokens (every run trains --tokens tokens)" if key == STEPS_KEY else RESERVED[key]
            raise CemtoolError(f"--grid {key} is not a grid key" + (f": use {use}" if use else ""))
        if is_section(key):
            raise CemtoolError(f"--grid {key} names a config section, not a field",
                               hint=f"grid one of its fields, e.g. --grid {key}.<field>=v1,v2 (cemtool config "
                                    f"--fields lists them)")
        if key in [k for k, _ in out]:
            raise UsageError(f"--grid {key} is given twice", hint="list all its values in one --grid")
        values = _split_values(raw)
        if not values:
            raise UsageError(f"--grid {key} lists no values")
        parsed = [json.dumps(parse_override(f"{key}={v}"), sort_keys=True) for v in values]
        dup = [v for v, q in zip(values, parsed, strict=True) if parsed.count(q) > 1]
        if dup:
            raise UsageError(f"--grid {key}: {' and '.join(map(repr, dup))} are the same value")
        out.append((key, values))
    return out


def grid_points(plan: Plan) -> list[dict[str, str]]:
    """Every grid point ({key: value}, the product of the grids in order); [{}] without a grid."""
    grid = parse_grid(plan.grid)
    return [dict(zip([k for k, _ in grid], combo, strict=True)) for combo in itertools.product(*[v for _, v in grid])]


def item_name(arch: str, seed: int, point: dict[str, str]) -> str:
    """'<arch>-s<seed>', or with a grid point '<arch>-lr=3e-3-s<seed>' (a key by its last part unless two grid keys
    share it; characters other than letters, digits and . _ + - = become _)."""
    keys = list(point)
    short = {k: k.rsplit(".", 1)[-1] for k in keys}
    parts = [f"{short[k] if list(short.values()).count(short[k]) == 1 else k}={v}" for k, v in point.items()]
    return re.sub(r"[^A-Za-z0-9._+=-]", "_", "-".join([arch, *parts, f"s{seed}"]))


def make_plan(archs: str | list, seeds: str | list, *, tokens: int | None = None, data: str = "grammar",
              overrides: list[str] | tuple = (), analyses: str | list = (), target: str | None = None,
              options: dict | None = None, grid: list[str] | tuple = (), arch_overrides: dict | None = None,
              tuned_from: str | None = None) -> Plan:
    """Validate a study's plan (unknown architecture, bad override, no seeds, bad grid... -> CemtoolError).
    ``tokens`` defaults to what the first architecture's config trains on (train.max_tokens, else max_steps x
    batch). ``grid``: ['key=v1,v2', ...] (every point is trained); ``arch_overrides``: {arch: ['key=value']} (the
    tuned values, see :func:`plan_from_tuning`)."""
    from cemtool.data.grammar import GRAMMARS
    from cemtool.train import total_steps

    arch_list = _split_list(archs, "architecture", "architectures")
    seed_list = parse_seeds(seeds)
    chosen = _split_list(analyses, "analysis", "analyses") if analyses else []
    bad = [a for a in chosen if a not in ANALYSES]
    if bad:
        raise CemtoolError(f"unknown analysis {bad[0]!r}", hint=known_hint(bad[0], ANALYSES, "choose from"))
    if tokens is not None and tokens < 1:
        raise UsageError(f"--tokens must be positive, got {tokens}")
    for o in overrides:
        key = _override_key(o)
        if key in RESERVED:
            raise CemtoolError(f"--set {key} is not for a sweep: the sweep sets it"
                               + (f"; use {RESERVED[key]}" if RESERVED[key] else ""))
    if target is not None and "forgetting" not in chosen:
        raise CemtoolError(f"--to {target} is the forgetting analysis' target, but forgetting is not among the "
                           f"analyses", hint="add --analyses forgetting, or drop --to")
    arch_overrides = {a: list(v) for a, v in (arch_overrides or {}).items()}
    _check_grid(grid, overrides, arch_overrides, arch_list)
    size = len(arch_list) * len(seed_list) * math.prod(len(v) for _, v in parse_grid(grid))
    if size > MAX_RUNS:
        raise CemtoolError(f"the study would train {size:,} runs (at most {MAX_RUNS:,} in one study)",
                           hint="split it into several studies, or use fewer grid values")
    draft = Plan(tuple(arch_list), (), 0, data, tuple(overrides), grid=tuple(grid), arch_overrides=arch_overrides)
    points = grid_points(draft)
    for a in arch_list:  # validates every architecture at every grid point; two points may not be one config
        seen: dict[str, dict] = {}
        for point in points:
            key = json.dumps(to_dict(resolve(arch=a, overrides=item_overrides(draft, a, point), data_source=data)),
                             sort_keys=True)
            if key in seen:
                raise CemtoolError(f"--grid: for {a}, {_point_str(seen[key])} and {_point_str(point)} give the "
                                   f"same config", hint="list each value once")
            seen[key] = point
    cfgs = [resolve(arch=a, overrides=item_overrides(draft, a), data_source=data) for a in arch_list]
    if tokens is None:
        c = cfgs[0]
        tokens = c.train.max_tokens or total_steps(c) * c.train.batch_size * c.train.grad_accum * c.data.seq_len
    sized = replace(draft, tokens=int(tokens))
    for a in arch_list:  # every item's own config (its seed and tokens), before anything is created
        for seed in seed_list:
            item_config(sized, a, seed, points[0])
    check_data_source(data)
    if "forgetting" in chosen and target is None:
        target = {"grammar": "grammar-b", "grammar-b": "grammar"}.get(data)
        if target is None:
            raise CemtoolError(f"forgetting needs target data for runs trained on {data!r}",
                               hint="give --to (pydoc or a .txt file for text runs)")
    if "forgetting" not in chosen:
        target = None
    else:  # grammar corpora are read with their word tokenizer, text never is
        from cemtool.forgetting import check_tokenizer

        check_tokenizer("word" if data in GRAMMARS else "text", target)
    options = {k: dict(v) for k, v in (options or {}).items()}
    _check_options(options, chosen)
    plan = Plan(tuple(arch_list), tuple(seed_list), int(tokens), data, tuple(overrides), tuple(chosen), target,
                options, tuple(grid), arch_overrides, tuned_from)
    names = [it["name"] for it in new_manifest(plan)["items"]]
    long = [n for n in names if len(n) > MAX_RUN_NAME]
    if long:
        raise CemtoolError(f"the run name {long[0][:60]}... is {len(long[0])} characters long (at most "
                           f"{MAX_RUN_NAME}: a run's folder is named after its grid point)",
                           hint="use shorter grid values")
    folded = collections.Counter(n.casefold() for n in names)  # one folder on a case-insensitive file system
    clash = sorted({n for n in names if folded[n.casefold()] > 1})
    if clash:
        raise CemtoolError(f"two grid points give the same run name {clash[0]!r} (run folder names are compared "
                           f"ignoring case)", hint="write the values apart")
    return plan


def plan_notes(plan: Plan) -> list[str]:
    """What the plan does other than a --set says, for the command to print: a train.max_steps in --set that does
    not give --tokens tokens is not what the runs train (every run of a sweep trains --tokens tokens)."""
    if STEPS_KEY not in {_override_key(o) for o in plan.overrides}:
        return []
    notes = []
    for a in plan.archs:
        c = resolve(arch=a, overrides=item_overrides(plan, a), data_source=plan.data)
        per_step = c.train.batch_size * c.train.grad_accum * c.data.seq_len
        if c.train.max_steps * per_step != plan.tokens:
            notes.append(f"{a}: --set {STEPS_KEY}={c.train.max_steps} is not used: every run of a sweep trains "
                         f"--tokens {plan.tokens:,} tokens ({-(-plan.tokens // per_step):,} steps of {per_step:,})")
    return notes


def _point_str(point: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in point.items()) or "(no grid)"


def check_data_source(data: str) -> None:
    """A training data source that is neither built in nor an existing file or folder is refused at planning."""
    import cemtool.data.synthetic  # noqa: F401 (registers its sources)
    from cemtool.data.corpus import sources

    if data not in sources() and not Path(data).expanduser().exists():
        raise CemtoolError(f"--data {data!r}: no such file or folder (and not a built-in source: "
                           f"{', '.join(sources())})", hint=did_you_mean(data, sources()))


def _check_grid(grid, overrides, arch_overrides: dict, archs: list[str]) -> None:
    """Grid keys, --set keys and tuned keys must not overlap (which one would win is not what the user asked)."""
    grid_keys = [k for k, _ in parse_grid(grid)]
    set_keys = {_override_key(o) for o in overrides}
    for key in grid_keys:
        if key in set_keys:
            raise CemtoolError(f"{key} is both in --set and in --grid", hint="drop one of them")
    for arch, items in arch_overrides.items():
        if arch not in archs:
            raise CemtoolError(f"tuned values are given for {arch!r}, which is not among the architectures")
        for key in map(_override_key, items):
            if key in set_keys or key in grid_keys:
                where = "--set" if key in set_keys else "--grid"
                raise CemtoolError(f"{key} is tuned per architecture and also in {where}", hint="drop it there")


def _check_options(options: dict, chosen: list[str]) -> None:
    from cemtool.analysis.sharpness import SharpnessOptions

    known = {"sharpness": {f.name for f in fields(SharpnessOptions)} - {"device"} | {"tokens", "checkpoint"},
             "collapse": set(COLLAPSE_DEFAULTS), "forgetting": FORGETTING_KEYS}
    for name, opts in options.items():
        if name not in known:
            raise CemtoolError(f"options for unknown analysis {name!r}", hint=f"choose from {', '.join(ANALYSES)}")
        if name not in chosen:
            raise CemtoolError(f"options given for {name}, which is not among the analyses",
                               hint="add it to --analyses")
        bad = sorted(set(opts) - known[name])
        if bad:
            raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=known_hint(bad[0], known[name]))
        _check_option_values(name, opts)


# the analyses' options a sweep takes with -A, beyond the sharpness measurement's own (SharpnessOptions checks
# those): (type, lowest value, whether None is allowed); floats must also be finite
OPTION_VALUES = {
    "sharpness": {"tokens": (int, 1, False), "checkpoint": (str, None, False)},
    "collapse": {"checkpoint": (str, None, False), "tokens": (int, 1, False), "seq_len": (int, 1, True),
                 "batch_size": (int, 1, False), "alpha": (float, 0.0, False), "words": (str, None, True),
                 "k": (int, 1, False), "folds": (int, 2, False), "per_class": (int, 1, False),
                 "min_per_class": (int, 1, False), "seed": (int, 0, False)},
    "forgetting": {"steps": (int, 1, False), "warmup_steps": (int, 0, False), "eval_every": (int, 1, False),
                   "eval_tokens": (int, 1, False), "checkpoint": (str, None, False), "lr": (float, 0.0, False),
                   "beta1": (float, 0.0, False), "beta2": (float, 0.0, False), "weight_decay": (float, 0.0, False),
                   "min_lr_ratio": (float, 0.0, False), "grad_clip": (float, 0.0, False)},
}


def _check_option_values(name: str, opts: dict) -> None:
    """Every -A value of one analysis is of its type and in range, before the study exists (not after a run has
    trained): a NaN, a negative count or a string where a number goes is refused."""
    from cemtool.analysis.sharpness import SharpnessOptions

    def check(key: str, v, tp: type, low, none_ok: bool) -> None:
        if v is None and none_ok:
            return
        if tp is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif tp is int:
            ok = _whole(v)
        else:
            ok = isinstance(v, tp)
        if not ok or (low is not None and v < low):
            want = {int: "a whole number", float: "a finite number", str: "a string", bool: "true or false",
                    tuple: "a list"}.get(tp, tp.__name__)
            raise CemtoolError(f"-A {name}.{key}={json.dumps(v)}: must be {want}"
                               + (f" >= {low}" if low is not None else ""))

    table = dict(OPTION_VALUES.get(name, {}))
    if name == "sharpness":
        for f in fields(SharpnessOptions):
            if f.name in table or f.name == "device" or f.name not in opts:
                continue
            default = f.default
            tp = type(default) if default is not None else float  # graph_memory, density_sigma: numbers or null
            table[f.name] = (tp, None, default is None)
    for key, v in opts.items():
        if key in table:
            tp = table[key][0]
            check(key, tuple(v) if tp is tuple and isinstance(v, list) else v, *table[key])
    if name == "forgetting":
        for key in ("beta1", "beta2", "min_lr_ratio"):
            if key in opts and opts[key] > 1:
                raise CemtoolError(f"-A forgetting.{key}={opts[key]}: must be <= 1")
    if name == "sharpness":
        rest = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items() if k not in ("tokens", "checkpoint")}
        try:
            SharpnessOptions(**rest)  # its own checks (ranges, methods, Lanczos steps against k)
        except TypeError as e:
            raise CemtoolError(f"-A sharpness: {e}") from None


# --------------------------------------------------------------------------------------------------------------
# selection on a tuning study


def select(tuning: str | Path, archs: list[str] | tuple | None = None, final_seeds: list[int] | tuple = (),
           write: bool = True) -> dict:
    """Each architecture's best grid point in the finished tuning study ``tuning``: the lowest mean final validation
    loss over the tuning seeds (a point with a failed run, e.g. a diverged learning rate, cannot be chosen; a tie
    goes to the earlier point in grid order). Refuses ``final_seeds`` (the comparison's) that tuned the values.
    Writes <tuning>/selection.json (the choice and every point's results; unless ``write`` is false) and returns
    it."""
    path = Path(tuning)
    study = open_study(path)
    plan, items = study.plan, study.manifest["items"]
    if not plan.grid:
        raise CemtoolError(f"{path} is not a tuning study: it was planned without --grid")
    overlap = sorted(set(final_seeds) & set(plan.seeds))
    if overlap:
        raise CemtoolError(f"seed {overlap[0]} tuned the values in {path}: the comparison must use other seeds",
                           hint=f"tuning seeds: {','.join(map(str, plan.seeds))}")
    archs = list(plan.archs if archs is None else archs)
    missing = [a for a in archs if a not in plan.archs]
    if missing:
        raise CemtoolError(f"{path} did not tune {missing[0]!r}", hint=f"it tuned {', '.join(plan.archs)}")
    left = [it["name"] for it in items if it["arch"] in archs and it["status"] not in ("completed", "failed")]
    if left:
        raise CemtoolError(f"{path} is not finished ({len(left)} run(s) left, e.g. {left[0]})",
                           hint=f"continue it first: cemtool sweep --resume {path}")
    # every finished architecture of the study goes into selection.json (a comparison of some of them must not
    # erase the others' choice); the ones asked for must be finished (checked above)
    chosen = {}
    for a in plan.archs:
        if a in archs:
            chosen[a] = _select_arch(a, plan, items)
        elif all(it["status"] in ("completed", "failed") for it in items if it["arch"] == a):
            try:
                chosen[a] = _select_arch(a, plan, items)
            except CemtoolError:  # not asked for, and nothing to choose: left out
                pass
    selection = {"schema_version": SCHEMA_VERSION, "kind": "cemtool-selection",
                 "rule": "lowest mean final validation loss over the tuning seeds", "grid": list(plan.grid),
                 "tuning_seeds": list(plan.seeds), "tokens": plan.tokens, "data": plan.data,
                 "overrides": list(plan.overrides), "archs": chosen}
    if write:
        atomic_write_json(path / SELECTION, selection)
    return selection


def _select_arch(arch: str, plan: Plan, items: list[dict]) -> dict:
    points = []
    for pt in grid_points(plan):
        runs = [it for it in items if it["arch"] == arch and it.get("point", {}) == pt]
        losses = [it.get("val_loss") for it in runs]
        ok = all(it["status"] == "completed" and v is not None and math.isfinite(v) for it, v in zip(runs, losses,
                                                                                                     strict=True))
        points.append({"point": pt, "runs": [it["run"] for it in runs], "seeds": [it["seed"] for it in runs],
                       "val_loss": losses, "failed": sum(it["status"] == "failed" for it in runs),
                       "mean_val_loss": statistics.fmean(losses) if ok and runs else None,
                       "std_val_loss": statistics.stdev(losses) if ok and len(runs) > 1 else None})
    eligible = [p for p in points if p["mean_val_loss"] is not None]
    if not eligible:
        raise CemtoolError(f"no grid point of {arch} trained on every tuning seed (all have failed runs)",
                           hint="widen the grid towards values that train")
    best = min(eligible, key=lambda p: p["mean_val_loss"])  # the first of equal means
    return {"chosen": best["point"], "overrides": [f"{k}={v}" for k, v in best["point"].items()],
            "mean_val_loss": best["mean_val_loss"], "at_edge": grid_edges(plan, best["point"]), "points": points}


def grid_edges(plan: Plan, point: dict[str, str]) -> list[str]:
    """The numeric grid keys (3 or more values) whose chosen value is the grid's smallest or largest: the best
    value may lie beyond the grid (extend it: the same sweep command with more values keeps every finished run)."""
    edges = []
    for key, values in parse_grid(plan.grid):
        nums = [parse_override(f"{key}={v}") for v in values]
        nums = [n for n in (_leaf(x) for x in nums) if isinstance(n, (int, float)) and not isinstance(n, bool)]
        if len(nums) < 3 or len(nums) != len(values) or key not in point:
            continue
        chosen = _leaf(parse_override(f"{key}={point[key]}"))
        if chosen in (min(nums), max(nums)):
            edges.append(key)
    return edges


def _leaf(tree):
    """The value of a one-key nested override {'train': {'lr': 0.01}} -> 0.01."""
    while isinstance(tree, dict) and len(tree) == 1:
        tree = next(iter(tree.values()))
    return tree


def plan_from_tuning(tuning: str | Path, seeds: str | list, *, archs: str | list | None = None,
                     tokens: int | None = None, data: str | None = None, overrides: list[str] | tuple | None = None,
                     **rest) -> tuple[Plan, dict, list[str]]:
    """The comparison study of a tuning study: each architecture at its chosen values (:func:`select`) on
    ``seeds`` (disjoint from the tuning seeds). Tokens, data and --set overrides default to the tuning study's;
    given values that differ are used, with a note saying so. ``rest``: make_plan's analyses, target, options.
    Returns (plan, selection, notes)."""
    tuned = open_study(tuning).plan
    arch_list = list(tuned.archs) if archs is None else _split_list(archs, "architecture", "architectures")
    selection = select(tuning, arch_list, parse_seeds(seeds), write=False)  # written once the plan is valid
    notes = []
    for arch in arch_list:
        for key in selection["archs"][arch]["at_edge"]:
            notes.append(f"{arch}: the chosen {key} ({selection['archs'][arch]['chosen'][key]}) is at the edge of "
                         f"the grid, so a better value may lie beyond it (add values to the tuning study's --grid: "
                         f"its finished runs are kept)")
    for what, mine, theirs in (("tokens per run", tokens, tuned.tokens), ("data", data, tuned.data),
                               ("--set overrides", None if overrides is None else list(overrides),
                                list(tuned.overrides))):
        if mine is not None and mine != theirs:
            notes.append(f"the comparison uses {what} {mine}; the values were tuned with {theirs}")
    plan = make_plan(arch_list, seeds, tokens=tuned.tokens if tokens is None else tokens,
                     data=tuned.data if data is None else data,
                     overrides=tuned.overrides if overrides is None else overrides,
                     arch_overrides={a: selection["archs"][a]["overrides"] for a in arch_list},
                     tuned_from=str(tuning), **rest)
    atomic_write_json(Path(tuning) / SELECTION, selection)
    return plan, selection, notes


# --------------------------------------------------------------------------------------------------------------
# the analyses (each writes the report an analysis command would write)


def _report_path(study: Path, item: dict, name: str, plan: Plan) -> tuple[Path, Path | None]:
    """(report file, fine-tune run dir or None) of one analysis of one item."""
    run = study / item["run"]
    if name == "forgetting":
        from cemtool.forgetting import target_slug

        ft = study / f"{item['run']}-ft-{target_slug(plan.target)}"
        return ft / "reports" / "forgetting.json", ft
    return run / "reports" / f"{name}.json", None


def _sharpness(run_path: Path, options: dict, device: torch.device, emit: Callback) -> None:
    from cemtool.analysis.sharpness import SharpnessOptions, measure_sharpness, write_sharpness_report
    from cemtool.subject import open_subject

    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    tokens, checkpoint = opts.pop("tokens", 2048), opts.pop("checkpoint", "final")
    loaded = open_subject(run_path, checkpoint, device=device)
    x, y = loaded.eval_set(tokens)
    rep = measure_sharpness(loaded.model, x, y, SharpnessOptions(**opts, device=str(device)), tokens_requested=tokens)
    write_sharpness_report(loaded, rep, seq_len=int(x.shape[1]), device=str(device), command="sweep")


def _collapse(run_path: Path, options: dict, device: torch.device, emit: Callback) -> None:
    from cemtool.analysis.collapse import all_rows, measure_run
    from cemtool.report import provenance, write_report

    opts = {**COLLAPSE_DEFAULTS, **options}
    r = measure_run(run_path, label=run_path.name, device=device, **opts)
    single = {"provenance": provenance(r["run"], seed=opts["seed"], checkpoint=r["checkpoint"], step=r["step"],
                                       command="collapse-report", options=opts), "runs": [r]}
    write_report(Path(r["run"]) / "reports", "collapse", single, all_rows(single))


def _forgetting(run_path: Path, options: dict, device: torch.device, emit: Callback, target: str,
                out: Path) -> None:
    from cemtool.forgetting import fine_tune

    opts = dict(options)
    kw = {k: opts.pop(k) for k in ("steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint") if k in opts}
    fine_tune(run_path, target, out, recipe=opts, device=device, resume=True, callback=emit, **kw)


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
        self.retune: tuple[Plan, list[str]] | None = None  # a re-planned comparison, for run_sweep to apply

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
    items = [{"name": item_name(a, s, pt), "arch": a, "seed": s, "run": item_name(a, s, pt),
              **({"point": pt} if pt else {}), "status": "pending", "error": None,
              "analyses": {n: {"status": "pending", "report": None, "error": None} for n in plan.analyses}}
             for s in plan.seeds for a in plan.archs for pt in grid_points(plan)]
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
            added = grid_extension(stored, plan)
            if added == {}:  # the same values, listed in another order: the same study
                return Study(out, manifest)
            retuned = retuned_archs(stored, plan)
            if retuned:  # applied by run_sweep once it holds the study's lock
                study = Study(out, manifest)
                study.retune = (plan, retuned)
                return study
            if added is None:
                diff = [k for k in stored.to_dict() if stored.to_dict()[k] != plan.to_dict()[k]]
                raise CemtoolError(f"{out} holds a study planned with other settings ({', '.join(diff)} differ)",
                                   hint=f"use another --out, or `cemtool sweep --resume {out}` to continue it as "
                                        f"planned (a --grid may only add values)")
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


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


STUDY_STATUSES = ("running", "completed", "incomplete", "interrupted")
ITEM_STATUSES = ("pending", "running", "completed", "failed", "interrupted")  # of an item and of its analyses
_RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=-]*")  # what item_name makes: a folder name inside the study
_WHOLE_FIELDS = ("step", "tokens", "params", "non_embedding")  # of an item: a whole number >= 0 or null
_REAL_FIELDS = ("val_loss", "val_floor", "seconds", "flops_per_token", "flops_forward_per_token", "total_flops")
_PLAN_TYPES = {"archs": "a list of architecture names", "seeds": "a list of whole numbers",
               "tokens": "a whole number >= 1", "data": "a string", "overrides": "a list of strings",
               "analyses": f"a list of analyses ({', '.join(ANALYSES)})", "target": "a string or null",
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
            "overrides": lambda: _strs(v), "analyses": lambda: _strs(v) and all(a in ANALYSES for a in v),
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
    from cemtool.models.registry import get_arch

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
        if name not in ANALYSES:
            raise bad(f"{at}: unknown analysis (known: {', '.join(ANALYSES)})")
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


def grid_extension(stored: Plan, plan: Plan) -> dict[str, list[str]] | None:
    """The values ``plan`` adds to the grid of ``stored`` ({key: [value, ...]}) when it is otherwise the same plan
    (same grid keys in the same order, every stored value kept); {} when it lists the same values in another order;
    None when it is not such an extension."""
    if not stored.grid or plan.grid == stored.grid or replace(plan, grid=stored.grid) != stored:
        return None
    old, new = parse_grid(stored.grid), parse_grid(plan.grid)
    if [k for k, _ in old] != [k for k, _ in new]:
        return None
    added: dict[str, list[str]] = {}
    for (key, before), (_, after) in zip(old, new, strict=True):
        have, given = {_value(key, v) for v in before}, {_value(key, v) for v in after}
        if not have <= given:
            return None
        extra = [v for v in after if _value(key, v) not in have]
        if extra:
            added[key] = extra
    return added


def retuned_archs(stored: Plan, plan: Plan) -> list[str] | None:
    """The architectures whose tuned values differ when ``plan`` is ``stored`` re-planned from the same tuning study
    after its choice changed (its grid was extended), and nothing else differs; None otherwise."""
    if stored.tuned_from is None or replace(plan, arch_overrides=stored.arch_overrides) != stored:
        return None
    changed = [a for a in stored.archs if stored.arch_overrides.get(a) != plan.arch_overrides.get(a)]
    return changed or None


def _retune(study: Study, plan: Plan, archs: list[str]) -> Study:
    """Continue a comparison study whose tuning study now chooses other values for ``archs``: their runs (and
    fine-tunes) move, whole, to ``superseded-<time>/`` inside the study and their items start afresh at the new
    values; every other architecture's runs are kept. Recorded in study.json (``retuned``) and said in
    ``study.notes``. Called with the study's lock held; refused, before anything moves, while a run of those
    architectures is locked by another process or is a symbolic link."""
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
    return study


def _extend(study: Study, plan: Plan, added: dict[str, list[str]]) -> Study:
    """Extend a grid study in place: the added values' runs are appended (pending), every run already planned is
    kept, and the extension is recorded in study.json (``extensions``) and said in ``study.notes``. The stored
    values keep their spelling (the runs' names and points carry it); the added ones follow them."""
    grid = tuple(f"{k}={','.join(values + added.get(k, []))}" for k, values in parse_grid(study.plan.grid))
    plan = replace(plan, grid=grid)
    names = {it["name"] for it in study.manifest["items"]}
    fresh = [it for it in new_manifest(plan)["items"] if it["name"] not in names]
    study.manifest["items"] += fresh
    study.manifest.setdefault("extensions", []).append(
        {"at": now(), "grid_before": list(study.plan.grid), "grid": list(grid), "added": added,
         "runs_added": len(fresh)})
    study.manifest["plan"] = plan.to_dict()
    study.plan = plan
    what = "; ".join(f"{k} + {', '.join(v)}" for k, v in added.items())
    study.notes.append(f"extending the study's grid ({what}): {len(fresh)} new run(s); the {len(names)} planned "
                       f"before are kept (finished ones are not redone)")
    return study


def run_sweep(out: str | Path, plan: Plan | None = None, *, device: str | torch.device | None = None,
              callback: Callback | None = None, jobs: int = 1) -> dict:
    """Run (or continue) the study in ``out`` and return its manifest. ``plan`` None: continue as stored.

    ``callback`` receives the training loop's events with ``item`` added, and ``{"kind": "item", "item", "index",
    "total", "status"}`` / ``{"kind": "analysis", "item", "analysis", "status", "error"}``. Ctrl-C (or an
    interrupted training) marks the item interrupted, saves the manifest and raises KeyboardInterrupt.

    ``jobs`` > 1: that many worker processes share the items (see :func:`_run_workers`); the callback then gets
    the item and analysis events (not the training steps), read from the manifest as the workers write it."""
    from cemtool.train import pick_device

    if not isinstance(jobs, int) or jobs < 1:
        raise CemtoolError(f"--jobs must be a whole number >= 1, not {jobs!r}")
    study = open_study(out, plan)
    dev = device if isinstance(device, torch.device) else pick_device(device)
    lock = Run(study.path)  # the run-directory lock, on the study directory
    lock.lock()
    corpora: dict[str, object] = {}
    try:
        if study.retune is not None:
            _retune(study, *study.retune)
        for note in study.notes:
            if callback is not None:
                callback({"kind": "note", "item": None, "text": note})
        study.manifest["status"] = "running"
        study.save()
        if jobs > 1:
            study = _run_workers(study, device, dev, jobs, callback, corpora)
        else:
            items = study.manifest["items"]
            for index, item in enumerate(items):
                def emit(ev: dict, name: str = item["name"]) -> None:
                    if callback is not None:
                        callback({**ev, "item": name})

                emit({"kind": "item", "index": index, "total": len(items), "status": "start"})
                _do_item(study, item, dev, corpora, emit)
                emit({"kind": "item", "index": index, "total": len(items), "status": item["status"]})
        study.manifest["status"] = "completed" if all(_finished(it) for it in study.manifest["items"]) \
            else "incomplete"
        study.save()
    except KeyboardInterrupt:
        raise  # the item and the study are marked interrupted where it was caught
    except BaseException as e:
        if study.owned is None and study.manifest.get("status") == "running":
            _stopped_by(study, e)
        raise
    finally:
        lock.unlock()
    return study.manifest


def _stopped_by(study: Study, error: BaseException) -> None:
    """An error ended the sweep: what was running is marked failed with it, and the study incomplete (so that
    study.json does not say running for a sweep that is gone). Best effort: the error itself is what matters."""
    what = error.message if isinstance(error, CemtoolError) else f"internal error ({type(error).__name__}: {error})"
    for item in study.manifest["items"]:
        for entry in [item, *item.get("analyses", {}).values()]:
            if entry.get("status") == "running":
                entry.update(status="failed", error=what[:300])
    study.manifest["status"] = "incomplete"
    try:
        study.save()
    except (CemtoolError, OSError):
        pass


def _not_a_link(path: Path) -> None:
    """A study's folders are its own: one that is a symbolic link (made by someone else) is refused, not followed
    to wherever it points."""
    if path.is_symlink():
        raise CemtoolError(f"{path} is a symbolic link: cemtool does not follow links it did not make",
                           hint="remove the link; the study makes the folder itself")


def _finished(item: dict) -> bool:
    return item["status"] == "completed" and all(a["status"] == "completed" for a in item["analyses"].values())


def _do_item(study: Study, item: dict, dev: torch.device, corpora: dict, emit: Callback) -> None:
    """Train one item (or continue or skip it), then run its analyses; a Ctrl-C marks it interrupted."""
    try:
        _train_item(study, item, dev, corpora, emit)
        if item["status"] == "completed":
            for name in study.plan.analyses:
                _analyse(study, item, name, dev, emit)
    except KeyboardInterrupt:
        if item["status"] == "running":
            item["status"] = "interrupted"
        for a in item.get("analyses", {}).values():
            if a["status"] == "running":
                a["status"] = "interrupted"
        if study.owned is None:
            study.manifest["status"] = "interrupted"
        study.save()
        raise


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
    import multiprocessing as mp
    import signal
    import uuid

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
    import signal

    from cemtool.runs import os_error

    def stop(signum, frame):  # stop once: a second signal must not cut short the saving of the item's state
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop if takes_ctrl_c else signal.SIG_IGN)
    try:  # Linux: a SIGTERM when the parent dies (a kill -9 of the sweep leaves no worker behind)
        import ctypes

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


def _corpus(cfg: RunConfig, corpora: dict):
    from cemtool.data.corpus import load_corpus

    key = json.dumps(to_dict(cfg.data), sort_keys=True)
    if key not in corpora:
        corpora[key] = load_corpus(cfg.data)
    return corpora[key]


def _train_item(study: Study, item: dict, dev: torch.device, corpora: dict, emit: Callback) -> None:
    """Train one item, or continue it, or skip it if completed; record its compute."""
    from cemtool.forgetting import clear_partial_run
    from cemtool.train import finalize_model_config, train

    plan, path = study.plan, study.path / item["run"]
    _not_a_link(path)
    cfg = item_config(plan, item["arch"], item["seed"], item.get("point"))
    clear_partial_run(path)
    resume = is_run(path)
    if resume:
        run = open_run(path)
        stored = run.config()
        filled = replace_config(cfg, **{"model.vocab_size": stored.model.vocab_size,
                                        "model.max_seq_len": stored.model.max_seq_len})
        if to_dict(stored) != to_dict(filled):
            raise CemtoolError(f"{path} holds a run with another config than the study plans",
                               hint="move it away, or use another --out")
        cfg = stored
    if not resume or run.meta().get("status") != "completed":
        corpus = _corpus(cfg, corpora)
        if resume:
            run.lock()  # train() marks it running again once its checkpoint has loaded
        else:
            cfg = finalize_model_config(cfg, corpus)
            run = create_run(path, cfg, argv=sys.argv, device=str(dev),
                             extra_meta={"corpus": corpus.info, "study": str(study.path.resolve()),
                                         "item": item["name"]}, tokenizer=corpus.tokenizer)
        item.update(status="running", error=None)
        study.save()
        try:
            res = train(cfg, corpus, run, device=dev, resume=resume, callback=emit)
        except CemtoolError as e:
            item.update(status="failed", error=e.message)
            study.save()
            return
        finally:
            run.unlock()
        if res.status != "completed":
            raise KeyboardInterrupt  # train() caught a Ctrl-C and kept its last checkpoint
    meta = run.meta()
    item.update(status="completed", error=None, step=meta.get("step"), tokens=meta.get("tokens"),
                val_loss=meta.get("val_loss"), val_floor=meta.get("val_floor"), seconds=meta.get("train_seconds"))
    if "flops_per_token" not in item:
        from cemtool.analysis.compare import run_compute

        item.update(run_compute(cfg))
        item["total_flops"] = item["flops_per_token"] * (item["tokens"] or 0)
    study.save()


def _analyse(study: Study, item: dict, name: str, dev: torch.device, emit: Callback) -> None:
    """Run one analysis of one item unless its report exists."""
    plan = study.plan
    report, ft = _report_path(study.path, item, name, plan)
    entry = item["analyses"].setdefault(name, {"status": "pending", "report": None, "error": None})
    if ft is not None:
        _not_a_link(ft)
        entry["run"] = ft.name
    if report.exists():
        if entry["status"] != "completed":
            entry.update(status="completed", report=str(report.relative_to(study.path)), error=None)
            study.save()
        emit({"kind": "analysis", "analysis": name, "status": "skipped", "error": None})
        return
    entry.update(status="running", error=None)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "running", "error": None})
    t0 = time.perf_counter()
    run_path, options = study.path / item["run"], plan.options.get(name, {})
    try:
        if name == "sharpness":
            _sharpness(run_path, options, dev, emit)
        elif name == "collapse":
            _collapse(run_path, options, dev, emit)
        else:
            _forgetting(run_path, options, dev, emit, plan.target, ft)
    except CemtoolError as e:
        entry.update(status="failed", error=e.message, seconds=time.perf_counter() - t0)
        study.save()
        emit({"kind": "analysis", "analysis": name, "status": "failed", "error": e.message})
        return
    entry.update(status="completed", report=str(report.relative_to(study.path)), error=None,
                 seconds=time.perf_counter() - t0)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "completed", "error": None})


__all__ = ["ANALYSES", "Plan", "Study", "grid_points", "item_config", "make_plan", "open_study", "parse_grid",
           "plan_from_tuning", "run_sweep", "select"]
