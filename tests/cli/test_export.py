"""`cemtool export RUN --to hf DIR`: a standard LlamaForCausalLM directory whose logits (and λ_max) are the run's."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.config import resolve
from cemtool.errors import CemtoolError
from cemtool.models.registry import build_model
from cemtool.subject import open_subject
from cemtool.subject.hf.export import pick_target, refusals

from kit import train_tiny

runner = CliRunner()

QUICK = ["train.max_steps=2", "train.eval_every=2", "data.tokenizer=byte"]


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory, text_file):
    """Baseline with RoPE, RMSNorm, SwiGLU and tied embeddings (the defaults)."""
    return train_tiny(tmp_path_factory.mktemp("export") / "tied", data=text_file, extra=QUICK)


def export(run, out, *extra):
    return runner.invoke(app, ["export", str(run), "--to", "hf", str(out), "--json", *extra])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tied_run):
    """(DIR, export's --json result) of the tied run, exported into a fresh folder that holds nothing else."""
    parent = tmp_path_factory.mktemp("exported")
    res = export(tied_run, parent / "hf")
    assert res.exit_code == 0, res.output
    assert [p.name for p in parent.iterdir()] == ["hf"]  # nothing written outside DIR
    return parent / "hf", json.loads(res.stdout)


def transformers_logits_match(run, out):
    """Logits of transformers' own AutoModelForCausalLM on the directory against the run's, on random sequences."""
    from cemtool.subject import open_subject

    loaded = open_subject(run)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    idx = torch.randint(0, loaded.config.model.vocab_size, (3, loaded.config.model.max_seq_len),
                        generator=torch.Generator().manual_seed(1))  # (3, T)
    with torch.no_grad():
        diff = (loaded.model(idx) - hf(input_ids=idx).logits).abs().max().item()
    assert diff <= 1e-5, diff
    return loaded, hf


def test_export_round_trip_tied(exported, tied_run, text_file):
    from safetensors.numpy import load_file

    out, info = exported
    assert info["architecture"] == "LlamaForCausalLM" and info["tie_word_embeddings"] is True
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(info["files"])
    loaded, hf = transformers_logits_match(tied_run, out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = open(text_file, encoding="utf-8").read()[:300]
    assert tok(text)["input_ids"] == loaded.tokenizer.encode(text)
    w, sd = load_file(str(out / "model.safetensors")), loaded.model.state_dict()  # the checkpoint's weights, as is
    np.testing.assert_array_equal(w["model.layers.1.self_attn.q_proj.weight"], sd["blocks.1.attn.wq.weight"].numpy())
    np.testing.assert_array_equal(w["model.layers.0.mlp.gate_proj.weight"], sd["blocks.0.mlp.gate.weight"].numpy())
    assert "lm_head.weight" not in w  # tied


def test_export_untied_head_dim_rope_base_eps_and_uniform_head_lists(tmp_path, text_file):
    run = train_tiny(tmp_path / "run", data=text_file,
                     extra=[*QUICK, "model.tie_embeddings=false", "model.rope_base=500", "model.head_dim=6",
                            "model.heads=[4,4]", "model.norm_eps=1e-3", "model.mlp_hidden=48"])
    res = export(run, tmp_path / "hf")
    assert res.exit_code == 0, res.output
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["head_dim"], cfg["hidden_size"]) == (4, 6, 32)  # 4*6 != 32
    _, hf = transformers_logits_match(run, tmp_path / "hf")
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()


def test_gpt2_style_baseline_exports_as_gpt2_at_any_checkpoint(tmp_path, text_file):
    from safetensors.numpy import load_file

    from cemtool.subject import open_subject

    run = train_tiny(tmp_path / "run", data=text_file,
                     extra=[*QUICK, "model.norm=layernorm", "model.pos=learned", "model.mlp=gelu",
                            "model.norm_eps=1e-4", "model.tie_embeddings=false", "train.eval_every=1"])
    assert export(run, tmp_path / "hf").exit_code == 0
    _, hf = transformers_logits_match(run, tmp_path / "hf")
    assert type(hf).__name__ == "GPT2LMHeadModel"
    res = export(run, tmp_path / "hf1", "--checkpoint", "1")  # the step-1 weights, not the final ones
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["architecture"] == "GPT2LMHeadModel"
    w = load_file(str(tmp_path / "hf1" / "model.safetensors"))
    assert not w["transformer.h.0.attn.c_attn.bias"].any() and w["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    step1, final = (open_subject(run, c).model.tok_emb.weight.detach().numpy() for c in ("1", "final"))
    np.testing.assert_array_equal(w["transformer.wte.weight"], step1)
    assert not np.array_equal(step1, final)


def test_exported_model_has_the_runs_lambda_max(exported, tied_run, text_file):
    out = exported[0]
    opts = ["--tokens", "128", "--trace-hvps", "0", "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0",
            "--avg-rho", "0", "--top-k", "1", "--bottom-k", "0", "--tol", "1e-9", "--json", "--no-plots"]
    lam = []
    for args in ([tied_run], [str(out), "--data", text_file]):
        res = runner.invoke(app, ["sharpness", *args, *opts])
        assert res.exit_code == 0, res.output
        rep = json.loads(res.stdout)
        lam.append(rep["eigen"]["top"][0])
    assert abs(lam[0] - lam[1]) <= 1e-5 * abs(lam[0]), lam


@pytest.mark.parametrize("sets, words", [
    (["model.pos=learned"], ["as LlamaForCausalLM: model.pos=learned (needs rope)", "as GPT2LMHeadModel: "
                             "model.norm=rmsnorm (needs layernorm), model.mlp=swiglu (needs gelu)"]),
    (["model.alloc_strategy=early-heavy"], ["per-layer (heads, head_dim)", "early-heavy"]),
    (["model.heads=[2,4]"], ["explicit model.heads/head_dims"]),
    (["model.n_head=3", "model.head_dim=8"], ["3 heads do not divide model.d_model=128"]),
    (["model.norm=layernorm", "model.pos=learned", "model.mlp=gelu", "model.head_dim=16"],
     ["4 heads of size 16 are not model.d_model=128 wide"]),
])
def test_what_no_standard_architecture_expresses_is_named(sets, words):
    cfg = resolve(overrides=["model.n_layer=2", *sets, "model.vocab_size=50", "model.max_seq_len=64"])
    with pytest.raises(CemtoolError) as e:
        pick_target(build_model(cfg.model))
    for w in words:
        assert w in str(e.value), str(e.value)
    default = build_model(resolve(overrides=["model.vocab_size=50", "model.max_seq_len=64"]).model)
    assert refusals(default, "LlamaForCausalLM") == [] and pick_target(default) == "LlamaForCausalLM"


def one_line_error(res, code, *words):
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    assert "Traceback" not in res.output, res.output
    for w in words:
        assert w in res.output, (w, res.output)
    return lines


def test_other_families_and_bad_targets_are_refused(tmp_path, tied_run, text_file):
    cem = train_tiny(tmp_path / "cem", arch="cem", data=text_file, extra=QUICK)
    lines = one_line_error(export(cem, tmp_path / "x"), 1, "architecture cem (family cem) has no standard")
    assert lines[0].startswith("Error: ") and not (tmp_path / "x").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    one_line_error(export(tied_run, busy), 1, "is not empty", "--force")
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    assert export(tied_run, busy, "--force").exit_code == 0
    assert (busy / "notes.txt").read_text() == "keep me" and (busy / "model.safetensors").is_file()
    (busy / "pytorch_model.bin").write_bytes(b"old")
    one_line_error(export(tied_run, busy, "--force"), 1, "other weight files (pytorch_model.bin)")
    one_line_error(export(tied_run, tied_run, "--force"), 1, "is a cemtool run")
    one_line_error(runner.invoke(app, ["export", tied_run, "--to", "onnx", str(tmp_path / "y")]), 2, "onnx")
    assert not (tmp_path / "y").exists()


def test_analysing_an_exported_model_refuses_bad_token_files(tmp_path, exported):
    out = exported[0]
    open_subject(out)  # loading writes model_source.json (what was loaded), as an earlier analysis of it does
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    np.array([1, 2, 3, 255, 300] * 40, dtype=np.uint16).tofile(tmp_path / "oov.bin")  # byte tokenizer: 256 ids
    for data, words in (("odd.bin", ["5 bytes", "not a multiple of 2"]),
                        ("oov.bin", ["token id 300 at position 4", "outside the vocabulary", "0..255"])):
        res = runner.invoke(app, ["sharpness", str(out), "--data", str(tmp_path / data), "--tokens", "64"])
        lines = one_line_error(res, 1, *words)
        assert lines[0].startswith("Error: ")
        assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing written


LAMBDA_OPTS = ["--tokens", "128", "--trace-hvps", "0", "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0",
               "--avg-rho", "0", "--top-k", "1", "--bottom-k", "0", "--tol", "1e-9", "--json", "--no-plots"]


def test_exported_grammar_run_is_analysed_on_its_own_data(tmp_path):
    """A run on the default grammar corpus (word tokenizer): its export is evaluated on the run's own data when no
    --data is given (pydoc would not encode), with the run's λ_max, and still reads the grammar corpora by name."""
    run = train_tiny(tmp_path / "run", extra=["train.max_steps=2", "train.eval_every=2", "data.train_tokens=1000",
                                            "data.val_tokens=1024"])
    assert export(run, tmp_path / "hf").exit_code == 0
    record = json.loads((tmp_path / "hf" / "cemtool_export.json").read_text())
    assert record["data"]["source"] == "grammar" and record["tokenizer_kind"] == "word"
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")) is not None  # still loads
    lam = []
    for args in ([run], [str(tmp_path / "hf")], [str(tmp_path / "hf"), "--data", "grammar"]):
        res = runner.invoke(app, ["sharpness", *args, *LAMBDA_OPTS])
        assert res.exit_code == 0, res.output
        lam.append(json.loads(res.stdout)["eigen"]["top"][0])
    assert max(abs(v - lam[0]) for v in lam) <= 1e-5 * abs(lam[0]), lam


def test_export_refuses_a_target_inside_a_run(tmp_path, tied_run):
    from pathlib import Path

    for target in (Path(tied_run) / "reports" / "hf", Path(tied_run) / "plots"):
        one_line_error(export(tied_run, target), 1, "lies inside", "a cemtool run")
        assert not (Path(tied_run) / "reports" / "hf").exists()


def test_plot_and_runs_tell_a_model_directory_from_a_run(tmp_path, exported, tied_run):
    """An exported (Hugging Face) directory is no run: plot refuses it in one line and writes nothing (it wrote a
    report.md of None), runs skips it beside a real run (it listed it as unreadable)."""
    import shutil

    hf = tmp_path / "folder" / "hf"
    shutil.copytree(exported[0], hf)
    before = sorted(p.relative_to(hf) for p in hf.rglob("*"))
    lines = one_line_error(runner.invoke(app, ["plot", str(hf)]), 1, "is a Hugging Face model directory")
    assert lines[0].startswith("Error: ")
    assert sorted(p.relative_to(hf) for p in hf.rglob("*")) == before
    shutil.copytree(tied_run, tmp_path / "folder" / "run", ignore=shutil.ignore_patterns("checkpoints"))
    res = runner.invoke(app, ["runs", str(tmp_path / "folder"), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["run"] for r in json.loads(res.stdout)] == [str(tmp_path / "folder" / "run")]
    assert json.loads(runner.invoke(app, ["runs", str(hf), "--json"]).stdout) == []


def test_gpt2_export_has_the_runs_lambda_max_without_its_added_zero_biases(tmp_path, text_file):
    """GPT-2's projection biases are zeros the export adds: recorded as added parameters, they are no Hessian
    coordinates of the analysed export, whose λ_max and parameter count are then the run's."""
    run = train_tiny(tmp_path / "run", data=text_file,
                     extra=[*QUICK, "model.norm=layernorm", "model.pos=learned", "model.mlp=gelu"])
    res = export(run, tmp_path / "hf")
    assert res.exit_code == 0, res.output
    info = json.loads(res.stdout)
    record = json.loads((tmp_path / "hf" / "cemtool_export.json").read_text())
    assert record["added_parameters"] == info["added_tensors"] and len(info["added_tensors"]) == 2 * 4
    assert all(n.endswith(".bias") for n in info["added_tensors"])
    opts = ["--tokens", "128", "--trace-hvps", "0", "--density-runs", "0", "--sam-rho", "0", "--asam-rho", "0",
            "--avg-rho", "0", "--top-k", "1", "--bottom-k", "0", "--tol", "1e-9", "--json", "--no-plots"]
    reps = []
    for args in ([run], [str(tmp_path / "hf"), "--data", text_file]):
        res = runner.invoke(app, ["sharpness", *args, *opts])
        assert res.exit_code == 0, res.output
        reps.append(json.loads(res.stdout))
    lam = [r["eigen"]["top"][0] for r in reps]
    assert abs(lam[0] - lam[1]) <= 1e-5 * abs(lam[0]), lam
    assert reps[0]["n_params"] == reps[1]["n_params"]
    assert any(f"{info['added_parameters']:,} parameters in 8 tensors left out (added by cemtool export" in n
               for n in reps[1]["notes"]), reps[1]["notes"]
