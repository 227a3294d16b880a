"""The GPU check behind scripts/gpu_check.sh: train, measure and cross-check on one machine, write one table.

    python benchmarks/gpu_check.py [--budget 240] [--device auto|cuda|cpu] [--tiny] [--out runs/gpu_check]
                                   [--sizes 25m,124m] [--archs baseline,cem-rec2,tmm,lime,alloc] [--steps N]
                                   [--no-compile] [--profile]

What it runs (each row of the table is one measurement; nothing is estimated or copied from a spec sheet):
1. matmul peak: the best bf16 (on CUDA; fp32 on CPU) FLOP/s of large square matmuls on this device, measured here;
   MFU below is against this measured peak.
2. training with cemtool's defaults for the device (on CUDA: torch.compile, bf16 autocast, fused attention, fused
   AdamW, host reads only at log steps) of the baseline and one architecture of each family (cem-rec2, tmm, lime,
   alloc = the baseline with model.alloc_strategy=early-heavy) at ~25M (8 x 512, 8 heads, seq 256, micro-batch 64,
   65,536 tokens per step) and, for the 124M shape (12 x 768, 12 heads, seq 1024, micro-batch 16, 131,072 tokens per
   step), the architectures in --archs-124m (default: the baseline); --tiny: 2 x 64 on the CPU. With --budget S
   every configuration trains for an equal share of S seconds, timed from its first logged step (start-up and
   compilation are reported apart, as "to first step"), then gets SIGTERM (cemtool checkpoints and stops); without
   it, --steps steps. tokens/s = the median of the logged intervals after the first; MFU = tokens/s x training
   FLOPs/token (counted by torch.utils.flop_counter on the model) / the measured peak, and beside it the same with
   nanoGPT's 6N + 12 L d T FLOPs/token.
3. with compilation on: the 25M baseline once more in eager mode (what compile buys).
4. `cemtool sharpness` (fp32, Lanczos both ends + trace) and `cemtool collapse-report` on each 25M run (wall time,
   lambda_max, convergence) and the process start-up of the CLI (`cemtool archs`).
5. --profile: torch.profiler over 5 steady steps of the 25M baseline (after 15 steps of warm-up and compilation),
   the top operators by device time in profile.txt: where the time goes when MFU falls short.
6. with two or more GPUs: `torchrun --nproc_per_node 2` training of the 25M baseline.
7. fused-vs-explicit attention: max |logit difference| between scaled_dot_product_attention and the explicit
   softmax path for every architecture, in fp32 and (CUDA) bf16.
Writes <out>/gpu_check.json and gpu_check.md (the table) after every step, so a check cut short still leaves what
it measured; exit code 1 when a step failed or a check is off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from train_throughput import matmul_peak  # benchmarks/ is on sys.path when run as a script

ARCHS = ["baseline", "cem-rec2", "tmm", "lime", "alloc"]
ALIASES = {"alloc": ("baseline", ["model.alloc_strategy=early-heavy"])}  # a family that is a baseline option


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    seq_len: int
    batch: int  # micro-batch
    tokens_per_step: int
    log_every: int
    train_tokens: int

    def sets(self) -> list[str]:
        return [f"model.n_layer={self.n_layer}", f"model.d_model={self.d_model}", f"model.n_head={self.n_head}",
                f"data.seq_len={self.seq_len}", f"train.batch_size={self.batch}",
                f"train.tokens_per_step={self.tokens_per_step}", f"train.log_every={self.log_every}",
                f"data.train_tokens={self.train_tokens}"]


SIZES = {"tiny": Size("tiny", 2, 64, 2, 64, 8, 512, 2, 200_000),
         "25m": Size("25m", 8, 512, 8, 256, 64, 65_536, 10, 4_000_000),
         "124m": Size("124m", 12, 768, 12, 1024, 16, 131_072, 5, 4_000_000)}


def arch_sets(name: str) -> tuple[str, list[str]]:
    """(cemtool architecture, its extra --set) of a check's architecture name."""
    return ALIASES.get(name, (name, []))


