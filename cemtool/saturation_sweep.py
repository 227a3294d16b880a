"""The saturation sweep (METHODS §4): small models trained over head sizes d_h at a fixed attention budget H*d_h
(or a fixed head count) and over sequence lengths T; per T the final loss against d_h, the gain per doubling of d_h
and the saturation point. ``cemtool saturation sweep`` parses its options into a :class:`SweepSpec` and calls
:func:`run_sweep`; this module trains (through :func:`cemtool.start.start_or_resume`, so a completed grid point in
the sweep folder is reused) and never prints: progress goes to the caller's callback."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cemtool.config import resolve
from cemtool.errors import CemtoolError, UsageError
from cemtool.report import provenance
from cemtool.start import start_or_resume

Progress = Callable[[int, int, str], None]  # (steps done, steps in all, status)


# --------------------------------------------------------------------------------------------------------------
# the grid and the summary


@dataclass(frozen=True)
class SweepPoint:
    seq_len: int
    head_dim: int
    heads: int
    seed: int
    lr: float | None = None  # a tuning point's learning rate (None: the sweep's --lr, or the tuned one)

    @property
    def name(self) -> str:
        return f"T{self.seq_len}-dh{self.head_dim}-s{self.seed}" + ("" if self.lr is None else f"-lr{self.lr:g}")


def sweep_grid(head_dims: Sequence[int], seq_lens: Sequence[int], seeds: Sequence[int], budget: int | None,
               rope: bool = True, heads: int | None = None) -> list[SweepPoint]:
    """Every (T, d_h, seed): at a fixed budget, H = budget / d_h heads (refusing sizes that do not divide it); at a
    fixed head count (``heads``), H = heads and the budget H * d_h grows with d_h."""
    if not head_dims or not seq_lens or not seeds:
        raise CemtoolError("the sweep needs at least one head size, one sequence length and one seed")
    if (budget is None) == (heads is None):
        raise CemtoolError("give the sweep either a budget H*d_h or a fixed head count, not both")
    if heads is not None and heads < 1:
        raise CemtoolError(f"the head count must be >= 1, got {heads}")
    for d in head_dims:
        if d < 1 or (budget is not None and budget % d):
            raise CemtoolError(f"head size {d} does not divide the budget H*d_h = {budget}",
                               hint="choose head sizes that divide --budget")
        if rope and d % 2:
            raise CemtoolError(f"head size {d} is odd: RoPE needs even head sizes")
    for T in seq_lens:
        if T < 2:
            raise CemtoolError(f"sequence length {T} is too short (at least 2)")
    return [SweepPoint(T, d, heads if heads is not None else budget // d, s) for T in sorted(set(seq_lens))
            for d in sorted(set(head_dims)) for s in sorted(set(seeds))]


def choose_lrs(rows: list[dict]) -> dict[tuple[int, int], float]:
    """(T, d_h) -> the learning rate with the lowest mean final validation loss over the tuning rows of that point
    (a diverged run, loss None or not finite, counts as infinitely bad)."""
    by: dict[tuple[int, int], dict[float, list[float]]] = {}
    for r in rows:
        loss = r.get("val_loss")
        bad = loss is None or not math.isfinite(loss)
        by.setdefault((r["seq_len"], r["head_dim"]), {}).setdefault(r["lr"], []).append(math.inf if bad else loss)
    return {k: min(v, key=lambda lr: (sum(v[lr]) / len(v[lr]), lr)) for k, v in by.items()}


def _gain(a: dict, b: dict) -> float:
    """Loss gained per doubling of the head size from point a to the larger point b (nats)."""
    return (a["loss"] - b["loss"]) / math.log2(b["head_dim"] / a["head_dim"])


def summarise_sweep(results: list[dict], threshold: float = 0.01) -> list[dict]:
    """Per sequence length: mean ± se final loss per head size, the gain per doubling of d_h to the next size,
    and the saturation point: the smallest d_h from which no larger d_h in the grid gains ``threshold`` nats per
    doubling or more, (L(d) - L(d'))/log2(d'/d) < threshold for every d' > d (None when even the second-largest
    size is beaten; on a convex, falling curve this is where the next doubling first gains less than the
    threshold, and a dip after a bump is not mistaken for saturation). ``results``: rows with seq_len,
    head_dim, seed, val_loss (and val_floor)."""
    out = []
    for T in sorted({r["seq_len"] for r in results}):
        rows = [r for r in results if r["seq_len"] == T and r.get("val_loss") is not None]
        dims = sorted({r["head_dim"] for r in rows})
        points = []
        for d in dims:
            losses = np.array([r["val_loss"] for r in rows if r["head_dim"] == d], dtype=np.float64)
            se = float(losses.std(ddof=1) / math.sqrt(len(losses))) if len(losses) > 1 else None
            floors = [r.get("val_floor") for r in rows if r["head_dim"] == d and r.get("val_floor") is not None]
            points.append({"head_dim": d, "loss": float(losses.mean()), "se": se, "seeds": int(len(losses)),
                           "floor": float(np.mean(floors)) if floors else None})
        for a, b in zip(points, points[1:], strict=False):
            a["gain_per_doubling"] = _gain(a, b)
        if points:
            points[-1]["gain_per_doubling"] = None
        sat = next((a["head_dim"] for i, a in enumerate(points[:-1])
                    if all(_gain(a, b) < threshold for b in points[i + 1:])), None)
        out.append({"seq_len": T, "points": points, "saturation_head_dim": sat, "threshold": threshold})
    return out


# --------------------------------------------------------------------------------------------------------------
# training the grid


@dataclass(frozen=True)
class SweepSpec:
    """What the sweep trains: the grid (head sizes, a budget or a head count, sequence lengths, seeds), the model
    and its training (steps, width, depth, lr or an lr grid tuned on ``tune_seeds``, tokens per step), the data and
    the saturation threshold. Validated on construction (the mutually exclusive options, disjoint seeds)."""

    head_dims: list[int]
    seq_lens: list[int]
    seeds: list[int]
    budget: int | None = None
    heads: int | None = None
    steps: int = 300
    d_model: int = 32
    n_layer: int = 1
    lr: float = 1e-2
    lrs: list[float] | None = None
    tune_seeds: list[int] = field(default_factory=list)
    batch_tokens: int = 1024
    data: str = "ngram"
    arch: str = "baseline"
    train_tokens: int = 200_000
    eval_tokens: int = 4096
    threshold: float = 0.01
    extra: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget is not None and self.heads is not None:
            raise UsageError("--budget and --heads: a fixed budget and a fixed head count exclude each other; give "
                             "one")
        if self.budget is None and self.heads is None:
            object.__setattr__(self, "budget", 16)
        if not self.lrs:
            object.__setattr__(self, "tune_seeds", [])
        both = sorted(set(self.tune_seeds) & set(self.seeds))
        if both:
            raise UsageError(f"--tune-seeds {both} are also comparison seeds: the lr would be chosen on the runs it "
                             f"is judged by")

    def options(self) -> dict:
        """The options as the report's provenance records them."""
        return {"head_dims": self.head_dims, "budget": self.budget, "heads": self.heads, "seq_lens": self.seq_lens,
                "seeds": self.seeds, "steps": self.steps, "d_model": self.d_model, "n_layer": self.n_layer,
                "lr": self.lr, "lrs": self.lrs, "tune_seeds": self.tune_seeds, "batch_tokens": self.batch_tokens,
                "data": self.data, "arch": self.arch, "train_tokens": self.train_tokens,
                "eval_tokens": self.eval_tokens, "set": self.extra}

    def config(self, p: SweepPoint, lr: float):
        """The run configuration of one grid point."""
        steps = self.steps
        overrides = [f"model.n_layer={self.n_layer}", f"model.d_model={self.d_model}", f"model.n_head={p.heads}",
                     f"model.head_dim={p.head_dim}", f"data.seq_len={p.seq_len}",
                     f"train.batch_size={max(1, self.batch_tokens // p.seq_len)}", f"train.max_steps={steps}",
                     f"train.eval_every={steps}", f"train.eval_tokens={self.eval_tokens}",
                     f"train.log_every={max(1, steps // 10)}", f"train.warmup_steps={min(30, steps // 10)}",
                     f"train.lr={lr}", f"data.train_tokens={max(1000, self.train_tokens)}",
                     f"data.val_tokens={max(128, 2 * self.eval_tokens)}", *self.extra]
        return resolve(arch=self.arch, overrides=overrides, seed=p.seed, data_source=self.data)

    def grids(self) -> tuple[list[SweepPoint], list[SweepPoint]]:
        """(the comparison points, the tuning points: every lr of ``lrs`` at every point of ``tune_seeds``)."""
        probe = self.config(sweep_grid(self.head_dims[:1], self.seq_lens[:1], self.seeds[:1], self.budget,
                                       rope=False, heads=self.heads)[0], self.lr)
        rope = probe.model.pos == "rope"
        points = sweep_grid(self.head_dims, self.seq_lens, self.seeds, self.budget, rope=rope, heads=self.heads)
        tune = [replace(p, lr=x) for p in sweep_grid(self.head_dims, self.seq_lens, self.tune_seeds, self.budget,
                                                     rope=rope, heads=self.heads) for x in self.lrs] \
            if self.lrs else []
        return points, tune


