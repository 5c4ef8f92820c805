"""One error hierarchy. Every error carries an exit code and a hint for the user.

The CLI prints ``error: <message>`` and, when there is one, ``hint: <hint>`` on
stderr, then exits with ``exit_code``. Tracebacks only with ``--debug``.
"""

from __future__ import annotations


class NodeAgentError(Exception):
    """Base of every error nodeagent raises on purpose."""

    exit_code = 1
    default_hint: str | None = None

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint if hint is not None else self.default_hint

    def __str__(self) -> str:  # one line, no class name
        return self.message


class UsageError(NodeAgentError):
    """The user asked for something that cannot be done as asked."""

    exit_code = 2


class ConfigError(NodeAgentError):
    """A configuration file or variable holds a bad value."""

    exit_code = 3


class NotFoundError(NodeAgentError):
    """A model, profile or file that was named does not exist."""

    exit_code = 4


class ModelFileError(NodeAgentError):
    """A model file is not a GGUF file nodeagent can read (bad magic, truncated, hostile)."""

    exit_code = 5

    def __init__(self, message: str, *, offset: int | None = None, hint: str | None = None) -> None:
        self.offset = offset
        text = f"{message} (at byte offset {offset})" if offset is not None else message
        super().__init__(text, hint=hint)


class ProbeError(NodeAgentError):
    """The hardware probe could not read something it needs."""

    exit_code = 6


class PlanError(NodeAgentError):
    """No plan can be made for the request (as opposed to a plan that does not fit)."""

    exit_code = 7


class BackendError(NodeAgentError):
    """A backend failed to load or run a model."""

    exit_code = 8
