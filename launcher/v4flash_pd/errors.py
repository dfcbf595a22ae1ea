"""The one exception type for problems a user can fix.

The CLI prints these as one paragraph (problem, then the fix) without a traceback; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_RUNTIME = 1
EXIT_USAGE = 2


class UserError(Exception):
    """A problem the operator can fix: `message` names it, `hint` says how to fix it."""

    def __init__(self, message: str, hint: str = "", exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.exit_code = exit_code

    def render(self) -> str:
        text = f"error: {self.message}"
        if self.hint:
            text += f"\n  fix: {self.hint}"
        return text


class RuntimeFailure(UserError):
    """A run-time failure (a worker died, a probe timed out): exit code 1, not 2."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message, hint, exit_code=EXIT_RUNTIME)
