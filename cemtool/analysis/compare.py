"""Compare architectures across runs and seeds from the runs' records and reports alone (no checkpoint is read):
one row per architecture, rank correlations between sharpness and forgetting, and pairwise differences with
confidence intervals (METHODS §3, §6, §7).

Inputs: a study directory (``study.json`` of ``cemtool sweep``), a run, a fine-tune run (it stands for its
parent, the run it was fine-tuned from), or a folder searched for runs. Fine-tune runs (meta.json ``"parent"``)
are never rows of their own: their forgetting report is attached to the parent. A parent's fine-tunes are found
in the study manifest and among the parent's sibling directories.

Per run, what each source provides (absent -> null, and the run is listed under ``missing``):

- meta.json (written by training): final ``val_loss`` and ``val_floor``, tokens trained, parameters; with
  ``at_tokens``, ``val_loss`` comes from metrics.jsonl instead: the last evaluation at or before that many tokens
  (``val_tokens`` says which); ``val_bpb`` (bits per byte, comparable across tokenizers) as training wrote it
  (meta.json, else the evaluation rows of metrics.jsonl; null, with a note, for runs from before it did) and
  ``val_ppl`` = exp(val_loss);
- the config: training FLOPs per token (``cemtool.models.lm.flops_per_token`` on a freshly built model, or the
  study's record), total FLOPs = FLOPs/token x tokens;
- ``reports/sharpness.json`` (or the report named by ``names["sharpness"]``): ``lambda_max`` (largest Hessian
  eigenvalue), ``lambda_min`` (smallest), ``trace_per_param`` = tr(H)/n (n = parameters; the first trace
  estimate, with its standard error), and the number of evaluation tokens they used;
- ``reports/collapse.json`` (or ``names["collapse"]``): the last layer's value entropy (Rényi, ``v_entropy``) and
  value separability (probe accuracy from the values, ``probe_v``, beside chance), and both for every layer
  (``layers``);
- a fine-tune's ``reports/forgetting.json``: ``forgetting`` and ``plasticity`` (one target; ``target`` chooses when
  the runs were fine-tuned on several).

Named reports: each run's reports are listed with their analysis and options (:func:`cemtool.report.named_reports`);
the runs' other reports of an analysis are named in a note, and settings that differ between the compared reports
of an analysis (evaluation tokens, options, checkpoint; not the device or batch size) are flagged in ``mismatch``
and a note, or refused with ``strict``.

Runs are grouped by their config without the seed and without the ``model.cem`` / ``model.momentum`` /
``model.lime`` sections of other families (which do not change the model; :func:`cemtool.report.run_settings`);
the group is labelled by its architecture name, with the differing settings appended when two groups share an
architecture (:func:`cemtool.report.group_labels`). Per group and metric: mean, standard
deviation over seeds (ddof = 1) and n. That standard deviation is the one spread of a comparison (``SPREAD``): the
tables, compare.md, report.md and the figures' error bars all show it, never a standard error. Flagged in a note
(refused with ``strict``): two runs of one group with the same seed (a repeat, not a second sample; the group's
``duplicate_seeds``). Flagged in a note: a group whose value probe is at its ceiling in every layer (it cannot tell
architectures apart) and runs whose sharpness report has |λ_min| > λ_max.

Correlations: Spearman's rank correlation (``scipy.stats.spearmanr``) across runs between forgetting and each of
tr(H)/n and lambda_max (the momentum-streams paper reports 0.93 for tr(H)/n), with a two-sided p-value [decision:
exact, over all permutations of the ranks, for n <= 9 runs, where scipy's t approximation gives p = 0 for a
perfect rank order however few the runs; scipy's beyond]; it needs at least 3 runs with both values.

Pairwise differences [decision: Welch]: for every pair of groups (a, b) and the metrics in ``PAIRWISE``, the
difference of means mean_a - mean_b with a Welch t confidence interval (unequal variances,
Welch-Satterthwaite degrees of freedom; ``scipy.stats.ttest_ind(equal_var=False)``) and the test's p-value; it
needs two runs in each group. Seeds are not paired (different architectures share no initialisation). The
same per layer for the collapse measures in ``LAYER_METRICS`` (``pairwise_layers``); no correction for multiple
comparisons is applied (read a table of many intervals accordingly).

compare.json schema (``reports/compare.json`` under the output folder)::

    {
      "provenance": {...}, "inputs": [str], "target": str | null, "level": 0.95, "at_tokens": int | null,
      "metrics": {key: column label}, "reports": {"sharpness": name, "collapse": name},
      "runs": [{"run", "label", "arch", "seed", "val_loss", "val_bpb", "val_ppl", "val_floor", "tokens",
                "val_tokens", "params",
                "non_embedding",
                "flops_per_token", "total_flops", "lambda_max", "lambda_min", "lambda_converged",
                "trace_per_param", "trace_per_param_se", "trace", "trace_se", "curvature_n", "curvature_operator",
                "standing", "grad_norm", "sharpness_tokens", "asam", "sam", "value_entropy", "separability",
                "separability_chance", "collapse_layer", "forgetting", "plasticity", "forgetting_target",
                "forgetting_run", "forgetting_curve": [[plasticity, forgetting], ...], "forgetting_matched", "lr",
                "layers": [{"layer", "value_entropy", "separability"}],
                "reports": {"sharpness": path | null, "collapse": path | null, "forgetting": path | null},
                "settings": {"sharpness": {option: value}, "collapse": {...}},
                "other_reports": {"sharpness": [name], "collapse": [name]}}],
      "archs": [{"label", "arch", "n", "seeds": [int], "duplicate_seeds": [int], "runs": [str], "standing",
                 "<metric>": {"mean", "std", "n"} | null, ...,
                 "layers": [{"layer", "value_entropy": {"mean", "std", "n"} | null, "separability": ...}]}],
      "correlations": [{"x", "y", "rho", "p", "p_method", "n", "note",
                        "arch_level": {"rho", "p", "p_method", "n_archs", "n_runs", "lo", "hi", "se", "n_boot",
                                       "undefined", "seed", "note"},
                        "partial": {"rho", "p", "n", "given", "df", "note"}, "partial_arch_level": {...}}],
      "pairwise": [{"metric", "a", "b", "diff", "lo", "hi", "df", "p", "p_holm", "mde", "n_a", "n_b", "note",
                    "margin", "p_tost", "equivalent", "lo90", "hi90"}],     # the last five with a margin
      "factors": [{"factor", "metric", "with", "without", "diff", "lo", "hi", "p", "p_holm", "mde", "n_a", "n_b",
                   "boot_lo", "boot_hi", "boot_undefined"}],                 # n_a, n_b: architectures
      "margins": {metric: margin}, "covariates": [field], "bootstrap": {"n_boot", "seed", "levels"},
      "matched_plasticity": {"level", "rule", "unreached": [run], "note"},
      "pairwise_layers": [{"metric", "layer", "a", "b", "diff", "lo", "hi", "df", "p", "mde", "n_a", "n_b",
                           "note"}],
      "missing": {"sharpness": [run], "collapse": [run], "forgetting": [run]},
      "mismatch": {"sharpness" | "collapse": {option: {value as JSON: [run name]}}},
      "notes": [str]
    }
"""

