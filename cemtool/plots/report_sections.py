"""The sections of a report.md, one per report found in ``reports/``, and its figure lists with captions.

Section writers take the report's JSON (as the command wrote it) and return Markdown; :data:`SECTIONS` maps a
report's file stem to its writer; :func:`section` puts a section's title, numbers, figures and source files
together. Never recomputes. The pages around them are assembled by :mod:`cemtool.plots.report_md`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from cemtool.analysis.curvature import DEFAULT_OPERATOR, symbol, title
from cemtool.plots.compare import layer_of
from cemtool.report import SPREAD, fmt, markdown_table, report_kind, report_options

# --------------------------------------------------------------------------------------------------------------
# small formatting helpers


def pm(mean: float | None, se: float | None, digits: int = 4) -> str:
    """``mean ± se`` (or just the mean, or ``-``)."""
    if mean is None:
        return "-"
    known = se is not None and math.isfinite(float(se))
    return fmt(float(mean), digits) + (f" ± {float(se):.2g}" if known else "")


def _int(v) -> str:
    return "-" if v is None else f"{int(v):,}"


def _rel(path: Path, base: Path) -> str:
    return Path(os.path.relpath(Path(path).resolve(), Path(base).resolve())).as_posix()


CAPTIONS = {
    "training": "training loss (thin: moving average over 5% of the run's batches) and validation loss (markers) "
                "against tokens seen (colour: architecture; line style: seed)",
    "curvature": "λ_max of the Hessian on a fixed validation batch during training against 2/η (dashed; dotted: "
                 "λ_max of M^½HM^½ where the parameters' groups take other multiples M of η), and when "
                 "recorded the preconditioned λ_max of Adam against (2+2β1)/((1−β1)η) and tr(H) ± 1 SE (open markers: "
                 "Lanczos not converged)",
    "collapse_layers": "per layer: matrix entropy of values and hidden states, linear-probe accuracy, effective rank, "
                       "mean pairwise cosine and normalised attention entropy (error bars: s.e. over sequences, "
                       "probe std over folds)",
    "collapse_attention": "attention entropy / log(context) and maximum attention probability against context length, "
                          "per layer (mean over heads)",
    "collapse_routing": "LIMe router weights per layer (consumer head x source layer/head), share per source layer "
                        "and expected retrieved layer",
    "collapse_streams": "learned optimizer-stream scalars per layer (attention and MLP substeps)",
    "saturation_truncation": "loss increase when the score form W_Q W_K^T is truncated to rank r (thin: one head; "
                             "thick: the whole layer; dotted: tolerance)",
    "saturation_logits": "attention-logit range (max - min) against context length, mean over heads",
    "sharpness_blocks": "per block (rows: tensor kind, or the whole layer; columns: layer): the largest eigenvalue "
                        "(Lanczos; * not converged) and the trace (Hutchinson-type estimate) of the curvature "
                        "operator restricted to that block's parameters; grey –: no such block",
    "sharpness_spectrum": "spectral density of the curvature operator the title names (stochastic Lanczos "
                          "quadrature, log scale) with the extreme eigenvalues from Lanczos marked (dotted: not "
                          "converged)",
    "sharpness_slice": "loss along filter-normalised random directions through the trained weights (1-D slice; "
                       "2-D: contours on the plane of two directions, + = the trained weights)",
    "sharpness_layers": "per layer: largest and smallest eigenvalue of the Hessian restricted to that layer's "
                        "parameters (error bars: Lanczos error estimates; hollow: not converged) and tr(H)/n",
    "forgetting": "validation loss on the source data (left: rises = forgetting) and on the target data (right: "
                  "falls = plasticity) along the fine-tune; dashed: entropy floors",
    "compare_correlations": "each run's forgetting against its curvature (tr(H)/n, λ_max); colour: architecture, "
                            "marker: seed; Spearman's rank correlation in the title",
    "compare": "per architecture: the mean over seeds (large marker) with error bars of ± one standard deviation "
               "over seeds (the tables' ±); dots: the individual seeds; y axes span the data, not zero",
    "training_groups": "validation loss averaged over the seeds of each group of runs (band: ± one standard "
                       "deviation over seeds)",
    "compare_layers": "value entropy and value separability against depth, one line per architecture: mean over "
                      "seeds with error bars of ± one standard deviation over seeds (from the runs' collapse "
                      "reports)",
    "saturation_sweep": "final validation loss against head size at a fixed budget H d_h, one line per sequence "
                        "length (error bars: s.e. over seeds; dashed: floor)",
}


def caption(fig: Path) -> str:
    """The caption of a figure from its file name: ``<kind>[_<label>]_<part>[_<label>]`` -> CAPTIONS[kind_part]."""
    stem = Path(fig).stem
    words = re.split(r"[_-]", stem)
    for key in sorted(CAPTIONS, key=len, reverse=True):
        kind, _, part = key.partition("_")
        if words[0] == kind and (not part or part in words[1:]):
            return CAPTIONS[key]
    return stem.replace("_", " ")


FLOOR_CAPTIONS = {"training": "; dashed: the corpus's exact entropy floor; right: the validation gap above the floor "
                              "(log scale)",
                  "training_groups": "; dashed: the entropy floor; right: the gap above it"}


def figures_md(figs: list[Path], base: Path, floor: bool = True) -> str:
    """Each PNG inline with its caption and a link to the SVG beside it. ``floor``: whether the runs' corpus has an
    entropy floor (the training figures draw it, and their captions describe it, only then)."""
    out = []
    for f in figs:
        f = Path(f)
        if f.suffix != ".png":
            continue
        svg = f.with_suffix(".svg")
        link = f" ([SVG]({_rel(svg, base)}))" if svg.exists() else ""
        extra = FLOOR_CAPTIONS.get(f.stem, "") if floor else ""
        out.append(f"![{f.stem}]({_rel(f, base)})\n\n*{f.stem}: {caption(f)}{extra}*{link}\n")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------------------------
# sections: one per report kind, returning the Markdown of its numbers


def collapse_section(report: dict) -> str:
    out = []
    opts = report.get("provenance", {}).get("options", {})
    for r in report["runs"]:
        c = r["collapse"]
        out.append(f"**{r['label']}** (`{r['arch']}`, step {r.get('step')}): {c['tokens']:,} tokens "
                   f"({c['sequences']} sequences of {c['seq_len']}), Rényi alpha = {c['alpha']}; "
                   f"entropy in nats (mean ± s.e. over sequences), probe = {opts.get('folds', 5)}-fold CV accuracy "
                   f"(chance {fmt(1 / len(c['probe_classes']['names']), 3) if c.get('probe_classes') else '-'}).\n")
        rows = [{"layer": s["layer"], "H(values)": pm(s["v_entropy"], s["v_entropy_se"], 3),
                 "H(hidden)": pm(s["h_entropy"], s["h_entropy_se"], 3),
                 "probe values": pm(s["probe_v"], s.get("probe_v_std"), 3),
                 "probe hidden": pm(s["probe_h"], s.get("probe_h_std"), 3),
                 "erank hidden": fmt(s["h_erank"], 3), "cosine hidden": fmt(s["h_cosine"], 3),
                 "attn H / log ctx": fmt(s["attn_entropy_norm"], 3)} for s in r["summary"]]
        out.append(markdown_table(rows))
        routing = r.get("routing")
        if isinstance(routing, dict):
            exp = ", ".join(f"layer {e['layer']}: {e['expected_layer']:.2f}" for e in routing["layers"])
            out.append(f"LIMe {routing['variant']} router, expected retrieved layer: {exp}.\n")
        scalars = r.get("stream_scalars")
        if isinstance(scalars, list) and scalars:
            out.append("Optimizer-stream scalars:\n\n" + markdown_table(scalars, digits=3))
    return "\n".join(out)


def saturation_section(report: dict) -> str:
    sat = report["saturation"]
    ranks = sorted({r for e in sat["layers"] for r in e["ranks"]})
    rows = []
    for e in sat["layers"]:
        inc = dict(zip(e["ranks"], e["layer_loss_increase"], strict=True))
        row = {"layer": e["layer"], "H x d_h": f"{e['heads']}x{e['head_dim']}", "truncation": e["truncation"]}
        row.update({f"r={r}": (f"{inc[r]:+.4f}" if r in inc else "") for r in ranks})
        row["tolerated r"] = e["tolerated_rank"]
        rows.append(row)
    out = [f"Loss increase (nats/token) when every head of a layer is truncated to rank r; base loss "
           f"{fmt(sat['base_loss'])} on {sat['tokens']:,} tokens; tolerated r = smallest rank within "
           f"{sat['tolerance']} nats.\n", markdown_table(rows)]
    for k, why in (sat.get("not_applicable") or {}).items():
        out.append(f"- layer {k}: {why}" if str(k).isdigit() else f"- {why}")
    adv = report.get("advice") or {}
    if adv.get("applicable"):
        out.append(f"\nAllocation advice (budget {adv['budget']} -> {adv['new_budget']}): heads {adv['heads']}, "
                   f"head_dims {adv['head_dims']} (`reports/saturation_advice.toml`; rule: {adv.get('rule', '')}).\n")
    elif adv:
        out.append(f"\nAllocation advice: {adv.get('why', 'not applicable')}.\n")
    return "\n".join(out)


def saturation_sweep_section(report: dict) -> str:
    rows = []
    for s in report["summary"]:
        for p in s["points"]:
            rows.append({"T": s["seq_len"], "d_h": p["head_dim"],
                         "H": report.get("heads") or report["budget"] // p["head_dim"],
                         "loss": pm(p["loss"], p["se"]), "floor": fmt(p["floor"]), "seeds": p["seeds"],
                         "gain / doubling": "-" if p.get("gain_per_doubling") is None
                         else f"{p['gain_per_doubling']:+.4f}"})
    sat = "; ".join(f"T = {s['seq_len']}: " + (f"saturates at d_h = {s['saturation_head_dim']}"
                                               if s["saturation_head_dim"] else "no saturation in the grid")
                    for s in report["summary"])
    at = f"H = {report['heads']} heads" if report.get("heads") else f"budget H d_h = {report['budget']}"
    return (f"Task `{report['task']}`, {at}, {report['steps']} steps, seeds "
            f"{report['seeds']}; final validation loss (nats/token, mean ± s.e. over seeds). {sat}.\n\n"
            + markdown_table(rows))


def sharpness_section(report: dict) -> str:
    """The numbers of one ``cemtool sharpness`` report: eigenvalues, traces, sharpness measures, slices."""
    o = report.get("options") or {}
    rows = [{"quantity": "loss", "value": fmt(report["loss"]), "uncertainty / notes": f"{report['tokens']:,} tokens"},
            {"quantity": "gradient norm", "value": fmt(report["grad_norm"]), "uncertainty / notes": ""}]
    e = report.get("eigen")
    if e:
        for end, sym in (("top", "λ_top"), ("bottom", "λ_bottom")):
            for i, v in enumerate(e.get(end) or []):
                ok = e[f"{end}_converged"][i]
                rows.append({"quantity": f"{sym}[{i + 1}]", "value": fmt(v),
                             "uncertainty / notes": f"error ≤ ~{e[f'{end}_error'][i]:.2g}"
                                                    + ("" if ok else ", NOT converged")})
    for t in report.get("traces") or []:
        rows.append({"quantity": f"tr(H) ({t['method']})", "value": pm(t["trace"], t["se"]),
                     "uncertainty / notes": f"s.e.; {t['hvps']} HVPs"})
        rows.append({"quantity": f"tr(H)/n ({t['method']})", "value": pm(t["per_param"], t["per_param_se"]),
                     "uncertainty / notes": f"n = {t['n']:,} parameters"})
    d = report.get("density")
    if d:
        rows.append({"quantity": "spectral density (SLQ)", "value": "-",
                     "uncertainty / notes": f"{d['runs']} run(s) x {d['steps']} Lanczos steps, σ = {d['sigma']:.3g}"})
    names = {"sam": "SAM", "asam": "ASAM (adaptive)", "average": "average-case (adaptive)"}
    for sh in report.get("sharpness") or []:
        extra = f"ρ = {sh['rho']:g}" + (f", η = {sh['eta']:g}" if sh.get("eta") is not None else "") + \
            (f", {sh['samples']} antithetic pairs" if sh.get("samples") else "") + \
            (f", {sh['ascent_steps']} ascent steps" if sh.get("ascent_steps", 1) > 1 else "")
        rows.append({"quantity": f"sharpness {names.get(sh['kind'], sh['kind'])}", "value": pm(sh["value"], sh["se"]),
                     "uncertainty / notes": extra})
    for key, what in (("slice_1d", "1-D loss slice"), ("slice_2d", "2-D loss slice")):
        sl = report.get(key)
        if sl:
            flat = [v for row in sl["losses"] for v in (row if isinstance(row, list) else [row])]
            rows.append({"quantity": what, "value": f"{fmt(min(flat))} .. {fmt(max(flat))}",
                         "uncertainty / notes": f"{len(sl['alphas'])} points per axis, ±{max(sl['alphas']):g} "
                                                f"(filter-normalised)"})
    head = (f"Hessian of the mean token loss over N = {report['tokens']:,} evaluation tokens ({report['sequences']} "
            f"windows of {report['seq_len']}), parameters `{o.get('params', 'all')}` ({report['n_params']:,} of "
            f"{report['n_model_params']:,}), {o.get('dtype', 'fp32')}; {report.get('hvps', 0)} HVPs in "
            f"{fmt(report.get('seconds'), 3)} s. Eigenvalue errors are Lanczos error estimates; ± is a standard "
            f"error.\n")
    return head + "\n" + markdown_table(rows) + negative_curvature_note(e) + settings_line(report)


def negative_curvature_note(eigen: dict | None) -> str:
    """A line when the most negative eigenvalue is larger in magnitude than the largest one."""
    top, bottom = (eigen or {}).get("top") or [], (eigen or {}).get("bottom") or []
    if not top or not bottom or abs(bottom[0]) <= abs(top[0]):
        return ""
    return (f"\n**Note: |λ_min| = {fmt(abs(bottom[0]))} > λ_max = {fmt(top[0])}**: the most negative curvature exceeds "
            f"the most positive, so the weights are not near a minimum of this loss and λ_max alone understates the "
            f"curvature.\n")


def settings_line(report: dict) -> str:
    """The settings a report was measured with (:func:`cemtool.report.report_options`), for a report's section."""
    opts = {k: v for k, v in report_options(report).items() if v is not None}
    if not opts:
        return ""
    return "\nSettings: " + ", ".join(f"`{k}={v}`" for k, v in sorted(opts.items())) + ".\n"


