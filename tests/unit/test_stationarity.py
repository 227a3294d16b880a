"""Where the model stands: the certificate's rule on hand-made numbers (every branch, and the thresholds'
sides), and on real tiny models: a 50-step model is not stationary; one trained by full-batch descent to ‖g‖ ≈ 0
is."""

from __future__ import annotations

import pytest
import torch

from cemtool.analysis.curvature.stationarity import certify, negative_mass
from cemtool.analysis.density import Density
from cemtool.analysis.sharpness import SharpnessOptions, measure_sharpness
from cemtool.models import lm_loss

from kit import tiny_model, tiny_tokens

V, T = 10, 6


def test_the_rule_on_hand_made_numbers():
    kw = dict(n=100, operator="hessian", psd=False, lambda_min_error=1e-6)
    # descent gap g^2 / (2 lambda_max): 0.1^2 / 2 = 5e-3 > 1e-3 -> not stationary; 0.04^2 / 2 = 8e-4 -> stationary
    assert certify(grad_norm=0.1, lambda_max=1.0, lambda_min=0.0, **kw).verdict == "not stationary"
    at = certify(grad_norm=0.04, lambda_max=1.0, lambda_min=0.0, **kw)
    assert at.verdict == "minimum" and at.descent_gap == pytest.approx(8e-4) and at.grad_norm_per_sqrt_n == 0.004
    assert certify(grad_norm=0.04, lambda_max=1.0, lambda_min=-0.5, **kw).verdict == "saddle"
    # negative curvature within max(error bound, neg_tol * lambda_max) is no negative curvature
    assert certify(grad_norm=0.04, lambda_max=1.0, lambda_min=-9e-4, **kw).verdict == "minimum"
    assert certify(grad_norm=0.04, lambda_max=1.0, lambda_min=-2e-3, **kw).verdict == "saddle"
    assert certify(grad_norm=0.04, lambda_max=1.0, lambda_min=-2e-3, **{**kw, "lambda_min_error": 3e-3}
                   ).verdict == "minimum"
    # a PSD operator cannot certify a minimum; no Lanczos, no verdict; lambda_max <= 0 is never stationary
    assert certify(grad_norm=0.04, lambda_max=1.0, lambda_min=0.0, **{**kw, "psd": True}).verdict == "stationary"
    assert certify(grad_norm=0.0, lambda_max=None, lambda_min=None, **kw).verdict == "unknown"
    assert certify(grad_norm=0.0, lambda_max=-1.0, lambda_min=-2.0, **kw).verdict == "not stationary"
    assert certify(grad_norm=0.1, lambda_max=1.0, lambda_min=0.0, gap_tol=1e-2, **kw).verdict == "minimum"


def test_negative_mass_is_the_weight_below_zero_with_a_standard_error_across_runs():
    d = Density([[-1.0, 2.0], [-1.0, 3.0]], [[0.25, 0.75], [0.5, 0.5]], [], [], 0.1, 2, 2, 4, 0.0, 0, 10)
    mass, se = negative_mass(d.nodes, d.weights)
    assert mass == pytest.approx(0.375) and se == pytest.approx(0.125)
    assert negative_mass([[-1.0, 2.0]], [[0.25, 0.75]]) == (0.25, None)


def _options(operator: str) -> SharpnessOptions:
    return SharpnessOptions(dtype="fp64", operator=operator, top_k=1, bottom_k=1, lanczos_steps=60, tol=1e-8,
                            trace_hvps=0, density_runs=1, density_steps=20, sam_rho=0, asam_rho=0, avg_rho=0,
                            landscape="none")


@pytest.fixture(scope="module")
def models():
    """A tiny model after 50 Adam steps, and one trained on the same 12 tokens by full-batch L-BFGS to ‖g‖ ≈ 0."""
    x, y = tiny_tokens(2, T, V, seed=3)
    early = tiny_model("baseline", d_model=8, n_layer=1, n_head=2, mlp_hidden=8, vocab=V, seq_len=T,
                       dtype=torch.float64)
    opt = torch.optim.Adam(early.parameters(), lr=3e-3)
    for _ in range(50):
        opt.zero_grad()
        lm_loss(early(x), y).backward()
        opt.step()
    done = tiny_model("baseline", d_model=8, n_layer=1, n_head=2, mlp_hidden=8, vocab=V, seq_len=T,
                      dtype=torch.float64)
    lbfgs = torch.optim.LBFGS(done.parameters(), lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=0,
                              history_size=50, line_search_fn="strong_wolfe")

    def closure():
        lbfgs.zero_grad()
        loss = lm_loss(done(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        lbfgs.step(closure)
    return x, y, early.eval(), done.eval()


@pytest.mark.parametrize("operator", ["hessian", "ggn"])
def test_a_50_step_model_is_not_stationary(models, operator):
    x, y, early, _ = models
    rep = measure_sharpness(early, x, y, _options(operator))
    st = rep.standing
    assert st.verdict == "not stationary" and st.descent_gap > st.gap_tol, st.reason
    assert st.descent_gap == pytest.approx(rep.grad_norm ** 2 / (2 * rep.eigen.lambda_max))


@pytest.mark.parametrize("operator", ["hessian", "ggn"])
def test_a_model_descended_to_zero_gradient_is_stationary(models, operator):
    x, y, _, done = models
    rep = measure_sharpness(done, x, y, _options(operator))
    st = rep.standing
    assert rep.grad_norm < 1e-4 and st.descent_gap <= st.gap_tol, st.reason
    assert st.verdict == ("stationary" if operator == "ggn" else "minimum"), st.reason
    assert rep.payload()["standing"]["verdict"] == st.verdict
