"""research/scripts/study_gpu.sh end to end with --tiny on the CPU: the estimate, the studies, the tuning/comparison
split, resuming, and the refusals."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
from tiny_study import SCRIPTS, TINY, meta_mtimes, run, study_dirs


def study_gpu():
    spec = importlib.util.spec_from_file_location("study_gpu", SCRIPTS / "study_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("study_gpu", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tiny_study):
    """--estimate-only, then the whole tiny study on two CPU lanes, in one folder (research/tests/tiny_study.py:
    started in the background when the tests were collected)."""
    return tiny_study.result()


def table(stdout: str) -> dict[str, tuple[int, int]]:
    """The estimate table: study -> (runs, tokens per run)."""
    rows = re.findall(r"^((?:main|muon)/\S+)\s+(\d+)\s+([\d,]+)\s+\S+$", stdout, re.M)
    return {name: (int(runs), int(tokens.replace(",", ""))) for name, runs, tokens in rows}


@pytest.mark.slow
def test_every_study_completed_as_the_estimate_planned(tiny):
    out, stdout = tiny["out"], tiny["res"].stdout
    planned = table(stdout)
    assert "estimate:" in stdout and "device-hours" in stdout
    assert len(planned) == 30 and {"main/tune/momentum", "main/core", "main/depth6", "main/late-lowrank-75",
                                   "main/momentum-shared-lr", "main/tune/momentum-zero", "main/lime-frozen",
                                   "main/init", "muon/tune/lane1", "muon/lane2"} <= set(planned)
    assert {str(p.relative_to(out)) for p in study_dirs(out)} == set(planned)
    for name, (runs, tokens) in planned.items():
        study = json.loads((out / name / "study.json").read_text())
        assert study["status"] == "completed", name
        assert len(study["items"]) == runs and study["plan"]["tokens"] == tokens, name
        assert all(i["status"] == "completed" for i in study["items"]), name


@pytest.mark.slow
def test_comparisons_use_their_tuning_selection_on_other_seeds(tiny):
    out = tiny["out"]
    compared = 0
    for d in study_dirs(out):
        plan = json.loads((d / "study.json").read_text())["plan"]
        if plan["grid"]:
            assert plan["seeds"] == [100] and plan["tuned_from"] is None  # --tiny's one tuning seed
            continue
        if d.name in ("momentum-shared-lr", "init"):  # fixed rates (the test below)
            assert plan["tuned_from"] is None
            continue
        tuning = Path(plan["tuned_from"])
        assert tuning.is_absolute() and tuning.parent.name == "tune" and tuning.parent.parent == d.parent
        tune = json.loads((tuning / "study.json").read_text())
        assert not set(plan["seeds"]) & set(tune["plan"]["seeds"])
        assert plan["seeds"] == [0, 1]
        for arch in plan["archs"]:
            # the grid point with the lowest mean final validation loss over the tuning seeds
            points = {}
            for item in tune["items"]:
                if item["arch"] == arch:
                    points.setdefault(tuple(item["point"].items()), []).append(item["val_loss"])
            best = min(points, key=lambda p: sum(points[p]) / len(points[p]))
            assert plan["arch_overrides"][arch] == [f"{k}={v}" for k, v in best], (d, arch)
        compared += 1
    assert compared == 15  # core, cem, baseline-lime-flops, 10 more groups of main, muon lane1 and lane2


@pytest.mark.slow
def test_the_controls_run_as_study_sh_stdlib_part_runs_them(tiny):
    """The controls that can flip a verdict, as study.sh's stdlib part runs them: every momentum architecture at
    the baseline's tuned lr (read from main/tune/core's selection when the sweep starts) with sharpness and
    forgetting; the zero-initialised streams; LIMe's router at lr 1e-2 and frozen; one step at lr 0."""
    mod, out = study_gpu(), tiny["out"]

    def study(name):
        return json.loads((out / name / "study.json").read_text())

    def configs(name):
        return [json.loads((out / name / i["run"] / "config.json").read_text()) for i in study(name)["items"]]

    lr = json.loads((out / "main/tune/core/selection.json").read_text())["archs"]["baseline"]["chosen"]["train.lr"]
    shared = study("main/momentum-shared-lr")["plan"]
    assert shared["archs"] == mod.MOMENTUM and f"train.lr={lr}" in shared["overrides"]
    assert shared["analyses"] == ["sharpness", "forgetting"] and shared["seeds"] == [0, 1]
    assert {c["train"]["lr"] for c in configs("main/momentum-shared-lr")} == {float(lr)}
    assert {c["model"]["momentum"]["stream_init"] for c in configs("main/momentum-zero")} == {"zero"}
    assert {c["model"]["lime"]["router_lr"] for c in configs("main/lime-router-abs")} == {0.01}
    assert {c["model"]["lime"]["freeze_router"] for c in configs("main/lime-frozen")} == {True}
    init = study("main/init")
    assert init["plan"]["tokens"] == 512 and {c["train"]["lr"] for c in configs("main/init")} == {0.0}
    assert all((out / "main/init" / i["run"] / "reports" / "collapse.json").is_file() for i in init["items"])


