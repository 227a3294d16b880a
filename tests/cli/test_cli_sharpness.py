"""`cemtool sharpness`: help, a tiny real run (reports, CSV, figures, summary), the PyHessian extra, bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool import jobs
from cemtool.cli.main import app

from kit import one_line_error

QUICK = ["--quick", "--device", "cpu", "--quiet", "--trace-hvps", "8", "--lanczos-steps", "10",
         "--density-steps", "12", "--slice-points", "3"]


@pytest.fixture()
def run_dir(tiny_run, tmp_path):
    return str(shutil.copytree(tiny_run, tmp_path / "run"))


def invoke(*args: str):
    return CliRunner().invoke(app, ["sharpness", *args])


def test_help_lists_the_options():
    res = invoke("--help")
    assert res.exit_code == 0
    for opt in ("--tokens", "--params", "--top-k", "--bottom-k", "--trace-hvps", "--density-runs", "--sam-rho",
                "--landscape", "--backend", "--dtype", "--quick"):
        assert opt in res.output


def test_a_tiny_run_writes_reports_figures_and_a_summary(run_dir):
    from pathlib import Path

    res = invoke(run_dir, *QUICK, "--landscape", "both", "--trace-method", "hutch++,xtrace", "--ascent-steps", "2")
    assert res.exit_code == 0, res.output
    rep = json.loads((Path(run_dir) / "reports" / "sharpness.json").read_text())
    n_tokens = rep["tokens"]
    assert n_tokens == 1024 and rep["provenance"]["tokens"] == n_tokens and rep["provenance"]["step"] == 30
    assert f"N = {n_tokens:,} tokens" in res.output  # the token count is always printed
    assert "λ_max" in res.output and "sharpness SAM" in res.output
    eig = rep["eigen"]
    assert len(eig["top"]) == 3 and len(eig["top_converged"]) == 3 and eig["hvps"] <= 10
    assert [t["method"] for t in rep["traces"]] == ["hutch++", "xtrace"] and all(t["se"] > 0 for t in rep["traces"])
    kinds = [(s["kind"], s["ascent_steps"]) for s in rep["sharpness"]]
    assert ("sam", 2) in kinds and ("asam", 1) in kinds and ("average", 0) in kinds
    assert rep["hvps"] == eig["hvps"] + 2 * 8 + rep["density"]["hvps"]
    csv = (Path(run_dir) / "reports" / "sharpness.csv").read_text().splitlines()
    assert csv[0].startswith("quantity,index,value,uncertainty") and any(r.startswith("lambda_top,1,") for r in csv)
    for fig in ("sharpness_spectrum", "sharpness_slice_1d", "sharpness_slice_2d"):
        assert (Path(run_dir) / "plots" / f"{fig}.png").stat().st_size > 1000


def test_central_difference_hvps_give_the_exact_eigenvalues(run_dir):
    """--hvp fd (fp64) against the exact double backward (fp64) on the same run and tokens; the option is recorded."""
    from pathlib import Path

    reports = {}
    for method in ("exact", "fd"):
        res = invoke(run_dir, *QUICK, "--dtype", "fp64", "--hvp", method, "--name", f"hvp-{method}",
                     "--landscape", "none", "--trace-hvps", "0", "--density-runs", "0")
        assert res.exit_code == 0, res.output
        reports[method] = json.loads((Path(run_dir) / "reports" / f"hvp-{method}.json").read_text())
    assert reports["fd"]["options"]["hvp"] == "fd" and reports["exact"]["options"]["hvp"] == "exact"
    for a, b in zip(reports["fd"]["eigen"]["top"], reports["exact"]["eigen"]["top"], strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_per_layer_report_and_json(run_dir):
    from pathlib import Path

    res = invoke(run_dir, *QUICK, "--params", "layer:1", "--landscape", "none", "--json", "--no-plot")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["options"]["params"] == "layer:1" and all(n.startswith("blocks.1.") for n in rep["param_names"])
    assert (Path(run_dir) / "reports" / "sharpness-layer-1.json").exists()


def test_pyhessian_backend_without_pyhessian_names_the_extra(run_dir, monkeypatch):
    """PyHessian is an optional extra: without it --backend pyhessian is one line naming the extra, exit 1, before
    the model is loaded. The cross-check itself is benchmarks/pyhessian_crosscheck.py (it needs the extra)."""
    monkeypatch.setitem(sys.modules, "pyhessian", None)  # what an environment without PyHessian imports
    monkeypatch.setattr(jobs, "open_subject", lambda *a, **k: pytest.fail("the model was loaded"))  # run_job opens
    res = invoke(run_dir, *QUICK, "--backend", "pyhessian")
    one_line_error(res, code=1)
    assert res.output.strip() == 'Error: --backend pyhessian needs PyHessian: pip install "cemtool[pyhessian]"'
    assert not (Path(run_dir) / "reports" / "sharpness_pyhessian.json").exists()


@pytest.mark.parametrize("args, message", [
    (["--params", "nonexistent.*"], "matches no parameter"),
    (["--checkpoint", "step_999"], "does not exist"),
    (["--trace-method", "magic"], "unknown trace method"),
    (["--density-sigma", "-1"], "density_sigma must be a positive number"),
    (["--density-sigma", "0"], "density_sigma must be a positive number"),
    (["--top-k", "3", "--lanczos-steps", "3"], "need at least 4 Lanczos steps"),
    (["--name", "../../escape"], "not a plain name"),
    (["--hvp", "fd"], "needs --dtype fp64"),
    (["--hvp", "jvp", "--dtype", "fp64"], "unknown HVP method"),
    (["--hvp", "fd", "--dtype", "fp64", "--backend", "pyhessian"], "--hvp fd is cemtool's own HVP"),
])
def test_bad_input_is_one_line(run_dir, args, message):
    res = invoke(run_dir, *QUICK, *args)
    # an option refused on its own, before the run is read, is a usage error (issue 20 item 22)
    usage = args[0] in ("--trace-method", "--density-sigma", "--top-k", "--hvp")
    assert res.exit_code == (2 if usage else 1), res.output
    assert "Error: " in res.output and message in res.output and "Traceback" not in res.output


def test_missing_checkpoint_and_missing_run(run_dir, tmp_path):
    from pathlib import Path

    (Path(run_dir) / "checkpoints" / "final.safetensors").unlink()
    res = invoke(run_dir, *QUICK)
    assert res.exit_code == 1 and "no final checkpoint" in res.output
    res = invoke(str(tmp_path / "nowhere"), *QUICK)
    assert res.exit_code == 1 and "does not exist" in res.output


def test_a_file_is_not_a_run_directory(run_dir):
    from pathlib import Path

    res = invoke(str(Path(run_dir) / "config.json"), *QUICK)
    assert res.exit_code == 1 and "is a file, not a run directory" in res.output


def test_the_default_report_is_strict_json(run_dir):
    from pathlib import Path

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    res = invoke(run_dir, *QUICK, "--landscape", "none", "--no-plot")
    assert res.exit_code == 0, res.output
    rep = json.loads((Path(run_dir) / "reports" / "sharpness.json").read_text(), parse_constant=refuse)
    assert rep["density"]["runs"] == 1 and "trace" not in rep["density"]


def test_tokens_used_and_requested_are_said_on_stdout_and_in_the_report(run_dir):
    from pathlib import Path

    res = invoke(run_dir, *QUICK, "--tokens", "5", "--landscape", "none", "--no-plot")
    assert res.exit_code == 0, res.output
    rep = json.loads((Path(run_dir) / "reports" / "sharpness.json").read_text())
    assert rep["tokens_requested"] == 5 and rep["tokens"] > 5
    assert f"note: {rep['tokens']} evaluation tokens used of 5 requested" in res.output  # printed even with -q
    assert rep["notes"] == [res.output.split("note: ")[1].strip()]


def test_model_too_large_for_fp64_is_one_line(run_dir, monkeypatch):
    from cemtool import memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 1 << 20)
    res = invoke(run_dir, *QUICK, "--dtype", "fp64")
    assert res.exit_code == 1
    assert "too large" in res.output and "fp64" in res.output and "--dtype fp32" in res.output


def test_bad_usage_exits_2(run_dir):
    assert invoke(run_dir, "--backend", "magic").exit_code == 2
    assert invoke(run_dir, "--top-k", "-1").exit_code == 2
    res = invoke(run_dir, *QUICK, "--tokens", "0")  # refused by cemtool, not Click: exit 2 all the same
    assert res.exit_code == 2 and res.output.startswith("Error: --tokens must be positive"), res.output


def test_the_stage_bar_completes_when_a_stage_stops_early():
    from cemtool.cli.sharpness_cmd import StageBar

    with StageBar(quiet=True) as bar:
        for done in range(21):
            bar("eigenvalues (Lanczos)", done, 40)
        bar("eigenvalues (Lanczos)", 20, 20)  # Lanczos converged after 20 of 40 steps
        task = bar.bar.tasks[0]
        assert task.finished and task.completed == task.total == 20
        assert task.fields["status"] == "stopped early (20 of 40)"


def test_quick_keeps_the_options_given_on_the_command_line(run_dir):
    res = invoke(run_dir, *QUICK, "--tokens", "512", "--top-k", "5", "--landscape", "none", "--no-plot", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert rep["tokens"] == rep["tokens_requested"] == 512 and len(rep["eigen"]["top"]) == 5  # not capped to 3
