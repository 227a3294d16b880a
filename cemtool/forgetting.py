"""Forgetting and plasticity (METHODS §7): fine-tune a trained run on a second corpus with one fixed recipe and
follow both validation losses along the way.

    forgetting = L_A(after) - L_A(before)      A = the source run's data: how much of A the fine-tune destroys
    plasticity = L_B(before) - L_B(after)      B = the target data: how much of B the model picks up

Both losses are mean token losses (nats) on fixed validation windows (``Corpus.eval_windows``: the same windows
at every point of the curve), evaluated with ``cemtool.train.evaluate`` at step 0 (the source weights) and every
``eval_every`` fine-tuning steps, the last step included.

The recipe
----------
One recipe for every variant (METHODS §7, the reference): AdamW, lr 1e-4, betas 0.9/0.95, weight decay 0.01,
50 warmup steps, cosine to 0.1 x lr, gradient clipping at 1.0, 1000 steps. The batch (``train.batch_size`` x
``grad_accum`` x ``data.seq_len`` tokens per step), precision and seed are the source run's.

Scaling to the run's size [decision]: the reference fine-tunes a 124M model pretrained for thousands of steps.
cemtool's runs are often far shorter, and 1000 steps would then be a second pretraining. So by default

- steps = min(1000, ceil(source steps / 4)): a quarter of the source run's optimizer steps, capped at the
  reference (a source run of >= 4000 steps gets exactly the reference's 1000);
- warmup = round(steps x 50 / 1000): the reference's 5 % of the steps;
- eval_every = ceil(steps / 20): about 20 points on each curve (plus step 0);

while lr, betas, weight decay, the cosine floor and clipping stay at the reference values (the recipe must not
depend on the variant being compared). Every value can be overridden (``scaled_recipe`` keyword arguments, the
``cemtool forgetting`` flags). Two options change the scaling itself:

- ``step_fraction`` (default 0.25): the share of the source run's steps (same batch, hence of its tokens). The
  TMM paper fine-tunes on about 3.3% of its pretraining tokens; ``step_fraction=0.03`` is that recipe.
- ``lr_scale`` (default none: the fixed reference lr): the fine-tune's peak lr is ``lr_scale`` x the source
  run's ``train.lr`` (its peak lr; for a Muon run, the AdamW part's). A fixed 1e-4 is 1/30 to 1/3000 of the
  rates cemtool's small models are tuned to, so their fine-tunes differ mostly in how far each model moves;
  a lr proportional to the model's own keeps the fine-tune's step size in proportion. It is refused beside an
  explicit ``lr``, and for a source without a training lr (a Hugging Face model).

Data and tokenizer: the target is read with the SOURCE run's tokenizer. The grammar corpora (``grammar``,
``grammar-b``) are written in their own word vocabulary, so a grammar run fine-tunes on ``grammar-b`` (same
words, another distribution), and a text run (byte or BPE tokenizer, lossless on any text) on ``pydoc`` or any
.txt source; other combinations are refused with one line (:func:`check_tokenizer`).

The fine-tune is an ordinary cemtool run, trained by ``cemtool.train.train`` from the source weights
(``init_weights``), in a NEW directory (default ``<source>-ft-<target>``) whose meta.json names the source as
``"parent"`` and holds a summary under ``"forgetting"``. The source run is only read (not even locked). The
source-data losses are measured on each checkpoint the loop writes (one per evaluation) and appended to the
fine-tune's metrics.jsonl as ``{"step", "tokens", "source_val_loss", "source_val_floor"}`` rows, so an
interrupted fine-tune resumes with its curve intact. This is the one analysis that trains, hence the one that
imports ``cemtool.train``.

Under ``torchrun`` (DESIGN "Distributed") the fine-tune trains data-parallel (``train`` runs DDP) and the
evaluations of the source and step-0 target losses shard the validation windows over the ranks (contiguously,
:func:`cemtool.distributed.shard`) and all-reduce float64 token sums. Rank 0 alone creates (or reopens and locks)
the run directory, writes metrics rows, checkpoints and the report; it decides what is left to do and tells the
other ranks (:func:`_from_main`), which read the checkpoints it writes (one machine: a shared filesystem). Every
rank returns the same payload.

Report schema (``reports/forgetting.json`` of the fine-tuned run; ``reports/forgetting.csv`` holds ``curve``)::

    {
      "provenance": {...},                      # cemtool.report.provenance: run = the fine-tuned run
      "measure": "forgetting",
      "source": {"run", "arch", "data", "checkpoint", "step", "eval_tokens", "floor"},
      "target": {"data", "eval_tokens", "floor", "corpus"},   # floor: exact entropy floor or null
      "recipe": {"lr", "beta1", "beta2", "weight_decay", "warmup_steps", "min_lr_ratio", "grad_clip", "steps",
                 "eval_every", "schedule", "batch_size", "grad_accum", "seq_len", "tokens_per_step", "scaling"},
      "before": {"source_loss", "target_loss"}, # the source weights (step 0)
      "after": {"source_loss", "target_loss"},  # the last step
      "forgetting": float,                      # after.source_loss - before.source_loss
      "plasticity": float,                      # before.target_loss - after.target_loss
      "curve": [{"step", "tokens", "source_loss", "target_loss"}, ...]   # step 0, eval_every, ..., steps
    }
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from cemtool.checkpoints import find_checkpoint
from cemtool.config import RunConfig, to_dict
from cemtool.config import replace as replace_config
from cemtool.data.corpus import Corpus, load_corpus
from cemtool.data.grammar import GRAMMARS
from cemtool.distributed import all_gather, all_reduce_sum, check_same_device, current, init_distributed, shard
from cemtool.errors import CemtoolError
from cemtool.fileio import check_regular, read_bytes, read_json
from cemtool.layout import is_run
from cemtool.models.registry import build_model
from cemtool.options import at_least, check_types
from cemtool.report import provenance, write_report
from cemtool.runs import Run, create_run, open_run
from cemtool.subject import open_subject
from cemtool.train import evaluate, pick_device, train
from cemtool.writes import atomic_write_bytes

Callback = Callable[[dict], None]

STEP_FRACTION = 0.25  # default fine-tune steps = this share of the source run's steps (capped at the reference)
CURVE_POINTS = 20  # default evaluations along the fine-tune (plus step 0)


@dataclass(frozen=True)
class Recipe:
    """The fine-tuning recipe; the defaults are the reference of METHODS §7."""

    lr: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.01
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine to 0.1 x lr
    grad_clip: float = 1.0
    steps: int = 1000
    eval_every: int = 50
    schedule: str = "cosine"


REFERENCE = Recipe()


@dataclass(frozen=True)
class Options:
    """What a fine-tune takes (``cemtool forgetting``, ``sweep -A forgetting.key=value``): its length, warmup and
    evaluation cadence (None: scaled from the source run, :func:`scaled_recipe`), validation tokens per evaluation
    (None: the source run's), the source checkpoint, and the AdamW recipe (the reference's values by default)."""

    steps: int | None = None
    warmup_steps: int | None = None
    eval_every: int | None = None
    eval_tokens: int | None = None
    checkpoint: str = "final"
    step_fraction: float = STEP_FRACTION
    lr_scale: float | None = None
    lr: float = REFERENCE.lr
    beta1: float = REFERENCE.beta1
    beta2: float = REFERENCE.beta2
    weight_decay: float = REFERENCE.weight_decay
    min_lr_ratio: float = REFERENCE.min_lr_ratio
    grad_clip: float = REFERENCE.grad_clip

    def __post_init__(self):
        check_types(self, "forgetting")
        at_least(self, "forgetting", steps=1, warmup_steps=0, eval_every=1, eval_tokens=1, lr=0, beta1=0, beta2=0,
                 weight_decay=0, min_lr_ratio=0, grad_clip=0, lr_scale=0)
        if not 0 < self.step_fraction <= 1:
            raise CemtoolError(f"forgetting.step_fraction={self.step_fraction}: must be in (0, 1]")
        if self.lr_scale is not None and (self.lr_scale <= 0 or self.lr != REFERENCE.lr):
            raise CemtoolError(f"forgetting.lr_scale={self.lr_scale}: must be > 0 and not given with forgetting.lr"
                               if self.lr_scale <= 0 else "forgetting.lr and forgetting.lr_scale both given",
                               hint="lr is the fine-tune's lr; lr_scale makes it lr_scale x the source run's lr")
        for key in ("beta1", "beta2", "min_lr_ratio"):
            if getattr(self, key) > 1:
                raise CemtoolError(f"forgetting.{key}={getattr(self, key)}: must be <= 1")

    def recipe(self) -> dict:
        """The AdamW recipe's fields (Recipe), as fine_tune takes them."""
        return {k: getattr(self, k) for k in ("lr", "beta1", "beta2", "weight_decay", "min_lr_ratio", "grad_clip")}

    def schedule(self) -> dict:
        """Length, warmup, evaluation cadence and tokens, and the source checkpoint, as fine_tune takes them."""
        return {"steps": self.steps, "warmup_steps": self.warmup_steps, "eval_every": self.eval_every,
                "eval_tokens": self.eval_tokens, "checkpoint": self.checkpoint, "step_fraction": self.step_fraction,
                "lr_scale": self.lr_scale}


