"""cemtool compare: one table over architectures and seeds from the reports of runs or studies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded


def _num(v) -> str:
    from cemtool.analysis.compare import fmt_num  # start-up: torch

    return fmt_num(v)


def print_notes(payload: dict) -> None:
    """What is missing, and what was flagged (settings that differ, reports not compared)."""
    for name, runs in payload["missing"].items():
        if runs:
            shown = ", ".join(Path(r).name for r in runs[:6]) + (" ..." if len(runs) > 6 else "")
            console.result(f"missing {name} report: {len(runs)} of {len(payload['runs'])} runs ({shown})")
    for n in payload["notes"]:
        console.result(f"note: {n}")


def print_compare(payload: dict) -> None:
    from cemtool.analysis.compare import METRICS, SPREAD, arch_table, layer_table, val_loss_note  # start-up: torch

    if payload.get("at_tokens") is not None:
        console.result(val_loss_note(payload))
    cols, rows = arch_table(payload, transpose=True)
    target = f"; forgetting on {payload['target']}" if payload["target"] else ""
    console.table(f"comparison of {len(payload['runs'])} runs ({SPREAD}{target})", cols, rows)
    cols, rows = layer_table(payload, transpose=True)  # one row per measure and layer: fits a terminal
    if rows:
        console.table(f"per layer, from the collapse reports ({SPREAD}; per-layer differences with intervals in "
                      f"compare.md)", cols, rows)
    names = {**METRICS, **(payload.get("metrics") or {})}  # tr(G)/n for a GGN comparison
    corr = [[f"{names[c['x']]} vs {names[c['y']]}", _num(c["rho"]), _num(c["p"]), c["p_method"] or "",
             str(c["n"]), c["note"] or ""] for c in payload["correlations"]]
    console.table("Spearman rank correlation across runs", ["pair", "rho", "p", "p from", "n", "note"], corr)
    if payload["pairwise"]:
        level = f"{payload['level']:.0%}"
        pairs = [[names[p["metric"]], f"{p['a']} - {p['b']}", _num(p["diff"]),
                  "" if p["lo"] is None else f"[{_num(p['lo'])}, {_num(p['hi'])}]", _num(p["p"]),
                  _num(p.get("p_holm")), _num(p.get("mde")), f"{p['n_a']}/{p['n_b']}", p["note"] or ""]
                 for p in payload["pairwise"]]
        console.table(f"pairwise differences (Welch t {level} intervals over seeds; p Holm: adjusted over the "
                      f"metric's pairs; MDE: 80%-power detectable difference where the interval holds 0)",
                      ["metric", "a - b", "diff", f"{level} CI", "p", "p Holm", "MDE", "n", "note"], pairs)
    print_notes(payload)


@app.command()
@guarded
def compare(
    paths: Annotated[list[Path], typer.Argument(help="study directories (from cemtool sweep), runs, fine-tune runs "
                                                     "or folders of runs")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="where compare.csv, compare_runs.csv, "
                                                "compare.md and reports/compare.json go; default the study "
                                                "directory (one study given), else ./compare")] = None,
    target: Annotated[Optional[str], typer.Option(help="the forgetting target to use when runs were fine-tuned on "
                                                       "several")] = None,
    level: Annotated[float, typer.Option(help="confidence level of the pairwise intervals (default 0.95)")] = 0.95,
    at_tokens: Annotated[Optional[int], typer.Option("--at-tokens", help="compare validation losses at this point "
                                                     "of training (each run's last evaluation at or before this "
                                                     "many tokens) instead of at the end")] = None,
    sharpness: Annotated[str, typer.Option("--sharpness", help="the sharpness report to read: "
                                           "reports/<NAME>.json (as written by sharpness --name)")] = "sharpness",
    collapse: Annotated[str, typer.Option("--collapse", help="the collapse report to read: reports/<NAME>.json (as "
                                          "written by collapse-report --name)")] = "collapse",
    strict: Annotated[bool, typer.Option("--strict", help="refuse reports measured with different settings and "
                                                          "runs of one architecture that share a seed (default: "
                                                          "compare them and flag it)")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no tables: print only the notes and the files "
                                                              "written")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print compare.json instead of the tables")] = False,
) -> None:
    """Compare architectures from their reports alone (no checkpoints): val loss (nats/token, bits/byte,
    perplexity), parameters, FLOPs/token, λ_max, λ_min, tr(H)/n, forgetting, plasticity, value entropy and
    separability of the last layer and of every layer (mean ± std over seeds: the sample standard deviation, in
    the tables and figures alike); Spearman correlations of sharpness
    with forgetting; pairwise differences with Welch intervals. Reports measured with different settings are
    flagged (--strict: refused), and so are runs of one architecture that share a seed."""
    from cemtool.analysis.compare import compare as compare_runs  # start-up: torch
    from cemtool.analysis.compare import write_compare  # start-up: torch

    payload = compare_runs(paths, target=target, level=level, at_tokens=at_tokens,
                           names={"sharpness": sharpness, "collapse": collapse}, strict=strict)
    if out is None:
        out = paths[0] if len(paths) == 1 and (paths[0] / "study.json").is_file() else Path("compare")
    written = write_compare(payload, out)
    if json_:
        console.print_json(payload)
        return
    if quiet:
        print_notes(payload)
    else:
        print_compare(payload)
    layers = f", {written['layers_csv']}" if "layers_csv" in written else ""
    console.result(f"wrote {written['csv']}, {written['runs_csv']}{layers}, {written['md']} and {written['json']}")
