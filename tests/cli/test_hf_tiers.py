"""Every causal LM transformers builds, tier a (cemtool.subject.hf.logits_only): the families are enumerated from the
installed transformers' causal-LM mapping (not a hand list), each built tiny from its config; its loss through
cemtool equals transformers' own ``model(input_ids, labels=)`` and one Hessian-vector product runs; the round trip
through a saved directory and the CLI for one state-space, one mixture-of-experts and one attention family; the
analyses that read inside the blocks refuse a tier-a model by name."""

from __future__ import annotations

import functools
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_hf import FAMILIES, WORDS, invoke, one_line_error, save_tiny, tiny_config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING

from cemtool.analysis.curvature.operators import make_operator
from cemtool.errors import CemtoolError
from cemtool.models.lm import lm_loss
from cemtool.subject import open_subject
from cemtool.subject.hf.adapter import ForeignLM, Projection
from cemtool.subject.hf.algebra import hook_algebra_check
from cemtool.subject.hf.catalog import family_adapters
from cemtool.subject.hf.llama import LlamaLike
from cemtool.subject.hf.loader import causality_check
from cemtool.subject.hf.logits_only import LogitsLM

V = 128
TINY = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, max_position_embeddings=64, head_dim=8, num_local_experts=4, num_experts=4,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)
# where the generic sizes break a family's own constraint (a default rotary width larger than the tiny head), or
# leave a family's own widths large: Falcon-H1's Mamba-2 mixer keeps 128 heads, d_state 256 and chunks of 256
# tokens (its reference scan pads every sequence to a chunk: ~5 s a forward here), shrunk to the tiny sizes
FAMILY_SIZES = {"gptj": {"rotary_dim": 4}, "stablelm": {"partial_rotary_factor": 0.5},
                "falcon_h1": {"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8,
                              "mamba_chunk_size": 8}}
MAX_PARAMS = 1_000_000  # a tiny config the generic sizes do not shrink (a family's own large defaults) is skipped


def config_of(model_type: str, **extra):
    """A tiny config of a family from the generic sizes (without ``head_dim`` where the family computes it: Falcon's
    is a read-only property)."""
    sizes = {**TINY, **FAMILY_SIZES.get(model_type, {}), **extra}
    try:
        return transformers.AutoConfig.for_model(model_type, **sizes)
    except AttributeError:
        return transformers.AutoConfig.for_model(model_type, **{k: v for k, v in sizes.items() if k != "head_dim"})


def large_weights(cfg):
    """A model of ``cfg`` with weights N(0, 0.3): attention far from uniform, so a wrong hook mapping shows."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return hf


@functools.cache
def tiny_hf(model_type: str):
    """A tiny causal LM of a family from the generic sizes above, or the reason it cannot be built so (built once per
    session: the tests only read it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = config_of(model_type)
        except Exception as e:  # noqa: BLE001
            return None, f"config: {type(e).__name__}"
        if getattr(cfg, "is_encoder_decoder", False) or (type(cfg) in MODEL_FOR_MASKED_LM_MAPPING
                                                         and not getattr(cfg, "is_decoder", False)):
            return None, "not a decoder-only causal LM (cemtool refuses it by kind)"
        try:
            with torch.device("meta"):
                n = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
            if n > MAX_PARAMS:
                return None, f"{n:,} parameters at the generic sizes"
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
        except Exception as e:  # noqa: BLE001
            return None, f"build: {type(e).__name__}"
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                model(input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=False)
            model.cemtool_test_seconds = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001  (the generic sizes break this family's own constraints)
            return None, f"forward at the generic sizes: {type(e).__name__}"
        return model, None


TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
SLOW_FORWARD = 0.5  # seconds of a 4-token forward beyond which the test skips the Hessian-vector product


def test_the_enumeration_covers_the_families_people_analyse():
    built = {t for t in TYPES if tiny_hf(t)[0] is not None}
    named = {"phi", "phi3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "qwen3", "qwen3_moe", "mixtral",
             "stablelm", "falcon", "gpt_bigcode", "bloom", "opt", "starcoder2", "cohere", "granite", "smollm3", "mamba",
             "jamba", "falcon_mamba", "rwkv"}
    assert named <= built, sorted(named - built)
    assert len(built) >= 100  # 107 of 200 causal-LM types on transformers 5.25 build and run a forward


@pytest.mark.parametrize("model_type", TYPES)
def test_tier_a_loss_is_transformers_own_and_one_hvp_runs(model_type):
    hf, why = tiny_hf(model_type)
    if hf is None:
        pytest.skip(why)
    model = LogitsLM(hf, arch=f"hf-{model_type}")
    causal = causality_check(model)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(1, V, (2, 13), generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        ours = float(lm_loss(model(x), y))
        theirs = float(hf(input_ids=idx, labels=idx, use_cache=False).loss)
    if not causal["passed"]:  # refused at load (a bidirectional model, an inconsistent tiny config): say which
        pytest.skip(f"refused at load by the causality check: {causal}")
    if ours != pytest.approx(theirs, rel=1e-6, abs=1e-6):  # a family whose labels= loss does not shift (TrOCR)
        with torch.no_grad():
            logits = hf(input_ids=idx, use_cache=False).logits
            unshifted = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1)))
        assert theirs == pytest.approx(unshifted, rel=1e-6), (ours, theirs)
        assert ours == pytest.approx(float(lm_loss(logits[:, :-1], y)), rel=1e-6)
    else:
        assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6)
    if hf.cemtool_test_seconds > SLOW_FORWARD:  # a family's reference kernel at large own widths (none on 5.25)
        pytest.skip("loss checked; the Hessian-vector product through a reference kernel takes ~50 s here")
    with make_operator("hessian", model, x, y, params="all", dtype="fp32", device="cpu", batch_size=None,
                       graph_budget=None, vectors=1, hvp="exact", mc_samples=1, seed=0) as op:
        v = torch.randn(op.n, generator=g)
        hv = op.matvec(v)
    assert hv.shape == v.shape and torch.isfinite(hv).all() and float(v.double() @ hv.double()) != 0.0
    assert model.inside_blocks() is not None and model.num_params()["total"] == sum(p.numel() for p in
                                                                                   hf.parameters())


