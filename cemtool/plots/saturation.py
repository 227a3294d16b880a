"""Figures of ``cemtool saturation`` from its saved reports; never recomputes.

- sweep: final loss against head size d_h (log scale) at a fixed budget H d_h, one line per sequence length T,
  error bars = standard error over seeds, the task's floor dashed;
- trained model: loss increase against the rank r of the truncated score form, one panel per layer (thin lines:
  one head at a time; thick: every head of the layer at once); attention-logit spread against context length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.ticker import FuncFormatter

from cemtool.plots.style import PALETTE, legend_below, new_figure, save


def plot_sweep(report: dict, plots_dir: str | Path, name: str = "saturation_sweep") -> list[Path]:
    summary = report["summary"]
    fig, axes = new_figure(6.4, 4.4)
    ax = axes[0, 0]
    colors = [PALETTE[k % len(PALETTE)] for k in range(len(summary))]
    any_floor = False
    for c, s in zip(colors, summary, strict=True):
        pts = s["points"]
        x = [p["head_dim"] for p in pts]
        ax.errorbar(x, [p["loss"] for p in pts], yerr=[p["se"] or 0.0 for p in pts], marker="o", color=c,
                    capsize=3, label=f"T = {s['seq_len']}" + (f" (saturates at d_h = {s['saturation_head_dim']})"
                                                              if s["saturation_head_dim"] else ""))
        floors = [p["floor"] for p in pts if p["floor"] is not None]
        if floors:
            ax.axhline(float(np.mean(floors)), color=c, ls="--", lw=0.8)
            any_floor = True
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    heads = report.get("heads")
    ax.set_xlabel(f"head size d_h ({heads} heads)" if heads else "head size d_h (heads H = budget / d_h)")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(f"{report['task']}: " + (f"H = {heads} heads" if heads else f"budget H d_h = {report['budget']}")
                 + f", {report['steps']} steps, "
                 f"{len(report['seeds'])} seed(s)" + ("; dashed = floor" if any_floor else ""), fontsize=9)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, handles, labels, most=2)
    return save(fig, plots_dir, name)


def plot_truncation(report: dict, plots_dir: str | Path, name: str = "saturation") -> list[Path]:
    sat = report["saturation"]
    layers = sat["layers"]
    n = max(1, len(layers))
    fig, axes = new_figure(3.2 * n, 3.4, ncols=n)
    for ax, e in zip(axes[0], layers, strict=False):
        for h in e["per_head"]:
            ax.plot(e["ranks"], h["loss_increase"], lw=0.9, alpha=0.8, marker=".",
                    color=PALETTE[h["head"] % len(PALETTE)], label=f"head {h['head']}")
        ax.plot(e["ranks"], e["layer_loss_increase"], lw=2.2, color="k", marker="o", label="all heads")
        ax.axhline(sat["tolerance"], color="grey", ls=":", lw=1, label=f"tolerance {sat['tolerance']:g}")
        ax.set_xscale("symlog", base=2, linthresh=1)
        ax.set_xticks(e["ranks"], [str(r) for r in e["ranks"]])
        ax.minorticks_off()
        ax.set_title(f"layer {e['layer']} ({e['truncation']}, tolerates r = {e['tolerated_rank']})", fontsize=8)
        ax.set_xlabel("rank r of the score form")
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("loss increase (nats/token)")
    handles, labels = max((ax.get_legend_handles_labels() for ax in axes[0]), key=lambda hl: len(hl[1]))
    legend_below(fig, handles, labels, most=8)
    return save(fig, plots_dir, f"{name}_truncation")


def plot_logits(report: dict, plots_dir: str | Path, name: str = "saturation") -> list[Path]:
    logits = report["saturation"].get("logits") or {}
    if not logits:
        return []
    fig, axes = new_figure(6.4, 4.2)
    ax = axes[0, 0]
    colors = [PALETTE[k % len(PALETTE)] for k in range(len(logits))]
    for c, (layer, d) in zip(colors, sorted(logits.items(), key=lambda kv: int(kv[0])), strict=True):
        ax.plot(d["context_length"][1:], np.mean(np.array(d["logit_range"]), axis=0)[1:], color=c,
                label=f"layer {layer}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length t + 1")
    ax.set_ylabel("logit range max - min (mean over heads)")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    legend_below(fig, handles, labels)
    return save(fig, plots_dir, f"{name}_logits")


__all__ = ["plot_logits", "plot_sweep", "plot_truncation"]
