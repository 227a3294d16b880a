"""Issue 20 items 7 and 8: a FIFO (or another special file) planted at any file a command reads is refused in one
line or skipped with a note, never waited on; deeply nested or oversized JSON/TOML is refused before it is parsed
(cemtool/fileio.py, docs/reliability.md "Reading files")."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool import fileio
from cemtool.cli.main import app
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json, read_jsonl
from cemtool.runs import list_runs

from kit import TEXT, one_line_error

runner = CliRunner()
LIMIT_S = 90  # a command that reads a FIFO blocks for ever; each of these ends in seconds (more under load)


class Hung(BaseException):
    """Raised by the alarm: a BaseException, so that no command's error handling takes it for an error of its own."""


@contextlib.contextmanager
def bounded(what: str):
    """Raise Hung if the block takes over LIMIT_S seconds (a blocked open() is interrupted by the alarm)."""
    def ring(*_):
        raise Hung(what)

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def invoke_bounded(args: list):
    with bounded(" ".join(map(str, args))):
        return runner.invoke(app, [str(a) for a in args])


# the files of a run that commands read (the report and the checkpoint: those the analyses and plot look at)
RUN_FILES = [".lock", "config.json", "meta.json", "metrics.jsonl", "tokenizer.json", "checkpoints/manifest.json",
             "checkpoints/final.safetensors", "reports/sharpness.json", "model_source.json"]

FAST_SHARPNESS = ["--quick", "--quiet", "--no-plots", "--tokens", "32", "--top-k", "1", "--bottom-k", "0",
                  "--trace-hvps", "0", "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0", "--avg-rho", "0",
                  "--landscape", "none", "--lanczos-steps", "4"]


def commands(run: Path, ws: Path) -> dict[str, list]:
    """Every command that reads a run, at its smallest settings."""
    return {
        "runs": ["runs", run],
        "runs (folder)": ["runs", ws],
        "sharpness": ["sharpness", run, *FAST_SHARPNESS],
        "collapse-report": ["collapse-report", run, "--tokens", "128", "--quiet", "--no-plots"],
        "saturation analyze": ["saturation", "analyze", run, "--tokens", "64", "--ranks", "1", "--quiet",
                               "--no-plots", "--layers-only"],
        "forgetting": ["forgetting", run, "--to", ws / "target.txt", "--steps", "1", "--eval-every", "1",
                       "--eval-tokens", "32", "--out", ws / "ft", "--quiet"],
        "compare": ["compare", run, "--out", ws / "cmp"],
        "plot": ["plot", run],
        "export": ["export", run, ws / "exported"],
        "train --resume": ["train", "--resume", run, "--quiet"],
    }


def plant_fifo(p: Path) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.unlink(missing_ok=True)
    os.mkfifo(p)


def clean(res) -> bool:
    """A one-line error (exit 1, 'Error:' first on stderr's line, at most a hint) or a success: never a traceback."""
    if "Traceback" in res.output or "internal error" in res.output:
        return False
    if res.exit_code == 0:
        return True
    errors = [line for line in res.output.splitlines() if line.startswith("Error: ")]
    return res.exit_code == 1 and len(errors) == 1


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
@pytest.mark.parametrize("name", RUN_FILES)
def test_fifo_in_a_run_never_hangs_a_command(tmp_path, tiny_run, name):
    (tmp_path / "target.txt").write_text(TEXT[::-1])
    run = tmp_path / "run"
    named = []
    for what, args in commands(run, tmp_path).items():
        for d in ("run", "ft", "exported", "cmp"):  # each command on a fresh copy (what the others wrote is gone)
            shutil.rmtree(tmp_path / d, ignore_errors=True)
        shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".lock"))
        plant_fifo(run / name)
        res = invoke_bounded(args)  # raises Hung after LIMIT_S
        assert clean(res), (name, what, res.output)
        if "not a regular file" in res.output or "not a plain file" in res.output:
            named.append(what)
    assert named, f"no command said that {name} is not a regular file"


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
def test_fifo_config_data_and_study_files_are_refused(tmp_path):
    for name in ("c.toml", "c.json", "data.txt", "study/study.json"):
        plant_fifo(tmp_path / name)
    for args, words in ((["config", "--config", tmp_path / "c.toml"], "a FIFO"),
                        (["train", "--config", tmp_path / "c.json", "--out", tmp_path / "o", "--quiet"], "a FIFO"),
                        (["train", "--data", tmp_path / "data.txt", "--out", tmp_path / "o", "--quiet"],
                         "not a regular file"),
                        (["sweep", "--resume", tmp_path / "study"], "a FIFO"),
                        (["compare", tmp_path / "study"], "a FIFO")):
        res = invoke_bounded(args)
        one_line_error(res, words)
    assert not (tmp_path / "o").exists()