def scaled_recipe(source_steps: int, *, steps: int | None = None, warmup_steps: int | None = None,
                  eval_every: int | None = None, step_fraction: float = STEP_FRACTION, **fixed) -> Recipe:
    """The reference recipe scaled to a source run of ``source_steps`` optimizer steps (see the module
    docstring); explicit ``steps`` / ``warmup_steps`` / ``eval_every`` and any other Recipe field override it."""
    if steps is None:  # a source of unknown training length (a Hugging Face model): the reference's steps
        steps = REFERENCE.steps if source_steps is None else \
            min(REFERENCE.steps, max(1, math.ceil(step_fraction * source_steps)))
    if steps < 1:
        raise CemtoolError(f"fine-tuning steps must be >= 1, got {steps}")
    if warmup_steps is None:
        warmup_steps = round(steps * REFERENCE.warmup_steps / REFERENCE.steps)
    if eval_every is None:
        eval_every = max(1, math.ceil(steps / CURVE_POINTS))
    if warmup_steps < 0 or eval_every < 1:
        raise CemtoolError(f"bad fine-tuning schedule: warmup_steps={warmup_steps}, eval_every={eval_every}")
    unknown = sorted(set(fixed) - {f for f in Recipe.__dataclass_fields__})
    if unknown:
        raise CemtoolError(f"unknown recipe field {unknown[0]!r}", hint=f"known: {', '.join(asdict(REFERENCE))}")
    return replace(REFERENCE, steps=steps, warmup_steps=warmup_steps, eval_every=eval_every, **fixed)


