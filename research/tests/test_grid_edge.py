"""research/scripts/grid_edge.py, the stdlib part's edge rule (a tuning choice at its grid's edge gets one more value
beyond it, once), on hand-made study folders, and its wiring in study.sh's group() end to end with a stand-in
cemtool that records each call and refuses a grid that drops stored values, as `cemtool sweep` does."""

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research" / "scripts"))
import grid_edge  # noqa: E402

GRID = "train.lr=1e-3,2e-3,4e-3,8e-3,1.6e-2"


def study(tmp_path: Path, stored: str | None, chosen: str | None = None, selected: str | None = None) -> Path:
    """A tuning folder whose study.json holds ``stored`` and whose selection.json (of grid ``selected``, default
    ``stored``) chose ``chosen``."""
    d = tmp_path / "tune"
    d.mkdir(exist_ok=True)
    if stored is not None:
        (d / "study.json").write_text(json.dumps({"plan": {"grid": [stored]}}))
    if chosen is not None:
        grid = selected or stored
        values = [float(v) for v in grid.split("=", 1)[1].split(",")]
        edge = ["train.lr"] if float(chosen) in (min(values), max(values)) else []
        (d / "selection.json").write_text(json.dumps(
            {"grid": [grid], "archs": {"nesterov": {"chosen": {"train.lr": chosen}, "at_edge": edge}}}))
    return d


def test_ask_is_the_stated_grid_unless_the_study_holds_an_extension_of_it(tmp_path):
    assert grid_edge.ask(tmp_path / "none", GRID) == GRID
    assert grid_edge.ask(study(tmp_path, GRID), GRID) == GRID
    assert grid_edge.ask(study(tmp_path, GRID + ",3.2e-2"), GRID) == GRID + ",3.2e-2"
    assert grid_edge.ask(study(tmp_path, "train.lr=0.001,0.002,0.004,0.008,0.016,0.032"), GRID) \
        == "train.lr=0.001,0.002,0.004,0.008,0.016,0.032"  # the same values spelt otherwise
    assert grid_edge.ask(study(tmp_path, "train.lr=1e-3,2e-3"), GRID) == GRID  # fewer values: the sweep says no
    assert grid_edge.ask(study(tmp_path, "train.wd=1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2"), GRID) == GRID


@pytest.mark.parametrize("chosen, want", [
    ("1.6e-2", GRID + ",3.2e-2"),  # the top edge, at the factor-2 spacing
    ("1e-3", GRID + ",5e-4"),      # the bottom edge
    ("4e-3", ""),                  # inside: nothing
])
def test_edge_adds_one_value_at_the_grids_spacing(tmp_path, chosen, want):
    assert grid_edge.edge(study(tmp_path, GRID, chosen), GRID) == want


def test_edge_follows_an_uneven_grids_own_spacing_at_its_edge(tmp_path):
    fine = GRID + ",5.66e-3,1.13e-2"  # listed out of order; the top step is 1.13e-2 -> 1.6e-2 (x sqrt 2)
    assert grid_edge.edge(study(tmp_path, fine, "1.6e-2"), fine) == fine + ",2.27e-2"
    six = "train.lr=2e-3,4e-3,8e-3"
    assert grid_edge.edge(study(tmp_path, six, "8e-3"), six) == six + ",1.6e-2"


def test_a_grid_stated_anew_by_hand_is_a_new_grid_for_the_rule(tmp_path):
    """nesterov-zero (stop 53): its study holds GRID + 3.2e-2 (the rule's extension); the refinement states
    GRID + 3.2e-2 + the x sqrt 2 values, which ``ask`` passes on (it holds all the stored values), and a choice at its
    top is extended once more, by the new top step (2.26e-2 -> 3.2e-2), and then no further."""
    refined = GRID + ",3.2e-2,1.13e-2,2.26e-2"
    assert grid_edge.ask(study(tmp_path, GRID + ",3.2e-2"), refined) == refined
    assert grid_edge.edge(study(tmp_path, refined, "3.2e-2"), refined) == refined + ",4.53e-2"
    assert grid_edge.edge(study(tmp_path, refined, "1.6e-2"), refined) == ""
    assert grid_edge.edge(study(tmp_path, refined + ",4.53e-2", "4.53e-2"), refined) == ""  # extended already


