"""LIMe, Layer-Integrated Memory (METHODS §5): attention that reads keys and values from every earlier layer.

Gerasimov et al., "You Do Not Fully Utilize Transformer's Representation Capacity" (arXiv 2502.09245; reference
code github.com/corl-team/lime). Three routers, chosen by ``model.lime.variant`` and registered as ``lime``
(static), ``lime-softmax`` and ``lime-dynamic``. The block is the pre-norm baseline block; only where the keys and
values of its attention come from changes. Layer 0 has nothing earlier to read: in every variant it is the
baseline attention.

static (the current version)
    Every layer l projects its own keys and values K_l, V_l (B, R_l, T, d_h) from LN(x) as the baseline does, and
    the model keeps them all. Layer l >= 1 attends, for kv-head r, with the mix
        [K~; V~]_{l,r} = sum_{m<=l} sum_h W^(l)[r, off_m + h] [K; V]_{m,h},   off_m = R_0 + ... + R_{m-1}
    (off_m = m R when every layer has R heads): one matrix W^(l) (R_l, R_0 + ... + R_l) for keys and values,
    every head of every layer so far, no normalisation, weights may be negative. Routing happens after the K/V
    projections and before RoPE (``Attention.attend`` rotates the routed keys).
    Init (METHODS, as the reference): uniform +-sqrt(3 / fan_in), fan_in = R_0 + ... + R_l, then the current
    layer's block (the last R_l columns) set to the identity. The earlier blocks therefore start random, not zero:
    a fresh LIMe model already mixes layers. With the earlier blocks zero it is the baseline exactly (tested).
    Keys of different sizes cannot be added, so all layers must share one head size (ConfigError otherwise);
    head counts may differ (explicit ``model.heads``), W^(l) is then R_l x (R_0 + ... + R_l).

softmax (earlier version) [recon: the exact form is not in the sources we had]
    h_m is the input of block m: h_0 the embeddings, h_m the output of block m-1, for m = 0..l. Layer l >= 1 has
    an extra norm N_l (the block's norm type) and logits w^(l) (H_l, l+1); head h forms its key/value input
        X_{l,h} = sum_{m<=l} softmax_m(w^(l)_h)[m] N_l(h_m)      (B, T, d)
    and projects it with that head's slices of W_K and W_V. Queries come from LN(h_l) as in the baseline. The
    logits start at zero: a uniform mix over layers [recon: init not stated].

dynamic (earlier version) [recon]
    as softmax, with per-token weights softmax_m(Linear(N_l(h_l))) (B, T, H_l, l+1) from a router
    Linear(d -> (l+1) H_l) on the current state (initialised like every Linear: normal(0, init_std), so the mix
    starts near uniform). Each position only reads its own states h_m[t], which only see tokens <= t: causal.

Router parameters (W^(l), the logits, the dynamic router's matrix) are tagged for their own AdamW group:
``p.opt_group = "router"``, ``p.lr_mult = lime.router_lr_mult`` (10 in the reference), ``p.weight_decay = 0``;
``lime.router_lr`` sets an absolute rate instead (the reference code's 1e-2), and ``lime.freeze_router`` keeps the
routers at their random initialisation (the control of what their training adds).

Hook points of block l, besides resid_pre/resid_mid/resid_post and the attention's:
  lime.weights  static: W^(l) (R_l, R_0+...+R_l), the identity at l = 0; softmax: the mix (H, l+1); dynamic: the
                per-token mix (B, T, H, l+1); at l = 0 ones.
  lime.v_own    (B, H, T, d_h) the layer's own values LN(h_l) W_V before routing. Static: what it contributes to
                the memory; softmax/dynamic: what a baseline layer would attend with (computed only when captured).
  attn.k, attn.v  the routed keys and values the layer attends with (before RoPE); attn.q its queries.
:meth:`LimeLM.routing_weights` returns the mixing weights per layer (static: the router parameters themselves).
"""

from __future__ import annotations

import math
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import nn

from cemtool.config import ModelConfig
from cemtool.errors import CemtoolError, ConfigError
from cemtool.models.allocation import layer_shapes
from cemtool.models.capture import HookPoint
from cemtool.models.layers import Attention, Context, make_norm
from cemtool.models.lm import LM, make_attention, make_mlp
from cemtool.models.registry import register


@dataclass
class Memory:
    """What the layers so far leave for the next: own keys/values (static) or block inputs (softmax, dynamic)."""

    kv: list[torch.Tensor] = field(default_factory=list)  # per layer (B, R_m, T, 2 d_h): [K_m | V_m]
    hidden: list[torch.Tensor] = field(default_factory=list)  # per layer h_m (B, T, d)


