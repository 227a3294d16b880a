"""The findings study (research/scripts/study.sh's grammar and muon parts) at GPU scale, on a corpus of token files.

    research/scripts/study_gpu.sh --data PATH [--size 25m|125m] [--gpus K] [--out DIR] [--tokens N] [--to PATH]
                         [--set key=value ...] [--device auto|cpu|cuda] [--yes] [--estimate-only]
                         [--budget-minutes M] [--tiny]

The same groups as study.sh, as ordinary `cemtool sweep` studies (a tuning study on seeds 100,101 over a learning
rate grid, then a comparison with --tuned on other seeds), grouped into chains that must run in order (a tuning
study before its comparisons). K lanes run side by side, one per GPU (CUDA_VISIBLE_DEVICES=i, --device cuda) or
one CPU thread each; a lane that finishes a chain takes the next longest one. Before anything trains, every
architecture (at each size the groups use) trains a few steps on the real device, and the measured tokens/s gives
the time estimate table; then it asks (unless --yes). Rerunning the same command continues where it stopped:
completed runs, probes and reports are skipped. See research/docs/study_gpu.md.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cemtool.errors import CemtoolError

MOMENTUM = ["hb", "nesterov", "tmm", "adam", "adamw", "rmsprop", "muon", "ortho", "soap", "shampoo"]
CEM = ["cem", "cem-rec2", "cem-precond", "cem-dplr", "cem-full"]
TUNE_SEEDS = [100, 101]
MUON_GRID = "train.muon_lr=0.01,0.02,0.04"
BATCH_KEYS = {"train.batch_size": "batch_size", "train.grad_accum": "grad_accum", "data.seq_len": "seq_len"}
TUNE_FRACTION = 10  # tuning runs train on 1/10 of the comparison's tokens (research/docs/study_gpu.md says why)


@dataclass(frozen=True)
class Size:
    """A model size and its training budget."""

    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch_size: int
    grad_accum: int
    tokens: int  # comparison runs (tuning: tokens / TUNE_FRACTION, or tune_tokens)
    seeds: tuple[int, ...]  # comparison seeds
    lr_grid: str
    warmup_steps: int
    eval_every: int
    eval_tokens: int
    log_every: int
    probe_steps: int  # steps of the timed probe run
    tune_tokens: int = 0  # 0 = tokens / TUNE_FRACTION
    muon_grid: str = MUON_GRID  # the tuning grid of the muon part
    tune_seeds: tuple[int, ...] = tuple(TUNE_SEEDS)  # the seeds of every tuning run
    analysis_options: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()  # further --set of every run

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len

    def whole_steps(self, tokens: float) -> int:
        """tokens rounded to a whole number of optimizer steps (at least one)."""
        return max(1, round(tokens / self.tokens_per_step)) * self.tokens_per_step

    def sets(self) -> list[str]:
        return [f"model.n_layer={self.n_layer}", f"model.d_model={self.d_model}", f"model.n_head={self.n_head}",
                f"data.seq_len={self.seq_len}", f"train.batch_size={self.batch_size}",
                f"train.grad_accum={self.grad_accum}", f"train.warmup_steps={self.warmup_steps}",
                f"train.eval_every={self.eval_every}", f"train.eval_tokens={self.eval_tokens}",
                f"train.log_every={self.log_every}", *self.extra]


SIZES = {
    # GPT-2 small: 124M parameters with GPT-2's 50,257 tokens (85M without the tied embedding); 2.5B tokens per
    # comparison run (~20 per parameter), 3 comparison seeds
    "125m": Size(12, 768, 12, 1024, 32, 4, 2_500_000_000, (0, 1, 2), "train.lr=3e-4,6e-4,1.2e-3", 200, 1000,
                 1_048_576, 20, 30),
    # 8 layers x 320 (5 heads of 64): 25.9M parameters with GPT-2's vocabulary (9.8M without the embedding);
    # 520M tokens per comparison run (~20 per parameter), 5 comparison seeds
    "25m": Size(8, 320, 5, 1024, 32, 4, 520_093_696, (0, 1, 2, 3, 4), "train.lr=6e-4,1.2e-3,2.4e-3", 100, 500,
                524_288, 20, 30),
    # --tiny: the pipeline end to end on a CPU in a few minutes; the numbers mean nothing. Two-point grids (a
    # selection still has a choice to make), one tuning seed and the smallest analyses, since the suite runs it
    # (research/tests)
    "tiny": Size(2, 32, 2, 32, 16, 1, 4096, (0, 1), "train.lr=1e-3,1e-2", 2, 10**6, 512, 2, 6,
                 tune_tokens=2048, muon_grid="train.muon_lr=0.01,0.04", tune_seeds=(100,),
                 analysis_options=("sharpness.tokens=128", "sharpness.lanczos_steps=3", "sharpness.top_k=1",
                                   "sharpness.trace_hvps=4", "sharpness.density_runs=0", "sharpness.avg_samples=0",
                                   "sharpness.landscape=none", "collapse.tokens=1024", "collapse.folds=2"),
                 # soap's and shampoo's R^{-1/2} by 2 Newton steps, not 10: a third of their step time at this size
                 # (94 -> 30 ms a forward and backward), where they were half of the study's training and analyses
                 extra=("model.momentum.newton_steps=2",)),
}


# --------------------------------------------------------------------------------------------------------------
# the studies


@dataclass
class Sweep:
    """One `cemtool sweep`: a tuning study (grid) or a comparison (tuned)."""

    dir: str  # relative to --out
    archs: list[str]
    seeds: list[int]
    tokens: int
    probe: str  # the probe whose speeds it takes
    sets: list[str] = field(default_factory=list)  # tuning: the group's --set beyond the size's
    grid: str | None = None
    tuned: str | None = None
    analyses: list[str] = field(default_factory=list)
    lr_from: tuple[str, str] | None = None  # (tuning study, arch): train.lr as that study chose it for that arch

    @property
    def runs(self) -> int:
        return len(self.archs) * len(self.seeds) * (len(self.grid.split("=", 1)[1].split(",")) if self.grid else 1)


@dataclass
class Chain:
    """Sweeps that run in order (a tuning study, then the comparisons that select on it)."""

    name: str
    sweeps: list[Sweep]
    hours: float = 0.0


def group(part: str, name: str, archs: list[str], size: Size, grid: str, analyses: list[str], probe: str,
          sets: list[str] = ()) -> Chain:
    """study.sh's `group`: tune the architectures, then compare them on the comparison seeds."""
    tune = Sweep(f"{part}/tune/{name}", archs, list(size.tune_seeds), tune_tokens(size), probe, list(sets),
                 grid=grid)
    compare = Sweep(f"{part}/{name}", archs, list(size.seeds), size.tokens, probe, tuned=tune.dir, analyses=analyses)
    return Chain(f"{part}/{name}", [tune, compare])


