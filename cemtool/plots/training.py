"""Training curves from run directories (metrics.jsonl, meta.json, config.json); never recomputes.

Several runs share one pair of axes: colour per architecture (:func:`cemtool.plots.style.arch_color`), line style
per seed (per run, where runs share architecture and seed). The thin line is the training loss (a moving average of the
logged batches, :func:`smoothed`), the line with markers the validation loss, and the black
dashed line the corpus's entropy floor where one is known (the exact mean -log p of the validation targets; no model
can go below it). A second panel shows the validation gap above the floor on a log
scale when a floor is known.

Only JSON is read here (no torch import), so ``cemtool plot`` works on a run whose checkpoints were deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import EngFormatter

from cemtool.errors import CemtoolError
from cemtool.fileio import read_json, read_jsonl
from cemtool.layout import is_hf_dir, is_run
from cemtool.plots.style import arch_color, legend_below, log_ticks, new_figure, save
from cemtool.report import group_labels, run_settings

FLOOR_COLOR = "k"
SEED_STYLES = ["-", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3))]  # never "--": that is the floor's


@dataclass
class RunCurves:
    """What a training-curve figure needs from one run directory."""

    path: Path
    arch: str
    seed: int
    meta: dict
    config: dict
    train: list[dict] = field(default_factory=list)  # rows with step, tokens, train_loss
    val: list[dict] = field(default_factory=list)  # rows with step, tokens, val_loss (val_floor)
    label: str = ""

    @property
    def floor(self) -> float | None:
        floors = [r["val_floor"] for r in self.val if r.get("val_floor") is not None]
        return floors[-1] if floors else self.meta.get("val_floor")

    @property
    def final_val(self) -> float | None:
        return self.val[-1]["val_loss"] if self.val else self.meta.get("val_loss")


def read_run(path: str | Path) -> RunCurves:
    """Read a run's metrics, meta and config (JSON only)."""
    p = Path(path)
    if not p.is_dir():
        raise CemtoolError(f"run directory {p} does not exist")
    if is_hf_dir(p):
        raise CemtoolError(f"{p} is a Hugging Face model directory, not a cemtool run: it has no training curves")
    if not is_run(p):
        raise CemtoolError(f"{p} is not a cemtool run (no config.json)")
    config = read_json(p / "config.json", "config file")
    meta = read_json(p / "meta.json", "run metadata") if (p / "meta.json").exists() else {}
    if not isinstance(config, dict) or not isinstance(meta, dict):
        raise CemtoolError(f"{p}: config.json and meta.json must hold JSON objects")
    arch = meta.get("arch") or config.get("model", {}).get("arch", "?")
    seed = meta.get("seed", config.get("seed", 0))
    rows = read_jsonl(p / "metrics.jsonl")
    train = [r for r in rows if isinstance(r.get("train_loss"), (int, float))]
    val = [r for r in rows if isinstance(r.get("val_loss"), (int, float))]
    return RunCurves(p, str(arch), int(seed), meta, config, train, val)


def label_runs(runs: list[RunCurves]) -> list[RunCurves]:
    """``arch (seed s)``, or the directory name where two runs share architecture and seed."""
    keys = [(r.arch, r.seed) for r in runs]
    for r, k in zip(runs, keys, strict=True):
        if not r.label:
            r.label = f"{r.arch} (seed {r.seed})" if keys.count(k) == 1 else f"{r.path.name}"
    return runs


def line_styles(runs: list[RunCurves]) -> list:
    """Line style per run: by seed; where two runs share architecture and seed (they differ in other settings),
    by the run's place among the runs of its architecture instead."""
    keys = [(r.arch, r.seed) for r in runs]
    if len(set(keys)) == len(keys):
        seeds = sorted({r.seed for r in runs})
        return [SEED_STYLES[seeds.index(r.seed) % len(SEED_STYLES)] for r in runs]
    styles = []
    for i, r in enumerate(runs):
        same = [j for j, q in enumerate(runs) if q.arch == r.arch]
        styles.append(SEED_STYLES[same.index(i) % len(SEED_STYLES)])
    return styles


def distinguishable(runs: list[RunCurves]) -> bool:
    """Whether colour (architecture) and line style tell every run apart on one pair of axes."""
    archs = [r.arch for r in runs]
    return len({(r.arch, r.seed) for r in runs}) == len(runs) or \
        max(archs.count(a) for a in archs) <= len(SEED_STYLES)


SMOOTH_FRACTION = 0.05  # the training loss's moving-average window, as a fraction of the run's logged batches


def smoothed(values: list[float], fraction: float = SMOOTH_FRACTION) -> np.ndarray:
    """Centred moving average of a run's logged batch losses over a window of ``fraction`` of the run (at least 3
    batches; cut at both ends), so that the curve neither shows one noisy batch nor lags behind the loss."""
    v = np.asarray(values, dtype=float)
    half = max(1, int(round(fraction * len(v) / 2)))
    c = np.concatenate([[0.0], np.cumsum(v)])  # c[i] = sum of v[:i]
    idx = np.arange(len(v))
    lo, hi = np.maximum(idx - half, 0), np.minimum(idx + half + 1, len(v))
    return (c[hi] - c[lo]) / (hi - lo)


