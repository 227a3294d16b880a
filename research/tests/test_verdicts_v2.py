"""research/scripts/verdicts_v2.py: the re-issued verdicts' tests against scipy, the Holm family, the outcome and
verdict rules on hand-made numbers (each able to fail: a swapped sign, a missing minimum), and the rows it writes
from the committed records."""

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from cemtool.analysis.stats import holm, t_mde

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import verdicts_v2 as V  # noqa: E402  (research/scripts, as findings.py imports it)


def test_paired_difference_is_scipys_paired_t_with_its_mde():
    rng = np.random.default_rng(0)
    a, b = rng.normal(3.3, 0.02, 5), rng.normal(3.35, 0.02, 5)
    t = V.difference("a − b", V.Values(a, range(5)), V.Values(b, range(5)))
    ref = stats.ttest_rel(a, b)
    ci = ref.confidence_interval(0.95)
    assert (t.est, t.lo, t.hi, t.p) == pytest.approx((np.mean(a - b), ci.low, ci.high, ref.pvalue), rel=1e-9)
    assert t.mde == pytest.approx(t_mde(np.std(a - b, ddof=1) / np.sqrt(5), 4)) and "paired" in t.unit


def test_welch_difference_and_tost():
    rng = np.random.default_rng(1)
    a, b = list(rng.normal(0.003, 0.004, 6)), list(rng.normal(0.0, 0.005, 7))
    t = V.difference("a − b", a, b, margin=0.01)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert t.p == pytest.approx(ref.pvalue, rel=1e-9) and t.kind == "equivalence"
    p_low = stats.ttest_ind(np.add(a, 0.01), b, equal_var=False, alternative="greater").pvalue
    p_high = stats.ttest_ind(np.subtract(a, 0.01), b, equal_var=False, alternative="less").pvalue
    assert t.p_tost == pytest.approx(max(p_low, p_high), rel=1e-9)
    ci90 = ref.confidence_interval(0.90)
    assert (t.lo90, t.hi90) == pytest.approx((ci90.low, ci90.high), rel=1e-9)


def test_holm_family_counts_primary_tests_only():
    tests = [V.Test("a", -1.0, p=0.01), V.Test("b", -1.0, p=0.04), V.Test("c", 1.0, p=0.03, primary=False),
             V.Test("d", 0.5, p=0.02)]
    V.holm_family(tests)
    want = holm([0.01, 0.04, 0.02])
    assert [tests[i].p_holm for i in (0, 1, 3)] == pytest.approx(want)
    assert tests[2].p_holm == pytest.approx(min(1.0, 0.03 * 4))  # a second reading: shown, not counted


def test_outcomes_follow_the_claimed_sign():
    t = V.Test("x", -0.1, p=0.001, p_holm=0.004)
    assert t.outcome() == "reproduced"
    t.est = 0.1  # the deliberately wrong sign: the same p now resolves the opposite
    assert t.outcome() == "opposite"
    assert V.Test("x", -0.1, p=0.2, p_holm=0.6).outcome() == "unresolved"
    eq = V.Test("x", 0.002, kind="equivalence", margin=0.01, p=0.6, p_tost=0.001, p_holm=0.01)
    assert eq.outcome() == "equivalent"
    worse = V.Test("x", 0.05, kind="equivalence", margin=0.01, p=0.001, p_tost=0.9, p_holm=1.0,
                   extra={"p_holm_difference": 0.004})
    assert worse.outcome() == "worse" and V.WORDS["worse"] == "worse, resolved"  # (not "by more than the margin":
    # a difference resolved from 0 need not exceed the margin)


def test_an_equivalence_test_shows_both_ps_and_a_second_reading_reads_its_difference_as_a_primary_does():
    """The TOST p (equivalence) and the difference's p, both Holm-adjusted, are printed; a second reading of an
    equivalence test is 'worse, resolved' or 'better, resolved' from its difference's p adjusted as one more member
    of the family, as a second reading of a directional test is read from its own adjusted p."""
    a, b = V.Values([3.10, 3.12, 3.11, 3.13, 3.12], range(5)), V.Values([3.00, 3.01, 3.02, 3.00, 3.01], range(5))
    prim = V.difference("primary", a, b, margin=0.01)
    second = V.difference("second", a, b, margin=0.01, primary=False)
    other = V.Test("other", -0.1, p=0.2)
    V.holm_family([prim, second, other])
    # the second family: the part's primaries with the difference p in place of the TOST p (not the equivalence
    # tests alone, which left it nearly uncorrected), and a second reading as one more member of the family
    assert prim.extra["p_holm_difference"] == pytest.approx(holm([prim.p, other.p])[0])
    assert prim.extra["p_holm_difference"] > prim.p  # corrected for the other member
    assert second.extra["p_holm_difference"] == pytest.approx(min(1.0, second.p * 3))
    assert prim.outcome() == second.outcome() == "worse"
    assert f"p_Holm {prim.p_holm:.2g} equivalence, {prim.extra['p_holm_difference']:.2g} difference" in prim.text()
    assert "difference" not in other.text()


