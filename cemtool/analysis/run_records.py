"""One record per source run of a comparison, read from the runs' records and reports alone (no checkpoint is
read): the inputs resolved to source runs and their fine-tunes, each run's evaluation, parameters and FLOPs, and
the fields of its named sharpness and collapse reports and of its fine-tunes' forgetting reports. What each source
provides is in the docstring of :mod:`cemtool.analysis.compare`, which groups these records and compares them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from cemtool.analysis.compute import run_compute
from cemtool.analysis.curvature import DEFAULT_OPERATOR, symbol
from cemtool.config import to_dict
from cemtool.errors import CemtoolError, did_you_mean
from cemtool.fileio import read_json
from cemtool.layout import is_run
from cemtool.models.registry import get_arch
from cemtool.report import group_labels, mismatched_settings, named_reports, run_settings
from cemtool.runs import open_run
from cemtool.sweep import read_manifest  # validated whole: a hand-edited study is one line

METRICS = {"val_loss": "val loss", "val_bpb": "val bits/byte", "val_ppl": "val perplexity", "params": "params",
           "flops_per_token": "FLOPs/token", "lambda_max": "λ_max",
           "lambda_min": "λ_min", "trace_per_param": "tr(H)/n", "trace": "tr(H)",
           "asam": "adaptive sharpness (ASAM, scale-invariant)", "sam": "SAM sharpness", "forgetting": "forgetting",
           "plasticity": "plasticity", "forgetting_matched": "forgetting at matched plasticity",
           "value_entropy": "H(values) last", "separability": "probe(values) last"}


def metric_labels(operator: str | None = None) -> dict[str, str]:
    """METRICS' labels with the curvature operator's symbol in the trace columns (tr(G)/n for a GGN comparison):
    a comparison's columns say which operator they hold."""
    A = symbol(operator or DEFAULT_OPERATOR)
    return {k: v.replace("(H)", f"({A})") for k, v in METRICS.items()}


NAMED = ("sharpness", "collapse")  # analyses whose report is chosen by name (``names``); forgetting: by target


def sharpness_fields(report: dict) -> dict:
    """λ_max, λ_min, tr(H)/n and tr(H) with n (first trace estimate), the operator, ‖g‖ and the stationarity
    verdict of a sharpness report (cemtool backend). λ_max (λ_min) is
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
            "trace": t.get("trace"), "trace_se": t.get("se"), "curvature_n": report.get("n_params"),
            "curvature_operator": (report.get("options") or {}).get("operator", DEFAULT_OPERATOR),  # older reports: H
            "standing": (report.get("standing") or {}).get("verdict"), "grad_norm": report.get("grad_norm"),
            "sharpness_tokens": report.get("tokens"), **_worst_case(report)}


def _worst_case(report: dict) -> dict:
    """The adaptive (ASAM: the perturbation scaled by |w|, invariant to rescaling a layer's weights) and plain SAM
    sharpness of a report (nats: perturbed loss - loss; the first of each kind), null when not measured: beside the
    trace in a comparison, because tr/n and λ_max change under reparameterisations that leave the function alone
    (Dinh et al. 2017) and ASAM does not."""
    out = {"asam": None, "sam": None}
    for s in report.get("sharpness") or []:
        if isinstance(s, dict) and s.get("kind") in out and out[s["kind"]] is None:
            out[s["kind"]] = s.get("value")
    return out


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


def _curve(report: dict) -> list[list[float]]:
    """A fine-tune's (plasticity, forgetting) so far at each point of its curve, from step 0 (0, 0) on."""
    before = report.get("before") or {}
    if before.get("target_loss") is None or before.get("source_loss") is None:
        return []
    return [[before["target_loss"] - p["target_loss"], p["source_loss"] - before["source_loss"]]
            for p in report.get("curve") or [] if p.get("target_loss") is not None
            and p.get("source_loss") is not None]


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
    """One record per source run (see the docstring of :mod:`cemtool.analysis.compare`) and notes on what was
    skipped. ``at_tokens``: take each run's validation loss from its last evaluation at or before that many training
    tokens (metrics.jsonl) instead of the final one. ``names``: which named report of each analysis to read (default
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
        rec: dict = {"run": str(u), "label": None, "arch": cfg.model.arch, "seed": cfg.seed, "lr": cfg.train.lr,
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
                       forgetting_run=str(f[0].parent.parent), forgetting_curve=_curve(f[1]))
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
        if others:  # a suggestion only where some run lacks the report read
            close = did_you_mean(names[kind], others) if any(r["reports"].get(kind) is None for r in records) \
                else None
            notes.append(f"{kind} reports not compared: {', '.join(others)} (compare reads '{names[kind]}'"
                         f"{': ' + close if close else ''}; choose another with --{kind} NAME)")
    return records, notes


def settings_mismatch(records: list[dict]) -> dict[str, dict]:
    """Per analysis, the settings its compared reports differ in: kind -> {setting: {value: [run, ...]}}."""
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
