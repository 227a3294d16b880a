"""Models cemtool did not train (cemtool.subject.hf): tiny random-weight transformers models of every supported family,
built here from transformers configs (no download) and saved with save_pretrained, analysed by every command."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.data.corpus import load_corpus, windows
from cemtool.data.tokenizer import byte_tokenizer, word_tokenizer
from cemtool.errors import CemtoolError
from cemtool.models.capture import capture
from cemtool.models.lm import lm_loss
from cemtool.subject import open_subject

FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2")
WORDS = [f"w{i}" for i in range(8)]


def tiny_config(family: str, vocab: int = 256, d: int = 16, layers: int = 2):
    ids = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=d, n_layer=layers, n_head=2, n_positions=16, **ids)
    if family == "gpt_neox":  # partial rotary as in Pythia
        return transformers.GPTNeoXConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=2,
                                          intermediate_size=2 * d, max_position_embeddings=16, rotary_pct=0.5, **ids)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
           "qwen2": transformers.Qwen2Config}[family]
    kv = {"llama": 2, "mistral": 1, "qwen2": 2}[family]  # GQA and MQA
    return cls(hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv,
               intermediate_size=2 * d, max_position_embeddings=16, **ids)


def save_tiny(path, config, tokenizer, seed: int = 0) -> str:
    """A random-weight causal LM and its tokenizer, written as save_pretrained writes them."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger weights than the default init, so that attention is far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, str]:
    """One tiny model directory per family (byte tokenizer, d_model 16, 2 layers); treat as read-only."""
    root = tmp_path_factory.mktemp("hf")
    return {f: save_tiny(root / f, tiny_config(f), byte_tokenizer()) for f in FAMILIES}


@pytest.fixture(scope="session")
def word_text(tmp_path_factory) -> str:
    g = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("words") / "words.txt"
    p.write_text("\n".join(" ".join(g.choice(WORDS, 16)) for _ in range(400)) + "\n", encoding="utf-8")
    return str(p)


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(res, *words: str) -> None:
    assert res.exit_code != 0
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[0].startswith("Error: ") and all(ln.startswith(("Error: ", "Hint: ")) for ln in lines), res.output
    assert len(lines) <= 2 and all(w.lower() in res.output.lower() for w in words), res.output


# --------------------------------------------------------------------------------------------------------------
# every analysis on every family


