"""The comparison (:func:`cemtool.analysis.compare.compare`'s payload) as tables, Markdown and files:
compare.csv (per architecture), compare_runs.csv, compare_layers.csv, compare.md and reports/compare.json."""

from __future__ import annotations

from pathlib import Path

from cemtool.analysis.compare import LAYER_METRICS, METRICS
from cemtool.report import SPREAD, csv_text, markdown_table, write_report
from cemtool.writes import atomic_write_text


def fmt_num(v: float | None, digits: int = 4) -> str:
    """``digits`` significant digits; exponent form for very large or small magnitudes; blank for None."""
    if v is None:
        return ""
    if isinstance(v, int) or (float(v).is_integer() and abs(v) >= 100):
        return f"{int(v):,}" if abs(v) < 1e7 else f"{v:.{digits - 1}e}"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def cell(s: dict | None) -> str:
    """'mean ± std' (:data:`SPREAD`; the std omitted for one run or no spread), blank when missing."""
    if s is None:
        return ""
    if not s["std"]:
        return fmt_num(s["mean"])
    return f"{fmt_num(s['mean'])} ± {fmt_num(s['std'], 2)}"


def arch_table(payload: dict, transpose: bool = False) -> tuple[list[str], list[list[str]]]:
    """One row per architecture and one column per metric that some run provides (``transpose``: one row per
    metric, one column per architecture, which fits a terminal better)."""
    # a metric an older compare.json lacks (e.g. val_bpb before bits per byte were recorded) is simply absent
    present = [m for m in METRICS if any(a.get(m) is not None for a in payload["archs"])]
    names = {**METRICS, **(payload.get("metrics") or {})}  # the operator's symbol in the trace columns
    if transpose:
        cols = ["", *[a["label"] for a in payload["archs"]]]
        rows = [["runs", *[runs_cell(a) for a in payload["archs"]]]]
        rows += [[names[m], *[cell(a.get(m)) for a in payload["archs"]]] for m in present]
        return cols, rows
    cols = ["arch", "n", *[names[m] for m in present]]
    rows = [[a["label"], runs_cell(a), *[cell(a.get(m)) for m in present]] for a in payload["archs"]]
    return cols, rows


def runs_cell(arch_row: dict) -> str:
    """The number of runs, and the seeds given more than once: ``3 (seed 0 twice)``."""
    dup = arch_row.get("duplicate_seeds") or []
    if not dup:
        return str(arch_row["n"])
    seeds = arch_row["seeds"]
    return f"{arch_row['n']} ({', '.join(f'seed {s} x{seeds.count(s)}' for s in dup)})"


def flat_arch_rows(payload: dict) -> list[dict]:
    """compare.csv: per architecture, mean / std / n of every metric."""
    out = []
    for a in payload["archs"]:
        row = {"arch": a["label"], "family_arch": a["arch"], "n": a["n"], "seeds": " ".join(map(str, a["seeds"]))}
        for m in METRICS:
            s = a.get(m) or {}
            row.update({f"{m}_mean": s.get("mean"), f"{m}_std": s.get("std"), f"{m}_n": s.get("n", 0)})
        out.append(row)
    return out


def run_rows(payload: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("reports", "layers", "settings", "other_reports",
                                                     "forgetting_curve")}
            for r in payload["runs"]]


def layer_table(payload: dict, transpose: bool = False) -> tuple[list[str], list[list[str]]]:
    """One row per architecture, one column per (collapse measure, layer): mean ± std over seeds (``transpose``:
    one row per measure and layer, one column per architecture)."""
    layers = sorted({e["layer"] for a in payload["archs"] for e in a.get("layers") or []})
    cols = ["arch", *[f"{label} L{layer}" for m, label in LAYER_METRICS.items() for layer in layers]]
    rows = []
    for a in payload["archs"]:
        by = {e["layer"]: e for e in a.get("layers") or []}
        if by:
            rows.append([a["label"], *[cell(by[layer][m]) if layer in by else "" for m in LAYER_METRICS
                                       for layer in layers]])
    if transpose and rows:
        return ["", *[r[0] for r in rows]], [[c, *[r[j] for r in rows]] for j, c in enumerate(cols) if j > 0]
    return cols, rows


def flat_layer_rows(payload: dict) -> list[dict]:
    """compare_layers.csv: per architecture and layer, mean / std / n of the per-layer collapse measures."""
    out = []
    for a in payload["archs"]:
        for e in a.get("layers") or []:
            row = {"arch": a["label"], "layer": e["layer"]}
            for m in LAYER_METRICS:
                s = e[m] or {}
                row.update({f"{m}_mean": s.get("mean"), f"{m}_std": s.get("std"), f"{m}_n": s.get("n", 0)})
            out.append(row)
    return out


def val_loss_note(payload: dict) -> str:
    """What "val loss" means in a comparison made with ``at_tokens``."""
    points = sorted({r["val_tokens"] for r in payload["runs"] if r.get("val_tokens") is not None})
    return (f"Val loss: each run's last evaluation at or before {payload['at_tokens']:,} training tokens (at "
            f"{', '.join(f'{p:,}' for p in points) or 'no run has one'} tokens), not the final one. A loss in the "
            f"middle of a decaying learning-rate schedule is not the loss of a run trained for that many tokens.")


