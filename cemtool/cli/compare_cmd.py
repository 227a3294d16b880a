"""cemtool compare: one table over architectures and seeds from the reports of runs or studies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import UsageError


def _num(v) -> str:
    from cemtool.analysis.compare_tables import fmt_num  # start-up: torch

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
    from cemtool.analysis.compare import METRICS  # start-up: torch
    from cemtool.analysis.compare_tables import arch_table, layer_table, val_loss_note  # start-up: torch
    from cemtool.report import SPREAD  # start-up: torch

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
    print_statistics(payload, names)
    print_notes(payload)


def print_statistics(payload: dict, names: dict) -> None:
    """The tables of the study statistics: TOST, architecture-level and partial correlations, main effects."""
    level = f"{payload['level']:.0%}"
    margins = payload.get("margins") or {}
    if margins:
        rows = [[names[p["metric"]], f"{p['a']} - {p['b']}", _num(p["diff"]), f"±{_num(p['margin'])}",
                 "" if p.get("lo90") is None else f"[{_num(p['lo90'])}, {_num(p['hi90'])}]", _num(p.get("p_tost")),
                 {True: "equivalent", False: "not shown equivalent", None: ""}[p.get("equivalent")]]
                for p in payload["pairwise"] if p["metric"] in margins]
        console.table(f"equivalence (TOST, Welch: equivalent when the {1 - 2 * (1 - payload['level']):.0%} "
                      f"interval lies inside ±margin)", ["metric", "a - b", "diff", "margin", "interval", "p TOST",
                                                          "verdict"], rows)
    rows = []
    for c in payload["correlations"]:
        a = c.get("arch_level") or {}
        part = c.get("partial_arch_level") or {}
        rows.append([f"{names[c['x']]} vs {names[c['y']]}", _num(a.get("rho")), _num(a.get("p")),
                     "" if a.get("lo") is None else f"[{_num(a['lo'])}, {_num(a['hi'])}]", str(a.get("n_archs", "")),
                     _num((c.get("partial") or {}).get("rho")), _num(part.get("rho")), a.get("note") or ""])
    given = ", ".join(payload.get("covariates") or []) or "-"
    console.table(f"Spearman across architecture means ({level} two-level bootstrap: architectures, then seeds); "
                  f"partial given {given}: over runs and over architecture means",
                  ["pair", "rho (archs)", "p", f"{level} bootstrap", "archs", "partial (runs)", "partial (archs)",
                   "note"], rows)
    m = payload.get("matched_plasticity") or {}
    if m.get("level") is not None:
        console.result(f"forgetting at matched plasticity: each fine-tune's forgetting where its plasticity first "
                       f"reaches {m['level']:.4g} ({m['rule']})")
    if payload.get("factors"):
        rows = [[f["factor"], names[f["metric"]], _num(f["diff"]),
                 "" if f["lo"] is None else f"[{_num(f['lo'])}, {_num(f['hi'])}]",
                 "" if f.get("boot_lo") is None else f"[{_num(f['boot_lo'])}, {_num(f['boot_hi'])}]", _num(f["p"]),
                 _num(f.get("p_holm")), _num(f.get("mde")), f"{f['n_a']}/{f['n_b']}"] for f in payload["factors"]]
        console.table(f"main effects (mean of the architectures' means with the factor minus without; Welch over "
                      f"architecture means, {level})", ["factor", "metric", "effect", "Welch CI", "bootstrap CI",
                                                         "p", "p Holm", "MDE", "archs"], rows)


def parse_margins(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--margin {item!r}: give METRIC=MARGIN, e.g. val_loss=0.01") from None
    return out


def parse_factors(items: list[str] | None) -> dict[str, tuple[list[str], list[str] | None]]:
    out = {}
    for item in items or []:
        name, sep, groups = item.partition("=")
        with_, slash, without = groups.partition("/")
        split = lambda t: [g.strip() for g in t.split(",") if g.strip()]  # noqa: E731
        if not sep or not name.strip() or not split(with_) or (slash and not split(without)):
            raise UsageError(f"--factor {item!r}: give NAME=GROUP,GROUP or NAME=GROUP,GROUP/GROUP,GROUP")
        out[name.strip()] = (split(with_), split(without) if slash else None)
    return out


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
    margin: Annotated[Optional[list[str]], typer.Option("--margin", help="METRIC=MARGIN (repeatable): an "
                                                       "equivalence test (TOST) at that margin beside the metric's "
                                                       "intervals, e.g. val_loss=0.01")] = None,
    covariate: Annotated[Optional[list[str]], typer.Option("--covariate", help="partial correlations given this "
                                                           "run field (repeatable): lr, plasticity, val_loss, ...")]
    = None,
    factor: Annotated[Optional[list[str]], typer.Option("--factor", help="NAME=GROUP,... or NAME=GROUP,.../GROUP,..."
                                                        " (repeatable): the main effect of a factor the first groups "
                                                        "have and the others (after /; default every other group) "
                                                        "lack, with the architecture as the unit")] = None,
    plasticity_level: Annotated[Optional[float], typer.Option("--plasticity-level", help="where forgetting is "
                                                              "matched (default: the lowest plasticity every "
                                                              "fine-tune reaches)")] = None,
    boot: Annotated[int, typer.Option("--boot", help="replicates of the two-level bootstrap (architectures, then "
                                                     "seeds)")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="seed of the bootstrap")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no tables: print only the notes and the files "
                                                              "written")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print compare.json instead of the tables")] = False,
) -> None:
    """Compare architectures from their reports alone (no checkpoints): val loss (nats/token, bits/byte,
    perplexity), parameters, FLOPs/token, λ_max, λ_min, tr(H)/n, forgetting, plasticity, value entropy and
    separability of the last layer and of every layer (mean ± std over seeds: the sample standard deviation, in
    the tables and figures alike); Spearman correlations of sharpness
    with forgetting, over runs and over architecture means (two-level bootstrap), partial given --covariate;
    pairwise differences with Welch intervals, Holm-adjusted p, the MDE and (--margin) a TOST; forgetting at
    matched plasticity; main effects of --factor with the architecture as the unit. Reports measured with
    different settings are flagged (--strict: refused), and so are runs of one architecture that share a seed."""
    from cemtool.analysis.compare import compare as compare_runs  # start-up: torch
    from cemtool.analysis.compare_tables import write_compare  # start-up: torch

    payload = compare_runs(paths, target=target, level=level, at_tokens=at_tokens,
                           names={"sharpness": sharpness, "collapse": collapse}, strict=strict,
                           margins=parse_margins(margin), covariates=covariate, factors=parse_factors(factor),
                           plasticity_level=plasticity_level, n_boot=boot, seed=seed)
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
