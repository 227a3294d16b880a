"""Figures a reviewer accepts: every requested format written (PDF/SVG/PNG headers), no title wider than its axes
(measured with the renderer), no absolute path in a title, units on the axes, one kind of tick label per log axis,
visible "not converged" markers, one stream-scalar figure for several runs; `cemtool plot --format/--size`."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.plots import style

from kit import one_line_error

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "sample_runs" / "demo"
HEADERS = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<?xml"}
ABSOLUTE = re.compile(r"(^|[\s(:,])/[\w.-]+/")
# the unit each kind of figure must name on an axis: (stem, axis, text in the label)
UNITS = [("curvature", "y", style.CURVATURE), ("sharpness_spectrum", "x", style.CURVATURE),
         ("sharpness_layers", "y", style.CURVATURE), ("training", "y", "nats/token"),
         ("forgetting", "y", "nats/token"), ("collapse_compare_streams", "y", "dimensionless")]


# (step, λ_max, its error) of the curvature rows of a tiny run trained with train.curvature_every=10 and
# train.curvature_steps=3: after 3 Lanczos steps no value has converged
CURVATURE = [(10, 16.808910541814882, 6.715924321778752), (20, 1.2915635718781409, 0.01784870278078205),
             (30, 1.1925444969586612, 0.002707585493455261)]


def curvature_run(path: Path) -> Path:
    """A run that tracked curvature, made by hand: the demo's baseline run (config, meta, metrics; no reports) and
    the curvature rows train.py would have appended to its metrics.jsonl at steps 10, 20 and 30 (the run's own
    learning rates and tokens at those steps)."""
    shutil.copytree(DEMO / "baseline-s0", path, ignore=shutil.ignore_patterns("plots", "reports", "*.md"))
    logged = {r["step"]: r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if "lr" in r}
    rows = [{"kind": "curvature", "step": step, "lr": logged[step]["lr"],
             "threshold_2_over_lr": 2 / logged[step]["lr"], "curvature_tokens": 512, "lambda_max": lam,
             "lambda_max_converged": False, "lambda_max_error": err, "lanczos_steps": 3, "params_n": 39168,
             "curvature_seconds": 0.2, "tokens": logged[step]["tokens"],
             "lr_mults": [1.0, 10.0], "lambda_max_lr_scaled": 1.5 * lam,  # per-group rates (as LIMe's routers)
             "lambda_max_lr_scaled_converged": True, "lanczos_steps_lr_scaled": 3} for step, lam, err in CURVATURE]
    with open(path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    """Every figure of the demo's study (with an absolute path as a fine-tune's target data), of a run that
    tracked curvature (made by hand), and of a sharpness report, drawn at the narrowest preset into PNG, PDF and
    SVG; the figures are kept (name -> figure) for inspection."""
    from cemtool.plots.render import render_all, render_run
    from cemtool.plots.sharpness import plot_sharpness

    tmp = tmp_path_factory.mktemp("figs")
    study = tmp / "demo"
    shutil.copytree(DEMO, study, ignore=shutil.ignore_patterns("plots", "*.md"))
    rep = study / "baseline-s0-ft-grammar-b" / "reports" / "forgetting.json"
    payload = json.loads(rep.read_text())
    payload["target"]["data"] = "/home/someone/corpora/stories.txt"
    rep.write_text(json.dumps(payload))
    curv = curvature_run(tmp / "curv")
    figures: dict = {}
    real_close = plt.close

    def keep(fig=None):
        if fig is not None and hasattr(fig, "axes"):
            figures[len(figures)] = fig
        real_close(fig)

    mp = pytest.MonkeyPatch()
    mp.setattr(plt, "close", keep)
    try:
        with style.output(("png", "pdf", "svg"), "column"):
            written = render_all(study, each_run=False)
            written += render_run(curv)
            written += plot_sharpness(json.loads((DEMO / "baseline-s0" / "reports" / "sharpness.json").read_text()),
                                      tmp, "sharpness")
    finally:
        mp.undo()
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(figures) == len(pngs) >= 12
    return dict(zip([p.stem for p in pngs], figures.values(), strict=True)), pngs


def test_every_figure_writes_every_requested_format(drawn):
    _, pngs = drawn
    for png in pngs:
        for ext, head in HEADERS.items():
            data = png.with_suffix(f".{ext}").read_bytes()
            assert data.startswith(head), (png.name, ext, data[:16])
            if ext == "svg":
                assert b"<svg" in data[:2000]


def test_no_title_wider_than_its_axes_nor_label_cut_off(drawn):
    figures, _ = drawn
    for name, fig in figures.items():
        r = FigureCanvasAgg(fig).get_renderer()  # closed figures lost their canvas
        fig.draw_without_rendering()
        fig_box = fig.bbox
        titles = [(ax.title, ax.get_window_extent(r)) for ax in fig.axes if ax.title.get_text()]
        if fig._suptitle is not None:
            titles.append((fig._suptitle, fig_box))
        for t, box in titles:
            ext = t.get_window_extent(r)
            assert ext.width <= box.width + 1, (name, t.get_text(), ext.width, box.width)
            assert ext.x0 >= fig_box.x0 - 1 and ext.x1 <= fig_box.x1 + 1, (name, t.get_text())
            assert ext.y1 <= fig_box.y1 + 1, (name, t.get_text())
        for lg in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]:  # legends inside too
            ext = lg.get_window_extent(r)
            assert fig_box.x0 - 1 <= ext.x0 and ext.x1 <= fig_box.x1 + 1, (name, "legend", ext, fig_box)
        for ax in fig.axes:  # and no axis label longer than the figure is wide (x) or high (y)
            for label in (ax.xaxis.label, ax.yaxis.label):
                ext = label.get_window_extent(r)
                assert fig_box.y0 - 1 <= ext.y0 and ext.y1 <= fig_box.y1 + 1, (name, label.get_text())
                assert fig_box.x0 - 1 <= ext.x0 and ext.x1 <= fig_box.x1 + 1, (name, label.get_text())


def test_no_absolute_path_in_titles(drawn):
    figures, _ = drawn
    texts = [t.get_text() for fig in figures.values() for t in
             [ax.title for ax in fig.axes] + ([fig._suptitle] if fig._suptitle else [])]
    assert any("stories.txt" in t for t in texts)  # the planted target is named ...
    assert not [t for t in texts if ABSOLUTE.search(t)]  # ... by its file name only


def test_units_on_the_axes(drawn):
    figures, _ = drawn
    for stem, axis, unit in UNITS:
        assert stem in figures, stem
        labels = [" ".join((ax.get_ylabel() if axis == "y" else ax.get_xlabel()).split()) for ax in
                  figures[stem].axes]  # long labels are wrapped
        assert any(unit in lb for lb in labels), (stem, labels)


def _tick_kinds(ax, axis: str) -> set[str]:
    a = ax.yaxis if axis == "y" else ax.xaxis
    lo, hi = sorted(ax.get_ylim() if axis == "y" else ax.get_xlim())
    labels = [t.get_text() for t in a.get_majorticklabels() + a.get_minorticklabels()
              if t.get_text() and t.get_visible() and lo <= (t.get_position()[1 if axis == "y" else 0]) <= hi]
    return {"power" if ("10^" in s or "times" in s or "10^{" in s) else "plain" for s in labels}


def test_log_axes_have_one_kind_of_tick_label(drawn):
    figures, _ = drawn
    seen = 0
    for name, fig in figures.items():
        FigureCanvasAgg(fig).draw()
        for ax in fig.axes:
            for axis in ("x", "y"):
                if (ax.get_yscale() if axis == "y" else ax.get_xscale()) == "log":
                    seen += 1
                    assert len(_tick_kinds(ax, axis)) <= 1, (name, axis, _tick_kinds(ax, axis))
    assert seen >= 3  # curvature, the gap panels, the spectrum


def test_not_converged_markers_stand_out(drawn):
    figures, _ = drawn
    rings = [ln for stem in ("sharpness_layers", "curvature") for ax in figures[stem].axes for ln in ax.get_lines()
             if ln.get_markerfacecolor() == "white" and len(ln.get_xdata())]
    assert rings, "no not-converged point drawn"
    lines = [ln for ax in figures["sharpness_layers"].axes for ln in ax.get_lines()]
    for ln in rings:
        assert ln.get_markersize() >= 8 and ln.get_markeredgewidth() >= 1.5, (ln.get_markersize(),
                                                                               ln.get_markeredgewidth())
        assert ln.get_zorder() > max(o.get_zorder() for o in lines if o is not ln and o.get_markerfacecolor()
                                     != "white")


def test_one_streams_figure_for_several_runs_with_greek_names(drawn):
    figures, _ = drawn
    streams = [s for s in figures if "streams" in s]
    assert streams == ["collapse_compare_streams"], streams
    titles = {ax.get_title() for ax in figures[streams[0]].axes}
    assert {"β", "γ", "μ", "ν"} <= titles, titles
    assert not titles & {"beta", "gamma", "mu", "nu"}


def test_size_presets_set_the_width():
    for size, (width, _, _) in style.SIZES.items():
        with style.output(size=size):
            fig, axes = style.new_figure(12.0, 4.0, ncols=4)
        assert fig.get_figwidth() == pytest.approx(width), size
        assert axes.shape == (1, 4)
        plt.close(fig)


def test_plot_format_and_size_options(tiny_run, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(tiny_run, run)
    res = CliRunner().invoke(app, ["plot", str(run), "--format", "pdf,svg", "--size", "page", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["formats"] == ["png", "pdf", "svg"]
    for p in out["pdf"]:
        assert Path(p).read_bytes().startswith(b"%PDF-")
    res = CliRunner().invoke(app, ["plot", str(run), "--format", "png,jpeg"])
    assert res.exit_code == 2 and "jpeg" in res.output, res.output
    res = CliRunner().invoke(app, ["plot", str(run), "--size", "poster"])
    assert res.exit_code == 2 and "poster" in res.output, res.output
    one_line_error(CliRunner().invoke(app, ["plot", str(tmp_path / "missing"), "--format", "pdf"]))
