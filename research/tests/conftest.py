"""The research tests share the product suite's settings, fixtures and helpers: tests/kit.py (on sys.path through
pyproject's pytest `pythonpath`), imported as `from kit import ...`; its fixtures are this folder's too.

The tiny GPU study that test_study_gpu.py's slow tests share (research/tests/tiny_study.py) starts in the
background once collection is done, when a selected test needs it, and runs beside the tests before it (under
pytest-xdist, whose `--dist loadfile --no-loadscope-reorder` (pyproject addopts) gives whole files to the workers in
the collection's order: at that worker's first test of it, the file sorted first so that the study starts at once
while the other workers run the rest. Without --no-loadscope-reorder, xdist sorts the files by their number of tests,
and the study started 141 s into a 291-s run)."""

import os

import pytest
from tiny_study import TinyStudy

from kit import text_file, tiny_run  # noqa: F401  (fixtures: pytest finds them in this module)

TINY_STUDY = pytest.StashKey[TinyStudy]()


def pytest_collection_finish(session):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under pytest-xdist every worker collects every test: the one that
        return  # runs test_study_gpu.py (loadfile) starts it at its first test
    if any(item.path.name == "test_study_gpu.py" and "tiny" in getattr(item, "fixturenames", ())
           for item in session.items) and not session.config.option.collectonly:
        session.config.stash[TINY_STUDY] = TinyStudy().start()


@pytest.hookimpl(trylast=True)  # after tests/conftest.py's order of the files, which this keeps otherwise
def pytest_collection_modifyitems(session, config, items):
    """Under pytest-xdist, test_study_gpu.py first, its tiny-study tests at its head (every worker sorts alike):
    the worker that takes the file runs the study while the others run the rest of the suite."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        def rank(it) -> int:  # (another file's fixture may be called tiny too)
            if it.path.name != "test_study_gpu.py":
                return 2
            return 0 if "tiny" in getattr(it, "fixturenames", ()) else 1

        items.sort(key=rank)


def pytest_sessionfinish(session):
    study = session.config.stash.get(TINY_STUDY, None)
    if study is not None:
        study.stop()


@pytest.fixture(scope="session")
def tiny_study(request) -> TinyStudy:
    """The background study (started now if collection did not start it)."""
    if TINY_STUDY not in request.config.stash:
        request.config.stash[TINY_STUDY] = TinyStudy().start()
    return request.config.stash[TINY_STUDY]
