"""One error hierarchy. Every error carries an exit code and a hint for the user.

The CLI prints ``error: <message>`` and, when there is one, ``hint: <hint>`` on
stderr, then exits with ``exit_code``. Tracebacks only with ``--debug``.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from pydantic import ConfigDict, Field

from nodeagent.values import Strict


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


class SettingError(UsageError):
    """A setting fixed by a flag, a variable or the config file cannot be honoured as given."""


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


class FetchError(NodeAgentError):
    """A model file could not be fetched from the package index."""

    exit_code = 9


class HubError(NodeAgentError):
    """The model hub (or a mirror) could not serve what was asked."""

    exit_code = 10


class InputError(UsageError):
    """The task's input is empty, too large, or not text."""


# A failed task's error, as its Result carries it (tasks/contracts.py): the code (declared in codes.py), the
# message, and whether another attempt may succeed. (A comment, not a docstring: the published schema is unchanged.)
class ErrorInfo(Strict):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    code: str = Field(description="Stable machine-readable code, e.g. input_too_long, invalid_output, deadline")
    message: str
    retryable: bool


class TaskFailed(NodeAgentError):
    """A task ran and failed: its code (declared in ``codes.py``), message, and whether another attempt
    may succeed (the code's own answer unless given) become its error Result, or an HTTP error."""

    exit_code = 12

    def __init__(self, code: str, message: str, retryable: bool | None = None, *, hint: str | None = None) -> None:
        from nodeagent.codes import code as lookup

        super().__init__(message, hint=hint)
        self.code = code
        self.retryable = lookup(code).retryable if retryable is None else retryable

    @property
    def info(self) -> "ErrorInfo":
        """The ErrorInfo of the Result."""
        return ErrorInfo(code=self.code, message=self.message, retryable=self.retryable)


class HttpError(NodeAgentError):
    """A request the HTTP door refuses or fails, in OpenAI's error shape: the status, the error's type, its code
    and the parameter it is about. The middleware renders any that reaches it (``tasks/openai/fields.py``'s
    ``Refused``, a request's checks, is one, and a ValueError for library callers)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.code, self.headers, self.param = status, kind, code, headers or {}, param

    @classmethod
    def of_task(cls, failed: "TaskFailed") -> "HttpError":
        """A task's failure as HTTP: the status its code is declared with."""
        from nodeagent.codes import code

        declared = code(failed.code)
        status = declared.http_status
        return cls(status, failed.message, "invalid_request_error" if status < 500 else "server_error", failed.code,
                   param=declared.param)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def renamed(self, names: Mapping[str, str]) -> "HttpError":
        """The error in another request's names (a Responses request's, for the chat request it runs as): the field
        it is about (``param``: ``max_tokens`` -> ``max_output_tokens``, ``messages.0`` -> ``input.0``), and that
        field's name where its message says it. An error about no field of ``names`` is itself."""
        if not self.param:
            return self
        head = re.split(r"[.\[]", self.param, maxsplit=1)[0]
        if head not in names:
            return self
        new = names[head]
        message = re.sub(rf"\b{re.escape(head)}\b", new, self.message)
        return HttpError(self.status, message, self.kind, self.code, headers=self.headers,
                         param=new + self.param[len(head):])


class TemplateError(NodeAgentError):
    """A chat template failed to render, or broke the sandbox's limits."""

    exit_code = 13


class ConflictError(NodeAgentError):
    """What was asked for would overwrite something that exists (a task id already queued)."""

    exit_code = 15


class BrokerError(NodeAgentError):
    """The queue (SQLite or Redis) could not be reached or refused an operation: usually a passing outage."""

    exit_code = 16


def param_of(exc: Any, skip: tuple[str, ...] = (), tags: tuple[str, ...] = ()) -> str | None:
    """The field a pydantic ValidationError (or FastAPI's RequestValidationError) is about, as OpenAI's ``param``
    names one: its first error's location joined by dots, less the parts in ``skip`` (FastAPI's ``body``) and the
    parts that begin with one of ``tags`` (the members of a union, which pydantic names in a location:
    ``list[int]``); None when no part is left."""
    errors = exc.errors()
    if not errors:
        return None
    parts = [str(p) for p in errors[0].get("loc", ()) if str(p) not in skip and not str(p).startswith(tags)]
    return ".".join(parts) or None


def validation_message(exc: Any, skip: tuple[str, ...] = ()) -> str:
    """A pydantic ValidationError (or FastAPI's RequestValidationError) in one line: its first error's message
    and where (``skip``: location parts left out, such as FastAPI's ``body``)."""
    errors = exc.errors()
    if not errors:
        return "invalid"
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p not in skip)
    return str(first["msg"]).removeprefix("Value error, ") + (f" ({where})" if where else "")