def test_open_regular_refuses_every_kind_of_special_file(tmp_path):
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "f")
    with bounded("read_bytes"), pytest.raises(CemtoolError, match="a FIFO"):
        fileio.read_bytes(tmp_path / "f")
    for p, kind in ((tmp_path / "d", "a folder"), (Path("/dev/null"), "a character device")):
        with pytest.raises(CemtoolError, match=f"is {kind}, not a regular file"):
            fileio.read_bytes(p)
    with pytest.raises(FileNotFoundError):
        fileio.open_regular(tmp_path / "missing")
    (tmp_path / "ok").write_bytes(b"x" * 10)
    (tmp_path / "link").symlink_to(tmp_path / "ok")  # a link to a regular file is read (the run dir may be one)
    assert fileio.read_bytes(tmp_path / "link") == b"x" * 10
    with pytest.raises(CemtoolError, match="larger than 9 bytes"):
        fileio.read_bytes(tmp_path / "ok", limit=9)


def test_a_fifo_metrics_file_is_a_note_in_the_listing_and_other_runs_are_listed(tmp_path, tiny_run):
    for r in ("a", "b"):
        shutil.copytree(tiny_run, tmp_path / r, ignore=shutil.ignore_patterns(".lock"))
    plant_fifo(tmp_path / "a" / "metrics.jsonl")
    with bounded("list_runs"):
        rows = {Path(r["run"]).name: r for r in list_runs(tmp_path)}
    assert rows["b"]["val_loss"] is not None and rows["b"]["notes"] == []
    assert rows["a"]["status"] == "completed" and "a FIFO" in rows["a"]["notes"][0]
    res = invoke_bounded(["runs", tmp_path])
    assert res.exit_code == 0 and "a FIFO" in res.output


# --------------------------------------------------------------------------------------------------------------
# item 8: depth and size of what is parsed

DEEP = 100_000


def deep_json(n: int = DEEP) -> str:
    return "[" * n + "]" * n


def test_deep_json_is_refused_before_parsing(tmp_path):
    (tmp_path / "deep.json").write_text(deep_json())
    with pytest.raises(CemtoolError, match=f"nested deeper than {fileio.MAX_DEPTH} levels"):
        read_json(tmp_path / "deep.json", "report")
    ok = "[" * fileio.MAX_DEPTH + "]" * fileio.MAX_DEPTH
    (tmp_path / "ok.json").write_text(ok)
    assert read_json(tmp_path / "ok.json", "report") == json.loads(ok)
    (tmp_path / "str.json").write_text(json.dumps({"s": "[" * DEEP}))  # brackets inside a string do not nest
    assert read_json(tmp_path / "str.json", "report") == {"s": "[" * DEEP}
    (tmp_path / "obj.json").write_text('{"a":' * DEEP + "1" + "}" * DEEP)
    with pytest.raises(CemtoolError, match="nested deeper"):
        read_json(tmp_path / "obj.json", "report")