def layers_section(reports: list[dict]) -> str:
    """One row per layer subset (``sharpness --params layer:N``): extreme eigenvalues and the trace per param."""
    rows = []
    names = {Path(str((r.get("provenance") or {}).get("run"))).name for r in reports}
    for r in sorted(reports, key=lambda r: (str((r.get("provenance") or {}).get("run")), layer_of(r) or 0)):
        e, t = r.get("eigen") or {}, (r.get("traces") or [None])[0]
        run = {"run": Path(str((r.get("provenance") or {}).get("run"))).name} if len(names) > 1 else {}
        rows.append({**run, "layer": layer_of(r), "parameters": _int(r.get("n_params")),
                     "λ_max": fmt(e["top"][0]) + ("" if e["top_converged"][0] else " (not converged)")
                     if e.get("top") else "-",
                     "λ_min": fmt(e["bottom"][0]) + ("" if e["bottom_converged"][0] else " (not converged)")
                     if e.get("bottom") else "-",
                     "tr(H)/n": pm(t["per_param"], t["per_param_se"]) if t else "-", "tokens": _int(r.get("tokens"))})
    return ("Hessian restricted to each layer's parameters (`cemtool sharpness --params layer:N`).\n\n"
            + markdown_table(rows))


def per_layer_section(report: dict) -> str:
    """The table of ``cemtool sharpness --per-layer``: λ_max and tr(H) of each layer's Hessian block."""
    operator = (report.get("options") or {}).get("operator", DEFAULT_OPERATOR)
    A, blocks = symbol(operator), report.get("blocks", "layer")
    rows = [{"block": r.get("block") or r["layer"], "parameters": _int(r.get("n_params")),
             "λ_max": "-" if r.get("lambda_max") is None else
             fmt(r["lambda_max"]) + ("" if r.get("lambda_max_converged") else " (not converged)"),
             f"tr({A})": "-" if r.get("trace") is None else pm(r["trace"], r["trace_se"]),
             f"tr({A})/n": "-" if r.get("trace") is None else pm(r["trace_per_param"], r["trace_per_param_se"])}
            for r in report["layers"]]
    what = ("each layer's parameters (`cemtool sharpness --per-layer`)" if blocks == "layer" else
            f"each parameter block (`cemtool sharpness --blocks {blocks}`)")
    return (f"{title(operator).capitalize()} restricted to {what}, "
            f"{_int(report.get('tokens'))} tokens.\n\n" + markdown_table(rows))