@pytest.mark.parametrize("family", FAMILIES)
def test_every_analysis_runs_on_every_family(hf_models, text_file, word_text, family):
    d = hf_models[family]
    res = invoke("sharpness", d, "--data", text_file, "--tokens", 64, "--top-k", 1, "--bottom-k", 0,
                 "--lanczos-steps", 2, "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0,
                 "--avg-rho", 0, "--landscape", "none", "--params", "layer:1,embed", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    res = invoke("collapse-report", d, "--data", text_file, "--tokens", 128, "--folds", 2, "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    res = invoke("saturation", d, "--data", text_file, "--tokens", 64, "--ranks", "0,2", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    ft = Path(d).parent / f"{family}-ft"
    res = invoke("forgetting", d, "--data", text_file, "--to", word_text, "--out", ft, "--steps", 2, "--eval-every", 2,
                 "--eval-tokens", 64, "--quiet")
    assert res.exit_code == 0, res.output
    reports = {n: json.loads((Path(d) / "reports" / f"{n}.json").read_text())
               for n in ("sharpness-layer-1-embed", "collapse", "saturation")}
    forgot = json.loads((ft / "reports" / "forgetting.json").read_text())
    assert forgot["source"]["data"] == text_file and [c["step"] for c in forgot["curve"]] == [0, 2]
    src = open_subject(d, data=text_file)  # step 0 is the source model on the source data's validation windows
    corpus = load_corpus(src.config.data, tokenizer=src.tokenizer)
    x, y = windows(corpus.val, corpus.eval_windows(16, 64), 16)  # data.seq_len = max_position_embeddings
    with torch.no_grad():
        assert forgot["before"]["source_loss"] == pytest.approx(float(lm_loss(src.model(x), y)), rel=1e-5)
    assert open_subject(ft).config.model.arch == forgot["source"]["arch"]  # the fine-tune reloads (its own process too)
    for rep in reports.values():
        src = rep["provenance"]["model_source"]
        assert src["logits_check"]["passed"] and src["logits_check"]["max_abs_diff"] <= 1e-5
        assert src["attn_implementation"] == "eager" and src["weights"] == ["model.safetensors"]
    sat = reports["saturation"]["saturation"]
    assert [e["layer"] for e in sat["layers"]] == [0, 1] and all(e["rope"] == (family != "gpt2") for e in sat["layers"])
    layers = reports["collapse"]["runs"][0]["collapse"]["layers"]
    kv = {"gpt2": 2, "gpt_neox": 2, "llama": 2, "mistral": 1, "qwen2": 2}[family]
    assert all(e["values"]["heads"] == kv for e in layers)  # values per key-value head
    assert all(len(e["attention"]["per_head"]) == (2 if family in ("gpt2", "gpt_neox") else 4) for e in layers)
    for e in layers:  # GQA/MQA: statistics per key-value head, the mean over the query heads that read it
        att = e["attention"]
        assert ("per_kv_head" in att) == (kv < len(att["per_head"]))
        for g in att.get("per_kv_head", []):
            mine = [r for r in att["per_head"] if r["kv_head"] == g["kv_head"]]
            assert [r["head"] for r in mine] == g["query_heads"] and len(mine) == 4 // kv
            assert g["entropy"] == pytest.approx(np.mean([r["entropy"] for r in mine]), rel=1e-12)


def test_parameter_subsets_by_cemtool_and_by_the_models_own_names(hf_models):
    from cemtool.analysis.curvature.risk import select_parameters

    model = open_subject(hf_models["llama"]).model
    names = lambda spec: [n for n, _ in select_parameters(model, spec)]  # noqa: E731
    assert names("layer:1") and all(n.startswith("blocks.1.layer.") for n in names("layer:1"))
    attn = set(names("attn"))  # cemtool's word rule: self_attn.* and post_attention_layernorm (the word attention)
    assert {n for n, _ in model.named_parameters() if ".self_attn." in n} <= attn
    assert not any(".mlp." in n for n in attn)
    assert set(names("mlp")) == {n for n, _ in model.named_parameters() if ".mlp." in n}
    assert names("embed") == ["tok_emb.weight", "head.weight"]  # embed_tokens and lm_head (untied)
    assert names("*.q_proj.weight") == ["blocks.0.layer.self_attn.q_proj.weight",
                                        "blocks.1.layer.self_attn.q_proj.weight"]
    assert names("model.layers.1.mlp.*") == [n for n in names("mlp") if n.startswith("blocks.1.")]  # its own names
    assert names("lm_head.weight") == ["head.weight"]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in model.hf.parameters())


# --------------------------------------------------------------------------------------------------------------
# against ground truth


def dense_hessian(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Exact Hessian of the mean token loss over all parameters (float64), by autograd on a float64 copy."""
    from torch.func import functional_call

    work = __import__("copy").deepcopy(model).double().eval()
    named = dict(work.named_parameters())
    sizes = [p.numel() for p in named.values()]

    def f(w: torch.Tensor) -> torch.Tensor:
        ps = {n: t.view(p.shape) for (n, p), t in zip(named.items(), torch.split(w, sizes), strict=True)}
        return lm_loss(functional_call(work, ps, (x,)), y)

    w0 = torch.cat([p.detach().reshape(-1) for p in named.values()])
    H = torch.autograd.functional.hessian(f, w0, vectorize=True)
    return (H + H.T) / 2


def test_sharpness_of_a_tiny_llama_matches_its_dense_hessian(tmp_path, word_text):

    cfg = transformers.LlamaConfig(hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                   intermediate_size=2, max_position_embeddings=16, vocab_size=len(WORDS),
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    d = save_tiny(tmp_path / "llama", cfg, word_tokenizer(WORDS))
    loaded = open_subject(d, data=word_text)
    n = sum(p.numel() for p in loaded.model.parameters())
    assert n <= 3000
    x, y = loaded.eval_set(32)  # 2 windows of 16 tokens
    ev = torch.linalg.eigvalsh(dense_hessian(loaded.model, x, y)).numpy()
    res = invoke("sharpness", d, "--data", word_text, "--tokens", 32, "--dtype", "fp64", "--top-k", 3,
                 "--bottom-k", 1, "--lanczos-steps", n, "--tol", 1e-10, "--trace-method", "hutch++",
                 "--trace-hvps", 3 * n, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0, "--avg-rho", 0,
                 "--landscape", "none", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "llama" / "reports" / "sharpness.json").read_text())
    assert rep["tokens"] == y.numel()
    np.testing.assert_allclose(rep["eigen"]["top"], ev[::-1][:3], rtol=1e-5)
    np.testing.assert_allclose(rep["eigen"]["bottom"], ev[:1], rtol=1e-5)
    np.testing.assert_allclose(rep["traces"][0]["trace"], ev.sum(), rtol=1e-5)  # sketch of rank n: exact


# transformers' Llama computes RMSNorm, softmax and rotary in float32 inside a float64 model (its error bounds say
# so: test_fp64_bounds_use_the_precision_the_forward_computes_in); GPT-2 computes in float64
HF_TOLERANCE = {"gpt2": 1e-8, "llama": 1e-5}


@pytest.mark.parametrize("operator", ["ggn", "ef", "fisher"])
@pytest.mark.parametrize("family", list(HF_TOLERANCE))
def test_every_operator_of_a_tiny_hf_model_matches_its_dense_matrix(tmp_path, word_text, family, operator):
    """The GGN and the Fishers of a Hugging Face model (no cemtool layer inside) against dense matrices from
    torch.func Jacobians of its logits: top-3 and bottom eigenvalues and the trace, PSD."""
    from cemtool.analysis.curvature.operators import make_operator
    from cemtool.analysis.lanczos import lanczos
    from cemtool.analysis.trace import hutch_plus_plus

    from kit import dense_curvature, own_options

    ids = dict(vocab_size=len(WORDS), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg = transformers.GPT2Config(n_embd=2, n_layer=1, n_head=1, n_positions=16, **ids) if family == "gpt2" else \
        transformers.LlamaConfig(hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                                 intermediate_size=2, max_position_embeddings=16, tie_word_embeddings=True, **ids)
    loaded = open_subject(save_tiny(tmp_path / family, cfg, word_tokenizer(WORDS)), data=word_text)
    x, y = loaded.eval_set(32)  # 2 windows of 16 tokens
    with make_operator(operator, loaded.model, x, y, dtype="fp64",
                       **own_options(operator, mc_samples=2, seed=3)) as op:
        assert op.n <= 3000
        A = dense_curvature(operator, loaded.model, x, y, labels=torch.cat(op.labels) if operator == "fisher" else None)
        eig = lanczos(op, 3, 1, max_steps=op.n, tol=1e-10)
        tr = hutch_plus_plus(op, 3 * op.n)  # a sketch of rank n: exact
    ev = torch.linalg.eigvalsh(A)
    rel, scale = HF_TOLERANCE[family], float(ev.abs().max())
    assert eig.top == pytest.approx(ev.flip(0)[:3].tolist(), rel=rel)
    assert eig.bottom[0] == pytest.approx(float(ev[0]), abs=rel * scale)
    assert tr.trace == pytest.approx(float(torch.trace(A)), rel=rel)
    assert float(ev[0]) >= -1e-10 * scale


def test_collapse_of_a_tiny_llama_equals_values_taken_from_v_proj(hf_models):
    """Value entropy, effective rank and cosine per layer from the adapter equal those computed by hand from what
    transformers' own v_proj modules output (forward hooks on them, no cemtool hook point involved)."""
    from cemtool.analysis.collapse import collapse_report

    model = open_subject(hf_models["llama"]).model
    x = torch.randint(0, 256, (6, 16), generator=torch.Generator().manual_seed(1))
    rep = collapse_report(model, x, alpha=0.5, batch_size=4)
    seen: dict[int, list] = {0: [], 1: []}
    handles = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o, k=k: seen[k].append(o.detach()))
               for k, layer in enumerate(model.hf.model.layers)]
    with torch.no_grad():
        model.hf(input_ids=x)
    for h in handles:
        h.remove()

    def renyi(eigs: np.ndarray, alpha: float = 0.5) -> float:
        eigs = np.clip(eigs, 0, None)
        eigs = np.where(eigs > len(eigs) * np.finfo(float).eps * eigs.max(), eigs, 0.0)
        p = eigs / eigs.sum()
        return float(np.log((p[p > 0] ** alpha).sum()) / (1 - alpha))

    for i, e in enumerate(rep["layers"]):
        V = seen[i][0].double().numpy()  # (n, T, kv_heads * d_h)
        flat = V.reshape(-1, V.shape[-1])
        Z = (V - flat.mean(0)) / flat.std(0)  # z-scored over every token
        ent = [renyi(np.linalg.eigvalsh(z @ z.T)) for z in Z]
        s = np.sqrt(np.clip(np.linalg.eigvalsh(flat.T @ flat), 0, None))
        p = s / s.sum()
        erank = float(np.exp(-(p[p > 0] * np.log(p[p > 0])).sum()))
        U = V / np.linalg.norm(V, axis=-1, keepdims=True)
        cos = [(u @ u.T)[~np.eye(len(u), dtype=bool)].mean() for u in U]
        head0 = [renyi(np.linalg.eigvalsh(z[:, :4] @ z[:, :4].T)) for z in Z]
        got = e["values"]
        assert got["dim"] == V.shape[-1] == 8 and got["heads"] == 2
        assert got["entropy"]["mean"] == pytest.approx(np.mean(ent), rel=1e-6)
        assert got["erank_all"] == pytest.approx(erank, rel=1e-6)
        assert got["cosine"]["mean"] == pytest.approx(np.mean(cos), rel=1e-6)
        assert got["entropy_per_head"][0]["mean"] == pytest.approx(np.mean(head0), rel=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_query_and_key_weights_reproduce_the_hook_points(hf_models, family):
    """What rank truncation reads (attn.wq/wk .weight, bias as the last column, key-value heads repeated per query
    head) maps the attention's input to exactly the q and k at the hook points."""
    model = open_subject(hf_models[family]).model
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    inputs = []
    attn_mod = {"gpt2": lambda b: b.layer.attn, "gpt_neox": lambda b: b.layer.attention}.get(
        family, lambda b: b.layer.self_attn)(model.blocks[1])
    h = attn_mod.register_forward_pre_hook(lambda m, a, k: inputs.append(a[0] if a else k["hidden_states"]),
                                           with_kwargs=True)
    with torch.no_grad(), capture(model, ["blocks.1.attn.q", "blocks.1.attn.k"]) as cache:
        model(x)
    h.remove()
    attn = model.blocks[1].attn
    u = inputs[0]  # (B, T, d)
    u1 = torch.cat([u, torch.ones_like(u[..., :1])], -1)  # (B, T, d+1)
    for name, w, heads in (("q", attn.wq.weight, attn.n_head), ("k", attn.wk.weight, attn.n_head)):
        ext = u1 if w.shape[1] == u.shape[-1] + 1 else u
        got = (ext @ w.detach().T).view(2, 12, heads, -1).transpose(1, 2)  # (B, H, T, d_h)
        want = cache[f"blocks.1.attn.{name}"]
        if name == "k":
            want = want.repeat_interleave(attn.n_head // want.shape[1], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_truncation_at_the_hook_point_changes_the_model_and_full_rank_does_not(hf_models, text_file):
    from cemtool.analysis.saturation import mean_loss, truncated

    model = open_subject(hf_models["gpt_neox"]).model
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    y = torch.roll(x, -1, 1)
    base = mean_loss(model, x, y)
    eye = torch.eye(8, dtype=torch.float64).expand(2, 8, 8)
    with truncated(model, {0: eye}):
        assert mean_loss(model, x, y) == pytest.approx(base, abs=1e-6)
    with truncated(model, {0: torch.zeros(2, 8, 8, dtype=torch.float64)}):  # rank 0: uniform attention
        assert abs(mean_loss(model, x, y) - base) > 1e-4
    assert mean_loss(model, x, y) == base  # hooks removed


def test_rope_order_makes_partial_rotary_planes_p_and_p_plus_half():
    from cemtool.subject.hf.adapter import rope_order

    order = rope_order(8, 4).tolist()  # rotary pairs (0, 2), (1, 3); coordinates 4..7 do not rotate
    assert order == [0, 1, 4, 5, 2, 3, 6, 7]
    pairs = {(order[p], order[p + 4]) for p in range(4)}
    assert pairs == {(0, 2), (1, 3), (4, 6), (5, 7)}
    assert rope_order(8, 8).tolist() == list(range(8)) == rope_order(8, 0).tolist()


def test_hf_id_is_read_offline_from_the_huggingface_cache(hf_models, text_file, tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snap = cache / "models--acme--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(hf_models["llama"], snap, ignore=shutil.ignore_patterns("reports", "plots", "model_source.json"))
    (cache / "models--acme--tiny-llama" / "refs").mkdir()
    (cache / "models--acme--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    res = invoke("sharpness", "hf:acme/tiny-llama", "--data", text_file, "--tokens", 64, "--top-k", 1, "--bottom-k",
                 0, "--lanczos-steps", 3, "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0,
                 "--avg-rho", 0, "--landscape", "none", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "runs" / "hf" / "acme--tiny-llama" / "reports" / "sharpness.json").read_text())
    src = rep["provenance"]["model_source"]
    assert src["repo"] == "acme/tiny-llama" and src["commit"] == "a" * 40 and src["logits_check"]["passed"]


# --------------------------------------------------------------------------------------------------------------
# refused, each with one line, nothing written


class Planted:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_weights_are_refused_and_never_unpickled(tmp_path):
    d = tmp_path / "pickled"
    d.mkdir()
    tiny_config("llama").save_pretrained(d)
    marker = tmp_path / "EXECUTED"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Planted(str(marker))))
    before = sorted(p.name for p in d.iterdir())
    res = invoke("sharpness", d, "--quick", "--no-plots")
    one_line_error(res, "pickle", "never unpickles")
    assert not marker.exists()
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written


