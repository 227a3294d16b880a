"""Cost of one Hessian-vector product against one gradient on the same tokens (time and peak memory).

    python benchmarks/hvp_cost.py [--layers 6] [--width 256] [--tokens 4096] [--seq-len 128] [--rounds 5]

Contenders, all on the explicit-softmax attention path in fp32 (what `cemtool sharpness --dtype fp32` runs):
- gradient: forward + backward of the mean token loss (the unit everything is divided by);
- hvp reverse-over-reverse, graph kept: the first-order graph (create_graph=True) is built once and every HVP is
  one more backward through it (cemtool's default while the graph fits: `keep_graph='auto'`);
- hvp reverse-over-reverse, no graph kept: forward + create_graph backward + backward, every product;
- hvp forward-over-reverse: torch.func.jvp of torch.func.grad (one forward pass with dual numbers through the
  backward, no second graph).
Time: median over ``--rounds`` alternating rounds (noise hits every contender alike). Memory: each contender runs
in a fresh process, and its peak is the rise of the process's peak RSS (VmHWM) above its resident size just before
the operation; ratios are against the gradient's rise measured the same way. The kept-graph contender's memory
includes the kept graph. Targets (issue 12): time <= 2.5x and memory <= 2x a gradient for the default method.
Exit code 1 when the default method misses a target.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch

from cemtool.analysis.hessian import Objective
from cemtool.config import replace, resolve
from cemtool.models import attention_impl, build_model, lm_loss

METHODS = ["gradient", "hvp: kept graph", "hvp: no graph kept", "hvp: forward-over-reverse"]
DEFAULT = "hvp: kept graph"


def setup(args):
    torch.manual_seed(0)
    cfg = resolve(overrides=[f"model.n_layer={args.layers}", f"model.d_model={args.width}",
                             f"model.n_head={args.heads}"])
    model = build_model(replace(cfg.model, vocab_size=args.vocab, max_seq_len=args.seq_len)).float().eval()
    n_seq = max(1, args.tokens // args.seq_len)
    x = torch.randint(0, args.vocab, (n_seq, args.seq_len))  # (N, T)
    y = torch.randint(0, args.vocab, (n_seq, args.seq_len))  # (N, T)
    return model, x, y


def make_op(method: str, model, x, y):
    """A zero-argument callable performing one unit of the method (after any one-off setup)."""
    params = [p for p in model.parameters()]
    if method == "gradient":
        def grad_once():
            with attention_impl("explicit"):
                loss = lm_loss(model(x), y)
                return torch.autograd.grad(loss, params)
        return grad_once
    if method in ("hvp: kept graph", "hvp: no graph kept"):
        obj = Objective(model, x, y, dtype="fp32", batch_size=len(x), keep_graph=method == "hvp: kept graph")
        v = torch.randn(obj.n, dtype=torch.float64)
        obj.hvp(v)  # builds (and, if kept, keeps) the first-order graph
        return lambda: obj.hvp(v)
    if method == "hvp: forward-over-reverse":
        from torch.func import functional_call, grad, jvp

        names = [n for n, _ in model.named_parameters()]
        primals = tuple(p.detach() for p in params)
        tangents = tuple(torch.randn_like(p) for p in params)

        def loss_of(*ps):
            with attention_impl("explicit"):
                return lm_loss(functional_call(model, dict(zip(names, ps, strict=True)), (x,)), y)

        g = grad(loss_of, argnums=tuple(range(len(params))))
        return lambda: jvp(g, primals, tangents)[1]
    raise ValueError(method)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _memory_child(method: str, args, q) -> None:
    torch.set_num_threads(args.threads)
    model, x, y = setup(args)
    before = _rss_kib("VmRSS")  # model and tokens resident
    op = make_op(method, model, x, y)
    op()
    q.put((_rss_kib("VmHWM") - before) * 1024)


def peak_memory(method: str, args) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_memory_child, args=(method, args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096, help="evaluation tokens per gradient / HVP")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", action="store_true", help="print the results as JSON as well")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    model, x, y = setup(args)
    n_params = sum(p.numel() for p in model.parameters())
    ops = {m: make_op(m, model, x, y) for m in METHODS}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for m in METHODS:
        ops[m]()  # warm-up
    for _ in range(args.rounds):
        for m in METHODS:
            t0 = time.perf_counter()
            ops[m]()
            times[m].append(time.perf_counter() - t0)
    del ops
    mem = {m: peak_memory(m, args) for m in METHODS}

    t_grad, m_grad = statistics.median(times["gradient"]), mem["gradient"]
    print(f"model: {args.layers} layers x {args.width} wide, {n_params:,} parameters; "
          f"{x.numel():,} tokens per product; {args.threads} threads; median of {args.rounds} rounds")
    print(f"{'method':<28}{'time (s)':>10}{'x gradient':>12}{'peak mem (MiB)':>16}{'x gradient':>12}")
    rows = []
    for m in METHODS:
        t = statistics.median(times[m])
        rows.append({"method": m, "seconds": t, "time_ratio": t / t_grad, "peak_bytes": mem[m],
                     "memory_ratio": mem[m] / max(m_grad, 1)})
        print(f"{m:<28}{t:>10.3f}{t / t_grad:>12.2f}{mem[m] / 2**20:>16.1f}{mem[m] / max(m_grad, 1):>12.2f}")
    d = next(r for r in rows if r["method"] == DEFAULT)
    ok = d["time_ratio"] <= 2.5 and d["memory_ratio"] <= 2.0
    print(f"default ({DEFAULT}): time {d['time_ratio']:.2f}x (target <= 2.5x), memory {d['memory_ratio']:.2f}x "
          f"(target <= 2x): targets {'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps({"params": n_params, "tokens": x.numel(), "rows": rows, "targets_met": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
