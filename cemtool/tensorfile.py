"""The one check of a safetensors file's layout, read from its header alone (no tensor data is read).

A safetensors file is a little-endian u64 ``n``, ``n`` bytes of a JSON object, then the tensors' bytes. The header
maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (and ``__metadata__`` to a string
map). :func:`read_header` refuses, with the reason, anything else: a pickle or zip (``torch.save``) under a
safetensors name, a header longer than the file or than 100 MB, a header that is not a flat JSON object, an unknown
dtype, a shape whose size does not match its byte range, ranges that overlap, leave gaps or run past the end of the
file (a truncated file). Used by cemtool's own checkpoints (``cemtool.checkpoints.read_checkpoint``) and by the
loader of Hugging Face models (``cemtool.subject.hf.loader``) before safetensors or transformers open the file.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

MAX_HEADER = 100_000_000  # bytes; the safetensors library's own limit
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class BadTensorFile(ValueError):
    """The file is not a well-formed safetensors file; the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: str | Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors by name, metadata) of a safetensors file, after checking its whole layout against the file size;
    raises :class:`BadTensorFile` (the reason) or OSError."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)  # the header length (whose first byte may be 0x80 or 'P'), then the header's '{'
        if head[8:9] != b"{" and (head[:1] == b"\x80" or head[:2] == b"PK"):
            raise BadTensorFile("it is a pickle/torch.save file, not safetensors: cemtool never unpickles files")
        if len(head) < 9:
            raise BadTensorFile(f"{size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head[:8])
        if n > MAX_HEADER:
            raise BadTensorFile(f"header of {n:,} bytes exceeds the limit of {MAX_HEADER:,}")
        if 8 + n > size:
            raise BadTensorFile(f"header of {n:,} bytes is longer than the file ({size:,} bytes): truncated?")
        f.seek(8)
        raw = f.read(n)
    if raw[:1] != b"{":
        raise BadTensorFile("the header is not a JSON object")
    try:
        header = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise BadTensorFile("the header is nested too deeply to be a safetensors header") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise BadTensorFile(f"the header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise BadTensorFile("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise BadTensorFile("__metadata__ is not a map of strings to strings")
    tensors, spans = {}, []
    for name, entry in header.items():
        info, span = _entry(name, entry)
        tensors[name] = info
        spans.append((span, name))
    _check_spans(sorted(spans), size - 8 - n)
    return tensors, meta


def _entry(name: str, entry) -> tuple[TensorInfo, tuple[int, int]]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise BadTensorFile(f"tensor {name!r}: an entry needs exactly dtype, shape and data_offsets")
    dtype, shape, span = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ITEMSIZE:
        raise BadTensorFile(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
    whole = lambda v: type(v) is int and v >= 0  # noqa: E731
    if not isinstance(shape, list) or not all(whole(s) for s in shape):
        raise BadTensorFile(f"tensor {name!r}: shape is not a list of whole numbers")
    if not isinstance(span, list) or len(span) != 2 or not all(whole(s) for s in span) or span[0] > span[1]:
        raise BadTensorFile(f"tensor {name!r}: data_offsets is not [begin, end] with begin <= end")
    info = TensorInfo(dtype, tuple(shape))
    if span[1] - span[0] != info.numel * ITEMSIZE[dtype]:
        raise BadTensorFile(f"tensor {name!r}: shape {list(shape)} of {dtype} needs {info.numel * ITEMSIZE[dtype]:,} "
                            f"bytes, its data_offsets give {span[1] - span[0]:,}")
    return info, (span[0], span[1])


def _check_spans(spans: list, data_bytes: int) -> None:
    """The byte ranges (sorted) must tile the data part of the file exactly: no overlap, no gap, nothing past the
    end."""
    at = 0
    for (begin, end), name in spans:
        if begin != at:
            raise BadTensorFile(f"tensor {name!r}: data_offsets {begin} {'overlap' if begin < at else 'leave a gap'} "
                                f"(expected {at})")
        at = end
    if at > data_bytes:
        raise BadTensorFile(f"the tensors need {at:,} bytes of data, the file holds {data_bytes:,}: truncated")
    if at < data_bytes:
        raise BadTensorFile(f"{data_bytes - at:,} bytes after the last tensor")
