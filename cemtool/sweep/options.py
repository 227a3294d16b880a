"""The options a study passes to each analysis (``-A name.key=value``): the analyses a study can run, which keys each
takes, their types and ranges, and collapse's defaults, all checked when the plan is made (before anything trains).

A copy of the analyses' own option types, kept together in this one module so that it can be replaced by them."""

from __future__ import annotations

import json
import math
from dataclasses import fields

from cemtool.analysis.sharpness import SharpnessOptions
from cemtool.errors import CemtoolError, known_hint

ANALYSES = ("sharpness", "collapse", "forgetting")
COLLAPSE_DEFAULTS = {"checkpoint": "final", "tokens": 16384, "seq_len": None, "batch_size": 16, "alpha": 0.5,
                     "words": None, "k": 4, "folds": 5, "per_class": 256, "min_per_class": 16,
                     "seed": 0}  # cemtool collapse-report's
FORGETTING_KEYS = {"steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint", "lr", "beta1", "beta2",
                   "weight_decay", "min_lr_ratio", "grad_clip"}


def _check_options(options: dict, chosen: list[str]) -> None:
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
            raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=known_hint(bad[0], known[name]))
        _check_option_values(name, opts)


# the analyses' options a sweep takes with -A, beyond the sharpness measurement's own (SharpnessOptions checks
# those): (type, lowest value, whether None is allowed); floats must also be finite
OPTION_VALUES = {
    "sharpness": {"tokens": (int, 1, False), "checkpoint": (str, None, False)},
    "collapse": {"checkpoint": (str, None, False), "tokens": (int, 1, False), "seq_len": (int, 1, True),
                 "batch_size": (int, 1, False), "alpha": (float, 0.0, False), "words": (str, None, True),
                 "k": (int, 1, False), "folds": (int, 2, False), "per_class": (int, 1, False),
                 "min_per_class": (int, 1, False), "seed": (int, 0, False)},
    "forgetting": {"steps": (int, 1, False), "warmup_steps": (int, 0, False), "eval_every": (int, 1, False),
                   "eval_tokens": (int, 1, False), "checkpoint": (str, None, False), "lr": (float, 0.0, False),
                   "beta1": (float, 0.0, False), "beta2": (float, 0.0, False), "weight_decay": (float, 0.0, False),
                   "min_lr_ratio": (float, 0.0, False), "grad_clip": (float, 0.0, False)},
}


def _check_option_values(name: str, opts: dict) -> None:
    """Every -A value of one analysis is of its type and in range, before the study exists (not after a run has
    trained): a NaN, a negative count or a string where a number goes is refused."""
    def check(key: str, v, tp: type, low, none_ok: bool) -> None:
        if v is None and none_ok:
            return
        if tp is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        elif tp is int:
            ok = _whole(v)
        else:
            ok = isinstance(v, tp)
        if not ok or (low is not None and v < low):
            want = {int: "a whole number", float: "a finite number", str: "a string", bool: "true or false",
                    tuple: "a list"}.get(tp, tp.__name__)
            raise CemtoolError(f"-A {name}.{key}={json.dumps(v)}: must be {want}"
                               + (f" >= {low}" if low is not None else ""))

    table = dict(OPTION_VALUES.get(name, {}))
    if name == "sharpness":
        for f in fields(SharpnessOptions):
            if f.name in table or f.name == "device" or f.name not in opts:
                continue
            default = f.default
            tp = type(default) if default is not None else float  # graph_memory, density_sigma: numbers or null
            table[f.name] = (tp, None, default is None)
    for key, v in opts.items():
        if key in table:
            tp = table[key][0]
            check(key, tuple(v) if tp is tuple and isinstance(v, list) else v, *table[key])
    if name == "forgetting":
        for key in ("beta1", "beta2", "min_lr_ratio"):
            if key in opts and opts[key] > 1:
                raise CemtoolError(f"-A forgetting.{key}={opts[key]}: must be <= 1")
    if name == "sharpness":
        rest = {k: tuple(v) if isinstance(v, list) else v for k, v in opts.items() if k not in ("tokens", "checkpoint")}
        try:
            SharpnessOptions(**rest)  # its own checks (ranges, methods, Lanczos steps against k)
        except TypeError as e:
            raise CemtoolError(f"-A sharpness: {e}") from None


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
