"""CEM family (METHODS §2): causality, training, checkpoints, and the energy/gradient identities."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cemtool.checkpoints import load_weights, read_checkpoint, save_checkpoint
from cemtool.models import build_model, capture
from cemtool.models.cem import CEMMLP, CEMAttention, CEMBlock, Preconditioner, antiderivative
from cemtool.models.layers import attention_impl, mlp_hidden
from cemtool.models.lm import lm_loss
from cemtool.runs import Run

from kit import tiny_config, tiny_model

PRESETS = ["cem", "cem-dplr", "cem-precond", "cem-rec2", "cem-full", "cem-untied", "cem-selfgate"]
V, S = 40, 12


def perturb(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Move the parameters that start at special values (delta = 0, P ~ I, eta = step_init) somewhere generic,
    so that every path of the layer matters in the test."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("delta", ".U", ".p", "_raw")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype) + (0.5 if name.endswith("_raw")
                                                                                   else 0.0))
    return model


_MODELS: dict[str, torch.nn.Module] = {}


def generic_model(arch: str, dtype=torch.float64) -> torch.nn.Module:
    key = f"{arch}:{dtype}"
    if key not in _MODELS:
        _MODELS[key] = perturb(tiny_model(arch, seed=0)).to(dtype).eval()
    return _MODELS[key]


# --------------------------------------------------------------------------------------------------------------
# whole models, every preset


@pytest.mark.parametrize("arch", PRESETS)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_causal(arch, data):
    model = generic_model(arch)
    idx = torch.tensor([data.draw(st.lists(st.integers(0, V - 1), min_size=S, max_size=S))])
    t = data.draw(st.integers(0, S - 1))
    new = data.draw(st.integers(0, V - 1))
    idx2 = idx.clone()
    idx2[0, t] = new
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    assert torch.equal(a[:, :t], b[:, :t]) or torch.allclose(a[:, :t], b[:, :t], atol=1e-12, rtol=0)
    if new != idx[0, t]:
        assert not torch.allclose(a[:, t:], b[:, t:])  # the change does reach position t


@pytest.mark.parametrize("arch", PRESETS)
def test_finite_and_learns(arch):
    torch.manual_seed(0)
    model = build_model(tiny_config(arch))
    x = torch.randint(0, V, (4, S + 1), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(V), abs=0.3)
    assert losses[-1] < 0.6 * losses[0]


@pytest.mark.parametrize("arch", PRESETS)
def test_save_load_roundtrip(arch, tmp_path):
    model = generic_model(arch, torch.float32)
    save_checkpoint(Run(tmp_path), "final", model, step=3)
    torch.manual_seed(123)
    fresh = build_model(tiny_config(arch)).eval()
    load_weights(fresh, read_checkpoint(tmp_path / "checkpoints" / "final.safetensors"))
    idx = torch.randint(0, V, (2, S))
    with torch.no_grad():
        assert torch.equal(model(idx), fresh(idx))


@pytest.mark.parametrize("arch", ["cem", "cem-full", "cem-dplr"])
def test_fused_and_explicit_models_agree(arch):
    model = generic_model(arch)
    idx = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), attention_impl("fused"):
        a = model(idx)
    with torch.no_grad(), attention_impl("explicit"):
        b = model(idx)
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


@pytest.mark.parametrize("arch", ["cem-rec2", "cem-untied"])
def test_capture_points(arch):
    model = generic_model(arch)
    idx = torch.randint(0, V, (2, S))
    with capture(model, ["blocks.*.attn.v", "blocks.*.attn.pattern", "blocks.*.resid_post",
                         "blocks.*.resid_mid"]) as cache:
        logits = model(idx)
    steps = model.cfg.cem.steps
    for i in range(2):
        assert cache[f"blocks.{i}.attn.v"].shape == (2, 2, S, 8)
        assert len(cache.all(f"blocks.{i}.attn.pattern")) == steps  # one pattern per recursion step
        assert len(cache.all(f"blocks.{i}.resid_mid")) == steps
        pat = cache[f"blocks.{i}.attn.pattern"]
        assert pat.shape == (2, 2, S, S)
        torch.testing.assert_close(pat.sum(-1), torch.ones(2, 2, S, dtype=pat.dtype))
        assert (pat.triu(1) == 0).all()
        assert cache[f"blocks.{i}.resid_post"].shape == (2, S, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), logits)  # capture does not change the output


def test_block_runs_the_documented_steps():
    """forward = T steps of y += eta_t P u(LN(y)) for attention then MLP, c = LN_c(x) fixed."""
    model = generic_model("cem-full")
    block = model.blocks[0]
    x = torch.randn(2, S, 16, dtype=torch.float64)
    c = block.ln_c(x)
    eta = block.step_sizes()
    y = x
    Pa, Pm = block.precond_attn.matrix(), block.precond_mlp.matrix()  # (d, d)
    with torch.no_grad():
        for t in range(2):
            y = y + eta["attn"][t] * block.attn.update(block.ln_attn(y), c) @ Pa.T  # (B, T, d)
            y = y + eta["mlp"][t] * block.mlp.update(block.ln_mlp(y), c) @ Pm.T
        torch.testing.assert_close(block(x), y, atol=1e-12, rtol=0)


def test_step_sizes_and_preconditioner_init():
    torch.manual_seed(0)
    model = build_model(tiny_config("cem-full", "model.cem.step_init=0.25"))
    for block in model.blocks:
        for eta in block.step_sizes().values():
            torch.testing.assert_close(eta, torch.full((2,), 0.25))
        P = block.precond_attn.matrix()
        torch.testing.assert_close(torch.diagonal(P) - (block.precond_attn.U ** 2).sum(1), torch.ones(16))
        assert torch.linalg.eigvalsh(P).min() >= 1 - 1e-6
        assert (block.attn.delta == 0).all()


# --------------------------------------------------------------------------------------------------------------
# attention: the update is exactly -dE/dg


def make_attention(dplr: bool, pos: str, impl: str = "explicit", seed: int = 0) -> CEMAttention:
    torch.manual_seed(seed)
    attn = CEMAttention(12, 3, 4, pos=pos, max_len=16, rope_base=10.0, impl=impl, dplr=dplr).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.5)
    return attn


def rotation(attn: CEMAttention, i: int) -> torch.Tensor:
    """R_i (d_h x d_h) written out from the RoPE tables: pairs (k, k + d_h/2) rotate by angle i * f_k."""
    dh, half = attn.head_dim, attn.head_dim // 2
    R = torch.eye(dh, dtype=torch.float64)
    if attn.rotary is None:
        return R
    cos, sin = attn.rotary.cos[i].double(), attn.rotary.sin[i].double()
    for k in range(half):
        R[k, k], R[k, k + half], R[k + half, k], R[k + half, k + half] = cos[k], -sin[k], sin[k], cos[k]
    return R


def dense_energy(attn: CEMAttention, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """METHODS §2 literally: E_i = -sum_h (1/beta) log sum_{j<=i} exp(beta g_i^T A_h^{ij} c_j),
    A_h^{ij} = W_Q^hT R_i^T R_j W_K^h (+ diag(delta_h))."""
    B, T, d = g.shape
    beta = 1 / math.sqrt(attn.head_dim)
    E = torch.zeros(B, T, dtype=g.dtype)
    for h in range(attn.n_head):
        Wq = attn.wq.weight[h * attn.head_dim:(h + 1) * attn.head_dim]  # (d_h, d)
        Wk = attn.wk.weight[h * attn.head_dim:(h + 1) * attn.head_dim]
        for i in range(T):
            s = []
            for j in range(i + 1):
                A = Wq.T @ rotation(attn, i).T @ rotation(attn, j) @ Wk  # (d, d)
                if attn.delta is not None:
                    A = A + torch.diag(attn.delta[h])
                s.append(beta * torch.einsum("bd,de,be->b", g[:, i], A, c[:, j]))
            E[:, i] = E[:, i] - torch.logsumexp(torch.stack(s, -1), -1) / beta
    return E


def test_rope_tables_match_the_formula():
    attn = make_attention(False, "rope")
    f = 10.0 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)
    ang = torch.arange(16, dtype=torch.float64)[:, None] * f
    torch.testing.assert_close(attn.rotary.cos.double(), ang.cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(attn.rotary.sin.double(), ang.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dplr", [False, True])
@pytest.mark.parametrize("pos", ["rope", "learned"])
def test_attention_update_is_minus_energy_gradient(dplr, pos):
    attn = make_attention(dplr, pos)
    g = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 7, 12, dtype=torch.float64)
    E = attn.energy(g, c)  # (B, T)
    torch.testing.assert_close(E, dense_energy(attn, g, c), atol=1e-10, rtol=0)
    (grad,) = torch.autograd.grad(E.sum(), g)
    for impl in ("explicit", "fused"):
        attn.impl = impl
        torch.testing.assert_close(attn.update(g, c), -grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dplr", [False, True])
def test_attention_update_jacobian_is_symmetric(dplr):
    attn = make_attention(dplr, "rope")
    c = torch.randn(1, 5, 12, dtype=torch.float64)
    g = torch.randn(1, 5, 12, dtype=torch.float64)

    def last(gi):  # the update at the last position as a function of g there
        return attn.update(torch.cat([g[:, :-1], gi[None, None]], 1), c)[0, -1]

    J = torch.autograd.functional.jacobian(last, g[0, -1])  # (d, d)
    torch.testing.assert_close(J, J.T, atol=1e-10, rtol=0)


def test_dplr_changes_scores_and_update():
    attn = make_attention(True, "rope")
    g, c = torch.randn(2, 6, 12, dtype=torch.float64), torch.randn(2, 6, 12, dtype=torch.float64)
    u = attn.update(g, c)
    with torch.no_grad():
        attn.delta.zero_()
    assert not torch.allclose(attn.update(g, c), u)


# --------------------------------------------------------------------------------------------------------------
# MLP: the update is -dE/dg for closed-form Phi, and a gradient field for SiLU


@pytest.mark.parametrize("act,Phi", [(torch.tanh, lambda z: torch.log(torch.cosh(z))),
                                     (lambda z: z, lambda z: z ** 2 / 2)])
@pytest.mark.parametrize("gated", [True, False])
def test_mlp_update_is_minus_energy_gradient_closed_form(act, Phi, gated):
    torch.manual_seed(0)
    mlp = CEMMLP(10, 24, gated=gated, act=act).double()
    g = torch.randn(2, 5, 10, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 5, 10, dtype=torch.float64)
    E = mlp.energy(g, c, Phi=Phi)
    (grad,) = torch.autograd.grad(E.sum(), g)
    torch.testing.assert_close(mlp.update(g, c), -grad, atol=1e-10, rtol=0)


def test_quadrature_antiderivative():
    z = torch.linspace(-6, 6, 41, dtype=torch.float64)
    torch.testing.assert_close(antiderivative(torch.tanh, z), torch.log(torch.cosh(z)), atol=1e-12, rtol=0)
    # SiLU: Phi(z) = z softplus(z) - int_0^z softplus; check Phi' = silu by finite differences
    h = 1e-5
    fd = (antiderivative(torch.nn.functional.silu, z + h) - antiderivative(torch.nn.functional.silu, z - h)) / (2 * h)
    torch.testing.assert_close(fd, torch.nn.functional.silu(z), atol=1e-8, rtol=0)


@pytest.mark.parametrize("gated", [True, False])
def test_silu_mlp_default_energy_gradient(gated):
    torch.manual_seed(0)
    mlp = CEMMLP(10, 24, gated=gated).double()  # SiLU (gated) / GELU (ungated), Phi by quadrature
    g = torch.randn(2, 5, 10, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 5, 10, dtype=torch.float64)
    (grad,) = torch.autograd.grad(mlp.energy(g, c).sum(), g)
    torch.testing.assert_close(mlp.update(g, c), -grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("from_context", [True, False])
def test_silu_mlp_jacobian_symmetric_iff_gate_from_context(from_context):
    torch.manual_seed(0)
    mlp = CEMMLP(8, 16, gate_from_context=from_context).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    c = torch.randn(1, 1, 8, dtype=torch.float64)
    g = torch.randn(8, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: mlp.update(v[None, None], c)[0, 0], g)  # (d, d)
    asym = (J - J.T).abs().max().item()
    if from_context:
        assert asym < 1e-12
    else:
        assert asym > 1e-3  # gate from g: not a gradient field


# --------------------------------------------------------------------------------------------------------------
# a small preconditioned step lowers the energy


@pytest.mark.parametrize("which", ["attn", "mlp"])
def test_preconditioned_step_lowers_energy(which):
    torch.manual_seed(0)
    P = Preconditioner(12, 3).double()
    with torch.no_grad():
        P.p.normal_(0.0, 1.0)
        P.U.normal_(0.0, 1.0)
    M = P.matrix()
    assert torch.linalg.eigvalsh(M).min() > 0
    if which == "attn":
        mod = make_attention(True, "rope")
    else:
        mod = CEMMLP(12, 20).double()
        with torch.no_grad():
            for p in mod.parameters():
                p.normal_(0.0, 0.5)
    g = torch.randn(2, 6, 12, dtype=torch.float64, requires_grad=True)
    c = torch.randn(2, 6, 12, dtype=torch.float64)
    E0 = mod.energy(g, c)
    (grad,) = torch.autograd.grad(E0.sum(), g)
    step = P(grad)  # (B, T, d) = P dE/dg
    torch.testing.assert_close(step, grad @ M.T)
    for eps in (1e-2, 1e-3, 1e-4):
        with torch.no_grad():
            E1 = mod.energy(g - eps * step, c)
        assert (E1 < E0).all()  # every position's energy drops (each E_i depends on g_i only)
        predicted = -eps * (grad * step).sum(-1)  # first order: -eps <grad, P grad>
        torch.testing.assert_close(E1 - E0, predicted, rtol=50 * eps, atol=0)


# --------------------------------------------------------------------------------------------------------------
# parameter counts


def sublayer_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def test_tied_attention_has_half_the_parameters():
    extra = ("model.d_model=24", "model.n_head=3", "model.head_dim=6")  # H d_h != d on purpose
    d, H, dh = 24, 3, 6
    base = build_model(tiny_config("baseline", *extra))
    cem = build_model(tiny_config("cem", *extra))
    dplr = build_model(tiny_config("cem-dplr", *extra))
    untied = build_model(tiny_config("cem-untied", *extra))
    assert sublayer_params(base.blocks[0].attn) == 4 * d * H * dh
    assert sublayer_params(cem.blocks[0].attn) == 2 * d * H * dh
    assert sublayer_params(dplr.blocks[0].attn) == 2 * d * H * dh + H * d
    assert sublayer_params(untied.blocks[0].attn) == 4 * d * H * dh
    m = mlp_hidden(d, "swiglu", 0)
    assert sublayer_params(base.blocks[0].mlp) == 3 * m * d
    assert sublayer_params(cem.blocks[0].mlp) == 2 * m * d
    assert sublayer_params(untied.blocks[0].mlp) == 3 * m * d


@pytest.mark.parametrize("arch", PRESETS + ["cem-gelu-learned"])
def test_model_parameter_count_formula(arch):
    extra = ["model.d_model=24", "model.n_head=3", "model.head_dim=6", "model.n_layer=3"]
    if arch == "cem-gelu-learned":
        arch, extra = "cem-full", extra + ["model.mlp=gelu", "model.pos=learned", "model.norm=layernorm"]
    cfg = tiny_config(arch, *extra)
    d, H, dh, L, c = 24, 3, 6, 3, cfg.cem
    m = mlp_hidden(d, cfg.mlp, 0)
    norm = d if cfg.norm == "rmsnorm" else 2 * d
    attn = (2 if c.tie_attention else 4) * d * H * dh + (H * d if c.dplr and c.tie_attention else 0)
    n_mlp_mats = 2 if cfg.mlp == "swiglu" else 1
    mlp = (n_mlp_mats if c.tie_mlp else n_mlp_mats + 1) * m * d
    precond = 2 * (d + d * c.precond_rank) if c.precond_rank else 0
    block = 3 * norm + attn + mlp + precond + 2 * c.steps
    pos = S * d if cfg.pos == "learned" else 0
    expected = V * d + pos + L * block + norm
    assert build_model(cfg).num_params()["total"] == expected


def test_block_type():
    assert isinstance(build_model(tiny_config("cem")).blocks[0], CEMBlock)
