"""Gemma-3 (text): Gemma-2's sandwich norms, per-head RMSNorms on the queries and keys before RoPE, and two kinds of
layer: sliding-window layers with a local RoPE base and full-attention layers with a global one (``layer_types``).

    model.embed_tokens (x sqrt(d)) -> model.layers[i] (input_layernorm, self_attn{q_proj -> q_norm, k_proj ->
    k_norm, v_proj, o_proj}, post_attention_layernorm, pre_feedforward_layernorm, mlp, post_feedforward_layernorm)
    -> model.norm -> lm_head

    resid_mid = resid_pre + post_attention_layernorm(attention output)
    resid_post = resid_mid + post_feedforward_layernorm(mlp output)

Hook points: q and k are the outputs of q_norm and k_norm ((B, heads, T, d_h): after the q/k norms, before RoPE);
v is v_proj's output; resid_mid the input of pre_feedforward_layernorm; mlp.out the MLP's output before its
post-norm; z the input of o_proj. The pattern check applies each layer's own rotary (the rotary module called with
the layer's type) and window. ``qk_weights`` is None (the q/k norms). A config with bidirectional attention (an
embedding model) is refused (it is not causal).
"""

from __future__ import annotations

from cemtool.subject.hf.gemma2 import Gemma2


class Gemma3(Gemma2):
    name = "gemma3"
    model_types = ("gemma3_text",)
    kinds = {"gemma3_text": ("rmsnorm", "gelu")}
    bilinear_qk = False
    qk_norms = (None, "q_norm", "k_norm", "bhtd")
    norms = "sandwich (RMSNorm before and after each sublayer); per-head q/k RMSNorms"
    positions = "RoPE, a local base on sliding-window layers and a global one on full layers"
    points = {"q, k": "q_norm / k_norm outputs: after the q/k norms, before RoPE", "v": "v_proj output",
              "resid_mid": "input of pre_feedforward_layernorm", "mlp.out": "MLP output, before its post-norm",
              "z": "input of o_proj"}

    def refuse(self, config) -> str | None:
        if getattr(config, "use_bidirectional_attention", False):
            return "use_bidirectional_attention: the attention is not causal"
        return None

    def cos_sin(self, hf, x, pos, layer):
        return hf.model.rotary_emb(x, pos, layer.self_attn.layer_type)