def router_param(p: nn.Parameter, cfg: ModelConfig) -> nn.Parameter:
    """Tag a router parameter for its own optimizer group (read by cemtool.optim.param_groups): its lr is
    ``lime.router_lr`` when set (absolute, ``p.lr_abs``), else ``lime.router_lr_mult`` x train.lr; with
    ``lime.freeze_router`` it takes no gradient and keeps its initialisation."""
    p.opt_group = "router"
    p.lr_mult = cfg.lime.router_lr_mult
    if cfg.lime.router_lr > 0:
        p.lr_abs = cfg.lime.router_lr
    p.weight_decay = 0.0
    if cfg.lime.freeze_router:
        p.requires_grad_(False)
    return p


def own_kv(attn: Attention, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's own keys and values from its normalised input a (B, T, d), as the baseline projects them."""
    return attn.heads(attn.wk(a)), attn.heads(attn.wv(a))  # (B, R, T, d_h) each


def head_project(linear: nn.Linear, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-head projection of per-head inputs: x (B, H, T, d), head h uses rows h*d_h:(h+1)*d_h of the weight."""
    H, d = x.shape[1], x.shape[-1]
    w = linear.weight.view(H, head_dim, d)  # (H, d_h, d)
    return torch.einsum("bhtd,hed->bhte", x, w)  # (B, H, T, d_h)


# --------------------------------------------------------------------------------------------------------------
# routers: (attention, LN(x), x, memory) -> routed keys and values (B, H, T, d_h), before RoPE


class StaticRouter(nn.Module):
    """One learned matrix W^(l) mixes the keys and values of every head of layers 0..l."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        heads = [h for h, _ in layer_shapes(cfg)[: i + 1]]
        self.n_out, self.fan_in = heads[-1], sum(heads)
        self.weight = router_param(nn.Parameter(torch.empty(self.n_out, self.fan_in)), cfg) if i > 0 else None
        self.weights, self.v_own = HookPoint(), HookPoint()

    def extra_repr(self) -> str:
        return f"heads={self.n_out}, fan_in={self.fan_in}"

    def cemtool_init(self, std: float) -> None:
        if self.weight is None:
            return
        bound = math.sqrt(3.0 / self.fan_in)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            self.weight[:, -self.n_out:] = torch.eye(self.n_out)

    def forward(self, attn: Attention, a: torch.Tensor, x: torch.Tensor,
                memory: Memory) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = own_kv(attn, a)  # (B, R, T, d_h) each
        v = self.v_own(v)
        memory.kv.append(torch.cat([k, v], dim=-1))  # (B, R, T, 2 d_h)
        if self.weight is None:
            if self.weights.active:
                self.weights(torch.eye(self.n_out, device=k.device, dtype=k.dtype))
            return k, v
        kv = torch.cat(memory.kv, dim=1)  # (B, fan_in, T, 2 d_h): layers 0..l, heads in order
        kv = torch.einsum("rj,bjtd->brtd", self.weights(self.weight), kv)  # (B, R, T, 2 d_h)
        return kv.split(attn.head_dim, dim=-1)  # (B, R, T, d_h) each


class HiddenRouter(nn.Module, metaclass=ABCMeta):
    """Per-head mix of the normalised block inputs h_0..h_l, then that head's K/V projection (softmax, dynamic)."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.n_head, self.n_src = layer_shapes(cfg)[i][0], i + 1
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps) if i > 0 else None
        self.weights, self.v_own = HookPoint(), HookPoint()

    @abstractmethod
    def probs(self, x: torch.Tensor) -> torch.Tensor:
        """The mix over layers: (H, l+1) or per token (B, T, H, l+1); rows sum to 1 (each subclass defines it)."""

    def forward(self, attn: Attention, a: torch.Tensor, x: torch.Tensor,
                memory: Memory) -> tuple[torch.Tensor, torch.Tensor]:
        memory.hidden.append(x)  # h_l (B, T, d)
        if self.norm is None:  # layer 0: the baseline attention
            k, v = own_kv(attn, a)  # (B, H, T, d_h) each
            if self.weights.active:
                self.weights(torch.ones(self.n_head, 1, device=x.device, dtype=x.dtype))
            return k, self.v_own(v)
        if self.v_own.active:
            self.v_own(attn.heads(attn.wv(a)))  # (B, H, T, d_h), not used by the layer
        p = self.weights(self.probs(x))  # (H, S) or (B, T, H, S), S = l+1
        src = torch.stack([self.norm(h) for h in memory.hidden], dim=2)  # (B, T, S, d)
        if p.dim() == 2:
            mixed = torch.einsum("hs,btsd->bhtd", p, src)  # (B, H, T, d)
        else:
            mixed = torch.einsum("bths,btsd->bhtd", p, src)  # (B, H, T, d)
        k = head_project(attn.wk, mixed, attn.head_dim)  # (B, H, T, d_h)
        v = head_project(attn.wv, mixed, attn.head_dim)  # (B, H, T, d_h)
        return k, v


class SoftmaxRouter(HiddenRouter):
    """Static per-head softmax over layers: logits w^(l) (H, l+1), zero at init (uniform mix)."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.logits = router_param(nn.Parameter(torch.zeros(self.n_head, self.n_src)), cfg) if i > 0 else None

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits, dim=-1)  # (H, S)


class DynamicRouter(HiddenRouter):
    """Per-token softmax over layers from Linear(d -> (l+1) H) on the current state N_l(h_l)."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__(cfg, i)
        self.proj = nn.Linear(cfg.d_model, self.n_src * self.n_head, bias=False) if i > 0 else None
        if self.proj is not None:
            router_param(self.proj.weight, cfg)

    def probs(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        logits = self.proj(self.norm(x)).view(B, T, self.n_head, self.n_src)  # (B, T, H, S)
        return torch.softmax(logits, dim=-1)  # (B, T, H, S)


ROUTERS = {"static": StaticRouter, "softmax": SoftmaxRouter, "dynamic": DynamicRouter}


# --------------------------------------------------------------------------------------------------------------
# the block and the model


class LimeBlock(nn.Module):
    """The pre-norm block whose attention takes its keys and values from the router (same parameter names as
    the baseline Block, plus ``lime``)."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.ln1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, i)
        self.lime = ROUTERS[cfg.lime.variant](cfg, i)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = make_mlp(cfg)
        self.resid_pre, self.resid_mid, self.resid_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor, memory: Memory) -> torch.Tensor:
        x = self.resid_pre(x)  # (B, T, d)
        a = self.ln1(x)  # (B, T, d)
        attn = self.attn
        q = attn.q(attn.heads(attn.wq(a)))  # (B, H, T, d_h)
        k, v = self.lime(attn, a, x, memory)  # (B, H, T, d_h) each, routed, before RoPE
        x = self.resid_mid(x + attn.attend(q, attn.k(k), attn.v(v)))  # (B, T, d)
        return self.resid_post(x + self.mlp(self.ln2(x)))  # (B, T, d)