@pytest.mark.parametrize("text, deep", [
    ('["\\\\", ' + "[" * 100 + "]" * 100 + "]", True),  # an escaped backslash ends nothing: the string closes
    ('["\\"' + "[" * 200 + '"]', False),  # an escaped quote does not close the string: its brackets are text
    ('{"a": "' + "{" * 200 + '", "b": [1, [2]]}', False),
    ("[" * 10 + "]" * 10 + "[" * 101 + "]" * 101, True),
    ("[" + ",".join(["[]"] * 2_200_000) + "]", False),  # many brackets, shallow (the numpy path)
    ("[" + ",".join(["[]"] * 2_200_000) + "," + "[" * 101 + "]" * 101 + "]", True),
])
def test_nesting_is_counted_outside_strings(text, deep):
    assert (fileio.nesting(text.encode()) > fileio.MAX_DEPTH) is deep
    if len(text) > 1000:
        return
    if not deep:
        assert fileio.loads_json(text) == json.loads(text)
    else:
        with pytest.raises(fileio.DepthError):
            fileio.loads_json(text)


def test_oversized_json_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "MAX_FILE_BYTES", 1000)
    (tmp_path / "big.json").write_text(json.dumps(["x" * 2000]))
    with pytest.raises(CemtoolError, match="larger than 1,000 bytes"):
        read_json(tmp_path / "big.json", "report")


def test_a_deep_or_long_metrics_line_is_skipped_with_a_note_and_the_rest_read(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "MAX_LINE_BYTES", 4096)
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1}\n' + deep_json(2000) + "\n" + '{"step": 2, "x": "' + "y" * 10000 + '"}\n' +
                 '{"step": 3}\n')
    notes: list[str] = []
    assert [r["step"] for r in read_jsonl(p, notes)] == [1, 3]
    assert notes == [f"metrics.jsonl line 2 skipped (nested deeper than {fileio.MAX_DEPTH} levels)",
                     "metrics.jsonl line 3 skipped (longer than 4,096 bytes)"]


def test_deep_metrics_line_in_one_run_leaves_every_run_listed(tmp_path, tiny_run):
    for r in ("a", "b"):
        shutil.copytree(tiny_run, tmp_path / r, ignore=shutil.ignore_patterns(".lock"))
    with open(tmp_path / "a" / "metrics.jsonl", "a") as f:
        f.write(deep_json() + "\n")
    res = invoke_bounded(["runs", tmp_path])
    assert res.exit_code == 0 and "internal error" not in res.output, res.output
    assert "nested deeper than" in res.output
    assert all(r["val_loss"] is not None for r in list_runs(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "meta.json", "tokenizer.json", "checkpoints/manifest.json",
                                  "reports/sharpness.json"])
def test_deep_json_in_a_run_file_is_a_one_line_error(tmp_path, tiny_run, name):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".lock"))
    (run / name).parent.mkdir(exist_ok=True)
    (run / name).write_text(deep_json())
    if name.startswith("reports/"):  # plot draws what it can, then names the report it could not read
        res = invoke_bounded(["plot", run])
        assert res.exit_code == 1 and clean(res) and "is corrupt (nested deeper than" in res.output, res.output
        return
    command = ["train", "--resume", run] if name == "meta.json" else ["sharpness", run, *FAST_SHARPNESS]
    one_line_error(invoke_bounded(command), "nested deeper than")


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"model": ' + deep_json() + "}"),
    (".toml", "x = " + deep_json() + "\n"),
    (".toml", "x = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n"),
])
def test_deep_config_file_is_a_one_line_error(tmp_path, suffix, text):
    (tmp_path / f"c{suffix}").write_text(text)
    one_line_error(invoke_bounded(["config", "--config", tmp_path / f"c{suffix}"]), "nested deeper than")


def test_toml_brackets_in_strings_and_comments_do_not_count(tmp_path):
    (tmp_path / "c.toml").write_text('# [[[[ ' + "[" * 500 + '\n[model]\narch = "baseline"  # ' + "[" * 500 + "\n"
                                     "[data]\nsource = '" + "[" * 500 + "'\n")
    assert fileio.loads_toml((tmp_path / "c.toml").read_text())["data"]["source"] == "[" * 500


def test_deep_set_value_is_a_one_line_error(tmp_path):
    one_line_error(invoke_bounded(["config", "--set", "model.d_model=" + deep_json()]), "nested deeper than")