from __future__ import annotations

import itertools
from pathlib import Path

from cemtool.analysis.compute import run_compute
from cemtool.analysis.curvature import DEFAULT_OPERATOR, title
from cemtool.analysis.run_records import METRICS, NAMED, collect, metric_labels, settings_mismatch
from cemtool.analysis.stats import (
    at_matched,
    hierarchical_bootstrap,
    holm,
    partial_spearman,
    spearman,
    spearman_of_means,
    summary,
    tost,
    welch,
)
from cemtool.errors import CemtoolError, UsageError, did_you_mean
from cemtool.report import (
    mismatch_text,
    provenance,
)
from cemtool.writes import safe_name

PAIRWISE = ("val_loss", "val_bpb", "forgetting", "plasticity", "forgetting_matched", "trace_per_param", "trace",
            "lambda_max")
LAYER_METRICS = {"value_entropy": "H(values)", "separability": "probe(values)"}  # per layer, from collapse.json
CORRELATE = (("trace_per_param", "forgetting"), ("lambda_max", "forgetting"), ("plasticity", "forgetting"))
COVARIATES = ("lr", *[m for m in METRICS if m not in ("val_ppl",)])  # what a partial correlation may be given
N_BOOT = 2000  # replicates of the two-level (architectures, then seeds) bootstrap
REPORTS = ("sharpness", "collapse", "forgetting")
CEILING = 0.999  # a probe accuracy at or above this is at its ceiling


