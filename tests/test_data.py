"""Tokenizers, text corpora and batches."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.config import DataConfig
from cemtool.data.corpus import Corpus, batch_starts, load_corpus, windows
from cemtool.data.tokenizer import byte_tokenizer, load_tokenizer, train_bpe, word_tokenizer
from cemtool.errors import CemtoolError


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=200))
def test_byte_tokenizer_round_trip(text):
    tok = byte_tokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256


@pytest.fixture(scope="module")
def bpe():
    corpus = ["the cat sat on the mat. " * 50, "is are was were " * 40, "élan naïve 東京 🙂 " * 10]
    return train_bpe(iter(corpus), 300)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=200))
def test_bpe_round_trip_any_text(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_bpe_learns_merges_and_saves(bpe, tmp_path):
    assert 256 < bpe.vocab_size <= 300
    assert len(bpe.encode("the cat sat on the mat")) < len("the cat sat on the mat")
    bpe.save(tmp_path / "tok.json")
    again = load_tokenizer(tmp_path / "tok.json")
    assert again.encode("the cat was here") == bpe.encode("the cat was here") and again.kind == "bpe"


def test_word_tokenizer_round_trip(tmp_path):
    tok = word_tokenizer(["the", "cat", "is", "are", "."])
    ids = tok.encode("the cat is .")
    assert ids == [0, 1, 2, 4] and tok.decode(ids) == "the cat is ."
    assert tok.token_to_id("are") == 3
    tok.save(tmp_path / "w.json")
    assert load_tokenizer(tmp_path / "w.json").decode([1, 3]) == "cat are"


def test_corrupt_tokenizer_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(CemtoolError, match="corrupt"):
        load_tokenizer(p)


def test_text_corpus_streams_to_memmap(text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    c = load_corpus(DataConfig(source=text_file, tokenizer="byte", seq_len=16, val_fraction=0.1))
    raw = open(text_file, "rb").read()
    assert isinstance(c.train, np.memmap)
    assert len(c.train) + len(c.val) == len(raw)
    assert bytes(np.concatenate([c.train, c.val]).astype(np.uint8)) == raw
    # a folder of files works too, in sorted order
    d = tmp_path / "folder"
    d.mkdir()
    (d / "a.txt").write_text("alpha " * 50)
    (d / "b.txt").write_text("beta " * 50)
    c2 = load_corpus(DataConfig(source=str(d), tokenizer="byte", seq_len=8))
    assert c2.info["files"] == 2 and len(c2.train) + len(c2.val) == 550


@pytest.mark.parametrize("content, msg", [
    (b"", "is empty"),
    (b"abc\x00def" * 10, "looks binary"),
    (b"caf\xe9 au lait " * 10, "not UTF-8"),
])
def test_bad_text_files(tmp_path, content, msg):
    p = tmp_path / "bad.txt"
    p.write_bytes(content)
    with pytest.raises(CemtoolError, match=msg):
        load_corpus(DataConfig(source=str(p), tokenizer="byte", seq_len=4))


def test_missing_source_and_seq_len_too_long(tmp_path, text_file):
    with pytest.raises(CemtoolError, match="neither a built-in source"):
        load_corpus(DataConfig(source=str(tmp_path / "nope.txt")))
    with pytest.raises(CemtoolError, match="larger than the validation data"):
        load_corpus(DataConfig(source=text_file, tokenizer="byte", seq_len=4000))


def test_pydoc_source_is_real_english():
    c = load_corpus(DataConfig(source="pydoc", tokenizer="byte", seq_len=32))
    text = c.tokenizer.decode(c.train[:2000].tolist())
    assert "the" in text and len(c.train) > 300_000


def _corpus(n=1000, starts=None):
    tok = byte_tokenizer()
    arr = np.arange(n) % 251
    return Corpus("t", tok, arr, arr.copy(), starts, starts)


def test_batches_are_pure_functions_of_seed_and_step():
    c = _corpus()
    a = batch_starts(c, 16, 8, seed=3, step=5)
    assert np.array_equal(a, batch_starts(c, 16, 8, seed=3, step=5))
    assert not np.array_equal(a, batch_starts(c, 16, 8, seed=3, step=6))
    assert a.max() <= 1000 - 17
    x, y = windows(c.train, a, 16)
    assert x.shape == (8, 16) and torch_equal_shift(x, y)


def torch_equal_shift(x, y):
    return bool((x[:, 1:] == y[:, :-1]).all())


def test_aligned_windows_start_at_sentence_starts():
    starts = np.arange(0, 1000, 10)
    c = _corpus(starts=starts)
    b = batch_starts(c, 16, 64, seed=0, step=0)
    assert np.all(b % 10 == 0) and b.max() <= 1000 - 17
    ev = c.eval_windows(16, 200)
    assert np.all(ev % 10 == 0) and np.all(np.diff(ev) >= 17)
