"""Sharpness measures and loss slices against closed forms (quadratics) and dense Hessians of a tiny model."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from torch.func import functional_call

from cemtool.analysis.curvature.operators import Hessian
from cemtool.analysis.sharpness import (
    TRACE_METHODS,
    SharpnessOptions,
    asam_sharpness,
    average_sharpness,
    filter_normalized_direction,
    loss_slice_1d,
    loss_slice_2d,
    measure_sharpness,
    sam_sharpness,
)
from cemtool.errors import CemtoolError
from cemtool.models import attention_impl, lm_loss

from kit import tiny_model, tiny_tokens

V, T = 16, 8


def tiny() -> torch.nn.Module:
    return tiny_model("baseline", n_layer=1, mlp_hidden=16, vocab=V, seq_len=T)


def tokens(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return tiny_tokens(n, T, V, seed=1)


def dense_hessian(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Exact Hessian of the mean token loss w.r.t. all parameters, float64 (torch.autograd.functional)."""
    work = copy.deepcopy(model).to(torch.float64).eval()
    md = {k: v.detach() for k, v in work.named_parameters()}
    names, sizes = list(md), [v.numel() for v in md.values()]

    def f(w: torch.Tensor) -> torch.Tensor:
        ps = {n: t.view(md[n].shape) for n, t in zip(names, torch.split(w, sizes), strict=True)}
        with attention_impl("explicit"):
            return lm_loss(functional_call(work, ps, (x,)), y)

    H = torch.autograd.functional.hessian(f, torch.cat([v.reshape(-1) for v in md.values()]), vectorize=True)
    return (H + H.T) / 2


class Quadratic:
    """L(w) = 1/2 w^T A w + b^T w: the duck-typed objective interface the sharpness functions use."""

    def __init__(self, A: torch.Tensor, b: torch.Tensor, w: torch.Tensor):
        self.A, self.b, self.w = A, b, w.clone()
        self.n, self.tokens, self.device = len(w), 1, w.device
        self.evaluations = self.gradients = 0

    def loss(self) -> float:
        self.evaluations += 1
        return float(0.5 * self.w @ self.A @ self.w + self.b @ self.w)

    def gradient(self) -> tuple[float, torch.Tensor]:
        self.gradients += 1
        return float(0.5 * self.w @ self.A @ self.w + self.b @ self.w), self.A @ self.w + self.b

    def parameters_vector(self) -> torch.Tensor:
        return self.w.clone()

    @contextmanager
    def shifted(self, delta: torch.Tensor):
        saved = self.w.clone()
        self.w = self.w + delta
        try:
            yield
        finally:
            self.w = saved


def trust_region_max(A: torch.Tensor, g: torch.Tensor, rho: float) -> float:
    """max_{||e|| <= rho} g^T e + 1/2 e^T A e (A with a positive eigenvalue: the maximum is on the sphere)."""
    lam, U = torch.linalg.eigh(A)
    c = U.T @ g
    lo, hi = float(lam[-1]) + 1e-12, float(lam[-1]) + float(g.norm()) / rho + 1.0
    for _ in range(200):  # ||(mu - lam)^-1 c|| = rho, decreasing in mu
        mu = (lo + hi) / 2
        lo, hi = (mu, hi) if float((c / (mu - lam)).norm()) > rho else (lo, mu)
    e = U @ (c / (mu - lam))
    return float(g @ e + 0.5 * e @ A @ e)


@pytest.fixture(scope="module")
def quad():
    g = torch.Generator().manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(40, 40, generator=g, dtype=torch.float64))
    lam = torch.cat([torch.tensor([8.0, 3.0]), torch.linspace(-1, 1, 38)]).double()
    A = Q @ torch.diag(lam) @ Q.T
    b = 0.05 * torch.randn(40, generator=g, dtype=torch.float64)
    return A, b, torch.randn(40, generator=g, dtype=torch.float64)


