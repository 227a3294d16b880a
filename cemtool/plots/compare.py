"""Figures that put several runs side by side, from saved reports only (never recomputes, never imports models):

- forgetting curves: the source-data and target-data validation losses along each fine-tune
  (reports/forgetting.json of the fine-tuned runs), forgetting and plasticity in the legend;
- eigenvalues per layer: lambda_max, lambda_min and tr(H)/n of each layer's parameter block, from the
  ``cemtool sharpness --params layer:N`` reports (reports/sharpness-layer-N.json) of one or several runs;
- comparison: per architecture and measure, the mean over seeds with error bars of ± one standard deviation over
  seeds (the tables' ± std: :data:`cemtool.analysis.compare.SPREAD`) and the single runs (reports/compare.json);
- the forgetting-plasticity frontier: forgetting against plasticity along the fine-tunes, per architecture
  (compare.json's ``forgetting_curve`` of each run).

Colour = architecture (:func:`cemtool.plots.style.arch_color`) and line style = seed, as in the training curves.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from cemtool.analysis.curvature import DEFAULT_OPERATOR, symbol
from cemtool.plots.style import (
    CURVATURE,
    arch_color,
    layer_axis,
    legend_below,
    mark_not_converged,
    new_figure,
    not_converged_handle,
    plain_numbers,
    save,
    variant_index,
)
from cemtool.plots.training import FLOOR_COLOR, SEED_STYLES
from cemtool.report import SPREAD

# --------------------------------------------------------------------------------------------------------------
# forgetting curves


FLOOR_REACH = 1.0  # an entropy floor further below the curves than their own span is named, not drawn


def data_name(data) -> str:
    """A data source as a figure names it: a built-in source as it is, a file or folder by its last part (never a
    whole path: titles are for readers, and paths are long and private)."""
    text = str(data)
    return Path(text.rstrip("/")).name or text if ("/" in text or "\\" in text) else text


def _forgetting_label(rep: dict, dup: bool) -> str:
    src = rep["source"]
    seed = (rep.get("provenance") or {}).get("seed")
    return Path(src["run"]).name if dup else f"{src['arch']} (seed {seed})"


def plot_forgetting(reports: list[dict], plots_dir: str | Path, name: str = "forgetting") -> list[Path]:
    """Left: loss on the source data A along the fine-tune (rises = forgetting); right: loss on the target data B
    (falls = plasticity). One line per fine-tune; the exact floors dashed where known."""
    if not reports:
        return []
    keys = [(r["source"]["arch"], (r.get("provenance") or {}).get("seed")) for r in reports]
    seeds = sorted({k[1] for k in keys}, key=lambda s: (s is None, s))
    rows = (len(reports) + 1 + 2) // 3  # legend rows below the axes
    fig, axes = new_figure(11.0, 4.2 + 0.25 * rows, ncols=2)
    for rep, key in zip(reports, keys, strict=True):
        label = _forgetting_label(rep, keys.count(key) > 1)
        color, ls = arch_color(key[0]), SEED_STYLES[seeds.index(key[1]) % len(SEED_STYLES)]
        steps = [p["step"] for p in rep["curve"]]
        for ax, field in ((axes[0, 0], "source_loss"), (axes[0, 1], "target_loss")):
            ax.plot(steps, [p[field] for p in rep["curve"]], color=color, ls=ls, lw=1.8, marker="o", ms=3,
                    label=f"{label}: forgetting {rep['forgetting']:+.3f}, plasticity {rep['plasticity']:+.3f}")
    floor_text = []
    for ax, side in ((axes[0, 0], "source"), (axes[0, 1], "target")):
        floors = sorted({round(r[side]["floor"], 6) for r in reports if r[side].get("floor") is not None})
        lo, hi = ax.dataLim.y0, ax.dataLim.y1
        for f in floors:
            if f >= lo - FLOOR_REACH * max(hi - lo, 1e-9):
                ax.axhline(f, color=FLOOR_COLOR, ls="--", lw=1.2)
                floor_text.append(f"{side} {f:.3f}")
            else:  # drawn, it would squash the curves into a sliver at the top
                floor_text.append(f"{side} {f:.3f}, below the axis")
        data = sorted({data_name(r[side]["data"]) for r in reports})
        ax.set_title(f"{side} data ({', '.join(data)}): " + ("forgetting = after - before" if side == "source"
                                                              else "plasticity = before - after"), fontsize=9)
        ax.set_xlabel("fine-tuning step")
        ax.set_ylabel(f"validation loss on the {side} data (nats/token)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if floor_text:
        handles.append(Line2D([], [], color=FLOOR_COLOR, ls="--", lw=1.2))
        labels.append(f"entropy floor ({', '.join(floor_text)})")
    legend_below(fig, handles, labels, most=3)
    rec = reports[0]["recipe"]
    fig.suptitle(f"fine-tune: AdamW lr {rec['lr']:g}, {rec['steps']} steps ({rec['warmup_steps']} warmup, "
                 f"{rec['schedule']}), {rec['tokens_per_step']:,} tokens/step", fontsize=9)
    return save(fig, plots_dir, name)


# --------------------------------------------------------------------------------------------------------------
# eigenvalues per layer

LAYER_SUBSET = re.compile(r"^layer:(\d+)$")


def layer_of(report: dict) -> int | None:
    """The layer a sharpness report measured (``--params layer:N``), else None."""
    m = LAYER_SUBSET.match(str((report.get("options") or {}).get("params", "")))
    return int(m.group(1)) if m else None


def plot_layer_eigenvalues(entries: list[dict], plots_dir: str | Path, name: str = "sharpness_layers") -> list[Path]:
    """``entries``: [{"label", "arch", "seed", "reports": [sharpness reports of layer subsets]}]. Panels:
    lambda_max and lambda_min of each layer's block of the Hessian (error bars: Lanczos error estimates; hollow
    markers: not converged), and tr(H)/n of the block when a trace was measured (error bars: s.e.)."""
    entries = [e for e in entries if any(layer_of(r) is not None and r.get("eigen") for r in e["reports"])]
    if not entries:
        return []
    has_trace = any(r.get("traces") for e in entries for r in e["reports"])
    ncols = 3 if has_trace else 2
    fig, axes = new_figure(4.0 * ncols, 3.8 + 0.25 * ((len(entries) + 3) // 4), ncols=ncols)
    seeds = sorted({e["seed"] for e in entries}, key=lambda s: (s is None, s))
    tokens = sorted({r.get("tokens") for e in entries for r in e["reports"] if r.get("tokens")})
    any_bad = False
    for e in entries:
        reps = sorted((r for r in e["reports"] if layer_of(r) is not None and r.get("eigen")), key=layer_of)
        color, ls = arch_color(e["arch"]), SEED_STYLES[seeds.index(e["seed"]) % len(SEED_STYLES)]
        layers = [layer_of(r) for r in reps]
        for ax, end, err, ok in ((axes[0, 0], "top", "top_error", "top_converged"),
                                 (axes[0, 1], "bottom", "bottom_error", "bottom_converged")):
            pts = [(layer, r["eigen"][end][0], r["eigen"][err][0], r["eigen"][ok][0])
                   for layer, r in zip(layers, reps, strict=True) if r["eigen"].get(end)]
            if not pts:
                continue
            x, y, yerr, conv = (list(v) for v in zip(*pts, strict=True))
            ax.errorbar(x, y, yerr=yerr, color=color, ls=ls, marker="o", capsize=2, label=e["label"])
            for xi, yi, r in zip(x, y, [r for r in reps if r["eigen"].get(end)], strict=True):
                if len(tokens) > 1:  # mixed N: each point marked with its own
                    ax.annotate(f"N={r.get('tokens'):,}", (xi, yi), textcoords="offset points", xytext=(4, 4),
                                fontsize=6, color=color)
            bad = [(xi, yi) for xi, yi, c in zip(x, y, conv, strict=True) if not c]
            if bad:
                mark_not_converged(ax, *zip(*bad, strict=True), color)
                any_bad = True
        if has_trace:
            pts = [(layer, r["traces"][0]["per_param"], r["traces"][0].get("per_param_se") or 0.0)
                   for layer, r in zip(layers, reps, strict=True) if r.get("traces")]
            if pts:
                x, y, yerr = (list(v) for v in zip(*pts, strict=True))
                axes[0, 2].errorbar(x, y, yerr=yerr, color=color, ls=ls, marker="s", capsize=2, label=e["label"])
    ops = {(r.get("options") or {}).get("operator") or r.get("operator") or DEFAULT_OPERATOR
           for e in entries for r in e["reports"]}
    A = symbol(ops.pop()) if len(ops) == 1 else "A"  # the operator the reports measured (mixed: A, named below)
    titles = [f"largest eigenvalue λ_max({A}) of the layer's block",
              f"smallest eigenvalue λ_min({A}) of the layer's block", f"tr({A})/n of the layer's block"]
    all_layers = [layer_of(r) for e in entries for r in e["reports"] if layer_of(r) is not None]
    for ax, title in zip(axes[0], titles, strict=False):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        layer_axis(ax, all_layers)
        plain_numbers(ax)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel(f"Hessian eigenvalue ({CURVATURE})", fontsize=8)
    axes[0, 1].set_ylabel(f"Hessian eigenvalue ({CURVATURE})", fontsize=8)
    if has_trace:
        axes[0, 2].set_ylabel(f"mean Hessian eigenvalue ({CURVATURE})", fontsize=8)
    axes[0, 1].axhline(0.0, color="0.6", lw=0.8)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    if any_bad:
        handles.append(not_converged_handle())
        labels.append("Lanczos not converged")
    legend_below(fig, handles, labels, most=4)
    n_text = (f"N = {tokens[0]:,} tokens" if len(tokens) == 1 else
              f"mixed N = {', '.join(f'{t:,}' for t in tokens)} tokens (marked): not comparable")
    fig.suptitle("Hessian of the loss restricted to each layer's parameters (Lanczos); "
                 + n_text, fontsize=9, color="#B00000" if len(tokens) > 1 else "black")
    return save(fig, plots_dir, name)


# --------------------------------------------------------------------------------------------------------------
# comparison: a point per group with its interval


FILLS = ["full", "none", "left", "bottom"]  # the 1st, 2nd, ... group of one architecture (same colour)
N_MARKERS = "os^Dv<>"  # the runs' own points: one marker per evaluation token count N of the curvature


def interval_figure(groups: list[dict], measures: list[dict], title: str = ""):
    """``groups``: [{"label", "arch"}] (one colour each); ``measures``: [{"name", "unit", "values":
    [{"mean", "std", "n", "points": [...], "tokens": [...]}] aligned with groups}]. One panel per measure: the mean
    as a large marker with ± one standard deviation over seeds, the individual runs as small dots beside it, n
    under each group. The y axis spans the data (not zero), so that small differences are visible. Where a
    measure's runs were evaluated on different token counts N (curvature depends on N), their dots get one marker
    per N and the panel says so."""
    n = len(measures)
    ncols = min(3, n)
    nrows = (n + ncols - 1) // ncols
    fig, axes = new_figure(3.9 * ncols, 3.6 * nrows, ncols=ncols, nrows=nrows)
    flat = axes.reshape(-1)
    x = np.arange(len(groups))
    fills = [FILLS[k % len(FILLS)] for k in variant_index([g["arch"] for g in groups])]
    crowded = len(groups) > 4 or max(len(g["label"]) for g in groups) > 12  # slanted tick labels
    mixed_any = []
    for ax, m in zip(flat, measures, strict=False):
        ns = sorted({t for v in m["values"] if v for t in v.get("tokens") or [] if t is not None})
        mixed = len(ns) > 1
        for i, (g, v) in enumerate(zip(groups, m["values"], strict=True)):
            if v is None or v.get("mean") is None:
                ax.annotate("n/a", (i, 0.5), xycoords=("data", "axes fraction"), ha="center", fontsize=7,
                            color="0.4")
                continue
            color = arch_color(g["arch"])
            pts = v.get("points") or []
            toks = v.get("tokens") or [None] * len(pts)
            jitter = np.linspace(-0.06, 0.06, len(pts)) if len(pts) > 1 else np.zeros(len(pts))
            for dx, y, t in zip(jitter, pts, toks, strict=True):
                mk = N_MARKERS[ns.index(t) % len(N_MARKERS)] if mixed and t in ns else "."
                ax.plot(i + 0.2 + dx, y, ls="none", marker=mk, color="0.25", ms=4 if mk == "." else 3.5)
            ax.errorbar(i, v["mean"], yerr=v.get("std"), color=color, marker="o", ms=8, capsize=4, lw=1.6,
                        mec=color, mfc=color if fills[i] == "full" else "white", fillstyle=fills[i])
        ticks = [f"{g['label']} (n={v['n'] if v else 0})" if crowded else f"{g['label']}\n(n={v['n'] if v else 0})"
                 for g, v in zip(groups, m["values"], strict=True)]
        if crowded:
            ax.set_xticks(x, ticks, fontsize=7, rotation=35, ha="right", rotation_mode="anchor")
        else:
            ax.set_xticks(x, ticks, fontsize=8)
        ax.set_xlim(-0.5, len(groups) - 0.5)
        where = ""
        if ns:
            where = (f"\nmixed N = {', '.join(f'{t:,}' for t in ns)} tokens: not comparable" if mixed
                     else f"\nN = {ns[0]:,} tokens")
        if mixed:
            mixed_any.append(ns)
        ax.set_title(m["name"] + where, fontsize=9, color="#B00000" if mixed else "black")
        ax.set_ylabel(m.get("unit", ""), fontsize=8)
        lo, hi = ax.get_ylim()
        if lo < 0 < hi:
            ax.axhline(0.0, color="0.6", lw=0.6)
        ax.grid(alpha=0.3, axis="y")
    for ax in flat[n:]:
        ax.axis("off")
    if mixed_any:
        ns = sorted({t for group in mixed_any for t in group})
        legend_below(fig, [Line2D([], [], ls="none", marker=N_MARKERS[k % len(N_MARKERS)], color="0.25")
                           for k in range(len(ns))], [f"run measured on N = {t:,} tokens" for t in ns])
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


BARS = ("gap", "lambda_max", "trace_per_param", "forgetting", "plasticity", "value_entropy", "separability")
TITLES = {"gap": "final validation loss - entropy floor", "val_loss": "final validation loss",
          "lambda_max": "largest eigenvalue λ_max(H)", "trace_per_param": "trace per parameter tr(H)/n",
          "forgetting": "forgetting (source loss after - before)",
          "plasticity": "plasticity (target loss before - after)",
          "value_entropy": "value entropy, last layer", "separability": "value separability, last layer"}
UNITS = {"gap": "nats/token", "val_loss": "nats/token", "lambda_max": CURVATURE, "trace_per_param": CURVATURE,
         "forgetting": "nats/token", "plasticity": "nats/token", "value_entropy": "Rényi entropy (nats)",
         "separability": "probe accuracy (CV)"}
TOKENS_OF = {"lambda_max": "sharpness_tokens", "trace_per_param": "sharpness_tokens"}  # measures that depend on N


def _run_value(run: dict, metric: str) -> float | None:
    if metric == "gap":
        return None if run.get("val_loss") is None or run.get("val_floor") is None \
            else run["val_loss"] - run["val_floor"]
    return run.get(metric)


def operator_title(metric: str, operator: str | None) -> str:
    """TITLES[metric], its curvature named by the operator the comparison measured (tr(G)/n for a GGN)."""
    op = operator or DEFAULT_OPERATOR
    if metric == "lambda_max":
        return f"largest eigenvalue λ_max({symbol(op)})"
    if metric == "trace_per_param":
        return f"trace per parameter tr({symbol(op)})/n"
    return TITLES.get(metric, metric)


def compare_measures(report: dict) -> tuple[list[dict], list[dict]]:
    """Groups and measures of a compare.json: per architecture, mean and standard deviation over seeds (ddof 1, as
    in the tables) of each metric over its runs, the runs' own values and, for the curvatures, the token count N
    each was measured on."""
    groups = [{"label": a["label"], "arch": a["arch"]} for a in report["archs"]]
    has_floor = all(r.get("val_floor") is not None for r in report["runs"])
    measures = []
    for m in (BARS if has_floor else ("val_loss", *BARS[1:])):
        values = []
        for a in report["archs"]:
            runs = [r for r in report["runs"] if r["label"] == a["label"] and _run_value(r, m) is not None]
            pts = [_run_value(r, m) for r in runs]
            if not pts:
                values.append(None)
                continue
            std = float(np.std(pts, ddof=1)) if len(pts) > 1 else None
            values.append({"mean": float(np.mean(pts)), "std": std, "n": len(pts), "points": pts,
                           "tokens": [r.get(TOKENS_OF[m]) for r in runs] if m in TOKENS_OF else None})
        if any(v is not None for v in values):
            measures.append({"key": m, "name": operator_title(m, report.get("curvature_operator")), "unit": UNITS[m],
                             "values": values})
    return groups, measures


def plot_correlations(report: dict, plots_dir: str | Path, name: str = "compare_correlations") -> list[Path]:
    """One scatter per correlation of compare.json (e.g. forgetting against tr(H)/n), a point per run, with
    Spearman's rho and its p-value in the title."""
    pairs = [c for c in report.get("correlations", [])
             if sum(1 for r in report["runs"] if r.get(c["x"]) is not None and r.get(c["y"]) is not None) >= 2]
    if not pairs:
        return []
    fig, axes = new_figure(4.6 * len(pairs), 4.4, ncols=len(pairs))
    seeds = sorted({r["seed"] for r in report["runs"]})
    markers = "osD^v<>"
    groups = list(dict.fromkeys((r["label"], r["arch"]) for r in report["runs"]))
    variant = dict(zip([g[0] for g in groups], variant_index([g[1] for g in groups]), strict=True))
    for ax, c in zip(axes[0], pairs, strict=True):
        shown = set()
        for r in report["runs"]:
            if r.get(c["x"]) is None or r.get(c["y"]) is None:
                continue
            first = r["label"] not in shown
            shown.add(r["label"])
            color = arch_color(r["arch"])  # a second group of the same architecture: hollow markers, ...
            fill = FILLS[variant[r["label"]] % len(FILLS)]
            ax.plot(r[c["x"]], r[c["y"]], ls="none", marker=markers[seeds.index(r["seed"]) % len(markers)], ms=7,
                    color=color, mec="k" if fill == "full" else color, mew=0.5 if fill == "full" else 1.5,
                    fillstyle=fill, label=r["label"] if first else None)
        rho = "n/a" if c["rho"] is None else f"{c['rho']:+.2f}"
        p = "" if c["p"] is None else f", p = {c['p']:.2g} ({c['p_method']})"
        note = f"\n{c['note']}" if c.get("note") else ""
        ns = sorted({r.get(TOKENS_OF[k]) for k in (c["x"], c["y"]) if k in TOKENS_OF for r in report["runs"]
                     if r.get(c["x"]) is not None and r.get(c["y"]) is not None and r.get(TOKENS_OF[k])})
        if len(ns) > 1:
            note += f"\nmixed N = {', '.join(f'{t:,}' for t in ns)} tokens: curvatures not comparable"
        ax.set_title(f"Spearman ρ = {rho}{p}, n = {c['n']}{note}", fontsize=8,
                     color="#B00000" if len(ns) > 1 else "black")
        op = report.get("curvature_operator")
        ax.set_xlabel(f"{operator_title(c['x'], op)} ({UNITS.get(c['x'], '')})", fontsize=8)
        ax.set_ylabel(f"{operator_title(c['y'], op)} ({UNITS.get(c['y'], '')})", fontsize=8)
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for s_, m in zip(seeds, markers, strict=False):  # marker = seed
        handles.append(Line2D([], [], ls="none", marker=m, color="0.5", mec="k", mew=0.5))
        labels.append(f"seed {s_}")
    legend_below(fig, handles, labels)
    return save(fig, plots_dir, name)


