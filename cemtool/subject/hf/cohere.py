"""Cohere (Command-R): one LayerNorm feeding attention and MLP in parallel, RoPE on interleaved pairs of
coordinates (not the two halves as in Llama), logits scaled by ``logit_scale``.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj, mlp) -> model.norm ->
    lm_head

    resid_post = resid_pre + attention output + mlp output      (parallel residual: no resid_mid)

Hook points: q/k/v are the projections' outputs (before RoPE); z the input of o_proj. The pattern check applies
the family's own interleaved rotary (Cohere's ``apply_rotary_pos_emb``). Rank truncation in the weights' basis
assumes RoPE planes (p, p + d_h/2), which Cohere's are not: ``qk_weights`` is None (and the saturation analysis
says so). With ``use_qk_norm`` (Command R+) the q and k hook points are the outputs of its per-head q/k norms.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.llama import LlamaLike


class Cohere(LlamaLike):
    name = "cohere"
    model_types = ("cohere",)
    routers = ()
    norm, mlp_kind = "layernorm", "swiglu"
    kinds = {}
    bilinear_qk = False  # the weights are bilinear, but not in the plane order rank truncation assumes
    qk_norms = ("use_qk_norm", "q_norm", "k_norm", "bthd")
    residual = "parallel"
    norms = "one pre-LayerNorm for both sublayers"
    positions = "RoPE on interleaved pairs"
    points = {"q, k, v": "the projections' outputs, before RoPE (q, k: the q/k norms' outputs with use_qk_norm)",
              "z": "input of o_proj"}

    def mid_norm(self, layer):
        return None  # parallel residual

    def rotate(self, hf, q, k, layer):
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

        pos = torch.arange(q.shape[2])[None]  # (1, T)
        cos, sin = hf.model.rotary_emb(q, pos)
        return apply_rotary_pos_emb(q, k, cos, sin)

