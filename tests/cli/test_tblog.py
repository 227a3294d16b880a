"""train.log_to=tensorboard: the metrics.jsonl rows, one function mapping a row to scalars, are the event file's
only content (also after a resume cut metrics.jsonl back); without the package training is refused before a run
is made. The mapping is tested always; the event-file round trip where tensorboard is importable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.config import resolve
from cemtool.data.corpus import load_corpus
from cemtool.runs import create_run, open_run
from cemtool.tblog import EVENT_FILE, TB_DIR, row_scalars
from cemtool.train import finalize_model_config, train

from kit import TINY, one_line_error, tiny_setup

SMALL = [*TINY, "model.n_layer=1", "model.d_model=16", "train.batch_size=4", "train.eval_tokens=256",
         "data.tokenizer=byte", "train.max_steps=20", "train.log_to=tensorboard"]


def test_row_scalars_takes_every_finite_number_but_the_step():
    row = {"step": 10, "tokens": 640, "val_loss": 2.5, "val_gap": None, "kind": "curvature", "converged": True,
           "lambda_max": float("nan"), "lr": 1e-3, "note": "x", "nested": {"a": 1}}
    assert row_scalars(row) == {"curvature/tokens": 640.0, "curvature/val_loss": 2.5, "curvature/lr": 1e-3}
    assert row_scalars({"step": 3, "val_loss": 2.0, "tokens": 8}) == {"eval/val_loss": 2.0, "eval/tokens": 8.0}
    assert row_scalars({"step": 3, "train_loss": 2.0, "tokens": 8}) == {"train/train_loss": 2.0, "train/tokens": 8.0}
    assert row_scalars({"step": 3}) == {}


def _no_tensorboard(monkeypatch):
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard -> ImportError


def test_without_the_package_training_is_refused_before_the_run_exists(tmp_path, text_file, monkeypatch):
    _no_tensorboard(monkeypatch)
    args = ["train", "--out", str(tmp_path / "r"), "--quiet", "--device", "cpu", "--data", text_file]
    for s in SMALL:
        args += ["--set", s]
    one_line_error(CliRunner().invoke(app, args), "tensorboard", "cemtool[tensorboard]")
    assert not (tmp_path / "r").exists()


def test_without_the_package_the_api_refuses_at_start(tmp_path, text_file, monkeypatch):
    from cemtool.errors import CemtoolError

    cfg = resolve(overrides=SMALL, data_source=text_file)
    corpus = load_corpus(cfg.data)
    cfg = finalize_model_config(cfg, corpus)
    _no_tensorboard(monkeypatch)
    with pytest.raises(CemtoolError, match=r"cemtool\[tensorboard\]"):
        train(cfg, corpus, None, device="cpu")


def _events(run: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(p.name for p in (run / TB_DIR).iterdir())
    assert files == [EVENT_FILE]
    ea = EventAccumulator(str(run / TB_DIR))
    ea.Reload()
    out = {}
    for tag in ea.Tags()["scalars"]:
        steps = [e.step for e in ea.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)  # no step twice (a resume rewrote the file)
        out[tag] = {e.step: e.value for e in ea.Scalars(tag)}
    return out


def _expected(run: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for tag, v in row_scalars(row).items():
            out.setdefault(tag, {})[row["step"]] = v
    return out


def _same(a, b):
    assert a.keys() == b.keys()
    for tag in a:
        assert a[tag].keys() == b[tag].keys(), tag
        for step in a[tag]:
            assert a[tag][step] == pytest.approx(b[tag][step], rel=1e-6), (tag, step)  # float32 in the events


def test_event_file_holds_exactly_the_metrics_rows_also_after_a_resume(tmp_path, text_file):
    pytest.importorskip("tensorboard")
    cfg, corpus = tiny_setup(text_file, "train.ckpt_every=5", "train.eval_every=5", "train.log_every=2", base=SMALL)
    path = tmp_path / "r"
    run = create_run(path, cfg, tokenizer=corpus.tokenizer)
    try:  # killed after step 12: metrics.jsonl has rows up to step 12, the newest checkpoint is step 10
        assert train(cfg, corpus, run, device="cpu", stop_after=12).status == "interrupted"
    finally:
        run.unlock()
    before = _events(path)
    _same(before, _expected(path))
    assert max(before["train/train_loss"]) == 12
    run = open_run(path, lock=True)
    try:
        assert train(cfg, corpus, run, device="cpu", resume=True).status == "completed"
    finally:
        run.unlock()
    after = _events(path)
    _same(after, _expected(path))
    assert sorted(after["eval/val_loss"]) == [0, 5, 10, 15, 20]
    assert sorted(after["train/train_loss"]) == list(range(2, 21, 2))


def test_log_to_is_validated():
    from cemtool.errors import ConfigError

    with pytest.raises(ConfigError, match="train.log_to"):
        resolve(overrides=["train.log_to=wandb"])
