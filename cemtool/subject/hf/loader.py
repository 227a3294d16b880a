"""Load a model cemtool did not train: a local Hugging Face directory or ``hf:ORG/NAME[@REVISION]``.

Rules (docs/models.md):

- no code from the directory: a config.json or tokenizer_config.json with an ``auto_map`` (custom Python classes)
  is refused, and every transformers call passes ``trust_remote_code=False``;
- no link out of the directory: the directory and every entry in it must not be symbolic links, except, in the
  huggingface_hub cache, links that resolve inside the same cache repository (``snapshots/<rev>/*`` -> ``blobs/``);
- every weight file's safetensors layout is checked from its header (:mod:`cemtool.tensorfile`), and the tensors
  must be exactly those the config's model has, with their shapes (read from the header; the expected ones from the
  model built on the meta device), before anything is allocated, after the size check: parameters and memory are
  estimated from the config and a model that cannot fit is refused;
- safetensors only: a directory whose weights are only pickles (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) is
  refused before anything is read, and transformers is called with ``use_safetensors=True``; an ``hf:`` download
  fetches only safetensors, JSON and tokenizer files;
- ``hf:`` ids resolve through huggingface_hub's own cache (``HF_HOME``, ``HF_HUB_OFFLINE=1`` honoured);
- the model is loaded in float32 with eager attention and eager experts (:data:`EAGER`: double backward for
  Hessians, float64 for ``--dtype fp64``, which transformers' grouped-matmul experts refuse; attention
  probabilities for collapse and saturation) and wrapped in :class:`~cemtool.subject.hf.adapter.ForeignLM`;
- its own tokenizer (``tokenizer.json``, else the files transformers converts to one); none is needed for
  pretokenised ids (``.bin``/``.npy`` data);
- at load, the adapter's logits (with every hook point captured) are compared with the plain transformers forward
  (no hooks; the default attention kernel) on a few sequences; a mismatch beyond 1e-5 is refused, and the check is
  recorded in the source description every report's provenance carries;
- two tiers (docs/models.md): a model type with a declared family adapter (catalog.py) is wrapped in ForeignLM
  (hook points: every analysis) unless its family refuses the config by name (``Family.refuse``: a structure it
  does not declare, recorded as ``tier_b_refused``); any other causal LM transformers builds is wrapped in
  :class:`~cemtool.subject.hf.logits_only.LogitsLM` (its own forward, no hook points: sharpness and forgetting;
  collapse-report and saturation refuse it by name).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as Fast

from cemtool.config import DataConfig, RunConfig, from_dict, replace, to_dict
from cemtool.data.tokenizer import Tokenizer
from cemtool.data.tokens import id_tokenizer, is_token_source
from cemtool.errors import CemtoolError
from cemtool.fileio import read_json
from cemtool.layout import is_hf_dir  # the one detector of run and model directories (re-exported here)
from cemtool.memory import check_weights_memory
from cemtool.models.capture import capture
from cemtool.models.registry import register
from cemtool.runs import Run
from cemtool.subject.base import Subject
from cemtool.subject.hf.adapter import ForeignLM
from cemtool.subject.hf.algebra import hook_algebra_check
from cemtool.subject.hf.catalog import family_of
from cemtool.subject.hf.catalog import transformers_module as _transformers
from cemtool.subject.hf.logits_only import LogitsLM
from cemtool.tensorfile import BadTensorFile, TensorInfo, read_header
from cemtool.writes import atomic_write_json, os_error

EAGER = {"attn_implementation": "eager",  # the attention probabilities, and a double backward
         "experts_implementation": "eager"}  # a mixture of experts in float64 (grouped_mm takes no float64)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]  # never a pickle
ALGEBRA_KEYS = ("rows_sum_to_one", "causal_pattern", "pattern_is_softmax_qk", "z_is_pattern_v", "resid_mid",
                "resid_post")
TOLERANCE = 1e-5  # logits check: max |difference| / max(1, max |logit|), float32
EXPORT_FILE = "cemtool_export.json"  # written by cemtool export: the run's data section and tokenizer kind
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "vocab.txt", "*.model",
                   "*.tiktoken")  # what AutoTokenizer reads; without any, only token ids can be evaluated
SOURCE_FILE = "model_source.json"  # written beside the reports: what was loaded (read by report.provenance)
_CONFIGS: dict[str, dict] = {}  # registered foreign architectures: arch name -> transformers config
_REFUSED: dict[str, str] = {}  # registered architectures whose tier-b mapping failed a load check: arch -> why


def is_foreign(source: str | Path) -> bool:
    s = str(source)
    return s.startswith("hf:") or is_hf_dir(Path(s))


# --------------------------------------------------------------------------------------------------------------
# where the files are


def parse_hub_id(spec: str) -> tuple[str, str | None]:
    """'hf:ORG/NAME[@REVISION]' -> (ORG/NAME, REVISION or None)."""
    body = spec[len("hf:"):]
    repo, _, rev = body.partition("@")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", repo) or (rev == "" and "@" in body):
        raise CemtoolError(f"{spec!r} is not a Hugging Face model id", hint="write hf:ORG/NAME or hf:ORG/NAME@REVISION")
    return repo, rev or None


def hub_snapshot(spec: str) -> tuple[Path, dict]:
    """The local snapshot directory of an hf: id (downloaded into the huggingface_hub cache if allowed)."""
    repo, rev = parse_hub_id(spec)
    try:
        from huggingface_hub import snapshot_download  # optional dependency: huggingface_hub
    except ImportError:
        raise CemtoolError("hf: ids need the huggingface_hub package",
                           hint='install the extra: pip install -e ".[hf]"') from None
    try:
        path = Path(snapshot_download(repo, revision=rev, allow_patterns=HUB_FILES))
    except Exception as e:  # offline without cache, unknown repo or revision, network errors: one line each
        why = " ".join(str(e).split()) or type(e).__name__  # the whole message, on one line
        raise CemtoolError(f"{spec}: the model is not in the Hugging Face cache and could not be downloaded "
                           f"({type(e).__name__}: {why})",
                           hint=f"on a machine with network access run `{download_command(repo, rev)}` "
                                f"(HF_HOME selects the cache), or pass a local directory written by save_pretrained"
                           ) from None
    return path, {"kind": "hf-hub", "repo": repo, "revision": rev, "commit": path.name}


def download_command(repo: str, rev: str | None) -> str:
    """The command line that fills the cache: ``hf download`` since huggingface_hub 1.0 (``huggingface-cli``
    before)."""
    try:
        from huggingface_hub import __version__ as hub_version  # optional dependency: huggingface_hub
    except ImportError:
        hub_version = "1"
    cli = "huggingface-cli" if int(hub_version.split(".")[0]) < 1 else "hf"
    return f"{cli} download {repo}{' --revision ' + rev if rev else ''}"


def check_links(path: Path, cache_repo: Path | None = None) -> None:
    """Refuse a model directory that is a symbolic link or holds one: cemtool reads nothing outside the directory.
    In the huggingface_hub cache (``cache_repo``: ``models--ORG--NAME``) the snapshot's links into the same
    repository's ``blobs/`` are how the cache stores files, and are allowed."""
    inside = cache_repo.resolve() if cache_repo is not None else None
    for p in [path, *sorted(path.iterdir())]:
        if not p.is_symlink():
            continue
        target = p.resolve()
        if inside is not None and target.is_relative_to(inside):
            continue
        raise CemtoolError(f"{p} is a symbolic link (to {target}): cemtool follows no link out of a model directory",
                           hint="copy the files into the directory (only the Hugging Face cache's own links "
                                "inside a cache repository are followed)")


