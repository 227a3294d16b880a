"""One runner for every analysis: an entry point names a job, :func:`run_job` performs it.

An analysis is a module with an ``Options`` dataclass (its option types, ranges and defaults, checked by the
dataclass itself) and ``measure(subject, options, progress) -> Report``, a pure function: it never loads a model,
writes a file, prints or asks its rank. A ``Report`` has ``payload()`` (the JSON report without provenance),
``rows()`` (the CSV), ``provenance()`` (what the report's provenance adds: seed, token counts, the options as
recorded) and may have ``files()`` (other files beside the report: name suffix -> text).

:func:`run_job` is the only code that opens the subject, decides what rank 0 writes, assembles provenance, writes
reports and draws the plots; the commands (``cemtool sharpness``, ``collapse-report``, ``saturation``), the sweep's
items and the demo call it. Adding an analysis is its module and one :func:`register` line below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from cemtool.analysis import collapse, pyhessian_backend, sharpness
from cemtool.analysis import saturation as saturation_analysis
from cemtool.distributed import check_same_device, init_distributed
from cemtool.errors import CemtoolError
from cemtool.report import provenance, replaced_data_note, write_report
from cemtool.runs import lock_for_reading
from cemtool.subject import Subject, open_subject
from cemtool.train import pick_device
from cemtool.writes import atomic_write_text, safe_name

Progress = Callable[[str, int, int], None]  # (stage, done, total)


class Report(Protocol):
    def payload(self) -> dict: ...

    def rows(self) -> list[dict]: ...

    def provenance(self) -> dict: ...


@dataclass(frozen=True)
class Analysis:
    """A registered analysis: its name (``sweep --analyses NAME``, ``-A NAME.key=value``), its Options class, its
    measure function, the report name for given options, and the figures it draws from a written payload."""

    name: str
    options: type
    measure: Callable[[Subject, Any, Progress | None], Report]
    report_name: Callable[[Any], str]
    plot: Callable[[dict, Path, str], list] | None = None


ANALYSES: dict[str, Analysis] = {}


def register(analysis: Analysis) -> Analysis:
    """Add (or replace) an analysis in the registry: every entry point then finds it by name."""
    ANALYSES[analysis.name] = analysis
    return analysis


def get(name: str) -> Analysis:
    if name not in ANALYSES:
        raise CemtoolError(f"unknown analysis {name!r}", hint=f"use one of {', '.join(sorted(ANALYSES))}")
    return ANALYSES[name]


def make_options(name: str, values: dict | None = None) -> Any:
    """The analysis's Options from a dict (``sweep -A``, a study manifest): unknown keys and values of the wrong
    type or range are refused with one line naming ``name.key``."""
    cls = get(name).options
    values = dict(values or {})
    known = {f for f in cls.__dataclass_fields__}
    bad = sorted(set(values) - known)
    if bad:
        raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=f"{name} takes {', '.join(sorted(known))}")
    try:
        return cls(**values)
    except TypeError as e:
        raise CemtoolError(f"{name}: {e}") from None


@dataclass
class JobResult:
    """What :func:`run_job` did: the subject, the report, and on the writing rank the payload as written, the
    files (json, csv and any others) and the figures."""

    subject: Subject
    report: Any
    name: str
    payload: dict | None = None
    paths: dict = field(default_factory=dict)
    figures: list = field(default_factory=list)
    replaced: str | None = None  # the note when a report measured on other data was replaced

    @property
    def written(self) -> bool:
        return self.payload is not None


def run_job(subject_spec: str | Path | Subject, name: str, options: Any = None, progress: Progress | None = None, *,
            checkpoint: str | int = "final", device: Any = "auto", data: str | None = None,
            report_name: str | None = None, plots: bool = True, label: str | None = None,
            provenance_extra: dict | None = None, hold: bool = True,
            on_open: Callable[[Subject], None] | None = None) -> JobResult:
    """Run the analysis ``name`` on the subject ``subject_spec`` (a run directory, a Hugging Face model, or an
    opened :class:`Subject`) and write its report into the subject's ``reports/`` (and figures into ``plots/``):
    ``reports/<report_name>.json`` and ``.csv``, ``report_name`` defaulting to the analysis's own name for these
    options. Under torchrun every rank measures its shard; rank 0 alone writes. ``provenance_extra``: fields the
    provenance adds (e.g. ``command="sweep"``); ``hold``: take the run's shared lock while measuring (a run being
    trained is refused; ``train --force`` cannot move it aside meanwhile); ``on_open(subject)``: called once the
    subject is open, before the measurement (a command says what it measures)."""
    analysis = get(name)
    opts = options if options is not None else analysis.options()
    if isinstance(opts, dict):
        opts = make_options(name, opts)
    stem = report_name or analysis.report_name(opts)
    safe_name(stem, "--name")
    dev = None
    if not isinstance(subject_spec, Subject):
        dev = device if isinstance(device, torch.device) else pick_device(device)
    dd = init_distributed(dev if dev is not None else subject_spec.device)
    held = None
    try:
        if isinstance(subject_spec, Subject):
            subject = subject_spec
        else:
            check_same_device(dev)
            held = lock_for_reading(subject_spec) if hold else None
            subject = open_subject(subject_spec, checkpoint, device=dev, data=data)
        if label is not None:
            subject.label = label
        if on_open is not None:
            on_open(subject)
        report = analysis.measure(subject, opts, progress)
        result = JobResult(subject, report, stem)
        if dd.main:  # every rank holds the same results; rank 0 alone writes
            write_job(result, analysis, plots=plots, provenance_extra=provenance_extra)
        return result
    finally:
        if held is not None:
            held.unlock()


def write_job(result: JobResult, analysis: Analysis, *, plots: bool = True, provenance_extra: dict | None = None
              ) -> None:
    """Assemble the payload (provenance first), write the report, its CSV and other files, and draw the figures."""
    subject, report, stem = result.subject, result.report, result.name
    body = report.payload()
    replaced = replaced_data_note(subject.reports / f"{stem}.json", subject.run.path)
    if replaced and isinstance(body.get("notes"), list):  # a Hugging Face model's report measured on other --data
        body["notes"].append(replaced)
    where = {"checkpoint": subject.checkpoint.name, "step": subject.step}  # a report may say it otherwise
    prov = provenance(subject.run.path, **{**where, **report.provenance(), **(provenance_extra or {})})
    result.payload = {"provenance": prov, **body}
    result.paths = write_report(subject.reports, stem, result.payload, report.rows())
    for suffix, text in (report.files() if hasattr(report, "files") else {}).items():
        path = subject.reports / f"{stem}{suffix}"
        atomic_write_text(path, text)
        result.paths[suffix.lstrip("_.")] = path
    result.replaced = replaced
    if plots and analysis.plot is not None:
        result.figures = list(analysis.plot(result.payload, subject.plots, stem) or [])


def write_comparison(results: list[JobResult], name: str, payload: dict, rows: list[dict], out: Path | None,
                     plot: Callable[[dict, Path, str], Any] | None = None) -> Path:
    """A report over several subjects (``collapse-report A B``): ``<out or the first subject's reports>/<name>``."""
    first = results[0].subject
    reports = out if out is not None else first.reports
    plots_dir = out / "plots" if out is not None else first.plots
    path = write_report(reports, name, payload, rows)["json"]
    if plot is not None:
        plot(payload, plots_dir, name)
    return path


