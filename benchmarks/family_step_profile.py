"""Where one training step of each family spends its time on this machine (docs/performance.md, "The families' hot
spots"): a forward and backward of --batch x --seq-len tokens at the study's small shape, timed over --steps steps
after one warm-up, then one step under torch.profiler, whose top operators by self time are printed.

    OMP_NUM_THREADS=1 python benchmarks/family_step_profile.py --archs baseline,hb,muon,soap,lime
"""

from __future__ import annotations

import argparse
import time

import torch

from cemtool.config import resolve
from cemtool.models.lm import lm_loss
from cemtool.models.registry import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="baseline,hb,muon,soap,lime")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)  # (B, T)
    y = torch.randint(0, a.vocab, (a.batch, a.seq_len), generator=g)
    for arch in a.archs.split(","):
        cfg = resolve(arch=arch, overrides=[f"model.d_model={a.d_model}", f"model.n_layer={a.n_layer}",
                                            f"model.n_head={a.n_head}", f"model.vocab_size={a.vocab}",
                                            f"model.max_seq_len={a.seq_len}"]).model
        model = build_model(cfg)

        def step(model=model) -> None:
            lm_loss(model(x), y).backward()

        step()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        ms = (time.perf_counter() - t0) / a.steps * 1e3
        with torch.profiler.profile() as prof:
            step()
        print(f"== {arch}: {ms:.0f} ms per step ({torch.get_num_threads()} thread(s))")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))


if __name__ == "__main__":
    main()
