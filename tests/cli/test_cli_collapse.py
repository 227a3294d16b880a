"""`cemtool collapse-report` end to end on tiny real runs: one run, a baseline-vs-LIMe comparison, bad input."""

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.errors import CemtoolError

from kit import train_tiny


@pytest.fixture(scope="module")
def runs(tiny_run, text_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("collapse")
    base = root / "base"
    shutil.copytree(tiny_run, base)
    lime = train_tiny(root / "lime", arch="lime", data=text_file, extra=["data.tokenizer=byte",
                                                                         "data.val_fraction=0.1"])
    return base, root / "lime" if lime else None


def test_help():
    res = CliRunner().invoke(app, ["collapse-report", "--help"])
    assert res.exit_code == 0 and "--alpha" in res.output


def test_one_run(runs):
    base, _ = runs
    res = CliRunner().invoke(app, ["collapse-report", str(base), "--tokens", "512", "--per-class", "40", "-q",
                                   "--no-plots"])
    assert res.exit_code == 0, res.output
    assert "collapse" in res.output and "skipped" in res.output  # byte tokenizer: no whole-word tokens
    rep = json.loads((base / "reports" / "collapse.json").read_text())
    (run,) = rep["runs"]
    assert run["arch"] == "baseline" and run["collapse"]["tokens"] == 512
    assert run["routing"].startswith("not applicable") and run["stream_scalars"].startswith("not applicable")
    layer = run["collapse"]["layers"][0]
    assert layer["probe"]["hidden"].startswith("not applicable") and "whole-word" in layer["probe"]["hidden"]
    assert run["collapse"]["probe_classes"]["counts"] == [0, 0, 0, 0]
    assert len(layer["attention"]["curves"]["entropy"][0]) == 16
    csv = (base / "reports" / "collapse.csv").read_text().splitlines()
    assert csv[0].startswith("run,arch,layer,head,measure") and len(csv) > 20
    assert not (base / "plots" / "collapse_layers.png").exists()  # --no-plots


def test_comparison_baseline_vs_lime(runs, tmp_path):
    base, lime = runs
    out = tmp_path / "cmp"
    res = CliRunner().invoke(app, ["collapse-report", str(base), str(lime), "--tokens", "256", "--alpha", "1",
                                   "--out", str(out), "-q", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)
    assert {r["run"] for r in rows} == {"base", "lime"} and len(rows) == 4
    rep = json.loads((out / "collapse_compare.json").read_text())
    assert [r["arch"] for r in rep["runs"]] == ["baseline", "lime"]
    routing = rep["runs"][1]["routing"]
    assert routing["variant"] == "static" and len(routing["layers"]) == 2
    assert (out / "plots" / "collapse_compare_layers.png").exists()
    assert (out / "plots" / "collapse_compare_routing_lime.png").exists()
    assert (lime / "reports" / "collapse.json").exists()


def test_bad_input(runs, tmp_path):
    base, _ = runs
    r = CliRunner()
    res = r.invoke(app, ["collapse-report", str(tmp_path / "nope")])
    assert res.exit_code == 1 and res.output.count("Error:") == 1 and "does not exist" in res.output
    res = r.invoke(app, ["collapse-report", str(base), "--alpha", "0"])
    assert res.exit_code == 2
    res = r.invoke(app, ["collapse-report", str(base), "--words", "horse,cart", "--tokens", "64"])
    assert res.exit_code == 1 and "not single tokens" in res.output
    res = r.invoke(app, ["collapse-report", str(base), "--tokens", "4"])
    assert res.exit_code == 1 and "fewer than one window" in res.output
    res = r.invoke(app, ["collapse-report"])
    assert res.exit_code == 2


def test_empty_words_are_refused_not_replaced_by_the_defaults(tmp_path):
    from cemtool.analysis.collapse import probe_classes
    from cemtool.data.tokenizer import word_tokenizer

    for words in ["", " ", ",", " , "]:
        res = CliRunner().invoke(app, ["collapse-report", str(tmp_path / "nope"), "--words", words])
        assert res.exit_code == 2 and "--words" in res.output and "is empty" in res.output, res.output
    tok, x = word_tokenizer(["is", "are", "was", "were"]), np.zeros((2, 8), dtype=np.int64)
    with pytest.raises(CemtoolError, match="at least 2 words"):
        probe_classes(tok, x, words=[])
    with pytest.raises(CemtoolError, match="are empty or hold spaces"):  # what --words "is,,are" passes now
        probe_classes(tok, x, words=["is", "", "are"])


def test_named_reports_keep_each_setting(runs):
    base, _ = runs
    r = CliRunner()
    args = ["collapse-report", str(base), "--tokens", "256", "--per-class", "16", "-q", "--no-plots"]
    assert r.invoke(app, args).exit_code == 0
    res = r.invoke(app, [*args[:3], "512", *args[4:], "--name", "collapse-512", "--alpha", "1"])
    assert res.exit_code == 0, res.output
    first = json.loads((base / "reports" / "collapse.json").read_text())
    second = json.loads((base / "reports" / "collapse-512.json").read_text())
    assert first["provenance"]["options"]["tokens"] == 256 and first["runs"][0]["collapse"]["tokens"] == 256
    assert second["provenance"]["options"]["tokens"] == 512 and second["provenance"]["options"]["alpha"] == 1
    assert second["provenance"]["name"] == "collapse-512"
    from cemtool.report import named_reports

    found = {n.name: n for n in named_reports(base, kind="collapse")}
    assert {"collapse", "collapse-512"} <= set(found) and found["collapse-512"].options["min_per_class"] == 16
    res = r.invoke(app, [*args, "--name", "../../escape"])
    assert res.exit_code == 1 and res.output.count("Error:") == 1 and not (base.parent / "escape.json").exists()
    res = r.invoke(app, [*args, "--min-per-class", "32"])
    assert res.exit_code == 2 and "--min-per-class" in res.output  # --per-class 16 could never reach it


def test_defaults_match_the_api_and_the_device_is_auto():
    import inspect
    from dataclasses import fields

    from cemtool.analysis.collapse import MIN_PER_CLASS, Options
    from cemtool.cli.collapse_cmd import collapse_report_cmd

    cli = {k: v.default for k, v in inspect.signature(collapse_report_cmd).parameters.items()}
    api = {f.name: f.default for f in fields(Options)}
    assert set(api) <= set(cli)
    for k, default in api.items():
        assert default == cli[k], k  # every option has the command's default (the Options dataclass holds it)
    assert cli["min_per_class"] == MIN_PER_CLASS and cli["device"] == "auto" and cli["checkpoint"] == "final"


def test_plot_draws_reports_under_any_name(runs, tmp_path, monkeypatch):
    """`plot` sees every named report: collapse-report --name goes to the collapse figures under its own name,
    a sharpness --params layer:N report under any name to the eigenvalues-per-layer figure."""
    from cemtool.plots import render

    run = tmp_path / "run"
    shutil.copytree(runs[0], run, ignore=shutil.ignore_patterns("plots", "reports"))
    res = CliRunner().invoke(app, ["collapse-report", str(run), "--tokens", "64", "--per-class", "16", "--name",
                                   "coll", "-q", "--no-plots"])
    assert res.exit_code == 0, res.output
    layer = {"provenance": {"analysis": "sharpness", "backend": "cemtool"}, "options": {"params": "layer:0"},
             "tokens": 64, "eigen": {"top": [2.0], "bottom": [-0.1]}}
    (run / "reports" / "first-layer.json").write_text(json.dumps(layer))
    drawn = []
    monkeypatch.setitem(render.PLOTTERS, "collapse", lambda rep, plots, stem: drawn.append((stem, rep)) or [])
    figures: dict = {}
    problems: list[str] = []
    reports = render._plot_reports(render.find_reports(run), run / "plots", figures, problems)
    assert not problems and [stem for stem, _ in drawn] == ["coll"] and drawn[0][1] == reports["coll"][1]
    entries, sources = render._layer_entries([run])
    assert sources == [run / "reports" / "first-layer.json"] and entries[0]["reports"] == [layer]


def test_plot_flags_merged_collapse_reports_with_different_settings(tmp_path, monkeypatch):
    from cemtool.plots import render

    runs = []
    for name, tokens in (("a", 2048), ("b", 2048), ("c", 512)):
        (tmp_path / name / "reports").mkdir(parents=True)
        rep = {"provenance": {"command": "collapse-report", "options": {"tokens": tokens, "device": name}},
               "runs": [{"label": name, "summary": []}]}
        (tmp_path / name / "reports" / "collapse.json").write_text(json.dumps(rep))
        runs.append(tmp_path / name)
    monkeypatch.setattr(render, "_collapse", lambda payload, plots, stem: [])
    notes: list[str] = []
    render._collapse_all(runs, tmp_path / "plots", {}, {}, [], notes)
    assert notes == [f"the merged collapse reports were measured with different settings: tokens: 2048 "
                     f"({tmp_path.name}/a, {tmp_path.name}/b), 512 ({tmp_path.name}/c)"]