def test_claim6_without_a_minimum_is_not_testable_as_stated():
    tests = [V.Test("tr/n", -1e-4, p=0.001, p_holm=0.01, extra={"standing": {"not stationary": 40}}),
             V.Test("tr", -10.0, p=0.2, p_holm=0.9, primary=False)]
    v = V.verdict("6", tests)
    assert v.startswith("not testable as stated (no model certified at a minimum: 40 not stationary)")
    assert "lower tr(H)/n at the end of training: reproduced" in v and "total trace: not resolved" in v
    tests[0].extra["standing"] = {"minimum": 40}
    assert not V.verdict("6", tests).startswith("not testable")


def test_correlation_over_means_is_spearman_of_the_means():
    rng = np.random.default_rng(2)
    groups = {str(g): [(g + rng.normal(0, 0.1), 2 * g + rng.normal(0, 0.1)) for _ in range(4)] for g in range(6)}
    t = V.correlation_over_means("rho", groups)
    means = {g: np.mean(v, axis=0) for g, v in groups.items()}
    assert t.est == pytest.approx(stats.spearmanr([m[0] for m in means.values()],
                                                  [m[1] for m in means.values()]).statistic)
    assert t.lo <= t.est <= t.hi and "6 architecture means" in t.unit


def _findings(monkeypatch, claims):
    spec = importlib.util.spec_from_file_location("findings", SCRIPTS / "findings.py")
    F = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(F)
    monkeypatch.setitem(F.PART_CLAIMS, "toy", [getattr(F, c) for c in claims])
    return F


def test_router_controls_are_extra_rows_of_claims_11_and_12_where_the_part_ran_them(tmp_path, monkeypatch):
    """The LIMe router controls (the reference's router lr, a frozen router) are second readings of claims 11 and
    12: paired differences against lime and the baseline, shown where the part ran them, leaving the primary
    tests, their Holm p and the verdicts as they were."""
    F = _findings(monkeypatch, ["claim11", "claim12"])
    rng = np.random.default_rng(3)

    def runs(loss, entropy):
        return [{"seed": s, "val_loss": float(v), "layers": [{"layer": 0, "value_entropy": 9.0},
                                                              {"layer": 1, "value_entropy": float(e)}]}
                for s, (v, e) in enumerate(zip(loss, entropy, strict=True))]

    base, flops, lime, ctl = (rng.normal(m, 0.02, 5) for m in (3.0, 3.0, 2.95, 3.1))
    e_base, e_lime, e_ctl = (rng.normal(m, 0.05, 5) for m in (1.0, 1.5, 1.2))
    p = F.Part(tmp_path, "toy")
    p.groups = {("core", "baseline"): runs(base, e_base), ("core", "lime"): runs(lime, e_lime),
                ("baseline-lime-flops", "baseline"): runs(flops, e_base)}
    before = V.reissue(p, F, tmp_path, "toy")
    assert [len(r["tests"]) for r in before] == [1, 2]  # no control run: no control row
    p.groups[("lime-router-abs", "lime")] = runs(ctl, e_ctl)
    after = V.reissue(p, F, tmp_path, "toy")
    t11, t12 = ({t.name: t for t in r["tests"]} for r in after)
    c = t11["control: lime, router at lr 1e-2 − lime"]
    ref = stats.ttest_rel(ctl, lime)
    assert not c.primary and (c.est, c.p) == pytest.approx((np.mean(ctl - lime), ref.pvalue), rel=1e-9)
    assert t11["control: lime, router at lr 1e-2 − baseline"].est == pytest.approx(np.mean(ctl - base))
    e = t12["control: lime, router at lr 1e-2 − lime, value entropy"]
    assert not e.primary and e.est == pytest.approx(np.mean(e_ctl - e_lime))
    for b, a in zip(before, after, strict=True):  # the primary tests and the verdicts are untouched
        assert a["verdict"] == b["verdict"]
        assert [t.p_holm for t in a["tests"] if t.primary] == [t.p_holm for t in b["tests"]]


