"""Curvature during training (``train.curvature_every``): λ_max of the loss Hessian over the optimizer steps against
the stability threshold 2/η of gradient descent at the scheduled rate η (beside λ_max(M^½ H M^½) where the measured
parameters' groups take other multiples M of η, the sharpness 2/η bounds then), and, when the run measured it, the
preconditioned λ_max of Adam's update against its threshold (2 + 2 β1)/((1 - β1) η) (Cohen et al. 2022); the trace
estimate (± 1 SE) when recorded. Reads the ``"kind": "curvature"`` rows of metrics.jsonl only; never recomputes.

A filled marker is a converged Lanczos value; a large open ring one that hit the step cap
(train.curvature_steps).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cemtool.fileio import read_jsonl
from cemtool.plots.style import (
    CURVATURE,
    arch_color,
    legend_below,
    log_ticks,
    mark_not_converged,
    new_figure,
    not_converged_handle,
    save,
)
from cemtool.plots.training import read_run

THRESHOLD_COLOR = "k"


def curvature_rows(run: str | Path) -> list[dict]:
    """The curvature rows of a run's metrics.jsonl, in step order (the last row of a step wins)."""
    p = Path(run) / "metrics.jsonl"
    rows = read_jsonl(p) if p.exists() else []
    by_step = {r["step"]: r for r in rows if r.get("kind") == "curvature" and isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows where ``key`` is a positive number (log axes)."""
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and r[key] > 0]
    return np.asarray([s for s, _ in pts], dtype=float), np.asarray([v for _, v in pts], dtype=float)


def _panel(ax, rows: list[dict], value: str, converged: str, threshold: str, color, label: str,
           threshold_label: str) -> None:
    x, y = _series(rows, value)
    ok = np.asarray([bool(r.get(converged, True)) for r in rows
                     if isinstance(r.get(value), (int, float)) and r[value] > 0], dtype=bool)
    ax.plot(x, y, "-", color=color, lw=1.2, label=label)
    ax.plot(x[ok], y[ok], "o", color=color, ms=5)
    mark_not_converged(ax, x[~ok], y[~ok], color)
    tx, ty = _series(rows, threshold)
    ax.plot(tx, ty, "--", color=THRESHOLD_COLOR, lw=1.0, label=threshold_label)
    ax.set_yscale("log")
    log_ticks(ax)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(f"eigenvalue ({CURVATURE})")


def curvature_figure(run: str | Path, rows: list[dict]):
    """The figure (not saved) of a run's curvature rows."""
    info = read_run(run)
    color = arch_color(info.arch)
    precond = any(isinstance(r.get("lambda_max_precond"), (int, float)) for r in rows)
    trace = any(isinstance(r.get("trace"), (int, float)) for r in rows)
    ncols = 1 + precond + trace
    fig, axes = new_figure(4.6 * ncols + 1.0, 4.4, ncols=ncols)
    ax = axes[0, 0]
    _panel(ax, rows, "lambda_max", "lambda_max_converged", "threshold_2_over_lr", color, "λ_max of the Hessian",
           "2/η (gradient descent)")
    sx, sy = _series(rows, "lambda_max_lr_scaled")
    if len(sx):  # per-group rates (e.g. LIMe's routers): the sharpness 2/η bounds is this one
        ax.plot(sx, sy, ":", marker="^", color=color, ms=4, lw=1.2,
                label="λ_max of $M^{1/2}HM^{1/2}$ (M: the groups' rates)")
    ax.set_title("sharpness", fontsize=9)
    col = 1
    if precond:
        ax = axes[0, col]
        _panel(ax, rows, "lambda_max_precond", "lambda_max_precond_converged", "threshold_adaptive", color,
               "λ_max of P⁻¹H (Adam)", "(2+2β1)/((1−β1)η) (Adam)")
        ax.set_title("preconditioned sharpness", fontsize=9)
        col += 1
    if trace:
        ax = axes[0, col]
        pts = [(r["step"], r["trace"], r.get("trace_se") or 0.0) for r in rows
               if isinstance(r.get("trace"), (int, float))]
        s, t, se = (np.asarray(v, dtype=float) for v in zip(*pts, strict=True))
        ax.errorbar(s, t, yerr=se, fmt="s-", color=color, ms=3, lw=1.0, capsize=2, label="tr(H) ± 1 SE (XTrace)")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"trace ({CURVATURE})")
        ax.set_title("trace of the Hessian", fontsize=9)
    last = rows[-1]
    fig.suptitle(f"Curvature during training: {info.arch} (seed {info.seed}), "
                 f"{last.get('curvature_tokens', 0):,} fixed validation tokens, {last.get('params_n', 0):,} parameters",
                 fontsize=9)
    handles, labels = [], []
    for a in axes[0]:
        h, lb = a.get_legend_handles_labels()
        handles += h
        labels += lb
    if not all(bool(r.get(k, True)) for r in rows for k in ("lambda_max_converged", "lambda_max_precond_converged")):
        handles.append(not_converged_handle())
        labels.append("Lanczos not converged (step cap)")
    legend_below(fig, handles, labels)
    return fig


def plot_curvature(run: str | Path, plots_dir: str | Path, name: str = "curvature") -> list[Path]:
    """``plots/<name>.png`` and ``.svg`` of a run that recorded curvature; [] if it did not."""
    rows = curvature_rows(run)
    if not rows:
        return []
    return save(curvature_figure(run, rows), plots_dir, name)


__all__ = ["curvature_figure", "curvature_rows", "plot_curvature"]
