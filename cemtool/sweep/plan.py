"""The plan of a study: what it trains and measures (:class:`Plan`, stored in study.json), built and validated by
:func:`make_plan` before anything is created, with its grids (``--grid``), its items' names and configs, and the
notes the command prints about it."""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import cemtool.data.synthetic  # noqa: F401 (registers its sources)
from cemtool.config import RunConfig, is_section, parse_override, resolve, to_dict
from cemtool.data.corpus import sources
from cemtool.data.grammar import GRAMMARS
from cemtool.errors import CemtoolError, UsageError, did_you_mean, known_hint
from cemtool.forgetting import check_tokenizer
from cemtool.sweep.options import _check_options, analysis_names
from cemtool.train import total_steps

RESERVED = {"seed": "--seeds", "train.max_tokens": "--tokens", "model.arch": "--archs", "data.source": "--data",
            "schema_version": None}  # set by the sweep: refused in --set and --grid
# a grid over it would train one config (every run trains --tokens tokens); in --set, a value that does not give
# --tokens tokens is noted (plan_notes)
STEPS_KEY = "train.max_steps"
MAX_RUNS = 10_000  # runs in one study (each is a folder; the plan resolves every one before anything starts)
MAX_RUN_NAME = 150  # characters of a run folder's name (a fine-tune's and the temporary names add to it)


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


def plan_items(plan: Plan) -> list[dict]:
    """The items of a new study, all pending: every seed x architecture x grid point (study.json's "items")."""
    return [{"name": item_name(a, s, pt), "arch": a, "seed": s, "run": item_name(a, s, pt),
             **({"point": pt} if pt else {}), "status": "pending", "error": None,
             "analyses": {n: {"status": "pending", "report": None, "error": None} for n in plan.analyses}}
            for s in plan.seeds for a in plan.archs for pt in grid_points(plan)]


def make_plan(archs: str | list, seeds: str | list, *, tokens: int | None = None, data: str = "grammar",
              overrides: list[str] | tuple = (), analyses: str | list = (), target: str | None = None,
              options: dict | None = None, grid: list[str] | tuple = (), arch_overrides: dict | None = None,
              tuned_from: str | None = None) -> Plan:
    """Validate a study's plan (unknown architecture, bad override, no seeds, bad grid... -> CemtoolError).
    ``tokens`` defaults to what the first architecture's config trains on (train.max_tokens, else max_steps x
    batch). ``grid``: ['key=v1,v2', ...] (every point is trained); ``arch_overrides``: {arch: ['key=value']} (the
    tuned values, see :func:`plan_from_tuning`)."""
    arch_list = _split_list(archs, "architecture", "architectures")
    seed_list = parse_seeds(seeds)
    chosen = _split_list(analyses, "analysis", "analyses") if analyses else []
    bad = [a for a in chosen if a not in analysis_names()]
    if bad:
        raise CemtoolError(f"unknown analysis {bad[0]!r}", hint=known_hint(bad[0], analysis_names(), "choose from"))
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
        check_tokenizer("word" if data in GRAMMARS else "text", target)
    options = {k: dict(v) for k, v in (options or {}).items()}
    _check_options(options, chosen)
    plan = Plan(tuple(arch_list), tuple(seed_list), int(tokens), data, tuple(overrides), tuple(chosen), target,
                options, tuple(grid), arch_overrides, tuned_from)
    names = [it["name"] for it in plan_items(plan)]
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
