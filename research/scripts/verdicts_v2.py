"""The verdicts re-issued from the same records under the second set of rules (research/docs/findings.md "Re-issued
verdicts"): no training, only the statistics changed.

    python research/scripts/findings.py [STUDY]   (writes them beside the first table: findings.md, findings.json)

What changed against the first rules (research/scripts/findings.py):

- **Holm per part.** Every primary test of a part (one or two per claim, named in its row) is one family; a claim
  is resolved by its Holm-adjusted p < 0.05, not by its own interval.
- **Nulls carry their MDE**: an unresolved difference is "not resolved" with the 80%-power minimum detectable
  effect of its own test (noncentral t, cemtool.analysis.stats.t_mde), never "no difference".
- **"Matches" claims are equivalence tests**: two one-sided tests at the margin DELTA = 0.01 nats (TOST; the
  90% interval inside ±DELTA), or a resolved gain; the first rules' one-sided "upper end below DELTA" is kept in the
  first table.
- **The architecture is the unit** where a claim is about a class of architectures (claims 5-8): the class's
  architecture means against vanilla's seeds (Welch), and the factorial main effects of claim 5 over architecture
  means; the first rules pooled every run of the class.
- **Both readings where the metric is a choice**: claim 6 reads tr(H)/n and the total trace, and states where the
  models stand (the stationarity certificate recomputed from each sharpness report's ‖g‖, λ_max and λ_min);
  claim 7 reads forgetting after the fine-tune and at matched plasticity (each fine-tune's curve read where its
  plasticity first reaches the lowest peak plasticity of the runs compared); claim 9 reads the fall of the returns
  with and without d_h = 2 (a 2-dim RoPE head has one rotation frequency: it aliases positions with or without
  saturation).
- **Claim 8 over architecture means**, with the two-level bootstrap (architectures, then seeds) and the partial
  correlation given the learning rate.
- **Claim 4's two tests are one where vanilla is the lowest other** (stop 52): named and counted once in Holm.
- **No test where the arms are equal run for run** (stop 52): a difference whose runs are all equal on both
  sides (a measure at its ceiling: the input-token probe of claim 12 reads 1.000 in every run) has no spread to test
  against; it is shown as "no test (the arms equal run for run)", leaves the Holm family, and has no MDE (the MDE 0
  that a zero standard error gives says nothing about a measure that cannot go higher). Where the part has a second
  reading of the same quantity that is not degenerate (claim 12's lag-1 probe), that reading takes its place in the
  family and the verdict, and the degenerate test is shown as a second reading; where it has none, the degenerate
  test stays in the verdict as the part of the claim that went untested (never counted as reproduced). Fixed after
  the lag-1 reading was known (stdlib +0.0003 [-0.019, +0.020], not resolved); it changes no verdict's outcome.
- **"Not run yet" and "not run (why)"** (stop 53): a test without an estimate waits for its groups ("not run yet"),
  unless its part leaves the claim out by design (findings.CUT, :func:`mark_cut`: stdlib's claim 13, depth 12 being
  out of its budget), where the test and the verdict say "not run" and why. A wording change: no outcome changes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy import stats

from cemtool.analysis.curvature.stationarity import certify
from cemtool.analysis.stats import (
    at_matched,
    hierarchical_bootstrap,
    holm,
    partial_spearman,
    spearman,
    spearman_of_means,
    t_mde,
)

ALPHA = 0.05


class Values(list):
    """A group's values with the seed of each (runs with the same seed saw the same batches in the same order)."""

    def __init__(self, values, seeds):
        super().__init__(values)
        self.seeds = list(seeds)

    def by_seed(self) -> dict[int, float]:
        return dict(zip(self.seeds, self, strict=True))


def same_seeds(*groups) -> bool:
    """Every group is a Values over the same seeds (at least 2), each seed once."""
    if not all(isinstance(g, Values) for g in groups):
        return False
    seeds = [sorted(g.seeds) for g in groups]
    return len(seeds[0]) >= 2 and len(set(seeds[0])) == len(seeds[0]) and all(s == seeds[0] for s in seeds)