def test_the_regime_leaves_the_models_at_initialisation_out_of_its_ranges(tmp_path):
    """regime(): the init study's runs (one step at lr 0) are counted apart, not in the tokens-per-parameter span."""
    def run(name, tokens, params):
        d = tmp_path / name
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"tokens": tokens, "params": {"total": params}, "epochs": 0.5}))
        return {"run": str(d), "seed": 0}

    p = SimpleNamespace(groups={("core", "baseline"): [run("a", 2000, 100), run("b", 3000, 100)],
                                ("init", "baseline"): [run("c", 20, 100)]})
    r = V.regime(p)
    assert (r["runs"], r["at_init"], r["tokens"], r["tokens_per_param"]) == (2, 1, "2,000–3,000", "20.00–30.00")
    assert "| toy | 2 (+1 at initialisation) | 2,000–3,000 |" in "\n".join(V.regime_markdown({"toy": r}))


def test_the_momentum_group_at_the_baselines_lr_is_a_second_reading_of_claims_6_to_8(tmp_path, monkeypatch):
    """momentum-shared-lr (every momentum architecture at the baseline's tuned lr): claims 6 and 7 gain the class
    difference at that lr (architecture means vs the baseline's seeds: scipy's Welch t), claim 8 the Spearman ρ
    over the architecture means at that lr (scipy's), and the primary tests and verdicts stay as they were; the
    study's runs are not read as the architectures' own-lr runs."""
    F = _findings(monkeypatch, ["claim6", "claim7", "claim8"])
    rng = np.random.default_rng(5)

    def runs(tr, fg):
        return [{"seed": s, "trace_per_param": float(a), "trace": float(a) * 1e5, "forgetting": float(b),
                 "plasticity": 1.0, "forgetting_curve": [[0.0, 0.0], [1.0, float(b)]], "val_loss": 3.0, "lr": 4e-3}
                for s, (a, b) in enumerate(zip(tr, fg, strict=True))]

    own = ["hb", "nesterov", "tmm", "adam"]
    p = F.Part(tmp_path, "toy")
    p.groups = {("core", "baseline"): runs(rng.normal(1.0, 0.05, 5), rng.normal(0.3, 0.02, 5))}
    for k, a in enumerate(own):
        p.groups[(a, a)] = runs(rng.normal(0.5 + 0.1 * k, 0.05, 5), rng.normal(0.1 + 0.02 * k, 0.02, 5))
    before = V.reissue(p, F, tmp_path, "toy")
    shared = {a: (rng.normal(0.8 - 0.1 * k, 0.05, 5), rng.normal(0.25 - 0.03 * k, 0.02, 5)) for k, a in enumerate(own)}
    for a, (tr, fg) in shared.items():
        p.groups[("momentum-shared-lr", a)] = runs(tr, fg)
    after = V.reissue(p, F, tmp_path, "toy")
    t6, t7, t8 = ({t.name: t for t in r["tests"]} for r in after)
    for t, metric, k in ((t6["at the baseline's lr: momentum − vanilla, tr(H)/n"], "trace_per_param", 0),
                         (t7["at the baseline's lr: momentum − vanilla, forgetting"], "forgetting", 1)):
        means = [float(np.mean(v[k])) for v in shared.values()]
        base = [r[metric] for r in p.groups[("core", "baseline")]]
        ref = stats.ttest_ind(means, base, equal_var=False)
        assert not t.primary and (t.est, t.p) == pytest.approx((np.mean(means) - np.mean(base), ref.pvalue),
                                                               rel=1e-9)
    means = [float(np.mean(tr)) for tr, _ in shared.values()]
    base = [r["trace_per_param"] for r in p.groups[("core", "baseline")]]
    r8 = t8["at the baseline's lr: ρ(tr(H)/n, forgetting) over architecture means"]
    xs = [np.mean(base)] + means
    ys = [np.mean([r["forgetting"] for r in p.groups[("core", "baseline")]])] + [float(np.mean(f))
                                                                                for _, f in shared.values()]
    assert not r8.primary and r8.est == pytest.approx(stats.spearmanr(xs, ys).statistic)
    for b, a in zip(before, after, strict=True):  # the own-lr tests and the verdicts are untouched
        assert a["verdict"] == b["verdict"]
        assert [(t.name, t.est) for t in a["tests"] if t.primary] == [(t.name, t.est) for t in b["tests"]
                                                                       if t.primary]


