"""The tier-b families beyond the Llama layout (cemtool/subject/hf/*.py): their declarations against the mapping on
tiny models, the structures the hook-point algebra check must see (sliding windows, ALiBi, per-layer rotary, NoPE
layers, Falcon's three packings and its in-place MLP output), each shown to fail under a deliberately wrong
declaration; configs a family refuses by name; mixture-of-experts router hook points and collapse-report's expert
load against transformers' own router outputs; the four commands end to end on one family of each structural kind;
and docs/models.md's family table, generated from the declarations."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from test_hf import WORDS, invoke, one_line_error, save_tiny
from test_hf_tiers import config_of, large_weights

from cemtool.analysis.collapse import collapse_report
from cemtool.analysis.curvature.risk import select_parameters
from cemtool.data.tokenizer import word_tokenizer
from cemtool.models.capture import capture
from cemtool.subject import open_subject
from cemtool.subject.hf.adapter import ForeignLM, Projection
from cemtool.subject.hf.algebra import hook_algebra_check
from cemtool.subject.hf.bloom import Bloom
from cemtool.subject.hf.catalog import BEGIN, END, families_table, family_adapters, family_of
from cemtool.subject.hf.falcon import Falcon
from cemtool.subject.hf.gemma3 import Gemma3
from cemtool.subject.hf.llama import LlamaLike
from cemtool.subject.hf.loader import logits_check
from cemtool.subject.hf.logits_only import LogitsLM
from cemtool.subject.hf.smollm3 import SmolLM3

ROOT = Path(__file__).resolve().parents[2]


def foreign(model_type: str, fam=None, **extra) -> ForeignLM:
    hf = large_weights(config_of(model_type, **extra))
    return ForeignLM(hf, fam or family_adapters()[model_type], arch="x")


def passes(model: ForeignLM, fam=None) -> dict:
    return hook_algebra_check(model, fam or family_adapters()[model.hf.config.model_type])


def fails(model: ForeignLM, fam, identity: str) -> None:
    """``model``'s transformers model mapped by ``fam``: the logits stay exact (hooks that only read change
    nothing) while the algebra check refuses the mapping."""
    model = ForeignLM(model.hf, fam, arch="x")
    assert logits_check(model)["passed"]
    check = hook_algebra_check(model, fam)
    assert not check["passed"] and check[identity] > 10 * check["tolerance"], (identity, check)


# --------------------------------------------------------------------------------------------------------------
# declarations against the mapping


@pytest.mark.parametrize("model_type", sorted(family_adapters()))
def test_each_familys_declarations_describe_its_mapping(model_type):
    """residual (parallel: no resid_mid), positions (RoPE: a rotary somewhere; learned: a position embedding),
    routers (declared for exactly the model types whose layers have one), as docs/models.md prints them."""
    fam = family_adapters()[model_type]
    model = foreign(model_type)
    mids = {b.resid_mid is not None for b in model.blocks}
    if fam.residual == "parallel":
        assert mids == {False}
    elif fam.residual == "sequential":
        assert mids == {True}
    else:  # a config option chooses ("parallel (...), or sequential")
        assert "parallel" in fam.residual and "sequential" in fam.residual and len(mids) == 1
    rotary = any(b.attn.rotary for b in model.blocks)
    if "RoPE" not in fam.positions:
        assert not rotary
    elif not re.search(r"\bor\b", fam.positions):  # "RoPE, or ALiBi": a config option chooses
        assert rotary
    assert (model.pos_emb is not None) == (fam.positions == "learned")
    assert any(b.moe is not None for b in model.blocks) == (model_type in fam.routers)


def test_the_docs_family_table_is_the_generated_one():
    text = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    assert BEGIN in text and END in text
    block = text[text.index(BEGIN):text.index(END) + len(END)]
    assert block == families_table(), "regenerate it: cemtool archs --hf --markdown"
    res = invoke("archs", "--hf", "--markdown")
    assert res.exit_code == 0 and families_table() in res.stdout
    for t in family_adapters():
        assert f"`{t}`" in block


# --------------------------------------------------------------------------------------------------------------
# what the pattern check must see, and a wrong declaration of it


def test_sliding_windows_are_part_of_the_pattern_check():
    """A window of 4 keys over 12 tokens binds: Mistral (the config's window in every layer) and Gemma-3 (per
    layer) pass, and the same models with the window left undeclared do not."""
    class NoWindow(LlamaLike):
        def window(self, layer):
            return None

    mistral = foreign("mistral", sliding_window=4)
    assert passes(mistral)["passed"] and family_adapters()["mistral"].window(mistral.blocks[0].layer) == 4
    fails(mistral, NoWindow(), "pattern_is_softmax_qk")

    class Gemma3NoWindow(Gemma3):
        def window(self, layer):
            return None

    gemma3 = foreign("gemma3_text", sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    assert passes(gemma3)["passed"]
    assert [Gemma3().window(b.layer) for b in gemma3.blocks] == [4, None]
    fails(gemma3, Gemma3NoWindow(), "pattern_is_softmax_qk")


def test_gemma3_rotates_each_layer_with_its_own_base_and_its_q_hook_is_after_the_q_norm():
    class OneBase(Gemma3):  # the global RoPE base in every layer
        def cos_sin(self, hf, x, pos, layer):
            return hf.model.rotary_emb(x, pos, "full_attention")

    class QBeforeTheNorm(Gemma3):  # the q and k hooks on the projections, before the q/k norms
        def projections(self, layer, s):
            a = layer.self_attn
            return [Projection(a.q_proj, "q", torch.arange(s.n_head * s.head_dim), s.n_head),
                    Projection(a.k_proj, "k", torch.arange(s.n_kv_head * s.head_dim), s.n_kv_head),
                    Projection(a.v_proj, "v", torch.arange(s.n_kv_head * s.head_dim), s.n_kv_head)]

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    model = foreign("gemma3_text", layer_types=["sliding_attention", "full_attention"], rope_parameters=rope)
    assert passes(model)["passed"]
    fails(model, OneBase(), "pattern_is_softmax_qk")
    fails(model, QBeforeTheNorm(), "pattern_is_softmax_qk")
    assert model.qk_weights(0) is None  # the norms: no fixed bilinear form


def test_a_qwen3_q_hook_before_its_q_norm_is_caught():
    """The Llama mapping on Qwen3 puts q and k before the per-head norms: the scores it implies are wrong."""
    fails(foreign("qwen3"), LlamaLike(), "pattern_is_softmax_qk")


def test_smollm3s_nope_layers_are_not_rotated():
    class RotateAll(SmolLM3):
        def rotary_dims(self, layer, shape):
            return shape.rotary_dims

    model = foreign("smollm3", num_hidden_layers=4, no_rope_layer_interval=2)
    assert [b.attn.rotary is not None for b in model.blocks] == [True, False, True, False]
    assert passes(model)["passed"]
    fails(model, RotateAll(), "pattern_is_softmax_qk")
    sat = [a.rope for a in model.attention_layers()[0]]
    assert sat == [True, False, True, False]  # saturation truncates a NoPE layer in the SVD basis


@pytest.mark.parametrize("model_type", ["bloom", "falcon"])
def test_alibi_is_part_of_the_pattern_check(model_type):
    extra = {"alibi": True} if model_type == "falcon" else {}
    cls = {"bloom": Bloom, "falcon": Falcon}[model_type]

    class NoAlibi(cls):
        def score_bias(self, hf, layer, batch, T):
            return None

    model = foreign(model_type, **extra)
    assert passes(model)["passed"] and all(b.attn.rotary is None for b in model.blocks)
    fails(model, NoAlibi(), "pattern_is_softmax_qk")


@pytest.mark.parametrize("packing", [
    {}, {"multi_query": False, "num_kv_heads": 4}, {"new_decoder_architecture": True, "num_kv_heads": 2},
    {"parallel_attn": False, "multi_query": False, "num_kv_heads": 4}, {"alibi": True}],
    ids=["multi-query", "per-head", "grouped", "sequential", "alibi"])
def test_falcon_in_each_packing_and_residual(packing):
    model = foreign("falcon", **packing)
    assert logits_check(model)["passed"] and passes(model)["passed"], packing
    seq = packing.get("parallel_attn") is False
    assert all((b.resid_mid is not None) == seq for b in model.blocks)


def test_falcons_packing_and_its_in_place_mlp_output_are_checked():
    """Read as multi-query, a grouped (new_decoder_architecture) Falcon's v is the wrong slice; and without the copy
    of the MLP output, the value a capture holds is changed in place by the model (mlp + attention)."""
    class AsMultiQuery(Falcon):
        def projections(self, layer, s):
            dh, H = s.head_dim, s.n_head
            qkv = layer.self_attention.query_key_value
            return [Projection(qkv, "q", torch.arange(H * dh), H),
                    Projection(qkv, "k", torch.arange(H * dh, (H + s.n_kv_head) * dh), s.n_kv_head),
                    Projection(qkv, "v", torch.arange((H + s.n_kv_head) * dh, (H + 2 * s.n_kv_head) * dh),
                               s.n_kv_head)]

    class NoCopy(Falcon):
        copy_mlp_out = False

    grouped = foreign("falcon", new_decoder_architecture=True, num_kv_heads=2)
    fails(grouped, AsMultiQuery(), "z_is_pattern_v")
    fails(foreign("falcon"), NoCopy(), "resid_post")


def test_bloom_and_opt_configs_their_families_do_not_declare_are_refused_by_name(tmp_path):
    """A refused config is tier a: sharpness still runs, collapse-report says why in one line; without the refusal
    the algebra check would catch BLOOM's normed residual."""
    bloom = config_of("bloom", apply_residual_connection_post_layernorm=True)
    fam, why = family_of(bloom)
    assert fam is None and "apply_residual_connection_post_layernorm" in why
    fails(ForeignLM(large_weights(bloom), Bloom(), arch="x"), Bloom(), "resid_mid")
    for extra, words in (({"do_layer_norm_before": False}, "post-LN"), ({"word_embed_proj_dim": 16}, "project_in")):
        fam, why = family_of(config_of("opt", **extra))
        assert fam is None and words in why
    d = save_tiny(tmp_path / "opt", config_of("opt", vocab_size=len(WORDS) + 2, do_layer_norm_before=False),
                  word_tokenizer(WORDS))
    text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 16)) for _ in range(100)) + "\n", encoding="utf-8")
    s = open_subject(d, data=str(text))
    assert isinstance(s.model, LogitsLM)
    src = json.loads((Path(d) / "model_source.json").read_text())
    assert src["tier"] == "a" and "post-LN" in src["tier_b_refused"]
    one_line_error(invoke("collapse-report", d, "--data", text, "--no-plots"), "post-LN", "tier a")