@dataclass
class Test:
    """One test of a claim: the estimate, its 95% interval, p, the unit, and what the claim predicts."""

    name: str
    est: float | None
    lo: float | None = None
    hi: float | None = None
    p: float | None = None
    mde: float | None = None
    unit: str = ""
    kind: str = "direction"  # direction | equivalence | correlation
    sign: int = -1  # the claimed sign of the estimate (-1: lower, +1: higher)
    margin: float | None = None  # equivalence margin
    p_tost: float | None = None
    lo90: float | None = None
    hi90: float | None = None
    primary: bool = True  # in the part's Holm family
    p_holm: float | None = None
    extra: dict = field(default_factory=dict)

    def identical(self) -> bool:
        """Every difference between the arms is 0 (paired: each seed's two runs equal; Welch: both arms one and
        the same constant): nothing to test (:func:`difference`)."""
        return bool(self.extra.get("identical"))

    def family_p(self) -> float | None:
        return self.p_tost if self.kind == "equivalence" else self.p

    def resolved(self) -> bool:
        return self.p_holm is not None and self.p_holm < ALPHA

    def outcome(self) -> str:
        """reproduced / opposite / unresolved for directional tests and correlations; equivalent / better / worse /
        unresolved for equivalence tests (after Holm)."""
        if self.est is None:
            return "not run" if self.extra.get("not_run") else "not run yet"
        if self.identical():
            return "no test"
        if self.kind == "equivalence":
            if self.resolved():
                return "equivalent"
            p_dir = self.extra.get("p_holm_difference")  # (a second reading's: adjusted as one more member)
            if p_dir is not None and p_dir < ALPHA:
                return "better" if self.est < 0 else "worse"
            return "unresolved"
        if not self.resolved():
            return "unresolved"
        return "reproduced" if np.sign(self.est) == self.sign else "opposite"

    def number_format(self, digits: int = 3) -> str:
        """d decimals: ``digits``, or more where the 95% interval is narrower than 10^-digits (two significant
        digits of its width, so that its ends differ in print); scientific notation, with as many significant
        digits, for an estimate below 10^-d or where d would exceed 5."""
        width = (self.hi - self.lo) if self.lo is not None and self.hi is not None else 0.0
        d = math.ceil(-math.log10(width)) + 1 if math.isfinite(width) and 0 < width < 10 ** -digits else digits
        if d <= 5 and (self.est == 0 or abs(self.est) >= 10 ** -d):
            return f"{{:+.{d}f}}"
        sig = max(3, math.ceil(math.log10(abs(self.est) / width)) + 2) \
            if math.isfinite(width) and width > 0 and self.est and math.isfinite(self.est) else 3
        return f"{{:+.{sig - 1}e}}"

    def text(self, digits: int = 3) -> str:
        if self.est is None:  # a part's cut (findings.CUT) says why, where the test is not waiting for runs
            return f"{self.name}: " + (f"not run ({self.extra['not_run']})" if self.extra.get("not_run") else
                                       "not run yet")
        f = self.number_format(digits)
        if self.identical():
            return f"{self.name} {f.format(self.est)} (the arms equal run for run: no test" + \
                (f", {self.unit})" if self.unit else ")")
        iv = "" if self.lo is None else f" [{f.format(self.lo)}, {f.format(self.hi)}]"
        bits = [f"{self.name} {f.format(self.est)}{iv}"]
        if self.p_holm is not None and self.extra.get("p_holm_difference") is not None:  # an equivalence test
            bits.append(f"p_Holm {self.p_holm:.2g} equivalence, {self.extra['p_holm_difference']:.2g} difference")
        elif self.p_holm is not None:
            bits.append(f"p_Holm {self.p_holm:.2g}")
        if self.kind == "equivalence" and self.lo90 is not None:
            bits.append(f"90% [{f.format(self.lo90)}, {f.format(self.hi90)}] vs ±{self.margin}")
        if self.outcome() == "unresolved" and self.mde is not None:
            bits.append(f"MDE {self.mde:.2g}")
        if self.unit:
            bits.append(self.unit)
        return "; ".join(bits[:1]) + (" (" + ", ".join(bits[1:]) + ")" if len(bits) > 1 else "")


# --------------------------------------------------------------------------------------------------------------
# the tests


def _t_parts(est: float, se: float, df: float) -> dict:
    if se == 0:
        return {"lo": est, "hi": est, "p": 0.0 if est != 0 else 1.0, "mde": 0.0}
    half = float(stats.t.ppf(0.975, df)) * se
    return {"lo": est - half, "hi": est + half, "p": float(2 * stats.t.sf(abs(est) / se, df)),
            "mde": t_mde(se, df)}


def _se_df(groups: list[np.ndarray], signs: list[int]) -> tuple[float, float]:
    terms = [g.var(ddof=1) / len(g) for g in groups]
    se = math.sqrt(sum(terms))
    df = sum(terms) ** 2 / sum(t ** 2 / (len(g) - 1) for t, g in zip(terms, groups, strict=True)) if se else math.inf
    return se, df


def difference(name: str, a, b, sign: int = -1, unit: str | None = None, margin: float | None = None,
               primary: bool = True) -> Test:
    """mean(a) - mean(b): paired by seed when both are Values of the same seeds, else Welch; with a margin, also the
    TOST equivalence test on the same t (the test's kind is then equivalence)."""
    if len(a) < 2 or len(b) < 2:
        return Test(name, None, sign=sign, primary=primary, kind="equivalence" if margin else "direction",
                    margin=margin)
    if same_seeds(a, b):
        ba, bb = a.by_seed(), b.by_seed()
        d = np.array([ba[s] - bb[s] for s in sorted(ba)])
        est, se, df = float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d))), len(d) - 1
        unit = unit or f"{len(d)} seeds, paired"
    else:
        ga, gb = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        est = float(ga.mean() - gb.mean())
        se, df = _se_df([ga, gb], [1, -1])
        unit = unit or f"Welch, {len(ga)} vs {len(gb)}"
    t = Test(name, est, **_t_parts(est, se, df), unit=unit, sign=sign, primary=primary)
    if se == 0 and est == 0:  # every run equal on both sides: no spread to test against (module docstring)
        t.p, t.mde, t.extra["identical"] = None, None, True
        t.kind, t.margin = ("equivalence", margin) if margin else (t.kind, None)
        return t
    if margin:
        t.kind, t.margin = "equivalence", margin
        if se == 0:
            t.p_tost = 0.0 if abs(est) < margin else 1.0
            t.lo90 = t.hi90 = est
        else:
            t.p_tost = max(float(stats.t.sf((est + margin) / se, df)), float(stats.t.cdf((est - margin) / se, df)))
            half = float(stats.t.ppf(0.95, df)) * se
            t.lo90, t.hi90 = est - half, est + half
    return t


