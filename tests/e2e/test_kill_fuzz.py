"""scripts/kill_resume.py and scripts/fuzz_cli.py stay runnable (issue 20, "what must be shown"): one random
SIGKILL of a short training resumes bit-exact, a few fuzzed command lines are clean, and the checks of both scripts
do see a difference or an unclean answer when there is one."""

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
try:
    import fuzz_cli
    import kill_resume
finally:
    sys.path.pop(0)


def test_one_kill_resumes_bit_exact(capsys):
    assert kill_resume.main(["--kills", "1", "--steps", "30", "--seed", "1"]) == 0
    assert "kills 1 / resumed bit-exact 1" in capsys.readouterr().out


def test_kill_resume_sees_a_changed_tensor_and_val_loss(tmp_path, tiny_run):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    ref = kill_resume.run_summary(run)
    assert kill_resume.differences(ref, kill_resume.run_summary(run)) == []
    final = run / "checkpoints" / "final.safetensors"
    tensors = load_file(str(final))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = torch.nextafter(tensors[name].view(-1)[0], torch.tensor(1e9))  # one ulp
    save_file(tensors, str(final))
    got = {**kill_resume.run_summary(run), "val_loss": ref["val_loss"] + 1e-12}
    diffs = kill_resume.differences(ref, got)
    assert f"tensor {name} differs" in diffs and any(d.startswith("val_loss") for d in diffs), diffs


def test_a_few_fuzzed_command_lines_are_clean(tmp_path, tiny_run):
    (tmp_path / "cases").mkdir()
    r = fuzz_cli.fuzz(8, 7, tmp_path / "cases", Path(tiny_run), limit=5.0, show=lambda line: None)
    assert r["fuzzed"] == 8 and not r["unclean"], r["unclean"]
    assert r["clean"] >= 4  # most cases end within the limit


def test_fuzzing_leaves_the_environment_and_threads_as_they_were(tmp_path, tiny_run, monkeypatch):
    monkeypatch.setattr(fuzz_cli, "command_line", lambda rng, app_cmd, ws: ["--threads", "3", "runs", str(ws)])
    env, threads = dict(os.environ), torch.get_num_threads()
    (tmp_path / "cases").mkdir()
    assert not fuzz_cli.fuzz(1, 0, tmp_path / "cases", Path(tiny_run), show=lambda line: None)["unclean"]
    assert dict(os.environ) == env and torch.get_num_threads() == threads


@pytest.mark.parametrize("code,output,why", [
    (0, "done", None),
    (1, "Error: no such run\nHint: check the path", None),
    (2, "Usage: cemtool train [OPTIONS]\nError: No such option: --x", None),
    (1, "Traceback (most recent call last):\n  ...\nValueError: x", "traceback or internal error"),
    (1, "Error: internal error (ValueError: x)", "traceback or internal error"),
    (1, "note: 2 torch thread(s) as asked\nError: unknown architecture 'x'\nHint: known: baseline", None),
    (1, "progress\nError: late", "exit 1 without a one-line 'Error:'"),
    (1, "Error: a\nHint: b\nmore", "exit 1 without a one-line 'Error:'"),
    (2, "Error: bad", "exit 2 without a usage message"),
    (3, "", "exit 3"),
])
def test_fuzz_verdict(code, output, why):
    assert fuzz_cli.verdict(code, output) == why
