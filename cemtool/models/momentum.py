"""Optimizer-inspired Transformers with momentum streams (METHODS §3).

A pre-norm layer is read as one step of an optimizer on a surrogate token energy whose gradient oracle is a
sublayer, g = O(LN x) with O in {Attn, MLP}. Each layer takes two substeps, attention then MLP (Lie–Trotter
splitting); each substep has its own learned scalars and its own stream norms (LN_v, LN_u). Extra state streams
(velocity v, moments m and s, preconditioner R) are carried through all 2·n_layer substeps, from layer to layer:

    vanilla   x <- x + g                                                      (the baseline model itself)
    hb        v <- LN_v(beta v + gamma g);                 x <- x + v
    nesterov  v <- LN_v(beta v + gamma O(LN(x + mu v)));   x <- x + v
    tmm       as nesterov;                                  x <- x + nu v
    adam      m <- b1 m + (1-b1) g;  s <- b2 s + (1-b2) g^2;   x <- x + gamma LN_u(m / (sqrt(s) + 1e-8))
    adamw     as adam;                                      x <- (1 - lambda) x + gamma LN_u(...)
    rmsprop   adam without m (u = g / (sqrt(s) + 1e-8))
    muon      m <- beta m + (1-beta) g;                     x <- x + gamma LN_u(NS(m as (H, d_h)))
    ortho     muon without m
    soap      M <- b1 M + (1-b1) G;  R <- bR R + (1-bR) G^T G;  x <- x + gamma LN_u(M R^{-1/2})   (G = g as (H, d_h))
    shampoo   soap without M (U = G R^{-1/2})

Choices made here (METHODS leaves them open; each is also stated where it is implemented):

- Learned scalars: beta, beta1, beta2 (= beta_R for soap/shampoo), mu, lambda are sigmoid(raw) in (0, 1); gamma and
  nu are softplus(raw) > 0. Raw inits follow METHODS ("0 unless stated"): beta = mu = 1/2, gamma = log 2; nu's raw
  is log(e - 1) = 0.5413 so nu = 1; lambda's raw is -5 (lambda = 0.0067). See :data:`RAW_INIT`.
- One set of streams is shared by the attention and the MLP substeps (an optimizer has one state; the splitting
  only alternates the oracle), and carried across layers.
- Matrix view of a d-vector (muon, ortho, soap, shampoo): (H, d/H) with H = ``model.n_head``. For the attention
  substep of muon/ortho this is the layer's own head layout whenever that layout tiles d (always, with the default
  uniform allocation); the MLP substep uses (n_head, d/n_head). soap/shampoo carry R (d_h x d_h) across layers and
  substeps, so they use the model-wide (n_head, d/n_head) everywhere. See :func:`matrix_layout`.
- Stream init "embed": v and m (also soap's M) start from their own learned token + position embeddings; s starts
  at ones and R at the identity in both modes, as in the reference implementation (METHODS: "s starts at ones",
  "R starts at I"; a table for s would add (V + T) d parameters the reference does not have). "zero": v, m = 0,
  s = 1, R = I. So rmsprop, shampoo and ortho have no extra parameters in either mode.
- soap/shampoo preconditioner math (R update, Newton iterations) runs in at least float32, outside autocast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cemtool.config import ModelConfig
from cemtool.errors import ConfigError
from cemtool.models.allocation import layer_shapes
from cemtool.models.capture import HookPoint
from cemtool.models.layers import Context, make_norm
from cemtool.models.lm import LM, make_attention, make_mlp
from cemtool.models.registry import register

VARIANTS = ("vanilla", "hb", "nesterov", "tmm", "adam", "adamw", "rmsprop", "muon", "ortho", "soap", "shampoo")

SOFTPLUS_ONE = math.log(math.e - 1.0)  # 0.5413...: softplus(SOFTPLUS_ONE) = 1

# the learned scalars of one substep, in the order the ``scalars`` hook point reports them
SCALARS: dict[str, tuple[str, ...]] = {
    "hb": ("beta", "gamma"),
    "nesterov": ("mu", "beta", "gamma"),
    "tmm": ("mu", "beta", "gamma", "nu"),
    "adam": ("beta1", "beta2", "gamma"),
    "adamw": ("beta1", "beta2", "gamma", "lambda"),
    "rmsprop": ("beta2", "gamma"),
    "muon": ("beta", "gamma"),
    "ortho": ("gamma",),
    "soap": ("beta1", "beta2", "gamma"),  # beta2 is soap's beta_R (the EMA of the preconditioner G^T G)
    "shampoo": ("beta2", "gamma"),
}
POSITIVE = ("gamma", "nu")  # softplus(raw) > 0; every other scalar is sigmoid(raw) in (0, 1)
RAW_INIT = {"mu": 0.0, "beta": 0.0, "beta1": 0.0, "beta2": 0.0, "gamma": 0.0, "nu": SOFTPLUS_ONE, "lambda": -5.0}

# the streams each variant carries: v, m (B, T, d); s (B, T, d) positive; R (B, T, d_h, d_h) SPD
STREAMS: dict[str, tuple[str, ...]] = {
    "hb": ("v",), "nesterov": ("v",), "tmm": ("v",), "adam": ("m", "s"), "adamw": ("m", "s"), "rmsprop": ("s",),
    "muon": ("m",), "ortho": (), "soap": ("m", "R"), "shampoo": ("R",),
}
EMBEDDED = ("v", "m")  # streams that get learned token + position embeddings with stream_init="embed"

NS_COEFFS = (3.4445, -4.7750, 2.0315)
ADAM_EPS = 1e-8
PRECOND_EPS = 1e-6


# --------------------------------------------------------------------------------------------------------------
# the pure math


def newton_schulz(Y: torch.Tensor, steps: int = 5, coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise a batch of matrices (..., n, k) (METHODS §3, muon).

    Y is first divided by its Frobenius norm (+ eps), so every singular value is <= 1; then ``steps`` quintic
    iterations Y <- Y (a I + b A + c A^2), A = Y^T Y. Each iteration keeps the singular vectors and maps every
    singular value through p(s) = a s + b s^3 + c s^5, which for the default coefficients pushes them into a band
    around 1 (not exactly 1: the quintic trades accuracy for speed). Since Y (Y^T Y)^j = (Y Y^T)^j Y, the code
    forms the Gram matrix on the smaller side: A = Y Y^T (n x n) and Y <- (a I + b A + c A^2) Y when n <= k.
    """
    a, b, c = coeffs
    Y = Y / (torch.linalg.matrix_norm(Y, keepdim=True) + eps)  # (..., n, k), ||Y||_F <= 1
    wide = Y.shape[-2] <= Y.shape[-1]
    if not wide:
        Y = Y.mT  # (..., k, n): now the short side comes first
    for _ in range(steps):
        A = Y @ Y.mT  # (..., n, n) the small Gram matrix
        Y = a * Y + (b * A + c * (A @ A)) @ Y  # (..., n, k)
    return Y if wide else Y.mT