def tune_tokens(size: Size) -> int:
    return size.tune_tokens or size.whole_steps(size.tokens / TUNE_FRACTION)


def chains(size: Size, shapes: dict, lime_ratio: float) -> list[Chain]:
    """The groups of study.sh's grammar part (in `main/`) and its muon part (in `muon/`)."""
    S, grid, sf = list(size.seeds), size.lr_grid, ["sharpness", "forgetting"]
    core_archs = ["baseline", "lime", *CEM]
    core = Chain("main/core", [
        Sweep("main/tune/core", core_archs, list(size.tune_seeds), tune_tokens(size), "default", grid=grid),
        Sweep("main/core", ["baseline", "lime"], S, size.tokens, "default", tuned="main/tune/core",
              analyses=["sharpness", "collapse", "forgetting"]),
        Sweep("main/cem", CEM, S, size.tokens, "default", tuned="main/tune/core"),
        # the baseline trained on LIMe's training FLOPs: more tokens by the ratio of their FLOPs per token
        Sweep("main/baseline-lime-flops", ["baseline"], S, size.whole_steps(size.tokens * lime_ratio), "default",
              tuned="main/tune/core"),
        # claims 6-8 at a shared lr as well as at each one's own: every momentum architecture at the baseline's
        # tuned lr (study.sh's stdlib part: momentum-shared-lr), after the tuning it reads
        Sweep("main/momentum-shared-lr", MOMENTUM, S, size.tokens, "default", analyses=sf,
              lr_from=("main/tune/core", "baseline"))])
    controls = [  # the controls of study.sh's stdlib part that can flip a verdict
        # the momentum streams without learned embeddings: the baseline's parameters (claims 4-8)
        group("main", "momentum-zero", ["hb", "nesterov", "tmm"], size, grid, sf, "default",
              ["model.momentum.stream_init=zero"]),
        # LIMe's router at the reference code's absolute lr, and a random router frozen at initialisation (11-14)
        group("main", "lime-router-abs", ["lime"], size, grid, ["collapse"], "default", ["model.lime.router_lr=0.01"]),
        group("main", "lime-frozen", ["lime"], size, grid, ["collapse"], "default", ["model.lime.freeze_router=true"]),
        # value entropy and separability at initialisation: one step at lr 0 leaves the weights as initialised
        Chain("main/init", [Sweep("main/init", ["baseline", "lime"], S, size.tokens_per_step, "default",
                                  ["train.lr=0"], analyses=["collapse"])]),
    ]
    return [
        group("main", "momentum", MOMENTUM, size, grid, sf, "default"),
        group("main", "baseline-wide", ["baseline"], size, grid, sf, "wide", shapes["wide"]),
        core,
        group("main", "baseline-cem-size", ["baseline"], size, grid, [], "cem-size", shapes["cem-size"]),
        group("main", "early-heavy", ["baseline"], size, grid, [], "early-heavy", ["model.alloc_strategy=early-heavy"]),
        group("main", "late-lowrank", ["baseline"], size, grid, [], "late-lowrank",
              ["model.alloc_strategy=late-lowrank"]),
        group("main", "late-lowrank-75", ["baseline"], size, grid, [], "late-lowrank-75", shapes["late-lowrank-75"]),
        group("main", f"depth{3 * size.n_layer}", ["baseline", "lime"], size, grid, ["collapse"], "deep",
              shapes["deep"]),
        *controls,
        group("muon", "lane1", ["baseline", "hb", "nesterov", "tmm", "adam", "adamw"], size, size.muon_grid, sf,
              "muon",
              ["train.optimizer=muon"]),
        group("muon", "lane2", ["rmsprop", "muon", "ortho", "soap", "shampoo"], size, size.muon_grid, sf, "muon",
              ["train.optimizer=muon"]),
    ]


