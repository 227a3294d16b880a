"""The subject of a measurement: one model, the data it is evaluated on and where its reports go.

Every analysis measures a :class:`Subject`; :func:`cemtool.subject.open_subject` makes one from a cemtool run
directory (:mod:`cemtool.subject.run`) or a Hugging Face model (:mod:`cemtool.subject.hf`). What an analysis may ask
of the model inside (hook points, attention shapes, q/k weights, routers) is the model's own declaration:
:class:`cemtool.models.capabilities.Capabilities`, which cemtool's ``LM`` and the Hugging Face adapter implement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cemtool.data.synthetic  # noqa: F401  (registers the ngram source: a run may evaluate on it)
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
    checkpoint_asked: str | int = "final"  # the checkpoint as asked for (final, latest, a step, a file)
    data_asked: str | None = None  # evaluation data asked for instead of the model's own
    label: str | None = None  # its name in a comparison of several subjects (default: the run folder's name)

    _eval: tuple | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.label is None:
            self.label = self.run.path.name

    @property
    def device(self) -> str:
        """Where the model's parameters are (what reports record as the device)."""
        p = next(self.model.parameters(), None)
        return "cpu" if p is None else str(p.device)

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
        if self._eval is None or self._eval[0] != (tokens, T):  # the last set is kept: asked again, it is reused
            corpus = load_corpus(self.config.data, tokenizer=self.tokenizer)
            starts = corpus.eval_windows(T, tokens)
            self._eval = ((tokens, T), windows(corpus.val, starts, T))  # (n, T), (n, T)
        return self._eval[1]


__all__ = ["Subject"]
