"""Export a cemtool run as a standard Hugging Face directory that transformers loads without custom code.

The baseline block (METHODS §1) with RoPE, RMSNorm and SwiGLU is Llama's decoder layer, name for name, as
``LlamaForCausalLM``::

    tok_emb                        -> model.embed_tokens
    blocks.N.ln1 / ln2             -> model.layers.N.input_layernorm / post_attention_layernorm
    blocks.N.attn.wq, wk, wv, wo   -> model.layers.N.self_attn.q_proj, k_proj, v_proj, o_proj
    blocks.N.mlp.gate, up, down    -> model.layers.N.mlp.gate_proj, up_proj, down_proj
    ln_f                           -> model.norm
    head                           -> lm_head (omitted when tied: tie_word_embeddings)

No weight is permuted: cemtool's RoPE rotates the planes (i, i + d_h/2) of each head, which is Llama's
``rotate_half`` convention, with the same frequencies base^(-2i/d_h). Both scale scores by 1/sqrt(d_h), apply
x * rsqrt(mean(x²) + eps) * weight with the same eps, compute down(silu(gate x) * up x), and have no biases.
The uniform allocation of heads is one ``num_attention_heads`` and one ``head_dim`` (set explicitly, so
head_dim * heads may differ from the width, though transformers requires the heads to divide the width).

The baseline with LayerNorm, learned positions and GELU is GPT-2's block, as ``GPT2LMHeadModel``: tok_emb/pos_emb
-> transformer.wte/wpe, ln1/ln2 -> ln_1/ln_2, wq|wk|wv stacked -> attn.c_attn, wo -> attn.c_proj, up/down ->
mlp.c_fc/c_proj (Conv1D weights are the transpose of nn.Linear's), ln_f -> transformer.ln_f, with exact GELU
(``activation_function="gelu"``), no dropout, and zero biases on the projections (GPT-2 has them, cemtool does
not: the exported model has those extra, zero, parameters; cemtool_export.json lists them as ``added_parameters``
and an analysis of the export leaves them out, so that its Hessian is the run's). Its head size must be the
width / heads.

Per-layer head counts or sizes (``early-heavy``, ``late-lowrank``, explicit lists) cannot be said in either
config, and mixtures (RoPE with LayerNorm, ...) and every other family have no standard equivalent: they are
refused by one line naming what stands in the way.

The directory holds config.json, model.safetensors (fp32, metadata naming the run and step) and, from the run's
tokenizer, tokenizer.json and tokenizer_config.json (``PreTrainedTokenizerFast``), and cemtool_export.json: the
run's data section and tokenizer kind, so that ``cemtool sharpness DIR`` (any analysis) evaluates on the run's own
data when no --data is given, and a word-level run still reads the grammar corpora. Before it returns, the export
loads the directory with ``AutoModelForCausalLM.from_pretrained`` and compares its logits with the run's on random
sequences (fp32: max |difference| <= 1e-5 max(1, max |logit|), float rounding of an exact mapping); on a mismatch
it removes what it wrote and fails.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save

from cemtool.config import to_dict
from cemtool.errors import CemtoolError
from cemtool.layout import is_run
from cemtool.models.allocation import layer_shapes
from cemtool.models.baseline import Block
from cemtool.models.lm import LM
from cemtool.models.registry import get_arch
from cemtool.subject import open_subject
from cemtool.subject.hf.catalog import transformers_module as _transformers
from cemtool.subject.hf.loader import EXPORT_FILE
from cemtool.writes import atomic_write_bytes, atomic_write_json

TOLERANCE = 1e-5  # max |logit difference| / max(1, max |logit|), fp32
WRITES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", EXPORT_FILE)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


# --------------------------------------------------------------------------------------------------------------
# what each standard architecture can express

NEEDS = {"LlamaForCausalLM": {"norm": "rmsnorm", "pos": "rope", "mlp": "swiglu"},
         "GPT2LMHeadModel": {"norm": "layernorm", "pos": "learned", "mlp": "gelu"}}


def family_refusal(model) -> str | None:
    """Why this model's layers have no standard equivalent (None: it is the baseline block)."""
    if type(model) is LM and all(type(b) is Block for b in model.blocks):
        return None
    arch = model.cfg.arch
    return (f"architecture {arch} (family {get_arch(arch).family}) has no standard transformers equivalent; only "
            f"the baseline block is exported")


