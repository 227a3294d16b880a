"""Corpora, tokenizers and batches."""

from cemtool.data.corpus import Corpus, batch_starts, load_corpus, register_source, sources, windows
from cemtool.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Corpus", "Tokenizer", "batch_starts", "load_corpus", "load_tokenizer", "register_source", "sources",
           "windows"]
