"""cemtool runs, cemtool archs, cemtool config: look at what exists."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.architectures import arch_list
from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.config import describe_fields, resolve, to_dict
from cemtool.errors import UsageError


@app.command()
@guarded
def runs(
    root: Annotated[Path, typer.Argument(help="a run, or a folder searched for runs")] = Path("runs"),
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """List runs with what made them (kind: train, fine-tune), their data, status, steps and last validation loss
    (on the run's own data: a fine-tune's is on its target data). A run marked running whose process is gone
    (killed) shows as 'stopped'; unreadable lines of metrics.jsonl are skipped with a note."""
    from cemtool.runs import list_runs  # start-up: loaded when the command runs (docs/performance.md)

    rows = list_runs(root)
    if json_:
        console.print_json(rows)
        return
    fmt = lambda v: f"{v:.4f}" if isinstance(v, float) else v  # noqa: E731
    console.table(f"runs under {root} (val loss: on each run's own data)",
                  ["run", "kind", "arch", "seed", "data", "status", "step", "val loss", "floor"],
                  [[r["run"], r.get("kind"), r.get("arch"), r.get("seed"), r.get("data"), r["status"], r.get("step"),
                    fmt(r.get("val_loss")), fmt(r.get("floor"))] for r in rows])
    for r in rows:
        for note in r.get("notes", []):
            console.info(f"note: {r['run']}: {note}")


def _hf_archs(markdown: bool, json_: bool) -> None:
    """archs --hf: the installed transformers' causal-LM families and their tiers (or docs/models.md's table)."""
    from cemtool.subject.hf.catalog import families_table, hf_families  # start-up: transformers

    if markdown:
        console.result(families_table())
        return
    rows = hf_families()
    if json_:
        console.print_json(rows)
        return
    counts = {t: sum(r["tier"] == t for r in rows) for t in ("b", "a", "refused")}
    console.table(f"transformers causal-LM families: {counts['b']} tier b, {counts['a']} tier a, "
                  f"{counts['refused']} refused", ["model_type", "class", "tier", "what cemtool runs on it"],
                  [[r["model_type"], r["class"], r["tier"], r["note"]] for r in rows])


def _match_width(match_params: str | None, match_flops: str | None, match_arch: str, overrides: list[str],
                 vocab: int, seq_len: int, json_: bool) -> None:
    """archs --match-params/--match-flops: the width at which match_arch matches the reference."""
    from cemtool.analysis.compute import match_width, target_size  # start-up: torch

    by, ref = ("params", match_params) if match_params else ("flops", match_flops)
    target = target_size(ref, overrides, vocab, seq_len)
    best = match_width(target, by, match_arch, overrides)
    if json_:
        console.print_json({"target": target, **{k: v for k, v in best.items()}})
        return
    key = "non_embedding" if by == "params" else "flops_train"
    flags = " ".join("--set " + o for o in best["overrides"])
    console.result(f"{match_arch} with {flags} has {best['row'][key]:,.0f} "
                   f"{'non-embedding parameters' if by == 'params' else 'training FLOPs/token'} vs "
                   f"{target[key]:,.0f} of {ref} ({best['rel_error']:+.2%})")


@app.command()
@guarded
def archs(
    sizes: Annotated[bool, typer.Option("--sizes", help="build every model: parameters, FLOPs per token and the "
                                        "per-layer attention shapes (slower: seconds per architecture)")] = False,
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="base size overrides, e.g. "
                                                      "model.d_model=256 (implies --sizes)")] = None,
    vocab: Annotated[Optional[int], typer.Option(help="vocabulary size assumed for the counts (default 512; "
                                                 "implies --sizes)")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="context length for FLOPs/token (default 64; implies "
                                                   "--sizes)")] = None,
    time: Annotated[bool, typer.Option("--time", help="also measure seconds per training step (CPU, batch 8; "
                                       "implies --sizes)")] = False,
    only: Annotated[Optional[list[str]], typer.Option("--arch", help="only these architectures")] = None,
    match_params: Annotated[Optional[str], typer.Option(help="size a baseline (--match-arch) to the non-embedding "
                                                         "parameters of this architecture or run")] = None,
    match_flops: Annotated[Optional[str], typer.Option(help="size a baseline to the training FLOPs/token of this "
                                                        "architecture or run")] = None,
    match_arch: Annotated[str, typer.Option(help="the architecture to resize when matching")] = "baseline",
    hf: Annotated[bool, typer.Option("--hf", help="list the installed transformers' causal-LM families and the "
                                               "tier cemtool gives each (b: every analysis; a: sharpness and "
                                               "forgetting through the logits)")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="with --hf: print docs/models.md's table of the "
                                                              "tier-b families, generated from their declarations")
                        ] = False,
) -> None:
    """List the registered architectures: name, family and what each is (instant; no model is built).
    With --hf, the Hugging Face families instead, each with its tier (docs/models.md).

    With --sizes (or --set/--vocab/--seq-len/--time), build each one and add parameters and FLOPs per token.
    With --match-params/--match-flops, print the width at which --match-arch matches the reference instead."""
    vocab_, seq_len_ = vocab or 512, seq_len or 64
    if markdown and not hf:
        raise UsageError("--markdown prints the Hugging Face families' table: give it with --hf")
    if hf:
        _hf_archs(markdown, json_)
        return
    if match_params or match_flops:
        _match_width(match_params, match_flops, match_arch, set_ or [], vocab_, seq_len_, json_)
        return
    if not (sizes or time or set_ or vocab is not None or seq_len is not None):
        _list_archs(only, json_)
        return

    from cemtool.analysis.compute import arch_table  # start-up: torch

    rows = arch_table(overrides=set_ or [], vocab=vocab_, seq_len=seq_len_, timed=time, only=only)
    if json_:
        console.print_json(rows)
        return
    cols = ["arch", "family", "params", "non-emb", "attn budget (heads x d_h per layer)", "fwd FLOPs/tok",
            "train FLOPs/tok"]
    if time:
        cols.append("s/step")
    body = []
    for r in rows:
        if "error" in r:  # not buildable with these overrides
            body.append([r["arch"], r["family"], "-", "-", f"not buildable: {r['error']}", "-", "-",
                         *(["-"] if time else [])])
            continue
        line = [r["arch"], r["family"], f"{r['params']:,}", f"{r['non_embedding']:,}",
                f"{r['attn_budget']} ({' '.join(r['layer_shapes'])})",
                f"{r['flops_forward']:.3e}", f"{r['flops_train']:.3e}"]
        if time:
            line.append(f"{r['seconds_per_step']:.4f}")
        body.append(line)
    console.table(f"architectures (vocab {vocab_}, seq_len {seq_len_})", cols, body)


def _list_archs(only: list[str] | None, json_: bool) -> None:
    """Names, families and descriptions from the registry alone (no model is built)."""
    rows = arch_list(only)
    if json_:
        console.print_json(rows)
        return
    console.table("architectures (`cemtool archs --sizes` adds parameters and FLOPs per token)",
                  ["arch", "family", "what it is"], [[r["arch"], r["family"], r["description"]] for r in rows])


@app.command()
@guarded
def config(
    arch: Annotated[Optional[str], typer.Option("--arch", "-a", help="architecture whose preset to apply")] = None,
    file: Annotated[Optional[list[Path]], typer.Option("--config", "-c", help="TOML or JSON config file; "
                                                        "repeatable: composed in order, later keys win")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", "-s", help="override section.key=value")] = None,
    fields: Annotated[bool, typer.Option("--fields", help="document every field instead")] = False,
) -> None:
    """Print the resolved configuration as JSON (or, with --fields, every field with its documentation)."""
    if fields:
        console.table("configuration fields", ["key", "type", "default", "meaning"],
                      [list(r) for r in describe_fields()])
        return
    cfg = resolve(arch=arch, file=file, overrides=set_ or [])  # first: a file it refuses is the only line
    if file and len(file) > 1:
        console.info(f"config: composed {' then '.join(map(str, file))} (a later file overrides an earlier one key "
                     f"by key; --set overrides them all)")
    console.print_json(to_dict(cfg))
