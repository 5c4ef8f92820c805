"""OpenAI's Responses API as far as a node honours it, as a translation to and from the chat request the door
already runs: a ``/v1/responses`` body becomes a chat completion request (the same field table's checks, the same
executors, the same grammar for ``text.format`` and tools), and the chat answer becomes a ``response`` object.
Nothing new reaches a worker: a gateway queues the translated request as a chat task, so a fleet mid-upgrade
serves it on any node.

Every field of ``responses.create`` has a row in ``fields.RESPONSES`` (one ``FieldTable`` with chat's and
completions').

Input items: a string, or messages (``input_text``/``output_text`` parts), ``function_call`` and
``function_call_output`` items; ``instructions`` come first as a system message. A stored response (``store``)
keeps its conversation, so ``previous_response_id`` continues from it: its messages, its answer, then the new
input (its ``instructions`` are not carried over, as OpenAI's are not).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from nodeagent.tasks.openai.fields import CHAT, RESPONSES, Refused, check_metadata

PARTS_IN = ("input_text", "output_text", "text", "refusal")


class Translated:
    """A Responses request as the chat request it runs as, and what the answer needs to be rendered back."""

    def __init__(self, chat: dict[str, Any], messages: list[dict[str, Any]], echo: dict[str, Any]) -> None:
        self.chat = chat  # the chat completion request (no model field defaults: the door's own)
        self.messages = messages  # the conversation so far, as chat messages (a stored response keeps it)
        self.echo = echo  # the request's settings the response object repeats


def check(body: dict[str, Any]) -> None:
    """Refused (naming the field) for a field no row of ``fields.RESPONSES`` has, a refused one that is set, a
    boolean that is not one, or metadata past OpenAI's limits."""
    RESPONSES.check(body)
    for name in ("store", "stream"):  # a boolean is true or false: "no" is not false
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise Refused(name, f"{name} must be true or false, not {body[name]!r}"[:200], code="invalid_type")
    check_metadata(body.get("metadata"))


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise Refused(where, f"{where} must be a string or a list of content parts")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PARTS_IN:
            raise Refused(f"{where}[{i}].type", f"content parts of type {kind!r} are not supported (text only: "
                                                "input_text, output_text)")
        out.append(str(part.get("text", part.get("refusal", ""))))
    return "".join(out)


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The input as chat messages: a string is a user message; consecutive function calls are one assistant
    message's tool calls; a call's output is a tool message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise Refused("input", "input must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise Refused(where, f"{where} must be an object (a message, function_call or function_call_output)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise Refused(f"{where}.role", f"{where}.role must be user, assistant, system or developer")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            if not item.get("call_id") or not item.get("name"):
                raise Refused(where, f"{where}: a function_call needs call_id and name")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.get("call_id"):
                raise Refused(where, f"{where}: a function_call_output needs the call_id it answers")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise Refused(f"{where}.type", f"input items of type {kind!r} are not supported here (message, "
                                           "function_call and function_call_output are)")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise Refused("tools", "tools must be a list of tools", code="invalid_type")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise Refused(f"tools[{i}].type", f"tools of type {kind!r} are not run here: only function tools, "
                                              "which the client runs")
        if not tool.get("name"):
            raise Refused(f"tools[{i}].name", f"tools[{i}] needs a name")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        for key in ("description", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise Refused("tool_choice", "tool_choice must be auto, required, none or {\"type\": \"function\", \"name\": "
                                 "...}: hosted tools and allowed_tools are not supported here")


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise Refused("text", "text must be an object ({\"format\": ...})")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise Refused("text.format", "text.format must be an object ({\"type\": \"text\" | \"json_object\" | "
                                     "\"json_schema\", ...})", code="invalid_type")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise Refused("text.format.schema", "text.format json_schema needs a schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise Refused("text.format.type", f"text.format of type {fmt.get('type')!r} is not supported (text, "
                                      "json_object, json_schema)")


def to_chat(body: dict[str, Any], earlier: list[dict[str, Any]] | None = None) -> Translated:
    """The chat completion request a checked Responses body runs as (``earlier``: the stored conversation
    ``previous_response_id`` continues)."""
    if "input" not in body or body["input"] is None:
        raise Refused("input", "input is required (a string, or a list of items)")
    messages = list(earlier or []) + input_messages(body["input"])
    if not messages:
        raise Refused("input", "input holds no message")
    first = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
    chat: dict[str, Any] = {"messages": first + messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("parallel_tool_calls", "parallel_tool_calls"), ("keep_alive", "keep_alive"),
                     ("stream", "stream")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if body.get("max_tool_calls") is not None:
        if not isinstance(body["max_tool_calls"], int) or body["max_tool_calls"] < 1:
            raise Refused("max_tool_calls", "max_tool_calls must be a positive integer")
        if body["max_tool_calls"] == 1:
            chat["parallel_tool_calls"] = False
    tools, fmt = _tools(body.get("tools")), _format(body.get("text"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None and tools:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    elif body.get("tool_choice") not in (None, "auto", "none"):
        raise Refused("tool_choice", "tool_choice names a tool, but tools holds none")
    if fmt is not None:
        chat["response_format"] = fmt
    assert set(chat) <= CHAT.names()
    echo = {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0,
            "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": body.get("previous_response_id"), "metadata": body.get("metadata") or {},
            "max_tool_calls": body.get("max_tool_calls"), "user": body.get("user")}
    return Translated(chat, messages, echo)


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def message_id(response_id: str, index: int = 0) -> str:
    return f"msg_{response_id.removeprefix('resp_')}_{index}"


def usage(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    u = chat_usage or {}
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def output_items(response_id: str, chat_body: dict[str, Any]) -> list[dict[str, Any]]:
    """The answer's output items: its text as a message (when it has any), then each function call."""
    choice = (chat_body.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    items: list[dict[str, Any]] = []
    if message.get("content"):
        items.append(message_item(response_id, message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call, "completed"))
    return items


def message_item(response_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": message_id(response_id), "type": "message", "role": "assistant", "status": status,
            "content": content}


def call_item(call: dict[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"id": "fc_" + call["id"].removeprefix("call_"), "type": "function_call", "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"] if arguments is None else arguments, "status": status}


def status_of(chat_body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
    """``completed``, or ``incomplete`` with its reason (the answer was cut at the token budget)."""
    finish = ((chat_body.get("choices") or [{}])[0]).get("finish_reason")
    return ("incomplete", {"reason": "max_output_tokens"}) if finish == "length" else ("completed", None)


def response_object(response_id: str, model: str, echo: dict[str, Any], *, created_at: float | None = None,
                    chat_body: dict[str, Any] | None = None, status: str | None = None, store: bool = False,
                    output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A ``response`` object: in progress (no ``chat_body``), or the finished answer."""
    incomplete = None
    if chat_body is not None:
        done, incomplete = status_of(chat_body)
        status = status or done
        output = output_items(response_id, chat_body) if output is None else output
    created = time.time() if created_at is None else created_at
    return {"id": response_id, "object": "response", "created_at": int(created), "status": status or "in_progress",
            "background": False, "error": None, "incomplete_details": incomplete,
            "completed_at": int(time.time()) if status == "completed" else None,
            "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
            "max_tool_calls": echo.get("max_tool_calls"), "model": model, "output": output or [],
            "parallel_tool_calls": echo.get("parallel_tool_calls", True),
            "previous_response_id": echo.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": store, "temperature": echo.get("temperature", 1.0),
            "text": echo.get("text", {"format": {"type": "text"}}), "tool_choice": echo.get("tool_choice", "auto"),
            "tools": echo.get("tools", []), "top_p": echo.get("top_p", 1.0),
            "truncation": "disabled", "usage": usage(chat_body.get("usage")) if chat_body is not None else None,
            "user": echo.get("user"), "metadata": echo.get("metadata") or {}}


def conversation(translated: Translated, chat_body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages a stored response keeps: the conversation so far and its answer (a continuation's start)."""
    message = ((chat_body.get("choices") or [{}])[0]).get("message") or {}
    answer: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("tool_calls"):
        answer["tool_calls"] = message["tool_calls"]
    return translated.messages + [answer]


def stored(response: dict[str, Any], messages: list[dict[str, Any]]) -> str:
    return json.dumps({"response": response, "conversation": messages}, ensure_ascii=False)
