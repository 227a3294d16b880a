"""cemtool.train.memory_estimate against the measured peak resident memory of real CPU training steps.

    OMP_NUM_THREADS=1 python benchmarks/memory_estimate.py

Each case runs in a fresh process (ru_maxrss is a high-water mark): growth of the peak resident memory over building
the model and two AdamW steps, beside the estimate for the same config and batch. Prints one line per case and the
range of estimate / measured.
"""

from __future__ import annotations

import subprocess
import sys

CASES = [(a, 16, 256) for a in ("baseline", "cem-rec2", "tmm", "lime", "muon")] + \
        [(a, b, t) for a in ("baseline", "lime", "muon") for b, t in ((64, 64), (4, 1024))]


def measure(arch: str, batch: int, seq_len: int) -> tuple[float, float]:
    import resource

    import torch

    from cemtool.config import replace, resolve
    from cemtool.models.lm import lm_loss
    from cemtool.models.registry import build_model
    from cemtool.train import make_optimizer, memory_estimate

    torch.set_num_threads(1)
    cfg = resolve(arch=arch, overrides=["model.d_model=256", "model.n_head=4", "model.n_layer=4"])
    cfg = replace(cfg, **{"model.vocab_size": 2048, "model.max_seq_len": seq_len, "data.seq_len": seq_len})
    x = torch.randint(0, 2048, (batch, seq_len + 1))  # (B, T+1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = build_model(cfg.model)
    opt = make_optimizer(model, cfg.train, torch.device("cpu"))
    for _ in range(2):
        lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return peak, memory_estimate(cfg.model, batch, seq_len, training=True)["total"]


def main() -> None:
    if len(sys.argv) == 4:
        peak, est = measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
        print(peak, est)
        return
    ratios = []
    for arch, b, t in CASES:
        out = subprocess.run([sys.executable, __file__, arch, str(b), str(t)], capture_output=True, text=True,
                             check=True).stdout.split()
        peak, est = float(out[0]), float(out[1])
        ratios.append(est / peak)
        print(f"{arch:9s} B={b:<3d} T={t:<5d} measured {peak / 2**20:7.1f} MiB  estimate {est / 2**20:7.1f} MiB  "
              f"ratio {est / peak:.2f}")
    print(f"estimate / measured: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
