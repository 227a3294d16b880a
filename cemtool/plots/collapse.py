"""Figures of ``cemtool collapse-report`` from its saved report (reports/collapse*.json); never recomputes.

A report holds one entry per run (``runs``: label, arch, collapse, routing, stream_scalars); every figure puts
the runs on the same axes, one colour per architecture (:func:`cemtool.plots.style.arch_color`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from cemtool.plots.style import arch_color, new_figure, save
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


PANELS = [
    ("matrix entropy (Rényi, nats)", lambda e: _stat(e, "values", "entropy"), lambda e: _stat(e, "hidden", "entropy"),
     "values", "hidden (dashed)"),
    ("probe accuracy", lambda e: _probe(e, "values"), lambda e: _probe(e, "hidden"), "values", "hidden (dashed)"),
    ("effective rank (all tokens)", lambda e: _stat(e, "hidden", "erank_all"),
     lambda e: _stat(e, "values", "erank_all"), "hidden", "values (dashed)"),
    ("mean pairwise cosine", lambda e: _stat(e, "hidden", "cosine"), lambda e: _stat(e, "values", "cosine"),
     "hidden", "values (dashed)"),
    ("attention entropy / log(context)", _attn_norm, None, "mean over heads", ""),
]


def plot_layers(report: dict, plots_dir: str | Path, name: str = "collapse") -> list[Path]:
    """Every headline measure against depth, one line per run."""
    runs = report["runs"]
    fig, axes = new_figure(13.5, 7.0, ncols=3, nrows=2)
    flat = axes.reshape(-1)
    for ax, (title, solid, dashed, lab_s, lab_d) in zip(flat, PANELS, strict=False):
        for k, run in enumerate(runs):
            st = _style(runs, k)
            x, y, e = _series(run, solid)
            if x:
                ax.errorbar(x, y, yerr=e, color=st["color"], marker=st["marker"], label=st["label"], capsize=2)
            if dashed is not None:
                x, y, e = _series(run, dashed)
                if x:
                    ax.errorbar(x, y, yerr=e, color=st["color"], marker=st["marker"], ls="--", alpha=0.7,
                                capsize=2)
        if title == "probe accuracy":
            chance = [e["probe"]["values"]["chance"] for run in runs for e in run["collapse"]["layers"]
                      if isinstance(e["probe"].get("values"), dict)]
            if chance:
                ax.axhline(chance[0], color="grey", lw=1, ls=":", label="chance")
        ax.set_title(f"{title}\n{lab_s}" + (f"; {lab_d}" if lab_d else ""), fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    flat[0].legend(fontsize=7)
    ax = flat[-1]
    ax.axis("off")
    c = runs[0]["collapse"]
    classes = c.get("probe_classes") or {}
    ax.text(0.0, 1.0, f"{c['tokens']:,} evaluation tokens ({c['sequences']} sequences of {c['seq_len']})\n"
                      f"Rényi alpha = {c['alpha']}\nprobe classes: {', '.join(map(str, classes.get('names', [])))}\n"
                      f"{classes.get('per_class', 0)} per class, {classes.get('folds', '')}-fold CV\n"
                      f"error bars: entropy s.e. over sequences; probe std over folds",
            va="top", fontsize=8, transform=ax.transAxes)
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
    axes[0, 0].legend(fontsize=7)
    return save(fig, plots_dir, f"{name}_attention")


def plot_routing(run: dict, plots_dir: str | Path, name: str) -> list[Path]:
    """A LIMe run's routers: one heatmap per layer, the share per source layer and the expected layer."""
    routing = run["routing"]
    layers = routing["layers"]
    n = len(layers)
    fig, axes = new_figure(3.0 * n + 6.0, 3.6, ncols=n + 2)
    for ax, e in zip(axes[0][:n], layers, strict=True):
        W = np.array(e["heatmap"], dtype=float)
        lim = np.abs(W).max() or 1.0
        im = ax.imshow(W, cmap="RdBu_r" if routing["signed"] else "viridis", vmin=-lim if routing["signed"] else 0,
                       vmax=lim, aspect="auto")
        for a, _b in e["source_blocks"][1:]:
            ax.axvline(a - 0.5, color="k", lw=0.6)
        if routing["signed"]:
            ax.set_xticks(range(W.shape[1]), [f"L{m}h{j - a}" for m, (a, b) in enumerate(e["source_blocks"])
                                              for j in range(a, b)], rotation=90, fontsize=7)
        else:
            ax.set_xticks(range(W.shape[1]), [f"L{m}" for m in range(W.shape[1])], fontsize=7)
        ax.set_yticks(range(W.shape[0]))
        ax.set_title(f"layer {e['layer']}", fontsize=9)
        ax.set_xlabel("source (layer, head)" if routing["signed"] else "source layer")
        ax.set_ylabel("consumer head")
        fig.colorbar(im, ax=ax, shrink=0.8)
    ax = axes[0][n]
    for e in layers:
        ax.plot(range(len(e["share"])), e["share"], marker="o", label=f"layer {e['layer']}")
    ax.set_xlabel("source layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("share of |weight|")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    ax = axes[0][n + 1]
    ax.plot([e["layer"] for e in layers], [e["expected_layer"] for e in layers], marker="o",
            color=arch_color(run["arch"]), label="expected retrieved layer")
    ax.plot([e["layer"] for e in layers], [float(np.mean(e["self_retrieval"])) for e in layers], marker="s",
            ls="--", color="grey", label="mean self-retrieval")
    ax.set_xlabel("layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"{run['label']}: LIMe {routing['variant']} router ({routing['source']})", fontsize=9)
    return save(fig, plots_dir, name)


def plot_streams(run: dict, plots_dir: str | Path, name: str) -> list[Path]:
    """A momentum run's learned scalars per layer, attention and MLP substeps."""
    rows = run["stream_scalars"]
    keys = sorted({k for r in rows for k in r if k not in ("layer", "substep")})
    fig, axes = new_figure(3.0 * max(1, len(keys)), 3.2, ncols=max(1, len(keys)))
    for ax, key in zip(axes[0], keys, strict=False):
        for sub, ls in (("attn", "-"), ("mlp", "--")):
            pts = [(r["layer"], r[key]) for r in rows if r["substep"] == sub and key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), ls=ls, marker="o", color=arch_color(run["arch"]), label=sub)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{run['label']}: optimizer-stream scalars", fontsize=9)
    return save(fig, plots_dir, name)


def plot_collapse(report: dict, plots_dir: str | Path, name: str = "collapse") -> list[Path]:
    """All figures of a collapse report (one run or a comparison)."""
    paths = plot_layers(report, plots_dir, name) + plot_attention(report, plots_dir, name)
    for run in report["runs"]:
        suffix = run["label"] if len(report["runs"]) > 1 else ""
        if isinstance(run.get("routing"), dict):
            paths += plot_routing(run, plots_dir, f"{name}_routing" + (f"_{suffix}" if suffix else ""))
        if isinstance(run.get("stream_scalars"), list):
            paths += plot_streams(run, plots_dir, f"{name}_streams" + (f"_{suffix}" if suffix else ""))
    return paths


__all__ = ["plot_attention", "plot_collapse", "plot_layers", "plot_routing", "plot_streams"]