@pytest.fixture(scope="module")
def model_problem():
    model = tiny()
    x, y = tokens()
    return model, x, y, dense_hessian(model, x, y)


# ------------------------------------------------------------------------------------------------------------------
# closed forms on a quadratic


def test_first_order_sam_and_asam_on_a_quadratic(quad):
    A, b, w = quad
    q = Quadratic(A, b, w)
    g = A @ w + b
    rho = 0.1
    e = rho * g / g.norm()
    s = sam_sharpness(q, rho)
    assert s.value == pytest.approx(float(g @ e + 0.5 * e @ A @ e), rel=1e-12)
    T = w.abs() + 0.01
    e = rho * T**2 * g / (T * g).norm()
    a = asam_sharpness(q, rho, eta=0.01)
    assert a.value == pytest.approx(float(g @ e + 0.5 * e @ A @ e), rel=1e-12)
    assert float((e / T).norm()) == pytest.approx(rho)  # on the adaptive sphere
    assert torch.equal(q.w, w)  # restored


def test_ascent_steps_approach_the_true_worst_case(quad):
    """Small gradient, large radius: the worst case lies along the top eigenvector, not along g."""
    A, b, _ = quad
    w = torch.zeros(40, dtype=torch.float64)
    q = Quadratic(A, b, w)
    rho = 1.0
    best = trust_region_max(A, b, rho)
    first = sam_sharpness(q, rho, 1).value
    many = sam_sharpness(q, rho, 30)
    assert first < 0.5 * best  # first order misses it badly
    assert many.value <= best + 1e-9 and many.value >= 0.97 * best
    assert many.first_order == pytest.approx(first) and many.gradients == 29 + 1


def test_average_case_sharpness_is_unbiased_on_a_quadratic(quad):
    A, b, w = quad
    rho = 0.2
    exact = 0.5 * rho**2 * float((w**2 * torch.diagonal(A)).sum())  # E[1/2 d^T A d], d = rho |w| z
    runs = [average_sharpness(Quadratic(A, b, w), rho, 20, seed=s) for s in range(20)]
    est = np.array([r.value for r in runs])
    assert abs(est.mean() - exact) < 3.5 * est.std(ddof=1) / np.sqrt(len(est))
    assert 0.5 < np.mean([r.se for r in runs]) / est.std(ddof=1) < 2.0


# ------------------------------------------------------------------------------------------------------------------
# on a model, against its dense Hessian


def test_sharpness_on_a_model_matches_second_order_taylor(model_problem):
    model, x, y, H = model_problem
    rho = 1e-3
    with Hessian(model, x, y, dtype="fp64") as obj:
        loss0, g = obj.gradient()
        w = obj.parameters_vector()
        s = sam_sharpness(obj, rho)
        u = g / g.norm()
        taylor = rho * float(g.norm()) + 0.5 * rho**2 * float(u @ H @ u)
        assert s.value == pytest.approx(taylor, rel=1e-3)
        assert s.loss == pytest.approx(loss0) and s.tokens == 32
        avg = average_sharpness(obj, 1e-2, 16, seed=0, loss0=loss0)
        exact = 0.5 * 1e-4 * float((w**2 * torch.diagonal(H)).sum())
        assert abs(avg.value - exact) < 4 * avg.se and avg.evaluations == 32
        assert torch.equal(obj.parameters_vector(), w)


def test_filter_normalised_directions(model_problem):
    model, x, y, _ = model_problem
    with Hessian(model, x, y, dtype="fp64") as obj:
        d = obj.split(filter_normalized_direction(obj, torch.Generator().manual_seed(0)))
        for p, di in zip(obj.params, d, strict=True):
            if p.dim() < 2:
                assert torch.equal(di, torch.zeros_like(di))
            else:
                np.testing.assert_allclose(di.reshape(p.shape[0], -1).norm(dim=1),
                                           p.detach().reshape(p.shape[0], -1).norm(dim=1), rtol=1e-10)
    with Hessian(model, x, y, params="*ln*", dtype="fp64") as obj, pytest.raises(CemtoolError, match="1-D"):
        filter_normalized_direction(obj, torch.Generator())


