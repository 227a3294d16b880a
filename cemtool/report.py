"""Reports: tables -> JSON / CSV / Markdown, with provenance attached.

Every analysis command writes ``reports/<name>.json`` (the full result with provenance: config, seed, checkpoint,
versions, token counts) and, for its main table, ``reports/<name>.csv``. Markdown tables feed report.md files.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from cemtool.runs import atomic_write_json, atomic_write_text, now, versions


def provenance(run_path: str | Path | None = None, *, seed: int | None = None, checkpoint: str | None = None,
               step: int | None = None, **extra: Any) -> dict:
    """Where a report came from: the run, its checkpoint and step, the seed, versions and time."""
    out = {"run": None if run_path is None else str(run_path), "checkpoint": checkpoint, "step": step,
           "seed": seed, "versions": versions(), "created": now()}
    out.update(extra)
    return out


def csv_text(rows: list[dict]) -> str:
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _cell(v) for k, v in r.items()})
    return buf.getvalue()


def _cell(v: Any) -> Any:
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v)
    return v


def write_report(reports_dir: str | Path, name: str, payload: dict, rows: list[dict] | None = None) -> dict:
    """Write reports/<name>.json (payload) and, if given, reports/<name>.csv (rows). Returns the paths."""
    d = Path(reports_dir)
    paths = {"json": d / f"{name}.json"}
    atomic_write_json(paths["json"], payload)
    if rows is not None:
        paths["csv"] = d / f"{name}.csv"
        atomic_write_text(paths["csv"], csv_text(rows))
    return paths


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.{digits}g}" if abs(v) >= 1e4 or (v != 0 and abs(v) < 1e-3) else f"{v:.{digits}f}"
    return str(v)


def markdown_table(rows: list[dict], columns: list[str] | None = None, digits: int = 4) -> str:
    if not rows:
        return "_(no rows)_\n"
    cols = columns or list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(fmt(r.get(c), digits) for c in cols) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------------------
# groups of runs across seeds

FAMILY_SECTIONS = ("cem", "momentum", "lime")  # config sections under "model" that only their own family reads


def run_settings(config: dict, family: str | None = None) -> dict[str, Any]:
    """A run's config (config.json as a dict) flattened to dotted keys, without what does not change the
    experiment: the seed, the schema version and, when the run's family is known, the ``model.<section>`` of
    other families (a baseline's ``model.momentum.stream_init`` builds the same model either way)."""
    flat: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v

    walk({k: v for k, v in config.items() if k not in ("seed", "schema_version")}, "")
    if family is not None:
        other = tuple(f"model.{s}." for s in FAMILY_SECTIONS if s != family)
        flat = {k: v for k, v in flat.items() if not k.startswith(other)}
    return flat


def group_labels(archs: list[str], settings: list[dict]) -> list[str]:
    """One label per run for its group (same settings apart from the seed): the architecture name, plus up to three
    of the settings that tell apart groups sharing that name, e.g. ``baseline[model.mlp_hidden=224]``."""
    keys = [json.dumps(s, sort_keys=True, default=str) for s in settings]
    by_arch: dict[str, list[str]] = {}
    for a, k in zip(archs, keys, strict=True):
        if k not in by_arch.setdefault(a, []):
            by_arch[a].append(k)
    label_of: dict[tuple[str, str], str] = {}
    for a, ks in by_arch.items():
        for k in ks:
            if len(ks) == 1:
                label_of[(a, k)] = a
                continue
            mine = json.loads(k)
            others = [json.loads(o) for o in ks if o != k]
            diff = sorted(name for name in set(mine) | {n for o in others for n in o}
                          if any(o.get(name) != mine.get(name) for o in others))
            label_of[(a, k)] = f"{a}[{','.join(f'{n}={mine.get(n)}' for n in diff[:3])}]"
    return [label_of[(a, k)] for a, k in zip(archs, keys, strict=True)]
