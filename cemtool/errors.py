"""The one exception type cemtool raises for problems a user can fix.

The CLI turns a CemtoolError into a single line ``Error: <message>`` (plus an optional hint) and exit code 1.
Anything else is a bug and, with CEMTOOL_DEBUG=1, shows its traceback.
"""

from __future__ import annotations

import difflib


class CemtoolError(Exception):
    """A user-facing error: bad input, a missing or corrupt file, an impossible configuration."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class ConfigError(CemtoolError):
    """An invalid configuration value, key or file."""


class UsageError(CemtoolError):
    """A bad value given on the command line, refused on its own (before any file, run or data is read): exit 2,
    like Click's own usage errors, with one ``Error:`` line."""


def did_you_mean(word: str, choices: list[str] | tuple[str, ...] | set[str] | dict) -> str | None:
    """``"did you mean 'tmm'?"`` for the choice closest to a mistyped ``word`` (``difflib``: ratio >= 0.6), else
    None. The one spelling suggestion of cemtool: architectures, config keys, data sources, report names."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def known_hint(word: str, choices, what: str = "known") -> str:
    """A hint naming the closest choice first (when one is close) and then every choice."""
    close = did_you_mean(word, choices)
    listed = f"{what}: {', '.join(sorted(map(str, choices)))}"
    return f"{close} ({listed})" if close else listed
