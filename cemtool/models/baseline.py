"""The pre-norm baseline (METHODS §1): x <- x + Attn(LN x); x <- x + MLP(LN x).

The block reads top to bottom; the backbone (embeddings, final norm, head) is :class:`cemtool.models.lm.LM`.
Hook points: resid_pre, resid_mid, resid_post (B, T, d), plus those of Attention and MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from cemtool.config import ModelConfig
from cemtool.models.allocation import layer_shapes
from cemtool.models.capture import HookPoint
from cemtool.models.layers import MLP, Attention, make_norm, mlp_hidden
from cemtool.models.lm import LM
from cemtool.models.registry import register


def make_attention(cfg: ModelConfig, i: int) -> Attention:
    """The standard attention of layer i, with that layer's allocated heads and head size."""
    n_head, head_dim = layer_shapes(cfg)[i]
    return Attention(cfg.d_model, n_head, head_dim, pos=cfg.pos, max_len=cfg.max_seq_len,
                     rope_base=cfg.rope_base, impl=cfg.attn_impl)


def make_mlp(cfg: ModelConfig) -> MLP:
    return MLP(cfg.d_model, mlp_hidden(cfg.d_model, cfg.mlp, cfg.mlp_hidden), cfg.mlp)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.ln1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, i)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = make_mlp(cfg)
        self.resid_pre, self.resid_mid, self.resid_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resid_pre(x)  # (B, T, d)
        x = self.resid_mid(x + self.attn(self.ln1(x)))  # (B, T, d)
        return self.resid_post(x + self.mlp(self.ln2(x)))  # (B, T, d)


register("baseline", "baseline", LM, description="pre-norm decoder (METHODS §1)")
