"""LIMe (METHODS §5): routing definitions against dense ground truth, causality, baseline equivalence,
router optimizer group, FLOPs overhead, checkpoint round trip."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.checkpoints import load_weights, read_checkpoint, save_checkpoint
from cemtool.config import TrainConfig, replace, resolve
from cemtool.errors import CemtoolError, ConfigError
from cemtool.models import build_model, capture, flops_per_token, lm_loss
from cemtool.runs import Run
from cemtool.train import make_optimizer

from kit import tiny_config, tiny_model, tiny_tokens

VARIANTS = ["lime", "lime-softmax", "lime-dynamic"]
ROUTER_PARAM = {"lime": "weight", "lime-softmax": "logits", "lime-dynamic": "proj.weight"}
V, T = 50, 12


def tiny(arch: str, *overrides: str, n_layer: int = 3):
    return tiny_config(arch, *overrides, d_model=32, n_layer=n_layer, n_head=None, vocab=V, seq_len=16)


def built(arch: str, *overrides: str, seed: int = 0, n_layer: int = 3):
    return tiny_model(arch, *overrides, seed=seed, dtype=torch.float64, d_model=32, n_layer=n_layer, n_head=None,
                      vocab=V, seq_len=16)


def tokens(B: int = 2, seed: int = 1) -> torch.Tensor:
    return tiny_tokens(B, T, V, seed, targets=False)


_MODELS: dict[str, torch.nn.Module] = {}


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(VARIANTS), st.integers(0, T - 1), st.integers(0, V - 1), st.integers(0, 10**6))
def test_causal(arch, pos, new_token, seed):
    if arch not in _MODELS:
        _MODELS[arch] = built(arch)
    model = _MODELS[arch]
    x = tokens(seed=seed)
    y = x.clone()
    y[:, pos] = new_token
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :pos], b[:, :pos], rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", VARIANTS)
def test_finite_forward_backward_and_every_router_gets_a_gradient(arch):
    model = built(arch)
    x = tokens()
    loss = lm_loss(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if ".lime." in name:
            assert p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("arch", VARIANTS)
def test_loss_drops(arch):
    torch.manual_seed(0)
    model = build_model(tiny(arch, n_layer=2))
    opt = make_optimizer(model, TrainConfig(lr=3e-3), torch.device("cpu"))
    x = torch.randint(0, V, (4, 17), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(20):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("heads", [(), (2, 4, 1)])
def test_static_with_zero_earlier_blocks_is_the_baseline(heads):
    """W^(l) = [0 ... 0 | I]: every layer attends with its own keys and values, as the baseline."""
    extra = [f"model.heads={list(heads)}", "model.head_dims=[8,8,8]"] if heads else []
    base = built("baseline", *extra, seed=0)
    lime = built("lime", *extra, seed=1)
    result = lime.load_state_dict(base.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert sorted(result.missing_keys) == ["blocks.1.lime.weight", "blocks.2.lime.weight"]
    x = tokens()
    with torch.no_grad():
        assert (lime(x) - base(x)).abs().max() > 1e-6  # the random earlier blocks do mix layers
        for block in lime.blocks[1:]:
            R = block.lime.n_out
            block.lime.weight.zero_()
            block.lime.weight[:, -R:] = torch.eye(R, dtype=torch.float64)
        assert (lime(x) - base(x)).abs().max() <= 1e-12


def test_static_init_and_routing_weights():
    model = built("lime")
    weights = model.routing_weights()
    assert sorted(weights) == [0, 1, 2] and torch.equal(weights[0], torch.eye(4, dtype=torch.float64))
    for i in (1, 2):
        W = model.blocks[i].lime.weight
        assert W.shape == (4, 4 * (i + 1)) and torch.equal(weights[i], W.detach())
        assert torch.equal(W[:, -4:], torch.eye(4, dtype=W.dtype))
        bound = math.sqrt(3 / (4 * (i + 1)))
        earlier = W[:, :-4]
        assert earlier.abs().max() <= bound and earlier.abs().min() > 0
    assert sorted(model.routing_weights(raw=True)) == [1, 2]


def test_static_routes_values_as_defined():
    """attn.v of layer l = sum over layers m <= l and heads h of W^(l)[r, m R + h] * own values V_{m,h}."""
    model = built("lime")
    with capture(model, ["blocks.*.attn.v", "blocks.*.attn.k", "blocks.*.lime.*"]) as cache:
        model(tokens())
    own = [cache[f"blocks.{m}.lime.v_own"] for m in range(3)]  # (B, R, T, d_h)
    weights = model.routing_weights()
    for layer in range(3):
        W = cache[f"blocks.{layer}.lime.weights"]
        assert torch.equal(W, weights[layer])
        expected = torch.zeros_like(own[layer])
        for r in range(4):
            for m in range(layer + 1):
                for h in range(4):
                    expected[:, r] += W[r, m * 4 + h] * own[m][:, h]
        assert torch.allclose(cache[f"blocks.{layer}.attn.v"], expected, rtol=0, atol=1e-12)
    # keys are routed with the same weights: identity at layer 0
    assert torch.equal(cache["blocks.0.attn.v"], own[0])


@pytest.mark.parametrize("arch", ["lime-softmax", "lime-dynamic"])
def test_hidden_state_routers_mix_as_defined(arch):
    """v_{l,h} = (sum_m p[h, m] N_l(h_m)) W_V^h with h_m the block inputs; p rows are distributions."""
    model = built(arch)
    if arch == "lime-softmax":  # zero logits (the init) mix uniformly, which would hide the layer order
        with torch.no_grad():
            for block in model.blocks[1:]:
                block.lime.logits.normal_()
    with capture(model, ["blocks.*.resid_pre", "blocks.*.attn.v", "blocks.*.lime.weights"]) as cache:
        model(tokens())
    hidden = [cache[f"blocks.{m}.resid_pre"] for m in range(3)]  # (B, T, d)
    for layer in (1, 2):
        block = model.blocks[layer]
        p = cache[f"blocks.{layer}.lime.weights"]
        shape = (4, layer + 1) if arch == "lime-softmax" else (2, T, 4, layer + 1)
        assert p.shape == shape and (p > 0).all()
        assert torch.allclose(p.sum(-1), torch.ones((), dtype=p.dtype), atol=1e-12)
        if arch == "lime-softmax":
            assert torch.equal(p, model.routing_weights()[layer])
            p = p.expand(2, T, 4, layer + 1)
        Wv = block.attn.wv.weight.detach().view(4, 8, 32)  # (H, d_h, d)
        with torch.no_grad():
            for h in range(4):
                mixed = sum(p[:, :, h, m, None] * block.lime.norm(hidden[m]) for m in range(layer + 1))  # (B,T,d)
                expected = mixed @ Wv[h].T  # (B, T, d_h)
                assert torch.allclose(cache[f"blocks.{layer}.attn.v"][:, h], expected, rtol=0, atol=1e-12)


def test_routing_weights_of_dynamic_router_is_an_error():
    with pytest.raises(CemtoolError, match="per-token"):
        built("lime-dynamic").routing_weights()


def test_static_needs_one_head_size_other_variants_take_any_allocation():
    with pytest.raises(ConfigError, match="one head size"):
        build_model(tiny("lime", "model.alloc_strategy=early-heavy", n_layer=2))
    model = built("lime-softmax", "model.alloc_strategy=early-heavy", n_layer=2)
    assert [(b.attn.n_head, b.attn.head_dim) for b in model.blocks] == [(6, 8), (4, 4)]
    assert model(tokens()).shape == (2, T, V)


@pytest.mark.parametrize("arch", VARIANTS)
def test_router_parameters_get_their_own_group(arch):
    model = build_model(tiny(arch))
    tc = TrainConfig()
    groups = {g["name"]: g for g in make_optimizer(model, tc, torch.device("cpu")).param_groups}
    router = groups["router"]
    assert router["lr"] == pytest.approx(10 * tc.lr) and router["weight_decay"] == 0.0
    assert sorted(router["param_names"]) == [f"blocks.{i}.lime.{ROUTER_PARAM[arch]}" for i in (1, 2)]
    for name, g in groups.items():
        if name != "router":
            assert g["lr"] == pytest.approx(tc.lr) and not any(".lime." in n and ROUTER_PARAM[arch] in n
                                                              for n in g["param_names"])


def test_router_at_an_absolute_lr_and_frozen(arch_pair=("lime", "lime-softmax")):
    """lime.router_lr: the router group's peak lr is that number whatever train.lr (the reference code's 1e-2), and
    it follows train.lr's schedule; lime.freeze_router: the routers take no gradient and a training step leaves
    them exactly at their initialisation while every other parameter moves."""
    from cemtool.optim import param_groups

    for arch in arch_pair:
        for lr in (1e-3, 3e-3):
            model = build_model(tiny(arch, "model.lime.router_lr=0.01"))
            groups = {g["name"]: g for g in make_optimizer(model, TrainConfig(lr=lr), torch.device("cpu")).param_groups}
            assert groups["router"]["lr"] == pytest.approx(0.01) and groups["decay"]["lr"] == pytest.approx(lr)
        with pytest.raises(ConfigError, match="absolute learning rate"):
            param_groups(build_model(tiny(arch, "model.lime.router_lr=0.01")), TrainConfig(lr=0.0))
        model = built(arch, "model.lime.freeze_router=true")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        routers = [n for n in before if ".lime." in n and ROUTER_PARAM[arch] in n]
        assert routers and all(not dict(model.named_parameters())[n].requires_grad for n in routers)
        opt = make_optimizer(model, TrainConfig(lr=1e-2), torch.device("cpu"))
        assert not any(n in routers for g in opt.param_groups for n in g["param_names"])
        x = tokens()
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        after = dict(model.named_parameters())
        assert all(torch.equal(after[n], before[n]) for n in routers)
        assert not torch.equal(after["tok_emb.weight"], before["tok_emb.weight"])


def test_static_flops_overhead_is_the_router_matmul():
    """Extra forward FLOPs per token = sum_{l>=1} 2 * R * (l+1) R * 2 d_h (one matmul for K and V)."""
    L, R, dh = 3, 4, 8
    extra = flops_per_token(built("lime"), T)["forward"] - flops_per_token(built("baseline"), T)["forward"]
    assert extra == sum(2 * R * (i + 1) * R * 2 * dh for i in range(1, L))
    # at the default size (d 128, 4 layers, vocab 512, T 64) the overhead is about one percent
    cfgs = {a: replace(resolve(arch=a).model, vocab_size=512, max_seq_len=64) for a in ("lime", "baseline")}
    f = {a: flops_per_token(build_model(c), 64)["forward"] for a, c in cfgs.items()}
    assert 0 < f["lime"] / f["baseline"] - 1 < 0.02


@pytest.mark.parametrize("arch", VARIANTS)
def test_checkpoint_round_trip(arch, tmp_path):
    model = built(arch, seed=0)
    path = save_checkpoint(Run(tmp_path), "final", model, step=7)
    other = built(arch, seed=5)
    load_weights(other, read_checkpoint(path))
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x), other(x))
    if arch != "lime-dynamic":
        for i, w in model.routing_weights(raw=True).items():
            assert torch.equal(other.routing_weights(raw=True)[i], w)
