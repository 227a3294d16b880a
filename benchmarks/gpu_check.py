"""The GPU check behind scripts/gpu_check.sh: train, measure and cross-check on one machine, print one table.

    python benchmarks/gpu_check.py [--device auto|cuda|cpu] [--tiny] [--out runs/gpu_check] [--steps 60]

What it runs (each row of the table is one measurement; nothing is estimated or copied from a spec sheet):
1. matmul peak: the best bf16 (on CUDA; fp32 on CPU) FLOP/s of large square matmuls on this device, measured here;
   MFU below is against this measured peak.
2. training of baseline, cem-rec2, tmm and lime at ~25M parameters (8 layers x 512 wide on the built-in grammar
   corpus; --tiny: 2 x 64) in bf16 autocast (CUDA) with and without torch.compile: tokens/s (median of the logged
   intervals after the first) and MFU = tokens/s x training FLOPs/token (torch.utils.flop_counter) / peak.
3. `cemtool sharpness` (fp32, Lanczos both ends + trace) and `cemtool collapse-report` on each eager run: wall
   time, λ_max and whether Lanczos converged.
4. with two or more GPUs: `torchrun --nproc_per_node 2` training of the baseline (tokens/s against one GPU).
5. fused-vs-explicit attention: max |logit difference| between scaled_dot_product_attention and the explicit
   softmax path for every architecture, in fp32 and (CUDA) bf16.
Writes <out>/gpu_check.json and gpu_check.md (the table); exit code 1 when a step failed or a check is off.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from train_throughput import matmul_peak  # benchmarks/ is on sys.path when run as a script

ARCHS = ["baseline", "cem-rec2", "tmm", "lime"]


def cemtool(args: list[str], env: dict | None = None, launcher: list[str] | None = None,
            timeout: float = 3600) -> tuple[int, float, str]:
    """Run one cemtool command; (exit code, wall seconds, last lines of output)."""
    cmd = (launcher or [sys.executable, "-m", "cemtool"]) + args
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    out = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode, time.perf_counter() - t0, "\n".join(out[-3:])


def size_overrides(tiny: bool) -> list[str]:
    return ["model.n_layer=2", "model.d_model=64", "model.n_head=2"] if tiny else \
        ["model.n_layer=8", "model.d_model=512", "model.n_head=8"]


def train_overrides(args) -> list[str]:
    seq = 64 if args.tiny else 256
    batch = 8 if args.tiny else 32
    return [f"data.seq_len={seq}", f"train.batch_size={batch}", f"train.max_steps={args.steps}",
            f"train.log_every={max(1, args.steps // 6)}", f"train.eval_every={args.steps}",
            "train.eval_tokens=1024", "train.warmup_steps=5",
            f"data.train_tokens={200_000 if args.tiny else 4_000_000}"]


def throughput(run: Path) -> float | None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")]
    return statistics.median(rates[1:] or rates) if rates else None


def train_flops_per_token(arch: str, overrides: list[str], seq_len: int) -> float:
    from cemtool.config import replace, resolve
    from cemtool.models import build_model, flops_per_token

    cfg = resolve(arch=arch, overrides=overrides)
    model = build_model(replace(cfg.model, vocab_size=cfg.model.vocab_size or 512, max_seq_len=seq_len))
    return flops_per_token(model, seq_len)["train"]


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
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    ap.add_argument("--tiny", action="store_true", help="2 layers x 64 wide, few steps: the CPU smoke test")
    ap.add_argument("--out", default="runs/gpu_check", help="folder for the runs and the table")
    ap.add_argument("--steps", type=int, default=0, help="training steps per run (default 60; --tiny 12)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    ap.add_argument("--archs", default=",".join(ARCHS), help="comma-separated architectures (default: all four)")
    args = ap.parse_args()
    args.steps = args.steps or (12 if args.tiny else 60)
    archs = [a for a in args.archs.split(",") if a]
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("Error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    n_gpu = torch.cuda.device_count() if dev.type == "cuda" else 0
    precision = "bf16" if dev.type == "cuda" else "fp32"
    peak_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    info = {"device": torch.cuda.get_device_name(0) if dev.type == "cuda" else platform.processor() or "cpu",
            "gpus": n_gpu, "torch": torch.__version__, "tiny": args.tiny, "precision": precision}
    peak = matmul_peak(1024 if args.tiny else 8192, device=dev, dtype=peak_dtype)
    info["matmul_peak_tflops"] = peak / 1e12
    failures: list[str] = []
    sizes = size_overrides(args.tiny)
    seq = 64 if args.tiny else 256
    base = sizes + train_overrides(args) + [f"train.precision={precision}"]
    compiles = [False] if args.no_compile else [False, True]

    train_rows: list[dict] = []
    analysis_rows: list[dict] = []
    ddp_rows: list[dict] = []
    attn: list[dict] = []

    def write(done: bool) -> str:
        """The table (and gpu_check.json) from the rows so far: written after every step, so a run cut short by a
        time limit still leaves what it measured."""
        lines = [f"# GPU check: {info['device']} ({n_gpu} GPU), torch {info['torch']}, "
                 f"{'tiny' if args.tiny else '~25M'} models, {precision}", "",
                 f"Measured matmul peak ({str(peak_dtype).replace('torch.', '')}): {peak / 1e12:.2f} TFLOP/s", "",
                 "| arch | compile | params | tokens/s | MFU | wall s | status |", "|---|---|---|---|---|---|---|"]
        for r in train_rows:
            lines.append(f"| {r['arch']} | {r['compile']} | {r['params'] or '-'} | "
                         f"{r['tokens_per_s']:.0f} | {r['mfu']:.1%} | {r['wall_s']:.1f} | ok |" if r["rc"] == 0 else
                         f"| {r['arch']} | {r['compile']} | - | - | - | {r['wall_s']:.1f} | failed |")
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

    for arch in archs:
        fpt = train_flops_per_token(arch, sizes, seq)
        for comp in compiles:
            run = out / f"{arch}{'-compiled' if comp else ''}"
            rc, wall, tail = cemtool(["train", "--arch", arch, "--out", str(run), "--force", "--device", dev.type,
                                      "-q"] + [a for o in base + [f"train.compile={str(comp).lower()}"]
                                               for a in ("--set", o)])
            tps = throughput(run) if rc == 0 else None
            params = (json.loads((run / "meta.json").read_text()).get("params") or {}).get("total") if rc == 0 else None
            train_rows.append({"arch": arch, "compile": comp, "rc": rc, "wall_s": wall, "params": params,
                               "tokens_per_s": tps, "train_flops_per_token": fpt,
                               "mfu": tps * fpt / peak if tps else None, "error": tail if rc else None})
            if rc:
                failures.append(f"train {arch} compile={comp}: {tail}")
            write(False)

    for arch in archs:
        run = out / arch
        if not (run / "meta.json").exists():
            continue
        tokens = "1024" if args.tiny else "16384"
        quick = ["--quick"] if args.tiny else []  # --tiny: small Lanczos/trace budgets (a smoke test)
        rc, wall, tail = cemtool(["sharpness", str(run), "--dtype", "fp32", "--tokens", tokens, "--device",
                                  dev.type, "--no-plots", "-q"] + quick)
        rep = run / "reports" / "sharpness.json"
        lam, conv = None, None
        if rc == 0 and rep.exists():
            r = json.loads(rep.read_text())
            eig = r.get("eigen") or {}
            lam = (eig.get("top") or [None])[0]
            conv = all(eig.get("top_converged") or [False]) and all(eig.get("bottom_converged") or [True])
        analysis_rows.append({"arch": arch, "analysis": "sharpness", "rc": rc, "wall_s": wall, "lambda_max": lam,
                              "converged": conv, "error": tail if rc else None})
        rc2, wall2, tail2 = cemtool(["collapse-report", str(run), "--tokens", tokens, "--device", dev.type,
                                     "--no-plots", "-q"])
        analysis_rows.append({"arch": arch, "analysis": "collapse-report", "rc": rc2, "wall_s": wall2,
                              "error": tail2 if rc2 else None})
        failures += [f"{a} {arch}: {t}" for a, r_, t in (("sharpness", rc, tail), ("collapse", rc2, tail2)) if r_]
        write(False)

    if n_gpu >= 2:
        run = out / "baseline-ddp2"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "cemtool"]
        rc, wall, tail = cemtool(["train", "--arch", "baseline", "--out", str(run), "--force", "-q"] +
                                 [a for o in base for a in ("--set", o)], launcher=launcher)
        ddp_rows.append({"what": "torchrun x2 train baseline", "rc": rc, "wall_s": wall,
                         "tokens_per_s": throughput(run) if rc == 0 else None, "error": tail if rc else None})
        if rc:
            failures.append(f"torchrun train: {tail}")

    attn += attention_check(dev, sizes, archs)
    failures += [f"attention {r['arch']} {r['dtype']}: diff {r['max_abs_diff']:.2e}" for r in attn if not r["ok"]]

    print(write(True))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