# --------------------------------------------------------------------------------------------------------------
# sizes of the matched groups (parameter counts of models built on the meta device: no FLOPs, no memory)


def param_count(arch: str, sets: list[str], vocab: int, seq_len: int) -> dict:
    import torch

    from cemtool.config import resolve
    from cemtool.models.registry import build_model

    cfg = resolve(arch=arch, overrides=[*sets, f"model.vocab_size={vocab}", f"model.max_seq_len={seq_len}"])
    with torch.device("meta"):  # shapes without memory or initialisation: instant at 125M
        return build_model(cfg.model).num_params()


def fit_mlp(sets: list[str], key: str, target: int, vocab: int, seq_len: int, d_model: int) -> tuple[int, int]:
    """(MLP width, count) of the baseline nearest ``target`` (the count is linear in the MLP width)."""
    from cemtool.models.layers import mlp_hidden

    m0 = mlp_hidden(d_model, "swiglu", 0)
    c0 = param_count("baseline", [*sets, f"model.mlp_hidden={m0}"], vocab, seq_len)[key]
    c1 = param_count("baseline", [*sets, f"model.mlp_hidden={m0 + 64}"], vocab, seq_len)[key]
    m = max(8, round((m0 + (target - c0) * 64 / (c1 - c0)) / 8) * 8)
    return m, param_count("baseline", [*sets, f"model.mlp_hidden={m}"], vocab, seq_len)[key]


def fit_width(sets: list[str], target: int, vocab: int, seq_len: int, d_guess: float, head: int) -> dict:
    """The baseline's width (heads of about ``head`` dims, even sizes) and MLP width nearest ``target``
    non-embedding parameters."""
    n_head = max(1, round(d_guess / head))
    step = 2 * n_head
    best = None
    for d in sorted({max(step, round(d_guess / step) * step + k * step) for k in (-1, 0, 1)}):
        s = [*sets, f"model.d_model={d}", f"model.n_head={n_head}"]
        m, c = fit_mlp(s, "non_embedding", target, vocab, seq_len, d)
        if best is None or abs(c - target) < abs(best["count"] - target):
            best = {"sets": [*s[len(sets):], f"model.mlp_hidden={m}"], "count": c}
    return best


def late_lowrank_75(size: Size) -> list[int]:
    """Head sizes at 75% of the uniform attention budget: the early layers uniform, the late half's sizes
    falling linearly to the last layer (study.sh's [16,16,10,6] for 4 layers of 4 heads of 16)."""
    L, dh = size.n_layer, size.d_model // size.n_head
    P = L // 2
    late_sum = round(0.75 * L * dh) - (L - P) * dh
    weights = list(range(P, 0, -1))
    late = [max(2, 2 * round(late_sum * w / sum(weights) / 2)) for w in weights]
    late[0] += late_sum - sum(late)  # the rounding remainder (even) on the first late layer
    return [dh] * (L - P) + late


def matched_shapes(size: Size, vocab: int) -> tuple[dict, list[list]]:
    """The --set of each matched group, and rows (group, what, reference, count, relative difference)."""
    base, T = size.sets(), size.seq_len
    ref = param_count("baseline", base, vocab, T)
    tmm = param_count("tmm", base, vocab, T)
    cem = param_count("cem", base, vocab, T)
    wide_m, wide_c = fit_mlp(base, "total", tmm["total"], vocab, T, size.d_model)
    head = size.d_model // size.n_head
    small = fit_width(base, cem["non_embedding"], vocab, T,
                      size.d_model * math.sqrt(cem["non_embedding"] / ref["non_embedding"]), head)
    deep_sets = [*base, f"model.n_layer={3 * size.n_layer}"]
    deep = fit_width(deep_sets, ref["non_embedding"], vocab, T, size.d_model / math.sqrt(3), head)
    dims = late_lowrank_75(size)
    shapes = {"wide": [f"model.mlp_hidden={wide_m}"], "cem-size": small["sets"],
              "deep": [f"model.n_layer={3 * size.n_layer}", *deep["sets"]],
              "late-lowrank-75": [f"model.head_dims=[{','.join(map(str, dims))}]"]}
    budget = sum(dims) / (size.n_layer * head)
    rows = [["baseline-wide", "params", "tmm", tmm["total"], wide_c],
            ["baseline-cem-size", "non-embedding", "cem", cem["non_embedding"], small["count"]],
            [f"depth{3 * size.n_layer}", "non-embedding", "baseline", ref["non_embedding"], deep["count"]]]
    rows = [[*r, r[4] / r[3] - 1] for r in rows]
    rows.append(["late-lowrank-75", "attention budget", "uniform", size.n_layer * head, sum(dims), budget - 1])
    return shapes, rows


# --------------------------------------------------------------------------------------------------------------
# the probes: a few timed steps of every architecture at every size, on the study's device