@pytest.mark.parametrize("model_type", ["mamba", "olmoe", "helium"])
def test_tier_a_through_a_saved_directory_and_the_cli(model_type, tmp_path):
    import numpy as np

    from cemtool.data.tokenizer import word_tokenizer

    word_text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    word_text.write_text("\n".join(" ".join(rng.choice(WORDS, 16)) for _ in range(200)) + "\n", encoding="utf-8")
    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, "vocab_size": len(WORDS) + 2})
    d = save_tiny(tmp_path / model_type, cfg, word_tokenizer(WORDS))
    word_text = str(word_text)
    s = open_subject(d, data=word_text)
    assert isinstance(s.model, LogitsLM) and model_type not in family_adapters()
    res = invoke("sharpness", d, "--data", word_text, "--tokens", 64, "--top-k", 1, "--bottom-k", 0,
                 "--lanczos-steps", 3, "--trace-hvps", 4, "--density-runs", 0, "--landscape", "none", "--no-plots",
                 "-q")
    assert res.exit_code == 0, res.output
    res = invoke("sharpness", d, "--data", word_text, "--tokens", 64, "--params", "layer:1", "--lanczos-steps", 2,
                 "--trace-hvps", 0, "--density-runs", 0, "--landscape", "none", "--no-plots", "--top-k", 1,
                 "--bottom-k", 0, "-q", "--name", "layer1")
    assert res.exit_code == 0, res.output
    one_line_error(invoke("collapse-report", d, "--data", word_text, "--no-plots"), "logits only", "tier a")
    if model_type == "mamba":  # forgetting fine-tunes a tier-a model: the registered architecture builds it again
        res = invoke("forgetting", d, "--data", word_text, "--to", word_text, "--steps", 2, "--eval-every", 1,
                     "--eval-tokens", 64, "--out", tmp_path / "ft", "--device", "cpu", "-q", "--json")
        assert res.exit_code == 0, res.output
        import json

        rep = json.loads(res.stdout)
        assert [p["step"] for p in rep["curve"]] == [0, 1, 2] and rep["source"]["step"] is None
    with pytest.raises(CemtoolError, match="logits only"):
        from cemtool.analysis.saturation import measure

        measure(s)


def test_the_causality_check_fails_a_bidirectional_model_and_passes_a_causal_one():
    """The load-time check on models whose answer is known: BERT as a plain encoder (every position sees every
    other) fails it, GPT-2 passes, and a GPT-2 whose causal mask is removed fails."""
    bert = transformers.BertLMHeadModel(transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=32,
                                                                is_decoder=False)).eval()
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=2,
                                                                n_positions=64)).eval()
    assert not causality_check(LogitsLM(bert, arch="x"))["passed"]
    assert causality_check(LogitsLM(gpt2, arch="x"))["passed"]

    class Unmasked(torch.nn.Module):  # the same GPT-2 attending to the future: an all-ones 4-D mask
        def __init__(self, m):
            super().__init__()
            self.m, self.config = m, m.config
            self.get_output_embeddings = m.get_output_embeddings
            self.get_input_embeddings = m.get_input_embeddings

        def forward(self, input_ids, use_cache=False):
            B, T = input_ids.shape
            mask = torch.zeros(B, 1, T, T)  # additive: 0 everywhere, nothing masked
            return self.m(input_ids=input_ids, attention_mask=mask, use_cache=False)

    check = causality_check(LogitsLM(Unmasked(gpt2), arch="x"))
    assert not check["passed"] and check["future_token_effect"] > 1e-3


