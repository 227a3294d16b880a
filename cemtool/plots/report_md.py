"""report.md per run and per sweep: every figure beside the numbers it shows; never recomputes.

A run's report.md sits in the run directory: what was trained (architecture, sizes, data, provenance), the
training curves with the evaluation table, then one section per report found in ``reports/`` (sharpness,
collapse, saturation, forgetting, comparison), each a table of its headline numbers followed by its figures.
A sweep's report.md (any folder of runs, e.g. ``cemtool demo``'s output or a saturation sweep) has a table of its
runs linking to each run's own report.md, the overlaid training curves and the sweep-level reports.

The sections, one per report, and the figure lists are written by :mod:`cemtool.plots.report_sections`;
figures are passed in by :mod:`cemtool.plots.render`.
"""

from __future__ import annotations

import math
from pathlib import Path

from cemtool.plots.report_sections import (
    CAPTIONS,
    SECTIONS,
    _int,
    _rel,
    caption,
    collapse_section,
    compare_section,
    figures_md,
    negative_curvature_note,
    pm,
    saturation_section,
    saturation_sweep_section,
    section,
    section_writer,
    study_section,
)
from cemtool.plots.training import RunCurves, label_runs, read_run
from cemtool.report import fmt, markdown_table
from cemtool.writes import atomic_write_text

# --------------------------------------------------------------------------------------------------------------
# whole files


def _model_line(cfg: dict) -> str:
    m = cfg.get("model", {})
    heads = f"{m.get('n_head')} heads" if not m.get("heads") else f"heads {list(m['heads'])}"
    return (f"d_model {m.get('d_model')}, {m.get('n_layer')} layers, {heads}, {m.get('mlp')} MLP, {m.get('norm')}, "
            f"{m.get('pos')} positions, vocabulary {m.get('vocab_size')}")


def _train_line(cfg: dict) -> str:
    t, d = cfg.get("train", {}), cfg.get("data", {})
    batch = (t.get("batch_size") or 0) * (t.get("grad_accum") or 1)
    steps = t.get("max_steps")
    if t.get("max_tokens") and batch and d.get("seq_len"):  # max_tokens overrides max_steps (cemtool.train)
        steps = math.ceil(t["max_tokens"] / (batch * d["seq_len"]))
    return (f"{steps} steps of {batch} x {d.get('seq_len')} tokens, AdamW lr {t.get('lr')} ({t.get('schedule')}, "
            f"{t.get('warmup_steps')} warmup steps), weight decay {t.get('weight_decay')}")


def _data_line(cfg: dict, corpus: dict) -> str:
    """The data source with what is known of it (tokenizer, token counts); nothing is printed for what is not."""
    data = cfg.get("data", {})
    tok = corpus.get("tokenizer") or data.get("tokenizer")
    train = corpus.get("train_tokens")
    parts = ([f"{tok} tokenizer"] if tok else []) + ([f"{_int(train)} training tokens"] if train else
                                                     [f"{_int(corpus['tokens'])} tokens"] if corpus.get("tokens")
                                                     else [])
    return f"`{data.get('source')}`" + (f" ({', '.join(parts)})" if parts else "")


def run_summary(r: RunCurves) -> dict:
    params = r.meta.get("params") or {}
    floor, val = r.floor, r.final_val
    return {"run": r.path.name, "arch": r.arch, "seed": r.seed, "status": r.meta.get("status", "?"),
            "steps": r.meta.get("step"), "tokens": r.meta.get("tokens"), "params": params.get("total"),
            "val loss": val, "floor": floor, "gap": None if floor is None or val is None else val - floor}


def _bpb_text(meta: dict) -> str:
    """', X bits/byte, perplexity Y' from meta.json when training recorded them (older runs: nothing)."""
    parts = [f"{fmt(meta['val_bpb'])} bits/byte"] if meta.get("val_bpb") is not None else []
    parts += [f"perplexity {fmt(meta['val_ppl'])}"] if meta.get("val_ppl") is not None else []
    return f" ({', '.join(parts)})" if parts else ""


def eval_table(r: RunCurves, max_rows: int = 12) -> str:
    rows = r.val
    if len(rows) > max_rows:  # keep the first, the last and evenly spaced ones between
        idx = sorted({round(i * (len(rows) - 1) / (max_rows - 1)) for i in range(max_rows)})
        rows = [rows[i] for i in idx]
    floor = any(v.get("val_floor") is not None for v in rows)  # no floor known: no floor or gap columns
    bpb = any(v.get("val_bpb") is not None for v in rows)  # runs trained before bits/byte were logged: no column
    table = []
    for v in rows:
        row = {"step": v.get("step"), "tokens": _int(v.get("tokens")), "val loss": v["val_loss"]}
        if bpb:
            row["bits/byte"] = v.get("val_bpb")
        if floor:
            row.update(floor=v.get("val_floor"),
                       gap=None if v.get("val_floor") is None else v["val_loss"] - v["val_floor"])
        table.append(row)
    return markdown_table(table)