def probe_plans(size: Size, shapes: dict) -> dict[str, tuple[list[str], list[str]]]:
    """probe name -> (architectures, --set beyond the size's)."""
    return {"default": (["baseline", "lime", *CEM, *MOMENTUM], []),
            "muon": (["baseline"], ["train.optimizer=muon"]),  # Muon's cost relative to AdamW, for every arch
            "wide": (["baseline"], shapes["wide"]),
            "cem-size": (["baseline"], shapes["cem-size"]),
            "early-heavy": (["baseline"], ["model.alloc_strategy=early-heavy"]),
            "late-lowrank": (["baseline"], ["model.alloc_strategy=late-lowrank"]),
            "late-lowrank-75": (["baseline"], shapes["late-lowrank-75"]),
            "deep": (["baseline", "lime"], shapes["deep"])}


def steady_rate(run: Path) -> float:
    """Training tokens/s of a probe run: the median of metrics.jsonl's tokens_per_s after the first window (which
    holds the step-0 evaluation and the warm-up)."""
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    return statistics.median(rates[1:] or rates)


def run_probes(out: Path, size: Size, data_sets: list[str], data: str, shapes: dict, device: str,
               analysis_options: dict, scan_s: float) -> dict:
    """Train every probe (or find it trained), and time sharpness and collapse on the baseline's probe run.
    Returns {"rate": {probe: {arch: tokens/s}}, "overhead_s", "flops": {arch: FLOPs/token}, "params": {arch: n},
    "analysis_s"}.
    overhead_s: a run's time in its sweep besides training and analyses (building the model, counting its FLOPs,
    checkpoints), measured when the probes train and kept in estimate/overhead.json for reruns."""
    import json

    import torch

    from cemtool.sweep import make_plan, run_sweep
    from cemtool.writes import atomic_write_text

    if device == "cpu":
        torch.set_num_threads(1)  # as a lane
    probe_sets = [*size.sets(), *data_sets, f"train.log_every={max(1, size.probe_steps // 6)}",
                  f"train.eval_every={10 ** 9}", f"train.eval_tokens={size.tokens_per_step // size.grad_accum}"]
    tokens = size.probe_steps * size.tokens_per_step
    rate, overhead, flops, params = {}, [], {}, {}
    plans = dict(probe_plans(size, shapes))
    plans["analyses"] = (["baseline"], [])
    for name, (archs, sets) in plans.items():
        analyses = ["sharpness", "collapse"] if name == "analyses" else []
        plan = make_plan(archs, [0], tokens=tokens, data=data, overrides=[*probe_sets, *sets], analyses=analyses,
                         options={k: v for k, v in analysis_options.items() if k in analyses})
        fresh = not (out / "estimate" / name / "study.json").exists()
        t0 = time.perf_counter()
        manifest = run_sweep(out / "estimate" / name, plan, device=device)
        if fresh:  # the sweep's wall time besides reading the corpus, training and analyses, per run
            inside = sum(i["seconds"] + sum(a["seconds"] for a in i["analyses"].values()) for i in manifest["items"])
            overhead += [max(0.0, time.perf_counter() - t0 - scan_s - inside) / len(manifest["items"])]
        failed = [i for i in manifest["items"] if i["status"] != "completed"]
        if failed:  # e.g. out of memory: lower train.batch_size and raise train.grad_accum (research/docs/study_gpu.md)
            sys.exit(f"Error: the probe run {out / 'estimate' / name / failed[0]['run']} failed: {failed[0]['error']}")
        for item in manifest["items"]:
            r = steady_rate(out / "estimate" / name / item["run"])
            rate.setdefault(name, {})[item["arch"]] = r
            if name == "default":
                flops[item["arch"]] = item["flops_per_token"]
                params[item["arch"]] = item["params"]
            if name == "analyses":
                analysis_s = {a: v["seconds"] for a, v in item["analyses"].items()}
    saved = out / "estimate" / "overhead.json"
    if overhead:
        atomic_write_text(saved, json.dumps({"overhead_s": statistics.median(overhead)}))
    overhead_s = json.loads(saved.read_text())["overhead_s"] if saved.is_file() else 0.0
    if device == "cuda":
        torch.cuda.empty_cache()  # the lanes need the memory of the first GPU
    return {"rate": rate, "overhead_s": overhead_s, "flops": flops, "params": params, "analysis_s": analysis_s}


# --------------------------------------------------------------------------------------------------------------
# the estimate


def run_seconds(probes: dict, sweep: Sweep, arch: str, size: Size, tokens: int) -> float:
    """Training plus evaluations (forward only: a third of a training step's time per token) plus overhead."""
    rate = probes["rate"]
    r = rate[sweep.probe].get(arch)
    if r is None:  # an arch timed only under AdamW: add Muon's extra time per token, measured on the baseline
        r = 1 / (1 / rate["default"][arch] + 1 / rate["muon"]["baseline"] - 1 / rate["default"]["baseline"])
    steps = tokens // size.tokens_per_step
    evals = steps // size.eval_every + 2
    return tokens / r + evals * size.eval_tokens / (3 * r) + probes["overhead_s"]


def startup_seconds(probes: dict) -> float:
    """A sweep's own start: Python and torch, the plan's checks, one pass over the corpus."""
    return probes["startup_s"] + probes["scan_s"]


