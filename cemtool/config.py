"""Configuration: frozen dataclasses for model, data and training, with validation.

A run is fully described by a :class:`RunConfig`. It is built in layers, each overriding the previous:

1. the dataclass defaults below,
2. the preset of the chosen architecture (``cemtool.models.registry``), e.g. ``cem-rec2`` sets ``model.cem.steps=2``,
3. TOML or JSON config files (``--config``, repeatable: composed in order, a later file overriding an earlier
   one key by key),
4. ``--set section.key=value`` overrides (dotted paths, nested: ``model.cem.steps=2``).

Every field carries its documentation (``help``) and its allowed values in the dataclass metadata;
:func:`describe_fields` lists them (``cemtool config --fields``). Invalid values are rejected with one line naming
the field, the value and what is allowed. The resolved config (``to_dict``) is what a run directory stores.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cemtool.architectures import get_arch
from cemtool.errors import CemtoolError, ConfigError, UsageError, did_you_mean
from cemtool.fileio import DepthError, loads_json, loads_toml, read_bytes


class OverrideError(ConfigError, UsageError):
    """A malformed ``--set`` item (not ``section.key=value``): a config error and a usage error (exit 2)."""


SCHEMA_VERSION = 1

# upper bounds of the size fields: far above anything cemtool trains, low enough that no single field can ask for
# an absurd allocation (whether a whole model fits is checked from the config by
# ``cemtool.models.sizing.check_memory``)
MAX_WIDTH = 1 << 16
MAX_HEADS = 1 << 12
MAX_SEQ_LEN = 1 << 20
MAX_VOCAB = 1 << 24
MAX_SYNTHETIC_TOKENS = 1 << 31
MAX_SEED = (1 << 32) - 1


def opt(default: Any, help: str, choices: tuple | None = None, min: float | None = None,
        max: float | None = None) -> Any:
    """A dataclass field with its documentation and constraints in the metadata."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if isinstance(default, (list, dict)):
        raise TypeError("use tuples for sequence defaults (configs are frozen)")
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------------------------
# model


@dataclass(frozen=True)
class CEMConfig:
    """Causal-energy-minimisation layers (METHODS §2); used by the ``cem*`` architectures."""

    tie_attention: bool = opt(True, "attention as the gradient of the log-sum-exp energy: W_V = W_K, W_O = W_Q^T")
    tie_mlp: bool = opt(True, "gated MLP as the gradient of an element-wise energy: W_down = W_up^T")
    gate_from_context: bool = opt(True, "MLP gate computed from the context c = LN(x) instead of g = LN(y) [recon]")
    dplr: bool = opt(False, "diagonal-plus-low-rank interaction A_h = diag(delta_h) + W_Q^T W_K")
    precond_rank: int = opt(0, "rank r of the preconditioner P = diag(softplus(p)) + U U^T (0 = no preconditioner)",
                            min=0, max=4096)
    steps: int = opt(1, "recursive energy steps T per layer (context fixed to the layer input)", min=1, max=16)
    step_init: float = opt(1.0, "initial value of each learned positive step size eta_t", min=1e-6, max=1e3)


@dataclass(frozen=True)
class MomentumConfig:
    """Optimizer-inspired layers with extra state streams (METHODS §3)."""

    variant: str = opt("vanilla", "the optimizer a layer imitates",
                       choices=("vanilla", "hb", "nesterov", "tmm", "adam", "adamw", "rmsprop", "muon", "ortho",
                                "soap", "shampoo"))
    stream_init: str = opt("embed", "initial extra streams: learned token+position embeddings, or zeros/ones",
                           choices=("embed", "zero"))
    ns_steps: int = opt(5, "Newton-Schulz iterations (muon, ortho)", min=1, max=20)
    newton_steps: int = opt(10, "Newton iterations for R^{-1/2} (soap, shampoo)", min=1, max=50)


@dataclass(frozen=True)
class LimeConfig:
    """Layer-Integrated Memory (METHODS §5)."""

    variant: str = opt("static", "router: static K/V mix over earlier layers, softmax over hidden states, or dynamic",
                       choices=("static", "softmax", "dynamic"))
    router_lr_mult: float = opt(10.0, "learning-rate multiplier of the router parameters (own optimizer group)",
                                min=0.0, max=1e4)
    router_lr: float = opt(0.0, "absolute peak lr of the router group (the reference code's 1e-2), on train.lr's "
                                "schedule; 0 = router_lr_mult x train.lr", min=0.0, max=100.0)
    freeze_router: bool = opt(False, "keep the routers at their random initialisation (no gradient): the control "
                                     "of what training the routers adds")