def test_unknown_model_type_and_an_encoder_are_refused(tmp_path):
    d = tmp_path / "unknown"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "no-such-model", "architectures": ["NoSuchForCausalLM"]}))
    (d / "model.safetensors").write_bytes(b"")
    one_line_error(invoke("collapse-report", d, "--no-plots"), "unknown model type")
    bert = tmp_path / "bert"
    cfg = transformers.BertConfig(vocab_size=256, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=64)
    transformers.BertForMaskedLM(cfg).save_pretrained(bert)
    one_line_error(invoke("sharpness", bert, "--quick", "--no-plots"), "encoder-only", "causal")
    assert not (bert / "reports").exists() and not (d / "reports").exists()


def test_hf_id_offline_without_cache_says_how_to_get_the_files(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    res = invoke("saturation", "hf:acme/not-cached@v1", "--no-plots")
    # huggingface_hub >= 1.0 installs `hf`, not `huggingface-cli`; the cause is given whole (no cut at 160 characters)
    one_line_error(res, "not in the Hugging Face cache", "`hf download acme/not-cached --revision v1`",
                   "outgoing traffic has been disabled. To enable repo look-ups and downloads online, set "
                   "'HF_HUB_OFFLINE=0' as environment variable.")
    assert not (tmp_path / "runs").exists()


def test_without_transformers_the_error_names_the_extra(hf_models, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    one_line_error(invoke("sharpness", hf_models["gpt2"], "--quick"), 'pip install -e ".[hf]"')


def test_token_ids_outside_the_models_vocabulary_are_refused(hf_models):
    model = open_subject(hf_models["gpt2"]).model
    with pytest.raises(CemtoolError, match="outside the model's vocabulary of 256"):
        model(torch.tensor([[1, 2, 256]]))
    with pytest.raises(CemtoolError, match="longer than"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_values_replaced_at_hook_points_change_the_model_as_the_same_change_inside_transformers(hf_models, family):
    """Zeroing blocks.0.attn.z (and doubling blocks.1.resid_pre) through hooks on cemtool's hook points gives the
    logits of the same edit made on the transformers modules themselves."""
    model = open_subject(hf_models[family]).model
    x = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        base = model(x)
        handles = [model.get_submodule("blocks.0.attn.z").register_forward_hook(lambda m, i, z: torch.zeros_like(z)),
                   model.get_submodule("blocks.1.resid_pre").register_forward_hook(lambda m, i, r: 2 * r)]
        ours = model(x)
        for h in handles:
            h.remove()
        layers = model.hf.model.layers if family == "llama" else model.hf.gpt_neox.layers
        out_proj = layers[0].self_attn.o_proj if family == "llama" else layers[0].attention.dense
        handles = [out_proj.register_forward_pre_hook(lambda m, a: (torch.zeros_like(a[0]),)),
                   layers[1].register_forward_pre_hook(lambda m, a: (2 * a[0], *a[1:]))]
        theirs = model.hf(input_ids=x).logits
        for h in handles:
            h.remove()
        assert torch.equal(model(x), base)  # nothing left behind
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------
# issue 20: nothing from the directory runs, no link leads out, the weights are complete, sizes are checked first


def copy_model(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("reports", "plots", "model_source.json"))
    return dst


QUICK = ("--tokens", 32, "--top-k", 1, "--bottom-k", 0, "--lanczos-steps", 2, "--trace-hvps", 0, "--density-runs", 0,
         "--sam-rho", 0, "--asam-rho", 0, "--avg-rho", 0, "--landscape", "none", "--no-plots", "--quiet")


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_a_directory_naming_its_own_code_is_refused_even_when_y_is_typed(hf_models, tmp_path, where):
    d = copy_model(hf_models["llama"], tmp_path / "custom")
    marker = tmp_path / "EXECUTED"
    code = f"open({str(marker)!r}, 'w').write('ran')\n"
    (d / "configuration_evil.py").write_text(code + "from transformers import LlamaConfig as EvilConfig\n")
    (d / "tokenization_evil.py").write_text(code + "from transformers import PreTrainedTokenizerFast as EvilTok\n")
    raw = json.loads((d / where).read_text())
    raw["auto_map"] = {"AutoConfig": "configuration_evil.EvilConfig"} if where == "config.json" else \
        {"AutoTokenizer": ["tokenization_evil.EvilTok", None]}
    (d / where).write_text(json.dumps(raw))
    res = CliRunner().invoke(app, ["sharpness", str(d), "--quick", "--no-plots"], input="y\ny\ny\n")
    one_line_error(res, "auto_map", "never runs code")
    assert not marker.exists()
    assert not (d / "reports").exists()


def test_every_transformers_call_refuses_remote_code(hf_models, monkeypatch):
    """Beyond the auto_map check: each call into transformers passes trust_remote_code=False."""
    seen = []
    for cls, name in ((transformers.AutoConfig, "from_pretrained"), (transformers.AutoTokenizer, "from_pretrained"),
                      (transformers.AutoModelForCausalLM, "from_pretrained"),
                      (transformers.AutoModelForCausalLM, "from_config")):
        orig = getattr(cls, name)

        def spy(*a, _orig=orig, _n=f"{cls.__name__}.{name}", **k):
            seen.append((_n, k.get("trust_remote_code")))
            return _orig(*a, **k)
        monkeypatch.setattr(cls, name, spy)
    d = hf_models["gpt2"]
    Path(d, "tokenizer.json").rename(Path(d, "tokenizer.json.off"))  # transformers' tokenizer path too
    try:
        with pytest.raises(CemtoolError, match="no usable tokenizer"):
            open_subject(d)
    finally:
        Path(d, "tokenizer.json.off").rename(Path(d, "tokenizer.json"))
    open_subject(d)
    assert {n for n, _ in seen} >= {"AutoConfig.from_pretrained", "AutoModelForCausalLM.from_pretrained",
                                    "AutoModelForCausalLM.from_config", "AutoTokenizer.from_pretrained"}
    assert all(v is False for _, v in seen), seen


@pytest.mark.parametrize("link", ["model.safetensors", "config.json", "directory"])
def test_links_out_of_a_model_directory_are_refused(hf_models, tmp_path, link):
    d = copy_model(hf_models["llama"], tmp_path / "real")
    outside = tmp_path / "outside"
    outside.mkdir()
    if link == "directory":
        target = tmp_path / "linked"
        target.symlink_to(d)
        d = target
    else:
        (outside / link).write_bytes((d / link).read_bytes())
        (d / link).unlink()
        (d / link).symlink_to(outside / link)
    one_line_error(invoke("sharpness", d, "--quick", "--no-plots"), "symbolic link", "follows no link")
    assert not (d / "reports").exists()


def test_a_weight_file_linked_to_etc_passwd_is_not_parsed(hf_models, tmp_path, monkeypatch):
    d = copy_model(hf_models["llama"], tmp_path / "passwd")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to("/etc/passwd")
    import cemtool.subject.hf.loader as loader

    opened = []
    monkeypatch.setattr(loader, "read_header", lambda p: opened.append(p))
    one_line_error(invoke("collapse-report", d, "--no-plots"), "symbolic link", "/etc/passwd")
    assert opened == []


def hub_cache(tmp_path: Path, src: str, name: str = "acme--tiny") -> tuple[Path, Path]:
    """A huggingface_hub cache holding ``src`` as the hub stores it: snapshot files are links into blobs/."""
    repo = tmp_path / "hub" / f"models--{name}"
    snap, blobs = repo / "snapshots" / ("b" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in Path(src).iterdir():
        if f.is_file() and f.name != "model_source.json":
            (blobs / f.name).write_bytes(f.read_bytes())
            (snap / f.name).symlink_to(Path("..", "..", "blobs", f.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    return tmp_path / "hub", snap


def offline_cache(monkeypatch, cache: Path, cwd: Path) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(cwd)


def test_hub_cache_links_into_its_blobs_load_and_a_link_out_of_the_cache_is_refused(hf_models, tmp_path, monkeypatch):
    cache, snap = hub_cache(tmp_path, hf_models["gpt2"])
    offline_cache(monkeypatch, cache, tmp_path)
    assert open_subject("hf:acme/tiny").model.describe()["layers"] == 2
    assert open_subject(snap).model.describe()["layers"] == 2  # the snapshot folder given as a directory
    outside = tmp_path / "elsewhere.json"
    outside.write_text((snap / "config.json").read_text())
    (snap / "config.json").unlink()
    (snap / "config.json").symlink_to(outside)
    one_line_error(invoke("sharpness", "hf:acme/tiny", "--quick", "--no-plots"), "symbolic link", "elsewhere.json")


def test_a_cache_snapshot_given_as_a_directory_gets_no_reports_written_into_it(hf_models, tmp_path, monkeypatch):
    """The hub's cache is not the user's folder: a snapshot passed by path reports where hf:ORG/NAME@COMMIT does
    (runs/hf/ORG--NAME@COMMIT under the current folder), and the snapshot's files stay exactly as they were."""
    cache, snap = hub_cache(tmp_path, hf_models["gpt2"])
    offline_cache(monkeypatch, cache, tmp_path)
    before = sorted(p.name for p in snap.iterdir())
    res = invoke("sharpness", snap, "--tokens", 64, "--top-k", 1, "--bottom-k", 0, "--lanczos-steps", 3,
                 "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0, "--avg-rho", 0,
                 "--landscape", "none", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in snap.iterdir()) == before  # no reports/, no model_source.json
    home = tmp_path / "runs" / "hf" / f"acme--tiny@{'b' * 40}"
    rep = json.loads((home / "reports" / "sharpness.json").read_text())
    assert (home / "model_source.json").is_file() and rep["eigen"]["top"]
    assert open_subject(snap).run.path.resolve() == home.resolve()
    link = tmp_path / "my-model"  # a link to the snapshot, and the snapshot as "." from inside it: the same
    link.symlink_to(snap, target_is_directory=True)
    assert open_subject(link).run.path.resolve() == home.resolve()
    monkeypatch.chdir(snap)  # ("runs/hf" is under the current folder, as for an hf: id: here, the snapshot)
    assert (Path.cwd() / open_subject(".").run.path).resolve() == (snap / "runs" / "hf" / home.name).resolve()


def edited_weights(src: str, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    d = copy_model(src, dst)
    t = load_file(d / "model.safetensors")
    edit(t)
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), ["1 missing", "model.layers.1.mlp.up_proj.weight"]),
    (lambda t: t.clear(), ["are missing", "the weight files hold 0"]),
    (lambda t: t.update({"model.embed_tokenz.weight": t.pop("model.embed_tokens.weight")}),
     ["missing (model.embed_tokens.weight)", "unexpected (model.embed_tokenz.weight)"]),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(31, 16)}),
     ["of another shape", "model.layers.0.mlp.up_proj.weight"]),
    (lambda t: t.update({"model.layers.0.extra": torch.zeros(3)}), ["1 unexpected (model.layers.0.extra)"]),
], ids=["one-missing", "all-missing", "renamed-embedding", "mis-shaped", "extra"])
def test_missing_unexpected_or_misshaped_weights_are_refused(hf_models, tmp_path, edit, words):
    d = edited_weights(hf_models["llama"], tmp_path / "edited", edit)
    one_line_error(invoke("sharpness", d, *QUICK), "do not fit", *words)
    assert not (d / "reports").exists() and not (d / "model_source.json").exists()


