"""What an analysis may ask of a model: one declared interface, implemented by cemtool's ``LM`` (and each family
that adds something: LIMe's routers, the momentum streams' scalars, CEM's score form) and by the Hugging Face
adapter (:class:`cemtool.subject.hf.adapter.ForeignLM`).

The analyses read these methods and never probe a model with ``hasattr``: a model that has no routers says so by
returning None, and the analysis reports "not applicable" with the reason. The defaults below are what a model
without the capability answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cemtool.models.capture import HookPoint, hook_points


@dataclass(frozen=True)
class AttentionLayer:
    """One layer's attention as the analyses see it: query heads, key/value heads (fewer under grouped-query
    attention), head size, whether queries and keys are rotated (RoPE), and the hook point of the pre-RoPE
    queries."""

    layer: int
    heads: int
    head_dim: int
    kv_heads: int
    rope: bool
    q_point: str


class Capabilities:
    """The analysis-facing interface of a language model. The class using it is an ``nn.Module`` with ``blocks``
    (each with ``attn``: ``n_head``, ``head_dim``, ``n_kv_head``, ``rotary``, ``wq``, ``wk``) and ``cfg``."""

    family = ""

    def inside_blocks(self) -> str | None:
        """None when the analyses that read inside the blocks (hook points, attention shapes) can read this model;
        else why not (a Hugging Face model measured through its logits only: cemtool.subject.hf.logits_only)."""
        return None

    def hook_points(self) -> dict[str, HookPoint]:
        """Every capture point by name (``blocks.3.attn.v``, ``blocks.3.resid_post``, ...)."""
        return hook_points(self)

    def attention_layers(self) -> tuple[list[AttentionLayer], dict[int, str]]:
        """The layers whose attention the analyses can read (heads, sizes, the query hook point), and for the
        others why not."""
        points = self.hook_points()
        out, skipped = [], {}
        for i, block in enumerate(self.blocks):
            attn, name = block.attn, f"blocks.{i}.attn.q"
            if name not in points:
                skipped[i] = "not applicable: no attention with a blocks.<i>.attn.q hook point"
                continue
            out.append(AttentionLayer(i, attn.n_head, attn.head_dim, attn.n_kv_head, attn.rotary is not None, name))
        return out, skipped

    def qk_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(W_Q, W_K) of a layer, each (heads * d_h, d) with the key rows repeated per query head under grouped
        attention; None where the attention has no such projections."""
        attn = self.blocks[layer].attn
        return attn.wq.weight, attn.wk.weight

    def router(self) -> str | None:
        """The LIMe router's variant (static, softmax, dynamic), None for a model without layer routers."""
        return None

    def routing_weights(self, raw: bool = False) -> dict[int, torch.Tensor] | None:
        """LIMe's mixing weights per layer (see cemtool.models.lime), None without routers."""
        return None

    def experts(self, layer: int) -> tuple[int, int] | None:
        """(experts, experts chosen per token) of a layer whose MLP is a mixture of experts, with its router's hook
        points ``blocks.<layer>.moe.router_logits`` (B, T, E) and ``blocks.<layer>.moe.experts`` (B, T, k); None
        for a dense MLP."""
        return None

    def stream_scalars(self) -> list[dict] | None:
        """The learned scalars of the optimizer streams per layer and substep (momentum family), None elsewhere."""
        return None

    def truncation_note(self) -> str | None:
        """What rank truncation of the score form leaves untouched in this model (CEM's diagonal term), or None."""
        return None

    def parameter_aliases(self) -> dict[str, list[str]]:
        """Other names of each parameter (a Hugging Face model's own), by cemtool name; empty for cemtool's."""
        return {}

    def fixed_parameters(self) -> dict[str, str]:
        """Parameters that are coordinates of the model rather than free parameters (an export's added zeros),
        by name, with the reason: curvature analyses leave them out."""
        return {}


__all__ = ["AttentionLayer", "Capabilities"]
