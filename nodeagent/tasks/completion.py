"""Chat and text completions on a node's slots: the one implementation behind ``/v1/chat/completions`` and
``/v1/completions`` (and a queued chat task).

A request is first *prepared* on one slot: its prompt rendered and counted, its grammar built (tools,
``response_format``), everything a client can be told before the first token checked (the prompt's length, the
schema, the tools); that is where a bad request fails, so the HTTP door can answer it with a status code.
Then its ``n`` choices decode as parallel sequences of the slots engine, each on a slot of its own (the others
start once the first has read the prompt, so they take its cells instead of reading it again), and each
choice's text is read back (tool calls parsed and their arguments validated, a ``response_format`` object
validated). The answers are OpenAI's bodies; streaming gets each choice's pieces as they come.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from nodeagent.backends.session import exact_tokens
from nodeagent.errors import BackendError, TaskFailed
from nodeagent.tasks import events
from nodeagent.tasks import tools as toolsmod
from nodeagent.tasks.decoding.closer import Closer
from nodeagent.tasks.decoding.decoder import Decoded
from nodeagent.tasks.decoding.sampling import Sampling, TokenLogprob, token_logprob
from nodeagent.tasks.schema import prepare

Emit = Callable[[int, str, Any], None]  # (choice index, kind: content | tool_calls | logprobs, value)


@dataclass
class Prepared:
    kind: str  # chat | text
    prompts: list[list[int]]  # one per prompt (chat: one)
    prompt_texts: list[str]
    max_tokens: int  # the chosen tokens (a grammar's forced ones are free: tasks/decoding/)
    sampling: Sampling
    n: int
    grammar: str | None = None
    schema: dict[str, Any] | None = None  # the response_format schema the answer is validated against
    tools: toolsmod.ToolPlan | None = None
    closing: Callable[[], Closer] | None = None  # the tool answer's follower (tasks/decoding/closer.py): room kept to close
    echo: bool = False
    best_of: int = 1
    notes: list[str] = field(default_factory=list)
    room: int | None = None  # every token, forced ones included: what the context leaves after the prompt


@dataclass
class Choice:
    index: int
    text: str
    finish: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    masked: bool
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    chosen: int | None = None  # the tokens charged to max_tokens (None: every one)


def _fits(prompt: list[int], ctx: int, max_tokens: int) -> int:
    """The tokens the answer may take: max_tokens within what the context leaves after the prompt."""
    room = ctx - len(prompt)
    if room < 1:
        raise TaskFailed("input_too_long", f"the prompt is {len(prompt)} tokens and the context holds {ctx}: "
                                           "no room is left for an answer", False)
    return min(max_tokens, room)


def prepare_chat(runner: Any, messages: list[dict[str, Any]], max_tokens: int, sampling: Sampling, n: int,
                 schema: dict[str, Any] | None, tools: list[dict[str, Any]] | None, tool_choice: Any,
                 parallel: bool | None) -> Prepared:
    """A chat request checked and rendered on ``runner``'s session (TaskFailed for what cannot be done)."""
    s = runner.session
    notes: list[str] = []
    try:
        plan = toolsmod.plan_tools(tools or [], tool_choice, parallel, s.chat_template, runner.max_string_chars,
                                   runner.max_array_items)
    except ValueError as exc:
        raise TaskFailed("invalid_request", str(exc), False) from None
    if plan is not None and schema is not None:
        raise TaskFailed("invalid_request", "a response_format schema and tool calls cannot both constrain the "
                                            "answer: give one (tool_choice none keeps the format)", False)
    rendered, extra = toolsmod.render_messages(messages, plan, s.chat_template)
    prompt = runner._prompt_tokens(rendered, notes, extra)
    grammar = closing = None
    limit = _fits(prompt, s.ctx_per_slot, max_tokens)
    room = s.ctx_per_slot - len(prompt)
    if plan is not None:
        notes += [n for n in plan.notes if n not in notes]
        grammar, closing = toolsmod.grammar(plan), toolsmod.closers(plan)
        if plan.calls_only:
            _room_for_a_call(runner, grammar, closing, limit, max_tokens, room,
                             runner.fast_forward and sampling.top_logprobs is None)
    elif schema is not None:
        try:  # the same preparation as extraction: bounds, relaxations (stated), the final validation after
            p = prepare(schema, runner.max_string_chars, runner.max_array_items, object_root=False)
        except ValueError as exc:
            raise TaskFailed("schema_unsupported", f"the response format's schema cannot be used: {exc}",
                             False) from None
        notes += [n for n in p.relaxations if n not in notes]
        grammar = p.grammar()
    if grammar is not None:
        runner._matcher(grammar)  # refused here, before any token, when the decoder cannot compile it
    return Prepared(kind="chat", prompts=[prompt], prompt_texts=[s.detokenize(prompt)], max_tokens=limit,
                    room=room, sampling=sampling, n=n, grammar=grammar, schema=schema if plan is None else None,
                    tools=plan, closing=closing, notes=notes)