# --------------------------------------------------------------------------------------------------------------
# mixtures of experts


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_router_hook_points_and_expert_load_equal_transformers_own_router_outputs(model_type):
    """The router logits at ``blocks.N.moe.router_logits`` are transformers' own ``output_router_logits``; the
    chosen experts are the top-k of their softmax; collapse's expert load and router entropy follow from those, here
    recomputed independently."""
    model = foreign(model_type)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 128, (6, 10), generator=g)  # (B, T)
    with torch.no_grad():
        theirs = model.hf(input_ids=x, output_router_logits=True, use_cache=False).router_logits
    with torch.no_grad(), capture(model, "blocks.*.moe.*") as cache:
        model(x)
    E, k = model.experts(0)
    rep = collapse_report(model, x, folds=2)
    for i, logits in enumerate(theirs):
        mine = cache[f"blocks.{i}.moe.router_logits"]  # (B, T, E)
        assert torch.equal(mine, logits.reshape(6, 10, E))
        top = torch.topk(torch.softmax(logits.double(), -1), k, dim=-1).indices  # (B T, k)
        chosen = cache[f"blocks.{i}.moe.experts"]  # (B, T, k)
        assert torch.equal(torch.sort(chosen.reshape(-1, k), -1).values, torch.sort(top, -1).values)
        counts = np.bincount(top.reshape(-1).numpy(), minlength=E)
        ex = rep["layers"][i]["experts"]
        np.testing.assert_allclose(ex["fraction"], counts / counts.sum(), rtol=0, atol=1e-15)
        f = counts[counts > 0] / counts.sum()
        assert ex["entropy"] == pytest.approx(float(-(f * np.log(f)).sum()), rel=1e-12)
        assert ex["tokens"] == 60 and ex["top_k"] == k and ex["entropy_max"] == pytest.approx(math.log(E))
        p = torch.softmax(logits.double(), -1).reshape(6, 10, E)
        per_seq = (-(p * p.log()).sum(-1)).mean(-1)  # (B,)
        r = ex["router_entropy"]
        assert r["mean"] == pytest.approx(float(per_seq.mean()), rel=1e-9) and r["n"] == 6
        assert r["se"] == pytest.approx(float(per_seq.std() / math.sqrt(6)), rel=1e-9)
    dense = foreign("llama")
    assert dense.experts(0) is None and all("experts" not in e for e in collapse_report(dense, x, folds=2)["layers"])


