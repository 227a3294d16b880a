"""cemtool sample: seeded text generation from a trained run (temperature, top-k)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from cemtool.cli import console
from cemtool.cli.app import app
from cemtool.cli.common import guarded
from cemtool.errors import CemtoolError
from cemtool.writes import atomic_write_json


@app.command()
@guarded
def sample(
    run: Annotated[Path, typer.Argument(help="a run directory, a Hugging Face model directory, or "
                                             "hf:ORG/NAME[@REVISION]")],
    prompt: Annotated[Optional[str], typer.Option(help="text to continue (default: start from token id 0)")]
    = None,
    tokens: Annotated[int, typer.Option(help="new tokens per sample (default 100, at most 4096)")] = 100,
    temperature: Annotated[float, typer.Option(help="softmax temperature; 0 = greedy (argmax) decoding "
                                                    "(default 1)")] = 1.0,
    top_k: Annotated[Optional[int], typer.Option(help="draw only from the K most likely tokens (default: all); "
                                                      "1 = greedy")] = None,
    seed: Annotated[int, typer.Option(help="seed of the draws: the same seed gives the same text (default 0)")] = 0,
    num_samples: Annotated[int, typer.Option(help="samples to draw, one after another (default 1)")] = 1,
    checkpoint: Annotated[str, typer.Option(help="final, latest, a step number, or a checkpoint file")] = "final",
    device: Annotated[str, typer.Option(help="auto (cuda > mps > cpu), cpu, cuda, cuda:N")] = "auto",
    out: Annotated[Optional[Path], typer.Option(help="also write the samples, settings and provenance to this "
                                                     "JSON file")] = None,
    json_: Annotated[bool, typer.Option("--json", help="print the result as JSON")] = False,
) -> None:
    """Continue a prompt with the model of a run: seeded sampling with temperature and top-k (greedy at
    temperature 0). The model sees the last max_seq_len tokens. Prints each sample (prompt + continuation)."""
    from cemtool.generate import SampleOptions  # start-up: torch
    from cemtool.generate import sample as generate_samples  # start-up: torch
    from cemtool.report import provenance  # start-up: loaded when the command runs (docs/performance.md)
    from cemtool.subject import open_subject  # start-up: torch
    from cemtool.train import pick_device  # start-up: torch

    opts = SampleOptions(tokens=tokens, temperature=temperature, top_k=top_k, seed=seed, num_samples=num_samples)
    opts.check()  # the numbers first, before anything is loaded; top-k against the vocabulary once it is known
    if run.is_file():
        raise CemtoolError(f"{run} is a file, not a run directory", hint="pass the directory `cemtool train` made")
    if out is not None and out.is_dir():
        raise CemtoolError(f"--out {out} is a folder", hint="give the path of a JSON file to write")
    if out is not None and not out.parent.is_dir():
        raise CemtoolError(f"--out {out}: the folder {out.parent} does not exist", hint="create it first")
    loaded = open_subject(run, checkpoint, device=pick_device(device))
    res = generate_samples(loaded, prompt, opts)
    payload = {"provenance": provenance(loaded.run.path, seed=seed, checkpoint=loaded.checkpoint.name,
                                        step=loaded.step, command="sample", arch=loaded.config.model.arch),
               **res}
    if out is not None:
        atomic_write_json(out, payload)
    if json_:
        console.print_json(payload)
        return
    head = prompt or ""
    for i, s in enumerate(res["samples"]):
        if res["samples"][1:]:
            console.result(f"--- sample {i + 1} of {len(res['samples'])}")
        console.result(head + s["text"])
