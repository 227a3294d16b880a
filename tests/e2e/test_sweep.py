"""`cemtool sweep`: a study of architectures x seeds on equal tokens, interrupted (SIGKILL of a real process, and a
Ctrl-C inside training) and resumed without redoing completed work; compute accounting; bad input."""

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cemtool.analysis.compute import arch_row
from cemtool.errors import CemtoolError
from cemtool.sweep import make_plan, run_sweep

from kit import TINY, set_args

runner = CliRunner()
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TOKENS = 30 * 8 * 16  # TINY: 30 steps of 8 x 16 tokens


def sets(*extra):
    return set_args(*TINY, *extra)


def app():
    from cemtool.cli.main import app

    return app


def snapshot(*roots: Path) -> dict[str, tuple[str, int]]:
    return {str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def manifest(out: Path) -> dict:
    return json.loads((out / "study.json").read_text())


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A real `cemtool sweep` process SIGKILLed once its first item (training + collapse) is complete, then the same
    sweep resumed in-process. Returns the study dir, the first item's files before/after, and the resume output."""
    out = tmp_path_factory.mktemp("kill") / "study"
    args = [sys.executable, "-m", "cemtool", "sweep", "--archs", "baseline,tmm", "--seeds", "0", "--tokens",
            str(TOKENS), *sets(), "--analyses", "collapse", "-A", "collapse.tokens=2048", "-A",
            "collapse.per_class=16", "--out", str(out), "--device", "cpu", "-q"]
    proc = subprocess.Popen(args, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 180
    while True:
        assert proc.poll() is None, f"the sweep ended before it could be killed: {proc.stderr.read()}"
        assert time.time() < deadline, "the first item never completed"
        try:
            first = manifest(out)["items"][0]
        except (FileNotFoundError, json.JSONDecodeError):
            first = None
        if first and first["status"] == "completed" and first["analyses"]["collapse"]["status"] == "completed":
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    m = manifest(out)
    assert m["status"] == "running" and m["items"][1]["status"] in ("pending", "running")
    before = snapshot(out / "baseline-s0")
    res = runner.invoke(app(), ["sweep", "--resume", str(out), "--device", "cpu", "-q"])
    return out, before, snapshot(out / "baseline-s0"), res


def test_killed_sweep_resumes_and_completes(killed):
    out, before, after, res = killed
    assert res.exit_code == 0, res.output
    assert "study:" in res.stdout and "completed" in res.stdout
    m = manifest(out)
    assert m["status"] == "completed"
    assert [i["status"] for i in m["items"]] == ["completed", "completed"]
    assert all(i["step"] == 30 and i["tokens"] == TOKENS for i in m["items"])
    assert (out / "tmm-s0" / "reports" / "collapse.json").exists()
    assert after == before                                     # the completed item: not a byte or mtime changed


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """An in-process sweep stopped by Ctrl-C inside the second item's training, then resumed."""
    out = tmp_path_factory.mktemp("ctrlc") / "study"
    plan = make_plan("baseline,tmm", "0", tokens=TOKENS, overrides=TINY, analyses="sharpness,forgetting",
                     options={"sharpness": {"tokens": 256, "top_k": 1, "lanczos_steps": 6, "trace_hvps": 4,
                                            "density_runs": 0, "landscape": "none", "avg_samples": 2},
                              "forgetting": {"steps": 4, "eval_every": 2}})

    def stop(ev):
        if ev["item"] == "tmm-s0" and ev["kind"] == "step" and ev["step"] == 15:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(out, plan, device="cpu", callback=stop)
    stopped = manifest(out)
    stopped["run_status"] = json.loads((out / "tmm-s0" / "meta.json").read_text())["status"]
    first = [out / "baseline-s0", out / "baseline-s0-ft-grammar-b"]
    before = snapshot(*first)
    events: list[dict] = []
    done = run_sweep(out, device="cpu", callback=events.append)
    return out, stopped, done, events, before, snapshot(*first)


def test_interrupted_sweep_resumes_from_the_checkpoint(interrupted):
    out, stopped, done, events, before, after = interrupted
    assert stopped["status"] == "interrupted"
    assert [i["status"] for i in stopped["items"]] == ["completed", "interrupted"]
    assert stopped["run_status"] == "interrupted"
    starts = [(e["item"], e["step"]) for e in events if e["kind"] == "start"]
    assert starts == [("tmm-s0", 10), ("tmm-s0", 0)]          # training resumed at step 10, then its fine-tune
    skipped = [(e["item"], e["analysis"]) for e in events if e["kind"] == "analysis" and e["status"] == "skipped"]
    assert skipped == [("baseline-s0", "sharpness"), ("baseline-s0", "forgetting")]
    assert after == before
    assert done["status"] == "completed"
    for it in done["items"]:
        assert it["status"] == "completed" and it["step"] == 30
        for name, a in it["analyses"].items():
            assert a["status"] == "completed" and (out / a["report"]).exists(), name
    assert done["items"][1]["analyses"]["forgetting"]["run"] == "tmm-s0-ft-grammar-b"
    sharp = json.loads((out / "tmm-s0" / "reports" / "sharpness.json").read_text())
    assert sharp["tokens"] == 256 and len(sharp["eigen"]["top"]) == 1
    assert sharp["tokens_requested"] == 256  # what the plan asked for is recorded beside what was used


def test_resumed_training_equals_uninterrupted(killed, interrupted):
    """The two studies train the same items; one was SIGKILLed, the other stopped at step 15 and resumed from its
    step-10 checkpoint: the final losses agree exactly (resume is bit-exact on the CPU)."""
    a, b = manifest(killed[0]), interrupted[2]
    assert [i["val_loss"] for i in a["items"]] == [i["val_loss"] for i in b["items"]]


def test_compute_accounting(interrupted):
    done = interrupted[2]
    for it in done["items"]:
        meta = json.loads((interrupted[0] / it["run"] / "meta.json").read_text())
        row = arch_row(it["arch"], TINY, vocab=483, seq_len=16)  # the grammar's 483 words
        assert it["params"] == meta["params"]["total"] == row["params"]
        assert it["flops_per_token"] == row["flops_train"]
        assert it["total_flops"] == it["flops_per_token"] * TOKENS
    assert done["items"][0]["params"] < done["items"][1]["params"]  # tmm's learned stream embeddings


def test_rerunning_a_finished_study_changes_nothing(interrupted, tmp_path):
    out = interrupted[0]
    before = snapshot(out)
    events: list[dict] = []
    run_sweep(out, device="cpu", callback=events.append)
    assert not [e for e in events if e["kind"] == "start"]
    changed = {k for k, v in snapshot(out).items() if before.get(k) != v}
    assert changed <= {str(out / "study.json"), str(out / ".lock")}


# a bad option value refused on its own (its form, its range) is a usage error: exit 2 (issue 20 item 22)
USAGE_ERRORS = ("no seeds given", "seeds must be integers", "listed twice", "is not of the form", "must be positive",
                "is a config section", "is given twice", "are the same value")


def usage_error(message: str) -> bool:
    return any(u in message for u in USAGE_ERRORS)


@pytest.mark.parametrize("args, message", [
    (["--archs", "baseline,nope"], "unknown architecture 'nope'"),
    (["--archs", "baseline", "--seeds", ","], "no seeds given"),
    (["--archs", "baseline", "--seeds", "0,x"], "seeds must be integers"),
    (["--archs", "baseline", "--seeds", "1,1"], "listed twice"),
    (["--archs", "baseline", "--seeds", "1,01"], "seed 1 is listed twice"),
    (["--archs", "baseline", "--analyses", "sharpness", "-A", "sharpness.tokens"],
     "is not of the form analysis.key=value"),
    (["--archs", "baseline", "--analyses", "hessian"], "unknown analysis 'hessian'"),
    (["--archs", "baseline", "--data", "pydoc", "--analyses", "forgetting"], "forgetting needs target data"),
    (["--archs", "baseline", "--analyses", "forgetting", "--to", "pydoc"], "cannot be tokenized"),
    (["--archs", "baseline", "--analyses", "collapse", "-A", "collapse.nope=1"], "unknown collapse option"),
    (["--archs", "baseline", "--tokens", "0"], "must be positive"),
    # what the sweep sets itself, or a whole section, is refused rather than silently overridden
    (["--archs", "tmm", "--set", "model=x"], "model is a config section and must be a table/object"),
    (["--archs", "baseline", "--set", "seed=7"], "--set seed is not for a sweep: the sweep sets it; use --seeds"),
    (["--archs", "baseline", "--set", "data.source=pydoc"], "use --data"),
    (["--archs", "baseline", "--set", "schema_version=0"], "--set schema_version is not for a sweep"),
    # every item's values, the data and the analyses' options are checked before the study exists
    (["--archs", "baseline", "--seeds", "0,-1"], "seed=-1 is not allowed"),
    (["--archs", "baseline", "--tokens", "99999999999999999999"], "train.max_tokens=99999999999999999999"),
    (["--archs", "baseline", "--data", "/nonexistent/texts.txt"], "no such file or folder"),
    (["--archs", "baseline", "--to", "pydoc"], "forgetting is not among the analyses"),
    (["--archs", "baseline", "--analyses", "sharpness", "-A", "sharpness.sam_rho=NaN"],
     "-A sharpness.sam_rho=NaN: must be a finite number"),
    (["--archs", "baseline", "--analyses", "sharpness", "-A", "sharpness.tokens=-5"], "must be a whole number >= 1"),
    (["--archs", "baseline", "--analyses", "sharpness", "-A", "sharpness.top_k=x"], "sharpness.top_k=\"x\""),
    (["--archs", "baseline", "--analyses", "collapse", "-A", 'collapse.alpha="x"'], "must be a finite number"),
    (["--archs", "baseline", "--analyses", "forgetting", "-A", "forgetting.lr=1e999"], "forgetting.lr=Infinity"),
    (["--archs", "baseline", "--analyses", "forgetting", "-A", "forgetting.beta2=1.5"], "must be <= 1"),
])
def test_bad_plan_one_line(args, message, tmp_path):
    res = runner.invoke(app(), ["sweep", *args, "--out", str(tmp_path / "s"), "-q"])
    assert res.exit_code == (2 if usage_error(message) else 1), res.output
    assert res.output.startswith("Error:") and message in res.output.splitlines()[0]
    assert not (tmp_path / "s").exists()


def test_max_steps_that_do_not_give_the_tokens_are_noted(tmp_path):
    res = runner.invoke(app(), ["sweep", "--archs", "baseline", "--tokens", "5000", "--set", "train.max_steps=10",
                                "--out", str(tmp_path / "s"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert ("Note: baseline: --set train.max_steps=10 is not used: every run of a sweep trains --tokens 5,000 "
            "tokens (3 steps of 2,048)") in " ".join(res.output.split())
    res = runner.invoke(app(), ["sweep", "--archs", "baseline", "--tokens", str(TOKENS), *sets(), "--out",
                                str(tmp_path / "s"), "--dry-run"])
    assert res.exit_code == 0 and "Note:" not in res.output  # TINY's 30 steps are its tokens


def test_other_plan_in_existing_study_is_refused(interrupted, tmp_path):
    before = snapshot(interrupted[0])
    for dry in ([], ["--dry-run"]):  # a dry run refuses what the run would refuse
        res = runner.invoke(app(), ["sweep", "--archs", "baseline", "--tokens", str(TOKENS), *sets(), "--out",
                                    str(interrupted[0]), "-q", *dry])
        assert res.exit_code == 1 and "planned with other settings" in res.output
    assert snapshot(interrupted[0]) == before
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    res = runner.invoke(app(), ["sweep", "--archs", "baseline", "--out", str(tmp_path / "full"), "--dry-run"])
    assert res.exit_code == 1 and "exists and is not a study directory" in res.output
    res = runner.invoke(app(), ["sweep", "--resume", str(interrupted[0]), "--archs", "tmm"])
    assert res.exit_code == 2
    with pytest.raises(CemtoolError, match="holds no study"):
        run_sweep(interrupted[0] / "baseline-s0")


# --------------------------------------------------------------------------------------------------------------
# grids and the selection of tuned values

# the learning rate comes from the grid; the steps from --tokens (a --set train.max_steps must agree with it)
TUNE = [s for s in TINY if not s.startswith(("train.lr=", "train.max_steps="))]


def test_grid_is_the_product_and_names_carry_the_point():
    from cemtool.sweep import item_config, new_manifest

    plan = make_plan("baseline,tmm", "0,1", tokens=TOKENS, overrides=TUNE,
                     grid=["train.lr=1e-3,3e-2", "model.mlp=gelu,swiglu"])
    items = new_manifest(plan)["items"]
    assert len(items) == 2 * 2 * 2 * 2 and len({i["name"] for i in items}) == 16
    first = items[0]
    assert first["name"] == "baseline-lr=1e-3-mlp=gelu-s0"
    assert first["point"] == {"train.lr": "1e-3", "model.mlp": "gelu"}
    points = {(i["arch"], i["seed"], i["point"]["train.lr"], i["point"]["model.mlp"]) for i in items}
    assert points == {(a, s, lr, m) for a in ("baseline", "tmm") for s in (0, 1) for lr in ("1e-3", "3e-2")
                      for m in ("gelu", "swiglu")}
    cfg = item_config(plan, "tmm", 1, {"train.lr": "3e-2", "model.mlp": "swiglu"})  # parsed like --set
    assert cfg.train.lr == 0.03 and cfg.model.mlp == "swiglu" and cfg.seed == 1 and cfg.train.max_tokens == TOKENS


@pytest.mark.parametrize("grid, extra, message", [
    (["train.lr"], [], "is not of the form key=v1,v2"),
    (["seed=1,2"], [], "use --seeds"),
    (["train.max_tokens=100,200"], [], "use --tokens"),
    (["train.lr=1e-3", "train.lr=3e-3"], [], "is given twice"),
    (["train.lr=1e-3,0.001"], [], "'1e-3' and '0.001' are the same value"),
    (["train.lr=1e-3,3e-3"], ["train.lr=1e-2"], "both in --set and in --grid"),
    (["train.nope=1,2"], [], "unknown config key train.nope"),
    (["train.lr=-1,1e-3"], [], "train.lr=-1"),
    (["data.tokenizer=/x/a/b.json,/x/a_b.json"], [], "give the same run name 'baseline-tokenizer=_x_a_b.json-s0'"),
    (["data.tokenizer=/x/A.json,/x/a.json"], [], "give the same run name 'baseline-tokenizer=_x_A.json-s0'"),
    (["model=a,b"], [], "--grid model names a config section, not a field"),
    (['model={"n_layer":1,"d_model":16}'], [], "--grid model names a config section"),
    (["train.max_steps=10,20"], [], "use --tokens"),
    (["train.lr=1,1.0"], [], "train.lr=1 and train.lr=1.0 give the same config"),
    (["train.weight_decay=0,0.0"], [], "train.weight_decay=0 and train.weight_decay=0.0 give the same config"),
    ([f"data.tokenizer=/x/{'a' * 200}.json,byte"], [], "characters long"),
    ([f"train.lr={','.join(f'{k}e-5' for k in range(1, 101))}",
      f"train.weight_decay={','.join(f'{k}e-4' for k in range(101))}"],
     [], "the study would train 10,100 runs (at most 10,000 in one study)"),
])
def test_bad_grid_one_line(grid, extra, message, tmp_path):
    args = ["sweep", "--archs", "baseline", *[a for g in grid for a in ("--grid", g)],
            *[a for s in [*TUNE, *extra] for a in ("--set", s)]]
    res = runner.invoke(app(), [*args, "--out", str(tmp_path / "s"), "-q"])
    assert res.exit_code == (2 if usage_error(message) else 1), res.output
    assert res.output.startswith("Error:") and message in res.output.splitlines()[0]
    assert not (tmp_path / "s").exists()


def test_a_linked_run_folder_is_refused_not_followed(tmp_path):
    """A run folder of the study that is a symbolic link (not made by cemtool) is refused: the run is not written
    where it points, and study.json does not say running once the sweep has stopped."""
    from cemtool.sweep import open_study

    out, outside = tmp_path / "study", tmp_path / "outside"
    outside.mkdir()
    open_study(out, make_plan("baseline", "0", tokens=TOKENS, overrides=TINY)).save()
    (out / "baseline-s0").symlink_to(outside)
    with pytest.raises(CemtoolError, match="is a symbolic link: cemtool does not follow links"):
        run_sweep(out, device="cpu")
    assert list(outside.iterdir()) == []
    assert manifest(out)["status"] == "incomplete"


def item0(m: dict, **changes) -> dict:
    return {**m, "items": [{**m["items"][0], **changes}, *m["items"][1:]]}


def analysis0(m: dict, **changes) -> dict:
    it = m["items"][0]
    return item0(m, analyses={**it["analyses"], "collapse": {**it["analyses"]["collapse"], **changes}})


CORRUPT_MANIFESTS = [
    (lambda m: [m], "not a cemtool-study object"),
    (lambda m: [], "not a cemtool-study object"),
    (lambda m: {k: v for k, v in m.items() if k != "plan"}, "no plan"),
    (lambda m: {**m, "schema_version": "2"}, "schema_version '2' is not a whole number"),
    (lambda m: {**m, "schema_version": 99}, "written by a newer cemtool"),
    (lambda m: {**m, "status": "bogus"}, "status 'bogus' is not one of running"),
    (lambda m: {**m, "updated": 5}, "updated 5 is not a time"),
    (lambda m: {**m, "plan": {}}, "plan.archs is missing"),
    (lambda m: {**m, "plan": {**m["plan"], "archs": ["nosuch"]}}, "plan.archs: unknown architecture 'nosuch'"),
    (lambda m: {**m, "plan": {**m["plan"], "archs": "baseline"}}, "plan.archs 'baseline' is not a list"),
    (lambda m: {**m, "plan": {**m["plan"], "seeds": ["0"]}}, "plan.seeds ['0'] is not a list of whole numbers"),
    (lambda m: {**m, "plan": {**m["plan"], "seeds": [True]}}, "plan.seeds [True] is not a list of whole numbers"),
    (lambda m: {**m, "plan": {**m["plan"], "tokens": -1}}, "plan.tokens -1 is not a whole number >= 1"),
    (lambda m: {**m, "plan": {**m["plan"], "tokens": 1e400}}, "plan.tokens inf is not a whole number"),
    (lambda m: {**m, "plan": {**m["plan"], "data": 3}}, "plan.data 3 is not a string"),
    (lambda m: {**m, "plan": {**m["plan"], "overrides": [1]}}, "plan.overrides [1] is not a list of strings"),
    (lambda m: {**m, "plan": {**m["plan"], "analyses": ["magic"]}}, "plan.analyses ['magic'] is not a list of"),
    (lambda m: {**m, "plan": {**m["plan"], "options": {"collapse": 3}}}, "plan.options {'collapse': 3} is not an"),
    (lambda m: {**m, "plan": {**m["plan"], "grid": "train.lr=1"}}, "plan.grid 'train.lr=1' is not a list"),
    (lambda m: {**m, "plan": {**m["plan"], "arch_overrides": {"baseline": "x"}}}, "plan.arch_overrides"),
    (lambda m: {**m, "plan": {**m["plan"], "target": 7}}, "plan.target 7 is not a string or null"),
    (lambda m: {**m, "items": {}}, "no list of items"),
    (lambda m: {**m, "items": [3]}, "items[0] is not an object"),
    (lambda m: {**m, "items": [{k: v for k, v in m["items"][0].items() if k != "status"}]},
     "items[0].status is missing"),
    (lambda m: item0(m, status="bogus"), "items[0].status 'bogus' is not one of pending"),
    (lambda m: item0(m, name="../evil"), "items[0].name '../evil' is not a plain folder name inside the study"),
    (lambda m: item0(m, run="../elsewhere"), "items[0].run '../elsewhere' is not a plain folder name"),
    (lambda m: item0(m, run=".hidden"), "items[0].run '.hidden' is not a plain folder name"),
    (lambda m: item0(m, name="x" * 151), "is not a plain folder name"),
    (lambda m: {**m, "items": [m["items"][0], m["items"][0]]}, "items[1].name 'baseline-s0' is given twice"),
    (lambda m: item0(m, arch="tmm"), "items[0].arch 'tmm' is not among plan.archs"),
    (lambda m: item0(m, seed=1.5), "items[0].seed 1.5 is not a whole number"),
    (lambda m: item0(m, error=["x"]), "items[0].error is not a string or null"),
    (lambda m: item0(m, point={"train.lr": 3}), "items[0].point is not an object of strings"),
    (lambda m: item0(m, val_loss="abc"), "items[0].val_loss 'abc' is not a finite number or null"),
    (lambda m: item0(m, val_loss=float("nan")), "items[0].val_loss nan is not a finite number"),
    (lambda m: item0(m, seconds=float("inf")), "items[0].seconds inf is not a finite number"),
    (lambda m: item0(m, step=-3), "items[0].step -3 is not a whole number >= 0"),
    (lambda m: item0(m, tokens=True), "items[0].tokens True is not a whole number"),
    (lambda m: item0(m, analyses={"magic": {"status": "pending"}}), "items[0].analyses.magic: unknown analysis"),
    (lambda m: analysis0(m, status="bogus"), "items[0].analyses.collapse.status 'bogus' is not one of"),
    (lambda m: analysis0(m, report=3), "items[0].analyses.collapse.report is not a string or null"),
    (lambda m: analysis0(m, run="../../x"), "items[0].analyses.collapse.run '../../x' is not a plain folder"),
    (lambda m: analysis0(m, seconds=float("nan")), "items[0].analyses.collapse.seconds nan is not a finite"),
]


@pytest.fixture(scope="module")
def plain_manifest(tmp_path_factory) -> dict:
    """study.json of a planned study (baseline, seed 0, collapse), nothing trained."""
    from cemtool.sweep import open_study

    out = tmp_path_factory.mktemp("plain") / "study"
    open_study(out, make_plan("baseline", "0", tokens=TOKENS, overrides=TINY, analyses="collapse")).save()
    return manifest(out)


def hand_edited(tmp_path: Path, m: dict, edit) -> Path:
    out = tmp_path / "study"
    out.mkdir()
    (out / "study.json").write_text(json.dumps(edit(json.loads(json.dumps(m)))))
    return out


@pytest.mark.parametrize("edit, message", CORRUPT_MANIFESTS)
def test_a_corrupt_manifest_is_one_line_naming_the_field(edit, message, tmp_path, plain_manifest):
    """Issue 20 item 12: the whole manifest is validated on open (every reader goes through read_manifest)."""
    from cemtool.sweep import read_manifest

    out = hand_edited(tmp_path, plain_manifest, edit)
    with pytest.raises(CemtoolError) as e:
        read_manifest(out / "study.json")
    assert message in e.value.message and "\n" not in e.value.message


SWEEP_CASES = [CORRUPT_MANIFESTS[i] for i in (1, 5, 8, 24, 25, 35)]  # [], bogus statuses, nosuch, ../evil, NaN


@pytest.mark.parametrize("edit, message", SWEEP_CASES)
def test_sweep_resume_of_a_hand_edited_study_is_refused_and_writes_nothing(edit, message, tmp_path,
                                                                           plain_manifest):
    """One line naming the field; nothing is written (no run folder is made, inside the study or outside it)."""
    out = hand_edited(tmp_path, plain_manifest, edit)
    before = snapshot(tmp_path)
    res = runner.invoke(app(), ["sweep", "--resume", str(out), "-q"])
    assert res.exit_code == 1 and res.output.startswith("Error:") and message in res.output.splitlines()[0], \
        res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 2
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["study"]
    assert sorted(p.name for p in out.iterdir()) in (["study.json"], [".lock", "study.json"])


@pytest.mark.parametrize("edit, message", [CORRUPT_MANIFESTS[i] for i in (1, 8, 25)])
def test_compare_on_a_corrupt_study_is_one_line(edit, message, tmp_path, plain_manifest):
    out = hand_edited(tmp_path, plain_manifest, edit)
    res = runner.invoke(app(), ["compare", str(out), "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 1 and res.output.startswith("Error:") and message in res.output.splitlines()[0], \
        res.output
    assert "internal error" not in res.output and not (tmp_path / "cmp").exists()


def fake_tuning(out: Path, losses: dict, grid: str = "train.lr=1e-3,3e-3,1e-2") -> Path:
    """A finished tuning study written by hand: losses[(arch, lr, seed)] = final val loss, None for a failed run."""
    from cemtool.sweep import open_study

    plan = make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE, grid=[grid])
    study = open_study(out, plan)
    for it in study.manifest["items"]:
        loss = losses[(it["arch"], it["point"]["train.lr"], it["seed"])]
        it.update(status="failed" if loss is None else "completed", val_loss=loss,
                  error="non-finite loss" if loss is None else None)
    study.manifest["status"] = "incomplete"
    study.save()
    return out


LOSSES = {("baseline", "1e-3", 10): 3.0, ("baseline", "1e-3", 11): 2.0,    # mean 2.5
          ("baseline", "3e-3", 10): 2.4, ("baseline", "3e-3", 11): 2.4,    # mean 2.4: chosen
          ("baseline", "1e-2", 10): 1.0, ("baseline", "1e-2", 11): None,   # best single run, but one diverged
          ("tmm", "1e-3", 10): 2.2, ("tmm", "1e-3", 11): 2.4,              # mean 2.3, tied with 1e-2: first wins
          ("tmm", "3e-3", 10): 2.5, ("tmm", "3e-3", 11): 2.5,
          ("tmm", "1e-2", 10): 2.4, ("tmm", "1e-2", 11): 2.2}


def test_selection_takes_the_lowest_mean_over_tuning_seeds(tmp_path):
    from cemtool.sweep import select

    out = fake_tuning(tmp_path / "tune", LOSSES)
    sel = select(out)
    assert sel == json.loads((out / "selection.json").read_text())
    assert sel["tuning_seeds"] == [10, 11] and sel["grid"] == ["train.lr=1e-3,3e-3,1e-2"]
    base, tmm = sel["archs"]["baseline"], sel["archs"]["tmm"]
    assert base["chosen"] == {"train.lr": "3e-3"} and base["overrides"] == ["train.lr=3e-3"]
    assert base["mean_val_loss"] == pytest.approx(2.4)
    means = [p["mean_val_loss"] for p in base["points"]]
    assert means[0] == pytest.approx(2.5) and means[2] is None and base["points"][2]["failed"] == 1
    assert tmm["chosen"] == {"train.lr": "1e-3"}                        # 2.3 == 2.3: the earlier grid point
    assert [p["seeds"] for p in tmm["points"]] == [[10, 11]] * 3
    # choosing for one architecture keeps the other's choice in selection.json (a later comparison of some
    # architectures must not erase what the others were compared at)
    assert select(out, archs=["tmm"])["archs"]["baseline"] == base
    assert json.loads((out / "selection.json").read_text())["archs"]["baseline"] == base


def test_choice_at_the_grid_edge_is_flagged(tmp_path):
    from cemtool.sweep import plan_from_tuning

    out = fake_tuning(tmp_path / "tune", LOSSES)
    plan, sel, notes = plan_from_tuning(out, "0")
    assert sel["archs"]["baseline"]["at_edge"] == []                     # 3e-3: inside the grid
    assert sel["archs"]["tmm"]["at_edge"] == ["train.lr"]                # 1e-3: the grid's smallest value
    assert len(notes) == 1 and notes[0].startswith("tmm: the chosen train.lr (1e-3) is at the edge of the grid")
    # no shortfall estimate at the edge (the best value may lie beyond), nor beside a failed neighbour (1e-2)
    assert sel["archs"]["tmm"]["shortfall"] == {} and sel["archs"]["baseline"]["shortfall"] == {}


def test_grid_shortfall_is_the_log_parabola_through_the_choice_and_its_neighbours(tmp_path):
    """The selection's estimate of what the grid's spacing leaves on the table: on means exactly quadratic in
    log(lr), the parabola through the chosen point and its neighbours is that quadratic (its vertex and minimum
    recovered, on an unevenly spaced grid listed out of order); on other means it is numpy's fit through the same
    three points."""
    from cemtool.sweep import select

    grid = "train.lr=1e-2,1e-3,3e-3,4e-3,3e-2"  # out of order, uneven in log(lr)

    def quad(lr):  # minimum 2.0 at lr = 5e-3 (not a grid value)
        return 2.0 + 0.05 * (math.log(lr) - math.log(5e-3)) ** 2

    wobble = {"baseline": [3.1, 2.95, 2.9, 2.92, 3.3], "tmm": [3.0, 2.9, 2.8, 2.7, 2.6]}  # tmm: falls to the edge
    lrs = ["1e-3", "3e-3", "4e-3", "1e-2", "3e-2"]
    losses = {}
    for k, lr in enumerate(lrs):
        for seed, d in ((10, -0.125), (11, 0.125)):  # the seeds' mean is the value
            losses[("baseline", lr, seed)] = quad(float(lr)) + d
            losses[("tmm", lr, seed)] = wobble["tmm"][k] + d
    sel = select(fake_tuning(tmp_path / "a", losses, grid))
    f = sel["archs"]["baseline"]["shortfall"]["train.lr"]
    assert sel["archs"]["baseline"]["chosen"] == {"train.lr": "4e-3"}
    assert f["values"] == ["3e-3", "4e-3", "1e-2"] and f["means"] == pytest.approx([quad(3e-3), quad(4e-3),
                                                                                     quad(1e-2)], abs=1e-12)
    assert f["vertex"] == pytest.approx(5e-3, rel=1e-9)
    assert f["gain"] == pytest.approx(quad(4e-3) - 2.0, rel=1e-9)
    assert sel["archs"]["tmm"]["shortfall"] == {} and sel["archs"]["tmm"]["at_edge"] == ["train.lr"]
    res = runner.invoke(app(), ["sweep", "--tuned", str(tmp_path / "a"), "--seeds", "0", "--out",
                                str(tmp_path / "cmp"), "--dry-run"])
    assert res.exit_code == 0, res.output
    assert f"the parabola through its neighbours: train.lr=0.005, {quad(4e-3) - 2:.4f} lower" in \
        " ".join(res.stdout.split())
    for k, lr in enumerate(lrs):  # other means: numpy's parabola through the same three points
        losses[("baseline", lr, 10)], losses[("baseline", lr, 11)] = wobble["baseline"][k] - 0.1, \
            wobble["baseline"][k] + 0.1
    f = select(fake_tuning(tmp_path / "b", losses, grid))["archs"]["baseline"]["shortfall"]["train.lr"]
    x, y = np.log([3e-3, 4e-3, 1e-2]), wobble["baseline"][1:4]
    a, b, c = np.polyfit(x, y, 2)
    assert f["vertex"] == pytest.approx(math.exp(-b / (2 * a)), rel=1e-9)
    assert f["gain"] == pytest.approx(2.9 - (c - b * b / (4 * a)), rel=1e-9) and f["gain"] > 0


def test_extending_a_grid_keeps_every_finished_run(tmp_path):
    from cemtool.sweep import open_study

    out = fake_tuning(tmp_path / "tune", LOSSES)
    before = manifest(out)["items"]
    wider = make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE,
                      grid=["train.lr=0.001,3e-3,1e-2,3e-2"])                # 0.001 is the stored 1e-3
    study = open_study(out, wider)
    items = study.manifest["items"]
    assert items[:len(before)] == before                                  # kept as they were, finished or failed
    assert [(i["name"], i["status"]) for i in items[len(before):]] == [
        (f"{a}-lr=3e-2-s{s}", "pending") for s in (10, 11) for a in ("baseline", "tmm")]
    assert study.plan.grid == ("train.lr=1e-3,3e-3,1e-2,3e-2",)          # the stored spelling stays
    ext = study.manifest["extensions"][0]
    assert ext["added"] == {"train.lr": ["3e-2"]} and ext["runs_added"] == 4
    assert study.notes == ["extending the study (train.lr + 3e-2): 4 new run(s); the 12 planned before are "
                           "kept (finished ones are not redone)"]
    study.save()
    reordered = make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE,
                          grid=["train.lr=3e-2,1e-2,3e-3,1e-3"])          # the same values, in another order
    assert open_study(out, reordered).plan == study.plan
    for grid in (["train.lr=3e-3,1e-2,3e-2"],                               # drops a value
                 ["train.lr=1e-3,3e-3,1e-2", "model.mlp=gelu,swiglu"]):     # adds a key
        with pytest.raises(CemtoolError, match="planned with other settings"):
            open_study(out, make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE, grid=grid))
    with pytest.raises(CemtoolError, match="planned with other settings"):  # another change beside the grid
        open_study(out, make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE, data="grammar-b",
                                  grid=["train.lr=1e-3,3e-3,1e-2,3e-2"]))


def test_a_sweep_reads_its_study_again_once_it_holds_the_lock(tmp_path, monkeypatch):
    """What another process wrote to study.json between this sweep's first read and its lock (its last item's
    result, as it finished) is kept: the extension is made on the study as read under the lock, not on the stale
    copy (which would erase that result)."""
    from cemtool import runs as R

    out = fake_tuning(tmp_path / "tune", LOSSES)
    real_lock = R.Run.lock

    def lock(self, shared=False):  # the other process's last save lands just before the lock is taken
        m = json.loads((out / "study.json").read_text())
        m["items"][0]["val_loss"] = 1.234
        (out / "study.json").write_text(json.dumps(m))
        return real_lock(self, shared)

    monkeypatch.setattr(R.Run, "lock", lock)

    def stop(ev):
        if ev["kind"] == "item":
            raise KeyboardInterrupt

    wider = make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE, grid=["train.lr=1e-3,3e-3,1e-2,3e-2"])
    with pytest.raises(KeyboardInterrupt):
        run_sweep(out, wider, device="cpu", callback=stop)
    items = manifest(out)["items"]
    assert len(items) == 16 and items[0]["val_loss"] == 1.234


def test_a_refused_reread_under_the_lock_writes_nothing(tmp_path, monkeypatch):
    """When the study read again under the lock refuses this sweep's plan (another process extended it another
    way meanwhile), study.json stays as that process left it: nothing of the stale copy is written."""
    from cemtool import runs as R

    out = fake_tuning(tmp_path / "tune", LOSSES)
    real_lock = R.Run.lock
    theirs = {}

    def lock(self, shared=False):  # meanwhile, the other process extended the grid by another value and saved
        from cemtool.sweep import open_study
        other = open_study(out, make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE,
                                          grid=["train.lr=1e-3,3e-3,1e-2,3e-2"]))
        other.manifest["items"][0]["val_loss"] = 1.5
        other.save()
        theirs["text"] = (out / "study.json").read_text()
        return real_lock(self, shared)

    m = manifest(out)
    m["status"] = "running"  # our first read: while the other process runs
    (out / "study.json").write_text(json.dumps(m))
    monkeypatch.setattr(R.Run, "lock", lock)
    mine = make_plan("baseline,tmm", "10,11", tokens=TOKENS, overrides=TUNE, grid=["train.lr=1e-3,3e-3,1e-2,1e-1"])
    with pytest.raises(CemtoolError, match="planned with other settings"):
        run_sweep(out, mine, device="cpu")
    assert (out / "study.json").read_text() == theirs["text"]
    R.Run(out).lock()  # and the lock was let go


