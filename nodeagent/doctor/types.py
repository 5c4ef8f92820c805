"""What a doctor check says: its name, ok / warn / fail, one line of detail, and the fix where there is one."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nodeagent.values import Frozen

Status = Literal["ok", "warn", "fail"]


class Check(Frozen):
    """One finding about this machine's setup. ``fail`` makes `nodeagent doctor` exit 1; ``warn`` does not."""

    name: str
    status: Status
    detail: str = Field(description="One line: what was compared and what was found")
    fix: str | None = Field(None, description="The command to run (or the setting to change), where there is one")


def ok(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name=name, status="ok", detail=detail, fix=fix)


def warn(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name=name, status="warn", detail=detail, fix=fix)


def fail(name: str, detail: str, fix: str | None = None) -> Check:
    return Check(name=name, status="fail", detail=detail, fix=fix)


def passed(checks: list[Check]) -> bool:
    """Whether nothing failed (warnings pass)."""
    return all(c.status != "fail" for c in checks)