def forgetting_rows(reports: list[dict]) -> list[dict]:
    rows = []
    for r in reports:
        b, a = r["before"], r["after"]
        rows.append({"source run": Path(r["source"]["run"]).name, "arch": r["source"]["arch"],
                     "seed": (r.get("provenance") or {}).get("seed"),
                     "source loss before → after": f"{fmt(b['source_loss'])} → {fmt(a['source_loss'])}",
                     "target loss before → after": f"{fmt(b['target_loss'])} → {fmt(a['target_loss'])}",
                     "forgetting": f"{r['forgetting']:+.4f}", "plasticity": f"{r['plasticity']:+.4f}"})
    return rows


def forgetting_section(report: dict | list[dict]) -> str:
    reports = report if isinstance(report, list) else [report]
    r0 = reports[0]
    rec = r0["recipe"]
    return (f"Fine-tuned from the source data `{r0['source']['data']}` to `{r0['target']['data']}` with one recipe "
            f"(AdamW lr {rec['lr']:g}, betas {rec['beta1']}/{rec['beta2']}, wd {rec['weight_decay']:g}, "
            f"{rec['steps']} steps, {rec['warmup_steps']} warmup, {rec['schedule']} to {rec['min_lr_ratio']:g}x, "
            f"clip {rec['grad_clip']:g}, {rec['tokens_per_step']:,} tokens/step). Losses in nats/token on "
            f"{r0['source']['eval_tokens']:,} source and {r0['target']['eval_tokens']:,} target validation tokens; "
            f"forgetting = source loss after - before, plasticity = target loss before - after.\n\n"
            + markdown_table(forgetting_rows(reports)))


