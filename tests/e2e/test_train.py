"""The training loop: schedules, groups, determinism, kill-and-resume bit-exactness, DDP equivalence, NaN stop."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.config import TrainConfig
from cemtool.data.corpus import load_corpus
from cemtool.errors import CemtoolError
from cemtool.runs import create_run, open_run
from cemtool.subject import open_subject
from cemtool.train import NonFiniteLoss, lr_at, make_optimizer, train

from kit import TINY, set_args, tiny_config, tiny_setup, tiny_train

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def cli(*args) -> subprocess.CompletedProcess:
    """`cemtool ARGS` in a process of its own, forked from tests/procs.py's server."""
    return procs.run([sys.executable, "-m", "cemtool", *args], env=ENV)


def sets(extra=()):
    return set_args(*TINY, "data.tokenizer=byte", *extra)


def metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def losses(run):
    return [(m["step"], m["train_loss"]) for m in metrics(run) if "train_loss" in m]


def test_schedules():
    tc = TrainConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(0, 100, tc) == pytest.approx(0.1) and lr_at(9, 100, tc) == pytest.approx(1.0)
    assert lr_at(100, 100, tc) == pytest.approx(0.1)
    assert lr_at(55, 100, tc) == pytest.approx(0.55)
    wsd = TrainConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(79, 100, wsd) == 1.0 and lr_at(90, 100, wsd) == pytest.approx(0.5)
    assert lr_at(50, 100, TrainConfig(lr=2.0, warmup_steps=0, schedule="constant")) == 2.0


def test_param_groups_decay_and_custom(tiny_run):
    model = open_subject(tiny_run).model
    model.blocks[0].ln1.weight.opt_group = "router"
    model.blocks[0].ln1.weight.lr_mult = 10.0
    opt = make_optimizer(model, TrainConfig(lr=1e-3, weight_decay=0.1), torch.device("cpu"))
    groups = {g["name"]: g for g in opt.param_groups}
    assert set(groups) == {"decay", "no_decay", "router"}
    assert groups["router"]["lr"] == pytest.approx(1e-2) and groups["router"]["weight_decay"] == 0.0
    assert "tok_emb.weight" in groups["no_decay"]["param_names"]
    assert all(n.endswith("weight") and ".ln" not in n for n in groups["decay"]["param_names"])
    del model.blocks[0].ln1.weight.opt_group


def test_same_seed_identical_metrics(tmp_path, text_file):
    """The same seed gives the same metrics in this process (the kit's in-process training) as in another
    `cemtool train` process; another seed other losses."""
    tiny_train(tmp_path / "a", *tiny_setup(text_file))
    b = cli("train", "--data", text_file, "--out", str(tmp_path / "b"), "--quiet", *sets())
    assert b.returncode == 0
    strip = lambda ms: [{k: v for k, v in m.items() if k not in ("tokens_per_s", "elapsed_s")} for m in ms]  # noqa
    assert strip(metrics(tmp_path / "a")) == strip(metrics(tmp_path / "b"))
    tiny_train(tmp_path / "c", *tiny_setup(text_file, "seed=1"))
    assert losses(tmp_path / "c") != losses(tmp_path / "a")


