"""Gemma-2: the Llama layout with "sandwich" norms (an RMSNorm before and after each sublayer) and soft-capped
attention logits (``tanh(s / c) c`` before the mask and softmax).

    model.embed_tokens (x sqrt(d)) -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj,
    post_attention_layernorm, pre_feedforward_layernorm, mlp, post_feedforward_layernorm) -> model.norm -> lm_head

    resid_mid = resid_pre + post_attention_layernorm(attention output)
    resid_post = resid_mid + post_feedforward_layernorm(mlp output)

Hook points: q/k/v are the projections' outputs (before RoPE); resid_mid is the input of pre_feedforward_layernorm;
mlp.out the MLP's output before its post-norm; z the input of o_proj. The score scale is the attention's own
(``query_pre_attn_scalar``), and the soft cap the config's ``attn_logit_softcapping``.
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class Gemma2(LlamaLike):
    name = "gemma2"
    model_types = ("gemma2",)
    routers = ()
    kinds = {"gemma2": ("rmsnorm", "gelu")}
    norms = "sandwich (RMSNorm before and after each sublayer)"
    positions = "RoPE; sliding windows on alternate layers"
    points = {"q, k, v": "the projections' outputs, before RoPE", "resid_mid": "input of pre_feedforward_layernorm",
              "mlp.out": "MLP output, before its post-norm", "z": "input of o_proj"}

    def mid_norm(self, layer):
        return layer.pre_feedforward_layernorm

    def post_norms(self, layer):
        return layer.post_attention_layernorm, layer.post_feedforward_layernorm

    def softcap(self, layer) -> float | None:
        return getattr(self.attention(layer), "attn_logit_softcapping", None) or \
            getattr(self.attention(layer).config, "attn_logit_softcapping", None)
