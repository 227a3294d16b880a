"""What a measurement measures: :func:`open_subject` turns a run directory, a Hugging Face model directory or an
``hf:ORG/NAME[@REVISION]`` id into one :class:`Subject` (model, tokenizer, evaluation data, where reports go)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from cemtool.subject.base import Subject
from cemtool.subject.hf import is_foreign, load_foreign
from cemtool.subject.run import open_run_subject

if TYPE_CHECKING:
    import torch


def open_subject(spec: str | Path, checkpoint: str | int = "final", device: str | torch.device = "cpu",
                 data: str | None = None) -> Subject:
    """The subject ``spec`` names: a cemtool run directory, or a Hugging Face model (a local directory or
    ``hf:ORG/NAME[@REVISION]``, evaluated on ``data``, default pydoc or an exported run's own data).
    ``data``: evaluation data instead of the run's own (read with the model's tokenizer)."""
    if is_foreign(spec):
        subject = load_foreign(spec, device=device, data=data, checkpoint=checkpoint)
    else:
        subject = open_run_subject(spec, checkpoint, device=device, data=data)
    subject.checkpoint_asked, subject.data_asked = checkpoint, data
    return subject


__all__ = ["Subject", "open_subject"]