def test_sharpness_parameter_selection_over_experts_and_routers():
    model = foreign("mixtral")
    experts = {n for n, _ in select_parameters(model, "experts")}
    assert experts and experts == {n for n, _ in select_parameters(model, "experts.*")}
    assert all(".mlp.experts." in n for n in experts)
    assert experts == {n for n, _ in model.named_parameters() if ".experts." in n}
    one = {n for n, _ in select_parameters(model, "blocks.1.*experts.*")}
    assert one and all(n.startswith("blocks.1.") for n in one) and one < experts
    routers = {n for n, _ in select_parameters(model, "mlp.gate.weight")}
    assert routers == {"blocks.0.layer.mlp.gate.weight", "blocks.1.layer.mlp.gate.weight"}
    for typo in ("weight", "layer.*", "0.*", "experts"):  # no suffix of a bare word, the wrapper or a number
        with pytest.raises(Exception, match="matches no parameter"):
            select_parameters(foreign("llama"), typo)
    assert len(select_parameters(foreign("llama"), "q_proj.weight")) == 2  # a module's own name: one per layer


# --------------------------------------------------------------------------------------------------------------
# the four commands, one family of each structural kind


KINDS = {"qwen3": "q/k norms", "gemma2": "sandwich norms", "olmo2": "post-sublayer norms", "falcon": "parallel",
         "bloom": "ALiBi", "mixtral": "mixture of experts", "opt": "flattened MLP", "gemma3_text": "per-layer rotary",
         "smollm3": "NoPE layers"}