@dataclass(frozen=True)
class ModelConfig:
    """The network. Architecture-specific options live in the nested sections ``cem``, ``momentum``, ``lime``."""

    arch: str = opt("baseline", "architecture name (see `cemtool archs`)")
    n_layer: int = opt(4, "number of blocks", min=1, max=256)
    d_model: int = opt(128, "width of the residual stream", min=8, max=MAX_WIDTH)
    n_head: int = opt(4, "attention heads per layer (uniform allocation)", min=1, max=MAX_HEADS)
    head_dim: int = opt(0, "size of each head; 0 = d_model // n_head", min=0, max=MAX_WIDTH)
    heads: tuple = opt((), "per-layer head counts (empty = from alloc_strategy); length n_layer")
    head_dims: tuple = opt((), "per-layer head sizes (empty = from alloc_strategy); length n_layer")
    alloc_strategy: str = opt("uniform", "per-layer head/head-dim allocation at the uniform model's budget",
                              choices=("uniform", "early-heavy", "late-lowrank"))
    mlp: str = opt("swiglu", "MLP type", choices=("swiglu", "gelu"))
    mlp_hidden: int = opt(0, "MLP hidden width; 0 = 4*d_model for gelu, the multiple of 16 nearest 8/3*d_model "
                             "for swiglu (same parameters)", min=0, max=4 * MAX_WIDTH)
    norm: str = opt("rmsnorm", "normalisation layer", choices=("rmsnorm", "layernorm"))
    norm_eps: float = opt(1e-5, "epsilon of the norm layers", min=0.0, max=1.0)
    pos: str = opt("rope", "position encoding: rope, learned (absolute embeddings) or none (NoPE: the causal mask "
                           "alone carries order)", choices=("rope", "learned", "none"))
    rope_base: float = opt(10000.0, "RoPE base frequency", min=1.0, max=1e12)
    tie_embeddings: bool = opt(True, "share the token embedding with the LM head")
    max_seq_len: int = opt(0, "longest context the model accepts; 0 = data.seq_len", min=0, max=MAX_SEQ_LEN)
    vocab_size: int = opt(0, "vocabulary size; 0 = the tokenizer's", min=0, max=MAX_VOCAB)
    init_std: float = opt(0.02, "std of the normal init; residual output projections get std/sqrt(2*n_layer)",
                          min=0.0, max=10.0)
    attn_impl: str = opt("fused", "attention kernel: fused scaled_dot_product_attention or explicit softmax "
                                  "(identical outputs; explicit exposes probabilities and double backward)",
                         choices=("fused", "explicit"))
    cem: CEMConfig = field(default_factory=CEMConfig, metadata={"help": "CEM options"})
    momentum: MomentumConfig = field(default_factory=MomentumConfig, metadata={"help": "momentum-stream options"})
    lime: LimeConfig = field(default_factory=LimeConfig, metadata={"help": "LIMe options"})


