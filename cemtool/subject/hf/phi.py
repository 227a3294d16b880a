"""Phi (Phi-1, Phi-1.5, Phi-2): one LayerNorm feeding attention and MLP in parallel, partial RoPE on the first
``rotary_ndims`` coordinates of each head, an output projection named ``dense``.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q_proj, k_proj, v_proj, dense}, mlp{fc1, fc2})
    -> model.final_layernorm -> lm_head

    resid_post = resid_pre + attention output + mlp output      (parallel residual: no resid_mid)

Hook points: q/k/v are the projections' outputs (before RoPE, the model's own coordinates); z the input of dense.
The pattern check applies Phi's partial rotary (the first ``rotary_ndims`` coordinates rotated, the rest passed).
``qk_weights`` is None: rank truncation assumes RoPE planes (p, p + d_h/2) over the whole head. With
``qk_layernorm`` the q and k hook points are the outputs of its per-head q/k LayerNorms.
"""

from __future__ import annotations

from cemtool.subject.hf.adapter import Backbone
from cemtool.subject.hf.llama import LlamaLike


class Phi(LlamaLike):
    name = "phi"
    model_types = ("phi",)
    routers = ()
    norm, mlp_kind = "layernorm", "gelu"
    kinds = {}
    bilinear_qk = False
    qk_norms = ("qk_layernorm", "q_layernorm", "k_layernorm", "bhtd")
    residual = "parallel"
    norms = "one pre-LayerNorm for both sublayers"
    positions = "partial RoPE (the first rotary_ndims coordinates)"
    points = {"q, k, v": "the projections' outputs, before RoPE (q, k: the q/k norms' outputs with qk_layernorm)",
              "z": "input of self_attn.dense"}

    def backbone(self, hf):
        m = hf.model
        return Backbone(hf.get_input_embeddings(), None, m.layers, m.final_layernorm, hf.get_output_embeddings())

    def out_proj(self, layer):
        return layer.self_attn.dense

    def mid_norm(self, layer):
        return None  # parallel residual