def finetune_config(source: RunConfig, target: str, recipe: Recipe, eval_tokens: int | None = None) -> RunConfig:
    """The fine-tune's RunConfig: the source's model, the target data with the source's window and corpus
    settings, the source's batch/precision/seed, and the recipe."""
    tc = source.train
    return replace_config(source, **{
        "data.source": target, "train.max_steps": recipe.steps, "train.max_tokens": 0, "train.lr": recipe.lr,
        "train.optimizer": "adamw", "train.beta1": recipe.beta1, "train.beta2": recipe.beta2,
        "train.weight_decay": recipe.weight_decay,
        "train.warmup_steps": recipe.warmup_steps, "train.schedule": recipe.schedule,
        "train.min_lr_ratio": recipe.min_lr_ratio, "train.grad_clip": recipe.grad_clip,
        "train.eval_every": recipe.eval_every, "train.ckpt_every": recipe.eval_every,
        "train.log_every": max(1, min(tc.log_every, recipe.eval_every)),
        "train.eval_tokens": eval_tokens or tc.eval_tokens,
        "train.curvature_every": 0})  # the source's curvature tracking is not part of the recipe


def check_tokenizer(kind: str, target: str) -> None:
    """Refuse, with one line, target data that a source run's tokenizer of this kind (word, byte, bpe) cannot
    read."""

    if target in GRAMMARS and kind != "word":
        raise CemtoolError(f"target data {target!r} cannot be tokenized by the source run's {kind} tokenizer: "
                           f"the grammar corpora are written in their own word vocabulary",
                           hint="fine-tune a run trained on grammar with --to grammar-b; text runs take --to pydoc "
                                "or a .txt file")
    if target not in GRAMMARS and kind == "word":
        raise CemtoolError(f"target data {target!r} cannot be tokenized by the source run's word tokenizer (the "
                           f"grammar vocabulary)",
                           hint=f"for a run trained on grammar use --to {', '.join(g for g in GRAMMARS)}; "
                                "text targets need a run trained on text (byte or bpe tokenizer)")


