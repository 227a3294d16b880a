"""Peak memory of `cemtool sharpness` and `cemtool collapse-report` is flat in the number of evaluation tokens N.

    python benchmarks/analysis_memory.py [--small 16384] [--large 262144] [--run DIR]

Trains (or reuses, with --run) a run of the default model (`cemtool train` with no --arch or model settings: the
baseline, 4 layers, d_model 128, on the grammar corpus) for 2 steps, with a validation split large enough for
--large tokens. Then, for N = --small and --large, a fresh process runs each command on the CPU and reports its peak
resident set (ru_maxrss) and wall time:

- sharpness with a minimal budget (loss, gradient, λ_max with 3 Lanczos steps; no trace, density, SAM or slices)
  and --graph-memory 0: every HVP recomputes each batch's first-order graph (pure streaming). Kept graphs are the
  one thing allowed to grow with N, up to the stated --graph-memory budget (default a quarter of the free memory);
- collapse-report with its defaults (batches of 16 windows).

A baseline process imports cemtool and torch and does nothing else. Prints a table and, per command, the ratio of
the peak at --large to the peak at --small (target <= 1.2). Exit code 0 always (it reports, it does not judge).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, resource, runpy, sys, time
t0 = time.perf_counter()
sys.argv = ["cemtool"] + sys.argv[1:]
code = 0
if len(sys.argv) > 1:
    try:
        runpy.run_module("cemtool", run_name="__main__")
    except SystemExit as e:
        code = e.code or 0
else:
    import torch, cemtool.cli.main  # noqa: F401
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - t0, "code": code}))
"""

SHARPNESS = ["--top-k", "1", "--bottom-k", "0", "--lanczos-steps", "3", "--tol", "0", "--trace-hvps", "0",
             "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0", "--avg-rho", "0", "--landscape", "none"]


def measure(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "{}"
    res = json.loads(last) if last.startswith("{") else {}
    if out.returncode or res.get("code"):
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{out.stderr[-2000:]}")
    return res


def train_run(folder: Path, tokens: int) -> Path:
    run = folder / "default"
    sets = ["train.max_steps=2", "train.eval_every=2", "train.eval_tokens=1024", "data.train_tokens=50000",
            f"data.val_tokens={int(tokens * 1.1)}"]
    cmd = [sys.executable, "-m", "cemtool", "train", "--out", str(run), "--quiet", "--device", "cpu"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, check=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=16384)
    ap.add_argument("--large", type=int, default=262144)
    ap.add_argument("--run", type=Path, default=None, help="an existing run with enough validation tokens")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        run = args.run or train_run(Path(d), args.large)
        print(f"run {run} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        common = [str(run), "--device", "cpu", "--quiet"]
        commands = {
            "sharpness --graph-memory 0": lambda n: ["sharpness", *common, "--tokens", str(n), *SHARPNESS,
                                                     "--graph-memory", "0", "--no-plots", "--name", f"mem-{n}"],
            "collapse-report": lambda n: ["collapse-report", *common, "--tokens", str(n), "--no-plots",
                                          "--name", f"mem-{n}"],
        }
        base = measure([])
        rows = [("imports only", "-", base)]
        for name, make in commands.items():
            for n in (args.small, args.large):
                res = measure(make(n))
                print(f"{name} N={n}: {res['peak_rss_mib']:.0f} MiB, {res['seconds']:.1f} s", file=sys.stderr)
                rows.append((name, n, res))
    print(f"{'command':<32} {'N tokens':>9} {'peak RSS MiB':>13} {'seconds':>8}")
    for name, n, m in rows:
        print(f"{name:<32} {n!s:>9} {m['peak_rss_mib']:>13,.0f} {m['seconds']:>8.1f}")
    for name in commands:
        small, large = (m["peak_rss_mib"] for nm, n, m in rows if nm == name)
        print(f"{name}: peak RSS at N={args.large} / N={args.small} = {large / small:.3f} (target <= 1.2)")


if __name__ == "__main__":
    main()
