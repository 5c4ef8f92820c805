"""Every field of OpenAI's requests as a node treats it, one ``FieldTable`` per request (chat completions,
completions, Responses), each field one of

- ``honoured``: it changes the answer as OpenAI's does;
- ``ignored``: harmless here (accounting, caching and routing hints of OpenAI's own service), accepted;
- ``refused``: it would change the answer and is not implemented: a 400 in OpenAI's shape that names it and
  says why, unless it is null (null means unset) or holds a value that changes nothing (``harmless``:
  ``modalities: ["text"]``, ``background: false``).

A field in no row is refused too ("Unrecognized request argument supplied"), as OpenAI refuses it, so a new field
cannot slip in as silently ignored. ``keep_alive`` (Ollama's) is honoured with the node's model set. The rows follow
openai-python 3.57 (chat, completions) and 3.63 (``ResponseCreateParams``), and the API reference.

``EMBEDDINGS`` is ``/v1/embeddings``' (``dimensions`` honoured where the model declares Matryoshka sizes, refused
by the node otherwise). ``BATCHES`` is the Batch API's create request's.

``Refused`` is the one error of a request's checks here: the field it is about (``param``) and its ``code`` are
values, never parsed from the message. It is an ``HttpError`` (a 400, which the server's middleware renders in
OpenAI's shape: no route translates it) and a ``ValueError`` (what a library caller, or a pydantic validator,
catches), as huggingface_hub's ``BadRequestError(HfHubHTTPError, ValueError)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from nodeagent.errors import HttpError

Treatment = Literal["honoured", "ignored", "refused"]


class Refused(HttpError, ValueError):
    """A request refused before anything runs: a 400 naming the field it is about (``param``), with OpenAI's
    ``code``, as values."""

    def __init__(self, param: str | None, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(400, message, code=code, param=param)


@dataclass(frozen=True)
class FieldTable:
    """One request's fields: honoured, ignored, refused (with why, and the values that change nothing)."""

    honoured: frozenset[str]
    ignored: frozenset[str]
    refused: Mapping[str, str]  # the field -> why it is refused
    harmless: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)  # refused, but these values accepted

    @classmethod
    def of(cls, honoured: str, ignored: str, refused: Mapping[str, str],
           harmless: Mapping[str, tuple[Any, ...]] | None = None) -> "FieldTable":
        """A table from its rows: the honoured and ignored fields as space-separated names."""
        return cls(frozenset(honoured.split()), frozenset(ignored.split()), dict(refused), dict(harmless or {}))

    def treatment(self, name: str) -> Treatment | None:
        """How a field is treated (None: no row has it, so it is refused as unknown)."""
        return ("honoured" if name in self.honoured else "ignored" if name in self.ignored
                else "refused" if name in self.refused else None)

    def names(self) -> set[str]:
        return set(self.honoured) | set(self.ignored) | set(self.refused)

    def check(self, body: Mapping[str, Any]) -> None:
        """Refused for a field no row has, or a refused one that is set (not null, not a harmless value)."""
        unknown = sorted(k for k in body if self.treatment(k) is None)
        if unknown:
            raise Refused(unknown[0], f"Unrecognized request argument supplied: {', '.join(unknown)}",
                          code="unknown_parameter")
        for name, value in body.items():
            if name in self.refused and value is not None and value not in self.harmless.get(name, ()):
                raise Refused(name, f"Unsupported parameter: '{name}': {self.refused[name]}")


CHAT = FieldTable.of(
    honoured="messages model max_tokens max_completion_tokens temperature top_p seed stop stream stream_options n "
             "response_format tools tool_choice parallel_tool_calls logprobs top_logprobs logit_bias "
             "frequency_penalty presence_penalty keep_alive",
    ignored="user metadata store service_tier prompt_cache_key prompt_cache_retention prompt_cache_options "
            "safety_identifier reasoning_effort verbosity",
    refused={"audio": "audio output is not supported (text only)", "modalities": "only text output is supported",
             "prediction": "predicted outputs are not supported", "web_search_options": "there is no web search here",
             "moderation": "moderation is not done here", "functions": "use tools (functions is the deprecated form)",
             "function_call": "use tool_choice (function_call is the deprecated form)"},
    harmless={"modalities": (["text"],)})

COMPLETIONS = FieldTable.of(
    honoured="model prompt max_tokens temperature top_p seed stop stream stream_options n logprobs echo logit_bias "
             "frequency_penalty presence_penalty best_of keep_alive",
    ignored="user",
    refused={"suffix": "suffix (insertion) is not supported"})

RESPONSES = FieldTable.of(
    honoured="input instructions model max_output_tokens temperature top_p seed text tools tool_choice "
             "parallel_tool_calls stream store previous_response_id keep_alive max_tool_calls",
    ignored="metadata user service_tier prompt_cache_key prompt_cache_retention prompt_cache_options "
            "safety_identifier stream_options",
    refused={
        "background": "background responses are not run here (answer in the request, or use /v1/batches)",
        "include": "no extra output (reasoning, logprobs, search results) is produced here",
        "truncation": "the input is never truncated here (a prompt too long is a 400)",
        "reasoning": "these models do not reason in a separate channel",
        "top_logprobs": "log-probabilities are given by /v1/chat/completions (logprobs, top_logprobs)",
        "conversation": "conversations are not kept here: continue with previous_response_id",
        "prompt": "stored prompt templates are not kept here",
        "context_management": "the context is not compacted here",
        "moderation": "moderation is not done here",
        "image": "image generation is not done here",
        "access_programs": "not supported here",
        "background_options": "background responses are not run here"},
    harmless={"background": (False,), "include": ([],), "truncation": ("disabled",), "top_logprobs": (0,),
              "reasoning": ({}, {"effort": None}, {"effort": None, "summary": None}, {"summary": None})})

EMBEDDINGS = FieldTable.of(
    honoured="input model encoding_format dimensions",
    ignored="user",
    refused={})

# /v1/rerank (llama-server's, with Jina's and Cohere's fields): a document is read whole, never cut
RERANK = FieldTable.of(
    honoured="query documents model top_n return_documents instruction",
    ignored="user",
    refused={"rank_fields": "documents are texts (strings, or objects holding text) here: send each as its text",
             "max_chunks_per_doc": "a document is read whole, never cut into chunks: split a long document",
             "max_tokens_per_doc": "a document is read whole, never cut: shorten or split a long document"})

# the Batch API's create request (``POST /v1/batches``); output_expires_after is accepted and changes nothing here:
# a batch's output and error files are kept NODEAGENT_RESULT_RETENTION_S after it ends
BATCHES = FieldTable.of(honoured="input_file_id endpoint completion_window metadata", ignored="output_expires_after",
                        refused={})

# The Responses request's names for the chat request's fields it runs as (an error names what the client sent)
RESPONSES_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                   "messages": "input", "response_format": "text.format"}

METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits on a metadata object


def check_metadata(value: Any, param: str = "metadata") -> None:
    """Refused unless ``value`` is None or OpenAI's metadata: an object of at most 16 string values, keys up to 64
    characters and values up to 512 (a batch's, a stored response's)."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > METADATA_PAIRS or any(
            not isinstance(k, str) or not isinstance(v, str) or len(k) > METADATA_KEY_CHARS
            or len(v) > METADATA_VALUE_CHARS for k, v in value.items()):
        raise Refused(param, f"{param} holds at most {METADATA_PAIRS} string values (keys up to "
                             f"{METADATA_KEY_CHARS} characters, values up to {METADATA_VALUE_CHARS})",
                      code="invalid_value")
