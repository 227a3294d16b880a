"""Overhead of curvature tracking during training (train.curvature_every) at the default curvature settings.

    python benchmarks/curvature_overhead.py [--every 200] [--steps 400] [--rounds 3] [--threads 1] [--set K=V ...]

Trains the same run (default grammar data, a small model: 2 layers, width 64, batch 32 x 64 tokens; change it with
--set) with tracking off and on, alternating round by round in one process so that machine noise hits both alike;
nothing is written to disk (train(run=None)). The on-runs use ``train.curvature_every=--every`` and every other
``train.curvature_*`` field at its default (λ_max only: 512 fixed validation tokens, Lanczos capped at 20 steps, no
trace, no preconditioned λ_max). Prints each round and two estimates of the overhead:

- measured: the wall time of the measurements themselves (each row's curvature_seconds, timed inside the tracked
  runs) / the time of the runs without tracking. This is the extra work tracking does, and what the exit code judges:
  1 if it exceeds 5%;
- paired: (CPU time of the runs with tracking - CPU time of the runs without) / CPU time without, summed over the
  rounds (process CPU time, which other programs on the machine disturb far less than wall time; with one torch
  thread it is this run's compute). It also catches indirect costs; printed, not judged.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from cemtool.config import resolve
from cemtool.data.corpus import load_corpus
from cemtool.train import finalize_model_config, train

LIMIT = 0.05
SMALL = ["model.n_layer=2", "model.d_model=64", "model.n_head=2", "train.eval_every=1000000",
         "train.warmup_steps=20", "train.log_every=1000000"]


def run_once(cfg, corpus) -> tuple[float, float, list[dict]]:
    """(wall seconds, process CPU seconds, the curvature rows) of one training run."""
    rows: list[dict] = []

    def cb(ev: dict) -> None:
        if ev.get("kind") == "curvature":
            rows.append(ev)

    t0, c0 = time.perf_counter(), time.process_time()
    train(cfg, corpus, None, device="cpu", callback=cb)
    return time.perf_counter() - t0, time.process_time() - c0, rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=200, help="train.curvature_every of the tracked runs (default 200)")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per run (default 400)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating off/on rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="config override KEY=VALUE")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = [*SMALL, f"train.max_steps={a.steps}", *a.sets]
    off = resolve(overrides=base)
    corpus = load_corpus(off.data)
    off = finalize_model_config(off, corpus)
    on = finalize_model_config(resolve(overrides=[*base, f"train.curvature_every={a.every}"]), corpus)
    t = on.train
    print(f"model {on.model.arch} n_layer={on.model.n_layer} d_model={on.model.d_model}, batch {t.batch_size} x "
          f"{on.data.seq_len} tokens, {a.steps} steps, {a.threads} thread(s); tracking: curvature_every={a.every}, "
          f"curvature_tokens={t.curvature_tokens}, curvature_steps={t.curvature_steps}, "
          f"curvature_trace={t.curvature_trace}, curvature_precond={t.curvature_precond}")
    run_once(off, corpus)  # warm-up: first-call costs (allocator, lazy imports) in neither column
    wall_off = cpu_off = cpu_on = measured = 0.0
    print(f"{'round':>5} {'off wall s':>11} {'on wall s':>10} {'off CPU s':>10} {'on CPU s':>9} {'CPU overhead':>13} "
          f"{'measurements s':>15} {'Lanczos steps':>14}")
    for r in range(a.rounds):
        w_off, c_off, _ = run_once(off, corpus)
        w_on, c_on, rows = run_once(on, corpus)
        secs = sum(row["curvature_seconds"] for row in rows)
        wall_off, cpu_off, cpu_on, measured = wall_off + w_off, cpu_off + c_off, cpu_on + c_on, measured + secs
        steps = ",".join(str(row["lanczos_steps"]) for row in rows)
        print(f"{r + 1:>5} {w_off:>11.2f} {w_on:>10.2f} {c_off:>10.2f} {c_on:>9.2f} {(c_on - c_off) / c_off:>13.2%} "
              f"{secs:>15.2f} {steps:>14}")
    overhead = measured / wall_off
    paired = (cpu_on - cpu_off) / cpu_off
    print(f"overhead (measured): the measurements took {measured:.2f} s = {overhead:.2%} of the {wall_off:.2f} s "
          f"without tracking (limit {LIMIT:.0%}: {'ok' if overhead <= LIMIT else 'EXCEEDED'})")
    print(f"overhead (paired CPU time, {a.rounds} rounds): {paired:+.2%} (off {cpu_off:.2f} s, on {cpu_on:.2f} s)")
    return 0 if overhead <= LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