def _x(row: dict, axis: str) -> float:
    return row.get(axis, row.get("step", 0)) if axis == "tokens" else row.get("step", 0)


def _floors(runs: list[RunCurves]) -> list[float]:
    out: list[float] = []
    for r in runs:
        f = r.floor
        if f is not None and all(abs(f - g) > 1e-6 for g in out):
            out.append(float(f))
    return out


def training_figure(runs: list[RunCurves], x_axis: str = "tokens"):
    """The figure (not saved): loss curves on the left, gap above the floor (log) on the right if known."""
    if not runs:
        raise CemtoolError("no runs to plot")
    label_runs(runs)
    floors = _floors(runs)
    has_gap = bool(floors) and any(r.val and r.floor is not None for r in runs)
    rows = (len(runs) + 1 + 3) // 4  # legend rows below the axes
    fig, axes = new_figure(11.0 if has_gap else 6.4, 4.2 + 0.25 * rows, ncols=2 if has_gap else 1)
    ax = axes[0, 0]
    styles = line_styles(runs)
    for r, ls in zip(runs, styles, strict=True):
        color = arch_color(r.arch)
        if r.train:
            ax.plot([_x(t, x_axis) for t in r.train], smoothed([t["train_loss"] for t in r.train]), color=color,
                    ls=ls, lw=0.9, alpha=0.55)
        if r.val:
            ax.plot([_x(v, x_axis) for v in r.val], [v["val_loss"] for v in r.val], color=color, ls=ls, lw=1.8,
                    marker="o", ms=3.5, label=r.label)
    for f in floors:
        ax.axhline(f, color=FLOOR_COLOR, ls="--", lw=1.2)
    ax.set_xlabel("tokens seen" if x_axis == "tokens" else "optimizer step")
    ax.set_ylabel("loss (nats/token)")
    if x_axis == "tokens":
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_title("training (thin) and validation (markers) loss", fontsize=9)
    ax.grid(alpha=0.3)
    _legend_below(fig, ax, floors, train=any(r.train for r in runs))
    _zoom(ax, runs, floors)
    if has_gap:
        gx = axes[0, 1]
        for r, ls in zip(runs, styles, strict=True):
            if r.floor is None or not r.val:
                continue
            color = arch_color(r.arch)
            pts = [(_x(v, x_axis), v["val_loss"] - r.floor) for v in r.val]
            gx.plot(*zip(*pts, strict=True), color=color, ls=ls, lw=1.8, marker="o", ms=3.5, label=r.label)
        _log_gap_axis(gx)
        gx.set_xlabel(ax.get_xlabel())
        if x_axis == "tokens":
            gx.xaxis.set_major_formatter(EngFormatter(sep=""))
        gx.set_ylabel("validation loss - floor (nats/token)")
        gx.set_title("gap above the entropy floor", fontsize=9)
        gx.grid(alpha=0.3, which="both")
    return fig


def _legend_below(fig, ax, floors: list[float], train: bool = False) -> None:
    """The runs of ``ax``, the smoothing of the training loss (``train``) and the entropy floor in one legend
    below the axes."""
    handles, labels = ax.get_legend_handles_labels()
    if train:
        handles.append(Line2D([], [], color="0.4", lw=0.9, alpha=0.55))
        labels.append(f"training loss: moving average over {SMOOTH_FRACTION:.0%} of the run's batches")
    if floors:
        handles.append(Line2D([], [], color=FLOOR_COLOR, ls="--", lw=1.2))
        labels.append(f"entropy floor {floors[0]:.3f}" if len(floors) == 1 else "entropy floors")
    legend_below(fig, handles, labels, most=4)


def _log_gap_axis(ax) -> None:
    """Log scale for the gap panel when every plotted gap is positive, with one kind of tick label
    (:func:`cemtool.plots.style.log_ticks`)."""
    gaps = [y for line in ax.get_lines() for y in line.get_ydata()]
    if gaps and min(gaps) > 0:
        ax.set_yscale("log")
        log_ticks(ax)


def _zoom(ax, runs: list[RunCurves], floors: list[float], train: bool = True) -> None:
    """Start the y axis a little below the floor and leave the few highest training losses of the first steps
    (about ln(vocabulary) at initialisation) above the top, so that the part near the floor is readable
    (``train``: whether training losses are on the axes)."""
    vals = [v["val_loss"] for r in runs for v in r.val]
    trains = [v for r in runs if r.train for v in smoothed([t["train_loss"] for t in r.train])] if train else []
    if not vals and not trains:
        return
    lo = min(vals + trains + floors)
    hi = max(vals + ([float(np.percentile(trains, 95))] if trains else []))
    pad = 0.06 * max(hi - lo, 1e-3)
    ax.set_ylim(lo - pad, hi + pad)


