"""`cemtool sharpness --dtype fp64` on the tier-b families beyond Llama (cemtool.subject.hf family adapters) against
ground truth: tiny random-weight transformers models (no download), whose top-3 and bottom Hessian eigenvalues in
the report equal those of a dense float64 Hessian of the same loss, within the error bound the report itself states
(``eigen.top_error``: min(r, r^2/gap), never below the rounding term of the precision the forward computes in).

The dense Hessian is taken by autograd through transformers' own model (from_pretrained in float64, no cemtool code
in the loss but the cross-entropy), on the evaluation windows the command reads. transformers computes rotary,
softmax and norms partly in float32 inside a float64 model; the report says so (``computed_in``) and its bound uses
float32's rounding (test_hf.py: test_fp64_bounds_use_the_precision_the_forward_computes_in)."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
import transformers
from test_hf import WORDS, dense_hessian, invoke, save_tiny, word_text  # noqa: F401  (word_text: a fixture)

from cemtool.data.tokenizer import word_tokenizer
from cemtool.models.lm import lm_loss
from cemtool.subject import open_subject
from cemtool.subject.hf.catalog import family_adapters

IDS = dict(vocab_size=len(WORDS), bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=16,
           tie_word_embeddings=True)
ATTN = dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=2,
            intermediate_size=4)  # 2 query heads of 2 dimensions sharing one key-value head
FAMILIES = {  # model type -> its tiny sizes (what the block has that Llama's does not)
    "mixtral": dict(ATTN, num_local_experts=3, num_experts_per_tok=2),  # MoE: 3 experts, top-2 renormalised
    "qwen2_moe": dict(ATTN, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=4,
                      shared_expert_intermediate_size=4),  # MoE: top-1 of 2 experts plus a gated shared expert
    "qwen3_moe": dict(ATTN, num_experts=3, num_experts_per_tok=2, moe_intermediate_size=4),  # MoE, per-head q/k norm
    "qwen3": dict(ATTN),  # per-head q/k RMSNorm before RoPE
    "gemma2": dict(ATTN, query_pre_attn_scalar=2),  # sandwich norms, (1 + w) RMSNorm, attention and logit soft-caps
    "olmo2": dict(ATTN),  # post-norms only, q/k RMSNorm over all heads
    "cohere": dict(ATTN),  # parallel residual, bias-free LayerNorm, interleaved rotary, logit scale
    "phi": dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, intermediate_size=4,
                partial_rotary_factor=0.5),  # parallel residual, partial rotary, biases
    "gptj": dict(n_embd=4, n_layer=1, n_head=2, rotary_dim=2, n_inner=4, n_positions=16),  # parallel, interleaved
    "phi3": dict(ATTN),  # fused qkv_proj and gate_up_proj
    "stablelm": dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=4, partial_rotary_factor=0.5),  # LayerNorm, partial rotary
    "gpt_bigcode": dict(n_embd=4, n_layer=1, n_head=2, n_inner=4, n_positions=16, multi_query=True),  # MQA, learned
    "gemma3_text": dict(ATTN, query_pre_attn_scalar=2, sliding_window=4),  # sandwich, q/k norms, a binding window
    "smollm3": dict(ATTN, num_hidden_layers=2, no_rope_layer_interval=2),  # a RoPE layer and a NoPE layer
    "falcon": dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, ffn_hidden_size=4),  # parallel, MQA
    "bloom": dict(hidden_size=4, n_layer=1, n_head=2),  # ALiBi, residual added inside the sublayers
    "opt": dict(hidden_size=4, num_hidden_layers=1, num_attention_heads=2, ffn_dim=4, word_embed_proj_dim=4),
}
TOKENS = 32  # 2 windows of 16 tokens
MAX_PARAMS = 1500  # the dense Hessian by autograd stays a fraction of a second
SLACK = 1e-12  # float64 rounding of the comparison itself, relative to the spectral scale


class Logits(torch.nn.Module):
    """transformers' own forward, as logits (what dense_hessian differentiates)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=x, use_cache=False).logits


