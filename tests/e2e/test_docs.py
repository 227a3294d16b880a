"""Every snippet of the docs runs: Python blocks executed page by page, every `cemtool` line of a shell block
parsed by the real CLI (and executed when its measured time is small), and every time claimed beside a block
backed by a measurement of scripts/doc_snippets.py (docs/snippet_times.json)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cemtool.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
# typer 0.29 carries its own click: its UsageError is the base of typer.BadParameter
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
CHEAP = 20.0  # seconds (measured): shell blocks at most this long are executed, the others only parsed


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


DS = load("doc_snippets")
SNIPPETS = DS.all_snippets()
RECORDS = DS.load_records()
PAGES = sorted({s.page for s in SNIPPETS})

# bash prints every `cemtool` command's arguments (after its own expansion of variables, quotes, ~ and line
# continuations) instead of running it; with an empty PATH, every other program is "not found".
PRELUDE = r"""
cemtool() { printf '%s\037' "$@"; printf '\n'; }
pip() { return 0; }  # so that `pip install ... && cemtool ...` reaches cemtool
torchrun() { while [ "$#" -gt 0 ] && [ "$1" != "-m" ]; do shift; done; shift 2; cemtool "$@"; }
"""


def cemtool_calls(code: str) -> list[list[str]]:
    """The argument lists of every `cemtool ...` (and `torchrun ... -m cemtool ...`) command of a shell block."""
    res = subprocess.run(["/bin/bash", "--noprofile", "--norc", "-c", PRELUDE + code], capture_output=True,
                         text=True, env={"PATH": "/nonexistent", "HOME": "/home/user"}, timeout=30)
    return [line.split("\x1f")[:-1] for line in res.stdout.splitlines() if line]


def parse_cli(args: list[str]) -> object:
    """Resolve a command line with the real CLI without running it; a UsageError names what is wrong."""
    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("cemtool", list(args))
    while hasattr(cmd, "resolve_command"):  # a group: its subcommand next
        rest = [*ctx._protected_args, *ctx.args]
        if not rest:
            break
        name, cmd, rest = cmd.resolve_command(ctx, rest)
        ctx = cmd.make_context(name, rest, parent=ctx)
    return cmd


def cheap(s) -> bool:
    rec = RECORDS.get(s.id)
    return bool(rec and rec["digest"] == s.digest and rec["status"] == "ok" and rec["seconds"] <= CHEAP)


# --- the CLI parse ----------------------------------------------------------------------------------------------


def test_parse_cli_catches_unknown_options_and_commands():
    assert parse_cli(["sharpness", "runs/x", "--quick"]).name == "sharpness"
    assert parse_cli(["saturation", "runs/x"]).name == "analyze"
    for bad in (["sharpness", "runs/x", "--no-such-option"], ["no-such-command"], ["train", "--arch"],
                ["sharpness", "runs/x", "--trace-method", "nope", "--tokens", "many"]):
        with pytest.raises(UsageError):
            parse_cli(bad)


def test_cemtool_calls_expand_like_a_shell():
    code = 'S="--set a=1\n   --set b=2"\ncemtool train $S \\\n  --out runs/x   # a comment\npip install x\n' \
           "torchrun --nproc_per_node 2 -m cemtool runs ~/r\n"
    assert cemtool_calls(code) == [["train", "--set", "a=1", "--set", "b=2", "--out", "runs/x"],
                                   ["runs", "/home/user/r"]]


SHELL = [s for s in SNIPPETS if s.lang == "bash"]


@pytest.mark.parametrize("snippet", SHELL, ids=[s.id for s in SHELL])
def test_every_cemtool_line_parses(snippet):
    calls = cemtool_calls(snippet.code)
    expected = len(re.findall(r"(^|&& |-m )cemtool ", snippet.code, re.M))
    assert len(calls) == expected, (snippet.id, calls)
    for args in calls:
        try:
            parse_cli(args)
        except UsageError as e:
            pytest.fail(f"{snippet.id} (line {snippet.line}): cemtool {' '.join(args)}: {e.format_message()}")


# --- running the snippets ---------------------------------------------------------------------------------------


RUNNABLE = [p for p in PAGES if any(s.lang == "python" or cheap(s) for s in SNIPPETS if s.page == p)]


@pytest.mark.parametrize("page", RUNNABLE)
def test_page_snippets_run(page, tmp_path, monkeypatch):
    """A page's Python blocks in order in one namespace, with its cheap shell blocks executed where they stand."""
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__snippet__"}
    for s in DS.extract(ROOT / page):
        if s.not_run() or (s.lang == "bash" and not cheap(s)):
            continue
        if s.lang == "python":
            try:
                DS.run_python(s.code, namespace, timeout=120)
            except BaseException as e:  # noqa: BLE001 - name the snippet
                pytest.fail(f"{s.id} (line {s.line}): {type(e).__name__}: {e}")
        else:
            for args in cemtool_calls(s.code):
                res = CliRunner().invoke(app, args)
                assert res.exit_code == 0, (s.id, args, res.output)


# --- the times beside the snippets ------------------------------------------------------------------------------


def test_every_snippet_carries_its_measured_time():
    for s in SNIPPETS:
        lines = (ROOT / s.page).read_text(encoding="utf-8").splitlines()
        claim = lines[s.end] if s.end < len(lines) else ""
        m = DS.CLAIM.match(claim)
        assert m, f"{s.id} (line {s.line}): no '(~N s on 2 idle cores)' or '(not timed: ...)' after the block"
        rec = RECORDS.get(s.id)
        assert rec is not None, f"{s.id}: no measurement record (run scripts/doc_snippets.py)"
        assert rec["digest"] == s.digest, f"{s.id}: the block changed since it was measured"
        assert claim == DS.claim_line(rec), (s.id, claim, DS.claim_line(rec))
        if m.group(2):
            assert rec["status"] != "ok"


def test_no_time_claim_without_a_record():
    """A timed claim in the docs is a claim line right after a block (so it has a record), never loose text."""
    after = {(s.page, s.end + 1) for s in SNIPPETS}
    for page in DS.pages():
        for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            rel = str(page.relative_to(ROOT))
            if "on 2 idle" in line or DS.CLAIM.match(line.strip()):
                assert (rel, i) in after and DS.CLAIM.match(line), f"{rel}:{i}: {line.strip()}"
    for s in SNIPPETS:
        assert not re.search(r"a few (CPU )?(seconds|minutes)|about a minute|\d+ min on", s.code), s.id


def test_failed_snippets_are_not_hidden():
    """No record says a snippet failed: a failing snippet is fixed, not documented."""
    assert [k for k, v in RECORDS.items() if v["status"] == "failed"] == []
