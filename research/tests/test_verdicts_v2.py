"""research/scripts/verdicts_v2.py: the re-issued verdicts' tests against scipy, the Holm family, the outcome and
verdict rules on hand-made numbers (each able to fail: a swapped sign, a missing minimum), and the rows it writes
from the committed records."""

import importlib.util
import json
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
                   extra={"p_holm_direction": 0.004})
    assert worse.outcome() == "worse"


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


def test_router_controls_are_extra_rows_of_claims_11_and_12_where_the_part_ran_them(tmp_path, monkeypatch):
    """The LIMe router controls (the reference's router lr, a frozen router) are second readings of claims 11 and
    12: paired differences against lime and the baseline, shown where the part ran them, leaving the primary
    tests, their Holm p and the verdicts as they were."""
    spec = importlib.util.spec_from_file_location("findings", SCRIPTS / "findings.py")
    F = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(F)
    monkeypatch.setitem(F.PART_CLAIMS, "toy", [F.claim11, F.claim12])
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
