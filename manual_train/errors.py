"""The one user-error type: every check in manual_train raises it, manual_train.cli.run prints it.

Its own module so that any module can raise it without importing the config (which imports the
checks of other modules): no import cycles.
"""
from __future__ import annotations

from typing import Optional


class UsageError(Exception):
    """A user error: printed as one `error: --flag: ...` line, exit status 2, no traceback."""

    def __init__(self, flag: str, what: str, allowed: Optional[str] = None):
        self.flag, self.what, self.allowed = flag, what, allowed
        text = f"{flag}: {what}" if flag else what
        if allowed:
            text += f" (allowed: {allowed})"
        super().__init__(text)
