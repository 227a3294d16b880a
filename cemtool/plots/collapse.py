"""Figures of ``cemtool collapse-report`` from its saved report (reports/collapse*.json); never recomputes.

A report holds one entry per run (``runs``: label, arch, collapse, routing, stream_scalars); every figure puts
the runs on the same axes, one colour per architecture (:func:`cemtool.plots.style.arch_color`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from cemtool.plots.style import PALETTE, arch_color, layer_axis, legend_below, new_figure, note_panel, save
from cemtool.plots.training import SEED_STYLES

_MARKERS = "osD^v<>ph*"


def _style(runs: list[dict], k: int) -> dict:
    """Colour by architecture; runs of the same architecture get different markers and line dashes."""
    arch = runs[k]["arch"]
    same = [j for j in range(len(runs)) if runs[j]["arch"] == arch].index(k)
    return {"color": arch_color(arch), "marker": _MARKERS[same % len(_MARKERS)],
            "dash": SEED_STYLES[same % len(SEED_STYLES)], "label": runs[k]["label"]}


def _series(run: dict, get) -> tuple[list[int], list[float], list[float]]:
    xs, ys, es = [], [], []
    for e in run["collapse"]["layers"]:
        v = get(e)
        if v is None:
            continue
        y, err = v if isinstance(v, tuple) else (v, None)
        if y is None:
            continue
        xs.append(e["layer"])
        ys.append(y)
        es.append(err if err is not None else 0.0)
    return xs, ys, es


def _stat(e: dict, kind: str, measure: str):
    d = e.get(kind)
    if not isinstance(d, dict):
        return None
    s = d[measure]
    return (s["mean"], s["se"]) if isinstance(s, dict) else s


def _probe(e: dict, kind: str):
    p = e["probe"].get(kind)
    return (p["accuracy"], p["std"]) if isinstance(p, dict) else None


def _attn_norm(e: dict):
    a = e["attention"]
    if not isinstance(a, dict):
        return None
    vals = [h["entropy_norm"] for h in a["per_head"] if h["entropy_norm"] is not None]
    return float(np.mean(vals)) if vals else None


# (title, y label, solid: values, dashed: hidden states); the same line style means the same thing in every panel
PANELS = [
    ("matrix entropy (Rényi)", "entropy (nats)", lambda e: _stat(e, "values", "entropy"),
     lambda e: _stat(e, "hidden", "entropy")),
    ("linear-probe accuracy (separability)", "accuracy (cross-validated)", lambda e: _probe(e, "values"),
     lambda e: _probe(e, "hidden")),
    ("effective rank (all tokens)", "effective rank", lambda e: _stat(e, "values", "erank_all"),
     lambda e: _stat(e, "hidden", "erank_all")),
    ("mean pairwise cosine", "cosine similarity", lambda e: _stat(e, "values", "cosine"),
     lambda e: _stat(e, "hidden", "cosine")),
    ("attention entropy / log(context), mean over heads", "normalised entropy", _attn_norm, None),
]


def plot_layers(report: dict, plots_dir: str | Path, name: str = "collapse") -> list[Path]:
    """Every headline measure against depth, one colour (and marker) per run; solid lines: the attention values,
    dashed: the hidden states (residual stream), in every panel."""
    runs = report["runs"]
    fig, axes = new_figure(13.5, 7.6, ncols=3, nrows=2)
    flat = axes.reshape(-1)
    layers = [e["layer"] for run in runs for e in run["collapse"]["layers"]]
    for ax, (title, ylabel, solid, dashed) in zip(flat, PANELS, strict=False):
        for k, run in enumerate(runs):
            st = _style(runs, k)
            x, y, e = _series(run, solid)
            if x:
                ax.errorbar(x, y, yerr=e, color=st["color"], marker=st["marker"], label=st["label"], capsize=2)
            if dashed is not None:
                x, y, e = _series(run, dashed)
                if x:
                    ax.errorbar(x, y, yerr=e, color=st["color"], marker=st["marker"], ls="--", alpha=0.7,
                                capsize=2, mfc="white")
        if title.startswith("linear-probe"):
            chance = [e["probe"]["values"]["chance"] for run in runs for e in run["collapse"]["layers"]
                      if isinstance(e["probe"].get("values"), dict)]
            if chance:
                ax.axhline(chance[0], color="grey", lw=1, ls=":")
            lo = min([*chance, *[v for line in ax.get_lines() for v in line.get_ydata()]], default=0.0)
            ax.set_ylim(max(0.0, lo - 0.05), 1.0 + 0.02)  # an accuracy: never above 1 (the std bars are clipped)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("layer")
        ax.set_ylabel(ylabel)
        layer_axis(ax, layers)
        ax.grid(alpha=0.3)
    seen = {}
    for ax in flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(lab, h)
    handles, labels = list(seen.values()), list(seen)
    handles += [Line2D([], [], color="0.3", marker="o"), Line2D([], [], color="0.3", marker="o", ls="--",
                                                                mfc="white", alpha=0.7),
                Line2D([], [], color="grey", lw=1, ls=":")]
    labels += ["solid: attention values", "dashed: hidden states", "dotted: chance (probe)"]
    legend_below(fig, handles, labels, most=5)
    ax = flat[-1]
    ax.axis("off")
    c = runs[0]["collapse"]
    classes = c.get("probe_classes") or {}
    note_panel(ax, f"{c['tokens']:,} evaluation tokens ({c['sequences']} sequences of {c['seq_len']})\n"
                   f"Rényi alpha = {c['alpha']}\nprobe classes: {', '.join(map(str, classes.get('names', [])))}\n"
                   f"{classes.get('per_class', 0)} per class, {classes.get('folds', '')}-fold CV\n"
                   f"error bars: entropy s.e. over sequences; probe std over folds")
    return save(fig, plots_dir, f"{name}_layers")


def plot_attention(report: dict, plots_dir: str | Path, name: str = "collapse") -> list[Path]:
    """Normalised attention entropy and max probability against context length, per layer (mean over heads)."""
    runs = report["runs"]
    n_layer = max(len(r["collapse"]["layers"]) for r in runs)
    fig, axes = new_figure(3.2 * n_layer, 5.6, ncols=n_layer, nrows=2)
    for k, run in enumerate(runs):
        st = _style(runs, k)
        for i, e in enumerate(run["collapse"]["layers"]):
            a = e["attention"]
            if not isinstance(a, dict):
                axes[0, i].set_title(f"layer {e['layer']}: no pattern", fontsize=8)
                continue
            ctx = np.array(a["context_length"])
            for row, field in ((0, "entropy_norm"), (1, "max_prob")):
                c = np.array([[np.nan if v is None else v for v in h] for h in a["curves"][field]], dtype=float)
                ok = np.isfinite(c).any(axis=0)  # (T,) entropy_norm is undefined at context 1
                axes[row, i].plot(ctx[ok], np.nanmean(c[:, ok], axis=0), color=st["color"], ls=st["dash"],
                                  label=st["label"], lw=1.2)
            axes[0, i].set_title(f"layer {e['layer']}", fontsize=9)
    for i in range(n_layer):
        axes[0, i].set_ylabel("entropy / log(context)")
        axes[1, i].set_ylabel("max probability")
        axes[1, i].set_xlabel("context length t + 1")
        for row in (0, 1):
            axes[row, i].set_xscale("log", base=2)
            axes[row, i].set_xlim(left=1)  # both rows on the same axis (entropy / log(context) starts at 2)
            axes[row, i].grid(alpha=0.3)
            axes[row, i].xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 64, not 2^6
    handles, labels = axes[0, 0].get_legend_handles_labels()
    legend_below(fig, handles, labels)
    return save(fig, plots_dir, f"{name}_attention")


def _source_ticks(ax, blocks: list[list[int]], signed: bool) -> None:
    """Columns of a router heatmap: one per source layer, or (signed) one per head of each source layer. Labelled
    once per source layer at the middle of its block; the heads are minor ticks; blocks separated by lines."""
    mids = [(a + b - 1) / 2 for a, b in blocks] if signed else list(range(len(blocks)))
    ax.set_xticks(mids, [str(m) for m in range(len(blocks))], fontsize=8)
    if signed:
        ax.set_xticks(range(blocks[-1][1]), minor=True)
        for a, _b in blocks[1:]:
            ax.axvline(a - 0.5, color="k", lw=0.8)
    ax.set_xlabel("source layer" + (" (a column per head)" if signed else ""), fontsize=8)


def plot_routing(run: dict, plots_dir: str | Path, name: str) -> list[Path]:
    """A LIMe run's routers: one heatmap per layer on one shared colour scale (top); below, the share of |weight|
    per source layer, the expected retrieved layer (a layer index) and the mean self-retrieval (a weight), each on
    its own axes."""
    routing = run["routing"]
    layers = routing["layers"]
    n = len(layers)
    fig = plt.figure(figsize=(max(9.0, 2.8 * n + 1.0), 6.8), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1.0, 0.9])
    maps = top.subplots(1, n, squeeze=False)[0]
    heat = [np.array(e["heatmap"], dtype=float) for e in layers]
    signed = routing["signed"]
    lim = max(float(np.abs(W).max()) for W in heat) or 1.0  # one colour scale for every layer
    for ax, e, W in zip(maps, layers, heat, strict=True):
        im = ax.imshow(W, cmap="RdBu_r" if signed else "viridis", vmin=-lim if signed else 0.0, vmax=lim,
                       aspect="auto", interpolation="nearest")
        blocks = e["source_blocks"] if signed else [[m, m + 1] for m in range(W.shape[1])]
        _source_ticks(ax, blocks, signed)
        ax.set_yticks(range(W.shape[0]))
        ax.set_title(f"layer {e['layer']}", fontsize=9)
        ax.set_ylabel("consumer head", fontsize=8)
    top.colorbar(im, ax=list(maps), shrink=0.9, label="router weight" + (" (signed)" if signed else ""))
    share_ax, expect_ax, self_ax = bottom.subplots(1, 3, squeeze=False)[0]
    consumers = [e["layer"] for e in layers]
    for k, e in enumerate(layers):
        share_ax.plot(range(len(e["share"])), e["share"], marker="o", color=PALETTE[k % len(PALETTE)],
                      label=f"layer {e['layer']}")
    share_ax.set_xlabel("source layer")
    share_ax.set_ylabel("share of |weight|")
    share_ax.set_title("where each layer reads from", fontsize=9)
    layer_axis(share_ax, [m for e in layers for m in range(len(e["share"]))])
    share_ax.legend(fontsize=7, title="consumer", title_fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    color = arch_color(run["arch"])
    expect_ax.plot(consumers, [e["expected_layer"] for e in layers], marker="o", color=color)
    expect_ax.plot(consumers, consumers, ls=":", color="grey", lw=1)  # reading only from itself
    expect_ax.set_ylabel("expected source layer")
    expect_ax.set_title("expected retrieved layer (dotted: itself)", fontsize=9)
    layer_axis(expect_ax, consumers, "y")
    self_ax.plot(consumers, [float(np.mean(e["self_retrieval"])) for e in layers], marker="s", color=color)
    self_ax.set_ylabel("weight on the own layer (mean over heads)")
    self_ax.set_title("self-retrieval", fontsize=9)
    for ax in (expect_ax, self_ax, share_ax):
        ax.grid(alpha=0.3)
    for ax in (expect_ax, self_ax):
        ax.set_xlabel("consumer layer")
        layer_axis(ax, consumers)
    fig.suptitle(f"{run['label']}: LIMe {routing['variant']} router ({routing['source']})", fontsize=9)
    return save(fig, plots_dir, name)


GREEK = {"alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "eta": "η", "lambda": "λ", "mu": "μ", "nu": "ν",
         "rho": "ρ", "sigma": "σ", "tau": "τ", "theta": "θ"}
SUBSTEPS = (("attn", "o", "attention substep"), ("mlp", "s", "MLP substep"))


def greek(name: str) -> str:
    """A scalar's name as a symbol ('beta' -> 'β', 'beta_1' -> 'β_1'); other names unchanged."""
    head, sep, tail = name.partition("_")
    return GREEK.get(head, head) + sep + tail