def test_claim_4_counts_vanilla_once_where_it_is_the_lowest_other(tmp_path, monkeypatch):
    """Claim 4 tests tmm against the lowest other architecture and against vanilla; where vanilla is the lowest
    other they are one test, named once and counted once in the Holm family (stop 51's stdlib table listed it
    twice); where another architecture is lower, both are tested."""
    F = _findings(monkeypatch, ["claim4"])
    rng = np.random.default_rng(9)

    def reissue(means):
        p = F.Part(tmp_path, "toy")
        p.groups = {("core" if a == "baseline" else a, a):
                    [{"seed": s, "val_loss": float(v)} for s, v in enumerate(rng.normal(m, 0.01, 5))]
                    for a, m in means.items()}
        return V.reissue(p, F, tmp_path, "toy")[0]

    low = reissue({"baseline": 3.00, "tmm": 3.02, "nesterov": 3.05, "hb": 3.06, "adam": 3.07, "adamw": 3.08})
    assert [t.name for t in low["tests"]] == ["tmm − baseline (the lowest other, and vanilla)"]
    t = low["tests"][0]
    assert t.p_holm == pytest.approx(t.p)  # a family of one
    assert low["verdict"].startswith("not reproduced (tmm ranks 2 of 6")
    other = reissue({"baseline": 3.10, "tmm": 3.02, "nesterov": 3.00, "hb": 3.06, "adam": 3.07, "adamw": 3.08})
    assert [t.name for t in other["tests"]] == ["tmm − nesterov (the lowest other)", "tmm − vanilla"]
    assert other["tests"][1].outcome() == "reproduced" and other["verdict"].startswith("not reproduced")


def test_claim_10_is_tested_at_6_layers_once_its_four_groups_have_run(tmp_path, monkeypatch):
    """Claim 10 at 6 layers (the paper's depth): with all four 6-layer groups finished, its primary test is the
    6-layer late-lowrank at 75% − uniform (paired by seed), and the 4-layer tests become second readings; with
    three of the four, nothing changes."""
    F = _findings(monkeypatch, ["claim10"])
    rng = np.random.default_rng(7)

    def runs(loss):
        return [{"seed": s, "val_loss": float(v)} for s, v in enumerate(loss)]

    p = F.Part(tmp_path, "toy")
    p.groups = {(s, "baseline"): runs(rng.normal(m, 0.02, 5)) for s, m in
                (("core", 3.0), ("late-lowrank-75", 3.1), ("early-heavy", 3.05), ("late-lowrank", 3.02))}
    four = V.reissue(p, F, tmp_path, "toy")[0]
    assert [t.name for t in four["tests"] if t.primary] == ["late-lowrank at 75% − uniform"]
    six = {s: rng.normal(m, 0.02, 5) for s, m in
           (("uniform-6", 2.9), ("late-lowrank-75-6", 2.905), ("early-heavy-6", 2.95), ("late-lowrank-6", 2.97))}
    for s in list(six)[:3]:
        p.groups[(s, "baseline")] = runs(six[s])
    assert [(t.name, t.est) for t in V.reissue(p, F, tmp_path, "toy")[0]["tests"]] == \
        [(t.name, t.est) for t in four["tests"]]
    p.groups[("late-lowrank-6", "baseline")] = runs(six["late-lowrank-6"])
    row = V.reissue(p, F, tmp_path, "toy")[0]
    prim = [t for t in row["tests"] if t.primary]
    assert [t.name for t in prim] == ["at 6 layers: late-lowrank at 75% − uniform"]
    ref = stats.ttest_rel(six["late-lowrank-75-6"], six["uniform-6"])
    assert (prim[0].est, prim[0].p) == pytest.approx((np.mean(six["late-lowrank-75-6"] - six["uniform-6"]),
                                                      ref.pvalue), rel=1e-9)
    names = [t.name for t in row["tests"]]
    assert "at 4 layers: late-lowrank at 75% − uniform" in names and len(names) == 6
    assert row["verdict"].startswith(("reproduced", "not reproduced"))