# --------------------------------------------------------------------------------------------------------------
# data and training


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are cut into windows."""

    source: str = opt("grammar", "'grammar' (built-in, exact entropy floor), 'grammar-b' (its sibling), "
                                 "'grammar-hard' (nested to depth 4), 'ngram', 'ngram4', "
                                 "'pydoc', 'stdlib' or 'stdlib-core' (Python's standard library source, with or "
                                 "without its tests), or a path to a .txt file or a folder of .txt files, or "
                                 "pretokenised token files (.bin, .npy, or a folder with train.bin and val.bin)")
    tokenizer: str = opt("auto", "auto = word for grammar, bpe for text, ids alone for token files; word, byte, bpe, "
                                 "or the path of a Hugging Face tokenizer.json (e.g. GPT-2's)")
    bpe_vocab_size: int = opt(2048, "vocabulary size of a locally trained BPE tokenizer", min=260, max=65535)
    seq_len: int = opt(64, "tokens per training window", min=2, max=MAX_SEQ_LEN)
    train_tokens: int = opt(2_000_000, "tokens generated for training (synthetic sources only)", min=1000,
                            max=MAX_SYNTHETIC_TOKENS)
    val_tokens: int = opt(65_536, "held-out validation tokens (synthetic sources: generated with another seed)",
                          min=128, max=MAX_SYNTHETIC_TOKENS)
    val_fraction: float = opt(0.05, "share of a text corpus held out for validation (the end of the text)",
                              min=0.001, max=0.5)
    seed: int = opt(1234, "seed of the corpus itself (synthetic generation), independent of the training seed",
                    min=0, max=MAX_SEED)
    token_dtype: str = opt("auto", "dtype of flat .bin token files; auto = uint16 (nanoGPT's) unless the tokenizer "
                                   "has over 65,536 ids, then uint32; .npy files carry their own",
                           choices=("auto", "uint16", "uint32"))


@dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop."""

    max_steps: int = opt(800, "optimizer steps (ignored when max_tokens > 0)", min=1, max=10**9)
    max_tokens: int = opt(0, "train on this many tokens instead of max_steps (0 = use max_steps)", min=0,
                          max=10**15)
    batch_size: int = opt(32, "sequences per micro-batch (global, across processes)", min=1, max=1 << 20)
    grad_accum: int = opt(1, "micro-batches per optimizer step", min=1, max=1 << 16)
    lr: float = opt(3e-3, "peak learning rate", min=0.0, max=100.0)
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of lr (cosine, wsd)", min=0.0, max=1.0)
    schedule: str = opt("cosine", "learning-rate schedule after warmup", choices=("cosine", "constant", "wsd"))
    warmup_steps: int = opt(50, "linear warmup steps", min=0, max=10**9)
    decay_fraction: float = opt(0.2, "wsd: fraction of steps spent decaying at the end", min=0.0, max=1.0)
    weight_decay: float = opt(0.1, "AdamW weight decay (matrices only; norms, biases, embeddings... exempt)",
                              min=0.0, max=100.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0, max=1.0)
    optimizer: str = opt("adamw", "adamw for every parameter, or muon: Muon for the blocks' Linear weights and AdamW "
                                  "for the rest (embeddings, head, norms, scalars, routers)", choices=("adamw", "muon"))
    muon_lr: float = opt(0.02, "Muon's peak learning rate (train.optimizer=muon; same warmup and decay as lr)",
                         min=0.0, max=100.0)
    muon_momentum: float = opt(0.95, "Muon's momentum (Nesterov)", min=0.0, max=1.0)
    grad_clip: float = opt(1.0, "clip the global gradient norm to this (0 = off)", min=0.0, max=1e6)
    eval_every: int = opt(200, "evaluate every N steps (and at step 0 and the end)", min=1, max=10**9)
    eval_tokens: int = opt(32_768, "validation tokens per evaluation (fixed windows)", min=1, max=1 << 30)
    log_every: int = opt(20, "write a metrics line every N steps", min=1, max=10**9)
    ckpt_every: int = opt(0, "checkpoint every N steps (0 = at each evaluation)", min=0, max=10**9)
    keep_checkpoints: int = opt(2, "step checkpoints kept besides final (oldest deleted first)", min=1, max=10**6)
    precision: str = opt("auto", "auto = bf16 autocast on CUDA, fp32 elsewhere", choices=("auto", "fp32", "bf16"))
    compile: str = opt("auto", "torch.compile the model: auto = on CUDA (falls back to eager, with the reason, when "
                               "compilation fails), eager elsewhere; true; false", choices=("auto", "true", "false"))
    host_sync: str = opt("auto", "when the host reads the training loss (and checks it is finite): every step, or "
                                 "only at log steps (no per-step device-to-host sync; a non-finite loss is caught at "
                                 "the next log step); auto = log on CUDA, step elsewhere",
                         choices=("auto", "step", "log"))
    tokens_per_step: int = opt(0, "tokens per optimizer step: sets train.grad_accum to tokens_per_step / "
                                  "(batch_size x data.seq_len), which must be a whole number (0 = use grad_accum)",
                               min=0, max=10**12)
    optimizer_impl: str = opt("auto", "AdamW's kernel: fused (one kernel over all parameters), foreach (batched "
                                      "per-op) or loop (torch's per-parameter reference); auto = fused on CUDA, loop "
                                      "elsewhere. Muon is torch's own (one Newton-Schulz per matrix)",
                              choices=("auto", "fused", "foreach", "loop"))
    threads: int = opt(0, "CPU threads for torch (0 = torch's default)", min=0, max=4096)
    curvature_every: int = opt(0, "record the Hessian's λ_max (and the curvature_* options) in metrics.jsonl every N "
                                  "steps (0 = off)", min=0, max=10**9)
    curvature_tokens: int = opt(512, "tokens of the fixed validation batch the curvature is measured on (the first "
                                      "windows, as `cemtool sharpness --tokens N`)", min=1, max=1 << 24)
    curvature_params: str = opt("all", "parameter subset of the curvature: all, layer:N, attn, mlp, embed or a glob on "
                                       "names (comma-separated union)")
    curvature_steps: int = opt(20, "Lanczos step (HVP) cap of each λ_max measurement", min=2, max=10_000)
    curvature_trace: int = opt(0, "HVPs of an XTrace estimate of tr(H) per measurement (0 = off, else >= 4)", min=0,
                               max=100_000)
    curvature_precond: bool = opt(False, "also λ_max of P^-1 H, Adam's preconditioned Hessian (train.optimizer=adamw)")
    log_to: str = opt("none", "also write the metrics.jsonl rows as TensorBoard scalars to RUN/tensorboard/ (needs "
                              "the extra cemtool[tensorboard])", choices=("none", "tensorboard"))


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run."""

    model: ModelConfig = field(default_factory=ModelConfig, metadata={"help": "the network"})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "the corpus"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "the optimisation"})
    seed: int = opt(0, "seed of initialisation, batch order and dropout", min=0, max=MAX_SEED)
    schema_version: int = opt(SCHEMA_VERSION, "config schema version (written by cemtool)", min=1, max=SCHEMA_VERSION)


# --------------------------------------------------------------------------------------------------------------
# (de)serialisation and validation


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


def is_section(key: str, cls: type | None = None) -> bool:
    """Whether a dotted config key names a section (model, model.momentum, ...) rather than a field."""
    tp: Any = cls or RunConfig
    for part in key.split("."):
        hints = _hints(tp) if _is_section(tp) else {}
        if part not in hints:
            return False
        tp = hints[part]
    return _is_section(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # cached: the config classes do not change, and every override walks them


def to_dict(cfg: Any) -> dict:
    """Nested plain dict (JSON-able; tuples become lists)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true/false", str: "a string",
            tuple: "a list of integers"}.get(tp, str(tp))


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Convert a parsed value to the field's type or raise a one-line ConfigError."""
    bad = ConfigError(f"{path}={value!r} is not valid: expected {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    f = float(value)
                except ValueError:
                    raise bad from None
                if f.is_integer():
                    return int(f)
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        try:
            f = float(value) if isinstance(value, (int, float, str)) else None
        except (ValueError, OverflowError):
            raise bad from None
        if f is None:
            raise bad
        if not math.isfinite(f):
            raise ConfigError(f"{path}={value!r} is not allowed: must be a finite number")
        return f
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    if tp is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(path, v, int) for v in value)
        raise bad
    raise bad