@pytest.mark.parametrize("model_type", sorted(KINDS))
def test_the_four_commands_on_each_structural_kind(model_type, tmp_path):
    text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 16)) for _ in range(150)) + "\n", encoding="utf-8")
    extra = {"num_hidden_layers": 4, "no_rope_layer_interval": 2} if model_type == "smollm3" else {}
    d = save_tiny(tmp_path / model_type, config_of(model_type, vocab_size=len(WORDS) + 2, **extra),
                  word_tokenizer(WORDS))
    params = "experts" if model_type == "mixtral" else "layer:1"
    res = invoke("sharpness", d, "--data", text, "--tokens", 64, "--top-k", 1, "--bottom-k", 0, "--lanczos-steps",
                 3, "--trace-hvps", 0, "--density-runs", 0, "--sam-rho", 0, "--asam-rho", 0, "--avg-rho", 0,
                 "--landscape", "none", "--params", params, "--no-plots", "-q")
    assert res.exit_code == 0, res.output
    res = invoke("collapse-report", d, "--data", text, "--tokens", 256, "--folds", 2, "--no-plots", "-q")
    assert res.exit_code == 0, res.output
    res = invoke("saturation", d, "--data", text, "--tokens", 64, "--ranks", "0,2", "--no-plots", "-q")
    assert res.exit_code == 0, res.output
    res = invoke("forgetting", d, "--data", text, "--to", text, "--out", tmp_path / "ft", "--steps", 2,
                 "--eval-every", 2, "--eval-tokens", 64, "-q")
    assert res.exit_code == 0, res.output
    reports = Path(d) / "reports"
    src = json.loads((Path(d) / "model_source.json").read_text())
    assert src["tier"] == "b" and src["hook_algebra_check"]["passed"] and src["logits_check"]["passed"]
    col = json.loads((reports / "collapse.json").read_text())["runs"][0]["collapse"]["layers"]
    assert all(isinstance(e["values"], dict) and isinstance(e["attention"], dict) for e in col)
    assert all(("experts" in e) == (model_type == "mixtral") for e in col)
    sat = json.loads((reports / "saturation.json").read_text())["saturation"]["layers"]
    if model_type == "smollm3":
        assert [e["rope"] for e in sat] == [True, False, True, False]
    shp = json.loads(next(reports.glob("sharpness*.json")).read_text())
    assert shp["eigen"]["top"][0] is not None
    forgot = json.loads((tmp_path / "ft" / "reports" / "forgetting.json").read_text())
    assert [c["step"] for c in forgot["curve"]] == [0, 2]


