"""The options a study passes to each analysis (``-A name.key=value``), checked when the plan is made (before
anything trains): a registered analysis (cemtool.jobs) by its own Options dataclass; the fine-tune (forgetting) by
the table below."""

from __future__ import annotations

import json

from cemtool import forgetting, jobs
from cemtool.errors import CemtoolError, known_hint


def analysis_names() -> tuple[str, ...]:
    """The analyses a study can run: every analysis registered in cemtool.jobs, and forgetting (a fine-tune, which
    trains a run of its own: cemtool.forgetting)."""
    return (*jobs.ANALYSES, "forgetting")


def options_class(name: str) -> type:
    """The Options dataclass of an analysis a study runs: the registered analysis's, or the fine-tune's."""
    return forgetting.Options if name == "forgetting" else jobs.get(name).options


def _check_options(options: dict, chosen: list[str]) -> None:
    known = analysis_names()
    for name, opts in options.items():
        if name not in known:
            raise CemtoolError(f"options for unknown analysis {name!r}", hint=f"choose from {', '.join(known)}")
        if name not in chosen:
            raise CemtoolError(f"options given for {name}, which is not among the analyses",
                               hint="add it to --analyses")
        analysis_options(name, opts)  # the analysis's own Options check its keys, types and ranges


def analysis_options(name: str, opts: dict):
    """(the checkpoint, the Options) of an analysis from a study's -A values: one line naming -A name.key where
    one is refused. The fine-tune's Options hold its source checkpoint; a registered analysis's checkpoint is the
    runner's."""
    cls = options_class(name)
    rest = dict(opts)
    known = set(cls.__dataclass_fields__) - {"device"}
    checkpoint = rest.get("checkpoint", "final") if "checkpoint" in known else rest.pop("checkpoint", "final")
    if not isinstance(checkpoint, (str, int)) or isinstance(checkpoint, bool):
        raise CemtoolError(f"-A {name}.checkpoint={json.dumps(checkpoint)}: must be a string")
    bad = sorted(set(rest) - known)
    if bad:
        raise CemtoolError(f"unknown {name} option {bad[0]!r}", hint=known_hint(bad[0], known | {"checkpoint"}))
    try:
        return checkpoint, cls(**rest)
    except TypeError as e:
        raise CemtoolError(f"-A {name}: {e}") from None
    except CemtoolError as e:
        raise CemtoolError(f"-A {e.message}" if e.message.startswith(f"{name}.") else f"-A {name}: {e.message}",
                           hint=e.hint) from None


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


__all__ = ["analysis_names", "analysis_options", "options_class"]
