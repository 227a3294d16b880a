"""The subject of a measurement: one model, the data it is evaluated on and where its reports go.

Every analysis measures a :class:`Subject`; :func:`cemtool.subject.open_subject` makes one from a cemtool run
directory (:mod:`cemtool.subject.run`) or a Hugging Face model (:mod:`cemtool.subject.hf`). What an analysis may ask
of the model inside (hook points, attention shapes, q/k weights, routers) is the model's own declaration:
:class:`cemtool.models.capabilities.Capabilities`, which cemtool's ``LM`` and the Hugging Face adapter implement.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cemtool.config import RunConfig
from cemtool.data.corpus import load_corpus, windows
from cemtool.errors import CemtoolError
from cemtool.runs import Run

if TYPE_CHECKING:
    import torch


@dataclass
class Subject:
    """A model to measure: the model (eval mode, on its device), its config (whose ``data`` section is the
    evaluation data), its tokenizer, the :class:`~cemtool.runs.Run` its reports and plots go into, and the
    checkpoint (file and step; ``step`` is None for a model cemtool did not train)."""

    model: torch.nn.Module
    config: RunConfig
    tokenizer: Any
    run: Run
    checkpoint: Path
    step: int | None

    @property
    def reports(self) -> Path:
        return self.run.reports

    @property
    def plots(self) -> Path:
        return self.run.plots

    @property
    def arch(self) -> str:
        return self.config.model.arch

    def eval_set(self, tokens: int, seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Fixed validation windows covering about ``tokens`` target tokens: inputs and targets (n, T) int64.
        ``seq_len``: the window length (default the data's own)."""
        if tokens <= 0:
            raise CemtoolError(f"the number of evaluation tokens must be positive, got {tokens}")
        T = seq_len or self.config.data.seq_len
        corpus = load_corpus(self.config.data, tokenizer=self.tokenizer)
        starts = corpus.eval_windows(T, tokens)
        return windows(corpus.val, starts, T)  # (n, T), (n, T)


__all__ = ["Subject"]
