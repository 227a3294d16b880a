"""Momentum-stream models (METHODS §3): causality, training, round trips, the equivalences between variants,
and the Newton–Schulz / Newton inverse-square-root math against dense ground truth."""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.checkpoints import load_weights, read_checkpoint, save_checkpoint
from cemtool.config import replace, resolve
from cemtool.errors import ConfigError
from cemtool.models import archs, attention_impl, build_model, capture, lm_loss
from cemtool.models.momentum import NS_COEFFS, SCALARS, VARIANTS, inv_sqrt_newton, newton_schulz
from cemtool.runs import Run

from kit import tiny_config, tiny_model, tiny_tokens

V, T = 40, 12
STREAM_VARIANTS = [v for v in VARIANTS if v != "vanilla"]


def model_cfg(arch: str, *extra: str, init: str = "embed"):
    return tiny_config(arch, f"model.momentum.stream_init={init}", *extra, vocab=V, seq_len=T)


def build(arch: str, *extra: str, init: str = "embed", seed: int = 0, dtype=torch.float64):
    return tiny_model(arch, f"model.momentum.stream_init={init}", *extra, seed=seed, dtype=dtype, vocab=V, seq_len=T)


def tokens(seed: int = 0, B: int = 2) -> torch.Tensor:
    return tiny_tokens(B, T, V, seed, targets=False)


# --------------------------------------------------------------------------------------------------------------
# registry and construction


def test_all_eleven_registered_in_the_momentum_family():
    table = archs()
    for name in VARIANTS:
        assert table[name].family == "momentum"
        assert resolve(arch=name).model.momentum.variant == name
    assert table["vanilla"].build is table["baseline"].build  # the baseline itself, not a second implementation


def test_vanilla_is_the_baseline_with_the_same_seed():
    a, b = build("vanilla"), build("baseline")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    idx = tokens()
    assert torch.equal(a(idx), b(idx))


def test_variant_contradicting_the_arch_and_untileable_width_are_refused():
    with pytest.raises(ConfigError, match="contradicts"):
        build("hb", "model.momentum.variant=adam")
    with pytest.raises(ConfigError, match="must divide"):
        build("muon", "model.n_head=3", "model.head_dim=4")


def test_matrix_layout_follows_the_heads_of_each_layer():
    """muon/ortho attention substeps use the layer's head layout; MLP substeps and soap/shampoo use (n_head, d/H)."""
    alloc = ("model.heads=[2,4]", "model.head_dims=[8,4]")
    muon, soap = build("muon", *alloc), build("soap", *alloc)
    assert [b.attn_step.layout for b in muon.blocks] == [(2, 8), (4, 4)]
    assert [b.mlp_step.layout for b in muon.blocks] == [(2, 8), (2, 8)]
    assert {b.attn_step.layout for b in soap.blocks} | {b.mlp_step.layout for b in soap.blocks} == {(2, 8)}
    assert torch.isfinite(muon(tokens())).all() and torch.isfinite(soap(tokens())).all()


def test_stream_embeddings_exist_only_with_embed_init():
    for v in STREAM_VARIANTS:
        e = build(v, init="embed").num_params()["total"] - build(v, init="zero").num_params()["total"]
        n_embedded = {"hb": 1, "nesterov": 1, "tmm": 1, "adam": 1, "adamw": 1, "rmsprop": 0, "muon": 1, "ortho": 0,
                      "soap": 1, "shampoo": 0}[v]
        assert e == n_embedded * (V + T) * 16, v


# the reference's parameter count, written from METHODS §3 (not from the model code): the backbone (tied head,
# RMSNorm weights only, no biases), then per substep (2 per layer) its learned scalars and the d weights of its
# stream norm (LN_v or LN_u), then with stream_init=embed one token + position table per embedded stream: v
# (hb, nesterov, tmm) or m (adam, adamw, muon, soap). s starts at ones and R at I: no table in either mode.
REF_SCALARS = {"hb": 2, "nesterov": 3, "tmm": 4, "adam": 3, "adamw": 4, "rmsprop": 2, "muon": 2, "ortho": 1,
               "soap": 3, "shampoo": 2}  # beta, gamma | mu, beta, gamma | + nu | b1, b2, gamma | + lambda | ...
