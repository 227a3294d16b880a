"""Forgetting and plasticity (METHODS §7): the grammar-b corpus, the scaled recipe, `cemtool forgetting` end to end
on tiny real runs (source never modified, losses re-measured independently, resume), and bad input."""

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cemtool.config import DataConfig
from cemtool.data.corpus import load_corpus
from cemtool.data.grammar import default_grammar, grammar_b
from cemtool.data.tokenizer import byte_tokenizer, word_tokenizer
from cemtool.errors import CemtoolError
from cemtool.forgetting import REFERENCE, fine_tune, scaled_recipe
from cemtool.subject import open_subject
from cemtool.train import evaluate

from kit import train_tiny

runner = CliRunner()
FT = ["--steps", "12", "--eval-every", "4", "--device", "cpu", "-q"]


def snapshot(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under root: sha256 and mtime (ns)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def grammar_run(tmp_path_factory) -> Path:
    return Path(train_tiny(tmp_path_factory.mktemp("fg") / "src"))


@pytest.fixture(scope="module")
def forgot(grammar_run):
    """`cemtool forgetting` on the grammar run, with the source's files hashed before."""
    before = snapshot(grammar_run)
    res = runner.invoke(app(), ["forgetting", str(grammar_run), "--to", "grammar-b", *FT, "--json"])
    assert res.exit_code == 0, res.output
    return before, json.loads(res.stdout), grammar_run.parent / "src-ft-grammar-b"


def app():
    from cemtool.cli.main import app

    return app


# ---------------------------------------------------------------------- grammar-b


def test_grammar_b_same_vocabulary_other_distribution():
    a, b = default_grammar(), grammar_b()
    assert b.vocab == a.vocab and grammar_b() is b
    tv = 0.5 * np.abs(a.unigram() - b.unigram()).sum()
    assert tv > 0.3                                              # a real distribution shift
    assert b.entropy_rate() != pytest.approx(a.entropy_rate(), abs=1e-3)
    assert b.describe()["name"] == "grammar-b" and b.describe()["p_sentence_longer_than_64"] < 1e-6
    nouns = [rhs[0] for rhs, _ in b.productions["N_SG"]]
    probs = [p for _, p in b.productions["N_SG"]]
    assert probs == sorted(probs) and nouns[0] == "dog"          # Zipf ranking reversed: "dog" is now the rarest


def test_grammar_b_floor_is_exact():
    """Monte Carlo entropy rate (ratio estimator over sentences) agrees with the analytic one, and every
    sentence's per-token nll sums to the parser's -log P(sentence)."""
    g = grammar_b()
    s = g.sample(150_000, seed=11)
    ends = np.append(s.sentence_starts[1:], len(s.tokens))
    nll = np.add.reduceat(s.nll, s.sentence_starts)
    lengths = (ends - s.sentence_starts).astype(float)
    rate = nll.sum() / lengths.sum()
    se = np.std(nll - rate * lengths, ddof=1) / math.sqrt(len(lengths)) / lengths.mean()
    assert abs(rate - g.entropy_rate()) < 4 * se
    for a, e in list(zip(s.sentence_starts, ends, strict=True))[:800]:
        assert s.nll[a:e].sum() == pytest.approx(-g.sentence_logprob(g.decode(s.tokens[a:e])), abs=1e-9)
    assert default_grammar().sentence_logprob(g.decode(s.tokens[:ends[0]])) > -math.inf  # same language


def test_grammar_b_corpus_and_tokenizer_check():
    cfg = DataConfig(source="grammar-b", train_tokens=2000, val_tokens=500, seq_len=16)
    c = load_corpus(cfg, tokenizer=word_tokenizer(default_grammar().vocab))
    assert c.name == "grammar-b" and c.entropy_rate == pytest.approx(grammar_b().entropy_rate())
    starts = c.eval_windows(16, 256)
    assert c.floor(starts, 16) is not None
    with pytest.raises(CemtoolError, match="cannot be read with this byte tokenizer"):
        load_corpus(cfg, tokenizer=byte_tokenizer())


# ---------------------------------------------------------------------- the recipe


def test_scaled_recipe():
    r = scaled_recipe(30)
    assert (r.steps, r.warmup_steps, r.eval_every) == (8, 0, 1)
    r = scaled_recipe(1200)
    assert (r.steps, r.warmup_steps, r.eval_every) == (300, 15, 15)
    r = scaled_recipe(100_000)
    assert (r.steps, r.warmup_steps, r.eval_every) == (1000, 50, 50)           # the reference at scale
    assert (r.lr, r.beta1, r.beta2, r.weight_decay, r.min_lr_ratio, r.grad_clip) == (1e-4, 0.9, 0.95, 0.01, 0.1, 1.0)
    assert r == REFERENCE
    r = scaled_recipe(1200, steps=10, eval_every=3, lr=3e-4)
    assert (r.steps, r.warmup_steps, r.eval_every, r.lr) == (10, 0, 3, 3e-4)
    with pytest.raises(CemtoolError, match="unknown recipe field"):
        scaled_recipe(10, momentum=0.9)
    r = scaled_recipe(3360, step_fraction=0.03)                               # the TMM paper's ~3% of the tokens
    assert (r.steps, r.warmup_steps, r.eval_every) == (101, 5, 6)             # ceil(100.8), round(5.05), ceil(5.05)


def test_step_fraction_and_lr_scale_options():
    from cemtool.forgetting import Options

    o = Options(step_fraction=0.03, lr_scale=0.1)
    assert o.schedule()["step_fraction"] == 0.03 and o.schedule()["lr_scale"] == 0.1 and o.recipe()["lr"] == 1e-4
    for bad, msg in [({"step_fraction": 0.0}, "step_fraction"), ({"step_fraction": 1.5}, "step_fraction"),
                     ({"lr_scale": 0.1, "lr": 3e-4}, "both given"), ({"lr_scale": -1.0}, "lr_scale")]:
        with pytest.raises(CemtoolError, match=msg):
            Options(**bad)


def test_lr_scale_follows_the_source_runs_lr(grammar_run, tmp_path):
    src_lr = json.loads((grammar_run / "config.json").read_text())["train"]["lr"]
    res = runner.invoke(app(), ["forgetting", str(grammar_run), "--to", "grammar-b", "--out", str(tmp_path / "ft"),
                                "--step-fraction", "0.1", "--lr-scale", "0.5", "--device", "cpu", "-q", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    cfg = json.loads((tmp_path / "ft" / "config.json").read_text())["train"]
    assert cfg["lr"] == rep["recipe"]["lr"] == 0.5 * src_lr and rep["recipe"]["lr_scale"] == 0.5
    assert cfg["max_steps"] == rep["recipe"]["steps"] == 3                  # ceil(0.1 x 30 source steps)
    assert rep["recipe"]["step_fraction"] == 0.1 and "0.5 x the source run's train.lr" in rep["recipe"]["lr_rule"]
    res = runner.invoke(app(), ["forgetting", str(grammar_run), "--to", "grammar-b", "--out", str(tmp_path / "x"),
                                "--lr-scale", "0.5", "--lr", "3e-4", "--device", "cpu", "-q"])
    assert res.exit_code == 1 and res.output.startswith("Error:") and not (tmp_path / "x").exists()


# ---------------------------------------------------------------------- the command


def test_source_run_is_never_modified(forgot):
    before, _, _ = forgot
    src = Path(forgot[2]).parent / "src"
    assert snapshot(src) == before


def test_report_equals_recorded_and_remeasured_losses(forgot, grammar_run):
    _, rep, ft = forgot
    assert [p["step"] for p in rep["curve"]] == [0, 4, 8, 12]
    assert [p["tokens"] for p in rep["curve"]] == [0, 4 * 128, 8 * 128, 12 * 128]
    first, last = rep["curve"][0], rep["curve"][-1]
    assert rep["before"] == {"source_loss": first["source_loss"], "target_loss": first["target_loss"]}
    assert rep["after"] == {"source_loss": last["source_loss"], "target_loss": last["target_loss"]}
    assert rep["forgetting"] == last["source_loss"] - first["source_loss"]
    assert rep["plasticity"] == first["target_loss"] - last["target_loss"]
    assert rep["plasticity"] > 0                                    # fine-tuning on B lowers the loss on B
    # it starts from the source weights (a fresh init would sit near log 483 = 6.18 nats, far above)
    assert abs(rep["curve"][1]["source_loss"] - first["source_loss"]) < 0.02
    assert json.loads((ft / "reports" / "forgetting.json").read_text()) == rep
    assert (ft / "reports" / "forgetting.csv").read_text().count("\n") == 5

    # independent re-measurement: source and fine-tuned weights on both corpora's fixed windows
    src, tuned = open_subject(grammar_run), open_subject(ft)
    T, n_tok = src.config.data.seq_len, tuned.config.train.eval_tokens
    A = load_corpus(src.config.data, tokenizer=src.tokenizer)
    B = load_corpus(tuned.config.data, tokenizer=src.tokenizer)
    for model, which in ((src.model, "before"), (tuned.model, "after")):
        for corpus, key in ((A, "source_loss"), (B, "target_loss")):
            loss = evaluate(model, corpus, corpus.eval_windows(T, n_tok), T, "cpu", precision="fp32")
            assert loss == pytest.approx(rep[which][key], abs=1e-6), (which, key)
    assert rep["source"]["floor"] == pytest.approx(A.floor(A.eval_windows(T, n_tok), T))
    assert rep["target"]["floor"] == pytest.approx(B.floor(B.eval_windows(T, n_tok), T))


def test_new_run_links_its_parent_and_holds_the_recipe(forgot, grammar_run):
    _, rep, ft = forgot
    meta = json.loads((ft / "meta.json").read_text())
    assert meta["parent"] == str(grammar_run.resolve()) and meta["kind"] == "forgetting"
    assert meta["status"] == "completed" and meta["step"] == 12
    assert meta["forgetting"]["forgetting"] == rep["forgetting"]
    cfg = json.loads((ft / "config.json").read_text())
    src_cfg = json.loads((grammar_run / "config.json").read_text())
    assert cfg["model"] == src_cfg["model"] and cfg["data"]["source"] == "grammar-b"
    t = cfg["train"]
    assert (t["lr"], t["weight_decay"], t["max_steps"], t["eval_every"], t["min_lr_ratio"]) == (1e-4, 0.01, 12, 4, 0.1)
    assert rep["recipe"]["tokens_per_step"] == src_cfg["train"]["batch_size"] * src_cfg["data"]["seq_len"]
    assert rep["source"]["checkpoint"] == "final.safetensors" and rep["source"]["step"] == 30


def test_existing_out_needs_resume_or_force(forgot, grammar_run):
    res = runner.invoke(app(), ["forgetting", str(grammar_run), "--to", "grammar-b", *FT])
    assert res.exit_code == 1 and res.output.startswith("Error:") and "already holds a run" in res.output
    res = runner.invoke(app(), ["forgetting", str(grammar_run), "--to", "grammar-b", *FT, "--resume", "--json"])
    assert res.exit_code == 0 and json.loads(res.stdout) == forgot[1]     # the finished report, nothing redone


def test_interrupted_fine_tune_resumes_to_the_same_curve(forgot, grammar_run, tmp_path):
    out = tmp_path / "ft"

    def stop(ev):
        if ev["kind"] == "step" and ev["step"] == 6:
            raise KeyboardInterrupt  # Ctrl-C inside the training loop: it keeps the step-4 checkpoint

    with pytest.raises(KeyboardInterrupt):
        fine_tune(grammar_run, "grammar-b", out, steps=12, eval_every=4, device="cpu", callback=stop)
    assert json.loads((out / "meta.json").read_text())["status"] == "interrupted"
    assert not (out / "reports" / "forgetting.json").exists()
    starts = []
    rep = fine_tune(grammar_run, "grammar-b", out, steps=12, eval_every=4, device="cpu", resume=True,
                    callback=lambda ev: starts.append(ev["step"]) if ev["kind"] == "start" else None)
    assert starts == [4]                                                    # resumed from the checkpoint
    assert rep["curve"] == forgot[1]["curve"]                               # bit-exact on the CPU


def test_text_run_fine_tunes_on_pydoc(tiny_run, tmp_path):
    res = runner.invoke(app(), ["forgetting", tiny_run, "--to", "pydoc", "--out", str(tmp_path / "ft"), "--steps",
                                "4", "--eval-every", "2", "--device", "cpu", "-q", "--eval-tokens", "256"])
    assert res.exit_code == 0, res.output
    assert "forgetting" in res.stdout and "plasticity" in res.stdout
    rep = json.loads((tmp_path / "ft" / "reports" / "forgetting.json").read_text())
    assert rep["target"]["data"] == "pydoc" and rep["target"]["floor"] is None
    assert [p["step"] for p in rep["curve"]] == [0, 2, 4] and rep["target"]["eval_tokens"] == 256


@pytest.mark.parametrize("which, to, message", [
    ("missing", "grammar-b", "does not exist"),
    ("grammar", "pydoc", "cannot be tokenized by the source run's word tokenizer"),
    ("text", "grammar-b", "cannot be tokenized by the source run's byte tokenizer"),
])
def test_bad_input_one_line(which, to, message, grammar_run, tiny_run, tmp_path):
    run = {"missing": str(tmp_path / "nope"), "grammar": str(grammar_run), "text": tiny_run}[which]
    res = runner.invoke(app(), ["forgetting", run, "--to", to, "--out", str(tmp_path / "o"), *FT])
    assert res.exit_code == 1, res.output
    lines = res.output.strip().splitlines()
    assert lines[0].startswith("Error:") and message in lines[0] and len(lines) <= 2  # message + hint
    assert not (tmp_path / "o").exists()
