"""cemtool.analysis.stats beyond Welch: the TOST equivalence test against scipy's one-sided Welch tests, the partial
Spearman correlation against its closed form and a regression done by hand, the two-level bootstrap against a
hand-written loop and on data where the answer is known, and the matched-abscissa interpolation."""

import math

import numpy as np
import pytest
from scipy import stats

from cemtool.analysis.stats import at_matched, hierarchical_bootstrap, partial_spearman, spearman_of_means, tost


@pytest.mark.parametrize("shift, margin", [(0.0, 0.05), (0.03, 0.05), (0.2, 0.05), (-0.04, 0.1)])
def test_tost_equals_two_one_sided_welch_tests(shift, margin):
    rng = np.random.default_rng(1)
    a, b = list(rng.normal(shift, 0.02, 6)), list(rng.normal(0.0, 0.03, 5))
    res = tost(a, b, margin)
    p_low = stats.ttest_ind(np.add(a, margin), b, equal_var=False, alternative="greater").pvalue
    p_high = stats.ttest_ind(np.subtract(a, margin), b, equal_var=False, alternative="less").pvalue
    assert res["p_tost"] == pytest.approx(max(p_low, p_high), rel=1e-10)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)  # the 90% interval of a 5% TOST
    assert (res["lo90"], res["hi90"]) == pytest.approx((ci.low, ci.high), rel=1e-10)
    assert res["equivalent"] == (-margin < ci.low and ci.high < margin)


def test_tost_can_fail_and_has_its_size():
    """A true difference at the margin is declared equivalent at most ~5% of the time (the test's size)."""
    rng = np.random.default_rng(2)
    hits = sum(tost(list(rng.normal(0.05, 0.02, 5)), list(rng.normal(0, 0.02, 5)), 0.05)["equivalent"]
               for _ in range(2000))
    assert hits / 2000 < 0.05 + 3 * math.sqrt(0.05 * 0.95 / 2000)
    assert tost([1.0, 1.01], [0.0, 0.01], 0.1)["equivalent"] is False
    assert tost([1.0], [0.0, 0.01], 0.1)["p_tost"] is None
    with pytest.raises(ValueError):
        tost([1.0, 2.0], [1.0, 2.0], 0.0)


def test_partial_spearman_one_covariate_is_the_closed_form():
    rng = np.random.default_rng(3)
    z = rng.normal(size=12)
    x, y = z + rng.normal(0, 0.5, 12), z + rng.normal(0, 0.5, 12)
    res = partial_spearman(list(x), list(y), {"lr": list(z)})
    rx, ry, rz = (stats.rankdata(v) for v in (x, y, z))
    r = lambda u, v: np.corrcoef(u, v)[0, 1]  # noqa: E731
    closed = (r(rx, ry) - r(rx, rz) * r(ry, rz)) / math.sqrt((1 - r(rx, rz) ** 2) * (1 - r(ry, rz) ** 2))
    assert res["rho"] == pytest.approx(closed, abs=1e-12) and res["df"] == 9
    t = closed * math.sqrt(9 / (1 - closed ** 2))
    assert res["p"] == pytest.approx(2 * stats.t.sf(abs(t), 9), rel=1e-10)
    assert abs(stats.spearmanr(x, y).statistic) > 0.5 and abs(res["rho"]) < abs(stats.spearmanr(x, y).statistic)


def test_partial_spearman_two_covariates_and_too_few_points():
    rng = np.random.default_rng(4)
    c1, c2 = rng.normal(size=20), rng.normal(size=20)
    x, y = c1 + c2 + rng.normal(0, 0.1, 20), c1 - c2 + rng.normal(0, 0.1, 20)
    res = partial_spearman(list(x), list(y), {"a": list(c1), "b": list(c2)})
    design = np.column_stack([np.ones(20), stats.rankdata(c1), stats.rankdata(c2)])
    hat = design @ np.linalg.pinv(design)
    ex, ey = (np.eye(20) - hat) @ stats.rankdata(x), (np.eye(20) - hat) @ stats.rankdata(y)
    assert res["rho"] == pytest.approx(np.corrcoef(ex, ey)[0, 1], abs=1e-12) and res["df"] == 16
    assert partial_spearman([1.0, 2.0, 3.0], [1.0, 2.0, 3.0], {"a": [1.0, 2.0, 3.0]})["rho"] is None


def test_spearman_of_means_is_scipys_with_and_without_ties():
    rng = np.random.default_rng(3)
    for n, tied in ((5, False), (9, True), (30, True)):
        x, y = rng.normal(size=n), rng.normal(size=n)
        if tied:  # repeated values, as a bootstrap that draws an architecture twice makes
            x[1::3], y[::4] = x[0], y[2]
        m = list(zip(x, y, strict=True))
        assert spearman_of_means(m) == pytest.approx(stats.spearmanr(x, y).statistic, abs=1e-14), (n, tied)
    assert spearman_of_means([(1.0, 2.0), (1.0, 3.0), (1.0, 1.0)]) is None  # a constant side


def test_hierarchical_bootstrap_matches_a_hand_loop():
    groups = {"a": [(1.0, 2.0), (1.2, 2.1)], "b": [(2.0, 1.0), (2.5, 1.4), (2.2, 1.1)], "c": [(3.0, 3.0), (3.3, 2.9)],
              "d": [(4.0, 3.5), (4.1, 3.9)]}
    res = hierarchical_bootstrap(groups, spearman_of_means, n_boot=300, seed=7)
    rng = np.random.default_rng(7)
    names, vals = sorted(groups), []
    for _ in range(300):
        drawn = [names[i] for i in rng.integers(0, 4, size=4)]
        means = []
        for g in drawn:
            runs = np.array(groups[g])
            means.append(runs[rng.integers(0, len(runs), size=len(runs))].mean(axis=0))
        m = np.array(means)
        if np.ptp(m[:, 0]) > 0 and np.ptp(m[:, 1]) > 0 and len(m) >= 3:
            vals.append(stats.spearmanr(m[:, 0], m[:, 1]).statistic)
    assert res["undefined"] == 300 - len(vals)
    assert (res["lo"], res["hi"]) == pytest.approx(tuple(np.quantile(vals, [0.025, 0.975])), abs=1e-12)


def test_hierarchical_bootstrap_is_wider_than_pooling_seeds():
    """Eight architectures with no relation between their means, each with 10 seeds tightly correlated within:
    pooling the 80 runs finds a strong correlation; resampling architectures does not exclude 0."""
    rng = np.random.default_rng(5)
    groups = {}
    for g in range(8):
        cx, cy = rng.normal(), rng.normal()
        e = rng.normal(0, 0.3, 10)
        groups[str(g)] = [(cx + v, cy + v) for v in e]  # within an architecture x and y move together
    res = hierarchical_bootstrap(groups, spearman_of_means, n_boot=1000, seed=0)
    assert res["lo"] < 0 < res["hi"]
    centred = [(x - np.mean([p[0] for p in runs]), y - np.mean([p[1] for p in runs]))
               for runs in groups.values() for x, y in runs]
    assert stats.spearmanr([p[0] for p in centred], [p[1] for p in centred]).statistic > 0.9


def test_at_matched_interpolates_the_first_crossing():
    curve = [(0.0, 0.0), (0.1, 0.02), (0.3, 0.10), (0.25, 0.2), (0.5, 0.3)]
    assert at_matched(curve, 0.2) == pytest.approx(0.02 + 0.08 * 0.5)
    assert at_matched(curve, 0.0) == 0.0 and at_matched(curve, 0.5) == pytest.approx(0.3)
    assert at_matched(curve, 0.6) is None
