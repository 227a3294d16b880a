"""cemtool sharpness --per-layer (the measures against dense blocks: tests/unit/test_sharpness_per_layer.py): the
one-command table (JSON, CSV, Markdown, stdout) with convergence flags and standard errors; report.md
shows it; bad combinations are clean errors."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app

from kit import one_line_error

runner = CliRunner()


@pytest.fixture
def run_copy(tiny_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tiny_run, dst, ignore=shutil.ignore_patterns("reports", "plots", "report.md"))
    return str(dst)


def test_per_layer_command_writes_one_table(run_copy):
    args = ["sharpness", run_copy, "--per-layer", "--quick", "--tokens", "64", "--device", "cpu", "--quiet"]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert [r["layer"] for r in rep["layers"]] == [0, 1]
    for r in rep["layers"]:
        assert isinstance(r["lambda_max_converged"], bool) and r["trace_se"] > 0 and r["trace_method"] == "xtrace"
        assert r["lambda_max"] > 0 and r["n_params"] > 0
    assert rep["provenance"]["analysis"] == "sharpness_per_layer" and rep["tokens"] == 64
    reports = f"{run_copy}/reports/sharpness-per-layer"
    csv = open(reports + ".csv").read().splitlines()
    assert csv[0].startswith("block,layer,kind,n_params,lambda_max,lambda_max_error,lambda_max_converged,trace,"
                             "trace_se")
    assert len(csv) == 3
    md = open(reports + ".md").read()
    assert "| block | layer | kind | n_params | lambda_max |" in md and md.count("\n| ") == 3  # header + 2 layers
    text = runner.invoke(app, args[:-1])
    assert text.exit_code == 0 and "per-layer curvature" in text.stdout and "converged" in text.stdout
    # report.md shows the table; the plot command takes the report for what it is, and lays its figure out at two
    # layers (it collapsed there once: matplotlib's constrained_layout gave up on a 3.3 x 2.4 in figure)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = runner.invoke(app, ["plot", run_copy])
    assert res.exit_code == 0, res.output
    assert not [w for w in caught if "constrained_layout not applied" in str(w.message)]
    assert "Curvature per layer" in open(f"{run_copy}/report.md").read()


def test_blocks_by_kind_of_another_operator_is_its_own_report(run_copy):
    args = ["sharpness", run_copy, "--blocks", "kind", "--operator", "ggn", "--quick", "--tokens", "64",
            "--lanczos-steps", "6", "--trace-hvps", "4", "--device", "cpu"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "per-block (kind) curvature (ggn)" in res.stdout and "tr(G)" in res.stdout
    rep = json.loads(open(f"{run_copy}/reports/sharpness-ggn-blocks-kind.json").read())
    assert rep["blocks"] == "kind" and rep["options"]["operator"] == "ggn"
    kinds = {(r["layer"], r["kind"]) for r in rep["layers"]}
    assert {(0, "q"), (1, "mlp-out"), (None, "embed")} <= kinds
    assert all(r["lambda_max"] >= 0 for r in rep["layers"])  # a PSD operator's blocks are PSD
    assert not Path(run_copy, "reports", "sharpness-per-layer.json").exists()  # the Hessian's report untouched
    bad = runner.invoke(app, ["sharpness", run_copy, "--blocks", "layer,kind", "--device", "cpu"])
    assert bad.exit_code != 0 and bad.output.count("Error") == 1


@pytest.mark.parametrize("args, code, words", [
    (["--params", "layer:0"], 2, ["--per-layer"]),
    (["--backend", "pyhessian"], 2, ["--backend"]),
    (["--trace-method", "xtrace,hutchinson"], 1, ["one --trace-method"]),
    (["--lanczos-steps", "0", "--trace-hvps", "0", "--top-k", "0", "--bottom-k", "0"], 1, ["nothing to measure"]),
])
def test_per_layer_bad_combinations(tiny_run, args, code, words):
    res = runner.invoke(app, ["sharpness", tiny_run, "--per-layer", "--device", "cpu", *args])
    if code == 1:
        one_line_error(res, *words)
    else:
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        for w in words:
            assert w in res.output