def class_vs(name: str, means: list[float], ref, sign: int = -1, primary: bool = True) -> Test:
    """A class of architectures against one reference architecture with the architecture as the unit: the mean of
    the class's architecture means minus the reference's mean, Welch between the architecture means (k) and the
    reference's seeds."""
    return difference(name, means, list(ref), sign=sign, primary=primary,
                      unit=f"{len(means)} architecture means vs {len(ref)} seeds")


def main_effect(name: str, with_: list[float], without: list[float], sign: int = -1,
                primary: bool = True) -> Test:
    return difference(name, with_, without, sign=sign, primary=primary,
                      unit=f"architectures: {len(with_)} with, {len(without)} without")


def correlation_over_means(name: str, groups: dict[str, list[tuple[float, float]]], covariates=None) -> Test:
    """Spearman's rho over architecture means (exact permutation p up to 9), its two-level bootstrap interval, and
    the partial rho given the covariates (architecture means)."""
    groups = {g: v for g, v in groups.items() if v}
    means = {g: np.mean(v, axis=0) for g, v in groups.items()}
    s = spearman([m[0] for m in means.values()], [m[1] for m in means.values()])
    if s["rho"] is None:
        return Test(name, None, kind="correlation", sign=1)
    boot = hierarchical_bootstrap(groups, spearman_of_means, n_boot=2000, seed=0)
    t = Test(name, s["rho"], boot["lo"], boot["hi"], s["p"], kind="correlation", sign=1,
             unit=f"{len(means)} architecture means, {sum(len(v) for v in groups.values())} runs; interval: "
                  f"two-level bootstrap")
    if covariates:
        names = [g for g in means if all(covariates[c].get(g) is not None for c in covariates)]
        part = partial_spearman([means[g][0] for g in names], [means[g][1] for g in names],
                                {c: [covariates[c][g] for g in names] for c in covariates})
        t.extra["partial"] = part
    return t


def holm_family(tests: list[Test]) -> None:
    """Holm over a part's primary tests (each equivalence test's TOST p; its directional p is adjusted in a
    second family of the same size, for the 'better' / 'worse' readings)."""
    prim = [t for t in tests if t.primary and t.family_p() is not None]
    for t, adj in zip(prim, holm([t.family_p() for t in prim]), strict=True):
        t.p_holm = adj
    # the second family: the same tests, each equivalence test's difference p in place of its TOST p (until stop
    # 52 the code adjusted the difference p among the equivalence tests alone, 2-3 of them: too lenient)
    second = holm([t.p if t.kind == "equivalence" else t.family_p() for t in prim])
    for t, adj in zip(prim, second, strict=True):
        if t.kind == "equivalence":
            t.extra["p_holm_difference"] = adj
    for t in tests:  # second readings: adjusted as if in the family (the family size plus one), shown, not counted
        if not t.primary and t.family_p() is not None:
            t.p_holm = min(1.0, t.family_p() * (len(prim) + 1))
            if t.kind == "equivalence" and t.p is not None:  # its "better" / "worse" reading, as a primary's
                t.extra["p_holm_difference"] = min(1.0, t.p * (len(prim) + 1))


# --------------------------------------------------------------------------------------------------------------
# the claims


SHARED = "momentum-shared-lr"  # the stdlib part's momentum group at the baseline's tuned lr
SIX_LAYERS = ("uniform-6", "late-lowrank-75-6", "early-heavy-6", "late-lowrank-6")  # claim 10 at 6 layers


def _means(p, metric: str, archs: list[str], study: str | None = None) -> dict[str, float]:
    return {a: float(np.mean(v)) for a in archs if len(v := p.values(metric, a, study)) > 0}


def _standing(r: dict) -> str:
    """The stationarity verdict of a run's sharpness report (recomputed from its ‖g‖, λ_max and λ_min when the
    report predates the certificate)."""
    if r.get("standing"):
        return r["standing"]
    if r.get("grad_norm") is None or r.get("lambda_max") is None:
        return "unknown"
    return certify(grad_norm=r["grad_norm"], n=r.get("curvature_n") or r.get("params") or 1, operator="hessian",
                   psd=False, lambda_max=r["lambda_max"], lambda_min=r.get("lambda_min"),
                   lambda_min_error=None).verdict


