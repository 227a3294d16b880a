"""Train every registered architecture on the default corpus with the same token budget; print the table.

    python benchmarks/architectures.py [--tokens 200000] [--seed 0] [--out runs/archs] [--set k=v ...]
                                       [--arch NAME ...] [--write docs/architectures.md]

Each architecture is trained by the real CLI (`cemtool train --arch NAME --json ...`, one process each) with the
same data, seed, schedule and number of tokens. The table gives parameters (total / non-embedding), FLOPs per
token (training step, counted by torch.utils.flop_counter), measured seconds per optimizer step (median of the
logged intervals, on this machine, as loaded as it was) and the final validation loss beside the corpus's exact
entropy floor. These are small-scale numbers: they show every family trains and what it costs, not which is best.
With --write, the table replaces the block between the markers in the given Markdown file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from cemtool.analysis.compute import arch_row
from cemtool.models import archs

BEGIN, END = "<!-- arch-table:begin -->", "<!-- arch-table:end -->"
SIZE = ["model.n_layer=4", "model.d_model=64", "model.n_head=4", "data.seq_len=64", "train.batch_size=16",
        "train.eval_every=100", "train.eval_tokens=16384", "train.log_every=10", "train.warmup_steps=20"]


def train_one(arch: str, args) -> dict:
    out = Path(args.out) / arch
    cmd = [sys.executable, "-m", "cemtool", "train", "--arch", arch, "--seed", str(args.seed), "--out", str(out),
           "--force", "--quiet", "--json", "--device", "cpu"]
    for s in [*SIZE, f"train.max_tokens={args.tokens}", *args.set]:
        cmd += ["--set", s]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"arch": arch, "status": "failed: " + (res.stderr.strip().splitlines() or ["?"])[0]}
    summary = json.loads(res.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((out / "config.json").read_text())
    per_step = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    tokens_per_step = cfg["train"]["batch_size"] * cfg["train"]["grad_accum"] * cfg["data"]["seq_len"]
    sec = tokens_per_step / statistics.median(per_step) if per_step else float("nan")
    row = arch_row(arch, [*SIZE, *args.set], vocab=cfg["model"]["vocab_size"], seq_len=cfg["data"]["seq_len"])
    return {"arch": arch, "family": archs()[arch].family, "status": summary["status"], "params": row["params"],
            "non_embedding": row["non_embedding"], "flops_train": row["flops_train"], "s_per_step": sec,
            "tokens": summary["tokens"], "val_loss": summary["val_loss"], "floor": summary["val_floor"]}


def markdown(rows: list[dict], args) -> str:
    lines = [f"Budget: {args.tokens:,} tokens per architecture, seed {args.seed}, grammar corpus, "
             f"`{' '.join(SIZE + list(args.set))}`; produced by `python benchmarks/architectures.py "
             f"--tokens {args.tokens} --seed {args.seed}`.", "",
             "| arch | family | params | non-emb | train FLOPs/token | s/step | val loss | floor | gap |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["status"] == "completed":
            lines.append(f"| {r['arch']} | | | | | | {r['status']} | | |")
            continue
        lines.append(f"| {r['arch']} | {r['family']} | {r['params']:,} | {r['non_embedding']:,} | "
                     f"{r['flops_train']:.3g} | {r['s_per_step']:.3f} | {r['val_loss']:.4f} | {r['floor']:.4f} | "
                     f"{r['val_loss'] - r['floor']:+.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/archs")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--arch", action="append", default=None)
    ap.add_argument("--write", default=None, help="Markdown file whose marked block receives the table")
    args = ap.parse_args()
    names = args.arch or sorted(archs(), key=lambda n: (archs()[n].family != "baseline", archs()[n].family, n))
    rows = []
    for name in names:
        rows.append(train_one(name, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = markdown(rows, args)
    print(table)
    if args.write:
        p = Path(args.write)
        text = p.read_text()
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        p.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


if __name__ == "__main__":
    main()