LAYER_TITLES = {"value_entropy": ("value entropy per layer", "Rényi entropy (nats)"),
                "separability": ("value separability per layer", "probe accuracy (CV)")}


def layer_measures(report: dict) -> dict[str, list[dict]]:
    """Per collapse measure, per architecture: the layers, the mean and standard deviation (ddof 1) over runs at each
    layer
    (from the runs' ``layers`` of a compare.json)."""
    out: dict[str, list[dict]] = {}
    for m in LAYER_TITLES:
        rows = []
        for a in report["archs"]:
            by_layer: dict[int, list[float]] = {}
            for r in report["runs"]:
                if r["label"] != a["label"]:
                    continue
                for e in r.get("layers") or []:
                    if e.get(m) is not None:
                        by_layer.setdefault(e["layer"], []).append(e[m])
            if by_layer:
                layers = sorted(by_layer)
                pts = [by_layer[k] for k in layers]
                rows.append({"label": a["label"], "arch": a["arch"], "layers": layers,
                             "mean": [float(np.mean(p)) for p in pts],
                             "std": [float(np.std(p, ddof=1)) if len(p) > 1 else 0.0 for p in pts],
                             "n": [len(p) for p in pts]})
        if rows:
            out[m] = rows
    return out


def plot_compare_layers(report: dict, plots_dir: str | Path, name: str = "compare_layers") -> list[Path]:
    """Value entropy and separability against depth: one line per architecture, mean over seeds with error bars of
    ± one standard deviation over seeds (the collapse reports' per-layer numbers, as in compare.md's per-layer
    table)."""
    measures = layer_measures(report)
    if not measures:
        return []
    fig, axes = new_figure(5.0 * len(measures), 4.2, ncols=len(measures))
    for ax, (m, rows) in zip(axes[0], measures.items(), strict=True):
        styles = variant_index([row["arch"] for row in rows])  # groups of one architecture: line styles
        for k, row in enumerate(rows):
            shift = (k - (len(rows) - 1) / 2) * 0.04  # small offsets so that error bars do not hide each other
            ax.errorbar(np.array(row["layers"]) + shift, row["mean"], yerr=row["std"], color=arch_color(row["arch"]),
                        ls=SEED_STYLES[styles[k] % len(SEED_STYLES)], marker="o", ms=4, capsize=3,
                        label=f"{row['label']} (n={max(row['n'])})")
        title, unit = LAYER_TITLES[m]
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel(unit)
        layer_axis(ax, [k for row in rows for k in row["layers"]])
        ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    legend_below(fig, handles, labels)
    fig.suptitle(f"{SPREAD}: error bars = ± one std", fontsize=9)
    return save(fig, plots_dir, name)


