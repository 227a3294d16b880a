"""Cost of a per-block curvature run (`cemtool sharpness --per-layer` / `--blocks kind`) against one Lanczos run on
the whole model, same operator, tokens, dtype and step count.

    python benchmarks/block_cost.py [--layers 4] [--width 128] [--tokens 1024] [--steps 20] [--rounds 3]
                                    [--operators hessian,ggn] [--blocks layer]

Each block's product restricted to its parameters still runs the whole model's forward and a backward through
every layer above it, so a run over L layers costs about L full-model Lanczos runs at most; the target (issue 22):
<= L + 1 times one full-model run. Lanczos is given ``tol = 0`` (every block and the full model take exactly
``--steps`` products unless the Krylov space closes first; both counts are printed, full/blocks) and no trace.
Time: median over ``--rounds`` alternating rounds. Exit code 1 when an operator's ratio exceeds its target
(L + 1 for ``--blocks layer``; the block count + 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from cemtool.analysis.curvature.operators import make_operator
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.sharpness import SharpnessOptions, measure_per_layer
from cemtool.config import replace, resolve
from cemtool.models import build_model


def setup(args):
    torch.manual_seed(0)
    cfg = resolve(overrides=[f"model.n_layer={args.layers}", f"model.d_model={args.width}",
                             f"model.n_head={args.heads}"])
    model = build_model(replace(cfg.model, vocab_size=args.vocab, max_seq_len=args.seq_len)).eval()
    n_seq = max(1, args.tokens // args.seq_len)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (n_seq, args.seq_len), generator=g)  # (N, T)
    y = torch.randint(0, args.vocab, (n_seq, args.seq_len), generator=g)  # (N, T)
    return model, x, y


def full_run(model, x, y, operator: str, steps: int) -> tuple[float, int]:
    """(seconds, products) of one Lanczos run on the whole model."""
    t0 = time.perf_counter()
    with make_operator(operator, model, x, y, dtype="fp32") as op:
        eig = lanczos(op, 1, 0, max_steps=steps, tol=0.0, seed=0)
    return time.perf_counter() - t0, eig.hvps


def block_run(model, x, y, operator: str, steps: int, blocks: str) -> tuple[float, int, int]:
    """(seconds, blocks, products) of the per-block run."""
    o = SharpnessOptions(operator=operator, dtype="fp32", top_k=1, bottom_k=0, lanczos_steps=steps, tol=0.0,
                         trace_methods=(), trace_hvps=0, density_runs=0, landscape="none")
    t0 = time.perf_counter()
    rows = measure_per_layer(model, x, y, o, blocks=blocks)
    return time.perf_counter() - t0, len(rows), sum(r.lanczos_hvps for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="Lanczos products per run (full model and each block)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--operators", default="hessian,ggn")
    ap.add_argument("--blocks", default="layer", help="layer | kind | globs (as sharpness --blocks)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    for name in ("layers", "width", "heads", "vocab", "seq_len", "tokens", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    model, x, y = setup(args)
    n = sum(p.numel() for p in model.parameters())
    rows, ok = [], True
    for operator in args.operators.split(","):
        full, per = [], []
        info = (0, 0)
        for _ in range(args.rounds):  # alternating: noise hits both alike
            t, full_hvps = full_run(model, x, y, operator, args.steps)
            full.append(t)
            t, nb, hv = block_run(model, x, y, operator, args.steps, args.blocks)
            per.append(t)
            info = (nb, hv)
        f, b = statistics.median(full), statistics.median(per)
        target = args.layers + 1 if args.blocks == "layer" else info[0] + 1
        ratio = b / f
        ok &= ratio <= target
        rows.append({"operator": operator, "blocks": args.blocks, "n_blocks": info[0], "block_products": info[1],
                     "full_products": full_hvps,
                     "full_s": f, "blocks_s": b, "ratio": ratio, "target": target, "meets": ratio <= target})
    print(f"{n:,} parameters, {args.layers} layers, {x.numel():,} tokens, {args.steps} Lanczos products per run, "
          f"{args.threads} threads, median of {args.rounds}")
    print(f"{'operator':10s} {'blocks':8s} {'n':>3s} {'products':>14s} {'full s':>8s} {'blocks s':>9s} {'ratio':>7s} "
          f"{'target':>7s}")
    for r in rows:
        prods = f"{r['full_products']}/{r['block_products']}"
        print(f"{r['operator']:10s} {r['blocks']:8s} {r['n_blocks']:3d} {prods:>14s} {r['full_s']:8.2f} "
              f"{r['blocks_s']:9.2f} "
              f"{r['ratio']:6.2f}x {r['target']:6d}x {'ok' if r['meets'] else 'MISSED'}")
    if args.json:
        print(json.dumps({"params": n, "tokens": int(x.numel()), "steps": args.steps, "rows": rows}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