def pyhessian_section(report: dict) -> str:
    """``cemtool sharpness --backend pyhessian``: PyHessian's own numbers, for cross-checking."""
    rows = [{"quantity": f"eigenvalue {i + 1} (power iteration)", "value": fmt(v)}
            for i, v in enumerate(report.get("eigenvalues") or [])]
    if report.get("trace") is not None:
        rows.append({"quantity": "tr(H) (Hutchinson)", "value": pm(report["trace"], report.get("trace_se"))})
    errors = "".join(f"- PyHessian {k}() failed: {v}\n" for k, v in (report.get("errors") or {}).items())
    return (f"PyHessian {report.get('version')} on {_int(report.get('tokens'))} tokens ({_int(report.get('n'))} "
            f"parameters).\n\n" + markdown_table(rows) + errors)


def compare_section(report: dict) -> str:
    """The comparison table (mean ± std over seeds), Spearman correlations, pairwise Welch intervals and the
    comparison's notes (duplicate seeds, probes at their ceiling, |λ_min| > λ_max, settings that differ)."""
    # start-up: analysis.compare loads torch (~0.9 s); only a comparison's section needs it
    from cemtool.analysis.compare import METRICS
    from cemtool.analysis.compare_tables import arch_table, layer_table  # start-up: as above

    cols, rows = arch_table(report, transpose=True)
    out = [f"{len(report['runs'])} runs; {SPREAD}"
           + (f"; forgetting on `{report['target']}`" if report.get("target") else "") + ".\n",
           markdown_table([dict(zip(cols, r, strict=True)) for r in rows], cols)]
    cols, rows = layer_table(report)
    if rows:
        out.append(f"Per layer, from the collapse reports ({SPREAD}; per-layer differences with intervals in "
                   f"`compare.md`):\n\n" + markdown_table([dict(zip(cols, r, strict=True)) for r in rows], cols))
    corr = [{"pair": f"{METRICS.get(c['x'], c['x'])} vs {METRICS.get(c['y'], c['y'])}", "Spearman rho": c["rho"],
             "p": c["p"], "p from": c["p_method"] or "", "n": c["n"], "note": c["note"] or ""}
            for c in report.get("correlations", [])]
    if corr:
        out.append("Rank correlations across runs:\n\n" + markdown_table(corr))
    pw = [{"metric": METRICS.get(p["metric"], p["metric"]), "a - b": f"{p['a']} - {p['b']}", "diff": p["diff"],
           f"{report.get('level', 0.95):.0%} CI": "" if p["lo"] is None else f"[{fmt(p['lo'])}, {fmt(p['hi'])}]",
           "p": p["p"], "n": f"{p['n_a']}/{p['n_b']}", "note": p["note"] or ""} for p in report.get("pairwise", [])]
    if pw:
        out.append("Pairwise differences (Welch t intervals over seeds):\n\n" + markdown_table(pw))
    miss = [f"- {name}: {len(runs)} run(s) without it\n" for name, runs in (report.get("missing") or {}).items()
            if runs]
    notes = "".join(f"- {n}\n" for n in report.get("notes") or [])
    return ("\n".join(out) + ("\nMissing reports:\n\n" + "".join(miss) if miss else "")
            + ("\nNotes of the comparison:\n\n" + notes if notes else ""))


