"""The study's edge rule for one-key numeric tuning grids (research/scripts/study.sh's stdlib part): a choice at
the grid's edge gets one more value beyond it, once, at the grid's own spacing there.

    python3 research/scripts/grid_edge.py ask TUNEDIR GRID    the --grid to run TUNEDIR's tuning study with
    python3 research/scripts/grid_edge.py edge TUNEDIR GRID   the extended --grid, or nothing

GRID is the grid study.sh states (``train.lr=1e-3,2e-3,...``). ``ask`` prints the grid the tuning study already
holds where that is GRID plus more values (the extension below, made in an earlier invocation), so a rerun asks
for what is stored (a sweep refuses a grid that drops stored values); otherwise GRID. ``edge`` reads the study's
selection.json, which a tuning sweep does not write: study.sh writes it first with the comparison's
`cemtool sweep --tuned TUNEDIR ... --dry-run` (cemtool's one selection rule, docs/sweep.md). Where some
architecture's choice is the grid's smallest or largest value (``at_edge``) and the stored grid is still GRID's
values (no extension yet), it prints GRID with one more value, the edge times the ratio of the edge to its
neighbour (1.6e-2 -> 3.2e-2 on a factor-2 grid). It prints nothing where the choice is inside, the study or its
selection is missing or of another grid, or the grid was already extended, so the rule fires at most once per
stated grid. A grid stated anew (a hand refinement, as nesterov-zero's at stop 53) is a new GRID: a choice at its
edge is extended once more, by the ratio of the new edge to its new neighbour.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


def _split(grid: str) -> tuple[str, list[str]]:
    key, raw = grid.split("=", 1)
    return key, [v.strip() for v in raw.split(",") if v.strip()]


def _same(a: list[str], b: list[str]) -> bool:
    return sorted(map(float, a)) == sorted(map(float, b))


def _stored(tune: Path) -> list[str] | None:
    """The tuning study's stored --grid (one string per key), or None before it exists."""
    f = tune / "study.json"
    return json.loads(f.read_text(encoding="utf-8"))["plan"]["grid"] if f.is_file() else None


def ask(tune: Path, grid: str) -> str:
    stored = _stored(tune)
    if not stored or len(stored) != 1:
        return grid
    key, values = _split(grid)
    skey, svalues = _split(stored[0])
    have = set(map(float, svalues))
    if skey == key and set(map(float, values)) < have:
        return stored[0]
    return grid


def _fmt(x: float) -> str:
    """3.2e-2 style, at most 3 significant digits (the grids' own spelling)."""
    e = math.floor(math.log10(abs(x)))
    m = f"{x / 10 ** e:.3g}"
    if m == "10":  # rounding crossed a decade
        m, e = "1", e + 1
    return f"{m}e{e}"


def edge(tune: Path, grid: str) -> str:
    stored = _stored(tune)
    sel = tune / "selection.json"
    if not stored or len(stored) != 1 or not sel.is_file():
        return ""
    key, values = _split(grid)
    skey, svalues = _split(stored[0])
    selection = json.loads(sel.read_text(encoding="utf-8"))
    if skey != key or not _same(svalues, values) or len(selection.get("grid", [])) != 1 \
            or not _same(_split(selection["grid"][0])[1], values):
        return ""  # another key, extended already, or a selection of another grid
    nums = sorted(map(float, values))
    if len(nums) < 3 or nums[0] <= 0:
        return ""
    extra = []
    for arch in selection["archs"].values():
        if key not in arch.get("at_edge", []):
            continue
        chosen = float(arch["chosen"][key])
        if chosen == nums[-1]:
            extra.append(nums[-1] * nums[-1] / nums[-2])
        elif chosen == nums[0]:
            extra.append(nums[0] * nums[0] / nums[1])
    new = [_fmt(x) for x in sorted(set(extra))]
    new = [v for v in new if float(v) not in set(nums)]
    return f"{key}={','.join(values + new)}" if new else ""


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("ask", "edge"):
        print("usage: grid_edge.py ask|edge TUNEDIR GRID", file=sys.stderr)
        return 2
    out = (ask if argv[0] == "ask" else edge)(Path(argv[1]), argv[2])
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
