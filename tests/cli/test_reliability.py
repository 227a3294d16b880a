"""Run-directory reliability and security (issue 10, items 7 and 10-13): planted links are never followed, a killed
or failed run never stays 'running', run creation is all-or-nothing, corrupt checkpoints are skipped on resume and
detected without the manifest, malformed metrics and checkpoint headers are one-line errors. Plus the bad-input tally
(scripts/bad_inputs.py) on its fast cases."""

import errno
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from cemtool.checkpoints import read_checkpoint, save_checkpoint, step_checkpoints
from cemtool.cli.main import app
from cemtool.config import resolve
from cemtool.errors import CemtoolError
from cemtool.runs import Run, create_run, list_runs, open_run
from cemtool.writes import atomic_write_bytes, safe_name

from kit import one_line_error

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def copy_run(tiny_run, tmp_path, status=None) -> Path:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    if status is not None:
        meta = json.loads((run / "meta.json").read_text())
        meta["status"] = status
        (run / "meta.json").write_text(json.dumps(meta))
    return run


def interrupted_copy(tiny_run, tmp_path) -> Path:
    """The tiny run as if killed after its step-20 checkpoint: step checkpoints 10 and 20, no final."""
    run = copy_run(tiny_run, tmp_path, status="interrupted")
    (run / "checkpoints" / "final.safetensors").unlink()
    return run


def files_under(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and not p.is_symlink()}


# --------------------------------------------------------------------------------------------------------------
# item 7: links planted in a run directory


def test_planted_lock_symlink_is_never_written_through(tmp_path):
    create_run(tmp_path / "r", resolve()).unlock()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "r" / ".lock").unlink()
    (tmp_path / "r" / ".lock").symlink_to(victim)
    with pytest.raises(CemtoolError, match="symbolic link"):
        open_run(tmp_path / "r", lock=True)  # what --resume does
    with pytest.raises(CemtoolError, match="symbolic link"):
        create_run(tmp_path / "r", resolve(), force=True)  # --force probes the lock first
    assert victim.read_text() == "precious"
    res = invoke("train", "--resume", tmp_path / "r", "--quiet")
    one_line_error(res, "symbolic link", ".lock")
    assert victim.read_text() == "precious"


@pytest.mark.parametrize("sub", ["reports", "checkpoints", "plots"])
def test_symlinked_run_subfolder_is_refused(tmp_path, sub):
    run = create_run(tmp_path / "r", resolve())
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "step_000001.safetensors").write_bytes(b"not yours")
    (tmp_path / "r" / sub).symlink_to(outside, target_is_directory=True)
    with pytest.raises(CemtoolError, match="symbolic link"):
        getattr(run, sub)
    with pytest.raises(CemtoolError, match="symbolic link"):  # also when the path is built by hand
        atomic_write_bytes(tmp_path / "r" / sub / "x.json", b"{}")
    if sub == "checkpoints":
        model = torch.nn.Linear(2, 2)
        with pytest.raises(CemtoolError, match="symbolic link"):
            save_checkpoint(run, "step_000002", model, step=2)
        with pytest.raises(CemtoolError, match="symbolic link"):
            step_checkpoints(run)  # what pruning lists before deleting
    assert sorted(p.name for p in outside.iterdir()) == ["step_000001.safetensors"]
    run.unlock()


def test_planted_metrics_symlink_is_not_appended_to(tmp_path):
    run = create_run(tmp_path / "r", resolve())
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "r" / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(CemtoolError, match="symbolic link"):
        run.append_metrics({"step": 1})
    assert victim.read_text() == "precious"
    run.unlock()


