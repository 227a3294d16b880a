"""Training throughput of the cemtool baseline against what a user would pick instead, at the identical shape.

    python benchmarks/train_throughput.py [--layers 6] [--width 256] [--heads 4] [--seq-len 128] [--batch 16]

Measured in one process, alternating the contenders round by round so machine noise hits all of them alike:
- cemtool's baseline (pre-norm, RMSNorm, RoPE, SwiGLU, tied head),
- a minimal plain-PyTorch reference of the same network (nanoGPT style, written out below),
- Hugging Face transformers' LlamaForCausalLM built from a config (random init, nothing downloaded; the
  ``bench`` extra), when transformers is installed.
Each step is forward + backward + AdamW on random tokens. Model FLOP utilisation (MFU) = the step's matmul FLOPs
(counted by torch.utils.flop_counter) / step time / the machine's matmul peak, measured here with large fp32
matmuls. Prints a table; exit code 0 always (it reports, it does not judge).
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from cemtool.config import replace, resolve
from cemtool.models import build_model, lm_loss
from cemtool.models.layers import mlp_hidden

# ----------------------------------------------------------------------------------------------------------------
# the plain reference


class RefBlock(nn.Module):
    def __init__(self, d: int, h: int, m: int):
        super().__init__()
        self.h = h
        self.n1 = nn.RMSNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.n2 = nn.RMSNorm(d, eps=1e-5)
        self.gate_up = nn.Linear(d, 2 * m, bias=False)
        self.down = nn.Linear(m, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)  # (B, h, T, dh)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, d)
        x = x + self.o(y)
        g, u = self.gate_up(self.n2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(g) * u)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class RefLM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, h: int, m: int, T: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([RefBlock(d, h, m) for _ in range(layers)])
        self.norm = nn.RMSNorm(d, eps=1e-5)
        dh = d // h
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        ang = torch.arange(T).float()[:, None] * inv[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx):
        x = self.emb(idx)
        T = idx.shape[1]
        for b in self.blocks:
            x = b(x, self.cos[:T], self.sin[:T])
        return F.linear(self.norm(x), self.emb.weight)


# ----------------------------------------------------------------------------------------------------------------


def matmul_peak(n: int = 2048, repeats: int = 10, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> float:
    """Best matmul FLOP/s over a few large square products (fp32 on the CPU by default; synchronised on CUDA)."""
    device = device or torch.device("cpu")
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def train_flops(model, x, y, forward) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    from cemtool.models import attention_impl

    with FlopCounterMode(display=False) as fc, attention_impl("explicit"):
        lm_loss(forward(model, x), y).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def make_contenders(args):
    vocab, d, L, H, T = args.vocab, args.width, args.layers, args.heads, args.seq_len
    m = mlp_hidden(d, "swiglu", 0)
    cfg = resolve(overrides=[f"model.n_layer={L}", f"model.d_model={d}", f"model.n_head={H}"])
    torch.manual_seed(0)
    ours = build_model(replace(cfg.model, vocab_size=vocab, max_seq_len=T))
    out = {"cemtool baseline": (ours, lambda mod, x: mod(x))}
    torch.manual_seed(0)
    out["plain PyTorch"] = (RefLM(vocab, d, L, H, m, T), lambda mod, x: mod(x))
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=m, num_hidden_layers=L,
                             num_attention_heads=H, num_key_value_heads=H, max_position_embeddings=T,
                             tie_word_embeddings=True, rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False)
        hf_cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        out["HF transformers Llama"] = (LlamaForCausalLM(hf_cfg), lambda mod, x: mod(input_ids=x).logits)
    except ImportError:
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4, help="steps per contender per round")
    args = ap.parse_args()

    contenders = make_contenders(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=g)
    inp, tgt = x[:, :-1], x[:, 1:]
    params = {k: sum(p.numel() for p in dict((id(p), p) for p in mod.parameters()).values())
              for k, (mod, _) in contenders.items()}
    # one FLOP count for all: the networks are identical, and cemtool's explicit attention path makes the
    # attention matmuls visible to the counter (the CPU's fused SDPA kernel is not counted)
    mod, fwd = contenders["cemtool baseline"]
    flops = dict.fromkeys(contenders, train_flops(mod, inp, tgt, fwd))
    opts = {k: torch.optim.AdamW(mod.parameters(), lr=1e-4) for k, (mod, _) in contenders.items()}
    times: dict[str, list[float]] = {k: [] for k in contenders}

    def step(k):
        mod, fwd = contenders[k]
        loss = lm_loss(fwd(mod, inp), tgt)
        loss.backward()
        opts[k].step()
        opts[k].zero_grad(set_to_none=True)

    for k in contenders:  # warm-up
        step(k)
    peak = matmul_peak()
    for _ in range(args.rounds):
        for k in contenders:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(k)
            times[k].append((time.perf_counter() - t0) / args.steps)
    peak = max(peak, matmul_peak())
    tokens = args.batch * args.seq_len
    base = "cemtool baseline"
    print(f"shape: {args.layers} layers x {args.width} wide, {args.heads} heads, seq {args.seq_len}, batch "
          f"{args.batch}, vocab {args.vocab}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s")
    print(f"{'model':<24}{'params':>10}{'GFLOP/step':>12}{'s/step (median)':>17}{'tokens/s':>11}{'MFU':>8}"
          f"{'cemtool speed-up':>18}")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    for k in contenders:
        mfu = flops[k] / med[k] / peak
        print(f"{k:<24}{params[k]:>10,}{flops[k] / 1e9:>12.3f}{med[k]:>17.4f}{tokens / med[k]:>11,.0f}"
              f"{mfu:>8.1%}{med[k] / med[base]:>17.2f}x")
    if not math.isfinite(peak):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
