"""Typed tasks on real models, compared side by side in one run.

Classification: label scoring (nodeagent) vs the naive way (llama-cpp-python
chat completion with a JSON response format listing the labels): tasks/s,
p50/p95 latency and accuracy on benchmarks/data/labelled.json (110 texts
written by the team). Extraction: over 200 generated, varied inputs (unicode,
quotes, empty and very long texts; flat, nested and array schemas, enums,
bounded numbers), the share of schema-valid outputs from constrained decoding
vs unconstrained generation with the schema in the prompt.

Usage: python benchmarks/tasks.py [--models smollm2,gemma] [--extract N]
Writes benchmarks/results/tasks.json and tasks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import read_results, rewrite_markdown, write_results  # noqa: E402

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # no spin-waiting threads if the machine is shared

from benchmarks.stats import pct  # noqa: E402
from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.contracts import ClassifyTask, ExtractTask  # noqa: E402
from nodeagent.tasks.prompts import classify_messages, extract_messages, fallback_for, render_prompt  # noqa: E402
from nodeagent.tasks.schema import validate_output  # noqa: E402

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


def classify_sets(plan, config, path: Path, runner, llm, n_classify: int | None, set_names: list[str]) -> dict:
    """Every scoring variant and the JSON route over every set, alternating item by item (the order rotates).
    Each item's label probabilities (sum and mean, and the content-free inputs' under the same prompt) are
    kept per variant in the raw record (RAW_DIR), and the figures are computed from it (``summarise``), so a
    new way to read the same scores needs no new run (``--from-raw``)."""
    from nodeagent.node import Node
    from nodeagent.tasks.runner import _probabilities, calibrated, calibrates

    runners, nodes = {"json": runner}, []
    for v in VARIANTS:
        if v not in runners:
            nodes.append(Node(str(path), config=config, task="classify", ctx_tokens=plan.settings.n_ctx))
            runners[v] = nodes[-1].runner()
    methods = [*VARIANTS, "json_route"]
    raw: dict = {}
    for st in labelled_sets(set_names):
        items = st["items"] if n_classify is None else random.Random(3).sample(st["items"], min(n_classify,
                                                                                               len(st["items"])))
        rec = {v: {"latency_s": [], "sum": [], "mean": [], "neutral_sum": [], "neutral_mean": [], "rerun_diff": 0.0}
               for v in VARIANTS}
        naive = {"latency_s": [], "pred": [], "invalid": 0}
        for i, item in enumerate(items):
            spec = st["tasks"][item["task"]]
            for method in methods[i % len(methods):] + methods[:i % len(methods)]:
                if method == "json_route":
                    # llama-cpp-python's chat completion with a JSON response format listing the labels
                    task = variant_task("label", spec, item["text"])
                    schema = label_schema(task)
                    t0 = time.perf_counter()
                    done = llm.create_chat_completion(classify_messages(task), max_tokens=24, temperature=0,
                                                      response_format={"type": "json_object", "schema": schema})
                    naive["latency_s"].append(time.perf_counter() - t0)
                    try:
                        label = json.loads(done["choices"][0]["message"]["content"])["label"]
                    except (ValueError, KeyError, TypeError):
                        label = None
                        naive["invalid"] += 1
                    naive["pred"].append(label)
                    continue
                r, task = runners[method], variant_task(method, spec, item["text"])
                t0 = time.perf_counter()
                result = r.run(task)  # as a worker runs it: the task's own options
                rec[method]["latency_s"].append(time.perf_counter() - t0)
                assert result.status == "ok", result.error
                # every option's probabilities from one more pass over the same prompt (its KV cache reused)
                scores = r._label_scores(task, task.input, [], {}, {})
                names = spec["labels"]
                for key, norm in (("sum", False), ("mean", True)):
                    probs = _probabilities(scores, norm)
                    neutral = r._neutral_probs(task.model_copy(update={"length_norm": norm}), [])
                    rec[method][key].append([float(x) for x in probs])
                    rec[method]["neutral_" + key].append([float(x) for x in neutral])
                    if norm == task.length_norm:
                        got = calibrated(probs, neutral) if calibrates(task) else probs
                        diff = max(abs(float(got[j]) - result.output.probabilities[n_]) for j, n_ in enumerate(names))
                        rec[method]["rerun_diff"] = max(rec[method]["rerun_diff"], diff)
        raw[st["set"]] = {"meta": {k: st[k] for k in ("what", "license", "package") if k in st},
                          "gold": [it["label"] for it in items],
                          "labels": [st["tasks"][it["task"]]["labels"] for it in items],
                          "json_route": naive, "variants": rec}
        entry = summarise(raw[st["set"]])
        print(st["set"], json.dumps({v: e["configs"]["sum+calibrated"]["accuracy"] for v, e in entry["variants"].items()}),
              "json route", entry["json_route"]["accuracy"], file=sys.stderr)
    RAW_DIR.mkdir(parents=True, exist_ok=True)
    (RAW_DIR / f"tasks-{path.stem}.json").write_text(json.dumps(raw))
    for nd in nodes:
        nd.close()
    return {name: summarise(r) for name, r in raw.items()}


def summarise(raw: dict) -> dict:
    """One set's figures from its raw record: the JSON route's, and every variant's in every configuration
    (accuracy, SE, macro-F1, ECE of the top label), multi-label's per-label ECE, tasks/s."""
    from benchmarks.stats import accuracy_se, expected_calibration_error, macro_f1
    from nodeagent.tasks.runner import calibrated

    gold, naive, n = raw["gold"], raw["json_route"], len(raw["gold"])
    naive_total = sum(naive["latency_s"])
    acc, se = accuracy_se(sum(p == g for p, g in zip(naive["pred"], gold)), n)
    entry = {**raw["meta"], "items": n,
             "json_route": {"tasks_per_s": round(n / naive_total, 3), "p50_s": round(pct(naive["latency_s"], .5), 4),
                            "accuracy": round(acc, 4), "se": round(se, 4),
                            "macro_f1": round(macro_f1(gold, naive["pred"]), 4), "invalid": naive["invalid"]},
             "variants": {}}
    for v, d in raw["variants"].items():
        total = sum(d["latency_s"])
        configs = {}
        for c, (cal, norm) in CONFIGS.items():
            key = "mean" if norm else "sum"
            pred, conf = [], []
            for names, probs, neutral in zip(raw["labels"], d[key], d["neutral_" + key]):
                probs = np.array(probs)
                if cal:
                    probs = calibrated(probs, np.array(neutral))
                pred.append(names[int(probs.argmax())])
                conf.append(float(probs.max()))
            correct = [p == g for p, g in zip(pred, gold)]
            acc, se = accuracy_se(sum(correct), n)
            configs[c] = {"accuracy": round(acc, 4), "se": round(se, 4), "macro_f1": round(macro_f1(gold, pred), 4),
                          "ece": round(expected_calibration_error(conf, correct), 4)}
        # multi-label, per label: each (item, label) pair a yes/no case, the label's own probability
        multi = {"calibrated": ([], []), "uncalibrated": ([], [])}
        for names, probs, neutral, g in zip(raw["labels"], d["sum"], d["neutral_sum"], gold):
            for k, own in (("calibrated", calibrated(np.array(probs), np.array(neutral))), ("uncalibrated", probs)):
                multi[k][0].extend(map(float, own))
                multi[k][1].extend(n_ == g for n_ in names)
        entry["variants"][v] = {
            "tasks_per_s": round(n / total, 3), "p50_s": round(pct(d["latency_s"], .5), 4),
            "p95_s": round(pct(d["latency_s"], .95), 4),
            "speedup_vs_json_route": round((n / total) / (n / naive_total), 2), "configs": configs,
            "multi_label_ece_per_label": {k: round(expected_calibration_error(*pairs), 4) for k, pairs in multi.items()},
            "rerun_max_abs_diff": round(d["rerun_diff"], 6)}
    return entry


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


