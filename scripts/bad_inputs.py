"""Run bad inputs and malicious files through the cemtool CLI and print the tally "tried N / clean M".

A case is clean when cemtool answers as promised (docs/reliability.md): exit code 1 with a first line
``Error: ...`` (and at most a hint line), or exit code 2 with Click's usage message; no traceback, no
"internal error"; nothing written outside the run directory (every file of the workspace outside the run and the
output folder is compared before and after, and the planted links' targets are checked). A few cases are not
errors at all (a malformed line in metrics.jsonl is skipped with a note): those must exit 0 and print the note.

Every case runs in its own temporary workspace holding a copy of a tiny trained run (``run/``), a folder outside
it (``outside/``, where planted links point) and, for `train`, an output folder (``out/``). In process, through
typer's CliRunner, so the whole list takes well under a minute on two cores.

    python scripts/bad_inputs.py            # trains the tiny run first (a few seconds), then every case
    python scripts/bad_inputs.py --fast     # only the cases that need no measurement

tests/cli/test_reliability.py runs the fast cases on the test suite's tiny run.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
        "train.max_steps=30", "train.eval_every=10", "train.eval_tokens=512", "train.log_every=5",
        "train.warmup_steps=5", "train.lr=3e-3", "data.tokenizer=byte", "data.val_fraction=0.1"]
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Is it? Are they? Was it? Were they?\n") * 120
SMALL = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.n_head=2", "--set",
         "data.seq_len=8", "--set", "train.max_steps=4", "--set", "train.eval_every=2", "--set",
         "train.eval_tokens=64", "--set", "data.tokenizer=byte", "--set", "train.batch_size=4"]


@dataclass
class Case:
    """``setup(ws)`` prepares the workspace ``ws`` (``ws/run`` is the tiny run, ``ws/outside`` the folder links
    point to) and returns the command's arguments. ``expect`` is 'error' (exit 1/2, one line) or 'ok' (exit 0 and
    ``note`` in the output). ``check(ws)`` returns why the case is not clean, or None."""

    name: str
    item: str
    setup: Callable[[Path], list[str]]
    expect: str = "error"
    words: tuple[str, ...] = ()
    fast: bool = True
    check: Callable[[Path], str | None] | None = None
    patch: Callable[[], Callable[[], None]] | None = None  # installs a fault, returns its undo
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------------------------------------------
# helpers that plant things


def write(p: Path, data: bytes | str) -> str:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return str(p)


def set_status(run: Path, status: str, drop_final: bool = True) -> None:
    meta = json.loads((run / "meta.json").read_text())
    meta["status"] = status
    (run / "meta.json").write_text(json.dumps(meta))
    if drop_final:
        (run / "checkpoints" / "final.safetensors").unlink(missing_ok=True)


def relink(p: Path, target: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)
    p.symlink_to(target, target_is_directory=target.is_dir())


def handmade(ws: Path, header, tensors: dict | None = None) -> str:
    import torch
    from safetensors.torch import save

    tensors = tensors if tensors is not None else {"model.w": torch.zeros(2)}
    return write(ws / "handmade.safetensors", save(tensors, metadata={"cemtool": json.dumps(header)}))


def flip_final(ws: Path, where: str) -> None:
    final = ws / "run" / "checkpoints" / "final.safetensors"
    (ws / "run" / "checkpoints" / "manifest.json").unlink()
    data = bytearray(final.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    if where == "data":
        data[8 + n + (len(data) - 8 - n) // 2] ^= 0x01
    else:
        i = data.index(b'\\"step\\": ') + len(b'\\"step\\": ')
        data[i] = ord("7") if data[i] != ord("7") else ord("8")
    final.write_bytes(bytes(data))


def victim_intact(ws: Path) -> str | None:
    return None if (ws / "outside" / "victim.txt").read_text() == "precious" else "the link's target was written"


def meta_unchanged(ws: Path) -> str | None:
    return None if (ws / "run" / "meta.json").read_bytes() == (ws / "meta.before").read_bytes() else \
        "meta.json changed by a failed command"


def fail_fsync(marker: str) -> Callable[[], Callable[[], None]]:
    """Disk full (ENOSPC) on every file whose name contains ``marker`` (Linux: /proc/self/fd), with writes flushed
    to disk while it lasts (CEMTOOL_FSYNC=0, as the test suite sets it, would skip the fsync that fails)."""

    def install() -> Callable[[], None]:
        real, flag = os.fsync, os.environ.get("CEMTOOL_FSYNC")

        def fsync(fd):
            if marker in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd)

        def restore() -> None:
            os.fsync = real
            if flag is None:
                os.environ.pop("CEMTOOL_FSYNC", None)
            else:
                os.environ["CEMTOOL_FSYNC"] = flag

        os.fsync = fsync
        os.environ["CEMTOOL_FSYNC"] = "1"
        return restore

    return install


# --------------------------------------------------------------------------------------------------------------
# the cases


def _train(ws: Path, *args: str) -> list[str]:
    return ["train", "--out", str(ws / "out"), "--quiet", "--device", "cpu", *args]  # a case's own options win


def _sharp(ws: Path, *args: str, run: str = "run") -> list[str]:
    return ["sharpness", str(ws / run), "--quick", "--quiet", *args]


def _corrupt_all_steps(ws: Path) -> list[str]:
    set_status(ws / "run", "interrupted")
    for ck in (ws / "run" / "checkpoints").glob("step_*.safetensors"):
        ck.write_bytes(ck.read_bytes()[:100])
    shutil.copy(ws / "run" / "meta.json", ws / "meta.before")
    return ["train", "--resume", str(ws / "run"), "--quiet"]


def _pickle_steps(ws: Path) -> list[str]:
    set_status(ws / "run", "interrupted")
    for ck in (ws / "run" / "checkpoints").glob("step_*.safetensors"):
        ck.write_bytes(pickle.dumps({"evil": True}))
    shutil.copy(ws / "run" / "meta.json", ws / "meta.before")
    return ["train", "--resume", str(ws / "run"), "--quiet"]


def _half_created(ws: Path) -> list[str]:
    (ws / ".half.creating.4194999.0bad").mkdir()  # what a kill during creation leaves (hidden, dead pid)
    write(ws / ".half.creating.4194999.0bad" / "config.json", "{}")
    return ["train", "--resume", str(ws / "half"), "--quiet"]


def _stopped(ws: Path) -> list[str]:
    meta = json.loads((ws / "run" / "meta.json").read_text())
    meta["status"] = "running"
    (ws / "run" / "meta.json").write_text(json.dumps(meta))
    return ["runs", str(ws / "run")]


def _bad_utf8_metrics(ws: Path) -> list[str]:
    with open(ws / "run" / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 31, "val_loss": \xff}\n')
    return ["runs", str(ws / "run")]


_HF_TEMPLATE: dict[str, Path] = {}


def hf_dir(ws: Path, edit_config: dict | None = None) -> Path:
    """A tiny random-weight Llama directory (as save_pretrained writes it, byte tokenizer) at ws/hf."""
    if "llama" not in _HF_TEMPLATE:
        import torch
        import transformers

        from cemtool.data.tokenizer import byte_tokenizer

        d = Path(tempfile.mkdtemp(prefix="cemtool-hf-template-")) / "llama"
        cfg = transformers.LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
                                       vocab_size=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
        transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer().hf).save_pretrained(d)
        _HF_TEMPLATE["llama"] = d
    d = ws / "hf"
    shutil.copytree(_HF_TEMPLATE["llama"], d)
    if edit_config:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**raw, **edit_config}))
    return d


def _hf_sharp(d: Path, *args: str) -> list[str]:
    return ["sharpness", str(d), "--quick", "--no-plots", "--quiet", *args]


def _auto_map(ws: Path, where: str) -> list[str]:
    d = hf_dir(ws)
    write(d / "configuration_evil.py", f"open({str(ws / 'outside' / 'EXECUTED')!r}, 'w')\n")
    raw = json.loads((d / where).read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig", "AutoTokenizer": ["configuration_evil.T", None]}
    (d / where).write_text(json.dumps(raw))
    return _hf_sharp(d)


def _not_executed(ws: Path) -> str | None:
    return "the directory's Python ran" if (ws / "outside" / "EXECUTED").exists() else None


def _hf_link(ws: Path, name: str, target: Path | None = None) -> list[str]:
    d = hf_dir(ws)
    if target is None:
        target = ws / "outside" / name
        shutil.copy(d / name, target)
    (d / name).unlink()
    (d / name).symlink_to(target)
    return _hf_sharp(d)


def _hf_dir_link(ws: Path) -> list[str]:
    d = hf_dir(ws)
    (ws / "linked").symlink_to(d, target_is_directory=True)
    return _hf_sharp(ws / "linked")


def _hf_weights(ws: Path, edit: Callable[[dict], None], config: dict | None = None) -> list[str]:
    from safetensors.torch import load_file, save_file

    d = hf_dir(ws, config)
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return _hf_sharp(d)


def _st(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def _hf_blob(ws: Path, blob: bytes) -> list[str]:
    d = hf_dir(ws)
    (d / "model.safetensors").write_bytes(blob)
    return _hf_sharp(d)


def _hf_no_tokenizer(ws: Path) -> list[str]:
    d = hf_dir(ws)
    for f in d.glob("tokenizer*"):
        f.unlink()
    return _hf_sharp(d, "--data", write(ws / "t.txt", TEXT))


def _hub_offline() -> Callable[[], None]:
    """An empty huggingface_hub cache, offline."""
    from huggingface_hub import constants

    saved = (constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = tempfile.mkdtemp(prefix="cemtool-empty-hub-"), True
    os.environ["HF_HUB_OFFLINE"] = "1"

    def undo() -> None:
        constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[2]
    return undo


def cases_hf() -> list[Case]:
    """Cases of issue 20 items 1-5, 13-16: Hugging Face directories, safetensors, exports."""
    import torch

    f32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    bad_weights = [  # (case, the file's bytes, words)
        ("a pickle named model.safetensors", pickle.dumps({"evil": True}), ("pickle",)),
        ("a torch.save zip named model.safetensors", b"PK\x03\x04" + b"\0" * 60, ("pickle",)),
        ("a 2-byte model.safetensors", b"\x01\x00", ("too short",)),
        ("a header longer than the file", _st({"w": f32}, length=10_000), ("longer than the file",)),
        ("a 200 GB header length", _st(b"{}", length=200_000_000_000), ("exceeds the limit",)),
        ("a header that is not JSON", _st(b"{nope"), ("not valid JSON",)),
        ("a header nested 100,000 deep", _st(b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
         ("nested too deeply",)),
        ("an unknown dtype", _st({"w": {**f32, "dtype": "F33"}}, b"\0" * 16), ("unknown dtype",)),
        ("a shape larger than its bytes", _st({"w": {**f32, "shape": [4, 4]}}, b"\0" * 16), ("needs 64 bytes",)),
        ("a negative shape", _st({"w": {**f32, "shape": [-2, -2]}}, b"\0" * 16), ("whole numbers",)),
        ("overlapping data_offsets", _st({"w": f32, "v": {**f32, "data_offsets": [8, 24]}}, b"\0" * 24),
         ("overlap",)),
        ("a gap in the data_offsets", _st({"w": {**f32, "data_offsets": [8, 24]}}, b"\0" * 24), ("gap",)),
        ("a truncated file", _st({"w": f32}, b"\0" * 10), ("truncated",)),
        ("bytes after the last tensor", _st({"w": f32}, b"\0" * 20), ("after the last tensor",)),
        ("__metadata__ that is not strings", _st({"__metadata__": {"a": 1}, "w": f32}, b"\0" * 16),
         ("__metadata__",)),
    ]
    up = "model.layers.1.mlp.up_proj.weight"
    weights = [  # (case, edit of the tensors, config changes, words)
        ("one tensor missing", lambda t: t.pop(up), None, ("1 missing", up)),
        ("every tensor missing", lambda t: t.clear(), None, ("tensors are missing",)),
        ("a renamed embedding", lambda t: t.update({"model.embed_tokenz.weight": t.pop("model.embed_tokens.weight")}),
         None, ("missing (model.embed_tokens.weight)", "unexpected (model.embed_tokenz.weight)")),
        ("a mis-shaped tensor", lambda t: t.update({up: torch.zeros(16, 31)}), None, ("of another shape", up)),
        ("an extra tensor", lambda t: t.update({"model.layers.0.extra": torch.zeros(3)}), None, ("1 unexpected",)),
        ("num_hidden_layers: -1", lambda t: None, {"num_hidden_layers": -1}, ("num_hidden_layers=-1",)),
        ("num_hidden_layers: 1 for weights of 2", lambda t: None, {"num_hidden_layers": 1}, ("9 unexpected",)),
        ("num_hidden_layers: 1,000,000", lambda t: None, {"num_hidden_layers": 1_000_000}, ("1,000,000 layers",)),
        ("num_hidden_layers: 100,000", lambda t: None, {"num_hidden_layers": 100_000}, ("100,000 layers",)),
        ("hidden_size: 1,000,000 (terabytes)", lambda t: None, {"hidden_size": 1_000_000, "head_dim": 250_000},
         ("GiB are available",)),
    ]
    out: list[Case] = [
        Case("hf: auto_map in config.json, y typed", "1", lambda ws: _auto_map(ws, "config.json"),
             words=("auto_map", "never runs code"), check=_not_executed),
        Case("hf: auto_map in tokenizer_config.json", "1", lambda ws: _auto_map(ws, "tokenizer_config.json"),
             words=("auto_map",), check=_not_executed),
        Case("hf: model.safetensors -> /etc/passwd", "2", lambda ws: _hf_link(ws, "model.safetensors",
                                                                             Path("/etc/passwd")),
             words=("symbolic link", "/etc/passwd")),
        Case("hf: config.json linked outside", "2", lambda ws: _hf_link(ws, "config.json"), words=("symbolic link",)),
        Case("hf: tokenizer.json linked outside", "2", lambda ws: _hf_link(ws, "tokenizer.json"),
             words=("symbolic link",)),
        Case("hf: the model directory is a link", "2", _hf_dir_link, words=("symbolic link",)),
        *[Case(f"hf: {name}", "5", lambda ws, b=blob: _hf_blob(ws, b), words=("model.safetensors", *w))
          for name, blob, w in bad_weights],
        *[Case(f"hf: {name}", "4" if "000" in name else "3",
               lambda ws, e=edit, c=cfg: _hf_weights(ws, e, c), words=w) for name, edit, cfg, w in weights],
        Case("hf: no tokenizer, text data", "13", _hf_no_tokenizer, words=("no tokenizer files",)),
        Case("hf: id neither cached nor downloadable offline", "15", lambda ws: _hf_sharp("hf:acme/not-cached@v1"),
             words=("hf download acme/not-cached --revision v1",), patch=_hub_offline),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


def npy_bytes(header: str, data: bytes = b"", version: int = 1) -> bytes:
    """A .npy file with a hand-written header (numpy's layout: magic, version, length, header padded to 64)."""
    h = header.encode("latin1")
    h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
    return b"\x93NUMPY" + bytes([version, 0]) + struct.pack("<H", len(h)) + h + data


NPY_HEAD = "{'descr': '<u2', 'fortran_order': False, 'shape': (2000,)}"
NPY_IDS = bytes(range(50)) * 80  # 2,000 uint16 ids


def _npz(ws: Path) -> str:
    import numpy as np

    np.savez(ws / "ids.npz", ids=np.arange(2000, dtype=np.uint16) % 50)
    return write(ws / "ids.npy", (ws / "ids.npz").read_bytes())


def _object_npy(ws: Path) -> str:
    import numpy as np

    np.save(ws / "obj.npy", np.array([1, 2, 3], dtype=object), allow_pickle=True)
    return str(ws / "obj.npy")


def fifo(p: Path) -> str:
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    p.unlink(missing_ok=True)
    os.mkfifo(p)
    return str(p)


def deep(n: int = 100_000) -> str:
    return "[" * n + "]" * n


def _study(ws: Path, edit: Callable[[dict], object] | None = None) -> str:
    """A planned study (nothing trained) in ws/study, its study.json hand-edited by ``edit``."""
    from cemtool.sweep import make_plan, new_manifest

    m = new_manifest(make_plan("baseline", "0", tokens=512, overrides=TINY, analyses="collapse"))
    write(ws / "study" / "study.json", json.dumps(edit(m) if edit else m))
    return str(ws / "study")


def _item0(**changes) -> Callable[[dict], dict]:
    return lambda m: {**m, "items": [{**m["items"][0], **changes}]}


def _plan(**changes) -> Callable[[dict], dict]:
    return lambda m: {**m, "plan": {**m["plan"], **changes}}


def _with_metrics_line(ws: Path, line: str) -> list[str]:
    with open(ws / "run" / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    return ["runs", str(ws)]


def cases_files() -> list[Case]:
    """Cases of issue 20 items 6-8, 12: token files, special files, deep JSON, hand-edited studies."""
    data = lambda name, blob: lambda ws: _train(ws, "--data", write(ws / name, blob))  # noqa: E731
    out: list[Case] = [
        # item 6: malformed token files, one line each
        Case("train: .npy header not a Python literal", "6",
             data("h.npy", npy_bytes(NPY_HEAD.replace("(2000,)}", "(2000,}"), NPY_IDS)), words=("does not parse",)),
        Case("train: .npy header calling code", "6",
             data("c.npy", npy_bytes(NPY_HEAD.replace("(2000,)", "__import__('os')"), NPY_IDS)),
             words=("does not parse",)),
        Case("train: .npz renamed .npy", "6", lambda ws: _train(ws, "--data", _npz(ws)), words=("zip archive",)),
        Case("train: text named .npy", "6", data("t.npy", "not numpy\n" * 50), words=("no .npy header",)),
        Case("train: pickle named .npy", "6", data("p.npy", pickle.dumps(list(range(100)))), words=("a pickle",)),
        Case("train: empty .npy", "6", data("e.npy", b""), words=("no .npy header",)),
        Case("train: .npy of object dtype", "6", lambda ws: _train(ws, "--data", _object_npy(ws)),
             words=("Python objects",)),
        Case("train: .npy in fortran order, 2-D", "6",
             data("f.npy", npy_bytes("{'descr': '<u2', 'fortran_order': True, 'shape': (40, 50)}", NPY_IDS)),
             words=("not a flat",)),
        Case("train: .npy truncated data", "6",
             data("tr.npy", npy_bytes(NPY_HEAD.replace("2000,", "9000,"), NPY_IDS)), words=("truncated",)),
        Case("train: .npy truncated header", "6", data("th.npy", npy_bytes(NPY_HEAD)[:30]), words=("does not parse",)),
        Case("train: .npy of an unknown format version", "6", data("v.npy", npy_bytes(NPY_HEAD, NPY_IDS, version=9)),
             words=("format version 9",)),
        Case("train: .npy of negative length", "6",
             data("n.npy", npy_bytes(NPY_HEAD.replace("2000,", "-5,"), NPY_IDS)), words=("negative",)),
        Case("train: .npy of float values", "6",
             data("fl.npy", npy_bytes(NPY_HEAD.replace("<u2", "<f2"), NPY_IDS)), words=("not integer token ids",)),
        Case("train: .npy named .bin", "6", data("n.bin", npy_bytes(NPY_HEAD, NPY_IDS)), words=("is a NumPy .npy",)),
        Case("train: .bin of an odd size", "6", data("o.bin", b"\1\0\2"), words=("not a multiple of 2",)),
        # item 7: FIFOs (and folders) where files are read: one line or a note, never a wait
        Case("runs: meta.json is a FIFO", "7",
             lambda ws: (fifo(ws / "run" / "meta.json"), ["runs", str(ws), "--json"])[1], expect="ok",
             words=("a FIFO",)),
        Case("runs: metrics.jsonl is a FIFO", "7",
             lambda ws: (fifo(ws / "run" / "metrics.jsonl"), ["runs", str(ws)])[1], expect="ok", words=("a FIFO",)),
        Case("runs: .lock is a FIFO", "7", lambda ws: (fifo(ws / "run" / ".lock"), ["runs", str(ws / "run")])[1],
             expect="ok", words=("completed",)),
        Case("resume: .lock is a FIFO", "7",
             lambda ws: (set_status(ws / "run", "interrupted"), fifo(ws / "run" / ".lock"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1], words=("not a plain file",)),
        *[Case(f"sharpness: {name} is a FIFO", "7", lambda ws, n=name: (fifo(ws / "run" / n), _sharp(ws))[1],
               words=("a FIFO, not a regular file",))
          for name in ("config.json", "tokenizer.json", "checkpoints/manifest.json", "checkpoints/final.safetensors",
                       "model_source.json")],
        Case("sharpness: tokenizer.json is a folder", "7",
             lambda ws: ((ws / "run" / "tokenizer.json").unlink(), (ws / "run" / "tokenizer.json").mkdir(),
                         _sharp(ws))[-1], words=("a folder, not a regular file",)),
        Case("plot: metrics.jsonl is a FIFO", "7",
             lambda ws: (fifo(ws / "run" / "metrics.jsonl"), ["plot", str(ws / "run")])[1], words=("a FIFO",)),
        Case("compare: meta.json is a FIFO", "7",
             lambda ws: (fifo(ws / "run" / "meta.json"), ["compare", str(ws / "run"), "--out", str(ws / "out")])[1],
             words=("a FIFO",)),
        Case("compare: study.json is a FIFO", "7",
             lambda ws: ["compare", (fifo(ws / "st" / "study.json"), str(ws / "st"))[1]], words=("a FIFO",)),
        Case("sweep --resume: study.json is a FIFO", "7",
             lambda ws: ["sweep", "--resume", (fifo(ws / "st" / "study.json"), str(ws / "st"))[1], "-q"],
             words=("a FIFO",)),
        Case("train: --config is a FIFO", "7", lambda ws: _train(ws, "--config", fifo(ws / "c.toml")),
             words=("a FIFO",)),
        Case("train: --data is a FIFO", "7", lambda ws: _train(ws, "--data", fifo(ws / "d.txt")),
             words=("not a regular file",)),
        Case("train: --data token file is a FIFO", "7", lambda ws: _train(ws, "--data", fifo(ws / "d.npy")),
             words=("a FIFO",)),
        Case("train: data.tokenizer is a FIFO", "7",
             lambda ws: _train(ws, "--data", write(ws / "i.bin", NPY_IDS), "--set",
                               f"data.tokenizer={fifo(ws / 'tok.json')}"), words=("a FIFO",)),
        # item 8: deeply nested JSON / TOML (100,000 levels): one line, or a skipped line with a note
        Case("runs: a 100,000-deep line in metrics.jsonl", "8", lambda ws: _with_metrics_line(ws, deep()),
             expect="ok", words=("nested deeper than",)),
        Case("runs: meta.json 100,000 deep", "8",  # --json: a table would cut the long status
             lambda ws: (write(ws / "run" / "meta.json", deep()), ["runs", str(ws), "--json"])[1], expect="ok",
             words=("nested deeper than",)),
        *[Case(f"sharpness: {name} 100,000 deep", "8",
               lambda ws, n=name: (write(ws / "run" / n, deep()), _sharp(ws))[1], words=("nested deeper than",))
          for name in ("config.json", "tokenizer.json", "checkpoints/manifest.json")],
        Case("resume: meta.json 100,000 deep", "8",
             lambda ws: (write(ws / "run" / "meta.json", deep()),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[1], words=("nested deeper than",)),
        Case("train: JSON config 100,000 deep", "8",
             lambda ws: _train(ws, "--config", write(ws / "c.json", '{"model": ' + deep() + "}")),
             words=("nested deeper than",)),
        Case("train: TOML config, array 100,000 deep", "8",
             lambda ws: _train(ws, "--config", write(ws / "c.toml", "x = " + deep() + "\n")),
             words=("nested deeper than",)),
        Case("train: TOML config, inline table 100,000 deep", "8",
             lambda ws: _train(ws, "--config", write(ws / "c.toml", "x = " + "{a = " * 100_000 + "1" +
                                                     "}" * 100_000 + "\n")), words=("nested deeper than",)),
        Case("train: --set value 100,000 deep", "8", lambda ws: _train(ws, "--set", "model.d_model=" + deep()),
             words=("nested deeper than",)),
        Case("sweep --resume: study.json 100,000 deep", "8",
             lambda ws: ["sweep", "--resume", (write(ws / "st" / "study.json", deep()), str(ws / "st"))[1], "-q"],
             words=("nested deeper than",)),
        Case("train: tokenizer.json 100,000 deep", "8",
             lambda ws: _train(ws, "--data", write(ws / "i.bin", NPY_IDS), "--set",
                               f"data.tokenizer={write(ws / 'tok.json', deep())}"), words=("nested deeper than",)),
        # item 12: hand-edited studies, one line naming the field, nothing written
        Case("compare: study.json is []", "12", lambda ws: ["compare", _study(ws, lambda m: [])],
             words=("not a cemtool-study object",)),
        Case("compare: study item status bogus", "12", lambda ws: ["compare", _study(ws, _item0(status="bogus"))],
             words=("items[0].status 'bogus'",)),
        Case("sweep --resume: item status bogus", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _item0(status="bogus")), "-q"],
             words=("items[0].status 'bogus'",)),
        Case("sweep --resume: plan.archs [nosuch]", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _plan(archs=["nosuch"])), "-q"],
             words=("unknown architecture 'nosuch'",)),
        Case("sweep --resume: item named ../evil", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _item0(name="../evil", run="../evil")), "-q"],
             words=("items[0].name '../evil'",)),
        Case("sweep --resume: item val_loss NaN", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _item0(val_loss=float("nan"))), "-q"],
             words=("val_loss nan is not a finite number",)),
        Case("sweep --resume: plan.tokens -1", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _plan(tokens=-1)), "-q"], words=("plan.tokens -1",)),
        Case("sweep --resume: study status bogus", "12",
             lambda ws: ["sweep", "--resume", _study(ws, lambda m: {**m, "status": "bogus"}), "-q"],
             words=("status 'bogus'",)),
        Case("sweep --resume: analysis status bogus", "12",
             lambda ws: ["sweep", "--resume", _study(ws, _item0(analyses={"collapse": {"status": "bogus"}})), "-q"],
             words=("analyses.collapse.status 'bogus'",)),
        Case("sweep --resume: duplicate item names", "12",
             lambda ws: ["sweep", "--resume", _study(ws, lambda m: {**m, "items": m["items"] * 2}), "-q"],
             words=("is given twice",)),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