def inv_sqrt_newton(R: torch.Tensor, steps: int = 10, eps: float = PRECOND_EPS) -> torch.Tensor:
    """(R + eps I)^{-1/2} of a batch of SPD matrices (..., n, n) by Newton's iteration (METHODS §3, soap).

    R_hat = (R + eps I) / ||R + eps I||_F has eigenvalues in (0, 1]. METHODS' iteration is X <- 1/2 X (3I - X R_hat X)
    from X = I; the result is X / sqrt(||R + eps I||_F). An eigenvalue r of R_hat grows X's matching eigenvalue by
    at most 1.5 per step until it nears r^{-1/2}, then converges quadratically: small relative eigenvalues need
    more steps. We run it in its coupled form (Higham, Functions of Matrices, 2008, §6.3/§6.7):

        T = 1/2 (3I - Z Y);  Y <- Y T;  Z <- T Z      (Y = R_hat, Z = I at the start; Z -> R_hat^{-1/2})

    which keeps Y = R_hat Z and so gives the same iterates Z = X in exact arithmetic, at the same cost (3 matmuls
    a step; the first step, from Z = I, needs one).
    The uncoupled form is numerically unstable: near the fixed point a rounding error E_ij (eigenbasis of R)
    is multiplied by (1 - sqrt(l_j / l_i)) / 2 per step, which exceeds 1 once cond(R) > 9, so it diverges if run
    past convergence (measured: NaN after 60 steps on random 8x8 SPD matrices with cond ~ 60); the coupled form
    stays at rounding level.
    """
    n = R.shape[-1]
    eye = torch.eye(n, dtype=R.dtype, device=R.device)  # (n, n)
    Re = R + eps * eye  # (..., n, n)
    norm = torch.linalg.matrix_norm(Re, keepdim=True)  # (..., 1, 1) Frobenius norm
    Y = Re / norm  # (..., n, n) R_hat
    if steps == 0:
        return eye.expand_as(Y) / norm.sqrt()
    # the first step from Z = I written out: Z Y = Y and T Z = T exactly, so it costs one matmul, not three
    T = 0.5 * (3.0 * eye - Y)  # (..., n, n)
    Y, Z = Y @ T, T  # (..., n, n) each
    for _ in range(steps - 1):
        T = 0.5 * (3.0 * eye - Z @ Y)  # (..., n, n)
        Y, Z = Y @ T, T @ Z  # (..., n, n) each
    return Z / norm.sqrt()