def test_kill_and_resume_is_bit_exact(tmp_path, text_file):
    """SIGKILL a real training process after its first checkpoint, resume it (in this process), compare with an
    uninterrupted run (trained in this process). The same law for any stop step and checkpoint cadence:
    tests/e2e/test_resume_law.py."""
    extra = ["train.max_steps=120", "train.eval_every=40", "train.ckpt_every=20", "train.log_every=10"]
    ref = tmp_path / "ref"
    tiny_train(ref, *tiny_setup(text_file, *extra))
    killed = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "cemtool", "train", "--data", text_file, "--out", str(killed),
                             "--quiet", *sets(extra)], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 120

    def saved() -> bool:  # the first step checkpoint (its session's progress in meta.json comes before it)
        meta = killed / "meta.json"
        return meta.exists() and "last_checkpoint" in meta.read_text()

    while not saved() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    assert not (killed / "checkpoints" / "final.safetensors").exists()
    assert json.loads((killed / "meta.json").read_text())["status"] == "running"
    res = CliRunner().invoke(app, ["train", "--resume", str(killed), "--quiet"])  # resumed in this process
    assert res.exit_code == 0, res.output
    a = load_file(str(ref / "checkpoints" / "final.safetensors"))
    b = load_file(str(killed / "checkpoints" / "final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(ref) == losses(killed)
    meta = json.loads((killed / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["resumed"] == 1
    # the killed process's training up to its checkpoint is counted: a session marked unended, then the resumed one
    # (from that checkpoint, or from the one before if the kill came while the next was being written)
    dead, resumed = meta["sessions"]
    assert dead["unended"] and dead["from_step"] == 0 and dead["to_step"] % 20 == 0 and dead["seconds"] > 0
    assert resumed["from_step"] in (dead["to_step"], dead["to_step"] - 20) and resumed["from_step"] > 0
    assert dead["started"] <= dead["ended"] <= resumed["started"]
    assert "unended" not in resumed and resumed["to_step"] == 120 and "open_session" not in meta
    assert meta["train_seconds"] == pytest.approx(dead["seconds"] + resumed["seconds"], rel=1e-12)
    # resuming a completed run is refused, and leaves it as it was
    again = CliRunner().invoke(app, ["train", "--resume", str(killed), "--quiet"])
    assert again.exit_code == 1 and "already completed" in again.output


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_match_one(tmp_path, text_file):
    one = tmp_path / "one"
    tiny_train(one, *tiny_setup(text_file))  # one process: this one
    two = tmp_path / "two"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(_free_port()), "-m", "cemtool", "train", "--data", text_file, "--out", str(two),
                          "--quiet", *sets()], env=ENV, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((two / "meta.json").read_text())["world_size"] == 2
    l1, l2 = losses(one), losses(two)
    assert [s for s, _ in l1] == [s for s, _ in l2]
    for (_, a), (_, b) in zip(l1, l2):
        assert abs(a - b) < 1e-4 * abs(a)
    w1 = load_file(str(one / "checkpoints" / "final.safetensors"))
    w2 = load_file(str(two / "checkpoints" / "final.safetensors"))
    assert all(torch.allclose(w1[k], w2[k], atol=1e-4) for k in w1)

    # the same 2-process run killed after its step-20 checkpoint, resumed on 2 ranks: every rank restores the
    # step, weights and optimizer state (before the fix only rank 0 did, and the ranks ran different schedules)
    three = tmp_path / "three"
    shutil.copytree(two, three)
    (three / "checkpoints" / "final.safetensors").unlink()
    meta = json.loads((three / "meta.json").read_text())
    (three / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    # (the resume's 2 ranks in torchrun's environment, forked (tests/procs.py); the run above had the launcher. A
    # rank that fails makes the other fail within CEMTOOL_DIST_TIMEOUT, which ends the wait)
    ranks = procs.ranks([sys.executable, "-m", "cemtool", "train", "--resume", str(three), "--quiet"], 2,
                        {**ENV, "CEMTOOL_DIST_TIMEOUT": "30"})
    try:
        codes = [rank.wait(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()  # (nothing, when it has ended)
    assert codes == [0, 0], [rank.communicate()[1][-2000:] for rank in ranks]
    assert losses(three) == losses(two)
    w3 = load_file(str(three / "checkpoints" / "final.safetensors"))
    assert all(torch.equal(w2[k], w3[k]) for k in w2)


def test_non_finite_loss_marks_failed_and_keeps_checkpoint(tmp_path, text_file, monkeypatch):
    import cemtool.train as tr

    cfg, corpus = tiny_setup(text_file, "train.ckpt_every=10")
    run = create_run(tmp_path / "r", cfg)
    corpus.tokenizer.save(run.path / "tokenizer.json")
    real = tr.lm_loss
    calls = {"n": 0}

    def poisoned(logits, y, reduction="mean"):  # the training loss (with grad) of the 15th step on
        calls["n"] += torch.is_grad_enabled()
        out = real(logits, y, reduction)
        return out * float("nan") if calls["n"] > 14 and torch.is_grad_enabled() else out

    monkeypatch.setattr(tr, "lm_loss", poisoned)
    with pytest.raises(NonFiniteLoss, match="became nan at step 15"):
        train(cfg, corpus, run, device="cpu")
    run.unlock()
    meta = open_run(run.path).meta()
    assert meta["status"] == "failed" and meta["error"] == "non-finite loss"
    assert open_subject(run.path, checkpoint="latest").step == 10
    with pytest.raises(CemtoolError, match="no final checkpoint"):
        open_subject(run.path)


# --------------------------------------------------------------------------------------------------------------
# issue 10: bits per byte, step-0 evaluation, epochs; finite checkpoints; data changes on resume; memory


def test_eval_rows_bits_per_byte_perplexity_epochs_and_step0(tiny_run):
    """Every eval row has val_bpb = val_loss / (ln 2 * bytes/token) and val_ppl = exp(val_loss), every row the epochs
    seen; the first eval row is the untrained model at step 0; meta.json holds bytes_per_token for `compare`."""
    import math

    from cemtool.data.corpus import run_bits_per_byte

    meta = open_run(tiny_run).meta()
    assert meta["bytes_per_token"] == 1.0  # byte tokenizer: one byte per token, exactly
    evals = [m for m in metrics(tiny_run) if "val_loss" in m]
    assert (evals[0]["step"], evals[0]["tokens"], evals[0]["epochs"]) == (0, 0, 0)
    assert evals[0]["val_loss"] == pytest.approx(math.log(256), abs=0.3)  # untrained: about uniform over bytes
    for m in evals:
        assert m["val_bpb"] == pytest.approx(m["val_loss"] / math.log(2))
        assert m["val_ppl"] == pytest.approx(math.exp(m["val_loss"]))
        assert run_bits_per_byte(meta, m["val_loss"]) == pytest.approx(m["val_bpb"])
    rows = metrics(tiny_run)
    assert all(m["epochs"] == pytest.approx(m["tokens"] / meta["epoch_tokens"]) for m in rows)
    assert meta["epoch_tokens"] == len(load_corpus(open_run(tiny_run).config().data).train)
    assert meta["val_bpb"] == pytest.approx(evals[-1]["val_bpb"]) and meta["epochs"] > 0


def test_checkpoints_hold_only_weights_that_resume(tmp_path, text_file, monkeypatch):
    """issue 10 item 8: a huge learning rate broke the weights in the step after the loss check, and that step's
    checkpoint became "the last good one", from which --resume failed at once. Now a checkpoint is written only
    for finite weights whose loss on the next batch is finite."""
    import cemtool.train as tr

    cfg, corpus = tiny_setup(text_file, "train.ckpt_every=1", "train.keep_checkpoints=50")
    run = create_run(tmp_path / "r", cfg)
    corpus.tokenizer.save(run.path / "tokenizer.json")
    real = tr.lr_at
    monkeypatch.setattr(tr, "lr_at", lambda step, total, tc: 1e30 if step >= 5 else real(step, total, tc))
    with pytest.raises(NonFiniteLoss):
        train(cfg, corpus, run, device="cpu")
    run.unlock()
    assert open_run(run.path).meta()["status"] == "failed"
    latest = open_subject(run.path, checkpoint="latest")
    assert latest.step >= 5
    assert all(torch.isfinite(p).all() for p in latest.model.parameters())
    from cemtool.data.corpus import batch_starts, windows
    from cemtool.models.lm import lm_loss

    x, y = windows(corpus.train, batch_starts(corpus, cfg.data.seq_len, 8, cfg.seed, latest.step, 0), 16)
    with torch.no_grad():
        assert torch.isfinite(lm_loss(latest.model(x), y))  # what the resume computes first


def test_resume_refuses_changed_data_unless_allowed(tmp_path, text_file):
    """issue 10 item 13: resuming a text run whose files changed proceeded silently."""
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    data = tmp_path / "data.txt"
    data.write_text(Path(text_file).read_text())
    cfg, corpus = tiny_setup(str(data), "train.ckpt_every=5")
    run = create_run(tmp_path / "r", cfg, extra_meta={"corpus": corpus.info})
    corpus.tokenizer.save(run.path / "tokenizer.json")
    assert train(cfg, corpus, run, device="cpu", stop_after=5).status == "interrupted"
    run.unlock()
    text = data.read_text()
    data.write_text(text.replace("fox", "cat"))  # same size, different bytes
    before = (run.path / "meta.json").read_text()
    res = CliRunner().invoke(app, ["train", "--resume", str(run.path), "--quiet"])
    assert res.exit_code == 1 and "changed since it started" in res.output and "--allow-data-change" in res.output
    assert (run.path / "meta.json").read_text() == before  # a refused resume leaves the run as it was
    res = CliRunner().invoke(app, ["train", "--resume", str(run.path), "--quiet", "--allow-data-change"])
    assert res.exit_code == 0, res.output
    assert open_run(run.path).meta()["status"] == "completed"


def test_every_session_of_a_resumed_run_is_recorded(tmp_path, text_file):
    """meta.json keeps one session per process that trained the run (its start, end, steps and seconds), and
    train_seconds is their sum: a resumed run counts its first session's training too. A run written before
    sessions were recorded keeps its earlier seconds as one session of unknown start."""
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    cfg, corpus = tiny_setup(text_file, "train.ckpt_every=5")
    run = create_run(tmp_path / "r", cfg, extra_meta={"corpus": corpus.info})
    corpus.tokenizer.save(run.path / "tokenizer.json")
    assert train(cfg, corpus, run, device="cpu", stop_after=7).status == "interrupted"
    run.unlock()
    meta = open_run(run.path).meta()
    [first] = meta["sessions"]
    assert (first["from_step"], first["to_step"], first["device"]) == (0, 7, "cpu")
    assert meta["train_seconds"] == first["seconds"] > 0 and meta["ended"] == first["ended"]
    assert "open_session" not in meta  # step 5's progress record: replaced by the session that ended
    res = CliRunner().invoke(app, ["train", "--resume", str(run.path), "--quiet"])
    assert res.exit_code == 0, res.output
    meta = open_run(run.path).meta()
    assert meta["sessions"][0] == first and len(meta["sessions"]) == 2
    second = meta["sessions"][1]
    assert (second["from_step"], second["to_step"]) == (5, 30)  # from its last checkpoint
    assert second["started"] >= first["ended"] and meta["ended"] == second["ended"]
    assert meta["train_seconds"] == pytest.approx(first["seconds"] + second["seconds"], rel=1e-12)
    assert meta["status"] == "completed" and meta["resumed"] == 1
    # a run from before sessions: its last known training becomes a session with no start
    old = {k: v for k, v in meta.items() if k != "sessions"}
    old.update(status="interrupted", train_seconds=12.5, ended="2026-01-01T00:00:00+00:00")
    (run.path / "meta.json").write_text(json.dumps(old))
    r = open_run(run.path)
    r.end_session({"started": "2026-01-02T00:00:00+00:00", "from_step": 30, "to_step": 30, "seconds": 1.5,
                   "device": "cpu"}, "completed")
    meta = r.meta()
    assert meta["sessions"][0] == {"started": None, "ended": "2026-01-01T00:00:00+00:00", "from_step": None,
                                   "to_step": None, "seconds": 12.5, "device": "cpu"}
    assert meta["train_seconds"] == 14.0 and meta["sessions"][1]["seconds"] == 1.5


def test_absurd_model_refused_with_estimate_before_allocating(tmp_path, tiny_run):
    """issue 10 item 9: d_model=10**9 in a hand-edited config.json allocated 8 GB before failing as an internal
    error. Sizes within the field ranges that cannot fit are refused from the config, with the estimate."""
    import resource
    import shutil

    from cemtool.train import check_memory, memory_estimate

    run = tmp_path / "edited"
    shutil.copytree(tiny_run, run)
    cfg = json.loads((run / "config.json").read_text())
    cfg["model"].update(d_model=32768, n_head=256, n_layer=64)
    (run / "config.json").write_text(json.dumps(cfg))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CemtoolError, match=r"needs about [\d.]+ GiB .* but [\d.]+ GiB are available on cpu"):
        open_subject(run)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 200_000  # KiB: nothing big was allocated
    big = open_run(tiny_run).config().model
    est = memory_estimate(big, batch_size=8, seq_len=16, training=True)
    assert est["total"] == est["weights"] * 4 + est["activations"] and est["activations"] > 0
    with pytest.raises(CemtoolError, match="activations for 100000 x 1048576 tokens"):
        check_memory(big, "cpu", batch_size=100_000, seq_len=1 << 20, training=True)
    cfg["model"]["d_model"] = 10 ** 9  # beyond the field's range: refused by validation first
    (run / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CemtoolError, match="model.d_model=1000000000"):
        open_subject(run)


def test_parameter_count_estimates_match_every_architecture():
    """count_params (built on the meta device) is exact and rough_params an upper bound, for every family (not the
    transformers architectures other tests registered: those are sized from their weights' headers at load)."""
    from cemtool.models.registry import archs, build_model, get_arch
    from cemtool.train import count_params, rough_params

    for name in [a for a in archs() if get_arch(a).family != "foreign"]:
        m = tiny_config(name, d_model=32, vocab=300, seq_len=32)
        model = build_model(m)
        exact = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
        assert count_params(m) == exact, name
        assert rough_params(m) >= exact, name
