"""Saturation: the truncations against closed forms, the loss at full rank, the n-gram source's exact floor, the
sweep summary, the allocation advice, and the `cemtool saturation` command."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import cemtool.data.synthetic as syn
from cemtool.analysis.saturation import (
    advice_toml,
    advised_config,
    allocation_advice,
    attention_layers,
    effective_form,
    mean_loss,
    rank_truncation,
    rope_projection,
    svd_projection,
    truncated,
    weight_factors,
)
from cemtool.cli.main import app
from cemtool.config import DataConfig, replace, resolve, to_dict
from cemtool.data.corpus import load_corpus, windows
from cemtool.errors import CemtoolError
from cemtool.models.allocation import layer_shapes
from cemtool.models.layers import apply_rope, rope_tables
from cemtool.saturation_sweep import summarise_sweep, sweep_grid

from kit import tiny_model, tiny_tokens


def tiny(arch="baseline", extra=(), vocab=30, T=10):
    """A small float64 model whose query/key weights are scaled up so that attention is far from uniform."""
    model = tiny_model(arch, *extra, vocab=vocab, seq_len=T, dtype=torch.float64).eval()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wq.weight.mul_(15.0)
            b.attn.wk.weight.mul_(15.0)
    return model


def data(n=6, T=10, vocab=30, seed=0):
    return tiny_tokens(n, T, vocab, seed)


# -- the truncations ----------------------------------------------------------------------------------------------


def test_svd_projection_is_eckart_young_and_identity_at_full_rank():
    g = torch.Generator().manual_seed(0)
    dh, d = 6, 10
    A = torch.randn(dh, d, generator=g, dtype=torch.float64)
    B = torch.randn(dh, d, generator=g, dtype=torch.float64)
    assert torch.allclose(svd_projection(A, B, dh), torch.eye(dh, dtype=torch.float64), atol=1e-10)
    M = A.T @ B
    U, S, Vh = torch.linalg.svd(M)
    for r in (0, 1, 3, 5):
        form = effective_form(A, B, svd_projection(A, B, r))
        best = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
        assert torch.allclose(form, best, atol=1e-9)
        assert torch.linalg.matrix_rank(form).item() == r
        assert torch.linalg.norm(M - form).item() == pytest.approx(S[r:].pow(2).sum().sqrt().item(), rel=1e-9)


def test_rope_projection_keeps_heaviest_planes_and_commutes_with_rotation():
    g = torch.Generator().manual_seed(1)
    dh, d = 8, 12
    A = torch.randn(dh, d, generator=g, dtype=torch.float64)
    B = torch.randn(dh, d, generator=g, dtype=torch.float64)
    A[1] *= 10  # plane 1 = rows (1, 5) dominates
    B[5] *= 10
    P = rope_projection(A, B, 2)
    assert torch.equal(torch.diagonal(P), torch.tensor([0, 1, 0, 0, 0, 1, 0, 0], dtype=torch.float64))
    assert torch.equal(rope_projection(A, B, dh), torch.eye(dh, dtype=torch.float64))
    cos, sin = rope_tables(16, dh, 10000.0)
    q = torch.randn(1, 1, 16, dh, generator=g, dtype=torch.float64)
    P4 = rope_projection(A, B, 4)
    rotated_then = apply_rope(q, cos, sin) @ P4.T
    then_rotated = apply_rope(q @ P4.T, cos, sin)
    assert torch.allclose(rotated_then, then_rotated, atol=1e-12)
    assert torch.linalg.matrix_rank(P4).item() == 4


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_full_rank_truncation_leaves_the_loss_unchanged(pos):
    model = tiny(extra=[f"model.pos={pos}"])
    x, y = data()
    base = mean_loss(model, x, y)
    layers, _ = attention_layers(model)
    projections = {}
    for lh in layers:
        P = [(rope_projection if lh.rope else svd_projection)(Lq, Lk, lh.head_dim)
             for Lq, Lk in weight_factors(model, lh)]
        projections[lh.layer] = torch.stack(P)
    with truncated(model, projections):
        assert mean_loss(model, x, y) == pytest.approx(base, abs=1e-10)
    with truncated(model, {0: torch.zeros(2, 8, 8, dtype=torch.float64)}):
        assert abs(mean_loss(model, x, y) - base) > 1e-4  # rank 0 does change it
    assert mean_loss(model, x, y) == base  # hooks removed


def test_rank_zero_is_a_head_without_queries():
    model = tiny(extra=["model.pos=learned"])
    x, y = data()
    with truncated(model, {1: torch.zeros(2, 8, 8, dtype=torch.float64)}):
        truncated_loss = mean_loss(model, x, y)
    with torch.no_grad():
        model.blocks[1].attn.wq.weight.zero_()
    assert mean_loss(model, x, y) == pytest.approx(truncated_loss, abs=1e-12)


def test_rank_truncation_report_on_every_family():
    x, y = data()
    for arch, pos in (("baseline", "learned"), ("cem", "rope"), ("lime", "rope"), ("lime-dynamic", "learned"),
                      ("hb", "rope")):
        rep = rank_truncation(tiny(arch, [f"model.pos={pos}"]), x, y, batch_size=4, tolerance=0.0)
        for e in rep["layers"]:
            assert e["ranks"][0] == 0 and e["ranks"][-1] == 8
            assert e["layer_loss_increase"][-1] == 0.0 and all(h["loss_increase"][-1] == 0.0 for h in e["per_head"])
            inc = dict(zip(e["ranks"], e["layer_loss_increase"], strict=True))
            assert inc[e["tolerated_rank"]] <= 0.0 and all(inc[r] > 0.0 for r in e["ranks"] if r < e["tolerated_rank"])
            assert e["truncation"] == ("rope planes" if pos == "rope" else "svd")
        assert set(rep["logits"]) == {"0", "1"}
        if arch == "lime-dynamic":
            assert rep["layers"][1]["basis"].startswith("data") and rep["layers"][0]["basis"] == "weights"


def test_data_basis_full_rank_is_identity_on_the_queries():
    model = tiny(extra=["model.pos=learned"])
    x, y = data()
    rep = rank_truncation(model, x, y, basis="data", ranks=[7], per_head=False, batch_size=4)
    assert rep["layers"][0]["basis"] == "data" and rep["layers"][0]["ranks"] == [7, 8]
    with pytest.raises(CemtoolError, match="basis"):
        rank_truncation(model, x, y, basis="nope")


# -- allocation advice ------------------------------------------------------------------------------------------


def test_allocation_advice_keeps_the_budget_and_is_a_valid_config(tmp_path, monkeypatch):
    shapes = [(4, 16)] * 4
    adv = allocation_advice(shapes, {0: 16, 1: 16, 2: 4, 3: 2}, {0: 0.5, 1: 0.2, 2: 0.01, 3: 0.0}, rope=True,
                            tolerance=0.05)
    assert adv["head_dims"] == [16, 16, 4, 2] and adv["budget"] == 256
    assert adv["new_budget"] <= 256 and 256 - adv["new_budget"] < 16
    assert adv["heads"][0] >= adv["heads"][1] > 4 and adv["heads"][2:] == [4, 4]
    run_cfg = resolve(arch="tmm", overrides=["model.n_layer=4", "model.d_model=64", "data.seq_len=256",
                                             "data.tokenizer=bpe", "data.bpe_vocab_size=4096", "train.lr=1e-3",
                                             "train.max_steps=5000"], seed=7, data_source='data/my "text".txt')
    path = tmp_path / "advice.toml"
    path.write_text(advice_toml(adv, to_dict(run_cfg), "test"))
    cfg = resolve(file=path)  # no --arch, no --set: the file alone is the run's experiment
    assert layer_shapes(cfg.model) == list(zip(adv["heads"], adv["head_dims"], strict=True))
    changed = replace(run_cfg, **{"model.heads": tuple(adv["heads"]), "model.head_dims": tuple(adv["head_dims"])})
    assert to_dict(cfg) == to_dict(changed)  # data, seq_len, tokenizer, training, seed: the run's own
    (tmp_path / "corpus.txt").write_text("some text")
    monkeypatch.chdir(tmp_path)  # a data path relative to where the run's data was read: the same file, absolute
    rel = advised_config(to_dict(replace(run_cfg, **{"data.source": "corpus.txt"})), adv)
    assert rel["data"]["source"] == str(tmp_path / "corpus.txt")
    odd = allocation_advice([(2, 8)], {0: 3}, {0: 0.0}, rope=True)
    assert odd["head_dims"] == [4] and odd["heads"] == [4]


# -- sweep summary ----------------------------------------------------------------------------------------------


def test_summarise_sweep_gain_and_saturation_point():
    rows = []
    for seed, noise in ((0, 0.0), (1, 0.002)):
        for d, loss in ((2, 1.0), (4, 0.7), (8, 0.65), (16, 0.645)):
            rows.append({"seq_len": 32, "head_dim": d, "seed": seed, "val_loss": loss + noise, "val_floor": 0.6})
    s = summarise_sweep(rows, threshold=0.01)[0]
    assert [p["head_dim"] for p in s["points"]] == [2, 4, 8, 16]
    assert s["points"][0]["gain_per_doubling"] == pytest.approx(0.3)
    assert s["points"][1]["gain_per_doubling"] == pytest.approx(0.05)
    assert s["saturation_head_dim"] == 8
    assert s["points"][0]["se"] == pytest.approx(0.001)
    assert summarise_sweep([{**r, "head_dim": r["head_dim"], "val_loss": 1.0 - r["head_dim"] / 10}
                            for r in rows], 0.01)[0]["saturation_head_dim"] is None
    # a bump: 2 -> 4 loses, but 8 beats 2 by 0.055 (0.0275 per doubling): not saturated before 8
    bump = [{"seq_len": 16, "head_dim": d, "seed": 0, "val_loss": v}
            for d, v in ((2, 0.637), (4, 0.681), (8, 0.582), (16, 0.652), (32, 0.667))]
    s = summarise_sweep(bump, 0.01)[0]
    assert s["points"][0]["gain_per_doubling"] == pytest.approx(-0.044) and s["saturation_head_dim"] == 8
    with pytest.raises(CemtoolError, match="does not divide"):
        sweep_grid([3], [16], [0], 16, rope=False)
    with pytest.raises(CemtoolError, match="odd"):
        sweep_grid([1], [16], [0], 16, rope=True)
    assert len(sweep_grid([2, 4], [8, 16], [0, 1], 16)) == 8


# -- the n-gram source ------------------------------------------------------------------------------------------


def test_ngram_source_has_white_inputs_and_an_exact_floor():
    cfg = DataConfig(source="ngram", seq_len=15, train_tokens=64_000, val_tokens=16_000, seed=7)
    corpus = load_corpus(cfg)
    V, n, eps = syn.NGRAM_VOCAB, syn.NGRAM_ORDER, syn.NGRAM_NOISE
    table = syn.ngram_rule(V, n, 7)
    assert all(sorted(row) == list(range(V)) for row in table)  # a bijection in the oldest argument
    tokens = corpus.train.astype(np.int64).reshape(-1, 16)
    # any n - 1 consecutive tokens are uniform: pairs (x_t, x_{t+1}) at a position inside the sentence
    pairs = np.bincount(tokens[:, 7] * V + tokens[:, 8], minlength=V * V)
    assert pairs.min() > 0.6 * pairs.mean() and pairs.max() < 1.4 * pairs.mean()
    # the rule holds with probability 1 - eps + eps / V
    rule = syn.apply_rule(table, tokens[:, 8 - n + 1:8], V)
    assert np.mean(tokens[:, 8] == rule) == pytest.approx(1 - eps + eps / V, abs=0.01)
    # exact per-token -log p, and its mean is the analytic entropy
    nll = corpus.val_nll.reshape(-1, 16)
    assert np.allclose(nll[:, : n - 1], math.log(V))
    h = syn.rule_entropy(V, eps)
    assert nll[:, n - 1:].mean() == pytest.approx(h, abs=0.02)
    assert corpus.entropy_rate == pytest.approx(((n - 1) * math.log(V) + (16 - n + 1) * h) / 16)
    starts = corpus.eval_windows(15, 4000)
    x, y = windows(corpus.val, starts, 15)
    assert (starts % 16 == 0).all() and x.shape[1] == 15
    assert corpus.floor(starts, 15) == pytest.approx(nll[starts // 16, 1:].mean())
    # the same data and rule from the same seed; the rule changes with the seed
    assert np.array_equal(load_corpus(cfg).val, corpus.val)
    assert not np.array_equal(syn.ngram_rule(V, n, 8), table)
    with pytest.raises(CemtoolError, match="tokenizer"):
        load_corpus(replace(cfg, tokenizer="byte"))


def test_ngram_noise_free_rule_is_deterministic():
    cfg = DataConfig(source="ngram", seq_len=9, train_tokens=2000, val_tokens=1000)
    c = syn.ngram_corpus(cfg, vocab=5, order=4, noise=0.0)
    t = c.val.astype(np.int64).reshape(-1, 10)
    table = syn.ngram_rule(5, 4, cfg.seed)
    for j in range(3, 10):
        assert np.array_equal(t[:, j], syn.apply_rule(table, t[:, j - 3:j], 5))
    assert np.allclose(c.val_nll.reshape(-1, 10)[:, 3:], 0.0)
    assert c.info["rule_entropy"] == 0.0


def test_ngram4_source_is_the_4_gram_rule():
    """ngram4: each token follows the rule of the 3 before it (with probability 1 - eps + eps/V), not of the 2
    before it (the ngram source's order 3), and its exact floor accounts for 3 uniform head tokens."""
    cfg = DataConfig(source="ngram4", seq_len=15, train_tokens=32_000, val_tokens=8_000, seed=7)
    c = load_corpus(cfg)
    V, eps = syn.NGRAM_VOCAB, syn.NGRAM_NOISE
    assert c.name == "ngram4" and c.info["order"] == 4 and c.info["source"] == "ngram4"
    t = c.train.astype(np.int64).reshape(-1, 16)
    four = syn.apply_rule(syn.ngram_rule(V, 4, 7), t[:, 5:8], V)
    three = syn.apply_rule(syn.ngram_rule(V, 3, 7), t[:, 6:8], V)
    assert np.mean(t[:, 8] == four) == pytest.approx(1 - eps + eps / V, abs=0.015)
    assert np.mean(t[:, 8] == three) < 0.3  # the order-3 rule explains it no better than chance
    nll = c.val_nll.reshape(-1, 16)
    assert np.allclose(nll[:, :3], math.log(V)) and not np.allclose(nll[:, 3], math.log(V))


# -- the command ------------------------------------------------------------------------------------------------


def test_saturation_run_command(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    res = CliRunner().invoke(app, ["saturation", str(run), "--tokens", "256", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "tolerated r" in res.output and "advice" in res.output
    rep = json.loads((run / "reports" / "saturation.json").read_text())
    assert rep["saturation"]["layers"][0]["ranks"][-1] == 16 and (run / "reports" / "saturation.csv").exists()
    cfg = resolve(file=run / "reports" / "saturation_advice.toml")
    assert list(cfg.model.head_dims) == rep["advice"]["head_dims"]
    assert sum(h * d for h, d in layer_shapes(cfg.model)) <= 64
    own = json.loads((run / "config.json").read_text())  # the run's text data at T = 16, not grammar at 64
    assert (cfg.data.source, cfg.data.seq_len, cfg.data.tokenizer) == (own["data"]["source"], 16, "byte")
    assert to_dict(cfg) == {**own, "model": {**own["model"], "heads": rep["advice"]["heads"],
                                             "head_dims": rep["advice"]["head_dims"]}}
    assert rep["provenance"]["options"]["tokens"] == 256 and rep["provenance"]["options"]["per_head"] is True
    assert (run / "plots" / "saturation_truncation.png").exists() and (run / "plots" / "saturation_logits.png").exists()
    res = CliRunner().invoke(app, ["saturation", "analyze", str(run), "--tokens", "256", "-q", "--json",
                                   "--layers-only", "--ranks", "0,4", "--no-plots", "--name", "sat-r4"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["layers"][0]["ranks"] == [0, 4, 16]
    named = json.loads((run / "reports" / "sat-r4.json").read_text())  # the first report is kept
    assert named["provenance"]["options"]["ranks"] == [0, 4] and (run / "reports" / "sat-r4_advice.toml").exists()
    assert json.loads((run / "reports" / "saturation.json").read_text())["provenance"]["options"]["ranks"] is None
    from cemtool.report import named_reports

    assert [r.name for r in named_reports(run, kind="saturation")] == ["sat-r4", "saturation"]


def test_device_defaults_to_auto_like_every_command():
    import inspect

    from cemtool.cli.saturation_cmd import analyze, sweep

    assert inspect.signature(analyze).parameters["device"].default == "auto"
    assert inspect.signature(sweep).parameters["device"].default == "auto"


def test_saturation_sweep_command(tmp_path):
    out = tmp_path / "sweep"
    args = ["saturation", "sweep", "--head-dims", "4,8", "--budget", "8", "--seq-lens", "8", "--seeds", "0",
            "--steps", "6", "--d-model", "16", "--train-tokens", "3000", "--eval-tokens", "256", "--out", str(out),
            "-q"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "reports" / "saturation_sweep.json").read_text())
    assert [p["head_dim"] for p in rep["summary"][0]["points"]] == [4, 8]
    assert all(r["val_floor"] is not None and r["val_loss"] > r["val_floor"] for r in rep["results"])
    assert (out / "plots" / "saturation_sweep.png").exists() and (out / "runs" / "T8-dh4-s0" / "config.json").exists()
    again = CliRunner().invoke(app, args + ["--json"])  # completed grid points are reused
    assert again.exit_code == 0, again.output
    assert json.loads((out / "reports" / "saturation_sweep.json").read_text())["results"][0]["reused"] is True


def test_saturation_bad_input(tmp_path):
    r = CliRunner()
    res = r.invoke(app, ["saturation", str(tmp_path / "missing")])
    assert res.exit_code == 1 and res.output.count("Error:") == 1 and "does not exist" in res.output
    res = r.invoke(app, ["saturation", "sweep", "--head-dims", "3", "--budget", "16", "--out", str(tmp_path / "s")])
    assert res.exit_code == 1 and "does not divide" in res.output
    res = r.invoke(app, ["saturation", "sweep", "--head-dims", "a,b"])
    assert res.exit_code == 2
    res = r.invoke(app, ["saturation", str(tmp_path), "--basis", "nope"])
    assert res.exit_code == 2
    assert r.invoke(app, ["saturation", "--help"]).exit_code == 0


@pytest.mark.parametrize("pos", ["none", "learned", "rope"])
def test_without_positions_the_last_output_ignores_the_order_before_it(pos):
    """model.pos=none (NoPE): with one layer, the last position's logits are a function of the set of earlier
    tokens and its own, so permuting the earlier tokens leaves them unchanged; RoPE and learned positions do not."""
    model = tiny(extra=[f"model.pos={pos}", "model.n_layer=1"])
    x, _ = data(n=2)
    perm = torch.cat([torch.randperm(x.shape[1] - 1, generator=torch.Generator().manual_seed(3)),
                      torch.tensor([x.shape[1] - 1])])
    with torch.no_grad():
        a, b = model(x)[:, -1], model(x[:, perm])[:, -1]  # (B, V) logits at the last position
    same = torch.allclose(a, b, atol=1e-10)
    assert same == (pos == "none")
    assert (pos == "none") == (not any("pos_emb" in n for n, _ in model.named_parameters()) and pos != "rope")


def test_sweep_at_a_fixed_head_count_with_the_lr_tuned_per_point(tmp_path):
    from cemtool.saturation_sweep import choose_lrs

    out = tmp_path / "sweep"
    args = ["saturation", "sweep", "--head-dims", "4,8", "--heads", "2", "--seq-lens", "8", "--seeds", "0",
            "--lrs", "1e-3,3e-2", "--tune-seeds", "5", "--steps", "6", "--d-model", "16", "--train-tokens", "3000",
            "--eval-tokens", "256", "--set", "model.pos=learned", "--out", str(out), "-q", "--no-plots"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "reports" / "saturation_sweep.json").read_text())
    assert rep["heads"] == 2 and {r["heads"] for r in rep["results"]} == {2}
    tune = rep["tuning"]["rows"]
    assert {(r["head_dim"], r["lr"], r["seed"]) for r in tune} == {(d, x, 5) for d in (4, 8) for x in (1e-3, 3e-2)}
    chosen = {(c["seq_len"], c["head_dim"]): c["lr"] for c in rep["tuning"]["chosen"]}
    assert chosen == choose_lrs(tune)
    for d in (4, 8):  # the lower tuning loss wins, and the comparison run trains at it
        best = min((r for r in tune if r["head_dim"] == d), key=lambda r: r["val_loss"])["lr"]
        assert chosen[(8, d)] == best
        cfg = json.loads((out / "runs" / f"T8-dh{d}-s0" / "config.json").read_text())
        assert cfg["train"]["lr"] == best and cfg["model"]["n_head"] == 2 and cfg["model"]["pos"] == "learned"
    assert choose_lrs([{"seq_len": 8, "head_dim": 4, "lr": 0.1, "val_loss": None},
                       {"seq_len": 8, "head_dim": 4, "lr": 0.01, "val_loss": 9.0}]) == {(8, 4): 0.01}  # diverged
    for bad, msg in [(["--budget", "8"], "exclude each other"), (["--tune-seeds", "0"], "also comparison seeds"),
                     (["--lrs", "x"], "numbers")]:
        res = CliRunner().invoke(app, [*args, *bad])
        assert res.exit_code == 2 and msg in res.output, res.output