def test_loss_slices_are_the_loss_along_the_directions(model_problem):
    model, x, y, H = model_problem
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Hessian(model, x, y, dtype="fp64") as obj:
        loss0 = obj.loss()
        sl = loss_slice_1d(obj, span=1e-3, points=3, seed=4)
        d = filter_normalized_direction(obj, torch.Generator().manual_seed(4))  # the slice's direction
        assert sl.losses[1] == loss0 and sl.alphas == [-1e-3, 0.0, 1e-3]
        curvature = (sl.losses[0] + sl.losses[2] - 2 * loss0) / 1e-6  # second difference = d^T H d
        assert curvature == pytest.approx(float(d @ H @ d), rel=1e-3)
        big = loss_slice_1d(obj, span=1.0, points=5, seed=4)
        with obj.shifted(0.5 * d):
            assert big.losses[3] == pytest.approx(obj.loss(), rel=1e-12)
        sq = loss_slice_2d(obj, span=0.5, points=3, seed=1)
        assert len(sq.losses) == 3 and all(len(r) == 3 for r in sq.losses)
        assert sq.losses[1][1] == loss0 and sq.evaluations == 9
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bad_radii_and_steps(quad):
    q = Quadratic(*quad)
    with pytest.raises(CemtoolError, match="positive"):
        sam_sharpness(q, 0.0)
    with pytest.raises(CemtoolError, match="ascent_steps"):
        sam_sharpness(q, 0.1, 0)
    with pytest.raises(CemtoolError, match="unknown trace method"):
        SharpnessOptions(trace_methods=("magic",))


# ------------------------------------------------------------------------------------------------------------------
# everything at once


def test_measure_sharpness_reports_every_estimate_with_its_cost(model_problem):
    model, x, y, H = model_problem
    ev = torch.linalg.eigvalsh(H)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opts = SharpnessOptions(dtype="fp64", top_k=2, bottom_k=1, lanczos_steps=60, tol=1e-6,
                            trace_methods=("hutchinson", "hutch++", "xtrace"), trace_hvps=12, density_runs=2,
                            density_steps=20, avg_samples=2, landscape="both", slice_points=3, slice_points_2d=3)
    seen: dict[str, int] = {}
    rep = measure_sharpness(model, x, y, opts, progress=lambda stage, done, total: seen.__setitem__(stage, total))
    assert rep.tokens == 32 and rep.n_params == len(ev)
    assert rep.eigen.top[0] == pytest.approx(float(ev[-1]), rel=1e-5)
    new_density = rep.density.hvps
    assert rep.hvps == rep.eigen.hvps + 3 * 12 + new_density and new_density == 20  # first run reused the eigen run
    payload = rep.payload()
    json.dumps(payload)  # JSON-able (no tensors, no Lanczos state)
    rows = rep.rows()
    kinds = {r["quantity"] for r in rows}
    assert {"lambda_top", "lambda_bottom", "trace_xtrace", "trace_hutch++", "trace_hutchinson", "sharpness_sam",
            "sharpness_asam", "sharpness_average", "density_sigma"} <= kinds
    assert "trace_slq" not in kinds  # one SLQ probe is not a trace estimate
    assert all(r["tokens"] == 32 and "seed" in r for r in rows)
    assert all(r["uncertainty"] is not None for r in rows if r["quantity"].startswith(("trace", "lambda")))
    assert "eigenvalues (Lanczos)" in seen and "2-D loss slice" in seen
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_progress_completes_when_lanczos_stops_early(model_problem):
    model, x, y, _ = model_problem
    opts = SharpnessOptions(dtype="fp64", top_k=1, bottom_k=1, lanczos_steps=60, tol=1e-2, trace_hvps=9,
                            density_runs=0, avg_samples=2, landscape="none")
    last: dict[str, tuple[int, int]] = {}
    rep = measure_sharpness(model, x, y, opts, progress=lambda stage, done, total: last.__setitem__(stage,
                                                                                                   (done, total)))
    assert rep.eigen.steps < 60  # converged early
    assert last["eigenvalues (Lanczos)"] == (rep.eigen.steps, rep.eigen.steps)  # the bar completes where it stopped
    assert last["trace (xtrace)"] == (8, 8)  # XTrace uses an even number of HVPs
    assert all(done == total for done, total in last.values()), last