# --------------------------------------------------------------------------------------------------------------
# the comparison


def compare(paths: list[str | Path], target: str | None = None, level: float = 0.95,
            at_tokens: int | None = None, names: dict[str, str] | None = None, strict: bool = False,
            margins: dict[str, float] | None = None, covariates: list[str] | None = None,
            factors: dict[str, tuple[list[str], list[str] | None]] | None = None,
            plasticity_level: float | None = None, n_boot: int = N_BOOT, seed: int = 0) -> dict:
    """The comparison payload (schema in the module docstring). Raises CemtoolError if no run has any analysis
    report. ``at_tokens``: compare validation losses at that point of training (see :func:`collect`); ``names``:
    which named sharpness / collapse reports to read. Reports measured with different settings are flagged
    (``mismatch`` and a note), or refused with ``strict``. ``margins``: metric -> equivalence margin (a TOST beside
    that metric's intervals); ``covariates``: partial correlations given these run fields; ``factors``: name ->
    (groups with the factor, groups without it or None for every other group), main effects with the group as
    the unit; ``plasticity_level``: where forgetting is matched (default: the lowest plasticity every fine-tune
    reaches); ``n_boot``, ``seed``: the two-level bootstrap."""
    if not 0 < level < 1:
        raise UsageError(f"--level: the confidence level must be in (0, 1), got {level}")
    check_statistics(margins, covariates, plasticity_level, n_boot)
    if at_tokens is not None and at_tokens < 1:
        raise UsageError(f"--at-tokens must be a positive number of tokens, got {at_tokens}")
    for kind, name in (names or {}).items():
        if kind not in NAMED:
            raise CemtoolError(f"reports of {kind!r} are not chosen by name", hint=f"choose from {', '.join(NAMED)}")
        safe_name(name, f"--{kind}")
    records, notes = collect(paths, target, at_tokens, names)
    chosen = {**{k: k for k in NAMED}, **(names or {})}

    missing = {name: [r["run"] for r in records if r["reports"][name] is None] for name in REPORTS}
    if all(len(missing[name]) == len(records) for name in REPORTS):
        close = [c for kind in NAMED if (c := did_you_mean(chosen[kind], {n for r in records
                                                                          for n in r["other_reports"][kind]}))]
        raise CemtoolError(f"no analysis reports found for the {len(records)} run(s): looked for "
                           f"reports/{chosen['sharpness']}.json, reports/{chosen['collapse']}.json and fine-tunes "
                           f"with reports/forgetting.json",
                           hint=close[0] if close else "run cemtool sharpness / collapse-report / forgetting on "
                                "them, or cemtool sweep --analyses sharpness,collapse,forgetting")
    operators = {r["curvature_operator"] for r in records if r["reports"]["sharpness"] and r.get("curvature_operator")}
    if len(operators) > 1:  # a GGN λ_max and a Hessian λ_max never share a column
        raise CemtoolError(f"the sharpness reports measure different operators ({', '.join(sorted(operators))})",
                           hint="choose one report per run with --sharpness NAME (e.g. sharpness-ggn)")
    mismatch = settings_mismatch(records)
    for kind, diff in mismatch.items():
        text = f"the {kind} reports were measured with different settings: {mismatch_text(diff)}"
        if strict:
            raise CemtoolError(text, hint=f"measure them alike (cemtool {kind} --name ... keeps both), or compare "
                                          f"without --strict to see them flagged")
        notes.append(f"{text}; their numbers are not comparable as they stand")
    loose = [Path(r["run"]).name for r in records if r.get("lambda_converged") is False]
    if loose:
        notes.append(f"λ_max or λ_min did not converge (Lanczos) for {len(loose)} run(s): {', '.join(loose)}; "
                     f"raise the sharpness --lanczos-steps")
    for key, name, flag in (("lambda_max", "λ_max", "--top-k"), ("lambda_min", "λ_min", "--bottom-k")):
        unknown = [Path(r["run"]).name for r in records if r["reports"]["sharpness"] and r.get(key) is None]
        if unknown:
            notes.append(f"{name} is null for {len(unknown)} run(s) whose sharpness report has no such eigenvalue "
                         f"(measured with {flag} 0): {', '.join(unknown)}")
    notes += curvature_notes(records)
    matched = match_plasticity(records, plasticity_level)
    if matched["note"]:
        notes.append(matched["note"])
    labels = list(dict.fromkeys(r["label"] for r in records))
    archs = []
    for label in labels:
        rs = [r for r in records if r["label"] == label]
        row = {"label": label, "arch": rs[0]["arch"], "n": len(rs), "seeds": sorted(r["seed"] for r in rs),
               "runs": [r["run"] for r in rs]}
        row["duplicate_seeds"] = sorted({s for s in row["seeds"] if row["seeds"].count(s) > 1})
        if row["duplicate_seeds"]:
            text = duplicate_seed_text(label, rs, row["duplicate_seeds"])
            if strict:
                raise CemtoolError(text, hint="compare runs of distinct seeds, or compare without --strict to see "
                                              "them flagged")
            notes.append(text)
        for m in METRICS:
            row[m] = summary([r[m] for r in rs if r[m] is not None])
        verdicts = [r["standing"] for r in rs if r.get("standing")]
        row["standing"] = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts)) or None
        row["layers"] = [{"layer": layer, **{m: summary(_layer_values(rs, layer, m)) for m in LAYER_METRICS}}
                         for layer in _layer_ids(rs)]
        archs.append(row)
        if _at_ceiling(row):
            notes.append(f"{label}: the value probe is at its ceiling (accuracy ≥ {CEILING} in every layer of every "
                         f"run): it separates the classes perfectly, so it cannot tell these architectures apart "
                         f"(choose harder classes: collapse-report --words)")
    by_label = {label: [r for r in records if r["label"] == label] for label in labels}
    correlations = [correlation(records, by_label, x, y, covariates or [], n_boot, seed, level) for x, y in CORRELATE]
    margins = margins or {}
    pairwise = [{"metric": m, **p} for m in PAIRWISE
                for p in _with_holm(_pairs(labels, lambda g, m=m: [r[m] for r in by_label[g] if r[m] is not None],
                                           level, margins.get(m)))]
    factor_rows = [row for name, (with_, without) in (factors or {}).items()
                   for row in main_effects(name, with_, without, by_label, level, n_boot, seed)]
    pairwise_layers = [{"metric": m, "layer": layer, **p} for m in LAYER_METRICS for layer in _layer_ids(records)
                       for p in _pairs(labels, lambda g, m=m, layer=layer: _layer_values(by_label[g], layer, m),
                                       level)]
    targets = {r["forgetting_target"] for r in records if r.get("forgetting_target")}
    return {"provenance": provenance(None, analysis="compare", runs=[r["run"] for r in records]),
            "inputs": [str(p) for p in paths], "target": next(iter(targets), None), "level": level,
            "at_tokens": at_tokens,
            "curvature_operator": next(iter(operators), None), "metrics": metric_labels(next(iter(operators), None)),
            "reports": chosen, "runs": records, "archs": archs, "correlations": correlations,
            "pairwise": pairwise, "pairwise_layers": pairwise_layers, "factors": factor_rows,
            "margins": margins, "covariates": list(covariates or []), "matched_plasticity": matched,
            "bootstrap": {"n_boot": n_boot, "seed": seed, "levels": "architectures, then seeds within each"},
            "missing": missing, "mismatch": mismatch, "notes": notes}