def test_extending_a_study_by_seeds_keeps_every_finished_run(tmp_path):
    """More seeds are an extension too (a third tuning seed, more comparison seeds where the MDE asks for them):
    the new seeds' runs are appended, the stored seeds keep their order, and a choice made on two tuning seeds is
    made again on three once they have run. Dropping a seed is refused."""
    from cemtool.sweep import open_study, plan_from_tuning, select

    out = fake_tuning(tmp_path / "tune", LOSSES)
    before = manifest(out)["items"]
    more = make_plan("baseline,tmm", "12,11,10", tokens=TOKENS, overrides=TUNE, grid=["train.lr=1e-3,3e-3,1e-2,3e-2"])
    study = open_study(out, more)
    items = study.manifest["items"]
    assert items[:len(before)] == before and study.plan.seeds == (10, 11, 12)
    assert study.plan.grid == ("train.lr=1e-3,3e-3,1e-2,3e-2",)
    assert sorted(i["name"] for i in items[len(before):]) == sorted(
        [f"{a}-lr=3e-2-s{s}" for s in (10, 11) for a in ("baseline", "tmm")]
        + [f"{a}-lr={lr}-s12" for lr in ("1e-3", "3e-3", "1e-2", "3e-2") for a in ("baseline", "tmm")])
    ext = study.manifest["extensions"][0]
    assert ext["seeds_before"] == [10, 11] and ext["seeds_added"] == [12] and ext["runs_added"] == 12
    assert study.notes == ["extending the study (train.lr + 3e-2; seeds + 12): 12 new run(s); the 12 planned before "
                           "are kept (finished ones are not redone)"]
    study.save()
    with pytest.raises(CemtoolError, match="is not finished"):  # the choice waits for the new runs
        select(out)
    for it in study.manifest["items"][len(before):]:
        it.update(status="completed", val_loss=2.0 if it["arch"] == "baseline" and it["point"]["train.lr"] == "1e-3"
                  else 9.0)
    study.save()
    assert select(out)["archs"]["baseline"]["points"][0]["seeds"] == [10, 11, 12]
    assert select(out)["archs"]["baseline"]["mean_val_loss"] == pytest.approx(7 / 3)  # 1e-3 now: (3 + 2 + 2) / 3
    with pytest.raises(CemtoolError, match=r"\(seeds differ\)"):
        open_study(out, make_plan("baseline,tmm", "10,12", tokens=TOKENS, overrides=TUNE,
                                  grid=["train.lr=1e-3,3e-3,1e-2,3e-2"]))
    # a comparison study gains seeds the same way; its stored runs are kept
    cmp = tmp_path / "cmp"
    first = open_study(cmp, plan_from_tuning(out, "0,1")[0])
    first.save()
    wider = open_study(cmp, plan_from_tuning(out, "0,1,2")[0])
    assert wider.manifest["items"][:4] == first.manifest["items"]
    assert [i["name"] for i in wider.manifest["items"][4:]] == ["baseline-s2", "tmm-s2"]


