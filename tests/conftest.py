"""Shared fixtures of tests/ (and its unit/, cli/ and e2e/ folders): the kit's (tests/kit.py), and the order in
which pytest-xdist hands out the suite's files."""

from kit import text_file, tiny_run  # noqa: F401  (fixtures: pytest finds them in this module)

# e2e/ and cli/ files start real processes and train models, as research/tests/ reads the study's records (seconds
# to tens of seconds a file); most unit/ files take a second or two
_FOLDER_RANK = {("tests", "e2e"): 0, ("tests", "cli"): 1, ("research", "tests"): 1}


def pytest_collection_modifyitems(items):
    """The long files first, so that the last files a worker takes are short and the workers end together (under
    pytest-xdist, pyproject's --dist loadfile --no-loadscope-reorder hands out whole files in this order; research/
    tests/conftest.py then puts its tiny study's file ahead of all). A stable sort: within a folder, pytest's order."""
    items.sort(key=lambda it: _FOLDER_RANK.get(it.path.parent.parts[-2:], 2))
