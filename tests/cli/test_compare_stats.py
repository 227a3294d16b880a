"""cemtool compare's statistics for a study's claims: TOST beside the intervals, correlations across architecture
means with the two-level bootstrap, partial correlations given covariates, forgetting at matched plasticity, and
factorial main effects with the architecture as the unit, each against an independent computation on hand-made
run records (no checkpoints), and the CLI's options and one-line errors."""

import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from cemtool.analysis.compare import compare
from cemtool.analysis.stats import at_matched
from cemtool.config import replace, resolve, to_dict
from cemtool.errors import CemtoolError

from kit import TINY

runner = CliRunner()
ARCHS = ["baseline", "hb", "nesterov", "tmm", "adam"]


def app():
    from cemtool.cli.main import app

    return app


def run(root: Path, arch: str, seed: int, lr: float, loss: float, trace: float, curve: list[tuple[float, float]]):
    """A run and its fine-tune: curve = (source loss, target loss) per evaluation, step 0 first."""
    d = root / f"{arch}-s{seed}"
    (d / "reports").mkdir(parents=True)
    cfg = replace(resolve(arch=arch, overrides=[*TINY, f"train.lr={lr}"], seed=seed),
                  **{"model.vocab_size": 64, "model.max_seq_len": 16})
    (d / "config.json").write_text(json.dumps(to_dict(cfg)))
    (d / "meta.json").write_text(json.dumps({"status": "completed", "val_loss": loss, "tokens": 3840}))
    (d / "reports" / "sharpness.json").write_text(json.dumps(
        {"tokens": 512, "eigen": {"top": [trace * 1e4], "bottom": [-1.0]},
         "traces": [{"method": "xtrace", "per_param": trace, "per_param_se": trace / 10}]}))
    ft = root / f"{d.name}-ft-grammar-b"
    (ft / "reports").mkdir(parents=True)
    (ft / "config.json").write_text(json.dumps(to_dict(cfg)))
    (ft / "meta.json").write_text(json.dumps({"status": "completed", "parent": str(d.resolve())}))
    pts = [{"step": 4 * i, "tokens": 0, "source_loss": s, "target_loss": t} for i, (s, t) in enumerate(curve)]
    (ft / "reports" / "forgetting.json").write_text(json.dumps(
        {"target": {"data": "grammar-b"}, "before": {"source_loss": curve[0][0], "target_loss": curve[0][1]},
         "after": {"source_loss": curve[-1][0], "target_loss": curve[-1][1]},
         "forgetting": curve[-1][0] - curve[0][0], "plasticity": curve[0][1] - curve[-1][1], "curve": pts}))


@pytest.fixture(scope="module")
def study(tmp_path_factory, monkeypatch_module):
    """Five architectures x 4 seeds. Each architecture has its own lr and its own fine-tune speed k: forgetting
    and plasticity both grow with k, so forgetting after the fine-tune follows plasticity; at matched plasticity
    every architecture forgets alike (forgetting = 0.5 x plasticity on every curve) except tmm (0.3 x)."""
    root = tmp_path_factory.mktemp("cs")
    rng = np.random.default_rng(0)
    speed = {"baseline": 1.0, "hb": 1.5, "nesterov": 2.0, "tmm": 1.2, "adam": 2.5}
    lrs = {"baseline": 1e-3, "hb": 2e-3, "nesterov": 4e-3, "tmm": 3e-3, "adam": 8e-3}
    for arch in ARCHS:
        for seed in range(4):
            k = speed[arch] * (1 + 0.05 * rng.normal())
            slope = 0.3 if arch == "tmm" else 0.5
            plast = [0.0, 0.1 * k, 0.18 * k, 0.24 * k, 0.28 * k]
            curve = [(3.0 + slope * p, 5.0 - p) for p in plast]
            run(root, arch, seed, lrs[arch], 3.0 + 0.01 * rng.normal() + (0.05 if arch == "adam" else 0.0),
                1e-3 * k * (1 + 0.02 * rng.normal()), curve)
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    import cemtool.analysis.run_records as mod

    mp.setattr(mod, "run_compute", lambda cfg: {"params": 1000, "non_embedding": 800, "flops_per_token": 6000,
                                                "flops_forward_per_token": 2000})
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def payload(study):
    return compare([study], margins={"val_loss": 0.02}, covariates=["plasticity", "lr"],
                   factors={"momentum": (["hb", "nesterov", "tmm"], ["baseline", "adam"])}, n_boot=500)


def test_forgetting_at_matched_plasticity(payload):
    runs = payload["runs"]
    level = payload["matched_plasticity"]["level"]
    assert level == pytest.approx(min(r["plasticity"] for r in runs))  # the lowest peak: every run reaches it
    for r in runs:
        assert r["forgetting_matched"] == pytest.approx((0.3 if r["arch"] == "tmm" else 0.5) * level, rel=1e-9)
        curve = r["forgetting_curve"]
        assert at_matched(curve, level) == pytest.approx(r["forgetting_matched"])
    pair = next(p for p in payload["pairwise"] if p["metric"] == "forgetting_matched"
                and {p["a"], p["b"]} == {"baseline", "tmm"})
    assert pair["diff"] == pytest.approx(0.2 * level * (1 if pair["a"] == "baseline" else -1), rel=1e-6)
    # after the whole fine-tune, the fastest learner forgets most; at matched plasticity baseline = nesterov
    by = {a["label"]: a for a in payload["archs"]}
    assert by["nesterov"]["forgetting"]["mean"] > 1.5 * by["baseline"]["forgetting"]["mean"]
    assert by["nesterov"]["forgetting_matched"]["mean"] == pytest.approx(by["baseline"]["forgetting_matched"]["mean"])


