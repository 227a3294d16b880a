"""`cemtool compare`: statistics against closed forms and simulation, synthetic reports with known rank order,
a real tiny study compared after its checkpoints are deleted, and bad input."""

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from cemtool.analysis.compare import compare, spearman, welch
from cemtool.config import replace, resolve, to_dict
from cemtool.errors import CemtoolError
from cemtool.sweep import make_plan, run_sweep

from kit import TINY

runner = CliRunner()


def app():
    from cemtool.cli.main import app

    return app


# ---------------------------------------------------------------------- statistics


def test_spearman_known_orders():
    x = [0.1, 0.4, 0.2, 0.9, 0.5, 0.3]
    up = [2 * v + 1 for v in x]
    r = spearman(x, up)
    assert r["rho"] == 1.0 and r["p"] == pytest.approx(2 / math.factorial(6)) and r["p_method"] == "exact permutation"
    assert spearman(x, [-v for v in x])["rho"] == -1.0
    # the exact p-value equals brute force over all orderings of y
    y = [3, 1, 2, 6, 4, 5]
    rho = stats.spearmanr(x, y).statistic
    brute = np.mean([abs(stats.spearmanr(x, p).statistic) >= abs(rho) - 1e-12 for p in itertools.permutations(y)])
    assert spearman(x, y)["rho"] == pytest.approx(rho) and spearman(x, y)["p"] == pytest.approx(brute)
    big = np.random.default_rng(0).normal(size=(2, 15))
    r = spearman(list(big[0]), list(big[1]))
    ref = stats.spearmanr(big[0], big[1])
    assert (r["rho"], r["p"], r["p_method"]) == (pytest.approx(ref.statistic), pytest.approx(ref.pvalue),
                                                 "t approximation")
    assert spearman([1, 2], [1, 2])["rho"] is None and spearman([1, 1, 1], [1, 2, 3])["rho"] is None


def test_welch_interval_formula():
    a, b = [1.2, 0.7, 1.9, 1.1], [0.2, 0.4, 0.1, 0.5, 0.3]
    r = welch(a, b, 0.9)
    va, vb = np.var(a, ddof=1) / 4, np.var(b, ddof=1) / 5
    df = (va + vb) ** 2 / (va ** 2 / 3 + vb ** 2 / 4)  # Welch-Satterthwaite
    half = stats.t.ppf(0.95, df) * math.sqrt(va + vb)
    d = np.mean(a) - np.mean(b)
    assert r["diff"] == pytest.approx(d) and r["df"] == pytest.approx(df)
    assert (r["lo"], r["hi"]) == (pytest.approx(d - half), pytest.approx(d + half))
    assert welch([1.0], [2.0, 3.0])["lo"] is None
    assert welch([1.0, 1.0], [0.5, 0.5]) | {"note": None} == {"diff": 0.5, "lo": 0.5, "hi": 0.5, "df": None,
                                                              "p": None, "n_a": 2, "n_b": 2, "note": None,
                                                              "mde": None}


def test_welch_interval_covers_the_true_difference():
    """Over 2000 constructed experiments (unequal variances and sizes), the 95% interval contains the true
    difference of means about 95% of the time."""
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(2000):
        a, b = rng.normal(1.0, 0.5, size=4), rng.normal(0.3, 0.1, size=6)
        r = welch(list(a), list(b))
        hits += r["lo"] <= 0.7 <= r["hi"]
    assert abs(hits / 2000 - 0.95) < 3 * math.sqrt(0.95 * 0.05 / 2000)


def test_holm_against_a_hand_computation_and_the_family_wise_error_rate():
    from cemtool.analysis.stats import holm

    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> monotone 0.02, 0.03, 0.06, 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.01, None, 0.02]) == [pytest.approx(0.02), None, pytest.approx(0.02)]  # untested: not in the family
    assert holm([0.9, 0.6]) == [1.0, 1.0] and holm([]) == []
    # all nulls true: the chance that any adjusted p falls below 0.05 stays at or below 0.05 (Bonferroni would too;
    # unadjusted it would be 1 - 0.95^6 = 0.26)
    rng = np.random.default_rng(2)
    hits = np.mean([min(holm(list(rng.uniform(size=6)))) < 0.05 for _ in range(4000)])
    assert hits <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)