def test_the_regime_reads_a_run_on_another_corpus_apart(tmp_path):
    """regime(..., other): a study on another corpus (the harder grammar's check) is left out of the part's ranges
    and listed with its gap to that corpus's floor."""
    def run(name, tokens, params, source, loss=None, floor=None):
        d = tmp_path / name
        d.mkdir()
        (d / "meta.json").write_text(json.dumps({"tokens": tokens, "params": {"total": params}, "epochs": 0.5,
                                                 "corpus": {"source": source}}))
        return {"run": str(d), "seed": 0, "val_loss": loss, "val_floor": floor}

    p = SimpleNamespace(groups={("core", "baseline"): [run("a", 2000, 100, "stdlib")],
                                ("grammar-hard-check", "baseline"): [run("b", 9000, 100, "grammar-hard", 3.5, 3.24)]})
    r = V.regime(p, {"grammar-hard-check"})
    assert (r["runs"], r["tokens"], r["tokens_per_param"]) == (1, "2,000", "20.00")
    (c,) = r["checks"]
    assert c["gap"] == pytest.approx(0.26) and c["tokens_per_param"] == 90 and c["data"] == "grammar-hard"
    md = "\n".join(V.regime_markdown({"toy": r}))
    assert "toy/grammar-hard-check (baseline, seed 0, on grammar-hard; not in the row above): 90.0 tokens" in md
    assert "0.2600 nats above it." in md
    assert V.regime(p)["runs"] == 2  # without ``other``: every run counts


def test_the_lag1_probe_is_a_second_reading_of_claim_12_where_the_part_ran_it(tmp_path, monkeypatch):
    """Claim 12's separability from the lag-1 context probe (the runs' collapse-lag1 reports, layers >= 1): a paired
    difference lime − baseline shown where both groups have the report, not deciding the verdict while the
    input-token probe is a test; where that probe reads the same in every run of both (at its ceiling), it is no
    test and the lag-1 reading takes its place in the family."""
    F = _findings(monkeypatch, ["claim12"])
    rng = np.random.default_rng(11)

    def runs(sep, lag0=0.7, entropy=None):
        entropy = [1.0] * len(sep) if entropy is None else entropy
        def layer(k, e, v):
            return {"layer": k, "value_entropy": float(e), "separability": float(v)}

        return [{"seed": s, "val_loss": 3.0, "layers": [layer(0, 1.0, lag0), layer(1, e, v), layer(2, e, v)]}
                for s, (v, e) in enumerate(zip(sep, entropy, strict=True))]

    base, lime = rng.normal(0.84, 0.01, 5), rng.normal(0.90, 0.01, 5)
    e_base, e_lime = rng.normal(1.0, 0.05, 5), rng.normal(1.01, 0.05, 5)  # a value entropy that is a test
    ref = stats.ttest_rel(lime, base)
    name = "lime − baseline, separability of the token one back (lag-1 probe)"
    for first, primary in ((rng.normal(0.97, 0.01, 5), False), ([1.0] * 5, True)):
        p = F.Part(tmp_path, "toy")
        p.groups = {("core", "baseline"): runs(first, entropy=e_base),
                    ("core", "lime"): runs([1.0] * 5, entropy=e_lime)}
        before = V.reissue(p, F, tmp_path, "toy")[0]
        p.lag1 = {("core", "baseline"): runs(base, lag0=0.0), ("core", "lime"): runs(lime, lag0=0.0)}
        after = V.reissue(p, F, tmp_path, "toy")[0]
        t = {t.name: t for t in after["tests"]}[name]
        assert t.primary is primary and (t.est, t.p) == pytest.approx((np.mean(lime - base), ref.pvalue), rel=1e-9)
        assert len(after["tests"]) == len(before["tests"]) + 1
        sep = {t.name: t for t in after["tests"]}["lime − baseline, separability"]
        assert sep.identical() is primary and (sep.outcome() == "no test") is primary and sep.primary is not primary
        if not primary:
            assert after["verdict"] == before["verdict"]
        else:  # the lag-1 reading decides in its place
            assert t.outcome() == "reproduced" and f"{name}: reproduced" in after["verdict"]
            assert before["verdict"].startswith("not reproduced") or before["verdict"].startswith("mixed")
            assert "lime − baseline, separability: no test" in before["verdict"]  # without it: named as untested
            assert "lime − baseline, separability:" not in after["verdict"]  # replaced
    p.lag1 = {("core", "baseline"): runs([0.9] * 5, lag0=0.0), ("core", "lime"): runs([0.9] * 5, lag0=0.0)}
    degenerate = {t.name: t for t in V.reissue(p, F, tmp_path, "toy")[0]["tests"]}  # a lag-1 no better: no swap
    assert degenerate["lime − baseline, separability"].primary and not degenerate[name].primary


