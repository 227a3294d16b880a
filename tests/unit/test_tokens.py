"""Pretokenised token files (.bin, .npy, train.bin/val.bin folders) and Hugging Face tokenizer.json files as data."""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import re
import struct

import numpy as np
import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.config import DataConfig, resolve
from cemtool.data import tokens as tokmod
from cemtool.data.corpus import load_corpus
from cemtool.errors import CemtoolError

from kit import TEXT, train_tiny


def corpus_of(source, **kw):
    return load_corpus(DataConfig(source=str(source), seq_len=kw.pop("seq_len", 8), **kw))


def tiny_hf_tokenizer(path, vocab_size=300):
    """A plain Hugging Face tokenizer.json (byte-level BPE trained on TEXT), as `save_pretrained` would write it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(path))
    return hf


def mapped(arr) -> bool:
    """The array's memory is a file mapping (through views and numpy's memoryview of the mmap)."""
    while arr is not None and not isinstance(arr, mmap.mmap):
        arr = arr.obj if isinstance(arr, memoryview) else getattr(arr, "base", None)
    return arr is not None


def test_bin_is_memory_mapped_and_split_at_val_fraction(tmp_path):
    ids = np.random.default_rng(0).integers(0, 5000, 4000).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    c = corpus_of(tmp_path / "t.bin", val_fraction=0.1)
    assert mapped(c.train) and mapped(c.val)  # never loaded whole
    assert len(c.val) == 400
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), ids)
    assert c.tokenizer.kind == "ids" and c.tokenizer.vocab_size == int(ids.max()) + 1
    assert c.info["max_token_id"] == int(ids.max()) and c.info["val_split"] == "last 0.1 of train"
    assert c.tokenizer.token_to_id("is") is None  # a probe word is never taken for an id
    assert c.tokenizer.encode("<7> <42>") == [7, 42] and c.tokenizer.decode([7, 42]) == "<7> <42>"


def test_corpus_hash_follows_the_ids_so_a_resume_sees_changed_data(tmp_path):
    from cemtool.train import check_data_unchanged

    ids = np.arange(3000, dtype=np.uint16) % 500
    ids.tofile(tmp_path / "t.bin")
    before = corpus_of(tmp_path / "t.bin").info
    ids[1234] += 1
    ids.tofile(tmp_path / "t.bin")
    after = corpus_of(tmp_path / "t.bin")
    assert before["sha256"] != after.info["sha256"] and len(before["sha256"]) == 64
    with pytest.raises(CemtoolError, match="changed since it started"):
        check_data_unchanged({"corpus": before}, after)


def test_uint32_bin_with_token_dtype(tmp_path):
    ids = np.array([3, 70000, 123456, 5, 99999, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], dtype=np.uint32)
    ids.tofile(tmp_path / "big.bin")
    c = corpus_of(tmp_path / "big.bin", token_dtype="uint32", seq_len=4, val_fraction=0.25)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), ids)
    assert c.tokenizer.vocab_size == 123457


def test_auto_dtype_is_uint32_for_a_vocabulary_over_65536(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.save(str(tmp_path / "tokenizer.json"))
    ids = (np.arange(40, dtype=np.uint32) * 1700) % 70000
    ids.tofile(tmp_path / "t.bin")
    c = corpus_of(tmp_path / "t.bin", tokenizer=str(tmp_path / "tokenizer.json"), seq_len=4, val_fraction=0.25)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), ids)
    assert c.info["dtype"] == "uint32" and c.info["dtype_from"] == "auto: the vocabulary has 70,000 ids"
    assert c.tokenizer.kind == "hf" and c.tokenizer.id_to_token(69999) == "w69999"


def test_npy_any_integer_dtype(tmp_path):
    ids = np.arange(600, dtype=np.int64)
    np.save(tmp_path / "t.npy", ids)
    c = corpus_of(tmp_path / "t.npy", val_fraction=0.1)
    np.testing.assert_array_equal(np.concatenate([c.train, c.val]), ids)
    assert c.info["format"] == "npy" and c.info["dtype"] == "int64" and mapped(c.train)


def test_npy_of_another_shape_is_refused_not_flattened(tmp_path):
    for shape in [(20, 30), (2, 3, 100), ()]:
        np.save(tmp_path / "t.npy", np.zeros(shape, dtype=np.int32))
        with pytest.raises(CemtoolError, match=rf"shape {re.escape(str(shape))}, not a flat \(N,\) array"):
            corpus_of(tmp_path / "t.npy")


def test_huge_id_without_a_tokenizer_is_refused_before_any_vocabulary_is_built(tmp_path, monkeypatch):
    id_tokenizer, built = tokmod.id_tokenizer, []
    with pytest.raises(CemtoolError, match="exceed config.MAX_VOCAB"):
        id_tokenizer((1 << 24) + 1)
    monkeypatch.setattr(tokmod, "id_tokenizer", lambda n: built.append(n))
    np.save(tmp_path / "huge.npy", np.array([1, 2, 2**40, 3] * 1250, dtype=np.int64))
    np.array([1, 50000] * 50, dtype=np.uint16).tofile(tmp_path / "u16.bin")  # read as uint32: ids ~3.3e9
    np.save(tmp_path / "edge.npy", np.array([0, 1 << 24], dtype=np.int64))
    cases = [(["--data", str(tmp_path / "huge.npy")], [f"token id {2**40} at position 2", "MAX_VOCAB"]),
             (["--data", str(tmp_path / "u16.bin"), "--set", "data.token_dtype=uint32"],
              [f"token id {50000 << 16 | 1} at position 0", "MAX_VOCAB"]),
             (["--data", str(tmp_path / "edge.npy")], [f"token id {1 << 24} at position 1", "MAX_VOCAB"])]
    for i, (args, words) in enumerate(cases):
        out = tmp_path / f"run{i}"
        res = CliRunner().invoke(app, ["train", "--out", str(out), "--quiet", "--device", "cpu", *args])
        one_line_error(res, *words)
        assert not out.exists() and built == []


class Boom:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_object_npy_is_refused_never_unpickled(tmp_path):
    marker = tmp_path / "PWNED"
    np.save(tmp_path / "evil.npy", np.array([Boom(str(marker))], dtype=object), allow_pickle=True)
    assert not marker.exists()
    with pytest.raises(CemtoolError, match="not a NumPy array of token ids"):
        corpus_of(tmp_path / "evil.npy")
    assert not marker.exists()
    np.save(tmp_path / "f.npy", np.ones(100, dtype=np.float32))
    with pytest.raises(CemtoolError, match="float32 values, not integer token ids"):
        corpus_of(tmp_path / "f.npy")
    (tmp_path / "p.npy").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(CemtoolError, match="not a NumPy array"):
        corpus_of(tmp_path / "p.npy")


def test_nanogpt_folder_uses_val_bin_as_validation(tmp_path):
    train = np.arange(0, 1000, dtype=np.uint16) % 97
    val = (np.arange(0, 300, dtype=np.uint16) % 89) + 100
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    c = corpus_of(tmp_path)
    np.testing.assert_array_equal(c.train, train)
    np.testing.assert_array_equal(c.val, val)
    assert c.info["val_split"] == "val file" and c.tokenizer.vocab_size == int(val.max()) + 1  # max over both
    (tmp_path / "val.bin").unlink()
    c = corpus_of(tmp_path, val_fraction=0.1)
    assert len(c.val) == 100 and c.info["val_file"] is None


def test_id_check_reads_in_chunks_and_names_the_first_bad_position(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "SCAN_TOKENS", 64)  # many chunks: the boundary arithmetic is exercised
    ids = np.random.default_rng(1).integers(0, 200, 1000).astype(np.uint16)
    ids[777] = 300
    ids.tofile(tmp_path / "t.bin")
    arr, off = tokmod.open_tokens(tmp_path / "t.bin")
    assert tokmod.check_ids(tmp_path / "t.bin", arr, off, None, "") == 300 == int(ids.max())
    with pytest.raises(CemtoolError, match=r"token id 300 at position 777 of .* outside the vocabulary .*0\.\.255"):
        tokmod.check_ids(tmp_path / "t.bin", arr, off, 256, "the byte tokenizer")
    with pytest.raises(CemtoolError, match="position 777"):
        corpus_of(tmp_path / "t.bin", tokenizer="byte")
    np.save(tmp_path / "neg.npy", np.array([1, 2, -3, 4] * 10, dtype=np.int16))
    with pytest.raises(CemtoolError, match="token id -3 at position 2 .* is negative"):
        corpus_of(tmp_path / "neg.npy", seq_len=4)


def one_line_error(res, *words):
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert lines[0].startswith("Error: ") and "Traceback" not in res.output, res.output
    for w in words:
        assert w in lines[0], (w, res.output)


def test_bad_token_files_are_one_line_errors_and_write_nothing(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    hf_tok = tmp_path / "tokenizer.json"
    tiny_hf_tokenizer(hf_tok, 300)
    np.array([1, 2, 3, 299, 300] * 20, dtype=np.uint16).tofile(tmp_path / "oov.bin")
    cases = [(["--data", str(tmp_path / "odd.bin")], ["5 bytes", "not a multiple of 2"]),
             (["--data", str(tmp_path / "odd.bin"), "--set", "data.token_dtype=uint32"], ["not a multiple of 4"]),
             (["--data", str(tmp_path / "oov.bin"), "--set", f"data.tokenizer={hf_tok}"],
              ["token id 300 at position 4", "outside the vocabulary"]),
             (["--data", str(tmp_path / "oov.bin"), "--set", "data.tokenizer=bpe"], ["does not apply"]),
             (["--data", str(tmp_path / "oov.bin"), "--set", "data.tokenizer=gpt2"], ["data.tokenizer='gpt2'"]),
             (["--data", str(tmp_path / "oov.bin"), "--set", "data.tokenizer=missing.json"], ["does not exist"])]
    for i, (args, words) in enumerate(cases):
        out = tmp_path / f"run{i}"
        res = CliRunner().invoke(app, ["train", "--out", str(out), "--quiet", "--device", "cpu", *args])
        one_line_error(res, *words)
        assert not out.exists()


def test_hf_tokenizer_json_for_text_is_saved_into_the_run(tmp_path, text_file):
    from tokenizers import Tokenizer as HFTokenizer

    from cemtool.data.tokenizer import load_tokenizer

    hf = tiny_hf_tokenizer(tmp_path / "tokenizer.json", 300)
    run = train_tiny(tmp_path / "run", data=text_file, extra=[f"data.tokenizer={tmp_path / 'tokenizer.json'}",
                                                              "train.max_steps=3", "data.val_fraction=0.1"])
    tok = load_tokenizer(f"{run}/tokenizer.json")
    assert tok.kind == "hf" and tok.vocab_size == 300
    assert tok.encode(TEXT[:500]) == hf.encode(TEXT[:500]).ids == HFTokenizer.from_file(
        str(tmp_path / "tokenizer.json")).encode(TEXT[:500]).ids
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == 300


def test_train_on_nanogpt_folder_then_analyses_read_val_bin(tmp_path):
    from cemtool.subject import open_subject

    rng = np.random.default_rng(2)
    rng.integers(0, 50, 6000).astype(np.uint16).tofile(tmp_path / "train.bin")
    val = rng.integers(0, 50, 800).astype(np.uint16)
    val.tofile(tmp_path / "val.bin")
    run = train_tiny(tmp_path / "run", data=str(tmp_path), extra=["train.max_steps=3", "model.vocab_size=64"])
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["corpus"]["val_file"] == str((tmp_path / "val.bin").resolve())
    loaded = open_subject(run)
    assert loaded.config.model.vocab_size == 64 and loaded.tokenizer.kind == "ids"
    x, y = loaded.eval_set(64)  # (4, 16): the first windows of val.bin
    np.testing.assert_array_equal(x[0].numpy(), val[:16])
    np.testing.assert_array_equal(y[0].numpy(), val[1:17])


def test_config_fields():
    assert resolve().data.token_dtype == "auto"
    assert resolve(overrides=["data.token_dtype=uint32"]).data.token_dtype == "uint32"
    with pytest.raises(CemtoolError, match="data.token_dtype='int8' is not allowed"):
        resolve(overrides=["data.token_dtype=int8"])
    assert resolve(overrides=["data.tokenizer=/x/tokenizer.json"]).data.tokenizer == "/x/tokenizer.json"


def test_word_level_run_on_text_outside_its_words_is_one_line_naming_the_word(tmp_path):
    from cemtool.data.tokenizer import word_tokenizer

    tok = word_tokenizer(["a", "b"])
    assert tok.encode("a b a") == [0, 1, 0] and tok.encode_batch(["b", "a a"]) == [[1], [0, 0]]
    for call in (lambda: tok.encode("a zz b"), lambda: tok.encode_batch(["a", "b zz"])):
        with pytest.raises(CemtoolError, match="the word 'zz', outside the 2-word vocabulary"):
            call()
    run = train_tiny(tmp_path / "grammar", extra=["train.max_steps=4", "train.eval_every=2"])
    res = CliRunner().invoke(app, ["sharpness", run, "--data", "pydoc", "--quick", "--device", "cpu", "--quiet"])
    one_line_error(res, "outside the", "word-level")
    assert "internal error" not in res.output and "run's own source" in res.output


# --------------------------------------------------------------------------------------------------------------
# issue 20 item 6: every malformed token file is one line


def npy_bytes(header: str, data: bytes = b"", version: int = 1) -> bytes:
    """A .npy file with a hand-written header (numpy's layout: magic, version, length, header padded to 64)."""
    h = header.encode("latin1")
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<H", len(h)) + h + data


IDS = (np.arange(200) % 50).astype(np.uint16)
HEAD = "{'descr': '<u2', 'fortran_order': False, 'shape': (200,)}"


def npz_bytes() -> bytes:
    buf = io.BytesIO()
    np.savez(buf, ids=IDS)
    return buf.getvalue()


BAD_TOKEN_FILES = {  # name -> (bytes, words of the one-line error)
    "header not a literal": ("t.npy", npy_bytes(HEAD.replace("(200,)}", "(200,}"), IDS.tobytes()), "does not parse"),
    "header calls code": ("t.npy", npy_bytes(HEAD.replace("(200,)", "__import__('os')"), IDS.tobytes()),
                          "does not parse"),
    "header lacks a key": ("t.npy", npy_bytes("{'descr': '<u2', 'shape': (200,)}", IDS.tobytes()), "correct keys"),
    "unknown dtype": ("t.npy", npy_bytes(HEAD.replace("<u2", "zz9"), IDS.tobytes()), "dtype"),
    "fortran_order not a bool": ("t.npy", npy_bytes(HEAD.replace("False", "'yes'"), IDS.tobytes()), "fortran"),
    "negative length": ("t.npy", npy_bytes(HEAD.replace("200,", "-5,"), IDS.tobytes()), "negative"),
    "truncated data": ("t.npy", npy_bytes(HEAD.replace("200,", "100000,"), IDS.tobytes()), "truncated"),
    "truncated header": ("t.npy", npy_bytes(HEAD)[:30], "does not parse"),
    "unknown format version": ("t.npy", npy_bytes(HEAD, IDS.tobytes(), version=9), "format version 9"),
    "empty .npy": ("t.npy", b"", "no .npy header"),
    "text named .npy": ("t.npy", b"not numpy at all\n" * 10, "no .npy header"),
    "pickle named .npy": ("t.npy", pickle.dumps(list(range(100))), "a pickle"),
    ".npz named .npy": ("t.npy", npz_bytes(), "a zip archive"),
    "bool dtype": ("t.npy", npy_bytes(HEAD.replace("<u2", "|b1"), b"\1" * 200), "not integer token ids"),
    "fortran order, 2-D": ("t.npy", npy_bytes("{'descr': '<u2', 'fortran_order': True, 'shape': (10, 20)}",
                                              IDS.tobytes()), "not a flat (N,) array"),
    ".npy named .bin": ("t.bin", npy_bytes(HEAD, IDS.tobytes()), "is a NumPy .npy file"),
}


@pytest.mark.parametrize("case", BAD_TOKEN_FILES)
def test_malformed_token_file_is_one_line_error(tmp_path, case):
    name, data, words = BAD_TOKEN_FILES[case]
    (tmp_path / name).write_bytes(data)
    with pytest.raises(CemtoolError, match=re.escape(words)) as e:
        corpus_of(tmp_path / name)
    assert "\n" not in e.value.message and str(tmp_path / name) in e.value.message


def test_object_dtype_npy_header_is_refused_before_any_data_is_read(tmp_path):
    np.save(tmp_path / "o.npy", np.array([Boom(str(tmp_path / "PWNED"))], dtype=object), allow_pickle=True)
    with pytest.raises(CemtoolError, match="holds Python objects"):
        corpus_of(tmp_path / "o.npy")
    assert not (tmp_path / "PWNED").exists()


def test_flat_npy_in_fortran_order_or_big_endian_is_read(tmp_path):
    for head, data in (("{'descr': '<u2', 'fortran_order': True, 'shape': (200,)}", IDS.tobytes()),
                       ("{'descr': '>u2', 'fortran_order': False, 'shape': (200,)}", IDS.astype(">u2").tobytes())):
        (tmp_path / "t.npy").write_bytes(npy_bytes(head, data))
        c = corpus_of(tmp_path / "t.npy", val_fraction=0.1)
        np.testing.assert_array_equal(np.concatenate([c.train, c.val]), IDS)


@pytest.mark.parametrize("name", ["t.npy", "t.bin", "train.bin"])
def test_fifo_as_token_file_is_refused_without_blocking(tmp_path, name):
    os.mkfifo(tmp_path / name)
    source = tmp_path if name == "train.bin" else tmp_path / name
    with pytest.raises(CemtoolError, match="a FIFO, not a regular file"):
        corpus_of(source)
    with pytest.raises(CemtoolError, match="a FIFO, not a regular file"):
        tokmod.open_tokens(tmp_path / name)  # the one opener, also when a caller names the file itself
