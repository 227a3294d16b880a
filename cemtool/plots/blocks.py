"""The per-block heat map of a ``cemtool sharpness --per-layer`` / ``--blocks`` report: block kind (rows) × layer
(columns), one panel for λ_max and one for the trace of the operator restricted to each block, every cell labelled
with its value (readable at 12 layers). Reads the report only; never recomputes anything."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import LogNorm, Normalize, SymLogNorm

from cemtool.analysis.curvature import DEFAULT_OPERATOR, symbol, title
from cemtool.plots.style import CURVATURE, new_figure, save

OUTSIDE = "outside"  # the column of blocks outside the layers (embeddings, final norm)


def block_grid(report: dict, key: str) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """(row labels: kinds, column labels: layers, values (rows, cols) with NaN where no block, converged (rows,
    cols) bool) of ``key`` (lambda_max or trace) over the report's blocks. A --per-layer report has one row, "all";
    blocks given as globs (no layer, no kind) are one row each in the outside column."""
    rows_in = report["layers"]
    kinds = list(dict.fromkeys((r.get("kind") or (r.get("block") if r.get("layer") is None else "all"))
                               for r in rows_in))
    layers = sorted({r["layer"] for r in rows_in if r.get("layer") is not None})
    cols = [str(l) for l in layers] + ([OUTSIDE] if any(r.get("layer") is None for r in rows_in) else [])
    values = np.full((len(kinds), len(cols)), np.nan)
    converged = np.ones((len(kinds), len(cols)), dtype=bool)
    for r in rows_in:
        kind = r.get("kind") or (r.get("block") if r.get("layer") is None else "all")
        i, j = kinds.index(kind), cols.index(OUTSIDE if r.get("layer") is None else str(r["layer"]))
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            values[i, j] = v
        if key == "lambda_max" and r.get("lambda_max_converged") is False:
            converged[i, j] = False
    return kinds, cols, values, converged


def cell_text(v: float) -> str:
    """A cell's value in at most 4 characters' width where it can: 3 significant digits below 1000, whole numbers
    to 9999, else 2-digit scientific."""
    a = abs(v)
    if a == 0 or 1e-3 <= a < 1e3:
        return f"{v:.3g}"
    return f"{v:.0f}" if a < 1e4 else f"{v:.1e}"


def _norm(values: np.ndarray):
    """Log colours when every value is positive and they span a decade or more, linear ones within a decade (a log
    colour bar over less than a decade has no major tick, only crowded minor labels), else symmetric-log (the
    Hessian's blocks can be negative)."""
    v = values[np.isfinite(values)]
    if v.size == 0:
        return None
    if (v > 0).all():
        lo, hi = float(v.min()), float(v.max())
        if hi < 10 * lo:
            return Normalize(vmin=lo, vmax=hi if hi > lo else lo * 2)
        return LogNorm(vmin=lo, vmax=hi)
    big = float(np.abs(v).max()) or 1.0
    return SymLogNorm(linthresh=max(big * 1e-3, 1e-300), vmin=-big, vmax=big)


def _panel(fig, ax, kinds, cols, values, converged, label: str) -> None:
    norm = _norm(values)
    cmap = colormaps["RdBu_r" if isinstance(norm, SymLogNorm) else "viridis"].with_extremes(bad="0.9")
    im = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i in range(len(kinds)):
        for j in range(len(cols)):
            v = values[i, j]
            if not np.isfinite(v):
                ax.text(j, i, "–", ha="center", va="center", fontsize=6.5, color="0.4")
                continue
            rgba = im.cmap(im.norm(v)) if norm is not None else (1, 1, 1, 1)
            light = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] > 0.55
            ax.text(j, i, cell_text(v) + ("" if converged[i, j] else "*"), ha="center", va="center",
                    fontsize=6.5, color="black" if light else "white")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(kinds)), kinds)
    ax.set_xlabel("layer")
    ax.set_ylabel("block")
    fig.colorbar(im, ax=ax, label=label, shrink=0.9)


def plot_blocks(report: dict, plots_dir: str | Path, name: str = "sharpness_blocks") -> list[Path]:
    """Two heat maps (λ_max, then the trace) of the report's blocks; an asterisk marks a λ_max whose Lanczos run
    did not converge. Nothing is drawn when the report has no block with either number."""
    if not report.get("layers"):
        return []
    operator = (report.get("options") or {}).get("operator", DEFAULT_OPERATOR)
    A = symbol(operator)
    panels = [(k, label) for k, label in (("lambda_max", "λ_max"), ("trace", f"tr({A})"))  # (colour bars: short)
              if np.isfinite(block_grid(report, k)[2]).any()]
    if not panels:
        return []
    kinds, cols, _, _ = block_grid(report, panels[0][0])
    width = max(6.0, min(12.0, 2.2 + 0.55 * len(cols)))  # (6 in: the panel titles on one line at 2 layers)
    fig, axes = new_figure(width, len(panels) * (1.6 + 0.32 * len(kinds)), nrows=len(panels))
    for ax, (key, label) in zip(axes[:, 0], panels, strict=True):
        _panel(fig, ax, *block_grid(report, key), label)
        ax.set_title(f"{'λ_max' if key == 'lambda_max' else 'trace'} of {title(operator)} restricted to each block"
                     + (" (* not converged)" if key == "lambda_max" and not block_grid(report, key)[3].all()
                        else ""), fontsize=9)
    fig.suptitle(f"{(report.get('provenance') or {}).get('arch') or '?'}, "
                 f"N = {report.get('tokens', 0):,} tokens, blocks: {report.get('blocks', 'layer')}; "
                 f"in {CURVATURE}", fontsize=9)
    return save(fig, plots_dir, name)


__all__ = ["OUTSIDE", "block_grid", "cell_text", "plot_blocks"]
