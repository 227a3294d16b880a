"""Per-layer allocation of attention heads and head sizes (METHODS §4).

Layer m gets H_m heads of size d_m; the attention budget is D = sum_m H_m d_m. Explicit lists in the config
(``model.heads``, ``model.head_dims``) win; otherwise a named strategy distributes the uniform model's budget.
"""

from __future__ import annotations

from cemtool.config import ModelConfig
from cemtool.errors import ConfigError


def uniform_shape(cfg: ModelConfig) -> tuple[int, int]:
    return cfg.n_head, cfg.head_dim or cfg.d_model // cfg.n_head


def strategy_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(heads, head_dim) per layer for ``cfg.alloc_strategy``."""
    H, dh = uniform_shape(cfg)
    if cfg.alloc_strategy == "uniform":
        return [(H, dh)] * cfg.n_layer
    raise ConfigError(f"model.alloc_strategy={cfg.alloc_strategy!r} is not available")


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(heads, head_dim) for every layer: explicit lists first, then the strategy."""
    shapes = strategy_shapes(cfg)
    if cfg.heads:
        shapes = [(h, d) for h, (_, d) in zip(cfg.heads, shapes, strict=False)]
    if cfg.head_dims:
        shapes = [(h, d) for (h, _), d in zip(shapes, cfg.head_dims, strict=False)]
    if cfg.pos == "rope" and any(d % 2 for _, d in shapes):
        raise ConfigError(f"head sizes {[d for _, d in shapes]} include an odd size: RoPE needs even sizes")
    return shapes


def attention_budget(cfg: ModelConfig) -> int:
    """D = sum_m H_m d_m."""
    return sum(h * d for h, d in layer_shapes(cfg))