def test_the_data_basis_under_grouped_query_attention_uses_each_query_heads_own_key_head():
    """Qwen3 (q/k norms: the data basis) with 4 query heads over 2 key-value heads: query head h's key factor is
    the second moment of key head h // 2, computed here from the captured keys by hand."""
    from cemtool.analysis.saturation import _sqrt_psd, data_factors

    model = foreign("qwen3")
    x = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(5))
    layers = model.attention_layers()[0]
    assert layers[0].heads == 4 and layers[0].kv_heads == 2
    got = data_factors(model, layers, x, batch_size=2, device="cpu")
    with torch.no_grad(), capture(model, "blocks.0.attn.k") as cache:
        model(x)
    k = cache["blocks.0.attn.k"].double()  # (B, 2, T, d_h)
    for h in range(4):
        S = torch.einsum("bti,btj->ij", k[:, h // 2], k[:, h // 2])
        torch.testing.assert_close(got[0][h][1], _sqrt_psd(S), rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got[0][0][1], got[0][2][1])  # the two key heads differ


def test_a_config_that_breaks_the_algebra_loads_in_tier_a_with_the_reason(tmp_path):
    """Granite with residual_multiplier 0.5 (not declared by the Llama mapping): the load-time algebra check fails,
    so the model is measured through its logits (sharpness runs), collapse-report names the broken identity in one
    line, and a fine-tune of it stays tier a when it is loaded again."""
    text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 16)) for _ in range(100)) + "\n", encoding="utf-8")
    d = save_tiny(tmp_path / "granite", config_of("granite", vocab_size=len(WORDS) + 2, residual_multiplier=0.5),
                  word_tokenizer(WORDS))
    s = open_subject(d, data=str(text))
    assert isinstance(s.model, LogitsLM) and "resid_mid" in s.model.inside_blocks()
    src = json.loads((Path(d) / "model_source.json").read_text())
    assert src["tier"] == "a" and "algebra" in src["tier_b_refused"] and src["logits_check"]["passed"]
    assert not src["tier_b_checks"]["hook_algebra_check"]["passed"] and src["hook_algebra_check"] is None
    res = invoke("sharpness", d, "--data", text, "--tokens", 64, "--top-k", 1, "--bottom-k", 0, "--lanczos-steps", 2,
                 "--trace-hvps", 0, "--density-runs", 0, "--landscape", "none", "--no-plots", "-q")
    assert res.exit_code == 0, res.output
    one_line_error(invoke("collapse-report", d, "--data", text, "--no-plots"), "algebra", "tier a")
    res = invoke("forgetting", d, "--data", text, "--to", text, "--out", tmp_path / "ft", "--steps", 1,
                 "--eval-every", 1, "--eval-tokens", 64, "-q")
    assert res.exit_code == 0, res.output
    from cemtool.subject.hf import loader

    loader._REFUSED.clear()  # as in a new process: the fine-tune's model_source.json carries the refusal
    assert isinstance(open_subject(tmp_path / "ft").model, LogitsLM)