def multi_label_run(runner, n_pairs: int) -> dict:
    """The default multi-label task over ``multi_label_items``: what the runner chose, and every item's label
    shares and the content-free inputs' (the raw record ``summarise_multi`` reads)."""
    from nodeagent.tasks.runner import _probabilities, threshold

    labels, items = multi_label_items(n_pairs)
    rec: dict = {"labels": labels, "gold": [], "probs": [], "chosen": [], "latency_s": []}
    task = None
    for it in items:
        task = ClassifyTask(input=it["text"], labels=labels, multi_label=True)  # every other option its default
        t0 = time.perf_counter()
        result = runner.run(task)
        rec["latency_s"].append(time.perf_counter() - t0)
        assert result.status == "ok", result.error
        rec["chosen"].append(sorted(result.output.labels))
        rec["gold"].append(it["labels"])
        rec["probs"].append([float(x) for x in _probabilities(runner._label_scores(task, task.input, [], {}, {}),
                                                              task.length_norm)])
    rec["neutral"] = [float(x) for x in runner._neutral_probs(task, [])]
    rec["threshold"], rec["threshold_setting"], rec["calibrate"] = threshold(task), task.threshold, task.calibrate
    return rec


# multi-label's per-label forms that do not sum to 1, measured against the default on the same scores (a the
# label's share of the answer under the text, b under the content-free inputs, K labels)
PER_LABEL_FORMS = {
    # the label's odds under the text over its odds under the content-free inputs, times the odds 1 to K - 1
    # of a label that the prompt does not favour
    "odds_ratio": lambda a, b: 1 / (1 + np.exp(-(np.log(a / (1 - a)) - np.log(b / (1 - b)) - np.log(a.shape[-1] - 1)))),
    # the ratio of the shares at prior odds 1 to K - 1 (the default before this measurement)
    "share_ratio": lambda a, b: a / (a + (a.shape[-1] - 1) * b),
    "even_odds": lambda a, b: a / (a + b),  # the ratio of the shares at even odds (the one before that)
}
MULTI_THRESHOLDS = (0.2, 0.3, 0.4, 0.5)


