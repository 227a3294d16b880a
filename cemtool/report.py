"""Reports: tables -> JSON / CSV / Markdown, with provenance attached.

Every analysis command writes ``reports/<name>.json`` (the full result with provenance: config, seed, checkpoint,
versions, token counts, the options it was measured with) and, for its main table, ``reports/<name>.csv``.
Markdown tables feed report.md files. One rule for every analysis: a user-given ``--name`` keeps analyses of one
run under other settings apart; :func:`named_reports` lists a run's reports whatever their names, with the analysis
each holds (:func:`report_kind`) and its options (:func:`report_options`), and :func:`mismatched_settings` says
where the reports of several runs were measured differently (``compare`` and ``plot`` flag it).
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cemtool.config import uniform_head_dim
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json
from cemtool.provenance import now, versions
from cemtool.threads import threads_info
from cemtool.writes import atomic_write_json, atomic_write_text, safe_name


def provenance(run_path: str | Path | None = None, *, seed: int | None = None, checkpoint: str | None = None,
               step: int | None = None, **extra: Any) -> dict:
    """Where a report came from: the run, its checkpoint and step, the seed, versions and time, the CPU threads it
    was measured with (``cpu``: :func:`cemtool.threads.threads_info`); for a model cemtool did not train, what was
    loaded and the check of its logits (``model_source.json``, cemtool.subject.hf)."""
    out = {"run": None if run_path is None else str(run_path), "checkpoint": checkpoint, "step": step,
           "seed": seed, "versions": versions(), "created": now(), "cpu": threads_info()}
    source = Path(run_path) / "model_source.json" if run_path is not None else None
    if source is not None and source.exists():
        out["model_source"] = read_json(source, "model description")
    out.update(extra)
    return out


# --------------------------------------------------------------------------------------------------------------
# named reports: one rule for every analysis


KIND_OF = {"collapse-report": "collapse", "saturation sweep": "saturation_sweep"}  # provenance command -> kind
KINDS = ("sharpness_per_layer", "sharpness", "collapse_compare", "collapse", "saturation_sweep", "saturation",
         "forgetting", "compare", "demo")  # longest first where one starts another
NOT_SETTINGS = ("device", "batch_size")  # options that do not change what a report measures


def report_kind(stem: str, report: Any) -> str | None:
    """The analysis a report holds: from its provenance (``analysis``, else ``command``), else from its file name
    (``sharpness-layer-0`` -> sharpness); None when neither tells. A collapse report over several runs is
    ``collapse_compare``."""
    prov = report.get("provenance") if isinstance(report, dict) else None
    prov = prov if isinstance(prov, dict) else {}
    kind = prov.get("analysis") or KIND_OF.get(prov.get("command"), prov.get("command"))
    if kind == "collapse" and len(report.get("runs") or []) > 1:
        kind = "collapse_compare"
    if kind in KINDS:
        return kind
    return next((k for k in KINDS if stem == k or stem.startswith((k + "_", k + "-"))), None)


def report_options(report: Any) -> dict:
    """The settings a report was measured with: its provenance ``options`` (collapse, saturation) or its own
    ``options`` (sharpness), the fine-tuning ``recipe`` (forgetting), plus the checkpoint, the evaluation tokens and
    the window length where the report records them."""
    if not isinstance(report, dict):
        return {}
    prov = report.get("provenance") if isinstance(report.get("provenance"), dict) else {}
    opts = prov.get("options") or report.get("options") or report.get("recipe") or {}
    out = dict(opts) if isinstance(opts, dict) else {}
    for key in ("tokens", "seq_len"):
        if key not in out and isinstance(report.get(key), int):
            out[key] = report[key]
    if prov.get("backend"):
        out["backend"] = prov["backend"]
    if "checkpoint" not in out and isinstance(prov.get("checkpoint"), str):
        out["checkpoint"] = Path(prov["checkpoint"]).name
    return out


def _model_source_data(report: Any) -> dict | None:
    prov = report.get("provenance") if isinstance(report, dict) else None
    src = prov.get("model_source") if isinstance(prov, dict) else None
    data = src.get("data") if isinstance(src, dict) else None
    return data if isinstance(data, dict) else None


def replaced_data_note(path: Path, run_path: Path) -> str | None:
    """A note when writing the report ``path`` replaces one measured on other evaluation data than the model now
    loaded from ``run_path`` (a Hugging Face model's reports record it: ``provenance.model_source.data``, from
    ``model_source.json``), None otherwise."""
    source = Path(run_path) / "model_source.json"
    if not path.is_file() or not source.is_file():
        return None
    try:
        data = _model_source_data({"provenance": {"model_source": read_json(source, "model source")}})
        was = _model_source_data(read_json(path, "report"))
    except CemtoolError:
        return None
    if data is None or was is None or was.get("source") == data.get("source"):
        return None
    return (f"replaced {path.name}, which was measured on other data ({was.get('source')!r}; now "
            f"{data.get('source')!r}): --name keeps reports apart")


@dataclass
class NamedReport:
    """One ``reports/<name>.json``: its name, the analysis it holds, its settings, its content (None when it
    cannot be read, with ``problem`` saying why)."""

    name: str
    kind: str | None
    path: Path
    options: dict
    report: dict | None
    problem: str | None = None


def named_reports(folder: str | Path, kind: str | None = None) -> list[NamedReport]:
    """Every report in ``<folder>/reports`` (a run's, or a sweep's), by name, whatever name it was written under
    (``sharpness --name``, ``collapse-report --name``, ...); ``kind`` keeps one analysis (see :func:`report_kind`).
    """
    d = Path(folder) / "reports"
    out = []
    for path in sorted(d.glob("*.json")) if d.is_dir() and not d.is_symlink() else []:
        try:
            rep = read_json(path, "report")
            problem = None if isinstance(rep, dict) else "not a JSON object"
        except CemtoolError as e:
            rep, problem = None, e.message
        rep = rep if problem is None else None
        r = NamedReport(path.stem, report_kind(path.stem, rep) if rep else report_kind(path.stem, {}), path,
                        report_options(rep), rep, problem)
        if kind is None or r.kind == kind:
            out.append(r)
    return out


def mismatched_settings(options: dict[str, dict]) -> dict[str, dict[str, list[str]]]:
    """Settings that differ between reports (``options``: who -> report_options), except those in NOT_SETTINGS:
    setting -> {value as JSON: [who, ...]}; {} when all agree."""
    keys = sorted({k for o in options.values() for k in o} - set(NOT_SETTINGS))
    out = {}
    for k in keys:
        by_value: dict[str, list[str]] = {}
        for who, o in options.items():
            by_value.setdefault(json.dumps(o.get(k), sort_keys=True, default=str), []).append(who)
        if len(by_value) > 1:
            out[k] = by_value
    return out


def mismatch_text(mismatch: dict[str, dict[str, list[str]]], limit: int = 3) -> str:
    """'tokens: 1024 (a, b), 2048 (c); seq_len: ...' for a note."""
    parts = []
    for k, by_value in mismatch.items():
        vals = [f"{v} ({', '.join(w[:limit])}{' ...' if len(w) > limit else ''})" for v, w in by_value.items()]
        parts.append(f"{k}: {', '.join(vals)}")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------------------------
# tables


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
    paths = {"json": d / f"{safe_name(name)}.json"}
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

# the one spread of a group of runs over seeds, in tables, files and figures alike: the sample standard deviation
# (ddof = 1), never the standard error (compare, plot, report.md)
SPREAD = "mean ± std over seeds (sample standard deviation, ddof 1)"
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


def _shown(name: str, settings: dict) -> Any:
    """A setting's value in a label; a size left at 0 ("derive it") shows the size it derived, e.g.
    ``model.mlp_hidden=176(auto)`` rather than ``model.mlp_hidden=0``."""
    v, d = settings.get(name), settings.get("model.d_model")
    if v != 0 or not isinstance(d, int):
        return v
    if name == "model.mlp_hidden":
        # start-up: torch (about 1 s) loads only here; `cemtool plot` labels figures with this module
        from cemtool.models.layers import mlp_hidden
        return f"{mlp_hidden(d, settings.get('model.mlp', 'swiglu'), 0)}(auto)"
    if name == "model.head_dim" and isinstance(settings.get("model.n_head"), int):
        return f"{uniform_head_dim(d, settings['model.n_head'])}(auto)"
    return v


def group_labels(archs: list[str], settings: list[dict]) -> list[str]:
    """One label per run for its group (same settings apart from the seed): the architecture name, plus the
    settings that tell apart groups sharing that name, e.g. ``baseline[model.mlp_hidden=224]``: chosen greedily (the
    setting that tells the group from the most others first, ties by name) until no other group of the name is
    left, so two groups never share a label and labels stay short."""
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
            left = [json.loads(o) for o in ks if o != k]  # groups not yet told apart
            chosen: list[str] = []
            while left:
                names = sorted({n for o in left for n in (set(o) | set(mine)) if o.get(n) != mine.get(n)})
                best = max(names, key=lambda n: (sum(o.get(n) != mine.get(n) for o in left), -names.index(n)))
                chosen.append(best)
                left = [o for o in left if o.get(best) == mine.get(best)]
            label_of[(a, k)] = f"{a}[{','.join(f'{n}={_shown(n, mine)}' for n in sorted(chosen))}]"
    return [label_of[(a, k)] for a, k in zip(archs, keys, strict=True)]