HELD_AT: list[Path] = []  # the run whose lock hold_lock takes: named by the case's setup (_held)


def _held(ws: Path, args: list[str]) -> list[str]:
    HELD_AT[:] = [ws / "run"]
    return args


def hold_lock(shared: bool) -> Callable[[], Callable[[], None]]:
    """The lock of the run named by ``_held`` held while the command runs, as another process would hold it (the
    flock locks of two open files exclude each other within one process too): shared by an analysis, or
    exclusive by a training."""

    def install() -> Callable[[], None]:
        from cemtool.runs import Run

        run = Run(HELD_AT[0])
        run.lock(shared=shared)
        return run.unlock

    return install


def forge_step(ws: Path, tensors=None, header=None, which: str = "step_*") -> None:
    """Rewrite the run's step checkpoints (``which``): ``tensors(dict)`` and ``header(dict)`` change them in place,
    then the file's own checksum and the manifest's are recomputed, so that every hash accepts the forgery."""
    from safetensors import safe_open
    from safetensors.torch import save

    from cemtool.checkpoints import _content_sha256, _sha256

    set_status(ws / "run", "interrupted")
    ckdir = ws / "run" / "checkpoints"
    entries = json.loads((ckdir / "manifest.json").read_text())
    for path in sorted(ckdir.glob(f"{which}.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta, ts = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
        hdr = json.loads(meta["cemtool"])
        if tensors:
            tensors(ts)
        if header:
            header(hdr)
        meta["cemtool"] = json.dumps(hdr)
        meta["cemtool_sha256"] = _content_sha256(meta["cemtool"], ts)
        path.write_bytes(save(ts, metadata=meta))
        entries[path.name]["sha256"] = _sha256(path)
    (ckdir / "manifest.json").write_text(json.dumps(entries))
    shutil.copy(ws / "run" / "meta.json", ws / "meta.before")


def _first(ts: dict, part: str) -> str:
    return next(k for k in sorted(ts) if part in k)


def _opt_header(hdr: dict) -> dict:
    """The optimizer state_dict skeleton of a header, as {"state": ..., "param_groups": ...} (lists, editable)."""
    return {k: v for k, v in hdr["optimizer"]["__dict__"]}


def _drop_group(hdr: dict) -> None:
    opt = _opt_header(hdr)
    opt["param_groups"].pop()


def _ghost_param(hdr: dict) -> None:
    state = _opt_header(hdr)["state"]["__dict__"]
    state.append([{"__int__": 999}, state[0][1]])


def _missing_moment(hdr: dict) -> None:
    state = _opt_header(hdr)["state"]["__dict__"]
    state[0][1]["__dict__"] = [kv for kv in state[0][1]["__dict__"] if kv[0] != "exp_avg_sq"]


def _resume(ws: Path) -> list[str]:
    return ["train", "--resume", str(ws / "run"), "--quiet"]


def _forged(tensors=None, header=None, which: str = "step_*") -> Callable[[Path], list[str]]:
    return lambda ws: (forge_step(ws, tensors, header, which), _resume(ws))[-1]


def _reshape(part: str, fn) -> Callable[[dict], None]:
    def change(ts: dict) -> None:
        k = _first(ts, part)
        ts[k] = fn(ts[k])
    return change


def seed_unchanged(ws: Path) -> str | None:
    meta = json.loads((ws / "run" / "meta.json").read_text())
    moved = list(ws.glob("run.replaced-*"))
    return None if meta.get("seed") == 0 and not moved else "the run was replaced under the lock"


def cases_state() -> list[Case]:
    """Cases of issue 20 items 9-11, 18: locks, torchrun, forged checkpoints, interrupts."""
    small = lambda ws: ["--data", write(ws / "t.txt", TEXT), *SMALL, "--seed", "7"]  # noqa: E731
    analyses = {"sharpness": lambda ws: _sharp(ws, "--no-plots"),
                "collapse-report": lambda ws: ["collapse-report", str(ws / "run"), "--quiet", "--no-plots"],
                "saturation": lambda ws: ["saturation", str(ws / "run"), "--quiet", "--no-plots"],
                "forgetting (source run)": lambda ws: ["forgetting", str(ws / "run"), "--to", "grammar-b", "--out",
                                                       str(ws / "out"), "--quiet"]}
    out: list[Case] = [
        # item 9: analyses hold the run's lock shared; training and --force take it exclusively
        Case("train --force while an analysis measures the run", "20.9",
             lambda ws: _held(ws, ["train", "--out", str(ws / "run"), "--force", "--quiet", *small(ws)]),
             patch=hold_lock(shared=True), words=("in use by another process",), check=seed_unchanged),
        Case("train --force while the run is being trained", "20.9",
             lambda ws: _held(ws, ["train", "--out", str(ws / "run"), "--force", "--quiet", *small(ws)]),
             patch=hold_lock(shared=False), words=("in use by another process",), check=seed_unchanged),
        Case("train --resume while an analysis measures the run", "20.9",
             lambda ws: (set_status(ws / "run", "interrupted"), shutil.copy(ws / "run" / "meta.json",
                                                                            ws / "meta.before"),
                         _held(ws, _resume(ws)))[-1],
             patch=hold_lock(shared=True), words=("in use by another process",), check=meta_unchanged),
        *[Case(f"{name} while the run is being trained", "20.9", lambda ws, a=args: _held(ws, a(ws)),
               patch=hold_lock(shared=False), words=("being written by another process",))
          for name, args in analyses.items()],
        Case("sharpness: .lock is a symlink", "20.9",
             lambda ws: (relink(ws / "run" / ".lock", ws / "outside" / "victim.txt"), _sharp(ws))[-1],
             words=("symbolic link",), check=victim_intact),
        Case("sharpness: .lock is a hard link", "20.9",
             lambda ws: (os.link(ws / "outside" / "victim.txt", ws / "run" / ".lock"), _sharp(ws))[-1],
             words=("not a plain file",), check=victim_intact),
        Case("sharpness: .lock is a folder", "20.9",
             lambda ws: ((ws / "run" / ".lock").mkdir(), _sharp(ws))[-1], words=(".lock",)),
        Case("collapse-report: .lock is a symlink", "20.9",
             lambda ws: (relink(ws / "run" / ".lock", ws / "outside" / "victim.txt"),
                         ["collapse-report", str(ws / "run"), "--quiet"])[-1],
             words=("symbolic link",), check=victim_intact),
        # item 11: forged step checkpoints (every hash recomputed) are refused before anything is restored
        Case("resume: forged optimizer moment of the wrong shape", "20.11",
             _forged(_reshape("exp_avg_sq", lambda t: t.reshape(-1)[:-1].clone())), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged optimizer moment of the wrong dtype", "20.11",
             _forged(_reshape("state.1.exp_avg", lambda t: t.double())), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged optimizer step of the wrong shape", "20.11",
             _forged(_reshape("state.0.step", lambda t: t.reshape(1).repeat(3))), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged weight of the wrong shape", "20.11",
             _forged(_reshape("model.blocks.0.attn.wq", lambda t: t[:-1].clone())), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged weight of the wrong dtype", "20.11",
             _forged(_reshape("model.blocks.1", lambda t: t.half())), words=("does not fit",), check=meta_unchanged),
        Case("resume: forged extra weight", "20.11",
             _forged(lambda ts: ts.update({"model.blocks.9.attn.wq.weight": ts[_first(ts, "model.blocks.0")] * 1})),
             words=("does not fit",), check=meta_unchanged),
        Case("resume: forged checkpoint missing a weight", "20.11",
             _forged(lambda ts: ts.pop(_first(ts, "model.blocks.1.attn.wq"))), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged RNG state of the wrong length", "20.11",
             _forged(_reshape("rng.torch", lambda t: t[:-8].clone())), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: forged optimizer with a parameter group less", "20.11", _forged(header=_drop_group),
             words=("does not fit",), check=meta_unchanged),
        Case("resume: forged optimizer state of a parameter that does not exist", "20.11",
             _forged(header=_ghost_param), words=("does not fit",), check=meta_unchanged),
        Case("resume: forged optimizer state lacking a moment", "20.11",
             _forged(lambda ts: ts.pop("optim.state.0.exp_avg_sq"), _missing_moment), words=("does not fit",),
             check=meta_unchanged),
        Case("resume: newest step checkpoint forged, the older one resumes", "20.11",
             _forged(_reshape("exp_avg_sq", lambda t: t.reshape(-1)[:-1].clone()), which="step_000020"),
             expect="ok", words=("skipped step_000020.safetensors", "does not fit", "resuming from step 10"),
             fast=False),
        # item 18: where a resume starts is said
        Case("resume: a run interrupted before its first checkpoint says it starts from step 0", "20.18",
             lambda ws: (set_status(ws / "run", "interrupted"),
                         [p.unlink() for p in (ws / "run" / "checkpoints").glob("step_*")],
                         _resume(ws))[-1], expect="ok", words=("resuming from step 0",), fast=False),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


def _env(**values: str) -> Callable[[], Callable[[], None]]:
    """A patch that sets environment variables for one case (and its undo)."""
    def install() -> Callable[[], None]:
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)

        def undo() -> None:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return undo
    return install


def _twins(ws: Path, *args: str) -> list[str]:
    """Two copies of the tiny run (the same seed), each with a minimal sharpness report, for ``compare``."""
    for name in ("a", "b"):
        shutil.copytree(ws / "run", ws / "twins" / name)
        write(ws / "twins" / name / "reports" / "sharpness.json",
              json.dumps({"tokens": 64, "eigen": {"top": [1.0], "bottom": [-0.1]}, "traces": []}))
    return ["compare", str(ws / "twins"), "--out", str(ws / "out"), "--quiet", *args]


def _sweep(ws: Path, *args: str) -> list[str]:
    return ["sweep", "--archs", "baseline", "--out", str(ws / "out" / "study"), "-q", *args]


def cases_user() -> list[Case]:
    """Cases of issue 20 items 17, 19, 20, 22, 24: a new user's inputs."""
    cfg = {"yaml": "model:\n  d_model: 32\n", "toml": "[model]\nd_model = 32\n"}
    out: list[Case] = [
        # item 22: did you mean
        Case("train: architecture typo (did you mean)", "22", lambda ws: _train(ws, "--arch", "tmn"),
             words=("did you mean 'tmm'?",)),
        Case("train: config key typo (did you mean)", "22", lambda ws: _train(ws, "--set", "model.d_modle=32"),
             words=("did you mean 'd_model'?",)),
        Case("train: config section typo (did you mean)", "22", lambda ws: _train(ws, "--set", "trian.lr=1e-3"),
             words=("did you mean 'train'?",)),
        Case("train: data source typo (did you mean)", "22", lambda ws: _train(ws, "--data", "grammer"),
             words=("did you mean 'grammar'?",)),
        Case("sweep: data source typo (did you mean)", "22", lambda ws: _sweep(ws, "--data", "pydco"),
             words=("did you mean 'pydoc'?",)),
        Case("sweep: analysis typo (did you mean)", "22", lambda ws: _sweep(ws, "--analyses", "sharpnes"),
             words=("did you mean 'sharpness'?",)),
        Case("sweep: analysis option typo (did you mean)", "22",
             lambda ws: _sweep(ws, "--analyses", "collapse", "-A", "collapse.tokns=5"), words=("did you mean",)),
        # item 22: config formats
        Case("train: a YAML config", "22", lambda ws: _train(ws, "--config", write(ws / "c.yaml", cfg["yaml"])),
             words=("is YAML", "TOML")),
        Case("train: a .yml config", "22", lambda ws: _train(ws, "--config", write(ws / "c.yml", cfg["yaml"])),
             words=("is YAML",)),
        Case("config: a YAML config", "22", lambda ws: ["config", "--config", write(ws / "c.yaml", cfg["yaml"])],
             words=("is YAML",)),
        Case("train: TOML text in a .cfg file", "22",
             lambda ws: _train(ws, "--config", write(ws / "c.cfg", cfg["toml"])),
             words=("not valid JSON", "TOML (named *.toml)")),
        # item 22: a bad option value is a usage error (exit 2), whoever refuses it
        Case("train: --set without '=' (usage)", "22", lambda ws: _train(ws, "--set", "model.d_model")),
        Case("train: --set of a whole section (usage)", "22", lambda ws: _train(ws, "--set", "model=3")),
        Case("compare: --level 1.5 (usage)", "22", lambda ws: ["compare", str(ws / "run"), "--level", "1.5",
                                                               "--out", str(ws / "out")]),
        Case("compare: --at-tokens 0 (usage)", "22", lambda ws: ["compare", str(ws / "run"), "--at-tokens", "0",
                                                                 "--out", str(ws / "out")]),
        Case("sweep: --tokens 0 (usage)", "22", lambda ws: _sweep(ws, "--tokens", "0")),
        Case("sweep: seeds not integers (usage)", "22", lambda ws: _sweep(ws, "--seeds", "0,x")),
        Case("sweep: a seed listed twice (usage)", "22", lambda ws: _sweep(ws, "--seeds", "1,1")),
        Case("sweep: --grid without values (usage)", "22", lambda ws: _sweep(ws, "--grid", "train.lr")),
        Case("demo: a seed listed twice (usage)", "22",
             lambda ws: ["demo", "--quick", "--seeds", "0,0", "--out", str(ws / "out" / "demo")]),
        Case("sharpness: --tokens 0 (usage)", "22", lambda ws: _sharp(ws, "--tokens", "0")),
        # item 17: threads
        Case("--threads 0 (usage)", "17", lambda ws: ["--threads", "0", "archs"]),
        Case("CEMTOOL_THREADS not a number (usage)", "17", lambda ws: ["archs"], patch=_env(CEMTOOL_THREADS="lots"),
             words=("CEMTOOL_THREADS='lots'",)),
        Case("CEMTOOL_THREADS=0 (usage)", "17", lambda ws: ["archs"], patch=_env(CEMTOOL_THREADS="0"),
             words=("not a thread count",)),
        # item 19: two runs of one seed
        Case("compare --strict: two runs of one seed", "19", lambda ws: _twins(ws, "--strict"),
             words=("share seed",)),
        Case("compare: two runs of one seed are flagged", "19", _twins, expect="ok", words=("share seed",)),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


def _plot(ws: Path, *args: str) -> list[str]:
    return ["plot", str(ws / "run"), "--quiet", *args]


def cases_docs() -> list[Case]:
    """Cases of issue 20 items 21, 23: doc snippets and figures (`cemtool plot --format/--size`)."""
    bad_format = [("jpeg", "jpeg"), ("", "no figure format"), (",", "no figure format"), ("png,gif", "gif"),
                  ("png pdf", "png pdf"), ("../../x", "../../x"), ("pdf;svg", "pdf;svg"), ("eps", "eps"),
                  ("svgz", "svgz"), (".pdf", ".pdf")]
    bad_size = [("poster", "poster"), ("", "''"), ("COLUMN", "COLUMN"), ("3.5", "3.5"), ("column,page", "column"),
                ("../slide", "../slide")]
    out = [Case(f"plot: --format {f!r} (usage)", "23", lambda ws, f=f: _plot(ws, "--format", f), words=(w,))
           for f, w in bad_format]
    out += [Case(f"plot: --size {z!r} (usage)", "23", lambda ws, z=z: _plot(ws, "--size", z), words=(w,))
            for z, w in bad_size]
    out += [
        Case("plot: --size slide --format jpeg (usage)", "23", lambda ws: _plot(ws, "--size", "slide", "--format",
                                                                              "jpeg"), words=("jpeg",)),
        Case("plot: --format pdf on a folder without runs", "23",
             lambda ws: ["plot", str(ws / "outside"), "--format", "pdf"]),
        Case("plot: --format pdf, --out is a file", "23",
             lambda ws: ["plot", str(ws / "run"), str(ws / "run"), "--out", write(ws / "f.txt", "x"), "--format",
                         "pdf"], words=("not a directory",)),
        Case("plot: --format pdf on a missing run", "23", lambda ws: ["plot", str(ws / "nope"), "--format", "pdf"],
             words=("does not exist",)),
        Case("plot: --size column on a missing run", "23",
             lambda ws: ["plot", str(ws / "nope"), "--size", "column"], words=("does not exist",)),
        Case("plot: two runs, --format pdf, no --out (usage)", "23",
             lambda ws: ["plot", str(ws / "run"), str(ws / "run"), "--format", "pdf"], words=("--out",)),
        Case("plot: --format pdf,svg with plots/ a symlink", "23",
             lambda ws: (relink(ws / "run" / "plots", ws / "outside"), _plot(ws, "--format", "pdf,svg"))[-1],
             fast=False, words=("symbolic link",)),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


def _sample(ws: Path, *args: str, run: str = "run") -> list[str]:
    return ["sample", str(ws / run), "--device", "cpu", "--tokens", "4", *args]


def _word_level_run(ws: Path) -> list[str]:
    """The run's tokenizer replaced by a word-level one of as many ids (256 words w0..w255)."""
    from cemtool.data.tokenizer import word_tokenizer

    word_tokenizer([f"w{i}" for i in range(256)]).save(ws / "run" / "tokenizer.json")
    return _sample(ws, "--prompt", "w1 w2 zebra")


def no_tensorboard() -> Callable[[], None]:
    """The tensorboard package made unimportable (as where the extra is not installed)."""
    saved = {k: v for k, v in sys.modules.items() if k == "tensorboard" or k.startswith("tensorboard.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["tensorboard"] = None  # import tensorboard -> ImportError

    def undo() -> None:
        del sys.modules["tensorboard"]
        sys.modules.update(saved)
    return undo


def no_out(ws: Path) -> str | None:
    return None if not (ws / "out").exists() else "a run was created although training was refused"


def _per_layer(ws: Path, *args: str) -> list[str]:
    return _sharp(ws, "--per-layer", "--tokens", "32", *args)


def cases_new() -> list[Case]:
    """Cases of issue 20 item 24: sample, TensorBoard logging, the per-layer sharpness table."""
    out: list[Case] = [
        Case("sample: --temperature nan", "24", lambda ws: _sample(ws, "--temperature", "nan"),
             words=("--temperature",)),
        Case("sample: --temperature inf", "24", lambda ws: _sample(ws, "--temperature", "inf"),
             words=("--temperature",)),
        Case("sample: --temperature -0.5", "24", lambda ws: _sample(ws, "--temperature", "-0.5"),
             words=("--temperature",)),
        Case("sample: --temperature abc (usage)", "24", lambda ws: _sample(ws, "--temperature", "abc")),
        Case("sample: --top-k 0", "24", lambda ws: _sample(ws, "--top-k", "0"), words=("--top-k",)),
        Case("sample: --top-k above the vocabulary", "24", lambda ws: _sample(ws, "--top-k", "100000"),
             words=("--top-k", "256")),
        Case("sample: --top-k abc (usage)", "24", lambda ws: _sample(ws, "--top-k", "abc")),
        Case("sample: --tokens 0", "24", lambda ws: _sample(ws, "--tokens", "0"), words=("--tokens",)),
        Case("sample: --tokens 10**6", "24", lambda ws: _sample(ws, "--tokens", "1000000"), words=("4096",)),
        Case("sample: --num-samples 0", "24", lambda ws: _sample(ws, "--num-samples", "0"),
             words=("--num-samples",)),
        Case("sample: --num-samples 10**4", "24", lambda ws: _sample(ws, "--num-samples", "10000"),
             words=("--num-samples",)),
        Case("sample: --seed -1", "24", lambda ws: _sample(ws, "--seed", "-1"), words=("--seed",)),
        Case("sample: --seed 2**64", "24", lambda ws: _sample(ws, "--seed", str(2**64)), words=("--seed",)),
        Case("sample: empty --prompt", "24", lambda ws: _sample(ws, "--prompt", ""), words=("no tokens",)),
        Case("sample: prompt outside a word-level vocabulary", "24", _word_level_run, words=("zebra",)),
        Case("sample: --out is a folder", "24", lambda ws: _sample(ws, "--out", str(ws / "outside")),
             words=("is a folder",)),
        Case("sample: --out in a missing folder", "24",
             lambda ws: _sample(ws, "--out", str(ws / "nofolder" / "s.json")), words=("nofolder",)),
        Case("sample: run does not exist", "24", lambda ws: _sample(ws, run="nope"), words=("does not exist",)),
        Case("sample: run is a file", "24", lambda ws: ["sample", write(ws / "f.txt", "x")],
             words=("is a file",)),
        Case("sample: --checkpoint 999", "24", lambda ws: _sample(ws, "--checkpoint", "999"),
             words=("does not exist",)),
        Case("sample: final checkpoint is a pickle", "24",
             lambda ws: (write(ws / "run" / "checkpoints" / "final.safetensors", pickle.dumps({"x": 1})),
                         _sample(ws))[-1], words=("never unpickles",)),
        Case("train: train.log_to=tensorboard without the package", "24",
             lambda ws: _train(ws, "--data", write(ws / "t.txt", TEXT), *SMALL, "--set", "train.log_to=tensorboard"),
             words=("cemtool[tensorboard]",), patch=no_tensorboard, check=no_out),
        Case("train: train.log_to=wandb", "24", lambda ws: _train(ws, "--set", "train.log_to=wandb"),
             words=("train.log_to",)),
        Case("resume: tensorboard/ is a symlink", "24",
             lambda ws: (set_status(ws / "run", "interrupted"), relink(ws / "run" / "tensorboard", ws / "outside"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1],
             words=("symbolic link",), check=victim_intact),
        Case("sharpness --per-layer --params layer:0 (usage)", "24", lambda ws: _per_layer(ws, "--params", "layer:0")),
        Case("sharpness --per-layer --backend pyhessian (usage)", "24",
             lambda ws: _per_layer(ws, "--backend", "pyhessian")),
        Case("sharpness --per-layer with two trace methods", "24",
             lambda ws: _per_layer(ws, "--trace-method", "xtrace,hutchinson"), words=("one --trace-method",)),
        Case("sharpness --per-layer with nothing to measure", "24",
             lambda ws: _per_layer(ws, "--lanczos-steps", "0", "--trace-hvps", "0", "--top-k", "0", "--bottom-k",
                                   "0"), words=("nothing to measure",)),
        Case("sharpness --per-layer --name ../../escape", "24", lambda ws: _per_layer(ws, "--name", "../../escape"),
             words=("not a plain name",)),
        Case("sharpness --per-layer: reports/ is a symlink", "24",
             lambda ws: (relink(ws / "run" / "reports", ws / "outside"), _per_layer(ws))[-1], fast=False,
             words=("symbolic link",)),
    ]
    return out


# --------------------------------------------------------------------------------------------------------------


def cases() -> list[Case]:
    import torch

    out: list[Case] = [
        # train: bad data and configuration (tests/cli/test_cli.py's list, and issue 10's)
        Case("train: data file missing", "cli", lambda ws: _train(ws, "--data", str(ws / "nope.txt")), words=("nope",)),
        Case("train: empty data file", "cli", lambda ws: _train(ws, "--data", write(ws / "e.txt", b""))),
        Case("train: binary data file", "cli", lambda ws: _train(ws, "--data", write(ws / "b.txt", b"\0\1\2" * 100))),
        Case("train: latin-1 data file", "cli",
             lambda ws: _train(ws, "--data", write(ws / "l.txt", "café crème ".encode("latin-1") * 50))),
        Case("train: dangling *.txt link in a data folder", "13",
             lambda ws: (write(ws / "d" / "a.txt", TEXT), (ws / "d" / "b.txt").symlink_to(ws / "gone.txt"),
                         _train(ws, "--data", str(ws / "d"), *SMALL))[-1]),
        Case("train: unknown architecture", "cli", lambda ws: _train(ws, "--arch", "transformerxl")),
        Case("train: unknown config key", "cli", lambda ws: _train(ws, "--set", "model.widht=3")),
        Case("train: config value of the wrong type", "cli", lambda ws: _train(ws, "--set", "model.d_model=wide")),
        Case("train: seq_len beyond the data", "cli",
             lambda ws: _train(ws, "--data", write(ws / "t.txt", TEXT), "--set", "data.seq_len=100000", "--set",
                               "data.tokenizer=byte")),
        Case("train: config of a newer schema", "cli",
             lambda ws: _train(ws, "--config", write(ws / "c.json", json.dumps({"schema_version": 99})))),
        Case("train: lr=nan", "9", lambda ws: _train(ws, "--set", "train.lr=nan")),
        Case("train: lr=inf", "9", lambda ws: _train(ws, "--set", "train.lr=inf")),
        Case("train: negative seed", "9", lambda ws: _train(ws, "--seed", "-1")),
        Case("train: d_model=10**9", "9", lambda ws: _train(ws, "--set", "model.d_model=1000000000")),
        Case("train: unknown device", "cli", lambda ws: _train(ws, "--device", "tpu9")),
        Case("train: unknown flag (usage)", "cli", lambda ws: ["train", "--no-such-flag"]),
        Case("train: seed not a number (usage)", "cli", lambda ws: ["train", "--seed", "abc"]),
        Case("train: --resume with config options (usage)", "cli",
             lambda ws: ["train", "--resume", str(ws / "run"), "--arch", "baseline"]),
        Case("train: --out holds a run", "cli",
             lambda ws: ["train", "--out", str(ws / "run"), "--quiet", "--data", write(ws / "t.txt", TEXT), *SMALL],
             words=("already holds a run",)),
        Case("train: --out is a file", "cli", lambda ws: ["train", "--out", write(ws / "f", "x"), "--quiet"]),
        # resume
        Case("resume: a completed run", "cli", lambda ws: ["train", "--resume", str(ws / "run")],
             words=("already completed",)),
        Case("resume: not a run", "cli", lambda ws: ["train", "--resume", str(ws / "outside")],
             words=("not a cemtool run",)),
        Case("resume: run config of a newer schema", "cli",
             lambda ws: (set_status(ws / "run", "interrupted"),
                         write(ws / "run" / "config.json", json.dumps({"schema_version": 99})),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1]),
        Case("resume: meta.json not an object", "13",
             lambda ws: (write(ws / "run" / "meta.json", "[1, 2]"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1]),
        Case("resume: every step checkpoint a pickle", "12", _pickle_steps, words=("never unpickles",),
             check=meta_unchanged),
        Case("resume: every step checkpoint truncated (meta kept)", "10", _corrupt_all_steps,
             words=("corrupted",), check=meta_unchanged),
        Case("resume: killed during creation", "11", _half_created, words=("does not exist",)),
        # item 7: planted links
        Case("resume: .lock is a symlink", "7",
             lambda ws: (set_status(ws / "run", "interrupted"), relink(ws / "run" / ".lock", ws / "outside" /
                                                                      "victim.txt"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1],
             words=("symbolic link",), check=victim_intact),
        Case("train --force: .lock is a symlink", "7",
             lambda ws: (relink(ws / "run" / ".lock", ws / "outside" / "victim.txt"),
                         ["train", "--out", str(ws / "run"), "--force", "--quiet", "--data",
                          write(ws / "t.txt", TEXT), *SMALL])[-1],
             words=("symbolic link",), check=victim_intact),
        Case("resume: checkpoints/ is a symlink", "7",
             lambda ws: (set_status(ws / "run", "interrupted"),
                         shutil.copytree(ws / "run" / "checkpoints", ws / "outside" / "ck"),
                         relink(ws / "run" / "checkpoints", ws / "outside" / "ck"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1],
             words=("symbolic link",)),
        Case("resume: metrics.jsonl is a symlink", "7",
             lambda ws: (set_status(ws / "run", "interrupted"),
                         relink(ws / "run" / "metrics.jsonl", ws / "outside" / "victim.txt"),
                         ["train", "--resume", str(ws / "run"), "--quiet"])[-1],
             words=("symbolic link",), check=victim_intact),
        # reading runs: malformed files
        Case("runs: invalid UTF-8 line in metrics.jsonl", "13", _bad_utf8_metrics, expect="ok",
             words=("not UTF-8",)),
        Case("runs: killed run (running, lock free)", "10", _stopped, expect="ok", words=("stopped",)),
        Case("runs: folder does not exist", "cli", lambda ws: ["runs", str(ws / "nope")]),
        # checkpoints given to an analysis
        Case("sharpness: run does not exist", "cli", lambda ws: _sharp(ws, run="nope"), words=("does not exist",)),
        Case("sharpness: truncated final checkpoint", "12",
             lambda ws: (write(ws / "run" / "checkpoints" / "final.safetensors",
                               (ws / "run" / "checkpoints" / "final.safetensors").read_bytes()[:500]),
                         _sharp(ws))[-1], words=("corrupted",)),
        Case("sharpness: flipped data byte, no manifest", "12", lambda ws: (flip_final(ws, "data"), _sharp(ws))[-1],
             words=("checksum",)),
        Case("sharpness: flipped header byte, no manifest", "12",
             lambda ws: (flip_final(ws, "header"), _sharp(ws))[-1], words=("checksum",)),
        Case("sharpness: pickle as checkpoint", "cli",
             lambda ws: _sharp(ws, "--checkpoint", write(ws / "evil.safetensors", pickle.dumps({"x": 1}))),
             words=("never unpickles",)),
        Case("sharpness: torch.save file as checkpoint", "cli",
             lambda ws: (torch.save({"w": torch.ones(2)}, ws / "model.pt"),
                         _sharp(ws, "--checkpoint", str(ws / "model.pt")))[-1], words=("never unpickles",)),
        Case("sharpness: header step is not an integer", "13",
             lambda ws: _sharp(ws, "--checkpoint", handmade(ws, {"step": "abc"})), words=("invalid header",)),
        Case("sharpness: header alias to a missing tensor", "13",
             lambda ws: _sharp(ws, "--checkpoint", handmade(ws, {"step": 1, "aliases": {"v": "gone"}})),
             words=("invalid header",)),
        Case("sharpness: optimizer state names a missing tensor", "13",
             lambda ws: _sharp(ws, "--checkpoint", handmade(ws, {"step": 1, "optimizer": {"__dict__": [
                 ["state", {"__tensor__": "optim.gone"}], ["param_groups", []]]}})), words=("invalid header",)),
        Case("sharpness: weights of another model", "cli",
             lambda ws: _sharp(ws, "--checkpoint", handmade(ws, {"step": 1})), words=("does not fit",)),
        Case("sharpness: --tokens 0", "cli", lambda ws: _sharp(ws, "--tokens", "0")),
        Case("sharpness: --params matching nothing", "cli", lambda ws: _sharp(ws, "--params", "nonexistent.*")),
        Case("sharpness: --checkpoint step_999", "cli", lambda ws: _sharp(ws, "--checkpoint", "step_999")),
        Case("sharpness: --backend magic (usage)", "cli", lambda ws: _sharp(ws, "--backend", "magic")),
        Case("sharpness: config.json not UTF-8", "13",
             lambda ws: (write(ws / "run" / "config.json", b"\xff\xfe{}"), _sharp(ws))[-1], words=("corrupt",)),
        Case("sharpness: tokenizer.json garbage", "cli",
             lambda ws: (write(ws / "run" / "tokenizer.json", "{not json"), _sharp(ws))[-1]),
        Case("collapse-report: run does not exist", "cli", lambda ws: ["collapse-report", str(ws / "nope")]),
        Case("compare: folder does not exist", "cli", lambda ws: ["compare", str(ws / "nope")]),
        Case("plot: run does not exist", "cli", lambda ws: ["plot", str(ws / "nope")]),
        Case("forgetting: run does not exist", "cli",
             lambda ws: ["forgetting", str(ws / "nope"), "--to", "grammar-b", "--out", str(ws / "out")]),
        # slower: these measure before they write
        Case("sharpness --name ../../escape", "7", lambda ws: _sharp(ws, "--name", "../../escape"), fast=False,
             words=("not a plain name",)),
        Case("sharpness: reports/ is a symlink", "7",
             lambda ws: (relink(ws / "run" / "reports", ws / "outside"), _sharp(ws))[-1], fast=False,
             words=("symbolic link",)),
        Case("plot: plots/ is a symlink", "7",
             lambda ws: (relink(ws / "run" / "plots", ws / "outside"), ["plot", str(ws / "run")])[-1], fast=False,
             words=("symbolic link",)),
    ]
    if sys.platform.startswith("linux"):
        out.append(Case("train: disk full while writing a checkpoint", "10",
                        lambda ws: ["train", "--data", write(ws / "t.txt", TEXT), "--out", str(ws / "out"), "--quiet",
                                    "--device", "cpu", *SMALL],
                        words=("No space left on device",), patch=fail_fsync(".safetensors"),
                        check=lambda ws: None if json.loads((ws / "out" / "meta.json").read_text())["status"]
                        == "failed" and not list(ws.rglob("*.tmp")) else "status not failed, or a temp file left"))
    for more in (cases_hf, cases_files, cases_state, cases_user, cases_docs, cases_new):
        out += more()
    return out


# --------------------------------------------------------------------------------------------------------------
# running them


def snapshot(ws: Path) -> dict[str, bytes]:
    """Every file of the workspace outside run/ and out/ (where the command may write), links as their target."""
    files = {}
    for p in sorted(ws.rglob("*")):
        rel = p.relative_to(ws)
        if rel.parts[0] in ("run", "out"):
            continue
        if p.is_symlink():
            files[str(rel)] = b"-> " + os.readlink(p).encode()
        elif p.is_file():
            files[str(rel)] = p.read_bytes()
    return files


def judge(case: Case, code: int, output: str, ws: Path, before: dict) -> str | None:
    """Why the answer is not clean, or None."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if "Traceback" in output or "internal error" in output:
        return "traceback or internal error"
    if case.expect == "ok":
        if code != 0:
            return f"exit {code}"
    elif code == 1:
        if not lines or not lines[0].startswith("Error: ") or len(lines) > 2:
            return "exit 1 without a one-line 'Error:'"
    elif code == 2:
        if "Usage:" not in output:
            return "exit 2 without a usage message"
    else:
        return f"exit {code}"
    missing = [w for w in case.words if w not in output]
    if missing:
        return f"output lacks {missing}"
    after = snapshot(ws)
    if after != before:
        changed = sorted(k for k in set(after) | set(before) if after.get(k) != before.get(k))
        return f"wrote outside the run: {changed[:3]}"
    return case.check(ws) if case.check else None


def run_cases(root: Path, base_run: Path, fast_only: bool = False, items: tuple[str, ...] | None = None
              ) -> list[dict]:
    """Each case (only the fast ones, only those of these issue ``items``) in its own workspace under ``root``;
    returns one dict per case (case, item, clean, why, code, output, seconds)."""
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    runner = CliRunner()
    results = []
    chosen = [c for c in cases() if (c.fast or not fast_only) and (items is None or c.item in items)]
    for i, case in enumerate(chosen):
        ws = Path(root) / f"case{i:02d}"
        shutil.copytree(base_run, ws / "run", ignore=shutil.ignore_patterns(".lock"))
        write(ws / "outside" / "victim.txt", "precious")
        try:
            args = case.setup(ws)
        except Exception as e:  # a setup that cannot be done here (e.g. no symlinks) is reported, not counted
            results.append({"case": case.name, "item": case.item, "clean": False, "why": f"setup failed: {e!r}",
                            "code": None, "output": ""})
            continue
        before = snapshot(ws)
        t0 = time.perf_counter()
        undo = case.patch() if case.patch else None
        try:
            res = runner.invoke(app, [str(a) for a in args])
        finally:
            if undo:
                undo()
        output = res.output + ("".join(traceback.format_exception(res.exc_info[1]))
                               if res.exc_info and not isinstance(res.exc_info[1], SystemExit) else "")
        why = judge(case, res.exit_code, output, ws, before)
        results.append({"case": case.name, "item": case.item, "clean": why is None, "why": why,
                        "code": res.exit_code, "output": output.strip().splitlines()[:1],
                        "seconds": time.perf_counter() - t0})
    return results


def train_base(root: Path) -> Path:
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    data = Path(write(root / "corpus.txt", TEXT))
    args = ["train", "--data", str(data), "--out", str(root / "base"), "--quiet", "--device", "cpu"]
    for s in TINY:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    if res.exit_code != 0:
        raise SystemExit(f"training the tiny run failed: {res.output}")
    return root / "base"


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    fast = "--fast" in sys.argv
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cemtool-bad-inputs-") as tmp:
        base = train_base(Path(tmp))
        results = run_cases(Path(tmp) / "cases", base, fast_only=fast)
    for r in results:
        mark = "clean  " if r["clean"] else "UNCLEAN"
        print(f"{mark} [{r['item']:>3}] {r['case']}: exit {r['code']} ({r.get('seconds', 0):.1f} s)  "
              f"{(r['output'] or [''])[0][:100]}"
              + ("" if r["clean"] else f"  <- {r['why']}"))
    clean = sum(r["clean"] for r in results)
    print(f"tried {len(results)} / clean {clean}  ({time.perf_counter() - t0:.0f} s)")
    sys.exit(0 if clean == len(results) else 1)


if __name__ == "__main__":
    main()