def test_archs_hf_lists_every_family_with_its_tier():
    import json

    res = invoke("archs", "--hf", "--json")
    assert res.exit_code == 0, res.output
    rows = {r["model_type"]: r for r in json.loads(res.stdout[res.stdout.index("["):])}
    assert set(rows) == set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)  # enumerated, not a hand list
    issue = {"gpt2", "gpt_neox", "llama", "mistral", "qwen2",  # the five of the first round, and the 20 it refused
             "phi", "phi3", "gemma", "gemma2", "gemma3_text", "olmo", "olmo2", "qwen3", "qwen3_moe", "mixtral",
             "stablelm", "falcon", "gptj", "gpt_bigcode", "bloom", "opt", "starcoder2", "cohere", "granite", "smollm3"}
    assert {t for t in issue if rows[t]["tier"] == "b"} == issue
    assert {t for t, r in rows.items() if r["tier"] == "b"} == set(family_adapters())
    assert rows["mamba"]["tier"] == "a" and rows["exaone4"]["tier"] == "a" and rows["qwen3_moe"]["tier"] == "b"
    assert rows["bart"]["tier"] == "refused" and "encoder-decoder" in rows["bart"]["note"]
    text = invoke("archs", "--hf")
    assert text.exit_code == 0 and "tier b" in text.stdout and "gpt_neox" in text.stdout


# --------------------------------------------------------------------------------------------------------------
# tier b: the hook-point algebra check


def test_the_hook_algebra_holds_for_every_adapter_family():
    for family in FAMILIES:
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(tiny_config(family), attn_implementation="eager").eval()
        fam = family_adapters()[hf.config.model_type]
        check = hook_algebra_check(ForeignLM(hf, fam, arch="x"), fam)
        assert check["passed"], (family, check)


def test_deliberately_wrong_mappings_are_caught():
    """A residual hook on the wrong side of a norm, a v hook on the keys' projection, q/k hooks declared as after
    RoPE, and the Llama mapping put on Gemma-2's sandwich norms: the logits stay exact (hooks that only read change
    nothing), the algebra does not."""
    class MidOnTheWrongNorm(LlamaLike):
        def mid_norm(self, layer):
            return layer.input_layernorm  # its input is resid_pre, not the stream between attention and MLP

    class VFromTheKeys(LlamaLike):
        def projections(self, layer, s):
            q, k, _ = super().projections(layer, s)
            return [q, k, Projection(layer.self_attn.k_proj, "v", k.index, k.heads)]

    class QAfterRoPE(LlamaLike):  # a q/k hook declared as already rotated: the scores miss the rotary
        def rotate(self, hf, q, k, layer):
            return q, k

    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="eager").eval()
    for wrong, broken in ((MidOnTheWrongNorm(), "resid_mid"), (VFromTheKeys(), "z_is_pattern_v"),
                          (QAfterRoPE(), "pattern_is_softmax_qk")):
        check = hook_algebra_check(ForeignLM(hf, wrong, arch="x"), wrong)
        assert not check["passed"] and check[broken] > 10 * check["tolerance"], (broken, check)
    gemma2 = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        "gemma2", **{**TINY, "num_key_value_heads": 2}), attn_implementation="eager").eval()
    check = hook_algebra_check(ForeignLM(gemma2, LlamaLike(), arch="x"), LlamaLike())
    assert not check["passed"] and (check["resid_mid"] > 1e-2 or check["resid_post"] > 1e-2), check


