"""Chat and text completions on a node's slots: the one engine behind ``/v1/chat/completions``, ``/v1/completions``
and ``/v1/responses`` (on `serve`) and a queued chat or completion task (on a worker), entered once: ``complete``.

A request (``spec.py``'s ``CompletionSpec``) is first *prepared* on one slot: its prompt rendered and counted, its
grammar built (tools, ``response_format``), everything a client can be told before the first token checked (the
prompt's length, the schema, the tools); that is where a bad request fails, so the HTTP door can answer it with a
status code. Then its choices decode as parallel sequences of the slots engine, each on a slot of its own (the
others start once the first has read the prompt, so they take its cells instead of reading it again), and each
choice's text is read back (tool calls parsed and their arguments validated, a ``response_format`` object
validated). What happens goes to a sink as ``tasks/events.py`` values (``Prepared``, each ``Piece``); the answer
is a ``Finished`` holding OpenAI's body (``bodies.py``).
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, Callable, Protocol

from nodeagent.backends.session import TokenSession, exact_tokens
from nodeagent.errors import BackendError, TaskFailed
from nodeagent.tasks import events
from nodeagent.tasks.decoding.closer import Closer
from nodeagent.tasks.decoding.decoder import Decoded, DecodeSpec
from nodeagent.tasks.decoding.sampling import Sampling, TokenLogprob, token_logprob
from nodeagent.tasks.openai import bodies
from nodeagent.tasks.openai import tools as toolsmod
from nodeagent.tasks.openai.spec import Choice, CompletionSpec, PreparedRequest
from nodeagent.tasks.schema import prepare as prepare_schema
from nodeagent.tasks.tokens import token_ids

Emit = Callable[[int, str, Any], None]  # (choice index, kind: content | tool_calls | logprobs, value)


class Slot(Protocol):
    """What the engine uses of one slot of a model that generates (``tasks/runner.py``'s ``TaskRunner`` is one):
    its session, its decoding defaults and output bounds, and the steps it runs on them."""

    session: TokenSession
    decoding: DecodeSpec
    max_string_chars: int | None
    max_array_items: int | None

    def prompt_tokens(self, messages: list[dict[str, Any]], notes: list[str], extra: dict[str, Any] | None = None,
                      suffix: str = "") -> list[int]: ...
    def matcher(self, grammar: str) -> Any: ...
    def spec(self, max_tokens: int, **options: Any) -> DecodeSpec: ...
    def decode(self, prompt: list[int], matcher: Any, spec: DecodeSpec, timing: dict, check: Callable[[int], None],
               on_token: Callable[[list[int]], None] | None = None,
               after_prefill: Callable[[], None] | None = None) -> Decoded: ...
    def check_stop(self, task: Any, where: str) -> None: ...
    def checked(self, text: str, schema: dict[str, Any]) -> tuple[Any, str | None]: ...
    def validate(self, schema: dict[str, Any], value: Any) -> str | None: ...


def _fits(prompt: list[int], ctx: int, max_tokens: int) -> int:
    """The tokens the answer may take: max_tokens within what the context leaves after the prompt."""
    room = ctx - len(prompt)
    if room < 1:
        raise TaskFailed("input_too_long", f"the prompt is {len(prompt)} tokens and the context holds {ctx}: "
                                           "no room is left for an answer", False)
    return min(max_tokens, room)


def prepare(runner: Slot, spec: CompletionSpec) -> PreparedRequest:
    """The request checked and rendered on ``runner``'s session (TaskFailed for what cannot be done)."""
    token_ids(spec.sampling.logit_bias, runner.session.n_vocab, "logit_bias")
    return (prepare_chat if spec.kind == "chat" else prepare_text)(runner, spec)


def prepare_chat(runner: Slot, spec: CompletionSpec) -> PreparedRequest:
    """A chat request checked and rendered: its tools' plan or its response format's grammar, its prompt."""
    s = runner.session
    notes: list[str] = []
    try:
        plan = toolsmod.plan_tools(spec.tools or [], spec.tool_choice, spec.parallel_tool_calls, s.chat_template,
                                   runner.max_string_chars, runner.max_array_items)
    except ValueError as exc:
        raise TaskFailed("invalid_request", str(exc), False) from None
    if plan is not None and spec.schema is not None:
        raise TaskFailed("invalid_request", "a response_format schema and tool calls cannot both constrain the "
                                            "answer: give one (tool_choice none keeps the format)", False)
    rendered, extra = toolsmod.render_messages(list(spec.messages), plan, s.chat_template)
    prompt = runner.prompt_tokens(rendered, notes, extra)
    grammar = closing = None
    limit = _fits(prompt, s.ctx_per_slot, spec.max_tokens)
    room = s.ctx_per_slot - len(prompt)
    if plan is not None:
        notes += [n for n in plan.notes if n not in notes]
        grammar, closing = toolsmod.grammar(plan), toolsmod.closers(plan)
        if plan.calls_only:
            _room_for_a_call(runner, grammar, closing, limit, spec.max_tokens, room,
                             runner.decoding.fast_forward and spec.sampling.top_logprobs is None)
    elif spec.schema is not None:
        try:  # the same preparation as extraction: bounds, relaxations (stated), the final validation after
            p = prepare_schema(spec.schema, runner.max_string_chars, runner.max_array_items, object_root=False)
        except ValueError as exc:
            raise TaskFailed("schema_unsupported", f"the response format's schema cannot be used: {exc}",
                             False) from None
        notes += [n for n in p.relaxations if n not in notes]
        grammar = p.grammar()
    if grammar is not None:
        runner.matcher(grammar)  # refused here, before any token, when the decoder cannot compile it
    return PreparedRequest(kind="chat", prompts=[prompt], prompt_texts=[s.detokenize(prompt)], max_tokens=limit,
                           room=room, sampling=spec.sampling, n=spec.n, grammar=grammar,
                           schema=spec.schema if plan is None else None, tools=plan, closing=closing, notes=notes)


def _room_for_a_call(runner: Slot, grammar: str, closing: Callable[[], Closer], limit: int, max_tokens: int,
                     room: int, free: bool) -> None:
    """Refused before any token when the answer cannot hold the shortest call the request admits: its chosen
    tokens (the name's choice, the arguments: the envelope the grammar forces is free when ``free``) within
    ``max_tokens``, and all its tokens within what the context leaves."""
    from nodeagent.tasks.decoding.budget import chosen_tokens

    s = runner.session
    shortest = closing().closing() or ""
    every = len(s.tokenize_continuation(shortest))
    need = chosen_tokens(s, runner.matcher(grammar), shortest) if free else every
    if every > room:
        raise TaskFailed("max_tokens_too_small", f"the {room} tokens the context leaves cannot hold a tool call: "
                                                 f"the shortest this request admits takes {every} tokens "
                                                 f"({shortest}); shorten the prompt", False)
    if need > limit:
        where = f"max_tokens {max_tokens}" if limit == max_tokens else f"the {limit} tokens the context leaves"
        raise TaskFailed("max_tokens_too_small", f"{where} cannot hold a tool call: the shortest this request "
                                                 f"admits needs {need} tokens of the model's ({shortest}, its "
                                                 f"syntax not counted); give max_tokens of at least {need}", False)


def unresumable(runner: Slot, prepared: PreparedRequest, content: str) -> str | None:
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


def raw_prefix(prepared: PreparedRequest, content: str) -> str:
    """The answer's text that shows ``content`` (a stream's pieces are its content): the content itself, but for
    the generic tool format, whose text is ``{"response": "<content, escaped>``."""
    plan = prepared.tools
    if plan is not None and plan.format == "generic":
        return toolsmod.RESPONSE_LEAD + json.dumps(content, ensure_ascii=False)[1:-1]
    return content


def prepare_text(runner: Slot, spec: CompletionSpec) -> PreparedRequest:
    """A text completion: each prompt as it is (no chat template), or its token ids."""
    s = runner.session
    tokens: list[list[int]] = []
    for p in spec.prompts:
        if isinstance(p, str):
            tokens.append(s.tokenize(p))
        else:
            tokens.append(token_ids(p, s.n_vocab, "prompt"))
        if not tokens[-1]:
            raise TaskFailed("invalid_request", "a prompt is empty", False)
    longest = max(tokens, key=len)
    limit = _fits(longest, s.ctx_per_slot, spec.max_tokens) if spec.max_tokens > 0 else 0
    if spec.max_tokens == 0 and len(longest) > s.ctx_per_slot:
        _fits(longest, s.ctx_per_slot, 1)
    return PreparedRequest(kind="text", prompts=tokens, prompt_texts=[s.detokenize(t) for t in tokens],
                           max_tokens=limit, sampling=spec.sampling, n=spec.n, echo=spec.echo,
                           best_of=max(spec.best_of, spec.n))


def complete(runners: list[Slot], spec: CompletionSpec, sink: Callable[[events.Event], None] | None, model: str,
             resume: events.Resume | None = None) -> events.Finished:
    """The request on ``runners`` (one a choice at once; the first prepares it): ``sink`` gets its ``Prepared``
    and each ``Piece`` as it comes (None: nothing is streamed), and the answer is returned, OpenAI's body naming
    ``model``. ``resume``: what earlier attempts of a stream sent (the answer continues from exactly it, or the
    sink is told why it cannot and TaskFailed raised)."""
    prepared = prepare(runners[0], spec)
    start = None  # the content an earlier attempt of this stream sent: the answer continues from it
    if resume is not None:
        why = resume.why_not or unresumable(runners[0], prepared, resume.content)
        if why is not None:  # the gateway ends the stream saying why, and cancels the task
            if sink is not None:
                sink(events.Prepared.of(prepared, unresumable=why))
            raise TaskFailed("not_resumable", why, False)
        start = resume.content
    emit = None
    if sink is not None:
        sink(events.Prepared.of(prepared, resumed=None if start is None else len(start)))
        emit = lambda index, what, value: sink(events.Piece(index, what, value))  # noqa: E731
    choices = run(runners, prepared, emit, start)
    body = (bodies.chat_body if spec.kind == "chat" else bodies.text_body)(model, prepared, choices,
                                                                            runners[0].session)
    kind = bodies.logprob_kind(choices) if prepared.sampling.top_logprobs is not None else None
    return events.Finished(body, tuple(prepared.notes), kind)


def run(runners: list[Slot], prepared: PreparedRequest, emit: Emit | None = None,
        start: str | None = None) -> list[Choice]:
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


def _run_wave(runners: list[Slot], prepared: PreparedRequest, prompt: list[int], base: int, first: int,
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


def _choice(runner: Slot, prepared: PreparedRequest, prompt: list[int], index: int, k: int, emit: Emit | None,
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
        matcher = runner.matcher(prepared.grammar) if prepared.grammar is not None else None
        streamer = _Streamer(s, index, emit, prepared, start or "") if emit is not None else None
        prefix = exact_tokens(s, raw_prefix(prepared, start)) if start else None  # checked by ``unresumable``
        if prepared.max_tokens == 0:
            decoded = Decoded(tokens=[], finish="length")
            if read is not None:
                read()
        else:
            spec = runner.spec(prepared.max_tokens, sampling=sampling, closing=prepared.closing, room=prepared.room,
                               prefix=tuple(prefix or ()))
            decoded = runner.decode(prompt, matcher, spec, {},
                                    lambda n: runner.check_stop(None, f"after {n} generated tokens"),
                                    on_token=streamer.tokens if streamer else None, after_prefill=read)
    except BackendError as exc:  # the model failed under the request: another may succeed
        raise TaskFailed("backend_error", str(exc), True) from None
    text = cut_at_stops(s.detokenize(decoded.tokens), prepared.sampling.stop)
    choice = Choice(index=index, text=text, finish=decoded.finish, tokens=decoded.tokens, logprobs=decoded.logprobs,
                    masked=decoded.masked, content=text, prompt_logprobs=prompt_lp, chosen=decoded.charged)
    if decoded.cut is not None:  # closed early to stay valid within max_tokens: the answer was cut all the same
        choice.finish = "length"
        prepared.note(f"max_tokens: the answer was closed early at {decoded.cut} (what would have followed is "
                        "left out) so that it stays valid; finish_reason length")
    if prepared.tools is not None or decoded.finish == "stop":
        _read_back(runner, prepared, choice, decoded.cut)
    if streamer is not None:
        streamer.finish(choice)
    return choice


def _read_back(runner: Slot, prepared: PreparedRequest, choice: Choice, cut: str | None = None) -> None:
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
            prepared.note("tool calls: a call cut short by the end of generation left out")
        calls = []
        for call in parsed.calls:
            problem = runner.validate(toolsmod.function(plan, call["name"]).parameters, call["arguments"])
            if problem is not None and choice.finish == "length":  # closed early and invalid for it: left out
                prepared.note(f"tool calls: the call of {call['name']} was cut short and breaks its schema at "
                                f"{problem}: left out")
                continue
            if problem is not None:
                raise TaskFailed("invalid_output", f"the call of {call['name']} breaks its parameters' schema at "
                                                   f"{problem}", False)
            calls.append(call)
        choice.content, choice.tool_calls = parsed.content, toolsmod.openai_calls(calls)
        return
    if prepared.schema is not None:
        problem = runner.checked(choice.text, prepared.schema)[1]
        if problem is not None:
            raise TaskFailed("invalid_output", f"the output breaks the schema at {problem}", False)


def _prompt_logprobs(runner: Slot, prompt: list[int], k: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the ones before it (None for the first), read afresh."""
    s = runner.session
    s.truncate(0)
    rows = s.eval_all(prompt)
    return [None] + [token_logprob(rows[i], None, prompt[i + 1], k) for i in range(len(prompt) - 1)]


def cut_at_stops(text: str, stops: tuple[str, ...]) -> str:
    """An answer's text up to the first of its stop texts (the stop itself is never returned)."""
    first = min((text.index(t) for t in stops if t in text), default=None)
    return text if first is None else text[:first]


def held_for_stops(text: str, stops: tuple[str, ...]) -> str:
    """What of an answer's text so far may go out while ``stops`` can end it: cut at the first stop text, and short
    of a tail that could still begin one (``"...walked in"`` under the stop ``"in the"``), which goes out once the
    next tokens rule the stop out (or at the answer's end). So a stream sends exactly the whole answer's text."""
    cut = cut_at_stops(text, stops)
    if len(cut) < len(text):
        return cut
    tail = max((n for t in stops for n in range(min(len(t) - 1, len(text)), 0, -1) if text.endswith(t[:n])),
               default=0)
    return text[:len(text) - tail]


class _Streamer:
    """A choice's pieces as they come: its content (never the tool format's syntax: text held back while it could
    still be the start of a call, a generic ``response`` unwrapped as it grows), then, at the end, its calls."""

    def __init__(self, session: TokenSession, index: int, emit: Emit, prepared: PreparedRequest, sent: str = "") -> None:
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
        text = held_for_stops(text, self.prepared.sampling.stop)
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
