"""Curvature engine against dense Hessians of tiny models (torch.autograd.functional.hessian) and closed forms."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch.func import functional_call

from cemtool import memory
from cemtool.analysis.curvature.operators import FD_STEP, Hessian
from cemtool.analysis.curvature.protocol import DenseOperator
from cemtool.analysis.curvature.risk import select_parameters
from cemtool.analysis.density import slq, smooth_density
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.pyhessian_backend import run_pyhessian
from cemtool.analysis.trace import hutch_plus_plus, hutchinson, xtrace
from cemtool.errors import CemtoolError
from cemtool.models import attention_impl, lm_loss

from kit import tiny_model, tiny_tokens

V, T = 16, 8


def tiny(arch: str = "baseline", d: int = 16, n_layer: int = 1, **over) -> torch.nn.Module:
    return tiny_model(arch, d_model=d, n_layer=n_layer, mlp_hidden=16, **over, vocab=V, seq_len=T)


def tokens(n: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return tiny_tokens(n, T, V, seed)


def dense_hessian(model: torch.nn.Module, x, y, names: list[str]) -> torch.Tensor:
    """Exact Hessian of the mean token loss w.r.t. the named parameters, float64, by autograd.functional."""
    md = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    bufs = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in model.named_buffers()}
    work = __import__("copy").deepcopy(model).to(torch.float64).eval()
    sizes = [md[n].numel() for n in names]

    def f(w: torch.Tensor) -> torch.Tensor:
        ps = dict(md)
        for n, t in zip(names, torch.split(w, sizes), strict=True):
            ps[n] = t.view(md[n].shape)
        with attention_impl("explicit"):
            return lm_loss(functional_call(work, {**ps, **bufs}, (x,)), y)

    w0 = torch.cat([md[n].reshape(-1) for n in names])
    H = torch.autograd.functional.hessian(f, w0, vectorize=True)
    return (H + H.T) / 2


@pytest.fixture(scope="module")
def problem():
    """A 1-layer baseline (2,096 parameters), 32 tokens, its exact Hessian and spectrum."""
    model = tiny()
    x, y = tokens()
    names = [n for n, _ in model.named_parameters()]
    H = dense_hessian(model, x, y, names)
    return model, x, y, names, H, torch.linalg.eigvalsh(H)


# ------------------------------------------------------------------------------------------------------------------
# the HVP engine


def test_hvp_matches_dense_hessian_for_every_batching(problem):
    model, x, y, _, H, _ = problem
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = H @ v
    for bs, keep in ((None, "auto"), (1, True), (3, False), (2, "auto")):
        with Hessian(model, x, y, dtype="fp64", batch_size=bs, keep_graph=keep) as obj:
            hv = obj.hvp(v)
            assert obj.n == H.shape[0] and obj.tokens == 32
            assert float((hv - exact).norm() / exact.norm()) < 1e-10, (bs, keep)
            assert float((obj.hvp(v) - hv).norm()) < 1e-12 * float(hv.norm())  # reused graph = same result


def test_central_difference_hvp_matches_the_dense_hessian_in_fp64(problem):
    """--hvp fd: (grad L(w + h v) - grad L(w - h v)) / 2h against the dense Hessian; the weights come back bit for
    bit; fp32 is refused."""
    model, x, y, _, H, eig = problem
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for seed, scale in ((0, 1.0), (1, 1e-3), (2, 1e3)):  # the step is relative to |v|: any scale works
        v = scale * torch.randn(H.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        with Hessian(model, x, y, dtype="fp64", hvp="fd", batch_size=3) as obj:
            hv = obj.hvp(v)
            assert obj.hvps == 1 and obj.gradients == 0
        assert float((hv - H @ v).norm() / (H @ v).norm()) < 1e-8
    with Hessian(model, x, y, dtype="fp64", hvp="fd") as obj:
        assert float(obj.hvp(torch.zeros(H.shape[0], dtype=torch.float64)).abs().max()) == 0.0
        ev = lanczos(obj, 1, 0, max_steps=120, tol=1e-10)
    assert abs(ev.top[0] - float(eig[-1])) < 1e-7 * abs(float(eig[-1]))
    assert abs(ev.top[0] - float(eig[-1])) <= ev.top_residual[0]  # the bound holds: it carries the fd error level
    assert ev.rounding >= max(np.sqrt(obj.n), 10) * FD_STEP ** 2 * abs(ev.top[0])  # not float64's eps
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(CemtoolError, match="needs --dtype fp64"):
        Hessian(model, x, y, dtype="fp32", hvp="fd")
    with pytest.raises(CemtoolError, match="unknown HVP method"):
        Hessian(model, x, y, dtype="fp64", hvp="jvp")


def test_hvp_fp32_is_close_and_autocast_is_switched_off(problem):
    model, x, y, _, H, _ = problem
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16), Hessian(model, x, y, dtype="fp32") as obj:
        hv = obj.hvp(v)
        assert torch.is_autocast_enabled("cpu")  # restored around the call
    assert float((hv - H @ v).norm() / (H @ v).norm()) < 1e-5  # bf16 would be ~1e-2


def test_objective_leaves_the_model_as_it_was():
    model = tiny()
    x, y = tokens()
    model.train()
    model.blocks[0].ln1.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Hessian(model, x, y, dtype="fp32") as obj:  # fp32 model: works on the model itself
        assert obj.model is model and not model.training
        with obj.shifted(torch.ones(obj.n)):
            assert obj.loss() != pytest.approx(0.0)
        obj.hvp(torch.ones(obj.n))
    assert model.training and not model.blocks[0].ln1.weight.requires_grad
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with Hessian(model, x, y, dtype="fp64") as obj:  # fp64: a converted copy
        assert obj.model is not model
        obj.hvp(torch.ones(obj.n))
    assert next(model.parameters()).dtype == torch.float32 and model.training


def test_fused_attention_config_is_differentiated_through_the_explicit_path(problem):
    model, x, y, _, H, _ = problem
    assert model.cfg.attn_impl == "fused"  # the default: SDPA, which has no double backward
    with Hessian(model, x, y, dtype="fp64") as obj:
        v = torch.ones(obj.n, dtype=torch.float64)
        assert float((obj.hvp(v) - H @ v).norm()) < 1e-10 * float((H @ v).norm())


def test_unused_parameter_gets_zero_curvature():
    model = tiny()
    model.spare = torch.nn.Parameter(torch.ones(3))  # never used by forward
    x, y = tokens()
    with Hessian(model, x, y, dtype="fp64") as obj:
        assert "spare" in obj.names
        hv = obj.split(obj.hvp(torch.ones(obj.n)))
        assert torch.equal(hv[obj.names.index("spare")], torch.zeros(3, dtype=torch.float64))


# ------------------------------------------------------------------------------------------------------------------
# parameter subsets


def test_parameter_selection_names():
    model = tiny(n_layer=2)
    sel = lambda spec: [n for n, _ in select_parameters(model, spec)]  # noqa: E731
    assert sel("all") == [n for n, _ in model.named_parameters()]
    assert sel("layer:1") and all(n.startswith("blocks.1.") for n in sel("layer:1"))
    assert sel("attn") == [n for n, _ in model.named_parameters() if ".attn." in n]
    assert sel("mlp") == [n for n, _ in model.named_parameters() if ".mlp." in n]
    assert sel("blocks.*.mlp.up.weight") == ["blocks.0.mlp.up.weight", "blocks.1.mlp.up.weight"]
    assert set(sel("attn,mlp")) == set(sel("attn")) | set(sel("mlp"))
    for bad, msg in (("nothing*", "matches no parameter"), ("layer:7", "no layer 7"), ("layer:x", "layer:N")):
        with pytest.raises(CemtoolError, match=msg):
            select_parameters(model, bad)


@pytest.mark.parametrize("spec", ["layer:0", "attn", "mlp", "blocks.0.mlp.*"])
def test_restricted_hessian_equals_the_dense_sub_block(problem, spec):
    model, x, y, names, H, _ = problem
    sizes = [p.numel() for _, p in model.named_parameters()]
    offsets = dict(zip(names, np.cumsum([0] + sizes[:-1]), strict=True))
    with Hessian(model, x, y, params=spec, dtype="fp64") as obj:
        idx = torch.cat([torch.arange(offsets[n], offsets[n] + obj.sizes[i]) for i, n in enumerate(obj.names)])
        block = H[idx][:, idx]
        v = torch.randn(obj.n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        assert float((obj.hvp(v) - block @ v).norm()) < 1e-10 * float((block @ v).norm())
        e = lanczos(obj, 1, 1, max_steps=obj.n, tol=1e-10)
    ev = torch.linalg.eigvalsh(block)
    assert e.top[0] == pytest.approx(float(ev[-1]), rel=1e-6)
    assert e.bottom[0] == pytest.approx(float(ev[0]), rel=1e-6, abs=1e-8)


# ------------------------------------------------------------------------------------------------------------------
# Lanczos


def test_lanczos_top5_and_bottom_match_the_dense_spectrum(problem):
    model, x, y, _, H, ev = problem
    with Hessian(model, x, y, dtype="fp64") as obj:
        e = lanczos(obj, 5, 2, max_steps=300, tol=1e-9, seed=3)
    top, bottom = ev.flip(0)[:5].numpy(), ev[:2].numpy()
    assert e.converged and e.hvps == e.steps < 300
    np.testing.assert_allclose(e.top, top, rtol=1e-5)
    np.testing.assert_allclose(e.bottom, bottom, rtol=1e-5)
    for v, r in zip(e.top + e.bottom, e.top_residual + e.bottom_residual, strict=True):
        assert float((ev - v).abs().min()) <= r + 1e-10  # the residual is a rigorous bound


def test_fp32_residuals_and_errors_hold_in_the_working_precision(problem):
    model, x, y, _, _, ev = problem  # ev: the float64 spectrum
    with Hessian(model, x, y, dtype="fp32") as obj:
        e = lanczos(obj, 3, 1, max_steps=80, tol=1e-7, seed=0)
    assert e.rounding > 0
    for v, r, err in zip(e.top + e.bottom, e.top_residual + e.bottom_residual, e.top_error + e.bottom_error,
                         strict=True):
        actual = float((ev - v).abs().min())  # fp32 Ritz values are off by rounding, not by the 1e-20 recurrence
        assert actual <= r and actual <= err, (v, actual, r, err)


def test_lanczos_refuses_more_values_than_steps():
    op = DenseOperator(torch.diag(torch.linspace(-1, 1, 50, dtype=torch.float64)))
    with pytest.raises(CemtoolError, match="need at least 6 Lanczos steps"):
        lanczos(op, 5, 1, max_steps=4)  # the "top" would have included the bottom


def test_lanczos_is_seedable_and_reports_unconverged_values(problem):
    model, x, y, _, _, ev = problem
    with Hessian(model, x, y, dtype="fp64") as obj:
        a = lanczos(obj, 3, 1, max_steps=40, seed=5)
        b = lanczos(obj, 3, 1, max_steps=40, seed=5)
        c = lanczos(obj, 3, 1, max_steps=6, seed=5)
    assert a.top == b.top and a.bottom == b.bottom and a.steps == b.steps
    assert c.steps == 6 and not c.converged  # 6 steps cannot resolve this spectrum
    assert c.top[0] <= float(ev[-1]) + 1e-9  # Ritz values interlace: never beyond the true extremes


def test_lanczos_returns_the_algebraic_maximum_not_the_largest_magnitude():
    """Power iteration would return -10 here (largest magnitude); λ_max is 5."""
    q, _ = torch.linalg.qr(torch.randn(60, 60, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    lam = torch.cat([torch.tensor([-10.0, 5.0, 4.0]), torch.linspace(-1, 1, 57)]).double()
    op = DenseOperator(q @ torch.diag(lam) @ q.T)
    e = lanczos(op, 2, 1, max_steps=60, tol=1e-10, return_vectors=True)
    assert e.top == pytest.approx([5.0, 4.0], rel=1e-9) and e.bottom == pytest.approx([-10.0], rel=1e-9)
    y = e.vectors_top[:, 0]
    res = float((op.matrix @ y - e.top[0] * y).norm())  # the Ritz residual, as reported
    assert res == pytest.approx(e.top_residual[0], rel=1e-3, abs=1e-12) and res < 1e-5


def test_lanczos_survives_an_invariant_subspace():
    """A matrix with 3 distinct eigenvalues: the Krylov space closes after 3 steps and Lanczos restarts."""
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    lam = torch.tensor([3.0] * 10 + [1.0] * 10 + [-2.0] * 10, dtype=torch.float64)
    e = lanczos(DenseOperator(q @ torch.diag(lam) @ q.T), 2, 1, max_steps=30, tol=1e-10)
    assert e.top == pytest.approx([3.0, 3.0], abs=1e-9) and e.bottom == pytest.approx([-2.0], abs=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# trace


@pytest.mark.parametrize("method", [hutchinson, hutch_plus_plus, xtrace])
def test_trace_estimators_are_unbiased_with_honest_standard_errors(problem, method):
    H = problem[4][:800, :800]  # the Hessian w.r.t. the first 800 parameters (a principal sub-block)
    op, exact = DenseOperator(H), float(torch.trace(H))
    runs = [method(op, 60, seed=s) for s in range(30)]
    est = np.array([r.trace for r in runs])
    se_of_mean = est.std(ddof=1) / np.sqrt(len(est))
    assert abs(est.mean() - exact) <= 3.5 * se_of_mean  # unbiased
    ratio = np.mean([r.se for r in runs]) / est.std(ddof=1)  # reported SE matches the spread over seeds
    assert 0.5 < ratio < 2.0, ratio
    assert all(r.hvps == 60 and r.per_param == pytest.approx(r.trace / H.shape[0]) for r in runs)


def outliers_and_bulk(n: int, seed: int) -> torch.Tensor:
    """A dense symmetric matrix shaped like a trained model's Hessian: five outliers along dense directions over a
    sparse, nearly positive bulk with a few small negative eigenvalues."""
    g = torch.Generator().manual_seed(seed)
    U = torch.randn(n, 5, generator=g, dtype=torch.float64) / n**0.5  # (n, 5)
    top = U @ torch.diag(torch.tensor([40.0, 20, 10, 6, 3], dtype=torch.float64)) @ U.T
    B = torch.randn(n, n // 4, generator=g, dtype=torch.float64) * (torch.rand(n, n // 4, generator=g) < 0.05)
    return top + 0.075 * B @ B.T - 0.05 * torch.diag(torch.rand(n, generator=g, dtype=torch.float64))


def test_xtrace_standard_error_covers_the_error():
    # the authors' std(t_i)/sqrt(s) covered 82% at +-2 SE here (RMS error/SE 1.5); the jackknife SE covers >= 90%
    z = []
    for m in range(2):
        H = outliers_and_bulk(400, m)
        op, exact = DenseOperator(H), float(torch.trace(H))
        z += [(r.trace - exact) / r.se for r in (xtrace(op, 20, seed=s) for s in range(40))]
    z = np.abs(np.array(z))
    assert np.mean(z <= 2) >= 0.9, np.mean(z <= 2)
    assert np.sqrt(np.mean(z**2)) <= 1.2, np.sqrt(np.mean(z**2))


def test_trace_on_the_model_itself_matches_the_dense_trace(problem):
    model, x, y, _, _, ev = problem
    with Hessian(model, x, y, dtype="fp64") as obj:
        t = hutch_plus_plus(obj, 30, seed=0)
        assert obj.hvps == 30
    assert abs(t.trace - float(ev.sum())) <= 4 * t.se


def test_sketching_estimators_are_exact_on_low_rank_matrices():
    g = torch.Generator().manual_seed(2)
    B = torch.randn(80, 6, generator=g, dtype=torch.float64)
    A = B @ torch.diag(torch.tensor([5.0, 3, 2, -1, -2, 0.5], dtype=torch.float64)) @ B.T  # rank 6, indefinite
    exact = float(torch.trace(A))
    assert hutch_plus_plus(DenseOperator(A), 24).trace == pytest.approx(exact, rel=1e-9)  # sketch rank 8 >= 6
    assert xtrace(DenseOperator(A), 20).trace == pytest.approx(exact, rel=1e-9)


# ------------------------------------------------------------------------------------------------------------------
# spectral density


def test_slq_density_matches_the_exact_eigenvalue_histogram(problem):
    _, _, _, _, H, ev = problem
    d = slq(DenseOperator(H), runs=8, steps=60, seed=0)
    nodes, weights = np.concatenate(d.nodes), np.concatenate(d.weights) / d.runs
    assert weights.sum() == pytest.approx(1.0) and d.hvps == 8 * 60
    grid = np.linspace(float(ev[0]) - 1, float(ev[-1]) + 1, 4001)
    cdf_slq = np.array([weights[nodes <= g].sum() for g in grid])
    cdf_exact = np.searchsorted(np.sort(ev.numpy()), grid, side="right") / len(ev)
    spread = float(ev[-1] - ev[0])
    w1 = np.trapezoid(np.abs(cdf_slq - cdf_exact), grid)  # Wasserstein-1 distance of the spectral measures
    assert w1 < 0.01 * spread, w1 / spread
    exact_density = smooth_density(ev.numpy(), np.full(len(ev), 1 / len(ev)), np.asarray(d.grid), d.sigma)
    l1 = np.trapezoid(np.abs(np.asarray(d.density) - exact_density), d.grid)
    assert l1 < 0.2, l1  # same smoothing, close densities (total variation 0.1)
    assert np.trapezoid(d.density, d.grid) == pytest.approx(1.0, abs=1e-3)
    assert not hasattr(d, "trace")  # one SLQ probe is no trace estimate (11-33% off): use xtrace


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("nan")])
def test_slq_refuses_a_non_positive_sigma(sigma):
    with pytest.raises(CemtoolError, match="sigma must be a positive number"):
        slq(DenseOperator(torch.eye(4, dtype=torch.float64)), runs=1, steps=2, sigma=sigma)


def test_slq_continues_the_eigenvalue_run(problem):
    _, _, _, _, H, _ = problem
    op = DenseOperator(H)
    e = lanczos(op, 2, 1, max_steps=40, seed=1)
    taken = e.steps
    d = slq(op, runs=2, steps=50, reuse=[e.state], seed=2)
    assert d.hvps == (50 - taken) + 50 and len(d.nodes[0]) == 50


# ------------------------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_one_clear_error(problem, monkeypatch):
    model, x, y, _, _, _ = problem
    with pytest.raises(CemtoolError, match="zero tokens"):
        Hessian(model, x[:0], y[:0])
    with pytest.raises(CemtoolError, match="matches no parameter"):
        Hessian(model, x, y, params="nope.*")
    monkeypatch.setattr(memory, "available_memory", lambda device: 10_000)
    with pytest.raises(CemtoolError, match="too large.*fp64") as err:
        Hessian(model, x, y, dtype="fp64")
    assert "--dtype fp32" in err.value.hint


def test_memory_check_honours_a_cgroup_limit(problem, monkeypatch):
    """The curvature check uses the one available_memory (cemtool.memory), which caps the host's free memory by a
    container's cgroup limit: a limit below the estimate refuses, with the limit as the memory available."""
    model, x, y, _, _, _ = problem
    monkeypatch.setattr(memory, "_cgroup_free", lambda: 4096)
    assert memory.available_memory(torch.device("cpu")) == 4096
    with pytest.raises(CemtoolError, match="too large.*0.00 GiB available"):
        Hessian(model, x, y, dtype="fp64")
    monkeypatch.setattr(memory, "_cgroup_free", lambda: None)  # no limit: the host's free memory, ample here
    Hessian(model, x, y, dtype="fp64").close()


# ------------------------------------------------------------------------------------------------------------------
# every family


# (every family's Hessian against its dense matrix: tests/unit/test_operators.py, with the other operators)


# ------------------------------------------------------------------------------------------------------------------
# PyHessian backend


def test_run_pyhessian_without_pyhessian_names_the_extra(problem, monkeypatch):
    """PyHessian is optional: without it run_pyhessian raises the CemtoolError naming the extra. The cross-check
    against PyHessian itself is benchmarks/pyhessian_crosscheck.py (it needs the extra)."""
    model, x, y, *_ = problem
    monkeypatch.setitem(sys.modules, "pyhessian", None)  # what an environment without PyHessian imports
    with pytest.raises(CemtoolError) as e:
        run_pyhessian(model, x, y, dtype="fp64", top_k=1)
    assert str(e.value) == '--backend pyhessian needs PyHessian: pip install "cemtool[pyhessian]"'
