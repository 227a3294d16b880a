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

tests/test_reliability.py runs the fast cases on the test suite's tiny run.
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
    """Disk full (ENOSPC) on every file whose name contains ``marker`` (Linux: /proc/self/fd)."""

    def install() -> Callable[[], None]:
        real = os.fsync

        def fsync(fd):
            if marker in os.readlink(f"/proc/self/fd/{fd}"):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd)

        os.fsync = fsync
        return lambda: setattr(os, "fsync", real)

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


def cases_hf() -> list[Case]:
    """Cases of issue 20 items 1-5, 13-16: Hugging Face directories, safetensors, exports."""
    out: list[Case] = []
    return out


# --------------------------------------------------------------------------------------------------------------


def cases_files() -> list[Case]:
    """Cases of issue 20 items 6-8, 12: token files, special files, deep JSON, hand-edited studies."""
    out: list[Case] = []
    return out


# --------------------------------------------------------------------------------------------------------------


def cases_state() -> list[Case]:
    """Cases of issue 20 items 9-11, 18: locks, torchrun, forged checkpoints, interrupts."""
    out: list[Case] = []
    return out


# --------------------------------------------------------------------------------------------------------------


def cases_user() -> list[Case]:
    """Cases of issue 20 items 17, 19, 20, 22, 24: a new user's inputs."""
    out: list[Case] = []
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


def cases_new() -> list[Case]:
    """Cases of issue 20 item 24: sample, TensorBoard logging, the per-layer sharpness table."""
    out: list[Case] = []
    return out


# --------------------------------------------------------------------------------------------------------------


def cases() -> list[Case]:
    import torch

    out: list[Case] = [
        # train: bad data and configuration (tests/test_cli.py's list, and issue 10's)
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
