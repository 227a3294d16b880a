"""The seam between a Hugging Face causal LM and cemtool's analyses: :class:`ForeignLM`.

A ForeignLM holds the transformers model and shows it under cemtool's names, so that every analysis reads it as it
reads a model cemtool trained:

- ``forward(idx) -> logits`` (B, T, V), the transformers forward itself (``use_cache=False``);
- the parameters under cemtool's names: ``tok_emb``, ``pos_emb`` (learned positions), ``blocks.N.layer.<the
  model's own names inside a layer>``, ``ln_f``, ``head`` (so ``layer:N``, ``attn``, ``mlp``, ``embed`` and globs on
  the model's own module names such as ``*.q_proj.weight`` select parameters as for cemtool's models);
- the hook points of cemtool's blocks (:mod:`cemtool.models.capture`): ``blocks.N.attn.q``/``k``/``v`` (B, heads, T,
  d_h) after the projections and before RoPE, ``blocks.N.attn.pattern`` (B, H, T, T), ``blocks.N.attn.z`` (B, H, T,
  d_h) before the output projection, ``blocks.N.resid_pre``/``resid_mid``/``resid_post`` (B, T, d),
  ``blocks.N.mlp.out`` (B, T, d), ``final`` (B, T, d) after the final norm, and for a mixture of experts
  ``blocks.N.moe.router_logits`` (B, T, E) and ``blocks.N.moe.experts`` (B, T, k) (the chosen experts). They are
  fed by forward hooks on the transformers modules; a point that is neither captured nor hooked costs one attribute
  test per call. Exactly which point each family's hooks are (before or after a q-norm, before RoPE) is declared in
  its family file and listed in docs/models.md.
- ``blocks.N.attn`` also carries what rank truncation reads: ``n_head``, ``head_dim``, ``rotary`` and ``wq``/``wk``
  whose ``.weight`` is the (H d_h, d [+1]) matrix of the queries/keys of each query head in the hook points'
  coordinates (a bias is the last column, acting on a constant 1 input; a key-value head shared by several query
  heads is repeated for each).

What differs between families (where the projections sit, how q, k and v are packed in their outputs, norms,
rotary, windows, ALiBi, routers) is a :class:`Family`, one short file per family (gpt2.py, llama.py, falcon.py,
...), registered in catalog.py; docs/adding_a_family.md shows how to add one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from cemtool.config import ModelConfig
from cemtool.errors import CemtoolError
from cemtool.models.capabilities import Capabilities
from cemtool.models.capture import HookPoint


@dataclass
class Shape:
    """The attention shape of every layer."""

    n_head: int  # query heads
    n_kv_head: int  # key-value heads (GQA/MQA: fewer than n_head)
    head_dim: int
    rotary_dims: int  # 0: no RoPE (learned positions); < head_dim: partial rotary (GPT-NeoX)


@dataclass
class Projection:
    """Where one of q, k, v lies in the output of a projection module: ``index`` (heads * d_h,) picks its features
    head by head, in the order of the hook point's coordinates."""

    module: nn.Module
    point: str  # "q" | "k" | "v"
    index: torch.Tensor
    heads: int
    # the module's output: "flat" (B, T, features), or already per head (a per-head q/k norm; index unused) as
    # "bthd" (B, T, heads, d_h; Qwen3) or "bhtd" (B, heads, T, d_h; Gemma-3)
    layout: str = "flat"


@dataclass
class Backbone:
    tok_emb: nn.Module
    pos_emb: nn.Module | None
    layers: nn.ModuleList
    ln_f: nn.Module
    head: nn.Module