def target_slug(target: str) -> str:
    """A short directory-safe name of the target data (a path's file or folder name)."""
    name = Path(target).stem if ("/" in target or Path(target).suffix) else target
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "target"


def default_out(source: str | Path, target: str) -> Path:
    src = Path(source)
    return src.parent / f"{src.name}-ft-{target_slug(target)}"


# --------------------------------------------------------------------------------------------------------------
# curves and the summary


def forgetting_curve(rows: list[dict]) -> list[dict]:
    """Join the fine-tune's metrics rows by step: target losses (``val_loss``) and source losses
    (``source_val_loss``); the steps where both were measured, in order."""
    target: dict[int, dict] = {}
    source: dict[int, float] = {}
    for r in rows:
        if "val_loss" in r:
            target[r["step"]] = r
        if "source_val_loss" in r:
            source[r["step"]] = r["source_val_loss"]
    return [{"step": s, "tokens": target[s].get("tokens", 0), "source_loss": source[s],
             "target_loss": target[s]["val_loss"]} for s in sorted(set(target) & set(source))]


def summarise(curve: list[dict]) -> dict:
    """Before/after losses, forgetting and plasticity of a curve that starts at step 0."""
    if not curve or curve[0]["step"] != 0:
        raise CemtoolError("the forgetting curve has no step-0 point (the source weights)")
    first, last = curve[0], curve[-1]
    return {"before": {"source_loss": first["source_loss"], "target_loss": first["target_loss"]},
            "after": {"source_loss": last["source_loss"], "target_loss": last["target_loss"]},
            "forgetting": last["source_loss"] - first["source_loss"],
            "plasticity": first["target_loss"] - last["target_loss"]}


# --------------------------------------------------------------------------------------------------------------
# the fine-tune