def _check(path: str, value: Any, f: dataclasses.Field) -> None:
    m = f.metadata
    choices = m.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{path}={value!r} is not allowed: choose one of {', '.join(map(str, choices))}")
    lo, hi = m.get("min"), m.get("max")
    if lo is not None and value < lo:
        raise ConfigError(f"{path}={value!r} is not allowed: must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{path}={value!r} is not allowed: must be <= {hi}")


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build a (nested) config from a dict, rejecting unknown keys and wrong types with one clear line."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table/object, got {type(data).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key {prefix}{unknown[0]}: known keys in "
                          f"{prefix.rstrip('.') or 'the top level'} are {', '.join(fields)}",
                          hint=did_you_mean(unknown[0], fields))
    kwargs = {}
    for name, value in data.items():
        f, tp, path = fields[name], hints[name], prefix + name
        if _is_section(tp):
            kwargs[name] = from_dict(tp, value, path + ".")
        else:
            if tp is str and isinstance(value, bool) and "true" in (f.metadata.get("choices") or ()):
                value = "true" if value else "false"  # an option that was a boolean once (train.compile)
            v = _coerce(path, value, tp)
            _check(path, v, f)
            kwargs[name] = v
    return cls(**kwargs)


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge (override wins)."""
    out = dict(base)
    for k, v in override.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_override(item: str) -> dict:
    """'model.cem.steps=2' -> {'model': {'cem': {'steps': 2}}} (value parsed as JSON when possible)."""
    if "=" not in item:
        raise OverrideError(f"--set {item!r} is not of the form section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise OverrideError(f"--set {item!r}: empty key")
    try:
        value = loads_json(raw)
    except DepthError as e:
        raise ConfigError(f"--set {key}: the value is {e}") from None
    except json.JSONDecodeError:
        value = raw
    if is_section(key) and not isinstance(value, dict):
        raise OverrideError(f"--set {key}: {key} is a config section and must be a table/object, got "
                          f"{type(value).__name__}", hint=f"set one of its fields, e.g. --set {key}.<field>=...")
    out: dict = {}
    node = out
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = value
    return out


CONFIG_FORMATS = "TOML (named *.toml) or JSON (any other name); not YAML"


def load_file(path: str | Path) -> dict:
    """Read a TOML (``*.toml``) or JSON (any other name) config file into a dict (not yet validated): a regular
    file of at most ``fileio.MAX_FILE_BYTES``, nested at most ``fileio.MAX_DEPTH`` levels (:mod:`cemtool.fileio`);
    YAML (``*.yaml``, ``*.yml``) is refused with one line saying which formats are read."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {p} does not exist")
    if p.suffix.lower() in (".yaml", ".yml"):
        raise ConfigError(f"config file {p} is YAML: cemtool reads config files in {CONFIG_FORMATS}",
                          hint="write it as TOML (same keys: [model] d_model = 64) or JSON; `cemtool config` prints "
                               "a resolved config as JSON")
    try:
        text = read_bytes(p, "config file").decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p} is not UTF-8 text") from None
    except CemtoolError as e:  # a FIFO, a device, too large
        raise ConfigError(e.message, hint=e.hint) from None
    toml = p.suffix.lower() == ".toml"
    try:
        data = loads_toml(text) if toml else loads_json(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {p} is not valid JSON: {e.msg} at line {e.lineno}",
                          hint=f"cemtool reads config files in {CONFIG_FORMATS}") from None
    except ValueError as e:  # TOMLDecodeError, fileio.DepthError
        raise ConfigError(f"config file {p} is not valid {'TOML' if toml else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a table/object at the top level")
    return data