def summarise_multi(rec: dict) -> dict:
    """Per-label ECE (each (text, label) a yes/no case), how often the chosen labels are exactly the text's, how
    often both labels of a two-label text are chosen, and the chosen labels' precision and recall: the runner's
    probabilities calibrated (its default) and uncalibrated, and the per-label forms that do not sum to 1; the
    calibrated ones also at other thresholds."""
    from benchmarks.stats import expected_calibration_error
    from nodeagent.tasks.runner import calibrated

    labels, gold = rec["labels"], rec["gold"]
    truth = np.array([[lb in g for lb in labels] for g in gold])
    pairs = np.array([len(g) == 2 for g in gold])
    out = {"texts": len(gold), "two_label_texts": int(pairs.sum()), "threshold": rec["threshold"],
           "threshold_setting": rec.get("threshold_setting", rec["threshold"]),
           "default_calibrate": rec["calibrate"],
           "tasks_per_s": round(len(gold) / sum(rec["latency_s"]), 3),
           "default_exact_match": round(float(np.mean([c == g for c, g in zip(rec["chosen"], gold)])), 4)}
    shares, neutral = np.array(rec["probs"]), np.array(rec["neutral"])
    a, b = np.clip(shares, 1e-12, 1 - 1e-12), np.clip(neutral, 1e-12, 1 - 1e-12)

    def chosen_figures(chosen: np.ndarray) -> dict:
        hits = (chosen & truth).sum()
        return {"exact_match": round(float((chosen == truth).all(axis=1).mean()), 4),
                "both_found": round(float(((chosen & truth).sum(axis=1)[pairs] == 2).mean()), 4),
                "precision": round(float(hits / max(chosen.sum(), 1)), 4), "recall": round(float(hits / truth.sum()), 4)}

    forms = {"uncalibrated": shares, "calibrated": np.array([calibrated(row, neutral) for row in shares]),
             **{k: f(a, b) for k, f in PER_LABEL_FORMS.items()}}
    for key, probs in forms.items():
        out[key] = {"ece_per_label": round(expected_calibration_error(list(map(float, probs.ravel())),
                                                                      list(truth.ravel())), 4),
                    **chosen_figures(probs >= rec["threshold"])}
    out["calibrated_by_threshold"] = {str(t): chosen_figures(forms["calibrated"] >= t) for t in MULTI_THRESHOLDS}
    out["ece_halved"] = bool(out["calibrated"]["ece_per_label"] <= out["uncalibrated"]["ece_per_label"] / 2)
    return out


