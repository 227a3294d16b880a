"""Compute accounting: parameters, FLOPs per token and measured step time of every architecture."""

from __future__ import annotations

import functools
import time as _time
from pathlib import Path

import torch

from cemtool.config import ModelConfig, RunConfig, replace, resolve
from cemtool.errors import ConfigError
from cemtool.layout import is_run
from cemtool.models.allocation import attention_budget, describe_allocation
from cemtool.models.layers import mlp_hidden
from cemtool.models.lm import flops_per_token, lm_loss
from cemtool.models.registry import archs, build_model
from cemtool.runs import open_run


def fresh_counts(model_cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Parameters and FLOPs per token of a freshly built model of ``model_cfg`` (torch's seed 0; the global RNG
    left untouched): {"total", "non_embedding", "forward", "train"} (``num_params`` and ``flops_per_token``).
    Both follow from the configuration and seq_len alone, so each configuration is counted once per process: a
    sweep's seeds and grid points, and a width search's repeated rows, share their count."""
    return dict(_counts(model_cfg, seq_len))


@functools.lru_cache(maxsize=1024)  # ModelConfig is a frozen dataclass: hashable, equal when every field is
def _counts(model_cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(model_cfg)
    return {**model.num_params(), **flops_per_token(model, seq_len)}


def sized_config(arch: str, overrides: list[str] | tuple = (), vocab: int = 512, seq_len: int = 64) -> RunConfig:
    cfg = resolve(arch=arch, overrides=list(overrides))
    return replace(cfg, **{"model.vocab_size": vocab, "model.max_seq_len": seq_len, "data.seq_len": seq_len})


def seconds_per_step(model: torch.nn.Module, vocab: int, seq_len: int, batch: int = 8, repeats: int = 3) -> float:
    """Median wall time of a forward+backward+AdamW step on random tokens (after one warm-up step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    times = []
    for i in range(repeats + 1):
        t0 = _time.perf_counter()
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(_time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def arch_row(arch: str, overrides: list[str] | tuple = (), vocab: int = 512, seq_len: int = 64,
             timed: bool = False) -> dict:
    cfg = sized_config(arch, overrides, vocab, seq_len)
    spec = archs()[arch]
    n = fresh_counts(cfg.model, seq_len)
    row = {"arch": arch, "family": spec.family, "params": n["total"], "non_embedding": n["non_embedding"],
           "attn_budget": attention_budget(cfg.model),
           "layer_shapes": [f"{s['heads']}x{s['head_dim']}" for s in describe_allocation(cfg.model)["shapes"]],
           "flops_forward": n["forward"], "flops_train": n["train"],
           "n_layer": cfg.model.n_layer, "d_model": cfg.model.d_model,
           "mlp_hidden": mlp_hidden(cfg.model.d_model, cfg.model.mlp, cfg.model.mlp_hidden)}
    if timed:
        torch.manual_seed(0)
        row["seconds_per_step"] = seconds_per_step(build_model(cfg.model), vocab, seq_len)
    return row


def arch_table(overrides: list[str] | tuple = (), vocab: int = 512, seq_len: int = 64, timed: bool = False,
               only: list[str] | None = None) -> list[dict]:
    """One row per architecture. Listing every architecture, one that the overrides make impossible (e.g. LIMe's
    router under per-layer head sizes) gets {"arch", "family", "error"} instead of failing the whole table; named
    ones (``only``) and a table where none can be built raise. Listing all, the foreign architectures that loading
    a Hugging Face model registered in this process (family "foreign", each for its own vocabulary and context) are
    left out: the table is of cemtool's families at one size."""
    names = only or sorted((n for n, a in archs().items() if a.family != "foreign"),
                           key=lambda n: (archs()[n].family, n))
    rows = []
    for n in names:
        try:
            rows.append(arch_row(n, overrides, vocab, seq_len, timed))
        except ConfigError as e:
            if only or len(rows) + 1 == len(names) and all("error" in r for r in rows):
                raise
            rows.append({"arch": n, "family": archs()[n].family, "error": e.message})
    return rows


def target_size(ref: str, overrides: list[str] | tuple = (), vocab: int = 512, seq_len: int = 64) -> dict:
    """Parameters and FLOPs/token of a reference: an architecture name (at the given size) or a run directory."""
    if is_run(Path(ref)):
        cfg = open_run(ref).config()
        n = fresh_counts(cfg.model, cfg.data.seq_len)
        return {"ref": ref, "arch": cfg.model.arch, "params": n["total"], "non_embedding": n["non_embedding"],
                "flops_train": n["train"], "vocab": cfg.model.vocab_size, "seq_len": cfg.data.seq_len}
    row = arch_row(ref, overrides, vocab, seq_len)
    return {"ref": ref, **row, "vocab": vocab, "seq_len": seq_len}


def match_width(target: dict, by: str = "params", arch: str = "baseline", overrides: list[str] | tuple = ()) -> dict:
    """The d_model (head count fixed, head size d_model/n_head kept even) at which ``arch`` comes closest to the
    target's non-embedding parameters (by='params') or training FLOPs per token (by='flops')."""
    key = {"params": "non_embedding", "flops": "flops_train"}[by]
    base = sized_config(arch, overrides, target["vocab"], target["seq_len"])
    step = 2 * base.model.n_head
    best = None
    for d in range(step, 8 * base.model.d_model + 1, step):
        row = arch_row(arch, [*overrides, f"model.d_model={d}", "model.head_dim=0"], target["vocab"],
                       target["seq_len"])
        err = row[key] / target[key] - 1
        if best is None or abs(err) < abs(best["rel_error"]):
            best = {"d_model": d, "rel_error": err, "row": row}
        if row[key] > target[key] * 1.5:
            break
    # refine with the MLP width: the count is linear in it, so two evaluations find the best multiple of 8
    d = best["d_model"]
    m0 = best["row"].get("mlp_hidden") or 0
    r0 = arch_row(arch, [*overrides, f"model.d_model={d}", "model.head_dim=0", f"model.mlp_hidden={m0}"],
                  target["vocab"], target["seq_len"])
    r1 = arch_row(arch, [*overrides, f"model.d_model={d}", "model.head_dim=0", f"model.mlp_hidden={m0 + 64}"],
                  target["vocab"], target["seq_len"])
    slope = (r1[key] - r0[key]) / 64
    if slope > 0:
        m = max(8, int(round((m0 + (target[key] - r0[key]) / slope) / 8)) * 8)
        row = arch_row(arch, [*overrides, f"model.d_model={d}", "model.head_dim=0", f"model.mlp_hidden={m}"],
                       target["vocab"], target["seq_len"])
        err = row[key] / target[key] - 1
        if abs(err) < abs(best["rel_error"]):
            best = {"d_model": d, "mlp_hidden": m, "rel_error": err, "row": row}
    best["overrides"] = [f"model.d_model={d}"] + ([f"model.mlp_hidden={best['mlp_hidden']}"]
                                                   if "mlp_hidden" in best else [])
    best["by"] = by
    return best
def run_compute(cfg: RunConfig) -> dict:
    """Parameters and training FLOPs per token (forward + backward) of a run's model, from its config alone (a
    freshly built model; no checkpoint; the global RNG is left untouched)."""
    n = fresh_counts(cfg.model, cfg.data.seq_len)
    return {"params": n["total"], "non_embedding": n["non_embedding"], "flops_per_token": n["train"],
            "flops_forward_per_token": n["forward"]}


