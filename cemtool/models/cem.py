"""CEM: layers as gradient steps on causal conditional energies (METHODS §2).

Xu et al., "Revisiting Transformer Layer Parameterization Through Causal Energy Minimization". A layer keeps the
context fixed and moves a second variable y by gradient steps on an energy that, at position i, only sees the
context up to i -- so the layer is causal by construction::

    c = LN_c(x)                                   # the context: the layer input, normalised, fixed for the layer
    y = x
    for t in 1..T:                                # cem.steps (T = 1 is a plain layer, the paper used T = 2)
        y = y - eta_att[t] * P_att * dE_att/dg    with g = LN_att(y)     (attention step)
        y = y - eta_mlp[t] * P_mlp * dE_mlp/dg    with g = LN_mlp(y)     (MLP step)
    return y

-dE/dg is what a Transformer sublayer outputs, so each step is a residual update ``y + eta * P * sublayer(g)``.

Attention energy (log-sum-exp), per position i and head h, beta = 1/sqrt(d_h)::

    E_att(y_i | c_<=i) = - sum_h (1/beta) log sum_{j<=i} exp(beta g_i^T A_h c_j),   A_h = W_Q^hT W_K^h
    -dE_att/dg_i       = sum_h A_h sum_j a_ij c_j                                    (a = softmax attention)

i.e. multi-head attention with values = keys (W_V = W_K) and output = W_Q^T. With RoPE the form is
g_i^T W_Q^T R_i^T R_j W_K c_j: the value is the *rotated* key R_j W_K c_j and the output applies R_i^T before W_Q^T,
so the update stays exactly the gradient. DPLR (cem.dplr) adds diag(delta_h): each head's query and key are
extended by d coordinates, q = [R W_Q g ; delta_h * g], k = v = [R W_K c ; c], and the extra output coordinates
are multiplied by delta_h -- still exactly -dE/dg.

Gated MLP energy (element-wise), W (m x d) shared by up and down, gate W_g from the context::

    E_mlp(y; c) = - sum_k (W_g c)_k Phi(w_k^T g),   Phi' = act = SiLU
    -dE_mlp/dg  = W^T (act(W g) * (W_g c))          (SwiGLU with W_down = W_up^T)

With ``model.mlp = "gelu"`` the tied MLP has no gate: E = -sum_k Phi(w_k^T g), update W^T gelu(W g).

Preconditioner (cem.precond_rank = r > 0): P = diag(softplus(p)) + U U^T, positive definite; r = 0 means P = I.

Choices this module makes where the paper is not specific ([recon], all visible here and in the config):

* norms: one context norm LN_c (on the layer input x) and one norm per sublayer for g (LN_att, LN_mlp); every
  recursion step reuses the same norms, projections and preconditioners -- only the step sizes are per step.
* step form: ``y <- y - eta * P * dE/dg`` exactly as METHODS writes it: the gradient is taken w.r.t. g = LN(y)
  and applied to y (a descent step on E as a function of g; in y-space it is one up to the norm's Jacobian).
* step sizes: one learned positive eta per sublayer per step, softplus(raw), raw initialised so eta =
  cem.step_init.
* preconditioner: one P per sublayer (attention, MLP), shared by the steps; p starts at softplus(p) = 1, U at
  N(0, init_std), so P starts close to the identity.
* DPLR delta starts at 0 (the model starts as the plain tied attention).
* gate source: the context c (cem.gate_from_context=True, an exact gradient field); with False the gate is
  computed from g and the update is *not* a gradient field (``CEMMLP.energy`` then holds the gate fixed).
* untied sublayers (cem.tie_attention=False / cem.tie_mlp=False) use the standard modules of
  :mod:`cemtool.models.layers` inside the same step structure (attention queries from g, keys and values from c;
  the MLP on g); those updates are not gradients of any energy and have no ``energy`` method.

Hook points (relative to ``blocks.{i}``): ``resid_pre``, ``context`` (c), ``resid_mid`` (after every attention
step), ``resid_post`` (B, T, d); ``attn.q``, ``attn.k`` (B, H, T, d_h, projections before RoPE), ``attn.v``
(B, H, T, d_h: the value actually averaged, i.e. the key after RoPE; low-rank part only under DPLR),
``attn.pattern`` (B, H, T, T, explicit path), ``attn.z`` (B, H, T, d_h, head outputs before W_Q^T);
``mlp.hidden`` (B, T, m). Points inside the recursion fire once per step (``cache.all(name)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cemtool.config import CEMConfig, ModelConfig
from cemtool.models.allocation import layer_shapes
from cemtool.models.capture import HookPoint
from cemtool.models.layers import MLP, Attention, Rotary, causal_attention, make_norm, mlp_hidden
from cemtool.models.lm import LM
from cemtool.models.registry import register

Act = Callable[[torch.Tensor], torch.Tensor]


def inverse_softplus(y: float) -> float:
    """raw such that softplus(raw) = y (y > 0)."""
    return y + math.log(-math.expm1(-y))


def antiderivative(act: Act, z: torch.Tensor, nodes: int = 32) -> torch.Tensor:
    """Phi(z) = int_0^z act(s) ds by Gauss-Legendre quadrature (exact to float precision for smooth act and
    moderate |z|); used for energies whose Phi has no closed form (SiLU: z softplus(z) + Li2(-e^z))."""
    x, w = np.polynomial.legendre.leggauss(nodes)
    u = torch.tensor((x + 1) / 2, dtype=z.dtype, device=z.device)  # (n,) nodes on [0, 1]
    wt = torch.tensor(w / 2, dtype=z.dtype, device=z.device)  # (n,)
    return z * (act(z[..., None] * u) * wt).sum(-1)  # (..., ) = z * int_0^1 act(z u) du


# --------------------------------------------------------------------------------------------------------------
# attention: the gradient of the log-sum-exp energy (METHODS §2)


class CEMAttention(nn.Module):
    """Tied attention: -dE_att/dg with W_V = W_K, W_O = W_Q^T (and optionally A_h = diag(delta_h) + W_Q^T W_K).

    ``prepare(c)`` computes the keys of the fixed context once per layer; ``update_from(g, keys)`` is -dE/dg.
    ``update(g, c)`` and ``energy(g, c)`` are the one-call forms.
    """

    def __init__(self, d_model: int, n_head: int, head_dim: int, *, pos: str, max_len: int, rope_base: float,
                 impl: str, dplr: bool):
        super().__init__()
        self.n_head, self.head_dim, self.impl = n_head, head_dim, impl
        self.n_kv_head = n_head
        self.beta = 1.0 / math.sqrt(head_dim)
        self.wq = nn.Linear(d_model, n_head * head_dim, bias=False)  # W_Q, also the output projection W_Q^T
        self.wk = nn.Linear(d_model, n_head * head_dim, bias=False)  # W_K, also the value projection
        self.delta = nn.Parameter(torch.zeros(n_head, d_model)) if dplr else None  # (H, d) diagonals
        self.rotary = Rotary(head_dim, max_len, rope_base) if pos == "rope" else None
        self.q, self.k, self.v = HookPoint(), HookPoint(), HookPoint()
        self.pattern, self.z = HookPoint(), HookPoint()

    def cemtool_init(self, std: float) -> None:
        if self.delta is not None:
            nn.init.zeros_(self.delta)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, d_h)

    def rotate(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return x if self.rotary is None else self.rotary(x, inverse=inverse)

    def prepare(self, c: torch.Tensor) -> torch.Tensor:
        """Keys of the context, which are also the values: [R_j W_K c_j ; c_j] -> (B, H, T, d_h [+ d])."""
        k = self.k(self.heads(self.wk(c)))  # (B, H, T, d_h) before RoPE
        k = self.v(self.rotate(k))  # (B, H, T, d_h) the value that attention averages
        if self.delta is not None:
            k = torch.cat([k, c[:, None].expand(-1, self.n_head, -1, -1)], dim=-1)  # (B, H, T, d_h + d)
        return k

    def queries(self, g: torch.Tensor) -> torch.Tensor:
        """[R_i W_Q g_i ; delta_h * g_i] -> (B, H, T, d_h [+ d])."""
        q = self.rotate(self.q(self.heads(self.wq(g))))  # (B, H, T, d_h)
        if self.delta is not None:
            q = torch.cat([q, g[:, None] * self.delta[None, :, None, :]], dim=-1)  # (B, H, T, d_h + d)
        return q

    def update_from(self, g: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """-dE_att/dg (B, T, d) for queries from g and the prepared keys (= values) of the context."""
        B, T, _ = g.shape
        z = causal_attention(self.queries(g), keys, keys, scale=self.beta, impl=self.impl,
                             pattern=self.pattern)  # (B, H, T, d_h [+ d]) = sum_j a_ij k_j
        zl = self.z(self.rotate(z[..., :self.head_dim], inverse=True))  # (B, H, T, d_h) R_i^T sum_j a_ij k_j
        out = zl.transpose(1, 2).reshape(B, T, -1) @ self.wq.weight  # (B, T, d) W_Q^T (...)
        if self.delta is not None:
            out = out + (z[..., self.head_dim:] * self.delta[None, :, None, :]).sum(1)  # (B, T, d)
        return out

    def update(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """-dE_att/dg (B, T, d)."""
        return self.update_from(g, self.prepare(c))

    def energy(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """E_att(g_i | c_<=i) per position (B, T), written out explicitly (no attention kernel)."""
        T = g.shape[1]
        scores = self.beta * (self.queries(g) @ self.prepare(c).transpose(-2, -1))  # (B, H, T, T)
        mask = torch.ones(T, T, dtype=torch.bool, device=g.device).triu(1)
        lse = torch.logsumexp(scores.masked_fill(mask, float("-inf")), dim=-1)  # (B, H, T)
        return -lse.sum(1) / self.beta  # (B, T)


class UntiedAttention(Attention):
    """The standard attention (own W_V, W_O) in the CEM step structure: queries from g, keys/values from c.
    Not the gradient of an energy."""

    def prepare(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.k(self.heads(self.wk(c)))  # (B, H, T, d_h)
        v = self.v(self.heads(self.wv(c)))  # (B, H, T, d_h)
        return k, v

    def update_from(self, g: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = self.q(self.heads(self.wq(g)))  # (B, H, T, d_h)
        return self.attend(q, *kv)  # (B, T, d)

    def update(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self.update_from(g, self.prepare(c))


# --------------------------------------------------------------------------------------------------------------
# MLP: the gradient of the element-wise gated energy (METHODS §2)


class CEMMLP(nn.Module):
    """Tied MLP: -dE_mlp/dg = W^T (act(W g) * s), s = W_g c (gated) or 1 (ungated, GELU).

    ``act`` is SiLU for the gated form and GELU for the ungated one unless given (tests pass closed-form ones).
    """

    def __init__(self, d_model: int, hidden: int, *, gated: bool = True, gate_from_context: bool = True,
                 act: Act | None = None):
        super().__init__()
        self.gate_from_context = gate_from_context
        self.act = act or (F.silu if gated else F.gelu)
        self.up = nn.Linear(d_model, hidden, bias=False)  # W (m x d), also the down projection W^T
        self.gate = nn.Linear(d_model, hidden, bias=False) if gated else None  # W_g
        self.hidden = HookPoint()

    def prepare(self, c: torch.Tensor) -> torch.Tensor | None:
        """The gate of the fixed context, W_g c (B, T, m), once per layer (None when it comes from g or is 1)."""
        return self.gate(c) if self.gate is not None and self.gate_from_context else None

    def gate_for(self, g: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor | float:
        if self.gate is None:
            return 1.0
        return gate if gate is not None else self.gate(g)  # (B, T, m)

    def update_from(self, g: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        h = self.hidden(self.act(self.up(g)) * self.gate_for(g, gate))  # (B, T, m)
        return h @ self.up.weight  # (B, T, d) = W^T h

    def update(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """-dE_mlp/dg (B, T, d) (a gradient field only when the gate comes from c)."""
        return self.update_from(g, self.prepare(c))

    def energy(self, g: torch.Tensor, c: torch.Tensor, Phi: Act | None = None) -> torch.Tensor:
        """E_mlp per position (B, T) = -sum_k s_k Phi(w_k^T g); Phi defaults to the quadrature antiderivative of
        act. With the gate from g, s is detached (held fixed), so ``update`` is not -dE/dg there."""
        Phi = Phi or (lambda z: antiderivative(self.act, z))
        s = self.gate_for(g, self.prepare(c))
        if isinstance(s, torch.Tensor) and not self.gate_from_context:
            s = s.detach()
        return -(s * Phi(self.up(g))).sum(-1)  # (B, T)


class UntiedMLP(MLP):
    """The standard MLP (own down projection, gate from g) in the CEM step structure; not a gradient field."""

    def prepare(self, c: torch.Tensor) -> None:
        return None

    def update_from(self, g: torch.Tensor, _: None) -> torch.Tensor:
        return self(g)  # (B, T, d)

    def update(self, g: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return self(g)


# --------------------------------------------------------------------------------------------------------------
# the preconditioner and the block


class Preconditioner(nn.Module):
    """P = diag(softplus(p)) + U U^T (d x d, positive definite); ``forward(v)`` = P v on the last axis."""

    def __init__(self, d_model: int, rank: int):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(d_model))  # (d,) raw diagonal
        self.U = nn.Parameter(torch.zeros(d_model, rank))  # (d, r)

    def cemtool_init(self, std: float) -> None:
        nn.init.constant_(self.p, inverse_softplus(1.0))
        nn.init.normal_(self.U, 0.0, std)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        return F.softplus(self.p) * v + (v @ self.U) @ self.U.T  # (..., d)

    def matrix(self) -> torch.Tensor:
        return torch.diag(F.softplus(self.p)) + self.U @ self.U.T  # (d, d)


def make_cem_attention(cfg: ModelConfig, i: int) -> CEMAttention | UntiedAttention:
    n_head, head_dim = layer_shapes(cfg)[i]
    kw = dict(pos=cfg.pos, max_len=cfg.max_seq_len, rope_base=cfg.rope_base, impl=cfg.attn_impl)
    if cfg.cem.tie_attention:
        return CEMAttention(cfg.d_model, n_head, head_dim, dplr=cfg.cem.dplr, **kw)
    return UntiedAttention(cfg.d_model, n_head, head_dim, **kw)


def make_cem_mlp(cfg: ModelConfig) -> CEMMLP | UntiedMLP:
    hidden = mlp_hidden(cfg.d_model, cfg.mlp, cfg.mlp_hidden)
    if cfg.cem.tie_mlp:
        return CEMMLP(cfg.d_model, hidden, gated=cfg.mlp == "swiglu", gate_from_context=cfg.cem.gate_from_context)
    return UntiedMLP(cfg.d_model, hidden, cfg.mlp)


class CEMBlock(nn.Module):
    """One CEM layer: T steps of (attention step, MLP step) on y, with the context c = LN_c(x) fixed."""

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        cem: CEMConfig = cfg.cem
        self.steps, self.step_init = cem.steps, cem.step_init
        self.ln_c = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)  # context norm (layer input)
        self.ln_attn = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)  # g for the attention steps
        self.ln_mlp = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)  # g for the MLP steps
        self.attn = make_cem_attention(cfg, i)
        self.mlp = make_cem_mlp(cfg)
        r = cem.precond_rank
        self.precond_attn = Preconditioner(cfg.d_model, r) if r else None
        self.precond_mlp = Preconditioner(cfg.d_model, r) if r else None
        self.eta_attn_raw = nn.Parameter(torch.zeros(cem.steps))  # (T,) eta = softplus(raw)
        self.eta_mlp_raw = nn.Parameter(torch.zeros(cem.steps))  # (T,)
        self.resid_pre, self.context, self.resid_mid, self.resid_post = (HookPoint(), HookPoint(), HookPoint(),
                                                                         HookPoint())

    def cemtool_init(self, std: float) -> None:
        nn.init.constant_(self.eta_attn_raw, inverse_softplus(self.step_init))
        nn.init.constant_(self.eta_mlp_raw, inverse_softplus(self.step_init))

    def step_sizes(self) -> dict[str, torch.Tensor]:
        """The learned positive step sizes eta_t of each sublayer, (T,) each."""
        return {"attn": F.softplus(self.eta_attn_raw), "mlp": F.softplus(self.eta_mlp_raw)}

    @staticmethod
    def precondition(P: Preconditioner | None, v: torch.Tensor) -> torch.Tensor:
        return v if P is None else P(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.resid_pre(x)  # (B, T, d)
        c = self.context(self.ln_c(x))  # (B, T, d) fixed for the whole layer
        keys, gate = self.attn.prepare(c), self.mlp.prepare(c)  # context-side work, once
        eta = self.step_sizes()
        y = x
        for t in range(self.steps):
            u = self.attn.update_from(self.ln_attn(y), keys)  # (B, T, d) = -dE_att/dg
            y = self.resid_mid(y + eta["attn"][t] * self.precondition(self.precond_attn, u))  # (B, T, d)
            u = self.mlp.update_from(self.ln_mlp(y), gate)  # (B, T, d) = -dE_mlp/dg
            y = y + eta["mlp"][t] * self.precondition(self.precond_mlp, u)  # (B, T, d)
        return self.resid_post(y)


class CEMLM(LM):
    """The CEM language model: the shared backbone with :class:`CEMBlock` layers."""

    family = "cem"

    def make_block(self, i: int) -> nn.Module:
        return CEMBlock(self.cfg, i)

    def truncation_note(self) -> str | None:
        if self.cfg.cem.dplr:
            return "CEM dplr: only the low-rank part W_Qᵀ W_K is truncated; the diagonal term stays"
        return None


def _preset(**cem) -> dict:
    return {"model": {"cem": cem}}


register("cem", "cem", CEMLM, preset=_preset(),
         description="CEM: tied attention + tied gated MLP as one energy-gradient step per layer (METHODS §2)")
register("cem-dplr", "cem", CEMLM, preset=_preset(dplr=True),
         description="CEM with diagonal-plus-low-rank interaction A_h = diag(delta_h) + W_Q^T W_K")
register("cem-precond", "cem", CEMLM, preset=_preset(precond_rank=4),
         description="CEM with a learned preconditioner P = diag(softplus(p)) + U U^T, rank 4")
register("cem-rec2", "cem", CEMLM, preset=_preset(steps=2),
         description="CEM with two recursive energy steps per layer (shared weights)")
register("cem-full", "cem", CEMLM, preset=_preset(dplr=True, precond_rank=4, steps=2),
         description="CEM with DPLR, rank-4 preconditioner and two recursive steps")
register("cem-untied", "cem", CEMLM, preset=_preset(tie_attention=False, tie_mlp=False),
         description="CEM step structure with standard untied attention and MLP (not energy gradients)")
register("cem-selfgate", "cem", CEMLM, preset=_preset(gate_from_context=False),
         description="CEM with the MLP gate computed from g instead of the context (not a gradient field)")