def check_schema(data: dict, source: str) -> None:
    """Refuse configs written by a newer cemtool."""
    v = data.get("schema_version", SCHEMA_VERSION)
    if not isinstance(v, int) or v > SCHEMA_VERSION:
        raise ConfigError(f"{source} has schema_version {v!r}, newer than this cemtool understands "
                          f"({SCHEMA_VERSION})", hint="upgrade cemtool")


def load_files(files: str | Path | list | tuple | None) -> dict:
    """Read config files and compose them in order: a later file overrides an earlier one key by key (nested
    sections merge; a key a later file does not name keeps the earlier value)."""
    if files is None:
        return {}
    out: dict = {}
    for f in [files] if isinstance(files, (str, Path)) else files:
        data = load_file(f)
        check_schema(data, str(f))
        out = merge(out, data)
    return out


def resolve(arch: str | None = None, file: str | Path | list | tuple | None = None,
            overrides: list[str] | tuple = (), seed: int | None = None, data_source: str | None = None) -> RunConfig:
    """Build the run config from defaults, the architecture preset, config file(s) and --set overrides.
    ``file`` may be a list: the files are composed in order (:func:`load_files`)."""
    file_data = load_files(file)
    set_data: dict = {}
    for item in overrides:
        set_data = merge(set_data, parse_override(item))
    name = arch or set_data.get("model", {}).get("arch") or file_data.get("model", {}).get("arch") or "baseline"
    spec = get_arch(name)
    data = merge(merge(spec.preset, file_data), set_data)
    data = merge(data, {"model": {"arch": name}})
    if seed is not None:
        data["seed"] = seed
    if data_source is not None:
        data = merge(data, {"data": {"source": data_source}})
    data["schema_version"] = SCHEMA_VERSION
    return validate(from_dict(RunConfig, data))


