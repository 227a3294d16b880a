"""The one exception type cemtool raises for problems a user can fix.

The CLI turns a CemtoolError into a single line ``Error: <message>`` (plus an optional hint) and exit code 1.
Anything else is a bug and, with CEMTOOL_DEBUG=1, shows its traceback.
"""

from __future__ import annotations


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