def reissue(p, F, root, part: str) -> list[dict]:
    """The re-issued rows of one part (``F``: the findings module, for its groups and constants)."""
    rows = []
    mom, van = F.MOMENTUM, "baseline"
    with_m = [a for a in F.WITH_MOMENTUM]
    claims = F.PART_CLAIMS.get(part)
    only = None if claims is None else {c.__name__ for c in claims}

    def want(n: str) -> bool:
        return only is None or n in only

    D = F.DELTA
    # the momentum group at the baseline's tuned lr (the stdlib part, stop 51), where it ran: second readings of
    # claims 6-8 beside each architecture at its own lr (the baseline's comparison is at that lr)
    shared = sum(len(p.values("val_loss", a, SHARED)) >= 2 for a in with_m) >= 2
    if want("claim1"):
        rows.append(("1", [difference("cem − baseline", p.values("val_loss", "cem"), p.values("val_loss", van),
                                      margin=D),
                           difference("cem − baseline of cem's size", p.values("val_loss", "cem"),
                                      p.values("val_loss", van, "baseline-cem-size"), margin=D)]))
    if want("claim2"):
        cem, rec, pre = (p.values("val_loss", a) for a in ("cem", "cem-rec2", "cem-precond"))
        rows.append(("2", [difference("rec2 − cem", rec, cem), difference("rec2 − precond", rec, pre)]))
    if want("claim3"):
        cem = p.values("val_loss", "cem")
        rows.append(("3", [difference("dplr − cem", p.values("val_loss", "cem-dplr"), cem),
                           difference("full − cem", p.values("val_loss", "cem-full"), cem)]))
    if want("claim4"):
        field = _means(p, "val_loss", [van, *mom])
        if "tmm" in field and not F.paper_set_missing(p, "val_loss"):  # the paper's whole set, finished
            best = min((a for a in field if a != "tmm"), key=field.get)
            rank = sorted(field, key=field.get).index("tmm") + 1
            t4 = [difference(f"tmm − {best} (the lowest other)", p.values("val_loss", "tmm"),
                             p.values("val_loss", best))]
            if best != van:  # (where vanilla is the lowest other, the one test is both: counted once in Holm)
                t4.append(difference("tmm − vanilla", p.values("val_loss", "tmm"), p.values("val_loss", van)))
            else:
                t4[0].name = f"tmm − {best} (the lowest other, and vanilla)"
            t4[0].extra["rank"] = f"tmm ranks {rank} of {len(field)}"
            rows.append(("4", t4))
        else:
            rows.append(("4", [Test("tmm − the lowest other", None)]))
    if want("claim5"):
        loss = _means(p, "val_loss", [van, *mom])
        m_with = [loss[a] for a in with_m if a in loss]
        m_without = [loss[a] for a in [van, *F.PRECOND_ONLY] if a in loss]
        pre_with = [loss[a] for a in [*F.PRECOND_ONLY, "adam", "adamw", "soap", "muon"] if a in loss]
        pre_without = [loss[a] for a in [van, *F.MOMENTUM_ONLY] if a in loss]
        rows.append(("5", [main_effect("momentum's main effect", m_with, m_without),
                           main_effect("preconditioning's main effect", pre_with, pre_without, primary=False)]))
    if want("claim6"):
        tr = _means(p, "trace_per_param", with_m)
        tt = _means(p, "trace", with_m)
        t6 = [class_vs("momentum − vanilla, tr(H)/n", list(tr.values()), p.values("trace_per_param", van)),
              class_vs("momentum − vanilla, total tr(H)", list(tt.values()), p.values("trace", van), primary=False),
              difference("tmm − baseline of its size, tr(H)/n", p.values("trace_per_param", "tmm"),
                         p.values("trace_per_param", van, "baseline-wide"), primary=False)]
        runs = [r for a in [van, *with_m] for r in p.runs(a)] + p.runs(van, "baseline-wide")
        verdicts = [_standing(r) for r in runs if (r.get("reports") or {}).get("sharpness")]
        t6[0].extra["standing"] = {v: verdicts.count(v) for v in dict.fromkeys(verdicts)}
        if shared:
            t6.append(class_vs("at the baseline's lr: momentum − vanilla, tr(H)/n",
                               list(_means(p, "trace_per_param", with_m, SHARED).values()),
                               p.values("trace_per_param", van), primary=False))
        rows.append(("6", t6))
    if want("claim7"):
        comp = [van, *with_m]
        curves = {id(r): r.get("forgetting_curve") for a in comp for r in p.runs(a) if r.get("forgetting_curve")}
        level = min(max(x for x, _ in c) for c in curves.values()) if curves else None
        fm = {}
        for a in comp:
            vals = [v for r in p.runs(a) if r.get("forgetting_curve") and level
                    and (v := at_matched(r["forgetting_curve"], level)) is not None]
            if vals:
                fm[a] = vals
        f_means = _means(p, "forgetting", with_m)
        t7 = [class_vs("momentum − vanilla, forgetting", list(f_means.values()), p.values("forgetting", van)),
              class_vs(f"momentum − vanilla, forgetting at plasticity {level:.3g}" if level else
                       "momentum − vanilla, forgetting at matched plasticity",
                       [float(np.mean(fm[a])) for a in with_m if a in fm], fm.get(van, []))]
        groups = {a: [(r["plasticity"], r["forgetting"]) for r in p.runs(a)
                      if r.get("plasticity") is not None and r.get("forgetting") is not None] for a in comp}
        t7.append(correlation_over_means("ρ(plasticity, forgetting) over architecture means", groups))
        t7[2].primary = False
        if shared:
            t7.append(class_vs("at the baseline's lr: momentum − vanilla, forgetting",
                               list(_means(p, "forgetting", with_m, SHARED).values()), p.values("forgetting", van),
                               primary=False))
        rows.append(("7", t7))
    if want("claim8"):
        archs = [van, *mom]
        groups = {a: [(r["trace_per_param"], r["forgetting"]) for r in p.runs(a)
                      if r.get("trace_per_param") is not None and r.get("forgetting") is not None] for a in archs}
        groups["baseline-wide"] = [(r["trace_per_param"], r["forgetting"]) for r in p.runs(van, "baseline-wide")
                                   if r.get("trace_per_param") is not None and r.get("forgetting") is not None]
        lr = {a: float(np.mean([r["lr"] for r in p.runs(a)])) for a in archs if p.runs(a)}
        lr["baseline-wide"] = float(np.mean([r["lr"] for r in p.runs(van, "baseline-wide")])) \
            if p.runs(van, "baseline-wide") else None
        t8 = [correlation_over_means("ρ(tr(H)/n, forgetting) over architecture means", groups, {"lr": lr})]
        if shared:  # every architecture at one lr: no lr to partial out
            at = {a: [(r["trace_per_param"], r["forgetting"]) for r in p.runs(a, SHARED if a != van else None)
                      if r.get("trace_per_param") is not None and r.get("forgetting") is not None]
                  for a in [van, *mom]}
            t8.append(correlation_over_means("at the baseline's lr: ρ(tr(H)/n, forgetting) over architecture means",
                                             {a: g for a, g in at.items() if g}))
            t8[-1].primary = False
        rows.append(("8", t8))
    if only is None:
        rows.append(("9", saturation_tests(F, root, part)))
    if want("claim10"):
        # at 6 layers (the paper's depth; the stdlib part, stop 51) once all four groups have finished: those are the
        # claim's tests, the 4-layer ones second readings (decided before any 6-layer run had finished)
        at6 = all(len(p.values("val_loss", van, s)) >= 2 for s in SIX_LAYERS)
        t10 = []
        for suffix in ("-6", "") if at6 else ("",):  # the first depth read is the primary one
            tag = ("at 6 layers: " if suffix else "at 4 layers: ") if at6 else ""
            uni = p.values("val_loss", van, "uniform-6") if suffix else p.values("val_loss", van)
            t10 += [difference(f"{tag}late-lowrank at 75% − uniform", p.values("val_loss", van,
                                                                              f"late-lowrank-75{suffix}"),
                               uni, margin=D, primary=not t10),
                    difference(f"{tag}early-heavy − uniform", p.values("val_loss", van, f"early-heavy{suffix}"), uni,
                               margin=D, primary=False),
                    difference(f"{tag}late-lowrank − uniform", p.values("val_loss", van, f"late-lowrank{suffix}"), uni,
                               margin=D, primary=False)]
        rows.append(("10", t10))
    # the router controls (where the part ran them): the reference code's absolute router lr, a frozen random router
    controls = [(s, what) for s, what in (("lime-router-abs", "router at lr 1e-2"),
                                          ("lime-frozen", "router frozen at init"))
                if len(p.values("val_loss", "lime", s)) >= 2]
    if want("claim11"):
        lime, base = p.values("val_loss", "lime"), p.values("val_loss", van)
        t11 = [difference("lime − baseline with ≥ LIMe's FLOPs", lime,
                          p.values("val_loss", van, "baseline-lime-flops"))]
        for s, what in controls:
            ctl = p.values("val_loss", "lime", s)
            t11 += [difference(f"control: lime, {what} − lime", ctl, lime, primary=False),
                    difference(f"control: lime, {what} − baseline", ctl, base, primary=False)]
        rows.append(("11", t11))
    if want("claim12"):
        def per_run(arch, metric, study=None, lag1=False):
            rs = [(r["seed"], v) for r in p.runs(arch, study, lag1=lag1)
                  if (v := F._layer_mean(r, metric)) is not None]
            return F.Values([v for _, v in rs], [s for s, _ in rs])

        t12 = [difference("lime − baseline, value entropy (layers ≥ 1)",
                          per_run("lime", "value_entropy"), per_run(van, "value_entropy"), sign=1),
               difference("lime − baseline, separability", per_run("lime", "separability"),
                          per_run(van, "separability"), sign=1)]
        t12 += [difference(f"control: lime, {what} − lime, value entropy", per_run("lime", "value_entropy", s),
                           per_run("lime", "value_entropy"), sign=1, primary=False) for s, what in controls]
        # the probe the baseline does not saturate (where the part ran it): which of k words was one position back,
        # from the values at t (collapse-report --lag 1), layers >= 1
        lag = per_run("lime", "separability", lag1=True), per_run(van, "separability", lag1=True)
        if min(map(len, lag)) >= 2:  # primary in the separability test's place where that one is degenerate
            t = difference("lime − baseline, separability of the token one back (lag-1 probe)", *lag, sign=1,
                           primary=False)
            if t12[1].identical() and not t.identical():  # replaced: shown as a second reading ("no test")
                t.primary, t12[1].primary = True, False
            t12.append(t)
        rows.append(("12", t12))
    if want("claim13"):
        b4, l4 = p.values("val_loss", van), p.values("val_loss", "lime")
        b12, l12 = p.values("val_loss", van, "depth12"), p.values("val_loss", "lime", "depth12")
        dd = F.diff_of_diffs(l4, b4, l12, b12)
        t = Test("(lime − baseline) at 12 minus at 4", None)
        if dd is not None:
            df = dd["n"] - 1 if "n" in dd else dd["df"]  # paired by seed, or Welch over four groups
            se = (dd["hi"] - dd["diff"]) / float(stats.t.ppf(0.975, df))
            t = Test(t.name, dd["diff"], **_t_parts(dd["diff"], se, df),
                     unit=f"{dd['n']} seeds, paired" if dd.get("method") == "paired by seed" else
                     "Welch, four groups")
        rows.append(("13", [t]))
    if want("claim14"):
        prof = F._share_profile(p, None)
        if prof is None:
            rows.append(("14", [Test("last router's share on layer 0 − at init", None, sign=1)]))
        else:
            trained, init = prof
            L = trained.shape[1]
            ids = list(range(len(trained)))
            rows.append(("14", [difference("last router's share on layer 0 − at init", F.Values(trained[:, 0], ids),
                                           F.Values(init[:, 0], ids), sign=1),
                                difference("on layer L-2 − at init", F.Values(trained[:, L - 2], ids),
                                           F.Values(init[:, L - 2], ids), sign=1)]))
    holm_family([t for _, ts in rows for t in ts])
    return [{"claim": n, "tests": ts, "verdict": verdict(n, ts)} for n, ts in rows]


