"""The GGN, empirical Fisher and Monte-Carlo Fisher operators against dense matrices built independently
(torch.func Jacobians of the logits and of the per-token losses), their PSD-ness, and the Monte-Carlo Fisher's
expectation (the GGN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cemtool.analysis.curvature.operators import GGN, EmpiricalFisher, Hessian, MCFisher, make_operator
from cemtool.analysis.curvature.protocol import DenseOperator, as_operator
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.trace import xtrace
from cemtool.errors import CemtoolError

from kit import dense_curvature, dense_jacobian, own_options, tiny_model, tiny_tokens

V, T = 12, 6


def setup(arch: str = "baseline"):
    model = tiny_model(arch, d_model=8, n_layer=1, n_head=2, mlp_hidden=8, vocab=V, seq_len=T)
    x, y = tiny_tokens(3, T, V, seed=2)
    return model, x, y


def dense(op) -> torch.Tensor:
    return torch.stack([op.matvec(e) for e in torch.eye(op.n, dtype=torch.float64)], dim=1)  # (n, n)


def probed(op, A: torch.Tensor, k: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(op V, A V) for k Gaussian vectors V (n, k): equal to 1e-8 relative exactly when op is A to that level, up
    to an event of probability 0 (‖(op - A) V‖_F ~ sqrt(k) ‖op - A‖_F), at k products instead of the n of dense."""
    V = torch.randn(op.n, k, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))  # (n, k)
    return torch.stack([op.matvec(v) for v in V.T], dim=1), A @ V  # (n, k) each


def assert_probes_equal(op, A: torch.Tensor) -> None:
    got, want = probed(op, A)
    assert float((got - want).norm()) <= 1e-8 * float(want.norm()), float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def problem():
    model, x, y = setup()
    logits, J = dense_jacobian(model, x, lambda z: z)  # (B, T, V), (B, T, V, n)
    N = y.numel()
    p = torch.softmax(logits, -1)  # (B, T, V)
    H = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]  # (B, T, V, V)
    G = torch.einsum("btvi,btvw,btwj->ij", J, H, J) / N
    losses, Jl = dense_jacobian(model, x, lambda z: F.cross_entropy(z.flatten(0, 1), y.reshape(-1), reduction="none"))
    E = Jl.T @ Jl / N
    return model, x, y, G, E


def test_ggn_equals_the_dense_gauss_newton_and_is_psd(problem):
    model, x, y, G, _ = problem
    with GGN(model, x, y, dtype="fp64") as op:
        A = dense(op)
    assert torch.allclose(A, G, rtol=1e-8, atol=1e-12 * float(G.abs().max()))
    ev = torch.linalg.eigvalsh((A + A.T) / 2)
    assert float(ev.min()) >= -1e-10 * float(ev.max())


def test_ggn_is_not_the_hessian(problem):
    """The check can fail: the Hessian of the same model and tokens is another matrix (and indefinite)."""
    model, x, y, G, _ = problem
    with Hessian(model, x, y, dtype="fp64") as op:
        Hm = dense(op)
    assert float((Hm - G).abs().max()) > 1e-3 * float(G.abs().max())
    assert float(torch.linalg.eigvalsh((Hm + Hm.T) / 2).min()) < 0


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_empirical_fisher_equals_per_token_gradient_outer_products(problem, batch_size):
    model, x, y, _, E = problem
    with EmpiricalFisher(model, x, y, dtype="fp64", batch_size=batch_size) as op:
        assert_probes_equal(op, E)
        if batch_size == 3:  # once entry by entry (one batch: the fastest)
            assert torch.allclose(dense(op), E, rtol=1e-8, atol=1e-12 * float(E.abs().max()))


def test_the_probe_check_fails_on_one_wrong_entry(problem):
    """The Gaussian-probe comparison has power: the empirical Fisher with one symmetric pair of entries changed by
    1e-6 of its largest entry is refused."""
    model, x, y, _, E = problem
    wrong = E.clone()
    i, j = 3, 7
    wrong[i, j] += 1e-6 * float(E.abs().max())
    wrong[j, i] = wrong[i, j]
    with EmpiricalFisher(model, x, y, dtype="fp64") as op:
        assert_probes_equal(op, E)
        with pytest.raises(AssertionError):
            assert_probes_equal(op, wrong)


def test_mc_fisher_equals_the_outer_products_at_its_own_labels(problem):
    model, x, y, _, _ = problem
    with MCFisher(model, x, y, dtype="fp64", mc_samples=3, seed=5, batch_size=2) as op:
        labels = torch.cat(op.labels)  # (B, T, S)
        assert labels.shape == (*y.shape, 3) and int(labels.max()) < V
        _, Jl = dense_jacobian(model, x, lambda z: -torch.log_softmax(z, -1).gather(-1, labels))  # (B, T, S, n)
        Jl = Jl.reshape(-1, Jl.shape[-1])
        assert_probes_equal(op, Jl.T @ Jl / (y.numel() * 3))