def refuse_remote_code(path: Path) -> None:
    """Refuse a directory whose config names its own Python classes (``auto_map``): transformers would import and
    run the directory's ``*.py`` files. cemtool never runs code from a model directory."""
    for name in ("config.json", "tokenizer_config.json"):
        f = path / name
        raw = read_json(f, name) if f.is_file() else None
        if isinstance(raw, dict) and raw.get("auto_map"):
            shown = json.dumps(raw["auto_map"])
            raise CemtoolError(f"{f} has an auto_map ({shown[:200]}{'...' if len(shown) > 200 else ''}): it names "
                               f"the directory's own Python code, and cemtool never runs code from a model directory",
                               hint="use a model whose architecture transformers itself implements "
                                    "(trust_remote_code is never set)")


def check_files(path: Path) -> list[Path]:
    """The safetensors weight files of a model directory; refuse pickle-only directories without opening them."""
    weights = sorted(path.glob("*.safetensors"))
    if weights:
        return weights
    pickles = sorted({p.name for pat in PICKLES for p in path.glob(pat)})
    if pickles:
        raise CemtoolError(f"{path} holds only pickle weights ({', '.join(pickles[:3])}): cemtool never unpickles "
                           f"files, since loading a pickle can run arbitrary code",
                           hint="convert them where you trust them: model.save_pretrained(dir, "
                                "safe_serialization=True)")
    raise CemtoolError(f"{path} holds no *.safetensors weights", hint="write the model with save_pretrained")