def train_points(spec: SweepSpec, points: list[SweepPoint], root: Path, device, lrs: dict | None = None,
                 progress: Progress | None = None, done: int = 0, total: int = 0) -> list[dict]:
    """Train every grid point (a completed one is reused); one row per point. A point's lr: its own (a tuning
    point), else ``lrs[(T, d_h)]`` (the tuned one), else the spec's. A tuning run may diverge (a row with its loss
    None: the lr is then judged infinitely bad); a comparison run must complete."""
    results: list[dict] = []
    corpora: dict = {}
    steps = spec.steps
    for k, p in enumerate(points):
        run_dir = root / ("tune" if p.lr is not None else "runs") / p.name
        lr = p.lr if p.lr is not None else (lrs or {}).get((p.seq_len, p.head_dim), spec.lr)
        row = {"seq_len": p.seq_len, "head_dim": p.head_dim, "heads": p.heads, "seed": p.seed, "lr": lr,
               "run": str(run_dir)}
        at = done + k * steps

        def cb(ev: dict, at=at, name=p.name) -> None:
            if progress and ev["kind"] == "step":
                loss = f" loss {ev['loss']:.3f}" if ev.get("loss") is not None else ""
                progress(at + ev["step"], total, f"{name}{loss}")

        st = start_or_resume(spec.config(p, lr), run_dir, device=device, existing="reuse", corpora=corpora,
                             extra_meta={"sweep": str(root)}, callback=cb)
        if st.how == "reused":
            meta = st.run.meta()
            row.update(val_loss=meta.get("val_loss"), val_floor=meta.get("val_floor"), reused=True,
                       params=meta.get("params", {}).get("total"), seconds=meta.get("train_seconds"))
        else:
            res = st.result
            if res.status != "completed" and not (p.lr is not None and res.status == "diverged"):
                raise CemtoolError(f"training {p.name} ended {res.status}",
                                   hint="rerun with the same --out to resume the sweep")
            row.update(val_loss=res.val_loss, val_floor=res.val_floor, reused=False,
                       params=st.run.meta().get("params", {}).get("total"), seconds=res.seconds)
        results.append(row)
        if progress:
            progress(at + steps, total, p.name + (" (reused)" if row["reused"] else ""))
    return results