REF_TABLES = {"hb": 1, "nesterov": 1, "tmm": 1, "adam": 1, "adamw": 1, "rmsprop": 0, "muon": 1, "ortho": 0,
              "soap": 1, "shampoo": 0}


def reference_params(variant: str, *, d: int, n_layers: int, vocab: int, seq_len: int, mlp: str, pos: str,
                     init: str) -> int:
    hidden = 4 * d if mlp == "gelu" else 16 * round(8 * d / 3 / 16)  # swiglu: nearest multiple of 16 to 8d/3
    block = 4 * d * d + (2 if mlp == "gelu" else 3) * d * hidden + 2 * d  # Q, K, V, O; MLP; two norms
    backbone = vocab * d + (seq_len * d if pos == "learned" else 0) + n_layers * block + d  # + final norm
    if variant == "vanilla":
        return backbone
    tables = REF_TABLES[variant] * (vocab + seq_len) * d if init == "embed" else 0
    return backbone + 2 * n_layers * (REF_SCALARS[variant] + d) + tables


@pytest.mark.parametrize("init", ["embed", "zero"])
@pytest.mark.parametrize("backbone", [dict(d=32, n_layers=3, vocab=36, seq_len=16, mlp="gelu", pos="learned"),
                                      dict(d=16, n_layers=2, vocab=V, seq_len=T, mlp="swiglu", pos="rope")])
def test_parameter_counts_match_the_reference_formula(backbone, init):
    """Every variant's parameter count is the reference's closed form; with the reference backbone (GELU MLP,
    learned positions, d=32, 3 layers, vocab + seq_len = 52) adam has 40,626 parameters (42,290 while s had a
    table of its own)."""
    b = backbone
    for v in VARIANTS:
        cfg = resolve(arch=v, overrides=[f"model.d_model={b['d']}", "model.n_head=2", f"model.n_layer={b['n_layers']}",
                                         f"model.mlp={b['mlp']}", f"model.pos={b['pos']}",
                                         f"model.momentum.stream_init={init}"])
        model = build_model(replace(cfg.model, vocab_size=b["vocab"], max_seq_len=b["seq_len"]))
        assert model.num_params()["total"] == reference_params(v, **b, init=init), v
    if b["mlp"] == "gelu":
        assert reference_params("adam", **b, init="embed") == 40_626


# --------------------------------------------------------------------------------------------------------------
# causality, finiteness, training, round trip


@cache
def cached(arch: str, init: str):
    return build(arch, init=init).eval()


@pytest.mark.parametrize("arch", VARIANTS)
@settings(max_examples=4, deadline=None)
@given(pos=st.integers(0, T - 1), tok=st.integers(0, V - 1), init=st.sampled_from(["embed", "zero"]))
def test_causal(arch, pos, tok, init):
    model = cached(arch, init)
    idx = tokens(1)
    idx2 = idx.clone()
    idx2[:, pos] = (idx[:, pos] + 1 + tok % (V - 1)) % V  # a different token at pos
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    assert torch.allclose(a[:, :pos], b[:, :pos], rtol=0, atol=1e-12)
    assert (a[:, pos] - b[:, pos]).abs().max() > 1e-6  # the change is seen where it happens


@pytest.mark.parametrize("arch", STREAM_VARIANTS)
@pytest.mark.parametrize("init", ["embed", "zero"])
def test_finite_forward_backward(arch, init):
    model = build(arch, init=init, dtype=torch.float32)
    idx = tokens()
    loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    # every learned scalar takes part, except those multiplying v = 0 in the first substep of a zero-init stream
    idle = {"blocks.0.attn_step.raw.beta", "blocks.0.attn_step.raw.mu"} if init == "zero" and arch in (
        "hb", "nesterov", "tmm") else set()
    raw = {n: p.grad for n, p in model.named_parameters() if ".raw." in n}
    assert raw and all((g.abs() > 0) == (n not in idle) for n, g in raw.items())


