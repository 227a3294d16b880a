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


# --------------------------------------------------------------------------------------------------------------
# issue 10: the split is made in the text and BPE sees the training text only; bytes per token; corpus hash;
# broken symbolic links


def test_bpe_is_trained_on_the_training_split_only(tmp_path, monkeypatch):
    """issue 10 item 3: the BPE tokenizer also saw the validation text. The held-out tail here is made of a letter
    that the training text never uses: no merge may contain it."""
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "t.txt"
    p.write_text("the cat sat on the mat. " * 400 + "QQQQ QQQQ QQQQ. " * 60)  # 9600 + 960 bytes
    c = load_corpus(DataConfig(source=str(p), tokenizer="bpe", bpe_vocab_size=300, seq_len=8, val_fraction=0.1))
    learned = [t for t, i in c.tokenizer.hf.get_vocab().items() if i >= 256]
    assert learned and not [t for t in learned if "Q" in t]
    # the split is in the text: the training tokens decode to the first 90% of the bytes, validation to the rest
    raw = p.read_bytes()
    cut = len(raw) - round(0.1 * len(raw))
    assert c.tokenizer.decode(c.train.tolist()).encode() == raw[:cut]
    assert c.tokenizer.decode(c.val.tolist()).encode() == raw[cut:]
    assert c.info["train_bytes"] == cut and c.info["val_bytes"] == len(raw) - cut


def test_split_moves_to_a_character_boundary(tmp_path, monkeypatch):
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "u.txt"
    p.write_text("東京" * 100)  # 3-byte characters: a byte cut almost never falls on a boundary
    for frac in (0.051, 0.102, 0.333):  # none cuts 600 bytes at a multiple of 3
        c = load_corpus(DataConfig(source=str(p), tokenizer="byte", seq_len=4, val_fraction=frac))
        train, val = (bytes(np.asarray(a, dtype=np.uint8)) for a in (c.train, c.val))
        assert train.decode("utf-8") + val.decode("utf-8") == "東京" * 100  # each split is whole characters
        assert 0 <= len(train) - (600 - round(600 * frac)) <= 2  # the cut moved forward to the next boundary


def test_bytes_per_token_is_the_bytes_of_the_decoded_targets(tmp_path, monkeypatch, text_file):
    """val_bpb rests on Corpus.bytes_per_token: check it against decoded text (the ground truth) for BPE, bytes and
    the grammar's words (a word counts its bytes and one separating space)."""
    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    bpe = load_corpus(DataConfig(source=text_file, tokenizer="bpe", bpe_vocab_size=300, seq_len=16))
    starts = bpe.eval_windows(16, 512)
    truth = sum(len(bpe.tokenizer.decode(bpe.val[s + 1:s + 17].tolist()).encode()) for s in starts)
    assert bpe.bytes_per_token(starts, 16) == pytest.approx(truth / (16 * len(starts)))
    assert bpe.bytes_per_token(starts, 16) > 1.5  # BPE merges bytes
    byte = load_corpus(DataConfig(source=text_file, tokenizer="byte", seq_len=16))
    assert byte.bytes_per_token(byte.eval_windows(16, 512), 16) == 1.0
    g = load_corpus(DataConfig(seq_len=16, train_tokens=5000, val_tokens=2000))
    starts = g.eval_windows(16, 512)
    words = [g.tokenizer.decode(g.val[s + 1:s + 17].tolist()) for s in starts]  # words joined by single spaces
    truth = sum(len(w.encode()) + 1 for w in words) / (16 * len(starts))
    assert g.bytes_per_token(starts, 16) == pytest.approx(truth)


def test_bits_per_byte_and_perplexity():
    import math

    from cemtool.data.corpus import bits_per_byte, perplexity

    assert bits_per_byte(math.log(2) * 3, 1.5) == pytest.approx(2.0)
    assert bits_per_byte(1.0, None) is None and bits_per_byte(None, 2.0) is None
    assert bits_per_byte(float("nan"), 2.0) is None
    assert perplexity(math.log(7)) == pytest.approx(7) and perplexity(1e4) is None


def test_corpus_hash_follows_the_bytes(tmp_path, monkeypatch):
    """The corpus hash (stored in the run, checked on resume) and the token cache follow the files' bytes: a file
    rewritten with the same size and modification time is seen (the old cache was keyed by size and mtime)."""
    import os

    monkeypatch.setenv("CEMTOOL_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "t.txt"
    p.write_text("alpha beta gamma\n" * 100)
    cfg = DataConfig(source=str(p), tokenizer="byte", seq_len=8)
    a = load_corpus(cfg)
    st = p.stat()
    p.write_text("alpha BETA gamma\n" * 100)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    b = load_corpus(cfg)
    assert a.info["sha256"] != b.info["sha256"]
    assert bytes(np.asarray(b.train[:16], dtype=np.uint8)) == b"alpha BETA gamma"
    assert load_corpus(cfg).info["sha256"] == b.info["sha256"]  # deterministic


def test_broken_symlink_in_data_folder_is_one_line(tmp_path):
    """issue 10 item 13: a dangling *.txt symlink in a data folder was an internal error (FileNotFoundError)."""
    d = tmp_path / "folder"
    d.mkdir()
    (d / "a.txt").write_text("alpha " * 50)
    (d / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(CemtoolError, match=r"b\.txt .* is a broken symbolic link") as e:
        load_corpus(DataConfig(source=str(d), tokenizer="byte", seq_len=8))
    assert "\n" not in str(e.value)
    with pytest.raises(CemtoolError, match="broken symbolic link"):
        load_corpus(DataConfig(source=str(d / "b.txt"), tokenizer="byte", seq_len=8))
