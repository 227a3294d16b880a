"""Collapse measures against closed forms: matrix entropy, effective rank, cosine, the probe, attention rows,
streaming invariance, LIMe routing and momentum scalars."""

import math

import numpy as np
import pytest
import torch

from cemtool.analysis.collapse import (
    Moments,
    ProbeClasses,
    attention_row_stats,
    collapse_report,
    effective_rank,
    effective_rank_from_singular,
    gram_entropy,
    matrix_entropy,
    mean_pairwise_cosine,
    probe_accuracy,
    probe_classes,
    renyi_entropy,
    report_rows,
    summarise_attention,
)
from cemtool.analysis.routing import lime_routing, router_summary, stream_scalars
from cemtool.data.tokenizer import byte_tokenizer, word_tokenizer
from cemtool.errors import CemtoolError
from cemtool.models import capture

from kit import tiny_model


def tiny(arch="baseline", extra=(), vocab=40, T=12, dtype=torch.float64):
    return tiny_model(arch, *extra, vocab=vocab, seq_len=T, dtype=dtype).eval()


# -- matrix entropy ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_identity_gram_has_entropy_log_T_and_rank_one_zero(alpha):
    T = 9
    assert gram_entropy(torch.eye(T), alpha).item() == pytest.approx(math.log(T), abs=1e-12)
    u = torch.randn(T, 1, dtype=torch.float64)
    assert gram_entropy(u @ u.T, alpha).item() == pytest.approx(0.0, abs=1e-9)


def test_alpha_to_one_is_shannon():
    eigs = torch.tensor([4.0, 2.0, 1.0, 0.5, 0.0], dtype=torch.float64)
    p = eigs[:4] / eigs.sum()
    shannon = float(-(p * p.log()).sum())
    assert renyi_entropy(eigs, 1.0).item() == pytest.approx(shannon, abs=1e-12)
    assert renyi_entropy(eigs, 1 - 1e-6).item() == pytest.approx(shannon, abs=1e-5)
    assert renyi_entropy(eigs, 1 + 1e-6).item() == pytest.approx(shannon, abs=1e-5)
    # Rényi entropies decrease with the order
    assert renyi_entropy(eigs, 0.5) > renyi_entropy(eigs, 1.0) > renyi_entropy(eigs, 2.0)


@pytest.mark.parametrize("T,D", [(6, 10), (10, 4)])
def test_matrix_entropy_uses_the_gram_spectrum_whichever_side_is_smaller(T, D):
    X = torch.randn(3, T, D, dtype=torch.float64)
    direct = torch.stack([gram_entropy(x @ x.T, 0.5) for x in X])
    assert torch.allclose(matrix_entropy(X, 0.5), direct, atol=1e-10)


def test_zscored_entropy_ignores_per_feature_affine_maps():
    X = torch.randn(5, 8, 6, dtype=torch.float64)
    Y = X * torch.tensor([1.0, 3.0, 0.1, 7.0, 2.0, 5.0], dtype=torch.float64) + 4.0
    mx, my = Moments(6), Moments(6)
    mx.update(X)
    my.update(Y)
    assert torch.allclose(matrix_entropy(mx.zscore(X)), matrix_entropy(my.zscore(Y)), atol=1e-9)


# -- effective rank and cosine ------------------------------------------------------------------------------------


