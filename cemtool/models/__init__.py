"""Model families. ``build_model(cfg)`` builds any registered architecture."""

from cemtool.models.capture import HookPoint, capture, hook_points
from cemtool.models.layers import attention_impl, causal_attention
from cemtool.models.lm import LM, flops_per_token, lm_loss
from cemtool.models.registry import archs, build_model, get_arch

__all__ = ["LM", "HookPoint", "archs", "attention_impl", "build_model", "capture", "causal_attention",
           "flops_per_token", "get_arch", "hook_points", "lm_loss"]
