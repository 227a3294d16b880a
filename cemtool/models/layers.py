"""Shared layers: norms, positions, the one attention core, the standard attention and MLP modules.

Every family builds on these. Shapes: B batch, T tokens, d model width, H heads, d_h head size.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cemtool.models.capture import HookPoint

# --------------------------------------------------------------------------------------------------------------
# norms


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)  # (..., d)


def make_norm(kind: str, d: int, eps: float) -> nn.Module:
    """The block's norm layer: 'rmsnorm' or 'layernorm'."""
    return RMSNorm(d, eps) if kind == "rmsnorm" else nn.LayerNorm(d, eps=eps)


# --------------------------------------------------------------------------------------------------------------
# positions


@dataclass
class Context:
    """What a family's body may need besides the residual stream (extend with fields, not globals)."""

    idx: torch.Tensor  # (B, T) token ids


def rope_tables(max_len: int, dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of RoPE for head size ``dim`` (pairs (i, i + dim/2) rotate together)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (dim/2,)
    ang = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]  # (T, dim/2)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate (B, H, T, d_h) by position with tables built for this head size; ``inverse`` applies R^T."""
    T, half = x.shape[-2], x.shape[-1] // 2
    c = cos[:T, :half].to(x.dtype)  # (T, d_h/2)
    s = sin[:T, :half].to(x.dtype)
    if inverse:
        s = -s
    x1, x2 = x[..., :half], x[..., half:]  # (B, H, T, d_h/2) each
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)  # (B, H, T, d_h)


class Rotary(nn.Module):
    """RoPE tables for one head size (non-persistent buffers, rebuilt on load)."""

    def __init__(self, head_dim: int, max_len: int, base: float):
        super().__init__()
        cos, sin = rope_tables(max_len, head_dim, base)
        self.register_buffer("cos", cos, persistent=False)  # (max_len, d_h/2)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return apply_rope(x, self.cos, self.sin, inverse)


# --------------------------------------------------------------------------------------------------------------
# the attention core

_FORCE_IMPL: list[str] = []


@contextmanager
def attention_impl(impl: str) -> Iterator[None]:
    """Force every attention core to ``impl`` ('explicit' or 'fused') inside the context.

    Hessian-vector products need 'explicit': fused kernels cannot be differentiated twice.
    """
    if impl not in ("explicit", "fused"):
        raise ValueError(f"unknown attention impl {impl!r}")
    _FORCE_IMPL.append(impl)
    try:
        yield
    finally:
        _FORCE_IMPL.pop()


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
                     impl: str = "fused", pattern: HookPoint | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal softmax attention, the single core every family uses.

    q, k: (B, H, T, d_qk); v: (B, H, T, d_v) -> (B, H, T, d_v). ``scale`` defaults to 1/sqrt(d_qk).
    ``bias``: optional additive score term (B or 1, H, T, T) before the mask.
    The explicit path computes softmax(q k^T * scale + mask) v and passes the probabilities (B, H, T, T) through
    the ``pattern`` hook point; it is taken when impl == 'explicit', when the pattern is being captured, or inside
    :func:`attention_impl('explicit')`. Both paths give the same output up to float rounding.
    """
    if _FORCE_IMPL:
        impl = _FORCE_IMPL[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "fused" and not (pattern is not None and pattern.active):
        if bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # (B, H, T, d_v)
        T = q.shape[-2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        bias = bias.masked_fill(~mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # True above the diagonal
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B, H, T, T)
    if pattern is not None:
        probs = pattern(probs)
    return probs @ v  # (B, H, T, d_v)


# --------------------------------------------------------------------------------------------------------------
# standard attention and MLP


class Attention(nn.Module):
    """Multi-head causal self-attention with its own head count and head size (per-layer allocation).

    Hook points: q, k, v (B, H, T, d_h) after projection and before RoPE; pattern (B, H, T, T) (explicit path);
    z (B, H, T, d_h) the per-head outputs before the output projection.
    """

    def __init__(self, d_model: int, n_head: int, head_dim: int, *, pos: str, max_len: int, rope_base: float,
                 impl: str):
        super().__init__()
        self.n_head, self.head_dim, self.impl = n_head, head_dim, impl
        self.n_kv_head = n_head  # every query head has its own key/value head
        inner = n_head * head_dim
        self.wq = nn.Linear(d_model, inner, bias=False)
        self.wk = nn.Linear(d_model, inner, bias=False)
        self.wv = nn.Linear(d_model, inner, bias=False)
        self.wo = nn.Linear(inner, d_model, bias=False)
        self.wo.residual_out = True  # init scaled by depth
        self.rotary = Rotary(head_dim, max_len, rope_base) if pos == "rope" else None
        self.q, self.k, self.v = HookPoint(), HookPoint(), HookPoint()
        self.pattern, self.z = HookPoint(), HookPoint()

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        B, H, T, dh = y.shape
        return y.transpose(1, 2).reshape(B, T, H * dh)  # (B, T, H*d_h)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = self.q(self.heads(self.wq(x)))  # (B, H, T, d_h)
        k = self.k(self.heads(self.wk(x)))  # (B, H, T, d_h)
        v = self.v(self.heads(self.wv(x)))  # (B, H, T, d_h)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = causal_attention(q, k, v, impl=self.impl, pattern=self.pattern)  # (B, H, T, d_h)
        return self.wo(self.merge(self.z(y)))  # (B, T, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(*self.project(x))


def mlp_hidden(d_model: int, kind: str, hidden: int) -> int:
    """Default MLP width: 4d for GELU; for SwiGLU the multiple of 16 nearest 8d/3 (about the same parameters)."""
    if hidden:
        return hidden
    if kind == "gelu":
        return 4 * d_model
    return max(16, int(round(8 * d_model / 3 / 16)) * 16)


class MLP(nn.Module):
    """SwiGLU (down(silu(gate x) * up x)) or GELU (down(gelu(up x))). Hook point: hidden (B, T, m)."""

    def __init__(self, d_model: int, hidden: int, kind: str):
        super().__init__()
        self.kind = kind
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.gate = nn.Linear(d_model, hidden, bias=False) if kind == "swiglu" else None
        self.down = nn.Linear(hidden, d_model, bias=False)
        self.down.residual_out = True
        self.hidden = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.up(x)  # (B, T, m)
        else:
            h = F.gelu(self.up(x))  # (B, T, m)
        return self.down(self.hidden(h))  # (B, T, d)
