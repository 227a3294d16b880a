"""Falcon: one fused ``query_key_value`` in one of three packings, RoPE or ALiBi, and a parallel or a sequential
residual.

    transformer.word_embeddings -> transformer.h[i] (input_layernorm | ln_attn + ln_mlp, self_attention{
    query_key_value, dense}, [post_attention_layernorm], mlp{dense_h_to_4h, dense_4h_to_h}) -> transformer.ln_f
    -> lm_head

    parallel_attn or new_decoder_architecture:  resid_post = resid_pre + attention output + mlp output
    otherwise:                                   resid_mid = resid_pre + attention output, resid_post = resid_mid + mlp

The packings of ``query_key_value``'s output, in units of d_h: new_decoder_architecture: per key-value group j,
its g = H / H_kv query heads, then its key, then its value; multi_query: the H query heads, then one key and one
value; otherwise per head [q | k | v]. Hook points: q/k/v those slices (before RoPE); resid_mid the input of
post_attention_layernorm (sequential residual only); mlp.out the MLP's output (a copy: Falcon adds the attention
output to it in place); z the input of self_attention.dense. With ``alibi`` there is no rotary and the pattern
check adds the model's own ALiBi bias (``build_alibi_tensor`` / sqrt(d_h), as FalconModel adds it to the mask).
"""

from __future__ import annotations

import math

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape, packed_per_head


class Falcon(Family):
    name = "falcon"
    model_types = ("falcon",)
    copy_mlp_out = True
    residual = "parallel, or sequential where parallel_attn and new_decoder_architecture are false"
    positions = "RoPE, or ALiBi (alibi)"
    points = {"q, k, v": "slices of query_key_value's output, before RoPE",
              "resid_mid": "input of post_attention_layernorm (sequential residual only)",
              "mlp.out": "MLP output (a copy)", "z": "input of self_attention.dense"}

    def backbone(self, hf):
        t = hf.transformer
        return Backbone(hf.get_input_embeddings(), None, t.h, t.ln_f, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        H = c.num_attention_heads
        dh = c.hidden_size // H
        kv = c.num_kv_heads if (c.new_decoder_architecture or not c.multi_query) else 1
        return Shape(H, kv, dh, 0 if c.alibi else dh)

    def attention(self, layer):
        return layer.self_attention

    def out_proj(self, layer):
        return layer.self_attention.dense

    def mid_norm(self, layer):
        c = layer.config
        return None if (c.parallel_attn or c.new_decoder_architecture) else layer.post_attention_layernorm

    def mlp(self, layer):
        return layer.mlp

    def projections(self, layer, s: Shape) -> list[Projection]:
        dh, H, kv = s.head_dim, s.n_head, s.n_kv_head
        qkv = layer.self_attention.query_key_value
        span = torch.arange(dh)

        def heads(starts: list[int]) -> torch.Tensor:  # head starts (in units of d_h) -> feature indices
            return (torch.tensor(starts)[:, None] * dh + span).reshape(-1)

        if layer.config.new_decoder_architecture:
            g = H // kv
            q = [j * (g + 2) + i for j in range(kv) for i in range(g)]
            k, v = [j * (g + 2) + g for j in range(kv)], [j * (g + 2) + g + 1 for j in range(kv)]
        elif layer.config.multi_query:
            q, k, v = list(range(H)), [H], [H + 1]
        else:
            return packed_per_head(qkv, H, dh)
        return [Projection(qkv, "q", heads(q), H), Projection(qkv, "k", heads(k), kv),
                Projection(qkv, "v", heads(v), kv)]

    def rotate(self, hf, q, k, layer):
        if hf.config.alibi:
            return q, k
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

        pos = torch.arange(q.shape[2])[None]  # (1, T)
        cos, sin = hf.transformer.rotary_emb(q, pos)
        return apply_rotary_pos_emb(q, k, cos, sin)

    def score_bias(self, hf, layer, batch, T):
        if not hf.config.alibi:
            return None
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        H = hf.config.num_attention_heads
        alibi = build_alibi_tensor(torch.ones(batch, T, dtype=torch.long), H, torch.float32)  # (B H, 1, T)
        return alibi.view(batch, H, 1, T) / math.sqrt(hf.config.hidden_size // H)  # (B, H, 1, T): by key position
