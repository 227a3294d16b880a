"""Defects scripts/fuzz_cli.py found (issue 20: bad input gets one clear line), one test each."""

from typer.testing import CliRunner

from cemtool.cli.main import app

from kit import one_line_error

runner = CliRunner()


def test_config_with_a_folder_among_several_files_is_one_line(tmp_path):
    # fuzz seed 0, case 50: `config -c '' -c runs/new ...` printed "config: composed ..." before the error
    good = tmp_path / "a.toml"
    good.write_text("[train]\nlr = 1e-3\n")
    res = runner.invoke(app, ["config", "-c", str(good), "-c", str(tmp_path)])
    one_line_error(res, "is a folder, not a regular file")
    assert "composed" not in res.output


def test_demo_on_an_unavailable_device_is_one_line_and_makes_nothing(tmp_path):
    # fuzz seed 0, case 69: `demo --device mps` printed its plan and "step 1/4" before the error
    res = runner.invoke(app, ["demo", "--device", "mps", "--quick", "--archs", "baseline", "--seeds", "0",
                              "--out", str(tmp_path / "demo")])
    one_line_error(res, "MPS is not available")
    assert not (tmp_path / "demo").exists()


def test_sweep_on_an_unavailable_device_leaves_no_study_folder(tmp_path):
    # found with the demo case: `sweep --device mps` left an empty study folder behind
    res = runner.invoke(app, ["sweep", "--device", "mps", "--archs", "baseline", "--tokens", "1000",
                              "--out", str(tmp_path / "study")])
    one_line_error(res, "MPS is not available")
    assert not (tmp_path / "study").exists()
