"""The hook-point algebra check of a tier-b adapter (docs/models.md): the values the adapter shows at its hook
points must satisfy the block's own algebra, computed from the model's own modules. The logits check cannot see a
wrong mapping (a hook on the wrong side of a norm changes no logit); this one can.

Per layer, on a few random sequences with every hook point captured (float32):

- the pattern's rows sum to 1 and put no weight on later positions;
- the pattern is the softmax of the scaled q·k under the causal mask and the layer's sliding window
  (``Family.window``), from the q and k hook points with the layer's own rotary applied (``Family.rotate``; the
  hook points are before RoPE), its score scale, its logits' soft cap (``Family.softcap``) and its ALiBi bias
  (``Family.score_bias``);
- z = pattern · v, head by head (a key-value head repeated for the query heads that share it): v and the pattern
  are the values the attention combined, and z what it produced;
- the attention output z · W_o (+ b_o), from the out-projection module's own weights (through the family's declared
  post-sublayer norm, if it has one: ``Family.post_norms``), closes the residual stream:
  resid_mid = resid_pre + attention output and resid_post = resid_mid + mlp.out (sequential residual), or
  resid_post = resid_pre + attention output + mlp.out (parallel residual).

A family whose block has norms after its sublayers (OLMo-2, Gemma-2/3 "sandwich" norms) breaks the residual
identities under a pre-norm mapping, and one whose v hook sits on the wrong slice breaks z = pattern · v: the
check refuses such a mapping instead of measuring the wrong stream.
"""

from __future__ import annotations

import torch

from cemtool.models.capture import capture
from cemtool.subject.hf.adapter import weight_rows

TOLERANCE = 1e-4  # max |difference| / max(1, max |reference|), float32


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def _outside_window(T: int, w: int | None) -> torch.Tensor:
    """(T, T) True where key s is at least w positions before query t (a sliding window of w keys, t itself
    included); all False without a window."""
    t = torch.arange(T)
    return (t[:, None] - t[None, :] >= w) if w else torch.zeros(T, T, dtype=torch.bool)


@torch.no_grad()
def hook_algebra_check(model, fam, sequences: int = 2, tokens: int = 12, seed: int = 0) -> dict:
    """The largest relative violation of each identity over the layers, and whether all are within TOLERANCE."""
    T = min(tokens, model.max_seq_len)
    S = sequences
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, int(model.cfg.vocab_size), (sequences, T), generator=g)  # (S, T)
    with torch.no_grad(), capture(model, None) as cache:
        model(idx)
    worst = {"rows_sum_to_one": 0.0, "causal_pattern": 0.0, "pattern_is_softmax_qk": 0.0, "z_is_pattern_v": 0.0,
             "resid_mid": 0.0, "resid_post": 0.0}
    for i, block in enumerate(model.blocks):
        pre = f"blocks.{i}."
        pattern = cache[pre + "attn.pattern"]  # (S, H, T, T)
        v, z = cache[pre + "attn.v"], cache[pre + "attn.z"]  # (S, H_kv, T, d_h), (S, H, T, d_h)
        ones = torch.ones(pattern.shape[:-1])
        worst["rows_sum_to_one"] = max(worst["rows_sum_to_one"], _rel(pattern.sum(-1), ones))
        future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        worst["causal_pattern"] = max(worst["causal_pattern"], float(pattern[..., future].abs().max()))
        q, k = fam.rotate(model.hf, cache[pre + "attn.q"], cache[pre + "attn.k"], block.layer)  # (S, H, T, d_h)
        rep = pattern.shape[1] // v.shape[1]
        scores = q @ k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)  # (S, H, T, T)
        scores = scores * fam.score_scale(block.layer, model.shape)
        cap = fam.softcap(block.layer)
        if cap:
            scores = torch.tanh(scores / cap) * cap  # soft-capped logits (Gemma-2), before the mask
        bias = fam.score_bias(model.hf, block.layer, S, T)
        if bias is not None:
            scores = scores + bias  # ALiBi (BLOOM, Falcon): (S, H, T, T)
        hidden = future | _outside_window(T, fam.window(block.layer))  # (T, T) keys a query does not see
        expect = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        worst["pattern_is_softmax_qk"] = max(worst["pattern_is_softmax_qk"], _rel(expect, pattern))
        worst["z_is_pattern_v"] = max(worst["z_is_pattern_v"], _rel(pattern @ v.repeat_interleave(rep, 1), z))
        w, b = weight_rows(fam.out_proj(block.layer))  # (d, H d_h), (d,)
        S, H, _, dh = z.shape
        attn_out = z.transpose(1, 2).reshape(S, T, H * dh) @ w.T.float() + (0 if b is None else b.float())
        r_pre, r_post, mlp = cache[pre + "resid_pre"], cache[pre + "resid_post"], cache[pre + "mlp.out"]
        post_attn, post_mlp = fam.post_norms(block.layer)  # a block's norms on its sublayers' outputs, declared
        if post_attn is not None:
            attn_out = post_attn(attn_out)
        if post_mlp is not None:
            mlp = post_mlp(mlp)
        if block.resid_mid is not None:
            mid = cache[pre + "resid_mid"]
            worst["resid_mid"] = max(worst["resid_mid"], _rel(r_pre + attn_out, mid))
            worst["resid_post"] = max(worst["resid_post"], _rel(mid + mlp, r_post))
        else:
            worst["resid_post"] = max(worst["resid_post"], _rel(r_pre + attn_out + mlp, r_post))
    return {**worst, "sequences": sequences, "tokens": T, "tolerance": TOLERANCE,
            "passed": all(x <= TOLERANCE for x in worst.values())}