def _room_for_a_call(runner: Any, grammar: str, closing: Callable[[], Closer], limit: int, max_tokens: int,
                     room: int, free: bool) -> None:
    """Refused before any token when the answer cannot hold the shortest call the request admits: its chosen
    tokens (the name's choice, the arguments: the envelope the grammar forces is free when ``free``) within
    ``max_tokens``, and all its tokens within what the context leaves."""
    from nodeagent.tasks.decoding.budget import chosen_tokens

    s = runner.session
    shortest = closing().closing() or ""
    every = len(s.tokenize_continuation(shortest))
    need = chosen_tokens(s, runner._matcher(grammar), shortest) if free else every
    if every > room:
        raise TaskFailed("max_tokens_too_small", f"the {room} tokens the context leaves cannot hold a tool call: "
                                                 f"the shortest this request admits takes {every} tokens "
                                                 f"({shortest}); shorten the prompt", False)
    if need > limit:
        where = f"max_tokens {max_tokens}" if limit == max_tokens else f"the {limit} tokens the context leaves"
        raise TaskFailed("max_tokens_too_small", f"{where} cannot hold a tool call: the shortest this request "
                                                 f"admits needs {need} tokens of the model's ({shortest}, its "
                                                 f"syntax not counted); give max_tokens of at least {need}", False)


def model_id(spec: str) -> str:
    """A model's id for clients: its catalog name, or its file's name without the extension (never a path of
    this machine)."""
    return Path(spec).stem if ("/" in spec or spec.endswith(".gguf")) else spec


def prepare_request(runner: Any, body: Any, max_tokens: int, top: int | None,
                    schema: dict[str, Any] | None) -> Prepared:
    """A ChatRequest prepared: the route's and a queued chat task's one way in."""
    return prepare_chat(runner, [m.plain() for m in body.messages], max_tokens, body.sampling(top), body.n or 1,
                        schema, body.tools, body.tool_choice, body.parallel_tool_calls)


def queued(runner: Any, kind: str, request: dict[str, Any], model: str, max_tokens: int,
           notes: list[str], counts: dict[str, int], progress: Callable[[dict[str, Any]], None] | None = None
           ) -> dict[str, Any]:
    """A queued chat or text completion (chat.v1, completion.v1) on one runner (its ``n`` choices in turn): the
    body the route answers. ``max_tokens``: the answer's room when the request gives none (chat: up to what the
    context leaves). ``progress``: told the request was prepared (its notes, its choices; what a stream's headers
    carry) and each piece of each choice as it comes (a gateway streams them)."""
    from nodeagent.tasks.openai_api import queued_request

    body = queued_request(kind, request)
    if kind == "chat":
        prepared = prepare_request(runner, body, body.max_completion_tokens or body.max_tokens or max_tokens,
                                   body.top_k(), body.schema_for_output())
    else:
        n = body.n or 1
        prepared = prepare_text(runner, body.prompts(), 16 if body.max_tokens is None else body.max_tokens,
                                body.sampling(body.logprobs), n, bool(body.echo), body.best_of or n)
    emit = None
    start = None  # the content an earlier attempt of this stream sent: the answer continues from it
    if progress is not None:
        resume = progress.resume if isinstance(progress, events.Progress) else None
        why = None if resume is None else resume.why_not or unresumable(runner, prepared, resume.content)
        if why is not None:  # the gateway ends the stream saying why, and cancels the task
            progress(events.Prepared.of(prepared, unresumable=why).to_wire())
            raise TaskFailed("not_resumable", why, False)
        start = None if resume is None else resume.content
        progress(events.Prepared.of(prepared, resumed=None if start is None else len(start)).to_wire())
        emit = lambda index, what, value: progress(events.Piece(index, what, value).to_wire())  # noqa: E731
    choices = run([runner], prepared, emit, start)
    notes += [n for n in prepared.notes if n not in notes]
    u = usage(prepared, choices)
    counts["prompt"], counts["generated"] = u["prompt_tokens"], u["completion_tokens"]
    return (chat_body if kind == "chat" else text_body)(model, prepared, choices, runner.session)


