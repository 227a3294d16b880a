"""What a model needs in memory, from its config alone: its parameter count (exact, or a quick upper bound) and the
bytes of its weights, optimizer state and activations; :func:`check_memory` refuses, before anything is allocated,
a model (and batch) that cannot fit. The one estimate that training, building a model, loading a run and the
analyses use; the memory the device has comes from :mod:`cemtool.memory`.
"""

from __future__ import annotations

import os

import torch

from cemtool import memory  # memory.available_memory is looked up at each call: the one probe, replaceable in tests
from cemtool.architectures import get_arch
from cemtool.config import ModelConfig
from cemtool.errors import CemtoolError
from cemtool.memory import GIB
from cemtool.models.allocation import layer_shapes
from cemtool.models.layers import mlp_hidden


def count_params(m: ModelConfig) -> int:
    """Exact parameter (and buffer) count of a model config: the model is built on the meta device, which
    allocates nothing."""
    spec = get_arch(m.arch)
    with torch.device("meta"):
        model = spec.build(m)
    return sum(t.numel() for t in model.parameters()) + sum(t.numel() for t in model.buffers())


def rough_params(m: ModelConfig) -> int:
    """A quick upper bound of the parameter count (no model built): generous per-layer and embedding terms that
    cover every family's extras (tested against the exact count of every architecture)."""
    d, h = m.d_model, mlp_hidden(m.d_model, m.mlp, m.mlp_hidden)
    attn = sum(H * dh for H, dh in layer_shapes(m))  # summed over layers
    return 4 * d * attn + m.n_layer * (3 * d * h + 4 * d * d + 64 * (d + h)) + 6 * m.vocab_size * d \
        + 4 * m.max_seq_len * d


def memory_estimate(m: ModelConfig, batch_size: int = 0, seq_len: int = 0, training: bool = False,
                    params: int | None = None) -> dict:
    """Bytes a model needs, from its config alone (fp32): weights; for training also gradients and AdamW's two
    moments (16 bytes per parameter in all); and activations for a batch of ``batch_size`` x ``seq_len`` tokens.
    Activations are an estimate: per token and layer about 16 d + 6 h + 3 H T floats are kept for the backward
    pass (d width, h MLP width, H heads, T tokens: attention scores; H T with the fused attention kernel), times
    the recursive steps of CEM layers, 2.5 for the extra streams of momentum layers and 1.25 for LIMe's memory,
    plus 4 V floats per token for the logits (0.85x to 1.75x the peak resident memory measured for a CPU
    training step of five families at three shapes: benchmarks/memory_estimate.py); without training, the
    largest of these tensors three times over. The one estimate that training, loading a run and analyses use.
    ``params``: a parameter count to use instead of the exact one (:func:`count_params`)."""
    params = count_params(m) if params is None else params
    family = get_arch(m.arch).family
    d, h, T = m.d_model, mlp_hidden(m.d_model, m.mlp, m.mlp_hidden), seq_len
    heads = max(H for H, _ in layer_shapes(m))
    repeat = {"cem": m.cem.steps, "momentum": 2.5, "lime": 1.25}.get(family, 1)  # extra work per layer
    scores = 3 if m.attn_impl == "explicit" else 1  # the fused kernel keeps less than the T x T probabilities
    per_layer = int((16 * d + 6 * h + scores * heads * T) * repeat)  # floats per token
    tokens = batch_size * seq_len
    if training:
        acts = 4 * tokens * (m.n_layer * per_layer + 4 * m.vocab_size)
    else:
        acts = 4 * tokens * 3 * max(per_layer, m.vocab_size)
    weights = 4 * params
    state = 12 * params if training else 0
    return {"params": params, "weights": weights, "grads_and_optimizer": state, "activations": acts,
            "total": weights + state + acts}


def check_memory(m: ModelConfig, device: str | torch.device = "cpu", *, batch_size: int = 0, seq_len: int = 0,
                 training: bool = False, what: str | None = None) -> dict | None:
    """Refuse, with the estimate and the available memory, a model (and batch) that cannot fit on ``device``,
    before anything is allocated. Returns the exact estimate when it was needed (near the limit), else None.
    CEMTOOL_NO_MEMORY_CHECK=1 skips the check (the estimate may be pessimistic)."""
    avail = memory.available_memory(device)
    if avail is None or os.environ.get("CEMTOOL_NO_MEMORY_CHECK", "") not in ("", "0"):
        return None
    if 2 * memory_estimate(m, batch_size, seq_len, training, params=rough_params(m))["total"] <= avail:
        return None  # far from the limit: the exact count (a model built on the meta device) is not needed
    est = memory_estimate(m, batch_size, seq_len, training)
    if est["total"] <= avail:
        return est
    parts = f"{est['params']:,} parameters: weights {est['weights'] / GIB:.2f} GiB"
    if training:
        parts += f", gradients and AdamW state {est['grads_and_optimizer'] / GIB:.2f} GiB"
    if batch_size:
        parts += f", activations for {batch_size} x {seq_len} tokens {est['activations'] / GIB:.2f} GiB"
    raise CemtoolError(f"{what or ('training' if training else 'the model')} {m.arch} (d_model={m.d_model}, "
                       f"n_layer={m.n_layer}, vocab {m.vocab_size}) needs about {est['total'] / GIB:.2f} GiB "
                       f"({parts}) but {avail / GIB:.2f} GiB are available on {torch.device(device)}",
                       hint="shrink the model, train.batch_size or data.seq_len (set CEMTOOL_NO_MEMORY_CHECK=1 to "
                            "try anyway)")
