"""cemtool sample: seeded, reproducible generation; greedy = argmax decoding computed here independently; top-k;
the model's context; every bad number and an unencodable prompt as one clean error."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.errors import CemtoolError

from kit import one_line_error

runner = CliRunner()


def sample_json(run, *args):
    res = runner.invoke(app, ["sample", run, "--device", "cpu", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def loaded(tiny_run):
    from cemtool.subject import open_subject

    return open_subject(tiny_run, "final")


def argmax_decode(model, ids: list[int], n: int, context: int) -> list[int]:
    """Greedy decoding written out here: the argmax of the last position's logits over the last `context` ids."""
    ids = list(ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids[-context:]]))  # (1, T, V)
            ids.append(int(logits[0, -1].argmax()))
    return ids


def test_same_seed_same_text_other_seed_other_text(tiny_run):
    a = sample_json(tiny_run, "--prompt", "The quick", "--tokens", "24", "--seed", "3", "--num-samples", "2")
    b = sample_json(tiny_run, "--prompt", "The quick", "--tokens", "24", "--seed", "3", "--num-samples", "2")
    c = sample_json(tiny_run, "--prompt", "The quick", "--tokens", "24", "--seed", "4", "--num-samples", "2")
    assert [s["ids"] for s in a["samples"]] == [s["ids"] for s in b["samples"]]
    assert [s["ids"] for s in a["samples"]] != [s["ids"] for s in c["samples"]]
    assert a["samples"][0]["ids"] != a["samples"][1]["ids"]  # the samples of one call are distinct draws
    assert all(len(s["ids"]) == 24 for s in a["samples"])
    assert a["settings"]["seed"] == 3 and a["provenance"]["command"] == "sample"


@pytest.mark.parametrize("how", [["--temperature", "0"], ["--top-k", "1"], ["--temperature", "0.7", "--top-k", "1"]])
def test_greedy_is_argmax_decoding(tiny_run, loaded, how):
    # the prompt (23 tokens) is longer than the model's 16-token context: the model sees the last 16
    prompt = "The quick brown fox jum"
    got = sample_json(tiny_run, "--prompt", prompt, "--tokens", "12", *how)
    ids = loaded.tokenizer.encode(prompt)
    assert len(ids) > loaded.config.model.max_seq_len == got["context"] == 16
    want = argmax_decode(loaded.model, ids, 12, 16)[len(ids):]
    assert got["samples"][0]["ids"] == want
    assert got["settings"]["greedy"] is True


def test_top_k_draws_only_among_the_k_most_likely(tiny_run, loaded):
    got = sample_json(tiny_run, "--prompt", "Is it", "--tokens", "16", "--top-k", "3", "--temperature", "2",
                      "--seed", "1")
    ids = loaded.tokenizer.encode("Is it")
    new = got["samples"][0]["ids"]
    with torch.no_grad():
        for t in new:
            top = loaded.model(torch.tensor([ids[-16:]]))[0, -1].topk(3).indices.tolist()
            assert t in top
            ids.append(t)
    free = sample_json(tiny_run, "--prompt", "Is it", "--tokens", "16", "--temperature", "2", "--seed", "1")
    assert free["samples"][0]["ids"] != new  # the cut changes the draws (so the check above can fail)


def test_out_file_and_plain_output(tiny_run, tmp_path):
    out = tmp_path / "s.json"
    res = runner.invoke(app, ["sample", tiny_run, "--device", "cpu", "--prompt", "Are", "--tokens", "5",
                              "--temperature", "0", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["settings"]["tokens"] == 5 and rec["provenance"]["checkpoint"] == "final.safetensors"
    assert res.stdout.strip() == ("Are" + rec["samples"][0]["text"]).strip()


@pytest.mark.parametrize("args, words", [
    (["--temperature", "nan"], ["--temperature"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--temperature", "-1"], ["--temperature"]),
    (["--top-k", "0"], ["--top-k"]),
    (["--top-k", "257"], ["--top-k", "256"]),
    (["--tokens", "0"], ["--tokens"]),
    (["--tokens", "100000"], ["--tokens", "4096"]),
    (["--num-samples", "0"], ["--num-samples"]),
    (["--seed", "-1"], ["--seed"]),
    (["--prompt", ""], ["encodes to no tokens"]),
    (["--checkpoint", "99"], ["does not exist"]),
])
def test_bad_inputs_are_one_line(tiny_run, args, words):
    one_line_error(runner.invoke(app, ["sample", tiny_run, "--device", "cpu", *args]), *words)


def test_bad_out_and_run(tiny_run, tmp_path):
    one_line_error(runner.invoke(app, ["sample", tiny_run, "--out", str(tmp_path)]), "is a folder")
    one_line_error(runner.invoke(app, ["sample", tiny_run, "--out", str(tmp_path / "no" / "s.json")]),
                   "does not exist")
    assert not (tmp_path / "no").exists()
    one_line_error(runner.invoke(app, ["sample", str(tmp_path / "nope")]))


def test_unencodable_prompt_is_one_error():
    from cemtool.data.tokenizer import word_tokenizer
    from cemtool.generate import encode_prompt

    tok = word_tokenizer(["the", "cat", "sat"])
    assert encode_prompt(tok, "the cat") == [0, 1]
    with pytest.raises(CemtoolError, match="--prompt: .*'dog'"):
        encode_prompt(tok, "the dog")


def test_next_token_temperature_and_top_k():
    from cemtool.generate import next_token

    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, None, gen) == 1
    draws = {next_token(logits, 1.0, 2, gen) for _ in range(200)}
    assert draws == {1, 3}  # both of the top 2, never the others
    cold = [next_token(logits, 0.01, None, gen) for _ in range(50)]
    assert set(cold) == {1}  # a low temperature concentrates on the argmax (3.0 vs 2.9: e^-10 apart)


def test_hugging_face_directory_samples_like_its_run(tiny_run, tmp_path):
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    res = runner.invoke(app, ["export", tiny_run, "--to", "hf", str(hf)])
    assert res.exit_code == 0, res.output
    args = ["--prompt", "The quick", "--tokens", "10", "--temperature", "0"]
    ours, theirs = sample_json(tiny_run, *args), sample_json(str(hf), *args)
    assert theirs["samples"][0]["ids"] == ours["samples"][0]["ids"]
    assert theirs["context"] == ours["context"]


def test_item_24_bad_inputs_are_clean(tmp_path, tiny_run):
    """The fast cases of scripts/bad_inputs.py's cases_new (sample, TensorBoard, --per-layer)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    try:
        import bad_inputs
    finally:
        sys.path.pop(0)
    results = bad_inputs.run_cases(tmp_path, Path(tiny_run), fast_only=True, items=("24",))
    assert len(results) >= 25
    unclean = [(r["case"], r["why"]) for r in results if not r["clean"]]
    assert not unclean, unclean
