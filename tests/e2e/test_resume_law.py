"""Kill and resume, as a property of in-process training: a run stopped after any step k (as if killed: what it did
after its newest step checkpoint is lost) and resumed ends with the final weights and the metrics of an
uninterrupted run, bit for bit, whatever the checkpoint cadence (its step checkpoints hold the optimizer state).
The real SIGKILL of a training process: tests/e2e/test_train.py::test_kill_and_resume_is_bit_exact (and
scripts/kill_resume.py, run by tests/e2e/test_kill_fuzz.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.checkpoints import find_checkpoint, read_checkpoint
from cemtool.runs import open_run

from kit import tiny_setup, tiny_train

STEPS = 12
# a smaller tiny run than the kit's (1 layer of 16, batches of 4): an evaluation every 4 steps, a row every step
SMALL = ["model.n_layer=1", "model.d_model=16", "train.batch_size=4", f"train.max_steps={STEPS}", "train.eval_every=4",
         "train.eval_tokens=128", "train.log_every=1", "train.warmup_steps=2", "train.keep_checkpoints=100"]


def final_tensors(path) -> dict[str, torch.Tensor]:
    return read_checkpoint(find_checkpoint(open_run(path), "final")).weights


def rows(path) -> list[tuple]:
    return [(m["step"], m["tokens"], m.get("train_loss"), m.get("val_loss"), m.get("lr"))
            for m in open_run(path).metrics() if "train_loss" in m or "val_loss" in m]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_file):
    """The uninterrupted run (a checkpoint only at its end)."""
    path = tmp_path_factory.mktemp("law") / "ref"
    cfg, corpus = tiny_setup(text_file, *SMALL, f"train.ckpt_every={STEPS}")
    assert tiny_train(path, cfg, corpus).status == "completed"
    return final_tensors(path), rows(path)


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, STEPS - 1), cadence=st.integers(1, STEPS))
def test_stopped_at_any_step_and_resumed_is_the_uninterrupted_run(reference, text_file, tmp_path_factory, k, cadence):
    tensors, metrics = reference
    path = tmp_path_factory.mktemp("law") / "run"
    cfg, corpus = tiny_setup(text_file, *SMALL, f"train.ckpt_every={cadence}")
    stopped = tiny_train(path, cfg, corpus, stop_after=k)
    assert stopped.status == "interrupted" and stopped.step == k
    assert stopped.resume_step == (k // cadence * cadence or None)  # the newest step checkpoint
    resumed = tiny_train(path, cfg, corpus, resume=True)
    assert resumed.status == "completed" and resumed.step == STEPS
    got = final_tensors(path)
    assert got.keys() == tensors.keys() and all(torch.equal(got[n], tensors[n]) for n in tensors)
    assert rows(path) == metrics
