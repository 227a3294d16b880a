"""The test kit: one place for the tiny models, tokens, configs and runs every test folder builds, and the shared
CLI helpers. Imported as `from kit import ...` (pyproject's pytest `pythonpath` puts tests/ on sys.path);
tests/conftest.py and research/tests/conftest.py turn its fixtures into fixtures of their folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cemtool.cli.main import app  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]  # the repository

# --------------------------------------------------------------------------------------------------------------
# tiny runs: 30 steps of 8 x 16 tokens of a small text

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
        "train.max_steps=30", "train.eval_every=10", "train.eval_tokens=512", "train.log_every=5",
        "train.warmup_steps=5", "train.lr=3e-3", "data.train_tokens=20000", "data.val_tokens=4000"]

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Is it? Are they? Was it? Were they?\n") * 120


def set_args(*overrides: str) -> list[str]:
    """['--set', o1, '--set', o2, ...]: config overrides as command-line options."""
    return [a for s in overrides for a in ("--set", s)]


def train_tiny(out, arch: str = "baseline", data: str | None = None, extra: list[str] | None = None) -> str:
    """Train a tiny run through the CLI (in-process) and return its directory."""
    args = ["train", "--arch", arch, "--out", str(out), "--quiet", "--device", "cpu"]
    if data:
        args += ["--data", data]
    res = CliRunner().invoke(app, args + set_args(*TINY, *(extra or [])))
    assert res.exit_code == 0, res.output
    return str(out)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """A small UTF-8 text corpus written to a temporary file."""
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text(TEXT, encoding="utf-8")
    return str(p)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, text_file) -> str:
    """A completed tiny baseline run on a byte-tokenized text file (session-scoped; treat as read-only)."""
    return train_tiny(tmp_path_factory.mktemp("runs") / "tiny", data=text_file,
                      extra=["data.tokenizer=byte", "data.val_fraction=0.1"])


# --------------------------------------------------------------------------------------------------------------
# CLI results


def one_line_error(res, *words, code: int = 1):
    """A CLI result that is one clean user error: exit 1 (``code``: 2 for a bad option value), 'Error: ...' (+ an
    optional 'Hint:' line), no traceback."""
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    if code == 2:  # a usage error cemtool refuses itself: its line (+ hint), then the command's usage
        assert lines[-1].startswith("Usage: "), res.output
        lines = lines[:-1]
    assert lines[0].startswith("Error: ") and len(lines) <= 2, res.output  # message (+ hint)
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    for w in words:
        assert w in res.output, (w, res.output)