class Family(ABC):
    """One family of transformers models: where its modules are. Each subclass (one short file per family) implements
    the abstract methods; the others have the defaults of a pre-norm, sequential-residual block.

    The class attributes ``residual``, ``norms``, ``positions`` and ``points`` describe the mapping in words for
    docs/models.md (its family table is generated from them: ``python -m cemtool.subject.hf.catalog``); the
    tests check the descriptions against the methods on a tiny model (a parallel residual has no ``mid_norm``)."""

    name = "?"
    model_types: tuple[str, ...] = ()
    norm, mlp_kind = "layernorm", "gelu"  # what cemtool's ModelConfig calls the family's norm and MLP
    bilinear_qk = True  # False: q and k pass through per-head norms, so the scores are no fixed bilinear form
    kinds: dict[str, tuple[str, str]] = {}  # model type -> (norm, mlp) where it differs from the family's
    copy_mlp_out = False  # the model adds to its MLP output in place (Falcon): a captured mlp.out must be a copy
    # the mapping in words (docs/models.md)
    residual = "sequential"  # "sequential" (resid_mid between attention and MLP) or "parallel" (no resid_mid)
    norms = "pre-norm"
    positions = "RoPE"
    routers: tuple[str, ...] = ()  # the model types whose sparse MLP layers have a router (mixture of experts)
    points = {"q, k, v": "the projections' outputs, before RoPE", "resid_mid": "input of the MLP's pre-norm",
              "z": "input of the output projection"}

    @abstractmethod
    def backbone(self, hf: nn.Module) -> Backbone:
        ...

    @abstractmethod
    def shape(self, config) -> Shape:
        ...

    @abstractmethod
    def attention(self, layer: nn.Module) -> nn.Module:
        """The module whose output is (attention output, probabilities)."""
        ...

    @abstractmethod
    def out_proj(self, layer: nn.Module) -> nn.Module:
        """The module whose input is the per-head outputs z (B, T, H d_h)."""
        ...

    @abstractmethod
    def mid_norm(self, layer: nn.Module) -> nn.Module | None:
        """The module whose input is the residual stream between attention and MLP (None: parallel residual)."""
        ...

    @abstractmethod
    def mlp(self, layer: nn.Module) -> nn.Module:
        """The module whose output is the MLP's contribution to the residual stream (before a post-norm)."""
        ...

    @abstractmethod
    def projections(self, layer: nn.Module, shape: Shape) -> list[Projection]:
        ...

    def refuse(self, config) -> str | None:
        """Why a config of this family cannot be mapped (a structure the declarations do not cover), or None. A
        refused config loads in tier a (through its logits) with the reason recorded."""
        return None

    def post_norms(self, layer: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
        """The norms a block applies to its attention output and to its MLP output before adding them to the
        residual stream (OLMo-2's post-sublayer norms, Gemma-2's sandwich); (None, None) for a pre-norm block."""
        return None, None

    def rotary_dims(self, layer: nn.Module, shape: Shape) -> int:
        """The rotated coordinates of each head in this layer (SmolLM3's NoPE layers: 0)."""
        return shape.rotary_dims

    def rotate(self, hf: nn.Module, q: torch.Tensor, k: torch.Tensor,
               layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k as the hook points show them (B, H, T, d_h) -> as the attention scores them (after the layer's
        rotary, in the model's own coordinates). Default: no rotary."""
        return q, k

    def softcap(self, layer: nn.Module) -> float | None:
        """The attention logits' soft cap c (scores -> tanh(s / c) c before the mask; Gemma-2), None without one."""
        return None

    def window(self, layer: nn.Module) -> int | None:
        """The layer's sliding window w (a query at t sees keys t-w < s <= t), None for full causal attention."""
        w = getattr(self.attention(layer), "sliding_window", None)
        return int(w) if w else None

    def score_bias(self, hf: nn.Module, layer: nn.Module, batch: int, T: int) -> torch.Tensor | None:
        """An additive bias on the scaled scores (B, H, T, T) (ALiBi: BLOOM, Falcon), None without one."""
        return None

    def score_scale(self, layer: nn.Module, shape: Shape) -> float:
        """The factor on q·k before the softmax (the attention module's ``scaling``, else 1/sqrt(d_h))."""
        return float(getattr(self.attention(layer), "scaling", None) or shape.head_dim ** -0.5)

    def router(self, layer: nn.Module) -> nn.Module | None:
        """A mixture of experts' router: the module whose output is (router logits (N, E), routing weights (N, k),
        chosen experts (N, k)) for the N = B T tokens; None for a dense MLP."""
        return None


def check_ids(idx: torch.Tensor, max_seq_len: int, vocab_size: int) -> None:
    """Refuse, in one line, token ids a Hugging Face model cannot take (both tiers)."""
    if idx.shape[1] > max_seq_len:
        raise CemtoolError(f"sequence of {idx.shape[1]} tokens is longer than the model's context {max_seq_len}")
    if idx.numel() and int(idx.max()) >= vocab_size:
        raise CemtoolError(f"token id {int(idx.max())} is outside the model's vocabulary of {vocab_size}",
                           hint="evaluate on data tokenised with the model's own tokenizer")


def rope_order(head_dim: int, rotary_dims: int) -> torch.Tensor:
    """A permutation of a head's coordinates after which the RoPE planes are (p, p + d_h/2), as cemtool's RoPE and
    rank truncation assume: with partial rotary (the first ``rotary_dims`` coordinates rotate in pairs (i, i + r/2))
    the unrotated coordinates are split between the two halves (pairs of them form planes that do not rotate)."""
    r, u = rotary_dims // 2, (head_dim - rotary_dims) // 2
    first = list(range(r)) + list(range(rotary_dims, rotary_dims + u))
    second = list(range(r, rotary_dims)) + list(range(rotary_dims + u, head_dim))
    return torch.tensor(first + second, dtype=torch.long)  # (d_h,)


def packed_per_head(module: nn.Module, heads: int, head_dim: int) -> list[Projection]:
    """q, k, v of a fused projection whose output is laid out head by head as [q | k | v] (BLOOM, GPT-BigCode
    without multi-query, Falcon's original layout; GPT-NeoX adds its rotary plane order)."""
    base = torch.arange(heads)[:, None] * 3 * head_dim  # (H, 1): where each head's [q | k | v] starts
    return [Projection(module, p, (base + i * head_dim + torch.arange(head_dim)).reshape(-1), heads)
            for i, p in enumerate("qkv")]


def weight_rows(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight as (out, in), bias (out,) or None) of a Linear or of GPT-2's Conv1D (whose weight is (in, out))."""
    w = module.weight
    if hasattr(module, "nf"):  # transformers.pytorch_utils.Conv1D
        w = w.T
    return w, getattr(module, "bias", None)


def _live(point: HookPoint) -> bool:
    return point.callback is not None or bool(point._forward_hooks) or bool(point._forward_pre_hooks)


class _Weight:
    """``.weight`` of the queries or keys of every query head, computed from the live parameters."""

    def __init__(self, proj: Projection, repeat: int):
        self.proj, self.repeat = proj, repeat

    @property
    def weight(self) -> torch.Tensor:
        w, b = weight_rows(self.proj.module)
        idx = self.proj.index.to(w.device)
        rows = w[idx]  # (heads*d_h, d)
        if b is not None:
            rows = torch.cat([rows, b[idx][:, None]], dim=1)  # (heads*d_h, d+1)
        if self.repeat > 1:
            dh = rows.shape[0] // self.proj.heads
            rows = rows.view(self.proj.heads, dh, -1).repeat_interleave(self.repeat, 0).reshape(-1, rows.shape[1])
        return rows  # (H*d_h, d[+1])


class ForeignAttention(nn.Module):
    """Hook points q, k, v, pattern, z of one layer and the shape rank truncation reads (no parameters)."""

    def __init__(self, shape: Shape, projections: list[Projection], rotary_dims: int):
        super().__init__()
        self.n_head, self.head_dim, self.n_kv_head = shape.n_head, shape.head_dim, shape.n_kv_head
        self.rotary = {"dims": rotary_dims} if rotary_dims else None
        self.q, self.k, self.v = HookPoint(), HookPoint(), HookPoint()
        self.pattern, self.z = HookPoint(), HookPoint()
        self._proj = {p.point: p for p in projections}  # plain dict: the modules stay registered under layer

    @property
    def wq(self) -> _Weight:
        return _Weight(self._proj["q"], 1)

    @property
    def wk(self) -> _Weight:
        return _Weight(self._proj["k"], self.n_head // self.n_kv_head)


class _MLPPoints(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = HookPoint()


class ForeignMoE(nn.Module):
    """Hook points of a mixture of experts' router: ``router_logits`` (B, T, E) and ``experts`` (B, T, k), the
    chosen experts' indices (int64), read from the router module's output."""

    def __init__(self, n_experts: int, top_k: int):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router_logits, self.experts = HookPoint(), HookPoint()


class _Tokens:
    """The (B, T) of the layer's current input, for the modules that see the tokens flattened to (B T, d) (OPT's
    MLP, the routers)."""

    def __init__(self):
        self.bt: tuple[int, int] = (0, 0)

    def __call__(self, _mod, args, kwargs=None):
        x = args[0] if args else kwargs["hidden_states"]
        self.bt = (int(x.shape[0]), int(x.shape[1]))
        return None


class ForeignBlock(nn.Module):
    """One transformers decoder layer (``layer``) with cemtool's hook points around it."""

    def __init__(self, layer: nn.Module, fam: Family, shape: Shape):
        super().__init__()
        self.layer = layer
        self.attn = ForeignAttention(shape, fam.projections(layer, shape), fam.rotary_dims(layer, shape))
        self.mlp = _MLPPoints()
        self.resid_pre, self.resid_post = HookPoint(), HookPoint()
        mid = fam.mid_norm(layer)
        self.resid_mid = HookPoint() if mid is not None else None
        tokens = _Tokens()
        layer.register_forward_pre_hook(tokens, with_kwargs=True)  # first: the hooks below read its (B, T)
        by_module: dict[int, list[Projection]] = {}
        for p in self.attn._proj.values():
            by_module.setdefault(id(p.module), []).append(p)
        for projs in by_module.values():
            projs[0].module.register_forward_hook(_Heads(self.attn, projs))
        fam.attention(layer).register_forward_hook(_Pattern(self.attn.pattern))
        fam.out_proj(layer).register_forward_pre_hook(_Input(self.attn.z, heads=shape.n_head))
        fam.mlp(layer).register_forward_hook(_Output(self.mlp.out, tokens, copy=fam.copy_mlp_out))
        layer.register_forward_pre_hook(_Input(self.resid_pre), with_kwargs=True)
        layer.register_forward_hook(_Output(self.resid_post))
        if mid is not None:
            mid.register_forward_pre_hook(_Input(self.resid_mid, tokens=tokens))
        router = fam.router(layer)
        self.moe = None
        if router is not None:
            self.moe = ForeignMoE(int(router.weight.shape[0]), int(router.top_k))
            router.register_forward_hook(_Router(self.moe, tokens))


# The hooks are small objects rather than closures, so that a deep copy of the model (an fp64 copy for the Hessian)
# gets hooks that feed its own hook points.


class _Heads:
    """Forward hook on a q/k/v projection: its output, head by head, through the hook points."""

    def __init__(self, attn: ForeignAttention, projs: list[Projection]):
        self.attn, self.projs = attn, projs

    def __call__(self, _mod, _inp, out: torch.Tensor):
        live = [p for p in self.projs if _live(getattr(self.attn, p.point))]
        if not live:
            return None
        p = self.projs[0]
        if p.layout != "flat":  # already per head: one point per module
            x = out.transpose(1, 2) if p.layout == "bthd" else out  # (B, heads, T, d_h)
            y = getattr(self.attn, p.point)(x)
            return None if y is x else (y.transpose(1, 2) if p.layout == "bthd" else y)
        B, T, _ = out.shape
        new = None
        for p in live:
            idx = p.index.to(out.device)
            x = out[..., idx].view(B, T, p.heads, -1).transpose(1, 2)  # (B, heads, T, d_h)
            y = getattr(self.attn, p.point)(x)
            if y is not x:
                new = out.clone() if new is None else new
                new[..., idx] = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, heads*d_h)
        return new


class _Pattern:
    """Forward hook on an attention module returning (output, probabilities): the probabilities, read only."""

    def __init__(self, point: HookPoint):
        self.point = point

    def __call__(self, _mod, _inp, out):
        probs = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if torch.is_tensor(probs) and probs.dim() == 4 and _live(self.point):
            self.point(probs)  # (B, H, T, T)
        return None


def _shown(x: torch.Tensor, tokens: _Tokens | None) -> torch.Tensor:
    """A (B T, d) tensor of a module that flattens the tokens as (B, T, d); anything else as it is."""
    return x.view(*tokens.bt, x.shape[-1]) if tokens is not None and x.dim() == 2 else x


class _Output:
    """Forward hook: a module's output (a tensor, or a tuple whose first element is it) through a hook point;
    ``copy``: the model then changes its output in place, so it gets a copy and the point keeps the value."""

    def __init__(self, point: HookPoint, tokens: _Tokens | None = None, copy: bool = False):
        self.point, self.tokens, self.copy = point, tokens, copy

    def __call__(self, _mod, _inp, out):
        if not _live(self.point):
            return None
        x = out[0] if isinstance(out, tuple) else out
        shown = _shown(x, self.tokens)
        y = self.point(shown)
        if y is shown and not self.copy:
            return None
        y = y.reshape(x.shape).clone() if self.copy else y.reshape(x.shape)
        return (y, *out[1:]) if isinstance(out, tuple) else y


class _Input:
    """Forward pre-hook: a module's first input (positional or ``hidden_states=``) through a hook point; with
    ``heads`` the (B, T, H d_h) input is shown per head (B, H, T, d_h); with ``tokens`` a (B T, d) input as (B, T,
    d)."""

    def __init__(self, point: HookPoint, heads: int = 0, tokens: _Tokens | None = None):
        self.point, self.heads, self.tokens = point, heads, tokens

    def __call__(self, _mod, args, kwargs=None):
        if not _live(self.point):
            return None
        x = args[0] if args else kwargs["hidden_states"]
        if self.heads:
            B, T, _ = x.shape
            shown = x.view(B, T, self.heads, -1).transpose(1, 2)  # (B, H, T, d_h)
        else:
            shown = _shown(x, self.tokens)  # (B, T, d)
        y = self.point(shown)
        if y is shown:
            return None
        y = y.transpose(1, 2).reshape(x.shape) if self.heads else y.reshape(x.shape)
        if kwargs is None:
            return (y, *args[1:])
        return ((y, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": y})


class _Router:
    """Forward hook on a router returning (logits (N, E), weights (N, k), indices (N, k)): logits and chosen
    experts through the MoE hook points as (B, T, E) and (B, T, k), read only."""

    def __init__(self, moe: ForeignMoE, tokens: _Tokens):
        self.moe, self.tokens = moe, tokens

    def __call__(self, _mod, _inp, out):
        logits, _weights, chosen = out
        B, T = self.tokens.bt
        if _live(self.moe.router_logits):
            self.moe.router_logits(logits.reshape(B, T, -1))  # (B, T, E)
        if _live(self.moe.experts):
            self.moe.experts(chosen.reshape(B, T, -1))  # (B, T, k)
        return None


class ForeignLM(Capabilities, nn.Module):
    """A transformers causal LM under cemtool's names and hook points. ``forward(idx) -> logits`` (B, T, V). What
    analyses may ask of it: :class:`cemtool.models.capabilities.Capabilities`."""

    family = "foreign"

    def __init__(self, hf: nn.Module, fam: Family, arch: str):
        super().__init__()
        parts = fam.backbone(hf)
        shape = fam.shape(hf.config)
        self.tok_emb = parts.tok_emb
        self.pos_emb = parts.pos_emb
        self.blocks = nn.ModuleList([ForeignBlock(layer, fam, shape) for layer in parts.layers])
        self.ln_f = parts.ln_f
        self.final = HookPoint()
        self.head = parts.head
        self.hf = hf  # registered last: its parameters keep the names above
        self.fixed: dict[str, str] = {}  # transformers name -> why it is not a free parameter (cemtool export)
        self.adapter = fam.name
        self.bilinear_qk = fam.bilinear_qk
        self.shape = shape
        self.max_seq_len = int(getattr(hf.config, "max_position_embeddings", 0) or getattr(hf.config, "n_positions", 0)
                               or 1 << 20)
        parts.ln_f.register_forward_hook(_Output(self.final))
        c = hf.config
        norm, mlp = fam.kinds.get(c.model_type, (fam.norm, fam.mlp_kind))
        self.cfg = ModelConfig(arch=arch, n_layer=len(self.blocks), d_model=int(c.hidden_size), n_head=shape.n_head,
                               head_dim=shape.head_dim, vocab_size=int(c.vocab_size), max_seq_len=self.max_seq_len,
                               pos="rope" if shape.rotary_dims else "learned" if parts.pos_emb is not None
                               else "none",  # ALiBi (BLOOM) shows as none: no position embedding, no rotary
                               norm=norm, mlp=mlp,
                               attn_impl="explicit",  # eager attention: probabilities and double backward
                               mlp_hidden=int(getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None)
                                              or getattr(c, "ffn_dim", None)  # OPT
                                              or getattr(c, "ffn_hidden_size", None)  # Falcon
                                              or 4 * c.hidden_size),
                               tie_embeddings=parts.head.weight is parts.tok_emb.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (B, T) int64 -> logits (B, T, V)."""
        check_ids(idx, self.max_seq_len, self.cfg.vocab_size)
        return self.hf(input_ids=idx, use_cache=False).logits  # (B, T, V)

    def qk_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As cemtool's models; None for a family whose q and k pass through per-head norms (Qwen3): its scores
        are not a fixed bilinear form of the layer's input, so rank truncation in the weights' basis is undefined."""
        return super().qk_weights(layer) if self.bilinear_qk else None

    def experts(self, layer: int) -> tuple[int, int] | None:
        moe = self.blocks[layer].moe
        return None if moe is None else (moe.n_experts, moe.top_k)

    def parameter_aliases(self) -> dict[str, list[str]]:
        """The transformers names of each parameter (``model.layers.0.self_attn.q_proj.weight``, and a tied head's
        too) by its cemtool name, so that ``--params`` globs take either."""
        ours = {id(p): n for n, p in self.named_parameters()}
        out: dict[str, list[str]] = {}
        for n, p in self.hf.named_parameters(remove_duplicate=False):
            out.setdefault(ours[id(p)], []).append(n)
        return out

    def fixed_parameters(self) -> dict[str, str]:
        """The parameters ``cemtool export`` added (GPT-2's zero projection biases), by cemtool name."""
        return {n: self.fixed[a] for n, names in self.parameter_aliases().items() for a in names if a in self.fixed}

    def num_params(self) -> dict[str, int]:
        """Total parameters (shared tensors once) and non-embedding parameters (without the token and position
        embeddings; an untied head is counted), as cemtool's LM.num_params."""
        total = sum(p.numel() for p in self.parameters())
        emb = self.tok_emb.weight.numel() + (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)
        return {"total": total, "non_embedding": total - emb}

    def describe(self) -> dict:
        s = self.shape
        moe = [(i, b.moe) for i, b in enumerate(self.blocks) if b.moe is not None]
        return {"adapter": self.adapter, "layers": len(self.blocks), "d_model": self.cfg.d_model,
                "heads": s.n_head, "kv_heads": s.n_kv_head, "head_dim": s.head_dim, "rotary_dims": s.rotary_dims,
                "rotary_dims_per_layer": [b.attn.rotary["dims"] if b.attn.rotary else 0 for b in self.blocks],
                "experts": {str(i): {"experts": m.n_experts, "top_k": m.top_k} for i, m in moe} or None,
                "vocab_size": self.cfg.vocab_size, "max_seq_len": self.max_seq_len,
                "parameters": sum(p.numel() for p in self.parameters())}
