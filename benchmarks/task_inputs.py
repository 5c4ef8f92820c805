"""The inputs of the typed-tasks benchmark (benchmarks/tasks.py): the models, the extraction schemas and their
generated inputs (unicode, quotes, empty and very long texts), the classification variants and configurations,
the labelled sets, the multi-label items, and the defaults a classify task gets."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from nodeagent.tasks.contracts import ClassifyTask  # noqa: E402

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma-3-270m-it"}
# the unconstrained baseline's output cap: these schemas' objects take under 60 tokens, and the whole output
# must parse as JSON, so a longer answer is invalid anyway
UNCONSTRAINED_MAX_TOKENS = 128

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
               "properties": {"name": {"type": "string", "maxLength": 60},
                              "age": {"type": "integer", "minimum": 0, "maximum": 130},
                              "city": {"type": "string", "maxLength": 60}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["order", "items", "total"],
              "properties": {"order": {"type": "object", "additionalProperties": False, "required": ["id", "status"],
                                       "properties": {"id": {"type": "string", "maxLength": 20},
                                                      "status": {"enum": ["open", "shipped", "cancelled"]}}},
                             "items": {"type": "array", "maxItems": 5,
                                       "items": {"type": "object", "additionalProperties": False,
                                                 "required": ["sku", "qty"],
                                                 "properties": {"sku": {"type": "string", "maxLength": 16},
                                                                "qty": {"type": "integer", "minimum": 1,
                                                                        "maximum": 99}}}},
                             "total": {"type": "number", "minimum": 0, "maximum": 100000}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["rating", "sentiment", "pros", "cons"],
               "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                              "sentiment": {"enum": ["positive", "negative", "mixed"]},
                              "pros": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
                              "cons": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 40}},
                              "price": {"type": "number", "minimum": 0, "maximum": 10000}}},
    "place": {"type": "object", "additionalProperties": False, "required": ["city", "country", "lat", "lon"],
              "properties": {"city": {"type": "string", "maxLength": 60},
                             "country": {"enum": ["France", "Germany", "Japan", "Brazil", "Vietnam", "Poland",
                                                  "Other"]},
                             "lat": {"type": "number", "minimum": -90, "maximum": 90},
                             "lon": {"type": "number", "minimum": -180, "maximum": 180}}},
}
NAMES = ["Alice Martin", "Zoë Dubois", "Łukasz Nowak", "Nguyễn Ngọc Anh", "José Ángel Pérez", "王芳", "Ольга Иванова",
         "O'Brien \"Danny\" Walsh", "Søren Kierkegaard", "Amélie Poulain"]
CITIES = ["Paris", "Kraków", "Hà Nội", "São Paulo", "Zürich", "東京", "Reykjavík", "Dún Laoghaire"]
FILLER = ("The committee reviewed the minutes, the budget and the schedule for the coming quarter, and agreed to "
          "revisit the remaining items at the next session. ")


def extraction_inputs(n: int, seed: int = 7) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    while len(out) < n:
        i = len(out)
        name, city = rng.choice(NAMES), rng.choice(CITIES)
        kind = ["person", "order", "review", "place"][i % 4]
        if i % 25 == 0:
            text = "n/a"  # an input with nothing to extract (an empty one is refused by the contract)
        elif kind == "person":
            text = f"{name} ({rng.randint(1, 99)}) lives in {city} and said: \"I'd rather not 'quote' myself.\""
        elif kind == "order":
            items = ", ".join(f"{rng.randint(1, 9)} x SKU-{rng.randint(100, 999)}" for _ in range(rng.randint(1, 4)))
            text = f"Order #{rng.randint(1000, 9999)} is {rng.choice(['open', 'shipped', 'cancelled'])}: {items}. " \
                   f"Total {rng.randint(5, 900)}.{rng.randint(0, 99):02d} €."
        elif kind == "review":
            text = f"{rng.randint(1, 5)}/5 — {rng.choice(['Great', 'Awful', 'OK-ish'])} blender. Pros: quiet, cheap; " \
                   f"cons: «small jar». Paid ${rng.randint(10, 300)}."
        else:
            text = f"We met in {city} ({rng.uniform(-60, 60):.4f}, {rng.uniform(-150, 150):.4f}) — ça va? 😀"
        if i % 10 == 9:
            text = FILLER * 40 + text  # very long input, about 1.4k tokens
        out.append((kind, text))
    return out




# the scoring variants, each on its own node (its own KV cache, as a worker serving that prompt would have):
# the answer form, and whether the labels carry descriptions and the task examples
VARIANTS = {"label": ("label", False, False), "json": ("json", False, False),
            "json+descriptions": ("json", True, False), "json+examples": ("json", False, True)}
# what each variant's probabilities are computed as, from the same label scores: (calibrate, length_norm)
CONFIGS = {"sum": (False, False), "sum+calibrated": (True, False), "mean": (False, True),
           "mean+calibrated": (True, True)}
RAW_DIR = Path(os.environ.get("NODEAGENT_BENCH_RAW", "/tmp/nodeagent-bench"))  # per-item records, not committed


def labelled_sets(names: list[str]) -> list[dict]:
    """The project's own texts and the public sets, each as items (text, label, task) and, per task, its
    labels, label descriptions and examples."""
    own = json.loads((ROOT / "benchmarks/data/labelled.json").read_text())
    out = [{"set": "project", "what": "110 texts written by the team: sentiment (3 labels) and topic (5)",
            "items": own["items"],
            "tasks": {t: {"labels": labels, "descriptions": own["descriptions"][t], "examples": own["examples"][t]}
                      for t, labels in own["tasks"].items()}}]
    from benchmarks import public_sets

    for name in names:
        data = public_sets.load(name)
        if data is None:
            raise SystemExit(f"the public set {name} is not fetched: run python benchmarks/public_sets.py")
        out.append({"set": name, "what": data["what"], "license": data["license"], "package": data["package"],
                    "items": [{**it, "task": name} for it in data["items"]],
                    "tasks": {name: {"labels": data["labels"], "descriptions": data["descriptions"],
                                     "examples": data["examples"]}}})
    return out


def label_schema(task: ClassifyTask) -> dict:
    """The JSON route's response schema: {"label": one of the task's labels}."""
    return {"type": "object", "properties": {"label": {"enum": [lb.name for lb in task.labels]}},
            "required": ["label"]}


def variant_task(variant: str, spec: dict, text: str) -> ClassifyTask:
    answer, described, with_examples = VARIANTS[variant]
    labels = [{"name": n, "description": spec["descriptions"][n]} if described else n for n in spec["labels"]]
    # timed calibrated whatever the default: the neutral passes are in every variant's tasks/s
    return ClassifyTask(input=text, labels=labels, answer=answer, examples=spec["examples"] if with_examples else [],
                        calibrate=True)


# multi-label on texts that do carry several labels: BBC News items of two different topics, joined, and as many
# single items (each text used once), every label judged on its own
MULTI_PAIRS = 100


def multi_label_items(n_pairs: int, seed: int = 11) -> tuple[list[str], list[dict]]:
    """The labels and ``n_pairs`` texts made of two BBC News items of different topics (two labels), then
    ``n_pairs`` single items (one label)."""
    from benchmarks import public_sets

    data = public_sets.load("bbc_news")
    if data is None:
        raise SystemExit("the public set bbc_news is not fetched: run python benchmarks/public_sets.py")
    pool = list(data["items"])
    random.Random(seed).shuffle(pool)
    out = []
    for _ in range(n_pairs):
        a = pool.pop()
        b = pool.pop(next(i for i in range(len(pool) - 1, -1, -1) if pool[i]["label"] != a["label"]))
        out.append({"text": a["text"] + "\n\n" + b["text"], "labels": sorted({a["label"], b["label"]})})
    out += [{"text": it["text"], "labels": [it["label"]]} for it in pool[-n_pairs:]]
    return sorted(data["labels"]), out


def set_labels(name: str) -> list[list[str]]:
    """The label lists of a set's tasks."""
    from benchmarks.public_sets import SETS

    if name == "project":
        return list(json.loads((ROOT / "benchmarks/data/labelled.json").read_text())["tasks"].values())
    return [sorted(SETS[name].descriptions)]


def default_choice(labels: list[str] | None = None) -> tuple[str, str]:
    """The variant and configuration a classify task over ``labels`` gets when it sets none of the options."""
    from nodeagent.tasks.runner import calibrates

    task = ClassifyTask(input="x", labels=labels or ["a", "b", "c"])
    return task.answer, ("mean" if task.length_norm else "sum") + ("+calibrated" if calibrates(task) else "")


def default_name() -> str:
    task = ClassifyTask(input="x", labels=["a", "b"])
    return f"answer {task.answer}, calibrate {task.calibrate}, " + ("mean" if task.length_norm else "sum")
