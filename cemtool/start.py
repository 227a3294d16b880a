"""Training has one start: :func:`start_or_resume` makes a new run from a config and trains it, or continues a run
directory from its newest step checkpoint, or reuses a completed one.

``cemtool train`` (new and ``--resume``), the sweep's items and ``cemtool saturation sweep`` call it. What differs
between them is a choice of :data:`EXISTING` (what to do when ``out`` already holds a run) and the meta.json fields
they add; the run's creation (all or nothing, cemtool.runs.create_run), its lock, the corpus, the model's
data-dependent sizes and the training loop are written once, here. Under torchrun rank 0 creates and writes the
run; every rank trains (cemtool.train restores each one's weights from the same checkpoint on resume).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cemtool.config import RunConfig, to_dict
from cemtool.config import replace as replace_config
from cemtool.data.corpus import Corpus, load_corpus
from cemtool.data.tokenizer import load_tokenizer
from cemtool.errors import CemtoolError
from cemtool.layout import is_run
from cemtool.runs import Run, create_run, open_run
from cemtool.tblog import check_log_to
from cemtool.train import TrainResult, finalize_model_config, pick_device, train

# what to do when ``out`` already holds a run:
#   error    refuse (``cemtool train`` without --force)
#   replace  move it aside and start anew (``--force``; a saturation sweep's unfinished point)
#   resume   continue it if its config is the one asked for, reuse it if completed (a sweep's item)
#   reuse    reuse it if completed, else replace it (a saturation sweep's point)
EXISTING = ("error", "replace", "resume", "reuse")


@dataclass
class Started:
    """What :func:`start_or_resume` did: the run (None on the ranks other than 0 of a new run), its path, the
    config it trained, the training result (None when a completed run was reused) and how it began."""

    run: Run | None
    path: Path
    config: RunConfig
    result: TrainResult | None
    how: str  # new, resumed or reused


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def corpus_for(cfg: RunConfig, corpora: dict | None = None) -> Corpus:
    """The corpus of a config, shared through ``corpora`` (data section -> corpus) when given."""
    if corpora is None:
        return load_corpus(cfg.data)
    key = json.dumps(to_dict(cfg.data), sort_keys=True)
    if key not in corpora:
        corpora[key] = load_corpus(cfg.data)
    return corpora[key]


def start_or_resume(what: RunConfig | str | Path, out: str | Path | None = None, *, device: Any = None,
                    existing: str = "error", corpus: Corpus | None = None, corpora: dict | None = None,
                    extra_meta: dict | None = None, argv: list[str] | None = None,
                    callback: Callable[[dict], None] | None = None, allow_data_change: bool = False,
                    on_start: Callable[[Run | None, str], None] | None = None) -> Started:
    """Train a new run of config ``what`` into ``out``, or continue the run directory ``what`` (a path).

    ``existing``: one of :data:`EXISTING`, what to do when ``out`` holds a run. ``corpus`` (or a ``corpora`` cache)
    is the training data (default: the config's, or for a continued run its own, read with its tokenizer).
    ``extra_meta``: fields meta.json adds beside the corpus description. ``on_start(run, how)`` is called once the
    run is created or locked, before the first step (a caller records that it is running)."""
    if existing not in EXISTING:
        raise ValueError(f"existing={existing!r}: one of {EXISTING}")
    dev = device if isinstance(device, torch.device) else pick_device(device)
    if not isinstance(what, RunConfig):
        return _continue(Path(what), dev, corpus, callback, allow_data_change, on_start)
    path = Path(out)
    if existing in ("resume", "reuse") and is_run(path):
        run = open_run(path)
        done = run.meta().get("status") == "completed"
        if existing == "resume":
            stored = run.config()
            filled = replace_config(what, **{"model.vocab_size": stored.model.vocab_size,
                                             "model.max_seq_len": stored.model.max_seq_len})
            if to_dict(stored) != to_dict(filled):
                raise CemtoolError(f"{path} holds a run with another config than the study plans",
                                   hint="move it away, or use another --out")
            if not done:
                run.lock()  # train() marks it running again once its checkpoint has loaded
                return _train(stored, corpus or corpus_for(stored, corpora), run, run, path, dev, "resumed",
                              callback, allow_data_change, on_start)
        if done:
            return Started(run, path, run.config(), None, "reused")
    check_log_to(what.train.log_to)  # before the run is created
    corpus = corpus or corpus_for(what, corpora)
    cfg = finalize_model_config(what, corpus)
    run = None
    if _rank() == 0:
        run = create_run(path, cfg, force=existing in ("replace", "reuse"), argv=argv if argv is not None else sys.argv,
                         device=str(dev), extra_meta={"corpus": corpus.info, **(extra_meta or {})},
                         tokenizer=corpus.tokenizer)
    return _train(cfg, corpus, run, run, path, dev, "new", callback, allow_data_change, on_start)


def _continue(path: Path, dev: torch.device, corpus: Corpus | None, callback, allow_data_change: bool,
              on_start) -> Started:
    """``cemtool train --resume``: every rank gets the run (each restores weights, optimizer state and step from
    the same checkpoint); rank 0 alone locks and writes it."""
    main = _rank() == 0
    run = open_run(path, lock=main)
    try:
        if run.meta().get("status") == "completed":
            raise CemtoolError(f"run {path} is already completed")
        cfg = run.config()
        check_log_to(cfg.train.log_to)
        corpus = corpus or load_corpus(cfg.data, tokenizer=load_tokenizer(run.path / "tokenizer.json"))
    except BaseException:
        if main:
            run.unlock()
        raise
    return _train(cfg, corpus, run, run if main else None, run.path, dev, "resumed", callback, allow_data_change,
                  on_start)


def _train(cfg: RunConfig, corpus: Corpus, run: Run | None, writer: Run | None, path: Path, dev: torch.device,
           how: str, callback, allow_data_change: bool, on_start) -> Started:
    """Train (``resume`` for a continued run) and unlock the run, whatever happens."""
    try:
        if on_start is not None:
            on_start(writer, how)
        res = train(cfg, corpus, run, device=dev, resume=how == "resumed", callback=callback,
                    allow_data_change=allow_data_change)
    finally:
        if writer is not None:
            writer.unlock()
    return Started(writer, path, cfg, res, how)


__all__ = ["EXISTING", "Started", "corpus_for", "start_or_resume"]
