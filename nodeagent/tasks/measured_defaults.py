"""What the project measured of a task type's default on a model, for the plan's reasons.

- ``benchmarks/tasks.py`` writes ``models/facts/classification.json``: per model file, for every labelled set
  it ran, the default scoring's accuracy, the JSON route's accuracy and standard error, and the speed-up, and
  whether the targets were met (accuracy at least the JSON route's less one standard error, at least 2x its
  tasks/s).
- ``benchmarks/extract_quality.py`` writes ``models/facts/extraction.json`` the same way for the default prompt
  form against the hand-written llama-cpp-python route (targets: field accuracy at least its plus one standard
  error, at least 2x its tasks/s, every output schema-valid).

A plan for a measured model cites the outcome, and says where the default fell short, so a user can see it
before trusting the output.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from nodeagent.datafiles import data_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measured:
    """One task type's measurement: where it is, what wrote it, what the default is compared with, and the
    accuracy target against that route (as the reason words it)."""

    facts_file: str
    task: str
    benchmark: str
    route: str
    target: str
    docs: str
    reference_key: str  # the set's field holding the route's accuracy
    reference_se_key: str  # and its standard error


KINDS = {
    "classify": Measured("classification.json", "classification", "benchmarks/tasks.py", "the JSON route",
                         "at least as accurate as the JSON route less one standard error", "Classification",
                         "json_accuracy", "json_se"),
    "extract": Measured("extraction.json", "extraction", "benchmarks/extract_quality.py", "the hand-written route",
                        "at least as accurate as the hand-written route plus one standard error, every output "
                        "schema-valid,", "Extraction accuracy", "reference_accuracy", "reference_se"),
}


def measured(model_file: str, task: str = "classify") -> dict[str, Any] | None:
    """The measurement of ``model_file`` (a file name) for ``task`` (classify, extract), or None."""
    kind = KINDS[task]
    try:
        data = json.loads((data_dir("models") / "facts" / kind.facts_file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s facts: %s", kind.task, exc)
        return None
    return data.get("models", {}).get(model_file)


def plan_reason(model_file: str, task: str = "classify") -> str | None:
    """The plan's reason for a measured model: the default's outcome against the task's reference route, or
    None (a task type or a model file the project did not measure)."""
    kind = KINDS.get(task)
    m = measured(model_file, task) if kind is not None else None
    if kind is None or m is None:
        return None
    sets = m["sets"]
    short = [s for s in sets if not (s["accurate_enough"] and s["fast_enough"] and s.get("all_valid", True))]
    head = (f"{kind.task} measured on {len(sets)} labelled sets ({kind.benchmark}, {m['measured']}): the "
            f"default ({m['default']})")
    if not short:
        return f"{head} is {kind.target} on every set, at {min(s['speedup'] for s in sets)}x its tasks/s or more"

    def missed(s: dict[str, Any]) -> str:
        out = []
        if not s["accurate_enough"]:
            out.append(f"accuracy {s['accuracy']} against {kind.route}'s {s[kind.reference_key]} "
                       f"(SE {s[kind.reference_se_key]})")
        if not s["fast_enough"]:
            out.append(f"{s['speedup']}x {kind.route}'s tasks/s (target 2x)")
        if not s.get("all_valid", True):
            out.append("an output not schema-valid")
        return f"{s['set']}: " + " and ".join(out)

    others = ("no fixed variant measured meets the targets on every set" if not m["passing_variants"] else
              "fixed variants that meet them on every set: " + ", ".join(m["passing_variants"]))
    return (f"{head} falls short of a target on " + "; ".join(missed(s) for s in short)
            + f" ({others}; see docs/typed-tasks.md, {kind.docs})")
