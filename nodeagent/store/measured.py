"""What `nodeagent bench` leaves in the state directory: one summary per model file (its tasks/s, the slot
count it recommended and the draft length that pays). The planner's reasons (a slot count bench applied, the
draft length), the node's registration (its throughput for the scheduler) and bench itself read and write it
here, below all of them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
BENCH_DIR = "bench"  # under the state directory


def tasks_per_s(result: dict[str, Any]) -> float:
    """A node's throughput on the model for the scheduler: the best slot count's mean of extraction and
    classification tasks per second; for an embedding model (``bench/embed.py``'s result), its tasks of one text
    per second, one at a time or in flight together, whichever was faster."""
    if "in_flight" in result:
        f = result["in_flight"]
        return max(f["one_at_a_time_tasks_per_s"], f["in_flight_tasks_per_s"])
    return max((s["tasks"]["extract"]["per_min"] + s["tasks"]["classify"]["per_min"]) / 2 / 60
               for s in result["slots"])


def record_path(state_dir: Path, model_file: str) -> Path:
    return Path(state_dir) / BENCH_DIR / f"{Path(model_file).name}.json"


def remember(result: dict[str, Any], state_dir: Path, applied: bool = False) -> Path:
    """What this node measured, where its registration (the scheduler's throughput) and its plans (the reasons
    for an applied slot count) read it."""
    out = record_path(state_dir, result["model_file"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model_file": Path(result["model_file"]).name, "tasks_per_s": round(tasks_per_s(
        result), 3), "quick": result.get("quick", False), "created": result["created"], "profile": result["profile"],
        "recommendation": result.get("recommendation"), "applied": applied,
        "drafts": {k: result["drafts"][k] for k in ("draft_tokens", "gain", "reason")} if result.get("drafts")
        else None,
        "embeddings_per_s": max(r["embeddings_per_s"] for r in result["batches"]) if "batches" in result
        else None, "prefix": _prefix(result)}) + "\n")
    return out


def _prefix(result: dict[str, Any]) -> dict[str, Any] | None:
    """Of bench's warm prefixes, the length read back nearest a 1,000-token prefix: its prefill and its restore."""
    done = [p for p in (result.get("prefixes") or {}).get("lengths", []) if p["restored"]]
    if not done:
        return None
    p = min(done, key=lambda p: abs(p["prompt_tokens"] - 1000))
    return {k: p[k] for k in ("prompt_tokens", "prefill_s", "prefill_tps", "state_bytes", "restore_s",
                              "prefill_over_restore")}


def measured_prefix(state_dir: Path, model_file: str) -> str | None:
    """The plan's line for a warm prefix `nodeagent bench` measured for the model file on this device: its prefill
    against its restore from disk; or None."""
    try:
        record = json.loads(record_path(state_dir, model_file).read_text())
        p = record["prefix"]
        return (f"warm prefixes measured here by nodeagent bench on {record['created'][:10]}: a "
                f"{p['prompt_tokens']:,}-token prefix is read from its tokens in {p['prefill_s']:.2f} s "
                f"({p['prefill_tps']:g} tok/s) and back from disk in {p['restore_s']:.3f} s "
                f"(x{p['prefill_over_restore']:g} faster; {p['state_bytes'] / 1e6:.1f} MB)")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measured_embeddings(state_dir: Path, model_file: str) -> str | None:
    """The plan's line for an embedding model `nodeagent bench` measured on this device, or None."""
    try:
        record = json.loads(record_path(state_dir, model_file).read_text())
    except (OSError, ValueError):
        return None
    if not record.get("embeddings_per_s"):
        return None
    return (f"measured {record['embeddings_per_s']:g} embeddings/s at best and {record['tasks_per_s']:g} tasks/s "
            f"of one text on this device by nodeagent bench on {record['created'][:10]}")


def measured_reason(state_dir: Path, model_file: str, slots: int) -> str | None:
    """The plan's reason for a slot count `nodeagent bench --apply` chose from its measurement, or None."""
    try:
        record = json.loads(record_path(state_dir, model_file).read_text())
    except (OSError, ValueError):
        return None
    rec = record.get("recommendation") or {}
    if not record.get("applied") or rec.get("slots") != slots:
        return None
    return (f"slots {slots}: measured x{rec['speedup']:.2f} tasks/min over one slot on this device by nodeagent "
            f"bench on {record['created'][:10]} ({rec['reason']})")


def measured_drafts(state_dir: Path, model_file: str) -> tuple[int, str] | None:
    """The draft length `nodeagent bench` found pays for the model file on this device (0: none do) and why, or
    None where it has not measured them."""
    try:
        record = json.loads(record_path(state_dir, model_file).read_text())
        d = record["drafts"]
        return int(d["draft_tokens"]), f"{d['reason']}; measured by nodeagent bench on {record['created'][:10]}"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def throughputs(state_dir: Path) -> dict[str, float]:
    """Tasks/s per model file that `nodeagent bench` measured on this node."""
    out: dict[str, float] = {}
    for path in sorted((Path(state_dir) / BENCH_DIR).glob("*.json")):
        try:
            data = json.loads(path.read_text())
            out[str(data["model_file"])] = float(data["tasks_per_s"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("ignoring the bench summary %s: it cannot be read", path)
    return out