def read_headers(weights: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor's dtype and shape, from the weight files' headers (no data read), each file's layout checked
    (:func:`cemtool.tensorfile.read_header`)."""
    found: dict[str, TensorInfo] = {}
    for w in weights:
        try:
            tensors, _ = read_header(w)
        except BadTensorFile as e:
            raise CemtoolError(f"{w} is not a valid safetensors file: {e}",
                               hint="write the weights again with save_pretrained (safetensors)") from None
        except OSError as e:
            raise os_error(e, w, "read") from None
        again = sorted(set(tensors) & set(found))
        if again:
            raise CemtoolError(f"{w}: tensor {again[0]!r} is also in another weight file")
        found.update(tensors)
    return found


# --------------------------------------------------------------------------------------------------------------
# the tensors the model expects, its size


def config_params(path: Path, config) -> tuple[int, int]:
    """(parameters of the config's model, layers), counted without building it: copies with one and two layers are
    built on the meta device (no memory) and the layers are alike, so a config with a million layers costs nothing
    (any family: total = P1 + (L - 1) (P2 - P1)). A config whose layer count cannot be changed (a per-layer list
    that does not follow it) is built whole on the meta device, up to MAX_META_LAYERS layers."""
    layers = getattr(config, "num_hidden_layers", None)
    if type(layers) is not int or layers < 1:
        raise CemtoolError(f"{path / 'config.json'}: num_hidden_layers={layers!r} is not a whole number >= 1")
    try:
        p1, p2 = (_meta_params(_with_layers(config, k)) for k in (1, 2))
        return p1 + (layers - 1) * (p2 - p1), layers
    except Exception:  # noqa: BLE001  (this family's config does not follow num_hidden_layers: build it whole)
        pass
    if layers > MAX_META_LAYERS:
        raise CemtoolError(f"{path / 'config.json'}: {layers:,} layers, and this family's size cannot be counted "
                           f"from fewer (at most {MAX_META_LAYERS:,} are built to count it)")
    try:
        return _meta_params(config), layers
    except Exception as e:  # noqa: BLE001  (a config transformers cannot build: one line, whatever it raises)
        raise CemtoolError(f"{path / 'config.json'}: transformers cannot build this model "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


MAX_META_LAYERS = 4096


def _with_layers(config, k: int):
    """A copy of ``config`` with k layers (and its per-layer type list, where it has one, cut to k)."""
    c = copy.deepcopy(config)
    c.num_hidden_layers = k
    types = getattr(c, "layer_types", None)
    if isinstance(types, list) and len(types) >= k:
        c.layer_types = types[:k]
    return c


def _meta_params(config) -> int:
    with torch.device("meta"):
        m = _transformers().AutoModelForCausalLM.from_config(config, **EAGER,
                                                             trust_remote_code=False)
    return sum(t.numel() for t in m.parameters())


def check_size(spec: str, path: Path, config, found: dict[str, TensorInfo]) -> int:
    """Refuse, before anything is built, a model whose weights cannot fit in memory (cemtool.memory's estimate:
    4 bytes per parameter), and one with more than twice the parameters the weight files hold (a config with a
    million layers for weights of two: tensors are missing, and building it would take minutes; a smaller
    shortfall is named tensor by tensor once loaded, :func:`check_loading`). Returns the parameter count."""
    params, layers = config_params(path, config)
    check_weights_memory(params, f"{spec} ({layers:,} layers)", "cpu")
    held = sum(t.numel for t in found.values())
    if params > 2 * held:
        raise CemtoolError(f"{spec}: the weights do not fit the model of its config.json ({layers:,} layers, "
                           f"{params:,} parameters): the weight files hold {held:,} parameters, tensors are missing",
                           hint=MISMATCH_HINT)
    return params


MISMATCH_HINT = ("cemtool loads complete weights only (nothing is initialised afresh): save them with save_pretrained "
                 "from the model this config describes")


def check_loading(spec: str, info: dict) -> None:
    """Refuse weights that transformers had to complete or drop (its loading report): missing tensors would be
    freshly initialised, unexpected ones ignored, mis-shaped ones replaced."""
    def shown(item) -> str:  # a name, or (name, shape in the file, shape of the model)
        if isinstance(item, (tuple, list)) and len(item) == 3:
            return f"{item[0]} {list(item[1])} for {list(item[2])}"
        return str(item)

    def some(items) -> str:
        items = sorted(shown(i) for i in items)
        return ", ".join(items[:5]) + (", ..." if len(items) > 5 else "")

    parts = [f"{len(info[k]):,} {what} ({some(info[k])})" for k, what in
             (("missing_keys", "missing"), ("unexpected_keys", "unexpected"), ("mismatched_keys", "of another shape"))
             if info.get(k)]
    if parts:
        raise CemtoolError(f"{spec}: the weights do not fit the model of its config.json: tensors {'; '.join(parts)}",
                           hint=MISMATCH_HINT)


# --------------------------------------------------------------------------------------------------------------
# the model


def read_config(path: Path):
    """transformers' config of the directory, refusing unknown types and models that are not causal LMs."""
    transformers = _transformers()
    raw = read_json(path / "config.json", "model config")
    mt = raw.get("model_type")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise CemtoolError(f"{path}: unknown model type {mt!r} ({str(e).splitlines()[0][:100]})",
                           hint="the transformers installed here cannot build it; update transformers or pass "
                                "a supported model") from None
    # optional dependency: transformers (importable here: _transformers() above succeeded)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_MASKED_LM_MAPPING

    encoder = type(config) in MODEL_FOR_MASKED_LM_MAPPING and not getattr(config, "is_decoder", False)
    if getattr(config, "is_encoder_decoder", False) or encoder or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        kind = "an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else \
            "an encoder-only (bidirectional)" if encoder else "not a causal"
        raise CemtoolError(f"{path}: model type {mt!r} is {kind} language model; cemtool analyses next-token "
                           f"(causal) language models", hint="pass a decoder-only model (GPT-2, Pythia, Llama, ...)")
    return config


def load_hf_model(path: Path, config, spec: str | None = None):
    """AutoModelForCausalLM from safetensors, float32, eager attention, eval mode; refused unless every tensor it
    expects was in the files with its shape, and nothing else (:func:`check_loading`)."""
    transformers = _transformers()
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # its load report is ours to give, in one line
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), config=config, use_safetensors=True, local_files_only=True, **EAGER,
            trust_remote_code=False, ignore_mismatched_sizes=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise CemtoolError(f"{path}: transformers could not load the model ({str(e).splitlines()[0][:160]})") from None
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    check_loading(spec or str(path), info)
    return model.float().eval()


def load_hf_tokenizer(path: Path, kind: str = "hf"):
    """The model's own tokenizer as a cemtool Tokenizer (kind 'hf'; an exported run's tokenizer.json keeps the
    run's kind)."""
    if (path / "tokenizer.json").is_file():
        return Tokenizer(Fast.from_file(str(path / "tokenizer.json")), kind)
    transformers = _transformers()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True,
                                                         trust_remote_code=False)
    except Exception as e:  # missing or unreadable tokenizer files
        raise CemtoolError(f"{path}: no usable tokenizer ({str(e).splitlines()[0][:120]})",
                           hint="save it beside the model: tokenizer.save_pretrained(dir)") from None
    if not hasattr(tok, "backend_tokenizer"):
        raise CemtoolError(f"{path}: the tokenizer has no fast (tokenizers) form")
    return Tokenizer(tok.backend_tokenizer, "hf")