def plot_streams(runs: dict | list[dict], plots_dir: str | Path, name: str) -> list[Path]:
    """The learned scalars of momentum runs per layer, one panel per scalar: colour = architecture, line style =
    run (seed), marker = substep (filled circle: attention; open square: MLP). One figure for all the runs."""
    runs = [runs] if isinstance(runs, dict) else list(runs)
    keys = sorted({k for run in runs for r in run["stream_scalars"] for k in r if k not in ("layer", "substep")})
    fig, axes = new_figure(3.0 * max(1, len(keys)), 3.6 + 0.2 * len(runs), ncols=max(1, len(keys)))
    for i, run in enumerate(runs):
        rows, color, ls = run["stream_scalars"], arch_color(run["arch"]), SEED_STYLES[i % len(SEED_STYLES)]
        for ax, key in zip(axes[0], keys, strict=False):
            for sub, marker, _ in SUBSTEPS:
                pts = [(r["layer"], r[key]) for r in rows if r["substep"] == sub and key in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), ls=ls, marker=marker, color=color, ms=6,
                            mfc=color if sub == "attn" else "white", mew=1.5)
    for ax, key in zip(axes[0], keys, strict=False):
        ax.set_title(greek(key), fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("learned value (dimensionless)")
        layer_axis(ax, [r["layer"] for run in runs for r in run["stream_scalars"]])
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color="0.3", ls="none", marker=m, mfc="0.3" if sub == "attn" else "white", mew=1.5)
               for sub, m, _ in SUBSTEPS]
    labels = [lb for _, _, lb in SUBSTEPS]
    if len(runs) > 1:
        handles += [Line2D([], [], color=arch_color(run["arch"]), ls=SEED_STYLES[i % len(SEED_STYLES)])
                    for i, run in enumerate(runs)]
        labels += [run["label"] for run in runs]
    legend_below(fig, handles, labels)
    who = runs[0]["label"] if len(runs) == 1 else f"{len(runs)} runs"
    fig.suptitle(f"{who}: optimizer-stream scalars", fontsize=9)
    return save(fig, plots_dir, name)


def plot_collapse(report: dict, plots_dir: str | Path, name: str = "collapse") -> list[Path]:
    """All figures of a collapse report (one run or a comparison)."""
    paths = plot_layers(report, plots_dir, name) + plot_attention(report, plots_dir, name)
    for run in report["runs"]:
        suffix = run["label"] if len(report["runs"]) > 1 else ""
        if isinstance(run.get("routing"), dict):
            paths += plot_routing(run, plots_dir, f"{name}_routing" + (f"_{suffix}" if suffix else ""))
    streams = [run for run in report["runs"] if isinstance(run.get("stream_scalars"), list)]
    if streams:  # every momentum run in one figure
        paths += plot_streams(streams, plots_dir, f"{name}_streams")
    return paths


__all__ = ["plot_attention", "plot_collapse", "plot_layers", "plot_routing", "plot_streams"]
