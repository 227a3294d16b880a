"""StableLM: the Llama layout with LayerNorms and partial RoPE on each head's first ``rotary_ndims`` coordinates
(optionally a parallel residual: ``use_parallel_residual``).

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj, post_attention_layernorm,
    mlp) -> model.norm -> lm_head

Hook points: q/k/v are the projections' outputs (before RoPE, the model's coordinates); resid_mid the input of
post_attention_layernorm (none with a parallel residual); z the input of o_proj. The pattern check applies the
partial rotary as the model does. ``qk_weights`` is None (rank truncation assumes whole-head RoPE planes). With
``qk_layernorm`` (StableLM-2 12B) the q and k hook points are the outputs of its per-head q/k LayerNorms.
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class StableLM(LlamaLike):
    name = "stablelm"
    model_types = ("stablelm",)
    routers = ()
    norm, mlp_kind = "layernorm", "swiglu"
    kinds = {}
    bilinear_qk = False
    qk_norms = ("qk_layernorm", "q_layernorm", "k_layernorm", "bhtd")
    residual = "sequential, or parallel (use_parallel_residual)"
    norms = "pre-LayerNorm"
    positions = "partial RoPE (partial_rotary_factor)"
    points = {"q, k, v": "the projections' outputs, before RoPE (q, k: the q/k norms' outputs with qk_layernorm)",
              "resid_mid": "input of post_attention_layernorm (sequential residual only)", "z": "input of o_proj"}

    def mid_norm(self, layer):
        return None if layer.use_parallel_residual else layer.post_attention_layernorm