@pytest.mark.parametrize("model_type", sorted(family_adapters()))
def test_every_tier_b_family_passes_its_load_checks(model_type):
    """Each model type with a family adapter, built tiny with large random weights (attention far from uniform):
    the adapter's logits equal transformers' and its hook points satisfy the block's algebra; its loss is
    transformers' own ``model(input_ids, labels=)``; one Lanczos step and one collapse pass run."""
    from cemtool.analysis.collapse import collapse_report
    from cemtool.analysis.lanczos import lanczos
    from cemtool.subject.hf.loader import logits_check

    cfg = config_of(model_type)
    hf = large_weights(cfg)
    fam = family_adapters()[model_type]
    model = ForeignLM(hf, fam, arch="x")
    assert logits_check(model)["passed"]
    check = hook_algebra_check(model, fam)
    assert check["passed"], check
    assert (model.qk_weights(0) is None) == (not fam.bilinear_qk)
    idx = torch.randint(1, V, (2, 13), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        ours = float(lm_loss(model(x), y))
        assert ours == pytest.approx(float(hf(input_ids=idx, labels=idx, use_cache=False).loss), rel=1e-6)
    with make_operator("hessian", model, x, y, params="all", dtype="fp32", device="cpu", batch_size=None,
                       graph_budget=None, vectors=3, hvp="exact", mc_samples=1, seed=0) as op:
        top = lanczos(op, k_top=1, k_bottom=0, max_steps=2, seed=0)
    assert np.isfinite(top.top[0]) and top.top[0] > 0
    layers = collapse_report(model, x, folds=2)["layers"]
    assert len(layers) == len(model.blocks) and all(isinstance(e["values"], dict) for e in layers)


def test_gpt_bigcode_without_multi_query_passes_too():
    from cemtool.subject.hf.loader import logits_check

    cfg = transformers.AutoConfig.for_model("gpt_bigcode", **{**TINY, "multi_query": False})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    fam = family_adapters()["gpt_bigcode"]
    model = ForeignLM(hf, fam, arch="x")
    assert model.shape.n_kv_head == model.shape.n_head
    assert logits_check(model)["passed"] and hook_algebra_check(model, fam)["passed"]


def test_gemma2s_soft_cap_is_part_of_the_pattern_check():
    """With a soft cap that binds (c = 2 on large weights), the Gemma-2 family passes and the same family without
    its cap declared does not."""
    from cemtool.subject.hf.gemma2 import Gemma2

    class NoCap(Gemma2):
        def softcap(self, layer):
            return None

    cfg = transformers.AutoConfig.for_model("gemma2", **{**TINY, "attn_logit_softcapping": 2.0})
    hf = large_weights(cfg)
    assert hook_algebra_check(ForeignLM(hf, Gemma2(), arch="x"), Gemma2())["passed"]
    check = hook_algebra_check(ForeignLM(hf, NoCap(), arch="x"), NoCap())
    assert not check["passed"] and check["pattern_is_softmax_qk"] > 10 * check["tolerance"]


@pytest.mark.parametrize("model_type,flag", [("cohere", "use_qk_norm"), ("phi", "qk_layernorm"),
                                             ("stablelm", "qk_layernorm")])
def test_optional_qk_norms_are_declared_and_the_hooks_before_them_are_caught(model_type, flag):
    """Cohere's use_qk_norm (Command R+), Phi's and StableLM's qk_layernorm (StableLM-2 12B): with the norms on, the
    family's q/k hook points are the norms' outputs and the algebra holds; the same model read at the projections
    (where the mapping puts them without the norms) breaks the pattern check."""
    fam = family_adapters()[model_type]

    class AtTheProjections(type(fam)):
        qk_norms = None  # the norms left undeclared: q and k read at the projections

    hf = large_weights(config_of(model_type, **{flag: True}))
    assert hook_algebra_check(ForeignLM(hf, fam, arch="x"), fam)["passed"]
    check = hook_algebra_check(ForeignLM(hf, AtTheProjections(), arch="x"), AtTheProjections())
    assert not check["passed"] and check["pattern_is_softmax_qk"] > 10 * check["tolerance"]


def test_a_granite_residual_multiplier_is_refused_by_the_algebra():
    cfg = transformers.AutoConfig.for_model("granite", **{**TINY, "residual_multiplier": 0.5})
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    check = hook_algebra_check(ForeignLM(hf, LlamaLike(), arch="x"), LlamaLike())
    assert not check["passed"] and check["resid_mid"] > 10 * check["tolerance"]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3", "olmo2"])
def test_collapse_report_on_new_tier_b_families(model_type, tmp_path):
    """A mixture of experts (Mixtral, the Llama family), a family with q/k norms (Qwen3) and one with post-sublayer
    norms (OLMo-2), each through a saved directory: tier b, the load checks recorded, collapse-report end to end."""
    import numpy as np

    from cemtool.data.tokenizer import word_tokenizer

    cfg = transformers.AutoConfig.for_model(model_type, **{**TINY, "vocab_size": len(WORDS) + 2})
    d = save_tiny(tmp_path / model_type, cfg, word_tokenizer(WORDS))
    text = tmp_path / "words.txt"
    rng = np.random.default_rng(0)
    text.write_text("\n".join(" ".join(rng.choice(WORDS, 16)) for _ in range(200)) + "\n", encoding="utf-8")
    s = open_subject(d, data=str(text))
    assert isinstance(s.model, ForeignLM)
    res = invoke("collapse-report", d, "--data", text, "--tokens", 256, "--no-plots", "-q")
    assert res.exit_code == 0, res.output
    import json

    src = json.loads((Path(d) / "model_source.json").read_text())
    assert src["tier"] == "b" and src["hook_algebra_check"]["passed"] and src["causality_check"]["passed"]
