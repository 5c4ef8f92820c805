"""Sample tasks for a running node, through the orchestrator client: classifications fanned out and fanned
back in, and extractions, with each Result printed. Used by scripts/quickstart."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

from nodeagent.client import Client
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask

REVIEWS = ["I waited two hours and the food was cold.", "Best pizza in town, friendly staff!",
           "The room was clean and the view was lovely.", "They lost my booking and nobody apologised.",
           "Great value, we will come back.", "The battery died after a week."]
PEOPLE = ["Alice Smith is 34 years old and lives in Paris.", "Bob Jones (52) moved to Lisbon last spring."]
SCHEMA = json.loads((Path(__file__).parent / "person.schema.json").read_text())


def main() -> int:
    client = Client()
    fan = client.map([ClassifyTask(input=t, labels=["positive", "negative", "neutral"]) for t in REVIEWS],
                     timeout=300)
    for i, r in fan.ok:
        print(f"classify  {REVIEWS[i]!r} -> {r.output.label} ({r.output.probabilities[r.output.label]:.2f})")
    people = client.map([ExtractTask(input=t, schema=SCHEMA) for t in PEOPLE], timeout=300)
    for i, r in people.ok:
        print(f"extract   {PEOPLE[i]!r} -> {json.dumps(r.output)}")
    for i, r in fan.failed + people.failed:
        print(f"failed    task {i}: {r.error.code}: {r.error.message}")
    print("labels:", dict(Counter(r.output.label for _, r in fan.ok)))
    return 0 if not (fan.failed or people.failed or fan.missing or people.missing) else 1


if __name__ == "__main__":
    sys.exit(main())
