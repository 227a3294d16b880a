"""sharpness per layer (measure_per_layer): λ_max and tr(H) of each layer's Hessian block against the dense block
of a tiny model; the budgets and skips. The command itself is tested in tests/cli/test_sharpness_layers.py."""

from __future__ import annotations

import pytest
import torch
from test_hessian import dense_hessian, tiny, tokens

from cemtool.analysis.sharpness import SharpnessOptions, measure_per_layer, model_layers


def test_per_layer_matches_the_dense_hessian_block_of_each_layer():
    model = tiny(d=8, n_layer=2)
    x, y = tokens()
    opts = SharpnessOptions(dtype="fp64", lanczos_steps=80, tol=1e-10, trace_hvps=60, seed=0)
    layers = measure_per_layer(model, x, y, opts)
    assert [r.layer for r in layers] == model_layers(model) == [0, 1]
    exact = []
    for r in layers:
        names = [n for n, _ in model.named_parameters() if n.startswith(f"blocks.{r.layer}.")]
        H = dense_hessian(model, x, y, names)  # the block H_SS of the full Hessian
        assert r.n_params == H.shape[0]
        ev = torch.linalg.eigvalsh(H)
        assert r.lambda_max == pytest.approx(float(ev[-1]), rel=1e-6)
        assert r.lambda_max_converged is True and r.lambda_max_error < 1e-6 * abs(r.lambda_max)
        tr = float(torch.trace(H))
        assert abs(r.trace - tr) <= 4 * r.trace_se + 1e-8 * abs(tr), (r.trace, r.trace_se, tr)
        assert r.trace_per_param == pytest.approx(r.trace / r.n_params)
        exact.append(float(ev[-1]))
    assert exact[0] != pytest.approx(exact[1], rel=1e-3)  # the layers' blocks differ: each row is its own layer


def test_per_layer_budgets_and_skips():
    model = tiny(d=8, n_layer=2)
    x, y = tokens()
    only_eig = measure_per_layer(model, x, y, SharpnessOptions(dtype="fp64", lanczos_steps=10, trace_hvps=0))
    assert all(r.trace is None and r.trace_hvps == 0 and r.lanczos_hvps <= 10 for r in only_eig)
    only_tr = measure_per_layer(model, x, y, SharpnessOptions(dtype="fp64", lanczos_steps=0, top_k=0, bottom_k=0,
                                                              trace_hvps=8, trace_methods=("hutchinson",)))
    assert all(r.lambda_max is None and r.trace_hvps == 8 and r.trace_method == "hutchinson" for r in only_tr)
    w = model.blocks[0].attn.wq.weight.detach().clone()
    measure_per_layer(model, x, y, SharpnessOptions(dtype="fp32", lanczos_steps=4, top_k=1, bottom_k=0,
                                                    trace_hvps=4))
    assert torch.equal(model.blocks[0].attn.wq.weight, w) and model.blocks[0].attn.wq.weight.requires_grad