def model_tokenizer(path: Path, record: dict | None, source: str, vocab_size: int):
    """The model's own tokenizer; for pretokenised data (``.bin``/``.npy``), the ids alone when the directory has
    no usable tokenizer (the ids need none)."""
    if not any(next(path.glob(pattern), None) for pattern in TOKENIZER_FILES):
        if is_token_source(source):
            return id_tokenizer(vocab_size)
        raise CemtoolError(f"{path} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...), so text cannot "
                           f"be read for it", hint="pass pretokenised ids (--data file.npy or .bin), or save the "
                                                   "tokenizer beside the model: tokenizer.save_pretrained(dir)")
    return load_hf_tokenizer(path, record.get("tokenizer_kind", "hf") if record else "hf")


def logits_check(model, sequences: int = 2, tokens: int = 16, seed: int = 0) -> dict:
    """The adapter's logits (every hook point captured) against the plain transformers forward (no hooks; the
    model's default attention kernel where this transformers can switch to it) on random token sequences."""
    hf = model.hf
    T = min(tokens, model.max_seq_len)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, int(hf.config.vocab_size), (sequences, T), generator=g)  # (S, T)
    with torch.no_grad(), capture(model, None):
        ours = model(idx).float()  # (S, T, V)
    # the adapter's hooks stay installed: with no point captured they return None and change nothing
    reference = "eager"
    switch = getattr(hf, "set_attn_implementation", None)
    try:
        if switch is not None:
            try:
                switch("sdpa")
                reference = "sdpa"
            except (ValueError, ImportError, AttributeError):
                reference = "eager"
        with torch.no_grad():
            plain = hf(input_ids=idx, use_cache=False).logits.float()
    finally:
        if reference != "eager":
            switch("eager")
    diff = float((ours - plain).abs().max())
    scale = max(1.0, float(plain.abs().max()))
    return {"sequences": sequences, "tokens": T, "max_abs_diff": diff, "scale": scale, "tolerance": TOLERANCE,
            "reference": f"transformers {_transformers().__version__} AutoModelForCausalLM forward "
                         f"({reference} attention, no hooks)", "passed": diff <= TOLERANCE * scale}