FRONTIER_POINTS = 25  # plasticity levels at which each architecture's mean frontier is drawn


def frontier(report: dict) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray, int]]] | None:
    """The forgetting-plasticity frontier per group from the runs' fine-tune curves (compare.json's
    ``forgetting_curve``): on a grid of plasticity levels from 0 to the lowest peak plasticity of the runs (where
    every curve is defined), each run's forgetting at the first point it reaches that level (linear between curve
    points, cemtool.analysis.stats.at_matched), then the group's mean and standard deviation over its runs."""
    from cemtool.analysis.stats import at_matched  # start-up: the comparison's own module, loaded with it

    runs = [r for r in report["runs"] if r.get("forgetting_curve")]
    if not runs:
        return None
    top = min(max(p for p, _ in r["forgetting_curve"]) for r in runs)
    if not top > 0:
        return None
    levels = np.linspace(0.0, top, FRONTIER_POINTS)  # (P,)
    out = {}
    for label in dict.fromkeys(r["label"] for r in runs):
        rows = np.array([[at_matched(r["forgetting_curve"], x) for x in levels] for r in runs
                         if r["label"] == label], dtype=float)  # (runs, P)
        out[label] = (rows.mean(0), rows.std(0, ddof=1) if len(rows) > 1 else np.zeros(len(levels)), len(rows))
    return levels, out