def test_minimum_detectable_effect_has_the_power_it_claims():
    from cemtool.analysis.stats import welch_mde

    # the textbook value: two groups of 10, SD 1, alpha 0.05 two-sided, 80% power -> d = 1.3249 (Cohen 1988)
    assert welch_mde(1.0, 10, 1.0, 10) == pytest.approx(1.3249, abs=1e-4)
    # exact on the noncentral t for unequal, small groups
    for sd_a, n_a, sd_b, n_b in ((1.0, 2, 3.0, 2), (0.2, 3, 0.05, 5), (1.0, 5, 1.0, 5)):
        va, vb = sd_a ** 2 / n_a, sd_b ** 2 / n_b
        df = (va + vb) ** 2 / (va ** 2 / (n_a - 1) + vb ** 2 / (n_b - 1))
        t_c, nc = stats.t.ppf(0.975, df), welch_mde(sd_a, n_a, sd_b, n_b) / math.sqrt(va + vb)
        assert stats.nct.sf(t_c, df, nc) + stats.nct.cdf(-t_c, df, nc) == pytest.approx(0.8, abs=1e-8)
    # simulated: a true difference of the MDE is detected by Welch's test about 80% of the time
    rng = np.random.default_rng(3)
    d = welch_mde(1.0, 8, 1.0, 8)
    hits = np.mean([stats.ttest_ind(rng.normal(d, 1, 8), rng.normal(0, 1, 8), equal_var=False).pvalue < 0.05
                    for _ in range(3000)])
    assert abs(hits - 0.8) < 0.03
    assert welch_mde(1.0, 1, 1.0, 5) is None and welch_mde(0.0, 3, 0.0, 3) == 0.0
    with pytest.raises(ValueError):
        welch_mde(1.0, 3, 1.0, 3, power=1.0)
    # welch() reports it only beside an unresolved difference, at the interval's own level
    r = welch([1.0, 1.3, 0.8], [1.1, 0.9, 1.2], 0.9)
    assert r["lo"] < 0 < r["hi"] and r["mde"] == pytest.approx(
        welch_mde(np.std([1.0, 1.3, 0.8], ddof=1), 3, np.std([1.1, 0.9, 1.2], ddof=1), 3, alpha=0.1))
    assert welch([5.0, 5.1, 5.2], [1.0, 1.1, 1.2])["mde"] is None


# ---------------------------------------------------------------------- synthetic reports


def fake_run(root: Path, name: str, arch: str, seed: int, val_loss: float, sharp=None, forget=None, target="grammar-b",
             extra=(), collapse=None) -> Path:
    """A run directory holding only what training and the analyses leave as records (no checkpoints)."""
    d = root / name
    (d / "reports").mkdir(parents=True)
    cfg = replace(resolve(arch=arch, overrides=[*TINY, *extra], seed=seed), **{"model.vocab_size": 64,
                                                                               "model.max_seq_len": 16})
    (d / "config.json").write_text(json.dumps(to_dict(cfg)))
    (d / "meta.json").write_text(json.dumps({"status": "completed", "val_loss": val_loss, "tokens": 3840}))
    if sharp is not None:
        lmax, lmin, tr = sharp
        (d / "reports" / "sharpness.json").write_text(json.dumps(
            {"tokens": 512, "eigen": {"top": [lmax, lmax / 2], "bottom": [lmin], "ritz_values": [lmin, lmax]},
             "traces": [{"method": "xtrace", "per_param": tr, "per_param_se": tr / 10}]}))
    if collapse is not None:  # [(value entropy, value probe accuracy) per layer]
        summary = [{"layer": i, "v_entropy": h, "probe_v": acc} for i, (h, acc) in enumerate(collapse)]
        (d / "reports" / "collapse.json").write_text(json.dumps({"runs": [{"summary": summary, "collapse": {
            "layers": [{"layer": i, "probe": {"values": {"accuracy": acc, "chance": 0.25}}}
                       for i, (_, acc) in enumerate(collapse)]}}]}))
    if forget is not None:
        ft = root / f"{name}-ft-{target}"
        (ft / "reports").mkdir(parents=True)
        (ft / "config.json").write_text(json.dumps(to_dict(cfg)))
        (ft / "meta.json").write_text(json.dumps({"status": "completed", "parent": str(d.resolve())}))
        (ft / "reports" / "forgetting.json").write_text(json.dumps(
            {"target": {"data": target}, "forgetting": forget[0], "plasticity": forget[1]}))
    return d


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """baseline and tmm x 3 seeds; forgetting an increasing function of tr(H)/n and of λ_max."""
    root = tmp_path_factory.mktemp("syn")
    tr = {"baseline": [3.0, 3.2, 2.9], "tmm": [1.4, 1.5, 1.6]}
    for arch, seed in itertools.product(("baseline", "tmm"), range(3)):
        t = tr[arch][seed]
        fake_run(root, f"{arch}-s{seed}", arch, seed, 5.0 + 0.1 * seed + (arch == "tmm") * 0.05,
                 sharp=(10 * t, -t / 5, t * 1e-3), forget=(0.25 * t, 0.1 + seed * 0.01))
    return root


def test_synthetic_reports(synthetic):
    p = compare([synthetic])
    assert {a["label"]: a["n"] for a in p["archs"]} == {"baseline": 3, "tmm": 3}
    corr = {c["x"]: c for c in p["correlations"]}
    assert corr["trace_per_param"]["rho"] == 1.0 and corr["lambda_max"]["rho"] == 1.0
    assert corr["trace_per_param"]["p"] == pytest.approx(2 / 720) and corr["trace_per_param"]["n"] == 6
    base = next(a for a in p["archs"] if a["label"] == "baseline")
    assert base["forgetting"]["mean"] == pytest.approx(0.25 * np.mean([3.0, 3.2, 2.9]))
    assert base["forgetting"]["std"] == pytest.approx(0.25 * np.std([3.0, 3.2, 2.9], ddof=1))
    assert base["lambda_min"]["mean"] == pytest.approx(-np.mean([3.0, 3.2, 2.9]) / 5)
    assert base["value_entropy"] is None and base["params"]["mean"] > 0 and base["flops_per_token"]["mean"] > 0
    pair = next(q for q in p["pairwise"] if q["metric"] == "forgetting")
    assert (pair["a"], pair["b"]) == ("baseline", "tmm")
    assert pair["diff"] == pytest.approx(0.25 * (np.mean([3.0, 3.2, 2.9]) - 1.5)) and pair["lo"] < pair["diff"]
    assert len(p["missing"]["collapse"]) == 6 and not p["missing"]["sharpness"] and not p["missing"]["forgetting"]
    assert p["target"] == "grammar-b"