def check_statistics(margins: dict | None, covariates: list[str] | None, plasticity_level: float | None,
                     n_boot: int) -> None:
    """One line for an option of the comparison's statistics that cannot be used."""
    for m, v in (margins or {}).items():
        if m not in PAIRWISE:
            raise UsageError(f"--margin {m}: not a compared metric", hint=f"choose from {', '.join(PAIRWISE)}")
        if not (isinstance(v, (int, float)) and v > 0 and v == v and v != float("inf")):
            raise UsageError(f"--margin {m}={v}: the equivalence margin must be a positive number")
    for c in covariates or []:
        if c not in COVARIATES:
            raise UsageError(f"--covariate {c}: not a run field", hint=did_you_mean(c, COVARIATES)
                             or f"choose from {', '.join(COVARIATES)}")
    if plasticity_level is not None and not plasticity_level > 0:
        raise UsageError(f"--plasticity-level must be > 0, got {plasticity_level}")
    if not 100 <= n_boot <= 10**6:
        raise UsageError(f"--boot must be between 100 and 1,000,000 replicates, got {n_boot}")


def match_plasticity(records: list[dict], level: float | None) -> dict:
    """Each run's ``forgetting_matched``: its forgetting where its fine-tune's plasticity first reaches ``level``
    (linear between curve points; :func:`cemtool.analysis.stats.at_matched`). Default level: the lowest of the
    runs' largest plasticities, so that every fine-tune reaches it [decision: the comparison needs no
    extrapolation; docs/sweep.md]. Forgetting and plasticity rise together along a fine-tune, so at matched
    plasticity architectures are compared at equal progress on the target rather than after equal steps."""
    curves = {r["run"]: r.get("forgetting_curve") for r in records if r.get("forgetting_curve")}
    out = {"level": None, "rule": "given" if level is not None else "lowest peak plasticity of the runs",
           "unreached": [], "note": None}
    if not curves:
        return out
    if level is None:
        level = min(max(p for p, _ in c) for c in curves.values())
    if not level > 0:
        out["note"] = ("forgetting at matched plasticity is not defined: some fine-tune never gained on its target "
                       "(peak plasticity <= 0)")
        return out
    out["level"] = float(level)
    for r in records:
        c = curves.get(r["run"])
        r["forgetting_matched"] = at_matched(c, level) if c else None
        if c and r["forgetting_matched"] is None:
            out["unreached"].append(r["run"])
    if out["unreached"]:
        out["note"] = (f"{len(out['unreached'])} fine-tune(s) never reach plasticity {level:.4g}: no forgetting at "
                       f"matched plasticity for them")
    return out


