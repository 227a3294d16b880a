"""Per-layer allocation of attention heads and head sizes (METHODS §4).

Layer m gets H_m heads of size d_m; the attention budget is D = sum_m H_m d_m (the width of the layer's Q, K and
V projections, summed over layers). The uniform model has D = L H d_h (L = n_layer, H = n_head,
d_h = head_dim or d_model // n_head).

Explicit lists in the config win: ``model.heads`` replaces the head counts and ``model.head_dims`` the head sizes
(each of length n_layer; the component not given comes from the strategy). Explicit lists need not keep the
uniform budget: :func:`describe_allocation` reports D beside the uniform budget.

Otherwise ``model.alloc_strategy`` moves budget between layers at exactly the uniform model's D. Definitions
(u = 2 under RoPE, else 1: every head size stays a multiple of u; layers pair up as (i, L-1-i) for
i < P = L // 2, and an odd middle layer keeps (H, d_h)):

- ``uniform``: every layer (H, d_h).
- ``early-heavy`` (more heads early, smaller heads late; the paper: early layers extract information, later layers
  saturate): each late layer L-1-i keeps H heads of the half size d_s = u * ceil(d_h / 2u). Its early partner i
  takes the freed budget, b = H (2 d_h - d_s), as H_e = b / d_e heads of size d_e = the largest multiple of u
  that divides b and is <= d_h (so H_e > H whenever d_s < d_h). Example H=4, d_h=32: early (6, 32), late (4, 16).
- ``late-lowrank`` (later layers with low-rank W_Q W_K^T, the rank moved to early layers): H heads everywhere;
  the head size, which is the rank of each head's W_Q W_K^T, falls linearly over the late half: late layer
  L-1-i gets d_i = u * max(1, round((i+1) d_h / ((P+1) u))) (round half up), its early partner 2 d_h - d_i.
  The last layer has about d_h / (P+1), the first about (2 - 1/(P+1)) d_h; sizes never increase with depth.
  Example L=4, H=4, d_h=32, RoPE: (4, 54), (4, 42), (4, 22), (4, 10).

Every pair holds 2 H d_h, so D is exact for every size the config allows, by construction. Where nothing can move
(L = 1, or d_h = u so heads cannot shrink) a strategy returns the uniform shapes; describe_allocation shows them.
"""

from __future__ import annotations

from cemtool.config import ModelConfig, uniform_head_dim
from cemtool.errors import ConfigError

STRATEGIES = ("uniform", "early-heavy", "late-lowrank")


def size_step(cfg: ModelConfig) -> int:
    """u: head sizes are multiples of 2 under RoPE (pairs of dimensions rotate together), else of 1."""
    return 2 if cfg.pos == "rope" else 1


def uniform_shape(cfg: ModelConfig) -> tuple[int, int]:
    """(H, d_h) of the uniform model."""
    if cfg.n_head < 1:
        raise ConfigError(f"model.n_head={cfg.n_head} must be >= 1")
    if not cfg.head_dim and cfg.d_model % cfg.n_head:
        raise ConfigError(f"model.n_head={cfg.n_head} does not divide model.d_model={cfg.d_model}",
                          hint="set model.head_dim explicitly")
    return cfg.n_head, uniform_head_dim(cfg.d_model, cfg.n_head, cfg.head_dim)


def uniform_budget(cfg: ModelConfig) -> int:
    """D of the uniform model: n_layer * n_head * head_dim."""
    H, dh = uniform_shape(cfg)
    return cfg.n_layer * H * dh


def _early_heavy_pair(H: int, dh: int, u: int) -> tuple[tuple[int, int], tuple[int, int]]:
    d_small = u * -(-dh // (2 * u))  # half the size, rounded up to the step
    b = H * (2 * dh - d_small)  # the early layer's budget
    d_early = next(d for d in range(dh, 0, -u) if b % d == 0)  # u always divides b: the loop ends
    return (b // d_early, d_early), (H, d_small)


def _late_lowrank_pair(i: int, P: int, H: int, dh: int, u: int) -> tuple[tuple[int, int], tuple[int, int]]:
    n, m = (i + 1) * dh, (P + 1) * u
    d_late = u * max(1, (2 * n + m) // (2 * m))  # u * round_half_up((i+1) dh / ((P+1) u))
    return (H, 2 * dh - d_late), (H, d_late)


def strategy_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(heads, head_dim) per layer for ``cfg.alloc_strategy`` (see the module docstring)."""
    H, dh = uniform_shape(cfg)
    L, u = cfg.n_layer, size_step(cfg)
    shapes = [(H, dh)] * L
    if cfg.alloc_strategy == "uniform":
        return shapes
    if cfg.alloc_strategy not in STRATEGIES:
        raise ConfigError(f"model.alloc_strategy={cfg.alloc_strategy!r} is not available: "
                          f"choose one of {', '.join(STRATEGIES)}")
    if dh % u:
        raise ConfigError(f"head size {dh} is odd: RoPE needs an even head size")
    P = L // 2
    for i in range(P):
        if cfg.alloc_strategy == "early-heavy":
            early, late = _early_heavy_pair(H, dh, u)
        else:
            early, late = _late_lowrank_pair(i, P, H, dh, u)
        shapes[i], shapes[L - 1 - i] = early, late
    budget = sum(h * d for h, d in shapes)
    if budget != L * H * dh:  # cannot happen by construction; kept as the documented contract
        raise ConfigError(f"alloc_strategy={cfg.alloc_strategy} gives budget {budget} != {L * H * dh} "
                          f"for n_layer={L}, n_head={H}, head_dim={dh}")
    return shapes


def _check_list(cfg: ModelConfig, name: str) -> tuple:
    v = tuple(getattr(cfg, name))
    if v and len(v) != cfg.n_layer:
        raise ConfigError(f"model.{name} has {len(v)} entries, expected model.n_layer={cfg.n_layer}")
    if any((not isinstance(x, int)) or x < 1 for x in v):
        raise ConfigError(f"model.{name}={list(v)} must hold positive integers")
    return v


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(heads, head_dim) for every layer: explicit lists first, then the strategy."""
    heads, dims = _check_list(cfg, "heads"), _check_list(cfg, "head_dims")
    shapes = strategy_shapes(cfg)
    if heads:
        shapes = [(h, d) for h, (_, d) in zip(heads, shapes, strict=True)]
    if dims:
        shapes = [(h, d) for (h, _), d in zip(shapes, dims, strict=True)]
    if cfg.pos == "rope" and any(d % 2 for _, d in shapes):
        raise ConfigError(f"head sizes {[d for _, d in shapes]} include an odd size: RoPE needs even sizes")
    return shapes


def attention_budget(cfg: ModelConfig) -> int:
    """D = sum_m H_m d_m."""
    return sum(h * d for h, d in layer_shapes(cfg))


def describe_allocation(cfg: ModelConfig) -> dict:
    """What `cemtool archs` shows: per-layer shapes, the budget D and the uniform model's budget."""
    shapes = layer_shapes(cfg)
    budget, uniform = sum(h * d for h, d in shapes), uniform_budget(cfg)
    explicit = [name for name in ("heads", "head_dims") if getattr(cfg, name)]
    return {"strategy": cfg.alloc_strategy, "explicit": explicit,
            "shapes": [{"layer": i, "heads": h, "head_dim": d, "width": h * d} for i, (h, d) in enumerate(shapes)],
            "budget": budget, "uniform_budget": uniform, "keeps_budget": budget == uniform}
