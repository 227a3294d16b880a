"""Parameter blocks (METHODS §6; docs/sharpness.md "Blocks"): the groups whose block-diagonal restriction of an
operator ``cemtool sharpness --blocks`` measures one at a time.

``--blocks`` takes ``layer`` (one block per layer N: every parameter under it), ``kind`` (one block per tensor kind
and layer: q, k, v, qkv (packed), o, mlp-in, mlp-out, norm, other; embed and the final norm outside the layers), or a
comma-separated list of globs on the parameter names (each glob one block). The kind of a parameter is read from its
dotted name by the declared patterns below (cemtool's names and the common Hugging Face ones); a name no pattern
claims is "other", never guessed into a kind. Restricting an operator A to a block S gives the block A_SS: its
eigenvalues are those of that sub-matrix, not of A (interactions between blocks are left out by definition).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from torch import nn

from cemtool.errors import CemtoolError

# (kind, pattern on the dotted name), first match wins [decision: declared, ordered; extend for new names]
KIND_PATTERNS: tuple[tuple[str, str], ...] = (
    ("norm", r"(^|\.)(ln\w*|\w*norm\w*)(\.|$)"),
    ("embed", r"(^|\.)(tok_emb|pos_emb|stream_emb|head|wte|wpe|embed_tokens|embed_in|embed_out|lm_head)(\.|$)"),
    ("qkv", r"(^|\.)(c_attn|query_key_value|qkv_proj|Wqkv|qkv)\."),
    ("q", r"(^|\.)(wq|q_proj|query|q)\."),
    ("k", r"(^|\.)(wk|k_proj|key|k)\."),
    ("v", r"(^|\.)(wv|v_proj|value|v)\."),
    ("o", r"(attn|attention)\.(wo|o_proj|c_proj|dense|out_proj|o)\."),
    ("mlp-in", r"(mlp|ffn)\.(up|gate|up_proj|gate_proj|c_fc|fc1|fc_in|dense_h_to_4h|w1|w3|gate_up_proj)\."),
    ("mlp-out", r"(mlp|ffn)\.(down|down_proj|c_proj|fc2|fc_out|dense_4h_to_h|w2)\."),
)
KINDS = ("q", "k", "v", "qkv", "o", "mlp-in", "mlp-out", "embed", "norm", "other")
LAYER = re.compile(r"(?:^|\.)(?:blocks|layers|h)\.(\d+)\.")


def kind_of(name: str) -> str:
    """The tensor kind of a parameter from its dotted name (KIND_PATTERNS), or "other"."""
    return next((kind for kind, pat in KIND_PATTERNS if re.search(pat, name)), "other")


def layer_of(name: str) -> int | None:
    """The layer index N of a parameter named ``blocks.N.*`` (or ``layers.N.*``, ``h.N.*``), None outside."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Block:
    """One parameter group: its label (a row of the table), its layer (None outside the layers), its kind (None
    for a whole layer or a glob) and the names of its parameters (model order)."""

    label: str
    layer: int | None
    kind: str | None
    names: tuple[str, ...]

    @property
    def spec(self) -> str:
        """The parameter selection of exactly these names (hessian.select_parameters)."""
        return ",".join(self.names)


def check_blocks(spec: str) -> None:
    """A --blocks value's form, before any model is loaded."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise CemtoolError("--blocks is empty", hint="use layer, kind, or globs on parameter names")
    if len(parts) > 1 and ({"layer", "kind"} & set(parts)):
        raise CemtoolError(f"--blocks {spec!r}: layer and kind stand alone", hint="use layer, kind, or a glob list")


def blocks_of(named: list[tuple[str, nn.Parameter]], spec: str) -> list[Block]:
    """The blocks ``spec`` describes over the parameters ``named`` (a curvature selection, model order)."""
    check_blocks(spec)
    names = [n for n, _ in named]
    if spec.strip() in ("layer", "kind"):
        groups: dict[tuple, list[str]] = {}
        for n in names:
            layer = layer_of(n)
            if spec.strip() == "layer" and layer is None:
                continue  # a layer's block: only what is under a layer
            key = (layer,) if spec.strip() == "layer" else (layer, kind_of(n))
            groups.setdefault(key, []).append(n)
        if not groups:
            raise CemtoolError("the model has no layers (no parameters named blocks.N.*, layers.N.* or h.N.*)")

        def order(key):
            return (key[0] is None, key[0] or 0, KINDS.index(key[1]) if len(key) > 1 else 0)

        return [Block(_label(key), key[0], key[1] if len(key) > 1 else None, tuple(groups[key]))
                for key in sorted(groups, key=order)]
    out = []
    for glob in [p.strip() for p in spec.split(",") if p.strip()]:
        hit = tuple(n for n in names if fnmatch.fnmatchcase(n, glob))
        if not hit:
            raise CemtoolError(f"--blocks glob {glob!r} matches no parameter",
                               hint=f"names look like {names[min(1, len(names) - 1)]}" if names else None)
        out.append(Block(glob, None, None, hit))
    return out


def _label(key: tuple) -> str:
    layer = "outside layers" if key[0] is None else f"layer {key[0]}"
    return layer if len(key) == 1 else f"{layer}: {key[1]}"


__all__ = ["KINDS", "KIND_PATTERNS", "Block", "blocks_of", "check_blocks", "kind_of", "layer_of"]
