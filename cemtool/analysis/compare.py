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
                "trace_per_param", "trace_per_param_se", "sharpness_tokens", "value_entropy", "separability",
                "separability_chance", "collapse_layer", "forgetting", "plasticity", "forgetting_target",
                "forgetting_run", "layers": [{"layer", "value_entropy", "separability"}],
                "reports": {"sharpness": path | null, "collapse": path | null, "forgetting": path | null},
                "settings": {"sharpness": {option: value}, "collapse": {...}},
                "other_reports": {"sharpness": [name], "collapse": [name]}}],
      "archs": [{"label", "arch", "n", "seeds": [int], "duplicate_seeds": [int], "runs": [str],
                 "<metric>": {"mean", "std", "n"} | null, ...,
                 "layers": [{"layer", "value_entropy": {"mean", "std", "n"} | null, "separability": ...}]}],
      "correlations": [{"x", "y", "rho", "p", "p_method", "n", "note"}],
      "pairwise": [{"metric", "a", "b", "diff", "lo", "hi", "df", "p", "n_a", "n_b", "note"}],
      "pairwise_layers": [{"metric", "layer", "a", "b", "diff", "lo", "hi", "df", "p", "n_a", "n_b", "note"}],
      "missing": {"sharpness": [run], "collapse": [run], "forgetting": [run]},
      "mismatch": {"sharpness" | "collapse": {option: {value as JSON: [run name]}}},
      "notes": [str]
    }
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np

from cemtool.analysis.compute import run_compute
from cemtool.config import to_dict
from cemtool.errors import CemtoolError, UsageError, did_you_mean
from cemtool.fileio import read_json
from cemtool.layout import is_run
from cemtool.models.registry import get_arch
from cemtool.report import (
    SPREAD,
    csv_text,
    group_labels,
    markdown_table,
    mismatch_text,
    provenance,
    run_settings,
    write_report,
)
from cemtool.runs import open_run
from cemtool.writes import atomic_write_text, safe_name

METRICS = {"val_loss": "val loss", "val_bpb": "val bits/byte", "val_ppl": "val perplexity", "params": "params",
           "flops_per_token": "FLOPs/token", "lambda_max": "λ_max",
           "lambda_min": "λ_min", "trace_per_param": "tr(H)/n", "forgetting": "forgetting",
           "plasticity": "plasticity", "value_entropy": "H(values) last", "separability": "probe(values) last"}
PAIRWISE = ("val_loss", "val_bpb", "forgetting", "plasticity", "trace_per_param", "lambda_max")
LAYER_METRICS = {"value_entropy": "H(values)", "separability": "probe(values)"}  # per layer, from collapse.json
CORRELATE = (("trace_per_param", "forgetting"), ("lambda_max", "forgetting"))
REPORTS = ("sharpness", "collapse", "forgetting")
CEILING = 0.999  # a probe accuracy at or above this is at its ceiling
NAMED = ("sharpness", "collapse")  # analyses whose report is chosen by name (``names``); forgetting: by target


# --------------------------------------------------------------------------------------------------------------
# statistics


EXACT_MAX_N = 9  # Spearman p-values by exact permutation up to this many runs (9! = 362,880 permutations)


def spearman(x: list[float], y: list[float]) -> dict:
    """Spearman's rho (``scipy.stats.spearmanr``) and its two-sided p-value: exact (all permutations of the
    ranks) for n <= 9, where scipy's t approximation is poor, else scipy's. rho None below 3 points or for
    constant input."""
    from scipy import stats

    n = len(x)
    if n < 3:
        return {"rho": None, "p": None, "p_method": None, "n": n, "note": "needs at least 3 runs with both values"}
    if len(set(x)) == 1 or len(set(y)) == 1:
        return {"rho": None, "p": None, "p_method": None, "n": n, "note": "one variable is constant"}
    res = stats.spearmanr(x, y)
    rho = float(res.statistic)
    if n > EXACT_MAX_N:
        return {"rho": rho, "p": float(res.pvalue), "p_method": "t approximation", "n": n, "note": None}
    rx, ry = stats.rankdata(x), stats.rankdata(y)
    perms = np.array(list(itertools.permutations(range(n))))  # (n!, n)
    ryp = ry[perms] - ry.mean()  # (n!, n)
    rhos = ryp @ (rx - rx.mean()) / (np.linalg.norm(rx - rx.mean()) * np.linalg.norm(ry - ry.mean()))  # (n!,)
    p = float(np.mean(np.abs(rhos) >= abs(rho) - 1e-12))
    return {"rho": rho, "p": p, "p_method": "exact permutation", "n": n, "note": None}