def run_markdown(run_dir: str | Path, figures: dict[str, list[Path]], reports: dict[str, tuple[Path, dict | None]],
                 notes: list[str] | None = None) -> str:
    """The text of a run's report.md. ``figures``: report stem ('training', 'collapse', ...) -> figure paths;
    ``reports``: report stem -> (its JSON path, its parsed content or None when it could not be read)."""
    base = Path(run_dir)
    r = read_run(base)
    label_runs([r])
    s = run_summary(r)
    m, cfg = r.meta, r.config
    corpus = m.get("corpus") or {}
    rows = [("architecture", f"`{r.arch}`"), ("seed", r.seed), ("status", s["status"]),
            ("steps / tokens", f"{_int(s['steps'])} / {_int(s['tokens'])}"),
            ("parameters", f"{_int(s['params'])} ({_int((m.get('params') or {}).get('non_embedding'))} "
                           f"non-embedding)"),
            ("model", _model_line(cfg)), ("training", _train_line(cfg)),
            ("data", _data_line(cfg, corpus)),
            ("final validation loss", f"{fmt(s['val loss'])} nats/token" + _bpb_text(m)),
            ("entropy floor / gap", f"{fmt(s['floor'])} / {fmt(s['gap'])}" if s["floor"] is not None
             else "not known for this corpus"),
            ("training time", f"{fmt(m.get('train_seconds'), 3)} s on {m.get('device', '?')}"),
            ("versions", ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items() if k != "platform")),
            ("git commit", f"`{m.get('git_commit')}`")]
    out = [f"# Run `{base.name}`\n", "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)]
    out.append("## Training curves\n")
    out.append(figures_md(figures.get("training", []), base, floor=r.floor is not None))
    if r.val:
        out.append("Validation loss (nats/token) at each evaluation:\n\n" + eval_table(r))
    for stem, (path, rep) in sorted(reports.items(), key=lambda kv: _order(kv[0])):
        out.append(section(stem, rep, figures.get(stem, []), base, path))
    out += _notes(notes)
    out.append(f"\n---\n*Written by `cemtool plot` from {base.name}/'s metrics.jsonl, meta.json, config.json and "
               f"reports/; nothing was recomputed.*\n")
    return "\n".join(out)


def _run_link(path: Path, base: Path) -> str:
    """The run's name (its path below ``base``), linked to its report.md when it has one."""
    rel = _rel(path, base)
    name = path.name if rel.startswith("..") else rel
    rep = path / "report.md"
    return f"[{name}]({_rel(rep, base)})" if rep.exists() else name


def collection_markdown(root: str | Path, runs: list[Path], figures: dict[str, list[Path]],
                        reports: dict[str, tuple], notes: list[str] | None = None, title: str | None = None,
                        finetunes: list[Path] | None = None) -> str:
    """The text of a sweep's report.md: the runs (linked), overlaid training curves, the sweep-level reports.
    ``runs``: the trained runs; ``finetunes``: fine-tunes of them (listed and linked, not overlaid)."""
    base = Path(root)
    curves = label_runs([read_run(p) for p in runs])
    out = [f"# {title or f'Sweep `{base.name}`'}\n"]
    if curves:
        rows = []
        for c in curves:
            s = run_summary(c)
            s["run"] = _run_link(c.path, base)
            s["tokens"], s["params"] = _int(s["tokens"]), _int(s["params"])
            rows.append(s)
        if any(c.floor is not None for c in curves):
            out.append(f"{len(curves)} run(s); losses in nats/token; gap = final validation loss - entropy floor.\n")
        else:  # text corpora: no floor, so no floor or gap columns
            rows = [{k: v for k, v in r.items() if k not in ("floor", "gap")} for r in rows]
            out.append(f"{len(curves)} run(s); losses in nats/token.\n")
        out.append(markdown_table(rows))
    if finetunes:
        out.append("Fine-tunes (`cemtool forgetting`): " + ", ".join(_run_link(p, base) for p in finetunes) + ".\n")
    if figures.get("training") or figures.get("training_groups"):
        out.append("## Training curves\n")
        out.append(figures_md(figures.get("training", []) + figures.get("training_groups", []), base,
                              floor=any(c.floor is not None for c in curves)))
    for stem, (path, rep) in sorted(reports.items(), key=lambda kv: _order(kv[0])):
        out.append(section(stem, rep, figures.get(stem, []), base, path))
    out += _notes(notes)
    out.append("\n---\n*Written by `cemtool plot` from the runs' metrics and the saved reports; nothing was "
               "recomputed.*\n")
    return "\n".join(out)


def _order(stem: str) -> tuple[int, str]:
    order = ["study", "compare", "forgetting", "sharpness", "sharpness_layers", "collapse", "collapse_compare",
             "saturation", "saturation_sweep", "demo"]
    key = stem if stem in order else stem.split("-")[0]
    return (order.index(key) if key in order else len(order), stem)


def _notes(notes: list[str] | None) -> list[str]:
    if not notes:
        return []
    return ["## Notes\n", "".join(f"- {n}\n" for n in notes)]


def write_run_report(run_dir: str | Path, figures: dict[str, list[Path]],
                     reports: dict[str, tuple[Path, dict | None]], notes: list[str] | None = None) -> Path:
    path = Path(run_dir) / "report.md"
    atomic_write_text(path, run_markdown(run_dir, figures, reports, notes))
    return path


def write_collection_report(root: str | Path, runs: list[Path], figures: dict[str, list[Path]],
                            reports: dict[str, tuple], notes: list[str] | None = None, title: str | None = None,
                            finetunes: list[Path] | None = None) -> Path:
    path = Path(root) / "report.md"
    atomic_write_text(path, collection_markdown(root, runs, figures, reports, notes, title, finetunes))
    return path


__all__ = ["CAPTIONS", "SECTIONS", "caption", "collapse_section", "collection_markdown", "compare_section",
           "eval_table", "figures_md", "negative_curvature_note", "pm", "run_markdown", "run_summary",
           "saturation_section", "saturation_sweep_section", "section", "section_writer", "study_section",
           "write_collection_report", "write_run_report"]