def check_config(cfg: ModelConfig) -> None:
    """The static router adds keys of different layers: one head size for all layers."""
    dims = sorted({d for _, d in layer_shapes(cfg)})
    if cfg.lime.variant == "static" and len(dims) > 1:
        raise ConfigError(f"LIMe's static router mixes keys across layers and needs one head size, got head sizes "
                          f"{[d for _, d in layer_shapes(cfg)]} (model.alloc_strategy={cfg.alloc_strategy}, "
                          f"model.head_dims={list(cfg.head_dims)})")


class LimeLM(LM):
    """The LM whose layers carry a memory of earlier layers (keys/values or hidden states) to the next."""

    family = "lime"

    def __init__(self, cfg: ModelConfig):
        check_config(cfg)
        super().__init__(cfg)

    def make_block(self, i: int) -> nn.Module:
        return LimeBlock(self.cfg, i)

    def body(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        memory = Memory()
        for block in self.blocks:
            x = block(x, memory)  # (B, T, d)
        return x

    def router(self) -> str:
        return self.cfg.lime.variant

    def routing_weights(self, raw: bool = False) -> dict[int, torch.Tensor]:
        """Mixing weights per layer, detached copies: static W^(l) (the router parameter itself; the identity at
        layer 0), softmax the mix softmax(w^(l)) (H, l+1) (ones at layer 0). ``raw``: only the router parameters
        (W^(l), or the logits w^(l)) of layers l >= 1. The dynamic router's weights depend on the tokens: capture
        ``blocks.*.lime.weights`` instead."""
        variant = self.cfg.lime.variant
        if variant == "dynamic":
            raise CemtoolError("the dynamic LIMe router has per-token weights, not one matrix per layer",
                               hint="capture blocks.*.lime.weights during a forward pass")
        out = {}
        ref = self.head.weight  # device and dtype of the model
        for i, block in enumerate(self.blocks):
            r = block.lime
            p = r.weight if variant == "static" else r.logits
            if p is not None:
                out[i] = (p if raw or variant == "static" else torch.softmax(p, dim=-1)).detach().clone()
            elif not raw and variant == "static":
                out[i] = torch.eye(r.n_out, device=ref.device, dtype=ref.dtype)
            elif not raw:
                out[i] = torch.ones(r.n_head, 1, device=ref.device, dtype=ref.dtype)
        return out

register("lime", "lime", LimeLM, preset={"model": {"lime": {"variant": "static"}}},
         description="LIMe: static router mixing every earlier layer's keys/values per head (METHODS §5)")
register("lime-softmax", "lime", LimeLM, preset={"model": {"lime": {"variant": "softmax"}}},
         description="LIMe (earlier version): per-head softmax over earlier hidden states (METHODS §5)")
register("lime-dynamic", "lime", LimeLM, preset={"model": {"lime": {"variant": "dynamic"}}},
         description="LIMe (earlier version): per-token softmax router over earlier hidden states (METHODS §5)")