def adamw_rate(probes: dict, sweep: Sweep, arch: str) -> float:
    """Training tokens/s of the arch at the sweep's size under AdamW (as its fine-tune trains)."""
    rate = probes["rate"]
    return rate["default" if sweep.probe == "muon" else sweep.probe][arch]


def analysis_seconds(probes: dict, sweep: Sweep, arch: str, size: Size) -> float:
    """Sharpness and collapse: the baseline probe's measured times, scaled by the arch's training speed;
    forgetting: its fine-tune (a quarter of the run's steps, at most 1,000; 21 evaluations on both corpora; a pass
    over each corpus)."""
    r = adamw_rate(probes, sweep, arch)
    slow = probes["rate"]["default"]["baseline"] / r
    s = sum(probes["analysis_s"].get(a, 0.0) * slow for a in sweep.analyses if a != "forgetting")
    if "forgetting" in sweep.analyses:
        ft_tokens = min(1000, math.ceil(0.25 * sweep.tokens / size.tokens_per_step)) * size.tokens_per_step
        s += ft_tokens / r + 21 * 2 * size.eval_tokens / (3 * r) + probes["overhead_s"] + 2 * probes["scan_s"]
    return s


def sweep_hours(probes: dict, sweep: Sweep, size: Size) -> float:
    per_arch = [run_seconds(probes, sweep, a, size, sweep.tokens) + analysis_seconds(probes, sweep, a, size)
                for a in sweep.archs]
    return (sum(per_arch) * sweep.runs / len(sweep.archs) + startup_seconds(probes)) / 3600


def lane_hours(work: list[Chain], lanes: int) -> float:
    """Wall hours of the chains on this many lanes, longest chain first to the first free lane."""
    free = [0.0] * lanes
    for c in sorted(work, key=lambda c: -c.hours):
        heapq.heapreplace(free, free[0] + c.hours)
    return max(free)


def startup_time(launcher: Launcher, args: list[str]) -> float:
    """Seconds of a sweep's start as a lane starts it (a forked child or a process: Launcher; checking the plan),
    timed on a --dry-run of the largest one. The launcher's server stays up for the lane that gets it."""
    launcher.run(["--help"], os.devnull, {"OMP_NUM_THREADS": "1"})  # starts the server: not each sweep's start
    t0 = time.perf_counter()
    rc = launcher.run([*args, "--dry-run"], os.devnull, {"OMP_NUM_THREADS": "1"})
    if rc:
        sys.exit(f"Error: the dry run of the first sweep failed (exit {rc}): {' '.join(launcher.argv(args))}")
    return time.perf_counter() - t0


def print_estimate(probes: dict, work: list[Chain], size: Size, lanes: int, device: str) -> None:
    print(f"{'study':<34} {'runs':>5} {'tokens/run':>14} {'est. hours':>11}")
    for c in work:
        for s in c.sweeps:
            print(f"{s.dir:<34} {s.runs:>5} {s.tokens:>14,} {sweep_hours(probes, s, size):>11.3g}")
    total = sum(c.hours for c in work)
    runs = sum(s.runs for c in work for s in c.sweeps)
    print(f"{'total':<34} {runs:>5} {'':>14} {total:>11.3g}")
    print(f"(each sweep {startup_seconds(probes):.0f} s to start and read the corpus; each run "
          f"{probes['overhead_s']:.1f} s besides its training; sharpness, collapse and forgetting included)")
    print(f"estimate: {total:.3g} device-hours; {lane_hours(work, lanes):.3g} hours on {lanes} lane(s) of {device} "
          f"(the longest chain: {max(c.hours for c in work):.3g} h)")


def budget_plan(probes: dict, work: list[Chain], size: Size, minutes: float, lanes: int,
                per_param: float = 20.0) -> list[str]:
    """What fits in ``minutes`` of device time, from the measured rates: one run of each architecture at
    ``per_param`` training tokens per parameter (Chinchilla's ~20) with its sharpness and collapse, how many such
    runs fit, and which of the study's chains fit in order (the order chains() puts them in) on the lanes."""
    lines = [f"within {minutes:g} minutes of device time ({lanes} lane(s)); one run at {per_param:g} tokens/param:",
             f"{'arch':<16} {'params':>12} {'tokens':>14} {'minutes/run':>12} {'runs that fit':>14}"]
    default = next(s for c in work for s in c.sweeps if s.probe == "default")
    for arch, n in sorted(probes["params"].items()):
        tokens = size.whole_steps(int(per_param * n))
        sec = run_seconds(probes, default, arch, size, tokens) + probes["analysis_s"].get("sharpness", 0.0) + \
            probes["analysis_s"].get("collapse", 0.0)
        lines.append(f"{arch:<16} {n:>12,} {tokens:>14,} {sec / 60:>12.2f} {int(minutes * 60 * lanes // sec):>14}")
    left, fit = minutes / 60, []
    for c in work:  # in the study's order: a chain that does not fit is skipped, a later shorter one may
        if c.hours / lanes <= left:  # a chain runs on one lane; lanes share the budget
            fit.append(c)
            left -= c.hours / lanes
    names = ", ".join(s.dir for c in fit for s in c.sweeps) or "none"
    lines.append(f"chains of this study that fit: {len(fit)} of {len(work)} ({names}); "
                 f"{(minutes / 60 - left) * 60:.1f} of {minutes:g} minutes used")
    return lines


