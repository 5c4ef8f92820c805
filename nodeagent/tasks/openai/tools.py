"""Tool calls enforced by the decoder: how a model is shown its tools, the grammar that admits only valid calls,
and how its output is read back into OpenAI's ``tool_calls``.

Two formats, chosen from the model's chat template (as llama.cpp's ``common/chat`` chooses per family):

- ``hermes``: a template that writes ``<tool_call>`` (Hermes 2 Pro, Hermes 3, Qwen 2.5): the tools go to the
  template (``tools`` in its context), past calls and tool results render as it expects, and a call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``generic``: any other template, which takes no tools: the tools and the answer format go into the system
  prompt (the result's notes say so), past calls and results render as JSON text, and the answer is one JSON
  object, ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or, where text is allowed,
  ``{"response": "..."}``.

``tool_choice`` ``required`` (or a named function) admits only calls from the first token; ``auto`` lets the
model write text (hermes: a lazy trigger on ``<tool_call>``, as llama.cpp's; generic: the ``response``
branch) and constrains any call it starts. An answer holds one call unless the request sets
``parallel_tool_calls: true``; then a call identical to one already made is taken back as it closes and no
further call is begun. Each call's arguments are decoded under its function's prepared schema (the same
preparation, bounds and relaxation notes as extraction) and validated after against the original.

Whatever stops generation, the format's syntax never reaches the client: the decoder keeps room to close the
answer within ``max_tokens`` (``tasks/decoding/closer.py``), complete calls are returned as calls, a call cut short is
left out (and said so), a ``response`` cut short is returned as its text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from nodeagent.tasks.decoding.closer import JsonCloser
from nodeagent.tasks.decoding.instances import Schemas
from nodeagent.tasks.schema import JSON_STYLE, prepare

Mode = Literal["none", "auto", "required"]
# the most calls one answer may make: a small model otherwise repeats its call until the context ends
MAX_CALLS = 8
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
GENERIC_SYSTEM = ("You can call tools. Each tool has a name, a description and a JSON Schema for its arguments:\n"
                  "{tools}\nTo call tools, reply with one JSON object and nothing else: "
                  '{{"tool_calls": [{{"name": <tool name>, "arguments": <arguments object>}}]}}')
RESPONSE_LEAD = '{"response": "'  # how a generic answer in text begins
GENERIC_TEXT = ' To answer without a tool, reply with {"response": "<your reply>"}.'


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict[str, Any]  # the original schema: the final validation's
    decoder: dict[str, Any]  # the prepared copy the decoder enforces
    notes: tuple[str, ...]


@dataclass(frozen=True)
class ToolPlan:
    functions: tuple[Function, ...]  # the ones a call may name
    listed: tuple[dict[str, Any], ...]  # every tool as the request listed it (shown to the model)
    mode: Mode
    parallel: bool
    format: str  # hermes | generic
    notes: tuple[str, ...] = ()

    @property
    def calls_only(self) -> bool:
        return self.mode == "required"


@dataclass
class Parsed:
    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)  # {"name", "arguments" (the decoded object)}
    dropped: int = 0  # calls begun and cut short, left out


def format_for(template: str | None) -> str:
    """The tool format a chat template speaks: hermes when it writes ``<tool_call>``, else generic."""
    return "hermes" if template and HERMES_OPEN in template else "generic"


def plan_tools(tools: list[dict[str, Any]], choice: Any, parallel: bool | None, template: str | None,
               max_string_chars: int | None, max_array_items: int | None) -> ToolPlan | None:
    """The tools of a request, checked and prepared; None when no call is possible (no tools, or ``none``).
    ValueError with the reason for a tool or choice that cannot be honoured."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice asks for a tool call, but the request lists no tools")
        return None
    mode: Mode
    wanted = None
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice in ("none", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        mode, wanted = "required", choice["function"].get("name")
    else:
        raise ValueError(f"tool_choice {json.dumps(choice)[:100]} is not one this node honours: use none, auto, "
                         "required or {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if mode == "none":
        return None
    functions, listed, seen = [], [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"tools[{i}] is not a function tool: only {{\"type\": \"function\"}} tools are honoured")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -")
        if name in seen:
            raise ValueError(f"tools[{i}]: the function {name!r} is listed twice")
        seen.add(name)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        try:
            prepared = prepare(params, max_string_chars, max_array_items)
        except ValueError as exc:
            raise ValueError(f"tools[{i}].function.parameters ({name}): {exc}") from None
        listed.append({"type": "function", "function": {"name": name, "description": fn.get("description"),
                                                        "parameters": params}})
        if wanted is None or wanted == name:
            functions.append(Function(name, fn.get("description"), params, prepared.decoder_schema,
                                      tuple(f"{name}: {n}" for n in prepared.relaxations)))
    if wanted is not None and not functions:
        raise ValueError(f"tool_choice names the function {wanted!r}, which the tools do not list")
    fmt = format_for(template)
    notes = tuple(n for f in functions for n in f.notes)
    if fmt == "generic":
        notes += ("tools: the model's chat template takes none, so they and the answer format (one JSON object) "
                  "went into the system prompt",)
    # one call unless the request asks for several (parallel_tool_calls: true): a small model otherwise repeats
    # the call it has just made until max_tokens cuts it
    many = parallel is True
    return ToolPlan(tuple(functions), tuple(listed), mode, many, fmt, notes)


# -- the grammar ----------------------------------------------------------------------------------------------
def _rebase(node: Any, prefix: str) -> Any:
    """A schema moved under ``prefix`` (a JSON pointer): its own references follow it."""
    if isinstance(node, dict):
        return {k: (prefix + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase(v, prefix))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(x, prefix) for x in node]
    return node


def _call_schema(plan: ToolPlan) -> dict[str, Any]:
    """One call: the name of a function the plan allows and arguments its schema admits (each function's
    schema under $defs, its references rebased there)."""
    items = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/f{i}"}}}
             for i, f in enumerate(plan.functions)]
    return {"anyOf": items,
            "$defs": {f"f{i}": _rebase(f.decoder, f"#/$defs/f{i}") for i, f in enumerate(plan.functions)}}


def _generic_schema(plan: ToolPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    """The generic format's answer as one JSON Schema, and its array of calls (the node the closer watches)."""
    call = _call_schema(plan)
    calls = {"type": "array", "minItems": 1, "items": {"anyOf": call["anyOf"]}}
    calls["maxItems"] = MAX_CALLS if plan.parallel else 1
    envelope = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                "properties": {"tool_calls": calls}}
    answer = envelope if plan.calls_only else {"anyOf": [envelope, {
        "type": "object", "additionalProperties": False, "required": ["response"],
        "properties": {"response": {"type": "string"}}}]}
    return {**answer, "$defs": call["$defs"]}, calls


def grammar(plan: ToolPlan) -> str:
    """The llguidance grammar of an answer under the plan."""
    import llguidance

    if plan.format == "generic":
        return llguidance.LLMatcher.grammar_from_json_schema(_generic_schema(plan)[0], overrides=JSON_STYLE)
    call = _call_schema(plan)
    body = f'"\\n" %json {json.dumps({**call, "x-guidance": JSON_STYLE})} "\\n{HERMES_CLOSE}"'
    if plan.calls_only:
        calls = "call" + ('' if not plan.parallel else ' ("\\n" call' * (MAX_CALLS - 1) + ')?' * (MAX_CALLS - 1))
        lark = f'%llguidance {{}}\nstart: {calls}\ncall: "{HERMES_OPEN}" {body}\n'
    else:  # text, then calls once the model writes the trigger (a lazy lexeme, as llguidance's struct tags)
        # text, then up to MAX_CALLS calls, each followed by text or the next
        start = "tag_end | tag" if not plan.parallel else \
            "tag_end | " + "tag (tag_end | " * (MAX_CALLS - 1) + "tag" + ")" * (MAX_CALLS - 1)
        lark = (f'%llguidance {{}}\nstart: {start}\ntag_end: TAG_TEXT\nTAG_TEXT: /(.|\\n)*/\n'
                f'tag_trig[lazy]: TAG_TEXT "{HERMES_OPEN}"\ntag: tag_trig {body}\n')
    return llguidance.LLMatcher.grammar_from_lark(lark)


def closers(plan: ToolPlan) -> Callable[[], Any]:
    """What makes a fresh follower of an answer under the plan (``tasks/decoding/closer.py``): what would close it, and
    the calls it holds. The schemas are built once; their smallest instances are worked out once."""
    if plan.format == "generic":
        schema, calls = _generic_schema(plan)
        schemas = Schemas(schema)
        return lambda: JsonCloser(schema, watch=calls, schemas=schemas)
    call = _call_schema(plan)
    call_schemas = Schemas(call)
    return lambda: HermesCloser(call, plan.calls_only, MAX_CALLS if plan.parallel else 1, call_schemas)


class HermesCloser:
    """The ``Closer`` (``decoding/closer.py``) for the hermes format: text, then calls, each ``<tool_call>\\n{...}\\n</tool_call>``
    (in ``required`` mode calls only, with a newline between them)."""

    SUFFIX = ("\n" + HERMES_CLOSE).encode()

    def __init__(self, call: dict[str, Any], calls_only: bool, cap: int, schemas: Schemas) -> None:
        self.call, self.calls_only, self.cap, self.schemas = call, calls_only, cap, schemas
        self.data = bytearray()
        self.state, self.matched = "text", 0  # text | open | json | suffix; bytes of OPEN or SUFFIX matched
        self.since = bytearray()  # text since the last call (or the start)
        self.json: JsonCloser | None = None
        self.items: list[bytes] = []
        self.repeat_from: int | None = None
        self._begin = 0
        self._json_at = 0  # where the call's JSON began

    def copy(self) -> "HermesCloser":
        c = HermesCloser.__new__(HermesCloser)
        c.__dict__.update(self.__dict__)
        c.data, c.since = bytearray(self.data), bytearray(self.since)
        c.json = self.json.copy() if self.json is not None else None
        c.items = list(self.items)
        return c

    def feed(self, data: bytes) -> None:
        for b in data:
            self.data.append(b)
            if self.state == "text":
                self.since.append(b)
                if self.since.endswith(HERMES_OPEN.encode()):
                    self.state, self.matched = "open", len(HERMES_OPEN)
                    self._begin = len(self.data) - len(HERMES_OPEN)
                    if self.calls_only and self._begin > 0 and self.data[self._begin - 1] == ord("\n"):
                        self._begin -= 1  # the newline between calls belongs to the call after it
            elif self.state == "open":
                self.state, self.json = "json", JsonCloser(self.call, schemas=self.schemas)
                self._json_at = len(self.data)
            elif self.state == "json":
                assert self.json is not None
                self.json.feed(bytes([b]))
                if self.json.done:
                    self.state, self.matched = "suffix", 0
            else:
                self.matched += 1
                if self.matched == len(self.SUFFIX):
                    self._call_done()

    def _call_done(self) -> None:
        assert self.json is not None
        text = bytes(self.json.data)
        value = json.loads(text)
        if self.repeat_from is None and any(json.loads(t) == value for t in self.items):
            self.repeat_from = self._begin
        self.items.append(text)
        self.state, self.since, self.json = "text", bytearray(), None

    def between_items(self) -> bool:
        return self.state == "text" and bool(self.items)

    # where the text stands, for the guards: the call's JSON, or none in the text around calls
    @property
    def duplicate(self) -> str | None:
        return self.json.duplicate if self.json is not None else None

    @property
    def duplicate_at(self) -> int | None:
        at = self.json.duplicate_at if self.json is not None else None
        return None if at is None else self._json_at + at

    def number_chars(self) -> int:
        return self.json.number_chars() if self.json is not None else 0

    def string_value(self) -> str | None:
        return self.json.string_value() if self.json is not None else None

    def started(self) -> int:
        """Where the call being written began."""
        return self._begin

    def closing(self) -> str | None:
        if self.state == "suffix":
            return self.SUFFIX[self.matched:].decode()
        if self.state == "json":
            assert self.json is not None
            rest = self.json.closing()
            return None if rest is None or len(self.items) + 1 > self.cap else rest + self.SUFFIX.decode()
        whole = self.schemas.minimal_of(self.schemas.alts(self.call))
        if whole is None:
            return None
        if self.state == "open":
            return None if len(self.items) + 1 > self.cap else "\n" + whole + self.SUFFIX.decode()
        # text: in required mode a call must come (after the newline between calls); otherwise it may end here
        if not self.calls_only or (self.items and not self.since):
            return ""
        if len(self.items) + 1 > self.cap:
            return None
        begun = next((k for k in range(len(HERMES_OPEN), 0, -1)
                      if self.since.endswith(HERMES_OPEN[:k].encode())), 0)
        lead = "" if not self.items or self.since.startswith(b"\n") else "\n"
        return lead + HERMES_OPEN[begun:] + "\n" + whole + self.SUFFIX.decode()

    def path(self) -> str:
        inner = self.json.path() if self.json is not None and self.state == "json" else "$"
        return f"tool_calls[{len(self.items)}]" + ("" if inner == "$" else "." + inner)


# -- the prompt -----------------------------------------------------------------------------------------------
def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, template: str | None
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the template is given them, and any extra context (``tools``). Past calls and tool
    results render as the template expects (hermes), or as JSON text in the generic format; so do they when the
    request has no tools left to call."""
    fmt = plan.format if plan is not None else format_for(template)
    out: list[dict[str, Any]] = []
    for m in messages:
        role, calls = m["role"], m.get("tool_calls") or []
        if fmt == "hermes":
            if calls:
                out.append({"role": "assistant", "content": m.get("content") or "",
                            "tool_calls": [{"type": "function", "id": c.get("id"),
                                            "function": {"name": c["function"]["name"],
                                                         "arguments": _arguments(c["function"].get("arguments"))}}
                                           for c in calls]})
            else:
                out.append({"role": role, "content": m.get("content") or "",
                            **({"tool_call_id": m["tool_call_id"]} if m.get("tool_call_id") else {})})
            continue
        if calls:  # generic: the call as the JSON the format answers with
            text = json.dumps({"tool_calls": [{"name": c["function"]["name"],
                                               "arguments": _arguments(c["function"].get("arguments"))}
                                              for c in calls]}, ensure_ascii=False)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            out.append({"role": "user", "content": json.dumps({"tool_response": {
                "tool_call_id": m.get("tool_call_id"), "content": m.get("content") or ""}}, ensure_ascii=False)})
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    extra: dict[str, Any] = {}
    if plan is not None and fmt == "hermes":
        extra["tools"] = list(plan.listed)
    elif plan is not None:
        shown = json.dumps([t["function"] for t in plan.listed], ensure_ascii=False)
        system = GENERIC_SYSTEM.format(tools=shown) + ("" if plan.calls_only else GENERIC_TEXT)
        if plan.mode == "required" and len(plan.functions) == 1 and len(plan.listed) > 1:
            system += f" Call the tool {plan.functions[0].name}."
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, extra


# -- reading the answer ---------------------------------------------------------------------------------------
def parse(text: str, plan: ToolPlan, make: Callable[[], Any] | None = None) -> Parsed:
    """The answer's text and complete calls, wherever generation stopped: the format's own syntax never reaches
    the client. A call cut short is left out (``dropped``); a ``response`` cut short is its text so far."""
    follower = (make or closers(plan))()
    follower.feed(text.encode())
    calls = [json.loads(t) for t in follower.items]
    if plan.format == "generic":
        if calls or plan.calls_only or text.startswith('{"tool_calls"'):
            return Parsed(content=None, calls=calls, dropped=int(follower.open_item()))
        return Parsed(content=response_text(text))
    data = bytes(follower.data)
    dropped = follower.state != "text"
    if dropped:  # a call begun and not finished: the text stops where it began
        data = data[:follower.started()]
    pattern = re.compile(re.escape(HERMES_OPEN) + r"\n(.*?)\n" + re.escape(HERMES_CLOSE), re.S)
    content = pattern.sub("", data.decode("utf-8", "replace")).strip()
    return Parsed(content=content or (None if calls else ""), calls=calls, dropped=int(dropped))


def response_text(text: str) -> str:
    """The generic format's ``{"response": "..."}``, complete or cut short, as its text (an escape cut in half is
    left out)."""
    if not text.startswith(RESPONSE_LEAD):
        return ""
    body = text[len(RESPONSE_LEAD):]
    i, out = 0, []
    while i < len(body):
        ch = body[i]
        if ch == '"':
            break
        if ch == "\\":
            size = 6 if body[i + 1:i + 2] == "u" else 2
            piece = body[i:i + size]
            if len(piece) < size:
                break
            out.append(piece)
            i += size
            continue
        out.append(ch)
        i += 1
    value = json.loads('"' + "".join(out) + '"')
    if value and "\ud800" <= value[-1] <= "\udbff":  # half of a surrogate pair
        value = value[:-1]
    return value


def openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls``: an id each, the arguments as a JSON string."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
            for c in calls]


def function(plan: ToolPlan, name: str) -> Function:
    return next(f for f in plan.functions if f.name == name)
