"""A cemtool run directory as a :class:`~cemtool.subject.base.Subject`: its config, tokenizer and a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cemtool.checkpoints import find_checkpoint, load_weights, manifest, read_checkpoint
from cemtool.config import replace
from cemtool.data.tokenizer import load_tokenizer
from cemtool.models.registry import build_model
from cemtool.runs import open_run
from cemtool.subject.base import Subject
from cemtool.subject.hf.loader import register_saved

if TYPE_CHECKING:
    import torch


def open_run_subject(path: str | Path, checkpoint: str | int = "final", device: str | torch.device = "cpu",
                     data: str | None = None) -> Subject:
    """Model (eval mode), config and tokenizer of a run. ``data``: evaluation data instead of the run's own (read
    with its tokenizer)."""
    run = open_run(path)
    cfg = run.config()
    if data is not None:
        cfg = replace(cfg, **{"data.source": data})
    tok = load_tokenizer(run.path / "tokenizer.json")
    ckpt = read_checkpoint(find_checkpoint(run, checkpoint), manifest(run))
    if (run.path / "model_source.json").exists():  # a run made from a model cemtool did not train (a fine-tune)
        register_saved(run.path)
    model = build_model(cfg.model)
    load_weights(model, ckpt)
    model.to(device).eval()
    return Subject(model, cfg, tok, run, ckpt.path, ckpt.step)


__all__ = ["open_run_subject"]
