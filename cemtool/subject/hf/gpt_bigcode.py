"""GPT-BigCode (StarCoder 1, SantaCoder): GPT-2's block with multi-query attention: one fused c_attn whose output
is the queries (all heads), then one key head and one value head (``multi_query``; without it, per-head [q|k|v]).

    transformer.wte + transformer.wpe -> transformer.h[i] (ln_1, attn{c_attn, c_proj}, ln_2, mlp) ->
    transformer.ln_f -> lm_head

Hook points: q is the first d features of c_attn's output; k and v the next d_h each (multi-query: one key-value
head shared by every query head); resid_mid the input of ln_2; z the input of attn.c_proj.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Projection, Shape, packed_per_head
from cemtool.subject.hf.gpt2 import GPT2


class GPTBigCode(GPT2):
    name = "gpt_bigcode"
    model_types = ("gpt_bigcode",)
    points = {"q, k, v": "slices of c_attn's output: q the first d features, then one key and one value head "
                         "(multi_query), else per head [q | k | v]", "resid_mid": "input of ln_2",
              "z": "input of attn.c_proj"}

    def shape(self, c) -> Shape:
        dh = c.n_embd // c.n_head
        return Shape(c.n_head, 1 if c.multi_query else c.n_head, dh, 0)

    def score_scale(self, layer, s: Shape) -> float:
        return s.head_dim ** -0.5 if layer.attn.scale_attn_weights else 1.0

    def projections(self, layer, s: Shape) -> list[Projection]:
        d, dh, H = s.n_head * s.head_dim, s.head_dim, s.n_head
        qkv = layer.attn.c_attn
        if s.n_kv_head == 1:  # [q (d) | k (d_h) | v (d_h)]
            return [Projection(qkv, "q", torch.arange(d), H), Projection(qkv, "k", torch.arange(d, d + dh), 1),
                    Projection(qkv, "v", torch.arange(d + dh, d + 2 * dh), 1)]
        return packed_per_head(qkv, H, dh)  # per head [q | k | v]