def run_model(key: str, n_extract: int, n_classify: int | None = None, sets: list[str] = (),
              n_multi: int = MULTI_PAIRS, classify: bool = True) -> dict:
    import llama_cpp

    from nodeagent.node import Node

    path = test_model_path(MODELS[key], resolve(env=dict(os.environ))["test_models_dir"])
    # planned for classification, as `nodeagent run classify` plans: label branches run as parallel sequences.
    # Two nodes of the same plan, one per method, so each keeps its own KV cache and the methods can
    # alternate item by item: on a shared, noisy machine both then see the same load
    config = resolve(env={})
    node = Node(str(path), config=config, task="classify", ctx_tokens=4096)
    naive_node = Node(str(path), config=config, task="classify", ctx_tokens=4096)
    assert naive_node.plan.settings == node.plan.settings
    p = node.plan
    runner = node.runner()
    session = runner.session
    llm: llama_cpp.Llama = naive_node.load().llama
    fallback = fallback_for(session)
    if fallback:
        # a model without a chat template: llama-cpp-python's chat completion would use its own default format
        # (llama-2); give it the template nodeagent renders, so the methods differ in method, not in prompt
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        llm.chat_handler = Jinja2ChatFormatter(fallback.template, eos_token=session.eos_text,
                                               bos_token=session.bos_text).to_chat_handler()

    def naive_prompt(messages: list[dict]) -> list[int]:
        # tokens, not text: a template that writes the BOS itself would otherwise get a second one
        return session.tokenize(render_prompt(session, messages).text)

    head = {"model": path.name, "quant": p.quant, "n_ctx": p.settings.n_ctx, "threads": p.settings.n_threads,
            "n_seq_max": p.settings.n_seq_max,
            "chat_template": f"fallback: {fallback.name}" if fallback else "the model's own"}
    if classify:
        head["classification"] = classify_sets(node.plan, config, path, runner, llm, n_classify, sets)
    if n_multi:
        raw = multi_label_run(runner, n_multi)
        RAW_DIR.mkdir(parents=True, exist_ok=True)
        (RAW_DIR / f"tasks-multi-{path.stem}.json").write_text(json.dumps(raw))
        head["multi_label"] = summarise_multi(raw)
    if not n_extract:
        node.close()
        naive_node.close()
        return head
    ext = {"constrained": {"valid": 0, "errors": {}, "latency_s": []},
           "unconstrained": {"valid": 0, "latency_s": []}}
    inputs = extraction_inputs(n_extract)
    for kind, text in inputs:
        task = ExtractTask(input=text, schema=SCHEMAS[kind])
        t0 = time.perf_counter()
        r = runner.run(task)
        ext["constrained"]["latency_s"].append(time.perf_counter() - t0)
        if r.status == "ok" and validate_output(SCHEMAS[kind], r.output) is None:
            ext["constrained"]["valid"] += 1
        else:
            code = r.error.code if r.error else "invalid"
            ext["constrained"]["errors"][code] = ext["constrained"]["errors"].get(code, 0) + 1
        t0 = time.perf_counter()
        out = llm.create_completion(naive_prompt(extract_messages(task)), max_tokens=UNCONSTRAINED_MAX_TOKENS,
                                    temperature=0)
        ext["unconstrained"]["latency_s"].append(time.perf_counter() - t0)
        try:
            value = json.loads(out["choices"][0]["text"].strip())
            ext["unconstrained"]["valid"] += validate_output(SCHEMAS[kind], value) is None
        except ValueError:
            pass
    extraction = {m: {"inputs": len(inputs), "schema_valid": d["valid"], "valid_share": round(d["valid"] / len(inputs), 3),
                      "p50_s": round(pct(d["latency_s"], .5), 3), "p95_s": round(pct(d["latency_s"], .95), 3),
                      **({"errors": d["errors"]} if "errors" in d else {})} for m, d in ext.items()}
    node.close()
    naive_node.close()
    return {**head, "extraction": extraction}


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


def _meets(e: dict, variant: str, config: str) -> tuple[bool, bool]:
    v, j = e["variants"][variant], e["json_route"]
    # the speed-up from the tasks/s themselves (the rounded speed-up can round 1.999 up to the target)
    return v["configs"][config]["accuracy"] >= j["accuracy"] - j["se"], v["tasks_per_s"] >= 2 * j["tasks_per_s"]


