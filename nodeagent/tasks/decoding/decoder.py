"""Generating tokens after a prompt: greedy or sampled, under a grammar's token mask when there is one, with
the guards small models need under a grammar, OpenAI's logit adjustments, and the log-probabilities of what
was chosen.

- **Sampling** (``Sampling``): temperature and nucleus (``top_p``) over the allowed tokens, a seeded generator;
  ``logit_bias`` (token id -> added to its logit), ``frequency_penalty`` and ``presence_penalty`` (OpenAI's:
  a logit less ``count * frequency + (count > 0) * presence`` for each token generated so far), stop texts.
- **Log-probabilities** (``top_logprobs`` set): each chosen token's log-probability and the most likely
  alternatives, from the distribution the decoder chose from: the model's logits with the adjustments above,
  at temperature 1, renormalised over the tokens the grammar allows when there is one (``masked``).
- **Guards** (with a grammar): a repetition loop is steered away from, an endless number is ended, an object
  that writes a key again is rolled back to that key and steered elsewhere (``duplicate_key`` after a few).
- **Forced tokens** (``fast_forward``, with a grammar): after each sampled token, the tokens the grammar allows
  one way only (a key's rest, quotes, separators, closing brackets: llguidance's ``compute_ff_tokens``) are
  taken without asking the model, each through the same guards and checks, and evaluated in one step with the
  sampled token (one llama.cpp batch, logits on the last only). A decode step reads every weight whatever it
  carries, so k tokens in one step cost far less than k steps. Off when log-probabilities are asked for (a
  forced token has no distribution of the model's to report). A forced token is the grammar's syntax, not the
  answer: it is not charged to ``max_tokens``, which bounds the tokens chosen (the model's, or the guards' and
  the budget's choices; drafts kept); ``room`` bounds them all (what the context leaves).
- **Drafts from the input** (``draft_tokens``, greedy under a grammar): inside a string value, the input's text
  after the value's tail (``decoding/drafts.py``), cut where the grammar rejects it (``validate_tokens``), goes into
  the step too; the session keeps the longest prefix whose every token is the model's best (read in the engine,
  no logits row copied but the one the decoder goes on from) and drops the rest of the cells. Each kept token
  then passes the same guards as a chosen one; one a guard would refuse ends the draft there. With sampling or
  logit adjustments, and where the session cannot verify drafts (``eval_draft``), there are none.

The parts: three token sources taken in turn as peers (``Forced``, ``Drafted``, ``Sampled``: the first that has a
token gives it), the guards (``decoding/guards.py``), the budget that keeps room to close (``decoding/budget.py``),
both over the answer's one reading (``decoding/reading.py``: a ``decoding/closer.py`` follower fed each token),
and the picking itself (``decoding/sampling.py``). ``Decoder`` holds one answer's state; ``decode`` runs one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from nodeagent.backends.session import TokenSession, eval_later
from nodeagent.errors import TaskFailed
from nodeagent.tasks.decoding.budget import RoomToClose
from nodeagent.tasks.decoding.closer import Closer
from nodeagent.tasks.decoding.drafts import MAX_MATCH_CHARS, InputDrafts
from nodeagent.tasks.decoding.guards import MAX_KEY_RETRIES, Guards
from nodeagent.tasks.decoding.reading import Reading
from nodeagent.tasks.decoding.sampling import (
    GREEDY,
    Sampling,
    TokenLogprob,
    adjust,
    chosen_logprob,
    pick,
    token_logprob,
)


@dataclass(frozen=True)
class DecodeSpec:
    """What one answer is decoded under, built once by its caller (a typed task, a completion's choice) and read by
    ``decode`` and the ``Decoder``: no option is threaded through a signature of its own.

    ``max_tokens`` bounds the tokens chosen (the model's, the guards' and the budget's choices; drafts kept);
    ``room`` bounds every token where forced ones are free of it (what the context leaves). ``closing`` makes the
    follower of the answer's format (a ``Closer``): the answer then keeps room to close within ``max_tokens``
    (``RoomToClose``), and an item that repeats an earlier one (a call made twice) is taken back and no further one
    begun. ``fast_forward``: the grammar's forced tokens go into the sampled token's step, free of ``max_tokens``;
    ``draft_tokens``: the longest draft from the input a step carries, 0 for none (see the module's notes).
    ``value_logprobs``: each token the model chose gets its log-probability (``Decoded.token_logprobs``; one pass
    over the row, without the alternatives ``top_logprobs`` asks for). ``prefix``: tokens the answer begins with
    (a stream continued on another node: ``Decoder.begin_with``), part of the returned tokens. ``fresh``: evaluate
    the whole prompt again rather than reuse cells the session holds (the same request then gets the same answer
    whatever ran before). A runner's own (``TaskRunner.decoding``) holds no budget: each decode sets it."""

    max_tokens: int = 0
    sampling: Sampling = GREEDY
    closing: Callable[[], Closer] | None = None
    fast_forward: bool = False
    draft_tokens: int = 0
    room: int | None = None
    value_logprobs: bool = False
    prefix: tuple[int, ...] = ()
    fresh: bool = False


@dataclass
class Decoded:
    tokens: list[int]
    finish: str  # stop (end of generation, the grammar closed, a stop text) | length
    logprobs: list[TokenLogprob] = field(default_factory=list)
    masked: bool = False  # the log-probabilities are over the tokens a grammar allowed
    cut: str | None = None  # where the answer was ended early to close within max_tokens (a JSON path)
    forced: int = 0  # tokens the grammar forced, taken without a model step of their own (``fast_forward``)
    drafts: list[tuple[int, int]] = field(default_factory=list)  # each draft from the input: (its tokens, kept)
    steps: int = 0  # model evaluations after the prompt's
    chosen: int | None = None  # tokens charged to max_tokens (forced ones are free): None, every token
    # with ``value_logprobs``: each output token's log-probability when the model chose it (over the tokens the
    # grammar allowed), None where it did not (forced by the grammar, or kept from a draft of the input)
    token_logprobs: list[float | None] = field(default_factory=list)

    @property
    def charged(self) -> int:
        """Tokens counted against ``max_tokens`` and reported as ``completion_tokens``."""
        return len(self.tokens) if self.chosen is None else self.chosen

    @property
    def drafted(self) -> int:
        """Tokens drafted from the input and evaluated (``draft_tokens``)."""
        return sum(n for n, _ in self.drafts)

    @property
    def accepted(self) -> int:
        """Drafted tokens kept: the model's own choices, without a step of their own."""
        return sum(k for _, k in self.drafts)


class TokenSource(Protocol):
    """Where the decoder's next token may come from: ``take`` gives one (consumed by the grammar when there is one)
    or None when this source has none now; ``kind`` names it in the answer's record (forced tokens are free of
    ``max_tokens``). The decoder asks its sources in turn, the first with a token gives it."""

    kind: str

    def take(self, d: "Decoder") -> int | None: ...


class Forced:
    """The grammar's forced tokens (``fast_forward``): the tokens it allows one way only, taken without a model
    step and without a choice."""

    kind = "forced"

    def __init__(self) -> None:
        self.queue: list[int] = []  # still to take, in order
        self.taken = 0

    def take(self, d: "Decoder") -> int | None:
        if not self.queue:
            return None
        token = self.queue.pop(0)
        self.taken += 1
        if not d.matcher.consume_token(token):
            raise TaskFailed("decoder_error", d.matcher.get_error() or "the decoder refused a forced token", True)
        return token

    def refill(self, d: "Decoder") -> None:
        """What the grammar forces next, short of a position a rollback steered away from."""
        if d.fast and not self.queue:
            self.queue = d.guards.short_of_banned(d.matcher.compute_ff_tokens()[:d.total - len(d.out)])


class Drafted:
    """Drafts from the input (``draft_tokens``): inside a string value, the input's text after the value's tail,
    verified in one model step; the tokens the model agreed with are taken in order, each through the guards."""

    kind = "drafted"

    def __init__(self, input_drafts: InputDrafts | None, draft_tokens: int) -> None:
        self.input, self.draft_tokens = input_drafts, draft_tokens
        self.accepted: list[int] = []  # drafted tokens the model agreed with, in the cells already
        self.log: list[tuple[int, int]] = []  # each draft: (its tokens, kept)

    def take(self, d: "Decoder") -> int | None:
        if not self.accepted:
            return None
        token = self.accepted[0]
        if d.refused(token):  # the draft ends here: the session goes back to the answer, its logits read again
            self.accepted.clear()
            d.rewind(1)
            return None
        del self.accepted[0]
        if not d.matcher.consume_token(token):
            raise TaskFailed("decoder_error", d.matcher.get_error() or "the decoder refused a drafted token", True)
        return token

    def propose(self, d: "Decoder") -> list[int]:
        """A draft for the string value being written: within the tokens left (one kept for the model's own next
        token), short of a position a rollback steered away from, cut where the grammar would reject it."""
        value = d.reading.closer.string_value()
        if self.input is None or value is None:
            return []
        draft = d.guards.short_of_banned(self.input.propose(value[-MAX_MATCH_CHARS:], min(
            self.draft_tokens, d.max_tokens - d.charged() - 1, d.total - len(d.out) - 1)))
        return draft[:d.matcher.validate_tokens(draft)] if draft else []


class Sampled:
    """The model's own choice: under the grammar's mask and the guards, with the budget's say."""

    kind = "chosen"

    def __init__(self) -> None:
        self.ahead: np.ndarray | None = None  # the next token's grammar mask, computed while the model decodes

    def take(self, d: "Decoder") -> int | None:
        logits = adjust(d.logits, d.sampling, d.counts)
        allowed = grammar_allowed = None
        if d.matcher is not None:
            grammar_allowed = self.ahead if self.ahead is not None else d.grammar_mask()
            self.ahead = None
            if grammar_allowed.size == 0:
                raise TaskFailed("decoder_error", d.matcher.get_error() or "no token can continue the object", True)
            allowed = d.guards.narrow(grammar_allowed)
        token = pick(logits, allowed, d.sampling.temperature, d.sampling.top_p, d.rng)
        if d.budget is not None:
            token, cutting = d.budget.choose(token, d.charged(), len(d.out), allowed, logits)
            if cutting and d.cut is None:
                d.cut = d.budget.closer.path()
        if d.sampling.top_logprobs is not None:
            d.logprobs.append(token_logprob(logits, grammar_allowed, token, d.sampling.top_logprobs))
        if d.value_logprobs:  # the same number as the log-probabilities' own, when they are asked for too
            d.chosen_lp = d.logprobs[-1].logprob if d.sampling.top_logprobs is not None else \
                chosen_logprob(logits, grammar_allowed, token)
        if d.matcher is not None and not d.matcher.consume_token(token):
            raise TaskFailed("decoder_error", d.matcher.get_error() or "the decoder refused its own token", True)
        return token


class Decoder:
    """One answer being generated: its tokens and what is known of each (forced, log-probability), the sources,
    its reading, the guards, the budget, and the logits the next choice is made from."""

    def __init__(self, session: TokenSession, prompt: list[int], matcher: Any, spec: DecodeSpec) -> None:
        sampling, max_tokens, closing = spec.sampling, spec.max_tokens, spec.closing
        self.s, self.prompt, self.matcher, self.sampling = session, prompt, matcher, sampling
        self.max_tokens, self.value_logprobs = max_tokens, spec.value_logprobs
        self.fast = spec.fast_forward and matcher is not None and sampling.top_logprobs is None
        self.total = max(max_tokens, spec.room or 0) if self.fast else max_tokens  # max_tokens bounds the chosen
        self.rng = sampling.rng()
        self.out: list[int] = []
        self.free: list[bool] = []  # each output token: forced by the grammar, so not charged
        self.lps: list[float | None] = []  # each output token's log-probability as chosen (``value_logprobs``)
        self.logprobs: list[TokenLogprob] = []
        self.counts: dict[int, int] = {}
        self.chosen_lp: float | None = None  # the last chosen token's
        self.reading = Reading(session, closing)  # fed under a grammar only: it is JSON then
        self.guards = Guards(self.out, session.detokenize, self.reading)
        self.key_retries = self.steps = 0
        self.given = 0  # tokens the answer began with (``begin_with``): never taken back
        self.cut: str | None = None
        self.finish = "length"
        self.budget = RoomToClose(session, self.reading, max_tokens, matcher if self.fast else None, self.total) \
            if closing is not None and matcher is not None else None
        self.unread: list[int] = []  # tokens taken since the model's last step: evaluated together at the next
        self.logits: np.ndarray | None = None
        self._mask: Any = None
        drafts = InputDrafts(session, session.detokenize(prompt)) if (
            spec.draft_tokens > 0 and matcher is not None and sampling.temperature <= 0 and not sampling.adjusts
            and sampling.top_logprobs is None and hasattr(session, "eval_draft")) else None
        self.forced, self.drafted, self.sampled = Forced(), Drafted(drafts, spec.draft_tokens), Sampled()
        self.sources: tuple[TokenSource, ...] = (self.forced, self.drafted, self.sampled)  # asked in this order

    def charged(self) -> int:
        """The tokens counted against ``max_tokens``: every one but those the grammar forced."""
        return len(self.out) - sum(self.free)

    def grammar_mask(self) -> np.ndarray:
        import llguidance.numpy as llnp

        if self._mask is None:
            self._mask = llnp.allocate_token_bitmask(1, self.s.n_vocab)
        llnp.fill_next_token_bitmask(self.matcher, self._mask)
        return np.flatnonzero(np.unpackbits(self._mask.view(np.uint8), bitorder="little")[: self.s.n_vocab])

    def refused(self, token: int) -> bool:
        """Whether greedy decoding would be kept from this token here (the model's best under the mask): a guard
        refuses it, or the answer could not close after it."""
        if self.guards.refuses(token):
            return True
        return self.budget is not None and not self.budget.fits(
            token, self.max_tokens - self.charged() - 1, self.total - len(self.out) - 1)

    def next_token(self) -> tuple[int, str]:
        """The next token from the first source that has one: forced, then drafted, then the model's choice."""
        for source in self.sources:
            token = source.take(self)
            if token is not None:
                return token, source.kind
        raise TaskFailed("decoder_error", "no source gave a token", True)  # the model's choice always gives one

    def rewind(self, n: int) -> None:
        """The session back to the answer as taken: the cells past it dropped (a draft's the model did not agree
        with), and its last ``n`` tokens read again for the logits after it (one model step)."""
        self.s.truncate(len(self.prompt) + len(self.out) - n)
        self.logits = self.s.eval(self.out[-n:])
        self.steps += 1

    def append(self, token: int, kind: str) -> bool:
        """The token taken into the answer; False when that led to a rollback (an item repeated, a key written
        twice) and the answer stands shorter."""
        self.out.append(token)
        self.free.append(kind == "forced")
        self.lps.append(self.chosen_lp)
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.matcher is None:
            return True
        self.reading.feed(token)
        start = self.reading.repeated() if self.budget is not None else None
        if start is not None:  # the same call again: taken back, and the answer may hold no further one
            self.take_back(start, cap=len(self.reading.closer.items) - 1)
            return False
        duplicate = self.reading.duplicate_key()
        if duplicate is not None:  # steer away: back to where the key's text began, not that way again
            key, start = duplicate
            self.key_retries += 1
            if self.key_retries > MAX_KEY_RETRIES:
                raise TaskFailed("duplicate_key", f"the object kept writing the key {key!r} it already "
                                                  "has; no partial result is returned", True)
            self.guards.steer_from(start)
            self.take_back(start)
            return False  # the mask is computed afresh for the rolled-back matcher
        return True

    def begin_with(self, tokens: list[int]) -> None:
        """The answer begins with ``tokens`` (what an earlier attempt of a stream sent), taken through the grammar,
        the guards and the budget as if chosen, and charged to ``max_tokens``: decoding goes on after them."""
        for token in tokens:
            if self.matcher is not None and not self.matcher.consume_token(token):
                why = self.matcher.get_error() or "the grammar refuses it"
                raise TaskFailed("not_resumable", f"the text already sent cannot be continued under the answer's "
                                                  f"format: {why}", False)
            if not self.append(token, "given"):
                raise TaskFailed("not_resumable", "the text already sent repeats itself (a key or a call written "
                                                  "twice): it cannot be continued", False)
        self.given = len(tokens)

    def take_back(self, start: int, cap: int | None = None) -> None:
        """The output back to its first ``start`` tokens (the matcher, the counts, the log-probabilities, the
        reading, with at most ``cap`` watched items from now on when given; nothing forced, drafted or unread
        stands), and the logits after what is left of it: the session keeps the common prefix and reads the
        rest."""
        if start < self.given:
            raise TaskFailed("not_resumable", "the continuation would take back text already sent", False)
        self.matcher.rollback(len(self.out) - start)
        for t in self.out[start:]:
            self.counts[t] -= 1
        for kept in (self.out, self.free, self.lps, self.logprobs):
            del kept[start:]
        self.reading.rebuild(self.out, self.reading.closer.cap if cap is None else cap)
        self.forced.queue.clear()
        self.unread.clear()
        self.drafted.accepted.clear()
        self.steps += 1
        self.logits = self.s.prefill(self.prompt + self.out)

    def ended(self) -> bool:
        """Whether the answer is over after its last token: the grammar closed, a stop text, no room."""
        if self.matcher is not None and self.matcher.is_stopped():
            self.finish = "stop"
            return True
        if self.sampling.stop and any(t in self.s.detokenize(self.out[-16:]) for t in self.sampling.stop):
            self.finish = "stop"
            return True
        return len(self.out) >= self.total

    def advance(self, token: int, kind: str) -> bool:
        """After a token: what the model evaluates next (the unread tokens, with a draft when there is one), so
        that the logits are ready for the next choice; False when the answer's budget is spent."""
        if self.drafted.accepted:  # the draft's next token is checked before anything else is asked of the grammar
            return True
        if kind != "drafted":
            self.unread.append(token)
        self.forced.refill(self)
        if self.forced.queue:
            return True
        if self.charged() >= self.max_tokens:  # nothing forced follows: the answer's budget is spent
            return False
        if not self.unread:  # a draft's tokens were all taken: the logits after them are at hand
            return True
        draft = self.drafted.propose(self)
        if draft:
            kept, self.logits = self.s.eval_draft(self.unread, draft)
            self.drafted.log.append((len(draft), kept))
            self.drafted.accepted = draft[:kept]
        else:
            pending = eval_later(self.s, self.unread)
            if self.matcher is not None:  # the mask depends on the grammar's state only: computed while it decodes
                self.sampled.ahead = self.grammar_mask()
            self.logits = pending()
        self.unread = []
        self.steps += 1
        return True

    def run(self, check: Callable[[int], None], on_token: Callable[[list[int]], None] | None) -> Decoded:
        if self.fast:  # what the grammar forces before the first choice (a tool call's envelope) is taken as such
            self.forced.queue = self.matcher.compute_ff_tokens()[:self.total]
        while len(self.out) < self.total and (self.charged() < self.max_tokens or self.forced.queue):
            check(len(self.out))
            self.chosen_lp = None
            token, kind = self.next_token()
            if token in self.s.eog_tokens:
                self.finish = "stop"
                if self.logprobs:
                    self.logprobs.pop()  # the end of generation is not a token of the answer
                break
            if not self.append(token, kind):
                continue
            if on_token is not None:
                on_token(self.out)
            if self.ended() or not self.advance(token, kind):
                break
        return Decoded(tokens=self.out, finish=self.finish, logprobs=self.logprobs, masked=self.matcher is not None,
                       cut=self.cut, forced=self.forced.taken, steps=self.steps, drafts=self.drafted.log,
                       chosen=self.charged(), token_logprobs=self.lps if self.value_logprobs else [])


def decode(session: TokenSession, prompt: list[int], matcher: Any, spec: DecodeSpec, timing: dict,
           check: Callable[[int], None], clock: Callable[[], float],
           on_token: Callable[[list[int]], None] | None = None,
           after_prefill: Callable[[], None] | None = None) -> Decoded:
    """Generate after ``prompt`` under ``matcher``'s token mask when there is one (then with the guards), as
    ``spec`` says. ``check(n)`` is asked before each token (it raises to stop); ``on_token`` is told the answer so
    far after each; ``after_prefill`` once the prompt is read (the choices that share its cells start then).
    Returns the tokens, why it ended, which were forced, and their log-probabilities when asked for."""
    t0 = clock()
    if spec.fresh:
        session.truncate(0)
    decoder = Decoder(session, prompt, matcher, spec)
    if spec.prefix:
        decoder.begin_with(list(spec.prefix))
    decoder.logits = session.prefill(prompt + decoder.out)
    t1 = clock()
    timing["prompt_s"] = timing.get("prompt_s", 0.0) + t1 - t0
    if after_prefill is not None:
        after_prefill()
    decoded = decoder.run(check, on_token)
    timing["generation_s"] = timing.get("generation_s", 0.0) + clock() - t1
    return decoded
