"""Tool calls that hold: how many of a small model's calls are valid against their function's schema, through
nodeagent's OpenAI door, against llama-cpp-python's own OpenAI-style chat handler on the same model and requests,
in one run; and instructor's TOOLS mode (its default) against its JSON_SCHEMA mode on the same texts.

- 12 tool definitions (enums, bounded integers and numbers, nested objects, arrays, booleans, formats), a request
  for each, asked ``--rounds`` times at temperature 0.7 with a different seed each round, once with
  ``tool_choice: required`` (all 12 tools listed) and once naming the function: 120 calls by default;
- the reference: ``Llama.create_chat_completion(tools=..., tool_choice=...)`` with ``chatml-function-calling``
  (llama-cpp-python's handler for models without a tool format of their own), the same messages and settings;
- a call is valid when its name is a listed tool (the named one, when named) and its arguments, parsed, pass the
  function's schema (jsonschema, formats checked); anything else (text, no call, an error) counts as invalid.

Targets (issue 19): 100 % valid with ``required`` and named; instructor TOOLS at least as good as JSON_SCHEMA.

``--sweep``: the same 12 requests under the ``max_tokens`` orchestrators set (10, 20, 30, 60, 120 and none), on
SmolLM2 and Gemma 3, with ``required``, a named function and ``auto``; an answer counts when it carries a
schema-valid call, and a 400 ``max_tokens_too_small`` (the budget cannot hold the shortest call's chosen tokens: the
envelope the grammar forces is not charged, issue 46) is counted apart. Also ``n`` 4 against
``n`` 1 on the same one-slot server (the choices decode in turn). Targets (issue 33): with ``required`` or named,
100 % of the answers whose budget allows a call carry a valid one; 0 answers carry the tool format as content.

Usage: python benchmarks/tools.py [--rounds 5] [--texts 20]   -> benchmarks/results/tools.json and tools.md
       python benchmarks/tools.py --sweep [--repeats 5]       -> benchmarks/results/tools_budget.json and .md
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.results_io import write_results  # noqa: E402
from benchmarks.stats import pct  # noqa: E402
from nodeagent.config import load  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402
from nodeagent.tasks.schema import validate_output  # noqa: E402


def fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    fn("get_weather", "The current weather in a city",
       {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    fn("send_email", "Send an email", {"to": {"type": "string", "format": "email"}, "subject": {"type": "string"},
                                       "body": {"type": "string"}}, ["to", "subject"]),
    fn("create_event", "Put an event in the calendar",
       {"title": {"type": "string"}, "date": {"type": "string", "format": "date"},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}}, ["title", "date"]),
    fn("convert_currency", "Convert an amount of money",
       {"amount": {"type": "number", "exclusiveMinimum": 0}, "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
        "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "from", "to"]),
    fn("search_products", "Search the shop",
       {"query": {"type": "string"}, "max_price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}}, ["query"]),
    fn("set_thermostat", "Set the heating", {"room": {"type": "string", "enum": ["kitchen", "bedroom", "office"]},
                                             "temperature_c": {"type": "number", "minimum": 10, "maximum": 30}},
       ["room", "temperature_c"]),
    fn("book_table", "Book a restaurant table",
       {"restaurant": {"type": "string"}, "people": {"type": "integer", "minimum": 1, "maximum": 20},
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}, ["restaurant", "people", "time"]),
    fn("translate", "Translate a text", {"text": {"type": "string"},
                                         "target_language": {"type": "string", "enum": ["fr", "de", "es", "it"]}},
       ["text", "target_language"]),
    fn("add_contact", "Add someone to the address book",
       {"name": {"type": "string"}, "phones": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                    "required": ["city"]}}, ["name"]),
    fn("create_ticket", "Open a support ticket",
       {"summary": {"type": "string", "maxLength": 120},
        "priority": {"type": "string", "enum": ["low", "normal", "high", "urgent"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["billing", "bug", "login", "shipping"]}}},
       ["summary", "priority"]),
    fn("schedule_reminder", "Remind the user later",
       {"message": {"type": "string"}, "in_minutes": {"type": "integer", "minimum": 1, "maximum": 10080}},
       ["message", "in_minutes"]),
    fn("get_stock_price", "The latest price of a share", {"symbol": {"type": "string", "pattern": "^[A-Z]{1,5}$"}},
       ["symbol"]),
]
ASKS = [
    "What is the weather like in Lisbon today, in celsius?",
    "Email bob@example.com that the meeting moved to Friday.",
    "Add a dentist appointment on 2026-03-14 for 45 minutes.",
    "How much is 120 US dollars in euros?",
    "Find me running shoes under 80 that are in stock.",
    "Set the bedroom to 19 degrees.",
    "Book a table for 4 at Chez Anna at 19:30.",
    "Translate 'good morning, how are you' into German.",
    "Save Maria Lopez, phone 555-0134, who lives in Madrid.",
    "My invoice was charged twice, this is urgent!",
    "Remind me to call my mother in two hours.",
    "What is Apple's share price right now?",
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def valid(message: dict | None, named: str | None) -> tuple[bool, str]:
    """Whether an answer is a valid call, and why not."""
    calls = (message or {}).get("tool_calls") or []
    if not calls:
        return False, "no call"
    for call in calls:
        name = call["function"]["name"]
        if name not in SCHEMAS or (named is not None and name != named):
            return False, f"name {name}"
        try:
            args = json.loads(call["function"]["arguments"])
        except (TypeError, json.JSONDecodeError):
            return False, "arguments not JSON"
        problem = validate_output(SCHEMAS[name], args)
        if problem is not None:
            return False, f"schema: {problem}"[:120]
    return True, "ok"


def requests(rounds: int) -> list[dict]:
    out = []
    for r in range(rounds):
        for i, ask in enumerate(ASKS):
            for mode in ("required", "named"):
                choice = "required" if mode == "required" else \
                    {"type": "function", "function": {"name": TOOLS[i]["function"]["name"]}}
                out.append({"mode": mode, "tool": TOOLS[i]["function"]["name"], "seed": r, "body": {
                    "messages": [{"role": "user", "content": ask}], "tools": TOOLS, "tool_choice": choice,
                    "temperature": 0.7, "seed": r}})
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    home = Path(tempfile.mkdtemp())
    env = {**os.environ, "NODEAGENT_HOME": str(home), "NODEAGENT_CONFIG": str(home / "c.toml")}
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "serve", "--model", model, "--port", str(port),
                             "--ctx", "4096", "--slots", "1", *extra], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not start")


def run_nodeagent(url: str, reqs: list[dict]) -> list[dict]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    rows = []
    for q in reqs:
        t0 = time.perf_counter()
        why = None
        try:
            r = client.chat.completions.create(model=model, **q["body"])
            message = r.choices[0].message.model_dump()
        except openai.APIError as exc:
            message = None
            why = f"error: {exc}"[:120]
        ok, reason = valid(message, q["tool"] if q["mode"] == "named" else None)
        rows.append({"side": "nodeagent", "mode": q["mode"], "tool": q["tool"], "seed": q["seed"], "valid": ok,
                     "reason": why or reason, "s": time.perf_counter() - t0})
    return rows


def run_llama_cpp_python(model: str, reqs: list[dict]) -> list[dict]:
    import llama_cpp

    llm = llama_cpp.Llama(model, n_ctx=4096, n_threads=os.cpu_count() or 2, chat_format="chatml-function-calling",
                          verbose=False)
    rows = []
    try:
        for q in reqs:
            t0 = time.perf_counter()
            b = q["body"]
            try:
                r = llm.create_chat_completion(messages=b["messages"], tools=b["tools"], tool_choice=b["tool_choice"],
                                               temperature=b["temperature"], seed=b["seed"], max_tokens=None)
                message, why = r["choices"][0]["message"], None
            except Exception as exc:  # noqa: BLE001  (the handler refused or failed: an invalid answer)
                message, why = None, f"error: {type(exc).__name__}: {exc}"[:120]
            ok, reason = valid(message, q["tool"] if q["mode"] == "named" else None)
            rows.append({"side": "llama-cpp-python", "mode": q["mode"], "tool": q["tool"], "seed": q["seed"],
                         "valid": ok, "reason": why or reason, "s": time.perf_counter() - t0})
    finally:
        llm.close()
    return rows


NAMES = ["Alice Martin", "Bruno Silva", "Chen Wei", "Dana Cohen", "Emil Novak", "Fatima Zahra", "Goran Petrov",
         "Hana Sato", "Ivan Horvat", "Julia Weber"]
CITIES = ["Lyon", "Porto", "Osaka", "Haifa", "Brno", "Rabat", "Sofia", "Kyoto", "Split", "Graz"]


def texts(n: int) -> list[dict]:
    out = []
    for i in range(n):
        name, city, age = NAMES[i % 10], CITIES[(i * 3) % 10], 21 + (i * 7) % 50
        text = (f"{name} is {age} years old and lives in {city}." if i % 2 == 0 else
                f"Our new colleague, {name}, moved to {city} last year; {name.split()[0]} turned {age} in May.")
        out.append({"text": text, "name": name, "age": age, "city": city})
    return out


INSTRUCTOR_SCRIPT = textwrap.dedent("""
    import json, sys, instructor, openai
    from pydantic import BaseModel, Field
    class Person(BaseModel):
        name: str = Field(description="The person's full name", max_length=60)
        age: int = Field(description="Age in years", ge=0, le=130)
        city: str = Field(description="Where the person lives", max_length=60)
    url, mode, items = sys.argv[1], sys.argv[2], json.loads(sys.stdin.read())
    raw = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    model = raw.models.list().data[0].id
    for item in items:
        try:
            p = client.chat.completions.create(model=model, response_model=Person, temperature=0, max_retries=1,
                messages=[{"role": "user", "content": "Extract the person. Text: " + item["text"]}])
            print(json.dumps({"ok": True, "exact": [p.name, p.age, p.city] == [item["name"], item["age"], item["city"]]}))
        except Exception as exc:
            print(json.dumps({"ok": False, "error": type(exc).__name__}))
