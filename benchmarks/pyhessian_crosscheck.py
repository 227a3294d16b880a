"""Cross-check: cemtool against PyHessian on the same model and tokens (needs ``pip install "cemtool[pyhessian]"``).

    OMP_NUM_THREADS=1 python benchmarks/pyhessian_crosscheck.py     # about 10 s on one CPU core; exit 1 on a miss

PyHessian is an optional extra, so these checks live here rather than in the test suite (which must run, and not
skip, without it). Two parts, each printing a table of cemtool and PyHessian side by side with their ratio:

1. ``run_pyhessian`` on a 1-layer baseline (2,096 parameters, 32 tokens) whose dense Hessian is computed exactly
   (torch.autograd.functional.hessian): PyHessian's top eigenvalue (power iteration: the largest *magnitude*) must
   match the exact largest |eigenvalue| within 2% relative; cemtool's Lanczos top eigenvalue and trace are printed
   beside it. Also checked: no PyHessian step fails, ``density()`` runs through cemtool's ``torch.eig`` shim (and
   without the shim its crash is reported, not raised), and the caller's model is left unchanged.
2. ``cemtool sharpness RUN --backend pyhessian`` on a tiny trained run (2 layers, d_model 32, 30 steps), in-process:
   exit 0, the table with the cemtool column, two eigenvalues and no errors in reports/sharpness_pyhessian.json;
   a simulated failure inside PyHessian's eigenvalues() is one reported line, not a traceback; ``--top-k 0
   --density-runs 0`` computes the trace alone. The cemtool and PyHessian numbers are printed for comparison (a
   30-step model's Hessian is indefinite, and power iteration finds the largest magnitude, so no tolerance there).

Exits 1 when any check fails.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch.func import functional_call  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cemtool.analysis.curvature.operators import Hessian  # noqa: E402
from cemtool.analysis.lanczos import lanczos  # noqa: E402
from cemtool.analysis.pyhessian_backend import require_pyhessian, run_pyhessian  # noqa: E402
from cemtool.cli.main import app  # noqa: E402
from cemtool.config import replace, resolve  # noqa: E402
from cemtool.errors import CemtoolError  # noqa: E402
from cemtool.models import attention_impl, build_model, lm_loss  # noqa: E402

EIG_RTOL = 2e-2  # PyHessian's top |eigenvalue| against the exact one (power iteration at its default tolerance)
V, T = 16, 8
TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
        "train.max_steps=30", "train.eval_every=10", "train.eval_tokens=512", "train.log_every=5",
        "train.warmup_steps=5", "train.lr=3e-3", "data.train_tokens=20000", "data.val_tokens=4000",
        "data.tokenizer=byte", "data.val_fraction=0.1"]
TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Is it? Are they? Was it? Were they?\n") * 120
QUICK = ["--quick", "--device", "cpu", "--quiet", "--trace-hvps", "8", "--lanczos-steps", "10",
         "--density-steps", "12", "--slice-points", "3"]


class Checks:
    """Named pass/fail checks, printed as they are made."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str) -> None:
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        if not ok:
            self.failed.append(what)


def table(rows: list[tuple[str, float, float]]) -> None:
    """quantity, cemtool (or exact), PyHessian, their ratio and difference."""
    print(f"  {'quantity':<38} {'cemtool':>13} {'PyHessian':>13} {'ratio':>9} {'difference':>12}")
    for name, ours, theirs in rows:
        ratio = theirs / ours if ours else float("nan")
        print(f"  {name:<38} {ours:>13.6g} {theirs:>13.6g} {ratio:>9.4f} {theirs - ours:>12.3e}")


def tiny_model() -> torch.nn.Module:
    sets = ["model.d_model=16", "model.n_layer=1", "model.n_head=2", "model.mlp_hidden=16"]
    cfg = resolve(arch="baseline", overrides=sets)
    torch.manual_seed(0)
    return build_model(replace(cfg.model, vocab_size=V, max_seq_len=T))


def tiny_tokens(n: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))
    return idx[:, :-1], idx[:, 1:]