def plot_frontier(report: dict, plots_dir: str | Path, name: str = "compare_frontier") -> list[Path]:
    """Forgetting against plasticity along the fine-tunes, per architecture (mean ± std over seeds): an architecture
    below another at the same plasticity forgets less for what it learns. The dashed line is the matched level of
    compare.json (``matched_plasticity``)."""
    got = frontier(report)
    if got is None:
        return []
    levels, groups = got
    arch_of = {r["label"]: r["arch"] for r in report["runs"]}
    fig, axes = new_figure(6.0, 4.4)
    ax = axes[0, 0]
    for label, (mean, sd, n) in groups.items():
        c = arch_color(arch_of[label])
        ax.plot(levels, mean, color=c, lw=1.6, label=f"{label} (n={n})")
        ax.fill_between(levels, mean - sd, mean + sd, color=c, alpha=0.15, lw=0)
    level = (report.get("matched_plasticity") or {}).get("level")
    if level is not None:
        ax.axvline(level, color="0.4", ls="--", lw=0.8)
    ax.set_xlabel("plasticity: target loss gained (nats)", fontsize=8)
    ax.set_ylabel("forgetting: source loss lost (nats)", fontsize=8)
    ax.set_title(f"forgetting-plasticity frontier along the fine-tunes ({SPREAD}); dashed: the matched level",
                 fontsize=8)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, handles, labels)
    return save(fig, plots_dir, name)


def plot_compare(report: dict, plots_dir: str | Path, name: str = "compare") -> list[Path]:
    """The comparison (one panel per metric, a mean ± std over seeds per architecture), the correlation
    scatters and the per-layer collapse measures."""
    groups, measures = compare_measures(report)
    if not measures:
        return []
    fig = interval_figure(groups, measures, f"{len(report['runs'])} runs: large markers and error bars = {SPREAD}, "
                                            f"dots = single runs")
    return (save(fig, plots_dir, name) + plot_correlations(report, plots_dir, f"{name}_correlations")
            + plot_compare_layers(report, plots_dir, f"{name}_layers")
            + plot_frontier(report, plots_dir, f"{name}_frontier"))


__all__ = ["BARS", "frontier", "interval_figure", "compare_measures", "layer_measures", "layer_of", "plot_compare",
           "plot_compare_layers", "plot_correlations", "plot_frontier",
           "plot_forgetting", "plot_layer_eigenvalues"]