@pytest.mark.parametrize("name", ["../../escape", "a/b", "..", ".hidden", "", "-rf", "x" * 101, "a\x00b", "/etc/x"])
def test_report_names_stay_inside_their_folder(tmp_path, name):
    from cemtool.report import write_report

    reports = tmp_path / "run" / "reports"
    with pytest.raises(CemtoolError, match="not a plain name"):
        safe_name(name)
    with pytest.raises(CemtoolError, match="not a plain name"):
        write_report(reports, name, {"x": 1}, [{"x": 1}])
    with pytest.raises(CemtoolError, match="not a plain name"):
        Run(tmp_path / "run").write_report(name, {"x": 1})
    assert not any(tmp_path.rglob("*.json"))
    for ok in ("sharpness", "sharpness-layer-0", "collapse_compare", "sharpness_pyhessian", "a.b+c=d"):
        assert safe_name(ok) == ok


# --------------------------------------------------------------------------------------------------------------
# item 10: status after a crash, OSError, temporary files, failed resume


def test_killed_run_is_listed_as_stopped(tmp_path):
    run = create_run(tmp_path / "r", resolve())
    assert list_runs(tmp_path)[0]["status"] == "running"  # its process holds the lock
    run.unlock()  # what the kernel does when the process is killed with -9
    row = list_runs(tmp_path)[0]
    assert row["status"] == "stopped" and "no process" in row["notes"][0]
    assert json.loads((tmp_path / "r" / "meta.json").read_text())["status"] == "running"  # nothing rewritten
    res = invoke("runs", tmp_path)
    assert res.exit_code == 0 and "stopped" in res.output