# --------------------------------------------------------------------------------------------------------------
# the registry: one line per analysis

# The figures import matplotlib (0.5-0.7 s) only when they are drawn: most processes that import this module (a
# sweep's workers with --no-plots, torchrun ranks other than 0, the commands' option checks) draw none.

def _sharpness_figures(payload: dict, plots: Path, stem: str) -> list:
    from cemtool.plots.sharpness import plot_sharpness  # start-up: matplotlib

    return plot_sharpness(payload, plots, prefix=stem) if "layers" not in payload else []


def _collapse_figures(payload: dict, plots: Path, stem: str) -> list:
    from cemtool.plots.collapse import plot_collapse  # start-up: matplotlib

    return plot_collapse(payload, plots, stem)


def _saturation_figures(payload: dict, plots: Path, stem: str) -> list:
    from cemtool.plots.saturation import plot_logits, plot_truncation  # start-up: matplotlib

    return [plot_truncation(payload, plots, stem), plot_logits(payload, plots, stem)]


register(Analysis("sharpness", sharpness.Options, sharpness.measure, sharpness.report_name, _sharpness_figures))
register(Analysis("sharpness_pyhessian", sharpness.Options, pyhessian_backend.measure,  # needs cemtool[pyhessian]
                  lambda o: "sharpness_pyhessian"))
register(Analysis("collapse", collapse.Options, collapse.measure, lambda o: "collapse", _collapse_figures))
register(Analysis("saturation", saturation_analysis.Options, saturation_analysis.measure, lambda o: "saturation",
                  _saturation_figures))

__all__ = ["ANALYSES", "Analysis", "JobResult", "Report", "get", "make_options", "register", "run_job",
           "write_comparison"]