class _Evaluator:
    """Evaluates weights on the fixed validation windows of both corpora (a model instance of its own); under
    torchrun each rank evaluates its share of the windows and the token sums are all-reduced."""

    def __init__(self, cfg: RunConfig, source: Corpus, target: Corpus, device: torch.device):
        T = cfg.data.seq_len
        self.cfg, self.source, self.target, self.device = cfg, source, target, device
        self.source_starts = source.eval_windows(T, cfg.train.eval_tokens)
        self.target_starts = target.eval_windows(T, cfg.train.eval_tokens)  # what train() evaluates on
        self.source_floor = source.floor(self.source_starts, T)
        self.target_floor = target.floor(self.target_starts, T)
        self.source_mine = self.source_starts[shard(len(self.source_starts))]  # this rank's windows (all of them
        self.target_mine = self.target_starts[shard(len(self.target_starts))]  # with one process)
        self.model = build_model(cfg.model).to(device)

    def loss(self, weights: dict[str, torch.Tensor], which: str) -> float:
        """Mean token loss of ``weights`` on every rank's windows of ``which`` (source or target)."""

        self.model.load_state_dict(weights, strict=True)
        corpus, mine = (self.source, self.source_mine) if which == "source" else (self.target, self.target_mine)
        T = self.cfg.data.seq_len
        mean = evaluate(self.model, corpus, mine, T, self.device, precision=self.cfg.train.precision)
        total, count = all_reduce_sum(torch.tensor([mean * len(mine) * T, len(mine) * T], dtype=torch.float64))
        return float(total / count)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint the fine-tune has just written (safetensors; its optimizer tensors are
    not read). [Also sidesteps runs._refuse_pickle, which takes the 1 in 256 safetensors files whose header
    length ends in byte 0x80 for pickles.]"""

    check_regular(path, "checkpoint")
    with safe_open(str(path), framework="pt") as f:
        header = json.loads((f.metadata() or {})["cemtool"])
        weights = {k[len("model."):]: f.get_tensor(k) for k in f.keys() if k.startswith("model.")}
    for alias, target in header.get("aliases", {}).items():
        weights[alias] = weights[target]
    return weights


def _from_main(fn: Callable[[], object]) -> object:
    """``fn()`` evaluated on rank 0 alone, handed to every rank (a barrier too). An error of rank 0 (a one-line
    CemtoolError or OSError) stops every rank: rank 0 raises its own, the others one line naming it."""
    d = current()
    if d.world == 1:
        return fn()
    value, error = None, None
    if d.main:
        try:
            value = fn()
        except (CemtoolError, OSError) as e:
            error = e
    got, failed = all_gather((value, None if error is None else str(error).splitlines()[0]))[0]
    if error is not None:
        raise error
    if failed is not None:
        raise CemtoolError(f"rank {d.rank}: rank 0 stopped the fine-tune: {failed}")
    return got


def _source_row(ev: _Evaluator, weights: dict, step: int, tokens: int) -> dict:
    return {"step": step, "tokens": tokens, "source_val_loss": ev.loss(weights, "source"),
            "source_val_floor": ev.source_floor}


def clear_partial_run(path: Path) -> None:
    """Remove what a kill during a run's creation leaves behind (create_run writes .lock, config.json, then
    meta.json; the caller then adds tokenizer.json; training starts after), so that the run can be created
    afresh. Only those files (and hidden temporaries) are removed, and only while no training output exists.
    (Used when continuing a fine-tune or a study; unnecessary once create_run builds the directory atomically.)"""
    if not path.is_dir() or ((path / "meta.json").exists() and (path / "tokenizer.json").exists()):
        return
    known = {"config.json", "meta.json", "tokenizer.json"}
    if all(p.is_file() and (p.name in known or p.name.startswith(".")) for p in path.iterdir()):
        for p in path.iterdir():
            p.unlink()


def _open_existing(out: Path, source: Run, cfg: RunConfig) -> Run:
    """Reopen a fine-tune to continue it, after checking it is this source's fine-tune with this config."""
    run = open_run(out, lock=True)
    meta = run.meta()
    parent = meta.get("parent")
    if parent is None or Path(parent).resolve() != source.path.resolve():
        run.unlock()
        raise CemtoolError(f"{out} is not a fine-tune of {source.path} (parent: {parent})",
                           hint="choose another --out, or --force to move it aside")
    if to_dict(run.config()) != to_dict(cfg):
        run.unlock()
        raise CemtoolError(f"{out} holds a fine-tune with other settings than those asked for",
                           hint="repeat the original options, or use --force to start anew")
    return run


