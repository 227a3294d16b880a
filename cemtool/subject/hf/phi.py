"""Phi (Phi-1, Phi-1.5, Phi-2): one LayerNorm feeding attention and MLP in parallel, partial RoPE on the first
``rotary_ndims`` coordinates of each head, an output projection named ``dense``.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q_proj, k_proj, v_proj, dense}, mlp{fc1, fc2})
    -> model.final_layernorm -> lm_head

    resid_post = resid_pre + attention output + mlp output      (parallel residual: no resid_mid)

Hook points: q/k/v are the projections' outputs (before RoPE, the model's own coordinates); z the input of dense.
The pattern check applies Phi's partial rotary (the first ``rotary_ndims`` coordinates rotated, the rest passed).
``qk_weights`` is None: rank truncation assumes RoPE planes (p, p + d_h/2) over the whole head. A config with
``qk_layernorm`` is refused at load by the algebra check (those norms are not declared).
"""

from __future__ import annotations

from cemtool.subject.hf.adapter import Backbone
from cemtool.subject.hf.llama import LlamaLike


class Phi(LlamaLike):
    name = "phi"
    model_types = ("phi",)
    norm, mlp_kind = "layernorm", "gelu"
    kinds = {}
    bilinear_qk = False

    def backbone(self, hf):
        m = hf.model
        return Backbone(hf.get_input_embeddings(), None, m.layers, m.final_layernorm, hf.get_output_embeddings())

    def out_proj(self, layer):
        return layer.self_attn.dense

    def mid_norm(self, layer):
        return None  # parallel residual
