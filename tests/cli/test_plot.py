"""`cemtool plot` on the demo's committed runs (sample_runs/demo): the figures carry the saved numbers, report.md
shows them, it works on reports alone (no checkpoints, torch never imported), and bad input is answered by one
line."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.plots.compare import compare_measures, layer_of
from cemtool.plots.report_md import caption, eval_table
from cemtool.plots.style import arch_color
from cemtool.plots.training import FLOOR_COLOR, SEED_STYLES, read_run, smoothed, training_figure
from cemtool.report import fmt

DEMO = Path(__file__).resolve().parents[2] / "sample_runs" / "demo"
runner = CliRunner()
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def usage_error(res, *words):
    """Click's usage error (exit 2) naming the option."""
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    for w in words:
        assert w in res.output, (w, res.output)


def one_line_error(res, code, *words):
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert lines[0].startswith("Error: ") and "Traceback" not in res.output, res.output
    for w in words:
        assert w in res.output, (w, res.output)


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Two of the demo's committed runs (baseline seed 0 and tmm seed 1, each with sharpness of the whole model and
    per layer and collapse) and the baseline's fine-tune (forgetting), copied from sample_runs/demo without their
    figures, report.md and the baseline's saturation report (its figures are tested below from their own data):
    reports the real commands wrote, nothing trained here."""
    root = tmp_path_factory.mktemp("plot") / "study"
    root.mkdir()
    for name in ("baseline-s0", "tmm-s1", "baseline-s0-ft-grammar-b"):
        shutil.copytree(DEMO / name, root / name, ignore=shutil.ignore_patterns("plots", "report.md", "saturation*"))
    return root, root / "baseline-s0", root / "tmm-s1"


# --------------------------------------------------------------------------------------------------------------
# the figures carry the saved numbers


def test_training_figure_lines_are_the_metrics(study):
    _, base, tmm = study
    curves = [read_run(base), read_run(tmm)]
    fig = training_figure(curves)
    ax, gap = fig.axes[0], fig.axes[1]
    for c, ls in zip(curves, SEED_STYLES[:2], strict=True):  # seeds 0 and 1 -> the first two styles
        val = [line for line in ax.get_lines() if line.get_label() == c.label]
        assert len(val) == 1
        line = val[0]
        assert np.allclose(line.get_ydata(), [v["val_loss"] for v in c.val])
        assert np.allclose(line.get_xdata(), [v["tokens"] for v in c.val])
        assert np.allclose(to_rgb(line.get_color()), arch_color(c.arch)[:3])
        assert line.get_linestyle() == {"-": "-", "-.": "-."}[ls]
        train = [ln for ln in ax.get_lines() if np.allclose(to_rgb(ln.get_color()), arch_color(c.arch)[:3])
                 and ln.get_label().startswith("_")]
        assert any(np.allclose(ln.get_ydata(), smoothed([t["train_loss"] for t in c.train])) for ln in train)
        g = [ln for ln in gap.get_lines() if ln.get_label() == c.label][0]
        assert np.allclose(g.get_ydata(), [v["val_loss"] - v["val_floor"] for v in c.val])
    floor = curves[0].floor
    assert floor is not None and 2.5 < floor < 4.0  # the grammar corpus's exact floor (nats/token)
    floors = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(floors) == 1 and np.allclose(floors[0].get_ydata(), floor)
    assert to_rgb(floors[0].get_color()) == to_rgb(FLOOR_COLOR)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["baseline (seed 0)", "tmm (seed 1)", "training loss: moving average over 5% of the run's batches",
                      f"entropy floor {floor:.3f}"]
    assert ax.get_xlabel() == "tokens seen" and "nats/token" in ax.get_ylabel()
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_line_styles_tell_runs_apart():
    from cemtool.plots.training import RunCurves, distinguishable, line_styles

    def run(arch, seed, name):
        return RunCurves(Path(name), arch, seed, {}, {})

    by_seed = [run("baseline", 0, "a"), run("baseline", 1, "b"), run("tmm", 0, "c")]
    assert line_styles(by_seed) == [SEED_STYLES[0], SEED_STYLES[1], SEED_STYLES[0]]
    same = [run("baseline", 0, "lr1"), run("baseline", 0, "lr2"), run("tmm", 0, "t")]  # differ in other settings
    assert line_styles(same) == [SEED_STYLES[0], SEED_STYLES[1], SEED_STYLES[0]]
    assert distinguishable(same)
    many = [run("baseline", 0, f"r{i}") for i in range(len(SEED_STYLES) + 1)]
    assert not distinguishable(many)


def test_compare_bars_are_mean_and_the_tables_std():
    """Issue 20 item 19: the figures' error bars are the tables' ± (std over seeds, ddof 1), not a standard error."""
    runs = [{"label": "a", "arch": "baseline", "seed": s, "val_loss": v, "val_floor": 3.0, "lambda_max": lm,
             "forgetting": None} for s, v, lm in ((0, 3.5, 10.0), (1, 3.7, 14.0), (2, 3.6, 12.0))]
    runs.append({"label": "b", "arch": "tmm", "seed": 0, "val_loss": 3.4, "val_floor": 3.0, "lambda_max": 5.0,
                 "forgetting": 0.2})
    report = {"archs": [{"label": "a", "arch": "baseline"}, {"label": "b", "arch": "tmm"}], "runs": runs}
    groups, measures = compare_measures(report)
    assert [g["label"] for g in groups] == ["a", "b"]
    by = {m["key"]: m for m in measures}
    gap_a = by["gap"]["values"][0]
    assert math.isclose(gap_a["mean"], 0.6) and gap_a["n"] == 3
    assert math.isclose(gap_a["std"], np.std([0.5, 0.7, 0.6], ddof=1)) and "se" not in gap_a
    assert by["gap"]["values"][1]["std"] is None  # one run: no error bar
    assert math.isclose(by["lambda_max"]["values"][0]["mean"], 12.0)
    assert by["forgetting"]["values"][0] is None and by["forgetting"]["values"][1]["mean"] == 0.2
    assert "plasticity" not in by  # no run has it
    assert by["lambda_max"]["name"] == "largest eigenvalue λ_max(H)"  # no operator recorded: the Hessian
    _, measures = compare_measures({**report, "curvature_operator": "ggn"})
    assert {m["key"]: m for m in measures}["lambda_max"]["name"] == "largest eigenvalue λ_max(G)"  # a GGN's panel


def test_training_groups_are_mean_and_std_over_seeds(tmp_path):
    from cemtool.plots.training import RunCurves, group_runs, plot_training_groups, training_groups_figure

    def run(name, arch, seed, vals, cfg=None):
        val = [{"step": 10 * (i + 1), "tokens": 1000 * (i + 1), "val_loss": v, "val_floor": 3.0}
               for i, v in enumerate(vals)]
        config = {"seed": seed, "model": {"arch": arch, "d_model": 32, **(cfg or {})}}
        return RunCurves(tmp_path / name, arch, seed, {}, config, [], val)

    runs = [run("a0", "baseline", 0, [5.0, 4.0, 3.5]), run("a1", "baseline", 1, [5.2, 4.4, 3.7]),
            run("a2", "baseline", 2, [5.1, 4.2]),  # stopped early: the shared points only
            run("w0", "baseline", 0, [4.0, 3.6, 3.3], {"d_model": 48})]
    groups = group_runs(runs)
    assert {k: [r.path.name for r in v] for k, v in groups.items()} == {
        "baseline[model.d_model=32]": ["a0", "a1", "a2"], "baseline[model.d_model=48]": ["w0"]}
    assert group_runs(runs, {str(r.path): "all" for r in runs}) == {"all": runs}  # a compare.json's labels
    fig = training_groups_figure(groups)
    ax, gx = fig.axes[:2]
    line = next(ln for ln in ax.get_lines() if ln.get_label().startswith("baseline[model.d_model=32]"))
    assert list(line.get_xdata()) == [1000, 2000] and np.allclose(line.get_ydata(), [5.1, 4.2])
    gap = next(ln for ln in gx.get_lines() if ln.get_label().startswith("baseline[model.d_model=32]"))
    assert np.allclose(gap.get_ydata(), [2.1, 1.2]) and gx.get_yscale() == "log"
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # mean ± std over seeds (as in the tables; item 19)
    assert np.isclose(band.max(), 5.1 + np.std([5.0, 5.2, 5.1], ddof=1))
    assert np.isclose(band.min(), 4.2 - np.std([4.0, 4.4, 4.2], ddof=1))
    assert line.get_label() == "baseline[model.d_model=32] (n=3)"
    import matplotlib.pyplot as plt

    plt.close(fig)
    paths = plot_training_groups(runs, tmp_path / "plots")
    assert paths[0].read_bytes()[:8] == PNG_MAGIC


def test_compare_layers_are_mean_and_std_over_seeds(tmp_path):
    from cemtool.plots.compare import layer_measures, plot_compare_layers

    ent = {0: [2.0, 1.0], 1: [2.2, 1.4], 2: [2.1, 1.3]}
    runs = [{"label": "a", "arch": "baseline", "seed": s, "layers": [
        {"layer": i, "value_entropy": h, "separability": None} for i, h in enumerate(ent[s])]} for s in ent]
    runs.append({"label": "b", "arch": "lime", "seed": 0, "layers": [{"layer": 0, "value_entropy": 2.5,
                                                                      "separability": 0.9}]})
    report = {"archs": [{"label": "a", "arch": "baseline"}, {"label": "b", "arch": "lime"}], "runs": runs}
    m = layer_measures(report)
    a = m["value_entropy"][0]
    assert a["layers"] == [0, 1] and a["n"] == [3, 3]
    assert np.allclose(a["mean"], [2.1, 1.2 + 0.1 / 3])
    assert np.allclose(a["std"], [np.std([2.0, 2.2, 2.1], ddof=1), np.std([1.0, 1.4, 1.3], ddof=1)])
    assert [r["label"] for r in m["separability"]] == ["b"]  # only lime has it
    paths = plot_compare_layers(report, tmp_path)
    assert [p.name for p in paths] == ["compare_layers.png", "compare_layers.svg"]
    assert paths[0].read_bytes()[:8] == PNG_MAGIC


def test_captions_and_eval_table(study):
    from cemtool.plots.report_md import figures_md

    (tmp := study[0] / "captions").mkdir(exist_ok=True)
    (tmp / "training.png").write_bytes(PNG_MAGIC)
    assert "entropy floor" in figures_md([tmp / "training.png"], tmp, floor=True)
    assert "floor" not in figures_md([tmp / "training.png"], tmp, floor=False)  # a text corpus has none
    assert "LIMe router" in caption(Path("collapse_compare_routing_lime.png"))
    assert "spectral density" in caption(Path("sharpness-layer-0_spectrum.png"))
    assert "forgetting" in caption(Path("forgetting.png"))
    r = read_run(study[1])
    table = eval_table(r, max_rows=2)
    assert table.count("\n") == 4  # header, rule, first and last evaluation
    assert fmt(r.val[-1]["val_loss"]) in table
    assert "bits/byte" in table.splitlines()[0] and fmt(r.val[-1]["val_bpb"]) in table  # beside nats/token
    from cemtool.plots.report_md import run_markdown

    md = run_markdown(study[1], {}, {})
    assert f"{fmt(r.meta['val_bpb'])} bits/byte" in md


# --------------------------------------------------------------------------------------------------------------
# the command


def test_plot_run_from_reports_alone(study, tmp_path):
    """A run without checkpoints (the committed runs keep none): every figure is still drawn and report.md shows the
    saved numbers."""
    _, base, _ = study
    run = tmp_path / "base"
    shutil.copytree(base, run)
    assert not (run / "checkpoints").exists() and not (run / "plots").exists()
    res = invoke("plot", run, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    names = sorted(Path(p).name for p in out["figures"])
    assert names == ["collapse_attention.png", "collapse_layers.png", "sharpness_layers.png",
                     "sharpness_slice_1d.png", "sharpness_slice_2d.png", "sharpness_spectrum.png", "training.png"]
    for p in out["figures"]:
        assert Path(p).read_bytes()[:8] == PNG_MAGIC
        assert Path(p).with_suffix(".svg").read_text().lstrip().startswith("<?xml")
    assert "tokens seen" in (run / "plots" / "training.svg").read_text()
    md = (run / "report.md").read_text()
    meta = json.loads((run / "meta.json").read_text())
    sharp = json.loads((run / "reports" / "sharpness.json").read_text())
    layer1 = json.loads((run / "reports" / "sharpness-layer-1.json").read_text())
    assert f"{fmt(meta['val_loss'])} nats/token" in md
    assert fmt(sharp["eigen"]["top"][0]) in md and fmt(layer1["eigen"]["top"][0]) in md
    collapse = json.loads((run / "reports" / "collapse.json").read_text())
    assert f"{collapse['runs'][0]['summary'][0]['v_entropy']:.3f}" in md
    for section in ("## Training curves", "## Curvature and sharpness", "## Curvature per layer",
                    "## Representation collapse"):
        assert section in md
    for link in [line.split("](")[1].split(")")[0] for line in md.splitlines() if line.startswith("![")]:
        assert (run / link).exists(), link
    assert out["reports"] == [str(run / "report.md")] and out["problems"] == []


def test_plot_sweep_folder(study):
    """A folder of runs: on shared axes the training curves (the fine-tune listed, not overlaid), the forgetting
    curves, the eigenvalues per layer and the merged collapse reports (each run's own figures: --each-run, the
    default, tested on one run above)."""
    root, base, tmm = study
    res = invoke("plot", root, "--no-each-run")
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-2] == f"report  {root / 'report.md'}"
    for name in ("training", "forgetting", "sharpness_layers", "collapse_compare_layers"):
        assert (root / "plots" / f"{name}.png").exists() and (root / "plots" / f"{name}.svg").exists(), name
    md = (root / "report.md").read_text()
    steps = {r.name: json.loads((r / "meta.json").read_text())["step"] for r in (base, tmm)}
    assert f"| baseline-s0 | baseline | 0 | completed | {steps['baseline-s0']} |" in md
    assert f"| tmm-s1 | tmm | 1 | completed | {steps['tmm-s1']} |" in md
    assert "baseline-s0-ft-grammar-b" in md and "## Forgetting and plasticity" in md
    forget = json.loads((root / "baseline-s0-ft-grammar-b" / "reports" / "forgetting.json").read_text())
    assert f"{forget['forgetting']:+.4f}" in md
    layer0 = json.loads((tmm / "reports" / "sharpness-layer-0.json").read_text())
    assert "| tmm-s1 | 0 |" in md and fmt(layer0["eigen"]["top"][0]) in md  # the per-layer table names the runs
    assert not (base / "report.md").exists()  # --no-each-run


def test_forgetting_curves_are_the_report(study):
    from cemtool.plots import compare

    root, _, _ = study
    rep = json.loads((root / "baseline-s0-ft-grammar-b" / "reports" / "forgetting.json").read_text())
    figs = {}
    orig = compare.save
    compare.save = lambda fig, d, name: figs.setdefault(name, fig) and []
    try:
        compare.plot_forgetting([rep], root / "unused")
    finally:
        compare.save = orig
    src_ax, tgt_ax = figs["forgetting"].axes
    (src,) = [ln for ln in src_ax.get_lines() if ln.get_label().startswith("baseline")]
    assert np.allclose(src.get_xdata(), [p["step"] for p in rep["curve"]])
    assert np.allclose(src.get_ydata(), [p["source_loss"] for p in rep["curve"]])
    (tgt,) = [ln for ln in tgt_ax.get_lines() if ln.get_label().startswith("baseline")]
    assert np.allclose(tgt.get_ydata(), [p["target_loss"] for p in rep["curve"]])
    assert f"{rep['forgetting']:+.3f}" in src.get_label() and f"{rep['plasticity']:+.3f}" in tgt.get_label()


def test_layer_reports_are_recognised(study):
    _, base, _ = study
    rep = json.loads((base / "reports" / "sharpness-layer-1.json").read_text())
    assert layer_of(rep) == 1
    assert layer_of(json.loads((base / "reports" / "sharpness.json").read_text())) is None


def test_several_runs_into_out(study, tmp_path):
    _, base, tmm = study
    out = tmp_path / "both"
    bare = []
    for run in (base, tmm):  # metrics, config and meta only
        shutil.copytree(run, tmp_path / run.name, ignore=shutil.ignore_patterns("checkpoints", "reports", "plots"))
        bare.append(tmp_path / run.name)
    res = invoke("plot", *bare, "--out", out, "-q")
    assert res.exit_code == 0, res.output
    assert res.output.strip().splitlines()[-1] == f"report  {out / 'report.md'}"  # -q: the report.md paths
    assert (out / "plots" / "training.png").exists()
    md = (out / "report.md").read_text()
    assert "# Comparison of 2 runs" in md and "[baseline-s0](../baseline-s0/report.md)" in md
    assert (tmp_path / "tmm-s1" / "plots" / "training.png").exists()  # each run's own figures too


# --------------------------------------------------------------------------------------------------------------
# bad input: one line


def test_bad_input(study, tmp_path):
    _, base, tmm = study
    one_line_error(invoke("plot", tmp_path / "nope"), 1, "does not exist")
    (tmp_path / "empty").mkdir()
    one_line_error(invoke("plot", tmp_path / "empty"), 1, "holds no cemtool run")
    f = tmp_path / "file.txt"
    f.write_text("x")
    one_line_error(invoke("plot", f), 1, "is not a directory")
    usage_error(invoke("plot", base, tmm), "--out", "several paths")
    one_line_error(invoke("plot", base, tmp_path / "empty", "--out", tmp_path / "o"), 1, "is not a cemtool run")
    usage_error(invoke("plot", base, "--out", tmp_path / "o"), "--out", "one run")
    broken = tmp_path / "broken"
    shutil.copytree(base, broken, ignore=shutil.ignore_patterns("checkpoints"))
    (broken / "config.json").write_text("{not json")
    one_line_error(invoke("plot", broken), 1, "config file", "is corrupt")


def test_corrupt_report_is_one_line_and_the_rest_is_drawn(study, tmp_path):
    _, base, _ = study
    run = tmp_path / "run"
    shutil.copytree(base, run, ignore=shutil.ignore_patterns("checkpoints", "plots", "sharpness*"))
    (run / "reports" / "collapse.json").write_text('{"runs": [{"label": 1}]}')  # not what collapse writes
    res = invoke("plot", run, "-q")
    assert res.exit_code == 1
    err = [line for line in res.stderr.splitlines() if line.startswith("Error: ")]
    assert len(err) == 1 and "collapse.json does not have the shape" in err[0]
    assert (run / "plots" / "training.png").exists()
    assert "collapse.json does not have the shape" in (run / "report.md").read_text()  # under Notes


def test_collapse_figures_tell_seeds_of_one_arch_apart():
    from cemtool.plots.collapse import _style

    runs = [{"arch": "baseline", "label": "baseline-s0"}, {"arch": "baseline", "label": "baseline-s1"},
            {"arch": "tmm", "label": "tmm-s0"}]
    styles = [_style(runs, k) for k in range(3)]
    assert (styles[0]["color"], styles[0]["dash"]) != (styles[1]["color"], styles[1]["dash"])
    assert styles[0]["marker"] != styles[1]["marker"]
    assert styles[0]["color"] != styles[2]["color"]


def test_plot_does_not_import_torch(study, tmp_path):
    """cemtool plot works from JSON reports alone: drawing a run's figures must not pay torch's import (seconds)."""
    import subprocess
    import sys

    _, base, _ = study
    run = tmp_path / "base"
    shutil.copytree(base, run)
    code = (f"import sys; sys.argv = ['cemtool', 'plot', {str(run)!r}, '-q']; from cemtool.cli.main import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    print(e.code or 0, 'torch' in sys.modules)")
    # (the entry point itself, its exit included)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["0", "False"], out


def test_many_runs_are_averaged_not_overlaid(tmp_path):
    """13 runs (more than one pair of axes can show): no overlay, but the per-group mean curves, and a note."""
    from cemtool.plots.render import MAX_OVERLAID

    n = MAX_OVERLAID + 1
    for i in range(n):
        arch, seed = ("baseline", i) if i % 2 else ("tmm", i)
        d = tmp_path / f"{arch}-s{seed}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": seed, "model": {"arch": arch, "d_model": 32}}))
        (d / "meta.json").write_text(json.dumps({"status": "completed", "arch": arch, "seed": seed}))
        rows = [{"step": s, "tokens": 100 * s, "val_loss": 5.0 - 0.1 * s + 0.01 * i, "val_floor": 3.0}
                for s in (1, 2, 3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = invoke("plot", tmp_path, "--no-each-run")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "plots" / "training.png").exists()
    assert (tmp_path / "plots" / "training_groups.png").exists()
    md = (tmp_path / "report.md").read_text()
    assert f"no overlaid training curves of all {n} runs" in md and "training_groups" in md
    # too many groups to tell apart: neither figure, and a note
    for i in range(len(SEED_STYLES) + 1):
        d = tmp_path / f"wide{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"seed": 0, "model": {"arch": "baseline", "d_model": 40 + i}}))
        (d / "meta.json").write_text(json.dumps({"status": "completed", "arch": "baseline", "seed": 0}))
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "tokens": 100, "val_loss": 5.0}) + "\n")
    (tmp_path / "plots" / "training_groups.png").unlink()
    res = invoke("plot", tmp_path, "--no-each-run")
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "plots" / "training_groups.png").exists()
    assert "no averaged training curves" in (tmp_path / "report.md").read_text()


def test_legend_columns_fit_the_figure_and_variants_are_counted():
    from cemtool.plots.style import legend_below, new_figure, variant_index

    assert variant_index(["tmm", "baseline", "tmm", "tmm", "lime"]) == [0, 0, 1, 2, 0]
    for labels, ncol in ((["a", "b", "c"], 3), (["x" * 40] * 4, 1), (["x" * 20] * 8, 3)):
        fig, axes = new_figure(6.4, 4.0)
        handles = [axes[0, 0].plot([0, 1], [0, 1])[0] for _ in labels]
        legend_below(fig, handles, labels)
        assert fig.legends[0]._ncols == ncol, (labels[0], fig.legends[0]._ncols)
        import matplotlib.pyplot as plt

        plt.close(fig)


# --------------------------------------------------------------------------------------------------------------
# readable figures (issue 10, item 14): every figure is drawn through Figure.savefig, where it is caught


@pytest.fixture
def drawn(monkeypatch):
    """``drawn(plot_fn, *args)`` -> {figure name: Figure}: the figures a plotting function saved, caught as they are
    written (after any layout), named by the files it returns, in order."""
    from matplotlib.figure import Figure

    def run(fn, *args, **kwargs):
        seen = []
        orig = Figure.savefig

        def catch(self, *a, **k):
            if not seen or seen[-1] is not self:
                seen.append(self)
            return orig(self, *a, **k)

        monkeypatch.setattr(Figure, "savefig", catch)
        try:
            paths = fn(*args, **kwargs)
        finally:
            monkeypatch.setattr(Figure, "savefig", orig)
        return dict(zip(dict.fromkeys(Path(p).stem for p in paths), seen, strict=True))

    return run


def test_each_format_is_one_draw_of_the_layout_the_checks_measured(tmp_path, monkeypatch):
    """style.save lays a figure out for its checks (ticks, titles), then writes each format with one draw of that
    layout: no layout engine is left on the figure, since even "none"'s placeholder engine makes every savefig
    draw the figure once more before its real draw."""
    from matplotlib.figure import Figure

    from cemtool.plots import style

    fig, axes = style.new_figure(5.0, 3.0, ncols=2)
    for ax in axes[0]:
        ax.plot([0, 1, 2], [1, 0, 2])
        ax.set_title("a title long enough to be wrapped onto more lines by the checks of style.save " * 2)
    draws, per_save, boxes = [], [], []
    draw, savefig = Figure.draw, Figure.savefig

    def counted_draw(self, renderer):
        draws.append(type(renderer).__name__)
        return draw(self, renderer)

    def counted_savefig(self, *a, **k):
        before = len(draws)
        boxes.append([ax.get_position().bounds for ax in self.axes])
        out = savefig(self, *a, **k)
        per_save.append(draws[before:])
        return out

    monkeypatch.setattr(Figure, "draw", counted_draw)
    monkeypatch.setattr(Figure, "savefig", counted_savefig)
    paths = style.save(fig, tmp_path, "f", formats=("png", "svg"))
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 1000 for p in paths)
    assert len(per_save) == 2 and all(len(d) == 1 for d in per_save), per_save  # one draw per format
    assert "\n" in axes[0, 0].title.get_text()  # the checks did wrap the title (they ran)
    assert boxes[0] == boxes[1] == [ax.get_position().bounds for ax in fig.axes]  # the layout the checks made


def overlapping_ticks(ax) -> bool:
    """Whether two visible x tick labels of a drawn axes overlap (their boxes in display pixels)."""
    boxes = sorted((t.get_window_extent() for t in ax.get_xticklabels() if t.get_visible() and t.get_text()),
                   key=lambda b: b.x0)
    return any(b.x0 < a.x1 - 1.0 for a, b in zip(boxes, boxes[1:]))


def wcag_contrast(color) -> float:
    """Contrast ratio against white, WCAG 2.1 (computed here, independently of cemtool.plots.style)."""
    lin = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in to_rgb(color)]
    return 1.05 / (0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2] + 0.05)


def test_every_architecture_colour_has_contrast():
    from cemtool.models.registry import archs

    for c in [arch_color(a) for a in [*archs(), "some-new-arch", "another"]]:
        assert wcag_contrast(c) >= 3.0, c  # WCAG 2.1 non-text contrast against the white axes
    common = ["baseline", "tmm", "lime", "cem", "hb", "nesterov", "adam", "adamw", "rmsprop", "muon", "ortho", "soap",
              "shampoo"]  # the momentum study's figure holds all of these at once
    assert len({arch_color(a) for a in common}) == len(common)


def compare_report(tokens=(2048, 2048, 2048, 2048)):
    """A text-corpus comparison (no floor): validation losses 0.05 nats apart, curvatures, forgetting."""
    runs = []
    for i, (arch, seed) in enumerate((("baseline", 0), ("baseline", 1), ("tmm", 0), ("tmm", 1))):
        runs.append({"label": arch, "arch": arch, "seed": seed, "val_loss": 3.50 + 0.05 * (arch == "tmm") + 0.01 * seed,
                     "val_floor": None, "lambda_max": 1234.5 * (i + 1) ** 3, "trace_per_param": 1.3e-5 * (i + 1) ** 3,
                     "sharpness_tokens": tokens[i], "forgetting": 0.1 * i, "plasticity": 0.2})
    return {"archs": [{"label": "baseline", "arch": "baseline"}, {"label": "tmm", "arch": "tmm"}], "runs": runs,
            "correlations": [{"x": "trace_per_param", "y": "forgetting", "rho": 1.0, "p": 0.08,
                              "p_method": "exact permutation", "n": 4},
                             {"x": "lambda_max", "y": "forgetting", "rho": 1.0, "p": 0.08,
                              "p_method": "exact permutation", "n": 4}]}


def test_compare_shows_points_with_intervals_in_curvature_units(drawn, tmp_path):
    from matplotlib.patches import Rectangle

    from cemtool.plots.compare import plot_compare

    figs = drawn(plot_compare, compare_report(), tmp_path)
    fig = figs["compare"]
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title()}
    loss = panels["final validation loss"]
    assert not [p for ax in fig.axes for p in ax.patches if isinstance(p, Rectangle)]  # no bars from zero
    lo, hi = loss.get_ylim()
    assert 3.3 < lo < 3.5 and hi < 3.7  # zoomed on the data: a 0.05-nat difference is a fifth of the axis
    for name in ("largest eigenvalue λ_max(H)", "trace per parameter tr(H)/n"):
        assert "²" in panels[name].get_ylabel() and panels[name].get_ylabel() != "nats/token", name
        assert "N = 2,048 tokens" in panels[name].get_title()
    assert loss.get_ylabel() == "nats/token"
    for ax in figs["compare_correlations"].axes:
        assert not overlapping_ticks(ax), ax.get_xlabel()
        assert "nats/token per" in ax.get_xlabel()


def test_compare_marks_curvatures_from_different_token_counts(drawn, tmp_path):
    from cemtool.plots.compare import plot_compare

    figs = drawn(plot_compare, compare_report(tokens=(1024, 2048, 1024, 4096)), tmp_path)
    titles = [" ".join(ax.get_title().split()) for ax in figs["compare"].axes]  # long titles are wrapped
    assert sum("mixed N = 1,024, 2,048, 4,096 tokens" in t for t in titles) == 2  # λ_max and tr(H)/n
    assert "mixed N" in figs["compare_correlations"].axes[0].get_title()
    legend = [t.get_text() for t in figs["compare"].legends[0].get_texts()]
    assert legend == [f"run measured on N = {n:,} tokens" for n in (1024, 2048, 4096)]


def integer_layer_ticks(ax, layers) -> bool:
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    return bool(ticks) and all(float(t).is_integer() and min(layers) <= t <= max(layers) for t in ticks)


def test_collapse_layer_figure_reads_the_same_in_every_panel(study, drawn, tmp_path):
    from cemtool.plots.collapse import plot_layers

    _, base, tmm = study
    reps = [json.loads((r / "reports" / "collapse.json").read_text()) for r in (base, tmm)]
    report = {"runs": [e for r in reps for e in r["runs"]]}
    fig = drawn(plot_layers, report, tmp_path)["collapse_layers"]
    run = report["runs"][0]
    layers = [e["layer"] for e in run["collapse"]["layers"]]
    def mean(v):
        return v["mean"] if isinstance(v, dict) else v

    truth = {"matrix entropy": lambda e, k: mean(e[k]["entropy"]),
             "effective rank": lambda e, k: mean(e[k]["erank_all"]),
             "mean pairwise cosine": lambda e, k: mean(e[k]["cosine"])}
    for ax in fig.axes:
        if not ax.get_title():
            continue  # the text panel
        assert ax.get_ylabel(), ax.get_title()
        assert integer_layer_ticks(ax, layers), (ax.get_title(), ax.get_xticks())
        assert ax.get_legend() is None
        for name, get in truth.items():
            if ax.get_title().startswith(name):  # solid = values, dashed = hidden states, in every panel
                lines = [ln for ln in ax.get_lines() if len(ln.get_ydata()) == len(layers)
                         and np.allclose(to_rgb(ln.get_color()), arch_color(run["arch"]))]
                solid = [ln for ln in lines if ln.get_linestyle() == "-"]
                dashed = [ln for ln in lines if ln.get_linestyle() == "--"]
                assert any(np.allclose(ln.get_ydata(), [get(e, "values") for e in run["collapse"]["layers"]])
                           for ln in solid), name
                assert any(np.allclose(ln.get_ydata(), [get(e, "hidden") for e in run["collapse"]["layers"]])
                           for ln in dashed), name
        if ax.get_title().startswith("linear-probe"):
            assert ax.get_ylim()[1] <= 1.02 + 1e-9  # an accuracy
    assert fig.legends  # outside the axes


def routing_report(n_layer=3, heads=4):
    rng = np.random.default_rng(0)
    layers = []
    for i in range(n_layer):
        blocks = [[m * heads, (m + 1) * heads] for m in range(i + 1)]
        W = rng.normal(0, 0.3 * (i + 1), (heads, heads * (i + 1)))
        layers.append({"layer": i, "heatmap": W.tolist(), "source_blocks": blocks, "share": [1 / (i + 1)] * (i + 1),
                       "self_retrieval": [1.0 + 0.01 * i] * heads, "expected_layer": i / 2})
    return {"label": "lime (seed 0)", "arch": "lime",
            "routing": {"variant": "static", "source": "router", "signed": True, "layers": layers}}


def test_routing_figure_shares_one_scale_and_splits_units(drawn, tmp_path):
    from cemtool.plots.collapse import plot_routing

    fig = drawn(plot_routing, routing_report(), tmp_path, "routing")["routing"]
    images = [im for ax in fig.axes for im in ax.get_images()]
    assert len(images) == 3 and len({im.get_clim() for im in images}) == 1  # one colour scale
    lim = max(np.abs(np.array(e["heatmap"])).max() for e in routing_report()["routing"]["layers"])
    assert np.isclose(images[0].get_clim()[1], lim)
    assert sum(ax.get_label() == "<colorbar>" for ax in fig.axes) == 1
    for ax in fig.axes:
        if ax.get_images():  # a labelled tick per source layer, not per head
            labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
            assert labels == [str(m) for m in range(len(labels))]
    ylabels = {ax.get_ylabel() for ax in fig.axes if ax.get_lines()}
    layer_ax = [ax for ax in fig.axes if ax.get_ylabel() == "expected source layer"]
    weight_ax = [ax for ax in fig.axes if "weight on the own layer" in ax.get_ylabel()]
    assert len(layer_ax) == 1 and len(weight_ax) == 1 and layer_ax != weight_ax, ylabels


def saturation_reports():
    layers = [{"layer": i, "ranks": [0, 2, 4, 8], "truncation": "rope planes", "tolerated_rank": 4,
               "per_head": [{"head": h, "loss_increase": [0.1 / (h + 1), 0.05, 0.01, 0.0]} for h in range(2)],
               "layer_loss_increase": [0.3, 0.1, 0.02, 0.0]} for i in range(2)]
    logits = {"0": {"context_length": [1, 2, 4, 8], "logit_range": [[0, 1, 2, 3], [0, 1.5, 2, 2.5]]}}
    sat = {"saturation": {"layers": layers, "tolerance": 0.01, "logits": logits}}
    sweep = {"task": "ngram", "budget": 16, "steps": 10, "seeds": [0], "summary": [
        {"seq_len": 16, "saturation_head_dim": 4, "points": [{"head_dim": d, "loss": 1.0 / d, "se": None,
                                                              "floor": 0.1} for d in (2, 4, 8)]}]}
    return sat, sweep


def test_saturation_legends_sit_outside_the_axes(drawn, tmp_path):
    from cemtool.plots.saturation import plot_logits, plot_sweep, plot_truncation

    sat, sweep = saturation_reports()
    figs = {**drawn(plot_truncation, sat, tmp_path), **drawn(plot_logits, sat, tmp_path),
            **drawn(plot_sweep, sweep, tmp_path)}
    for name in ("saturation_truncation", "saturation_logits", "saturation_sweep"):
        fig = figs[name]
        assert fig.legends and all(ax.get_legend() is None for ax in fig.axes), name
        legend_box = fig.legends[0].get_window_extent()
        for ax in fig.axes:  # below the axes, not on them
            assert legend_box.y1 <= ax.get_window_extent().y0 + 1.0, name


def test_one_layer_of_eigenvalues_has_a_plain_axis(drawn, tmp_path):
    from cemtool.plots.compare import plot_layer_eigenvalues

    rep = {"options": {"params": "layer:0"}, "tokens": 1024,
           "eigen": {"top": [12.3456789], "top_error": [1e-6], "top_converged": [True], "bottom": [-0.0123],
                     "bottom_error": [1e-6], "bottom_converged": [True]},
           "traces": [{"per_param": 0.00123456, "per_param_se": 1e-7}]}
    fig = drawn(plot_layer_eigenvalues, [{"label": "baseline (seed 0)", "arch": "baseline", "seed": 0,
                                          "reports": [rep]}], tmp_path)["sharpness_layers"]
    for ax in fig.axes:
        assert ax.yaxis.get_offset_text().get_text() == "", ax.get_title()  # no '+1.2346e1' at the top
        labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
        assert len(set(labels)) == len(labels) and max(len(t) for t in labels) <= 8, labels
        assert [t.get_text() for t in ax.get_xticklabels() if t.get_text()] == ["0"]
        assert "²" in ax.get_ylabel()


def test_training_loss_is_smoothed_and_says_so():
    from cemtool.plots.training import RunCurves, smoothed

    noisy = [5.0 - 0.01 * i + (0.5 if i % 2 else -0.5) for i in range(200)]
    train = [{"step": i, "tokens": 100 * i, "train_loss": v} for i, v in enumerate(noisy)]
    val = [{"step": i, "tokens": 100 * i, "val_loss": 5.0 - 0.01 * i} for i in range(0, 200, 50)]
    run = RunCurves(Path("r"), "baseline", 0, {}, {}, train, val)
    fig = training_figure([run])
    ax = fig.axes[0]
    (thin,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("_") and len(ln.get_ydata()) == 200]
    y = np.asarray(thin.get_ydata())
    trend = 5.0 - 0.01 * np.arange(200)
    assert np.std(y - trend) < 0.1 * np.std(np.array(noisy) - trend)  # the batch-to-batch noise is gone ...
    assert np.abs(y[5:-5] - trend[5:-5]).max() < 0.06  # ... and the trend is kept
    assert np.allclose(y, smoothed(noisy))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("moving average" in t for t in labels)
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_text_run_report_describes_only_what_exists(tiny_run, tmp_path):
    run = tmp_path / "tiny"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("checkpoints", "plots", "report.md"))
    res = invoke("plot", run, "-q")
    assert res.exit_code == 0, res.output
    md = (run / "report.md").read_text()
    data_row = next(line for line in md.splitlines() if line.startswith("| data |"))
    assert " - " not in data_row and "?" not in data_row and "byte tokenizer" in data_row, data_row
    caption = next(line for line in md.splitlines() if line.startswith("*training:"))
    assert "floor" not in caption, caption  # a text corpus has no floor line
    assert "| floor |" not in md and "| gap |" not in md


def block_report(n_layer: int = 12, operator: str = "ggn") -> dict:
    """A hand-made `sharpness --blocks kind` report: λ_max = 10 * layer + kind index + 1 (so every cell is known),
    the trace negative in layer 0's q block (a Hessian's blocks can be), layer 3's v block not converged."""
    kinds = ["q", "k", "v", "o", "mlp-in", "mlp-out", "norm"]
    rows = [{"layer": layer, "kind": kind, "block": f"layer {layer}: {kind}", "n_params": 64,
             "lambda_max": 10.0 * layer + i + 1, "lambda_max_converged": not (layer == 3 and kind == "v"),
             "trace": -5.0 if (layer, kind) == (0, "q") else 100.0 * (layer + 1) + i, "trace_se": 1.0}
            for layer in range(n_layer) for i, kind in enumerate(kinds)]
    rows += [{"layer": None, "kind": "embed", "block": "outside layers: embed", "n_params": 512,
              "lambda_max": 0.5, "lambda_max_converged": True, "trace": 7.0, "trace_se": 0.1}]
    return {"layers": rows, "blocks": "kind", "tokens": 2048, "options": {"operator": operator},
            "provenance": {"analysis": "sharpness_per_layer", "arch": "baseline"}}


