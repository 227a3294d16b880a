"""The options a study passes to each analysis (``-A name.key=value``), checked when the plan is made (before
anything trains): a registered analysis (cemtool.jobs) by its own Options dataclass; the fine-tune (forgetting) by
the table below."""

from __future__ import annotations

import json
import math

from cemtool import jobs
from cemtool.errors import CemtoolError, known_hint

FORGETTING_KEYS = {"steps", "warmup_steps", "eval_every", "eval_tokens", "checkpoint", "lr", "beta1", "beta2",
                   "weight_decay", "min_lr_ratio", "grad_clip"}


class _Names(tuple):
    """The analyses a study can run: every analysis registered in cemtool.jobs, and forgetting (a fine-tune)."""

    def _names(self) -> tuple[str, ...]:
        return (*jobs.ANALYSES, "forgetting")

    def __iter__(self):
        return iter(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __len__(self) -> int:
        return len(self._names())

    def __getitem__(self, i):
        return self._names()[i]


ANALYSES = _Names()


def _check_options(options: dict, chosen: list[str]) -> None:
    for name, opts in options.items():
        if name not in ANALYSES:
            raise CemtoolError(f"options for unknown analysis {name!r}", hint=f"choose from {', '.join(ANALYSES)}")
        if name not in chosen:
            raise CemtoolError(f"options given for {name}, which is not among the analyses",
                               hint="add it to --analyses")
        if name in jobs.ANALYSES:  # the analysis's own Options check its keys, types and ranges
            analysis_options(name, opts)
            continue
        bad = sorted(set(opts) - FORGETTING_KEYS)
        if bad:
            raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=known_hint(bad[0], FORGETTING_KEYS))
        _check_option_values(name, opts)


def analysis_options(name: str, opts: dict):
    """(the checkpoint, the Options) of a registered analysis from a study's -A values: one line naming -A
    name.key where one is refused."""
    rest = dict(opts)
    checkpoint = rest.pop("checkpoint", "final")
    if not isinstance(checkpoint, (str, int)) or isinstance(checkpoint, bool):
        raise CemtoolError(f"-A {name}.checkpoint={json.dumps(checkpoint)}: must be a string")
    known = set(jobs.get(name).options.__dataclass_fields__) - {"device"}
    bad = sorted(set(rest) - known)
    if bad:
        raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=known_hint(bad[0], known | {"checkpoint"}))
    try:
        return checkpoint, jobs.make_options(name, rest)
    except CemtoolError as e:
        raise CemtoolError(f"-A {e.message}" if e.message.startswith(f"{name}.") else f"-A {name}: {e.message}",
                           hint=e.hint) from None


# the analyses' options a sweep takes with -A, beyond the sharpness measurement's own (SharpnessOptions checks
# those): (type, lowest value, whether None is allowed); floats must also be finite
OPTION_VALUES = {
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
    for key, v in opts.items():
        if key in table:
            tp = table[key][0]
            check(key, tuple(v) if tp is tuple and isinstance(v, list) else v, *table[key])
    if name == "forgetting":
        for key in ("beta1", "beta2", "min_lr_ratio"):
            if key in opts and opts[key] > 1:
                raise CemtoolError(f"-A forgetting.{key}={opts[key]}: must be <= 1")


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