def tuned(tmp_path: Path, grid: str, seeds: list[int], chosen: str, gain: float | None, sel_seeds=None) -> Path:
    """A tuning folder of ``grid`` on ``seeds`` whose current selection chose ``chosen`` with shortfall ``gain``."""
    d = tmp_path / "tune"
    d.mkdir(exist_ok=True)
    (d / "study.json").write_text(json.dumps({"plan": {"grid": [grid], "seeds": seeds}}))
    values = [float(v) for v in grid.split("=", 1)[1].split(",")]
    edge = ["train.lr"] if float(chosen) in (min(values), max(values)) else []
    short = {} if gain is None else {"train.lr": {"gain": gain}}
    (d / "selection.json").write_text(json.dumps({"grid": [grid], "tuning_seeds": sel_seeds or seeds, "archs": {
        "nesterov": {"chosen": {"train.lr": chosen}, "at_edge": edge, "shortfall": short}}}))
    return d


def test_refine_adds_the_sqrt2_values_beside_a_choice_with_a_shortfall_and_a_third_seed_once(tmp_path):
    """The refinement rule on nesterov-zero's real case (1.6e-2 chosen on the extended grid, shortfall 0.017): the
    x√2 values beside it and seed 102; not at or below the threshold, not at the edge, not on a selection of other
    seeds, not again once the neighbours are x√2 away (baseline-wide's 1.13e-2 with its 0.014 stays)."""
    ext = GRID + ",3.2e-2"
    assert grid_edge.refine(tuned(tmp_path, ext, [100, 101], "1.6e-2", 0.017)) == \
        f"{ext},1.13e-2,2.26e-2 100,101,102"
    assert grid_edge.refine(tuned(tmp_path, ext, [100, 101], "1.6e-2", 0.01)) == ""  # (not above 0.01)
    assert grid_edge.refine(tuned(tmp_path, ext, [100, 101], "1.6e-2", None)) == ""  # no estimate
    assert grid_edge.refine(tuned(tmp_path, ext, [100, 101], "3.2e-2", 0.05)) == ""  # the edge is the edge rule's
    assert grid_edge.refine(tuned(tmp_path, ext, [100, 101], "1.6e-2", 0.017, [100])) == ""  # stale selection
    fine = GRID + ",5.66e-3,1.13e-2"
    assert grid_edge.refine(tuned(tmp_path, fine, [100, 101, 102], "1.13e-2", 0.014)) == ""  # refined already
    assert grid_edge.refine(tuned(tmp_path, fine, [100, 101, 102], "4e-3", 0.02)) == \
        f"{fine},2.83e-3 100,101,102"  # one side refined, the other not; three seeds already: none added
    (tmp_path / "tune" / "selection.json").unlink()
    assert grid_edge.refine(tmp_path / "tune") == "" and grid_edge.refine(tmp_path / "none") == ""


def test_seeds_asks_for_the_stored_seeds_of_a_refined_study(tmp_path):
    d = tuned(tmp_path, GRID, [100, 101, 102], "4e-3", None)
    assert grid_edge.seeds(d, "100,101") == "100,101,102"
    assert grid_edge.seeds(d, "100,101,102") == "100,101,102"
    assert grid_edge.seeds(d, "100,103") == "100,103"  # not a subset: the sweep says what is wrong
    assert grid_edge.seeds(tmp_path / "none", "100,101") == "100,101"


def test_edge_fires_once_and_never_on_a_stale_or_missing_selection(tmp_path):
    assert grid_edge.edge(study(tmp_path, GRID + ",3.2e-2", "3.2e-2"), GRID) == ""  # extended already
    stale = study(tmp_path, GRID, "4e-3", selected="train.lr=1e-3,2e-3,4e-3")  # at the edge of another grid
    assert json.loads((stale / "selection.json").read_text())["archs"]["nesterov"]["at_edge"] == ["train.lr"]
    assert grid_edge.edge(stale, GRID) == ""
    (tmp_path / "tune" / "selection.json").unlink()
    assert grid_edge.edge(study(tmp_path, GRID), GRID) == ""
    assert grid_edge.edge(tmp_path / "none", GRID) == ""
    two = "train.lr=1e-3,2e-3"  # two values: no edge (the selection's own rule wants 3)
    assert grid_edge.edge(study(tmp_path, two, "2e-3"), two) == ""


def test_fmt_spells_values_as_the_grids_do():
    assert [grid_edge._fmt(x) for x in (0.032, 5e-4, 0.0226, 0.99999)] == ["3.2e-2", "5e-4", "2.26e-2", "1e0"]


