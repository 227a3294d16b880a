"""OPT: learned positions (offset by 2), LayerNorm, separate q/k/v projections with biases; the MLP is two Linear
layers of the decoder layer itself, applied to the tokens flattened to (B T, d).

    model.decoder.embed_tokens + embed_positions -> model.decoder.layers[i] (self_attn_layer_norm, self_attn{q,k,v,
    out}_proj, final_layer_norm, fc1, fc2) -> model.decoder.final_layer_norm -> lm_head (tied)

Hook points: q/k/v are the projections' outputs (q before the module multiplies it by d_h^-1/2, which the pattern
check applies as the score scale); resid_mid the input of final_layer_norm and mlp.out fc2's output, both shown as
(B, T, d); z the input of out_proj. Refused: OPT-350m's layout (post-LN, ``do_layer_norm_before`` false) and a
``project_in``/``project_out`` pair (``word_embed_proj_dim`` != ``hidden_size``): the stream they put between the
blocks and the head is not declared.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape


class OPT(Family):
    name = "opt"
    model_types = ("opt",)
    positions = "learned"
    points = {"q, k, v": "the projections' outputs (q before its d_h^-1/2 factor)",
              "resid_mid": "input of final_layer_norm", "mlp.out": "fc2 output", "z": "input of out_proj"}

    def refuse(self, config) -> str | None:
        if not config.do_layer_norm_before:
            return "do_layer_norm_before=false (post-LN, as OPT-350m): the residual stream is normed between blocks"
        if config.word_embed_proj_dim != config.hidden_size:
            return "word_embed_proj_dim != hidden_size: project_in/project_out are not mapped"
        return None

    def backbone(self, hf):
        dec = hf.model.decoder
        return Backbone(hf.get_input_embeddings(), dec.embed_positions, dec.layers, dec.final_layer_norm,
                        hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        H = c.num_attention_heads
        return Shape(H, H, c.hidden_size // H, 0)

    def attention(self, layer):
        return layer.self_attn

    def out_proj(self, layer):
        return layer.self_attn.out_proj

    def mid_norm(self, layer):
        return layer.final_layer_norm

    def mlp(self, layer):
        return layer.fc2

    def projections(self, layer, s: Shape) -> list[Projection]:
        a, n = layer.self_attn, s.n_head * s.head_dim
        return [Projection(getattr(a, f"{p}_proj"), p, torch.arange(n), s.n_head) for p in "qkv"]
