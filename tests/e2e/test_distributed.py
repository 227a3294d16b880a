"""Analyses under torch.distributed (gloo on CPU): 2 processes give the 1-process results, bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import procs
import pytest
import torch

from cemtool import distributed
from cemtool.analysis.collapse import collapse_report
from cemtool.analysis.curvature.operators import Hessian
from cemtool.distributed import Dist
from cemtool.errors import CemtoolError

# the measurement both sides run: a 2-layer baseline in fp64 on 8 sequences of 8 tokens, batches of 2 sequences:
# sharpness (every estimator), collapse-report and saturation's rank truncation
WORKER = r'''
import json, os, sys
import torch
from cemtool.analysis.collapse import ProbeClasses, collapse_report
from cemtool.analysis.saturation import rank_truncation
from cemtool.analysis.sharpness import SharpnessOptions, measure_sharpness
from cemtool.config import replace, resolve
from cemtool.analysis.curvature.operators import OPERATORS, make_operator
from cemtool.analysis.lanczos import lanczos
from cemtool.analysis.trace import xtrace
from cemtool.distributed import init_distributed
from cemtool.models import build_model


def model_and_tokens():
    cfg = resolve(arch="baseline", overrides=["model.d_model=16", "model.n_layer=2", "model.n_head=2",
                                              "model.mlp_hidden=16"])
    torch.manual_seed(0)
    model = build_model(replace(cfg.model, vocab_size=16, max_seq_len=8)).double()
    idx = torch.randint(0, 16, (8, 9), generator=torch.Generator().manual_seed(1))
    return model, idx[:, :-1], idx[:, 1:]


def measure(die: bool = False) -> dict:
    model, x, y = model_and_tokens()
    if die:  # this rank dies in the middle of the Lanczos run
        from cemtool.analysis.curvature.operators import Hessian
        real = Hessian.hvp
        def hvp(self, v):
            if self.hvps == 3:
                os._exit(3)
            return real(self, v)
        Hessian.hvp = hvp
    opts = SharpnessOptions(dtype="fp64", batch_size=2, top_k=2, bottom_k=1, lanczos_steps=8, trace_hvps=6,
                            trace_methods=("xtrace", "hutchinson"), density_runs=1, density_steps=8,
                            avg_samples=2, landscape="both", slice_points=5, slice_points_2d=3, device="cpu")
    rep = measure_sharpness(model, x, y, opts)
    classes = ProbeClasses(["a", "b"], [[1, 2, 3, 4], [5, 6, 7, 8]], "words")
    col = collapse_report(model, x, classes=classes, folds=2, per_class=6, batch_size=2)
    sat = rank_truncation(model, x, y, ranks=[0, 2, 4], basis="data", batch_size=2, per_head=True)
    ops = {}
    for name in ("ggn", "ef", "fisher"):  # every other operator: 4 Lanczos steps and a 4-product trace
        with make_operator(name, model, x, y, dtype="fp64", batch_size=2,
                           **{k: v for k, v in dict(mc_samples=2, seed=3).items() if k in OPERATORS[name].takes}) as op:
            eig = lanczos(op, 1, 1, max_steps=4, seed=1)
            ops[f"op_{name}"] = [*eig.top, *eig.bottom, xtrace(op, 4, seed=2).trace]
    return {**ops, "loss": rep.loss, "grad_norm": rep.grad_norm, "top": rep.eigen.top, "bottom": rep.eigen.bottom,
            "traces": [t.trace for t in rep.traces], "sharpness": [s.value for s in rep.sharpness],
            "slice_1d": list(rep.slice_1d.losses), "slice_2d": [v for r in rep.slice_2d.losses for v in r],
            "density": list(rep.density.density), "batches": [rep.batches],
            "entropy": [L["values"]["entropy"]["mean"] for L in col["layers"]],
            "entropy_heads": [h["mean"] for L in col["layers"] for h in L["values"]["entropy_per_head"]],
            "hidden": [L["hidden"][k]["mean"] if k != "erank_all" else L["hidden"][k] for L in col["layers"]
                       for k in ("entropy", "erank_seq", "cosine", "erank_all")],
            "probe": [L["probe"][k]["accuracy"] for L in col["layers"] for k in ("values", "hidden")],
            "probe_n": [L["probe"]["values"]["n"] for L in col["layers"]],
            "saturation": [sat["base_loss"]] + [v for L in sat["layers"] for v in L["layer_loss_increase"]]
            + [v for L in sat["layers"] for h in L["per_head"] for v in h["loss_increase"]],
            "logit_range": [v for k in sorted(sat["logits"]) for r in sat["logits"][k]["logit_range"] for v in r]}


if __name__ == "__main__":
    init_distributed(torch.device("cpu"))
    out = measure(die=os.environ.get("DIE_RANK") == os.environ["RANK"])
    with open(sys.argv[1] + f".rank{os.environ['RANK']}.json", "w") as f:
        json.dump(out, f)
    from cemtool.distributed import exit_process

    exit_process(0)  # as a command does: gloo's threads can abort the interpreter's teardown (distributed.py)
'''


def _ranks(cmd: list[str], world: int, **env) -> list[subprocess.CompletedProcess]:
    """``cmd`` in ``world`` processes with the environment torchrun gives its workers (without its launcher),
    each forked from tests/procs.py's server (the real torchrun launcher: tests/e2e/test_train.py, test_jobs.py)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "CEMTOOL_DIST_TIMEOUT": "30", **env}
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=120), *p.communicate())
            for p in procs.ranks(cmd, world, e)]