def fine_tune(source: str | Path, target: str, out: str | Path | None = None, *, checkpoint: str = "final",
              data: str | None = None, steps: int | None = None, warmup_steps: int | None = None,
              eval_every: int | None = None, eval_tokens: int | None = None, recipe: dict | None = None,
              step_fraction: float = STEP_FRACTION, lr_scale: float | None = None,
              device: str | torch.device | None = None,
              resume: bool = False, force: bool = False, callback: Callback | None = None,
              argv: list[str] | None = None) -> dict:
    """Fine-tune the run ``source`` on ``target`` data into a new run directory and return the report payload
    (also written to its reports/forgetting.json and .csv). ``recipe``: other Recipe fields (lr, beta1, ...).

    resume: continue the fine-tune found at ``out`` (its report is returned as is if already written; a missing
    ``out`` starts afresh). ``step_fraction``, ``lr_scale``: the recipe's scaling (module docstring).
    force: move an existing ``out`` aside first. ``callback`` receives the training loop's
    events plus ``{"kind": "source_eval", "step", "source_loss"}``. ``source``: anything
    :func:`cemtool.subject.open_subject` loads (a run, a Hugging Face model directory or hf: id); ``data``: the source
    data A (default the run's own; pydoc for a Hugging Face model), read with the source's tokenizer.
    """

    dev = device if isinstance(device, torch.device) else pick_device(device)
    main = init_distributed(dev).main  # under torchrun: DDP training, sharded evaluations, rank 0 writes
    check_same_device(dev)
    loaded = open_subject(source, checkpoint, data=data)  # read only: the source run is not locked
    src, src_cfg, tok = loaded.run, loaded.config, loaded.tokenizer
    check_tokenizer(tok.kind, target)
    weights = dict(loaded.model.state_dict())
    ckpt_path, ckpt_step = loaded.checkpoint, loaded.step
    del loaded
    recipe = dict(recipe or {})
    if lr_scale is not None:
        if ckpt_step is None:  # a model cemtool did not train: no training lr is known
            raise CemtoolError("forgetting.lr_scale needs a source run cemtool trained (its train.lr)",
                               hint="give the fine-tune's lr instead")
        recipe["lr"] = lr_scale * src_cfg.train.lr
    rec = scaled_recipe(ckpt_step, steps=steps, warmup_steps=warmup_steps, eval_every=eval_every,
                        step_fraction=step_fraction, **recipe)
    cfg = finetune_config(src_cfg, target, rec, eval_tokens)
    out = Path(out) if out is not None else default_out(src.path, target)
    if out.resolve() == src.path.resolve() or src.path.resolve() in out.resolve().parents:
        raise CemtoolError(f"the fine-tune cannot be written into the source run {src.path}", hint="use another --out")
    target_corpus = load_corpus(cfg.data, tokenizer=tok)
    source_corpus = load_corpus(src_cfg.data, tokenizer=tok)
    ev = _Evaluator(cfg, source_corpus, target_corpus, dev)  # refuses more ranks than windows, before any writing
    run: Run | None = None

    def start() -> tuple[str, bool, dict | None]:
        """Rank 0: create or reopen (and lock) the fine-tune; (its path, whether it existed, a finished report)."""
        nonlocal run
        if resume:
            clear_partial_run(out)
        existing = is_run(out) and not force
        if existing and not resume:
            raise CemtoolError(f"{out} already holds a run", hint="use --resume to continue it, --force to move it "
                                                                  "aside, or another --out")
        if existing:
            run = _open_existing(out, src, cfg)
            if (run.reports / "forgetting.json").exists():
                return str(run.path), True, read_json(run.reports / "forgetting.json", "forgetting report")
            return str(run.path), True, None
        run = create_run(out, cfg, force=force, argv=argv if argv is not None else sys.argv, device=str(dev),
                         extra_meta={"parent": str(src.path.resolve()), "kind": "forgetting",
                                     "source_checkpoint": ckpt_path.name, "source_step": ckpt_step,
                                     "corpus": target_corpus.info}, tokenizer=tok)
        if (src.path / "model_source.json").exists():  # a model cemtool did not train: the fine-tune keeps
            atomic_write_bytes(run.path / "model_source.json",  # its description (and rebuilds from it)
                               read_bytes(src.path / "model_source.json", "model description"))
        return str(run.path), False, None

    try:
        path, existing, done = _from_main(start)
        if done is not None:
            return done
        if run is None:  # the other ranks read the run (train() restores their weights from its checkpoint)
            run = open_run(path)
        if _from_main(lambda: not any(r.get("step") == 0 and "source_val_loss" in r for r in run.metrics())):
            row = _source_row(ev, weights, 0, 0)
            row.update(val_loss=ev.loss(weights, "target"), val_floor=ev.target_floor)
            if main:
                run.append_metrics(row)
        if _from_main(lambda: run.meta().get("status") != "completed"):
            res = train(cfg, target_corpus, run, device=dev, resume=existing, init_weights=weights,
                        callback=_tracker(run, ev, callback))
            if res.status != "completed":
                raise KeyboardInterrupt  # train() caught a Ctrl-C and kept the last checkpoint
        if _from_main(lambda: not any(r.get("step") == rec.steps and "source_val_loss" in r for r in run.metrics())):
            _track(run, ev, "final", rec.steps, callback)  # the final weights (also after a kill right at the end)
        return _from_main(lambda: _report(run, src, src_cfg, cfg, rec, ev, ckpt_path.name, ckpt_step,
                                          target_corpus, step_fraction, lr_scale))
    finally:
        if run is not None:
            run.unlock()