def _sweep_losses(path):
    """A saturation sweep's final losses {(T, d_h): {seed: loss}}, its lengths, head sizes and common seeds."""
    import json

    rep = json.loads((path / "reports" / "saturation_sweep.json").read_text())
    loss: dict = {}
    for r in rep["results"]:
        if r.get("val_loss") is not None and math.isfinite(r["val_loss"]):
            loss.setdefault((r["seq_len"], r["head_dim"]), {})[r["seed"]] = r["val_loss"]
    lens, dims = sorted({t for t, _ in loss}), sorted({d for _, d in loss})
    seeds = sorted(set.intersection(*(set(v) for v in loss.values())))
    return loss, lens, dims, seeds


def _fall(F, sweep, t, ds):
    """fall(T) per seed: (gain of the first doubling of ds) - (gain of the last); ``ds`` None: zero per seed."""
    loss, _, _, seeds = sweep
    return F.Values([0.0 if ds is None else
                     (loss[(t, ds[0])][s] - loss[(t, ds[1])][s]) - (loss[(t, ds[-2])][s] - loss[(t, ds[-1])][s])
                     for s in seeds], list(range(len(seeds))))


def saturation_tests(F, root, part: str) -> list[Test]:
    """Claim 9: the fall of the returns of d_h at the longest T (gain of the first doubling minus gain of the last,
    paired by seed), with every head size and without d_h = 2, and its growth from the shortest to the longest T;
    then, where the part ran them (F.SATURATION_CONTROLS), each control sweep's fall at its longest T, a second
    reading."""
    src = next((d for d in F.saturation_dirs(root, part) if (d / "reports" / "saturation_sweep.json").is_file()), None)
    out = [Test("fall of the returns at the longest T", None, sign=1)]
    if src is not None:
        sw = _sweep_losses(src)
        _, lens, dims, seeds = sw
        zero = _fall(F, sw, None, None)
        out = [difference(f"fall at T = {lens[-1]}, d_h {dims[0]}→{dims[1]} vs {dims[-2]}→{dims[-1]}",
                          _fall(F, sw, lens[-1], dims), zero, sign=1),
               difference(f"the same without d_h = {dims[0]} (d_h {dims[1]}→{dims[2]} vs {dims[-2]}→{dims[-1]})",
                          _fall(F, sw, lens[-1], dims[1:]), zero, sign=1),
               difference(f"its growth, T = {lens[0]} → {lens[-1]}", _fall(F, sw, lens[-1], dims),
                          _fall(F, sw, lens[0], dims), sign=1, primary=False),
               difference(f"its growth without d_h = {dims[0]}", _fall(F, sw, lens[-1], dims[1:]),
                          _fall(F, sw, lens[0], dims[1:]), sign=1, primary=False)]
        for t in out:
            t.unit = f"{len(seeds)} seeds, paired"
    for name, what in F.SATURATION_CONTROLS.get(part, ()):
        d = root / part / name
        if not (d / "reports" / "saturation_sweep.json").is_file():
            continue
        sw = _sweep_losses(d)
        _, lens, dims, seeds = sw
        t = difference(f"control, {what}: fall at T = {lens[-1]}, d_h {dims[0]}→{dims[1]} vs {dims[-2]}→{dims[-1]}",
                       _fall(F, sw, lens[-1], dims), _fall(F, sw, None, None), sign=1, primary=False)
        t.unit = f"{len(seeds)} seeds, paired"
        out.append(t)
    return out