FAKE = textwrap.dedent('''\
    #!/usr/bin/env python3
    """A stand-in for cemtool: records each call. A grid sweep stores its grid, seeds and archs (refusing a grid or
    seeds that drop a stored value) and writes no selection, as `cemtool sweep --grid` does not; `--tuned T
    --dry-run` writes T's selection.json, choosing the largest lr in the groups named by $EDGE_AT and the middle
    one elsewhere, with a shortfall of 0.02 nats in the groups named by $REFINE_AT (0.005 elsewhere)."""
    import json, os, sys
    from pathlib import Path
    args = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    if args[:1] == ["sweep"] and "--tuned" in args and "--dry-run" in args:
        tune = Path(args[args.index("--tuned") + 1])
        if not (tune / "study.json").exists():
            sys.exit(1)
        stored = json.loads((tune / "study.json").read_text())["plan"]
        grid = stored["grid"][0]
        values = [float(v) for v in grid.split("=", 1)[1].split(",")]
        edge = tune.name in os.environ.get("EDGE_AT", "").split(",")
        chosen = max(values) if edge else sorted(values)[len(values) // 2]
        gain = 0.02 if tune.name in os.environ.get("REFINE_AT", "").split(",") else 0.005
        (tune / "selection.json").write_text(json.dumps({"grid": [grid], "tuning_seeds": stored["seeds"], "archs": {
            stored["archs"][0]: {"chosen": {"train.lr": repr(chosen)}, "at_edge": ["train.lr"] if edge else [],
                                 "shortfall": {"train.lr": {"gain": gain}}}}}))
        sys.exit(0)
    if args[:1] != ["sweep"] or "--grid" not in args:
        sys.exit(0)
    out, grid = Path(args[args.index("--out") + 1]), args[args.index("--grid") + 1]
    values = [float(v) for v in grid.split("=", 1)[1].split(",")]
    seeds = [int(x) for x in args[args.index("--seeds") + 1].split(",")]
    if (out / "study.json").exists():
        stored = json.loads((out / "study.json").read_text())["plan"]
        if not {float(v) for v in stored["grid"][0].split("=", 1)[1].split(",")} <= set(values):
            print("Error: the grid drops stored values", file=sys.stderr)
            sys.exit(1)
        if not set(stored["seeds"]) <= set(seeds):
            print("Error: the seeds drop stored seeds", file=sys.stderr)
            sys.exit(1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.json").write_text(json.dumps({"plan": {"grid": [grid], "seeds": seeds,
                                                         "archs": [args[args.index("--archs") + 1]]}}))
''')