def matrix_layout(cfg: ModelConfig, i: int, sublayer: str) -> tuple[int, int]:
    """(H, d_h) of the per-token matrix view of a d-vector in layer i's ``sublayer`` ('attn' or 'mlp') substep.

    muon/ortho, attention substep: the layer's own head layout when it tiles d (H_i d_h_i = d). Otherwise, and for
    the MLP substep, and always for soap/shampoo (R must keep one shape across layers): (n_head, d / n_head).
    """
    H = cfg.n_head
    if cfg.d_model % H:
        raise ConfigError(f"model.momentum.variant={cfg.momentum.variant!r} views d_model={cfg.d_model} as an "
                          f"(n_head, d_model/n_head) matrix: model.n_head={H} must divide it")
    if sublayer == "attn" and cfg.momentum.variant in ("muon", "ortho"):
        Hi, dhi = layer_shapes(cfg)[i]
        if Hi * dhi == cfg.d_model:
            return Hi, dhi
    return H, cfg.d_model // H


# --------------------------------------------------------------------------------------------------------------
# one substep


class Substep(nn.Module):
    """One optimizer step with one oracle: its learned scalars, its stream norm(s) and the update rule.

    Hook points: scalars (n_scalars,) the transformed scalars in :data:`SCALARS` order; update (B, T, d) the term
    added to x (after the (1 - lambda) decay for adamw).
    """

    def __init__(self, cfg: ModelConfig, layout: tuple[int, int] | None):
        super().__init__()
        mc = cfg.momentum
        self.variant, self.layout = mc.variant, layout
        self.ns_steps, self.newton_steps = mc.ns_steps, mc.newton_steps
        self.names = SCALARS[self.variant]
        self.raw = nn.ParameterDict({n: nn.Parameter(torch.tensor(RAW_INIT[n])) for n in self.names})
        norm = lambda: make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)  # noqa: E731
        self.ln_v = norm() if "v" in STREAMS[self.variant] else None  # velocity norm (hb, nesterov, tmm)
        self.ln_u = None if self.ln_v is not None else norm()  # norm of the update direction (the others)
        self.scalars, self.update = HookPoint(), HookPoint()

    def cemtool_init(self, std: float) -> None:
        """Called by LM.init_weights: (re)set the raw scalars to :data:`RAW_INIT`."""
        with torch.no_grad():
            for n, p in self.raw.items():
                p.fill_(RAW_INIT[n])

    def values(self) -> dict[str, torch.Tensor]:
        """The learned scalars: softplus(raw) for gamma and nu, sigmoid(raw) for the others."""
        return {n: F.softplus(p) if n in POSITIVE else torch.sigmoid(p) for n, p in self.raw.items()}

    def forward(self, x: torch.Tensor, streams: dict[str, torch.Tensor], oracle) -> tuple[torch.Tensor, dict]:
        """x (B, T, d), the carried streams, oracle(h) = O(LN h) -> new x, new streams."""
        k = self.values()
        if self.scalars.active:
            self.scalars(torch.stack([k[n] for n in self.names]))  # (n_scalars,)
        if self.ln_v is not None:
            return self.momentum_step(x, streams, oracle, k)
        g = oracle(x)  # (B, T, d)
        if self.variant in ("adam", "adamw", "rmsprop"):
            u, streams = self.adaptive_direction(g, streams, k)
        elif self.variant in ("muon", "ortho"):
            u, streams = self.orthogonal_direction(g, streams, k)
        else:
            u, streams = self.preconditioned_direction(g, streams, k)
        step = self.update(k["gamma"] * self.ln_u(u))  # (B, T, d)
        if self.variant == "adamw":
            x = (1 - k["lambda"]) * x  # decoupled weight decay of the state
        return x + step, streams

    def momentum_step(self, x, streams, oracle, k) -> tuple[torch.Tensor, dict]:
        """hb, nesterov (look-ahead x + mu v), tmm (x <- x + nu v)."""
        v = streams["v"]  # (B, T, d)
        probe = x if self.variant == "hb" else x + k["mu"] * v  # (B, T, d) where the oracle is queried
        v = self.ln_v(k["beta"] * v + k["gamma"] * oracle(probe))  # (B, T, d)
        step = self.update(k["nu"] * v if self.variant == "tmm" else v)  # (B, T, d)
        return x + step, {**streams, "v": v}

    def adaptive_direction(self, g, streams, k) -> tuple[torch.Tensor, dict]:
        """adam/adamw: m / (sqrt(s) + 1e-8); rmsprop: g / (sqrt(s) + 1e-8)."""
        s = k["beta2"] * streams["s"] + (1 - k["beta2"]) * g.square()  # (B, T, d) > 0
        if self.variant == "rmsprop":
            return g / (s.sqrt() + ADAM_EPS), {**streams, "s": s}
        m = k["beta1"] * streams["m"] + (1 - k["beta1"]) * g  # (B, T, d)
        return m / (s.sqrt() + ADAM_EPS), {**streams, "m": m, "s": s}

    def orthogonal_direction(self, g, streams, k) -> tuple[torch.Tensor, dict]:
        """muon: NS(m) with m <- beta m + (1 - beta) g; ortho: NS(g); per token as an (H, d_h) matrix."""
        B, T, d = g.shape
        new = dict(streams)
        if self.variant == "muon":
            g = new["m"] = k["beta"] * streams["m"] + (1 - k["beta"]) * g  # (B, T, d) the momentum
        Y = newton_schulz(g.reshape(B, T, *self.layout), self.ns_steps)  # (B, T, H, d_h)
        return Y.reshape(B, T, d), new

    def preconditioned_direction(self, g, streams, k) -> tuple[torch.Tensor, dict]:
        """soap: M R^{-1/2}; shampoo: G R^{-1/2}; R <- beta_R R + (1 - beta_R) G^T G (in >= float32, no autocast)."""
        B, T, d = g.shape
        R0 = streams["R"]  # (B, T, d_h, d_h) or the broadcast identity (1, 1, d_h, d_h)
        with torch.autocast(device_type=g.device.type, enabled=False):
            G = g.to(R0.dtype).view(B, T, *self.layout)  # (B, T, H, d_h)
            R = k["beta2"] * R0 + (1 - k["beta2"]) * (G.mT @ G)  # (B, T, d_h, d_h)
            new = {**streams, "R": R}
            M = G
            if self.variant == "soap":
                m = k["beta1"] * streams["m"].to(R.dtype) + (1 - k["beta1"]) * G.reshape(B, T, d)  # (B, T, d)
                new["m"], M = m, m.view(B, T, *self.layout)
            U = M @ inv_sqrt_newton(R, self.newton_steps)  # (B, T, H, d_h)
        return U.reshape(B, T, d), new