def test_identical_arms_are_no_test_and_leave_the_family():
    """Every run equal on both sides (a measure at its ceiling): no p, no MDE, outcome 'no test', not in Holm's
    family; a difference of equal constants that are not zero apart (every pair +0.1) stays a test (p 0)."""
    same = V.difference("ceiling", V.Values([1.0] * 5, range(5)), V.Values([1.0] * 5, range(5)), sign=1)
    assert same.identical() and same.p is None and same.mde is None and same.outcome() == "no test"
    assert same.text() == "ceiling +0.000 (the arms equal run for run: no test, 5 seeds, paired)"
    real = V.difference("real", V.Values([1.0, 2.0, 3.0], range(3)), V.Values([0.5, 1.0, 2.5], range(3)))
    V.holm_family([same, real])
    assert real.p_holm == pytest.approx(real.p) and same.p_holm is None  # a family of one
    shifted = V.difference("shift", V.Values([1.1] * 3, range(3)), V.Values([1.0] * 3, range(3)), sign=1)
    assert not shifted.identical() and shifted.p == 0.0
    eq = V.difference("eq", V.Values([2.0] * 3, range(3)), V.Values([2.0] * 3, range(3)), margin=0.01)
    assert eq.identical() and eq.family_p() is None and V.WORDS[eq.outcome()].startswith("no test")


def test_numbers_print_with_enough_digits_for_their_interval():
    """An interval narrower than 10^-3 gets the decimals that keep its ends apart in print (stop 51's table read
    -0.004 [-0.004, -0.004]); wider ones keep 3 decimals; tiny estimates print in scientific notation."""
    t = V.Test("tr", -0.00413, -0.00425, -0.00401)
    assert t.text() == "tr -0.00413 [-0.00425, -0.00401]"
    assert V.Test("loss", 0.018, -0.032, 0.068).text() == "loss +0.018 [-0.032, +0.068]"
    assert V.Test("mid", 0.003, 0.001, 0.005).text() == "mid +0.003 [+0.001, +0.005]"  # 0.004 wide: 3 decimals
    assert V.Test("lag", 3.19e-4, -1.91e-2, 1.97e-2).text() == "lag +3.19e-04 [-1.91e-02, +1.97e-02]"
    narrow = V.Test("n", 0.0040012, 0.0040010, 0.0040014).text()  # 4e-7 wide: more significant digits
    lo, hi = narrow.split("[")[1].rstrip("]").split(", ")
    assert lo != hi and "e-03" in narrow
    assert V.Test("z", 0.0, -1e-9, 1e-9).text() == "z +0.00e+00 [-1.00e-09, +1.00e-09]"  # not 10 zeros
    assert V.Test("inf", 0.5, -math.inf, math.inf).text() == "inf +0.500 [-inf, +inf]"
    assert V.Test("nan", math.nan, math.nan, math.nan).text() == "nan +nan [+nan, +nan]"


def test_a_verdict_never_counts_a_test_of_identical_arms_as_reproduced():
    """A degenerate primary test is the untested part of its claim: named in the verdict, which it keeps from
    'reproduced'; a claim whose every primary test is degenerate is 'no test'."""
    ok = V.Test("a", -0.1, -0.2, -0.05, p=0.001, p_holm=0.001)
    same = V.difference("b", V.Values([1.0] * 3, range(3)), V.Values([1.0] * 3, range(3)))
    assert ok.outcome() == "reproduced"
    assert V.verdict("11", [ok, same]) == "mixed (a: reproduced; b: no test (the arms equal run for run))"
    assert V.verdict("11", [same]).startswith("no test (b: no test")
    same.primary = False  # replaced by another reading: shown, not deciding
    assert V.verdict("11", [ok, same]) == "reproduced"


