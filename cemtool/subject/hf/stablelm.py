"""StableLM: the Llama layout with LayerNorms and partial RoPE on each head's first ``rotary_ndims`` coordinates
(optionally a parallel residual: ``use_parallel_residual``).

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj, post_attention_layernorm,
    mlp) -> model.norm -> lm_head

Hook points: q/k/v are the projections' outputs (before RoPE, the model's coordinates); resid_mid the input of
post_attention_layernorm (none with a parallel residual); z the input of o_proj. The pattern check applies the
partial rotary as the model does. ``qk_weights`` is None (rank truncation assumes whole-head RoPE planes); a config
with ``qk_layernorm`` is refused at load by the algebra check (those norms are not declared).
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class StableLM(LlamaLike):
    name = "stablelm"
    model_types = ("stablelm",)
    norm, mlp_kind = "layernorm", "swiglu"
    kinds = {}
    bilinear_qk = False

    def mid_norm(self, layer):
        return None if layer.use_parallel_residual else layer.post_attention_layernorm
