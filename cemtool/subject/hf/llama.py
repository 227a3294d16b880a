"""Llama-like models (Llama, Mistral, Qwen2, Ministral, Arcee, Seed-OSS, Granite, Gemma, OLMo, StarCoder2,
EXAONE, and the mixtures of experts Mixtral and Qwen2-MoE, whose MLP is the sparse block): pre-norm, RoPE,
separate q/k/v projections, GQA; module for module the same layout, whatever the norm and MLP inside.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj, post_attention_layernorm,
    mlp) -> model.norm -> lm_head

Hook points: q/k/v are the outputs of q_proj/k_proj/v_proj (biases included, Qwen2), k and v with the model's
key-value heads; resid_mid is the input of post_attention_layernorm; z the input of o_proj.
"""

from __future__ import annotations

import torch

from cemtool.subject.hf.adapter import Backbone, Family, Projection, Shape

WINDOW_FROM_CONFIG = ("mistral", "mixtral", "phi3", "starcoder2")  # every layer's window is config.sliding_window


class LlamaLike(Family):
    name = "llama"
    # the families whose blocks are Llama's, module for module; each is verified at load by the hook-point algebra
    # check (cemtool.subject.hf.algebra), which refuses a config that breaks the mapping (Granite with a residual
    # multiplier other than 1, say). Qwen3, OLMo-2, Helium, ERNIE-4.5, EXAONE-4 and Hunyuan fail it at any config
    # (q/k norms, post-sublayer norms, another rotary layout): they stay tier a until a family file declares them.
    model_types = ("llama", "mistral", "qwen2", "ministral", "arcee", "seed_oss", "granite", "mixtral", "qwen2_moe",
                   "gemma", "olmo", "starcoder2", "exaone")
    norm, mlp_kind = "rmsnorm", "swiglu"
    norms = "pre-norm (RMSNorm; LayerNorm in OLMo and StarCoder2)"
    routers = ("mixtral", "qwen2_moe")
    # q/k norms after the projections: (the attention's flag that switches them on, None: always; the q norm's and
    # the k norm's attribute names; their output's layout, Projection.layout); None: no q/k norms
    qk_norms: tuple[str | None, str, str, str] | None = None
    positions = "RoPE (partial where partial_rotary_factor < 1); sliding windows where configured"
    points = {"q, k, v": "q_proj / k_proj / v_proj outputs (biases included), before RoPE",
              "resid_mid": "input of post_attention_layernorm", "z": "input of o_proj"}
    kinds = {"starcoder2": ("layernorm", "gelu"), "olmo": ("layernorm", "swiglu"),  # cemtool's nearest names for
             "gemma": ("rmsnorm", "gelu")}  # the norm and MLP (descriptive: the model's own modules run)

    def backbone(self, hf):
        return Backbone(hf.get_input_embeddings(), None, hf.model.layers, hf.model.norm, hf.get_output_embeddings())

    def shape(self, c) -> Shape:
        heads = c.num_attention_heads
        dh = getattr(c, "head_dim", None) or c.hidden_size // heads
        rope = getattr(c, "rope_parameters", None) or {}
        factor = rope.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0
        return Shape(heads, getattr(c, "num_key_value_heads", None) or heads, dh, int(dh * factor))

    def attention(self, layer):
        return layer.self_attn

    def out_proj(self, layer):
        return layer.self_attn.o_proj

    def mid_norm(self, layer):
        return layer.post_attention_layernorm

    def mlp(self, layer):
        return layer.mlp

    def rotate(self, hf, q, k, layer):
        """RoPE as the model applies it, from its own rotary module (cos, sin at positions 0..T-1), on each head's
        first ``rotary_dims`` coordinates (all of them but for partial rotary: Phi, StableLM), the rest passed."""
        # optional dependency: transformers (a model of this family was built by it)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        r = self.rotary_dims(layer, self.shape(hf.config))
        if r == 0:
            return q, k
        pos = torch.arange(q.shape[2])[None]  # (1, T)
        cos, sin = self.cos_sin(hf, q, pos, layer)
        q_rot, k_rot = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin)
        return torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)

    def window(self, layer):
        """The attention module's own ``sliding_window`` (Qwen2, Ministral, Gemma-2: per layer), or for the types
        that read it from the config in every layer (Mistral, Mixtral, Phi-3, StarCoder2) the config's."""
        a = self.attention(layer)
        if a.config.model_type in WINDOW_FROM_CONFIG:
            return int(a.config.sliding_window) if a.config.sliding_window else None
        return super().window(layer)

    def cos_sin(self, hf, x, pos, layer):
        """The model's own rotary module's (cos, sin) at positions ``pos``."""
        return hf.model.rotary_emb(x, pos)

    def router(self, layer):
        """The sparse block's router (Mixtral, Qwen2-MoE, Qwen3-MoE: ``mlp.gate`` beside ``mlp.experts``), None for
        a dense MLP (also a Qwen-MoE layer listed in ``mlp_only_layers``)."""
        experts = getattr(layer.mlp, "experts", None)
        return layer.mlp.gate if isinstance(experts, torch.nn.Module) else None

    def projections(self, layer, s: Shape) -> list[Projection]:
        """q_proj, k_proj, v_proj; with the family's declared q/k norms (:attr:`qk_norms`, where its flag is on), q
        and k are the norms' outputs instead."""
        a = layer.self_attn
        q = Projection(a.q_proj, "q", torch.arange(s.n_head * s.head_dim), s.n_head)
        k = Projection(a.k_proj, "k", torch.arange(s.n_kv_head * s.head_dim), s.n_kv_head)
        v = Projection(a.v_proj, "v", torch.arange(s.n_kv_head * s.head_dim), s.n_kv_head)
        if self.qk_norms is None or (self.qk_norms[0] is not None and not getattr(a, self.qk_norms[0])):
            return [q, k, v]
        _, q_norm, k_norm, layout = self.qk_norms
        return [Projection(getattr(a, q_norm), "q", q.index, q.heads, layout=layout),
                Projection(getattr(a, k_norm), "k", k.index, k.heads, layout=layout), v]
