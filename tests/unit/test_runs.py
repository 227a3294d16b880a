"""Run directories: checkpoints round trip, corruption, pickle refusal, locking, listing."""

import json
import pickle

import pytest
import torch

from cemtool.checkpoints import find_checkpoint, load_weights, read_checkpoint, save_checkpoint
from cemtool.errors import CemtoolError
from cemtool.runs import Run, create_run, list_runs, open_run
from cemtool.subject import open_subject


def test_load_run_gives_model_config_tokenizer(tiny_run):
    lr = open_subject(tiny_run)
    assert lr.config.model.arch == "baseline" and lr.tokenizer.vocab_size == 256
    assert not lr.model.training
    idx = torch.tensor([lr.tokenizer.encode("The quick fox")])
    assert lr.model(idx).shape == (1, idx.shape[1], 256)
    meta = json.loads((lr.run.path / "meta.json").read_text())
    assert meta["status"] == "completed" and "torch" in meta["versions"] and meta["argv"]


def test_checkpoint_round_trip_with_optimizer(tiny_run, tmp_path):
    lr = open_subject(tiny_run)
    model = lr.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    run = Run(tmp_path)
    save_checkpoint(run, "step_000001", model, step=1, optimizer=opt, state={"tokens": 7})
    ck = read_checkpoint(tmp_path / "checkpoints" / "step_000001.safetensors")
    assert ck.step == 1 and ck.header["state"]["tokens"] == 7
    for k, v in model.state_dict().items():
        assert torch.equal(ck.weights[k], v)
    opt2 = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt2.load_state_dict(ck.optimizer_state())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for i in s1["state"]:
        for key in s1["state"][i]:
            assert torch.equal(s1["state"][i][key], s2["state"][i][key])
    assert s1["param_groups"] == s2["param_groups"]


def test_truncated_and_corrupted_checkpoints(tiny_run, tmp_path):
    import shutil

    run_dir = tmp_path / "r"
    shutil.copytree(tiny_run, run_dir)
    final = run_dir / "checkpoints" / "final.safetensors"
    data = final.read_bytes()
    final.write_bytes(data[: len(data) // 2])
    with pytest.raises(CemtoolError, match="corrupted"):
        open_subject(run_dir)
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    final.write_bytes(bytes(flipped))
    with pytest.raises(CemtoolError, match="checksum"):
        open_subject(run_dir)
    assert (run_dir / "config.json").exists()  # nothing else touched


def test_pickle_is_never_unpickled(tmp_path, monkeypatch):
    evil = tmp_path / "evil.safetensors"
    evil.write_bytes(pickle.dumps({"x": 1}))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(CemtoolError, match="never unpickles"):
        read_checkpoint(evil)
    pt = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, pt)
    with pytest.raises(CemtoolError, match="never unpickles"):
        read_checkpoint(pt)


def test_lock_excludes_second_writer(tmp_path):
    from cemtool.config import resolve

    run = create_run(tmp_path / "r", resolve())
    with pytest.raises(CemtoolError, match="in use"):
        open_run(tmp_path / "r", lock=True)
    run.unlock()
    open_run(tmp_path / "r", lock=True).unlock()


def test_existing_run_refused_and_force_moves_aside(tmp_path):
    from cemtool.config import resolve

    create_run(tmp_path / "r", resolve()).unlock()
    (tmp_path / "r" / "keep.txt").write_text("precious")
    with pytest.raises(CemtoolError, match="already holds a run"):
        create_run(tmp_path / "r", resolve())
    create_run(tmp_path / "r", resolve(), force=True).unlock()
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("r.replaced-")]
    assert len(moved) == 1 and (moved[0] / "keep.txt").read_text() == "precious"


def test_list_runs_and_checkpoint_lookup(tiny_run):
    rows = list_runs(tiny_run)
    assert rows[0]["status"] == "completed" and rows[0]["val_loss"] > 0
    run = open_run(tiny_run)
    assert find_checkpoint(run, "latest").name.startswith("step_")
    with pytest.raises(CemtoolError, match="does not exist"):
        find_checkpoint(run, 999999)


def test_weights_that_do_not_fit(tiny_run, tmp_path):
    from cemtool.config import replace
    from cemtool.models import build_model

    lr = open_subject(tiny_run)
    other = build_model(replace(lr.config.model, d_model=48, n_head=2))
    with pytest.raises(CemtoolError, match="does not fit"):
        load_weights(other, read_checkpoint(lr.checkpoint))


def test_safetensors_whose_header_length_starts_with_0x80_is_accepted(tmp_path):
    """A real safetensors file can begin with byte 0x80 (its header length); it must not be taken for a pickle."""
    import struct

    from safetensors.torch import save

    data = save({"model.w": torch.zeros(3)}, metadata={"cemtool": json.dumps({"step": 3})})
    n = struct.unpack("<Q", data[:8])[0]
    pad = (0x80 - n % 256) % 256 or 256
    header = data[8:8 + n].rstrip(b" ") + b" " * (n - len(data[8:8 + n].rstrip(b" ")) + pad)
    blob = struct.pack("<Q", len(header)) + header + data[8 + n:]
    assert blob[0] == 0x80
    p = tmp_path / "x.safetensors"
    p.write_bytes(blob)
    assert read_checkpoint(p).step == 3