def test_selection_refuses_overlapping_seeds_unfinished_and_plain_studies(tmp_path):
    from cemtool.sweep import open_study, select

    out = fake_tuning(tmp_path / "tune", LOSSES)
    with pytest.raises(CemtoolError, match="seed 11 tuned the values"):
        select(out, final_seeds=[0, 11])
    with pytest.raises(CemtoolError, match="did not tune 'lime'"):
        select(out, archs=["lime"])
    study = open_study(out)
    study.manifest["items"][3]["status"] = "interrupted"
    study.save()
    with pytest.raises(CemtoolError, match="is not finished"):
        select(out)
    open_study(tmp_path / "plain", make_plan("baseline", "0", tokens=TOKENS, overrides=TINY)).save()
    with pytest.raises(CemtoolError, match="planned without --grid"):
        select(tmp_path / "plain")


def test_tuned_dry_run_plans_each_arch_at_its_choice(tmp_path):
    out = fake_tuning(tmp_path / "tune", LOSSES)
    res = runner.invoke(app(), ["sweep", "--tuned", str(out), "--seeds", "0,1", "--out", str(tmp_path / "cmp"),
                                "--dry-run"])
    assert res.exit_code == 0, res.output
    assert "chosen" in res.stdout and "baseline-s1" in res.stdout and "train.lr=3e-3" in res.stdout
    assert (out / "selection.json").exists() and not (tmp_path / "cmp").exists()
    res = runner.invoke(app(), ["sweep", "--tuned", str(out), "--seeds", "0,10", "--out", str(tmp_path / "cmp")])
    assert res.exit_code == 1 and "seed 10 tuned the values" in res.output
    (out / "selection.json").unlink()
    res = runner.invoke(app(), ["sweep", "--tuned", str(out), "--seeds", "0,1", "--analyses", "nope", "--out",
                                str(tmp_path / "cmp"), "--dry-run"])
    assert res.exit_code == 1 and "unknown analysis 'nope'" in res.output
    assert not (out / "selection.json").exists()  # a refused plan writes nothing


