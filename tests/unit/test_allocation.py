"""Per-layer head allocation (METHODS §4): exact budgets, explicit lists in built models, RoPE constraints."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.config import ModelConfig, replace, resolve
from cemtool.errors import ConfigError
from cemtool.models import build_model, lm_loss
from cemtool.models.allocation import attention_budget, describe_allocation, layer_shapes, uniform_budget

from kit import tiny_config


@st.composite
def sizes(draw):
    """(n_layer, n_head, d_model, pos) the config accepts: n_head divides d_model, even head size under RoPE."""
    pos = draw(st.sampled_from(["rope", "learned"]))
    L = draw(st.integers(1, 24))
    H = draw(st.integers(1, 16))
    dh = draw(st.integers(1, 40).map(lambda k: 2 * k) if pos == "rope" else st.integers(1, 80))
    return L, H, H * dh, pos


@settings(max_examples=300, deadline=None)
@given(sizes(), st.sampled_from(["uniform", "early-heavy", "late-lowrank"]))
def test_strategies_keep_the_budget_exactly(size, strategy):
    L, H, d, pos = size
    cfg = ModelConfig(n_layer=L, n_head=H, d_model=d, pos=pos, alloc_strategy=strategy)
    dh, u = d // H, 2 if pos == "rope" else 1
    shapes = layer_shapes(cfg)
    assert len(shapes) == L
    assert attention_budget(cfg) == sum(h * k for h, k in shapes) == L * H * dh == uniform_budget(cfg)
    assert all(h >= 1 and k >= 1 and k % u == 0 for h, k in shapes)
    widths = [h * k for h, k in shapes]
    if strategy == "uniform":
        assert shapes == [(H, dh)] * L
    elif strategy == "early-heavy":
        early, late = shapes[: L // 2], shapes[L - L // 2:]
        assert all(h >= H and k <= dh for h, k in early)  # more heads early
        assert all(h == H and k <= dh for h, k in late)  # smaller heads late
        assert widths == sorted(widths, reverse=True)
        if L >= 2 and dh > u:
            assert shapes != [(H, dh)] * L and early[0][0] > H and late[-1][1] < dh
    else:
        assert all(h == H for h, _ in shapes)  # late-lowrank moves rank (head size), not heads
        dims = [k for _, k in shapes]
        assert dims == sorted(dims, reverse=True)
        if L >= 2 and dh > u:
            assert dims[-1] < dh < dims[0]


def test_describe_allocation_reports_budgets():
    cfg = ModelConfig(n_layer=4, n_head=4, d_model=128, alloc_strategy="early-heavy")
    info = describe_allocation(cfg)
    assert [(s["heads"], s["head_dim"]) for s in info["shapes"]] == [(6, 32), (6, 32), (4, 16), (4, 16)]
    assert info["budget"] == info["uniform_budget"] == 512 and info["keeps_budget"]
    cfg = replace(cfg, heads=(2, 4, 4, 1), head_dims=(8, 8, 16, 64))
    info = describe_allocation(cfg)
    assert info["budget"] == 2 * 8 + 4 * 8 + 4 * 16 + 64 and info["uniform_budget"] == 512
    assert not info["keeps_budget"] and info["explicit"] == ["heads", "head_dims"]


def tiny(arch: str = "baseline", *overrides: str):
    return tiny_config(arch, *overrides, d_model=32, n_head=None, vocab=50, seq_len=16)


def test_explicit_lists_shape_the_built_model():
    m = tiny("baseline", "model.heads=[2,4]", "model.head_dims=[10,4]")
    model = build_model(m)
    for i, (h, d) in enumerate([(2, 10), (4, 4)]):
        attn = model.get_submodule(f"blocks.{i}.attn")
        assert (attn.n_head, attn.head_dim) == (h, d)
        assert attn.wq.weight.shape == (h * d, 32) and attn.wo.weight.shape == (32, h * d)
    assert model(torch.randint(0, 50, (2, 16))).shape == (2, 16, 50)
    # only the head counts given: the sizes come from the strategy
    model = build_model(tiny("baseline", "model.heads=[1,3]"))
    assert [(b.attn.n_head, b.attn.head_dim) for b in model.blocks] == [(1, 8), (3, 8)]


def test_rope_rejects_odd_head_sizes():
    with pytest.raises(ConfigError, match="odd"):
        build_model(tiny("baseline", "model.head_dims=[3,4]"))
    with pytest.raises(ConfigError, match="odd"):
        layer_shapes(ModelConfig(n_layer=2, n_head=4, d_model=12, alloc_strategy="early-heavy"))
    model = build_model(tiny("baseline", "model.head_dims=[3,4]", "model.pos=learned"))
    assert model.blocks[0].attn.head_dim == 3


def test_bad_lists_and_strategy_are_one_line_errors():
    with pytest.raises(ConfigError, match="expected model.n_layer=2"):
        layer_shapes(ModelConfig(n_layer=2, heads=(4, 4, 4)))
    with pytest.raises(ConfigError, match="positive"):
        layer_shapes(ModelConfig(n_layer=2, head_dims=(8, 0)))
    with pytest.raises(ConfigError, match="not available"):
        layer_shapes(ModelConfig(alloc_strategy="random"))
    with pytest.raises(ConfigError):
        resolve(overrides=["model.alloc_strategy=random"])


def test_early_heavy_model_trains():
    torch.manual_seed(0)
    m = tiny("baseline", "model.alloc_strategy=early-heavy", "model.n_head=4")
    model = build_model(m)
    assert [(b.attn.n_head, b.attn.head_dim) for b in model.blocks] == [(6, 8), (4, 4)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 50, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(20):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5
