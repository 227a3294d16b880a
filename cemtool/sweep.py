"""The study runner: architectures x seeds trained on the same number of tokens, then analysed, in one resumable
study directory (``cemtool sweep``).

Every item (one architecture, one seed) is trained by ``cemtool.train.train`` with ``train.max_tokens`` set to the
study's token budget, so all items see the same tokens (and, for one seed, the same batches); its parameters,
training FLOPs per token (forward + backward, ``cemtool.models.lm.flops_per_token``) and total FLOPs (that times
the tokens trained) are recorded. Then the chosen analyses run on it, through their Python APIs:

- ``sharpness``: ``cemtool.analysis.sharpness.measure_sharpness`` -> ``<item>/reports/sharpness.json`` (the same
  payload as ``cemtool sharpness``; options: ``tokens`` and the SharpnessOptions fields),
- ``collapse``: the measurement of ``cemtool collapse-report`` -> ``<item>/reports/collapse.json`` (options: its
  ``tokens``, ``batch_size``, ``alpha``, ``words``, ``k``, ``folds``, ``per_class``, ``seed``, ...),
- ``forgetting``: ``cemtool.forgetting.fine_tune`` -> a fine-tune run ``<item>-ft-<target>`` beside the
  item, holding ``reports/forgetting.json`` (options: ``steps``, ``warmup_steps``, ``eval_every``,
  ``eval_tokens``, ``checkpoint`` and the Recipe fields ``lr``, ``beta1``, ...).

Resuming: running the same sweep again (or ``cemtool sweep --resume DIR``) continues where it stopped. A
completed run is skipped; a run left ``running``/``interrupted``/``failed`` (a killed process, Ctrl-C) continues
from its newest step checkpoint (``train(..., resume=True)``); an analysis whose report exists is skipped; an
interrupted fine-tune resumes the same way. Nothing completed is redone or rewritten. The study directory is
locked while a sweep runs in it.

``study.json`` (written atomically after every change; paths relative to the study directory)::

    {
      "schema_version": 1, "kind": "cemtool-study", "created", "updated",
      "status": "running" | "completed" | "incomplete" | "interrupted",
      "plan": {"archs": [...], "seeds": [...], "tokens": int, "data": str, "overrides": ["k=v", ...],
               "analyses": [...], "target": str | null, "options": {analysis: {key: value}}},
      "items": [{
        "name": "<arch>-s<seed>", "arch", "seed", "run": "<arch>-s<seed>",
        "status": "pending" | "running" | "completed" | "failed" | "interrupted", "error": str | null,
        "step", "tokens", "val_loss", "val_floor", "seconds",
        "params", "non_embedding", "flops_per_token", "flops_forward_per_token", "total_flops",
        "analyses": {"sharpness": {"status", "report", "error", "seconds"},
                     "collapse": {...}, "forgetting": {..., "run": "<arch>-s<seed>-ft-<target>"}}
      }, ...]
    }
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from cemtool.config import RunConfig, resolve, to_dict
from cemtool.config import replace as replace_config
from cemtool.errors import CemtoolError
from cemtool.runs import Run, atomic_write_json, create_run, is_run, now, open_run, read_json

Callback = Callable[[dict], None]
SCHEMA_VERSION = 1
ANALYSES = ("sharpness", "collapse", "forgetting")
COLLAPSE_DEFAULTS = {"checkpoint": "final", "tokens": 16384, "seq_len": None, "batch_size": 16, "alpha": 0.5,
                     "words": None, "k": 4, "folds": 5, "per_class": 256, "seed": 0}  # cemtool collapse-report's
FORGETTING_KEYS = {"steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint", "lr", "beta1", "beta2",
                   "weight_decay", "min_lr_ratio", "grad_clip"}


# --------------------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Plan:
    """What a study trains and measures; stored in study.json and compared on resume."""

    archs: tuple[str, ...]
    seeds: tuple[int, ...]
    tokens: int
    data: str = "grammar"
    overrides: tuple[str, ...] = ()
    analyses: tuple[str, ...] = ()
    target: str | None = None
    options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        names = {f.name for f in fields(cls)}
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def _split_list(value: str | list | tuple, what: str, plural: str) -> list[str]:
    items = [s.strip() for s in value.split(",")] if isinstance(value, str) else [str(s).strip() for s in value]
    items = [s for s in items if s]
    if not items:
        raise CemtoolError(f"no {plural} given", hint="list at least one, comma-separated")
    dup = sorted({s for s in items if items.count(s) > 1})
    if dup:
        raise CemtoolError(f"{what} {dup[0]!r} is listed twice")
    return items


def item_config(plan: Plan, arch: str, seed: int) -> RunConfig:
    """The resolved config of one item (before the data fill in vocab_size / max_seq_len)."""
    return resolve(arch=arch, overrides=[*plan.overrides, f"train.max_tokens={plan.tokens}"], seed=seed,
                   data_source=plan.data)


def make_plan(archs: str | list, seeds: str | list, *, tokens: int | None = None, data: str = "grammar",
              overrides: list[str] | tuple = (), analyses: str | list = (), target: str | None = None,
              options: dict | None = None) -> Plan:
    """Validate a study's plan (unknown architecture, bad override, no seeds... -> CemtoolError). ``tokens``
    defaults to what the first architecture's config trains on (train.max_tokens, else max_steps x batch)."""
    from cemtool.data.grammar import GRAMMARS
    from cemtool.train import total_steps

    arch_list = _split_list(archs, "architecture", "architectures")
    seed_strs = _split_list(seeds, "seed", "seeds")
    try:
        seed_list = [int(s) for s in seed_strs]
    except ValueError:
        raise CemtoolError(f"seeds must be integers, got {','.join(seed_strs)}") from None
    chosen = _split_list(analyses, "analysis", "analyses") if analyses else []
    bad = [a for a in chosen if a not in ANALYSES]
    if bad:
        raise CemtoolError(f"unknown analysis {bad[0]!r}", hint=f"choose from {', '.join(ANALYSES)}")
    if tokens is not None and tokens < 1:
        raise CemtoolError(f"--tokens must be positive, got {tokens}")
    cfgs = [resolve(arch=a, overrides=list(overrides), data_source=data) for a in arch_list]  # validates all
    if tokens is None:
        c = cfgs[0]
        tokens = c.train.max_tokens or total_steps(c) * c.train.batch_size * c.train.grad_accum * c.data.seq_len
    if "forgetting" in chosen and target is None:
        target = {"grammar": "grammar-b", "grammar-b": "grammar"}.get(data)
        if target is None:
            raise CemtoolError(f"forgetting needs target data for runs trained on {data!r}",
                               hint="give --to (pydoc or a .txt file for text runs)")
    if "forgetting" not in chosen:
        target = None
    else:  # grammar corpora are read with their word tokenizer, text never is
        from cemtool.forgetting import check_tokenizer

        check_tokenizer("word" if data in GRAMMARS else "text", target)
    options = {k: dict(v) for k, v in (options or {}).items()}
    _check_options(options, chosen)
    return Plan(tuple(arch_list), tuple(seed_list), int(tokens), data, tuple(overrides), tuple(chosen), target,
                options)