def dense_hessian(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Exact Hessian of the mean token loss w.r.t. every parameter, float64, by autograd.functional."""
    md = {k: v.detach().to(torch.float64) for k, v in model.named_parameters()}
    bufs = {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in model.named_buffers()}
    work = copy.deepcopy(model).to(torch.float64).eval()
    names = list(md)
    sizes = [md[n].numel() for n in names]

    def f(w: torch.Tensor) -> torch.Tensor:
        ps = {n: t.view(md[n].shape) for n, t in zip(names, torch.split(w, sizes), strict=True)}
        with attention_impl("explicit"):
            return lm_loss(functional_call(work, {**ps, **bufs}, (x,)), y)

    H = torch.autograd.functional.hessian(f, torch.cat([md[n].reshape(-1) for n in names]), vectorize=True)
    return (H + H.T) / 2


def dense_part(check: Checks) -> None:
    print("part 1: run_pyhessian on a 1-layer baseline with its exact Hessian (fp64)")
    model, (x, y) = tiny_model(), tiny_tokens()
    H = dense_hessian(model, x, y)
    ev = torch.linalg.eigvalsh(H)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = run_pyhessian(model, x, y, dtype="fp64", top_k=1, density_steps=10, trace_iter=20)
    with Hessian(model, x, y, dtype="fp64") as obj:
        e = lanczos(obj, 1, 1, max_steps=60, tol=1e-10)
    exact_abs = float(ev.abs().max())
    ph_abs = abs(res.eigenvalues[0]) if res.eigenvalues else float("nan")
    ph_trace = res.trace if res.trace is not None else float("nan")
    print(f"  {res.n:,} parameters, {res.tokens} tokens, PyHessian {res.version}; exact λ_max {float(ev[-1]):.6g}, "
          f"λ_min {float(ev[0]):.6g} (power iteration finds the largest magnitude)")
    table([("max |λ|: exact", exact_abs, ph_abs),
           ("max |λ|: cemtool Lanczos (both ends)", max(abs(e.top[0]), abs(e.bottom[0])), ph_abs),
           (f"trace: exact (PyHessian SE {res.trace_se or float('nan'):.3g})", float(ev.sum()), ph_trace)])
    check(not res.errors, f"no PyHessian step failed {res.errors or ''}")
    check(res.eigen_hvps > 0 and res.n == len(ev) and res.tokens == 32, "HVPs counted; n and tokens as cemtool's")
    ok = bool(res.eigenvalues) and abs(abs(res.eigenvalues[0]) - exact_abs) <= EIG_RTOL * exact_abs
    check(ok, f"PyHessian's top |eigenvalue| within {EIG_RTOL:g} relative of the exact largest |eigenvalue|")
    check(len(res.density_nodes) == 1 and "shim" in (res.density_note or ""), "density() ran through the eig shim")
    bad = run_pyhessian(model, x, y, dtype="fp64", eig_shim=False, steps=("density",), density_steps=5)
    check("RuntimeError" in bad.errors.get("density", ""), "without the shim density()'s crash is reported")
    check(all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "the caller's model is unchanged")


def sharpness(run: str, *args: str):
    return CliRunner().invoke(app, ["sharpness", run, *QUICK, *args])


def train_tiny(out: Path) -> str:
    text = out.parent / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["train", "--arch", "baseline", "--out", str(out), "--quiet", "--device", "cpu", "--data", str(text)]
    for s in TINY:
        args += ["--set", s]
    res = CliRunner().invoke(app, args)
    if res.exit_code != 0:
        raise SystemExit(f"training the tiny run failed:\n{res.output}")
    return str(out)


def cli_part(check: Checks, tmp: Path) -> None:
    print("part 2: cemtool sharpness --backend pyhessian on a tiny trained run")
    run = train_tiny(tmp / "run")
    ours = sharpness(run, "--landscape", "none", "--no-plot")
    check(ours.exit_code == 0, "cemtool's own sharpness report")
    res = sharpness(run, "--backend", "pyhessian", "--top-k", "2", "--density-steps", "5")
    check(res.exit_code == 0, f"--backend pyhessian exits 0 {'' if res.exit_code == 0 else res.output}")
    check("PyHessian" in res.output and "cemtool (reports)" in res.output and "N = 1,024 tokens" in res.output,
          "its table has the cemtool column and the token count")
    reports = Path(run) / "reports"
    rep = json.loads((reports / "sharpness_pyhessian.json").read_text())
    check(len(rep["eigenvalues"]) == 2 and rep["eigen_hvps"] > 0 and rep["errors"] == {},
          "two eigenvalues, HVPs counted, no errors in reports/sharpness_pyhessian.json")
    cem = json.loads((reports / "sharpness.json").read_text())
    cem_trace = cem["traces"][0]["trace"] if cem.get("traces") else float("nan")
    table([(f"λ_{i + 1} (PyHessian: largest |λ| first)", a, b)
           for i, (a, b) in enumerate(zip(cem["eigen"]["top"], rep["eigenvalues"], strict=False))]
          + [("trace", cem_trace, rep["trace"] if rep.get("trace") is not None else float("nan"))])

    _, ph, _ = require_pyhessian()
    original = ph.hessian.eigenvalues

    def broken(self, *a, **k):
        raise RuntimeError("simulated PyHessian bug")

    ph.hessian.eigenvalues = broken
    try:
        res = sharpness(run, "--backend", "pyhessian", "--density-runs", "1", "--density-steps", "3")
    finally:
        ph.hessian.eigenvalues = original
    check(res.exit_code == 0 and "PyHessian eigenvalues() failed: RuntimeError: simulated PyHessian bug" in res.output
          and "Traceback" not in res.output, "a failure inside PyHessian is reported, not raised")
    res = sharpness(run, "--backend", "pyhessian", "--top-k", "0", "--density-runs", "0")
    rep = json.loads((reports / "sharpness_pyhessian.json").read_text())
    check(res.exit_code == 0 and rep["eigenvalues"] == [] and rep["eigen_hvps"] == 0 and rep["density_nodes"] == []
          and rep["trace"] is not None and rep["steps"] == ["trace"], "--top-k 0 --density-runs 0: the trace alone")


def main() -> int:
    torch.set_num_threads(1)
    try:
        require_pyhessian()
    except CemtoolError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    check = Checks()
    dense_part(check)
    with tempfile.TemporaryDirectory() as d:
        cli_part(check, Path(d))
    print(f"{'all checks passed' if not check.failed else f'{len(check.failed)} check(s) FAILED'}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