def welch(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """mean(a) - mean(b) with its Welch t confidence interval at ``level`` and the test's p-value."""
    from scipy import stats

    na, nb = len(a), len(b)
    out = {"diff": float(np.mean(a) - np.mean(b)) if na and nb else None, "lo": None, "hi": None, "df": None,
           "p": None, "n_a": na, "n_b": nb, "note": None}
    if na < 2 or nb < 2:
        out["note"] = "needs at least 2 runs per architecture"
        return out
    if np.var(a) == 0 and np.var(b) == 0:
        out.update(lo=out["diff"], hi=out["diff"], note="no variance within either architecture")
        return out
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # scipy warns (to stderr) on nearly identical values
        warnings.simplefilter("always")
        res = stats.ttest_ind(a, b, equal_var=False)
        ci = res.confidence_interval(confidence_level=level)
    out.update(lo=float(ci.low), hi=float(ci.high), df=float(res.df), p=float(res.pvalue))
    if any("catastrophic cancellation" in str(w.message) for w in caught):
        out["note"] = "values nearly identical: the interval is unreliable (precision loss)"
    return out


def summary(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"mean": float(np.mean(values)), "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
            "n": len(values)}


# --------------------------------------------------------------------------------------------------------------
# reading runs and reports


def sharpness_fields(report: dict) -> dict:
    """λ_max, λ_min and tr(H)/n (first trace estimate) of a sharpness report (cemtool backend). λ_max (λ_min) is
    null when the report has no top (bottom) eigenvalues (``--top-k 0``): an unchecked extreme Ritz value is not
    the eigenvalue, only a bound on it."""
    eig = report.get("eigen") or {}
    top, bottom = eig.get("top") or [], eig.get("bottom") or []
    traces = report.get("traces") or []
    t = traces[0] if traces else {}
    flags = (eig.get("top_converged") or [])[:1] + (eig.get("bottom_converged") or [])[:1]
    return {"lambda_max": top[0] if top else None,
            "lambda_min": bottom[0] if bottom else None,
            "lambda_converged": all(flags) if flags else None,
            "trace_per_param": t.get("per_param"), "trace_per_param_se": t.get("per_param_se"),
            "sharpness_tokens": report.get("tokens")}


def collapse_fields(report: dict) -> dict:
    """The last layer's value entropy and value separability of a collapse report, and both for every layer."""
    run = (report.get("runs") or [{}])[0]
    rows = run.get("summary") or []
    if not rows:
        return {}
    last = rows[-1]
    layer = next((e for e in run.get("collapse", {}).get("layers", []) if e.get("layer") == last["layer"]), {})
    probe = (layer.get("probe") or {}).get("values")
    return {"value_entropy": last.get("v_entropy"), "separability": last.get("probe_v"),
            "separability_chance": probe.get("chance") if isinstance(probe, dict) else None,
            "collapse_layer": last["layer"],
            "layers": [{"layer": r["layer"], "value_entropy": r.get("v_entropy"), "separability": r.get("probe_v")}
                       for r in rows]}


def _meta(path: Path) -> dict:
    try:
        return read_json(path / "meta.json", "run metadata")
    except CemtoolError:
        return {}


class _Finder:
    """Resolves the inputs to source runs, and each source run to its fine-tunes."""

    def __init__(self):
        self.units: list[Path] = []
        self.children: dict[Path, set[Path]] = {}
        self.study_items: dict[Path, dict] = {}
        self._scanned: set[Path] = set()

    def add_unit(self, path: Path) -> None:
        path = path.resolve()
        if path not in self.units:
            self.units.append(path)
        self.children.setdefault(path, set())

    def add_run(self, path: Path) -> None:
        parent = _meta(path).get("parent")
        if parent is None:
            self.add_unit(path)
            return
        src = Path(parent)
        if not is_run(src):
            raise CemtoolError(f"{path} is a fine-tune of {src}, which is missing",
                               hint="compare the source runs (their fine-tunes are found beside them)")
        self.add_unit(src)
        self.children[src.resolve()].add(path.resolve())

    def add(self, path: Path) -> None:
        if not path.exists():
            raise CemtoolError(f"{path} does not exist")
        if (path / "study.json").exists():  # a FIFO or folder there is refused by read_json, not taken for no study
            from cemtool.sweep import read_manifest  # validated whole: a hand-edited study is one line

            study = read_manifest(path / "study.json")
            for item in study.get("items", []):
                run = (path / item["run"]).resolve()
                if not is_run(run):
                    continue
                self.add_unit(run)
                self.study_items[run] = item
                ft = item.get("analyses", {}).get("forgetting", {}).get("run")
                if ft and is_run(path / ft):
                    self.children[run].add((path / ft).resolve())
            return
        if is_run(path):
            self.add_run(path)
            return
        found = sorted({p.parent for p in path.rglob("config.json") if is_run(p.parent)})
        if not found:
            raise CemtoolError(f"{path} holds no runs and no study.json")
        for p in found:
            self.add_run(p)

    def siblings(self) -> None:
        """Attach fine-tunes that sit beside their parents."""
        for folder in {u.parent for u in self.units} - self._scanned:
            self._scanned.add(folder)
            for d in folder.iterdir():
                if d.is_dir() and is_run(d):
                    parent = _meta(d).get("parent")
                    if parent and Path(parent).resolve() in self.children:
                        self.children[Path(parent).resolve()].add(d.resolve())


def _forgetting_of(children: set[Path]) -> dict[str, tuple[Path, dict]]:
    """target -> (report path, report) among a run's fine-tunes (the newest report per target)."""
    out: dict[str, tuple[Path, dict]] = {}
    for c in sorted(children, key=lambda p: (p / "reports" / "forgetting.json").stat().st_mtime
                    if (p / "reports" / "forgetting.json").exists() else 0):
        rp = c / "reports" / "forgetting.json"
        if rp.exists():
            rep = read_json(rp, "forgetting report")
            out[rep["target"]["data"]] = (rp, rep)
    return out


def _evaluation(run, meta: dict, at_tokens: int | None) -> dict:
    """val_loss, val_bpb, val_ppl and val_tokens: the final evaluation (meta.json, else the last row of
    metrics.jsonl), or with ``at_tokens`` the last evaluation at or before that many training tokens. val_bpb is
    read as training wrote it (null for runs from before it did); val_ppl = exp(val_loss)."""
    evals = [m for m in run.metrics()
             if isinstance(m.get("val_loss"), (int, float)) and isinstance(m.get("tokens"), int)]
    if at_tokens is None:
        last = evals[-1] if evals else {}
        out = {"val_loss": meta.get("val_loss"), "val_tokens": meta.get("tokens"),
               "val_bpb": meta.get("val_bpb", last.get("val_bpb"))}
    else:
        row = next((m for m in reversed(evals) if m["tokens"] <= at_tokens), {})
        out = {"val_loss": row.get("val_loss"), "val_tokens": row.get("tokens"), "val_bpb": row.get("val_bpb")}
    loss = out["val_loss"]
    out["val_ppl"] = math.exp(loss) if isinstance(loss, (int, float)) and math.isfinite(loss) and loss < 700 else None
    return out


def _named(run_path: Path, kind: str, name: str) -> tuple[Path | None, dict | None, dict, list[str]]:
    """The report ``name`` of analysis ``kind`` in a run (path, content, options; None when absent) and the names
    of the run's other reports of that analysis."""
    from cemtool.report import named_reports

    found = named_reports(run_path, kind=kind)
    mine = next((r for r in found if r.name == name and r.report is not None), None)
    subset = ((mine.options if mine else None) or {}).get("params", "all")
    # a report of another parameter subset (e.g. the demo's sharpness-layer-N) measures another quantity: not an
    # alternative to the one compared, so not listed as one
    others = [r.name for r in found if r.name != name and (r.options or {}).get("params", "all") == subset]
    if mine is None:
        return None, None, {}, others
    return mine.path, mine.report, mine.options, others


def collect(paths: list[str | Path], target: str | None = None, at_tokens: int | None = None,
            names: dict[str, str] | None = None) -> tuple[list[dict], list[str]]:
    """One record per source run (see the module docstring) and notes on what was skipped. ``at_tokens``: take
    each run's validation loss from its last evaluation at or before that many training tokens (metrics.jsonl)
    instead of the final one. ``names``: which named report of each analysis to read (default
    ``{"sharpness": "sharpness", "collapse": "collapse"}``); each record's ``settings`` holds the options that
    report was measured with, and ``other_reports`` the run's other reports of that analysis."""
    names = {**{k: k for k in NAMED}, **(names or {})}
    finder = _Finder()
    for p in paths:
        finder.add(Path(p))
    if not finder.units:
        raise CemtoolError(f"no runs found in {', '.join(map(str, paths))}")
    finder.siblings()
    notes: list[str] = []
    fts = {u: _forgetting_of(finder.children[u]) for u in finder.units}
    targets = sorted({t for f in fts.values() for t in f})
    if target is None and len(targets) > 1:
        raise CemtoolError(f"the runs were fine-tuned on several targets ({', '.join(targets)})",
                           hint="choose one with --target")
    target = target or (targets[0] if targets else None)
    compute_cache: dict[str, dict] = {}
    records, configs = [], {}
    for u in finder.units:
        run = open_run(u)
        meta, cfg = run.meta(), run.config()
        if meta.get("status") != "completed":
            notes.append(f"{u}: skipped, training is {meta.get('status')}")
            continue
        item = finder.study_items.get(u, {})
        configs[str(u)] = run_settings(to_dict(cfg), get_arch(cfg.model.arch).family)
        rec: dict = {"run": str(u), "label": None, "arch": cfg.model.arch, "seed": cfg.seed,
                     **_evaluation(run, meta, at_tokens), "val_floor": meta.get("val_floor"),
                     "tokens": meta.get("tokens")}
        if at_tokens is not None and rec["val_tokens"] is None:
            notes.append(f"{u}: no evaluation at or before {at_tokens:,} tokens")
        if "flops_per_token" in item:
            comp = {k: item[k] for k in ("params", "non_embedding", "flops_per_token")}
        else:
            key = json.dumps([to_dict(cfg.model), cfg.data.seq_len], sort_keys=True)
            comp = compute_cache.setdefault(key, run_compute(cfg))
        rec.update(params=comp["params"], non_embedding=comp["non_embedding"],
                   flops_per_token=comp["flops_per_token"],
                   total_flops=comp["flops_per_token"] * rec["tokens"] if rec["tokens"] else None)
        reports: dict = {}
        rec["settings"], rec["other_reports"] = {}, {}
        for kind, fields_of in (("sharpness", sharpness_fields), ("collapse", collapse_fields)):
            rp, rep, options, others = _named(u, kind, names[kind])
            reports[kind] = str(rp) if rp else None
            rec["other_reports"][kind] = others
            if rep is not None:
                rec.update(fields_of(rep))
                rec["settings"][kind] = options
        f = fts[u].get(target) if target else None
        reports["forgetting"] = str(f[0]) if f else None
        if f:
            rec.update(forgetting=f[1]["forgetting"], plasticity=f[1]["plasticity"], forgetting_target=target,
                       forgetting_run=str(f[0].parent.parent))
        for k in METRICS:
            rec.setdefault(k, None)
        rec.setdefault("layers", [])
        rec["reports"] = reports
        records.append(rec)
    if not records:
        raise CemtoolError("no completed runs to compare", hint="; ".join(notes)[:300] or None)
    _label(records, configs)
    no_bpb = [Path(r["run"]).name for r in records if r["val_loss"] is not None and r["val_bpb"] is None]
    if no_bpb:
        notes.append(f"bits per byte unknown for {len(no_bpb)} run(s) ({', '.join(no_bpb[:6])}"
                     f"{' ...' if len(no_bpb) > 6 else ''}): trained before cemtool recorded bytes per token")
    for kind in NAMED:
        others = sorted({n for r in records for n in r["other_reports"][kind]})
        if others:
            close = did_you_mean(names[kind], others)
            notes.append(f"{kind} reports not compared: {', '.join(others)} (compare reads '{names[kind]}'"
                         f"{': ' + close if close else ''}; choose another with --{kind} NAME)")
    return records, notes


def settings_mismatch(records: list[dict]) -> dict[str, dict]:
    """Per analysis, the settings its compared reports differ in: kind -> {setting: {value: [run, ...]}}."""
    from cemtool.report import mismatched_settings

    out = {}
    for kind in NAMED:
        opts = {Path(r["run"]).name: r["settings"][kind] for r in records if kind in r["settings"]}
        diff = mismatched_settings(opts)
        if diff:
            out[kind] = diff
    return out


def _label(records: list[dict], settings: dict[str, dict]) -> None:
    """Group label per record (:func:`cemtool.report.group_labels`; ``settings``: run -> its settings)."""
    labels = group_labels([r["arch"] for r in records], [settings[r["run"]] for r in records])
    for r, label in zip(records, labels, strict=True):
        r["label"] = label


# --------------------------------------------------------------------------------------------------------------
# the comparison


def compare(paths: list[str | Path], target: str | None = None, level: float = 0.95,
            at_tokens: int | None = None, names: dict[str, str] | None = None, strict: bool = False) -> dict:
    """The comparison payload (schema in the module docstring). Raises CemtoolError if no run has any analysis
    report. ``at_tokens``: compare validation losses at that point of training (see :func:`collect`); ``names``:
    which named sharpness / collapse reports to read. Reports measured with different settings are flagged
    (``mismatch`` and a note), or refused with ``strict``."""
    if not 0 < level < 1:
        raise UsageError(f"--level: the confidence level must be in (0, 1), got {level}")
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
        row["layers"] = [{"layer": layer, **{m: summary(_layer_values(rs, layer, m)) for m in LAYER_METRICS}}
                         for layer in _layer_ids(rs)]
        archs.append(row)
        if _at_ceiling(row):
            notes.append(f"{label}: the value probe is at its ceiling (accuracy ≥ {CEILING} in every layer of every "
                         f"run): it separates the classes perfectly, so it cannot tell these architectures apart "
                         f"(choose harder classes: collapse-report --words)")
    correlations = []
    for x, y in CORRELATE:
        pairs = [(r[x], r[y]) for r in records if r[x] is not None and r[y] is not None]
        correlations.append({"x": x, "y": y, **spearman([p[0] for p in pairs], [p[1] for p in pairs])})
    by_label = {label: [r for r in records if r["label"] == label] for label in labels}
    pairwise = [{"metric": m, **p} for m in PAIRWISE
                for p in _pairs(labels, lambda g, m=m: [r[m] for r in by_label[g] if r[m] is not None], level)]
    pairwise_layers = [{"metric": m, "layer": layer, **p} for m in LAYER_METRICS for layer in _layer_ids(records)
                       for p in _pairs(labels, lambda g, m=m, layer=layer: _layer_values(by_label[g], layer, m),
                                       level)]
    targets = {r["forgetting_target"] for r in records if r.get("forgetting_target")}
    return {"provenance": provenance(None, analysis="compare", runs=[r["run"] for r in records]),
            "inputs": [str(p) for p in paths], "target": next(iter(targets), None), "level": level,
            "at_tokens": at_tokens,
            "metrics": METRICS, "reports": chosen, "runs": records, "archs": archs, "correlations": correlations,
            "pairwise": pairwise, "pairwise_layers": pairwise_layers, "missing": missing, "mismatch": mismatch,
            "notes": notes}


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
    """A note on runs whose sharpness report has |λ_min| > λ_max: the largest curvature is negative, so λ_max is
    not the Hessian's largest eigenvalue in magnitude (the weights are not near a minimum of this loss)."""
    neg = [Path(r["run"]).name for r in records if r.get("lambda_max") is not None and r.get("lambda_min")
           is not None and abs(r["lambda_min"]) > abs(r["lambda_max"])]
    if not neg:
        return []
    return [f"|λ_min| > λ_max for {len(neg)} run(s) ({', '.join(neg[:6])}{' ...' if len(neg) > 6 else ''}): the "
            f"most negative curvature exceeds the most positive, so the weights are not near a minimum of the "
            f"measured loss and λ_max alone understates the curvature"]


def _pairs(labels: list[str], values_of, level: float) -> list[dict]:
    """Welch intervals of mean_a - mean_b for every two groups that both have values (``values_of(label)``)."""
    out = []
    for a, b in itertools.combinations(labels, 2):
        va, vb = values_of(a), values_of(b)
        if va and vb:
            out.append({"a": a, "b": b, **welch(va, vb, level)})
    return out


def _layer_ids(records: list[dict]) -> list[int]:
    return sorted({e["layer"] for r in records for e in r.get("layers") or []})


def _layer_values(records: list[dict], layer: int, metric: str) -> list[float]:
    return [e[metric] for r in records for e in r.get("layers") or [] if e["layer"] == layer and e[metric] is not None]


# --------------------------------------------------------------------------------------------------------------
# tables and files


def fmt_num(v: float | None, digits: int = 4) -> str:
    """``digits`` significant digits; exponent form for very large or small magnitudes; blank for None."""
    if v is None:
        return ""
    if isinstance(v, int) or (float(v).is_integer() and abs(v) >= 100):
        return f"{int(v):,}" if abs(v) < 1e7 else f"{v:.{digits - 1}e}"
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def cell(s: dict | None) -> str:
    """'mean ± std' (:data:`SPREAD`; the std omitted for one run or no spread), blank when missing."""
    if s is None:
        return ""
    if not s["std"]:
        return fmt_num(s["mean"])
    return f"{fmt_num(s['mean'])} ± {fmt_num(s['std'], 2)}"


def arch_table(payload: dict, transpose: bool = False) -> tuple[list[str], list[list[str]]]:
    """One row per architecture and one column per metric that some run provides (``transpose``: one row per
    metric, one column per architecture, which fits a terminal better)."""
    # a metric an older compare.json lacks (e.g. val_bpb before bits per byte were recorded) is simply absent
    present = [m for m in METRICS if any(a.get(m) is not None for a in payload["archs"])]
    if transpose:
        cols = ["", *[a["label"] for a in payload["archs"]]]
        rows = [["runs", *[runs_cell(a) for a in payload["archs"]]]]
        rows += [[METRICS[m], *[cell(a.get(m)) for a in payload["archs"]]] for m in present]
        return cols, rows
    cols = ["arch", "n", *[METRICS[m] for m in present]]
    rows = [[a["label"], runs_cell(a), *[cell(a.get(m)) for m in present]] for a in payload["archs"]]
    return cols, rows


def runs_cell(arch_row: dict) -> str:
    """The number of runs, and the seeds given more than once: ``3 (seed 0 twice)``."""
    dup = arch_row.get("duplicate_seeds") or []
    if not dup:
        return str(arch_row["n"])
    seeds = arch_row["seeds"]
    return f"{arch_row['n']} ({', '.join(f'seed {s} x{seeds.count(s)}' for s in dup)})"


def flat_arch_rows(payload: dict) -> list[dict]:
    """compare.csv: per architecture, mean / std / n of every metric."""
    out = []
    for a in payload["archs"]:
        row = {"arch": a["label"], "family_arch": a["arch"], "n": a["n"], "seeds": " ".join(map(str, a["seeds"]))}
        for m in METRICS:
            s = a.get(m) or {}
            row.update({f"{m}_mean": s.get("mean"), f"{m}_std": s.get("std"), f"{m}_n": s.get("n", 0)})
        out.append(row)
    return out


def run_rows(payload: dict) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("reports", "layers", "settings", "other_reports")}
            for r in payload["runs"]]


