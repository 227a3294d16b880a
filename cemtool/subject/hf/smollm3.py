"""SmolLM3: the Llama block, with no RoPE in every ``no_rope_layer_interval``-th layer (``no_rope_layers[i] = 0``:
NoPE) and optional sliding windows.

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn{q,k,v,o}_proj, post_attention_layernorm,
    mlp) -> model.norm -> lm_head

Hook points as Llama's (before RoPE; in a NoPE layer the scores are q·k of the hook points themselves). The layer's
attention says whether it rotates (``self_attn.use_rope``): the pattern check rotates only those layers, and
``blocks.N.attn.rotary`` is None in a NoPE layer, so saturation truncates its scores in the SVD basis.
"""

from __future__ import annotations

from cemtool.subject.hf.llama import LlamaLike


class SmolLM3(LlamaLike):
    name = "smollm3"
    model_types = ("smollm3",)
    routers = ()
    kinds = {}
    positions = "RoPE, none in the NoPE layers (no_rope_layers)"

    def rotary_dims(self, layer, shape):
        return shape.rotary_dims if layer.self_attn.use_rope else 0
