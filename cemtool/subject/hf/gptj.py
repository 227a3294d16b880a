"""GPT-J (and CodeGen's layout): one LayerNorm feeding attention and MLP in parallel, RoPE on interleaved pairs
of the first ``rotary_dim`` coordinates of each head.

    transformer.wte -> transformer.h[i] (ln_1, attn{q_proj, k_proj, v_proj, out_proj}, mlp{fc_in, fc_out}) ->
    transformer.ln_f -> lm_head

    resid_post = resid_pre + attention output + mlp output      (parallel residual: no resid_mid)

Hook points: q/k/v are the projections' outputs (before RoPE); z the input of attn.out_proj. The pattern check
applies GPT-J's own rotary (``apply_rotary_pos_emb`` on the first ``rotary_dim`` coordinates, in its (B, T, H, d_h)
layout). ``qk_weights`` is None: its rotary planes are interleaved pairs, not the (p, p + d_h/2) rank truncation
assumes.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape


class GPTJ(Family):
    name = "gptj"
    model_types = ("gptj",)
    residual = "parallel"
    norms = "one pre-LayerNorm for both sublayers"
    positions = "RoPE on interleaved pairs of the first rotary_dim coordinates"
    points = {"q, k, v": "the projections' outputs, before RoPE", "z": "input of attn.out_proj"}
    bilinear_qk = False

    def backbone(self, hf):
        t = hf.transformer
        return Backbone(hf.get_input_embeddings(), None, t.h, t.ln_f, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        dh = c.n_embd // c.n_head
        return Shape(c.n_head, c.n_head, dh, c.rotary_dim or dh)

    def attention(self, layer):
        return layer.attn

    def out_proj(self, layer):
        return layer.attn.out_proj

    def mid_norm(self, layer):
        return None  # parallel residual

    def mlp(self, layer):
        return layer.mlp

    def projections(self, layer, s: Shape) -> list[Projection]:
        a, n = layer.attn, s.n_head * s.head_dim
        return [Projection(getattr(a, f"{p}_proj"), p, torch.arange(n), s.n_head) for p in "qkv"]

    def rotate(self, hf, q, k, layer):
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb

        r = self.shape(hf.config).rotary_dims
        pos = torch.arange(q.shape[2])[None]  # (1, T)
        sin, cos = hf.transformer.rotary_emb(q, pos)

        def rot(x):  # (B, H, T, d_h) -> GPT-J's (B, T, H, d_h) layout, rotated, and back
            x = x.transpose(1, 2)
            return torch.cat([apply_rotary_pos_emb(x[..., :r], sin, cos), x[..., r:]], dim=-1).transpose(1, 2)

        return rot(q), rot(k)
