"""Tokenizers: word-level (grammar corpus), byte-level (256 ids) and byte-level BPE trained locally.

All three are Hugging Face ``tokenizers`` objects, so a run stores one ``tokenizer.json`` (plain JSON, no code)
that every analysis reloads with :func:`load_tokenizer`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from cemtool.errors import CemtoolError
from cemtool.fileio import read_json
from cemtool.writes import atomic_write_text


class Tokenizer:
    """A thin wrapper with the few operations cemtool needs."""

    def __init__(self, hf: HFTokenizer, kind: str):
        self.hf = hf
        self.kind = kind  # "word" | "byte" | "bpe"
        self._token_bytes: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except Exception as e:  # tokenizers raises plain Exception (a word-level one on any unknown word)
            raise self._encode_error([text], e) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        try:
            return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        except Exception as e:
            raise self._encode_error(texts, e) from None

    def _encode_error(self, texts: list[str], e: Exception) -> CemtoolError:
        """One line for text this tokenizer cannot encode: for a word-level one, the first word outside its
        vocabulary (it has no unknown token, so any other text is refused)."""
        if self.kind == "word":
            word = next((w for t in texts for w in t.split() if self.hf.token_to_id(w) is None), None)
            if word is not None:
                return CemtoolError(f"the text holds the word {word[:40]!r}, outside the {self.vocab_size:,}-word "
                                    f"vocabulary of this word-level (grammar) tokenizer",
                                    hint="a word-level run reads only text in its own words: use data in that "
                                         "vocabulary, e.g. the run's own source (leave out --data)")
        return CemtoolError(f"the {self.kind} tokenizer cannot encode the text: {str(e).splitlines()[0][:200]}")

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of a whole word (word-level) or of a text that encodes to exactly one token, else None."""
        if self.kind == "word":
            return self.hf.token_to_id(token)
        ids = self.encode(token)
        return ids[0] if len(ids) == 1 else None

    def id_to_token(self, i: int) -> str:
        return self.decode([i]) if self.kind != "word" else self.hf.id_to_token(i)

    def token_bytes(self) -> np.ndarray | None:
        """(V,) UTF-8 bytes each id stands for, or None where a token's bytes depend on its neighbours. Byte-level
        vocabularies (byte, bpe, GPT-2-like): the bytes of the token. Word-level: the word's bytes plus one, for the
        single space that joins words in the decoded text."""
        if self._token_bytes is None:
            vocab = [self.hf.id_to_token(i) or "" for i in range(self.vocab_size)]
            if self.kind == "word":
                self._token_bytes = np.array([len(w.encode("utf-8")) + 1 for w in vocab], dtype=np.int64)
            elif isinstance(self.hf.decoder, decoders.ByteLevel):  # one symbol per byte
                self._token_bytes = np.array([len(w) for w in vocab], dtype=np.int64)
        return self._token_bytes

    def to_json(self) -> str:
        return json.dumps({"cemtool_kind": self.kind, "tokenizer": json.loads(self.hf.to_str())})

    def save(self, path: str | Path) -> None:

        atomic_write_text(Path(path), self.to_json())


def load_tokenizer(path: str | Path) -> Tokenizer:
    p = Path(path)
    data = read_json(p, "tokenizer file")  # regular, bounded: one-line errors
    try:
        return Tokenizer(HFTokenizer.from_str(json.dumps(data["tokenizer"])), data["cemtool_kind"])
    except (ValueError, KeyError, TypeError, Exception) as e:  # tokenizers raises plain Exception
        raise CemtoolError(f"tokenizer file {p} is corrupt: {str(e).splitlines()[0][:200]}") from None


def word_tokenizer(vocab: list[str]) -> Tokenizer:
    """Whitespace-separated words with fixed ids (the grammar corpus's own vocabulary)."""
    hf = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return Tokenizer(hf, "word")


def _byte_level(vocab: dict[str, int], merges: list) -> HFTokenizer:
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf


def byte_symbols() -> list[str]:
    """The printable character the byte-level pre-tokenizer uses for each byte 0..255 (the GPT-2 convention:
    printable Latin-1 bytes stand for themselves, the others are shifted to code points 256 and up)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def byte_tokenizer() -> Tokenizer:
    """One id per UTF-8 byte, id == byte value (256 ids), lossless on any text."""
    symbols = byte_symbols()
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    return Tokenizer(_byte_level({c: i for i, c in enumerate(symbols)}, []), "byte")


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE trained locally on an iterator of text chunks (lossless: the 256 bytes are in the vocab)."""
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=[])
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf, "bpe")
