"""Tier a: any causal LM transformers builds, measured through its logits alone (docs/models.md "Two tiers").

``sharpness`` and ``forgetting`` need nothing but ``forward(idx) -> logits`` and the parameters, so they run on
every model ``AutoModelForCausalLM`` builds, state-space and hybrid models included, with no adapter: nothing is
remapped, the forward is transformers' own, and the parameters keep the model's own names under ``hf.``
(``hf.model.layers.3.mlp.down_proj.weight``: ``layer:N`` and ``--blocks layer`` find ``layers.N`` / ``h.N``, and
globs take the names as transformers prints them). The analyses that read inside the blocks (collapse-report,
saturation RUN) need the declared family knowledge of :class:`cemtool.subject.hf.adapter.ForeignLM` (tier b) and
refuse a tier-a model by name (:meth:`LogitsLM.inside_blocks`).
"""

from __future__ import annotations

import torch
from torch import nn

from cemtool.config import ModelConfig
from cemtool.errors import CemtoolError
from cemtool.models.capabilities import Capabilities
from cemtool.subject.hf.adapter import check_ids


def _first(config, *names: str, default=None):
    """The first of a config's attributes that is set (families name the same thing differently)."""
    for n in names:
        v = getattr(config, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return default


class LogitsLM(Capabilities, nn.Module):
    """A transformers causal LM seen through its logits: ``forward(idx) -> logits`` (B, T, V), its parameters under
    ``hf.<its own names>``, no hook points."""

    family = "foreign"

    def __init__(self, hf: nn.Module, arch: str, why: str | None = None):
        super().__init__()
        self.hf = hf
        self.why = why  # why the model type's family adapter refused this config, None without an adapter
        self.blocks = nn.ModuleList()  # no block is mapped: tier a reads nothing inside
        self.fixed: dict[str, str] = {}
        self.adapter = "logits only (tier a)"
        self.model_type = str(getattr(hf.config, "model_type", "?"))
        text = getattr(hf.config, "get_text_config", None)
        c = text() if callable(text) else hf.config  # a multimodal config keeps its language model's sizes there
        head = hf.get_output_embeddings()
        vocab = getattr(c, "vocab_size", None) or (head.weight.shape[0] if head is not None else None)
        if not isinstance(vocab, int) or vocab < 1:
            raise CemtoolError(f"model type {self.model_type!r}: no vocabulary size in its config or output layer")
        self.max_seq_len = _first(c, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                                  default=1 << 20)
        d = _first(c, "hidden_size", "d_model", "n_embd", default=1)
        heads = _first(c, "num_attention_heads", "n_head", "num_heads", default=1)
        self.cfg = ModelConfig(arch=arch, n_layer=_first(c, "num_hidden_layers", "n_layer", "num_layers", default=1),
                               d_model=d, n_head=heads if d % heads == 0 else 1, head_dim=0,
                               vocab_size=vocab, max_seq_len=self.max_seq_len, pos="learned",
                               attn_impl="explicit")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V)."""
        check_ids(idx, self.max_seq_len, self.cfg.vocab_size)
        return self.hf(input_ids=idx, use_cache=False).logits  # (B, T, V)

    def inside_blocks(self) -> str | None:
        because = f" ({self.why})" if self.why else ""
        return (f"model type {self.model_type!r} is measured through its logits only{because} (tier a: sharpness "
                f"and forgetting); reading inside its blocks needs a declared adapter (docs/models.md)")

    def parameter_aliases(self) -> dict[str, list[str]]:
        """The transformers names (without the ``hf.`` prefix) of each parameter, so globs take either."""
        return {f"hf.{n}": [n] for n, _ in self.hf.named_parameters()}

    def fixed_parameters(self) -> dict[str, str]:
        return {f"hf.{n}": why for n, why in self.fixed.items()}

    def num_params(self) -> dict[str, int]:
        total = sum(p.numel() for p in self.parameters())
        emb = self.hf.get_input_embeddings()
        n_emb = emb.weight.numel() if emb is not None and hasattr(emb, "weight") else 0
        return {"total": total, "non_embedding": total - n_emb}

    def describe(self) -> dict:
        return {"adapter": self.adapter, "model_type": self.model_type, "layers": self.cfg.n_layer,
                "d_model": self.cfg.d_model, "vocab_size": self.cfg.vocab_size, "max_seq_len": self.max_seq_len,
                "parameters": sum(p.numel() for p in self.parameters())}
