"""research/scripts/study.sh's matched sizes, recomputed from the models: the baseline widened to tmm's parameters,
shrunk to cem's, trained to LIMe's FLOPs, at 12 layers, and late-lowrank at 75% of the attention budget, for each
corpus. The sizes are written into the script as numbers; a wrong one (the pydoc part's were once computed at another
vocabulary) would compare groups that are not matched."""

import re
import shlex
from pathlib import Path

import pytest

from cemtool.analysis.compute import arch_row
from cemtool.data.grammar import default_grammar

SCRIPT = (Path(__file__).resolve().parents[1] / "scripts" / "study.sh").read_text(encoding="utf-8")  # research/scripts


def part(name: str) -> dict:
    """The variables a part's function sets: arrays as lists of words, the rest as strings."""
    body = re.search(rf"^{name}\(\) \{{\n(.*?)^\}}", SCRIPT, re.S | re.M).group(1)
    body = re.sub(r"#[^\n]*", "", body)  # comments
    out = {k: shlex.split(v) for k, v in re.findall(r"^\s*([A-Z_0-9]+)=\((.*?)\)", body, re.S | re.M)}
    out.update({k: v.strip('"') for k, v in re.findall(r"^\s*([A-Z_0-9]+)=([^(\s]\S*)", body, re.M)})
    return out


def sets(words: list[str]) -> list[str]:
    return [words[i + 1] for i, w in enumerate(words) if w == "--set"]


def option(words: list[str], key: str) -> str:
    return next(s.split("=", 1)[1] for s in sets(words) if s.startswith(key + "="))


def size(arch: str, words: list[str], vocab: int, extra: tuple = ()) -> dict:
    overrides = [s for s in sets(words) if s.startswith("model.")] + list(extra)
    return arch_row(arch, overrides, vocab=vocab, seq_len=int(option(words, "data.seq_len")))


def _study(name: str):
    v = part(name)
    common = v["COMMON"]
    # the vocabulary the runs have: the grammar's words, or the BPE size (pydoc's runs record vocab_size 1,024)
    vocab = len(default_grammar().vocab) if name == "grammar" else int(option(common, "data.bpe_vocab_size"))
    return name, v, common, vocab


@pytest.fixture(scope="module", params=["grammar", "pydoc"])
def study(request):
    return _study(request.param)


@pytest.fixture(scope="module", params=["grammar", "pydoc", "stdlib"])
def any_part(request):
    """Every part that runs claims 1 and 11's matched baselines (the stdlib part has no depth-12 group)."""
    return _study(request.param)


def test_wide_baseline_has_tmms_parameters(study):
    _, v, common, vocab = study
    wide, tmm = size("baseline", common + v["WIDE"], vocab), size("tmm", common, vocab)
    assert abs(wide["params"] / tmm["params"] - 1) < 0.01


def test_cem_size_baseline_has_cems_parameters(any_part):
    _, v, common, vocab = any_part
    small, cem = size("baseline", common + v["CEM_SIZE"], vocab), size("cem", common, vocab)
    assert abs(small["non_embedding"] / cem["non_embedding"] - 1) < 0.01  # cemtool archs --match-params


def test_flop_tokens_are_the_fewest_steps_past_limes_flops(any_part):
    _, v, common, vocab = any_part
    base, lime = size("baseline", common, vocab), size("lime", common, vocab)
    tokens, flop_tokens = int(common[common.index("--tokens") + 1]), int(v["FLOP_TOKENS"])
    step = int(option(common, "train.batch_size")) * int(option(common, "data.seq_len"))
    assert flop_tokens % step == 0
    assert base["flops_train"] * flop_tokens >= lime["flops_train"] * tokens
    assert base["flops_train"] * (flop_tokens - step) < lime["flops_train"] * tokens


def test_depth12_has_the_parameters_of_depth4(study):
    _, v, common, vocab = study
    deep, shallow = size("baseline", common + v["DEPTH12"], vocab), size("baseline", common, vocab)
    assert deep["n_layer"] == 12
    assert abs(deep["non_embedding"] / shallow["non_embedding"] - 1) < 0.01


def test_late_lowrank_75_has_three_quarters_of_the_attention_budget(study):
    _, v, common, vocab = study
    low = size("baseline", common, vocab, (f"model.head_dims={v['LOWRANK_75']}",))
    uniform = size("baseline", common, vocab)
    assert low["attn_budget"] == pytest.approx(0.75 * uniform["attn_budget"])


