"""OpenAI's answer bodies from a completion's choices: chat completions' (message, tool calls, log-probabilities
with their bytes) and legacy completions' (text, echo, token offsets), with ``usage`` (a grammar's forced syntax
is not counted) and ``system_fingerprint`` (whether anything was left to the final validation)."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from nodeagent.tasks.decoding.sampling import TokenLogprob
from nodeagent.tasks.openai.spec import Choice, PreparedRequest


def model_id(spec: str) -> str:
    """A model's id for clients: its catalog name, or its file's name without the extension (never a path of
    this machine)."""
    return Path(spec).stem if ("/" in spec or spec.endswith(".gguf")) else spec


def finish_reason(c: Choice) -> str:
    """OpenAI's finish_reason: tool_calls when the answer ended with its calls, length when it was cut (calls it
    holds were closed early, or one was left out), else how it stopped."""
    return "tool_calls" if c.tool_calls and c.finish != "length" else c.finish


# -- OpenAI's bodies ----------------------------------------------------------------------------------------
def token_entry(session: Any, lp: TokenLogprob) -> dict[str, Any]:
    """A token's log-probability as chat completions give it: its text (``bytes:\\xNN`` where it is not UTF-8 on
    its own), its bytes, and the alternatives."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = session.token_bytes(token)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(raw)}

    return {**one(lp.token, lp.logprob), "top_logprobs": [one(t, v) for t, v in lp.top]}


def chat_body(model: str, prepared: PreparedRequest, choices: list[Choice], session: Any) -> dict[str, Any]:
    out = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content, "refusal": None}
        finish = finish_reason(c)
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        logprobs = None
        if prepared.sampling.top_logprobs is not None:
            logprobs = {"content": [token_entry(session, lp) for lp in c.logprobs], "refusal": None}
        out.append({"index": c.index, "message": message, "finish_reason": finish, "logprobs": logprobs})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(prepared, choices),
            "system_fingerprint": fingerprint(prepared)}


def text_body(model: str, prepared: PreparedRequest, choices: list[Choice], session: Any) -> dict[str, Any]:
    out = []
    for c in choices:
        p = c.index // prepared.n
        text = (prepared.prompt_texts[p] if prepared.echo else "") + c.text
        out.append({"index": c.index, "text": text, "finish_reason": c.finish,
                    "logprobs": legacy_logprobs(session, prepared, c, p) if prepared.sampling.top_logprobs is not None
                    else None})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(prepared, choices),
            "system_fingerprint": fingerprint(prepared)}


def legacy_logprobs(session: Any, prepared: PreparedRequest, c: Choice, p: int) -> dict[str, Any]:
    """Legacy completions' logprobs: tokens, token_logprobs, top_logprobs (a dict each, the chosen token
    included) and text offsets; with echo the prompt's tokens come first, the first of them without one."""
    tokens = (prepared.prompts[p] if prepared.echo else []) + c.tokens
    entries: list[TokenLogprob | None] = (c.prompt_logprobs if prepared.echo else []) + list(c.logprobs)
    texts = [session.token_bytes(t).decode("utf-8", "replace") for t in tokens]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    tops: list[dict[str, float] | None] = []
    for e in entries:
        if e is None:
            tops.append(None)
            continue
        top = {session.token_bytes(t).decode("utf-8", "replace"): max(v, -9999.0) for t, v in e.top}
        top.setdefault(session.token_bytes(e.token).decode("utf-8", "replace"), max(e.logprob, -9999.0))
        tops.append(top)
    return {"tokens": texts, "token_logprobs": [None if e is None else max(e.logprob, -9999.0) for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def usage(prepared: PreparedRequest, choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in prepared.prompts)
    completion = sum(len(c.tokens) if c.chosen is None else c.chosen for c in choices)  # forced syntax not counted
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fingerprint(prepared: PreparedRequest) -> str:
    """``system_fingerprint``: nodeagent's, and whether anything was left to the final validation."""
    relaxed = any("final validation" in n or "bounded at" in n for n in prepared.notes)
    return "nodeagent" + ("-relaxed" if relaxed else "")


def logprob_kind(choices: list[Choice]) -> str:
    """Which distribution the log-probabilities are from: the model's, or renormalised over a grammar's tokens."""
    return "grammar-masked" if any(c.masked for c in choices) else "model"
