"""Issue 20's state items: run locks shared by analyses (item 9), a torchrun rank that dies (10), forged step
checkpoints (11), SIGINT/SIGTERM during training (18)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import procs
import pytest
import torch
from typer.testing import CliRunner

from cemtool.cli.main import app
from cemtool.config import resolve
from cemtool.errors import CemtoolError
from cemtool.runs import Run, create_run, lock_for_reading, open_run
from cemtool.subject import open_subject

from kit import TINY, one_line_error, set_args, tiny_setup

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
SMALL = ["--set", "model.n_layer=1", "--set", "model.d_model=16", "--set", "model.n_head=2", "--set",
         "data.seq_len=8", "--set", "train.max_steps=4", "--set", "train.eval_every=2", "--set",
         "train.eval_tokens=64", "--set", "data.tokenizer=byte", "--set", "train.batch_size=4", "--seed", "7"]


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def copy_run(tiny_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".lock"))
    return run


# --------------------------------------------------------------------------------------------------------------
# item 9: analyses take the run's lock shared, training and --force exclusively


MEASURING = """
import sys
import cemtool.analysis.sharpness as sharpness
real = sharpness.measure_sharpness
def measure(*args, **kwargs):  # a real `cemtool sharpness` that waits, mid-measurement, for the test to go on
    print("measuring", flush=True)
    sys.stdin.read()
    return real(*args, **kwargs)
sharpness.measure_sharpness = measure
from cemtool.cli.main import main
sys.argv = ["cemtool", "sharpness", sys.argv[1], "--quick", "--quiet", "--no-plots", "--tokens", "256"]
main()
"""


def test_force_is_refused_while_another_process_measures_the_run(tmp_path, tiny_run, text_file):
    run = copy_run(tiny_run, tmp_path)
    analysis = subprocess.Popen([sys.executable, "-c", MEASURING, str(run)], env=ENV, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert analysis.stdout.readline().strip() == "measuring", analysis.communicate()[1]
        res = invoke("train", "--out", run, "--force", "--quiet", "--data", text_file, *SMALL)
        one_line_error(res, "in use by another process")
        assert json.loads((run / "meta.json").read_text())["seed"] == 0  # still the run being measured
        assert not list(tmp_path.glob("run.replaced-*"))
        with pytest.raises(CemtoolError, match="in use"):  # --resume, a writer, is refused alike
            open_run(run, lock=True)
        lock_for_reading(run).unlock()  # another analysis may read it meanwhile
    finally:
        out, err = analysis.communicate("", timeout=120)
    assert analysis.returncode == 0, err
    assert (run / "reports" / "sharpness.json").exists()  # written into the run it measured
    res = invoke("train", "--out", run, "--force", "--quiet", "--data", text_file, *SMALL)
    assert res.exit_code == 0, res.output  # the lock went with the analysis
    assert json.loads((run / "meta.json").read_text())["seed"] == 7
    assert not (run / "reports").exists()  # the new run holds no report of the old weights
    assert (next(tmp_path.glob("run.replaced-*")) / "reports" / "sharpness.json").exists()


def test_an_analysis_is_refused_while_the_run_is_being_trained(tmp_path, tiny_run):
    run = copy_run(tiny_run, tmp_path)
    writer = open_run(run, lock=True)
    try:
        one_line_error(invoke("sharpness", run, "--quick", "--quiet", "--no-plots"), "being written")
        one_line_error(invoke("collapse-report", run, "--quiet", "--no-plots"), "being written")
    finally:
        writer.unlock()
    assert not (run / "reports" / "sharpness.json").exists()


def test_the_analysis_lock_is_released_when_the_command_ends(tmp_path, tiny_run):
    run = copy_run(tiny_run, tmp_path)
    one_line_error(invoke("sharpness", run, "--quick", "--quiet", "--params", "nosuch.*"), "nosuch")  # after the lock
    open_run(run, lock=True).unlock()  # free again, also after an error


def test_a_report_never_lands_in_a_run_that_replaced_the_measured_one(tmp_path, tiny_run):
    run = copy_run(tiny_run, tmp_path)
    loaded = open_subject(run)  # what an analysis measures (seed 0)
    stale = Run(run)
    create_run(run, resolve(seed=7), force=True).unlock()  # moved aside under it (e.g. an old cemtool's --force)
    for write in (lambda: loaded.run.write_report("sharpness", {"x": 1}), lambda: loaded.run.plots,
                  lambda: stale.update_meta(status="failed"), lambda: stale.lock(shared=True)):
        with pytest.raises(CemtoolError, match="no longer the run that was opened"):
            write()
    assert not (run / "reports").exists()
    assert json.loads((run / "meta.json").read_text())["seed"] == 7
    fresh = Run(run)
    fresh.lock(shared=True)  # the new run itself opens and locks as usual
    fresh.unlock()


# --------------------------------------------------------------------------------------------------------------
# item 11: a forged step checkpoint (a tensor of the wrong shape or dtype under a recomputed checksum)


def forge(path: Path, name_part: str, change) -> None:
    """Rewrite checkpoint ``path`` with ``change`` applied to the first tensor whose name contains ``name_part``,
    its own checksum and the manifest's recomputed: a forgery that every hash accepts."""
    from safetensors import safe_open
    from safetensors.torch import save

    from cemtool.checkpoints import _content_sha256, _sha256

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(k for k in sorted(tensors) if name_part in k)
    tensors[key] = change(tensors[key])
    meta["cemtool_sha256"] = _content_sha256(meta["cemtool"], tensors)
    path.write_bytes(save(tensors, metadata=meta))
    manifest = path.parent / "manifest.json"
    entries = json.loads(manifest.read_text())
    entries[path.name]["sha256"] = _sha256(path)
    manifest.write_text(json.dumps(entries))