# --------------------------------------------------------------------------------------------------------------
# running the lanes


def sweep_args(s: Sweep, out: Path, size: Size, common: list[str], options: list[str], target: str | None,
               device: str) -> list[str]:
    """The arguments of `cemtool` for one sweep (the executable and its process: Launcher)."""
    argv = ["sweep", "--seeds", ",".join(map(str, s.seeds)), "--tokens", str(s.tokens)]
    if s.tuned:
        argv += ["--tuned", str(out / s.tuned), "--archs", ",".join(s.archs)]
    else:
        argv += ["--archs", ",".join(s.archs), *(["--grid", s.grid] if s.grid else []), *common]
        argv += [x for v in [*s.sets, *shared_lr(s, out)] for x in ("--set", v)]
    if s.analyses:
        argv += ["--analyses", ",".join(s.analyses)]
        argv += [x for o in options if o.split(".")[0] in s.analyses for x in ("-A", o)]
        if "forgetting" in s.analyses and target:
            argv += ["--to", target]
    return [*argv, "--out", str(out / s.dir), "--device", device, "--quiet"]


def shared_lr(s: Sweep, out: Path) -> list[str]:
    """``train.lr=X`` with X the learning rate ``s.lr_from``'s tuning study chose for its architecture (read when
    the sweep starts, after the tuning study before it in the chain); nothing for other sweeps. A tuning study
    that has not selected is one line, as the sweep's refusals are."""
    if s.lr_from is None:
        return []
    study, arch = s.lr_from
    sel = out / study / "selection.json"
    if not sel.is_file():
        raise CemtoolError(f"{s.dir} takes train.lr from {out / study}, which has not selected (no selection.json)")
    try:
        return [f"train.lr={json.loads(sel.read_text())['archs'][arch]['chosen']['train.lr']}"]
    except (ValueError, KeyError, TypeError) as e:  # a selection without the arch (nothing to choose) or unreadable
        raise CemtoolError(f"{s.dir} takes train.lr from {sel}, which has no choice of {arch}'s train.lr "
                           f"({type(e).__name__}: {e})") from None


def log(out: Path, line: str) -> None:
    with open(out / "study.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {line}\n")