def layer_table(payload: dict, transpose: bool = False) -> tuple[list[str], list[list[str]]]:
    """One row per architecture, one column per (collapse measure, layer): mean ± std over seeds (``transpose``:
    one row per measure and layer, one column per architecture)."""
    layers = sorted({e["layer"] for a in payload["archs"] for e in a.get("layers") or []})
    cols = ["arch", *[f"{label} L{layer}" for m, label in LAYER_METRICS.items() for layer in layers]]
    rows = []
    for a in payload["archs"]:
        by = {e["layer"]: e for e in a.get("layers") or []}
        if by:
            rows.append([a["label"], *[cell(by[layer][m]) if layer in by else "" for m in LAYER_METRICS
                                       for layer in layers]])
    if transpose and rows:
        return ["", *[r[0] for r in rows]], [[c, *[r[j] for r in rows]] for j, c in enumerate(cols) if j > 0]
    return cols, rows


def flat_layer_rows(payload: dict) -> list[dict]:
    """compare_layers.csv: per architecture and layer, mean / std / n of the per-layer collapse measures."""
    out = []
    for a in payload["archs"]:
        for e in a.get("layers") or []:
            row = {"arch": a["label"], "layer": e["layer"]}
            for m in LAYER_METRICS:
                s = e[m] or {}
                row.update({f"{m}_mean": s.get("mean"), f"{m}_std": s.get("std"), f"{m}_n": s.get("n", 0)})
            out.append(row)
    return out