def test_effective_rank_of_known_spectra():
    assert effective_rank_from_singular(torch.ones(7)).item() == pytest.approx(7.0)
    assert effective_rank_from_singular(torch.tensor([5.0, 0, 0])).item() == pytest.approx(1.0)
    p = torch.tensor([0.75, 0.25], dtype=torch.float64)
    assert effective_rank_from_singular(torch.tensor([3.0, 1.0])).item() == pytest.approx(
        math.exp(float(-(p * p.log()).sum())))
    # a matrix U diag(s) V^T has the effective rank of s
    U, _ = torch.linalg.qr(torch.randn(10, 4, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(6, 4, dtype=torch.float64))
    s = torch.tensor([4.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    X = U @ torch.diag(s) @ V.T
    assert effective_rank(X).item() == pytest.approx(effective_rank_from_singular(s).item(), abs=1e-9)


def test_mean_pairwise_cosine():
    same = torch.ones(5, 3, dtype=torch.float64) * torch.tensor([1.0, 2.0, 3.0])
    assert mean_pairwise_cosine(same).item() == pytest.approx(1.0)
    assert mean_pairwise_cosine(torch.eye(4, dtype=torch.float64)).item() == pytest.approx(0.0)
    X = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    c = 1 / math.sqrt(2)
    assert mean_pairwise_cosine(X).item() == pytest.approx((0 + c + c) / 3)


# -- the probe --------------------------------------------------------------------------------------------------


def test_probe_separable_features_and_shuffled_labels():
    g = torch.Generator().manual_seed(0)
    k, n, D = 4, 100, 8
    y = torch.arange(k).repeat_interleave(n)
    means = 4.0 * torch.randn(k, D, generator=g, dtype=torch.float64)
    X = means[y] + torch.randn(k * n, D, generator=g, dtype=torch.float64)
    good = probe_accuracy(X, y, k, folds=5, seed=0)
    assert good["accuracy"] >= 0.99 and good["chance"] == 0.25 and len(good["folds"]) == 5
    noise = torch.randn(k * n, D, generator=g, dtype=torch.float64)
    bad = probe_accuracy(noise, y, k, folds=5, seed=0)
    assert abs(bad["accuracy"] - 0.25) < 0.1
    shuffled = probe_accuracy(X, y[torch.randperm(len(y), generator=g)], k, folds=5, seed=0)
    assert abs(shuffled["accuracy"] - 0.25) < 0.1


def test_probe_classes_words_fallback_and_errors():
    tok = word_tokenizer(["the", "is", "are", "was", "were", "dog"])
    x = np.tile(np.arange(6), (4, 5))  # (4, 30): every word 20 times
    c = probe_classes(tok, x)
    assert c.source == "words" and c.names == ["is", "are", "was", "were"] and c.ids == [[1], [2], [3], [4]]
    assert c.counts == [20] * 4 and c.continues == [] and c.skipped is None  # word-level: the last column counts
    with pytest.raises(CemtoolError, match="not single tokens"):
        probe_classes(tok, x, words=["is", "horse"])


# a corpus where byte-level BPE writes ' is' as one token but 'is' also ends th|is and Par|is, and ' island' is
# ' is' + 'la' + 'n' + 'd' (the artefact: those pieces were counted as the word "is")
BPE_WORDS = "this Paris Clare island is is is are are was were the the a cat sat".split()


@pytest.fixture(scope="module")
def bpe():
    import random

    from cemtool.data.tokenizer import train_bpe

    rng = random.Random(0)
    text = " ".join(rng.choice(BPE_WORDS) for _ in range(3000)) + "."
    tok = train_bpe(iter([text]), 266)
    ids = tok.encode(text)
    x = np.array(ids[: len(ids) // 50 * 50]).reshape(-1, 50)  # (n, 50)
    return tok, x


def whole_word_truth(tok, x, word: str) -> int:
    """Occurrences of ' word' followed by a character that is no letter or digit, counted in each window's text
    (a word cut by the window's end is not counted: its end is unknown)."""
    import re

    return sum(len(re.findall(rf" {word}(?=[^A-Za-z0-9])", tok.decode(row.tolist()))) for row in x)


def test_probe_classes_are_whole_words_at_a_word_start_on_bpe(bpe):
    tok, x = bpe
    bare, start = tok.encode("is"), tok.encode(" is")
    assert len(bare) == 1 and len(start) == 1 and bare != start
    assert bare[0] in x[:, 1:] and tok.encode(" island")[0] == start[0]  # the pieces the probe must not take
    c = probe_classes(tok, x, words=["is", "are"], min_count=2)
    assert c.ids == [start, tok.encode(" are")]  # not the bare piece inside th|is, Par|is
    assert c.counts == [whole_word_truth(tok, x, "is"), whole_word_truth(tok, x, "are")]
    assert c.counts[0] < int((x == start[0]).sum())  # ' is' + 'land' was taken out
    lab = c.whole_words(torch.from_numpy(x), tok.vocab_size)
    assert [int((lab == k).sum()) for k in range(2)] == c.counts


def test_probe_falls_back_to_frequent_whole_words_or_skips_with_the_counts(bpe):
    tok, x = bpe
    assert len(tok.encode(" were")) > 1  # the default words are not all word-start tokens here
    c = probe_classes(tok, x, k=3, min_count=16)
    assert c.source == "frequent" and len(c.names) == 3 and "'were': 0" in c.note and c.skipped is None
    for name, ids, n in zip(c.names, c.ids, c.counts, strict=True):
        assert ids == tok.encode(" " + name) and n == whole_word_truth(tok, x, name) >= 16
    rare = probe_classes(tok, x, words=["is", "are"], min_count=10**6)  # the user's words: never replaced
    assert rare.source == "words" and rare.skipped and "fewer than 1000000" in rare.skipped
    model = tiny(vocab=tok.vocab_size, T=50, dtype=torch.float32)
    rep = collapse_report(model, torch.from_numpy(x[:4]), classes=rare, folds=2, per_class=16)
    assert rep["layers"][0]["probe"]["hidden"].startswith("not applicable: a probe class occurs fewer")
    assert rep["probe_classes"]["counts"] == rare.counts and rep["probe_classes"]["skipped"] == rare.skipped
    none = probe_classes(byte_tokenizer(), np.frombuffer(b"this is a test. " * 40, dtype=np.uint8).astype(int))
    assert none.skipped and "fewer than 2 other whole-word tokens" in none.skipped  # bytes are no words


def test_probe_uses_only_whole_word_samples_and_reports_them(bpe):
    tok, x = bpe
    x = x[:24]
    c = probe_classes(tok, x, words=["is", "are"], min_count=8)
    model = tiny(vocab=tok.vocab_size, T=50, dtype=torch.float32)
    rep = collapse_report(model, torch.from_numpy(x), classes=c, folds=2, per_class=1000, batch_size=24)
    assert rep["probe_classes"]["per_class"] == min(c.counts)
    assert rep["layers"][0]["probe"]["hidden"]["n"] == 2 * min(c.counts)
    with pytest.raises(CemtoolError, match="below the probe's minimum"):
        collapse_report(model, torch.from_numpy(x), classes=c, folds=2, per_class=4)


# -- attention rows ---------------------------------------------------------------------------------------------


def test_uniform_causal_pattern_has_entropy_log_context():
    T, H = 7, 3
    p = torch.ones(T, T, dtype=torch.float64).tril()
    p = (p / p.sum(-1, keepdim=True)).expand(2, H, T, T)
    s = attention_row_stats(p) / 2  # (6, H, T), per sequence
    ctx = torch.arange(1, T + 1, dtype=torch.float64)
    assert torch.allclose(s[0], ctx.log().expand(H, T), atol=1e-12)  # entropy
    assert torch.allclose(s[1], (1 / ctx).expand(H, T))  # max prob
    assert torch.allclose(s[3], torch.zeros(H, T, dtype=torch.float64), atol=1e-12)  # logit range: all logits equal
    summ = summarise_attention(attention_row_stats(p), 2)
    assert summ["per_head"][0]["entropy_norm"] == pytest.approx(1.0)
    assert summ["curves"]["entropy_norm"][0][0] is None  # one key: undefined
    assert summ["per_head"][0]["share_above_0.9"] == pytest.approx(1 / T)  # only the first row


def test_model_with_zero_queries_attends_uniformly():
    model = tiny(extra=["model.pos=learned"])
    with torch.no_grad():
        for b in model.blocks:
            b.attn.wq.weight.zero_()
    x = torch.randint(0, 40, (6, 12), generator=torch.Generator().manual_seed(1))
    rep = collapse_report(model, x, classes=None, batch_size=4)
    for e in rep["layers"]:
        for curve in e["attention"]["curves"]["entropy"]:
            assert np.allclose(curve, np.log(np.arange(1, 13)), atol=1e-9)
        assert e["probe"]["values"].startswith("not applicable")


# -- the whole report -------------------------------------------------------------------------------------------


def test_report_is_independent_of_the_batch_size():
    model = tiny()
    x = torch.randint(0, 40, (14, 12), generator=torch.Generator().manual_seed(2))
    classes = ProbeClasses(["a", "b"], [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], "words")
    a = collapse_report(model, x, classes=classes, batch_size=1, per_class=20, folds=2)
    b = collapse_report(model, x, classes=classes, batch_size=5, per_class=20, folds=2)
    for ea, eb in zip(a["layers"], b["layers"], strict=True):
        for kind in ("values", "hidden"):
            for m in ("entropy", "erank_seq", "cosine"):
                assert ea[kind][m]["mean"] == pytest.approx(eb[kind][m]["mean"], abs=1e-9)
            assert ea[kind]["erank_all"] == pytest.approx(eb[kind]["erank_all"], abs=1e-8)
        assert ea["probe"]["hidden"]["folds"] == pytest.approx(eb["probe"]["hidden"]["folds"])
        assert ea["values"]["heads"] == 2 and len(ea["values"]["entropy_per_head"]) == 2
    counts = [int(sum((x == i).sum() for i in ids)) for ids in classes.ids]
    assert a["probe_classes"]["per_class"] == min(20, *counts)
    assert a["layers"][0]["probe"]["hidden"]["n"] == 2 * min(20, *counts)
    assert a["layers"][0]["values"]["entropy"]["n"] == 14
    rows = report_rows(a, "r", "baseline")
    assert any(r["measure"] == "hidden.entropy.change" and r["layer"] == 1 for r in rows)


def test_every_architecture_reports_or_says_why():
    x = torch.randint(0, 40, (4, 12), generator=torch.Generator().manual_seed(3))
    for arch in ("cem-rec2", "nesterov", "lime-dynamic"):
        rep = collapse_report(tiny(arch, dtype=torch.float32), x, classes=None, batch_size=2)
        for e in rep["layers"]:
            assert isinstance(e["hidden"], dict) and isinstance(e["values"], dict)
            assert math.isfinite(e["hidden"]["entropy"]["mean"])


# -- LIMe routing and momentum scalars ----------------------------------------------------------------------------


def test_router_summary_by_hand():
    W = torch.tensor([[0.5, -0.5, 1.0, 0.0], [0.0, 1.0, 0.0, 2.0]], dtype=torch.float64)  # layer 1, 2 heads
    s = router_summary(1, W, [2, 2])
    assert s["source_blocks"] == [(0, 2), (2, 4)]
    assert s["mean_weight"] == pytest.approx([0.25, 0.75])
    assert s["share"] == pytest.approx([2.0 / 5.0, 3.0 / 5.0])
    assert s["self_retrieval"] == pytest.approx([1.0, 2.0])
    assert s["expected_layer"] == pytest.approx(0.6)
    assert s["expected_layer_per_head"] == pytest.approx([0.5, 2.0 / 3.0])


def test_static_routing_report_reproduces_the_router_parameters():
    model = tiny("lime", extra=["model.n_layer=3"])
    rep = lime_routing(model)
    assert rep["variant"] == "static" and rep["signed"]
    for e in rep["layers"]:
        i = e["layer"]
        expected = model.blocks[i].lime.weight if i > 0 else torch.eye(2, dtype=torch.float64)
        assert torch.equal(torch.tensor(e["heatmap"], dtype=torch.float64), expected.detach())
        assert e["self_retrieval"] == pytest.approx(torch.diagonal(expected[:, -2:]).tolist())


def test_softmax_and_dynamic_routing():
    sm = tiny("lime-softmax")
    with torch.no_grad():
        sm.blocks[1].lime.logits.copy_(torch.tensor([[0.0, 1.0], [2.0, -1.0]]))
    e = lime_routing(sm)["layers"][1]
    assert torch.allclose(torch.tensor(e["heatmap"], dtype=torch.float64), torch.softmax(sm.blocks[1].lime.logits, -1))
    assert e["self_retrieval"] == pytest.approx(torch.softmax(sm.blocks[1].lime.logits, -1)[:, 1].tolist())
    dyn = tiny("lime-dynamic")
    x = torch.randint(0, 40, (5, 12), generator=torch.Generator().manual_seed(4))
    rep = collapse_report(dyn, x, classes=None, batch_size=2)
    with capture(dyn, "blocks.1.lime.weights") as cache:
        dyn(x)
    manual = cache["blocks.1.lime.weights"].mean((0, 1))  # (H, 2)
    assert torch.allclose(torch.tensor(rep["layers"][1]["routing_mean"], dtype=torch.float64), manual, atol=1e-12)
    routed = lime_routing(dyn, {e["layer"]: e["routing_mean"] for e in rep["layers"] if "routing_mean" in e})
    assert routed["layers"][0]["layer"] == 1
    assert torch.allclose(torch.tensor(routed["layers"][0]["heatmap"], dtype=torch.float64), manual, atol=1e-12)
    assert isinstance(lime_routing(tiny()), str) and lime_routing(tiny()).startswith("not applicable")


def test_stream_scalars():
    model = tiny("tmm")
    rows = stream_scalars(model)
    assert rows == model.stream_scalars() and {r["substep"] for r in rows} == {"attn", "mlp"}
    assert rows[0]["nu"] == pytest.approx(1.0, abs=1e-3)  # softplus(0.5413)
    assert stream_scalars(tiny()).startswith("not applicable")


def test_probe_classes_on_a_sentencepiece_style_tokenizer():
    """Word starts keyed on what the tokenizer makes of ' word' / 'word', not on one tokenizer's symbols: with a
    Metaspace ('▁is') tokenizer, the class is '▁is' and the counts are the whole-word occurrences."""
    import random
    import re

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from cemtool.data.tokenizer import Tokenizer

    rng = random.Random(1)
    text = " ".join(rng.choice(BPE_WORDS) for _ in range(2000)) + "."
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer, hf.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    hf.train_from_iterator([text], trainers.BpeTrainer(vocab_size=40, show_progress=False))
    tok = Tokenizer(hf, "hf")
    assert [hf.id_to_token(i) for i in tok.encode("island")] == ["▁is", "lan", "d"]  # '▁is' + a continuation
    ids = tok.encode(text)
    x = np.array(ids[: len(ids) // 40 * 40]).reshape(-1, 40)  # (n, 40)
    c = probe_classes(tok, x, words=["is", "are"], min_count=2)
    assert [hf.id_to_token(i[0]) for i in c.ids] == ["▁is", "▁are"]
    truth = [sum(len(re.findall(rf"(?:^|(?<= )){w}(?=[^A-Za-z0-9])", tok.decode(row.tolist()))) for row in x)
             for w in ("is", "are")]
    assert c.counts == truth and min(truth) > 50 and c.counts[0] < int((x == c.ids[0][0]).sum())


def test_a_lagged_probe_asks_for_the_earlier_token_and_layer_0_values_cannot_answer_it():
    """``lag`` 1: the label at position t is the class of the token at t - 1 (none at t = 0). On i.i.d. tokens an
    untrained model's layer-0 values, a function of the token at t alone, read the current token perfectly
    (lag 0) and the previous one at chance (lag 1), while a later layer's hidden state, which attention mixes,
    reads it above chance."""
    from cemtool.analysis.probe import ProbeSample

    classes = ProbeClasses(["a", "b", "c", "d"], [[1], [2], [3], [4]], "words")
    idx = torch.tensor([[1, 2, 3, 4, 9, 1], [4, 4, 9, 2, 1, 3]])
    s = ProbeSample(classes, 40, per_class=100, lag=1)
    b, t = s.select(idx)
    got = sorted(zip(b.tolist(), t.tolist(), s.labels[0].tolist()))
    want = sorted((i, j, int(idx[i, j - 1]) - 1) for i in range(2) for j in range(1, 6) if 1 <= idx[i, j - 1] <= 4)
    assert got == want
    model = tiny(T=32)
    x = torch.randint(1, 5, (64, 32), generator=torch.Generator().manual_seed(4))  # i.i.d. over the 4 classes
    now = collapse_report(model, x, classes=classes, folds=4, per_class=300, lag=0)
    before = collapse_report(model, x, classes=classes, folds=4, per_class=300, lag=1)
    assert now["layers"][0]["probe"]["values"]["accuracy"] > 0.99
    v0 = before["layers"][0]["probe"]["values"]
    assert abs(v0["accuracy"] - 0.25) < 0.08, v0  # chance: nothing of token t - 1 is in layer 0's values
    assert before["layers"][0]["probe"]["hidden"]["accuracy"] > 0.33  # 0.42 here: attention brought some of it
    assert before["probe_classes"]["lag"] == 1 and now["probe_classes"]["lag"] == 0
    with pytest.raises(CemtoolError, match="lag"):
        collapse_report(model, x, classes=classes, lag=32)


def test_every_heads_value_entropy_equals_the_one_head_computation():
    """The per-head entropies (one batched spectrum call over the heads) against each head's values z-scored with
    the all-token moments and measured on their own, sequence by sequence."""
    model = tiny(T=12)
    x = torch.randint(0, 40, (6, 12), generator=torch.Generator().manual_seed(7))
    rep = collapse_report(model, x, classes=None, batch_size=4)
    with torch.no_grad(), capture(model, "blocks.1.attn.v") as cache:
        model(x)
    v = cache["blocks.1.attn.v"].double()  # (B, H, T, d_h)
    X = v.permute(0, 2, 1, 3).reshape(6, 12, -1)  # (B, T, H d_h)
    flat = X.reshape(-1, X.shape[-1])
    Z = (X - flat.mean(0)) / flat.std(0, unbiased=False)
    dh = v.shape[-1]
    got = rep["layers"][1]["values"]["entropy_per_head"]
    assert len(got) == v.shape[1] >= 2
    for h, g in enumerate(got):
        want = torch.stack([matrix_entropy(Z[b, :, h * dh:(h + 1) * dh], 0.5) for b in range(6)])  # (B,)
        assert g["mean"] == pytest.approx(float(want.mean()), rel=1e-10) and g["n"] == 6