def correlation(records: list[dict], by_label: dict[str, list[dict]], x: str, y: str, covariates: list[str],
                n_boot: int, seed: int, level: float) -> dict:
    """Spearman's rho of x and y across runs; across architecture means (``arch_level``: exact permutation p for up
    to 9 architectures, and the two-level bootstrap interval, resampling architectures and then their seeds);
    and partial correlations given the covariates at both levels."""
    both = [r for r in records if r[x] is not None and r[y] is not None]
    out = {"x": x, "y": y, **spearman([r[x] for r in both], [r[y] for r in both])}
    groups = {g: [(r[x], r[y]) for r in rs if r[x] is not None and r[y] is not None] for g, rs in by_label.items()}
    groups = {g: v for g, v in groups.items() if v}
    means = {g: (sum(p[0] for p in v) / len(v), sum(p[1] for p in v) / len(v)) for g, v in groups.items()}
    arch = spearman([m[0] for m in means.values()], [m[1] for m in means.values()])
    arch = {"rho": arch["rho"], "p": arch["p"], "p_method": arch["p_method"], "n_archs": len(means),
            "n_runs": len(both), "note": arch["note"]}
    if arch["rho"] is not None:
        arch.update(hierarchical_bootstrap(groups, spearman_of_means, n_boot=n_boot, seed=seed, level=level))
    out["arch_level"] = arch
    given = [c for c in covariates if c not in (x, y)]
    if given:
        full = [r for r in both if all(r.get(c) is not None for c in given)]
        out["partial"] = partial_spearman([r[x] for r in full], [r[y] for r in full],
                                          {c: [r[c] for r in full] for c in given})
        kept = {id(r) for r in full}
        runs = {g: [r for r in rs if id(r) in kept] for g, rs in by_label.items()}
        labels = [g for g, rs in runs.items() if rs]
        mean = {g: {k: _mean([r[k] for r in runs[g]]) for k in (x, y, *given)} for g in labels}
        out["partial_arch_level"] = partial_spearman([mean[g][x] for g in labels], [mean[g][y] for g in labels],
                                                     {c: [mean[g][c] for g in labels] for c in given})
    return out


