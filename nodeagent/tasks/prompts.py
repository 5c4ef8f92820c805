"""System prompts per task type, and the messages sent through the model's chat template."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from nodeagent.tasks.contracts import ClassifyTask, ExtractTask, RerankTask
from nodeagent.tasks.templates import DEFAULT_FALLBACK, Fallback, RenderedPrompt, pick_fallback, render

if TYPE_CHECKING:  # (the session's module imports numpy: a command that renders no prompt need not)
    from nodeagent.backends.session import TokenSession

EXTRACT_SYSTEM = ("You extract information from text. Reply with one JSON object that matches the JSON Schema "
                  "below, and nothing else. Use only facts stated in the text.\nJSON Schema:\n{schema}")
EXTRACT_FIELDS = ("You extract information from text. Reply with one JSON object with these fields, and nothing "
                  "else. Use only facts stated in the text.\n{fields}")
EXTRACT_BARE = ("You extract information from text. Reply with one JSON object, and nothing else. Use only facts "
                "stated in the text.")
# the prompt form an extraction gets when its task names none: the instruction alone, the grammar holding the
# shape. Measured (benchmarks/results/extract_quality.md): the most accurate and the fastest form without
# examples on both models and both labelled sets; the schema in the prompt (the earlier default) was the least
EXTRACT_PROMPT_DEFAULT = "none"


def _type_of(schema: Any) -> str:
    """A property's type as one line says it: its enum's values, its type(s), ``null if not stated``."""
    if not isinstance(schema, dict):
        return "any"
    if "enum" in schema:
        return "one of " + ", ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"])
    kinds = schema.get("type", "any")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    shown = [k for k in kinds if k != "null"] or ["null"]
    text = " or ".join(shown)
    if schema.get("format"):
        text += f" ({schema['format']})"
    if shown[0] == "array" and isinstance(schema.get("items"), dict):
        text = f"array of {_type_of(schema['items'])}"
    return text + (", null if not stated" if "null" in kinds and shown != ["null"] else "")


def field_lines(schema: dict[str, Any]) -> str:
    """The object's properties, one line each in the schema's order: name, type, description."""
    props = schema.get("properties") or {}
    lines = []
    for name, sub in props.items():
        desc = sub.get("description") if isinstance(sub, dict) else None
        lines.append(f"- {name}: {_type_of(sub)}" + (f". {desc}" if desc else ""))
    return "\n".join(lines) if lines else json.dumps(schema, ensure_ascii=False)
CLASSIFY_SYSTEM = "You classify text. Reply with exactly one of these labels and nothing else:\n{labels}"


def extract_messages(task: ExtractTask) -> list[dict[str, str]]:
    """The extraction prompt in the task's form (``ExtractTask.prompt``): the schema, its fields as lines, or the
    instruction alone; the examples as turns."""
    form = task.prompt or EXTRACT_PROMPT_DEFAULT
    if form == "fields" and (task.json_schema.get("properties") or {}):
        system = EXTRACT_FIELDS.format(fields=field_lines(task.json_schema))
    elif form == "none":
        system = EXTRACT_BARE
    else:
        system = EXTRACT_SYSTEM.format(schema=json.dumps(task.json_schema, ensure_ascii=False))
    if task.instructions:
        system += "\n" + task.instructions
    messages = [{"role": "system", "content": system}]
    for ex in task.examples:
        messages += [{"role": "user", "content": ex.text},
                     {"role": "assistant", "content": json.dumps(ex.output, ensure_ascii=False)}]
    return messages + [{"role": "user", "content": task.input}]


# Contextual calibration (Zhao et al. 2021): the labels' probabilities for content-free inputs under the same
# prompt, averaged, measure the prompt's own bias; multi-label judges each label against the same average
NEUTRAL_INPUTS = ("N/A", "", "[MASK]")
# what the answer starts with when labels are scored as JSON (what the JSON route writes under its grammar):
# the label is the string's content that follows
ANSWER_PREFIX = '{"label": "'


def classify_answer(task: ClassifyTask, label: str) -> str:
    """A whole answer in the task's answer form (an example's turn)."""
    return json.dumps({"label": label}, ensure_ascii=False) if task.answer == "json" else label


def classify_messages(task: ClassifyTask, text: str | None = None) -> list[dict[str, str]]:
    """The classification prompt for the task's input (or ``text`` in its place): the labels (with their
    descriptions) listed in the system prompt, the examples as turns in the answer's form. Both answer forms
    read the same system prompt, the one the JSON route reads too: a JSON answer differs only in what the
    answer starts with (``ANSWER_PREFIX``), so it is scored as exactly what the JSON route would write."""
    lines = [f"- {lb.name}" + (f": {lb.description}" if lb.description else "") for lb in task.labels]
    system = CLASSIFY_SYSTEM.format(labels="\n".join(lines))
    if task.instructions:
        system += "\n" + task.instructions
    messages = [{"role": "system", "content": system}]
    for ex in task.examples:
        messages += [{"role": "user", "content": ex.text},
                     {"role": "assistant", "content": classify_answer(task, ex.label)}]
    return messages + [{"role": "user", "content": task.input if text is None else text}]


# Rerank by a model that generates: Qwen3-Reranker's prompt (its model card's format, which llama.cpp serves as a
# two-label head), the answer read from the logits of "yes" and "no" at the start of the reply
RERANK_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                 'Note that the answer can only be "yes" or "no".')
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RERANK_USER = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
RERANK_ANSWERS = ("yes", "no")  # the reply's first token: relevant, not relevant


def rerank_messages(task: RerankTask, document: str | None = None) -> list[dict[str, str]]:
    """The prompt that asks whether ``document`` (the task's first by default) meets the task's query: the query
    before the document, so the documents of one task share the prompt up to the document (a slot reads it once)."""
    user = RERANK_USER.format(instruction=task.instruction or RERANK_INSTRUCTION, query=task.query,
                              document=task.documents[0] if document is None else document)
    return [{"role": "system", "content": RERANK_SYSTEM}, {"role": "user", "content": user}]


def fallback_for(session: TokenSession) -> Fallback | None:
    """The built-in template that stands in for the model's (the one its vocabulary's turn tokens point
    to), or None when the model has its own."""
    return None if session.chat_template else pick_fallback(session.has_token)


def render_prompt(session: TokenSession, messages: list[dict[str, Any]],
                  extra: dict[str, Any] | None = None) -> RenderedPrompt:
    """Through the model's chat template (``extra``: more of its context, such as ``tools``); without one,
    through ``fallback_for(session)``."""
    return render(session.chat_template, messages, bos_token=session.bos_text, eos_token=session.eos_text,
                  extra=extra, fallback=fallback_for(session) or DEFAULT_FALLBACK)