def cemtool(args: list[str], env: dict | None = None, launcher: list[str] | None = None,
            timeout: float = 3600) -> tuple[int, float, str]:
    """Run one cemtool command; (exit code, wall seconds, last lines of output)."""
    cmd = (launcher or [sys.executable, "-m", "cemtool"]) + args
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    out = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode, time.perf_counter() - t0, "\n".join(out[-3:])


def logged(run: Path) -> list[dict]:
    """The training rows of metrics.jsonl so far (a line being written is skipped)."""
    path = run / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "tokens_per_s" in row:
            rows.append(row)
    return rows


def throughput(run: Path) -> float | None:
    rates = [r["tokens_per_s"] for r in logged(run) if r.get("tokens_per_s")]
    return statistics.median(rates[1:] or rates) if rates else None


def train_timed(args: list[str], run: Path, seconds: float | None, timeout: float) -> dict:
    """`cemtool train ARGS` in a subprocess: until it ends (seconds None), or for ``seconds`` after its first logged
    step, then SIGTERM (it checkpoints and exits 143). Returns rc (0 for a stop we asked for), wall seconds, the
    seconds to the first logged step and the last lines of output."""
    t0 = time.perf_counter()
    log = run.with_name(run.name + ".log")
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "cemtool", *args], stdout=f, stderr=subprocess.STDOUT)
        first, stopped = None, False
        while proc.poll() is None:
            now = time.perf_counter()
            if first is None and logged(run):
                first = now
            if seconds is not None and first is not None and now - first >= seconds and not stopped:
                proc.send_signal(signal.SIGTERM)
                stopped = True
            if now - t0 > timeout:
                proc.kill()
                break
            time.sleep(0.25)
        try:
            rc = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    tail = "\n".join(log.read_text().strip().splitlines()[-3:])
    if first is None and logged(run):
        first = time.perf_counter()
    return {"rc": 0 if (stopped and rc == 143) else rc, "wall_s": time.perf_counter() - t0,
            "to_first_step_s": (first - t0) if first is not None else None, "error": tail if rc not in (0, 143) or
            (rc == 143 and not stopped) else None}


def flops_per_token(arch: str, sets: list[str], seq_len: int) -> tuple[float, float, int]:
    """(training FLOPs/token by torch.utils.flop_counter, nanoGPT's 6N + 12 L d T, non-embedding N) of the model."""
    from cemtool.config import replace, resolve
    from cemtool.models import build_model
    from cemtool.models import flops_per_token as counted

    cfg = resolve(arch=arch, overrides=sets)
    model = build_model(replace(cfg.model, vocab_size=cfg.model.vocab_size or 512, max_seq_len=seq_len))
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    n = sum(p.numel() for p in model.parameters()) - emb
    m = cfg.model
    return counted(model, seq_len)["train"], 6 * n + 12 * m.n_layer * m.d_model * seq_len, n


def profile_steps(size: Size, dev: torch.device, sets: list[str], out: Path) -> str:
    """torch.profiler over 5 steady steps of the baseline at ``size`` (15 steps of warm-up and compilation first):
    the top 20 operators by device time (CPU time on a CPU), written to out/profile.txt."""
    from torch.profiler import ProfilerActivity, profile, schedule

    from cemtool.config import resolve
    from cemtool.data.corpus import load_corpus
    from cemtool.train import finalize_model_config, train

    cfg = resolve(arch="baseline", overrides=[*size.sets(), *sets, "train.max_steps=20", "train.eval_every=1000",
                                              "train.eval_tokens=1024"])
    corpus = load_corpus(cfg.data)
    cfg = finalize_model_config(cfg, corpus)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts, schedule=schedule(wait=14, warmup=1, active=5)) as prof:
        train(cfg, corpus, None, device=dev.type,
              callback=lambda ev: prof.step() if ev.get("kind") == "step" else None)
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=20)
    (out / "profile.txt").write_text(table + "\n")
    return table