def test_study_sh_extends_an_edge_choice_and_refines_a_shortfall_once_and_a_rerun_asks_for_the_stored_study(
        tmp_path):
    """Lane 2 of the stdlib part twice with the stand-in: tmm-zero and late-lowrank-75-6 choose their edge, and each
    is extended once; nesterov-zero (whose study holds the edge rule's 3.2e-2, as the real one did at stop 53) and
    late-lowrank-6 report a shortfall of 0.02 inside the grid, and each is refined once (the x√2 values beside the
    choice, a third seed); every step is logged in study.log. The rerun asks for the stored grids and seeds and
    changes nothing, and no other group's grid or seeds change. The wiring fails if a rule's call is dropped, or if a
    rerun asks for the stated grid or seeds (the stand-in then refuses, as the sweep does)."""
    fake = tmp_path / "cemtool"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log, out = tmp_path / "calls.jsonl", tmp_path / "out"
    env = {**os.environ, "CEMTOOL": str(fake), "FAKE_LOG": str(log), "STUDY_LANE": "2",
           "EDGE_AT": "tmm-zero,late-lowrank-75-6", "REFINE_AT": "nesterov-zero,late-lowrank-6"}

    def lane2() -> list[list[str]]:
        log.write_text("")
        res = subprocess.run(["bash", "research/scripts/study.sh", "stdlib", str(out)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        return [json.loads(line) for line in log.read_text().splitlines()]

    def tunings(calls):  # (study, grid, seeds) of every tuning sweep
        return [(Path(c[c.index("--out") + 1]).name, c[c.index("--grid") + 1], c[c.index("--seeds") + 1])
                for c in calls if c[0] == "sweep" and "--grid" in c]

    def selected(calls):  # the dry runs that write each tuning study's selection before the rules read it
        return [Path(c[c.index("--tuned") + 1]).name for c in calls if "--dry-run" in c and "--tuned" in c]

    nz = out / "stdlib" / "tune" / "nesterov-zero"
    nz.mkdir(parents=True)
    (nz / "study.json").write_text(json.dumps({"plan": {"grid": [GRID + ",3.2e-2"], "seeds": [100, 101],
                                                        "archs": ["nesterov"]}}))
    calls = lane2()
    first = tunings(calls)
    two, three = "100,101", "100,101,102"
    assert {"tmm-zero", "nesterov-zero", "late-lowrank-75-6", "late-lowrank-6", "cem-rec2"} <= set(selected(calls))
    assert ("tmm-zero", GRID, two) in first and ("tmm-zero", GRID + ",3.2e-2", two) in first
    # nesterov-zero asks for its stored grid (not the stated one, which drops 3.2e-2); the stand-in chooses 8e-3,
    # the middle of six values, whose neighbours are a factor 2 away: 5.66e-3 and 1.13e-2 beside it
    assert [t for t in first if t[0] == "nesterov-zero"] == [
        ("nesterov-zero", GRID + ",3.2e-2", two), ("nesterov-zero", GRID + ",3.2e-2,5.66e-3,1.13e-2", three)]
    six = "train.lr=2e-3,4e-3,8e-3"
    assert [t for t in first if t[0] == "late-lowrank-6"] == [
        ("late-lowrank-6", six, two), ("late-lowrank-6", six + ",2.83e-3,5.66e-3", three)]
    assert first.count(("late-lowrank-75-6", six, two)) == 1 and ("late-lowrank-75-6", six + ",1.6e-2", two) in first
    per_group = Counter(name for name, _, _ in first)  # every other group: one tuning call, its stated grid
    assert {name for name, k in per_group.items() if k > 1} == {"tmm-zero", "late-lowrank-75-6", "nesterov-zero",
                                                                "late-lowrank-6"}
    assert max(per_group.values()) == 2 and len(per_group) > 10  # (17 groups in lane 2 at stop 52)
    hand = {"baseline-wide", "lime-router-abs"}  # refined by hand at stop 51: their own third seed
    assert {n for n, _, sd in first if sd == three} == hand | {"nesterov-zero", "late-lowrank-6"}
    study_log = (out / "study.log").read_text()
    assert study_log.count(" edge  ") == 2 and "extended to " + GRID + ",3.2e-2" in study_log
    assert study_log.count(" refine ") == 2 and f"refined to {six},2.83e-3,5.66e-3 on seeds {three}" in study_log

    again = tunings(lane2())
    assert ("tmm-zero", GRID + ",3.2e-2", two) in again and ("tmm-zero", GRID, two) not in again
    assert ("nesterov-zero", GRID + ",3.2e-2,5.66e-3,1.13e-2", three) in again
    assert ("late-lowrank-6", six + ",2.83e-3,5.66e-3", three) in again
    assert ("late-lowrank-75-6", six + ",1.6e-2", two) in again
    assert len(again) == len(set(again)) == len(set(n for n, _, _ in again))  # one call per group: nothing more
    log_again = (out / "study.log").read_text()
    assert log_again.count(" edge  ") == 2 and log_again.count(" refine ") == 2


@pytest.mark.parametrize("lane", ["1", "2"])
def test_either_lane_ends_with_the_context_probe_of_the_finished_runs_only(tmp_path, lane):
    """With the lanes as two processes, whichever ends last probes every run, so each lane's invocation ends with
    the lag-1 probe (collapse-report --lag 1), and it skips a run the other lane is still training (meta.json's
    status), which that lane's own probe covers. Fails if only lane 2 probes, or if a running run is probed."""
    fake = tmp_path / "cemtool"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    log, out = tmp_path / "calls.jsonl", tmp_path / "out"
    runs = {"completed": out / "stdlib" / "late-lowrank-6" / "baseline-s0",
            "running": out / "stdlib" / "uniform-6" / "baseline-s1"}
    for status, run in runs.items():
        run.mkdir(parents=True)
        (run / "meta.json").write_text(json.dumps({"schema_version": 1, "status": status}, indent=2))
    log.write_text("")
    env = {**os.environ, "CEMTOOL": str(fake), "FAKE_LOG": str(log), "STUDY_LANE": lane}
    res = subprocess.run(["bash", "research/scripts/study.sh", "stdlib", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    probed = [c[1] for c in calls if c[0] == "collapse-report"]
    assert probed == [str(runs["completed"])]
    assert [c for c in calls if c[0] == "collapse-report"][0][2:] == ["--lag", "1", "--name", "collapse-lag1",
                                                                      "--no-plots", "--quiet"]