def test_a_shared_lr_sweep_before_its_tuning_has_selected_is_one_line(tmp_path):
    """shared_lr reads the tuning study's selection when the sweep starts; without one it refuses in one line
    (run_lane notes it as a failed study and the lane goes on), and with one it passes that architecture's lr."""
    mod = study_gpu()
    s = mod.Sweep("main/momentum-shared-lr", ["tmm"], [0], 512, "default", lr_from=("main/tune/core", "baseline"))
    with pytest.raises(mod.CemtoolError, match="has not selected"):
        mod.shared_lr(s, tmp_path)
    (tmp_path / "main/tune/core").mkdir(parents=True)
    (tmp_path / "main/tune/core/selection.json").write_text(json.dumps(
        {"archs": {"baseline": {"chosen": {"train.lr": "3e-3"}}, "lime": {"chosen": {"train.lr": "1e-2"}}}}))
    assert mod.shared_lr(s, tmp_path) == ["train.lr=3e-3"]
    other = mod.Sweep("x", ["tmm"], [0], 512, "default", lr_from=("main/tune/core", "cem"))  # not in the selection
    with pytest.raises(mod.CemtoolError, match="no choice of cem"):
        mod.shared_lr(other, tmp_path)
    args = mod.sweep_args(s, tmp_path, mod.SIZES["tiny"], ["--data", "d"], [], None, "cpu")
    assert args[args.index("--set") + 1] == "train.lr=3e-3" and "--grid" not in args


@pytest.mark.slow
def test_matched_groups_are_matched(tiny):
    out, stdout = tiny["out"], tiny["res"].stdout
    diffs = dict(re.findall(r"^(baseline-wide|baseline-cem-size|depth6|late-lowrank-75)\s.*\s([+-][\d.]+)%$",
                            stdout, re.M))
    assert set(diffs) == {"baseline-wide", "baseline-cem-size", "depth6", "late-lowrank-75"}
    assert all(abs(float(diffs[g])) <= 2 for g in ("baseline-wide", "baseline-cem-size", "depth6"))
    assert float(diffs["late-lowrank-75"]) == -25.0

    def items(name):
        return {i["arch"]: i for i in json.loads((out / name / "study.json").read_text())["items"]}

    core, flops = items("main/core"), json.loads((out / "main/baseline-lime-flops/study.json").read_text())
    ratio = core["lime"]["flops_per_token"] / core["baseline"]["flops_per_token"]
    step = 16 * 32
    assert abs(flops["plan"]["tokens"] - 4096 * ratio) <= step / 2
    assert flops["plan"]["tokens"] % step == 0
    wide, tmm = items("main/baseline-wide")["baseline"], items("main/momentum")["tmm"]
    assert abs(wide["params"] / tmm["params"] - 1) <= 0.02
    deep = items("main/depth6")["baseline"]
    assert deep["non_embedding"] / core["baseline"]["non_embedding"] - 1 == pytest.approx(0, abs=0.02)


@pytest.mark.slow
def test_estimate_only_trains_nothing(tiny):
    est = tiny["estimate_only"]
    assert table(est["res"].stdout) == table(tiny["res"].stdout)  # the same plan, measured before
    assert est["studies"] == []
    assert all("/estimate/" in p for p in est["runs"])  # only the timed probes
    out = est["res"].stdout
    assert "within 15 minutes of device time" in out and "chains of this study that fit:" in out
    assert re.search(r"^baseline\s+[\d,]+\s+[\d,]+\s+[\d.]+\s+\d+$", out, re.M), out