def _check_options(options: dict, chosen: list[str]) -> None:
    from cemtool.analysis.sharpness import SharpnessOptions

    known = {"sharpness": {f.name for f in fields(SharpnessOptions)} - {"device"} | {"tokens", "checkpoint"},
             "collapse": set(COLLAPSE_DEFAULTS), "forgetting": FORGETTING_KEYS}
    for name, opts in options.items():
        if name not in known:
            raise CemtoolError(f"options for unknown analysis {name!r}", hint=f"choose from {', '.join(ANALYSES)}")
        if name not in chosen:
            raise CemtoolError(f"options given for {name}, which is not among the analyses",
                               hint="add it to --analyses")
        bad = sorted(set(opts) - known[name])
        if bad:
            raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=f"known: {', '.join(sorted(known[name]))}")


# --------------------------------------------------------------------------------------------------------------
# the analyses (each writes the report an analysis command would write)


def _report_path(study: Path, item: dict, name: str, plan: Plan) -> tuple[Path, Path | None]:
    """(report file, fine-tune run dir or None) of one analysis of one item."""
    run = study / item["run"]
    if name == "forgetting":
        from cemtool.forgetting import target_slug

        ft = study / f"{item['run']}-ft-{target_slug(plan.target)}"
        return ft / "reports" / "forgetting.json", ft
    return run / "reports" / f"{name}.json", None


def _sharpness(run_path: Path, options: dict, device: torch.device, emit: Callback) -> None:
    from cemtool.analysis.hessian import evaluation_set
    from cemtool.analysis.sharpness import SharpnessOptions, measure_sharpness, write_sharpness_report
    from cemtool.runs import load_run

    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    tokens, checkpoint = opts.pop("tokens", 2048), opts.pop("checkpoint", "final")
    loaded = load_run(run_path, checkpoint, device=device)
    x, y = evaluation_set(loaded, tokens)
    rep = measure_sharpness(loaded.model, x, y, SharpnessOptions(**opts, device=str(device)))
    write_sharpness_report(loaded, rep, seq_len=int(x.shape[1]), device=str(device), command="sweep")


