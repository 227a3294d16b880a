"""Shared figure conventions: headless backend, one colour per architecture across every figure, log axes with one
kind of tick label, visible "not converged" markers, titles that fit, and the output formats and size presets."""

from __future__ import annotations

import hashlib
import io
import textwrap
from contextlib import contextmanager
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.text import Text  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    FixedLocator,
    FuncFormatter,
    LogFormatterSciNotation,
    LogLocator,
    MaxNLocator,
    NullFormatter,
)

from cemtool.errors import CemtoolError  # noqa: E402
from cemtool.writes import atomic_write_bytes  # noqa: E402

# the unit of a Hessian eigenvalue: a second derivative of the loss (nats/token) in the parameters θ
CURVATURE = "nats/token per (unit of θ)²"

# Colour-blind-safe colours with at least 3:1 contrast against white (WCAG 2.1 non-text contrast): the four dark
# Okabe-Ito colours, then Paul Tol's "muted" ones that pass (his sand, pale cyan and teal do not). Black is the
# entropy floor's and greys are for references, so neither is an architecture's.
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#332288", "#999933", "#882255", "#117733", "#AA4499",
           "#CC6677", "#994F00", "#5C5C5C", "#1B7C86")
_FIXED = {"baseline": 0, "vanilla": 0, "tmm": 1, "lime": 2, "cem": 3, "hb": 4, "nesterov": 5, "adam": 6,
          "adamw": 7, "muon": 8, "soap": 9, "rmsprop": 10, "ortho": 11, "shampoo": 12}  # every momentum variant apart


def arch_color(arch: str) -> tuple[float, float, float]:
    """The same colour (RGB) for an architecture in every figure (fixed for the common ones, hashed otherwise)."""
    k = _FIXED[arch] if arch in _FIXED else int(hashlib.md5(arch.encode()).hexdigest(), 16) % len(PALETTE)
    return to_rgb(PALETTE[k])


def contrast_with_white(color) -> float:
    """WCAG 2.1 contrast ratio of a colour against a white background (1 = none, 21 = black)."""
    c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in to_rgb(color)]
    return 1.05 / (0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2] + 0.05)


def layer_axis(ax, layers: list[int], axis: str = "x") -> None:
    """An axis of layer indices: a tick at every layer (integers only; at most about 12 labelled), limits half a
    layer beyond the first and last, so that one layer is not drawn on an axis of fractions."""
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
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    size = max(abs(lo), abs(hi))
    if size > 0 and hi - lo < 1e-2 * size:
        mid = (lo + hi) / 2
        (ax.set_ylim if axis == "y" else ax.set_xlim)(mid - 0.05 * size, mid + 0.05 * size)


def log_ticks(ax, axis: str = "y") -> None:
    """A log axis with one kind of tick label: within two decades plain numbers (0.3, 1, 2, 5, 10, 20), the minor
    ticks at 2, 3 and 5 labelled too; beyond, powers of ten only (10⁻⁶, 10⁻³, 1 is not mixed with 2×10⁻¹)."""
    a = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = ax.get_ylim() if axis == "y" else ax.get_xlim()
    if lo > 0 and hi / lo <= 100:
        plain = FuncFormatter(lambda v, _: f"{v:.3g}")
        a.set_major_formatter(plain)
        a.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        a.set_minor_formatter(plain)
    else:
        a.set_major_locator(LogLocator(numticks=8))
        a.set_major_formatter(LogFormatterSciNotation())
        a.set_minor_formatter(NullFormatter())


# "not converged" (a Lanczos value that hit its step cap): a large ring with a thick edge and a white centre, drawn
# above the lines, so that it stands out from the filled markers of converged values at any size
NOT_CONVERGED = {"marker": "o", "ms": 9, "mfc": "white", "mew": 2.0, "ls": "none", "zorder": 5}


def mark_not_converged(ax, x, y, color) -> None:
    if len(x):
        ax.plot(x, y, mec=color, **NOT_CONVERGED)


def not_converged_handle():
    """The legend entry of :func:`mark_not_converged`."""
    return Line2D([], [], mec="0.3", **NOT_CONVERGED)


def note_panel(ax, text: str, fontsize: float = 8) -> None:
    """Text in an empty panel (its axes hidden), each line wrapped to the panel's width (about 0.5 em a
    character), so that it never widens the figure."""
    width_pt = ax.figure.get_figwidth() * ax.get_position().width * 72
    chars = max(12, int(width_pt / (0.55 * fontsize)))
    wrapped = "\n".join(textwrap.fill(line, chars) for line in text.splitlines())
    ax.axis("off")
    ax.text(0.0, 1.0, wrapped, va="top", fontsize=fontsize, transform=ax.transAxes)


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


