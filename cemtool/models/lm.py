"""The decoder-only language-model backbone every family shares.

``LM`` owns the token (and learned position) embeddings, the list of blocks, the final norm and the head.
A family subclasses it and overrides :meth:`LM.make_block` (what one layer is: by default the baseline's pre-norm
:class:`Block`, METHODS §1) and, when layers exchange more than the residual stream (momentum streams, LIMe's
memory of earlier layers), :meth:`LM.body`. :func:`make_attention` and :func:`make_mlp` are the standard
sublayers other families reuse.
Module names are therefore the same in every family: ``blocks.3.attn.wq``, ``blocks.3.resid_post``, ...
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from cemtool.config import ModelConfig
from cemtool.errors import CemtoolError
from cemtool.models.allocation import layer_shapes
from cemtool.models.capabilities import Capabilities
from cemtool.models.capture import HookPoint
from cemtool.models.layers import MLP, Attention, Context, attention_impl, make_norm, mlp_hidden


def make_attention(cfg: ModelConfig, i: int) -> Attention:
    """The standard attention of layer i, with that layer's allocated heads and head size."""
    n_head, head_dim = layer_shapes(cfg)[i]
    return Attention(cfg.d_model, n_head, head_dim, pos=cfg.pos, max_len=cfg.max_seq_len,
                     rope_base=cfg.rope_base, impl=cfg.attn_impl)


def make_mlp(cfg: ModelConfig) -> MLP:
    return MLP(cfg.d_model, mlp_hidden(cfg.d_model, cfg.mlp, cfg.mlp_hidden), cfg.mlp)


class Block(nn.Module):
    """The baseline's pre-norm layer: x <- x + Attn(LN x); x <- x + MLP(LN x)."""

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


class LM(Capabilities, nn.Module):
    """Token embedding -> blocks -> final norm -> LM head. ``forward(idx) -> logits``. What analyses may ask of it:
    :class:`cemtool.models.capabilities.Capabilities`."""

    family = "baseline"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1 or cfg.max_seq_len < 1:
            raise ValueError("ModelConfig.vocab_size and max_seq_len must be resolved before building a model")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.embed = HookPoint()  # (B, T, d) the input to the first block
        self.blocks = nn.ModuleList([self.make_block(i) for i in range(cfg.n_layer)])
        self.ln_f = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.final = HookPoint()  # (B, T, d) after the final norm
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    # -- what a family overrides --------------------------------------------------------------------------------

    def make_block(self, i: int) -> nn.Module:
        return Block(self.cfg, i)

    def body(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        return x

    # -- shared ---------------------------------------------------------------------------------------------------

    def init_weights(self) -> None:
        """Normal(0, init_std) for matrices and embeddings; residual output projections get
        init_std / sqrt(2 n_layer) (GPT-2); modules with a ``cemtool_init(std)`` method then set their own."""
        std = self.cfg.init_std
        for m in self.modules():
            if isinstance(m, nn.Linear):
                s = std / math.sqrt(2 * self.cfg.n_layer) if getattr(m, "residual_out", False) else std
                nn.init.normal_(m.weight, 0.0, s)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, std)
        for m in self.modules():
            if m is not self and hasattr(m, "cemtool_init"):
                m.cemtool_init(std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V)."""
        B, T = idx.shape
        if T > self.cfg.max_seq_len:
            raise CemtoolError(f"sequence of {T} tokens is longer than the model's max_seq_len "
                               f"{self.cfg.max_seq_len}")
        x = self.tok_emb(idx)  # (B, T, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))  # (B, T, d)
        x = self.body(self.embed(x), Context(idx=idx))  # (B, T, d)
        return self.head(self.final(self.ln_f(x)))  # (B, T, V)

    def num_params(self) -> dict[str, int]:
        """Total parameters (shared tensors once) and non-embedding parameters (total minus token, position and
        any other embedding tables; an untied LM head is counted, since it is a matmul per token)."""
        seen, total, emb = set(), 0, 0
        for _name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
        for m in self.modules():
            if isinstance(m, nn.Embedding):
                emb += m.weight.numel()
        return {"total": total, "non_embedding": total - emb}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in nats: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]) if logits.dtype != torch.float64
                           else logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction=reduction)


def flops_per_token(model: LM, seq_len: int) -> dict[str, float]:
    """FLOPs per token of one forward and one training step (forward + backward), counted by
    ``torch.utils.flop_counter`` on a batch of one sequence of ``seq_len`` tokens: every matmul, including the
    attention scores and the family's extra products (Newton-Schulz, routers); attention counted as dense T x T
    (what the kernels compute), element-wise work not counted."""
    was_training = model.training
    device = next(model.parameters()).device
    idx = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    model.train()
    fwd, bwd = FlopCounterMode(display=False), FlopCounterMode(display=False)
    with attention_impl("explicit"):  # the CPU's fused kernel is invisible to the counter
        with fwd:
            logits = model(idx)  # (1, T, V)
        with bwd:  # the backward of that one forward, counted apart (one forward fewer than counting both again)
            logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    f, b = fwd.get_total_flops(), bwd.get_total_flops()
    return {"forward": f / seq_len, "train": (f + b) / seq_len}