def uniform_head_dim(d_model: int, n_head: int, head_dim: int = 0) -> int:
    """The head size of the uniform model: ``model.head_dim``, or d_model // n_head where it is 0."""
    return head_dim or d_model // n_head


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks that no single field can express."""
    m = cfg.model
    hd = uniform_head_dim(m.d_model, m.n_head, m.head_dim)
    if m.head_dim == 0 and m.d_model % m.n_head:
        raise ConfigError(f"model.n_head={m.n_head} does not divide model.d_model={m.d_model}",
                          hint="set model.head_dim explicitly")
    if m.pos == "rope" and hd % 2:
        raise ConfigError(f"head size {hd} is odd: RoPE needs an even head size")
    for name in ("heads", "head_dims"):
        v = getattr(m, name)
        if v and len(v) != m.n_layer:
            raise ConfigError(f"model.{name} has {len(v)} entries, expected model.n_layer={m.n_layer}")
        if any(x < 1 or x > MAX_WIDTH for x in v):
            raise ConfigError(f"model.{name}={list(v)} must hold integers from 1 to {MAX_WIDTH}")
    tok = cfg.data.tokenizer
    if tok not in ("auto", "word", "byte", "bpe") and not tok.lower().endswith(".json"):
        raise ConfigError(f"data.tokenizer={tok!r} is not allowed: choose one of auto, word, byte, bpe, or the path "
                          f"of a tokenizer.json")
    if m.max_seq_len and m.max_seq_len < cfg.data.seq_len:
        raise ConfigError(f"model.max_seq_len={m.max_seq_len} is shorter than data.seq_len={cfg.data.seq_len}")
    t = cfg.train
    if 0 < t.curvature_trace < 4:
        raise ConfigError(f"train.curvature_trace={t.curvature_trace} is not allowed: 0 (off) or at least 4 HVPs")
    if t.curvature_precond and t.optimizer != "adamw":
        raise ConfigError("train.curvature_precond needs train.optimizer=adamw: the preconditioner is Adam's")
    if not t.curvature_params.strip():
        raise ConfigError("train.curvature_params is empty", hint="use all, layer:N, attn, mlp, embed or a glob")
    if cfg.train.optimizer == "muon" and cfg.train.lr <= 0:  # Muon's rate is muon_lr / lr x lr's schedule
        raise ConfigError("train.optimizer=muon needs train.lr > 0: Muon's rate follows the schedule of train.lr")
    if t.tokens_per_step:
        return dataclasses.replace(cfg, train=dataclasses.replace(t, grad_accum=accumulation(t, cfg.data.seq_len)))
    return cfg


def accumulation(t: TrainConfig, seq_len: int) -> int:
    """The micro-batches per step that give exactly ``train.tokens_per_step`` tokens; refused when no whole number
    does, or when train.grad_accum says otherwise (never a silently different step)."""
    micro = t.batch_size * seq_len
    if t.tokens_per_step % micro:
        lo = max(1, t.tokens_per_step // micro)
        raise ConfigError(f"train.tokens_per_step={t.tokens_per_step} is not a multiple of train.batch_size x "
                          f"data.seq_len = {micro}",
                          hint=f"use {lo * micro} or {(lo + 1) * micro}, or change train.batch_size")
    accum = t.tokens_per_step // micro
    if t.grad_accum not in (1, accum):
        raise ConfigError(f"train.tokens_per_step={t.tokens_per_step} needs train.grad_accum={accum}, but "
                          f"train.grad_accum={t.grad_accum} is set", hint="set one of the two")
    return accum


def replace(cfg: Any, **changes: Any) -> Any:
    """dataclasses.replace with dotted keys: replace(cfg, **{"model.d_model": 256})."""
    nested: dict = {}
    for k, v in changes.items():
        node = nested
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return from_dict(type(cfg), merge(to_dict(cfg), nested))


def describe_fields(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(path, type, default, help) for every field, for `cemtool config --fields` and the docs."""
    rows = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = prefix + f.name
        if _is_section(tp):
            rows.extend(describe_fields(tp, path + "."))
            continue
        default = f.default
        help_ = f.metadata.get("help", "")
        if f.metadata.get("choices"):
            help_ += f" [{'|'.join(map(str, f.metadata['choices']))}]"
        if f.metadata.get("min") is not None and f.metadata.get("max") is not None:
            lo, hi = f.metadata["min"], f.metadata["max"]
            help_ += f" [{lo:,} to {hi:,}]" if tp is int else f" [{lo:g} to {hi:g}]"
        elif tp is float:
            help_ += " [finite]"
        rows.append((path, getattr(tp, "__name__", str(tp)), json.dumps(to_dict_value(default)), help_))
    return rows


def to_dict_value(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def config_from_run_dict(data: dict, source: str = "config.json") -> RunConfig:
    """Rebuild a stored config (schema-checked)."""
    check_schema(data, source)
    return validate(from_dict(RunConfig, data))