def _mean(v: list[float]) -> float:
    return sum(v) / len(v)


def main_effects(name: str, with_: list[str], without: list[str] | None, by_label: dict[str, list[dict]],
                 level: float, n_boot: int, seed: int) -> list[dict]:
    """A factor's main effect on each compared metric with the architecture as the unit: the mean over the groups
    with the factor of their means minus the same over the groups without it, a Welch interval over those group
    means (the seeds of one architecture are not independent evidence about the factor) and the two-level
    bootstrap interval of the same difference."""
    unknown = [g for g in [*with_, *(without or [])] if g not in by_label]
    if unknown:
        raise UsageError(f"--factor {name}: no group {unknown[0]!r} in this comparison",
                         hint=did_you_mean(unknown[0], list(by_label)) or f"groups: {', '.join(by_label)}")
    without = without if without is not None else [g for g in by_label if g not in with_]
    out = []
    for m in PAIRWISE:
        mean_of = {g: _mean(v) for g in [*with_, *without]
                   if (v := [r[m] for r in by_label[g] if r[m] is not None])}
        a, b = [mean_of[g] for g in with_ if g in mean_of], [mean_of[g] for g in without if g in mean_of]
        if not a or not b:
            continue
        row = {"factor": name, "metric": m, "with": [g for g in with_ if g in mean_of],
               "without": [g for g in without if g in mean_of], **welch(a, b, level)}
        groups = {f"{side}:{g}": [(float(side == "with"), r[m]) for r in by_label[g] if r[m] is not None]
                  for side, gs in (("with", row["with"]), ("without", row["without"])) for g in gs}
        boot = hierarchical_bootstrap(groups, _difference_of_sides, n_boot=n_boot, seed=seed, level=level,
                                      strata={g: g.split(":", 1)[0] for g in groups})
        row.update(boot_lo=boot["lo"], boot_hi=boot["hi"], boot_undefined=boot["undefined"])
        out.append(row)
    for p, adj in zip(out, holm([p["p"] for p in out]), strict=True):
        p["p_holm"] = adj
    return out


def _difference_of_sides(means) -> float | None:
    """mean of the 'with' groups' means minus mean of the 'without' groups' (each mean tagged 1.0 / 0.0)."""
    w = [m[1] for m in means if m[0] == 1.0]
    wo = [m[1] for m in means if m[0] == 0.0]
    return _mean(w) - _mean(wo) if w and wo else None


def duplicate_seed_text(label: str, runs: list[dict], seeds: list[int]) -> str:
    """The note on a group that holds two runs of one seed (the same experiment twice, not two samples)."""
    twice = [Path(r["run"]).name for r in runs if r["seed"] in seeds]
    return (f"{label}: {len(twice)} runs share seed {', '.join(map(str, seeds))} ({', '.join(twice[:6])}): repeats "
            f"of one seed are not independent samples, yet its n, its ± std and its intervals count each run")


