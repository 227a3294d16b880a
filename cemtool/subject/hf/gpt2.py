"""GPT-2: learned positions, LayerNorm, one fused c_attn (Conv1D) for q, k, v.

    transformer.wte + transformer.wpe -> transformer.h[i] (ln_1, attn{c_attn, c_proj}, ln_2, mlp) ->
    transformer.ln_f -> lm_head (tied to wte)

Hook points: q, k, v are the three d-wide thirds of c_attn's output (biases included); resid_mid is the input of
ln_2; z the input of attn.c_proj.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape


class GPT2(Family):
    name = "gpt2"
    model_types = ("gpt2",)
    positions = "learned"
    points = {"q, k, v": "the three d-wide thirds of c_attn's output (biases included)", "resid_mid": "input of ln_2",
              "z": "input of attn.c_proj"}

    def backbone(self, hf):
        t = hf.transformer
        return Backbone(hf.get_input_embeddings(), t.wpe, t.h, t.ln_f, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        return Shape(c.n_head, c.n_head, c.n_embd // c.n_head, 0)

    def attention(self, layer):
        return layer.attn

    def out_proj(self, layer):
        return layer.attn.c_proj

    def mid_norm(self, layer):
        return layer.ln_2

    def mlp(self, layer):
        return layer.mlp

    def score_scale(self, layer, s: Shape) -> float:
        a = layer.attn
        scale = s.head_dim ** -0.5 if a.scale_attn_weights else 1.0
        return scale / (a.layer_idx + 1) if a.scale_attn_by_inverse_layer_idx else scale

    def projections(self, layer, s: Shape) -> list[Projection]:
        d = s.n_head * s.head_dim
        return [Projection(layer.attn.c_attn, p, torch.arange(i * d, (i + 1) * d), s.n_head)
                for i, p in enumerate("qkv")]