def demo_section(report: dict) -> str:
    """``cemtool demo``'s own timing: wall-clock and CPU seconds per step, and the settings it passed."""
    rows = [{"step": st["step"] + (" (reused: measured by the run that did it)" if st.get("reused") else ""),
             "wall clock (s)": f"{st['wall_s']:.1f}", "CPU (s)": f"{st['cpu_s']:.1f}"} for st in report["steps"]]
    tot = report["total"]
    done = any(st["step"] == "plot" for st in report["steps"])
    rows.append({"step": "**total**" if done else "**total before drawing the figures**",
                 "wall clock (s)": f"{tot['wall_s']:.1f}", "CPU (s)": f"{tot['cpu_s']:.1f}"})
    st = report.get("settings") or {}
    later = "" if done else " The figures (the last step) are timed in `reports/demo.json` and in the demo's output."
    if any(st.get("reused") for st in report["steps"]):
        this = report.get("this_session") or {}
        later += (f" The demo was run again on its folder: the steps marked reused kept the times of the run that did "
                  f"them; the total is the sum of the steps; this last run took {this.get('wall_s', 0):.1f} s.")
    return (f"Measured on {report.get('cpu_count')} CPU core(s), {report.get('threads')} torch thread(s); CPU = "
            f"process time of all threads.{later}\n\n" + markdown_table(rows)
            + f"\nSettings: architectures `{st.get('archs')}`, seeds `{st.get('seeds')}`, {_int(st.get('tokens'))} "
              f"tokens per run, `{' '.join(st.get('overrides', []))}`.\n")