class Launcher:
    """How a lane starts a `cemtool` command. With CEMTOOL set: that executable, one process per command. By
    default: a child forked from the lane's own server process (fork_server), which imported torch and cemtool's
    sweep command once, so that a sweep starts in milliseconds instead of the 2.5-3 s that importing torch takes
    on a CPU core (the tiny study of research/tests runs 44 sweeps; research/docs/study_gpu.md). The server is a
    fresh single-threaded interpreter: no lane thread and no CUDA context is forked, and each child sets its own
    CUDA_VISIBLE_DEVICES before torch touches a GPU. One Launcher serves one lane: its commands run one at a time."""

    def __init__(self):
        self.exe = os.environ.get("CEMTOOL", "").split()
        self.server: subprocess.Popen | None = None

    def argv(self, args: list[str]) -> list[str]:
        """The command line the lane runs (as printed in a message)."""
        return [*(self.exe or [sys.executable, "-m", "cemtool"]), *args]

    def run(self, args: list[str], log_path: str, env: dict[str, str]) -> int:
        """`cemtool ARGS` with stdout and stderr into log_path and env on top of this process's: its exit status
        (128 + N when signal N ended it)."""
        if self.exe:
            with open(log_path, "w") as f:
                return subprocess.run(self.argv(args), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**os.environ, **env}).returncode
        if self.server is None or self.server.poll() is not None:
            code = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); " \
                   "import study_gpu; study_gpu.fork_server()"
            self.server = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        self.server.stdin.write(json.dumps({"args": args, "log": log_path, "env": env}) + "\n")
        self.server.stdin.flush()
        reply = self.server.stdout.readline()
        if not reply:
            sys.exit(f"Error: the lane's fork server ended (exit {self.server.wait()}) while it ran: "
                     f"{' '.join(self.argv(args))}")
        return int(reply)

    def close(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.stdin.close()  # the server leaves at the end of its input
            self.server.wait()


def fork_server() -> None:
    """A lane's server (Launcher): imports cemtool's commands and torch once, then for each request line
    {"args", "log", "env"} forks a child that runs `cemtool ARGS` into the log, waits for it and answers its exit
    status on a line."""
    import torch._dynamo  # noqa: F401  (imported by the first torch.optim optimizer a process builds: 1.1-1.4 s)

    import cemtool.cli.main  # noqa: F401  (the commands)
    import cemtool.sweep  # noqa: F401  (the sweep command's modules, torch among them)

    ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the sweep's to handle, not the server's
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                signal.signal(signal.SIGINT, ctrl_c)  # as the lane's process had it (ignored in a background job)
                cemtool_child(request["args"], request["log"], request["env"])
            finally:
                os._exit(70)  # reached only when the child fails before cemtool runs (e.g. its log cannot be opened)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(status if status >= 0 else 128 - status, flush=True)


def cemtool_child(args: list[str], log_path: str, env: dict[str, str]) -> None:
    """In a forked child of fork_server: `cemtool ARGS` as its own process would run it, then leave with its
    status."""
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    sys.argv = ["cemtool", *args]
    from cemtool.cli.main import main  # imported already, in the server

    code = 0
    try:
        main()
    except SystemExit as e:  # how every command ends (typer)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # as the interpreter would report it
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_lane(lane: int, queue: list[Chain], lock: threading.Lock, args_of, launcher: Launcher, out: Path,
             device: str, failed: list[str]) -> None:
    env = {"OMP_NUM_THREADS": "1"}
    if device == "cuda":  # lane i on the i-th visible GPU (of CUDA_VISIBLE_DEVICES when it is set)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") \
            else [str(i) for i in range(torch_device_count())]
        env["CUDA_VISIBLE_DEVICES"] = gpus[lane % len(gpus)]
    while True:
        with lock:
            if not queue:
                launcher.close()
                return
            chain = queue.pop(0)
        for s in chain.sweeps:
            log(out, f"lane {lane} start {s.dir}")
            print(f"lane {lane}: {s.dir} ({s.runs} runs)", flush=True)
            (out / s.dir).parent.mkdir(parents=True, exist_ok=True)
            try:
                argv = args_of(s)
            except Exception as e:  # (shared_lr: no choice to read) noted, and the lane goes on
                log(out, f"lane {lane} exit 1 {s.dir}: {e}")
                with lock:
                    failed.append(f"{s.dir} ({e})")
                continue
            rc = launcher.run(argv, str(out / f"{s.dir}.log"), env)
            log(out, f"lane {lane} {'done ' if rc == 0 else f'exit {rc}'} {s.dir}")
            if rc:
                with lock:
                    failed.append(f"{s.dir} (exit {rc}, see {out / s.dir}.log)")


def torch_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def run_all(work: list[Chain], launchers: list[Launcher], args_of, out: Path, device: str) -> list[str]:
    """The chains on one lane per launcher, longest chain first to the first free lane."""
    queue = sorted(work, key=lambda c: -c.hours)
    lock, failed = threading.Lock(), []
    threads = [threading.Thread(target=run_lane, args=(i, queue, lock, args_of, launcher, out, device, failed))
               for i, launcher in enumerate(launchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failed


# --------------------------------------------------------------------------------------------------------------
# the tiny corpus


def tiny_corpus(out: Path) -> tuple[str, str, str]:
    """The grammar corpus and its sibling grammar-b (the forgetting target) as nanoGPT-style uint16 train.bin /
    val.bin folders, with the grammar's word tokenizer as a Hugging Face tokenizer.json (as GPT-2's would be):
    (data folder, target folder, tokenizer path). Written once; a rerun finds them."""
    import numpy as np

    from cemtool.config import DataConfig
    from cemtool.data.corpus import load_corpus
    from cemtool.writes import atomic_write_bytes

    root = out / "data"
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        cfg = {"train_tokens": 60_000, "val_tokens": 8_000, "seq_len": 32}
        src = load_corpus(DataConfig(source="grammar", **cfg))
        tgt = load_corpus(DataConfig(source="grammar-b", **cfg), tokenizer=src.tokenizer)
        for name, corpus in (("grammar", src), ("grammar-b", tgt)):
            (root / name).mkdir(parents=True, exist_ok=True)
            for split in ("train", "val"):
                ids = np.asarray(getattr(corpus, split), dtype=np.uint16)
                atomic_write_bytes(root / name / f"{split}.bin", ids.astype("<u2").tobytes())
        atomic_write_bytes(tok_path, src.tokenizer.hf.to_str().encode())
    return str(root / "grammar"), str(root / "grammar-b"), str(tok_path)


def data_vocab(data: str, data_sets: list[str]) -> int:
    """The vocabulary the runs will have: model.vocab_size if set, else the corpus's tokenizer's."""
    from cemtool.config import resolve
    from cemtool.data.corpus import load_corpus

    cfg = resolve(arch="baseline", overrides=data_sets, data_source=data)
    return cfg.model.vocab_size or load_corpus(cfg.data).tokenizer.vocab_size


# --------------------------------------------------------------------------------------------------------------
# main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="research/scripts/study_gpu.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", help="token files: a .bin/.npy file or a folder with train.bin (and val.bin); "
                                  "with --tiny default: a grammar corpus written under OUT/data")
    p.add_argument("--to", help="forgetting target: token files of the same tokenizer (grammar-b's with --tiny)")
    p.add_argument("--size", choices=("25m", "125m"), default="125m")
    p.add_argument("--gpus", type=int, help="lanes side by side: one per GPU (default: every visible GPU; 1 on cpu)")
    p.add_argument("--out", default="runs/study-gpu", help="the study folder (default runs/study-gpu)")
    p.add_argument("--tokens", type=int, help="training tokens of each comparison run (tuning: a tenth)")
    p.add_argument("--set", dest="sets", action="append", default=[], help="config override of every run, e.g. "
                   "data.tokenizer=gpt2/tokenizer.json or train.compile=true (repeatable)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--yes", action="store_true", help="start without asking")
    p.add_argument("--estimate-only", action="store_true", help="print the estimate and exit")
    p.add_argument("--budget-minutes", type=float, default=0.0, help="with the estimate: what fits in this many "
                   "minutes of device time (runs at 20 tokens/param per architecture, and the chains that fit)")
    p.add_argument("--tiny", action="store_true", help="a tiny model, tiny budgets and seeds 0,1: the whole "
                                                       "pipeline in minutes on a CPU")
    return p.parse_args(argv)


def absolute(path: str | None) -> str | None:
    """A path that exists, made absolute: the studies record it, and a rerun from elsewhere finds the same data."""
    return str(Path(path).resolve()) if path is not None and Path(path).exists() else path


def absolute_set(item: str) -> str:
    key, _, value = item.partition("=")
    return f"{key}={absolute(value)}" if key == "data.tokenizer" else item


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not (args.yes or args.estimate_only or sys.stdin.isatty()):
        print("Error: stdin is not a terminal, so the study cannot ask before it starts: add --yes to start it "
              "(or --estimate-only)", file=sys.stderr)
        return 2
    import dataclasses

    import torch

    from cemtool.config import merge, parse_override

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    lanes = max(1, args.gpus or (torch.cuda.device_count() if device == "cuda" else 1))
    size = SIZES["tiny" if args.tiny else args.size]
    for key, _, value in (item.partition("=") for item in args.sets):
        if key in BATCH_KEYS:  # a batch shape given with --set: the budgets are counted in its steps
            size = dataclasses.replace(size, **{BATCH_KEYS[key]: int(value)})
    size = dataclasses.replace(size, tokens=size.whole_steps(args.tokens or size.tokens))
    out = Path(args.out).resolve()  # the comparisons record their tuning study's path: the same on every rerun
    data, target, data_sets = absolute(args.data), absolute(args.to), [absolute_set(v) for v in args.sets]
    if not (args.tiny and data is None):
        for what, path in (("--data", data), ("--to", target)):
            if path is None or not Path(path).exists():
                print(f"Error: {what} {'is required' if path is None else f'{path} does not exist'} (token files: a "
                      f".bin/.npy file or a folder with train.bin; --to: the forgetting target, e.g. TinyStories "
                      f"for OpenWebText as in METHODS §7, in the same tokenizer)", file=sys.stderr)
                return 2
    out.mkdir(parents=True, exist_ok=True)
    if args.tiny and data is None:
        data, tiny_target, tok = tiny_corpus(out)
        target = target or tiny_target
        data_sets.append(f"data.tokenizer={tok}")
    t0 = time.perf_counter()
    vocab = data_vocab(data, data_sets)
    scan_s = time.perf_counter() - t0
    print(f"size {'tiny' if args.tiny else args.size}: {size.n_layer} layers x {size.d_model} ({size.n_head} heads), "
          f"seq {size.seq_len}, {size.tokens_per_step:,} tokens per step, vocabulary {vocab:,}; device {device}, "
          f"{lanes} lane(s)")
    shapes, rows = matched_shapes(size, vocab)
    print(f"{'group':<20} {'matches':<17} {'of':<9} {'reference':>12} {'this':>12} {'diff':>7}")
    for g, what, ref, a, b, err in rows:
        print(f"{g:<20} {what:<17} {ref:<9} {a:>12,} {b:>12,} {err:>+7.1%}")
    options = list(size.analysis_options)
    opt_dict: dict = {}
    for o in options:  # as `cemtool sweep -A` reads them
        opt_dict = merge(opt_dict, parse_override(o))
    print(f"timing every architecture: {size.probe_steps} steps each on {device} (in {out / 'estimate'})", flush=True)
    probes = run_probes(out, size, data_sets, data, shapes, device, opt_dict, scan_s)
    lime_ratio = probes["flops"]["lime"] / probes["flops"]["baseline"]
    work = chains(size, shapes, lime_ratio)
    common = ["--data", data, *[x for v in [*size.sets(), *data_sets] for x in ("--set", v)]]

    def args_of(s: Sweep) -> list[str]:
        return sweep_args(s, out, size, common, options, target, device)

    launchers = [Launcher() for _ in range(lanes)]  # lane 0's server starts (and is timed) here
    probes["scan_s"], probes["startup_s"] = scan_s, startup_time(launchers[0], args_of(work[0].sweeps[0]))
    for c in work:
        c.hours = sum(sweep_hours(probes, s, size) for s in c.sweeps)
    print_estimate(probes, work, size, lanes, device)
    if args.budget_minutes > 0:
        print("\n".join(budget_plan(probes, work, size, args.budget_minutes, lanes)))
    if args.estimate_only:
        launchers[0].close()
        return 0
    if not args.yes and input("start the study? [y/N] ").strip().lower() not in ("y", "yes"):
        launchers[0].close()
        print("not started")
        return 1
    start = time.time()
    failed = run_all(work, launchers, args_of, out, device)
    minutes = (time.time() - start) / 60
    log(out, f"study: {minutes:.1f} min")
    print(f"study: {minutes:.1f} min; {len(failed)} of {sum(len(c.sweeps) for c in work)} sweeps failed"
          + "".join(f"\n  {f}" for f in failed))
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except CemtoolError as e:  # a bad --set, unreadable token files...: one line, as the CLI prints it
        sys.exit(f"Error: {e}")