@pytest.mark.parametrize("bad, message", [
    (dict(density_sigma=-1.0), "density_sigma must be a positive number"),
    (dict(density_sigma=0.0), "density_sigma must be a positive number"),
    (dict(sam_rho=float("nan")), "sam_rho must be a finite number"),
    (dict(tol=float("inf")), "tol must be a finite number"),
    (dict(top_k=30, lanczos_steps=20), "need at least 31 Lanczos steps"),
    (dict(trace_hvps=3), "xtrace needs at least 4 HVPs"),  # refused before a model is opened, not after training
    (dict(trace_hvps=1, trace_methods=("hutchinson",)), "hutchinson needs at least 2 HVPs"),
    (dict(avg_samples=1), "needs at least 2 antithetic pairs"),  # once skipped without a word (a sweep's -A)
])
def test_options_refuse_what_cannot_be_measured(bad, message):
    with pytest.raises(CemtoolError, match=message):
        SharpnessOptions(**bad)


def test_the_options_trace_minimum_is_the_estimators_own():
    """Each budget the options accept runs in its estimator, and one HVP fewer is refused by both."""
    from cemtool.analysis.trace import MIN_HVPS
    H = torch.diag(torch.arange(1.0, 9.0, dtype=torch.float64))  # (8, 8)
    for method, need in MIN_HVPS.items():
        SharpnessOptions(trace_methods=(method,), trace_hvps=need)
        assert TRACE_METHODS[method](H, need).hvps <= need
        with pytest.raises(CemtoolError, match="at least"):
            SharpnessOptions(trace_methods=(method,), trace_hvps=need - 1)
        with pytest.raises(CemtoolError, match="at least"):
            TRACE_METHODS[method](H, need - 1)


def test_tokens_requested_and_used_are_both_reported(model_problem):
    model, x, y, _ = model_problem
    opts = SharpnessOptions(top_k=1, bottom_k=0, lanczos_steps=3, trace_hvps=0, density_runs=0, sam_rho=0,
                            asam_rho=0, avg_rho=0, landscape="none")
    rep = measure_sharpness(model, x, y, opts, tokens_requested=10_000)
    assert rep.tokens == 32 and rep.tokens_requested == 10_000
    assert rep.notes == ["32 evaluation tokens used of 10,000 requested: the validation split holds only 4 windows "
                         "of 8 tokens"]
    assert rep.payload()["tokens_requested"] == 10_000 and rep.payload()["notes"] == rep.notes
    assert measure_sharpness(model, x, y, opts, tokens_requested=32).notes == []


def test_reports_are_strict_json(tmp_path):
    from cemtool.writes import atomic_write_json

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    payload = {"trace_se": float("nan"), "inf": float("-inf"), "np": np.float32("nan"), "arr": np.array([1.0, np.inf]),
               "t": torch.tensor([float("nan"), 2.0]), "t0": torch.tensor(3.5), "ok": [1, 2.5, None, True, "x"],
               "nested": ({"a": np.float64("inf")},), "i": np.int64(7), "b": np.bool_(True)}
    atomic_write_json(tmp_path / "r.json", payload)
    back = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert back == {"trace_se": None, "inf": None, "np": None, "arr": [1.0, None], "t": [None, 2.0], "t0": 3.5,
                    "ok": [1, 2.5, None, True, "x"], "nested": [{"a": None}], "i": 7, "b": True}