def _collapse(run_path: Path, options: dict, device: torch.device, emit: Callback) -> None:
    from cemtool.analysis.collapse import all_rows, measure_run
    from cemtool.report import provenance, write_report

    opts = {**COLLAPSE_DEFAULTS, **options}
    r = measure_run(run_path, label=run_path.name, device=device, **opts)
    single = {"provenance": provenance(r["run"], seed=opts["seed"], checkpoint=r["checkpoint"], step=r["step"],
                                       command="collapse-report", options=opts), "runs": [r]}
    write_report(Path(r["run"]) / "reports", "collapse", single, all_rows(single))


def _forgetting(run_path: Path, options: dict, device: torch.device, emit: Callback, target: str,
                out: Path) -> None:
    from cemtool.forgetting import fine_tune

    opts = dict(options)
    kw = {k: opts.pop(k) for k in ("steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint") if k in opts}
    fine_tune(run_path, target, out, recipe=opts, device=device, resume=True, callback=emit, **kw)


# --------------------------------------------------------------------------------------------------------------
# the study


class Study:
    """A study directory: its plan, its manifest (study.json) and the runner."""

    def __init__(self, path: Path, manifest: dict):
        self.path = path
        self.manifest = manifest
        self.plan = Plan.from_dict(manifest["plan"])

    def save(self) -> None:
        self.manifest["updated"] = now()
        atomic_write_json(self.path / "study.json", self.manifest)


def new_manifest(plan: Plan) -> dict:
    items = [{"name": f"{a}-s{s}", "arch": a, "seed": s, "run": f"{a}-s{s}", "status": "pending", "error": None,
              "analyses": {n: {"status": "pending", "report": None, "error": None} for n in plan.analyses}}
             for s in plan.seeds for a in plan.archs]
    return {"schema_version": SCHEMA_VERSION, "kind": "cemtool-study", "created": now(), "updated": now(),
            "status": "running", "plan": plan.to_dict(), "items": items}


