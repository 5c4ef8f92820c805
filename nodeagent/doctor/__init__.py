"""`nodeagent doctor`: is this machine set up right for nodeagent? Each check says ok, warn or fail, one line
of detail, and the fix where there is one.

The checks are a list of small functions of one ``Edges`` (the machine, the environment, the broker, the hub,
the service manager: live, or recorded in tests); one more check is one more entry in ``CHECKS``.
"""

from __future__ import annotations

from typing import Callable

from nodeagent.doctor.build import llama_build_check, python_check, source_date_epoch_check, toolchain_check
from nodeagent.doctor.dirs import model_dir_check, secret_files_check, state_dir_check
from nodeagent.doctor.edges import Edges, live_edges
from nodeagent.doctor.network import broker_check, broker_settings_check, clock_check, hub_check
from nodeagent.doctor.service import service_check
from nodeagent.doctor.types import Check, passed
from nodeagent.errors import NodeAgentError

__all__ = ["CHECKS", "Check", "Edges", "live_edges", "passed", "run_checks"]

CHECKS: tuple[Callable[[Edges], Check | list[Check]], ...] = (
    llama_build_check, python_check, toolchain_check, source_date_epoch_check,  # the build, and a rebuild
    model_dir_check, state_dir_check, secret_files_check,
    broker_check, broker_settings_check, clock_check, hub_check,
    service_check,
)


def run_checks(edges: Edges, checks: tuple[Callable[[Edges], Check | list[Check]], ...] = CHECKS) -> list[Check]:
    """Every check, in order (one that reads several settings gives a finding each). A check that raises one of
    nodeagent's own errors fails with its message (and its hint as the fix) instead of stopping the others."""
    out: list[Check] = []
    for check in checks:
        try:
            got = check(edges)
            out.extend(got if isinstance(got, list) else [got])
        except NodeAgentError as exc:
            name = check.__name__.removesuffix("_check").replace("_", " ")
            out.append(Check(name=name, status="fail", detail=str(exc), fix=exc.hint))
    return out