def markdown(payload: dict) -> str:
    cols, rows = arch_table(payload)
    md = ["# Comparison", "", f"{SPREAD[0].upper()}{SPREAD[1:]} (n runs). Forgetting target: "
                              f"{payload['target'] or '-'}.", ""]
    if payload.get("at_tokens") is not None:
        md += [val_loss_note(payload), ""]
    md += [markdown_table([dict(zip(cols, r, strict=True)) for r in rows], cols)]
    md += ["## Spearman correlations across runs", "",
           markdown_table([{"x": c["x"], "y": c["y"], "rho": c["rho"], "p": c["p"], "p from": c["p_method"] or "",
                            "n": c["n"], "note": c["note"] or ""} for c in payload["correlations"]])]
    if payload["pairwise"]:
        md += [f"## Pairwise differences (a - b, Welch t {payload['level']:.0%} intervals)", "",
               markdown_table([{k: p.get(k) for k in ("metric", "a", "b", "diff", "lo", "hi", "df", "p", "p_holm",
                                                      "mde", "n_a", "n_b")} for p in payload["pairwise"]])]
    md += statistics_markdown(payload)
    layer_cols, layer_rows = layer_table(payload)
    if layer_rows:
        md += [f"## Per layer (collapse report; {SPREAD})", "",
               markdown_table([dict(zip(layer_cols, r, strict=True)) for r in layer_rows], layer_cols)]
    if payload.get("pairwise_layers"):
        md += [f"## Per-layer differences (a - b, Welch t {payload['level']:.0%} intervals, no multiple-comparison "
               f"correction)", "",
               markdown_table([{k: p[k] for k in ("metric", "layer", "a", "b", "diff", "lo", "hi", "df", "p", "n_a",
                                                  "n_b")} for p in payload["pairwise_layers"]])]
    miss = [f"- {name}: {len(runs)} run(s) without it" for name, runs in payload["missing"].items() if runs]
    if miss or payload["notes"]:
        md += ["## Missing", "", *miss, *[f"- {n}" for n in payload["notes"]], ""]
    return "\n".join(md)


def statistics_markdown(payload: dict) -> list[str]:
    """compare.md's sections on equivalence, architecture-level and partial correlations, matched plasticity and
    main effects (those the comparison has)."""
    md = []
    margins = payload.get("margins") or {}
    if margins:
        md += ["## Equivalence (TOST, Welch)", "",
               markdown_table([{k: p.get(k) for k in ("metric", "a", "b", "diff", "margin", "lo90", "hi90", "p_tost",
                                                      "equivalent")} for p in payload["pairwise"]
                               if p["metric"] in margins])]
    rows = [{"x": c["x"], "y": c["y"], **{k: (c.get("arch_level") or {}).get(k)
                                         for k in ("rho", "p", "lo", "hi", "n_archs", "n_runs")},
             "partial (runs)": (c.get("partial") or {}).get("rho"),
             "partial p": (c.get("partial") or {}).get("p"),
             "partial (archs)": (c.get("partial_arch_level") or {}).get("rho")} for c in payload["correlations"]]
    if any(r["rho"] is not None for r in rows):
        given = ", ".join(payload.get("covariates") or []) or "none"
        md += ["## Correlations across architecture means", "",
               f"Spearman over the architectures' means; lo/hi: {payload['level']:.0%} two-level bootstrap "
               f"(architectures, then seeds; {payload['bootstrap']['n_boot']} replicates); partial: given {given}.",
               "", markdown_table(rows)]
    m = payload.get("matched_plasticity") or {}
    if m.get("level") is not None:
        md += [f"Forgetting at matched plasticity: each fine-tune's forgetting where its plasticity first reaches "
               f"{m['level']:.4g} ({m['rule']}).", ""]
    if payload.get("factors"):
        md += [f"## Main effects (architecture as the unit, {payload['level']:.0%})", "",
               markdown_table([{k: f.get(k) for k in ("factor", "metric", "diff", "lo", "hi", "boot_lo", "boot_hi",
                                                      "p", "p_holm", "mde", "n_a", "n_b")}
                               for f in payload["factors"]])]
    return md


def write_compare(payload: dict, out: str | Path) -> dict[str, Path]:
    """Write <out>/compare.csv (per architecture), compare_runs.csv (per run), compare_layers.csv (per architecture
    and layer, when collapse reports exist), compare.md and <out>/reports/compare.json (+ .csv of the pairwise
    differences)."""
    out = Path(out)
    paths = {"csv": out / "compare.csv", "runs_csv": out / "compare_runs.csv", "md": out / "compare.md"}
    atomic_write_text(paths["csv"], csv_text(flat_arch_rows(payload)))
    atomic_write_text(paths["runs_csv"], csv_text(run_rows(payload)))
    layer_rows = flat_layer_rows(payload)
    if layer_rows:
        paths["layers_csv"] = out / "compare_layers.csv"
        atomic_write_text(paths["layers_csv"], csv_text(layer_rows))
    atomic_write_text(paths["md"], markdown(payload))
    paths["json"] = write_report(out / "reports", "compare", payload, payload["pairwise"] or None)["json"]
    return paths


__all__ = ["arch_table", "flat_arch_rows", "flat_layer_rows", "fmt_num", "layer_table", "markdown", "run_rows",
           "val_loss_note", "write_compare"]