def _launch(tmp_path: Path, world: int, **env) -> list[subprocess.CompletedProcess]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return _ranks([sys.executable, str(script), str(tmp_path / "out")], world, **env)


def _one_process() -> dict:
    ns: dict = {"__name__": "worker"}
    exec(compile(WORKER, "worker.py", "exec"), ns)
    return ns["measure"]()


def _close(a, b, rel: float = 1e-6) -> bool:
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(u, v, rel) for u, v in zip(a, b, strict=True))
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def test_two_processes_give_the_one_process_sharpness_collapse_and_saturation(tmp_path):
    res = _launch(tmp_path, 2)
    assert all(r.returncode == 0 for r in res), res[0].stderr[-2000:] + res[1].stderr[-2000:]
    r0 = json.loads((tmp_path / "out.rank0.json").read_text())
    r1 = json.loads((tmp_path / "out.rank1.json").read_text())
    one = _one_process()
    assert r0 == r1  # every rank holds the same (all-reduced) results
    assert one["probe_n"][0] >= 4 and len(one["top"]) == 2 and len(one["traces"]) == 2
    for key, ref in one.items():
        assert _close(ref, r0[key]), (key, ref, r0[key])


def test_a_rank_dying_mid_analysis_stops_the_others_with_one_line(tmp_path):
    res = _launch(tmp_path, 2, DIE_RANK="1")
    assert res[1].returncode == 3
    assert res[0].returncode != 0
    assert "another process of the analysis died or timed out" in res[0].stderr
    assert not list(tmp_path.glob("out.rank*.json"))  # nothing written as if complete


def _tiny():
    ns: dict = {"__name__": "worker"}
    exec(compile(WORKER, "worker.py", "exec"), ns)
    return ns["model_and_tokens"]()


def test_more_ranks_than_sequences_is_one_clear_error(monkeypatch):
    model, x, y = _tiny()
    monkeypatch.setattr(distributed, "current", lambda: Dist(0, 3))
    with pytest.raises(CemtoolError, match="3 processes but only 2 evaluation sequences"):
        Hessian(model, x[:2], y[:2], dtype="fp64")
    with pytest.raises(CemtoolError, match="3 processes but only 2 evaluation sequences"):
        collapse_report(model, x[:2])
    assert list(distributed.shard(7)) == [0, 1]  # rank 0 of 3: the first third
    monkeypatch.setattr(distributed, "current", lambda: Dist(2, 3))
    assert list(distributed.shard(7)) == [4, 5, 6]


def test_mixed_devices_are_refused(monkeypatch):
    monkeypatch.setattr(distributed, "all_gather", lambda obj: ["cuda", "cpu"])
    with pytest.raises(CemtoolError, match="different devices .rank 0: cuda, rank 1: cpu"):
        distributed.check_same_device("cuda")
    monkeypatch.setattr(distributed, "all_gather", lambda obj: ["cpu", "cpu"])
    distributed.check_same_device("cpu")  # the same kind everywhere: fine