""")


def run_instructor(url: str, items: list[dict]) -> dict:
    python = ROOT / ".venv-instructor" / "bin" / "python"
    out = {}
    for mode in ("TOOLS", "JSON_SCHEMA"):
        proc = subprocess.run([str(python), "-c", INSTRUCTOR_SCRIPT, url, mode], input=json.dumps(items),
                              capture_output=True, text=True, timeout=3600)
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        out[mode] = {"items": len(items), "valid": sum(r["ok"] for r in rows),
                     "exact": sum(r.get("exact", False) for r in rows),
                     "errors": sorted({r["error"] for r in rows if not r["ok"]})}
    return out


def summary(rows: list[dict]) -> dict:
    out = {}
    for side in sorted({r["side"] for r in rows}):
        for mode in ("required", "named"):
            sel = [r for r in rows if r["side"] == side and r["mode"] == mode]
            reasons: dict[str, int] = {}
            for r in sel:
                if not r["valid"]:
                    reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
            out[f"{side}/{mode}"] = {"calls": len(sel), "valid": sum(r["valid"] for r in sel),
                                     "p50_s": round(pct([r["s"] for r in sel], 0.5), 3), "invalid": reasons}
    return out


def markdown(data: dict) -> str:
    lines = [f"# Tool calls on {data['model']} ({data['calls_per_side']} calls a side, {len(TOOLS)} tools)", "",
             "| side | tool_choice | valid | p50 s |", "| --- | --- | --- | --- |"]
    for key, s in data["summary"].items():
        side, mode = key.split("/")
        lines.append(f"| {side} | {mode} | {s['valid']}/{s['calls']} | {s['p50_s']} |")
    lines += ["", "Why calls were invalid:", ""]
    for key, s in data["summary"].items():
        for reason, n in sorted(s["invalid"].items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"- {key}: {n} × {reason}")
    ins = data["instructor"]
    lines += ["", f"instructor on the same server, {ins['TOOLS']['items']} texts (name, age, city):", "",
              "| mode | schema-valid | exactly right | errors |", "| --- | --- | --- | --- |"]
    for mode, s in ins.items():
        lines.append(f"| {mode} | {s['valid']}/{s['items']} | {s['exact']}/{s['items']} | {', '.join(s['errors']) or '-'} |")
    return "\n".join(lines) + "\n"


# -- the budget sweep -----------------------------------------------------------------------------------------
BUDGETS = [10, 20, 30, 60, 120, None]
ENVELOPE = ('{"tool_calls"', '{"response"', "<tool_call>", '"arguments":')


def sweep_requests() -> list[dict]:
    out = []
    for budget in BUDGETS:
        for i, ask in enumerate(ASKS):
            for mode in ("required", "named", "auto"):
                choice = mode if mode != "named" else {"type": "function", "function": {"name": TOOLS[i]["function"]["name"]}}
                body = {"messages": [{"role": "user", "content": ask}], "tools": TOOLS, "tool_choice": choice,
                        "temperature": 0}
                if budget is not None:
                    body["max_tokens"] = budget
                out.append({"mode": mode, "tool": TOOLS[i]["function"]["name"], "budget": budget, "body": body})
    return out


def run_sweep(url: str, reqs: list[dict]) -> list[dict]:
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    for q in reqs:
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/chat/completions", json={"model": model, **q["body"]}, timeout=600)
        row = {"mode": q["mode"], "tool": q["tool"], "budget": q["budget"], "status": r.status_code,
               "s": round(time.perf_counter() - t0, 3)}
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            message = choice["message"]
            ok, reason = valid(message, q["tool"] if q["mode"] == "named" else None)
            row.update(valid=ok, reason=reason, finish=choice["finish_reason"],
                       envelope=any(m in (message.get("content") or "") for m in ENVELOPE),
                       calls=len(message.get("tool_calls") or []), tokens=r.json()["usage"]["completion_tokens"])
        else:
            row.update(valid=False, reason=r.json()["error"].get("code"), finish=None, envelope=False, calls=0)
        rows.append(row)
    return rows


def time_n(url: str, repeats: int) -> dict:
    """The same chat request with n 1 and n 4 on a one-slot server, taking turns; the median of each."""
    import httpx

    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Write one sentence about the sea."}],
            "max_tokens": 32, "temperature": 0.8, "seed": 1}
    times: dict[int, list[float]] = {1: [], 4: []}
    for _ in range(repeats):
        for n in (1, 4):
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/chat/completions", json={**body, "n": n}, timeout=600)
            assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
            times[n].append(time.perf_counter() - t0)
    med = {n: pct(v, 0.5) for n, v in times.items()}
    return {"n1_s": round(med[1], 3), "n4_s": round(med[4], 3), "ratio": round(med[4] / med[1], 2),
            "repeats": repeats}


def sweep_summary(rows: list[dict]) -> dict:
    out = {}
    for mode in ("required", "named", "auto"):
        for budget in BUDGETS:
            sel = [r for r in rows if r["mode"] == mode and r["budget"] == budget]
            refused = [r for r in sel if r["status"] == 400 and r["reason"] == "max_tokens_too_small"]
            served = [r for r in sel if r["status"] == 200]
            finishes: dict[str, int] = {}
            for r in served:
                finishes[r["finish"]] = finishes.get(r["finish"], 0) + 1
            out[f"{mode}/{budget or 'none'}"] = {
                "answers": len(sel), "refused_too_small": len(refused), "other_errors": len(sel) - len(refused) - len(served),
                "with_valid_call": sum(r["valid"] for r in served), "served": len(served),
                "envelope_as_content": sum(r["envelope"] for r in served), "finish": finishes,
                "invalid": sorted({r["reason"] for r in served if not r["valid"]})}
    return out


def sweep_markdown(data: dict) -> str:
    lines = ["# Tool calls under max_tokens (12 tools, temperature 0)", ""]
    for model, d in data["models"].items():
        lines += [f"## {model}", "", "| tool_choice | max_tokens | served | with a valid call | refused: too small | "
                  "envelope as content | finish |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for key, s in d["summary"].items():
            mode, budget = key.split("/")
            finish = ", ".join(f"{k} {v}" for k, v in sorted(s["finish"].items()))
            lines.append(f"| {mode} | {budget} | {s['served']}/{s['answers']} | {s['with_valid_call']}/{s['served']} | "
                         f"{s['refused_too_small']} | {s['envelope_as_content']} | {finish} |")
        n = d["n"]
        lines += ["", f"n 4 on one slot (the choices in turn): {n['n4_s']} s against {n['n1_s']} s for n 1, "
                      f"x{n['ratio']} (median of {n['repeats']}, taking turns)", ""]
    return "\n".join(lines) + "\n"


def main_sweep(repeats: int) -> None:
    data: dict = {"budgets": BUDGETS, "models": {}}
    for name in ("smollm2-135m-instruct", "gemma-3-270m-it"):
        model = str(test_model_path(name, load().test_models_dir))
        proc, url = serve(model, [])
        try:
            rows = run_sweep(url, sweep_requests())
            data["models"][Path(model).name] = {"summary": sweep_summary(rows), "n": time_n(url, repeats),
                                                "rows": rows}
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    write_results("tools_budget", data, sweep_markdown(data))
    print(sweep_markdown(data))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--texts", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="the max_tokens sweep and n in turn (tools_budget)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.sweep:
        main_sweep(args.repeats)
        return
    model = str(test_model_path("smollm2-135m-instruct", load().test_models_dir))
    reqs = requests(args.rounds)
    proc, url = serve(model, [])
    try:
        rows = run_nodeagent(url, reqs)
        instructor = run_instructor(url, texts(args.texts))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    rows += run_llama_cpp_python(model, reqs)
    data = {"model": Path(model).name, "calls_per_side": len(reqs), "rounds": args.rounds,
            "summary": summary(rows), "instructor": instructor, "rows": rows}
    write_results("tools", data, markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