def refusals(model, target: str) -> list[str]:
    """Why this baseline model is not a ``target`` (empty: it is one)."""
    cfg = model.cfg
    why = [f"model.{k}={getattr(cfg, k)} (needs {v})" for k, v in NEEDS[target].items() if getattr(cfg, k) != v]
    shapes = layer_shapes(cfg)
    H, dh = shapes[0]
    if len(set(shapes)) > 1:
        why.append(f"per-layer (heads, head_dim) {shapes} (alloc_strategy={cfg.alloc_strategy}"
                   f"{', explicit model.heads/head_dims' if cfg.heads or cfg.head_dims else ''}): its config has one "
                   f"head count and one head size")
    elif target == "LlamaForCausalLM" and cfg.d_model % H:
        why.append(f"{H} heads do not divide model.d_model={cfg.d_model} (LlamaConfig requires it, even with its "
                   f"own head_dim)")
    elif target == "GPT2LMHeadModel" and H * dh != cfg.d_model:
        why.append(f"{H} heads of size {dh} are not model.d_model={cfg.d_model} wide (GPT-2's head size is the "
                   f"width / heads)")
    return why


def pick_target(model, label: str = "the model") -> str:
    """The standard architecture that expresses this model, or a one-line refusal naming what stands in the way."""
    family = family_refusal(model)
    if family:
        raise CemtoolError(f"cannot export {label}: {family}")
    why = {t: refusals(model, t) for t in NEEDS}
    for t, w in why.items():
        if not w:
            return t
    raise CemtoolError(f"cannot export {label}: " + "; ".join(f"as {t}: {', '.join(w)}" for t, w in why.items()))


def llama_config(model) -> dict:
    """config.json of the equivalent LlamaForCausalLM (read by transformers 4.45 and later, including 5.x)."""
    cfg = model.cfg
    attn = model.blocks[0].attn
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model, "intermediate_size": model.blocks[0].mlp.up.out_features,
            "num_hidden_layers": cfg.n_layer, "num_attention_heads": attn.n_head,
            "num_key_value_heads": attn.n_head, "head_dim": attn.head_dim, "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base}, "rope_scaling": None,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
            "tie_word_embeddings": bool(cfg.tie_embeddings), "use_cache": True, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32"}


def gpt2_config(model) -> dict:
    """config.json of the equivalent GPT2LMHeadModel (exact GELU, no dropout)."""
    cfg = model.cfg
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model, "n_layer": cfg.n_layer, "n_head": model.blocks[0].attn.n_head,
            "n_inner": model.blocks[0].mlp.up.out_features, "n_positions": cfg.max_seq_len,
            "activation_function": "gelu", "layer_norm_epsilon": cfg.norm_eps, "initializer_range": cfg.init_std,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": bool(cfg.tie_embeddings), "use_cache": True, "bos_token_id": None,
            "eos_token_id": None, "pad_token_id": None, "torch_dtype": "float32"}


