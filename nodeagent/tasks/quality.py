"""What the project measured of classification on a model, for the plan's reasons.

``benchmarks/tasks.py`` writes ``models/facts/classification.json``: per model file, for every labelled set it
ran, the default scoring's accuracy, the JSON route's accuracy and standard error, and the speed-up, and
whether the targets were met (accuracy at least the JSON route's less one standard error, at least 2x its
tasks/s). A plan for classification of a measured model cites the outcome, and says where the default fell
short, so a user can see it before trusting the labels.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from nodeagent.datafiles import data_dir

log = logging.getLogger(__name__)
FACTS_FILE = "classification.json"


def measured(model_file: str) -> dict[str, Any] | None:
    """The measurement of ``model_file`` (a file name), or None."""
    try:
        data = json.loads((data_dir("models") / "facts" / FACTS_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable classification facts: %s", exc)
        return None
    return data.get("models", {}).get(model_file)


def plan_reason(model_file: str) -> str | None:
    """The plan's reason for a measured model: the default's outcome against the JSON route, or None."""
    m = measured(model_file)
    if m is None:
        return None
    sets = m["sets"]
    short = [s for s in sets if not (s["accurate_enough"] and s["fast_enough"])]
    head = (f"classification measured on {len(sets)} labelled sets (benchmarks/tasks.py, {m['measured']}): the "
            f"default ({m['default']})")
    if not short:
        return (f"{head} is at least as accurate as the JSON route less one standard error on every set, at "
                f"{min(s['speedup'] for s in sets)}x its tasks/s or more")

    def missed(s: dict[str, Any]) -> str:
        out = []
        if not s["accurate_enough"]:
            out.append(f"accuracy {s['accuracy']} against the JSON route's {s['json_accuracy']} (SE {s['json_se']})")
        if not s["fast_enough"]:
            out.append(f"{s['speedup']}x the JSON route's tasks/s (target 2x)")
        return f"{s['set']}: " + " and ".join(out)

    others = ("no fixed variant measured meets both on every set" if not m["passing_variants"] else
              "fixed variants that meet both on every set: " + ", ".join(m["passing_variants"]))
    return (f"{head} falls short of a target on " + "; ".join(missed(s) for s in short)
            + f" ({others}; see docs/typed-tasks.md, Classification)")