def test_objective_keeps_tokens_on_the_cpu_until_used():
    model, x, y = _tiny()
    with Hessian(model, x, y, dtype="fp64", batch_size=2) as obj:
        assert len(obj.batches) == 4 and all(b[0].device.type == "cpu" for b in obj.batches)
        assert obj.tokens == y.numel()
        torch.testing.assert_close(torch.tensor(obj.loss(), dtype=torch.float64), torch.nn.functional.cross_entropy(
            model.double()(x).flatten(0, 1), y.flatten()).detach(), rtol=1e-12, atol=0)


def test_sharpness_cli_on_two_ranks_rank0_writes_the_one_process_report(tmp_path, tiny_run):
    import shutil

    from typer.testing import CliRunner

    from cemtool.cli.main import app

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns("reports", "plots"))
    opts = ["--tokens", "128", "--dtype", "fp64", "--top-k", "2", "--lanczos-steps", "6", "--trace-hvps", "4",
            "--density-runs", "0", "--avg-samples", "2", "--slice-points", "3", "--no-plots", "--quiet",
            "--device", "cpu", "--batch-size", "4"]
    res = CliRunner().invoke(app, ["sharpness", str(run), *opts, "--name", "one"])
    assert res.exit_code == 0, res.output
    ranks = _ranks([sys.executable, "-m", "cemtool", "sharpness", str(run), *opts, "--name", "two"], 2)
    assert all(r.returncode == 0 for r in ranks), ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    assert "report:" in ranks[0].stdout and not ranks[1].stdout  # rank 0 alone prints
    one, dd = (json.loads((run / "reports" / f"{n}.json").read_text()) for n in ("one", "two"))
    assert one["tokens"] == dd["tokens"] == 128
    assert _close(one["eigen"]["top"], dd["eigen"]["top"]) and _close(one["loss"], dd["loss"])
    assert _close([t["trace"] for t in one["traces"]], [t["trace"] for t in dd["traces"]])


