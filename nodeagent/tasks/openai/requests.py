"""OpenAI's chat completions and completions requests as a node parses them (``fields.py`` says what it does with
each field): the messages, the response format, the sampling both share, and the request a queue task holds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from nodeagent.tasks.openai.fields import CHAT, COMPLETIONS, Refused


class _Open(BaseModel):
    """OpenAI's objects carry fields a node has no use for (``refusal``, ``annotations``, ``parsed``): kept."""

    model_config = ConfigDict(extra="allow")


class ToolCallFunction(_Open):
    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") not in ("text", "refusal"):
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text only)")
            parts.append(str(part.get("text", part.get("refusal", ""))))
        return "".join(parts)

    def plain(self) -> dict[str, Any]:
        """The message as the prompt is built from it: system for developer, text content, its calls."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


class JsonSchemaFormat(_Open):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # json_object with a schema (llama.cpp style)


class StreamOptions(_Open):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # ignored: nothing is obfuscated


class _Sampling(BaseModel):
    """What chat and text completions share."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=128)
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    keep_alive: float | str | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Any) -> Any:
        for key, value in (v or {}).items():
            if not str(key).lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys are token ids, got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"logit_bias values are from -100 to 100, got {value}")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def bias(self) -> dict[int, float]:
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def sampling(self, top: int | None) -> Any:
        """The decoder's sampling for this request (``top``: how many alternatives each log-probability lists)."""
        from nodeagent.tasks.decoding.sampling import Sampling

        return Sampling(temperature=self.temperature or 0.0, top_p=self.top_p if self.top_p is not None else 1.0,
                        seed=self.seed, logit_bias=self.bias(), frequency_penalty=self.frequency_penalty or 0.0,
                        presence_penalty=self.presence_penalty or 0.0, top_logprobs=top, stop=self.stop_list())


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _texts(cls, v: list[Message]) -> list[Message]:
        for m in v:
            m.text()  # raises for non-text parts
        return v

    def schema_for_output(self) -> dict[str, Any] | None:
        """The JSON Schema the output must follow: json_schema's schema, json_object's (or any object)."""
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise Refused("response_format", "response_format json_schema needs json_schema.schema",
                              code="invalid_value")
            return rf.json_schema.schema_
        return rf.schema_ or {"type": "object"}

    def top_k(self) -> int | None:
        """How many alternatives each token's log-probability lists (None: no log-probabilities)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise Refused("logprobs", "top_logprobs needs logprobs: true", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool | None = None
    best_of: int | None = Field(None, ge=1, le=20)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def queued_request(kind: str, body: dict[str, Any]) -> ChatRequest | CompletionRequest:
    """A chat or text completion request as a queue task holds it (a batch line's body, a gateway's request): the
    route's field table and validation, not streamed (its n choices decode in turn on the worker's slot);
    ValueError naming the field otherwise."""
    from pydantic import ValidationError

    table, model = (CHAT, ChatRequest) if kind == "chat" else (COMPLETIONS, CompletionRequest)
    table.check(body)  # Refused is a ValueError
    try:
        parsed = model.model_validate(body)
    except ValidationError as exc:
        from nodeagent.errors import validation_message

        raise ValueError(validation_message(exc)) from None
    if parsed.stream:
        raise Refused("stream", "a queued request is not streamed: its answer is the task's result (a gateway "
                                "streams it from the task's event log)")
    if isinstance(parsed, ChatRequest):
        parsed.top_k()  # top_logprobs without logprobs
        parsed.schema_for_output()
    return parsed