def test_synthetic_cli_and_files(synthetic, tmp_path):
    res = runner.invoke(app(), ["compare", str(synthetic), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    for word in ("baseline", "tmm", "forgetting", "tr(H)/n", "Spearman", "exact permutation", "missing collapse"):
        assert word in res.stdout, word
    payload = json.loads((tmp_path / "c" / "reports" / "compare.json").read_text())
    assert [a["label"] for a in payload["archs"]] == ["baseline", "tmm"]
    csv = (tmp_path / "c" / "compare.csv").read_text().splitlines()
    assert len(csv) == 3 and "forgetting_mean" in csv[0]
    assert (tmp_path / "c" / "compare_runs.csv").read_text().count("\n") == 7
    assert "| baseline | 3 |" in (tmp_path / "c" / "compare.md").read_text()


def test_groups_of_one_arch_get_distinct_labels(tmp_path):
    for seed in range(2):
        fake_run(tmp_path, f"a{seed}", "baseline", seed, 5.0, sharp=(1.0, -0.1, 1e-3))
        fake_run(tmp_path, f"b{seed}", "baseline", seed, 4.0, sharp=(2.0, -0.2, 2e-3), extra=["model.d_model=64"])
    p = compare([tmp_path])
    assert sorted(a["label"] for a in p["archs"]) == ["baseline[model.d_model=32]", "baseline[model.d_model=64]"]
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "baseline[model.d_model=32]" in res.stdout and "baseline[model.d_model=64]" in res.stdout  # not markup


def test_val_loss_at_tokens(tmp_path):
    """--at-tokens: each run's last evaluation at or before N tokens, from metrics.jsonl."""
    for seed in range(2):
        d = fake_run(tmp_path, f"b{seed}", "baseline", seed, 3.0, sharp=(1.0, -0.1, 1e-3))
        rows = [{"step": 1, "tokens": 100, "train_loss": 9.0}] + [
            {"step": s, "tokens": 100 * s, "val_loss": 6.0 - s - 0.1 * seed, "val_floor": 1.0} for s in (1, 2, 3)]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "tok')
    p = compare([tmp_path], at_tokens=250)
    assert [r["val_loss"] for r in p["runs"]] == [4.0, pytest.approx(3.9)] and p["runs"][0]["val_tokens"] == 200
    assert p["archs"][0]["val_loss"]["mean"] == pytest.approx(3.95) and p["at_tokens"] == 250
    assert compare([tmp_path])["runs"][0]["val_loss"] == 3.0  # the final one (meta.json) by default
    early = compare([tmp_path], at_tokens=50)
    assert early["runs"][0]["val_loss"] is None and any("no evaluation at or before 50" in n for n in early["notes"])
    res = runner.invoke(app(), ["compare", str(tmp_path), "--at-tokens", "300", "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "last evaluation at or before 300 training tokens (at 300 tokens)" in res.stdout
    assert "at or before 300" in (tmp_path / "c" / "compare.md").read_text()
    res = runner.invoke(app(), ["compare", str(tmp_path), "--at-tokens", "0", "--out", str(tmp_path / "c")])
    assert res.exit_code == 2 and res.output.startswith("Error: --at-tokens must be a positive")  # a usage error


def test_welch_flags_nearly_identical_values():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing reaches stderr: scipy's warning becomes the note
        r = welch([1.0, 1.0, 1.0 + 1e-15], [0.5, 0.5, 0.5])
    assert "nearly identical" in r["note"]
    r = welch([0.9, 1.0, 0.95], [0.5, 0.6, 0.55])
    assert r["note"] is None


def test_settings_another_family_never_reads_do_not_split_groups(tmp_path):
    """A baseline's model.momentum.stream_init builds the same model: one group. For tmm it is a real setting."""
    fake_run(tmp_path, "b0", "baseline", 0, 5.0, sharp=(1.0, -0.1, 1e-3), extra=["model.momentum.stream_init=zero"])
    fake_run(tmp_path, "b1", "baseline", 1, 5.0, sharp=(1.0, -0.1, 1e-3))
    fake_run(tmp_path, "t0", "tmm", 0, 5.0, sharp=(1.0, -0.1, 1e-3), extra=["model.momentum.stream_init=zero"])
    fake_run(tmp_path, "t1", "tmm", 1, 5.0, sharp=(1.0, -0.1, 1e-3))
    p = compare([tmp_path])
    assert {a["label"]: a["n"] for a in p["archs"]} == {"baseline": 2, "tmm[model.momentum.stream_init=zero]": 1,
                                                        "tmm[model.momentum.stream_init=embed]": 1}


def test_group_labels():
    from cemtool.report import group_labels, run_settings

    cfg = {"seed": 3, "schema_version": 1, "model": {"arch": "baseline", "d_model": 64, "momentum": {"beta": 0.5},
                                                      "lime": {"variant": "static"}}}
    assert run_settings(cfg) == {"model.arch": "baseline", "model.d_model": 64, "model.momentum.beta": 0.5,
                                 "model.lime.variant": "static"}
    assert run_settings(cfg, "baseline") == {"model.arch": "baseline", "model.d_model": 64}
    assert run_settings(cfg, "lime") == {"model.arch": "baseline", "model.d_model": 64, "model.lime.variant": "static"}
    a, b, c = {"x": 1, "y": 2}, {"x": 1, "y": 3}, {"x": 1, "y": 2, "z": 0}
    assert group_labels(["p", "p", "q"], [a, a, b]) == ["p", "p", "q"]
    assert group_labels(["p", "p", "p"], [a, b, a]) == ["p[y=2]", "p[y=3]", "p[y=2]"]
    assert group_labels(["p", "p"], [a, c]) == ["p[z=None]", "p[z=0]"]  # a key only one group has
    # a size left at 0 shows the size the model derived from it (the MLP's width: the model's own rule)
    from cemtool.models.layers import mlp_hidden
    base = {"model.d_model": 64, "model.mlp": "swiglu", "model.n_head": 4, "model.head_dim": 0}
    wide, auto = {**base, "model.mlp_hidden": 224}, {**base, "model.mlp_hidden": 0}
    assert group_labels(["b", "b"], [wide, auto]) == ["b[model.mlp_hidden=224]",
                                                      f"b[model.mlp_hidden={mlp_hidden(64, 'swiglu', 0)}(auto)]"]
    assert mlp_hidden(64, "swiglu", 0) == 176 and mlp_hidden(64, "gelu", 0) == 256
    narrow = {**base, "model.head_dim": 8}
    assert group_labels(["b", "b"], [narrow, base]) == ["b[model.head_dim=8]", "b[model.head_dim=16(auto)]"]
    # three groups of one name that differ in four settings: the label names what tells each apart, and never two
    # groups alike (the first three sorted differences alone would merge the first two: the bug this pins)
    g1 = {"a": 1, "b": 1, "c": 1, "t": 100}
    g2 = {"a": 1, "b": 1, "c": 1, "t": 200}
    g3 = {"a": 2, "b": 2, "c": 2, "t": 100}
    labels = group_labels(["p"] * 3, [g1, g2, g3])
    assert len(set(labels)) == 3
    assert labels == ["p[a=1,t=100]", "p[t=200]", "p[a=2]"]


def test_several_targets_need_a_choice(tmp_path):
    fake_run(tmp_path, "r0", "baseline", 0, 5.0, forget=(0.1, 0.2))
    fake_run(tmp_path, "r1", "baseline", 1, 5.0, forget=(0.3, 0.4), target="pydoc")
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 1 and "several targets (grammar-b, pydoc)" in res.output
    p = compare([tmp_path], target="pydoc")
    assert [r["forgetting"] for r in p["runs"]] == [None, 0.3]


def test_per_layer_collapse_measures(tmp_path):
    """Per-layer value entropy and separability: mean / std over seeds per layer and Welch intervals per layer."""
    ent = {"baseline": [[2.0, 1.0, 0.8], [2.1, 1.2, 0.9], [1.9, 1.1, 0.7]],
           "lime": [[2.0, 1.8, 1.9], [2.2, 1.9, 2.0], [2.1, 1.7, 2.1]]}
    for arch, seed in itertools.product(ent, range(3)):
        fake_run(tmp_path, f"{arch}-s{seed}", arch, seed, 5.0,
                 collapse=[(h, 0.9 + 0.01 * seed) for h in ent[arch][seed]])
    p = compare([tmp_path])
    lime = next(a for a in p["archs"] if a["label"] == "lime")
    assert [e["layer"] for e in lime["layers"]] == [0, 1, 2]
    for layer in range(3):
        col = [ent["lime"][s][layer] for s in range(3)]
        assert lime["layers"][layer]["value_entropy"]["mean"] == pytest.approx(np.mean(col))
        assert lime["layers"][layer]["value_entropy"]["std"] == pytest.approx(np.std(col, ddof=1))
        assert lime["layers"][layer]["separability"]["mean"] == pytest.approx(0.91)
    assert lime["value_entropy"]["mean"] == pytest.approx(np.mean([1.9, 2.0, 2.1]))  # the last layer
    rows = {(q["metric"], q["layer"]): q for q in p["pairwise_layers"]}
    assert len(rows) == 6 and all((q["a"], q["b"]) == ("baseline", "lime") for q in rows.values())
    for layer in range(3):
        a = [ent["baseline"][s][layer] for s in range(3)]
        b = [ent["lime"][s][layer] for s in range(3)]
        assert rows[("value_entropy", layer)] == {"metric": "value_entropy", "layer": layer, "a": "baseline",
                                                  "b": "lime", **welch(a, b)}
    assert rows[("value_entropy", 2)]["hi"] < 0 < rows[("value_entropy", 0)]["hi"]
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "H(values) L2" in res.stdout and "per layer" in res.stdout
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "## Per layer" in md and "| value_entropy | 2 | baseline | lime |" in md
    csv = (tmp_path / "c" / "compare_layers.csv").read_text().splitlines()
    assert len(csv) == 7 and csv[0].startswith("arch,layer,value_entropy_mean")


# ---------------------------------------------------------------------- a real tiny study, checkpoints deleted


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("cmp") / "study"
    plan = make_plan("baseline,tmm", "0,1", tokens=20 * 8 * 16, overrides=TINY, analyses="forgetting",
                     options={"forgetting": {"steps": 4, "eval_every": 2}})
    run_sweep(out, plan, device="cpu")
    for ck in out.rglob("*.safetensors"):
        ck.unlink()
    return out


def test_real_study_from_reports_alone(study):
    res = runner.invoke(app(), ["compare", str(study)])
    assert res.exit_code == 0, res.output
    assert "missing sharpness report: 4 of 4 runs" in res.stdout
    p = json.loads((study / "reports" / "compare.json").read_text())
    assert (study / "compare.md").exists() and (study / "compare.csv").exists()
    m = json.loads((study / "study.json").read_text())
    for a in p["archs"]:
        items = [i for i in m["items"] if i["arch"] == a["label"]]
        reports = [json.loads((study / i["analyses"]["forgetting"]["report"]).read_text()) for i in items]
        assert a["n"] == 2 and a["seeds"] == [0, 1]
        assert a["val_loss"]["mean"] == pytest.approx(np.mean([i["val_loss"] for i in items]))
        assert a["forgetting"]["mean"] == pytest.approx(np.mean([r["forgetting"] for r in reports]))
        assert a["plasticity"]["std"] == pytest.approx(np.std([r["plasticity"] for r in reports], ddof=1))
        assert a["flops_per_token"]["mean"] == items[0]["flops_per_token"] and a["lambda_max"] is None
    # the study's figures: validation curves averaged per group, with the comparison's groups
    res = runner.invoke(app(), ["plot", str(study), "--no-each-run", "-q"])
    assert res.exit_code == 0, res.output
    assert (study / "plots" / "training_groups.png").exists() and (study / "plots" / "compare.png").exists()
    assert "![training_groups](plots/training_groups.png)" in (study / "report.md").read_text()
    # a fine-tune run stands for its parent; a plain run is a row
    q = compare([study / "baseline-s0-ft-grammar-b", study / "tmm-s1"])
    assert [(r["arch"], r["seed"]) for r in q["runs"]] == [("baseline", 0), ("tmm", 1)]
    assert q["runs"][1]["forgetting"] is not None              # found beside its parent


def test_bad_input_one_line(study, tmp_path):
    plain = fake_run(tmp_path / "plain", "r", "baseline", 0, 5.0)  # trained, never analysed
    cases = [(["compare", str(tmp_path / "nope")], "does not exist"),
             (["compare", str(tmp_path / "plain" / "r" / "reports")], "holds no runs"),
             (["compare", str(plain)], "no analysis reports found for the 1 run(s)"),
             (["compare", str(study / "tmm-s0"), "--target", "pydoc"], "no analysis reports")]
    usage = [(["compare", str(study), "--level", "1.5"], "confidence level")]  # a bad option value: exit 2
    for args, message in cases + usage:
        res = runner.invoke(app(), [*args, "--out", str(tmp_path / "o")])
        assert res.exit_code == (2 if (args, message) in usage else 1), (args, res.output)
        assert res.output.startswith("Error:") and message in res.output.splitlines()[0], res.output


# ---------------------------------------------------------------------- bits per byte, named reports, settings


@pytest.fixture
def no_compute(monkeypatch):
    """Parameters and FLOPs are not under test here: skip building the models (seconds on a shared CPU)."""
    import cemtool.analysis.run_records as mod  # collect() calls it there

    monkeypatch.setattr(mod, "run_compute", lambda cfg: {"params": 1000, "non_embedding": 800,
                                                         "flops_per_token": 6000, "flops_forward_per_token": 2000})


def test_bits_per_byte_and_perplexity_beside_the_loss(tmp_path, no_compute):
    """val_bpb as training wrote it (eval rows of metrics.jsonl), val_ppl = exp(val_loss), with intervals; a run
    from before bits per byte were recorded gives null and a note."""
    bpb = {"a0": 1.50, "a1": 1.54, "a2": 1.52, "b0": 1.40, "b1": 1.41, "b2": 1.39}
    for name, v in bpb.items():
        d = fake_run(tmp_path, name, "baseline" if name[0] == "a" else "tmm", int(name[1]), 3.0 + v,
                     sharp=(1.0, -0.1, 1e-3))
        rows = [{"step": s, "tokens": 100 * s, "val_loss": 3.0 + v + 1 / s, "val_bpb": v + 0.5 / s} for s in (1, 2)]
        rows.append({"step": 3, "tokens": 300, "val_loss": 3.0 + v, "val_bpb": v})
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = compare([tmp_path])
    got = {Path(r["run"]).name: r for r in p["runs"]}
    assert all(got[n]["val_bpb"] == v and got[n]["val_ppl"] == pytest.approx(math.exp(3.0 + v)) for n, v in bpb.items())
    arch = {a["label"]: a for a in p["archs"]}
    assert arch["baseline"]["val_bpb"]["mean"] == pytest.approx(1.52) and arch["tmm"]["val_bpb"]["n"] == 3
    pair = next(q for q in p["pairwise"] if q["metric"] == "val_bpb")
    assert pair["diff"] == pytest.approx(0.12) and pair["lo"] < 0.12 < pair["hi"]
    early = {Path(r["run"]).name: r for r in compare([tmp_path], at_tokens=150)["runs"]}
    assert early["a0"]["val_bpb"] == pytest.approx(2.0) and early["a0"]["val_ppl"] == pytest.approx(math.exp(5.5))
    assert not any("bits per byte" in n for n in p["notes"])
    fake_run(tmp_path, "old", "baseline", 9, 4.5, sharp=(1.0, -0.1, 1e-3))  # no val_bpb anywhere
    p = compare([tmp_path])
    old = next(r for r in p["runs"] if r["run"].endswith("old"))
    assert old["val_bpb"] is None and old["val_ppl"] == pytest.approx(math.exp(4.5))
    assert any("bits per byte unknown for 1 run(s) (old)" in n for n in p["notes"])
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "c")])
    assert res.exit_code == 0 and "val bits/byte" in res.stdout and "val perplexity" in res.stdout


def sharpness_report(tokens: int, lmax: float, **options) -> dict:
    return {"provenance": {"analysis": "sharpness", "backend": "cemtool", "checkpoint": "final.safetensors"},
            "options": {"params": "all", "lanczos_steps": 20, "device": "cpu", **options}, "tokens": tokens,
            "eigen": {"top": [lmax], "bottom": [-lmax / 10]}, "traces": []}



def test_no_top_eigenvalues_gives_null_lambda_max_not_a_ritz_value(tmp_path, no_compute):
    """A sharpness report measured with --top-k 0 (bottom eigenvalues only) has Ritz values but no λ_max: compare
    shows null and says why, rather than the largest (unconverged) Ritz value; λ_min is still read."""
    for seed in range(2):
        d = fake_run(tmp_path, f"r{seed}", "baseline", seed, 5.0)
        rep = sharpness_report(1024, 1.0, top_k=0)
        rep["eigen"] = {"top": [], "bottom": [-0.5], "ritz_values": [-0.5, 0.3, 7.0], "bottom_converged": [True]}
        (d / "reports" / "sharpness.json").write_text(json.dumps(rep))
    p = compare([tmp_path])
    assert [r["lambda_max"] for r in p["runs"]] == [None, None]
    assert [r["lambda_min"] for r in p["runs"]] == [-0.5, -0.5]
    assert any("λ_max is null for 2 run(s)" in n and "--top-k 0" in n for n in p["notes"])
    assert not any("λ_min is null" in n for n in p["notes"])

def test_named_reports_and_mismatched_settings(tmp_path, no_compute):
    """compare reads the named report asked for, lists the others, and flags (or with strict refuses) reports
    measured with different settings; device and batch size do not count."""
    for seed, tokens in enumerate((1024, 1024, 4096)):
        d = fake_run(tmp_path, f"r{seed}", "baseline", seed, 5.0)
        (d / "reports" / "sharpness.json").write_text(json.dumps(sharpness_report(tokens, 1.0 + seed,
                                                                                  device=f"cuda:{seed}")))
        (d / "reports" / "sharp-4k.json").write_text(json.dumps(sharpness_report(4096, 10.0 + seed, batch_size=seed)))
        (d / "reports" / "sharpness-layer-0.json").write_text(json.dumps(sharpness_report(1024, 0.1, params="layer:0")))
    p = compare([tmp_path])
    assert [r["lambda_max"] for r in p["runs"]] == [1.0, 2.0, 3.0]
    assert not any("sharpness-layer-0" in n for n in p["notes"])  # another parameter subset: not an alternative
    assert p["mismatch"] == {"sharpness": {"tokens": {"1024": ["r0", "r1"], "4096": ["r2"]}}}
    assert any("different settings: tokens: 1024 (r0, r1), 4096 (r2)" in n for n in p["notes"])
    assert any("sharpness reports not compared: sharp-4k" in n for n in p["notes"])
    with pytest.raises(CemtoolError, match="different settings"):
        compare([tmp_path], strict=True)
    named = compare([tmp_path], names={"sharpness": "sharp-4k"}, strict=True)
    assert [r["lambda_max"] for r in named["runs"]] == [10.0, 11.0, 12.0] and named["mismatch"] == {}
    other = [n for n in named["notes"] if n.startswith("sharpness reports not compared")]
    assert other and "did you mean" not in other[0]  # every run has the report read: nothing to suggest
    assert named["reports"]["sharpness"] == "sharp-4k"
    assert all(r["settings"]["sharpness"]["tokens"] == 4096 for r in named["runs"])
    res = runner.invoke(app(), ["compare", str(tmp_path), "--sharpness", "sharp-4k", "-q", "--out",
                                str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert "comparison of" not in res.stdout and "wrote" in res.stdout  # -q: no tables
    assert "not compared: sharpness" in res.stdout  # the notes still show
    res = runner.invoke(app(), ["compare", str(tmp_path), "--strict", "--out", str(tmp_path / "c")])
    assert res.exit_code == 1 and res.output.count("Error:") == 1 and "tokens: 1024" in res.output
    res = runner.invoke(app(), ["compare", str(tmp_path), "--collapse", "../x", "--out", str(tmp_path / "c")])
    assert res.exit_code == 1 and res.output.count("Error:") == 1


def test_collapse_reports_with_different_options_are_flagged(tmp_path, no_compute):
    for seed, alpha in enumerate((0.5, 1.0)):
        d = fake_run(tmp_path, f"r{seed}", "baseline", seed, 5.0, collapse=[(2.0, 0.5)])
        rep = json.loads((d / "reports" / "collapse.json").read_text())
        rep["provenance"] = {"command": "collapse-report", "checkpoint": str(d / "checkpoints" / "final.safetensors"),
                             "options": {"tokens": 2048, "alpha": alpha, "device": "cpu", "checkpoint": "final"}}
        (d / "reports" / "collapse.json").write_text(json.dumps(rep))
    p = compare([tmp_path])
    assert p["mismatch"] == {"collapse": {"alpha": {"0.5": ["r0"], "1.0": ["r1"]}}}


def test_tables_of_a_compare_json_written_before_bits_per_byte(tmp_path, no_compute):
    """A compare.json from an older cemtool has no val_bpb/val_ppl: its tables (and so `cemtool plot`) still work."""
    from cemtool.analysis.compare_tables import arch_table, flat_arch_rows

    d = fake_run(tmp_path, "r0", "baseline", 0, 5.0)
    (d / "reports" / "sharpness.json").write_text(json.dumps(sharpness_report(1024, 1.0)))
    p = compare([tmp_path])
    for a in p["archs"]:
        a.pop("val_bpb"), a.pop("val_ppl")
    cols, rows = arch_table(p)
    assert "val loss" in cols and "val bits/byte" not in cols
    assert flat_arch_rows(p)[0]["val_bpb_mean"] is None


# ---------------------------------------------------------------------- issue 20 item 19: what a comparison flags


def test_duplicate_seeds_are_flagged_and_refused_with_strict(tmp_path, no_compute):
    """Two runs of one architecture with the same seed are a repeat, not two samples: the comparison says so (its
    note, the group's duplicate_seeds, the runs cell) and --strict refuses it."""
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        fake_run(tmp_path, name, "baseline", seed, 5.0 + 0.1 * (name == "c"), sharp=(1.0, -0.1, 1e-3))
    fake_run(tmp_path, "t", "tmm", 0, 5.0, sharp=(1.0, -0.1, 1e-3))
    p = compare([tmp_path])
    base = next(a for a in p["archs"] if a["label"] == "baseline")
    assert base["n"] == 3 and base["seeds"] == [0, 0, 1] and base["duplicate_seeds"] == [0]
    assert next(a for a in p["archs"] if a["label"] == "tmm")["duplicate_seeds"] == []
    assert any(n.startswith("baseline: 2 runs share seed 0 (a, b)") for n in p["notes"]), p["notes"]
    with pytest.raises(CemtoolError, match="share seed 0"):
        compare([tmp_path], strict=True)
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "3 (seed 0 x2)" in res.stdout and "note: baseline: 2 runs share seed 0" in res.stdout
    assert "share seed 0" in (tmp_path / "o" / "compare.md").read_text()
    res = runner.invoke(app(), ["compare", str(tmp_path), "--strict", "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and res.output.startswith("Error: baseline: 2 runs share seed 0")


def test_one_spread_named_in_every_table(tmp_path, no_compute):
    """The tables, compare.md and report.md name the one spread they show: the std over seeds (ddof 1)."""
    from cemtool.plots.report_md import compare_section
    from cemtool.report import SPREAD

    for arch, seed in itertools.product(("baseline", "tmm"), range(2)):
        fake_run(tmp_path, f"{arch}{seed}", arch, seed, 5.0 + 0.1 * seed, sharp=(1.0 + seed, -0.1, 1e-3))
    p = compare([tmp_path])
    assert "sample standard deviation" in SPREAD
    res = runner.invoke(app(), ["compare", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 0 and f"comparison of 4 runs ({SPREAD})" in res.stdout
    assert SPREAD[1:] in (tmp_path / "o" / "compare.md").read_text() and SPREAD in compare_section(p)
    lam = next(a for a in p["archs"] if a["label"] == "tmm")["lambda_max"]
    assert lam["std"] == pytest.approx(np.std([1.0, 2.0], ddof=1))  # not / sqrt(n)


def test_a_probe_at_its_ceiling_is_flagged(tmp_path, no_compute):
    """A value probe at accuracy 1.000 in every layer of every run cannot tell architectures apart: a note says so
    for that group only (and report.md's comparison section carries the comparison's notes)."""
    from cemtool.plots.report_md import compare_section

    for seed in range(2):
        fake_run(tmp_path, f"b{seed}", "baseline", seed, 5.0, collapse=[(2.0 + seed, 1.0), (1.5, 1.0)])
        fake_run(tmp_path, f"t{seed}", "tmm", seed, 5.0, collapse=[(2.0, 1.0), (1.5, 0.8 + 0.1 * seed)])
    p = compare([tmp_path])
    ceiling = [n for n in p["notes"] if "at its ceiling" in n]
    assert len(ceiling) == 1 and ceiling[0].startswith("baseline: the value probe is at its ceiling"), p["notes"]
    assert "at its ceiling" in compare_section(p)


def test_negative_curvature_larger_than_lambda_max_is_flagged(tmp_path, no_compute):
    """A sharpness report with |λ_min| > λ_max (not near a minimum) is named in a note, and its report.md section
    says so; |λ_min| < λ_max says nothing."""
    from cemtool.plots.report_md import negative_curvature_note

    fake_run(tmp_path, "neg", "baseline", 0, 5.0, sharp=(1.0, -3.0, 1e-3))
    fake_run(tmp_path, "pos", "baseline", 1, 5.0, sharp=(3.0, -1.0, 1e-3))
    notes = [n for n in compare([tmp_path])["notes"] if "|λ_min| > λ_max" in n]
    assert notes == [notes[0]] and "for 1 run(s) (neg)" in notes[0]
    assert "|λ_min| = 3.0000 > λ_max = 1.0000" in negative_curvature_note({"top": [1.0], "bottom": [-3.0]})
    assert negative_curvature_note({"top": [3.0], "bottom": [-1.0]}) == ""
    assert negative_curvature_note({"top": [], "bottom": [-1.0]}) == ""


def test_a_mistyped_report_name_gets_did_you_mean(tmp_path, no_compute):
    """Issue 20 item 22: --sharpness sharpnes finds no report; the error (or the note) names the close one."""
    for seed in range(2):
        fake_run(tmp_path, f"r{seed}", "baseline", seed, 5.0, sharp=(1.0, -0.1, 1e-3))
    with pytest.raises(CemtoolError) as e:
        compare([tmp_path], names={"sharpness": "sharpnes"})
    assert e.value.hint == "did you mean 'sharpness'?"
    fake_run(tmp_path, "r2", "baseline", 2, 5.0, collapse=[(2.0, 0.5)])  # something to compare: a note instead
    notes = compare([tmp_path], names={"sharpness": "sharpnes"})["notes"]
    assert any("compare reads 'sharpnes': did you mean 'sharpness'?" in n for n in notes), notes


def test_operators_never_share_a_column_and_the_runs_standing_and_total_trace_are_shown(tmp_path, no_compute):
    """Reports of different curvature operators are refused in one comparison (a GGN λ_max is not a Hessian
    λ_max); the stationarity verdicts are counted in a note; when the runs' n differ the total trace is shown and
    a note says to read it beside tr/n."""
    for seed, (op, n) in enumerate((("hessian", 100), ("hessian", 115))):
        d = fake_run(tmp_path, f"r{seed}", "baseline" if seed == 0 else "tmm", seed, 5.0)
        for name, operator in (("sharpness", op), ("sharpness-ggn", "ggn")):
            rep = sharpness_report(1024, 1.0 + seed, operator=operator)
            rep.update(n_params=n, standing={"verdict": "not stationary"},
                       traces=[{"trace": 2.0 * n, "se": 1.0, "per_param": 2.0, "per_param_se": 0.01}])
            (d / "reports" / f"{name}.json").write_text(json.dumps(rep))
    p = compare([tmp_path])
    assert [r["trace"] for r in p["runs"]] == [200.0, 230.0] and [r["curvature_n"] for r in p["runs"]] == [100, 115]
    assert any("2 not stationary" in n and "no run is certified a minimum" in n for n in p["notes"])
    assert any("dimensions n differ (100 to 115" in n for n in p["notes"])
    assert "trace" in p["metrics"]
    ggn = compare([tmp_path], names={"sharpness": "sharpness-ggn"})
    assert any("of the ggn operator, not the Hessian" in n for n in ggn["notes"])
    (tmp_path / "r1" / "reports" / "sharpness.json").write_text(
        (tmp_path / "r1" / "reports" / "sharpness-ggn.json").read_text())
    with pytest.raises(CemtoolError, match="different operators"):
        compare([tmp_path])


def test_curvature_fields_name_their_operator_and_carry_the_scale_invariant_sharpness():
    """A sharpness report's fields for compare: the adaptive (ASAM) and SAM sharpness beside the trace (the first
    of each kind; null when not measured), and column labels with the operator's symbol."""
    from cemtool.analysis.run_records import METRICS, metric_labels, sharpness_fields

    rep = {"eigen": {"top": [3.0], "top_converged": [True]}, "traces": [{"trace": 12.0, "per_param": 0.5}],
           "n_params": 24, "options": {"operator": "ggn"},
           "sharpness": [{"kind": "sam", "value": 0.02}, {"kind": "asam", "value": 0.03},
                         {"kind": "asam", "value": 9.0}, {"kind": "average", "value": 0.01}]}
    f = sharpness_fields(rep)
    assert (f["asam"], f["sam"], f["trace"], f["curvature_n"], f["curvature_operator"]) == (0.03, 0.02, 12.0, 24,
                                                                                             "ggn")
    assert sharpness_fields({"eigen": {}})["asam"] is None  # not measured: null, never 0
    labels = metric_labels("ggn")
    assert labels["trace_per_param"] == "tr(G)/n" and labels["trace"] == "tr(G)" and labels["asam"].startswith(
        "adaptive sharpness")
    assert metric_labels()["trace"] == "tr(H)" == METRICS["trace"]
    keys = list(METRICS)
    assert keys.index("trace") + 1 == keys.index("asam")  # named next to the trace