def test_mc_fisher_is_seeded_and_its_mean_is_the_ggn(problem):
    model, x, y, G, _ = problem
    kw = dict(dtype="fp64", mc_samples=1)
    with MCFisher(model, x, y, seed=1, **kw) as a, MCFisher(model, x, y, seed=1, batch_size=1, **kw) as b, \
            MCFisher(model, x, y, seed=2, **kw) as c:
        assert all(torch.equal(u, v) for u, v in zip(a.labels, [torch.cat(b.labels)], strict=True))
        assert not torch.equal(torch.cat(a.labels), torch.cat(c.labels))
    # tr(F_s) over 200 independent draws: their mean equals tr(G) within 4 standard errors
    traces = []
    for s in range(200):
        with MCFisher(model, x, y, seed=100 + s, **kw) as op:
            traces.append(_trace_at_labels(model, x, torch.cat(op.labels)))
    t = torch.tensor(traces)
    se = float(t.std() / len(t) ** 0.5)
    assert abs(float(t.mean()) - float(torch.trace(G))) < 4 * se
    assert se < 0.2 * float(torch.trace(G))  # the test has power: a factor 1.8 error in tr(F) would fail it


def _trace_at_labels(model, x, labels) -> float:
    _, Jl = dense_jacobian(model, x, lambda z: -torch.log_softmax(z, -1).gather(-1, labels))
    return float((Jl ** 2).sum()) / (labels.shape[0] * labels.shape[1] * labels.shape[2])


@pytest.mark.parametrize("name", ["hessian", "ggn", "ef", "fisher"])
@pytest.mark.parametrize("arch", ["baseline", "cem", "tmm", "lime"])
def test_every_operator_of_four_families_against_its_dense_matrix(arch, name):
    """Each operator's products with 8 Gaussian vectors equal the dense matrix's, built independently, to 1e-8
    relative (:func:`probed`; the fixture's tests compare whole matrices); Lanczos on the operator finds the dense
    top-3 and bottom eigenvalues to 1e-8 of the spectrum's scale; the GGN and the Fishers are PSD (>= -1e-10
    λ_max), the Hessian is not."""
    model = tiny_model(arch, d_model=8, n_layer=1, n_head=1, mlp_hidden=8, vocab=8, seq_len=4)
    x, y = tiny_tokens(2, 4, 8, seed=2)
    with make_operator(name, model, x, y, dtype="fp64", **own_options(name, mc_samples=2, seed=4)) as op:
        A = dense_curvature(name, model, x, y, labels=torch.cat(op.labels) if name == "fisher" else None)
        assert A.shape == (op.n, op.n) and op.n <= 3000
        assert_probes_equal(op, A)
        eig = lanczos(op, 3, 1, max_steps=min(op.n, 160), tol=1e-10)
    ev = torch.linalg.eigvalsh(A)
    scale = float(ev.abs().max())
    assert eig.top == pytest.approx(ev.flip(0)[:3].tolist(), rel=1e-8, abs=1e-12 * scale)
    assert eig.bottom[0] == pytest.approx(float(ev[0]), abs=1e-8 * scale)
    if name != "hessian":
        assert float(ev[0]) >= -1e-10 * scale
    else:
        assert float(ev[0]) < -1e-6 * scale  # indefinite at initialisation: the PSD check above has power


def test_a_dense_tensor_is_an_operator():
    A = torch.randn(30, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    A = A + A.T
    ev = torch.linalg.eigvalsh(A)
    assert lanczos(A, 2, 1, max_steps=30, tol=1e-10).top == pytest.approx(ev.flip(0)[:2].tolist(), rel=1e-9)
    assert xtrace(A, 60).trace  # 2n products: exact == pytest.approx(float(torch.trace(A)), rel=1e-9)
    assert isinstance(as_operator(A), DenseOperator) and as_operator(A).size == 30


def test_bad_operator_requests_are_one_clear_error(problem):
    model, x, y, _, _ = problem
    with pytest.raises(CemtoolError, match="unknown curvature operator"):
        make_operator("gauss", model, x, y)
    with pytest.raises(CemtoolError, match="--hvp fd sets a Hessian product method; the ggn operator does not"):
        make_operator("ggn", model, x, y, dtype="fp64", hvp="fd")
    with pytest.raises(CemtoolError, match="mc_samples"):
        make_operator("fisher", model, x, y, mc_samples=0)
    with pytest.raises(CemtoolError, match="--mc-samples 3 sets the Monte-Carlo Fisher's label draws"):
        make_operator("hessian", model, x, y, dtype="fp64", mc_samples=3)
    # another operator's resource hints are not a request: dropped (the Hessian's graph budget, the Fisher's seed)
    with make_operator("ggn", model, x, y, dtype="fp64", keep_graph=False, graph_budget=0, seed=5) as op:
        assert op.psd and not hasattr(op, "keep_graph")
    with make_operator("hessian", model, x, y, dtype="fp64", mc_samples=1, seed=5) as op:
        assert not op.psd and op.hvp_method == "exact"