def _at_ceiling(arch_row: dict) -> bool:
    """Every layer's value-probe accuracy is at its ceiling in every run of the group."""
    layers = [e["separability"] for e in arch_row.get("layers") or [] if e.get("separability")]
    return bool(layers) and all(s["mean"] >= CEILING and not s["std"] for s in layers)


def curvature_notes(records: list[dict]) -> list[str]:
    """Notes on the curvature columns: the operator when it is not the Hessian; where the runs stand (their
    stationarity verdicts, curvature.stationarity); total traces beside tr/n when the runs' n differ; and runs whose
    sharpness report has |λ_min| > λ_max (the largest curvature is negative, so λ_max is not the Hessian's largest
    eigenvalue in magnitude: the weights are not near a minimum of this loss)."""
    out = []
    measured = [r for r in records if r["reports"]["sharpness"]]
    ops = {r.get("curvature_operator") for r in measured} - {None, DEFAULT_OPERATOR}
    if ops:
        out.append(f"the curvature columns (λ_max, λ_min, tr/n, tr) are of the {ops.pop()} operator, not "
                   f"{title(DEFAULT_OPERATOR)}")
    verdicts = [r["standing"] for r in measured if r.get("standing")]
    if verdicts:
        counts = ", ".join(f"{verdicts.count(v)} {v}" for v in dict.fromkeys(verdicts))
        out.append(f"where the runs stand (sharpness reports' stationarity verdicts): {counts}"
                   + ("; no run is certified a minimum, so no difference here is one between minima"
                      if "minimum" not in verdicts else ""))
    ns = {r.get("curvature_n") for r in measured if r.get("curvature_n")}
    if len(ns) > 1:
        out.append(f"the runs' curvature dimensions n differ ({min(ns):,} to {max(ns):,} parameters): tr/n compares "
                   f"densities, the total tr compares curvatures; read both")
    neg = [Path(r["run"]).name for r in records if r.get("lambda_max") is not None and r.get("lambda_min")
           is not None and abs(r["lambda_min"]) > abs(r["lambda_max"])]
    if not neg:
        return out
    return out + [f"|λ_min| > λ_max for {len(neg)} run(s) ({', '.join(neg[:6])}{' ...' if len(neg) > 6 else ''}): the "
            f"most negative curvature exceeds the most positive, so the weights are not near a minimum of the "
            f"measured loss and λ_max alone understates the curvature"]


def _pairs(labels: list[str], values_of, level: float, margin: float | None = None) -> list[dict]:
    """Welch intervals of mean_a - mean_b for every two groups that both have values (``values_of(label)``), with
    the TOST equivalence test at ``margin`` when one is given."""
    out = []
    for a, b in itertools.combinations(labels, 2):
        va, vb = values_of(a), values_of(b)
        if va and vb:
            out.append({"a": a, "b": b, **welch(va, vb, level), **(tost(va, vb, margin, level) if margin else {})})
    return out


def _with_holm(pairs: list[dict]) -> list[dict]:
    """Each pair with ``p_holm``: Holm's adjustment over the family of one metric's differences (every pair of
    architectures) [decision: the family is a metric, the question "does the architecture change this
    measure?"; docs/sweep.md]."""
    for p, adj in zip(pairs, holm([p["p"] for p in pairs]), strict=True):
        p["p_holm"] = adj
    return pairs


def _layer_ids(records: list[dict]) -> list[int]:
    return sorted({e["layer"] for r in records for e in r.get("layers") or []})


def _layer_values(records: list[dict], layer: int, metric: str) -> list[float]:
    return [e[metric] for r in records for e in r.get("layers") or [] if e["layer"] == layer and e[metric] is not None]


__all__ = ["LAYER_METRICS", "METRICS", "PAIRWISE", "collect", "compare", "run_compute", "spearman", "welch"]
