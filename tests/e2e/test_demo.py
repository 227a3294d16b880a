"""`cemtool demo --quick` end to end (train, sharpness, per-layer curvature, collapse, forgetting, compare, plot in
one process), and bad input answered by one line."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app

from kit import one_line_error

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    res = invoke("demo", "--quick", "--seeds", "0", "--out", out, "--quiet", "--device", "cpu")
    assert res.exit_code == 0, res.output
    return out, res


def test_prints_where_the_report_is(demo):
    out, res = demo
    lines = res.stdout.strip().splitlines()
    assert lines[-1] == f"report: {out / 'report.md'}"
    assert lines[-2].startswith("demo took ") and "s CPU" in lines[-2]
    assert "comparison of 2 runs" in res.stdout  # the compare table


def test_every_step_left_its_files(demo):
    out, _ = demo
    study = json.loads((out / "study.json").read_text())
    assert study["status"] == "completed"
    assert [it["arch"] for it in study["items"]] == ["baseline", "tmm"]
    for it in study["items"]:
        run = out / it["run"]
        meta = json.loads((run / "meta.json").read_text())
        assert meta["status"] == "completed" and meta["tokens"] == study["plan"]["tokens"]
        for name in ("sharpness", "collapse", "sharpness-layer-0", "sharpness-layer-1"):
            assert (run / "reports" / f"{name}.json").exists(), (run, name)
        forget = json.loads((out / f"{it['run']}-ft-grammar-b" / "reports" / "forgetting.json").read_text())
        assert forget["source"]["arch"] == it["arch"] and forget["curve"][0]["step"] == 0
    compare = json.loads((out / "reports" / "compare.json").read_text())
    assert [a["label"] for a in compare["archs"]] == ["baseline", "tmm"]
    assert all(r["lambda_max"] is not None and r["forgetting"] is not None for r in compare["runs"])


def test_figures_and_report(demo):
    out, _ = demo
    for name in ("training", "compare", "forgetting", "sharpness_layers", "collapse_compare_layers",
                 "collapse_compare_attention"):
        assert (out / "plots" / f"{name}.png").stat().st_size > 1000, name
        assert (out / "plots" / f"{name}.svg").exists(), name
    md = (out / "report.md").read_text()
    assert md.startswith(f"# `cemtool demo`: {out.name}")
    for section in ("## Training curves", "## Study", "## Comparison", "## Forgetting and plasticity",
                    "## Curvature per layer", "## Representation collapse (comparison)", "## How long the demo took"):
        assert section in md, section
    for link in [line.split("](")[1].split(")")[0] for line in md.splitlines() if line.startswith("![")]:
        assert (out / link).exists(), link
    compare = json.loads((out / "reports" / "compare.json").read_text())
    lam = compare["archs"][1]["lambda_max"]["mean"]
    assert f"{lam:.4g}" in md  # the comparison table's numbers are in report.md


def test_timing_is_recorded(demo):
    out, _ = demo
    timing = json.loads((out / "reports" / "demo.json").read_text())
    steps = [s["step"] for s in timing["steps"]]
    assert steps == ["train + sharpness + collapse + forgetting", "curvature per layer", "compare", "plot"]
    assert all(s["wall_s"] > 0 and s["cpu_s"] >= 0 for s in timing["steps"])
    assert timing["total"]["wall_s"] >= sum(s["wall_s"] for s in timing["steps"]) * 0.99
    assert timing["settings"]["archs"] == "baseline,tmm" and timing["settings"]["seeds"] == "0"


def test_a_rerun_keeps_the_time_of_the_work(demo, tmp_path):
    """Issue 20 item 20: the demo run again on its folder reuses its runs and reports; report.md and demo.json keep
    the seconds of the run that did the work (not the 0.0 s of the reuse), and say which steps were reused."""
    import shutil

    out, _ = demo
    first = json.loads((out / "reports" / "demo.json").read_text())
    again = tmp_path / "demo"
    shutil.copytree(out, again, symlinks=True)
    res = invoke("demo", "--quick", "--seeds", "0", "--out", again, "--quiet", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert "reused from an earlier run of the demo" in res.stdout
    timing = json.loads((again / "reports" / "demo.json").read_text())
    train, layers = timing["steps"][:2]
    assert train["reused"] and layers["reused"] and not timing["steps"][2]["reused"]
    assert train["wall_s"] == first["steps"][0]["wall_s"] and train["rerun_wall_s"] < train["wall_s"]
    assert timing["total"]["wall_s"] == pytest.approx(sum(st["wall_s"] for st in timing["steps"]))
    section = (again / "report.md").read_text().split("## How long the demo took")[1]
    assert f"| {first['steps'][0]['wall_s']:.1f} |" in section
    assert "(reused: measured by the run that did it)" in section


def test_bad_input(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    one_line_error(invoke("demo", "--quick", "--out", f), "is not a directory")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    one_line_error(invoke("demo", "--quick", "--out", busy), "is not a study directory")
    one_line_error(invoke("demo", "--quick", "--archs", "baseline,nope", "--out", tmp_path / "x"),
                   "unknown architecture 'nope'")
    one_line_error(invoke("demo", "--quick", "--seeds", "zero", "--out", tmp_path / "y"), "seeds must be integers",
                   code=2)  # a bad option value: a usage error (issue 20 item 22)
    assert not Path(tmp_path / "x").exists() and not Path(tmp_path / "y").exists()


def test_every_json_file_is_strict_json(demo):
    """Reports are strict JSON (null, never NaN/Infinity): every .json the demo writes parses without Python's
    non-standard constants."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    out, _ = demo
    files = sorted(out.rglob("*.json"))
    assert len(files) > 20  # runs' config/meta, every report, the study, the comparison
    bad = []
    for f in files:
        try:
            json.loads(f.read_text(), parse_constant=refuse)
        except ValueError as e:
            bad.append(f"{f.relative_to(out)}: {e}")
    assert not bad, bad
