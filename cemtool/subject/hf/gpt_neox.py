"""GPT-NeoX (Pythia): LayerNorm, partial RoPE, one fused query_key_value laid out head by head, parallel residual.

    gpt_neox.embed_in -> gpt_neox.layers[i] (input_layernorm, attention{query_key_value, dense},
    post_attention_layernorm, mlp) -> gpt_neox.final_layer_norm -> embed_out

Hook points: the output of query_key_value is (H, 3 d_h) per token, [q | k | v] per head; q and k are shown in
:func:`rope_order` (the rotated coordinates of partial rotary as planes (p, p + d_h/2), the others paired among
themselves), so that rank truncation's RoPE planes are the model's. With ``use_parallel_residual`` (Pythia's
default) attention and MLP read the same input and there is no resid_mid; z is the input of attention.dense.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape, rope_order


class GPTNeoX(Family):
    name = "gpt_neox"
    model_types = ("gpt_neox",)
    residual = "parallel (use_parallel_residual, Pythia's default), or sequential"
    positions = "partial RoPE (rotary_pct)"
    points = {"q, k, v": "per-head slices of query_key_value's output, before RoPE; q and k in rope_order",
              "resid_mid": "input of post_attention_layernorm (sequential residual only)",
              "z": "input of attention.dense"}

    def backbone(self, hf):
        m = hf.gpt_neox
        return Backbone(hf.get_input_embeddings(), None, m.layers, m.final_layer_norm, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        dh = c.hidden_size // c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(c, "rotary_pct", 1.0))
        return Shape(c.num_attention_heads, c.num_attention_heads, dh, int(dh * factor))

    def attention(self, layer):
        return layer.attention

    def out_proj(self, layer):
        return layer.attention.dense

    def mid_norm(self, layer):
        return None if layer.use_parallel_residual else layer.post_attention_layernorm

    def mlp(self, layer):
        return layer.mlp

    def rotate(self, hf, q, k, layer):
        """The hook points' :func:`rope_order` undone, then the model's own partial RoPE."""
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

        s = self.shape(hf.config)
        back = torch.argsort(rope_order(s.head_dim, s.rotary_dims))  # hook coordinates -> the model's
        pos = torch.arange(q.shape[2])[None]  # (1, T)
        cos, sin = hf.gpt_neox.rotary_emb(q, pos)
        return apply_rotary_pos_emb(q[..., back], k[..., back], cos, sin)

    def projections(self, layer, s: Shape) -> list[Projection]:
        dh, H = s.head_dim, s.n_head
        base = torch.arange(H)[:, None] * 3 * dh  # (H, 1) where each head's [q | k | v] starts
        order = rope_order(dh, s.rotary_dims)
        q = (base + order).reshape(-1)  # (H*d_h,)
        k = (base + dh + order).reshape(-1)
        v = (base + 2 * dh + torch.arange(dh)).reshape(-1)
        qkv = layer.attention.query_key_value
        return [Projection(qkv, "q", q, H), Projection(qkv, "k", k, H), Projection(qkv, "v", v, H)]
