"""Figures of a saved sharpness report (reports/sharpness.json): spectral density with the extreme eigenvalues,
and the 1-D / 2-D loss slices. Reads the report only; never recomputes anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cemtool.analysis.curvature import DEFAULT_OPERATOR, title
from cemtool.plots.style import CURVATURE, arch_color, legend_below, log_ticks, new_figure, save


def _title(report: dict, what: str) -> str:
    prov = report.get("provenance") or {}
    arch = prov.get("arch") or "?"
    return f"{what}: {arch}, step {prov.get('step')}, N = {report.get('tokens', 0):,} tokens"


def plot_spectrum(report: dict, plots_dir: str | Path, name: str = "sharpness_spectrum") -> list[Path]:
    """SLQ density of the operator's spectrum (log scale; the Hessian unless the report names another) with the
    Lanczos extreme eigenvalues marked."""
    dens, eig = report.get("density"), report.get("eigen")
    if not dens and not eig:
        return []
    color = arch_color((report.get("provenance") or {}).get("arch") or "baseline")
    fig, axes = new_figure(6.4, 4.0)
    ax = axes[0][0]
    if dens:
        grid, d = np.asarray(dens["grid"]), np.asarray(dens["density"])
        floor = max(float(d.max()) * 1e-8, 1e-300)
        ax.semilogy(grid, np.maximum(d, floor), color=color,
                    label=f"SLQ density ({dens['runs']} × {dens['steps']} steps, σ = {dens['sigma']:.3g})")
        ax.set_ylim(bottom=floor * 10)
    if eig:
        for i, v in enumerate(eig.get("top", [])):
            ax.axvline(v, color="tab:red", lw=0.8, ls="-" if eig["top_converged"][i] else ":",
                       label="top eigenvalues (Lanczos)" if i == 0 else None)
        for i, v in enumerate(eig.get("bottom", [])):
            ax.axvline(v, color="black", lw=0.8, ls="-" if eig["bottom_converged"][i] else ":",
                       label="bottom eigenvalues (Lanczos)" if i == 0 else None)
    what = title((report.get("options") or {}).get("operator", DEFAULT_OPERATOR))
    ax.set_xlabel(f"eigenvalue of {what} ({CURVATURE})")
    ax.set_ylabel("density (per unit eigenvalue)")
    if dens:
        log_ticks(ax)
    ax.set_title(_title(report, f"spectrum of {what}"), fontsize=9)
    if eig and not all(eig.get("top_converged", []) + eig.get("bottom_converged", [])):
        ax.plot([], [], color="grey", lw=0.8, ls=":", label="dotted: Lanczos not converged")
    legend_below(fig, *ax.get_legend_handles_labels(), fontsize=7, most=2, frameon=False)  # never on a curve
    return save(fig, plots_dir, name)


def plot_slice_1d(report: dict, plots_dir: str | Path, name: str = "sharpness_slice_1d") -> list[Path]:
    sl = report.get("slice_1d")
    if not sl:
        return []
    fig, axes = new_figure(5.2, 3.8)
    ax = axes[0][0]
    ax.plot(sl["alphas"], sl["losses"], "o-", ms=3, color=arch_color((report.get("provenance") or {}).get("arch")
                                                                      or "baseline"))
    ax.axhline(sl["loss"], color="grey", lw=0.6, ls=":")
    ax.set_xlabel("α (filter-normalised direction)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(_title(report, "1-D loss slice"), fontsize=9)
    return save(fig, plots_dir, name)


def plot_slice_2d(report: dict, plots_dir: str | Path, name: str = "sharpness_slice_2d") -> list[Path]:
    sl = report.get("slice_2d")
    if not sl:
        return []
    fig, axes = new_figure(5.2, 4.4)
    ax = axes[0][0]
    a, b, z = np.asarray(sl["alphas"]), np.asarray(sl["betas"]), np.asarray(sl["losses"])  # z[i, j] at (a_i, b_j)
    cs = ax.contourf(a, b, z.T, levels=20, cmap="viridis")
    ax.contour(a, b, z.T, levels=10, colors="white", linewidths=0.4)
    ax.plot([0], [0], "r+", ms=8)
    fig.colorbar(cs, ax=ax, label="loss (nats/token)")
    ax.set_xlabel("α (direction 1)")
    ax.set_ylabel("β (direction 2)")
    ax.set_title(_title(report, "2-D loss slice"), fontsize=9)
    return save(fig, plots_dir, name)


def plot_sharpness(report: dict, plots_dir: str | Path, prefix: str = "sharpness") -> list[Path]:
    """Every figure the report supports; returns the written files (PNG and SVG)."""
    return (plot_spectrum(report, plots_dir, f"{prefix}_spectrum") + plot_slice_1d(report, plots_dir,
                                                                                    f"{prefix}_slice_1d")
            + plot_slice_2d(report, plots_dir, f"{prefix}_slice_2d"))


__all__ = ["plot_sharpness", "plot_slice_1d", "plot_slice_2d", "plot_spectrum"]
