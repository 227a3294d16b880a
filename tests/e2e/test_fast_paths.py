"""The GPU-speed paths of the training loop, checked on the CPU against the exact path (eager, fp32, per-parameter
AdamW, the loss read every step): torch.compile, bf16 autocast, fused/foreach AdamW, the host-read cadence
(train.host_sync), the compile fallback and the per-step token target (train.tokens_per_step). The tolerances are
the ones docs/train.md states."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import cemtool.train as tr
from cemtool.cli.main import app
from cemtool.config import RunConfig, from_dict, resolve, to_dict
from cemtool.errors import CemtoolError, ConfigError

from kit import create_run, one_line_error, set_args, tiny_setup

SHORT = ("train.max_steps=8", "train.eval_every=100", "train.log_every=1", "train.warmup_steps=2")


def losses(cfg, corpus, run=None) -> list[float]:
    """The training loss of every step, as the loop reports it (its step events)."""
    seen: list[float] = []

    def callback(ev: dict) -> None:
        if ev.get("kind") == "step":
            seen.append(ev["loss"])

    tr.train(cfg, corpus, run, device="cpu", callback=callback)
    return seen


def test_cpu_defaults_are_the_exact_path(text_file):
    cfg, _ = tiny_setup(text_file)
    dev = torch.device("cpu")
    assert not tr.wants_compile(cfg.train, dev) and tr.host_sync(cfg.train, dev) == "step"
    assert tr.autocast_for(dev, cfg.train.precision).__class__.__name__ == "nullcontext"
    from cemtool.optim import kernel
    assert kernel(cfg.train, dev) == {"fused": False, "foreach": False}
    cuda = torch.device("cuda")  # what CUDA gets by default (no device needed to resolve it)
    assert tr.wants_compile(cfg.train, cuda) and tr.host_sync(cfg.train, cuda) == "log"
    assert kernel(cfg.train, cuda) == {"fused": True, "foreach": False}


def test_compiled_losses_equal_eager(text_file):
    """torch.compile (inductor on the CPU) against the eager model: the same 8 losses within 1e-5 (measured: equal
    here; the validation loss differs by ~1e-8), and dynamo really compiled a graph."""
    from torch._dynamo.utils import counters

    cfg, corpus = tiny_setup(text_file, *SHORT)
    eager = losses(cfg, corpus)
    cfg_c, _ = tiny_setup(text_file, *SHORT, "train.compile=true")
    counters.clear()
    compiled = losses(cfg_c, corpus)
    assert counters["stats"]["unique_graphs"] >= 1
    assert len(eager) == len(compiled) == 8
    assert max(abs(a - b) for a, b in zip(eager, compiled, strict=True)) < 1e-5
    assert eager[-1] < eager[0] - 0.1  # it trains: the comparison is not of two constant curves


def test_bf16_autocast_losses_within_tolerance(text_file):
    """bf16 autocast on the CPU against fp32: within 0.01 nats at every one of 8 steps (bf16 keeps 8 bits of
    mantissa; the measured gap is 1.7e-4), and not identical (the autocast really ran)."""
    cfg, corpus = tiny_setup(text_file, *SHORT)
    fp32 = losses(cfg, corpus)
    cfg_b, _ = tiny_setup(text_file, *SHORT, "train.precision=bf16")
    bf16 = losses(cfg_b, corpus)
    gaps = [abs(a - b) for a, b in zip(fp32, bf16, strict=True)]
    assert max(gaps) < 0.01 and max(gaps) > 0


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_adamw_kernels_equal_the_loop(text_file, impl):
    from cemtool.optim import make_optimizer

    cfg_k, _ = tiny_setup(text_file, *SHORT, f"train.optimizer_impl={impl}")
    opt = make_optimizer(torch.nn.Linear(2, 2), cfg_k.train, torch.device("cpu"))
    assert opt.defaults[impl] is True  # the kernel asked for is the one torch runs
    cfg, corpus = tiny_setup(text_file, *SHORT, "train.optimizer_impl=loop")
    loop = losses(cfg, corpus)
    fast = losses(cfg_k, corpus)
    assert max(abs(a - b) for a, b in zip(loop, fast, strict=True)) < 1e-5


class Reads:
    """Counts the host reads of tensors (float(), bool(), .item(), .tolist()) while installed."""

    def __init__(self, monkeypatch):
        self.n = 0
        for name in ("__float__", "__bool__", "item", "tolist"):
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                self.n += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def reads(text_file, monkeypatch, mode: str, steps: int, log_every: int) -> int:
    cfg, corpus = tiny_setup(text_file, f"train.max_steps={steps}", f"train.log_every={log_every}",
                             "train.eval_every=1000", f"train.host_sync={mode}", "train.optimizer_impl=fused")
    with monkeypatch.context() as m:
        counter = Reads(m)
        tr.train(cfg, corpus, None, device="cpu")
    return counter.n


@pytest.mark.parametrize("mode,per_step", [("log", 0), ("step", 2)])
def test_host_reads_per_step(text_file, monkeypatch, mode, per_step):
    """R(steps, log_every) = base + steps x s + (steps / log_every) x c: with 20 more steps at log_every 20, the
    reads grow by 20 s + c; with log_every 10 instead of 20, by c. train.host_sync=log has s = 0 (nothing read
    between log steps); step mode reads the loss and its finiteness flag every step (s = 2), which is what the
    counter must see for the check to be able to fail. AdamW runs fused, as on CUDA (the per-parameter loop reads
    each parameter's step count with .item(), a CPU-only cost)."""
    r20 = reads(text_file, monkeypatch, mode, 20, 20)
    r40 = reads(text_file, monkeypatch, mode, 40, 20)
    r20_10 = reads(text_file, monkeypatch, mode, 20, 10)
    c = r20_10 - r20  # one more log step
    assert c > 0
    assert (r40 - r20 - c) == 20 * per_step


def test_log_mode_catches_a_non_finite_loss_at_the_next_read(text_file, monkeypatch):
    cfg, corpus = tiny_setup(text_file, "train.host_sync=log", "train.log_every=5", "train.eval_every=1000")
    real = tr.lm_loss
    calls = {"n": 0}

    def poisoned(logits, y, reduction="mean"):
        calls["n"] += torch.is_grad_enabled()
        out = real(logits, y, reduction)
        return out * float("nan") if calls["n"] == 12 and torch.is_grad_enabled() else out

    monkeypatch.setattr(tr, "lm_loss", poisoned)
    with pytest.raises(tr.NonFiniteLoss, match=r"non-finite at one of steps 11\.\.15"):
        tr.train(cfg, corpus, None, device="cpu")


def failing_compile(monkeypatch):
    def fake(model, *a, **k):
        def call(*args, **kwargs):
            raise RuntimeError("no C compiler found\nsecond line")
        return call

    monkeypatch.setattr(torch, "compile", fake)


def test_compile_failure_falls_back_with_its_reason(tmp_path, text_file, monkeypatch):
    """train.compile=auto where compilation fails (a raising torch.compile standing in for a missing compiler or a
    backend error): the eager model trains instead, with the same losses, the reason as a note and in the
    session record."""
    cfg, corpus = tiny_setup(text_file, *SHORT)
    eager = losses(cfg, corpus)
    failing_compile(monkeypatch)
    monkeypatch.setattr(tr, "wants_compile", lambda tc, dev: True)  # auto on a CUDA machine
    run = create_run(tmp_path / "r", cfg)
    corpus.tokenizer.save(run.path / "tokenizer.json")
    notes: list[str] = []
    seen: list[float] = []

    def callback(ev):
        if ev.get("kind") == "note":
            notes.append(ev["message"])
        if ev.get("kind") == "step":
            seen.append(ev["loss"])

    try:
        tr.train(cfg, corpus, run, device="cpu", callback=callback)
    finally:
        run.unlock()
    assert seen == eager
    assert notes == ["torch.compile failed, training eagerly: RuntimeError: no C compiler found"]
    session = json.loads((run.path / "meta.json").read_text())["sessions"][-1]
    assert session["compiled"] is False and session["compile_fallback"] == "RuntimeError: no C compiler found"


def test_compile_true_failure_is_one_line(tmp_path, text_file, monkeypatch):
    failing_compile(monkeypatch)
    res = CliRunner().invoke(app, ["train", "--out", str(tmp_path / "r"), "--data", text_file, "--device", "cpu",
                                   "--quiet", *set_args("data.tokenizer=byte", *SHORT[:1], "model.n_layer=1",
                                                        "model.d_model=16", "model.n_head=2", "data.seq_len=8",
                                                        "train.batch_size=2", "train.compile=true")])
    one_line_error(res, "torch.compile failed: RuntimeError: no C compiler found")


def test_tokens_per_step_sets_the_accumulation(text_file):
    cfg, corpus = tiny_setup(text_file, "train.tokens_per_step=512", "train.max_steps=6", "train.log_every=3",
                             "train.eval_every=1000")
    assert cfg.train.grad_accum == 512 // (8 * 16)
    result = tr.train(cfg, corpus, None, device="cpu")
    assert result.tokens == 6 * 512
    with pytest.raises(ConfigError, match="not a multiple of train.batch_size x data.seq_len = 128") as e:
        tiny_setup(text_file, "train.tokens_per_step=500")
    assert "use 384 or 512" in e.value.hint
    with pytest.raises(ConfigError, match="needs train.grad_accum=4, but train.grad_accum=2"):
        tiny_setup(text_file, "train.tokens_per_step=512", "train.grad_accum=2")
    assert tiny_setup(text_file, "train.tokens_per_step=512", "train.grad_accum=4")[0].train.grad_accum == 4


def test_old_boolean_compile_configs_load():
    data = to_dict(resolve())
    for old, new in ((True, "true"), (False, "false")):
        data["train"]["compile"] = old
        assert from_dict(RunConfig, data).train.compile == new
    data["train"]["compile"] = "sometimes"
    with pytest.raises(CemtoolError):
        from_dict(RunConfig, data)