# --------------------------------------------------------------------------------------------------------------
# the block and the model


class MomentumBlock(nn.Module):
    """Layer i: the baseline's attention and MLP as oracles, each driving one :class:`Substep`.

    Hook points: resid_pre, resid_mid, resid_post (B, T, d), those of ``attn`` and ``mlp``, and
    ``attn_step.scalars`` / ``mlp_step.scalars`` / ``attn_step.update`` / ``mlp_step.update``.
    """

    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.ln1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = make_attention(cfg, i)
        self.ln2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.mlp = make_mlp(cfg)
        matrix = cfg.momentum.variant in ("muon", "ortho", "soap", "shampoo")
        self.attn_step = Substep(cfg, matrix_layout(cfg, i, "attn") if matrix else None)
        self.mlp_step = Substep(cfg, matrix_layout(cfg, i, "mlp") if matrix else None)
        self.resid_pre, self.resid_mid, self.resid_post = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: torch.Tensor, streams: dict) -> tuple[torch.Tensor, dict]:
        x = self.resid_pre(x)  # (B, T, d)
        x, streams = self.attn_step(x, streams, lambda h: self.attn(self.ln1(h)))
        x = self.resid_mid(x)  # (B, T, d)
        x, streams = self.mlp_step(x, streams, lambda h: self.mlp(self.ln2(h)))
        return self.resid_post(x), streams


