"""Issue 20, a new user's items 17, 20, 22: CPU threads under load, the runs table's kind and data columns, tables
that are never folded, one exit code for bad option values, "did you mean", the config formats read, train --help,
report.md sections of named reports."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app

from kit import one_line_error

runner = CliRunner()
SAMPLE = Path(__file__).resolve().parents[2] / "sample_runs" / "demo"


def invoke(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


# ---------------------------------------------------------------------- item 17: threads


def test_threads_default_follows_the_free_cores():
    """No count asked: torch's default on an idle machine, one thread per free core on a busy one, with a note."""
    from cemtool.threads import choose

    assert choose(8, 0.3, None, None) == (None, None)  # idle: torch's default, nothing said
    threads, note = choose(8, 6.2, None, None)
    assert threads == 2 and "busy (load average 6.2 on 8 core(s))" in note and "--threads" in note
    assert choose(2, 11.0, None, None)[0] == 1  # never below one thread
    assert choose(2, None, None, None) == (None, None)  # no load average on this platform


def test_threads_asked_are_used_as_asked_and_the_load_is_said():
    """A count the user gave is never changed; a note says when it exceeds the cores the load leaves free."""
    from cemtool.threads import asked, choose

    assert choose(8, 0.5, 4, "--threads") == (4, None)
    threads, note = choose(2, 3.5, 2, "CEMTOOL_THREADS")
    assert threads == 2 and "2 torch thread(s) as asked (CEMTOOL_THREADS)" in note and "0.0 free" in note
    # the environment's OMP_NUM_THREADS (CI, schedulers, the test suite) is used without a note on every command
    assert choose(2, 3.5, 2, "OMP_NUM_THREADS") == (2, None)
    assert choose(2, 3.5, 1, "--threads") == (1, None)  # one thread: nothing fewer would help
    assert asked(3, {"CEMTOOL_THREADS": "5", "OMP_NUM_THREADS": "7"}) == (3, "--threads")
    assert asked(None, {"CEMTOOL_THREADS": "5", "OMP_NUM_THREADS": "7"}) == (5, "CEMTOOL_THREADS")
    assert asked(None, {"OMP_NUM_THREADS": "7"}) == (7, "OMP_NUM_THREADS")
    assert asked(None, {}) == (None, None)


def test_threads_option_env_and_provenance(tmp_path, monkeypatch):
    """--threads N sets torch's threads (and OMP_NUM_THREADS for workers); a bad CEMTOOL_THREADS is a usage error;
    a report's provenance records the thread count it was measured with."""
    import torch

    from cemtool.report import provenance

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    try:
        res = invoke("--threads", 2, "archs", "--arch", "baseline")
        assert res.exit_code == 0, res.output
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
        assert "2 torch thread(s) as asked (--threads), but the load average is 9.0" in res.stderr
        cpu = provenance(None)["cpu"]
        assert cpu["threads"] == 2 and cpu["asked"] == "--threads" and cpu["load_average"] == 9.0
    finally:
        torch.set_num_threads(before)
    one_line_error(invoke("archs", env={"CEMTOOL_THREADS": "lots"}), "CEMTOOL_THREADS='lots'", code=2)
    assert invoke("--threads", 0, "archs").exit_code == 2


# ---------------------------------------------------------------------- item 20: runs, tables


def test_runs_lists_kind_and_data(tmp_path):
    """A fine-tune is listed as one, with the data its validation loss is on (its target), beside the runs."""
    from cemtool.runs import list_runs

    rows = {os.path.basename(r["run"]): r for r in list_runs(SAMPLE)}
    assert rows["baseline-s0"]["kind"] == "train" and rows["baseline-s0"]["data"] == "grammar"
    assert rows["baseline-s0-ft-grammar-b"]["kind"] == "fine-tune"
    assert rows["baseline-s0-ft-grammar-b"]["data"] == "grammar-b"
    res = invoke("runs", SAMPLE)
    assert res.exit_code == 0, res.output
    header = next(line for line in res.stdout.splitlines() if "run" in line and "kind" in line)
    assert [c.strip() for c in header.strip("┃ ").split("┃")][:5] == ["run", "kind", "arch", "seed", "data"]
    line = next(line for line in res.stdout.splitlines() if "baseline-s0-ft-grammar-b" in line)
    assert "fine-tune" in line and "grammar-b" in line


def test_a_wide_table_is_never_folded(capsys):
    """Rows wider than the console (200 columns without a terminal, the terminal's width with one) stay one line
    each: nothing is folded into the width."""
    from cemtool.cli import console

    console.table("wide", ["a", "b"], [["x" * 150, "y" * 120], ["1", "2"]])
    lines = capsys.readouterr().out.splitlines()
    body = [line for line in lines if "x" in line or "│ 1" in line]
    assert len(body) == 2 and "x" * 150 in body[0] and "y" * 120 in body[0], lines


