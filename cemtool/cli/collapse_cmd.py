"""cemtool collapse-report: representation-collapse measures of one run or a comparison of several."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError
from cemtool.options import as_cli
from cemtool.writes import safe_name


def _label(path: Path, taken: set[str]) -> str:
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", path.resolve().name) or "run"
    label, n = base, 2
    while label in taken:
        label, n = f"{base}-{n}", n + 1
    taken.add(label)
    return label


def _bar_progress(bar, label: str):
    """A measure_run progress callback that advances one rich task (created on the first call)."""
    if bar is None:
        return None
    state: dict = {}

    def progress(stage: str, done: int, total: int) -> None:
        if "task" not in state:
            state["task"] = bar.add_task(label, total=total, status="")
        bar.update(state["task"], completed=done, total=total, status=stage)

    return progress


def _f(v, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_summary(payload: dict) -> None:
    cols = ["run", "layer", "H(values)", "H(hidden)", "probe v", "probe h", "erank h", "cos h", "attn H/log"]
    body = []
    for r in payload["runs"]:
        for s in r["summary"]:
            body.append([r["label"], s["layer"], f"{_f(s['v_entropy'])} ± {_f(s['v_entropy_se'])}",
                         f"{_f(s['h_entropy'])} ± {_f(s['h_entropy_se'])}",
                         _f(s["probe_v"]), _f(s["probe_h"]), _f(s["h_erank"], 1), _f(s["h_cosine"]),
                         _f(s["attn_entropy_norm"])])
    console.table("collapse (entropy: Rényi, nats, mean ± s.e. over sequences; probe: CV accuracy)", cols, body)
    for r in payload["runs"]:
        c = r["collapse"]
        pc = c.get("probe_classes") or {}
        chance = 1 / len(pc["names"]) if pc.get("names") else None
        found = ", ".join(f"{n!r} {m}" for n, m in zip(pc.get("names", []), pc.get("counts", []), strict=False))
        used = "skipped" if pc.get("skipped") else f"{pc.get('per_class', 0)} per class used, chance {_f(chance)}"
        console.result(f"{r['label']} ({r['arch']}): {c['tokens']:,} tokens; probe classes (whole-word "
                       f"occurrences) {found} ({used})" + (f"; {pc['note']}" if pc.get("note") else ""))
        notes = sorted({v for e in c["layers"] for v in (e["values"], e["hidden"], e["attention"], *e["probe"].values())
                        if isinstance(v, str)})
        for n in notes:
            console.result(f"  {n}")
        moe = [e for e in c["layers"] if e.get("experts")]
        for e in moe:
            ex, rt = e["experts"], e["experts"]["router_entropy"]
            console.result(f"  L{e['layer']} experts ({ex['experts']}, top {ex['top_k']}): load entropy "
                           f"{_f(ex['entropy'])} of {_f(ex['entropy_max'])} nats, largest share "
                           f"{_f(ex['max_fraction'])}, {ex['unused']} unused; router entropy {_f(rt['mean'])} ± "
                           f"{_f(rt['se'])} nats")
        if isinstance(r["routing"], dict):
            exp = ", ".join(f"L{e['layer']}: {e['expected_layer']:.2f}" for e in r["routing"]["layers"])
            console.result(f"  LIMe {r['routing']['variant']} router, expected retrieved layer: {exp}")
        else:
            console.result(f"  routing: {r['routing']}")
        if isinstance(r["stream_scalars"], list):
            first = r["stream_scalars"][0]
            keys = [k for k in first if k not in ("layer", "substep")]
            console.result(f"  stream scalars ({', '.join(keys)}) per layer and substep: see the report")
        else:
            console.result(f"  stream scalars: {r['stream_scalars']}")


@app.command("collapse-report")
@guarded
def collapse_report_cmd(
    runs: Annotated[list[Path], typer.Argument(help="one or more run directories, Hugging Face model directories or "
                                                    "hf:ORG/NAME[@REVISION] (several: one comparison)")],
    checkpoint: Annotated[str, typer.Option(help="final, latest, a step number or a file")] = "final",
    data: Annotated[Optional[str], typer.Option(help="evaluation data instead of the run's own: a built-in source, "
                                                "a .txt file/folder or token files, read with the model's tokenizer "
                                                "(Hugging Face models: default pydoc)")] = None,
    tokens: Annotated[int, typer.Option(help="evaluation tokens from the validation split (whole windows)")]
    = 16384,
    seq_len: Annotated[Optional[int], typer.Option(help="window length; default the run's data.seq_len")] = None,
    batch_size: Annotated[int, typer.Option(help="windows per forward pass (memory)")] = 16,
    alpha: Annotated[float, typer.Option(help="Rényi order of the matrix entropy (1 = Shannon)")] = 0.5,
    words: Annotated[Optional[str], typer.Option(help="comma-separated probe words (each one token at a word "
                                                 "start); default is,are,was,were if each occurs often enough, "
                                                 "else the k most frequent whole words")]
    = None,
    k: Annotated[int, typer.Option("--k", help="probe classes when falling back to the most frequent whole "
                                         "words")] = 4,
    folds: Annotated[int, typer.Option(help="cross-validation folds of the probe")] = 5,
    per_class: Annotated[int, typer.Option(help="at most this many probe samples per class")] = 256,
    min_per_class: Annotated[int, typer.Option(help="fewest whole-word samples per class; below it the probe is "
                                               "skipped with a note (default words: the most frequent whole "
                                               "words instead)")] = 16,  # collapse.MIN_PER_CLASS
    seed: Annotated[int, typer.Option(help="seed of the probe's fold split")] = 0,
    lag: Annotated[int, typer.Option(help="the probe's target: the word this many positions back (0: the input "
                                     "token itself; 1: a context probe, which an untrained model does not pass)")]
    = 0,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="folder of the comparison report (several "
                                                "runs); default the first run's reports/ and plots/")] = None,
    name: Annotated[str, typer.Option(help="report name: reports/<name>.json (several runs: also "
                                      "<name>_compare.json); analyses under other settings keep their own names")]
    = "collapse",
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N, mps")] = "auto",
    no_plots: Annotated[bool, typer.Option("--no-plots", help="skip the figures")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress output")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the per-layer summary as JSON")] = False,
) -> None:
    """Value/hidden-state entropy, token separability, effective rank, cosine similarity, attention statistics,
    LIMe routing and momentum-stream scalars per layer (METHODS §5); several runs give one comparison."""
    from cemtool.analysis.collapse import Options, all_rows, options_dict  # start-up: torch loads when it runs
    from cemtool.jobs import run_job, write_comparison
    from cemtool.plots.collapse import plot_collapse  # start-up: matplotlib
    from cemtool.report import provenance  # start-up: loaded when the command runs (docs/performance.md)

    safe_name(name, "--name")
    if words is not None and not words.strip(" ,"):
        raise typer.BadParameter("is empty: give at least 2 comma-separated words, or leave --words out for the "
                                 "default words", param_hint="--words")
    word_list = [w.strip() for w in words.split(",")] if words is not None else None  # an empty word is refused
    opts = _options(Options, "collapse", tokens=tokens, seq_len=seq_len, batch_size=batch_size, alpha=alpha,
                    words=word_list, k=k, folds=folds, per_class=per_class, min_per_class=min_per_class, seed=seed,
                    lag=lag)
    taken: set[str] = set()
    labels = [_label(p, taken) for p in runs]
    results = []
    with console.progress(quiet) as bar:
        for p, label in zip(runs, labels, strict=True):  # each run's own report (figures: one run only)
            results.append(run_job(p, "collapse", opts, _bar_progress(bar, label), checkpoint=checkpoint,
                                   device=device, data=data, report_name=name, label=label,
                                   plots=not no_plots and len(runs) == 1, provenance_extra={"name": name}))
    if not results[0].written:  # every rank holds the same reduced results; rank 0 alone writes and prints
        return
    measured = [r.report.run for r in results]
    written = [r.paths["json"] for r in results]
    options = {"checkpoint": checkpoint, "data": data, **options_dict(opts)}
    payload = {"provenance": provenance(None, seed=seed, command="collapse-report", name=f"{name}_compare",
                                        options=options, runs=[r["run"] for r in measured]), "runs": measured}
    if len(measured) > 1:
        written.append(write_comparison(results, f"{name}_compare", payload, all_rows(payload), out,
                                        plot=None if no_plots else plot_collapse))
    if json_:
        console.print_json([{"run": r["label"], "arch": r["arch"], **s} for r in measured for s in r["summary"]])
        return
    print_summary(payload)
    for w in written:
        console.result(f"wrote {w} (+ .csv)")


def _options(cls, what: str, **values):
    """The analysis's Options from the command line: a value they refuse is a usage error (exit 2) naming the
    option as it is spelled here."""
    try:
        return cls(**values)
    except CemtoolError as e:
        message, flag = as_cli(e.message, cls, what)
        raise typer.BadParameter(message, param_hint=flag) from None