def group_runs(runs: list[RunCurves], labels: dict[str, str | None] | None = None) -> dict[str, list[RunCurves]]:
    """Runs grouped across seeds: by ``labels`` (run path -> group label, e.g. from a compare.json) where it labels
    every run, else by their settings without the seed (:func:`cemtool.report.run_settings`, using the family
    recorded in meta.json)."""
    if labels is None or any(labels.get(str(r.path)) is None for r in runs):
        names = group_labels([r.arch for r in runs], [run_settings(r.config, r.meta.get("family")) for r in runs])
    else:
        names = [labels[str(r.path)] for r in runs]
    groups: dict[str, list[RunCurves]] = {}
    for r, name in zip(runs, names, strict=True):
        groups.setdefault(name, []).append(r)
    return groups


def _mean_curve(runs: list[RunCurves], x_axis: str, floor: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, mean and standard deviation (ddof 1, :data:`cemtool.report.SPREAD`) over the runs of the validation loss
    (or its gap above the floor) at every evaluation point that all runs share."""
    per_run = [{_x(v, x_axis): v["val_loss"] - (r.floor if floor else 0.0) for v in r.val} for r in runs]
    xs = sorted(set.intersection(*[set(d) for d in per_run]))
    ys = np.array([[d[x] for x in xs] for d in per_run])  # (runs, points)
    std = ys.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(len(xs))
    return np.array(xs), ys.mean(axis=0), std


def training_groups_figure(groups: dict[str, list[RunCurves]], x_axis: str = "tokens"):
    """Validation loss per group of runs (mean over seeds, shaded ± one standard deviation over seeds), with the
    floor; the gap above the floor on the right (log) when known. For studies with more seeds than line styles."""
    runs = [r for rs in groups.values() for r in rs if r.val]
    if not runs:
        raise CemtoolError("no validation curves to plot")
    floors = _floors(runs)
    has_gap = bool(floors) and all(r.floor is not None for r in runs)
    fig, axes = new_figure(11.0 if has_gap else 6.4, 4.4 + 0.25 * ((len(groups) + 4) // 4),
                           ncols=2 if has_gap else 1)
    panels = [(axes[0, 0], False)] + ([(axes[0, 1], True)] if has_gap else [])
    for label, rs in groups.items():
        rs = [r for r in rs if r.val]
        if not rs:
            continue
        arch = rs[0].arch  # colour = architecture; groups sharing one get line styles
        same_arch = [g for g, q in groups.items() if q and q[0].arch == arch]
        ls = SEED_STYLES[same_arch.index(label) % len(SEED_STYLES)]
        color = arch_color(arch)
        for ax, gap in panels:
            x, m, se = _mean_curve(rs, x_axis, gap)
            ax.plot(x, m, color=color, ls=ls, lw=1.8, marker="o", ms=3, label=f"{label} (n={len(rs)})")
            ax.fill_between(x, m - se, m + se, color=color, alpha=0.2, lw=0)
    ax = axes[0, 0]
    for f in floors:
        ax.axhline(f, color=FLOOR_COLOR, ls="--", lw=1.2)
    _zoom(ax, runs, floors, train=False)
    ax.set_title("validation loss: mean over seeds, band = ± one std over seeds", fontsize=9)
    ax.set_ylabel("loss (nats/token)")
    if has_gap:
        gx = axes[0, 1]
        _log_gap_axis(gx)
        gx.set_ylabel("validation loss - floor (nats/token)")
        gx.set_title("gap above the entropy floor (mean ± s.e.)", fontsize=9)
        gx.grid(alpha=0.3, which="both")
    for a, _ in panels:
        a.set_xlabel("tokens seen" if x_axis == "tokens" else "optimizer step")
        if x_axis == "tokens":
            a.xaxis.set_major_formatter(EngFormatter(sep=""))
        a.grid(alpha=0.3)
    _legend_below(fig, ax, floors)
    return fig


def plot_training_groups(runs: list[RunCurves], plots_dir: str | Path, labels: dict[str, str] | None = None,
                         name: str = "training_groups", x_axis: str = "tokens") -> list[Path]:
    """``plots/<name>.png`` and ``.svg``: the runs' validation curves averaged over seeds per group."""
    return save(training_groups_figure(group_runs(runs, labels), x_axis), plots_dir, name)


def plot_training(runs: list[str | Path | RunCurves], plots_dir: str | Path, name: str = "training",
                  x_axis: str = "tokens") -> list[Path]:
    """``plots/<name>.png`` and ``.svg`` for one or several runs."""
    curves = [r if isinstance(r, RunCurves) else read_run(r) for r in runs]
    return save(training_figure(curves, x_axis), plots_dir, name)


__all__ = ["FLOOR_COLOR", "RunCurves", "SEED_STYLES", "SMOOTH_FRACTION", "distinguishable", "group_runs",
           "label_runs", "line_styles", "plot_training", "plot_training_groups", "read_json", "read_run",
           "smoothed", "training_figure", "training_groups_figure"]