def test_more_layers_in_the_config_than_in_the_weights_or_fewer_are_refused(hf_models, tmp_path):
    d = copy_model(hf_models["llama"], tmp_path / "layers")
    raw = json.loads((d / "config.json").read_text())
    for layers, words in ((-1, ["num_hidden_layers=-1"]), (0, ["num_hidden_layers=0"]),
                          (1, ["9 unexpected", "model.layers.1."]), (3, ["9 missing", "model.layers.2."])):
        (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": layers}))
        one_line_error(invoke("sharpness", d, *QUICK), *words)


def test_a_config_of_a_million_layers_is_refused_at_once_with_its_size(hf_models, tmp_path, monkeypatch):
    import time

    import cemtool.memory

    d = copy_model(hf_models["llama"], tmp_path / "huge")
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": 1_000_000}))
    t = time.perf_counter()
    one_line_error(invoke("sharpness", d, *QUICK), "1,000,000 layers", "tensors are missing")
    monkeypatch.setattr(cemtool.memory, "available_memory", lambda device: 2 << 30)
    one_line_error(invoke("sharpness", d, *QUICK), "1,000,000 layers", "2,336,008,208 parameters", "8.70 GiB",
                   "2.00 GiB are available")
    assert time.perf_counter() - t < 30  # nothing of that size was built (building it takes minutes)


def safetensors_bytes(header: dict | bytes, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(raw) if length is None else length).to_bytes(8, "little") + raw + data


F32 = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
BAD_SAFETENSORS = {
    "pickle": (pickle.dumps({"a": 1}), "pickle"),
    "torch-save-zip": (b"PK\x03\x04" + b"\0" * 60, "pickle"),
    "too-short": (b"\x01\x00", "too short"),
    "header-past-the-end": (safetensors_bytes({"w": F32}, length=10_000), "longer than the file"),
    "oversized-header": (safetensors_bytes(b"{}", length=200_000_000_000), "exceeds the limit"),
    "not-json": (safetensors_bytes(b"{nope"), "not valid json"),
    "deeply-nested": (safetensors_bytes(b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
    "recursion": (safetensors_bytes(b"{" + b'"a":{' * 50_000 + b"}" * 50_001), "nested too deeply"),
    "unknown-dtype": (safetensors_bytes({"w": {**F32, "dtype": "F33"}}, b"\0" * 16), "unknown dtype"),
    "lying-shape": (safetensors_bytes({"w": {**F32, "shape": [4, 4]}}, b"\0" * 16), "needs 64 bytes"),
    "negative-shape": (safetensors_bytes({"w": {**F32, "shape": [-2, -2]}}, b"\0" * 16), "whole numbers"),
    "overlapping-offsets": (safetensors_bytes({"w": F32, "v": {**F32, "data_offsets": [8, 24]}}, b"\0" * 24),
                            "overlap"),
    "gap-in-offsets": (safetensors_bytes({"w": {**F32, "data_offsets": [8, 24]}}, b"\0" * 24), "gap"),
    "truncated": (safetensors_bytes({"w": F32}, b"\0" * 10), "truncated"),
    "trailing-bytes": (safetensors_bytes({"w": F32}, b"\0" * 20), "after the last tensor"),
    "metadata-not-strings": (safetensors_bytes({"__metadata__": {"a": 1}, "w": F32}, b"\0" * 16), "__metadata__"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAFETENSORS))
def test_a_bad_safetensors_file_is_one_line_naming_the_file(hf_models, tmp_path, case):
    blob, words = BAD_SAFETENSORS[case]
    d = copy_model(hf_models["gpt2"], tmp_path / case)
    (d / "model.safetensors").write_bytes(blob)
    one_line_error(invoke("sharpness", d, *QUICK), "model.safetensors", *words.split("|"))


def test_a_cemtool_checkpoint_shares_the_header_check(tiny_run, tmp_path):
    """runs.read_checkpoint reads a checkpoint only after the same layout check (here: offsets that overlap)."""
    from cemtool.checkpoints import read_checkpoint
    from cemtool.tensorfile import read_header

    src = Path(tiny_run) / "checkpoints" / "final.safetensors"
    tensors, _ = read_header(src)
    assert tensors and all(t.numel >= 1 for t in tensors.values())
    raw = src.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__" and header[k]["data_offsets"][0] > 0)
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin - 4, end - 4]
    bad = tmp_path / "final.safetensors"
    bad.write_bytes(safetensors_bytes(header, raw[8 + n:]))
    with pytest.raises(CemtoolError, match="corrupted or truncated.*overlap"):
        read_checkpoint(bad)


def test_token_ids_need_no_tokenizer(hf_models, tmp_path, text_file):
    d = copy_model(hf_models["gpt2"], tmp_path / "no-tokenizer")
    for f in d.glob("tokenizer*"):
        f.unlink()
    g = np.random.default_rng(0)
    ids, other = tmp_path / "ids.npy", tmp_path / "other.npy"
    np.save(ids, g.integers(0, 256, 3000).astype(np.uint16))
    np.save(other, g.integers(0, 64, 3000).astype(np.uint16))
    assert invoke("sharpness", d, "--data", ids, *QUICK).exit_code == 0
    res = invoke("saturation", d, "--data", ids, "--tokens", 64, "--ranks", "0,2", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    res = invoke("forgetting", d, "--data", ids, "--to", other, "--out", tmp_path / "ft", "--steps", 2,
                 "--eval-every", 2, "--eval-tokens", 64, "--quiet")
    assert res.exit_code == 0, res.output
    res = invoke("collapse-report", d, "--data", ids, "--tokens", 128, "--folds", 2, "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads((d / "reports" / "collapse.json").read_text())
    probe = rep["runs"][0]["collapse"]["layers"][0]["probe"]
    assert probe["values"] == "not applicable: the data are token ids without a tokenizer, so there are no words to " \
                              "probe"
    src = json.loads((d / "model_source.json").read_text())
    assert src["tokenizer"].startswith("token ids alone")
    one_line_error(invoke("sharpness", d, "--data", text_file, *QUICK), "no tokenizer files", "pretokenised ids")


def test_reports_record_the_evaluation_data_and_saturation_advice_is_not_applicable(hf_models, tmp_path, text_file):
    d = copy_model(hf_models["gpt_neox"], tmp_path / "neox")
    res = invoke("saturation", d, "--data", text_file, "--tokens", 64, "--ranks", "0,2", "--no-plots", "--quiet")
    assert res.exit_code == 0, res.output
    rep = json.loads((d / "reports" / "saturation.json").read_text())
    assert rep["provenance"]["model_source"]["data"]["source"] == text_file
    assert rep["advice"]["applicable"] is False and rep["advice"]["why"].startswith("not applicable: per-layer")
    assert not list((d / "reports").glob("*advice.toml"))  # no train command that cannot work
    assert invoke("sharpness", d, *QUICK).exit_code == 0  # default data: pydoc
    rep = json.loads((d / "reports" / "sharpness.json").read_text())
    assert rep["provenance"]["model_source"]["data"]["source"] == "pydoc" and rep["notes"] == []
    res = invoke("sharpness", d, "--data", text_file, *QUICK[:-1])  # other data: the replacement is said
    assert res.exit_code == 0 and "replaced sharpness.json, which was measured on other data ('pydoc'" in res.output
    assert "replaced sharpness.json" in json.loads((d / "reports" / "sharpness.json").read_text())["notes"][0]
    res = invoke("saturation", d, "--tokens", 64, "--ranks", "0,2", "--no-plots")
    assert res.exit_code == 0 and f"which was measured on other data ({text_file!r}" in res.output, res.output


def test_fp64_bounds_use_the_precision_the_forward_computes_in(hf_models, tiny_run):
    """transformers' Llama keeps RMSNorm and softmax in float32 in a float64 model; GPT-2 and cemtool's own models
    compute in float64. The error bounds of an fp64 analysis follow what is computed."""
    import copy as copy_

    from cemtool.analysis.curvature.risk import forward_precision

    x = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    for source, want in ((hf_models["llama"], torch.float32), (hf_models["gpt2"], torch.float64),
                         (tiny_run, torch.float64)):
        model = copy_.deepcopy(open_subject(source).model).double()
        assert forward_precision(model, x) == want, source
        assert forward_precision(model.float(), x) == torch.float32
    res = invoke("sharpness", hf_models["llama"], "--dtype", "fp64", "--tokens", 64, "--top-k", 1, "--bottom-k", 1,
                 "--lanczos-steps", 30, "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0,
                 "--avg-rho", 0, "--landscape", "none", "--no-plots", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["computed_in"] == "float32" and any("computes partly in float32" in n for n in rep["notes"])
    scale = max(abs(rep["eigen"]["top"][0]), abs(rep["eigen"]["bottom"][0]))
    assert rep["eigen"]["rounding"] >= 10 * float(torch.finfo(torch.float32).eps) * scale  # not 1e-13


@pytest.mark.parametrize("length", [0x80, 0x4B50])  # a first byte like a pickle's, first bytes like a zip's "PK"
def test_a_valid_header_whose_length_looks_like_a_pickle_is_read(tmp_path, length):
    from safetensors.torch import load_file

    from cemtool.tensorfile import read_header

    raw = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    raw += b" " * (length - len(raw))  # safetensors pads its header with spaces
    f = tmp_path / "x.safetensors"
    f.write_bytes(safetensors_bytes(raw, b"\0" * 16))
    assert f.read_bytes()[:2] in (b"\x80\x00", b"PK")
    tensors, _ = read_header(f)
    assert tensors["w"].shape == (2, 2) and load_file(f)["w"].shape == (2, 2)
