"""Cost of one Hessian-vector product against one gradient on the same tokens and in the same dtype (time and peak
memory), and the memory floor of any exact reverse-over-reverse HVP.

    python benchmarks/hvp_cost.py [--layers 6] [--width 256] [--tokens 4096] [--seq-len 128] [--rounds 5]

Contenders, all on the explicit-softmax attention path; each HVP is divided by the gradient of its own dtype:
- fp32 gradient: forward + backward of the mean token loss;
- fp32 hvp, reverse-over-reverse, graph kept: the first-order graph (create_graph=True) is built once and every HVP
  is one more backward through it (`sharpness --hvp exact`, cemtool's default, while the graph fits);
- fp32 hvp, reverse-over-reverse, no graph kept: forward + create_graph backward + backward, every product;
- fp32 hvp, forward-over-reverse: torch.func.jvp of torch.func.grad;
- fp32 GGN and empirical-Fisher products (`sharpness --operator ggn|ef`): forward, the vector-Jacobian product
  with create_graph, its derivative in u (J v), and one more backward, every product; compared with the Hessian
  product that also keeps no graph (the like-for-like) and with the gradient;
- fp64 gradient, fp64 hvp with the graph kept, and fp64 hvp by central difference (`sharpness --hvp fd --dtype
  fp64`): (grad L(w + h v) - grad L(w - h v)) / 2h, two gradients and no second-order graph.
Time: median over ``--rounds`` alternating rounds (noise hits every contender alike). Memory: each contender runs
in a fresh process, and its peak is the rise of the process's peak RSS (VmHWM) above its resident size just before
the operation (the model already in that dtype). The kept-graph contenders' memory includes the kept graph.

The floor: the bytes the forward pass saves for backward (A) and the bytes the create_graph backward saves on top
for the second backward (B, counted with saved-tensor hooks, each storage once); any exact reverse-over-reverse HVP
holds A + B at once, so (A + B) / gradient peak bounds its memory ratio from below.

Targets (issue 12): time <= 2.5x and memory <= 2x a gradient. Exit code 1 when no HVP contender meets both.
Targets (issue 22, printed, not in the exit code): a GGN product <= 1.0x a Hessian product (no graph kept) and
<= 2.5x a gradient.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

import torch

from cemtool.analysis.curvature.operators import Hessian, make_operator
from cemtool.config import replace, resolve
from cemtool.models import attention_impl, build_model, lm_loss

METHODS = [("gradient", "fp32"), ("hvp: kept graph", "fp32"), ("hvp: no graph kept", "fp32"),
           ("hvp: forward-over-reverse", "fp32"), ("ggn product", "fp32"), ("ef product", "fp32"),
           ("gradient", "fp64"), ("hvp: kept graph", "fp64"), ("hvp: central difference", "fp64")]
DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def setup(args, dtype: str = "fp32"):
    torch.manual_seed(0)
    cfg = resolve(overrides=[f"model.n_layer={args.layers}", f"model.d_model={args.width}",
                             f"model.n_head={args.heads}"])
    model = build_model(replace(cfg.model, vocab_size=args.vocab, max_seq_len=args.seq_len))
    model = model.to(DTYPES[dtype]).eval()
    n_seq = max(1, args.tokens // args.seq_len)
    x = torch.randint(0, args.vocab, (n_seq, args.seq_len))  # (N, T)
    y = torch.randint(0, args.vocab, (n_seq, args.seq_len))  # (N, T)
    return model, x, y


def make_op(method: str, dtype: str, model, x, y):
    """A zero-argument callable performing one unit of the method (after any one-off setup)."""
    params = [p for p in model.parameters()]
    if method == "gradient":
        def grad_once():
            with attention_impl("explicit"):
                loss = lm_loss(model(x), y)
                return torch.autograd.grad(loss, params)
        return grad_once
    if method in ("hvp: kept graph", "hvp: no graph kept", "hvp: central difference"):
        obj = Hessian(model, x, y, dtype=dtype, batch_size=len(x), keep_graph=method == "hvp: kept graph",
                        hvp="fd" if method == "hvp: central difference" else "exact")
        v = torch.randn(obj.n, dtype=torch.float64)
        obj.hvp(v)  # builds (and, if kept, keeps) the first-order graph
        return lambda: obj.hvp(v)
    if method in ("ggn product", "ef product"):  # the other operators (issue 22): recomputed every product
        op = make_operator(method.split()[0], model, x, y, dtype=dtype, batch_size=len(x))
        v = torch.randn(op.n, dtype=torch.float64)
        return lambda: op.matvec(v)
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


def saved_bytes(model, x, y) -> tuple[int, int]:
    """(A, B): bytes saved for backward by the forward pass, and saved on top by the create_graph backward."""
    def counter(seen: dict):
        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except RuntimeError:  # tensors without storage
                pass
            return t
        return pack

    forward, backward = {}, {}
    params = list(model.parameters())
    with attention_impl("explicit"):
        with torch.autograd.graph.saved_tensors_hooks(counter(forward), lambda t: t):
            loss = lm_loss(model(x), y)
        with torch.autograd.graph.saved_tensors_hooks(counter(backward), lambda t: t):
            grads = torch.autograd.grad(loss, params, create_graph=True)
    del grads
    return sum(forward.values()), sum(b for k, b in backward.items() if k not in forward)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _memory_child(method: str, dtype: str, args, q) -> None:
    torch.set_num_threads(args.threads)
    model, x, y = setup(args, dtype)
    before = _rss_kib("VmRSS")  # model (in its dtype) and tokens resident
    op = make_op(method, dtype, model, x, y)
    op()
    q.put((_rss_kib("VmHWM") - before) * 1024)


def peak_memory(method: str, dtype: str, args) -> int:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_memory_child, args=(method, dtype, args, q))
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

    # a model of its own per contender (same seed: same weights and tokens): the central difference shifts its
    # weights in place, which would invalidate another contender's kept graph
    ops = {(m, d): make_op(m, d, *setup(args, d)) for m, d in METHODS}
    n_params = sum(p.numel() for p in setup(args)[0].parameters())
    times: dict = {k: [] for k in METHODS}
    for k in METHODS:
        ops[k]()  # warm-up
    for _ in range(args.rounds):
        for k in METHODS:
            t0 = time.perf_counter()
            ops[k]()
            times[k].append(time.perf_counter() - t0)
    del ops
    a_bytes, b_bytes = saved_bytes(*setup(args))
    mem = {k: peak_memory(*k, args) for k in METHODS}

    print(f"model: {args.layers} layers x {args.width} wide, {n_params:,} parameters; "
          f"{args.tokens // args.seq_len * args.seq_len:,} tokens per product; {args.threads} threads; median of "
          f"{args.rounds} rounds; ratios against the gradient of the same dtype")
    print(f"{'method':<30}{'dtype':>6}{'time (s)':>10}{'x gradient':>12}{'peak mem (MiB)':>16}{'x gradient':>12}")
    rows = []
    for m, d in METHODS:
        t, t_grad = statistics.median(times[(m, d)]), statistics.median(times[("gradient", d)])
        mm, m_grad = mem[(m, d)], max(mem[("gradient", d)], 1)
        rows.append({"method": m, "dtype": d, "seconds": t, "time_ratio": t / t_grad, "peak_bytes": mm,
                     "memory_ratio": mm / m_grad})
        print(f"{m:<30}{d:>6}{t:>10.3f}{t / t_grad:>12.2f}{mm / 2**20:>16.1f}{mm / m_grad:>12.2f}")
    floor = (a_bytes + b_bytes) / max(mem[("gradient", "fp32")], 1)
    print(f"exact HVP floor (fp32): forward saves A = {a_bytes / 2**20:.1f} MiB, the create_graph backward saves "
          f"B = {b_bytes / 2**20:.1f} MiB more; (A + B) / gradient peak = {floor:.2f}x")
    good = [r for r in rows if r["method"] != "gradient" and r["time_ratio"] <= 2.5 and r["memory_ratio"] <= 2.0]
    for r in rows:
        if r["method"] != "gradient":
            ok = r["time_ratio"] <= 2.5 and r["memory_ratio"] <= 2.0
            print(f"  {r['method']} ({r['dtype']}): time {r['time_ratio']:.2f}x, memory {r['memory_ratio']:.2f}x: "
                  f"targets (<= 2.5x, <= 2x) {'met' if ok else 'NOT met'}")
    hess = statistics.median(times[("hvp: no graph kept", "fp32")])
    for m in ("ggn product", "ef product"):
        t = statistics.median(times[(m, "fp32")])
        ok = t / hess <= 1.0 and t / statistics.median(times[("gradient", "fp32")]) <= 2.5
        print(f"  {m} (fp32): {t / hess:.2f}x a Hessian product (no graph kept), "
              f"{t / statistics.median(times[('gradient', 'fp32')]):.2f}x a gradient: targets (<= 1.0x, <= 2.5x) "
              f"{'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps({"params": n_params, "tokens": args.tokens, "rows": rows, "saved_forward_bytes": a_bytes,
                          "saved_backward_bytes": b_bytes, "exact_floor_ratio": floor,
                          "targets_met_by": [f"{r['method']} ({r['dtype']})" for r in good]}))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