def test_block_heat_map_cells_are_the_report_and_readable_at_12_layers(drawn, tmp_path):
    from matplotlib.colors import LogNorm, SymLogNorm

    from cemtool.plots.blocks import OUTSIDE, block_grid, plot_blocks
    from cemtool.plots.render import PLOTTERS
    from cemtool.report import report_kind

    rep = block_report()
    kinds, cols, lam, ok = block_grid(rep, "lambda_max")
    assert kinds == ["q", "k", "v", "o", "mlp-in", "mlp-out", "norm", "embed"]
    assert cols == [str(i) for i in range(12)] + [OUTSIDE]
    for r in rep["layers"]:
        j = cols.index(OUTSIDE if r["layer"] is None else str(r["layer"]))
        assert lam[kinds.index(r["kind"]), j] == r["lambda_max"]
    assert np.isnan(lam[kinds.index("embed"), 0]) and np.isnan(lam[0, cols.index(OUTSIDE)])  # no such block
    assert not ok[kinds.index("v"), 3] and ok.sum() == ok.size - 1

    figs = drawn(plot_blocks, rep, tmp_path, "sharpness-blocks-kind_blocks")
    fig = figs["sharpness-blocks-kind_blocks"]
    lam_ax, tr_ax = [a for a in fig.axes if a.get_images()]
    assert isinstance(lam_ax.get_images()[0].norm, LogNorm)  # all positive: log colours
    assert isinstance(tr_ax.get_images()[0].norm, SymLogNorm)  # a negative trace: symmetric log
    assert "generalised Gauss-Newton" in lam_ax.get_title() and "* not converged" in lam_ax.get_title()
    texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in lam_ax.texts}
    assert texts[(3, kinds.index("v"))] == "33*" and texts[(11, kinds.index("norm"))] == "117"
    assert texts[(0, kinds.index("embed"))] == "–"
    assert not overlapping_ticks(lam_ax) and not overlapping_ticks(tr_ax)
    # every cell's label fits inside its cell (readable, not overprinted)
    for ax in (lam_ax, tr_ax):
        to_px = ax.transData.transform
        cell_w = abs(to_px((1, 0))[0] - to_px((0, 0))[0])
        cell_h = abs(to_px((0, 1))[1] - to_px((0, 0))[1])
        for t in ax.texts:
            box = t.get_window_extent()
            assert box.width < cell_w and box.height < cell_h, (t.get_text(), box.width, cell_w)
    # the per-layer report kind draws it (any name; the Hessian's too)
    plot = PLOTTERS[report_kind("sharpness-ggn-per-layer", rep)]
    paths = plot(block_report(4, "hessian"), tmp_path, "sharpness-per-layer")
    assert [p.name for p in paths] == ["sharpness-per-layer_blocks.png", "sharpness-per-layer_blocks.svg"]
    assert caption(paths[0]).startswith("per block")