WORDS = {"reproduced": "reproduced", "opposite": "the opposite is resolved", "unresolved": "not resolved",
         "equivalent": "equivalent within the margin", "better": "better, resolved",
         "worse": "worse, resolved", "not run yet": "not run yet", "not run": "not run",
         "no test": "no test (the arms equal run for run)"}


def verdict(claim: str, tests: list[Test]) -> str:
    """The re-issued verdict of a claim from its tests' outcomes (the rules in this module's docstring)."""
    prim = [t for t in tests if t.primary]
    cut = [t.extra["not_run"] for t in prim if t.est is None and t.extra.get("not_run")]
    if cut:
        return f"not run ({cut[0]})"
    if any(t.est is None for t in prim):
        return "not run yet"
    o = [t.outcome() for t in tests]
    good = {"reproduced", "equivalent", "better"}
    if claim == "6":
        st = tests[0].extra.get("standing") or {}
        certified = st.get("minimum", 0)
        reading = "lower tr(H)/n at the end of training: " + WORDS[o[0]] + "; total trace: " + WORDS[o[1]]
        if not certified:
            counts = ", ".join(f"{n} {v}" for v, n in st.items()) or "no certificate"
            return f"not testable as stated (no model certified at a minimum: {counts}); {reading}"
        return reading
    if claim == "7":
        return f"after the fine-tune: {WORDS[o[0]]}; at matched plasticity: {WORDS[o[1]]}"
    if claim == "9":
        return f"with d_h = 2: {WORDS[o[0]]}; without it: {WORDS[o[1]]}"
    if claim == "5":
        if o[0] == "reproduced" and o[1] != "reproduced":
            return "reproduced"
        return f"momentum's main effect: {WORDS[o[0]]}; preconditioning's: {WORDS[o[1]]}"
    if claim == "4":
        lead = tests[0].extra.get("rank", "")
        if all(x == "reproduced" for x, t in zip(o, tests, strict=True) if t.primary):
            return "reproduced"
        return f"not reproduced ({lead}; against the lowest other: {WORDS[o[0]]})"
    if claim == "1":
        if o[0] in good:
            return f"reproduced ({WORDS[o[0]]} against the same-width baseline)"
        if o[1] in good:
            return f"mixed (same width: {WORDS[o[0]]}; against the baseline of its size: {WORDS[o[1]]})"
        return f"not reproduced (same width: {WORDS[o[0]]}; baseline of its size: {WORDS[o[1]]})"
    if claim == "10":
        return ("reproduced" if o[0] in good else f"not reproduced ({WORDS[o[0]]})") + \
            f"; at the same budget: early-heavy {WORDS[o[1]]}, late-lowrank {WORDS[o[2]]}"
    if not prim or all(t.identical() for t in prim):  # nothing was tested: never "reproduced"
        return "no test (" + "; ".join(f"{t.name}: {WORDS['no test']}" for t in prim) + ")"
    n_good = sum(x in good for x, t in zip(o, tests, strict=True) if t.primary)
    if n_good == len(prim):  # (a primary test of identical arms is not good: that part of the claim went untested)
        return "reproduced"
    if n_good:
        return "mixed (" + "; ".join(f"{t.name}: {WORDS[x]}" for t, x in zip(tests, o, strict=True)
                                     if t.primary) + ")"
    return "not reproduced (" + "; ".join(f"{t.name}: {WORDS[x]}" for t, x in zip(tests, o, strict=True)
                                          if t.primary) + ")"


