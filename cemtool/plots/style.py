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


def new_figure(width: float = 6.4, height: float = 4.2, ncols: int = 1, nrows: int = 1):
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, height), squeeze=False, constrained_layout=True)
    return fig, axes


def save(fig, plots_dir: str | Path, name: str, formats: tuple[str, ...] = ("png", "svg")) -> list[Path]:
    """Save ``plots/<name>.png`` and ``.svg`` atomically; close the figure."""
    import os

    d = Path(plots_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in formats:
        p = d / f"{name}.{ext}"
        tmp = d / f".{name}.tmp{os.getpid()}.{ext}"
        fig.savefig(tmp, dpi=130)
        os.replace(tmp, p)
        paths.append(p)
    plt.close(fig)
    return paths
