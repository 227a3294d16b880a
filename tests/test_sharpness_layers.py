"""cemtool sharpness --per-layer: λ_max and tr(H) of each layer's Hessian block against the dense block of a tiny
model; the one-command table (JSON, CSV, Markdown, stdout) with convergence flags and standard errors; report.md
shows it; bad combinations are clean errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_hessian import dense_hessian, tiny, tokens
from typer.testing import CliRunner

from cemtool.analysis.sharpness import SharpnessOptions, measure_per_layer, model_layers
from cemtool.cli.main import app

from conftest import one_line_error

runner = CliRunner()


def test_per_layer_matches_the_dense_hessian_block_of_each_layer():
    model = tiny(d=8, n_layer=2)
    x, y = tokens()
    opts = SharpnessOptions(dtype="fp64", lanczos_steps=80, tol=1e-10, trace_hvps=60, seed=0)
    layers = measure_per_layer(model, x, y, opts)
    assert [r.layer for r in layers] == model_layers(model) == [0, 1]
    exact = []
    for r in layers:
        names = [n for n, _ in model.named_parameters() if n.startswith(f"blocks.{r.layer}.")]
        H = dense_hessian(model, x, y, names)  # the block H_SS of the full Hessian
        assert r.n_params == H.shape[0]
        ev = torch.linalg.eigvalsh(H)
        assert r.lambda_max == pytest.approx(float(ev[-1]), rel=1e-6)
        assert r.lambda_max_converged is True and r.lambda_max_error < 1e-6 * abs(r.lambda_max)
        tr = float(torch.trace(H))
        assert abs(r.trace - tr) <= 4 * r.trace_se + 1e-8 * abs(tr), (r.trace, r.trace_se, tr)
        assert r.trace_per_param == pytest.approx(r.trace / r.n_params)
        exact.append(float(ev[-1]))
    assert exact[0] != pytest.approx(exact[1], rel=1e-3)  # the layers' blocks differ: each row is its own layer


def test_per_layer_budgets_and_skips():
    model = tiny(d=8, n_layer=2)
    x, y = tokens()
    only_eig = measure_per_layer(model, x, y, SharpnessOptions(dtype="fp64", lanczos_steps=10, trace_hvps=0))
    assert all(r.trace is None and r.trace_hvps == 0 and r.lanczos_hvps <= 10 for r in only_eig)
    only_tr = measure_per_layer(model, x, y, SharpnessOptions(dtype="fp64", lanczos_steps=0, top_k=0, bottom_k=0,
                                                              trace_hvps=8, trace_methods=("hutchinson",)))
    assert all(r.lambda_max is None and r.trace_hvps == 8 and r.trace_method == "hutchinson" for r in only_tr)
    w = model.blocks[0].attn.wq.weight.detach().clone()
    measure_per_layer(model, x, y, SharpnessOptions(dtype="fp32", lanczos_steps=4, top_k=1, bottom_k=0,
                                                    trace_hvps=4))
    assert torch.equal(model.blocks[0].attn.wq.weight, w) and model.blocks[0].attn.wq.weight.requires_grad


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
    assert csv[0].startswith("layer,n_params,lambda_max,lambda_max_error,lambda_max_converged,trace,trace_se")
    assert len(csv) == 3
    md = open(reports + ".md").read()
    assert "| layer | n_params | lambda_max |" in md and md.count("\n| ") == 3  # header + 2 layers
    text = runner.invoke(app, args[:-1])
    assert text.exit_code == 0 and "per-layer curvature" in text.stdout and "converged" in text.stdout
    # report.md shows the table; the plot command takes the report for what it is
    res = runner.invoke(app, ["plot", run_copy])
    assert res.exit_code == 0, res.output
    assert "Curvature per layer" in open(f"{run_copy}/report.md").read()


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