def _fail_fsync_for(monkeypatch, suffix: str):
    """Make fsync fail with 'No space left on device' for files whose name contains ``suffix`` (Linux /proc), with
    writes flushed to disk (the suite's CEMTOOL_FSYNC=0 undone: tests/kit.py)."""
    monkeypatch.setenv("CEMTOOL_FSYNC", "1")
    real = os.fsync

    def fsync(fd):
        if suffix in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_writes_are_flushed_to_disk_unless_told_not_to(tmp_path, monkeypatch):
    """fsync before the rename by default (and with any value but 0); CEMTOOL_FSYNC=0 renames without it."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    for value, want in ((None, 1), ("1", 1), ("yes", 1), ("0", 0)):
        if value is None:
            monkeypatch.delenv("CEMTOOL_FSYNC", raising=False)
        else:
            monkeypatch.setenv("CEMTOOL_FSYNC", value)
        synced.clear()
        atomic_write_bytes(tmp_path / "f.json", b"{}")
        assert len(synced) == want and (tmp_path / "f.json").read_bytes() == b"{}", value
    assert [p.name for p in tmp_path.iterdir()] == ["f.json"]  # renamed into place either way


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc/self/fd")
def test_disk_full_is_one_line_removes_temp_and_marks_failed(tmp_path, text_file, monkeypatch):
    _fail_fsync_for(monkeypatch, "report")
    with pytest.raises(CemtoolError, match=r"cannot write .*report.json: No space left on device"):
        atomic_write_bytes(tmp_path / "report.json", b"{}" * 1000)
    assert list(tmp_path.iterdir()) == []  # the partial temporary file is gone
    # through `cemtool train`: the first step checkpoint cannot be written
    monkeypatch.undo()
    _fail_fsync_for(monkeypatch, ".safetensors")
    out = tmp_path / "o"
    sets = ["model.n_layer=1", "model.d_model=16", "model.n_head=2", "data.seq_len=8", "train.batch_size=4",
            "train.max_steps=4", "train.eval_every=2", "train.eval_tokens=64", "data.tokenizer=byte"]
    res = invoke("train", "--data", text_file, "--out", out, "--quiet", "--device", "cpu",
                 *[a for s in sets for a in ("--set", s)])
    one_line_error(res, "cannot write", "step_000002.safetensors", "No space left on device")
    assert json.loads((out / "meta.json").read_text())["status"] == "failed"
    assert not [p.name for p in out.rglob("*.tmp*")]


def test_stale_temporary_files_are_cleaned_on_open(tmp_path):
    create_run(tmp_path / "r", resolve()).unlock()
    dead = 2 ** 22 + 12345  # above the kernel's pid_max: no such process
    stale = [tmp_path / "r" / f".meta.json.{dead}.0badc0de.tmp", tmp_path / "r" / f".config.json.tmp{dead}"]
    (tmp_path / "r" / "checkpoints").mkdir()
    stale.append(tmp_path / "r" / "checkpoints" / f".step_000010.safetensors.{dead}.12ab.tmp")
    live = tmp_path / "r" / f".meta.json.{os.getpid()}.abcd.tmp"  # a writer that is still alive
    for p in [*stale, live]:
        p.write_bytes(b"x" * 100)
    open_run(tmp_path / "r", lock=True).unlock()
    assert not any(p.exists() for p in stale) and live.exists()


def test_failed_resume_leaves_meta_untouched(tmp_path, tiny_run):
    run = interrupted_copy(tiny_run, tmp_path)
    for ck in (run / "checkpoints").glob("step_*.safetensors"):
        ck.write_bytes(ck.read_bytes()[:100])  # no checkpoint verifies
    before = (run / "meta.json").read_bytes()
    one_line_error(invoke("train", "--resume", run, "--quiet"), "corrupted")
    assert (run / "meta.json").read_bytes() == before


# --------------------------------------------------------------------------------------------------------------
# item 11: run creation is all-or-nothing


def test_kill_during_run_creation_leaves_no_half_run(tmp_path, monkeypatch):
    import cemtool.runs as runs

    class Tok:
        def save(self, path):
            raise SystemExit("killed")  # the process dies after config.json, before tokenizer.json

    dead = 2 ** 22 + 777
    monkeypatch.setattr(runs.os, "getpid", lambda: dead)  # the temporary folder's name carries a dead pid
    monkeypatch.setattr(runs.shutil, "rmtree", lambda *a, **k: None)  # kill -9: no clean-up runs
    with pytest.raises(SystemExit):
        create_run(tmp_path / "r", resolve(), tokenizer=Tok())
    monkeypatch.undo()
    assert not (tmp_path / "r").exists()  # no run that --resume would choke on
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".r.creating.")
    one_line_error(invoke("train", "--resume", tmp_path / "r"), "does not exist")
    create_run(tmp_path / "r", resolve()).unlock()  # no --force needed; the leftover is cleaned
    assert [p.name for p in tmp_path.iterdir()] == ["r"]
    assert {"config.json", "meta.json", ".lock"} <= {p.name for p in (tmp_path / "r").iterdir()}


def test_created_run_holds_its_tokenizer(tmp_path):
    from cemtool.data.tokenizer import byte_tokenizer, load_tokenizer

    run = create_run(tmp_path / "r", resolve(), tokenizer=byte_tokenizer())
    assert run.path == tmp_path / "r" and load_tokenizer(tmp_path / "r" / "tokenizer.json").vocab_size == 256
    with pytest.raises(CemtoolError, match="in use"):
        open_run(tmp_path / "r", lock=True)  # the lock taken in the temporary folder moved with it
    run.unlock()


# --------------------------------------------------------------------------------------------------------------
# item 12: corrupt checkpoints


def test_resume_falls_back_to_newest_verifying_checkpoint_bit_exact(tmp_path, tiny_run):
    run = interrupted_copy(tiny_run, tmp_path)
    newest = run / "checkpoints" / "step_000020.safetensors"
    newest.write_bytes(newest.read_bytes()[:-50])
    res = invoke("train", "--resume", run, "--quiet")
    assert res.exit_code == 0, res.output
    assert "resuming from step_000010.safetensors: skipped step_000020.safetensors" in res.output
    assert (run / "checkpoints" / "step_000020.safetensors.corrupt").exists()
    ref = read_checkpoint(Path(tiny_run) / "checkpoints" / "final.safetensors")
    got = read_checkpoint(run / "checkpoints" / "final.safetensors")
    assert got.step == ref.step == 30
    for k, v in ref.weights.items():
        assert torch.equal(got.weights[k], v), k  # resumed from step 10: still bit-exact
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["resumed"] == 1


@pytest.mark.parametrize("where", ["data", "header"])
def test_flipped_byte_detected_without_manifest(tmp_path, tiny_run, where):
    run = copy_run(tiny_run, tmp_path)
    (run / "checkpoints" / "manifest.json").unlink()
    final = run / "checkpoints" / "final.safetensors"
    data = bytearray(final.read_bytes())
    n = struct.unpack("<Q", data[:8])[0]
    if where == "data":
        data[8 + n + (len(data) - 8 - n) // 2] ^= 0x01
    else:  # a digit of the step inside the cemtool header (still valid JSON)
        i = data.index(b'\\"step\\": 30') + len(b'\\"step\\": ')
        data[i] = ord("4")
    final.write_bytes(bytes(data))
    with pytest.raises(CemtoolError, match="checksum mismatch"):
        read_checkpoint(final)
    one_line_error(invoke("sharpness", run, "--quick", "--quiet"), "checksum mismatch")


# --------------------------------------------------------------------------------------------------------------
# item 13: malformed metrics lines and hand-crafted checkpoint headers


def test_invalid_utf8_in_metrics_is_skipped_with_a_note(tmp_path, tiny_run):
    from cemtool.plots.training import read_run

    run = copy_run(tiny_run, tmp_path)
    good = len(Run(run).metrics())
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 31, "val_loss": \xff\xfe}\n\x80garbage\n[1, 2]\n')
    notes: list[str] = []
    assert len(Run(run).metrics(notes)) == good
    assert [n.split("(")[1] for n in notes] == ["not UTF-8)", "not UTF-8)", "not a JSON object)"]
    res = invoke("runs", run)
    assert res.exit_code == 0 and "completed" in res.output and "not UTF-8" in res.output, res.output
    assert len(read_run(run).val) == len([m for m in Run(run).metrics() if "val_loss" in m])  # `cemtool plot`


def _handmade(path: Path, header: dict, tensors: dict) -> Path:
    from safetensors.torch import save

    path.write_bytes(save(tensors, metadata={"cemtool": json.dumps(header)}))
    return path


@pytest.mark.parametrize("header, tensors, what", [
    ({"step": "abc"}, {"model.w": torch.zeros(2)}, "step 'abc'"),
    ({"step": 1.5}, {"model.w": torch.zeros(2)}, "step 1.5"),
    ({"step": 1, "aliases": {"model.v": "missing"}}, {"model.w": torch.zeros(2)}, "alias"),
    ({"step": 1, "optimizer": {"__dict__": [["state", {"__tensor__": "optim.gone"}], ["param_groups", []]]}},
     {"model.w": torch.zeros(2)}, "optimizer state"),
    ({"step": 1, "state": {"tokens": "many"}}, {"model.w": torch.zeros(2)}, "tokens"),
    ([1, 2], {"model.w": torch.zeros(2)}, "not a JSON object"),
    ({"step": 1}, {"model.w": torch.zeros(2), "rng.torch": torch.zeros(3)}, "RNG"),
])
def test_handmade_checkpoint_headers_are_one_line_errors(tmp_path, tiny_run, header, tensors, what):
    bad = _handmade(tmp_path / "bad.safetensors", header, tensors)
    with pytest.raises(CemtoolError, match="invalid header") as e:
        read_checkpoint(bad)
    assert what in e.value.message
    one_line_error(invoke("sharpness", tiny_run, "--checkpoint", bad, "--quick", "--quiet"),
                   "invalid header")


# --------------------------------------------------------------------------------------------------------------
# the bad-input tally (the fast cases of items 6-8, 11-13; `python scripts/bad_inputs.py` runs them all)


def test_bad_inputs_script_fast_cases_are_clean(tmp_path, tiny_run):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        import bad_inputs
    finally:
        sys.path.pop(0)
    results = bad_inputs.run_cases(tmp_path, Path(tiny_run), fast_only=True, items=("6", "7", "8", "11", "12", "13"))
    assert len(results) >= 15
    unclean = [(r["case"], r["why"]) for r in results if not r["clean"]]
    assert not unclean, unclean
