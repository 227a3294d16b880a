"""What a run directory and a model directory are, by their files (JSON only, no torch): the one detector of
each, used by the run-directory module, the file writers (which refuse links inside a run) and ``cemtool plot``.

::

    runs/<name>/
      config.json        resolved RunConfig with "schema_version"
      meta.json          versions, git commit, argv, device, seed, start/end, status
      metrics.jsonl      one JSON object per logged step
      tokenizer.json     the run's tokenizer (every analysis reuses it)
      checkpoints/       step_000500.safetensors (+ optimizer/RNG state), final.safetensors, manifest.json
      reports/ plots/ report.md
"""

from __future__ import annotations

from pathlib import Path

from cemtool.errors import CemtoolError
from cemtool.fileio import read_json


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory: a config.json with ``model_type`` and no ``schema_version``, no meta.json."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file() or (Path(path) / "meta.json").is_file():
        return False
    try:
        data = read_json(cfg, "config file")
    except CemtoolError:
        return False
    return isinstance(data, dict) and "model_type" in data and "schema_version" not in data


def is_run(path: str | Path) -> bool:
    """A cemtool run directory: meta.json, or a config.json that is not a Hugging Face model's (a damaged
    config.json still marks a run, whose reading then says what is wrong). The one run detector: JSON only, no
    torch, so ``cemtool plot`` uses it too."""
    p = Path(path)
    return (p / "meta.json").is_file() or ((p / "config.json").is_file() and not is_hf_dir(p))


RUN_SUBDIRS = ("checkpoints", "reports", "plots", "tensorboard")
RUN_FILES = ("config.json", "meta.json", "metrics.jsonl", "tokenizer.json", "report.md")


__all__ = ["RUN_FILES", "RUN_SUBDIRS", "is_hf_dir", "is_run"]