def targets(results: list[dict]) -> list[dict]:
    """Per model and set: the default against the JSON route, and calibration against none."""
    rows = []
    for r in results:
        for name, e in r["classification"].items():
            choices = {default_choice(labels) for labels in set_labels(name)}
            assert len(choices) == 1, f"the tasks of {name} get different defaults: {choices}"
            variant, config = choices.pop()
            base = config.replace("+calibrated", "")
            v, j = e["variants"][variant], e["json_route"]
            d = v["configs"][config]
            ece_raw, ece_cal = v["configs"][base]["ece"], v["configs"][base + "+calibrated"]["ece"]
            multi = v["multi_label_ece_per_label"]
            accurate, fast = _meets(e, variant, config)
            rows.append({"model": r["model"], "set": name, "items": e["items"], "config": f"{variant} {config}",
                         "accuracy": d["accuracy"], "se": d["se"], "macro_f1": d["macro_f1"],
                         "json_macro_f1": j["macro_f1"], "json_accuracy": j["accuracy"],
                         "json_se": j["se"], "accurate_enough": accurate,
                         "speedup": round(v["tasks_per_s"] / j["tasks_per_s"], 3),
                         "fast_enough": fast, "ece": ece_raw, "ece_calibrated": ece_cal,
                         "ece_halved": ece_cal <= ece_raw / 2, "multi_ece": multi["uncalibrated"],
                         "multi_ece_calibrated": multi["calibrated"],
                         "multi_ece_halved": multi["calibrated"] <= multi["uncalibrated"] / 2})
    return rows


def passing_variants(result: dict) -> list[str]:
    """The fixed variants and configurations that meet both targets on every set of one model's run."""
    sets = list(result["classification"].values())
    return [f"{v} {c}" for v in VARIANTS for c in CONFIGS if all(all(_meets(e, v, c)) for e in sets)]