def open_study(out: str | Path, plan: Plan | None = None) -> Study:
    """The study in ``out``: an existing one (its stored plan must equal ``plan`` if given) or a new one."""
    out = Path(out)
    path = out / "study.json"
    if path.exists():
        manifest = read_json(path, "study manifest")
        if manifest.get("kind") != "cemtool-study" or manifest.get("schema_version", 0) > SCHEMA_VERSION:
            raise CemtoolError(f"{path} is not a study manifest this cemtool understands")
        stored = Plan.from_dict(manifest["plan"])
        if plan is not None and plan != stored:
            diff = [k for k in stored.to_dict() if stored.to_dict()[k] != plan.to_dict()[k]]
            raise CemtoolError(f"{out} holds a study planned with other settings ({', '.join(diff)} differ)",
                               hint=f"use another --out, or `cemtool sweep --resume {out}` to continue it as planned")
        return Study(out, manifest)
    if plan is None:
        raise CemtoolError(f"{out} holds no study (no study.json)")
    if out.exists() and (not out.is_dir() or any(p.name != ".lock" for p in out.iterdir())):
        raise CemtoolError(f"{out} exists and is not a study directory", hint="choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return Study(out, new_manifest(plan))


def run_sweep(out: str | Path, plan: Plan | None = None, *, device: str | torch.device | None = None,
              callback: Callback | None = None) -> dict:
    """Run (or continue) the study in ``out`` and return its manifest. ``plan`` None: continue as stored.

    ``callback`` receives the training loop's events with ``item`` added, and ``{"kind": "item", "item", "index",
    "total", "status"}`` / ``{"kind": "analysis", "item", "analysis", "status", "error"}``. Ctrl-C (or an
    interrupted training) marks the item interrupted, saves the manifest and raises KeyboardInterrupt."""
    from cemtool.train import pick_device

    study = open_study(out, plan)
    dev = device if isinstance(device, torch.device) else pick_device(device)
    lock = Run(study.path)  # the run-directory lock, on the study directory
    lock.lock()
    corpora: dict[str, object] = {}
    try:
        study.manifest["status"] = "running"
        study.save()
        items = study.manifest["items"]
        for index, item in enumerate(items):
            def emit(ev: dict, name: str = item["name"]) -> None:
                if callback is not None:
                    callback({**ev, "item": name})

            emit({"kind": "item", "index": index, "total": len(items), "status": "start"})
            try:
                _train_item(study, item, dev, corpora, emit)
                if item["status"] == "completed":
                    for name in study.plan.analyses:
                        _analyse(study, item, name, dev, emit)
            except KeyboardInterrupt:
                if item["status"] == "running":
                    item["status"] = "interrupted"
                for a in item.get("analyses", {}).values():
                    if a["status"] == "running":
                        a["status"] = "interrupted"
                study.manifest["status"] = "interrupted"
                study.save()
                raise
            emit({"kind": "item", "index": index, "total": len(items), "status": item["status"]})
        done = all(i["status"] == "completed" and all(a["status"] == "completed" for a in i["analyses"].values())
                   for i in items)
        study.manifest["status"] = "completed" if done else "incomplete"
        study.save()
    finally:
        lock.unlock()
    return study.manifest


def _corpus(cfg: RunConfig, corpora: dict):
    from cemtool.data.corpus import load_corpus

    key = json.dumps(to_dict(cfg.data), sort_keys=True)
    if key not in corpora:
        corpora[key] = load_corpus(cfg.data)
    return corpora[key]


def _train_item(study: Study, item: dict, dev: torch.device, corpora: dict, emit: Callback) -> None:
    """Train one item, or continue it, or skip it if completed; record its compute."""
    from cemtool.forgetting import clear_partial_run
    from cemtool.train import finalize_model_config, train

    plan, path = study.plan, study.path / item["run"]
    cfg = item_config(plan, item["arch"], item["seed"])
    clear_partial_run(path)
    resume = is_run(path)
    if resume:
        run = open_run(path)
        stored = run.config()
        filled = replace_config(cfg, **{"model.vocab_size": stored.model.vocab_size,
                                        "model.max_seq_len": stored.model.max_seq_len})
        if to_dict(stored) != to_dict(filled):
            raise CemtoolError(f"{path} holds a run with another config than the study plans",
                               hint="move it away, or use another --out")
        cfg = stored
    if not resume or run.meta().get("status") != "completed":
        corpus = _corpus(cfg, corpora)
        if resume:
            run.lock()  # train() marks it running again once its checkpoint has loaded
        else:
            cfg = finalize_model_config(cfg, corpus)
            run = create_run(path, cfg, argv=sys.argv, device=str(dev),
                             extra_meta={"corpus": corpus.info, "study": str(study.path.resolve()),
                                         "item": item["name"]}, tokenizer=corpus.tokenizer)
        item.update(status="running", error=None)
        study.save()
        try:
            res = train(cfg, corpus, run, device=dev, resume=resume, callback=emit)
        except CemtoolError as e:
            item.update(status="failed", error=e.message)
            study.save()
            return
        finally:
            run.unlock()
        if res.status != "completed":
            raise KeyboardInterrupt  # train() caught a Ctrl-C and kept its last checkpoint
    meta = run.meta()
    item.update(status="completed", error=None, step=meta.get("step"), tokens=meta.get("tokens"),
                val_loss=meta.get("val_loss"), val_floor=meta.get("val_floor"), seconds=meta.get("train_seconds"))
    if "flops_per_token" not in item:
        from cemtool.analysis.compare import run_compute

        item.update(run_compute(cfg))
        item["total_flops"] = item["flops_per_token"] * (item["tokens"] or 0)
    study.save()


def _analyse(study: Study, item: dict, name: str, dev: torch.device, emit: Callback) -> None:
    """Run one analysis of one item unless its report exists."""
    plan = study.plan
    report, ft = _report_path(study.path, item, name, plan)
    entry = item["analyses"].setdefault(name, {"status": "pending", "report": None, "error": None})
    if ft is not None:
        entry["run"] = ft.name
    if report.exists():
        if entry["status"] != "completed":
            entry.update(status="completed", report=str(report.relative_to(study.path)), error=None)
            study.save()
        emit({"kind": "analysis", "analysis": name, "status": "skipped", "error": None})
        return
    entry.update(status="running", error=None)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "running", "error": None})
    t0 = time.perf_counter()
    run_path, options = study.path / item["run"], plan.options.get(name, {})
    try:
        if name == "sharpness":
            _sharpness(run_path, options, dev, emit)
        elif name == "collapse":
            _collapse(run_path, options, dev, emit)
        else:
            _forgetting(run_path, options, dev, emit, plan.target, ft)
    except CemtoolError as e:
        entry.update(status="failed", error=e.message, seconds=time.perf_counter() - t0)
        study.save()
        emit({"kind": "analysis", "analysis": name, "status": "failed", "error": e.message})
        return
    entry.update(status="completed", report=str(report.relative_to(study.path)), error=None,
                 seconds=time.perf_counter() - t0)
    study.save()
    emit({"kind": "analysis", "analysis": name, "status": "completed", "error": None})


__all__ = ["ANALYSES", "Plan", "Study", "item_config", "make_plan", "open_study", "run_sweep"]
