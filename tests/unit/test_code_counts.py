"""The size rules docs/architecture.md states (no module over 600 lines, no command body over 60), read by
scripts/code_counts.py, hold for the package; the counter itself is checked on a hand-made command first."""

import importlib.util
import sys
import textwrap
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def cc():
    path = Path(__file__).resolve().parents[2] / "scripts" / "code_counts.py"
    spec = importlib.util.spec_from_file_location("code_counts", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["code_counts"] = mod
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["code_counts"]


def test_a_command_body_is_counted_without_its_docstring(cc, tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(61))
    path = tmp_path / "x_cmd.py"
    path.write_text(textwrap.dedent('''\
        @app.command()
        @guarded
        def long(
            a: int = 1,
        ) -> None:
            """Docstring,
            two lines."""
        ''') + body + "\n\n\n@app.command()\ndef short():\n    return 1\n")
    assert cc.command_bodies(path) == [("long", 61), ("short", 1)]


def test_no_module_over_600_lines_and_no_command_over_60(cc):
    long = [(p.name, n) for p in cc.modules() if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600]
    assert long == []
    cmds = [(p.name, f, n) for p in sorted((cc.PKG / "cli").glob("*_cmd.py")) for f, n in cc.command_bodies(p)]
    assert len(cmds) >= 15
    assert [c for c in cmds if c[2] > 60] == []
