"""Every figure and report.md of a run or a sweep, from what is on disk; never recomputes, never imports models.

:func:`render_all` is what ``cemtool plot`` runs:

- a **run** (a folder with config.json): the training curves from metrics.jsonl, then for each
  ``reports/<stem>.json`` the figures of that analysis (its own plotting module, :data:`PLOTTERS`), the
  eigenvalues-per-layer figure when there are ``sharpness-layer-N`` reports, then report.md;
- a **sweep** (any other folder holding runs below it and/or reports: a ``cemtool sweep`` study, ``cemtool demo``'s
  output, a saturation sweep, a comparison folder): the same for every run in it; then, on one pair of axes each,
  the training curves of all trained runs (fine-tunes excluded), the forgetting curves of all fine-tunes and the
  eigenvalues per layer of all runs; the figures of the sweep-level reports (``<root>/reports/*.json`` and
  ``<root>/*.json`` written by a command); and a report.md that links the runs' own.

A report that cannot be drawn (missing plotting module, unexpected shape, corrupt JSON) is recorded as a problem;
everything else is still drawn, and the caller decides whether a problem is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cemtool.errors import CemtoolError
from cemtool.layout import is_hf_dir, is_run
from cemtool.plots.blocks import plot_blocks
from cemtool.plots.collapse import plot_collapse
from cemtool.plots.compare import layer_of, plot_compare, plot_forgetting, plot_layer_eigenvalues
from cemtool.plots.curvature import plot_curvature
from cemtool.plots.report_md import section_writer, study_section, write_collection_report, write_run_report
from cemtool.plots.saturation import plot_logits, plot_sweep, plot_truncation
from cemtool.plots.sharpness import plot_sharpness
from cemtool.plots.style import save
from cemtool.plots.training import (
    SEED_STYLES,
    distinguishable,
    group_runs,
    label_runs,
    plot_training,
    read_json,
    read_run,
    training_groups_figure,
)
from cemtool.report import mismatch_text, mismatched_settings, named_reports, report_kind, report_options

Plotter = Callable[[dict, Path, str], list[Path]]

# --------------------------------------------------------------------------------------------------------------
# one plotting call per report kind: each calls that analysis' own plotting module


def _collapse(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_collapse(report, plots, stem)


def _saturation(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_truncation(report, plots, stem) + plot_logits(report, plots, stem)


def _saturation_sweep(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_sweep(report, plots, stem)


def _sharpness(report: dict, plots: Path, stem: str) -> list[Path]:
    if (report.get("provenance") or {}).get("backend") == "pyhessian":
        return []  # PyHessian's cross-check: numbers only
    if layer_of(report) is not None and not report.get("density") and not report.get("slice_1d") \
            and not report.get("slice_2d"):
        return []  # only eigenvalues: drawn with the other layers' in the eigenvalues-per-layer figure
    return plot_sharpness(report, plots, prefix=stem)


def _forgetting(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_forgetting([report], plots, stem)


def _compare(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_compare(report, plots, stem)


def _blocks(report: dict, plots: Path, stem: str) -> list[Path]:
    return plot_blocks(report, plots, f"{stem}_blocks")  # sharpness --per-layer / --blocks: block x layer maps


PLOTTERS: dict[str, Plotter] = {"collapse": _collapse, "collapse_compare": _collapse, "compare": _compare,
                                "forgetting": _forgetting, "saturation": _saturation,
                                "saturation_sweep": _saturation_sweep, "sharpness": _sharpness,
                                "sharpness_per_layer": _blocks}

SHAPE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError)


def plotter_for(stem: str) -> Plotter | None:
    """The plotting call of a report: by its exact stem, else by the longest known stem it starts with
    (``sharpness-layer-0`` -> sharpness)."""
    if stem in PLOTTERS:
        return PLOTTERS[stem]
    keys = [k for k in PLOTTERS if stem.startswith(k + "_") or stem.startswith(k + "-")]
    return PLOTTERS[max(keys, key=len)] if keys else None


# --------------------------------------------------------------------------------------------------------------
# finding things


def find_reports(folder: Path, top_level: bool = False) -> list[Path]:
    """``reports/*.json`` of a run or a sweep; with ``top_level``, also ``*.json`` beside it that a command wrote
    (they carry a ``provenance`` entry; config.json, meta.json, study.json and the like do not)."""
    found = sorted((folder / "reports").glob("*.json")) if (folder / "reports").is_dir() else []
    if top_level:
        for p in sorted(folder.glob("*.json")):
            try:
                if isinstance(obj := read_json(p, "report"), dict) and "provenance" in obj:
                    found.append(p)
            except CemtoolError:
                continue
    return found


def find_runs(root: Path) -> list[Path]:
    """Run directories below ``root`` (not runs moved aside by ``--force``: ``<name>.replaced-<time>``)."""
    runs = {p.parent for p in root.rglob("config.json") if is_run(p.parent)}
    return sorted(r for r in runs if ".replaced-" not in str(r.relative_to(root)) and r != root)


def is_finetune(run: Path) -> bool:
    """A fine-tune written by ``cemtool forgetting`` (its meta.json names a parent run)."""
    try:
        meta = read_json(run / "meta.json", "run metadata")
    except CemtoolError:
        return False
    return isinstance(meta, dict) and bool(meta.get("parent"))


def _has_metrics(run: Path) -> bool:
    return (run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size > 0


# --------------------------------------------------------------------------------------------------------------
# drawing


def _pngs(paths: list[Path]) -> list[Path]:
    return [p for p in paths if p.suffix == ".png"]


def _plot_reports(paths: list[Path], plots: Path, figures: dict, problems: list[str]) -> dict:
    """Draw each report's figures; return stem -> (path, content, or None when unusable)."""
    reports: dict[str, tuple[Path, dict | None]] = {}
    for path in paths:
        stem = path.stem
        try:
            rep = read_json(path, "report")
        except CemtoolError as e:
            problems.append(e.message)
            reports[stem] = (path, None)
            continue
        try:
            if not isinstance(rep, dict):
                raise TypeError("not a JSON object")
            plotter = PLOTTERS.get(report_kind(stem, rep) or "") or plotter_for(stem)  # any name (--name)
            if plotter is not None:
                figures[stem] = _pngs(plotter(rep, plots, stem))
            writer = section_writer(stem, rep)
            if writer is not None:
                writer(rep)  # its numbers can be read too
        except ModuleNotFoundError as e:
            problems.append(f"report {path}: its plotting module {e.name} is missing")
        except SHAPE_ERRORS as e:
            problems.append(f"report {path} does not have the shape this version of cemtool expects "
                            f"({type(e).__name__}: {str(e)[:100]})")
            rep = None
        reports[stem] = (path, rep)
    return reports


def _layer_entries(runs: list[Path]) -> tuple[list[dict], list[Path]]:
    """Per run, its ``sharpness --params layer:N`` reports (for the eigenvalues-per-layer figure)."""
    curves = label_runs([read_run(r) for r in runs])
    entries, sources = [], []
    for c in curves:
        reps = []
        for named in named_reports(c.path, kind="sharpness"):  # whatever their names (sharpness --name)
            rep, p = named.report, named.path  # an unreadable one is reported by _plot_reports
            if isinstance(rep, dict) and layer_of(rep) is not None and rep.get("eigen"):
                reps.append(rep)
                sources.append(p)
        if reps:
            entries.append({"label": c.label, "arch": c.arch, "seed": c.seed, "reports": reps})
    return entries, sources


def _layers(runs: list[Path], plots: Path, figures: dict, reports: dict, problems: list[str]) -> None:
    entries, sources = _layer_entries(runs)
    if not entries:
        return
    try:
        figures["sharpness_layers"] = _pngs(plot_layer_eigenvalues(entries, plots))
    except SHAPE_ERRORS as e:
        problems.append(f"the per-layer sharpness reports do not have the expected shape ({type(e).__name__}: {e})")
        return
    reports["sharpness_layers"] = (sources, [r for e in entries for r in e["reports"]])
    for stem in [s for s in reports if s.startswith("sharpness-layer-")]:  # one section for all layers
        figures["sharpness_layers"] += figures.pop(stem, [])
        reports.pop(stem)


def render_run(run: str | Path, problems: list[str] | None = None) -> list[Path]:
    """Figures (PNG + SVG) and report.md of one run. Returns the PNGs and the report.md written."""
    run = Path(run)
    read_run(run)  # a clear error if this is not a run or its JSON is corrupt
    problems = [] if problems is None else problems
    mine: list[str] = []
    plots = run / "plots"
    figures: dict[str, list[Path]] = {}
    notes = []
    if _has_metrics(run):
        # plot_curvature: [] unless the run was trained with train.curvature_every
        figures["training"] = _pngs(plot_training([run], plots)) + _pngs(plot_curvature(run, plots))
    else:
        notes.append("metrics.jsonl is missing or empty: no training curves")
    reports = _plot_reports(find_reports(run), plots, figures, mine)
    _layers([run], plots, figures, reports, mine)
    md = write_run_report(run, figures, reports, notes + mine)
    problems += mine
    return [p for figs in figures.values() for p in figs] + [md]


MAX_OVERLAID = 12  # at most this many runs are drawn on one pair of axes in the merged forgetting/collapse figures


def _forgetting_all(finetunes: list[Path], plots: Path, figures: dict, reports: dict, problems: list[str],
                    notes: list[str]) -> None:
    found = [(p / "reports" / "forgetting.json") for p in finetunes]
    found = [p for p in found if p.exists()]
    reps = []
    for p in found:
        try:
            rep = read_json(p, "report")
        except CemtoolError:
            continue  # reported by the run's own rendering
        if isinstance(rep, dict) and rep.get("curve"):
            reps.append(rep)
    if not reps:
        return
    if len(reps) > MAX_OVERLAID:
        notes.append(f"no overlaid forgetting curves: {len(reps)} fine-tunes are too many for one pair of axes "
                     f"(the table below and the comparison's bars have their numbers)")
        reports["forgetting"] = (found, reps)
        return
    try:
        figures["forgetting"] = _pngs(plot_forgetting(reps, plots, "forgetting"))
    except SHAPE_ERRORS as e:
        problems.append(f"the forgetting reports do not have the expected shape ({type(e).__name__}: {e})")
        return
    reports["forgetting"] = (found, reps)


def _collapse_all(runs: list[Path], plots: Path, figures: dict, reports: dict, problems: list[str],
                  notes: list[str]) -> None:
    """The runs' own collapse reports merged into one comparison (the same figures as ``cemtool collapse-report
    RUN RUN ...``, every run on the same axes); nothing is measured again."""
    found = []  # (run, report path, per-run entry)
    options = {}  # run -> the settings its report was measured with
    for r in runs:
        p = r / "reports" / "collapse.json"
        try:
            rep = read_json(p, "report") if p.exists() else None
        except CemtoolError:
            continue  # reported by the run's own rendering
        if isinstance(rep, dict) and isinstance(rep.get("runs"), list):
            found += [(r, p, entry) for entry in rep["runs"]]
            options[f"{r.parent.name}/{r.name}"] = report_options(rep)
    if len(found) < 2:
        return
    if diff := mismatched_settings(options):
        notes.append(f"the merged collapse reports were measured with different settings: {mismatch_text(diff)}")
    if len(found) > MAX_OVERLAID:
        notes.append(f"no merged collapse figures: {len(found)} runs are too many for one pair of axes (the "
                     f"comparison's compare_layers figure averages them over seeds; each run's own report.md "
                     f"has its figures)")
        return
    labels = [e.get("label") for _, _, e in found]
    unique = len(set(labels)) == len(labels)
    merged = [e if unique else {**e, "label": f"{r.parent.name}/{r.name}"} for r, _, e in found]
    sources = list(dict.fromkeys(p for _, p, _ in found))
    payload = {"provenance": {"merged_from": [str(p) for p in sources]}, "runs": merged}
    try:
        figures["collapse_compare"] = _pngs(_collapse(payload, plots, "collapse_compare"))
    except SHAPE_ERRORS as e:
        problems.append(f"the collapse reports do not have the expected shape ({type(e).__name__}: {e})")
        return
    reports["collapse_compare"] = (sources, payload)


def _training_groups(curves: list, plots: Path, figures: dict, reports: dict, notes: list[str]) -> None:
    """Validation curves averaged over seeds per group, when some group has several seeds; the groups are the
    comparison's (compare.json of this folder) where it names every run, else the runs' own settings."""
    cmp = (reports.get("compare") or (None, None))[1]
    runs = cmp.get("runs") if isinstance(cmp, dict) else None
    by_path = {Path(r["run"]).resolve(): r["label"] for r in runs or [] if isinstance(r, dict) and "label" in r}
    groups = group_runs(curves, {str(c.path): by_path.get(c.path.resolve()) for c in curves})
    if not any(len(g) > 1 for g in groups.values()):
        return  # nothing to average
    archs = [g[0].arch for g in groups.values()]
    if len(groups) > MAX_OVERLAID or max(archs.count(a) for a in archs) > len(SEED_STYLES):
        notes.append(f"no averaged training curves: {len(groups)} groups of runs are too many to tell apart on one "
                     f"pair of axes (colour = architecture, line style = group)")
        return
    figures["training_groups"] = _pngs(save(training_groups_figure(groups), plots, "training_groups"))


def render_sweep(root: str | Path, runs: list[Path] | None = None, *, each_run: bool = True,
                 problems: list[str] | None = None, title: str | None = None) -> list[Path]:
    """Figures and report.md of a folder of runs (or of ``runs`` given explicitly, drawn into ``root``)."""
    root = Path(root)
    problems = [] if problems is None else problems
    runs = find_runs(root) if runs is None else [Path(r) for r in runs]
    written: list[Path] = []
    if each_run:
        for r in runs:
            written += render_run(r, problems)
    mine: list[str] = []
    notes: list[str] = []
    plots = root / "plots"
    figures: dict[str, list[Path]] = {}
    finetunes = [r for r in runs if is_finetune(r)]
    trained = [r for r in runs if r not in finetunes]
    with_metrics = [r for r in trained if _has_metrics(r)]
    curves = [read_run(r) for r in with_metrics]
    if curves and distinguishable(curves) and len(curves) <= MAX_OVERLAID:
        figures["training"] = _pngs(plot_training(curves, plots))
    elif curves:  # colour = architecture and line style cannot tell so many runs apart
        notes.append(f"no overlaid training curves of all {len(curves)} runs: too many for one pair of axes "
                     f"(each run's report.md has its own curves)")
    reports: dict = {}
    if (root / "study.json").is_file():
        try:
            study = read_json(root / "study.json", "study manifest")
            study_section(study)  # readable
            reports["study"] = (root / "study.json", study)
            title = title or (f"`cemtool demo`: {root.name}" if (root / "reports" / "demo.json").exists()
                              else f"Study `{root.name}`")
        except CemtoolError as e:
            mine.append(e.message)
        except SHAPE_ERRORS as e:
            mine.append(f"{root / 'study.json'} does not have the shape this version of cemtool expects "
                        f"({type(e).__name__}: {str(e)[:100]})")
    reports.update(_plot_reports(find_reports(root, top_level=True), plots, figures, mine))
    _training_groups(curves, plots, figures, reports, notes)
    if "forgetting" not in reports:
        _forgetting_all(finetunes, plots, figures, reports, mine, notes)
    if "sharpness_layers" not in reports:
        _layers(trained, plots, figures, reports, mine)
    if "collapse_compare" not in reports:
        _collapse_all(trained, plots, figures, reports, mine, notes)
    md = write_collection_report(root, trained, figures, reports, notes + mine, title, finetunes=finetunes)
    problems += mine
    return written + [p for figs in figures.values() for p in figs] + [md]


def render_all(path: str | Path, problems: list[str] | None = None, *, each_run: bool = True) -> list[Path]:
    """Every figure and report.md of a run or a sweep; returns the PNGs (each has an SVG beside it) and the
    report.md files written. Reports that cannot be drawn are appended to ``problems`` when it is given;
    otherwise the first of them raises a CemtoolError after everything else was drawn."""
    p = Path(path)
    if not p.exists():
        raise CemtoolError(f"{p} does not exist", hint="give a run directory or a folder of runs")
    if not p.is_dir():
        raise CemtoolError(f"{p} is not a directory", hint="give a run directory or a folder of runs")
    if is_hf_dir(p):
        raise CemtoolError(f"{p} is a Hugging Face model directory, not a cemtool run: there is nothing to plot",
                           hint="plot a cemtool run or a folder of runs")
    collected: list[str] = []
    if is_run(p):
        written = render_run(p, collected)
    else:
        if not find_runs(p) and not find_reports(p, top_level=True):
            raise CemtoolError(f"{p} holds no cemtool run and no report",
                               hint="give a run directory (with config.json) or a folder of runs")
        written = render_sweep(p, each_run=each_run, problems=collected)
    if problems is not None:
        problems += collected
    elif collected:
        more = f" (and {len(collected) - 1} more)" if len(collected) > 1 else ""
        raise CemtoolError(collected[0] + more, hint="the other figures and report.md were written")
    return written


__all__ = ["PLOTTERS", "find_reports", "find_runs", "is_finetune", "plotter_for", "render_all", "render_run",
           "render_sweep"]
