"""Softmax saturation and the allocation of heads and head sizes (METHODS §4).

Two kinds of evidence, and advice drawn from them:

1. **Trained model** (:func:`rank_truncation`): for each layer and head, truncate the head's bilinear score form
   to rank r and record the loss increase on a fixed evaluation set; also every head of a layer at once, which
   says which layers tolerate low rank. Plus the attention-logit spread per query position (context length).
2. **Sweep** (:mod:`cemtool.saturation_sweep`, which trains: analysis never does): final loss of small models
   trained over a grid of head sizes d_h at a fixed budget H d_h, per sequence length T; the marginal gain per
   doubling of d_h and the head size from which no larger one gains more than a threshold per doubling (the
   saturation point).
3. **Advice** (:func:`allocation_advice`): a per-layer (heads, head_dims) schedule at the same budget, written as
   the run's own config with only that allocation changed (:func:`advice_toml`), which ``cemtool train --config``
   accepts.

The truncation [decision, documented in docs/saturation.md]
----------------------------------------------------------
A head scores ``s_ij = beta q_iᵀ R_{j-i} k_j`` with pre-RoPE queries ``q = L_q u`` and keys ``k = L_k w``
(``L_q``, ``L_k``: d_h x n factors; for a baseline head ``L_q = W_Qʰ``, ``L_k = W_Kʰ`` and ``u = w = LN x``;
``R`` is the RoPE rotation, the identity with learned positions). Truncation replaces the queries by ``P q`` with a
d_h x d_h matrix ``P`` of rank r, applied at the ``attn.q`` hook point, so values, output projection and everything
else are untouched (this matters for CEM, whose W_Q is also the output projection). At r = d_h no truncation
is applied; the computed ``P`` is then the identity up to rounding.

- Without RoPE the form is the d x d matrix ``M = L_qᵀ L_k`` and ``P = L_q U_r U_rᵀ L_q⁺`` (U_r: top-r left
  singular vectors of M) gives ``L_qᵀ Pᵀ L_k = U_r U_rᵀ M``, the best rank-r approximation of M (Eckart–Young).
- With RoPE the form is ``L_qᵀ R_Δ L_k`` for every offset Δ, and an SVD of ``L_qᵀ L_k`` ignores the rotation. The
  truncations that commute with every rotation are the selections of RoPE planes (pairs (p, p + d_h/2), each with
  its own frequency), so ``P`` keeps the r/2 planes (r rounded down to even) with the largest
  ``|L_q,p|_F |L_k,p|_F``. Averaged over offsets, the planes' forms are orthogonal and plane p contributes
  ``|L_q,p|_F^2 |L_k,p|_F^2 / 2`` to the squared Frobenius norm, so this is the best rank-r RoPE-compatible
  truncation in the offset-averaged Frobenius sense.
- Factors (``basis``): ``weights`` takes them from the parameters: W_Qʰ, W_Kʰ (baseline, momentum, CEM — a CEM
  dplr head's diagonal term is left in place); LIMe static: the routed key of head r is
  ``sum_j W[r, j] K_j``, so ``L_k = [W[r, j] W_K^{(j)}]_j`` over every source head j (their inputs stacked);
  LIMe softmax: ``L_k = [p_{h,m} W_Kʰ]_m``. ``data`` takes them from the evaluation set: ``L = Σ^{1/2}`` with
  ``Σ = E[q qᵀ]`` (resp. keys) per head, i.e. the best truncation for the queries and keys the model actually
  sees. ``auto`` = weights where they define the form, else data (the LIMe dynamic router).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from cemtool.analysis.collapse import attention_row_stats
from cemtool.config import replace, to_dict
from cemtool.distributed import all_reduce_sum, shard
from cemtool.errors import CemtoolError
from cemtool.models.allocation import layer_shapes
from cemtool.models.capabilities import AttentionLayer, Capabilities
from cemtool.models.capture import capture, hook_points
from cemtool.models.lm import lm_loss
from cemtool.models.registry import build_model
from cemtool.options import at_least, check_types

# --------------------------------------------------------------------------------------------------------------
# the truncation of one head


def svd_projection(Lq: torch.Tensor, Lk: torch.Tensor, r: int) -> torch.Tensor:
    """P (d_h, d_h) with Lqᵀ Pᵀ Lk = the best rank-r approximation of Lqᵀ Lk (no RoPE). Lq (d_h, n), Lk (d_h, m)."""
    Lq, Lk = Lq.double(), Lk.double()
    dh = Lq.shape[0]
    if r <= 0:
        return torch.zeros(dh, dh, dtype=torch.float64)
    M = Lq.T @ Lk  # (n, m) the bilinear form
    U, _, _ = torch.linalg.svd(M, full_matrices=False)  # (n, min(n, m))
    Ur = U[:, :r]  # (n, r)
    return Lq @ Ur @ Ur.T @ torch.linalg.pinv(Lq)  # (d_h, d_h)


def rope_planes(Lq: torch.Tensor, Lk: torch.Tensor) -> torch.Tensor:
    """Offset-averaged weight |L_q,p|_F |L_k,p|_F of each RoPE plane p = (p, p + d_h/2); (d_h/2,)."""
    half = Lq.shape[0] // 2
    nq = Lq.double().pow(2).sum(1)  # (d_h,)
    nk = Lk.double().pow(2).sum(1)
    return ((nq[:half] + nq[half:]) * (nk[:half] + nk[half:])).sqrt()


def rope_projection(Lq: torch.Tensor, Lk: torch.Tensor, r: int) -> torch.Tensor:
    """P (d_h, d_h): the diagonal selection of the r // 2 heaviest RoPE planes (commutes with every rotation)."""
    dh = Lq.shape[0]
    half = dh // 2
    keep = torch.zeros(half, dtype=torch.float64)
    n = max(0, min(r // 2, half))
    if n:
        keep[torch.argsort(rope_planes(Lq, Lk), descending=True, stable=True)[:n]] = 1.0
    return torch.diag(torch.cat([keep, keep]))


def head_projection(Lq: torch.Tensor, Lk: torch.Tensor, r: int, rope: bool) -> torch.Tensor:
    return rope_projection(Lq, Lk, r) if rope else svd_projection(Lq, Lk, r)


def effective_form(Lq: torch.Tensor, Lk: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """The truncated bilinear form Lqᵀ Pᵀ Lk (without rotation)."""
    return Lq.double().T @ P.T @ Lk.double()


# --------------------------------------------------------------------------------------------------------------
# the factors of every head


LayerHeads = AttentionLayer  # a layer's attention as truncation sees it (the model's own declaration)


def attention_layers(model: Capabilities) -> tuple[list[AttentionLayer], dict[int, str]]:
    """The layers whose queries can be truncated, and for the others why not."""
    return model.attention_layers()


def _rows(w: torch.Tensor, h: int, dh: int) -> torch.Tensor:
    return w[h * dh:(h + 1) * dh].detach().double().cpu()  # (d_h, d)


def weight_factors(model: Capabilities, lh: AttentionLayer) -> list[tuple[torch.Tensor, torch.Tensor]] | str:
    """(L_q, L_k) per head from the parameters, or a string saying why the weights do not define the form."""
    qk = model.qk_weights(lh.layer)
    if qk is None:
        return "the attention's scores are no fixed bilinear form of its input (no wq/wk, or q/k norms)"
    Wq, Wk = qk  # (H d_h, d) each
    dh, H = lh.head_dim, lh.heads
    lime_variant = model.router()
    if lime_variant is None or lh.layer == 0:
        return [(_rows(Wq, h, dh), _rows(Wk, h, dh)) for h in range(H)]
    if lime_variant == "static":
        W = model.routing_weights()[lh.layer].double().cpu()  # (R, sum of heads of layers 0..l)
        heads = {a.layer: a.heads for a in model.attention_layers()[0]}
        sources = [(m, h) for m in range(lh.layer + 1) for h in range(heads[m])]
        Ks = [_rows(model.qk_weights(m)[1], h, dh) for m, h in sources]  # each (d_h, d)
        return [(_rows(Wq, r, dh), torch.cat([W[r, j] * K for j, K in enumerate(Ks)], dim=1)) for r in range(H)]
    if lime_variant == "softmax":
        p = model.routing_weights()[lh.layer].double().cpu()  # (H, l+1)
        return [(_rows(Wq, h, dh), torch.cat([p[h, m] * _rows(Wk, h, dh) for m in range(p.shape[1])], dim=1))
                for h in range(H)]
    return f"the LIMe {lime_variant} router mixes per token"


def _sqrt_psd(S: torch.Tensor) -> torch.Tensor:
    e, U = torch.linalg.eigh(S.double())
    return (U * e.clamp_min(0.0).sqrt()) @ U.T


@torch.no_grad()
def data_factors(model: torch.nn.Module, layers: list[LayerHeads], inputs: torch.Tensor, batch_size: int,
                 device) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(Σ_q^{1/2}, Σ_k^{1/2}) per query head from the second moments of the pre-RoPE queries and keys (under
    grouped-query attention, the keys of the key-value head the query head reads)."""
    names = [lh.q_point for lh in layers] + [lh.q_point[:-1] + "k" for lh in layers]
    names = [n for n in names if n in hook_points(model)]
    sums: dict[str, torch.Tensor] = {}

    def moment(name: str, x: torch.Tensor) -> None:
        x = x.double()  # (B, H, T, d_h)
        sums[name] = sums.get(name, 0) + torch.einsum("bhti,bhtj->hij", x, x).cpu()
        return None

    with capture(model, names, transform=moment):
        for i in range(0, len(inputs), batch_size):
            model(inputs[i:i + batch_size].to(device))
    for name in sorted(sums):  # under torchrun: the moments of every rank's share
        sums[name] = all_reduce_sum(sums[name].contiguous())
    out = {}
    for lh in layers:
        k_name = lh.q_point[:-1] + "k"
        group = lh.heads // lh.kv_heads  # query heads per key-value head (grouped-query attention)
        if lh.q_point in sums and k_name in sums:
            out[lh.layer] = [(_sqrt_psd(sums[lh.q_point][h]), _sqrt_psd(sums[k_name][h // group]))
                             for h in range(lh.heads)]
    return out


# --------------------------------------------------------------------------------------------------------------
# evaluation under truncation


@contextmanager
def truncated(model: torch.nn.Module, projections: dict[int, torch.Tensor]) -> Iterator[None]:
    """Replace the pre-RoPE queries of layer i by P q, head by head: projections {layer: (H, d_h, d_h)}."""
    handles = []
    points = hook_points(model)
    for i, P in projections.items():
        def hook(_mod, _inp, q, P=P):
            Pd = P.to(device=q.device, dtype=q.dtype)
            return torch.einsum("bhtd,hed->bhte", q, Pd)  # (B, H, T, d_h)
        handles.append(points[f"blocks.{i}.attn.q"].register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def mean_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, batch_size: int = 32,
              device="cpu") -> float:
    """Mean next-token loss (nats) over windows (n, T); under torchrun each rank passes its share and gets the
    mean over all ranks' tokens."""
    total, count = 0.0, 0
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i:i + batch_size].to(device), targets[i:i + batch_size].to(device)
        total += float(lm_loss(model(x), y, reduction="sum"))
        count += y.numel()
    t = all_reduce_sum(torch.tensor([total, float(count)], dtype=torch.float64))
    return float(t[0] / t[1])


def default_ranks(head_dim: int, rope: bool) -> list[int]:
    """0, then powers of two (even ones with RoPE) below d_h, then d_h."""
    ranks, r = [0], (2 if rope else 1)
    while r < head_dim:
        ranks.append(r)
        r *= 2
    return ranks + [head_dim]


@torch.no_grad()
def logit_spread(model: torch.nn.Module, inputs: torch.Tensor, batch_size: int, device) -> dict:
    """Per layer and head, the attention-logit spread (max - min and std over keys) vs context length t + 1."""
    names = [n for n in hook_points(model) if n.endswith(".attn.pattern")]
    if not names:
        return {}
    sums: dict[str, torch.Tensor] = {}
    with capture(model, names, transform=lambda n, p: attention_row_stats(p)) as cache:
        for i in range(0, len(inputs), batch_size):
            cache.clear()
            model(inputs[i:i + batch_size].to(device))
            for n in names:
                if n in cache:
                    sums[n] = sums.get(n, 0) + cache[n]
    for n in sorted(sums):  # under torchrun: every rank's sequences
        sums[n] = all_reduce_sum(sums[n].double().contiguous()).to(sums[n].dtype)
    n_seq = int(all_reduce_sum(torch.tensor([float(len(inputs))], dtype=torch.float64))[0])
    out = {}
    for n, s in sums.items():
        layer = int(n.split(".")[1])
        m = (s / n_seq).numpy()  # (6, H, T)
        out[layer] = {"logit_range": m[3].tolist(), "logit_std": m[4].tolist(),
                      "underflow": m[5].tolist(), "context_length": list(range(1, m.shape[2] + 1))}
    return out


@torch.no_grad()
def rank_truncation(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *,
                    ranks: Sequence[int] | None = None, basis: str = "auto", tolerance: float = 0.01,
                    per_head: bool = True, batch_size: int = 32, device="cpu",
                    progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Loss increase when heads' score forms are truncated to rank r (one head at a time and a whole layer at
    once), per layer the smallest rank whose increase stays within ``tolerance`` nats, and the logit spread.

    Returns a JSON-able dict keyed by layer (``layers``), with ``base_loss`` and the token count.
    Under torchrun each rank evaluates a contiguous share of the windows; losses and moments are all-reduced.
    """
    if basis not in ("auto", "weights", "data"):
        raise CemtoolError(f"basis={basis!r}: choose auto, weights or data")
    if not tolerance >= 0:
        raise CemtoolError(f"tolerance={tolerance} must be >= 0 nats")
    model.eval()
    layers, skipped = attention_layers(model)
    if not layers:
        raise CemtoolError("no layer of this model has truncatable attention (no blocks.<i>.attn.q hook point)")
    n_tokens = int(targets.numel())
    mine = shard(len(inputs))  # this rank's windows (all of them with one process)
    inputs, targets = inputs[mine.start:mine.stop], targets[mine.start:mine.stop]
    base = mean_loss(model, inputs, targets, batch_size, device)
    factors: dict[int, list] = {}
    basis_used: dict[int, str] = {}
    need_data = []
    for lh in layers:
        f = weight_factors(model, lh) if basis != "data" else "data basis requested"
        if isinstance(f, str):
            if basis == "weights":
                skipped[lh.layer] = f"not applicable with basis=weights: {f}"
                continue
            need_data.append(lh)
            basis_used[lh.layer] = "data" if basis == "data" else f"data ({f})"
        else:
            factors[lh.layer] = f
            basis_used[lh.layer] = "weights"
    if need_data:
        factors.update(data_factors(model, need_data, inputs, batch_size, device))
    todo = [lh for lh in layers if lh.layer in factors]
    jobs = sum(len(ranks or default_ranks(lh.head_dim, lh.rope)) * ((lh.heads if per_head else 0) + 1)
               for lh in todo)
    done = 0
    result_layers = []
    for lh in todo:
        rks = sorted({int(r) for r in (ranks or default_ranks(lh.head_dim, lh.rope)) if 0 <= r <= lh.head_dim})
        if lh.head_dim not in rks:
            rks.append(lh.head_dim)
        eye = torch.eye(lh.head_dim, dtype=torch.float64)
        Ps = {r: [head_projection(Lq, Lk, r, lh.rope) if r < lh.head_dim else eye for Lq, Lk in factors[lh.layer]]
              for r in rks}
        heads = []
        for h in range(lh.heads if per_head else 0):
            curve = []
            for r in rks:
                if r == lh.head_dim:
                    curve.append(0.0)
                else:
                    P = torch.stack([Ps[r][j] if j == h else eye for j in range(lh.heads)])  # (H, d_h, d_h)
                    with truncated(model, {lh.layer: P}):
                        curve.append(mean_loss(model, inputs, targets, batch_size, device) - base)
                done += 1
                if progress:
                    progress("truncation", done, jobs)
            heads.append({"head": h, "loss_increase": curve})
        whole = []
        for r in rks:
            if r == lh.head_dim:
                whole.append(0.0)
            else:
                with truncated(model, {lh.layer: torch.stack(Ps[r])}):
                    whole.append(mean_loss(model, inputs, targets, batch_size, device) - base)
            done += 1
            if progress:
                progress("truncation", done, jobs)
        tolerated = next(r for r, inc in zip(rks, whole, strict=True) if inc <= tolerance)
        below = [inc for r, inc in zip(rks, whole, strict=True) if r < lh.head_dim]
        result_layers.append({"layer": lh.layer, "heads": lh.heads, "head_dim": lh.head_dim, "rope": lh.rope,
                              "truncation": "rope planes" if lh.rope else "svd", "basis": basis_used[lh.layer],
                              "ranks": rks, "per_head": heads, "layer_loss_increase": whole,
                              "tolerated_rank": tolerated,
                              "sensitivity": float(np.mean(below)) if below else 0.0})
    notes = {str(i): why for i, why in sorted(skipped.items())}
    if model.truncation_note() is not None:  # e.g. CEM dplr: the diagonal term is not part of the truncated form
        notes["dplr"] = model.truncation_note()
    return {"measure": "saturation", "base_loss": base, "tokens": n_tokens, "tolerance": tolerance,
            "basis": basis, "layers": result_layers, "not_applicable": notes,
            "logits": {str(k): v for k, v in logit_spread(model, inputs, batch_size, device).items()}}


def truncation_rows(report: dict, run: str = "") -> list[dict]:
    rows = []
    for e in report["layers"]:
        for k, r in enumerate(e["ranks"]):
            rows.append({"run": run, "layer": e["layer"], "head": "all", "rank": r, "head_dim": e["head_dim"],
                         "loss_increase": e["layer_loss_increase"][k], "basis": e["basis"]})
            for hrow in e["per_head"]:
                rows.append({"run": run, "layer": e["layer"], "head": hrow["head"], "rank": r,
                             "head_dim": e["head_dim"], "loss_increase": hrow["loss_increase"][k],
                             "basis": e["basis"]})
    return rows


# --------------------------------------------------------------------------------------------------------------
# allocation advice


def allocation_advice(shapes: list[tuple[int, int]], tolerated: dict[int, int], sensitivity: dict[int, float],
                      rope: bool, tolerance: float = 0.0) -> dict:
    """A (heads, head_dims) schedule at (at most) the same budget D = sum_m H_m d_m.

    Rule [decision]: layer m's head size becomes the smallest rank it tolerates (even and >= 2 with RoPE, >= 1
    otherwise; unchanged where it tolerates nothing lower); the budget this frees is spent on extra heads, round
    robin, for the layers whose sensitivity (mean loss increase over the ranks below full) exceeds ``tolerance``,
    most sensitive first (every layer when none does), each extra head costing that layer's head size, while the
    budget allows. What cannot be spent is reported (``new_budget`` <= ``budget``).
    """
    D = sum(h * d for h, d in shapes)
    heads, dims = [], []
    for m, (H, dh) in enumerate(shapes):
        r = tolerated.get(m, dh)
        r = max(2 if rope else 1, r)
        if rope and r % 2:
            r += 1
        heads.append(H)
        dims.append(min(r, dh))
    spare = D - sum(h * d for h, d in zip(heads, dims, strict=True))
    order = sorted(range(len(shapes)), key=lambda m: (-sensitivity.get(m, 0.0), m))
    order = [m for m in order if sensitivity.get(m, 0.0) > tolerance] or order
    grew = True
    while grew:
        grew = False
        for m in order:
            if dims[m] <= spare:
                heads[m] += 1
                spare -= dims[m]
                grew = True
    return {"heads": heads, "head_dims": dims, "budget": D,
            "new_budget": sum(h * d for h, d in zip(heads, dims, strict=True)),
            "rule": "head size = smallest tolerated rank; freed budget -> extra heads for the most sensitive layers"}


def advised_config(config: dict, advice: dict) -> dict:
    """The run's own config (config.json as a dict: data, seq_len, tokenizer, training, seed, ...) with only the
    allocation changed: ``model.heads`` and ``model.head_dims`` from the advice. A data source that is a path
    relative to the working directory (where the run's data was just read) is written as the same path made
    absolute, so that the config trains on that data from any directory."""
    out = json.loads(json.dumps(config))  # a deep copy
    source = out["data"]["source"]
    if not os.path.isabs(source) and os.path.exists(source):
        out["data"]["source"] = os.path.abspath(source)
    out["model"]["heads"] = list(advice["heads"])
    out["model"]["head_dims"] = list(advice["head_dims"])
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string (with its \u escapes) is a TOML basic string
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"{type(v).__name__} has no TOML form")


def toml_text(data: dict, prefix: str = "") -> str:
    """A nested dict of scalars, lists and dicts as TOML: the scalars of a table, then its sub-tables."""
    lines = [f"[{prefix}]"] if prefix else []
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for k, v in data.items():
        if isinstance(v, dict):
            lines += ["", toml_text(v, f"{prefix}.{k}" if prefix else k).rstrip("\n")]
    return "\n".join(lines) + "\n"


def advice_toml(advice: dict, config: dict, source: str) -> str:
    """The advised config as TOML for ``cemtool train --config``: the run's whole config (``config``, its
    config.json) with only the allocation changed (:func:`advised_config`)."""
    head = (f"# allocation advice from `cemtool saturation` on {source}: the run's own config (data, sequence "
            f"length, tokenizer, training, seed)\n"
            f"# with only model.heads and model.head_dims changed; attention budget sum_m H_m d_m: "
            f"{advice['budget']} -> {advice['new_budget']}\n"
            f"# rule: {advice['rule']}\n")
    return head + toml_text(advised_config(config, advice))


# --------------------------------------------------------------------------------------------------------------
# the analysis: Options and measure(subject, options)


@dataclass(frozen=True)
class Options:
    """What ``cemtool saturation RUN`` measures with: evaluation tokens (whole windows of the run's length), the
    ranks r (default 0, powers of two, d_h), the basis of the score form, the loss increase a layer may take at
    its tolerated rank, whether each head is also truncated alone, and windows per forward pass."""

    tokens: int = 8192
    ranks: tuple[int, ...] | None = None
    basis: str = "auto"
    tolerance: float = 0.01
    per_head: bool = True
    batch_size: int = 32

    def __post_init__(self):
        check_types(self, "saturation")
        if self.basis not in ("auto", "weights", "data"):
            raise CemtoolError(f"saturation.basis={self.basis!r}: choose auto, weights or data")
        at_least(self, "saturation", tokens=1, batch_size=1, tolerance=0)
        if self.ranks is not None and self.ranks and min(self.ranks) < 0:
            raise CemtoolError("saturation.ranks must be >= 0")


@dataclass
class SaturationReport:
    """The rank truncation of one subject and the allocation advice drawn from it."""

    result: dict
    advice: dict
    options: Options
    arch: str
    checkpoint: str
    step: int | None
    asked: dict  # the options as recorded (with the checkpoint asked for)
    label: str
    advice_text: str | None = None

    def payload(self) -> dict:
        return {"arch": self.arch, "saturation": self.result, "advice": self.advice}

    def rows(self) -> list[dict]:
        return truncation_rows(self.result, self.label)

    def provenance(self) -> dict:
        return dict(checkpoint=self.checkpoint, step=self.step, command="saturation", options=self.asked)

    def files(self) -> dict[str, str]:
        return {"_advice.toml": self.advice_text} if self.advice_text is not None else {}


def _advice(cfg, result: dict, tolerance: float) -> dict:
    """A per-layer (heads, head_dims) schedule at the same budget, and whether the model builds with it."""
    shapes = layer_shapes(cfg.model)
    tolerated = {e["layer"]: e["tolerated_rank"] for e in result["layers"]}
    sens = {e["layer"]: e["sensitivity"] for e in result["layers"]}
    advice = allocation_advice(shapes, tolerated, sens, rope=cfg.model.pos == "rope", tolerance=tolerance)
    try:
        build_model(replace(cfg.model, heads=tuple(advice["heads"]), head_dims=tuple(advice["head_dims"])))
        advice["applicable"] = True
    except CemtoolError as e:
        advice = {"applicable": False, "why": f"not applicable: {e.message}", **advice}
    return advice


def measure(subject, options: Options | None = None, progress: Callable[[str, int, int], None] | None = None
            ) -> SaturationReport:
    """Truncate every head's score form to rank r on the subject's validation windows; the allocation advice."""
    o = options or Options()
    why = subject.model.inside_blocks()
    if why is not None:
        raise CemtoolError(f"saturation reads inside the blocks: {why}",
                           hint="sharpness and forgetting take any causal LM")
    cfg = subject.config
    T = cfg.data.seq_len
    if o.tokens < T:
        raise CemtoolError(f"--tokens {o.tokens} is fewer than one window of {T} tokens")
    x, y = subject.eval_set(o.tokens, T)  # (n, T)
    ranks = list(o.ranks) if o.ranks else None
    result = rank_truncation(subject.model, x, y, ranks=ranks, basis=o.basis, tolerance=o.tolerance,
                             per_head=o.per_head, batch_size=o.batch_size, device=subject.device,
                             progress=progress)
    advice = _advice(cfg, result, o.tolerance)
    asked = {"checkpoint": subject.checkpoint_asked, "tokens": o.tokens, "ranks": ranks, "basis": o.basis,
             "tolerance": o.tolerance, "per_head": o.per_head}
    text = advice_toml(advice, to_dict(cfg), str(subject.run.path)) if advice["applicable"] else None
    return SaturationReport(result, advice, o, cfg.model.arch, str(subject.checkpoint), subject.step, asked,
                            subject.run.path.name, text)


__all__ = ["Options", "SaturationReport", "advice_toml", "advised_config", "allocation_advice",
           "attention_layers", "data_factors", "default_ranks", "effective_form", "head_projection",
           "logit_spread", "mean_loss", "measure", "rank_truncation", "rope_planes", "rope_projection",
           "svd_projection", "toml_text", "truncated", "truncation_rows",
           "weight_factors"]