def test_budget_plan_counts_runs_and_chains_by_hand():
    """budget_plan against a hand computation: 1,000 tokens/s, 1 s overhead, 2 s of analyses, 100 params at 20
    tokens/param -> 2,000 tokens (a whole number of the tiny size's steps, eval cost added) per run."""
    mod = study_gpu()
    size = dataclasses.replace(mod.SIZES["tiny"], eval_every=10 ** 9, eval_tokens=0)
    sweep = mod.Sweep(dir="main/core", archs=["baseline"], seeds=[0], tokens=size.tokens_per_step, probe="default")
    probes = {"rate": {"default": {"baseline": 1000.0}}, "overhead_s": 1.0, "params": {"baseline": 100},
              "analysis_s": {"sharpness": 1.5, "collapse": 0.5}}
    short, long = mod.Chain("short", [sweep], hours=0.1), mod.Chain("long", [sweep], hours=0.3)
    lines = mod.budget_plan(probes, [long, short], size, minutes=15, lanes=1)
    tokens = size.whole_steps(2000)
    sec = tokens / 1000 + 1.0 + 2.0
    row = lines[2].split()
    assert row[0] == "baseline" and int(row[2].replace(",", "")) == tokens
    assert float(row[3]) == pytest.approx(sec / 60, abs=0.005) and int(row[4]) == int(900 // sec)
    assert "fit: 1 of 2" in lines[-1] and "6.0 of 15 minutes" in lines[-1]  # the 18-minute chain does not fit


@pytest.mark.slow
def test_rerun_retrains_nothing(tiny):
    out, before, res = tiny["out"], tiny["rerun"]["before"], tiny["rerun"]["res"]  # rerun in the background
    assert res.returncode == 0, res.stdout + res.stderr
    assert meta_mtimes(out) == before and len(before) > 140
    assert "timing every architecture" in res.stdout


def test_a_lane_gets_each_commands_exit_status_and_output_forked_or_as_a_process(tmp_path, monkeypatch):
    """The Launcher, both ways: a command that works exits 0 with its output in the log; a refused one exits 1
    with its one-line error in the log, a usage error 2, as the command's own process does."""
    mod = study_gpu()
    for exe in ("", f"{sys.executable} -m cemtool"):
        monkeypatch.setenv("CEMTOOL", exe)
        launcher = mod.Launcher()
        assert (launcher.exe == []) == (exe == "")
        log = tmp_path / "lane.log"
        one = {"OMP_NUM_THREADS": "1"}  # (without it, a busy machine adds a note on the threads)
        assert launcher.run(["archs"], str(log), one) == 0
        assert "baseline" in log.read_text() and "tmm" in log.read_text()
        assert launcher.run(["sweep", "--archs", "no-such-arch", "--out", str(tmp_path / "s")], str(log), one) == 1
        text = log.read_text()  # the log is rewritten by each command
        assert text.startswith("Error: unknown architecture 'no-such-arch'") and "Traceback" not in text, text
        assert not (tmp_path / "s").exists()
        assert launcher.run(["sweep", "--no-such-option"], str(log), one) == 2
        assert "No such option" in log.read_text() and "Traceback" not in log.read_text()
        launcher.close()


def test_refuses_without_yes_when_stdin_is_not_a_terminal(tmp_path):
    res = run(*TINY, "--out", str(tmp_path / "s"))
    assert res.returncode != 0
    assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("Error: ") and "--yes" in res.stderr
    assert not (tmp_path / "s").exists()


def test_late_lowrank_75_keeps_three_quarters_of_the_budget():
    mod = study_gpu()
    sizes = {"tiny": [16, 8]}
    for name, size in mod.SIZES.items():
        dims, dh = mod.late_lowrank_75(size), size.d_model // size.n_head
        assert sum(dims) == 0.75 * size.n_layer * dh and len(dims) == size.n_layer, name
        assert dims == sorted(dims, reverse=True) and all(d % 2 == 0 and d > 0 for d in dims), name
        if name in sizes:
            assert dims == sizes[name]
    four = dataclasses.replace(mod.SIZES["tiny"], n_layer=4, d_model=64, n_head=4)
    assert mod.late_lowrank_75(four) == [16, 16, 10, 6]  # study.sh's model.head_dims for 4 layers of 4 x 16


def test_refuses_missing_data_or_target_with_one_line(tmp_path):
    for args, words in ((["--data", str(tmp_path / "none")], "does not exist"), (["--data", str(tmp_path)], "--to")):
        res = run("--device", "cpu", "--estimate-only", "--out", str(tmp_path / "s"), *args)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stderr.startswith("Error: ") and words in res.stderr and "Traceback" not in res.stderr
        assert not (tmp_path / "s").exists()
