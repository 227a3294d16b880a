"""Phi-3: the Llama block with one fused qkv_proj (queries, then keys, then values, each head after head) and a
fused gate_up_proj in the MLP.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{qkv_proj, o_proj}, post_attention_layernorm,
    mlp{gate_up_proj, down_proj}) -> model.norm -> lm_head

Hook points: q, k, v are the three slices of qkv_proj's output (H d_h, then H_kv d_h twice), before RoPE;
resid_mid the input of post_attention_layernorm; z the input of o_proj.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Projection, Shape
from cemtool.subject.hf.llama import LlamaLike


class Phi3(LlamaLike):
    name = "phi3"
    model_types = ("phi3",)
    routers = ()
    kinds = {}
    points = {"q, k, v": "slices of qkv_proj's output, before RoPE", "resid_mid": "input of post_attention_layernorm",
              "z": "input of o_proj"}

    def projections(self, layer, s: Shape) -> list[Projection]:
        qkv = layer.self_attn.qkv_proj
        nq, nkv = s.n_head * s.head_dim, s.n_kv_head * s.head_dim
        return [Projection(qkv, "q", torch.arange(nq), s.n_head),
                Projection(qkv, "k", torch.arange(nq, nq + nkv), s.n_kv_head),
                Projection(qkv, "v", torch.arange(nq + nkv, nq + 2 * nkv), s.n_kv_head)]