def mark_cut(rows: list[dict], cut: dict[str, str]) -> list[dict]:
    """Rows of claims a part leaves out by design (``cut``: claim -> why, findings.CUT): their tests that have no
    estimate say "not run (why)" rather than "not run yet", and so does the verdict, so that a part in progress
    tells what is waiting for runs from what will not be run."""
    for r in rows:
        why = cut.get(r["claim"])
        if why:
            for t in r["tests"]:
                if t.est is None:
                    t.extra["not_run"] = why
            r["verdict"] = verdict(r["claim"], r["tests"])
    return rows


def rows_json(rows: list[dict]) -> list[dict]:
    return [{"claim": r["claim"], "verdict": r["verdict"],
             "tests": [{**asdict(t), "outcome": t.outcome()} for t in r["tests"]]} for r in rows]


def markdown(part: str, rows: list[dict], first: dict[str, str], paper: dict[str, str] | None = None) -> list[str]:
    """One part's re-issued table: the claim, the paper's number, its tests (estimate [95% CI], Holm p, MDE or
    equivalence interval, unit), the first verdict and the re-issued one."""
    paper = paper or {}
    n_family = sum(1 for r in rows for t in r["tests"] if t.primary and t.family_p() is not None)
    md = [f"### {part}", "", f"Holm family: the part's {n_family} primary tests (second readings, in italics, are "
          f"adjusted as one more member, {n_family + 1} in all, and do not decide).", "",
          "| claim | paper | tests | first verdict | re-issued verdict |", "|---|---|---|---|---|"]
    for r in rows:
        tests = "; ".join(t.text() if t.primary else f"*{t.text()}*" for t in r["tests"])
        for t in r["tests"]:
            if "partial" in t.extra and t.extra["partial"]["rho"] is not None:
                tests += f"; partial ρ given lr {t.extra['partial']['rho']:+.2f} (p {t.extra['partial']['p']:.2g})"
            if "standing" in t.extra:
                tests += "; standing: " + (", ".join(f"{n} {v}" for v, n in t.extra["standing"].items()) or "–")
        md.append(f"| {r['claim']} | {paper.get(r['claim'], '–')} | {tests} | {first.get(r['claim'], '–')} | "
                  f"{r['verdict']} |")
    return md + [""]


