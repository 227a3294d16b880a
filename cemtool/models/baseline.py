"""The pre-norm baseline (METHODS §1): x <- x + Attn(LN x); x <- x + MLP(LN x).

The baseline is the backbone with its default block: :class:`cemtool.models.lm.LM` and
:class:`cemtool.models.lm.Block`, which reads top to bottom. Hook points: resid_pre, resid_mid, resid_post
(B, T, d), plus those of Attention and MLP.
"""

from __future__ import annotations

from cemtool.models.lm import LM, Block
from cemtool.models.registry import register

register("baseline", "baseline", LM, description="pre-norm decoder (METHODS §1)")

__all__ = ["Block"]
