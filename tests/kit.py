"""The test kit: one place for the tiny models, tokens, configs and runs every test folder builds, and the shared
CLI helpers. Imported as `from kit import ...` (pyproject's pytest `pythonpath` puts tests/ on sys.path);
tests/conftest.py and research/tests/conftest.py turn its fixtures into fixtures of their folders."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# writes are renamed into place but not flushed to disk (cemtool.writes.flush_to_disk): atomic against the kills the
# tests make, without waiting ~8 ms a file for the disk; the processes the tests start inherit it
os.environ.setdefault("CEMTOOL_FSYNC", "0")

import torch  # noqa: E402
import typer.main  # noqa: E402
import typer.testing  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from cemtool.cli.main import app  # noqa: E402
from cemtool.config import replace, resolve  # noqa: E402
from cemtool.data.corpus import load_corpus  # noqa: E402
from cemtool.models.registry import build_model  # noqa: E402
from cemtool.runs import create_run, open_run  # noqa: E402
from cemtool.train import finalize_model_config, train  # noqa: E402

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]  # the repository

# --------------------------------------------------------------------------------------------------------------
# the CLI in this process: typer.testing's CliRunner().invoke(app, ...) builds the click command of `app` again at
# every call (typer.main.get_command: ~0.07 s, most of it evaluating the commands' string annotations), some 900
# times in the suite (~60 s of CPU under cProfile's count). Nothing changes an app after its import, so each app's
# command is built once per process and reused (click makes a new Context for each invocation); an app whose
# number of commands or groups, or whose callback, changed is built again.


@functools.cache  # keyed by the app (by identity) and what would change its command
def _command(typer_app, commands: int, groups: int, callback):
    return typer.main.get_command(typer_app)


typer.testing._get_command = lambda typer_app: _command(typer_app, len(typer_app.registered_commands),
                                                        len(typer_app.registered_groups), typer_app.registered_callback)

# --------------------------------------------------------------------------------------------------------------
# tiny models and tokens (no data, no run directory)

SIZE = {"d_model": 16, "n_layer": 2, "n_head": 2}  # the kit's model unless a test asks for another


def tiny_config(arch: str = "baseline", *sets: str, vocab: int = 40, seq_len: int = 12, **model):
    """The ModelConfig of ``arch`` at the kit's size: SIZE updated by ``model`` (model fields, e.g. d_model=32;
    None keeps the preset's value), then the overrides ``sets``; vocab_size and max_seq_len set directly."""
    fields = {k: v for k, v in {**SIZE, **model}.items() if v is not None}
    cfg = resolve(arch=arch, overrides=[*(f"model.{k}={v}" for k, v in fields.items()), *sets])
    return replace(cfg.model, vocab_size=vocab, max_seq_len=seq_len)


def tiny_model(arch: str = "baseline", *sets: str, seed: int = 0, dtype: torch.dtype | None = None,
               **config) -> torch.nn.Module:
    """A freshly initialised model of tiny_config(arch, *sets, **config), torch's global seed set to ``seed``
    first (in train mode, as build_model returns it)."""
    cfg = tiny_config(arch, *sets, **config)
    torch.manual_seed(seed)
    model = build_model(cfg)
    return model if dtype is None else model.to(dtype)


def tiny_tokens(n: int, seq_len: int, vocab: int, seed: int = 0, targets: bool = True):
    """Uniform random token ids from their own generator: (inputs, next-token targets) of n x seq_len, or with
    targets=False one n x seq_len batch."""
    g = torch.Generator().manual_seed(seed)
    if not targets:
        return torch.randint(0, vocab, (n, seq_len), generator=g)
    idx = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]



def dense_jacobian(model: torch.nn.Module, x: torch.Tensor, fn) -> tuple[torch.Tensor, torch.Tensor]:
    """(fn(logits), d fn(logits) / d w) over every parameter, float64, by torch.func on a float64 copy (no cemtool
    curvature code): shapes (outputs...) and (outputs..., n)."""
    import copy

    from torch.func import functional_call, jacrev

    from cemtool.models import attention_impl

    work = copy.deepcopy(model).to(torch.float64).eval()
    names = [n for n, _ in work.named_parameters()]
    w0 = {n: p.detach() for n, p in work.named_parameters()}

    def f(ws):
        with attention_impl("explicit"):
            return fn(functional_call(work, ws, (x,)))

    jac = jacrev(f)(w0)
    out = f(w0).detach()
    return out, torch.cat([jac[n].reshape(*out.shape, -1) for n in names], dim=-1)


