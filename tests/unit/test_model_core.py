"""The backbone: one attention core (fused == explicit), causality, capture points, init, FLOPs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from cemtool.analysis.compute import fresh_counts
from cemtool.config import replace, resolve
from cemtool.models import attention_impl, build_model, capture, causal_attention, flops_per_token, hook_points

from kit import tiny_config, tiny_model

VOCAB, T = 40, 12


def tiny(*sets, arch="baseline"):
    return tiny_model(arch, *sets, d_model=32, n_head=4, vocab=VOCAB, seq_len=T)


def test_core_fused_equals_explicit_and_dense_reference():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 8, generator=g, dtype=torch.float64), torch.randn(2, 3, 7, 8, generator=g,
                                                                                   dtype=torch.float64)
    v = torch.randn(2, 3, 7, 5, generator=g, dtype=torch.float64)
    fused = causal_attention(q, k, v, impl="fused")
    explicit = causal_attention(q, k, v, impl="explicit")
    # dense reference written out by hand
    s = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(8)
    s = s + torch.triu(torch.full((7, 7), float("-inf"), dtype=torch.float64), 1)
    ref = torch.softmax(s, -1) @ v
    assert torch.allclose(fused, ref, atol=1e-12) and torch.allclose(explicit, ref, atol=1e-12)
    bias = torch.randn(1, 3, 7, 7, generator=g, dtype=torch.float64)
    assert torch.allclose(causal_attention(q, k, v, impl="fused", bias=bias, scale=0.3),
                          causal_attention(q, k, v, impl="explicit", bias=bias, scale=0.3), atol=1e-12)


@pytest.mark.parametrize("sets", [[], ["model.pos=learned", "model.norm=layernorm", "model.mlp=gelu",
                                       "model.tie_embeddings=false"]])
def test_model_fused_equals_explicit(sets):
    model = tiny(*sets).double()
    idx = torch.randint(0, VOCAB, (3, T))
    a = model(idx)
    with attention_impl("explicit"):
        b = model(idx)
    assert torch.allclose(a, b, atol=1e-10)


@settings(max_examples=15, deadline=None)
@given(t=st.integers(0, T - 1), seed=st.integers(0, 10_000),
       variant=st.sampled_from([[], ["model.pos=learned", "model.mlp=gelu", "model.norm=layernorm"]]))
def test_causality(t, seed, variant):
    model = tiny(*variant).double()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (2, T), generator=g)
    other = idx.clone()
    other[:, t] = (idx[:, t] + 1 + torch.randint(0, VOCAB - 1, (2,), generator=g)) % VOCAB
    a, b = model(idx), model(other)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_capture_points_and_shapes():
    model = tiny()
    idx = torch.randint(0, VOCAB, (2, T))
    names = set(hook_points(model))
    for i in range(2):
        for p in ("attn.q", "attn.k", "attn.v", "attn.pattern", "attn.z", "resid_pre", "resid_mid", "resid_post",
                  "mlp.hidden"):
            assert f"blocks.{i}.{p}" in names
    with capture(model, ["blocks.*.attn.pattern", "blocks.1.resid_post", "blocks.0.attn.v"]) as cache:
        logits = model(idx)
    pat = cache["blocks.0.attn.pattern"]
    assert pat.shape == (2, 4, T, T) and pat.device.type == "cpu" and not pat.requires_grad
    assert torch.allclose(pat.sum(-1), torch.ones(2, 4, T))
    assert torch.all(pat.triu(1) == 0)
    assert cache["blocks.0.attn.v"].shape == (2, 4, T, 8)
    assert cache["blocks.1.resid_post"].shape == (2, T, 32)
    # capture leaves the model unchanged and detaches afterwards
    assert torch.allclose(model(idx), logits, atol=1e-6)
    assert not any(p.active for p in hook_points(model).values())


def test_capture_unknown_name_is_clear():
    from cemtool.errors import CemtoolError

    with pytest.raises(CemtoolError, match="no hook point"):
        with capture(tiny(), "blocks.*.nothing"):
            pass


def test_init_scaled_by_depth_and_tied_head():
    cfg = resolve(overrides=["model.n_layer=8", "model.d_model=64"])
    torch.manual_seed(0)
    model = build_model(replace(cfg.model, vocab_size=VOCAB, max_seq_len=T))
    std_o = model.blocks[0].attn.wo.weight.std().item()
    std_q = model.blocks[0].attn.wq.weight.std().item()
    assert abs(std_q - 0.02) < 0.002
    assert abs(std_o - 0.02 / math.sqrt(16)) < 0.001
    assert model.head.weight is model.tok_emb.weight


def test_param_count_and_flops_closed_form():
    model = tiny("model.mlp=gelu", "model.pos=learned")
    d, L, V = 32, 2, VOCAB
    per_block = 4 * d * d + 2 * 4 * d * d + 2 * d  # attention, GELU MLP (4d), two RMSNorm weights
    expected = V * d + T * d + L * per_block + d
    n = model.num_params()
    assert n["total"] == expected and n["non_embedding"] == expected - V * d - T * d
    f = flops_per_token(model, T)
    matmul = 2 * (L * (4 * d * d + 8 * d * d) + d * V)  # 2 FLOPs per multiply-add, per token
    attn = L * 2 * 2 * T * d  # scores and weighted sum, dense T x T
    assert f["forward"] == pytest.approx(matmul + attn)
    assert f["train"] == pytest.approx(3 * f["forward"], rel=0.05)


def test_training_flops_are_a_forward_and_its_backward_and_counted_once_per_config():
    """flops_per_token's train count against counting forward and backward together under one counter, and
    fresh_counts' memo against fresh counts: equal for the same config, different for a changed one."""
    for arch in ("baseline", "tmm", "lime"):
        model = tiny_model(arch, vocab=VOCAB, seq_len=T)
        both = FlopCounterMode(display=False)
        with both, attention_impl("explicit"):
            model(torch.zeros(1, T, dtype=torch.long)).float().sum().backward()
        f = flops_per_token(model, T)
        assert f["train"] == both.get_total_flops() / T and f["train"] > 2 * f["forward"] > 0, arch
        cfg = tiny_config(arch, vocab=VOCAB, seq_len=T)
        counts = fresh_counts(cfg, T)
        assert counts == {**model.num_params(), **f} and fresh_counts(cfg, T) == counts, arch
        wider = fresh_counts(replace(cfg, d_model=32), T)
        assert wider["train"] > counts["train"] and wider["total"] > counts["total"], arch
