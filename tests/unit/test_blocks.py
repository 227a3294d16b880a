"""Parameter blocks (curvature.blocks) and the block-diagonal restriction of every operator: each block's λ_max and
trace equal the dense block's, for layers, tensor kinds and globs."""

from __future__ import annotations

import pytest
import torch

from cemtool.analysis.curvature.blocks import blocks_of, kind_of, layer_of
from cemtool.analysis.curvature.operators import make_operator
from cemtool.analysis.curvature.risk import select_parameters
from cemtool.analysis.sharpness import Options, SharpnessOptions, measure_per_layer, report_name
from cemtool.errors import CemtoolError

from kit import dense_curvature, tiny_model, tiny_tokens

V, T = 10, 6


@pytest.mark.parametrize("name, kind, layer", [
    ("blocks.0.attn.wq.weight", "q", 0), ("blocks.3.attn.wk.weight", "k", 3), ("blocks.1.attn.wv.weight", "v", 1),
    ("blocks.1.attn.wo.weight", "o", 1), ("blocks.0.mlp.up.weight", "mlp-in", 0),
    ("blocks.0.mlp.gate.weight", "mlp-in", 0), ("blocks.0.mlp.down.weight", "mlp-out", 0),
    ("blocks.2.ln1.weight", "norm", 2), ("ln_f.weight", "norm", None), ("tok_emb.weight", "embed", None),
    ("stream_emb.v.tok.weight", "embed", None), ("blocks.0.attn_step.raw.beta", "other", 0),
    ("blocks.0.eta_attn_raw", "other", 0), ("blocks.0.attn_step.ln_v.weight", "norm", 0),
    ("model.layers.4.self_attn.q_proj.weight", "q", 4), ("model.layers.4.self_attn.o_proj.weight", "o", 4),
    ("model.layers.4.mlp.gate_proj.weight", "mlp-in", 4), ("model.layers.4.mlp.down_proj.weight", "mlp-out", 4),
    ("model.layers.4.input_layernorm.weight", "norm", 4), ("transformer.h.2.attn.c_attn.weight", "qkv", 2),
    ("transformer.h.2.attn.c_proj.weight", "o", 2), ("transformer.h.2.mlp.c_proj.weight", "mlp-out", 2),
    ("transformer.wte.weight", "embed", None), ("lm_head.weight", "embed", None),
])
def test_kinds_and_layers_are_read_from_the_names(name, kind, layer):
    assert kind_of(name) == kind and layer_of(name) == layer


def dense(op) -> torch.Tensor:
    return torch.stack([op.matvec(e) for e in torch.eye(op.n, dtype=torch.float64)], dim=1)


@pytest.fixture(scope="module")
def problem():
    model = tiny_model("baseline", d_model=8, n_layer=2, n_head=2, mlp_hidden=8, vocab=V, seq_len=T)
    x, y = tiny_tokens(3, T, V, seed=4)
    return model, x, y


@pytest.mark.parametrize("operator, spec", [("hessian", "layer"), ("ggn", "kind"), ("hessian", "kind"),
                                            ("ef", "blocks.*.attn.w[qk].weight,tok_emb.weight")])
def test_each_block_equals_the_dense_block(problem, operator, spec):
    model, x, y = problem
    named = select_parameters(model, "all")
    A = dense_curvature(operator, model, x, y)  # the whole matrix, (n, n), built without cemtool's operators
    offsets, at = {}, 0
    for n, p in named:
        offsets[n] = (at, at + p.numel())
        at += p.numel()
    blocks = blocks_of(named, spec)
    opts = SharpnessOptions(dtype="fp64", operator=operator, lanczos_steps=120, tol=1e-10, trace_hvps=60,
                            trace_methods=("xtrace",))
    rows = measure_per_layer(model, x, y, opts, blocks=spec)
    assert [r.block for r in rows] == [b.label for b in blocks]
    for b, r in zip(blocks, rows, strict=True):
        idx = torch.cat([torch.arange(*offsets[n]) for n in b.names])
        sub = A[idx][:, idx]
        assert r.n_params == len(idx)
        assert r.lambda_max == pytest.approx(float(torch.linalg.eigvalsh(sub)[-1]), rel=1e-8, abs=1e-12)
        # the trace is an estimate (XTrace is not exact even at s = n): within 5 of its own standard errors
        assert abs(r.trace - float(torch.trace(sub))) <= 5 * r.trace_se + 1e-12, (b.label, r.trace, r.trace_se)
        if b.kind in ("q", "embed"):  # the restricted operator itself is the dense block, entry by entry
            with make_operator(operator, model, x, y, dtype="fp64", params=b.spec) as op:
                assert torch.allclose(dense(op), sub, rtol=1e-8, atol=1e-12 * float(sub.abs().max()))
    if spec == "kind":
        kinds = {(r.layer, r.kind) for r in rows}
        assert {(0, "q"), (1, "mlp-out"), (None, "embed"), (None, "norm"), (0, "norm")} <= kinds


def test_block_options_and_report_names():
    assert report_name(Options(blocks="kind")) == "sharpness-blocks-kind"
    assert report_name(Options(blocks="kind", operator="ggn")) == "sharpness-ggn-blocks-kind"
    assert report_name(Options(per_layer=True)) == "sharpness-per-layer" == report_name(Options(blocks="layer"))
    for bad in (dict(blocks="layer,kind"), dict(blocks=","), dict(blocks="kind", params="attn"),
                dict(blocks="kind", per_layer=True)):
        with pytest.raises(CemtoolError):
            Options(**bad)


def test_a_glob_that_matches_nothing_is_one_clear_error(problem):
    model, *_ = problem
    with pytest.raises(CemtoolError, match="matches no parameter"):
        blocks_of(select_parameters(model, "all"), "blocks.*.nothing")
