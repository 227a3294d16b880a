"""Selection on a tuning study: each architecture's best grid point (:func:`select`, written to selection.json)
and the comparison study planned at those values on other seeds (:func:`plan_from_tuning`)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from cemtool.config import parse_override
from cemtool.errors import CemtoolError
from cemtool.sweep.manifest import SCHEMA_VERSION, open_study
from cemtool.sweep.plan import Plan, _split_list, grid_points, make_plan, parse_grid, parse_seeds
from cemtool.writes import atomic_write_json

SELECTION = "selection.json"


# --------------------------------------------------------------------------------------------------------------
# selection on a tuning study


def select(tuning: str | Path, archs: list[str] | tuple | None = None, final_seeds: list[int] | tuple = (),
           write: bool = True) -> dict:
    """Each architecture's best grid point in the finished tuning study ``tuning``: the lowest mean final validation
    loss over the tuning seeds (a point with a failed run, e.g. a diverged learning rate, cannot be chosen; a tie
    goes to the earlier point in grid order). Refuses ``final_seeds`` (the comparison's) that tuned the values.
    Writes <tuning>/selection.json (the choice and every point's results; unless ``write`` is false) and returns
    it."""
    path = Path(tuning)
    study = open_study(path)
    plan, items = study.plan, study.manifest["items"]
    if not plan.grid:
        raise CemtoolError(f"{path} is not a tuning study: it was planned without --grid")
    overlap = sorted(set(final_seeds) & set(plan.seeds))
    if overlap:
        raise CemtoolError(f"seed {overlap[0]} tuned the values in {path}: the comparison must use other seeds",
                           hint=f"tuning seeds: {','.join(map(str, plan.seeds))}")
    archs = list(plan.archs if archs is None else archs)
    missing = [a for a in archs if a not in plan.archs]
    if missing:
        raise CemtoolError(f"{path} did not tune {missing[0]!r}", hint=f"it tuned {', '.join(plan.archs)}")
    left = [it["name"] for it in items if it["arch"] in archs and it["status"] not in ("completed", "failed")]
    if left:
        raise CemtoolError(f"{path} is not finished ({len(left)} run(s) left, e.g. {left[0]})",
                           hint=f"continue it first: cemtool sweep --resume {path}")
    # every finished architecture of the study goes into selection.json (a comparison of some of them must not
    # erase the others' choice); the ones asked for must be finished (checked above)
    chosen = {}
    for a in plan.archs:
        if a in archs:
            chosen[a] = _select_arch(a, plan, items)
        elif all(it["status"] in ("completed", "failed") for it in items if it["arch"] == a):
            try:
                chosen[a] = _select_arch(a, plan, items)
            except CemtoolError:  # not asked for, and nothing to choose: left out
                pass
    selection = {"schema_version": SCHEMA_VERSION, "kind": "cemtool-selection",
                 "rule": "lowest mean final validation loss over the tuning seeds", "grid": list(plan.grid),
                 "tuning_seeds": list(plan.seeds), "tokens": plan.tokens, "data": plan.data,
                 "overrides": list(plan.overrides), "archs": chosen}
    if write:
        atomic_write_json(path / SELECTION, selection)
    return selection


def _select_arch(arch: str, plan: Plan, items: list[dict]) -> dict:
    points = []
    for pt in grid_points(plan):
        runs = [it for it in items if it["arch"] == arch and it.get("point", {}) == pt]
        losses = [it.get("val_loss") for it in runs]
        ok = all(it["status"] == "completed" and v is not None and math.isfinite(v) for it, v in zip(runs, losses,
                                                                                                     strict=True))
        points.append({"point": pt, "runs": [it["run"] for it in runs], "seeds": [it["seed"] for it in runs],
                       "val_loss": losses, "failed": sum(it["status"] == "failed" for it in runs),
                       "mean_val_loss": statistics.fmean(losses) if ok and runs else None,
                       "std_val_loss": statistics.stdev(losses) if ok and len(runs) > 1 else None})
    eligible = [p for p in points if p["mean_val_loss"] is not None]
    if not eligible:
        raise CemtoolError(f"no grid point of {arch} trained on every tuning seed (all have failed runs)",
                           hint="widen the grid towards values that train")
    best = min(eligible, key=lambda p: p["mean_val_loss"])  # the first of equal means
    return {"chosen": best["point"], "overrides": [f"{k}={v}" for k, v in best["point"].items()],
            "mean_val_loss": best["mean_val_loss"], "at_edge": grid_edges(plan, best["point"]),
            "shortfall": grid_shortfall(plan.grid, points, best), "points": points}


def grid_edges(plan: Plan, point: dict[str, str]) -> list[str]:
    """The numeric grid keys (3 or more values) whose chosen value is the grid's smallest or largest: the best
    value may lie beyond the grid (extend it: the same sweep command with more values keeps every finished run)."""
    edges = []
    for key, values in parse_grid(plan.grid):
        nums = [parse_override(f"{key}={v}") for v in values]
        nums = [n for n in (_leaf(x) for x in nums) if isinstance(n, (int, float)) and not isinstance(n, bool)]
        if len(nums) < 3 or len(nums) != len(values) or key not in point:
            continue
        chosen = _leaf(parse_override(f"{key}={point[key]}"))
        if chosen in (min(nums), max(nums)):
            edges.append(key)
    return edges


def grid_shortfall(grid: list[str] | tuple, points: list[dict], best: dict) -> dict[str, dict]:
    """How much the grid's spacing may leave on the table (``grid``: the study's --grid; ``points``: selection.json's
    points of one architecture; ``best``: the chosen one), per numeric grid key (3 or more values, all positive)
    whose chosen value lies inside the grid: the parabola in log(value) through the chosen point and its two
    neighbours along that key (the other keys at their chosen values), by their mean losses. Its vertex lies
    between the neighbours, and ``gain`` = chosen mean − the parabola's minimum (>= 0: the chosen mean is the lowest
    of the three). {key: {"values", "means", "vertex", "gain"}}; a key is left out when the choice is at its edge
    (:func:`grid_edges`: the best value may lie beyond) or a neighbour has no mean (a failed run). A point
    estimate from the tuning seeds' means, as noisy as they are, not a bound: a gain within the means' spread is no
    evidence of a better value."""
    out = {}
    means = {json.dumps(p["point"], sort_keys=True): p["mean_val_loss"] for p in points}
    for key, values in parse_grid(tuple(grid)):
        nums = [_leaf(parse_override(f"{key}={v}")) for v in values]
        if len(nums) < 3 or not all(isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0
                                    for n in nums) or key not in best["point"]:
            continue
        order = sorted(range(len(values)), key=lambda k: nums[k])
        chosen = _leaf(parse_override(f"{key}={best['point'][key]}"))
        at = next(i for i, k in enumerate(order) if nums[k] == chosen)
        if at in (0, len(order) - 1):
            continue
        trio = [values[order[at + d]] for d in (-1, 0, 1)]
        ys = [means.get(json.dumps({**best["point"], key: v}, sort_keys=True)) for v in trio]
        if any(y is None for y in ys):
            continue
        xs = [math.log(nums[order[at + d]]) for d in (-1, 0, 1)]
        # the parabola through the three points: y = y1 + b (x - x1) + c (x - x1)^2
        d0, d2 = xs[0] - xs[1], xs[2] - xs[1]
        s0, s2 = (ys[0] - ys[1]) / d0, (ys[2] - ys[1]) / d2  # secant slopes: s0 <= 0 <= s2
        c = (s2 - s0) / (d2 - d0)
        b = s0 - c * d0
        shift = -b / (2 * c) if c > 0 else 0.0
        out[key] = {"values": trio, "means": ys, "vertex": float(math.exp(xs[1] + shift)),
                    "gain": float(b * b / (4 * c)) if c > 0 else 0.0}
    return out


def _leaf(tree):
    """The value of a one-key nested override {'train': {'lr': 0.01}} -> 0.01."""
    while isinstance(tree, dict) and len(tree) == 1:
        tree = next(iter(tree.values()))
    return tree


def plan_from_tuning(tuning: str | Path, seeds: str | list, *, archs: str | list | None = None,
                     tokens: int | None = None, data: str | None = None, overrides: list[str] | tuple | None = None,
                     **rest) -> tuple[Plan, dict, list[str]]:
    """The comparison study of a tuning study: each architecture at its chosen values (:func:`select`) on
    ``seeds`` (disjoint from the tuning seeds). Tokens, data and --set overrides default to the tuning study's;
    given values that differ are used, with a note saying so. ``rest``: make_plan's analyses, target, options.
    Returns (plan, selection, notes)."""
    tuned = open_study(tuning).plan
    arch_list = list(tuned.archs) if archs is None else _split_list(archs, "architecture", "architectures")
    selection = select(tuning, arch_list, parse_seeds(seeds), write=False)  # written once the plan is valid
    notes = []
    for arch in arch_list:
        for key in selection["archs"][arch]["at_edge"]:
            notes.append(f"{arch}: the chosen {key} ({selection['archs'][arch]['chosen'][key]}) is at the edge of "
                         f"the grid, so a better value may lie beyond it (add values to the tuning study's --grid: "
                         f"its finished runs are kept)")
    for what, mine, theirs in (("tokens per run", tokens, tuned.tokens), ("data", data, tuned.data),
                               ("--set overrides", None if overrides is None else list(overrides),
                                list(tuned.overrides))):
        if mine is not None and mine != theirs:
            notes.append(f"the comparison uses {what} {mine}; the values were tuned with {theirs}")
    plan = make_plan(arch_list, seeds, tokens=tuned.tokens if tokens is None else tokens,
                     data=tuned.data if data is None else data,
                     overrides=tuned.overrides if overrides is None else overrides,
                     arch_overrides={a: selection["archs"][a]["overrides"] for a in arch_list},
                     tuned_from=str(tuning), **rest)
    atomic_write_json(Path(tuning) / SELECTION, selection)
    return plan, selection, notes
