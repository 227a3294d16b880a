"""What a LIMe model's routers read (METHODS §5) and what a momentum model's streams learned (METHODS §3).

LIMe. Layer l's router is a matrix W^(l) with one row per consumer head and one column per source head of layers
0..l (static router: the K/V mixing weights, signed, unnormalised), or one column per source layer (softmax and
dynamic routers: a distribution over the block inputs h_0..h_l; the dynamic one per token, averaged over the
evaluation tokens here). From it, per layer:

- ``heatmap``: W^(l) itself, consumer head x source (layer, head), as the model holds it;
- ``mean_weight`` per source layer m: the mean of W^(l) over consumers and that layer's source heads (signed);
- ``share`` per source layer: w(m) = sum |W^(l)[:, block m]| / sum |W^(l)| (for the softmax routers this is the
  mean routing probability of layer m);
- ``self_retrieval`` per consumer head: the weight on its own head of the current layer (static: the diagonal of
  the last block, 1 at init) or on the current layer's state (softmax, dynamic);
- ``expected_layer``: sum_m m w(m), overall and per consumer head (with w normalised per row).

Momentum streams: the learned scalars (mu, beta, gamma, nu, lambda, ...) of every layer and substep, as
``model.stream_scalars()`` returns them.
"""

from __future__ import annotations

import numpy as np
import torch

from cemtool.models.allocation import layer_shapes


def source_blocks(layer: int, n_cols: int, heads_per_layer: list[int]) -> list[tuple[int, int]]:
    """Column ranges [start, stop) of each source layer 0..layer in a router matrix with ``n_cols`` columns: one
    column per layer (softmax/dynamic) or one per head (static, head counts from the allocation)."""
    if n_cols == layer + 1:
        return [(m, m + 1) for m in range(layer + 1)]
    widths = heads_per_layer[: layer + 1]
    if sum(widths) != n_cols:
        raise ValueError(f"router of layer {layer} has {n_cols} columns; expected {layer + 1} or {sum(widths)}")
    edges = np.cumsum([0, *widths])
    return [(int(edges[m]), int(edges[m + 1])) for m in range(layer + 1)]


def router_summary(layer: int, W: torch.Tensor, heads_per_layer: list[int]) -> dict:
    """The summaries of one layer's router matrix W (consumers, sources)."""
    W = W.detach().double().cpu()
    blocks = source_blocks(layer, W.shape[1], heads_per_layer)
    absW = W.abs()
    total = float(absW.sum())
    share = [float(absW[:, a:b].sum()) / total if total > 0 else float("nan") for a, b in blocks]
    per_row = torch.stack([absW[:, a:b].sum(1) for a, b in blocks], dim=1)  # (R, layer+1)
    per_row = per_row / per_row.sum(1, keepdim=True).clamp_min(1e-300)
    depth = torch.arange(layer + 1, dtype=torch.float64)
    a, b = blocks[-1]
    own = W[:, a:b]  # (R, width of the current layer)
    self_ret = torch.diagonal(own).tolist() if own.shape[1] == own.shape[0] else own[:, 0].tolist()
    return {"layer": layer, "heatmap": W.tolist(), "source_blocks": blocks,
            "mean_weight": [float(W[:, a:b].mean()) for a, b in blocks], "share": share,
            "self_retrieval": self_ret, "expected_layer": float(np.dot(share, depth.numpy())),
            "expected_layer_per_head": (per_row @ depth).tolist()}


def lime_routing(model: torch.nn.Module, mean_mix: dict[int, list] | None = None) -> dict | str:
    """Routing summaries of a LIMe model: from its router parameters (static, softmax) or, for the dynamic router,
    from ``mean_mix`` (layer -> the per-token mix averaged over evaluation tokens, (H, l+1)). A string saying why
    when the model has no routers."""
    variant = model.router()
    if variant is None:
        return "not applicable: this architecture has no layer router (LIMe only)"
    heads = [h for h, _ in layer_shapes(model.cfg)]
    if variant == "dynamic":
        if not mean_mix:
            return "not applicable: the dynamic router's weights depend on the tokens and none were captured"
        weights = {i: torch.tensor(m) for i, m in mean_mix.items()}
        source = "per-token mix averaged over the evaluation tokens"
    else:
        weights = model.routing_weights()
        source = "router parameters W^(l)" if variant == "static" else "softmax of the router logits"
    layers = [router_summary(i, W, heads) for i, W in sorted(weights.items())]
    return {"variant": variant, "source": source, "signed": variant == "static", "layers": layers}


def routing_rows(routing: dict | str, run: str = "", arch: str = "") -> list[dict]:
    """Long rows: per layer and source layer the mean weight and share; per layer and head the self-retrieval."""
    if isinstance(routing, str):
        return []
    rows = []
    for e in routing["layers"]:
        for m, (mw, sh) in enumerate(zip(e["mean_weight"], e["share"], strict=True)):
            rows.append({"run": run, "arch": arch, "layer": e["layer"], "head": None, "source_layer": m,
                         "measure": "routing.mean_weight", "mean": mw})
            rows.append({"run": run, "arch": arch, "layer": e["layer"], "head": None, "source_layer": m,
                         "measure": "routing.share", "mean": sh})
        for h, s in enumerate(e["self_retrieval"]):
            rows.append({"run": run, "arch": arch, "layer": e["layer"], "head": h, "measure": "routing.self",
                         "mean": s})
        rows.append({"run": run, "arch": arch, "layer": e["layer"], "head": None,
                     "measure": "routing.expected_layer", "mean": e["expected_layer"]})
    return rows


def stream_scalars(model: torch.nn.Module) -> list[dict] | str:
    """The learned scalars of a momentum-family model per layer and substep, or why there are none."""
    rows = model.stream_scalars()
    if rows is None:
        return "not applicable: this architecture has no optimizer-stream scalars (momentum family only)"
    if not rows:
        return "not applicable: this momentum variant learns no stream scalars"
    return rows


def stream_rows(scalars: list[dict] | str, run: str = "", arch: str = "") -> list[dict]:
    if isinstance(scalars, str):
        return []
    out = []
    for r in scalars:
        for k, v in r.items():
            if k not in ("layer", "substep"):
                out.append({"run": run, "arch": arch, "layer": r["layer"], "head": None, "substep": r["substep"],
                            "measure": f"stream.{k}", "mean": v})
    return out


__all__ = ["lime_routing", "router_summary", "routing_rows", "source_blocks", "stream_rows", "stream_scalars"]