def test_kept_graphs_stay_within_the_stated_budget():
    model, x, y = _tiny()
    v = torch.randn(sum(p.numel() for p in model.parameters()), dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    with Hessian(model, x, y, dtype="fp64", batch_size=2, graph_budget=0) as none, \
            Hessian(model, x, y, dtype="fp64", batch_size=2, graph_budget=2**40) as every:
        h0, h1 = none.hvp(v), every.hvp(v)
        assert none.kept_graph_batches == 0 and every.kept_graph_batches == len(every.batches) == 4
        torch.testing.assert_close(h0, h1, rtol=1e-12, atol=1e-14)
    with pytest.raises(CemtoolError, match="budget"):
        Hessian(model, x, y, dtype="fp64", graph_budget=-1)


def test_probe_sample_merge_keeps_the_one_process_sample(monkeypatch):
    from cemtool.analysis import probe as collapse  # the probe's sample lives in analysis.probe
    from cemtool.analysis.probe import ProbeClasses, ProbeSample

    classes = ProbeClasses(["a", "b"], [[1, 2], [3, 4]], "words")
    idx = torch.randint(0, 8, (6, 8), generator=torch.Generator().manual_seed(0))

    def sample(rows: torch.Tensor, per_class: int) -> ProbeSample:
        s = ProbeSample(classes, 8, per_class)
        sel = s.select(rows)
        if sel is not None:
            s.add("0.values", rows[sel[0], sel[1]].double()[:, None])  # the token id as its own feature
        return s

    one = sample(idx, 5)
    # rank 0 holds the first three windows, rank 1 the rest (each capped at 5 per class on its own), rank 2 none
    parts = [(s.labels, s.features) for s in (sample(idx[:3], 5), sample(idx[3:], 5), ProbeSample(classes, 8, 5))]
    merged = ProbeSample(classes, 8, 5)
    monkeypatch.setattr(collapse, "all_gather", lambda obj: parts)
    merged.merge_ranks()
    (f1, y1, m1), (f2, y2, m2) = one.balanced(), merged.balanced()
    assert m1 == m2 > 0 and torch.equal(y1, y2) and torch.equal(f1["0.values"], f2["0.values"])
    assert merged.counts == one.counts



@pytest.fixture(scope="module")
def grammar_src(tmp_path_factory) -> str:
    from kit import train_tiny

    return train_tiny(tmp_path_factory.mktemp("fg") / "src")  # batch 8 (4 sequences per rank), 32 eval windows


def test_forgetting_on_two_ranks_gives_the_one_process_fine_tune(tmp_path, grammar_src):
    from typer.testing import CliRunner

    from cemtool.cli.main import app
    from cemtool.data.corpus import load_corpus
    from cemtool.subject import open_subject
    from cemtool.train import evaluate

    opts = ["--to", "grammar-b", "--steps", "6", "--eval-every", "3", "--device", "cpu", "--json"]
    res = CliRunner().invoke(app, ["forgetting", grammar_src, *opts, "--out", str(tmp_path / "one"), "-q"])
    assert res.exit_code == 0, res.output
    cmd = [sys.executable, "-m", "cemtool", "forgetting", grammar_src, *opts, "--out", str(tmp_path / "two")]
    ranks = _ranks(cmd, 2)
    assert all(r.returncode == 0 for r in ranks), ranks[0].stderr[-2000:] + ranks[1].stderr[-2000:]
    assert ranks[0].stdout and not ranks[1].stdout  # rank 0 alone prints
    one, two = json.loads(res.stdout), json.loads(ranks[0].stdout)
    assert two == json.loads((tmp_path / "two" / "reports" / "forgetting.json").read_text())
    assert json.loads((tmp_path / "two" / "meta.json").read_text())["world_size"] == 2
    assert [p["step"] for p in one["curve"]] == [p["step"] for p in two["curve"]] == [0, 3, 6]
    # the same weights (the source's, step 0): the sharded evaluations equal one process's to float64 rounding
    assert _close(one["before"]["source_loss"], two["before"]["source_loss"], 1e-12)
    assert _close(one["before"]["target_loss"], two["before"]["target_loss"], 1e-12)
    # the fine-tuned weights of the 2-rank run, evaluated in one process: its sharded evaluation
    tuned = open_subject(tmp_path / "two")
    A = load_corpus(open_subject(grammar_src).config.data, tokenizer=tuned.tokenizer)
    T = tuned.config.data.seq_len
    loss = evaluate(tuned.model, A, A.eval_windows(T, tuned.config.train.eval_tokens), T, "cpu", precision="fp32")
    assert _close(loss, two["after"]["source_loss"], 1e-12)
    # the training: DDP averages the two ranks' fp32 gradients (another rounding than one batch's mean), so the
    # fine-tuned weights differ by ~1e-8; every loss on the curve still agrees to 1e-6 relative (measured ~2e-9)
    for key in ("source_loss", "target_loss"):
        assert _close([p[key] for p in one["curve"]], [p[key] for p in two["curve"]]), key
    # forgetting and plasticity are differences of such losses (~5 nats): they agree to 1e-6 x the losses
    for key in ("forgetting", "plasticity"):
        assert abs(one[key] - two[key]) <= 1e-6 * one["before"]["source_loss"], (key, one[key], two[key])
    # an error on rank 0 (here: --out already holds a run) stops the other rank with one line naming it
    again = _ranks(cmd, 2)
    assert [r.returncode for r in again] == [1, 1]
    assert again[0].stderr.strip().startswith("Error:") and "already holds a run" in again[0].stderr
    assert again[1].stderr.strip().startswith("Error: rank 1: rank 0 stopped the fine-tune:") and "already holds" in \
        again[1].stderr


def test_forgetting_with_more_ranks_than_evaluation_windows_is_one_line(tmp_path, grammar_src, monkeypatch):
    from typer.testing import CliRunner

    from cemtool.cli.main import app

    monkeypatch.setattr(distributed, "current", lambda: Dist(0, 3))
    monkeypatch.setattr(distributed, "all_gather", lambda obj: [obj] * 3)  # check_same_device: all on the CPU
    res = CliRunner().invoke(app, ["forgetting", grammar_src, "--to", "grammar-b", "--steps", "2", "--eval-tokens",
                                   "32", "--device", "cpu", "-q", "--out", str(tmp_path / "ft")])
    assert res.exit_code == 1
    assert res.output.startswith("Error: 3 processes but only 2 evaluation sequences: every rank needs at least one")
    assert not (tmp_path / "ft").exists()  # refused before the fine-tune's directory is made


def test_exit_status_is_what_sys_exit_would_give(capsys):
    from cemtool.distributed import exit_code, exit_process

    assert [exit_code(None), exit_code(0), exit_code(2), exit_code(130)] == [0, 0, 2, 130]
    assert exit_code("Error: x") == 1 and capsys.readouterr().err == "Error: x\n"
    exit_process(3)  # no process group: returns, and the caller's SystemExit goes on as usual
