"""Shared figure conventions: headless backend, one colour per architecture across every figure, PNG + SVG."""

from __future__ import annotations

import hashlib
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_PALETTE = plt.get_cmap("tab20").colors
_FIXED = {"baseline": 0, "vanilla": 0, "cem": 2, "hb": 4, "nesterov": 6, "tmm": 8, "adam": 10, "adamw": 12,
          "lime": 17, "muon": 16, "soap": 18}  # 14/15 are greys, kept for references


def arch_color(arch: str) -> tuple:
    """The same colour for an architecture in every figure (fixed for the common ones, hashed otherwise)."""
    if arch in _FIXED:
        return _PALETTE[_FIXED[arch]]
    h = int(hashlib.md5(arch.encode()).hexdigest(), 16)
    return _PALETTE[h % len(_PALETTE)]


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


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, constrained_layout=True)
    return fig, axes


def save(fig, plots_dir: str | Path, name: str, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save ``plots/<name>.png`` and ``.svg`` atomically (runs.atomic_write_bytes: no links followed inside a run);
    close the figure."""
    import io

    from cemtool.runs import atomic_write_bytes

    d = Path(plots_dir)
    paths = []
    for ext in formats:
        p = d / f"{name}.{ext}"
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=130)
        atomic_write_bytes(p, buf.getvalue())
        paths.append(p)
    plt.close(fig)
    return paths