def attention_check(device: torch.device, overrides: list[str], archs: list[str]) -> list[dict]:
    from cemtool.config import replace, resolve
    from cemtool.models import attention_impl, build_model

    rows = []
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    for arch in archs:
        cfg = resolve(arch=arch, overrides=overrides)
        torch.manual_seed(0)
        model = build_model(replace(cfg.model, vocab_size=512, max_seq_len=128)).to(device).eval()
        x = torch.randint(0, 512, (2, 128), device=device)  # (B, T)
        for dt in dtypes:
            with torch.no_grad(), torch.autocast(device.type, dtype=dt, enabled=dt != torch.float32):
                with attention_impl("fused"):
                    a = model(x).float()  # (B, T, V)
                with attention_impl("explicit"):
                    b = model(x).float()  # (B, T, V)
            diff = float((a - b).abs().max())
            scale = float(b.abs().max())
            tol = 1e-4 if dt == torch.float32 else 5e-2
            rows.append({"arch": arch, "dtype": str(dt).replace("torch.", ""), "max_abs_diff": diff,
                         "max_abs_logit": scale, "ok": diff <= tol * max(1.0, scale)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.0, help="seconds of timed training in all, shared evenly by "
                    "the configurations (each timed from its first logged step); 0 = --steps steps each")
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 64 wide: the CPU smoke test")
    ap.add_argument("--out", default="runs/gpu_check", help="folder for the runs and the table")
    ap.add_argument("--sizes", default="25m,124m", help="comma-separated: 25m, 124m (--tiny: tiny)")
    ap.add_argument("--archs", default=",".join(ARCHS), help="architectures at 25M (default: one per family)")
    ap.add_argument("--archs-124m", default="baseline", help="architectures at the 124M shape")
    ap.add_argument("--steps", type=int, default=0, help="without --budget: steps per run (default 60; --tiny 12)")
    ap.add_argument("--no-compile", action="store_true", help="train.compile=false everywhere (no compile rows)")
    ap.add_argument("--profile", action="store_true", help="profile 5 steps of the baseline (profile.txt)")
    args = ap.parse_args()
    args.steps = args.steps or (12 if args.tiny else 60)
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("Error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 1
    if args.budget < 0 or args.steps < 1:
        print("Error: --budget must be >= 0 and --steps >= 1", file=sys.stderr)
        return 2
    sizes = [SIZES["tiny"]] if args.tiny else [SIZES[s] for s in args.sizes.split(",") if s]
    plan = [(size, a) for size in sizes for a in (args.archs if size.name != "124m" else args.archs_124m).split(",")
            if a]
    compiling = not args.no_compile and dev.type == "cuda"
    first = sizes[0]
    if compiling and any(a == "baseline" for s, a in plan if s == first):
        plan.append((first, "baseline:eager"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_gpu = torch.cuda.device_count() if dev.type == "cuda" else 0
    precision = "bf16" if dev.type == "cuda" else "fp32"
    peak_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor() or "cpu",
            "gpus": n_gpu, "torch": torch.__version__, "tiny": args.tiny, "precision": precision,
            "budget_s": args.budget, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                          time.gmtime())}
    peak = matmul_peak(1024 if args.tiny else 8192, device=dev, dtype=peak_dtype)
    info["matmul_peak_tflops"] = peak / 1e12
    share = args.budget / len(plan) if args.budget else None
    failures: list[str] = []
    common = [f"train.precision={precision}", "train.eval_tokens=1024", "train.warmup_steps=5"]
    if args.no_compile:
        common.append("train.compile=false")

    train_rows: list[dict] = []
    analysis_rows: list[dict] = []
    ddp_rows: list[dict] = []
    attn: list[dict] = []
    profile: list[str] = []

    def write(done: bool) -> str:
        """The table (and gpu_check.json) from the rows so far: written after every step, so a run cut short by a
        time limit still leaves what it measured."""
        lines = [f"# GPU check: {info['device']} ({n_gpu} GPU), torch {info['torch']}, {precision}, {info['date']}",
                 "", f"Command: `{info['command']}`", "",
                 f"Measured matmul peak ({str(peak_dtype).replace('torch.', '')}): {peak / 1e12:.2f} TFLOP/s", "",
                 "| size | arch | compile | params | tokens/step | tokens/s | MFU (counted) | MFU (6N+12LdT) | "
                 "to first step s | timed s | status |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in train_rows:
            ok = r["rc"] == 0 and r["tokens_per_s"]
            lines.append(f"| {r['size']} | {r['arch']} | {r['compile']} | {r['params'] or '-'} | "
                         f"{r['tokens_per_step']:,} | " +
                         (f"{r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {r['mfu_6n']:.1%} | "
                          if ok else "- | - | - | ") +
                         f"{r['to_first_step_s'] if r['to_first_step_s'] is None else round(r['to_first_step_s'], 1)}"
                         f" | {r['timed_s']:.1f} | {'ok' if ok else 'failed'} |")
        lines += ["", "| arch | analysis | wall s | λ_max | converged | status |", "|---|---|---|---|---|---|"]
        for r in analysis_rows:
            lam = f"{r['lambda_max']:.4g}" if r.get("lambda_max") is not None else "-"
            lines.append(f"| {r['arch']} | {r['analysis']} | {r['wall_s']:.1f} | {lam} | {r.get('converged', '-')} | "
                         f"{'ok' if r['rc'] == 0 else 'failed'} |")
        if ddp_rows:
            lines += ["", "| multi-GPU | tokens/s | wall s | status |", "|---|---|---|---|"]
            lines += [f"| {r['what']} | {r['tokens_per_s'] or '-'} | {r['wall_s']:.1f} | "
                      f"{'ok' if r['rc'] == 0 else 'failed'} |" for r in ddp_rows]
        else:
            lines += ["", f"multi-GPU: not run ({n_gpu} GPU)"]
        lines += ["", "| arch | dtype | max abs logit diff (fused vs explicit) | ok |", "|---|---|---|---|"]
        lines += [f"| {r['arch']} | {r['dtype']} | {r['max_abs_diff']:.2e} | {r['ok']} |" for r in attn]
        if profile:
            lines += ["", "Profile of 5 steady steps of the baseline (top operators; profile.txt):", "", "```",
                      *profile, "```"]
        if failures:
            lines += ["", "Failures:"] + [f"- {f}" for f in failures]
        if not done:
            lines += ["", "(partial: the check was still running when this was written)"]
        table = "\n".join(lines)
        (out / "gpu_check.md").write_text(table + "\n")
        (out / "gpu_check.json").write_text(json.dumps({"info": info, "train": train_rows, "analyses": analysis_rows,
                                                        "ddp": ddp_rows, "attention": attn, "failures": failures,
                                                        "complete": done},
                                                       indent=1, allow_nan=False))
        return table

    for size, name in plan:
        label, _, mode = name.partition(":")
        arch, extra = arch_sets(label)
        sets = size.sets() + extra + common + (["train.compile=false"] if mode == "eager" else [])
        steps = 10 ** 7 if share else args.steps
        sets += [f"train.max_steps={steps}", f"train.eval_every={steps}"]
        fpt, fpt_6n, _ = flops_per_token(arch, size.sets() + extra, size.seq_len)
        run = out / f"{size.name}-{label}{'-eager' if mode else ''}"
        res = train_timed(["train", "--arch", arch, "--out", str(run), "--force", "--device", dev.type, "-q"] +
                          [a for o in sets for a in ("--set", o)], run, share, timeout=(share or 0) + 900)
        tps = throughput(run) if res["rc"] == 0 else None
        meta = json.loads((run / "meta.json").read_text()) if (run / "meta.json").exists() else {}
        sessions = meta.get("sessions") or [{}]
        row = {"size": size.name, "arch": label, "compile": ("fallback" if sessions[-1].get("compile_fallback") else
                                                              bool(sessions[-1].get("compiled"))),
               **res, "params": (meta.get("params") or {}).get("total"), "tokens_per_step": size.tokens_per_step,
               "tokens_per_s": tps, "train_flops_per_token": fpt, "flops_6n_per_token": fpt_6n,
               "timed_s": max(0.0, res["wall_s"] - (res["to_first_step_s"] or res["wall_s"])),
               "compile_fallback": sessions[-1].get("compile_fallback"),
               "mfu": tps * fpt / peak if tps else None, "mfu_6n": tps * fpt_6n / peak if tps else None}
        train_rows.append(row)
        if res["rc"] or not tps:
            failures.append(f"train {size.name} {name}: {res['error']}")
        write(False)

    rc, wall, tail = cemtool(["archs"])
    analysis_rows.append({"arch": "-", "analysis": "CLI start-up (cemtool archs)", "rc": rc, "wall_s": wall,
                          "error": tail if rc else None})
    for size, name in plan:
        run = out / f"{size.name}-{name}"
        if size != first or ":" in name or not (run / "meta.json").exists():
            continue
        tokens = "1024" if args.tiny else "16384"
        quick = ["--quick"] if args.tiny else []  # --tiny: small Lanczos/trace budgets (a smoke test)
        quick += ["--checkpoint", "latest"] if share else []  # a timed run stops at SIGTERM: its newest checkpoint
        rc, wall, tail = cemtool(["sharpness", str(run), "--dtype", "fp32", "--tokens", tokens, "--device",
                                  dev.type, "--no-plots", "-q"] + quick)
        rep = run / "reports" / "sharpness.json"
        lam, conv = None, None
        if rc == 0 and rep.exists():
            r = json.loads(rep.read_text())
            eig = r.get("eigen") or {}
            lam = (eig.get("top") or [None])[0]
            conv = all(eig.get("top_converged") or [False]) and all(eig.get("bottom_converged") or [True])
        analysis_rows.append({"arch": name, "analysis": "sharpness", "rc": rc, "wall_s": wall, "lambda_max": lam,
                              "converged": conv, "error": tail if rc else None})
        rc2, wall2, tail2 = cemtool(["collapse-report", str(run), "--tokens", tokens, "--device", dev.type,
                                     "--no-plots", "-q"] + (["--checkpoint", "latest"] if share else []))
        analysis_rows.append({"arch": name, "analysis": "collapse-report", "rc": rc2, "wall_s": wall2,
                              "error": tail2 if rc2 else None})
        failures += [f"{a} {name}: {t}" for a, r_, t in (("sharpness", rc, tail), ("collapse", rc2, tail2)) if r_]
        write(False)

    if args.profile:
        try:
            profile += profile_steps(first, dev, common, out).splitlines()[:26]
        except Exception as e:  # noqa: BLE001 (the table says what failed; the other rows stand)
            failures.append(f"profile: {type(e).__name__}: {e}")
        write(False)

    if n_gpu >= 2:
        run = out / "baseline-ddp2"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "cemtool"]
        sets = first.sets() + common + [f"train.max_steps={args.steps}", f"train.eval_every={args.steps}"]
        rc, wall, tail = cemtool(["train", "--arch", "baseline", "--out", str(run), "--force", "-q"] +
                                 [a for o in sets for a in ("--set", o)], launcher=launcher)
        ddp_rows.append({"what": "torchrun x2 train baseline", "rc": rc, "wall_s": wall,
                         "tokens_per_s": throughput(run) if rc == 0 else None, "error": tail if rc else None})
        if rc:
            failures.append(f"torchrun train: {tail}")

    archs = sorted({arch_sets(n.partition(":")[0])[0] for s, n in plan if s == first})
    attn += attention_check(dev, first.sets()[:3], archs)
    failures += [f"attention {r['arch']} {r['dtype']}: diff {r['max_abs_diff']:.2e}" for r in attn if not r["ok"]]

    print(write(True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
