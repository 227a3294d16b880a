"""Qwen3 (and Qwen3-MoE): the Llama block with per-head RMSNorms on the queries and keys before RoPE.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q_proj -> q_norm, k_proj -> k_norm, v_proj,
    o_proj}, post_attention_layernorm, mlp) -> model.norm -> lm_head

Hook points: q and k are the outputs of q_norm and k_norm, (B, T, heads, d_h) per token: after the q/k norms and
before RoPE, which is what the attention scores (the hook-point algebra check verifies it); v is v_proj's output;
resid_mid the input of post_attention_layernorm; z the input of o_proj. The scores are not a fixed bilinear form
of the layer input (the norms divide by each head's q and k norms), so ``qk_weights`` is None and saturation's
rank truncation in the weights' basis says so.
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class Qwen3(LlamaLike):
    name = "qwen3"
    model_types = ("qwen3", "qwen3_moe")
    bilinear_qk = False
    qk_norms = (None, "q_norm", "k_norm", "bthd")
    norms = "pre-norm RMSNorm; per-head q/k RMSNorms"
    routers = ("qwen3_moe",)
    points = {"q, k": "q_norm / k_norm outputs: after the q/k norms, before RoPE", "v": "v_proj output",
              "resid_mid": "input of post_attention_layernorm", "z": "input of o_proj"}

