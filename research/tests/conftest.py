"""The research tests share the product suite's settings, fixtures and helpers: tests/conftest.py, loaded by its
path and re-exported whole. Both folders have a conftest.py and a test's `from conftest import ...` gets whichever
pytest loaded last, so this one must offer every name the other does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("cemtool_tests_conftest",
                                               Path(__file__).resolve().parents[2] / "tests" / "conftest.py")
_product = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_product)  # also one torch thread and OMP_NUM_THREADS=1, as in tests/
globals().update({k: v for k, v in vars(_product).items() if not k.startswith("_")})