def untangle_ticks(fig) -> bool:
    """Where the x tick labels of an axis overlap once drawn: fewer ticks on a numeric axis, and slanted labels
    where that is not enough (or the ticks are categories). Whether it changed anything (if not, the figure's
    layout is the one its first draw made)."""
    fig.draw_without_rendering()
    crowded = [ax for ax in fig.axes if _overlapping(ax.get_xticklabels())]
    if not crowded:
        return False
    for ax in crowded:
        if not isinstance(ax.xaxis.get_major_locator(), FixedLocator):
            ax.xaxis.set_major_locator(MaxNLocator(nbins=3))
    fig.draw_without_rendering()
    for ax in crowded:
        if _overlapping(ax.get_xticklabels()):
            ax.tick_params(axis="x", labelrotation=35)
            for t in ax.get_xticklabels():
                t.set(ha="right", rotation_mode="anchor")
    return True


# --------------------------------------------------------------------------------------------------------------
# output: formats and size presets (cemtool plot --format, --size)

FORMATS = ("png", "pdf", "svg")
DEFAULT_FORMATS = ("png", "svg")
# width (inches), base font size (pt) and PNG resolution of each preset: a journal column, a full page width, a
# 16:9 slide. A figure keeps its own aspect ratio; panels narrower than MIN_PANEL move to further rows.
SIZES = {"column": (3.5, 7.0, 300), "page": (7.0, 8.0, 300), "slide": (10.0, 12.0, 150)}
MIN_PANEL = {"column": 3.4, "page": 2.3, "slide": 3.2}
_OUTPUT = {"formats": DEFAULT_FORMATS, "size": None}


def parse_formats(text: str) -> tuple[str, ...]:
    """'png,pdf,svg' -> ('png', 'pdf', 'svg'); PNG always comes first (report.md shows the PNGs)."""
    asked = [f.strip().lower() for f in str(text).split(",") if f.strip()]
    bad = [f for f in asked if f not in FORMATS]
    if bad or not asked:
        raise CemtoolError(f"unknown figure format {bad[0]!r}" if bad else "no figure format given",
                           hint=f"use a comma-separated list of {', '.join(FORMATS)}")
    return tuple(dict.fromkeys(["png", *asked]))


def check_size(size: str | None) -> str | None:
    if size is not None and size not in SIZES:
        raise CemtoolError(f"unknown figure size {size!r}",
                           hint="use " + ", ".join(f"{k} ({v[0]:g} in wide)" for k, v in SIZES.items()))
    return size


