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

Grids: ``grid=("train.lr=1e-3,3e-3", ...)`` (``--grid``) trains every architecture x seed x grid point (the product
of all grids); each value is a ``--set`` override, and the item's name carries its point
(``<arch>-lr=3e-3-s<seed>``). :func:`select` picks each architecture's best point on such a tuning study (lowest
mean final validation loss over its seeds), writes ``selection.json`` into it with every point's results, and a
comparison study planned with ``arch_overrides`` (``--tuned DIR``) trains each architecture at its chosen values
on seeds disjoint from the tuning seeds (an overlap is refused).

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
               "analyses": [...], "target": str | null, "options": {analysis: {key: value}},
               "grid": ["key=v1,v2", ...], "arch_overrides": {arch: ["k=v", ...]}, "tuned_from": str | null},
      "items": [{
        "name": "<arch>-s<seed>" (with a grid "<arch>-<key>=<value>...-s<seed>"), "arch", "seed", "run": name,
        "point": {key: value} (with a grid),
        "status": "pending" | "running" | "completed" | "failed" | "interrupted", "error": str | null,
        "step", "tokens", "val_loss", "val_floor", "seconds",
        "params", "non_embedding", "flops_per_token", "flops_forward_per_token", "total_flops",
        "analyses": {"sharpness": {"status", "report", "error", "seconds"},
                     "collapse": {...}, "forgetting": {..., "run": "<arch>-s<seed>-ft-<target>"}}
      }, ...]
    }

The package, one module per reason to change: ``plan`` (the plan and its grids), ``options`` (the analyses'
options a study takes), ``manifest`` (the study directory and study.json), ``selection`` (a tuning study's choice),
``items`` (what one item does: training and the analyses), ``workers`` (the --jobs processes) and ``runner``
(:func:`run_sweep`). Import from ``cemtool.sweep``: every name below is re-exported here.
"""

from cemtool.sweep.items import Callback
from cemtool.sweep.manifest import (
    ITEM_STATUSES,
    SCHEMA_VERSION,
    STUDY_STATUSES,
    Study,
    check_manifest,
    check_new_study_dir,
    new_manifest,
    open_study,
    read_manifest,
    retuned_archs,
    study_extension,
)
from cemtool.sweep.options import analysis_names
from cemtool.sweep.plan import (
    MAX_RUN_NAME,
    MAX_RUNS,
    RESERVED,
    STEPS_KEY,
    Plan,
    check_data_source,
    grid_points,
    item_config,
    item_name,
    item_overrides,
    make_plan,
    parse_grid,
    parse_seeds,
    plan_notes,
)
from cemtool.sweep.runner import run_sweep
from cemtool.sweep.selection import SELECTION, grid_edges, grid_shortfall, plan_from_tuning, select

__all__ = ["analysis_names", "ITEM_STATUSES", "MAX_RUNS", "MAX_RUN_NAME",
           "RESERVED", "SCHEMA_VERSION", "SELECTION", "STEPS_KEY", "STUDY_STATUSES", "Callback",
           "Plan", "Study", "check_data_source", "check_manifest", "check_new_study_dir", "grid_edges",
           "grid_shortfall", "grid_points", "item_config", "item_name", "item_overrides", "make_plan", "new_manifest",
           "open_study", "parse_grid", "parse_seeds", "plan_from_tuning", "plan_notes", "read_manifest",
           "retuned_archs", "run_sweep", "select", "study_extension"]