def test_architecture_level_correlation_and_its_bootstrap(payload):
    c = next(c for c in payload["correlations"] if c["x"] == "plasticity" and c["y"] == "forgetting")
    arch = c["arch_level"]
    by = {a["label"]: a for a in payload["archs"]}
    xs = [by[a]["plasticity"]["mean"] for a in ARCHS]
    ys = [by[a]["forgetting"]["mean"] for a in ARCHS]
    assert arch["rho"] == pytest.approx(stats.spearmanr(xs, ys).statistic) and arch["n_archs"] == 5
    assert arch["p_method"] == "exact permutation" and arch["lo"] <= arch["rho"] <= arch["hi"]
    assert arch["n_boot"] == 500 and c["n"] == 20


def test_partial_correlation_given_plasticity(payload):
    c = next(c for c in payload["correlations"] if c["x"] == "trace_per_param")
    assert c["partial"]["given"] == ["lr", "plasticity"] and c["partial"]["n"] == 20
    # trace and forgetting share one cause (k); plasticity measures k too: given it, little is left
    assert abs(c["rho"]) > 0.8 and abs(c["partial"]["rho"]) < abs(c["rho"])
    assert c["partial_arch_level"]["n"] == 5 and c["partial_arch_level"]["note"]  # 5 points, 2 covariates: too few


def test_tost_beside_the_loss_intervals(payload):
    pairs = {frozenset((p["a"], p["b"])): p for p in payload["pairwise"] if p["metric"] == "val_loss"}
    same, apart = pairs[frozenset(("baseline", "hb"))], pairs[frozenset(("baseline", "adam"))]
    assert same["margin"] == 0.02 and same["equivalent"] is True and same["p_tost"] < 0.05
    assert apart["equivalent"] is False
    assert "p_tost" not in next(p for p in payload["pairwise"] if p["metric"] == "forgetting")


def test_main_effect_has_the_architecture_as_its_unit(payload):
    row = next(f for f in payload["factors"] if f["metric"] == "forgetting_matched")
    by = {a["label"]: a for a in payload["archs"]}
    with_ = [by[a]["forgetting_matched"]["mean"] for a in ("hb", "nesterov", "tmm")]
    without = [by[a]["forgetting_matched"]["mean"] for a in ("baseline", "adam")]
    ref = stats.ttest_ind(with_, without, equal_var=False)
    assert row["diff"] == pytest.approx(np.mean(with_) - np.mean(without)) and row["p"] == pytest.approx(ref.pvalue)
    assert row["n_a"] == 3 and row["n_b"] == 2  # architectures, not the 12 and 8 runs
    assert row["boot_lo"] <= row["diff"] <= row["boot_hi"] and row["boot_undefined"] == 0
    assert all("p_holm" in f for f in payload["factors"])


def test_cli_options_and_errors(study, tmp_path):
    res = runner.invoke(app(), ["compare", str(study), "--out", str(tmp_path / "c"), "--margin", "val_loss=0.02",
                                "--covariate", "plasticity", "--factor", "momentum=hb,nesterov,tmm/baseline,adam",
                                "--boot", "200"])
    assert res.exit_code == 0, res.output
    for word in ("architecture means", "TOST", "momentum", "matched plasticity"):
        assert word in res.stdout, word
    md = (tmp_path / "c" / "compare.md").read_text()
    assert "## Main effects" in md and "## Correlations across architecture means" in md
    for args, msg in [(["--margin", "val_loss=-1"], "positive"), (["--margin", "nope=0.1"], "not a compared metric"),
                      (["--margin", "val_loss"], "METRIC=MARGIN"), (["--covariate", "lrr"], "not a run field"),
                      (["--factor", "m=hb,xx"], "no group 'xx'"), (["--boot", "5"], "--boot")]:
        res = runner.invoke(app(), ["compare", str(study), "--out", str(tmp_path / "d"), *args])
        assert res.exit_code in (1, 2) and "Error" in res.output and msg in res.output, (args, res.output)
        assert len(res.output.strip().splitlines()) <= 3  # Error, Hint, and for usage errors the Usage line
    with pytest.raises(CemtoolError):
        compare([study], plasticity_level=-1.0)


def test_frontier_figure_is_the_curves_read_at_common_plasticity(payload, tmp_path):
    """Every curve of the synthetic study has forgetting = 0.5 x plasticity (0.3 for tmm): the frontier's means are
    those lines exactly, its spread zero, and the figure is written."""
    from cemtool.plots.compare import frontier, plot_frontier

    levels, groups = frontier(payload)
    assert levels[0] == 0.0 and levels[-1] == pytest.approx(payload["matched_plasticity"]["level"])
    for label, (mean, sd, n) in groups.items():
        assert mean == pytest.approx((0.3 if label == "tmm" else 0.5) * levels, abs=1e-12) and n == 4
        assert np.allclose(sd, 0.0, atol=1e-12)
    paths = plot_frontier(payload, tmp_path)
    assert paths and all(p.exists() and p.stat().st_size > 1000 for p in paths)
    assert plot_frontier({**payload, "runs": [{**r, "forgetting_curve": None} for r in payload["runs"]]},
                         tmp_path / "none") == []