def val_loss_note(payload: dict) -> str:
    """What "val loss" means in a comparison made with ``at_tokens``."""
    points = sorted({r["val_tokens"] for r in payload["runs"] if r.get("val_tokens") is not None})
    return (f"Val loss: each run's last evaluation at or before {payload['at_tokens']:,} training tokens (at "
            f"{', '.join(f'{p:,}' for p in points) or 'no run has one'} tokens), not the final one. A loss in the "
            f"middle of a decaying learning-rate schedule is not the loss of a run trained for that many tokens.")


def markdown(payload: dict) -> str:
    cols, rows = arch_table(payload)
    md = ["# Comparison", "", f"{SPREAD[0].upper()}{SPREAD[1:]} (n runs). Forgetting target: "
                              f"{payload['target'] or '-'}.", ""]
    if payload.get("at_tokens") is not None:
        md += [val_loss_note(payload), ""]
    md += [markdown_table([dict(zip(cols, r, strict=True)) for r in rows], cols)]
    md += ["## Spearman correlations across runs", "",
           markdown_table([{"x": c["x"], "y": c["y"], "rho": c["rho"], "p": c["p"], "p from": c["p_method"] or "",
                            "n": c["n"], "note": c["note"] or ""} for c in payload["correlations"]])]
    if payload["pairwise"]:
        md += [f"## Pairwise differences (a - b, Welch t {payload['level']:.0%} intervals)", "",
               markdown_table([{k: p[k] for k in ("metric", "a", "b", "diff", "lo", "hi", "df", "p", "n_a", "n_b")}
                               for p in payload["pairwise"]])]
    layer_cols, layer_rows = layer_table(payload)
    if layer_rows:
        md += [f"## Per layer (collapse report; {SPREAD})", "",
               markdown_table([dict(zip(layer_cols, r, strict=True)) for r in layer_rows], layer_cols)]
    if payload.get("pairwise_layers"):
        md += [f"## Per-layer differences (a - b, Welch t {payload['level']:.0%} intervals, no multiple-comparison "
               f"correction)", "",
               markdown_table([{k: p[k] for k in ("metric", "layer", "a", "b", "diff", "lo", "hi", "df", "p", "n_a",
                                                  "n_b")} for p in payload["pairwise_layers"]])]
    miss = [f"- {name}: {len(runs)} run(s) without it" for name, runs in payload["missing"].items() if runs]
    if miss or payload["notes"]:
        md += ["## Missing", "", *miss, *[f"- {n}" for n in payload["notes"]], ""]
    return "\n".join(md)


def write_compare(payload: dict, out: str | Path) -> dict[str, Path]:
    """Write <out>/compare.csv (per architecture), compare_runs.csv (per run), compare_layers.csv (per architecture
    and layer, when collapse reports exist), compare.md and <out>/reports/compare.json (+ .csv of the pairwise
    differences)."""
    out = Path(out)
    paths = {"csv": out / "compare.csv", "runs_csv": out / "compare_runs.csv", "md": out / "compare.md"}
    atomic_write_text(paths["csv"], csv_text(flat_arch_rows(payload)))
    atomic_write_text(paths["runs_csv"], csv_text(run_rows(payload)))
    layer_rows = flat_layer_rows(payload)
    if layer_rows:
        paths["layers_csv"] = out / "compare_layers.csv"
        atomic_write_text(paths["layers_csv"], csv_text(layer_rows))
    atomic_write_text(paths["md"], markdown(payload))
    paths["json"] = write_report(out / "reports", "compare", payload, payload["pairwise"] or None)["json"]
    return paths


__all__ = ["LAYER_METRICS", "METRICS", "PAIRWISE", "SPREAD", "arch_table", "collect", "compare", "layer_table",
           "run_compute", "spearman", "val_loss_note", "welch", "write_compare"]