FORGERIES = {
    "optimizer moment of the wrong shape": ("exp_avg_sq", lambda t: t.reshape(-1)[:-1].clone()),
    "optimizer moment of the wrong dtype": ("state.1.exp_avg", lambda t: t.double()),
    "weight of the wrong shape": ("model.blocks.0.attn.wq", lambda t: t[:-1].clone()),
    "weight of the wrong dtype": ("model.blocks.1", lambda t: t.half()),
    "RNG state of the wrong length": ("rng.torch", lambda t: t[:-8].clone()),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_forged_step_checkpoint_falls_back_to_the_older_one_bit_exact(tmp_path, tiny_run, forgery):
    from cemtool.checkpoints import read_checkpoint

    run = copy_run(tiny_run, tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    (run / "checkpoints" / "final.safetensors").unlink()
    forge(run / "checkpoints" / "step_000020.safetensors", *FORGERIES[forgery])
    read_checkpoint(run / "checkpoints" / "step_000020.safetensors")  # every hash and the header accept it
    res = invoke("train", "--resume", run, "--quiet")
    assert res.exit_code == 0, res.output
    assert "skipped step_000020.safetensors" in res.output and "does not fit" in res.output, res.output
    assert "resuming from step 10 (step_000010.safetensors)" in res.output
    assert (run / "checkpoints" / "step_000020.safetensors.corrupt").exists()
    ref = read_checkpoint(Path(tiny_run) / "checkpoints" / "final.safetensors")
    got = read_checkpoint(run / "checkpoints" / "final.safetensors")
    assert all(torch.equal(got.weights[k], v) for k, v in ref.weights.items())
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["resumed"] == 1


def test_only_forged_step_checkpoints_is_one_line_and_leaves_meta(tmp_path, tiny_run):
    run = copy_run(tiny_run, tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    before = (run / "meta.json").read_bytes()
    for ck in (run / "checkpoints").glob("step_*.safetensors"):
        forge(ck, *FORGERIES["optimizer moment of the wrong shape"])
    one_line_error(invoke("train", "--resume", run, "--quiet"), "does not fit")
    assert (run / "meta.json").read_bytes() == before  # still interrupted, resumed not counted


# --------------------------------------------------------------------------------------------------------------
# item 18: SIGINT and SIGTERM checkpoint at the step they interrupt


LONG = set_args(*TINY, "data.tokenizer=byte", "train.max_steps=120", "train.eval_every=60", "train.ckpt_every=25",
                "train.log_every=5")


def _logged_step(run: Path) -> int:
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return 0
    return max((r["step"] for r in rows if "train_loss" in r), default=0)


def test_sigterm_and_sigint_checkpoint_the_step_they_stop_at_and_resume_bit_exact(tmp_path, text_file):
    from safetensors.torch import load_file

    ref = tmp_path / "ref"
    assert invoke("train", "--data", text_file, "--out", ref, "--quiet", *LONG).exit_code == 0
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        run = tmp_path / sig.name
        proc = procs.start([sys.executable, "-m", "cemtool", "train", "--data", text_file, "--out", str(run),
                            "--quiet", *LONG], env=ENV, ignore_sigint=False)  # a process of its own, forked
        # (tests/procs.py), which takes SIGINT as from a terminal even when this test run is a background job
        deadline = time.time() + 120
        while _logged_step(run) < 30 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == code, (sig, proc.returncode, err)
        meta = json.loads((run / "meta.json").read_text())
        step = meta["step"]
        assert meta["status"] == "interrupted" and 30 <= step < 120 and meta["resume_step"] == step, meta
        assert (run / "checkpoints" / f"step_{step:06d}.safetensors").exists()  # not only the step-25 one
        assert f"interrupted by {sig.name} at step {step}: checkpoint step_{step:06d} written; cemtool train " \
               f"--resume {run} continues from step {step}" in err, err
        assert "Traceback" not in err
        res = invoke("train", "--resume", run, "--quiet")
        assert res.exit_code == 0, res.output
        assert f"resuming from step {step} (step_{step:06d}.safetensors)" in res.output
        a = load_file(str(ref / "checkpoints" / "final.safetensors"))
        b = load_file(str(run / "checkpoints" / "final.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sig
        assert json.loads((run / "meta.json").read_text())["status"] == "completed"


# --------------------------------------------------------------------------------------------------------------
# item 10: a torchrun rank killed mid-training


def test_a_rank_killed_mid_training_is_one_line_and_marks_the_run_failed(tmp_path, text_file):
    run = tmp_path / "run"
    ranks = procs.ranks([sys.executable, "-m", "cemtool", "train", "--data", text_file, "--out", str(run), "--quiet",
                         "--device", "cpu", *LONG], 2, {**ENV, "CEMTOOL_DIST_TIMEOUT": "30"})
    # (torchrun's environment without its launcher, which would SIGTERM the other rank; forked: tests/procs.py)
    deadline = time.time() + 120
    while _logged_step(run) < 30 and ranks[0].poll() is None and time.time() < deadline:
        time.sleep(0.005)
    ranks[1].kill()
    ranks[1].wait()
    out, err = ranks[0].communicate(timeout=120)
    assert ranks[0].returncode == 1, (ranks[0].returncode, err[-2000:])
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) <= 2 and lines[0].startswith("Error: rank 0: training step "), err[-2000:]
    assert "another process of the training died or timed out" in lines[0] and "internal error" not in err
    kept = int(err.split("cemtool train --resume continues it from step ")[1].split()[0])
    assert kept >= 25 and kept % 25 == 0 and (run / "checkpoints" / f"step_{kept:06d}.safetensors").exists()
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "failed" and meta["error"] == "another rank died or timed out", meta


def test_bad_inputs_state_cases_are_clean(tmp_path, tiny_run):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bad_inputs
    finally:
        sys.path.pop(0)
    results = bad_inputs.run_cases(tmp_path, Path(tiny_run), fast_only=True, items=("20.9", "20.11", "20.18"))
    assert len(results) >= 20
    unclean = [(r["case"], r["why"]) for r in results if not r["clean"]]
    assert not unclean, unclean


def test_stop_signals_record_the_first_stop_at_the_second_and_keep_an_ignored_one():
    from cemtool.train import StopSignals

    before = signal.getsignal(signal.SIGTERM)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's Ctrl-C
    stop = StopSignals()
    try:
        stop.install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGTERM"  # recorded: the loop stops after the current step
        with pytest.raises(KeyboardInterrupt):  # a second one stops at once
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()
        signal.signal(signal.SIGINT, ignored)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_during_the_last_step_is_not_swallowed(tmp_path, text_file):
    """A SIGTERM that lands in the last step (or the final save) cannot stop training early: the run completes, and
    then the process's own handler gets the signal (a sweep worker then stops instead of taking the next item; the
    CI failure of the merged issue-20 branches, where such a worker ran the whole study to its end)."""
    from cemtool.train import train

    class Stopped(Exception):
        pass

    def handler(signum, frame):
        raise Stopped

    cfg, corpus = tiny_setup(text_file)
    run = create_run(tmp_path / "r", cfg, extra_meta={"corpus": corpus.info})
    corpus.tokenizer.save(run.path / "tokenizer.json")
    total = cfg.train.max_steps

    def callback(event):
        if event["kind"] == "step" and event["step"] == total:
            os.kill(os.getpid(), signal.SIGTERM)

    old = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Stopped):
            train(cfg, corpus, run, device="cpu", callback=callback)
    finally:
        signal.signal(signal.SIGTERM, old)
        run.unlock()
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["step"] == total
    assert (run.path / "checkpoints" / "final.safetensors").is_file()