class StreamEmbedding(nn.Module):
    """Learned token + position embedding that starts one extra stream (stream_init = 'embed')."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        return self.tok(idx) + self.pos(torch.arange(T, device=idx.device))  # (B, T, d)


class MomentumLM(LM):
    """The backbone with momentum-stream layers; ``cfg.momentum.variant`` picks the optimizer (not 'vanilla',
    which is the plain :class:`LM`)."""

    family = "momentum"

    def __init__(self, cfg: ModelConfig):
        variant = cfg.momentum.variant
        if variant == "vanilla":
            raise ConfigError("model.momentum.variant='vanilla' is the baseline model: use arch 'vanilla'")
        if cfg.arch in VARIANTS and cfg.arch != variant:
            raise ConfigError(f"model.momentum.variant={variant!r} contradicts arch {cfg.arch!r}",
                              hint="leave model.momentum.variant to the architecture's preset")
        super().__init__(cfg)
        self.variant = variant
        embed = cfg.momentum.stream_init == "embed"
        self.stream_emb = nn.ModuleDict({n: StreamEmbedding(cfg) for n in STREAMS[variant]
                                         if embed and n in EMBEDDED})
        for m in self.stream_emb.modules():  # built after LM.init_weights: same init as the token embedding
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, cfg.init_std)

    def make_block(self, i: int) -> nn.Module:
        return MomentumBlock(self.cfg, i)

    def init_streams(self, idx: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The streams entering layer 0: v, m from embeddings ('embed') or 0; s = 1 and R = I in both modes."""
        out = {}
        for n in STREAMS[self.variant]:
            if n == "R":
                dh = self.blocks[0].attn_step.layout[1]
                dtype = torch.promote_types(x.dtype, torch.float32)
                out[n] = torch.eye(dh, dtype=dtype, device=x.device).expand(1, 1, dh, dh)  # (1, 1, d_h, d_h)
            elif n in self.stream_emb:
                out[n] = self.stream_emb[n](idx).to(x.dtype)  # (B, T, d)
            else:
                out[n] = torch.ones_like(x) if n == "s" else torch.zeros_like(x)  # (B, T, d)
        return out

    def body(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        streams = self.init_streams(ctx.idx, x)
        for block in self.blocks:
            x, streams = block(x, streams)  # (B, T, d)
        return x

    def stream_scalars(self) -> list[dict]:
        """The learned scalars of every substep: rows {"layer", "substep": "attn"|"mlp", <scalar>: value}."""
        rows = []
        for i, block in enumerate(self.blocks):
            for sub, step in (("attn", block.attn_step), ("mlp", block.mlp_step)):
                rows.append({"layer": i, "substep": sub, **{n: v.item() for n, v in step.values().items()}})
        return rows


register("vanilla", "momentum", LM, preset={"model": {"momentum": {"variant": "vanilla"}}},
         description="gradient descent x <- x + O(LN x): the baseline itself (METHODS §3)")
_DESCRIPTIONS = {
    "hb": "heavy ball: v <- LN_v(beta v + gamma O); x <- x + v",
    "nesterov": "Nesterov: oracle at x + mu v, then heavy ball",
    "tmm": "triple momentum: Nesterov with x <- x + nu v",
    "adam": "Adam streams m, s: x <- x + gamma LN_u(m / sqrt(s))",
    "adamw": "Adam with decay: x <- (1 - lambda) x + ...",
    "rmsprop": "Adam without m: x <- x + gamma LN_u(g / sqrt(s))",
    "muon": "momentum m, Newton-Schulz orthogonalised per token as (H, d_h)",
    "ortho": "Newton-Schulz orthogonalised oracle, no momentum",
    "soap": "M R^{-1/2} with R the EMA of G^T G per token (Newton inverse root)",
    "shampoo": "G R^{-1/2} (soap without M)",
}
for _name, _desc in _DESCRIPTIONS.items():
    register(_name, "momentum", MomentumLM, preset={"model": {"momentum": {"variant": _name}}},
             description=f"{_desc} (METHODS §3)")