def test_the_tuning_study_named_another_way_is_the_same_plan(tmp_path, monkeypatch):
    """A comparison study stores --tuned as it was typed; the same tuning study named by another path (absolute,
    or from another folder) continues it, another tuning study does not."""
    import shutil

    from cemtool.sweep import open_study, plan_from_tuning

    monkeypatch.chdir(tmp_path)
    fake_tuning(tmp_path / "tune", LOSSES)
    cmp = tmp_path / "cmp"
    open_study(cmp, plan_from_tuning("tune", "0,1")[0]).save()
    assert open_study(cmp, plan_from_tuning(str(tmp_path / "tune"), "0,1")[0]).plan.tuned_from == "tune"
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    assert open_study(cmp, plan_from_tuning("../tune", "0,1")[0]).plan.tuned_from == "tune"
    shutil.copytree(tmp_path / "tune", tmp_path / "tune2")
    with pytest.raises(CemtoolError, match=r"\(tuned_from differ\)"):
        open_study(cmp, plan_from_tuning(str(tmp_path / "tune2"), "0,1")[0])


def test_grid_sweep_resumes_then_the_comparison_trains_at_the_choice(tmp_path):
    """A real tuning sweep (2 learning rates) stopped by Ctrl-C in its second run and resumed, then the comparison
    on another seed: one run per architecture, at the chosen learning rate."""
    from cemtool.sweep import plan_from_tuning

    tune = tmp_path / "tune"
    plan = make_plan("baseline", "7", tokens=TOKENS // 2, overrides=TUNE, grid=["train.lr=1e-4,3e-3"])

    def stop(ev):
        if ev["item"] == "baseline-lr=3e-3-s7" and ev["kind"] == "step" and ev["step"] == 12:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(tune, plan, device="cpu", callback=stop)
    first = snapshot(tune / "baseline-lr=1e-4-s7")
    events: list[dict] = []
    done = run_sweep(tune, plan, device="cpu", callback=events.append)
    assert done["status"] == "completed" and snapshot(tune / "baseline-lr=1e-4-s7") == first
    assert [(e["item"], e["step"]) for e in events if e["kind"] == "start"] == [("baseline-lr=3e-3-s7", 10)]
    losses = {i["point"]["train.lr"]: i["val_loss"] for i in done["items"]}
    best = min(losses, key=losses.get)
    cmp_plan, sel, notes = plan_from_tuning(tune, "8")
    assert sel["archs"]["baseline"]["chosen"] == {"train.lr": best} and notes == []
    assert cmp_plan.arch_overrides == {"baseline": [f"train.lr={best}"]} and cmp_plan.tokens == TOKENS // 2
    cmp = run_sweep(tmp_path / "cmp", cmp_plan, device="cpu")
    assert [i["name"] for i in cmp["items"]] == ["baseline-s8"] and cmp["items"][0]["status"] == "completed"
    cfg = json.loads((tmp_path / "cmp" / "baseline-s8" / "config.json").read_text())
    assert cfg["train"]["lr"] == float(best) and cfg["seed"] == 8
    # the same tuning command with one more value: only the new point trains, the finished runs stay untouched
    kept = snapshot(*(tune / i["run"] for i in done["items"]))
    res = runner.invoke(app(), ["sweep", "--archs", "baseline", "--seeds", "7", "--tokens", str(TOKENS // 2),
                                "--grid", "train.lr=1e-4,3e-3,1e-3", *[a for s in TUNE for a in ("--set", s)],
                                "--out", str(tune), "-q"])
    assert res.exit_code == 0, res.output
    assert "Note: extending the study (train.lr + 1e-3): 1 new run(s)" in res.output
    assert snapshot(*(tune / i["run"] for i in done["items"])) == kept
    assert [i["status"] for i in manifest(tune)["items"]] == ["completed"] * 3


def test_a_retuned_comparison_can_gain_seeds_in_the_same_command(tmp_path):
    """A comparison whose tuning choice moved, rerun with more seeds (or its seeds in another order): it is
    re-planned (the moved architecture's items afresh, the other's kept) and the new seeds' items are appended
    after, both recorded; the stored seeds keep their order."""
    from cemtool.sweep import open_study

    out = tmp_path / "cmp"
    before = make_plan("baseline,tmm", "8,7", tokens=TOKENS // 2, overrides=TUNE,
                       arch_overrides={"baseline": ["train.lr=1e-4"], "tmm": ["train.lr=3e-3"]}, tuned_from="tune")
    study = open_study(out, before)
    for it in study.manifest["items"]:
        it.update(status="completed", val_loss=2.0)
    study.manifest["status"] = "completed"
    study.save()

    def stop(ev):
        if ev["kind"] == "item":
            raise KeyboardInterrupt

    after = make_plan("baseline,tmm", "7,9,8", tokens=TOKENS // 2, overrides=TUNE,
                      arch_overrides={"baseline": ["train.lr=3e-3"], "tmm": ["train.lr=3e-3"]}, tuned_from="tune")
    notes: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(out, after, device="cpu",
                  callback=lambda ev: (ev["kind"] == "note" and notes.append(ev["text"])) or stop(ev))
    m = manifest(out)
    assert m["plan"]["seeds"] == [8, 7, 9] and m["plan"]["arch_overrides"]["baseline"] == ["train.lr=3e-3"]
    assert [(i["name"], i["status"]) for i in m["items"]] == [
        ("baseline-s8", "pending"), ("tmm-s8", "completed"), ("baseline-s7", "pending"), ("tmm-s7", "completed"),
        ("baseline-s9", "pending"), ("tmm-s9", "pending")]
    assert m["retuned"][0]["archs"] == {"baseline": {"from": ["train.lr=1e-4"], "to": ["train.lr=3e-3"]}}
    assert m["extensions"][0]["seeds_added"] == [9] and m["extensions"][0]["seeds_before"] == [8, 7]
    assert len(notes) == 2 and "seeds + 9" in notes[1]


def test_a_changed_tuning_choice_retrains_only_those_architectures(tmp_path):
    """A comparison re-planned after its tuning study chose another value for one architecture (a grid extended
    past the old choice): that architecture's runs move, whole, to superseded-*/ and train again at the new value;
    the other architecture's runs are not touched. Any other change of plan is still refused."""
    out = tmp_path / "cmp"
    before = make_plan("baseline,tmm", "8", tokens=TOKENS // 2, overrides=TUNE,
                       arch_overrides={"baseline": ["train.lr=1e-4"], "tmm": ["train.lr=3e-3"]}, tuned_from="tune")
    run_sweep(out, before, device="cpu")
    kept = snapshot(out / "tmm-s8")
    old_loss = manifest(out)["items"][0]["val_loss"]
    after = make_plan("baseline,tmm", "8", tokens=TOKENS // 2, overrides=TUNE,
                      arch_overrides={"baseline": ["train.lr=3e-3"], "tmm": ["train.lr=3e-3"]}, tuned_from="tune")
    notes: list[str] = []
    done = run_sweep(out, after, device="cpu", callback=lambda ev: ev["kind"] == "note" and notes.append(ev["text"]))
    assert done["status"] == "completed" and [i["status"] for i in done["items"]] == ["completed", "completed"]
    assert snapshot(out / "tmm-s8") == kept                          # not a byte or mtime changed
    cfg = json.loads((out / "baseline-s8" / "config.json").read_text())
    assert cfg["train"]["lr"] == 3e-3 and done["items"][0]["val_loss"] != old_loss
    aside = [p for p in out.iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and json.loads((aside[0] / "baseline-s8" / "config.json").read_text())["train"]["lr"] == 1e-4
    rec = done["retuned"][0]
    assert rec["archs"] == {"baseline": {"from": ["train.lr=1e-4"], "to": ["train.lr=3e-3"]}}
    assert rec["runs_moved"] == ["baseline-s8"] and rec["superseded"] == aside[0].name
    assert len(notes) == 1 and "baseline train.lr=1e-4 -> train.lr=3e-3" in notes[0]
    other = make_plan("baseline,tmm", "8", tokens=TOKENS, overrides=TUNE,
                      arch_overrides={"baseline": ["train.lr=1e-3"], "tmm": ["train.lr=3e-3"]}, tuned_from="tune")
    with pytest.raises(CemtoolError, match="planned with other settings"):
        run_sweep(out, other, device="cpu")
