"""How many CPU threads torch uses, and why (docs/performance.md "CPU threads").

On a shared machine torch's default (one thread per core) spins its threads against the other jobs: the same
numbers take several times the CPU time. The rule, applied once per command by the CLI (:func:`apply`):

- a count the user gave is used as given: ``--threads N`` (before the command), else ``CEMTOOL_THREADS``, else
  ``OMP_NUM_THREADS`` (which torch reads itself); when a count given to cemtool (``--threads``,
  ``CEMTOOL_THREADS``) is more than the cores left free by the load average, a note says so (the run is slower than
  on idle cores; its numbers do not change). ``OMP_NUM_THREADS`` is the environment's own setting (schedulers, CI
  and test harnesses set it for every process): it is used without a note, and the load is in the provenance;
- with none given, torch's default (one thread per usable core) while the machine is idle; when the 1-minute load
  average leaves fewer cores free, one thread per free core (at least 1), with a note saying so.

The count a report was measured with is in its provenance (:func:`threads_info`).
"""

from __future__ import annotations

import math
import os
import sys

from cemtool.errors import UsageError

_chosen: dict = {}  # what apply() decided in this process


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float | None:
    """The 1-minute load average, None where the platform has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def asked(flag: int | None = None, env: dict | None = None) -> tuple[int | None, str | None]:
    """The thread count the user gave and where: ``--threads``, ``CEMTOOL_THREADS`` or ``OMP_NUM_THREADS``."""
    env = os.environ if env is None else env
    if flag is not None:
        return flag, "--threads"
    for var in ("CEMTOOL_THREADS", "OMP_NUM_THREADS"):
        raw = (env.get(var) or "").strip()
        if not raw:
            continue
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            if var == "OMP_NUM_THREADS":  # torch's own variable: torch decides what it makes of it
                return None, None
            raise UsageError(f"{var}={raw!r} is not a thread count", hint="give a whole number >= 1")
        return n, var
    return None, None


def choose(cores: int, load: float | None, n: int | None, source: str | None) -> tuple[int | None, str | None]:
    """(threads to set, or None for torch's default; a note or None). ``n``/``source``: what the user asked."""
    free = None if load is None else max(0.0, cores - load)
    if n is not None:
        note = None
        if source != "OMP_NUM_THREADS" and free is not None and n > max(1, math.floor(free + 0.5)):
            note = (f"{n} torch thread(s) as asked ({source}), but the load average is {load:.1f} on {cores} "
                    f"core(s) ({free:.1f} free): slower than on idle cores, the numbers are the same")
        return n, note
    if free is None or math.floor(free + 0.5) >= cores:
        return None, None
    threads = max(1, math.floor(free + 0.5))
    return threads, (f"the machine is busy (load average {load:.1f} on {cores} core(s)): using {threads} torch "
                     f"thread(s) instead of {cores}; set --threads N or CEMTOOL_THREADS to choose")


def apply(flag: int | None = None) -> str | None:
    """Decide the thread count for this process (see the module docstring), set it (``OMP_NUM_THREADS`` for a
    torch not yet imported and for worker processes; ``torch.set_num_threads`` for one already imported) and
    return the note to show, if any."""
    n, source = asked(flag)
    cores, load = usable_cores(), load_average()
    threads, note = choose(cores, load, n, source)
    if threads is not None and source != "OMP_NUM_THREADS":
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
    _chosen.clear()
    _chosen.update({"asked": source or "default", "cores": cores, "load_average": load})
    return note


def threads_info() -> dict:
    """For a report's provenance: torch's thread count (None if torch is not loaded), where it came from, the
    usable cores and the load average when the command started."""
    torch = sys.modules.get("torch")
    info = {"threads": torch.get_num_threads() if torch is not None else None,
            "asked": _chosen.get("asked", "default"), "cores": _chosen.get("cores", usable_cores()),
            "load_average": _chosen.get("load_average", load_average())}
    return info


__all__ = ["apply", "asked", "choose", "load_average", "threads_info", "usable_cores"]