def _complete(model, used: set[str], out: dict[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """Refuse a parameter the target has no place for (rather than drop it); fp32, contiguous, no shared memory."""
    unmapped = sorted(set(dict(model.named_parameters())) - used)  # shared tensors once: a tied head is tok_emb
    if unmapped:
        raise CemtoolError(f"cannot export parameters {', '.join(unmapped)}: {target} has no place for them")
    return {k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in out.items()}


def llama_state_dict(model) -> dict[str, torch.Tensor]:
    """Llama's tensor names for every cemtool parameter, unchanged."""
    names = {"tok_emb.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}
    if not model.cfg.tie_embeddings:
        names["head.weight"] = "lm_head.weight"
    parts = {"ln1": "input_layernorm", "ln2": "post_attention_layernorm", "attn.wq": "self_attn.q_proj",
             "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    for i in range(len(model.blocks)):
        for ours, theirs in parts.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    p = dict(model.named_parameters())
    return _complete(model, set(names), {theirs: p[ours] for ours, theirs in names.items()}, "LlamaForCausalLM")


def added_tensors(target: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The tensors the export adds to the run's parameters: GPT-2's projection biases (zeros; cemtool's layers
    have none). Recorded in cemtool_export.json, so that an analysis of the export leaves them out (they would be
    Hessian coordinates the run does not have: cemtool.subject.hf.loader.mark_added)."""
    if target != "GPT2LMHeadModel":
        return []
    return sorted(n for n in tensors if re.search(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.bias$", n))


def gpt2_state_dict(model) -> dict[str, torch.Tensor]:
    """GPT-2's tensors: Conv1D weights are (in, out), the transpose of nn.Linear's; q, k, v are stacked in c_attn;
    the projections' biases, which cemtool's layers do not have, are zeros (:func:`added_tensors`)."""
    p = dict(model.named_parameters())
    out = {"transformer.wte.weight": p["tok_emb.weight"], "transformer.wpe.weight": p["pos_emb.weight"]}
    used = {"tok_emb.weight", "pos_emb.weight"}

    def take(ours: str, theirs: str) -> None:
        out[theirs] = p[ours]
        used.add(ours)

    def conv1d(ours: list[str], theirs: str) -> None:
        w = torch.cat([p[f"{o}.weight"] for o in ours], dim=0)  # (out, in)
        out[f"{theirs}.weight"], out[f"{theirs}.bias"] = w.T, w.new_zeros(w.shape[0])  # (in, out), (out,)
        used.update(f"{o}.weight" for o in ours)

    for i in range(len(model.blocks)):
        b, h = f"blocks.{i}", f"transformer.h.{i}"
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            take(f"{b}.{ours}.weight", f"{h}.{theirs}.weight")
            take(f"{b}.{ours}.bias", f"{h}.{theirs}.bias")
        conv1d([f"{b}.attn.wq", f"{b}.attn.wk", f"{b}.attn.wv"], f"{h}.attn.c_attn")
        conv1d([f"{b}.attn.wo"], f"{h}.attn.c_proj")
        conv1d([f"{b}.mlp.up"], f"{h}.mlp.c_fc")
        conv1d([f"{b}.mlp.down"], f"{h}.mlp.c_proj")
    take("ln_f.weight", "transformer.ln_f.weight")
    take("ln_f.bias", "transformer.ln_f.bias")
    if not model.cfg.tie_embeddings:
        take("head.weight", "lm_head.weight")
    return _complete(model, used, out, "GPT2LMHeadModel")


TARGETS = {"LlamaForCausalLM": (llama_config, llama_state_dict), "GPT2LMHeadModel": (gpt2_config, gpt2_state_dict)}


# --------------------------------------------------------------------------------------------------------------
# writing and checking


def _check_target(out: Path, run_path: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CemtoolError(f"export target {out} exists and is not a directory")
    for d in (out.resolve(), *out.resolve().parents):  # inside a run, the export would be taken for part of it
        if d == run_path.resolve() or is_run(d):
            where = "is" if d == out.resolve() else f"lies inside {d}, which is"
            raise CemtoolError(f"export target {out} {where} a cemtool run",
                               hint="choose a directory outside every run")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not force:
        raise CemtoolError(f"export target {out} is not empty", hint="choose an empty or new directory, or --force "
                                                                     "to write into it")
    stale = [n for n in present if n not in WRITES and n.endswith(WEIGHT_SUFFIXES)]
    if stale:
        raise CemtoolError(f"export target {out} holds other weight files ({', '.join(stale)}) that transformers "
                           f"might load instead", hint="remove them or choose another directory")


def _write_tokenizer(loaded, out: Path) -> list[str]:
    inner = json.loads(loaded.tokenizer.to_json())["tokenizer"]  # the plain Hugging Face tokenizer.json
    atomic_write_bytes(out / "tokenizer.json", json.dumps(inner, ensure_ascii=False).encode("utf-8"))
    atomic_write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast",
                                                      "model_max_length": loaded.config.model.max_seq_len,
                                                      "clean_up_tokenization_spaces": False})
    return ["tokenizer.json", "tokenizer_config.json"]


def export_record(loaded, added: list[str]) -> dict:
    """What an analysis of the exported directory needs from the run: its data section (the default evaluation
    data), its tokenizer's kind (a word-level one reads the grammar corpora) and the tensors the export added
    (``added_parameters``: left out of the analyses)."""
    return {"run": str(loaded.run.path.resolve()), "checkpoint": loaded.checkpoint.name, "step": loaded.step,
            "arch": loaded.config.model.arch, "tokenizer_kind": loaded.tokenizer.kind,
            "data": to_dict(loaded.config.data), "added_parameters": added}


@torch.no_grad()
def logits_difference(model, out: Path, target: str, sequences: int = 2, seed: int = 0) -> tuple[float, float]:
    """(max |logits of the exported directory (AutoModelForCausalLM.from_pretrained, fp32) - the run's|,
    max |logit|) on random sequences of max_seq_len tokens."""
    hf = _transformers().AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True,
                                                              use_safetensors=True).eval()
    if type(hf).__name__ != target:
        raise CemtoolError(f"transformers loaded the export as {type(hf).__name__}, not {target}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.cfg.vocab_size, (sequences, model.cfg.max_seq_len), generator=g)  # (n, T)
    ours = model.float()(idx)  # (n, T, V)
    theirs = hf(input_ids=idx, use_cache=False).logits  # (n, T, V)
    return float((ours - theirs).abs().max()), float(ours.abs().max())


def export_hf(run: str | Path, out: str | Path, checkpoint: str = "final", force: bool = False) -> dict:
    """Write the run's model as a standard transformers directory ``out`` (LlamaForCausalLM, else
    GPT2LMHeadModel); return what was written and the logits check. Nothing is written outside ``out``; a non-empty
    ``out`` needs ``force``."""
    _transformers()  # the check below needs it: fail before writing anything
    loaded = open_subject(run, checkpoint)
    model, out = loaded.model, Path(out)
    target = pick_target(model, f"run {loaded.run.path}")
    _check_target(out, loaded.run.path, force)
    config_of, tensors_of = TARGETS[target]
    tensors = tensors_of(model)
    added = added_tensors(target, tensors)
    meta = {"format": "pt", "cemtool_run": str(loaded.run.path.resolve()), "cemtool_arch": model.cfg.arch,
            "cemtool_checkpoint": loaded.checkpoint.name, "cemtool_step": str(loaded.step)}
    out.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    try:
        atomic_write_json(out / "config.json", config_of(model))
        written.append("config.json")
        atomic_write_bytes(out / "model.safetensors", save(tensors, metadata=meta))
        written.append("model.safetensors")
        written += _write_tokenizer(loaded, out)
        atomic_write_json(out / EXPORT_FILE, export_record(loaded, added))
        written.append(EXPORT_FILE)
        diff, scale = logits_difference(model, out, target)
        if not diff <= TOLERANCE * max(1.0, scale):
            raise CemtoolError(f"the exported model's logits differ from the run's by {diff:.3g} (max |logit| "
                               f"{scale:.3g}); nothing was kept in {out}", hint="report it: the mapping is exact")
    except BaseException:
        for name in written:
            (out / name).unlink(missing_ok=True)
        raise
    return {"run": str(loaded.run.path), "checkpoint": loaded.checkpoint.name, "step": loaded.step,
            "arch": model.cfg.arch, "format": "hf", "architecture": target, "out": str(out), "files": written,
            "parameters": sum(t.numel() for t in tensors.values()),
            "added_parameters": sum(tensors[n].numel() for n in added), "added_tensors": added,
            "tie_word_embeddings": bool(model.cfg.tie_embeddings), "logits_max_abs_diff": diff,
            "logits_max_abs": scale, "transformers": _transformers().__version__}