def write_facts(results: list[dict]) -> None:
    """models/facts/classification.json: what plans for classification cite (nodeagent/tasks/quality.py)."""
    import datetime

    rows = targets(results)
    keep = ("set", "items", "config", "accuracy", "se", "json_accuracy", "json_se", "accurate_enough", "speedup",
            "fast_enough")
    data = {"source": "benchmarks/tasks.py (generated: do not edit)",
            "models": {r["model"]: {"measured": r.get("created", str(datetime.date.today())),
                                    "default": default_name(), "passing_variants": passing_variants(r),
                                    "sets": [{k: t[k] for k in keep} for t in rows if t["model"] == r["model"]]}
                       for r in results}}
    (ROOT / "models/facts/classification.json").write_text(json.dumps(data, indent=1) + "\n")


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def markdown(results: list[dict]) -> str:
    first = results[0]["classification"]
    sets = "; ".join(f"{name}: {e['items']} items, {e['what']}" + (f" ({e['package']}, {e['license']})"
                                                                    if "package" in e else "")
                     for name, e in first.items())
    lines = ["# Typed tasks", "", "Produced by `benchmarks/tasks.py` on this machine (CPU, llama-cpp-python); all "
             "methods of each comparison ran in the same process over the same items, alternating item by item "
             "(the order rotating), each on its own instance of the same plan (so each keeps its own KV cache "
             "and all see the same machine load).", "",
             "## Classification", "",
             f"Sets: {sets}. The public sets come from wheels on the package index, their sha256 and that of "
             "the items drawn from them checked (`benchmarks/public_sets.py`); nothing of them is committed.", "",
             "Methods: the JSON route is llama-cpp-python's chat completion with a JSON response format whose "
             "schema lists the labels (greedy), after the bare-list system prompt. Label scoring (nodeagent): the "
             "prompt's new tokens and the labels' inner trie nodes (parallel sequences over the prompt's cells) in "
             "one batch; `label` scores "
             "the bare label after the system prompt listing the labels (the JSON route's); `json` scores the "
             "label as the JSON string content that continues the JSON route's own answer prefix "
             "`{\"label\": \"` after that same prompt: what the JSON route would write (no closing quote, so "
             "no deeper a tree than the bare label's); `+descriptions` adds each label's "
             "description (written by the team); `+examples` adds one worked example per label as turns (from "
             "items not evaluated; for the project's set, written by the team). Each method's probabilities "
             "four ways from the same scores: the sum of the label's token log-probabilities or their mean "
             "(length normalisation), each uncalibrated or calibrated against the content-free inputs N/A, "
             "the empty text and [MASK] (their probabilities averaged). Tasks/s are of the task as a worker "
             "runs it, timed with calibration on for every set (its neutral passes, three per prompt and cached per "
             "prompt, included; a task that is not calibrated skips them).", "",
             f"### Targets: the default ({default_name()}) against the JSON route", "",
             "| model | set | default (as resolved) | default accuracy (SE) | JSON route accuracy (SE) | at least JSON - 1 SE "
             "| macro-F1 default / JSON route | speed-up "
             "| at least 2x | ECE uncalibrated | ECE calibrated | at most half | multi-label ECE per label, "
             "uncalibrated / calibrated | at most half |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in targets(results):
        lines.append(f"| {t['model']} | {t['set']} | {t['config']} | {t['accuracy']} ({t['se']}) | {t['json_accuracy']} "
                     f"({t['json_se']}) | {_yes(t['accurate_enough'])} | {t['macro_f1']} / {t['json_macro_f1']} | {t['speedup']}x | {_yes(t['fast_enough'])} | "
                     f"{t['ece']} | {t['ece_calibrated']} | {_yes(t['ece_halved'])} | {t['multi_ece']} / "
                     f"{t['multi_ece_calibrated']} | {_yes(t['multi_ece_halved'])} |")
    multi = [r for r in results if "multi_label" in r]
    if multi:
        m0 = multi[0]["multi_label"]
        lines += ["", "### Multi-label on texts that carry two labels", "",
                  f"{m0['texts']} texts: {m0['two_label_texts']} made of two BBC News items of different topics "
                  f"(joined), and as many single items; the default multi-label task (calibrate "
                  f"{m0['default_calibrate']}, threshold {m0['threshold_setting']}: {round(m0['threshold'], 4)}), "
                  "every (text, label) a yes/no case. "
                  "The runner's probabilities are single-label's (calibrated the same way), so they sum to 1. "
                  "Against them, on the same scores, per-label forms that do not sum to 1 (a the label's share of "
                  "the answer under the text, b under the content-free inputs, K labels): `odds_ratio` the label's "
                  "odds under the text over its odds under the content-free inputs times the odds 1 to K - 1, "
                  "a (1 - b) / (a (1 - b) + (K - 1) b (1 - a)); `share_ratio` a / (a + (K - 1) b) (the default "
                  "before this measurement); `even_odds` a / (a + b). Precision and recall: of the labels chosen "
                  "and of the texts' labels.", "",
                  "| model | probabilities | ECE per label | labels exactly right | both labels of a two-label text "
                  "| precision | recall |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in multi:
            m = r["multi_label"]
            for key in ("uncalibrated", "calibrated", *PER_LABEL_FORMS):
                f = m[key]
                lines.append(f"| {r['model']} | {key}{' (the default)' if key == 'calibrated' else ''} | "
                             f"{f['ece_per_label']} | {f['exact_match']} | {f['both_found']} | {f['precision']} | "
                             f"{f['recall']} |")
        lines += ["", "Calibrated against uncalibrated: "
                  + "; ".join(f"{r['model']} per-label ECE {r['multi_label']['uncalibrated']['ece_per_label']} -> "
                              f"{r['multi_label']['calibrated']['ece_per_label']} (at most half: "
                              f"{_yes(r['multi_label']['ece_halved'])}), {r['multi_label']['tasks_per_s']} tasks/s, "
                              f"the runner's own labels exactly right {r['multi_label']['default_exact_match']}"
                              for r in multi) + ".", "",
                  "The default probabilities at fixed thresholds (`--threshold`):", "",
                  "| model | threshold | labels exactly right | both labels of a two-label text | precision | recall |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for r in multi:
            for t, f in r["multi_label"]["calibrated_by_threshold"].items():
                lines.append(f"| {r['model']} | {t} | {f['exact_match']} | {f['both_found']} | {f['precision']} | "
                             f"{f['recall']} |")
    lines += ["", "### Every method: accuracy by configuration, macro-F1 and expected calibration error", "",
              "ECE: 10 equal-width bins of the top label's probability. Multi-label: each (item, label) pair a "
              "yes/no case, the label's own probability against whether it is the item's label.", ""]
    for name in first:
        lines += [f"#### {name}", "",
                  "| model | method | tasks/s | speed-up | p50 s | acc sum | acc sum, cal. | acc mean | acc mean, cal. | "
                  "macro-F1 sum, cal. | ECE sum | ECE sum, cal. | multi-label ECE unc. / cal. |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in results:
            e = r["classification"][name]
            j = e["json_route"]
            lines.append(f"| {r['model']} | JSON route | {j['tasks_per_s']} | 1x | {j['p50_s']} | {j['accuracy']} | | | | "
                         f"{j['macro_f1']} | | | |")
            for v, d in e["variants"].items():
                c = d["configs"]
                lines.append(f"| {r['model']} | {v} | {d['tasks_per_s']} | {d['speedup_vs_json_route']}x | {d['p50_s']} | "
                             f"{c['sum']['accuracy']} | {c['sum+calibrated']['accuracy']} | {c['mean']['accuracy']} | "
                             f"{c['mean+calibrated']['accuracy']} | {c['sum+calibrated']['macro_f1']} | "
                             f"{c['sum']['ece']} | {c['sum+calibrated']['ece']} | "
                             f"{d['multi_label_ece_per_label']['uncalibrated']} / "
                             f"{d['multi_label_ece_per_label']['calibrated']} |")
        lines.append("")
    lines += ["The JSON route wrote no unparsable answer" if all(e["json_route"]["invalid"] == 0 for r in results
                                                             for e in r["classification"].values())
              else "Unparsable JSON-route answers: " + ", ".join(
                  f"{r['model']} {n} {e['json_route']['invalid']}" for r in results
                  for n, e in r["classification"].items() if e["json_route"]["invalid"]),
              "; the most a method's timed probabilities differed from the same prompt scored again (llama.cpp's "
              "batches of different shapes round differently): " + ", ".join(
                  f"{r['model']} {max(d['rerun_max_abs_diff'] for e in r['classification'].values() for d in e['variants'].values())}"
                  for r in results) + "."]
    lines += ["", "Prompts (both methods, both tasks) go through the chat template nodeagent renders: "
              + "; ".join(f"{r['model']} {r.get('chat_template', 'not recorded')}" for r in results) + "."]
    lines += ["", "When each model was measured (`--models` re-runs some and keeps the others' figures): "
              + "; ".join(f"{r['model']} {r.get('created', 'date not recorded')}, "
                          f"{'commit ' + r['commit'] if 'commit' in r else 'commit not recorded'}"
                          for r in results) + "."]
    lines += ["", "1-minute load average before and after each model's run: "
              + "; ".join(f"{r['model']} {r['load_avg_1m'][0]} / {r['load_avg_1m'][1]}" for r in results
                          if "load_avg_1m" in r) + "."]
    lines += ["", "## Extraction (generated varied inputs)", ""]
    earlier = sorted({r["extraction_from"] for r in results if "extraction_from" in r})
    if earlier:
        lines += [f"From {', '.join(earlier)}: `--extract 0` ran classification only and kept these figures "
                  "(`git log benchmarks/results/tasks.json` shows the run).", ""]
    lines += [
              f"Unconstrained generation: the same prompt (schema included), greedy, at most "
              f"{UNCONSTRAINED_MAX_TOKENS} tokens, the whole output parsed as JSON and validated.", "",
              "| model | method | inputs | schema-valid | share | p50 s | p95 s | error results |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "extraction" not in r:  # `--extract 0` with no saved extraction figures for this model
            lines.append(f"| {r['model']} | not run | | | | | | |")
            continue
        for m in ("constrained", "unconstrained"):
            e = r["extraction"][m]
            errors = ", ".join(f"{k}: {v}" for k, v in e.get("errors", {}).items()) if m == "constrained" else "n/a"
            lines.append(f"| {r['model']} | {m} | {e['inputs']} | {e['schema_valid']} | {e['valid_share']} | "
                         f"{e['p50_s']} | {e['p95_s']} | {errors or 'none'} |")
    lines += ["", "A constrained task that does not finish returns an error result with no output (never a partial "
              "object); the unconstrained outputs are counted valid only when the whole text parses and validates."]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """The commit the code under measurement is at (``+`` when the checkout has uncommitted changes)."""
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    changed = git("status", "--porcelain", "--", "nodeagent", "benchmarks/tasks.py")
    return (git("rev-parse", "--short", "HEAD") or "unknown") + ("+" if changed else "")


def main() -> None:
    from benchmarks.public_sets import SETS

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma")
    ap.add_argument("--extract", type=int, default=200, help="Extraction inputs; 0 keeps the saved extraction "
                                                             "figures of each model and runs classification only")
    ap.add_argument("--classify", type=int, default=None, help="Only N texts of each set (smoke runs)")
    ap.add_argument("--sets", default=",".join(SETS), help="Public labelled sets, besides the project's own")
    ap.add_argument("--out", default="tasks", help="Result file name (without extension)")
    ap.add_argument("--markdown-only", action="store_true", help="Rewrite the .md from the .json, run nothing")
    ap.add_argument("--multi", type=int, default=MULTI_PAIRS, help="Two-label texts (and as many single ones) "
                    "for multi-label; 0 keeps the saved multi-label figures")
    ap.add_argument("--multi-only", action="store_true", help="Only the multi-label measurement: keep the saved "
                    "classification figures")
    ap.add_argument("--from-raw", action="store_true", help="Compute the classification figures again from the "
                    "raw records of the saved run (RAW_DIR), run nothing")
    args = ap.parse_args()
    if args.from_raw:
        results = read_results(args.out)
        for r in results:
            raw = json.loads((RAW_DIR / f"tasks-{Path(r['model']).stem}.json").read_text())
            r["classification"] = {name: summarise(rec) for name, rec in raw.items()}
            multi = RAW_DIR / f"tasks-multi-{Path(r['model']).stem}.json"
            if multi.exists():
                r["multi_label"] = summarise_multi(json.loads(multi.read_text()))
        write_results(args.out, results, indent=1)
    if args.markdown_only or args.from_raw:
        rewrite_markdown(args.out, markdown)
        if args.out == "tasks":
            write_facts(read_results(args.out))
        return
    try:
        saved = {r["model"]: r for r in read_results(args.out)}
    except (OSError, ValueError):
        saved = {}
    results = []
    n_extract = 0 if args.multi_only else args.extract
    for key in args.models.split(","):
        load_before = os.getloadavg()[0]
        results.append(run_model(key, n_extract, args.classify, [x for x in args.sets.split(",") if x],
                                 args.multi, classify=not args.multi_only))
        # what else the machine was doing: the 1-minute load average (2 cores here) before and after
        results[-1]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        earlier = saved.get(results[-1]["model"], {})
        for part, kept in (("classification", args.multi_only), ("load_avg_1m", args.multi_only),
                           ("multi_label", not args.multi)):
            if kept and part in earlier:
                results[-1][part] = earlier[part]
        if not n_extract:
            if "extraction" in earlier:
                results[-1]["extraction"] = earlier["extraction"]
                results[-1]["extraction_from"] = earlier.get("extraction_from", "an earlier run of this benchmark")
        results[-1]["created"] = time.strftime("%Y-%m-%d")
        results[-1]["commit"] = _commit()
        # the figures first: a summary that fails loses nothing. A model this run leaves out keeps its saved
        # figures (the summary says when each model was measured)
        fresh = {r["model"]: r for r in results}
        merged = [fresh.pop(m, r) for m, r in saved.items()] + list(fresh.values())
        write_results(args.out, merged, indent=1)
        try:
            rewrite_markdown(args.out, markdown)
            if args.out == "tasks":
                write_facts(merged)
        except Exception as exc:  # the figures are saved: the summary can be rendered again (--markdown-only)
            print(f"the summary could not be rendered ({exc!r}); run --markdown-only", file=sys.stderr)


if __name__ == "__main__":
    main()
