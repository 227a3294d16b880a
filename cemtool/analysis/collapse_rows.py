"""The collapse report as tables: its long CSV rows and the per-layer summary (the change across depth)."""

from __future__ import annotations

import numpy as np


def _num(v) -> float | None:
    return v if isinstance(v, (int, float)) else None


def report_rows(report: dict, run: str = "", arch: str = "") -> list[dict]:
    """Long-format rows: one per (layer, head, measure) with mean, std, se, n."""
    rows = []

    def add(layer, head, measure, mean, std=None, se=None, n=None):
        rows.append({"run": run, "arch": arch, "layer": layer, "head": head, "measure": measure, "mean": mean,
                     "std": std, "se": se, "n": n})

    prev: dict[str, float] = {}
    for e in report["layers"]:
        i = e["layer"]
        for kind in ("values", "hidden"):
            d = e[kind]
            if isinstance(d, str):
                add(i, None, f"{kind}.entropy", d)
                continue
            for m in ("entropy", "erank_seq", "cosine"):
                s = d[m]
                add(i, None, f"{kind}.{m}", s["mean"], s["std"], s["se"], s["n"])
            add(i, None, f"{kind}.erank_all", d["erank_all"])
            for m in ("entropy", "erank_all", "cosine"):
                cur = d[m]["mean"] if isinstance(d[m], dict) else d[m]
                key = f"{kind}.{m}"
                if key in prev and cur is not None and prev[key] is not None:
                    add(i, None, f"{key}.change", cur - prev[key])
                prev[key] = cur
            for h, s in enumerate(d.get("entropy_per_head", [])):
                add(i, h, f"{kind}.entropy", s["mean"], s["std"], s["se"], s["n"])
        for kind, pr in e["probe"].items():
            if isinstance(pr, str):
                add(i, None, f"probe.{kind}", pr)
            else:
                add(i, None, f"probe.{kind}", pr["accuracy"], pr["std"], pr["se"], pr["n"])
                add(i, None, f"probe.{kind}.chance", pr["chance"])
        att = e["attention"]
        if isinstance(att, str):
            add(i, None, "attention.entropy", att)
        else:
            for hrow in att["per_head"]:
                for f in ("entropy", "entropy_norm", "max_prob", "share_above_0.9", "logit_range"):
                    add(i, hrow["head"], f"attention.{f}", hrow[f])
        ex = e.get("experts")
        if ex is not None:  # a mixture of experts: the load per expert ("head" = the expert) and the router
            for j, f in enumerate(ex["fraction"]):
                add(i, j, "experts.load", f, n=ex["tokens"])
            add(i, None, "experts.load_entropy", ex["entropy"], n=ex["tokens"])
            add(i, None, "experts.load_entropy_normalised", ex["entropy_normalised"], n=ex["tokens"])
            r = ex["router_entropy"]
            add(i, None, "experts.router_entropy", r["mean"], r["std"], r["se"], r["n"])
    return rows


def layer_summary(report: dict) -> list[dict]:
    """One row per layer with the headline numbers (for the stdout table and comparisons)."""
    out = []
    for e in report["layers"]:
        row: dict = {"layer": e["layer"]}
        for kind, short in (("values", "v"), ("hidden", "h")):
            d = e[kind]
            row[f"{short}_entropy"] = d["entropy"]["mean"] if isinstance(d, dict) else None
            row[f"{short}_entropy_se"] = d["entropy"]["se"] if isinstance(d, dict) else None
            row[f"{short}_erank"] = d["erank_all"] if isinstance(d, dict) else None
            row[f"{short}_cosine"] = d["cosine"]["mean"] if isinstance(d, dict) else None
            pr = e["probe"][kind]
            row[f"probe_{short}"] = pr["accuracy"] if isinstance(pr, dict) else None
            row[f"probe_{short}_std"] = pr["std"] if isinstance(pr, dict) else None
        att = e["attention"]
        if isinstance(att, dict):
            heads = att["per_head"]
            row["attn_entropy_norm"] = _mean([h["entropy_norm"] for h in heads])
            row["attn_max_prob"] = _mean([h["max_prob"] for h in heads])
        else:
            row["attn_entropy_norm"] = row["attn_max_prob"] = None
        ex = e.get("experts")
        if ex is not None:
            row["expert_load_entropy_norm"] = ex["entropy_normalised"]
            row["router_entropy"] = ex["router_entropy"]["mean"]
        out.append(row)
    return out


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if _num(x) is not None]
    return float(np.mean(xs)) if xs else None


__all__ = ["layer_summary", "report_rows"]