def _track(run: Run, ev: _Evaluator, which: str | int, step: int, callback: Callback | None) -> None:
    """Measure the source loss of one of the fine-tune's checkpoints (every rank, once rank 0 has written it) and
    append it to the run's metrics (rank 0)."""
    tokens = step * ev.cfg.train.batch_size * ev.cfg.train.grad_accum * ev.cfg.data.seq_len
    _from_main(lambda: None)  # a barrier: rank 0 has written the checkpoint
    row = _source_row(ev, _read_weights(find_checkpoint(run, which)), step, tokens)
    if current().main:
        run.append_metrics(row)
    if callback is not None:
        callback({"kind": "source_eval", "step": step, "source_loss": row["source_val_loss"]})


def _tracker(run: Run, ev: _Evaluator, callback: Callback | None) -> Callback:
    """The training loop's callback: passes the events on, and measures the source loss on every checkpoint the
    loop writes (one per evaluation but the last; the final weights are measured after the loop). Rank 0 is told
    of a checkpoint; the other ranks, which write none, act on the evaluation that precedes it (ckpt_every =
    eval_every) and wait in :func:`_track` until rank 0 has written it."""
    main, total, every = current().main, ev.cfg.train.max_steps, ev.cfg.train.ckpt_every

    def on_event(e: dict) -> None:
        if callback is not None:
            callback(e)
        if e["kind"] == ("checkpoint" if main else "eval") and 0 < e["step"] < total and e["step"] % every == 0:
            _track(run, ev, e["step"], e["step"], callback)

    return on_event


def _report(run: Run, src: Run, src_cfg: RunConfig, cfg: RunConfig, rec: Recipe, ev: _Evaluator, ckpt_name: str,
            ckpt_step: int | None, target_corpus: Corpus, step_fraction: float = STEP_FRACTION,
            lr_scale: float | None = None) -> dict:
    curve = forgetting_curve(run.metrics())
    summary = summarise(curve)
    T, tc = cfg.data.seq_len, cfg.train
    payload = {
        "provenance": provenance(run.path, seed=cfg.seed, checkpoint=ckpt_name, step=ckpt_step,
                                 analysis="forgetting", parent=str(src.path.resolve())),
        "measure": "forgetting",
        "source": {"run": str(src.path.resolve()), "arch": src_cfg.model.arch, "data": src_cfg.data.source,
                   "checkpoint": ckpt_name, "step": ckpt_step, "eval_tokens": len(ev.source_starts) * T,
                   "floor": ev.source_floor},
        "target": {"data": cfg.data.source, "eval_tokens": len(ev.target_starts) * T, "floor": ev.target_floor,
                   "corpus": target_corpus.info},
        "recipe": {**asdict(rec), "batch_size": tc.batch_size, "grad_accum": tc.grad_accum, "seq_len": T,
                   "tokens_per_step": tc.batch_size * tc.grad_accum * T,
                   "step_fraction": step_fraction, "lr_scale": lr_scale,
                   "lr_rule": "fixed" if lr_scale is None else f"{lr_scale:g} x the source run's train.lr "
                                                                  f"({src_cfg.train.lr:g})",
                   "scaling": f"steps = min({REFERENCE.steps}, ceil({step_fraction} x source steps)), warmup = "
                              f"round(steps x {REFERENCE.warmup_steps}/{REFERENCE.steps}), eval_every = "
                              f"ceil(steps / {CURVE_POINTS}), unless overridden"},
        **summary,
        "curve": curve,
    }
    write_report(run.reports, "forgetting", payload, curve)
    run.update_meta(forgetting={"source": str(src.path.resolve()), "target": cfg.data.source,
                                "forgetting": summary["forgetting"], "plasticity": summary["plasticity"],
                                **{f"{k}_{w}": v for k in ("before", "after") for w, v in summary[k].items()}})
    return payload


__all__ = ["REFERENCE", "Recipe", "check_tokenizer", "clear_partial_run", "default_out", "fine_tune", "finetune_config",
           "forgetting_curve", "scaled_recipe", "summarise"]
