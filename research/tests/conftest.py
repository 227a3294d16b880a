"""The research tests share the product suite's settings, fixtures and helpers: tests/kit.py (on sys.path through
pyproject's pytest `pythonpath`), imported as `from kit import ...`; its fixtures are this folder's too."""

from kit import text_file, tiny_run  # noqa: F401  (fixtures: pytest finds them in this module)