def regime(p, other: set[str] | tuple = ()) -> dict:
    """What one part's runs are: tokens per run, parameters, tokens per parameter and epochs (meta.json of each run),
    and where its measured models stand (the stationarity verdicts of their sharpness reports). ``other``: studies
    trained on another corpus than the part's (the harder grammar's check), left out of the ranges and read apart
    (``checks``: each run's gap to its corpus's floor)."""
    import json
    from pathlib import Path

    # the models at initialisation (the init study: one step at lr 0) are no regime of training: counted apart
    runs = [r for (study, _), rs in p.groups.items() if study != "init" and study not in other for r in rs]
    at_init = sum(len(rs) for (study, _), rs in p.groups.items() if study == "init")
    metas = []
    for r in runs:
        try:
            metas.append(json.loads((Path(r["run"]) / "meta.json").read_text()))
        except (OSError, ValueError):
            continue
    tokens = [m["tokens"] for m in metas if m.get("tokens")]
    params = [m["params"]["total"] for m in metas if isinstance(m.get("params"), dict)]
    ratio = [m["tokens"] / m["params"]["total"] for m in metas if m.get("tokens") and isinstance(m.get("params"), dict)]
    epochs = [m["epochs"] for m in metas if m.get("epochs") is not None]
    standing = [_standing(r) for r in runs if (r.get("reports") or {}).get("sharpness")]

    def span(v, fmt):
        if not v:
            return "–"
        lo, hi = fmt.format(min(v)), fmt.format(max(v))
        return lo if lo == hi else f"{lo}–{hi}"

    checks = []
    for (study, arch), rs in p.groups.items():
        for r in rs if study in other else []:
            try:
                m = json.loads((Path(r["run"]) / "meta.json").read_text())
            except (OSError, ValueError):
                m = {}
            per = m["tokens"] / m["params"]["total"] if m.get("tokens") and isinstance(m.get("params"), dict) else None
            floor, loss = r.get("val_floor"), r.get("val_loss")
            checks.append({"study": study, "arch": arch, "seed": r.get("seed"),
                           "data": (m.get("corpus") or {}).get("source"), "tokens_per_param": per,
                           "epochs": m.get("epochs"), "val_loss": loss, "floor": floor,
                           "gap": None if floor is None or loss is None else loss - floor})
    return {"runs": len(runs), "at_init": at_init, "tokens": span(tokens, "{:,}"), "params": span(params, "{:,}"),
            "tokens_per_param": span(ratio, "{:.2f}"), "epochs": span(epochs, "{:.3f}"),
            "standing": {v: standing.count(v) for v in dict.fromkeys(standing)}, "checks": checks}


def regime_markdown(rows: dict[str, dict]) -> list[str]:
    md = ["### Each part's regime", "", "The finished studies' runs (a study still running is not counted until it has "
          "finished).", "", "| part | runs | tokens per run | parameters | tokens per parameter | epochs | "
          "where the measured models stand |", "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        st = ", ".join(f"{n} {v}" for v, n in r["standing"].items()) or "–"
        runs = f"{r['runs']} (+{r['at_init']} at initialisation)" if r.get("at_init") else r["runs"]
        md.append(f"| {name} | {runs} | {r['tokens']} | {r['params']} | {r['tokens_per_param']} | {r['epochs']} "
                  f"| {st} |")
    md.append("")
    for name, r in rows.items():
        for c in r.get("checks", []):
            def f(v, fmt):
                return "–" if v is None else fmt.format(v)
            md.append(f"- {name}/{c['study']} ({c['arch']}, seed {c['seed']}, on {c['data'] or 'another corpus'}; "
                      f"not in the row above): {f(c['tokens_per_param'], '{:.1f}')} tokens per parameter, "
                      f"{f(c['epochs'], '{:.2f}')} epochs; val loss {f(c['val_loss'], '{:.4f}')} against the exact "
                      f"floor {f(c['floor'], '{:.4f}')}: {f(c['gap'], '{:.4f}')} nats above it.")
    return md + ([""] if md[-1] != "" else [])