def measure(root, text: str, model_type: str) -> dict:
    """Save a tiny model of the family, run `cemtool sharpness` on it in fp64 and load transformers' own float64
    model from the same directory with the windows the command evaluated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = transformers.AutoConfig.for_model(model_type, **IDS, **FAMILIES[model_type])
    d = save_tiny(root / model_type, cfg, word_tokenizer(WORDS))
    x, y = open_subject(d, data=text).eval_set(TOKENS)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    n = sum(p.numel() for p in hf.parameters())
    assert n <= MAX_PARAMS, n
    res = invoke("sharpness", d, "--data", text, "--tokens", TOKENS, "--dtype", "fp64", "--top-k", 3, "--bottom-k", 1,
                 "--lanczos-steps", n, "--tol", 1e-10, "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0,
                 "--asam-rho", 0, "--avg-rho", 0, "--landscape", "none", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads((root / model_type / "reports" / "sharpness.json").read_text())
    return dict(rep=rep, hf=hf, x=x, y=y, n=n)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, word_text):  # noqa: F811  (the fixture imported above)
    """model type -> measure(...), each family measured once per module (the control reuses it)."""
    root, done = tmp_path_factory.mktemp("hf-dense"), {}

    def get(model_type: str) -> dict:
        if model_type not in done:
            done[model_type] = measure(root, word_text, model_type)
        return done[model_type]

    return get


def eigenvalues(hf: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> np.ndarray:
    """Every eigenvalue (ascending) of the dense float64 Hessian of the mean token loss of ``hf`` on (x, y)."""
    return torch.linalg.eigvalsh(dense_hessian(Logits(hf), x, y)).numpy()


def test_the_families_are_tier_b_types_beyond_llama():
    adapters = family_adapters()
    assert set(FAMILIES) <= set(adapters)
    assert {"mixtral", "qwen2_moe", "qwen3", "gemma2", "gptj", "phi", "cohere"} <= set(FAMILIES)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_sharpness_of_a_tiny_model_matches_its_dense_hessian(measured, model_type):
    m = measured(model_type)
    rep = m["rep"]
    e = rep["eigen"]
    src = rep["provenance"]["model_source"]
    assert src["tier"] == "b" and src["model_type"] == model_type  # through the family adapter, not tier a
    assert rep["n_params"] == m["n"] and rep["tokens"] == m["y"].numel()
    with torch.no_grad():  # the same loss: transformers' own float64 model on the windows the command read
        assert rep["loss"] == pytest.approx(float(lm_loss(Logits(m["hf"])(m["x"]), m["y"])), rel=1e-9)
    ev = eigenvalues(m["hf"], m["x"], m["y"])
    scale = float(np.abs(ev).max())
    want_top, want_bottom = ev[::-1][:3], ev[:1]
    top, bottom = np.array(e["top"]), np.array(e["bottom"])
    err_top, err_bottom = np.array(e["top_error"]), np.array(e["bottom_error"])
    assert all(e["top_converged"]) and all(e["bottom_converged"])
    # not degenerate: the three top eigenvalues are non-zero and apart by far more than the bound
    assert np.all(np.abs(want_top) > 100 * err_top) and np.all(-np.diff(want_top) > 100 * err_top[1:])
    # the report's own per-eigenvalue bound holds, and its residual bound (>= the estimate) with it
    assert np.all(np.abs(top - want_top) <= err_top + SLACK * scale), (top, want_top, err_top)
    assert np.all(np.abs(bottom - want_bottom) <= err_bottom + SLACK * scale), (bottom, want_bottom, err_bottom)
    assert np.all(err_top <= np.array(e["top_residual"])) and np.all(err_bottom <= np.array(e["bottom_residual"]))
    # close relative to the spectrum (rounding is relative to ||H||, not to each eigenvalue)
    np.testing.assert_allclose(top, want_top, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(bottom, want_bottom, rtol=0, atol=1e-5 * scale)
    # the bound is at least the rounding level of the precision the forward computes in, and says which
    eps = float(torch.finfo(getattr(torch, rep["computed_in"])).eps)
    assert e["rounding"] >= 10 * eps * max(abs(top[0]), abs(bottom[0])) * (1 - 1e-9)
    if rep["computed_in"] == "float32":
        assert any("computes partly in float32" in n for n in rep["notes"]), rep["notes"]


@pytest.mark.parametrize("model_type, weight", [("qwen3", "self_attn.q_norm.weight"),
                                                ("gemma2", "post_feedforward_layernorm.weight")])
def test_the_dense_check_fails_for_a_loss_one_weight_away(measured, model_type, weight):
    """Control: the report against the dense Hessian of the same model with one entry of one norm weight moved by
    1e-3 (a slip an adapter could make) is outside the bound by far: the bound is tight enough to see it."""
    m = measured(model_type)
    e = m["rep"]["eigen"]
    other = copy.deepcopy(m["hf"])
    (name,) = [n for n, _ in other.named_parameters() if n.endswith(weight)]  # the one layer's
    with torch.no_grad():
        other.get_parameter(name).view(-1)[0] += 1e-3
    ev = eigenvalues(other, m["x"], m["y"])
    miss = np.abs(np.array(e["top"]) - ev[::-1][:3]) / np.array(e["top_error"])
    assert miss.max() > 10, miss