def causality_check(model, tokens: int = 9, seed: int = 1) -> dict:
    """What cemtool's next-token losses assume of a model, measured on its own forward: (1) changing the last token
    changes no earlier logit (causal), and (2) the logits of a prefix are those of the longer sequence (a window's
    losses do not depend on its length). A bidirectional model, or a tiny config whose positional code is
    inconsistent, fails one of them."""
    T = min(tokens, model.max_seq_len)
    V = int(model.cfg.vocab_size)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, V, (2, T), generator=g)  # (2, T)
    other = idx.clone()
    other[:, -1] = (idx[:, -1] + 1 + torch.randint(0, V - 1, (2,), generator=g)) % V  # another last token
    with torch.no_grad():
        full, changed, prefix = model(idx).float(), model(other).float(), model(idx[:, :-1]).float()
    scale = max(1.0, float(full.abs().max()))
    future = float((full[:, :-1] - changed[:, :-1]).abs().max())
    length = float((full[:, :-1] - prefix).abs().max())
    return {"tokens": T, "future_token_effect": future, "prefix_effect": length, "scale": scale,
            "tolerance": TOLERANCE, "passed": max(future, length) <= TOLERANCE * scale}


def register_arch(config: dict, refused: str | None = None) -> str:
    """Register the architecture of a transformers config with cemtool's registry (so that ``build_model`` and the
    training loop, e.g. a forgetting fine-tune, build it, with fresh weights) under ``hf-<model_type>-<hash>``."""
    body = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}
    arch = f"hf-{config['model_type']}-{hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:6]}"
    _CONFIGS[arch] = body
    if refused:
        _REFUSED[arch] = refused
    register(arch, "foreign", build_foreign, description=f"transformers {config['model_type']} (cemtool.subject.hf)")
    return arch


def register_saved(run_path: Path) -> None:
    """Register the architecture of a run made from a foreign model (a fine-tune), from its model_source.json."""
    src = read_json(Path(run_path) / SOURCE_FILE, "model description")
    register_arch(src["config"], src.get("tier_b_refused") if isinstance(src.get("tier_b_refused"), str) else None)


