"""cemtool's Hessian, GGN and empirical-Fisher products against curvlinops' (an independent implementation, by
torch.func; a test extra, never a runtime dependency) on the same tiny models and tokens: 1e-6 relative in
float32, 1e-10 in float64 (issue 22, point 5). The models use GELU MLPs: curvlinops' Hessian product is forward over
reverse, and torch has no forward-mode derivative of silu_backward (SwiGLU models are checked against dense
matrices in test_hessian.py and test_operators.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from curvlinops import EFLinearOperator, GGNLinearOperator, HessianLinearOperator

from cemtool.analysis.curvature.operators import make_operator
from cemtool.models import attention_impl

from kit import tiny_model, tiny_tokens

V, T = 12, 6
THEIRS = {"hessian": HessianLinearOperator, "ggn": GGNLinearOperator, "ef": EFLinearOperator}
TOL = {torch.float32: 1e-6, torch.float64: 1e-10}


class Flat(torch.nn.Module):
    """The model with its logits flattened to (B*T, V)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs).flatten(0, 1)  # (B*T, V)


def curvlinops_products(name, model, x, y, vs: torch.Tensor) -> torch.Tensor:
    """curvlinops' operator ``name`` of the token-mean cross entropy (one batch: every token of x) times the
    columns of vs (n, k); the model's logits flattened to (tokens, V), so that CrossEntropyLoss(mean) is the
    token mean."""
    model_func = Flat(model)
    params = [p for p in model_func.parameters() if p.requires_grad]
    op = THEIRS[name](model_func, torch.nn.CrossEntropyLoss(reduction="mean"), params, [(x, y.reshape(-1))],
                      check_deterministic=False)
    out = []
    for v in vs.T:
        chunks = list(torch.split(v.to(params[0].dtype), [p.numel() for p in params]))
        res = op @ [c.view(p.shape) for c, p in zip(chunks, params, strict=True)]
        out.append(torch.cat([r.reshape(-1) for r in res]).double())
    return torch.stack(out, dim=1)  # (n, k)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("name", list(THEIRS))
@pytest.mark.parametrize("arch", ["baseline", "tmm"])
def test_products_equal_curvlinops(arch, name, dtype):
    model = tiny_model(arch, d_model=8, n_layer=1, n_head=2, mlp_hidden=8, mlp="gelu", vocab=V, seq_len=T,
                       dtype=dtype).eval()
    x, y = tiny_tokens(3, T, V, seed=2)
    theirs_model = copy.deepcopy(model)
    with make_operator(name, model, x, y, dtype="fp64" if dtype == torch.float64 else "fp32") as op:
        vs = torch.randn(op.n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))  # (n, 4)
        ours = torch.stack([op.matvec(v) for v in vs.T], dim=1)  # (n, 4)
    with attention_impl("explicit"):
        theirs = curvlinops_products(name, theirs_model, x, y, vs)
    err = float((ours - theirs).norm() / theirs.norm())
    assert err <= TOL[dtype], err


def test_the_comparison_can_fail():
    """A product of another operator (the GGN against curvlinops' Hessian) or of other tokens is far outside the
    tolerance: the comparison above has power."""
    model = tiny_model("baseline", d_model=8, n_layer=1, n_head=2, mlp_hidden=8, mlp="gelu", vocab=V, seq_len=T,
                       dtype=torch.float64).eval()
    x, y = tiny_tokens(3, T, V, seed=2)
    x2, y2 = tiny_tokens(3, T, V, seed=9)
    vs = torch.randn(sum(p.numel() for p in model.parameters()), 2, dtype=torch.float64,
                     generator=torch.Generator().manual_seed(3))
    with attention_impl("explicit"):
        hessian = curvlinops_products("hessian", copy.deepcopy(model), x, y, vs)
        other_tokens = curvlinops_products("ggn", copy.deepcopy(model), x2, y2, vs)
    with make_operator("ggn", model, x, y, dtype="fp64") as op:
        ggn = torch.stack([op.matvec(v) for v in vs.T], dim=1)
    assert float((ggn - hessian).norm() / hessian.norm()) > 1e-3
    assert float((ggn - other_tokens).norm() / other_tokens.norm()) > 1e-3