def study_section(study: dict) -> str:
    plan = study.get("plan", {})
    head = (f"Study status **{study.get('status')}**: architectures {', '.join(plan.get('archs', []))}; seeds "
            f"{', '.join(map(str, plan.get('seeds', [])))}; {_int(plan.get('tokens'))} training tokens each on "
            f"`{plan.get('data')}`; analyses: {', '.join(plan.get('analyses', [])) or 'none'}"
            + (f" (fine-tune target `{plan['target']}`)" if plan.get("target") else "") + ".\n\n")
    rows = []
    for it in study.get("items", []):
        an = "; ".join(f"{k}: {v.get('status')}" + (f" ({v['error']})" if v.get("error") else "")
                       for k, v in (it.get("analyses") or {}).items())
        rows.append({"item": it.get("name"), "status": it.get("status") + (f" ({it['error']})" if it.get("error")
                                                                          else ""),
                     "params": _int(it.get("params")), "train FLOPs/token": _int(it.get("flops_per_token")),
                     "total FLOPs": f"{it['total_flops']:.3g}" if it.get("total_flops") else "-",
                     "val loss": fmt(it.get("val_loss")), "analyses": an})
    return head + markdown_table(rows)


SECTION_TITLES = {"sharpness": "Curvature and sharpness", "collapse": "Representation collapse",
                  "collapse_compare": "Representation collapse (comparison)", "saturation": "Softmax saturation",
                  "saturation_sweep": "Saturation sweep", "forgetting": "Forgetting and plasticity",
                  "compare": "Comparison", "study": "Study", "demo": "How long the demo took"}

