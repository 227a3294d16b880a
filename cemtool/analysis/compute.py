"""Compute accounting: parameters, FLOPs per token and measured step time of every architecture."""

from __future__ import annotations

import time as _time

import torch

from cemtool.config import RunConfig, replace, resolve
from cemtool.models.allocation import attention_budget, describe_allocation
from cemtool.models.lm import flops_per_token, lm_loss
from cemtool.models.registry import archs, build_model


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
    torch.manual_seed(0)
    model = build_model(cfg.model)
    spec = archs()[arch]
    n = model.num_params()
    fl = flops_per_token(model, seq_len)
    row = {"arch": arch, "family": spec.family, "params": n["total"], "non_embedding": n["non_embedding"],
           "attn_budget": attention_budget(cfg.model),
           "layer_shapes": [f"{s['heads']}x{s['head_dim']}" for s in describe_allocation(cfg.model)["shapes"]],
           "flops_forward": fl["forward"], "flops_train": fl["train"],
           "n_layer": cfg.model.n_layer, "d_model": cfg.model.d_model}
    if timed:
        row["seconds_per_step"] = seconds_per_step(model, vocab, seq_len)
    return row


def arch_table(overrides: list[str] | tuple = (), vocab: int = 512, seq_len: int = 64, timed: bool = False,
               only: list[str] | None = None) -> list[dict]:
    names = only or sorted(archs(), key=lambda n: (archs()[n].family, n))
    return [arch_row(n, overrides, vocab, seq_len, timed) for n in names]
