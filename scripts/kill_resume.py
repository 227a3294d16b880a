"""SIGKILL tiny training runs at random moments, resume them, and compare with an uninterrupted run, bit for bit.

Trains a tiny reference run on the CPU (``python -m cemtool train``, a subprocess), then ``--kills`` times: starts
the same training, SIGKILLs it (its whole process group) at a moment drawn uniformly over the reference run's wall
time (seeded), and finishes it: ``cemtool train --resume`` if the kill left a run, else the same ``train`` command
again (a kill before the run exists leaves nothing at ``--out``). The finished run must equal the reference: every
tensor of ``checkpoints/final.safetensors`` (weights and AdamW state, ``torch.equal``), the step, and the final
``val_loss`` of ``meta.json`` and of the last evaluation in ``metrics.jsonl``.

``--sweep`` does the same for ``cemtool sweep --jobs 2`` (2 architectures x 1 seed, each run in its own worker
process): killed, then continued with ``sweep --resume`` (or the same command again, if there is no study.json
yet), and compared with an uninterrupted sweep item by item (study.json's numbers and each run's final tensors).

    python scripts/kill_resume.py                     # 10 kills of `train`
    python scripts/kill_resume.py --kills 10 --sweep  # 10 kills of `sweep --jobs 2`

Prints one line per trial and ``kills N / resumed bit-exact M``; exits 0 only if every trial matches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
        "train.eval_every=10", "train.eval_tokens=256", "train.log_every=5", "train.warmup_steps=5",
        "train.lr=3e-3", "data.tokenizer=byte", "data.val_fraction=0.1"]
STEPS = 120  # long enough that many kills land inside the training loop, not only in Python's start-up
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Is it? Are they? Was it? Were they?\n") * 120
SWEEP_ARCHS = "baseline,tmm"


def env() -> dict[str, str]:
    """One torch thread everywhere: the thread count must not depend on the machine's load."""
    e = dict(os.environ, OMP_NUM_THREADS="1", CEMTOOL_THREADS="1")
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    return e


def sets(overrides: list[str]) -> list[str]:
    return [a for s in overrides for a in ("--set", s)]


def train_cmd(data: Path, out: Path, steps: int) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--quiet", "--device", "cpu",
            *sets(TINY + [f"train.max_steps={steps}"])]


def sweep_cmd(data: Path, out: Path, steps: int) -> list[str]:
    return ["sweep", "--archs", SWEEP_ARCHS, "--seeds", "0", "--tokens", str(steps * 8 * 16), "--data", str(data),
            "--out", str(out), "--jobs", "2", "--device", "cpu", "--quiet", *sets(TINY)]