SECTION_TITLES.update({"sharpness_layers": "Curvature per layer", "sharpness-per-layer": "Curvature per layer",
                       "sharpness_pyhessian": "PyHessian cross-check"})

SECTIONS: dict[str, Callable] = {"collapse": collapse_section, "collapse_compare": collapse_section,
                                 "saturation": saturation_section, "saturation_sweep": saturation_sweep_section,
                                 "sharpness": sharpness_section, "sharpness_layers": layers_section,
                                 "forgetting": forgetting_section, "study": study_section,
                                 "sharpness_pyhessian": pyhessian_section, "compare": compare_section,
                                 "demo": demo_section, "sharpness_per_layer": per_layer_section}


def section_writer(stem: str, report: dict | list | None = None) -> Callable | None:
    """The writer of a report stem: exact, else the longest known stem it starts with (``sharpness-attn``), else
    the analysis the report holds whatever its name (``sharpness --name mine``: :func:`cemtool.report.report_kind`);
    a per-layer sharpness report (its provenance says so) has its own, whatever its name."""
    if _kind(stem, report) == "sharpness_per_layer":
        return SECTIONS["sharpness_per_layer"]
    if stem in SECTIONS:
        return SECTIONS[stem]
    keys = [k for k in SECTIONS if stem.startswith(k + "_") or stem.startswith(k + "-")]
    if keys:
        return SECTIONS[max(keys, key=len)]
    kind = _kind(stem, report)
    if kind == "sharpness" and str((report.get("options") or {}).get("params", "all")).startswith("layer:"):
        return None  # a layer's report, under any name: its numbers are in the per-layer section
    return SECTIONS.get(kind or "")


def _kind(stem: str, report: dict | list | None) -> str | None:
    return report_kind(stem, report) if isinstance(report, dict) else None


def section_title(stem: str, report: dict | list | None = None) -> str:
    """``Curvature and sharpness`` for ``sharpness``; ``Curvature and sharpness (`mine`)`` for a report of that
    analysis under another name."""
    if stem in SECTION_TITLES:
        return SECTION_TITLES[stem]
    kind = stem.split("-")[0] if stem.split("-")[0] in SECTION_TITLES else _kind(stem, report)
    return f"{SECTION_TITLES[kind]} (`{stem}`)" if kind in SECTION_TITLES else stem.replace("_", " ")


def section(stem: str, report: dict | list | None, figs: list[Path], base: Path,
            source: Path | list[Path] | None = None) -> str:
    """``## Title``, the numbers (if a writer is known for this report), the figures, the source files."""
    parts = [f"## {section_title(stem, report)}\n"]
    writer = section_writer(stem, report)
    if writer is not None and report is not None:
        try:
            parts.append(writer(report))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # render.py checks reports first
            parts.append(f"_(the numbers of this report could not be read: {type(e).__name__}: {e})_\n")
    if figs:
        parts.append(figures_md(figs, base))
    sources = [] if source is None else source if isinstance(source, list) else [source]
    if len(sources) == 1:  # the report and its table
        src, csv = sources[0], sources[0].with_suffix(".csv")
        parts.append(f"Source: [{src.name}]({_rel(src, base)})"
                     + (f", [{csv.name}]({_rel(csv, base)})" if csv.exists() else "") + ".\n")
    elif sources:  # one report per run (each with its .csv beside it)
        parts.append("Sources: " + ", ".join(f"[{_rel(src, base)}]({_rel(src, base)})" for src in sources)
                     + " (each with its .csv).\n")
    return "\n".join(parts)