def dense_curvature(name: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
    """The curvature matrix ``name`` (hessian, ggn, ef, fisher at the sampled ``labels`` (B, T, S)) of the
    token-mean cross entropy over every parameter, (n, n) float64, built independently: the Hessian by
    torch.autograd.functional.hessian; the GGN as Σ J_tᵀ (diag p_t − p_t p_tᵀ) J_t / N from the logits' Jacobian;
    the empirical and Monte-Carlo Fishers as Jᵀ J / N of the per-token losses' Jacobian."""
    import torch.nn.functional as F

    N = y.numel()
    if name == "hessian":
        import copy

        from torch.func import functional_call

        from cemtool.models import attention_impl

        work = copy.deepcopy(model).to(torch.float64).eval()
        named = dict(work.named_parameters())
        sizes = [p.numel() for p in named.values()]

        def loss(w: torch.Tensor) -> torch.Tensor:
            ps = {n: t.view(p.shape) for (n, p), t in zip(named.items(), torch.split(w, sizes), strict=True)}
            with attention_impl("explicit"):
                logits = functional_call(work, ps, (x,))  # (B, T, V)
            return F.cross_entropy(logits.flatten(0, 1), y.reshape(-1))

        H = torch.autograd.functional.hessian(loss, torch.cat([p.detach().reshape(-1) for p in named.values()]),
                                              vectorize=True)
        return (H + H.T) / 2
    if name == "ggn":
        logits, J = dense_jacobian(model, x, lambda z: z)  # (B, T, V), (B, T, V, n)
        p = torch.softmax(logits, -1)  # (B, T, V)
        M = torch.diag_embed(p) - p[..., :, None] * p[..., None, :]  # (B, T, V, V)
        return torch.einsum("btvi,btvw,btwj->ij", J, M, J) / N
    if name == "ef":
        _, J = dense_jacobian(model, x, lambda z: F.cross_entropy(z.flatten(0, 1), y.reshape(-1),
                                                                  reduction="none"))  # (B*T, n)
        return J.T @ J / N
    if name == "fisher":
        _, J = dense_jacobian(model, x, lambda z: -torch.log_softmax(z, -1).gather(-1, labels))  # (B, T, S, n)
        J = J.reshape(-1, J.shape[-1])
        return J.T @ J / (N * labels.shape[-1])
    raise ValueError(name)

# --------------------------------------------------------------------------------------------------------------
# tiny runs: 30 steps of 8 x 16 tokens of a small text

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "data.seq_len=16", "train.batch_size=8",
        "train.max_steps=30", "train.eval_every=10", "train.eval_tokens=512", "train.log_every=5",
        "train.warmup_steps=5", "train.lr=3e-3", "data.train_tokens=20000", "data.val_tokens=4000"]

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 + "Is it? Are they? Was it? Were they?\n") * 120


def set_args(*overrides: str) -> list[str]:
    """['--set', o1, '--set', o2, ...]: config overrides as command-line options."""
    return [a for s in overrides for a in ("--set", s)]


def tiny_setup(text_file: str, *extra: str, arch: str = "baseline", base: tuple[str, ...] | list[str] = TINY):
    """(config, corpus) of a tiny byte-level run on ``text_file``: ``base`` + data.tokenizer=byte + ``extra``,
    its model config finalised from the corpus (as `cemtool train` does)."""
    cfg = resolve(arch=arch, overrides=[*base, "data.tokenizer=byte", *extra], data_source=text_file)
    corpus = load_corpus(cfg.data)
    return finalize_model_config(cfg, corpus), corpus


def tiny_train(path, cfg, corpus, *, stop_after: int | None = None, resume: bool = False, **create):
    """Train ``cfg`` in process into the run at ``path`` (created with the corpus's tokenizer and ``create``'s
    create_run options, or reopened with resume=True), unlocked afterwards; returns the TrainResult."""
    if resume:
        run = open_run(path, lock=True)
    else:
        run = create_run(path, cfg, **create)
        corpus.tokenizer.save(run.path / "tokenizer.json")
    try:
        return train(cfg, corpus, run, device="cpu", stop_after=stop_after, resume=resume)
    finally:
        run.unlock()


def train_tiny(out, arch: str = "baseline", data: str | None = None, extra: list[str] | None = None) -> str:
    """Train a tiny run through the CLI (in-process) and return its directory."""
    args = ["train", "--arch", arch, "--out", str(out), "--quiet", "--device", "cpu"]
    if data:
        args += ["--data", data]
    res = CliRunner().invoke(app, args + set_args(*TINY, *(extra or [])))
    assert res.exit_code == 0, res.output
    return str(out)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """A small UTF-8 text corpus written to a temporary file."""
    p = tmp_path_factory.mktemp("text") / "corpus.txt"
    p.write_text(TEXT, encoding="utf-8")
    return str(p)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, text_file) -> str:
    """A completed tiny baseline run on a byte-tokenized text file (session-scoped; treat as read-only)."""
    return train_tiny(tmp_path_factory.mktemp("runs") / "tiny", data=text_file,
                      extra=["data.tokenizer=byte", "data.val_fraction=0.1"])


# --------------------------------------------------------------------------------------------------------------
# CLI results


def one_line_error(res, *words, code: int = 1):
    """A CLI result that is one clean user error: exit 1 (``code``: 2 for a bad option value), 'Error: ...' (+ an
    optional 'Hint:' line), no traceback."""
    assert res.exit_code == code, res.output
    lines = [line for line in res.output.strip().splitlines() if line.strip()]
    if code == 2:  # a usage error cemtool refuses itself: its line (+ hint), then the command's usage
        assert lines[-1].startswith("Usage: "), res.output
        lines = lines[:-1]
    assert lines[0].startswith("Error: ") and len(lines) <= 2, res.output  # message (+ hint)
    assert "Traceback" not in res.output and "internal error" not in res.output, res.output
    for w in words:
        assert w in res.output, (w, res.output)


def own_options(operator: str, **options) -> dict:
    """The options among ``options`` that ``operator`` takes (make_operator refuses another operator's semantic
    options: ``mc_samples`` is the Monte-Carlo Fisher's)."""
    from cemtool.analysis.curvature.operators import OPERATORS

    return {k: v for k, v in options.items() if k in OPERATORS[operator].takes}
