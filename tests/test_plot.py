"""`cemtool plot` on tiny real runs: the figures carry the saved numbers, report.md shows them, it works on reports
alone (checkpoints deleted), and bad input is answered by one line."""

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
from cemtool.plots.training import FLOOR_COLOR, SEED_STYLES, read_run, training_figure
from cemtool.report import fmt

from conftest import train_tiny

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
    """Two tiny grammar runs (baseline seed 0, tmm seed 1) with sharpness (whole model and per layer), collapse
    and forgetting reports, made by the real commands."""
    root = tmp_path_factory.mktemp("plot")
    base = Path(train_tiny(root / "base"))
    tmm = Path(train_tiny(root / "tmm", arch="tmm", extra=["train.max_steps=20", "seed=1"]))
    cheap = ["--device", "cpu", "-q", "--quick", "--tokens", "128", "--no-plot"]
    res = invoke("sharpness", base, *cheap, "--landscape", "1d", "--slice-points", "5")
    assert res.exit_code == 0, res.output
    for run in (base, tmm):
        for layer in (0, 1):
            res = invoke("sharpness", run, *cheap, "--params", f"layer:{layer}", "--trace-hvps", "4",
                         "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0", "--avg-rho", "0",
                         "--landscape", "none")
            assert res.exit_code == 0, res.output
        res = invoke("collapse-report", run, "--tokens", "128", "--per-class", "8", "--folds", "2", "-q",
                     "--no-plots")
        assert res.exit_code == 0, res.output
    res = invoke("forgetting", base, "--to", "grammar-b", "--steps", "4", "--eval-every", "2", "--eval-tokens",
                 "256", "--device", "cpu", "-q")
    assert res.exit_code == 0, res.output
    return root, base, tmm


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
        assert any(np.allclose(ln.get_ydata(), [t["train_loss"] for t in c.train]) for ln in train)
        g = [ln for ln in gap.get_lines() if ln.get_label() == c.label][0]
        assert np.allclose(g.get_ydata(), [v["val_loss"] - v["val_floor"] for v in c.val])
    floor = curves[0].floor
    assert floor is not None and 2.5 < floor < 4.0  # the grammar corpus's exact floor (nats/token)
    floors = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert len(floors) == 1 and np.allclose(floors[0].get_ydata(), floor)
    assert to_rgb(floors[0].get_color()) == to_rgb(FLOOR_COLOR)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["baseline (seed 0)", "tmm (seed 1)", f"entropy floor {floor:.3f}"]
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


def test_compare_bars_are_mean_and_standard_error():
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
    assert math.isclose(gap_a["se"], np.std([0.5, 0.7, 0.6], ddof=1) / math.sqrt(3))
    assert by["gap"]["values"][1]["se"] is None  # one run: no error bar
    assert math.isclose(by["lambda_max"]["values"][0]["mean"], 12.0)
    assert by["forgetting"]["values"][0] is None and by["forgetting"]["values"][1]["mean"] == 0.2
    assert "plasticity" not in by  # no run has it


def test_training_groups_are_mean_and_standard_error(tmp_path):
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
    band = ax.collections[0].get_paths()[0].vertices[:, 1]  # mean ± s.e. at the shared points
    se = np.std([5.0, 5.2, 5.1], ddof=1) / math.sqrt(3)
    assert np.isclose(band.max(), 5.1 + se) and np.isclose(band.min(), 4.2 - np.std([4.0, 4.4, 4.2], ddof=1) / 3 ** .5)
    assert line.get_label() == "baseline[model.d_model=32] (n=3)"
    import matplotlib.pyplot as plt

    plt.close(fig)
    paths = plot_training_groups(runs, tmp_path / "plots")
    assert paths[0].read_bytes()[:8] == PNG_MAGIC


def test_compare_layers_are_mean_and_standard_error(tmp_path):
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
    assert np.allclose(a["se"], [np.std([2.0, 2.2, 2.1], ddof=1) / math.sqrt(3),
                                 np.std([1.0, 1.4, 1.3], ddof=1) / math.sqrt(3)])
    assert [r["label"] for r in m["separability"]] == ["b"]  # only lime has it
    paths = plot_compare_layers(report, tmp_path)
    assert [p.name for p in paths] == ["compare_layers.png", "compare_layers.svg"]
    assert paths[0].read_bytes()[:8] == PNG_MAGIC


def test_captions_and_eval_table(study):
    assert "entropy floor" in caption(Path("training.png"))
    assert "LIMe router" in caption(Path("collapse_compare_routing_lime.png"))
    assert "spectral density" in caption(Path("sharpness-layer-0_spectrum.png"))
    assert "forgetting" in caption(Path("forgetting.png"))
    r = read_run(study[1])
    table = eval_table(r, max_rows=2)
    assert table.count("\n") == 4  # header, rule, first and last evaluation
    assert fmt(r.val[-1]["val_loss"]) in table


# --------------------------------------------------------------------------------------------------------------
# the command


def test_plot_run_from_reports_alone(study, tmp_path):
    """The run's checkpoints are deleted: every figure is still drawn and report.md shows the saved numbers."""
    _, base, _ = study
    run = tmp_path / "base"
    shutil.copytree(base, run)
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "plots", ignore_errors=True)
    res = invoke("plot", run, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    names = sorted(Path(p).name for p in out["figures"])
    assert names == ["collapse_attention.png", "collapse_layers.png", "sharpness_layers.png",
                     "sharpness_slice_1d.png", "sharpness_spectrum.png", "training.png"]
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
    assert "| base | baseline | 0 | completed | 30 |" in md and "| tmm | tmm | 1 | completed | 20 |" in md
    assert "base-ft-grammar-b" in md and "## Forgetting and plasticity" in md
    forget = json.loads((root / "base-ft-grammar-b" / "reports" / "forgetting.json").read_text())
    assert f"{forget['forgetting']:+.4f}" in md
    layer0 = json.loads((tmm / "reports" / "sharpness-layer-0.json").read_text())
    assert "| tmm | 0 |" in md and fmt(layer0["eigen"]["top"][0]) in md  # the per-layer table names the runs
    assert not (base / "report.md").exists()  # --no-each-run


def test_forgetting_curves_are_the_report(study):
    from cemtool.plots import compare

    root, _, _ = study
    rep = json.loads((root / "base-ft-grammar-b" / "reports" / "forgetting.json").read_text())
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
    assert "# Comparison of 2 runs" in md and "[base](../base/report.md)" in md
    assert (tmp_path / "tmm" / "plots" / "training.png").exists()  # each run's own figures too


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
    code = ("import sys; from typer.testing import CliRunner; from cemtool.cli.main import app; "
            f"r = CliRunner().invoke(app, ['plot', {str(run)!r}, '-q']); "
            "print(r.exit_code, 'torch' in sys.modules)")
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