def run_sweep(spec: SweepSpec, root: Path, device, progress: Progress | None = None) -> dict:
    """Tune (if ``spec.lrs``), train the grid, summarise: the report's payload (provenance, results, summary, the
    tuning rows and the lr chosen per (T, d_h))."""
    points, tune = spec.grids()
    total = (len(points) + len(tune)) * spec.steps
    tuning = train_points(spec, tune, root, device, progress=progress, total=total) if tune else []
    chosen = choose_lrs(tuning) if tuning else None
    results = train_points(spec, points, root, device, lrs=chosen, progress=progress, done=len(tune) * spec.steps,
                           total=total)
    return {"provenance": provenance(root, command="saturation sweep", options=spec.options()),
            "task": spec.data, "budget": spec.budget, "heads": spec.heads, "steps": spec.steps,
            "seeds": spec.seeds, "threshold": spec.threshold, "results": results,
            "summary": summarise_sweep(results, spec.threshold),
            "tuning": {"rows": tuning, "chosen": [{"seq_len": t, "head_dim": d, "lr": x}
                                                  for (t, d), x in sorted(chosen.items())]} if chosen else None}


__all__ = ["SweepPoint", "SweepSpec", "choose_lrs", "run_sweep", "summarise_sweep", "sweep_grid", "train_points"]