def _raise(c):
    raise ValueError(f"non-strict JSON constant {c}")


def test_metrics_rows_are_strict_json(tmp_path):
    from cemtool.config import RunConfig

    run = create_run(tmp_path / "r", RunConfig())
    run.append_metrics({"step": 1, "train_loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    run.append_metrics({"step": 2, "train_loss": 2.5})
    lines = (run.path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=_raise) for line in lines]
    assert rows[0]["train_loss"] is None and rows[0]["grad_norm"] is None and rows[1]["train_loss"] == 2.5
    run.truncate_metrics(2)  # rewritten rows stay strict
    for line in (run.path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=_raise)


def test_console_json_is_strict(capsys):
    import numpy as np

    from cemtool.cli.console import print_json

    print_json({"a": float("nan"), "b": np.array([1.0, np.inf]), "c": np.float32(2.0), "p": "x"})
    out = json.loads(capsys.readouterr().out, parse_constant=_raise)
    assert out == {"a": None, "b": [1.0, None], "c": 2.0, "p": "x"}



def test_one_json_sanitiser_for_reports_and_console(capsys, tmp_path):
    """to_json_value is the one sanitiser: reports refuse unknown types, the console prints them as strings; both
    give the same strict JSON for numbers, arrays, tensors, paths and non-finite floats."""
    import numpy as np
    import torch

    from cemtool.cli.console import print_json
    from cemtool.writes import to_json_value

    obj = {"x": (np.float64("-inf"), torch.tensor([0.5, float("nan")])), "p": tmp_path, "n": np.int64(3)}
    plain = {"x": [None, [0.5, None]], "p": str(tmp_path), "n": 3}
    assert to_json_value(obj) == plain
    assert json.loads(json.dumps(to_json_value(obj), allow_nan=False)) == plain  # strict round trip
    with pytest.raises(TypeError, match="not JSON serialisable: set"):
        to_json_value({"s": {1}})
    assert to_json_value({"s": {1}}, unknown_as_str=True) == {"s": "{1}"}
    print_json({**obj, "s": {1}})
    assert json.loads(capsys.readouterr().out, parse_constant=_raise) == {**plain, "s": "{1}"}

def test_a_file_is_not_a_run_directory(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(CemtoolError, match="is a file, not a run directory"):
        open_run(f)


def test_sessions_left_open_are_counted_once_each_in_order(tmp_path):
    """Two processes that never end (killed with -9 after a checkpoint's progress record) and a third that ends:
    each left-open session joins ``sessions`` once, marked unended, as of its newest record, and train_seconds is
    the sum of the three. A process's own record is replaced, not counted, and a record never overwrites another
    process's. Fails if a left-open session is dropped or overwritten instead of moved, or if a process's own
    record is counted beside its session."""
    from cemtool.config import RunConfig

    run = create_run(tmp_path / "r", RunConfig())
    s = lambda t, a, b, sec: {"started": t, "from_step": a, "to_step": b, "seconds": sec, "device": "cpu"}  # noqa: E731
    run.record_progress(s("t1", 0, 10, 1.0))
    run.record_progress(s("t1", 0, 20, 2.0))  # the same process's newer checkpoint replaces its record
    assert "sessions" not in run.meta() or run.meta()["sessions"] == []
    run.mark_resumed("cpu")
    run.record_progress(s("t2", 20, 30, 4.0))
    run.mark_resumed("cpu")
    run.record_progress(s("t3", 30, 40, 6.0))  # replaced by its own session when it ends
    run.end_session(s("t3", 30, 50, 8.0), "completed")
    meta = run.meta()
    assert [(x["started"], x["to_step"], x.get("unended", False)) for x in meta["sessions"]] == [
        ("t1", 20, True), ("t2", 30, True), ("t3", 50, False)]
    assert meta["train_seconds"] == 14.0 and "open_session" not in meta and meta["resumed"] == 2
    # a record finding another process's left-open session (no resume between) moves it in first
    other = create_run(tmp_path / "o", RunConfig())
    other.record_progress(s("t1", 0, 10, 1.0))
    other.record_progress(s("t2", 10, 20, 3.0))
    meta = other.meta()
    assert [x["started"] for x in meta["sessions"]] == ["t1"] and meta["open_session"]["started"] == "t2"
    assert meta["train_seconds"] == 1.0
    # a hand-edited record that is not an object does not hide a failing run's own error
    meta["open_session"] = "junk"
    (other.path / "meta.json").write_text(json.dumps(meta))
    other.end_session(s("t3", 20, 20, 0.5), "failed", best_effort=True)
    assert other.meta()["status"] == "failed" and other.meta()["train_seconds"] == 1.5
    run.unlock()
    other.unlock()
