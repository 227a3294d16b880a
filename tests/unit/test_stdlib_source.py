"""The stdlib sources (cemtool.data.stdlib): which files, the split by file, what is skipped and said, the round
trip of the tokens, on a hand-made library folder (the real one takes ~45 s to tokenize; its counts are in the
module's docstring)."""

import hashlib

import numpy as np
import pytest

from cemtool.config import DataConfig
from cemtool.data import stdlib
from cemtool.data.corpus import load_corpus
from cemtool.errors import CemtoolError


def fake_library(root, n=60):
    """n modules, a test suite, site-packages, a cache folder, a latin-1 file and a symbolic link."""
    for i in range(n):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"mod{i:02d}.py").write_text(f'"""Module {i}."""\n\ndef f{i}(x):\n    return x * {i}\n')
    for d in ("test", "site-packages/numpy", "__pycache__", "idlelib/idle_test"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / "t.py").write_text("assert True\n")
    (root / "test" / "latin.py").write_bytes("# coding: latin-1\ns = 'caf\xe9'\n".encode("latin-1"))
    (root / "link.py").symlink_to(root / "pkg" / "mod00.py")
    return root


def rels(root, files):
    return {f.relative_to(root).as_posix() for f in files}


def test_which_files_with_and_without_tests(tmp_path):
    root = fake_library(tmp_path / "lib")
    core = rels(root, stdlib.library_files(root, tests=False))
    full = rels(root, stdlib.library_files(root, tests=True))
    assert core == {f"pkg/mod{i:02d}.py" for i in range(60)}
    assert full == core | {"test/t.py", "test/latin.py", "idlelib/idle_test/t.py"}  # never site-packages, caches, links


def test_split_is_by_file_from_the_path_hash(tmp_path):
    assert stdlib.held_out("a/b.py", 0.05) == stdlib.held_out("a/b.py", 0.05)
    h = int(hashlib.sha256(b"a/b.py").hexdigest()[:8], 16) / 16 ** 8  # by hand
    assert stdlib.held_out("a/b.py", h + 1e-6) and not stdlib.held_out("a/b.py", h - 1e-6)
    share = np.mean([stdlib.held_out(f"m{i}.py", 0.1) for i in range(20000)])
    assert abs(share - 0.1) < 4 * (0.1 * 0.9 / 20000) ** 0.5


def test_corpus_round_trips_the_files_and_names_what_it_skipped(tmp_path, monkeypatch):
    root = fake_library(tmp_path / "lib")
    monkeypatch.setattr(stdlib, "stdlib_root", lambda: root)
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    cfg = DataConfig(source="stdlib", tokenizer="byte", val_fraction=0.2, seq_len=8)
    c = load_corpus(cfg)
    assert c.info["skipped"] == ["test/latin.py"]  # not UTF-8: left out and named
    files = sorted(stdlib.library_files(root, tests=True))
    kept = [f for f in files if f.relative_to(root).as_posix() != "test/latin.py"]
    val = [f for f in kept if stdlib.held_out(f.relative_to(root).as_posix(), 0.2)]
    train = [f for f in kept if f not in val]
    assert val and train and c.info["files"] == {"train": len(train), "val": len(val)}
    assert c.tokenizer.decode(c.train.tolist()) == "".join(f.read_text() for f in train)
    assert c.tokenizer.decode(c.val.tolist()) == "".join(f.read_text() for f in val)
    again = load_corpus(cfg)  # from the cache: the same tokens
    assert np.array_equal(again.train, c.train) and again.info["sha256"] == c.info["sha256"]
    core = load_corpus(DataConfig(source="stdlib-core", tokenizer="byte", val_fraction=0.2, seq_len=8))
    assert core.info["skipped"] == [] and core.info["sha256"] != c.info["sha256"]
    assert len(core.train) + len(core.val) < len(c.train) + len(c.val)


def test_bpe_sees_only_the_training_files(tmp_path, monkeypatch):
    root = fake_library(tmp_path / "lib", n=40)
    (root / "pkg" / "zzz_unique.py").write_text("QQQQQQQQ = 'XJXJXJXJXJXJ' * 99\n" * 50)
    rel = "pkg/zzz_unique.py"
    frac = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 16 ** 8 + 1e-6  # just enough to hold it out
    monkeypatch.setattr(stdlib, "stdlib_root", lambda: root)
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    c = load_corpus(DataConfig(source="stdlib-core", tokenizer="bpe", bpe_vocab_size=300, val_fraction=frac))
    vocab = c.tokenizer.hf.get_vocab()
    assert not any("XJXJ" in t or "QQQQ" in t for t in vocab)  # its strings would be merged had BPE seen it


def test_a_library_too_small_to_split_is_one_line(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "only.py").write_text("x = 1\n")
    monkeypatch.setattr(stdlib, "stdlib_root", lambda: root)
    with pytest.raises(CemtoolError, match="too few readable .py files"):
        load_corpus(DataConfig(source="stdlib", tokenizer="byte", seq_len=2))
