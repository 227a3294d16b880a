"""Shared figure conventions: headless backend, one colour per architecture across every figure, PNG + SVG."""

from __future__ import annotations

import hashlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# Colour-blind-safe colours with at least 3:1 contrast against white (WCAG 2.1 non-text contrast): the four dark
# Okabe-Ito colours, then Paul Tol's "muted" ones that pass (his sand, pale cyan and teal do not). Black is the
# entropy floor's and greys are for references, so neither is an architecture's.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#332288", "#999933", "#882255", "#117733", "#AA4499",
           "#CC6677", "#994F00", "#5C5C5C", "#1B7C86")
_FIXED = {"baseline": 0, "vanilla": 0, "tmm": 1, "lime": 2, "cem": 3, "hb": 4, "nesterov": 5, "adam": 6,
          "adamw": 7, "muon": 8, "soap": 9, "rmsprop": 10, "ortho": 11, "shampoo": 12}  # every momentum variant apart


def arch_color(arch: str) -> tuple[float, float, float]:
    """The same colour (RGB) for an architecture in every figure (fixed for the common ones, hashed otherwise)."""
    from matplotlib.colors import to_rgb

    k = _FIXED[arch] if arch in _FIXED else int(hashlib.md5(arch.encode()).hexdigest(), 16) % len(PALETTE)
    return to_rgb(PALETTE[k])


def contrast_with_white(color) -> float:
    """WCAG 2.1 contrast ratio of a colour against a white background (1 = none, 21 = black)."""
    from matplotlib.colors import to_rgb

    c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in to_rgb(color)]
    return 1.05 / (0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2] + 0.05)


def layer_axis(ax, layers: list[int], axis: str = "x") -> None:
    """An axis of layer indices: a tick at every layer (integers only; at most about 12 labelled), limits half a
    layer beyond the first and last, so that one layer is not drawn on an axis of fractions."""
    from matplotlib.ticker import MaxNLocator

    layers = sorted({int(v) for v in layers})
    if not layers:
        return
    a = ax.xaxis if axis == "x" else ax.yaxis
    if len(layers) <= 12:
        a.set_ticks(layers)
    else:
        a.set_major_locator(MaxNLocator(integer=True))
    (ax.set_xlim if axis == "x" else ax.set_ylim)(layers[0] - 0.5, layers[-1] + 0.5)


def plain_numbers(ax, axis: str = "y") -> None:
    """Tick labels that carry their whole value (4 significant digits): no offset ('+1.234e1') and no multiplier at
    the axis end. Call it after drawing the data: an axis whose data span less than 1% of their size (one layer,
    one value) is widened to ±5% of it, so that its ticks read 12.0, 12.5, ... instead of 12.3456790, 12.3456795."""
    from matplotlib.ticker import FuncFormatter

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    size = max(abs(lo), abs(hi))
    if size > 0 and hi - lo < 1e-2 * size:
        mid = (lo + hi) / 2
        (ax.set_ylim if axis == "y" else ax.set_xlim)(mid - 0.05 * size, mid + 0.05 * size)


def legend_below(fig, handles: list, labels: list[str], fontsize: float = 8, most: int = 6, **kwargs) -> None:
    """One legend below the axes, with as many columns as the figure's width holds for its longest label (about
    13 characters per inch at 8 pt), so that no entry is cut off at the edges."""
    if not labels:
        return
    chars = fig.get_figwidth() * 13.0 * 8.0 / fontsize
    ncol = max(1, min(len(labels), most, int(chars // (max(len(str(lb)) for lb in labels) + 6))))
    fig.legend(handles, labels, fontsize=fontsize, loc="outside lower center", ncol=ncol, **kwargs)


def variant_index(archs: list[str]) -> list[int]:
    """For groups listed by architecture: 0 for the first group of each architecture, 1 for its second, ... (groups
    of one architecture share its colour; figures tell them apart by this index: hatching, line style, fill)."""
    return [archs[:i].count(a) for i, a in enumerate(archs)]


def _overlapping(labels) -> bool:
    boxes = sorted((t.get_window_extent() for t in labels if t.get_visible() and t.get_text()), key=lambda b: b.x0)
    return any(b.x0 < a.x1 - 1.0 for a, b in zip(boxes, boxes[1:], strict=False))


def untangle_ticks(fig) -> None:
    """Where the x tick labels of an axis overlap once drawn: fewer ticks on a numeric axis, and slanted labels
    where that is not enough (or the ticks are categories)."""
    from matplotlib.ticker import FixedLocator, MaxNLocator

    fig.draw_without_rendering()
    crowded = [ax for ax in fig.axes if _overlapping(ax.get_xticklabels())]
    if not crowded:
        return
    for ax in crowded:
        if not isinstance(ax.xaxis.get_major_locator(), FixedLocator):
            ax.xaxis.set_major_locator(MaxNLocator(nbins=3))
    fig.draw_without_rendering()
    for ax in crowded:
        if _overlapping(ax.get_xticklabels()):
            ax.tick_params(axis="x", labelrotation=35)
            for t in ax.get_xticklabels():
                t.set(ha="right", rotation_mode="anchor")


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, constrained_layout=True)
    return fig, axes


def save(fig, plots_dir: str | Path, name: str, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save ``plots/<name>.png`` and ``.svg`` atomically (runs.atomic_write_bytes: no links followed inside a run);
    close the figure."""
    import io

    from cemtool.runs import atomic_write_bytes

    d = Path(plots_dir)
    untangle_ticks(fig)
    paths = []
    for ext in formats:
        p = d / f"{name}.{ext}"
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=130)
        atomic_write_bytes(p, buf.getvalue())
        paths.append(p)
    plt.close(fig)
    return paths