@pytest.mark.parametrize("arch", STREAM_VARIANTS)
def test_adamw_steps_lower_the_loss_on_a_fixed_batch(arch):
    model = build(arch, dtype=torch.float32)
    idx = tokens(3, B=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = lm_loss(model(idx[:, :-1]), idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("arch", STREAM_VARIANTS)
@pytest.mark.parametrize("init", ["embed", "zero"])
def test_checkpoint_round_trip(arch, init, tmp_path):
    model = build(arch, init=init, dtype=torch.float32)
    with torch.no_grad():  # move the scalars off their init so the round trip is seen
        for n, p in model.named_parameters():
            if ".raw." in n:
                p.add_(0.3)
    save_checkpoint(Run(tmp_path), "final", model, step=7)
    ckpt = read_checkpoint(tmp_path / "checkpoints" / "final.safetensors")
    other = build(arch, init=init, seed=1, dtype=torch.float32)
    idx = tokens()
    assert not torch.equal(model(idx), other(idx))
    load_weights(other, ckpt)
    assert ckpt.step == 7 and torch.equal(model(idx), other(idx))
    assert other.stream_scalars() == model.stream_scalars()


# --------------------------------------------------------------------------------------------------------------
# equivalences between variants (float64, exact up to rounding)


def transplant(src, dst, **raw: float):
    """Copy src's weights into dst; set dst's extra raw scalars (absent in src) to the given values."""
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    assert not unexpected
    assert sorted({k.rsplit(".", 1)[1] for k in missing}) == sorted(raw)
    assert all(".raw." in k for k in missing)
    with torch.no_grad():
        for k in missing:
            dst.get_parameter(k).fill_(raw[k.rsplit(".", 1)[1]])


@pytest.mark.parametrize("init", ["embed", "zero"])
def test_tmm_with_nu_one_is_nesterov(init):
    nest, tmm = build("nesterov", init=init), build("tmm", init=init, seed=5)
    transplant(nest, tmm, nu=math.log(math.e - 1))
    assert all(abs(r["nu"] - 1) < 1e-15 for r in tmm.stream_scalars())
    idx = tokens()
    assert torch.allclose(tmm(idx), nest(idx), rtol=0, atol=1e-12)


@pytest.mark.parametrize("init", ["embed", "zero"])
def test_nesterov_with_mu_zero_is_heavy_ball(init):
    hb, nest = build("hb", init=init), build("nesterov", init=init, seed=5)
    transplant(hb, nest, mu=-math.inf)
    idx = tokens()
    assert torch.allclose(nest(idx), hb(idx), rtol=0, atol=1e-12)
    with torch.no_grad():  # and with mu > 0 they differ: the look-ahead is used
        for n, p in nest.named_parameters():
            if n.endswith(".raw.mu"):
                p.fill_(0.0)
    assert not torch.allclose(nest(idx), hb(idx), rtol=0, atol=1e-6)


@pytest.mark.parametrize("init", ["embed", "zero"])
def test_adamw_with_lambda_zero_is_adam(init):
    adam, adamw = build("adam", init=init), build("adamw", init=init, seed=5)
    transplant(adam, adamw, **{"lambda": -1e9})
    idx = tokens()
    assert torch.allclose(adamw(idx), adam(idx), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------------------------
# scalars and hook points


def test_stream_scalars_rows_and_hook_points_agree():
    for arch in STREAM_VARIANTS:
        model = build(arch)
        rows = model.stream_scalars()
        assert [(r["layer"], r["substep"]) for r in rows] == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
        names = SCALARS[arch]
        assert all(set(r) == {"layer", "substep", *names} for r in rows)
        init = {"mu": 0.5, "beta": 0.5, "beta1": 0.5, "beta2": 0.5, "gamma": math.log(2), "nu": 1.0,
                "lambda": 1 / (1 + math.exp(5))}
        assert all(abs(r[n] - init[n]) < 1e-6 for r in rows for n in names)
        with capture(model, ["blocks.*.attn_step.scalars", "blocks.*.mlp_step.scalars"]) as cache:
            model(tokens())
        for r in rows:
            got = cache[f"blocks.{r['layer']}.{r['substep']}_step.scalars"]
            assert got.shape == (len(names),)
            assert torch.allclose(got, torch.tensor([r[n] for n in names], dtype=got.dtype))


def test_standard_hook_points_and_both_attention_paths():
    model = build("tmm")
    idx = tokens()
    with capture(model, ["blocks.*.attn.pattern", "blocks.*.attn.v", "blocks.*.resid_post",
                         "blocks.*.attn_step.update"]) as cache:
        out = model(idx)
    pat = cache["blocks.1.attn.pattern"]
    assert pat.shape == (2, 2, T, T) and torch.allclose(pat.sum(-1), torch.ones(2, 2, T, dtype=pat.dtype))
    assert cache["blocks.0.attn.v"].shape == (2, 2, T, 8)
    assert cache["blocks.1.resid_post"].shape == (2, T, 16) and cache["blocks.0.attn_step.update"].shape == (2, T, 16)
    with attention_impl("explicit"):
        assert torch.allclose(model(idx), out, rtol=0, atol=1e-12)


def test_adam_step_matches_the_formula():
    """Layer 0's attention substep of adam recomputed by hand from the captured oracle output."""
    model = build("adam", init="zero")
    idx = tokens()
    blk = model.blocks[0]
    with capture(model, ["embed", "blocks.0.resid_mid"]) as cache:
        model(idx)
    x = cache["embed"]
    g = blk.attn(blk.ln1(x))
    k = blk.attn_step.values()
    m = (1 - k["beta1"]) * g
    s = k["beta2"] + (1 - k["beta2"]) * g**2
    want = x + k["gamma"] * blk.attn_step.ln_u(m / (s.sqrt() + 1e-8))
    assert torch.allclose(cache["blocks.0.resid_mid"], want.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("arch", ["hb", "tmm", "muon", "adamw", "rmsprop"])
def test_first_substep_with_embedded_streams_matches_the_formula(arch):
    """Layer 0's attention substep by hand, streams starting from their own token + position embeddings."""
    model = build(arch, init="embed")
    with torch.no_grad():  # scalars away from their init (nu = 1 there)
        for n, p in model.named_parameters():
            if ".raw." in n:
                p.add_(0.37)
    idx = tokens()
    blk, step = model.blocks[0], model.blocks[0].attn_step
    with capture(model, ["embed", "blocks.0.resid_mid"]) as cache:
        model(idx)
    x, k = cache["embed"], step.values()
    emb = {n: e.tok.weight[idx] + e.pos.weight[:T] for n, e in model.stream_emb.items()}  # (B, T, d)
    O = lambda h: blk.attn(blk.ln1(h))  # noqa: E731
    if arch in ("hb", "tmm"):
        probe = x + k["mu"] * emb["v"] if arch == "tmm" else x
        v = step.ln_v(k["beta"] * emb["v"] + k["gamma"] * O(probe))
        want = x + (k["nu"] if arch == "tmm" else 1) * v
    elif arch == "muon":
        m = k["beta"] * emb["m"] + (1 - k["beta"]) * O(x)
        want = x + k["gamma"] * step.ln_u(newton_schulz(m.view(2, T, 2, 8), 5).reshape(2, T, 16))
    else:
        g = O(x)
        s = k["beta2"] + (1 - k["beta2"]) * g**2  # s starts at ones, also with embedded streams
        m = g if arch == "rmsprop" else k["beta1"] * emb["m"] + (1 - k["beta1"]) * g
        decay = 1 - k["lambda"] if arch == "adamw" else 1
        want = decay * x + k["gamma"] * step.ln_u(m / (s.sqrt() + 1e-8))
    assert torch.allclose(cache["blocks.0.resid_mid"], want.detach(), rtol=0, atol=1e-12)


def test_shampoo_step_matches_eigendecomposition():
    """Layer 0's attention substep of shampoo: x + gamma LN_u(G R^{-1/2}) with R = b I + (1-b) G^T G, against
    eigh (enough Newton steps to converge)."""
    model = build("shampoo", "model.momentum.newton_steps=40")
    idx = tokens()
    blk = model.blocks[0]
    with capture(model, ["embed", "blocks.0.resid_mid"]) as cache:
        model(idx)
    x = cache["embed"]
    G = blk.attn(blk.ln1(x)).view(2, T, 2, 8).detach()
    b = blk.attn_step.values()["beta2"].detach()
    R = b * torch.eye(8, dtype=G.dtype) + (1 - b) * G.mT @ G + 1e-6 * torch.eye(8, dtype=G.dtype)
    e, Q = torch.linalg.eigh(R)
    U = G @ (Q @ torch.diag_embed(e.rsqrt()) @ Q.mT)
    gamma = blk.attn_step.values()["gamma"].detach()
    want = x + gamma * blk.attn_step.ln_u(U.reshape(2, T, 16)).detach()
    assert torch.allclose(cache["blocks.0.resid_mid"], want, rtol=0, atol=1e-9)


# --------------------------------------------------------------------------------------------------------------
# the pure math


def quintic(s: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFS
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
    return s


@pytest.mark.parametrize("shape", [(4, 32), (2, 8), (8, 16), (16, 4)])
def test_newton_schulz_maps_singular_values_by_the_quintic_and_keeps_singular_vectors(shape):
    Y = torch.randn(200, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(Y, 5)
    U, S, Vh = torch.linalg.svd(Y, full_matrices=False)
    s = S / (torch.linalg.matrix_norm(Y)[:, None] + 1e-7)  # after the Frobenius normalisation (+ eps)
    want = U @ torch.diag_embed(quintic(s, 5)) @ Vh
    assert torch.allclose(out, want, rtol=0, atol=1e-9)
    # METHODS' literal form Y <- Y(aI + bA + cA^2), A = Y^T Y, gives the same (the code uses the small Gram side)
    a, b, c = NS_COEFFS
    Z = Y / (torch.linalg.matrix_norm(Y, keepdim=True) + 1e-7)
    for _ in range(5):
        A = Z.mT @ Z
        Z = Z @ (a * torch.eye(shape[1], dtype=Z.dtype) + b * A + c * A @ A)
    assert torch.allclose(out, Z, rtol=0, atol=1e-12)


def test_newton_schulz_singular_values_lie_in_the_measured_band():
    """For a normalised singular value s in [0.05, 1], five quintic steps land in [0.6818, 1.1344] (the image of
    [0.05, 1] under the iterated quintic, computed below on a fine grid); random Gaussian (H, d_h) matrices with
    H <= d_h / 2 (the per-token views used here) have no normalised singular value below 0.05, so all of theirs
    land in the band. Square matrices can have tiny singular values, which five steps do not lift; over all of
    (0, 1] the iterated quintic peaks at 1.2024 (reached from s ~ 0.004)."""
    grid = quintic(torch.linspace(0.05, 1, 200001, dtype=torch.float64), 5)
    lo, hi = grid.min().item(), grid.max().item()
    assert 0.68 < lo < 0.69 and 1.13 < hi < 1.14
    for shape in [(4, 32), (2, 64), (8, 16), (32, 4)]:
        Y = torch.randn(500, *shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        S = torch.linalg.svdvals(newton_schulz(Y, 5))
        assert S.min() >= lo - 1e-9 and S.max() <= hi + 1e-9, shape
    assert abs(quintic(torch.tensor(1e-3, dtype=torch.float64), 5).item()) < 0.7  # tiny ones stay below the band


def random_spd(n: int, batch: int, shift: float, seed: int) -> torch.Tensor:
    A = torch.randn(batch, n, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    return A @ A.mT / n + shift * torch.eye(n, dtype=torch.float64)


def eig_inv_sqrt(R: torch.Tensor) -> torch.Tensor:
    e, Q = torch.linalg.eigh(R)
    return Q @ torch.diag_embed(e.rsqrt()) @ Q.mT


@pytest.mark.parametrize("n", [4, 8, 32])
def test_newton_inverse_square_root_matches_eigendecomposition(n):
    R = random_spd(n, 100, 0.05, n)  # condition numbers up to ~100
    ref = eig_inv_sqrt(R)
    rel = lambda X: (torch.linalg.matrix_norm(X - ref) / torch.linalg.matrix_norm(ref)).max().item()  # noqa: E731
    assert rel(inv_sqrt_newton(R, 30, eps=0.0)) < 1e-10
    assert rel(inv_sqrt_newton(R, 50, eps=0.0)) < 1e-10  # stays converged (the coupled form is stable)
    eye = torch.eye(n, dtype=torch.float64)
    ref_eps = eig_inv_sqrt(R + 1e-6 * eye)
    assert torch.allclose(inv_sqrt_newton(R, 30), ref_eps, rtol=1e-9, atol=0)  # the default eps is R + 1e-6 I
    # the default 10 steps: converged at these condition numbers (measured max rel. error 4e-11, 3e-10, 2e-7 for
    # n = 4, 8, 32), but not when cond(R) ~ 4e3 (measured 0.38 for n = 32); 30 steps then suffice
    assert rel(inv_sqrt_newton(R, 10, eps=0.0)) < 1e-6
    R_bad = random_spd(n, 100, 1e-3, n)
    e = torch.linalg.eigvalsh(R_bad)
    ref = eig_inv_sqrt(R_bad)
    if n == 32:
        assert (e[:, -1] / e[:, 0]).max() > 1e3 and rel(inv_sqrt_newton(R_bad, 10, eps=0.0)) > 1e-2
    assert rel(inv_sqrt_newton(R_bad, 30, eps=0.0)) < 1e-10


def test_newton_inverse_square_root_follows_the_methods_iteration():
    """The coupled iterates equal METHODS' X <- 1/2 X (3I - X R_hat X) before rounding errors grow; for an
    ill-conditioned R the literal form then diverges while the coupled one stays converged."""
    R = random_spd(8, 50, 0.01, 3)
    norm = torch.linalg.matrix_norm(R, keepdim=True)
    Rh, eye = R / norm, torch.eye(8, dtype=torch.float64)
    X = eye.expand_as(R)
    for k in range(1, 61):
        X = 0.5 * X @ (3 * eye - X @ Rh @ X)
        if k in (3, 10):
            assert torch.allclose(inv_sqrt_newton(R, k, eps=0.0), X / norm.sqrt(), rtol=1e-10, atol=0)
    ref = eig_inv_sqrt(R)
    assert not torch.allclose(X / norm.sqrt(), ref, rtol=1e-3)  # literal form after 60 steps: lost
    assert torch.allclose(inv_sqrt_newton(R, 60, eps=0.0), ref, rtol=1e-8, atol=0)


def test_newton_first_step_written_out_is_the_coupled_loop_bit_for_bit():
    """inv_sqrt_newton's first step skips Z Y and T Z (Z = I): values and gradients equal the plain coupled loop
    from Z = I exactly, in float32 and float64, for 0, 1, 2 and 10 steps."""

    def loop(R, steps):  # the coupled iteration, every step with its three matmuls
        eye = torch.eye(R.shape[-1], dtype=R.dtype)
        Re = R + 1e-6 * eye
        norm = torch.linalg.matrix_norm(Re, keepdim=True)
        Y, Z = Re / norm, eye.expand_as(Re)
        for _ in range(steps):
            T = 0.5 * (3.0 * eye - Z @ Y)
            Y, Z = Y @ T, T @ Z
        return Z / norm.sqrt()

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.float64):
        G = torch.randn(3, 5, 16, 8, dtype=dtype, generator=gen)
        R = (G.mT @ G).requires_grad_()
        for steps in (0, 1, 2, 10):
            a, b = loop(R, steps), inv_sqrt_newton(R, steps, eps=1e-6)
            assert torch.equal(a, b), (dtype, steps)
            g = torch.randn(a.shape, dtype=dtype, generator=gen)
            assert torch.equal(*(torch.autograd.grad(x, R, g)[0] for x in (a, b))), (dtype, steps)
    wrong = loop(R, 9)  # the check can fail: one step fewer differs
    assert not torch.equal(wrong, inv_sqrt_newton(R, 10, eps=1e-6))
