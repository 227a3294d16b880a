"""BLOOM: ALiBi, LayerNorm (also on the embeddings), one fused ``query_key_value`` with per-head [q | k | v]; the
attention module and the MLP add their residual themselves.

    transformer.word_embeddings -> word_embeddings_layernorm -> transformer.h[i] (input_layernorm,
    self_attention{query_key_value, dense} (+ residual), post_attention_layernorm, mlp{dense_h_to_4h,
    dense_4h_to_h} (+ residual)) -> transformer.ln_f -> lm_head (tied)

Hook points: q/k/v are the three slices of each head in query_key_value's output; z the input of
self_attention.dense; resid_mid the input of post_attention_layernorm (the attention module's output, residual
included); mlp.out the output of mlp.dense_4h_to_h (the MLP's contribution, before it adds the residual). The
pattern check adds BLOOM's own ALiBi bias (``build_alibi_tensor``, by key position). Refused:
``apply_residual_connection_post_layernorm`` (the residual is the normed stream) and ``pretraining_tp`` > 1 with
``slow_but_exact`` (the projections then run as slices, past the modules the hooks are on).
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape, packed_per_head


class Bloom(Family):
    name = "bloom"
    model_types = ("bloom",)
    positions = "ALiBi"
    norms = "pre-norm LayerNorm, and one on the embeddings"
    points = {"q, k, v": "per-head slices of query_key_value's output",
              "resid_mid": "input of post_attention_layernorm", "mlp.out": "output of mlp.dense_4h_to_h",
              "z": "input of self_attention.dense"}

    def refuse(self, config) -> str | None:
        if config.apply_residual_connection_post_layernorm:
            return "apply_residual_connection_post_layernorm: the residual is the normed stream"
        if config.pretraining_tp > 1 and config.slow_but_exact:
            return "pretraining_tp > 1 with slow_but_exact: the projections run as slices outside their modules"
        return None

    def backbone(self, hf):
        t = hf.transformer
        return Backbone(hf.get_input_embeddings(), None, t.h, t.ln_f, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        return Shape(c.n_head, c.n_head, c.hidden_size // c.n_head, 0)

    def attention(self, layer):
        return layer.self_attention

    def out_proj(self, layer):
        return layer.self_attention.dense

    def mid_norm(self, layer):
        return layer.post_attention_layernorm

    def mlp(self, layer):
        return layer.mlp.dense_4h_to_h

    def score_scale(self, layer, s: Shape) -> float:
        return float(layer.self_attention.inv_norm_factor)

    def projections(self, layer, s: Shape) -> list[Projection]:
        dh, H = s.head_dim, s.n_head
        return packed_per_head(layer.self_attention.query_key_value, H, dh)

    def score_bias(self, hf, layer, batch, T):
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.bloom.modeling_bloom import build_alibi_tensor

        H = hf.config.n_head
        alibi = build_alibi_tensor(torch.ones(batch, T, dtype=torch.long), H, torch.float32)  # (B H, 1, T)
        return alibi.view(batch, H, 1, T) * layer.self_attention.beta