def unresumable(runner: Any, prepared: Prepared, content: str) -> str | None:
    """Why a stream that sent ``content`` cannot be continued from it here, or None when it can."""
    if prepared.n != 1 or len(prepared.prompts) != 1 or prepared.best_of != 1:
        return "it has several choices"
    if prepared.echo:
        return "it echoes its prompt"
    if prepared.sampling.top_logprobs is not None:
        return ("it asked for log-probabilities, which this node cannot honestly give for the tokens another node "
                "sampled")
    given = exact_tokens(runner.session, raw_prefix(prepared, content))
    if given is None:
        return "this model's tokenizer does not give back the text sent exactly"
    if len(prepared.prompts[0]) + len(given) >= runner.session.ctx_per_slot:
        return "the text sent no longer fits the context with the prompt"
    return None


def raw_prefix(prepared: Prepared, content: str) -> str:
    """The answer's text that shows ``content`` (a stream's pieces are its content): the content itself, but for
    the generic tool format, whose text is ``{"response": "<content, escaped>``."""
    plan = prepared.tools
    if plan is not None and plan.format == "generic":
        return toolsmod.RESPONSE_LEAD + json.dumps(content, ensure_ascii=False)[1:-1]
    return content


def prepare_text(runner: Any, prompts: list[str | list[int]], max_tokens: int, sampling: Sampling, n: int,
                 echo: bool, best_of: int) -> Prepared:
    """A text completion: each prompt as it is (no chat template), or its token ids."""
    s = runner.session
    tokens: list[list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            tokens.append(s.tokenize(p))
        else:
            bad = next((t for t in p if not 0 <= t < s.n_vocab), None)
            if bad is not None:
                raise TaskFailed("invalid_request", f"the prompt's token {bad} is not in the model's vocabulary "
                                                    f"(0-{s.n_vocab - 1})", False)
            tokens.append(list(p))
        if not tokens[-1]:
            raise TaskFailed("invalid_request", "a prompt is empty", False)
    longest = max(tokens, key=len)
    limit = _fits(longest, s.ctx_per_slot, max_tokens) if max_tokens > 0 else 0
    if max_tokens == 0 and len(longest) > s.ctx_per_slot:
        _fits(longest, s.ctx_per_slot, 1)
    return Prepared(kind="text", prompts=tokens, prompt_texts=[s.detokenize(t) for t in tokens], max_tokens=limit,
                    sampling=sampling, n=n, echo=echo, best_of=max(best_of, n))


def run(runners: list[Any], prepared: Prepared, emit: Emit | None = None, start: str | None = None) -> list[Choice]:
    """Every choice of every prompt, decoded on the runners (one a choice; the first reads the prompt, the rest
    follow and share its cells; more choices than runners decode in turn on the same runners, whose cells still
    hold the prompt); choices in OpenAI's order (prompt by prompt, ``n`` each). ``start``: the content the one
    choice begins with (a stream continued from another node's: not sent again)."""
    per_prompt = prepared.best_of if prepared.kind == "text" else prepared.n
    out: list[Choice] = []
    for p, prompt in enumerate(prepared.prompts):
        choices: list[Choice] = []
        for first in range(0, per_prompt, len(runners)):
            wave = runners[: min(len(runners), per_prompt - first)]
            choices += _run_wave(wave, prepared, prompt, p * prepared.n, first, emit, start)
        if per_prompt > prepared.n:  # best_of: the n most likely of them
            choices = sorted(choices, key=lambda c: -sum(x.logprob for x in c.logprobs))[:prepared.n]
            for i, c in enumerate(choices):
                c.index = p * prepared.n + i
        out += choices
    return out


def _run_wave(runners: list[Any], prepared: Prepared, prompt: list[int], base: int, first: int,
              emit: Emit | None, start: str | None = None) -> list[Choice]:
    """Choices ``first`` .. ``first + len(runners) - 1`` of a prompt, one a runner, decoded together."""
    results: list[Choice | BaseException | None] = [None] * len(runners)
    first_read = threading.Event()

    def one(i: int) -> None:
        try:
            results[i] = _choice(runners[i], prepared, prompt, base + first + i, first + i, emit,
                                 first_read.set if i == 0 else None, start)
        except BaseException as exc:  # noqa: BLE001  (raised again on the calling thread)
            results[i] = exc
        finally:
            if i == 0:
                first_read.set()

    if len(runners) == 1:
        one(0)
    else:
        threads = [threading.Thread(target=one, args=(0,), name="choice-0")]
        threads[0].start()
        first_read.wait()  # the others start from the first's cells (seq_cp) instead of reading the prompt again
        for i in range(1, len(runners)):
            t = threading.Thread(target=one, args=(i,), name=f"choice-{i}")
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return [r for r in results if isinstance(r, Choice)]


def _choice(runner: Any, prepared: Prepared, prompt: list[int], index: int, k: int, emit: Emit | None,
            read: Callable[[], None] | None, start: str | None = None) -> Choice:
    s = runner.session
    sampling = prepared.sampling
    if sampling.seed is not None and sampling.seed >= 0 and k:
        sampling = Sampling(**{**sampling.__dict__, "seed": sampling.seed + k})  # each choice its own draw
    if prepared.best_of > prepared.n and sampling.top_logprobs is None:
        sampling = Sampling(**{**sampling.__dict__, "top_logprobs": 0})  # ranked by their log-probabilities
    try:
        prompt_lp = _prompt_logprobs(runner, prompt, sampling.top_logprobs or 0) if prepared.echo and \
            sampling.top_logprobs is not None else []
        matcher = runner._matcher(prepared.grammar) if prepared.grammar is not None else None
        streamer = _Streamer(s, index, emit, prepared, start or "") if emit is not None else None
        prefix = exact_tokens(s, raw_prefix(prepared, start)) if start else None  # checked by ``unresumable``
        if prepared.max_tokens == 0:
            decoded = Decoded(tokens=[], finish="length")
            if read is not None:
                read()
        else:
            decoded = runner.decode(prompt, matcher, prepared.max_tokens, {},
                                    lambda n: runner._check_stop(None, f"after {n} generated tokens"), sampling,
                                    on_token=streamer.tokens if streamer else None, after_prefill=read,
                                    closing=prepared.closing, room=prepared.room, prefix=prefix)
    except BackendError as exc:  # the model failed under the request: another may succeed
        raise TaskFailed("backend_error", str(exc), True) from None
    text = s.detokenize(decoded.tokens)
    for stop in prepared.sampling.stop:  # the stop text itself is not returned
        if stop in text:
            text = text[: text.index(stop)]
    choice = Choice(index=index, text=text, finish=decoded.finish, tokens=decoded.tokens, logprobs=decoded.logprobs,
                    masked=decoded.masked, content=text, prompt_logprobs=prompt_lp, chosen=decoded.charged)
    if decoded.cut is not None:  # closed early to stay valid within max_tokens: the answer was cut all the same
        choice.finish = "length"
        _note(prepared, f"max_tokens: the answer was closed early at {decoded.cut} (what would have followed is "
                        "left out) so that it stays valid; finish_reason length")
    if prepared.tools is not None or decoded.finish == "stop":
        _read_back(runner, prepared, choice, decoded.cut)
    if streamer is not None:
        streamer.finish(choice)
    return choice


def _note(prepared: Prepared, note: str) -> None:
    if note not in prepared.notes:
        prepared.notes.append(note)


def _read_back(runner: Any, prepared: Prepared, choice: Choice, cut: str | None = None) -> None:
    """The answer's calls and content (however it ended: the tool format's syntax is never the content), or its
    validated object; TaskFailed for one that breaks its schema. A call after the first that had to be closed
    early (``cut``) is left out, as a call cut short is: only the answer's one call is kept that way."""
    plan = prepared.tools
    if plan is not None:
        try:
            parsed = toolsmod.parse(choice.text, plan, prepared.closing)
        except (ValueError, KeyError, TypeError) as exc:
            raise TaskFailed("invalid_output", f"the answer is not the tool format the decoder enforced: {exc}",
                             False) from None
        later = re.match(r"tool_calls\[([1-9][0-9]*)\]", cut or "")
        if later is not None and len(parsed.calls) > int(later.group(1)):
            parsed.dropped += len(parsed.calls) - int(later.group(1))
            del parsed.calls[int(later.group(1)):]
        if parsed.dropped:
            _note(prepared, "tool calls: a call cut short by the end of generation left out")
        calls = []
        for call in parsed.calls:
            problem = runner._validate(toolsmod.function(plan, call["name"]).parameters, call["arguments"])
            if problem is not None and choice.finish == "length":  # closed early and invalid for it: left out
                _note(prepared, f"tool calls: the call of {call['name']} was cut short and breaks its schema at "
                                f"{problem}: left out")
                continue
            if problem is not None:
                raise TaskFailed("invalid_output", f"the call of {call['name']} breaks its parameters' schema at "
                                                   f"{problem}", False)
            calls.append(call)
        choice.content, choice.tool_calls = parsed.content, toolsmod.openai_calls(calls)
        return
    if prepared.schema is not None:
        problem = runner._checked(choice.text, prepared.schema)[1]
        if problem is not None:
            raise TaskFailed("invalid_output", f"the output breaks the schema at {problem}", False)


def _prompt_logprobs(runner: Any, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the ones before it (None for the first), read afresh."""
    s = runner.session
    s.truncate(0)
    rows = s.eval_all(prompt)
    return [None] + [token_logprob(rows[i], None, prompt[i + 1], k) for i in range(len(prompt) - 1)]


class _Streamer:
    """A choice's pieces as they come: its content (never the tool format's syntax: text held back while it could
    still be the start of a call, a generic ``response`` unwrapped as it grows), then, at the end, its calls."""

    def __init__(self, session: Any, index: int, emit: Emit, prepared: Prepared, sent: str = "") -> None:
        self.s, self.index, self.emit, self.prepared = session, index, emit, prepared
        self.sent = sent  # what went out (by an earlier attempt, for a stream continued here)
        plan = prepared.tools
        self.live = plan is None or not plan.calls_only
        self.hold = toolsmod.HERMES_OPEN if plan is not None and plan.format == "hermes" else ""

    def tokens(self, out: list[int]) -> None:
        if not self.live:
            return
        text = self.s.detokenize(out)
        if text.endswith("\ufffd"):
            return  # half a character: wait for the rest
        stop = next((t for t in self.prepared.sampling.stop if t in text), None)
        if stop is not None:
            text = text[: text.index(stop)]
        shown = self._content(text)
        if shown is not None and len(shown) > len(self.sent) and shown.startswith(self.sent):
            self.emit(self.index, "content", shown[len(self.sent):])
            self.sent = shown

    def _content(self, text: str) -> str | None:
        """The content the text shows so far (None: nothing yet)."""
        plan = self.prepared.tools
        if plan is None:
            return text
        if plan.format == "generic":  # {"response": "..."} grows as its text; a call comes at the end
            if text.startswith(toolsmod.RESPONSE_LEAD):
                return toolsmod.response_text(text)
            if not toolsmod.RESPONSE_LEAD.startswith(text):
                self.live = False
            return None
        if self.hold in text:
            self.live = False  # a call began: the rest comes as tool_calls
            return text[: text.index(self.hold)]
        for cut in range(len(self.hold) - 1, 0, -1):  # text that may be the trigger's start waits
            if text.endswith(self.hold[:cut]):
                return text[:-cut]
        return text

    def finish(self, choice: Choice) -> None:
        content = choice.content if choice.tool_calls or self.prepared.tools is not None else choice.text
        if content and len(content) > len(self.sent) and content.startswith(self.sent):
            self.emit(self.index, "content", content[len(self.sent):])
        if choice.tool_calls:
            self.emit(self.index, "tool_calls", choice.tool_calls)


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


def chat_body(model: str, prepared: Prepared, choices: list[Choice], session: Any) -> dict[str, Any]:
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


def text_body(model: str, prepared: Prepared, choices: list[Choice], session: Any) -> dict[str, Any]:
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


def legacy_logprobs(session: Any, prepared: Prepared, c: Choice, p: int) -> dict[str, Any]:
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


def usage(prepared: Prepared, choices: list[Choice]) -> dict[str, int]:
    prompt = sum(len(p) for p in prepared.prompts)
    completion = sum(len(c.tokens) if c.chosen is None else c.chosen for c in choices)  # forced syntax not counted
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def fingerprint(prepared: Prepared) -> str:
    """``system_fingerprint``: nodeagent's, and whether anything was left to the final validation."""
    relaxed = any("final validation" in n or "bounded at" in n for n in prepared.notes)
    return "nodeagent" + ("-relaxed" if relaxed else "")


def logprob_kind(choices: list[Choice]) -> str:
    """Which distribution the log-probabilities are from: the model's, or renormalised over a grammar's tokens."""
    return "grammar-masked" if any(c.masked for c in choices) else "model"
