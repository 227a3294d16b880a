"""Shared fixtures of tests/ (and its unit/, cli/ and e2e/ folders): the kit's (tests/kit.py)."""

from kit import text_file, tiny_run  # noqa: F401  (fixtures: pytest finds them in this module)