def cemtool(args: list[str], kill_after: float | None = None) -> tuple[int | None, float, str]:
    """Run ``python -m cemtool ARGS`` in its own process group; SIGKILL the group after ``kill_after`` seconds
    (None: let it finish). Returns (exit code, or None if killed; seconds; output)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "cemtool", *args], env=env(), cwd=ROOT, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=kill_after)
        return p.returncode, time.perf_counter() - t0, out
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, time.perf_counter() - t0, out


def tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def last_val_loss(run: Path) -> float | None:
    val = None
    for line in (run / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if isinstance(rec, dict) and "val_loss" in rec:
            val = rec["val_loss"]
    return val


def run_summary(run: Path) -> dict:
    meta = json.loads((run / "meta.json").read_text())
    return {"status": meta.get("status"), "step": meta.get("step"), "val_loss": meta.get("val_loss"),
            "metrics_val_loss": last_val_loss(run), "tensors": tensors(run / "checkpoints" / "final.safetensors")}


def differences(ref: dict, got: dict, where: str = "") -> list[str]:
    """What differs between two run summaries (empty when bit-exact)."""
    import torch

    diffs = [f"{where}{k}: {got[k]!r} != {ref[k]!r}" for k in ("status", "step", "val_loss", "metrics_val_loss")
             if got[k] != ref[k]]
    a, b = ref["tensors"], got["tensors"]
    if set(a) != set(b):
        diffs.append(f"{where}tensor names differ: {sorted(set(a) ^ set(b))[:3]}")
    diffs += [f"{where}tensor {k} differs" for k in sorted(set(a) & set(b))
              if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    return diffs


def study_summary(study: Path) -> dict:
    s = json.loads((study / "study.json").read_text())
    keep = ("name", "status", "step", "tokens", "val_loss", "params", "flops_per_token", "total_flops")
    return {"status": s["status"], "items": [{k: it.get(k) for k in keep} for it in s["items"]],
            "runs": {it["name"]: run_summary(study / it["run"]) for it in s["items"]}}


def study_differences(ref: dict, got: dict) -> list[str]:
    diffs = [] if got["status"] == ref["status"] else [f"study status {got['status']} != {ref['status']}"]
    if got["items"] != ref["items"]:
        diffs.append(f"study.json items differ: {got['items']} != {ref['items']}")
    for name, r in ref["runs"].items():
        diffs += differences(r, got["runs"][name], f"{name}: ") if name in got["runs"] else [f"{name} missing"]
    return diffs


def finish(args: list[str], out: Path, resume: list[str]) -> tuple[str, int | None, str]:
    """After the kill: resume what it left (``resume``), or run the command again if it left nothing. Nothing to
    do if the kill came after the run was marked completed (while the process was exiting)."""
    marker = out / ("study.json" if args[0] == "sweep" else "meta.json")
    if marker.is_file() and json.loads(marker.read_text()).get("status") == "completed":
        return "already completed", 0, ""
    if (out / ("study.json" if args[0] == "sweep" else "meta.json")).is_file():
        return ("resumed", *cemtool(resume)[::2])
    return ("rerun (nothing at --out)", *cemtool(args)[::2])


def trial(i: int, rng: random.Random, data: Path, tmp: Path, ref: dict, ref_seconds: float, sweep: bool,
          steps: int) -> bool:
    out = tmp / f"trial{i:02d}"
    args = (sweep_cmd if sweep else train_cmd)(data, out, steps)
    at = rng.uniform(0.0, ref_seconds)
    code, _, _ = cemtool(args, kill_after=at)
    if code is not None:  # the kill came after the command had ended
        how, output = "finished before the kill", ""
    else:
        status = _status(out, sweep)
        how, code, output = finish(args, out, ["sweep", "--resume", str(out), "--quiet"] if sweep
                                   else ["train", "--resume", str(out), "--quiet"])
        how = f"killed ({status}), {how}"
    if code != 0:
        diffs = [f"exit {code}: {' | '.join(output.strip().splitlines()[-3:])}"]
    else:
        got = study_summary(out) if sweep else run_summary(out)
        diffs = study_differences(ref, got) if sweep else differences(ref, got)
    ok = not diffs
    print(f"trial {i + 1}: SIGKILL at {at:.2f} s of {ref_seconds:.2f} s, {how}: "
          + ("bit-exact" if ok else "DIFFERENT: " + "; ".join(diffs[:4])), flush=True)
    return ok


def _status(out: Path, sweep: bool) -> str:
    """What the kill left: no run, a run at step N, or a study with K runs completed."""
    try:
        if sweep:
            items = json.loads((out / "study.json").read_text())["items"]
            return f"study, {sum(it['status'] == 'completed' for it in items)}/{len(items)} runs completed"
        meta = json.loads((out / "meta.json").read_text())
        return f"run {meta.get('status')} at step {meta.get('step')}, last checkpoint {meta.get('last_checkpoint')}"
    except (OSError, ValueError, KeyError, TypeError):
        return "nothing at --out"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="kill `cemtool sweep --jobs 2` instead of `train`")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps of each run")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cemtool-kill-resume-") as tmp:
        tmp = Path(tmp)
        data = tmp / "corpus.txt"
        data.write_text(TEXT, encoding="utf-8")
        args = (sweep_cmd if a.sweep else train_cmd)(data, tmp / "reference", a.steps)
        code, ref_seconds, out = cemtool(args)
        if code != 0:
            print(f"the reference run failed (exit {code}):\n{out}")
            return 1
        ref = study_summary(tmp / "reference") if a.sweep else run_summary(tmp / "reference")
        what = f"sweep --jobs 2 ({SWEEP_ARCHS} x seed 0)" if a.sweep else "train"
        print(f"reference {what}: {a.steps} steps in {ref_seconds:.2f} s", flush=True)
        good = sum(trial(i, rng, data, tmp, ref, ref_seconds, a.sweep, a.steps) for i in range(a.kills))
    print(f"kills {a.kills} / resumed bit-exact {good}  ({math.ceil(time.perf_counter() - t0)} s)")
    return 0 if good == a.kills else 1


if __name__ == "__main__":
    sys.exit(main())