def test_stdlib_claim_9_reads_its_long_sweep_and_its_controls_apart(tmp_path, monkeypatch):
    """The stdlib part's claim 9: the primary tests come from the 4-head sweep trained 3,000 steps
    (saturation-rope-heads-long), the fall of the returns per seed by hand; each control sweep the part ran is a
    second reading (its fall at the longest T), also before the long sweep exists."""
    F = _findings(monkeypatch, [])
    rng = np.random.default_rng(13)
    dims, lens, seeds = [2, 4, 8, 16], [16, 64], [0, 1, 2]

    def sweep(name, shift):
        loss = {(t, d, s): 2.0 - 0.1 * (t / 64) * np.log2(d) ** 0.5 + shift + rng.normal(0, 0.01)
                for t in lens for d in dims for s in seeds}
        d = tmp_path / "stdlib" / name / "reports"
        d.mkdir(parents=True)
        (d / "saturation_sweep.json").write_text(json.dumps({"results": [
            {"seq_len": t, "head_dim": h, "seed": s, "val_loss": v} for (t, h, s), v in loss.items()]}))
        return loss

    ctl = sweep("saturation-nope", 0.5)
    before = V.saturation_tests(F, tmp_path, "stdlib")
    assert before[0].est is None and before[0].primary and len(before) == 2
    fall_ctl = [(ctl[(64, 2, s)] - ctl[(64, 4, s)]) - (ctl[(64, 8, s)] - ctl[(64, 16, s)]) for s in seeds]
    assert not before[1].primary and before[1].name.startswith("control, no positions")
    assert before[1].est == pytest.approx(np.mean(fall_ctl), rel=1e-12)
    main = sweep("saturation-rope-heads-long", 0.0)
    tests = V.saturation_tests(F, tmp_path, "stdlib")
    fall = [(main[(64, 2, s)] - main[(64, 4, s)]) - (main[(64, 8, s)] - main[(64, 16, s)]) for s in seeds]
    assert tests[0].primary and tests[0].est == pytest.approx(np.mean(fall), rel=1e-12)
    assert tests[0].p == pytest.approx(stats.ttest_1samp(fall, 0.0).pvalue, rel=1e-9)
    assert [t.primary for t in tests] == [True, True, False, False, False]
    assert tests[-1].est == pytest.approx(np.mean(fall_ctl), rel=1e-12)


def test_a_claim_a_part_cuts_says_not_run_with_why_and_one_waiting_for_runs_says_not_run_yet(monkeypatch):
    """findings.CUT (stdlib claim 13: depth 12 is out of the budget) turns the claim's missing tests and its verdict
    into "not run (why)"; a claim of the same part whose runs are pending, and a cut claim that has an estimate
    after all, keep their own words; the parts' agreement treats "not run" as no verdict, as "not run yet"."""
    rows = [{"claim": "13", "tests": [V.Test("(lime − baseline) at 12 minus at 4", None)]},
            {"claim": "11", "tests": [V.Test("lime − baseline", None)]},
            {"claim": "2", "tests": [V.Test("rec2 − cem", -0.05, p=0.001, p_holm=0.004)]}]
    for r in rows:
        r["verdict"] = V.verdict(r["claim"], r["tests"])
    assert [r["verdict"] for r in rows] == ["not run yet", "not run yet", "reproduced"]
    V.mark_cut(rows, {"13": "depth 12 is cut", "2": "a cut that ran"})
    assert rows[0]["verdict"] == "not run (depth 12 is cut)"
    assert rows[0]["tests"][0].text() == "(lime − baseline) at 12 minus at 4: not run (depth 12 is cut)"
    assert rows[0]["tests"][0].outcome() == "not run"
    assert rows[1]["verdict"] == "not run yet" and rows[1]["tests"][0].text() == "lime − baseline: not run yet"
    assert rows[2]["verdict"] == "reproduced"  # an estimate is read as usual
    F = _findings(monkeypatch, [])
    out = {"grammar": {"rows": [{"claim": "13. x", "verdict": "not reproduced (no difference resolved)"}]},
           "stdlib": {"rows": [{"claim": "13. x", "verdict": "not run"}]}}
    assert F.agreement(out)[0]["same"] is None and F.verdict_class("not run") == "not run"
    assert "13" in F.CUT["stdlib"]