def build_foreign(cfg):
    """A registered foreign architecture with fresh weights: cemtool.models.registry's builder (ModelConfig ->
    module)."""
    transformers = _transformers()

    if cfg.heads or cfg.head_dims:  # e.g. saturation's allocation advice: its train command could not build it
        raise CemtoolError(f"per-layer allocation (model.heads, model.head_dims) does not apply to {cfg.arch}: a "
                           f"transformers architecture has one head count and size for every layer",
                           hint="allocation advice needs a cemtool architecture")
    body = dict(_CONFIGS[cfg.arch])
    config = transformers.AutoConfig.for_model(body.pop("model_type"), **body)
    hf = transformers.AutoModelForCausalLM.from_config(config, **EAGER,
                                                       trust_remote_code=False).float().eval()
    fam, why = family_of(config)
    if cfg.arch in _REFUSED:  # its mapping failed a load check when the source model was loaded
        fam, why = None, _REFUSED[cfg.arch]
    return ForeignLM(hf, fam, arch=cfg.arch) if fam is not None else LogitsLM(hf, arch=cfg.arch, why=why)


ADDED = "added by cemtool export (zero; the run has no such parameters)"


def mark_added(model, names: list, spec: str) -> None:
    """Record the tensors ``cemtool export`` added (GPT-2's zero projection biases) in ``model.fixed`` (the reason):
    curvature analyses leave fixed parameters out (cemtool.analysis.curvature.risk.select_parameters), so an exported
    run's Hessian, λ_max included, is the run's."""
    own = dict(model.hf.named_parameters())
    for name in names:
        if not isinstance(name, str) or name not in own:
            raise CemtoolError(f"{spec}: {EXPORT_FILE} lists an added parameter {str(name)[:100]!r} the model "
                               f"does not have", hint="export the run again")
        model.fixed[name] = ADDED


def read_export(path: Path) -> dict | None:
    """The record ``cemtool export`` writes beside the model (:data:`EXPORT_FILE`), None for other models."""
    f = path / EXPORT_FILE
    if not f.is_file():
        return None
    rec = read_json(f, "export record")
    if not isinstance(rec, dict) or not isinstance(rec.get("data"), dict) or \
            not isinstance(rec.get("tokenizer_kind", "hf"), str):
        raise CemtoolError(f"{f} is not an export record (a JSON object with a 'data' section)",
                           hint="export the run again, or remove the file to analyse the model as any other")
    return rec


def eval_data(record: dict | None, data: str | None, seq_len: int | None, max_seq_len: int):
    """The evaluation data: ``data`` (default pydoc, or an exported run's own data section, with its source
    replaced by ``data`` where given) in windows of at most the model's context."""
    if record is None:
        base = DataConfig(source=data or "pydoc")
    else:
        base = from_dict(DataConfig, record["data"], "data.")
        if data is not None:
            base = replace(base, source=data)
    return replace(base, seq_len=min(seq_len or base.seq_len, max_seq_len))