# ---------------------------------------------------------------------- item 22: consistency


@pytest.mark.parametrize("args, words", [
    (["compare", ".", "--level", "1.5"], ["confidence level"]),
    (["compare", ".", "--at-tokens", "0"], ["--at-tokens must be a positive"]),
    (["train", "--set", "model.d_model"], ["is not of the form section.key=value"]),
    (["train", "--set", "model=3"], ["model is a config section"]),
    (["sweep", "--archs", "baseline", "--tokens", "0", "--out", "s"], ["--tokens must be positive"]),
    (["sweep", "--archs", "baseline", "--seeds", "0,x", "--out", "s"], ["seeds must be integers"]),
    (["sweep", "--archs", "baseline", "--seeds", "1,1", "--out", "s"], ["listed twice"]),
    (["sweep", "--archs", "baseline", "--grid", "train.lr", "--out", "s"], ["is not of the form key=v1,v2"]),
])
def test_a_bad_option_value_exits_2_like_clicks_own(args, words, tmp_path, monkeypatch):
    """A value refused on its own (range, form) exits 2 whether Click or cemtool refuses it (Click: --top-k -1)."""
    monkeypatch.chdir(tmp_path)
    one_line_error(invoke(*args), *words, code=2)
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("args, hint", [
    (["train", "--arch", "tmn"], "did you mean 'tmm'?"),
    (["train", "--arch", "basline"], "did you mean 'baseline'?"),
    (["train", "--set", "model.d_modle=32"], "did you mean 'd_model'?"),
    (["train", "--set", "trian.lr=1"], "did you mean 'train'?"),
    (["train", "--data", "grammer"], "did you mean 'grammar'?"),
    (["sweep", "--archs", "baseline", "--data", "pydco", "--out", "s"], "did you mean 'pydoc'?"),
    (["sweep", "--archs", "baseline", "--analyses", "sharpnes", "--out", "s"], "did you mean 'sharpness'?"),
    (["sweep", "--archs", "baseline", "--analyses", "collapse", "-A", "collapse.tokns=5", "--out", "s"],
     "did you mean 'tokens'?"),
])
def test_typos_get_did_you_mean(args, hint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = invoke(*args)
    one_line_error(res, hint)
    assert res.output.splitlines()[1].startswith("Hint: " + hint), res.output


def test_did_you_mean_only_when_close():
    from cemtool.errors import did_you_mean

    assert did_you_mean("tmn", ["tmm", "baseline"]) == "did you mean 'tmm'?"
    assert did_you_mean("zzzz", ["tmm", "baseline"]) is None


@pytest.mark.parametrize("name, text, words", [
    ("c.yaml", "model:\n  d_model: 32\n", ["is YAML", "TOML (named *.toml) or JSON"]),
    ("c.yml", "model: {d_model: 32}\n", ["is YAML", "not YAML"]),
    ("c.cfg", "[model]\nd_model = 32\n", ["is not valid JSON", "TOML (named *.toml) or JSON (any other name)"]),
])
def test_config_formats_are_named(name, text, words, tmp_path):
    f = tmp_path / name
    f.write_text(text)
    for cmd in (["train", "--config", f, "--out", tmp_path / "o"], ["config", "--config", f]):
        one_line_error(invoke(*cmd), *words)
    assert not (tmp_path / "o").exists()


def test_train_help_names_token_files():
    res = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "250"})
    assert res.exit_code == 0
    text = " ".join(res.output.replace("│", " ").split())  # the help box's borders where a line wraps
    assert "token files (.bin, .npy," in text and "note:" not in res.output


def test_a_named_sharpness_report_has_its_numbers_and_settings_in_report_md(tmp_path):
    """A sharpness report under any name (--name mine) gets its section's numbers and settings, not only figures."""
    import shutil

    from cemtool.plots.render import render_run

    run = tmp_path / "run"
    shutil.copytree(SAMPLE / "baseline-s0", run, ignore=shutil.ignore_patterns("plots", "report.md"))
    rep = json.loads((run / "reports" / "sharpness.json").read_text())
    (run / "reports" / "mine.json").write_text(json.dumps(rep))
    render_run(run)
    md = (run / "report.md").read_text()
    section = md.split("## Curvature and sharpness (`mine`)")[1].split("\n## ")[0]
    assert "| λ_top[1] |" in section and f"{rep['eigen']['top'][0]:.4f}" in section
    assert "Settings:" in section and "`lanczos_steps=40`" in section and "`top_k=3`" in section
    assert "![" in section  # and its figures, as before