@contextmanager
def output(formats: tuple[str, ...] | None = None, size: str | None = None):
    """Within it, every figure is drawn at the size preset ``size`` (None: each figure's own size) and saved in
    ``formats``."""
    old = dict(_OUTPUT)
    _OUTPUT.update(formats=tuple(formats or DEFAULT_FORMATS), size=check_size(size))
    rc = {}
    if size:
        font = SIZES[size][1]
        rc = {"font.size": font, "axes.titlesize": font, "axes.labelsize": font, "xtick.labelsize": font - 1,
              "ytick.labelsize": font - 1, "legend.fontsize": font - 1, "figure.titlesize": font}
    try:
        with plt.rc_context(rc):
            yield
    finally:
        _OUTPUT.update(old)


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    """A figure with an (nrows, ncols) array of axes. Under a size preset: the preset's width and the figure's own
    aspect ratio, and when the panels would be too narrow, the same axes laid out on more rows (the array keeps
    its shape, so ``axes[0, i]`` is still the i-th panel)."""
    size = _OUTPUT["size"]
    if not size:
        fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, constrained_layout=True)
        return fig, axes
    preset = SIZES[size][0]
    n = nrows * ncols
    cols = max(1, min(ncols, int(preset // MIN_PANEL[size])))
    rows = -(-n // cols)
    panel_h = min(height / nrows * preset / width * ncols / cols, 0.65 * preset / cols)
    fig, grid = plt.subplots(rows, cols, figsize=(preset, max(1.6, panel_h) * rows + 0.6 * (rows > nrows)),
                             squeeze=False, constrained_layout=True)
    flat = grid.ravel()
    for ax in flat[n:]:
        ax.remove()
    return fig, np.asarray(flat[:n], dtype=object).reshape(nrows, ncols)


def _titles(fig) -> list[tuple[object, float, str]]:
    """Every title and axis label of a figure with the length (pixels) it may take and the side that length is
    measured on: a title or x label its axes' width, a y label its axes' height, the figure's title the figure's
    width."""
    out = []
    for ax in fig.axes:
        box = ax.bbox
        out += [(t, box.width, "width") for t in (ax.title, ax._left_title, ax._right_title, ax.xaxis.label)]
        out.append((ax.yaxis.label, box.height, "height"))
    if fig._suptitle is not None:
        out.append((fig._suptitle, fig.bbox.width, "width"))
    return [(t, avail, side) for t, avail, side in out if t.get_text() and t.get_visible()]


def title_overflow(fig) -> list[str]:
    """The titles and axis labels longer than their axes (or, for the figure's title, than the figure) once
    drawn: [] when every one fits."""
    fig.draw_without_rendering()
    r = fig.canvas.get_renderer()
    return [t.get_text() for t, avail, side in _titles(fig) if getattr(t.get_window_extent(r), side) > avail + 1.0]


SLACK = 0.95  # wrap to this share of the room: the wrapped lines move the axes a little once laid out again


def fit_titles(fig, drawn: bool = False) -> bool:
    """Wrap every title and axis label that is longer than its axes (or the figure) onto more lines, at spaces
    (``drawn``: the figure is laid out as it stands, so it is measured without another draw). Whether it changed
    anything: if not, every title and label is within SLACK of its room in the current layout."""
    if not drawn:
        fig.draw_without_rendering()
    r = fig.canvas.get_renderer()
    changed = False
    for t, avail, side in _titles(fig):
        text = " ".join(t.get_text().split())
        length = getattr(t.get_window_extent(r), side)
        chars = len(text)
        while length > avail * SLACK and chars > 8:
            chars = max(8, int(chars * min(0.95, avail * SLACK / length)))
            t.set_text(textwrap.fill(text, chars, break_on_hyphens=False))
            length = getattr(t.get_window_extent(r), side)
            changed = True
        if length > avail:  # a single word longer than the axes: a smaller font
            t.set_fontsize(t.get_fontsize() * avail / length)
            changed = True
    return changed


def _preset_fonts(fig, base: float) -> None:
    """Under a size preset no text is larger than the preset's font (the figures ask for 9 pt titles and 8 pt
    legends at their own sizes), legends one point smaller."""
    legend_texts = {id(t) for lg in fig.legends + [a.get_legend() for a in fig.axes if a.get_legend()]
                    for t in [*lg.get_texts(), lg.get_title()]}
    for t in fig.findobj(Text):
        top = base - 1 if id(t) in legend_texts else base
        if t.get_fontsize() > top:
            t.set_fontsize(top)


def save(fig, plots_dir: str | Path, name: str, formats: tuple[str, ...] | None = None) -> list[Path]:
    """Save ``plots/<name>.<format>`` for every format in ``formats`` (default: those of :func:`output`, PNG and
    SVG unless told otherwise) atomically (runs.atomic_write_bytes: no links followed inside a run); close the
    figure. Titles that would be wider than their axes are wrapped first. The layout those checks measured is
    kept for every format (the layout engine is removed before writing): each format is one draw, and the
    PNG, PDF and SVG of a figure have the same geometry."""
    d = Path(plots_dir)
    if _OUTPUT["size"]:
        _preset_fonts(fig, SIZES[_OUTPUT["size"]][1])
    drawn = not untangle_ticks(fig)  # unchanged: laid out as it stands
    for _ in range(3):  # again while the wrapped lines, laid out, moved the axes
        if not fit_titles(fig, drawn) or not title_overflow(fig):
            break  # either way the last draw came after the last change: the layout is current
        drawn = True  # title_overflow laid it out again
    # keep that layout: no engine at all, not "none"'s placeholder, for which every savefig draws the figure once
    # more before its real draw (the pre-draw a layout engine needs); under rc settings that would pick an engine
    # for None
    with matplotlib.rc_context({"figure.autolayout": False, "figure.constrained_layout.use": False}):
        fig.set_layout_engine(None)
    dpi = SIZES[_OUTPUT["size"]][2] if _OUTPUT["size"] else 130
    paths = []
    for ext in formats or _OUTPUT["formats"]:
        p = d / f"{name}.{ext}"
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=dpi, metadata={"Date": None} if ext in ("pdf", "svg") else None)
        atomic_write_bytes(p, buf.getvalue())
        paths.append(p)
    plt.close(fig)
    return paths
