"""OLMo-2: no pre-norms; RMSNorms on the attention output and on the MLP output before each residual add
(post-sublayer norms), RMSNorms on the full query and key projections, RoPE.

    model.embed_tokens -> model.layers[i] (self_attn{q_proj -> q_norm, k_proj -> k_norm, v_proj, o_proj},
    post_attention_layernorm, mlp, post_feedforward_layernorm) -> model.norm -> lm_head

    resid_mid = resid_pre + post_attention_layernorm(attention output)
    resid_post = resid_mid + post_feedforward_layernorm(mlp output)

Hook points: q and k are the outputs of q_norm and k_norm (after the norms over all heads, before RoPE); v is
v_proj's output; resid_mid is the MLP's input (the residual stream: there is no pre-norm); mlp.out the MLP's output
before its post-norm; z the input of o_proj. The norms make the scores no fixed bilinear form (``qk_weights`` None).
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class Olmo2(LlamaLike):
    name = "olmo2"
    model_types = ("olmo2",)
    routers = ()
    bilinear_qk = False
    qk_norms = (None, "q_norm", "k_norm", "flat")  # norms over all heads: (B, T, H d_h)
    norms = "post-sublayer RMSNorms (no pre-norms); RMSNorms on the full q and k projections"
    points = {"q, k": "q_norm / k_norm outputs (norms over all heads), before RoPE", "v": "v_proj output",
              "resid_mid": "the MLP's input", "mlp.out": "MLP output, before its post-norm", "z": "input of o_proj"}

    def mid_norm(self, layer):
        return layer.mlp  # its input is the residual stream between attention and MLP

    def post_norms(self, layer):
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm

