"""Reports: tables -> JSON / CSV / Markdown, with provenance attached.

Every analysis command writes ``reports/<name>.json`` (the full result with provenance: config, seed, checkpoint,
versions, token counts) and, for its main table, ``reports/<name>.csv``. Markdown tables feed report.md files.
"""

from __future__ import annotations

import csv
import io
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
        import json

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