def load_foreign(source: str | Path, *, device: Any = "cpu", data: str | None = None, seq_len: int | None = None,
                 checkpoint: str | int = "final"):
    """A :class:`~cemtool.subject.base.Subject` for a local HF directory or an hf: id: the wrapped model (eval mode), a
    RunConfig whose data section is ``data`` (default ``pydoc``, or the run's own for a ``cemtool export``
    directory: :func:`eval_data`) read with the model's tokenizer, the tokenizer,
    and a Run where reports go (the directory itself; ``runs/hf/ORG--NAME[@REV]`` for an hf: id, and
    ``runs/hf/ORG--NAME@COMMIT`` for a snapshot folder of the hub's cache given as a directory)."""

    spec = str(source)
    if checkpoint not in ("final", "latest"):
        raise CemtoolError(f"--checkpoint {checkpoint} applies to cemtool runs; {spec} is one set of weights",
                           hint="pick another revision with hf:ORG/NAME@REVISION")
    _transformers()
    if spec.startswith("hf:"):
        path, where = hub_snapshot(spec)
        home = Path("runs") / "hf" / re.sub(r"[^A-Za-z0-9_.@-]+", "--", spec[len("hf:"):])
        check_links(path, cache_repo=path.parents[1])  # <cache>/models--ORG--NAME/snapshots/<commit>
    else:
        path = Path(spec)
        real = path.resolve()  # (".", a relative path or a link to a snapshot: where it really is)
        where = {"kind": "hf-dir", "path": str(real)}
        if not path.is_dir():
            raise CemtoolError(f"{spec} is neither a cemtool run, a Hugging Face model directory nor an hf: id")
        in_cache = real.parent.name == "snapshots" and real.parents[1].name.startswith("models--")
        check_links(path, cache_repo=real.parents[1] if in_cache else None)  # a snapshot passed as a directory
        # a snapshot of the hub's cache is the hub's, not the user's: its reports go where hf:ORG/NAME@COMMIT's go
        home = Path("runs") / "hf" / f"{real.parents[1].name[len('models--'):]}@{real.name}" if in_cache \
            else path
    refuse_remote_code(path)
    weights = check_files(path)
    config = read_config(path)
    fam, refused = family_of(config)  # None: tier a, through the logits alone (logits_only.py)
    found = read_headers(weights)
    check_size(spec, path, config, found)
    record = read_export(path)
    hf = load_hf_model(path, config, spec)
    arch = register_arch(config.to_dict())
    model = ForeignLM(hf, fam, arch=arch) if fam is not None else LogitsLM(hf, arch=arch, why=refused)
    mark_added(model, (record or {}).get("added_parameters") or [], spec)
    causal = causality_check(model)
    if not causal["passed"]:
        what = "a later token changes earlier logits" if causal["future_token_effect"] > TOLERANCE * causal["scale"] \
            else "a prefix's logits differ from the longer sequence's"
        by = max(causal["future_token_effect"], causal["prefix_effect"])
        raise CemtoolError(f"{spec}: model type {config.model_type!r} is not a causal language model as cemtool "
                           f"measures one: {what} (by {by:.3g})",
                           hint="cemtool analyses next-token (causal) language models")
    check = logits_check(model) if fam is not None else None
    algebra = hook_algebra_check(model, fam) if fam is not None and check["passed"] else None
    if check is not None and not check["passed"]:  # the hooks change the computation: no mapping is trusted
        refused = (f"the {fam.name} adapter's logits differ from transformers' by {check['max_abs_diff']:.3g} "
                   f"(tolerance {TOLERANCE:g} x {check['scale']:.3g}); please report it with the config.json")
    elif algebra is not None and not algebra["passed"]:  # a structure the family does not declare
        broken = ", ".join(f"{k} off by {algebra[k]:.3g}" for k in ALGEBRA_KEYS if algebra[k] > algebra["tolerance"])
        refused = f"the {fam.name} adapter's hook points break the block's algebra ({broken})"
    failed = None  # the adapter's checks, where they refused its mapping
    if fam is not None and refused is not None:  # tier a: transformers' own forward, nothing remapped
        model, fam = LogitsLM(hf, arch=arch, why=refused), None
        _REFUSED[arch] = refused
        failed, check, algebra = {"logits_check": check, "hook_algebra_check": algebra}, None, None
        mark_added(model, (record or {}).get("added_parameters") or [], spec)
    elif fam is not None:
        _REFUSED.pop(arch, None)  # this model's mapping passed: a fine-tune of it rebuilds in tier b
    if check is None:
        check = {"passed": True, "reference": "none needed: tier a runs transformers' own forward, nothing is "
                                              "remapped"}
    model.to(torch.device(device) if not isinstance(device, torch.device) else device)
    cfg = RunConfig(model=model.cfg, data=eval_data(record, data, seq_len, model.max_seq_len))
    tok = model_tokenizer(path, record, cfg.data.source, model.cfg.vocab_size)
    described = {"source": spec, **where, "arch": arch, "model_type": config.model_type,
                 "architectures": list(getattr(config, "architectures", None) or []),
                 "weights": [w.name for w in weights], "transformers": _transformers().__version__,
                 "dtype": "float32", **EAGER, "model": model.describe(),
                 "tokenizer": "token ids alone (the data is pretokenised; the directory has no tokenizer)"
                 if tok.kind == "ids" else "the model's own",
                 "logits_check": check, "causality_check": causal, "hook_algebra_check": algebra,
                 "config": config.to_dict(),
                 "exported_from": record, "tier": "b" if fam is not None else "a", "tier_b_refused": refused,
                 "tier_b_checks": failed,
                 "data": to_dict(cfg.data)}  # the evaluation data (--data): every report's provenance names it
    run = Run(home)
    atomic_write_json(run.path / SOURCE_FILE, described)
    return Subject(model, cfg, tok, run, weights[0], None)