def test_stdlib_part_is_the_20_tokens_per_parameter_regime():
    """The stdlib part: >= 20 training tokens per parameter for every architecture it trains at the common size
    (its embeddings included), the wide baseline at tmm's parameters, the zero-initialised streams at the
    baseline's, late-lowrank-75 at 75% of the attention budget, and whole steps."""
    v = part("stdlib")
    common, vocab = v["COMMON"], int(option(v["COMMON"], "data.bpe_vocab_size"))
    tokens = int(common[common.index("--tokens") + 1])
    step = int(option(common, "train.batch_size")) * int(option(common, "data.seq_len"))
    assert tokens % step == 0
    archs = ["baseline", "tmm", "hb", "nesterov", "adam", "adamw", "rmsprop", "muon", "ortho", "lime", "cem",
             "cem-rec2", "cem-precond", "cem-dplr", "cem-full"]
    sizes = {a: size(a, common, vocab)["params"] for a in archs}
    assert min(tokens / p for p in sizes.values()) >= 20, sizes
    assert tokens / sizes["tmm"] < 20.5  # no more than needed: the largest model sets the budget
    wide = size("baseline", common + v["WIDE"], vocab)["params"]
    assert abs(wide / sizes["tmm"] - 1) < 0.001
    zero = size("tmm", common + v["ZERO"], vocab)["params"]
    assert zero == pytest.approx(sizes["baseline"], rel=0.005)  # + the streams' 544 mixing coefficients
    low = size("baseline", common, vocab, (f"model.head_dims={v['LOWRANK_75']}",))
    assert low["attn_budget"] == pytest.approx(0.75 * size("baseline", common, vocab)["attn_budget"])


def test_stdlib_refined_grid_values_are_the_sqrt2_steps_and_the_edge_rule_is_on():
    """The stdlib part's refinement (stop 51): the x sqrt(2) values on either side of the refined choices (both
    chose 8e-3: 4e-3 -> 5.66e-3 below it, 8e-3 -> 1.13e-2 above it, to three figures), absent from the factor-2
    grid; a third tuning seed for both refined groups; (stop 52) the edge rule of grid_edge.py, which gives
    nesterov-zero the next doubling its hand-written grid had, and (stop 53) its refinement rule
    (test_grid_edge.py)."""
    body = re.search(r"^stdlib\(\) \{\n(.*?)^\}", SCRIPT, re.S | re.M).group(1)
    grid = re.search(r"local grid=train\.lr=(\S+) ", body).group(1).split(",")
    fine = re.search(r"local fine=\$grid,(\S+) ", body).group(1)
    lrs = [float(x) for x in grid]
    assert all(b == pytest.approx(2 * a) for a, b in zip(lrs, lrs[1:]))  # the factor-2 grid
    assert [float(x) for x in fine.split(",")] == [float(f"{lr * 2 ** 0.5:.3g}") for lr in (4e-3, 8e-3)]
    assert all(float(x) not in lrs for x in fine.split(","))
    assert re.search(r"^\s*EDGE_RULE=1$", body, re.M)
    assert 'group "$o" "$a-zero" "$a" sharpness,forgetting $S "$grid"' in body  # the rule, not a second grid
    for g in ("baseline-wide", "lime-router-abs"):  # a third tuning seed where refined, on the fine grid
        assert re.search(rf'TUNE_SEEDS=\$TUNE_SEEDS,102 group "\$o" {g} \S+ \S+ \$S "\$fine"', body), g


def test_stdlib_six_layer_allocation_groups_are_claim_10s_regime():
    """Claim 10 at 6 layers (its paper's depth): >= 20 tokens per parameter for the 6-layer baseline, whole steps,
    the same width as the part's 4-layer groups, and late-lowrank-75-6 at 75% of the uniform attention budget with
    the early half uniform and the late sizes falling."""
    v = part("stdlib")
    six, vocab = v["SIX"], int(option(v["SIX"], "data.bpe_vocab_size"))
    assert option(six, "model.n_layer") == "6"
    assert [s for s in sets(six) if not s.startswith("model.n_layer=")] == \
        [s for s in sets(v["COMMON"]) if not s.startswith("model.n_layer=")]
    tokens = int(six[six.index("--tokens") + 1])
    assert tokens % (int(option(six, "train.batch_size")) * int(option(six, "data.seq_len"))) == 0
    uniform = size("baseline", six, vocab)
    assert 20 <= tokens / uniform["params"] < 20.2
    for strategy in ("early-heavy", "late-lowrank"):  # the same budget and parameters as uniform
        other = size("baseline", six, vocab, (f"model.alloc_strategy={strategy}",))
        assert other["attn_budget"] == uniform["attn_budget"] and other["params"] == uniform["params"]
    dims = [int(x) for x in v["LOWRANK_75_6"].strip("[]").split(",")]
    low = size("baseline", six, vocab, (f"model.head_dims={v['LOWRANK_75_6']}",))
    assert low["attn_budget"] == pytest.approx(0.75 * uniform["attn_budget"])
    dh = int(option(six, "model.d_model")) // int(option(six, "model.n_head"))
    assert dims[:3] == [dh] * 3 and dims[3:] == sorted(dims[3:], reverse=True) and len(set(dims[3:])) == 3
