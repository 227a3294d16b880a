"""The order in which pytest-xdist hands out the suite's files (tests/conftest.py, research/tests/conftest.py): the
tiny study's tests first, so that the study runs from the start beside the rest; then the long folders, then unit/.
Checked on the hooks themselves with stand-in items, and pyproject's addopts that make xdist keep that order."""

import importlib.util
import re
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def hook(path: Path):
    spec = importlib.util.spec_from_file_location(f"conftest_{path.parent.parent.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.pytest_collection_modifyitems


def item(path: str, *fixtures: str) -> SimpleNamespace:
    return SimpleNamespace(path=ROOT / path, fixturenames=fixtures)


def test_the_tiny_study_then_the_long_folders_then_unit(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.syspath_prepend(str(ROOT / "research" / "tests"))  # (its conftest imports tiny_study)
    items = [item("research/tests/test_findings.py"), item("research/tests/test_study_gpu.py"),
             item("research/tests/test_study_gpu.py", "tiny"), item("tests/cli/test_plot.py"),
             item("tests/e2e/test_demo.py"), item("tests/unit/test_grammar.py", "tiny"),  # another fixture "tiny"
             item("tests/unit/test_blocks.py"), item("tests/e2e/test_train.py")]
    hook(ROOT / "tests" / "conftest.py")(items)  # pytest calls research's last (trylast)
    hook(ROOT / "research" / "tests" / "conftest.py")(None, None, items)
    got = [(str(it.path.relative_to(ROOT)), it.fixturenames) for it in items]
    assert got == [("research/tests/test_study_gpu.py", ("tiny",)), ("research/tests/test_study_gpu.py", ()),
                   ("tests/e2e/test_demo.py", ()), ("tests/e2e/test_train.py", ()),
                   ("research/tests/test_findings.py", ()), ("tests/cli/test_plot.py", ()),
                   ("tests/unit/test_grammar.py", ("tiny",)), ("tests/unit/test_blocks.py", ())]


def test_xdist_hands_out_files_in_the_collections_order():
    opts = re.search(r'^addopts = "(.*?)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1).split()
    assert {"--dist", "loadfile", "--no-loadscope-reorder"} <= set(opts)  # by default, by their number of tests
