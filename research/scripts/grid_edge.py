"""The study's edge rule for one-key numeric tuning grids (research/scripts/study.sh's stdlib part): a choice at
the grid's edge gets one more value beyond it, once, at the grid's own spacing there.

    python3 research/scripts/grid_edge.py ask TUNEDIR GRID     the --grid to run TUNEDIR's tuning study with
    python3 research/scripts/grid_edge.py seeds TUNEDIR SEEDS  the --seeds to run it with
    python3 research/scripts/grid_edge.py edge TUNEDIR GRID    the extended --grid, or nothing
    python3 research/scripts/grid_edge.py refine TUNEDIR       the refined --grid and --seeds, or nothing

GRID is the grid study.sh states (``train.lr=1e-3,2e-3,...``). ``ask`` prints the grid the tuning study already
holds where that is GRID plus more values (the extension below, made in an earlier invocation), so a rerun asks
for what is stored (a sweep refuses a grid that drops stored values); otherwise GRID. ``edge`` reads the study's
selection.json, which a tuning sweep does not write: study.sh writes it first with the comparison's
`cemtool sweep --tuned TUNEDIR ... --dry-run` (cemtool's one selection rule, docs/sweep.md). Where some
architecture's choice is the grid's smallest or largest value (``at_edge``) and the stored grid is still GRID's
values (no extension yet), it prints GRID with one more value, the edge times the ratio of the edge to its
neighbour (1.6e-2 -> 3.2e-2 on a factor-2 grid). It prints nothing where the choice is inside, the study or its
selection is missing or of another grid, or the grid was already extended, so the rule fires at most once per
stated grid. A grid stated anew by hand is a new GRID: a choice at its edge is extended once more, by the ratio of
the new edge to its new neighbour.

The refinement rule (stop 53; the issue's "a x√2 grid with >= 3 tuning seeds wherever the grid shortfall exceeds
0.01"): ``refine`` reads the selection as ``edge`` does, and where some architecture's choice lies inside the grid
with a shortfall above ``SHORTFALL`` nats (the log-parabola through the choice and its neighbours, docs/sweep.md) and
a neighbour of the choice is more than a factor √2 away, it prints the stored grid plus the x√2 values beside the
choice on those sides (3 significant figures) and the stored tuning seeds plus the next one, up to three. A grid
whose neighbours are already x√2 from the choice is not refined again, whatever its shortfall, so the rule fires at
most once per choice. ``seeds`` prints the study's stored seeds where they hold SEEDS and more (a refined study, so
that a rerun asks for what is stored), otherwise SEEDS.
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


def _plan(tune: Path) -> dict | None:
    """The tuning study's stored plan (its --grid, one string per key, and its --seeds), or None before it exists."""
    f = tune / "study.json"
    return json.loads(f.read_text(encoding="utf-8"))["plan"] if f.is_file() else None


def _current(tune: Path, plan: dict | None) -> tuple[str, list[str], list[float], dict] | None:
    """(key, values, sorted numbers, selection) where ``plan`` is a one-key grid of >= 3 positive values and the
    study's selection.json is of that grid; None otherwise (no study, no selection, a selection of another grid).
    The rules' common reading of a tuning study as it stands."""
    sel = tune / "selection.json"
    if not plan or len(plan["grid"]) != 1 or not sel.is_file():
        return None
    key, values = _split(plan["grid"][0])
    selection = json.loads(sel.read_text(encoding="utf-8"))
    if len(selection.get("grid", [])) != 1 or not _same(_split(selection["grid"][0])[1], values):
        return None
    nums = sorted(map(float, values))
    if len(nums) < 3 or nums[0] <= 0:
        return None
    return key, values, nums, selection


def ask(tune: Path, grid: str) -> str:
    plan = _plan(tune)
    stored = plan["grid"] if plan else None
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
    cur = _current(tune, _plan(tune))
    if cur is None:
        return ""  # no current selection
    skey, svalues, nums, selection = cur
    key, values = _split(grid)
    if skey != key or not _same(svalues, values):
        return ""  # another key, or extended already
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


SHORTFALL = 0.01  # nats: the refinement's threshold
STEP = math.sqrt(2)


def _seeds_of(plan: dict | None) -> list[int] | None:
    return [int(x) for x in plan["seeds"]] if plan else None


def seeds(tune: Path, stated: str) -> str:
    have, want = _seeds_of(_plan(tune)), [int(x) for x in stated.split(",") if x.strip()]
    if have and set(want) < set(have):
        return ",".join(map(str, have))
    return stated


def refine(tune: Path) -> str:
    """``GRID SEEDS`` (one space between) for the refinement, or nothing (the module's docstring)."""
    plan = _plan(tune)
    cur, have = _current(tune, plan), _seeds_of(plan)
    if cur is None or not have:
        return ""  # no current selection
    key, values, nums, selection = cur
    if sorted(selection.get("tuning_seeds", [])) != sorted(have):
        return ""  # a selection of other seeds: not this study as it stands
    extra = []
    for arch in selection["archs"].values():
        gain = ((arch.get("shortfall") or {}).get(key) or {}).get("gain")
        if key in arch.get("at_edge", []) or gain is None or gain <= SHORTFALL:
            continue
        c = float(arch["chosen"][key])
        i = nums.index(c)
        if i > 0 and c / nums[i - 1] > STEP * 1.02:
            extra.append(c / STEP)
        if i < len(nums) - 1 and nums[i + 1] / c > STEP * 1.02:
            extra.append(c * STEP)
    new = [v for v in dict.fromkeys(_fmt(x) for x in sorted(extra)) if float(v) not in set(nums)]
    if not new:
        return ""
    more = have + ([max(have) + 1] if len(have) < 3 else [])
    return f"{key}={','.join(values + new)} {','.join(map(str, more))}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["refine"] and len(argv) == 2:
        out = refine(Path(argv[1]))
        if out:
            print(out)
        return 0
    if len(argv) != 3 or argv[0] not in ("ask", "seeds", "edge"):
        print("usage: grid_edge.py ask|edge TUNEDIR GRID | seeds TUNEDIR SEEDS | refine TUNEDIR", file=sys.stderr)
        return 2
    out = {"ask": ask, "seeds": seeds, "edge": edge}[argv[0]](Path(argv[1]), argv[2])
    if out:
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
