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
  after the value's tail (``tasks/drafts.py``), cut where the grammar rejects it (``validate_tokens``), goes into
  the step too; the session keeps the longest prefix whose every token is the model's best (read in the engine,
  no logits row copied but the one the decoder goes on from) and drops the rest of the cells. Each kept token
  then passes the same guards as a chosen one; one a guard would refuse ends the draft there. With sampling or
  logit adjustments, and where the session cannot verify drafts (``eval_draft``), there are none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from nodeagent.backends.session import TokenSession, eval_later
from nodeagent.errors import TaskFailed
from nodeagent.tasks.drafts import MAX_MATCH_CHARS, InputDrafts

# After this many identical tokens in a row, the repeated token is left out of the next choice when the
# grammar allows anything else: greedy decoding on small models otherwise loops ("1.0000000...").
MAX_REPEAT = 12
# A JSON number never needs more characters than this (float64's longest form, "-1.7976931348623157e+308");
# past it, tokens that would extend the number are left out when the grammar allows another. JSON Schema
# bounds a number's value, not its length, and small models loop in digits ("0.0010000000000010...").
MAX_NUMBER_CHARS = 24
NUMBER_CHARS = frozenset("0123456789.eE+-")


# A cycle of 2 to MAX_PERIOD tokens repeated over CYCLE_TOKENS tokens (and at least 4 times) is a loop: the
# token that would continue it is left out when the grammar allows another ("\u001b\u001b...", ", 0, 0, 0").
MAX_PERIOD = 16
CYCLE_TOKENS = 24
# An object that keeps starting a key it already has is steered away this many times, then the task stops.
MAX_KEY_RETRIES = 4
def cycle_token(out: list[int]) -> int | None:
    """The token that would continue a repetition loop at the end of ``out``, or None."""
    if len(out) >= MAX_REPEAT and len(set(out[-MAX_REPEAT:])) == 1:
        return out[-1]
    for period in range(2, MAX_PERIOD + 1):
        need = max(CYCLE_TOKENS, 4 * period)
        if len(out) < need:
            break
        tail = out[-need:]
        if all(tail[i] == tail[i - period] for i in range(period, need)):
            return out[-period]
    return None


class JsonTail:
    """Where JSON text fed piece by piece ends: inside a string, how many characters of a number, and the keys
    of every open object (``duplicate`` is set when a key closes that its object already has; ``key_at`` is
    the index of the token where that key's text began)."""

    def __init__(self) -> None:
        self.in_string = self.escaped = False
        self.number_chars = 0
        self.frames: list[dict | None] = []  # an open object: {"keys", "expect_key"}; an open array: None
        self.key: list[str] | None = None  # the key being written
        self.value: list[str] | None = None  # the string value being written (its characters, escapes as written)
        self.key_at: int | None = None
        self.duplicate: str | None = None

    def feed(self, text: str, token_index: int = 0) -> None:
        for ch in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.key is not None:
                        if self.key_at is None:  # an empty key: steer at its closing quote
                            self.key_at = token_index
                        self._key_done("".join(self.key))
                    self.value = None
                    continue
                if self.key is not None:
                    if not self.key:
                        self.key_at = token_index
                    self.key.append(ch)
                elif self.value is not None:
                    self.value.append(ch)
                continue
            top = self.frames[-1] if self.frames else None
            if ch == '"':
                self.in_string, self.number_chars = True, 0
                if top is not None and top["expect_key"]:
                    self.key, self.key_at = [], None
                else:
                    self.value = []
            elif ch == "{":
                self.frames.append({"keys": set(), "expect_key": True})
            elif ch == "[":
                self.frames.append(None)
            elif ch in "}]":
                if self.frames:
                    self.frames.pop()
            elif ch == "," and top is not None:
                top["expect_key"] = True
            elif ch in NUMBER_CHARS:
                self.number_chars += 1
                continue
            self.number_chars = 0

    def _key_done(self, key: str) -> None:
        top = self.frames[-1]
        assert top is not None
        if key in top["keys"]:
            self.duplicate = key
        top["keys"].add(key)
        top["expect_key"] = False
        self.key = None



@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None  # negative: a random one (as llama.cpp's -1)
    logit_bias: dict[int, float] = field(default_factory=dict)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int | None = None  # None: no log-probabilities; 0-20: that many alternatives each
    stop: tuple[str, ...] = ()

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed if self.seed is None or self.seed >= 0 else None)

    @property
    def adjusts(self) -> bool:
        return bool(self.logit_bias) or bool(self.frequency_penalty) or bool(self.presence_penalty)


GREEDY = Sampling()


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most likely tokens and their log-probabilities, best first


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


def chosen_tokens(session: TokenSession, matcher: Any, text: str) -> int:
    """How many of the tokens that write ``text`` from ``matcher``'s state would be chosen rather than forced
    (``fast_forward``): walked on a copy of the matcher, the grammar's forced tokens taken where ``text`` goes
    on with them, else the text's own next token counted and taken."""
    m = matcher.deep_copy()
    rest, chosen = text.encode(), 0
    while rest:
        ff = m.compute_ff_tokens()
        data = b"".join(session.token_bytes(t) for t in ff)
        if ff and rest.startswith(data):
            m.consume_tokens(ff)
            rest = rest[len(data):]
            continue
        step = session.tokenize_continuation(rest.decode("utf-8", "replace"))[:1]
        if not step:
            break
        chosen += 1
        taken = session.token_bytes(step[0])
        if not m.consume_token(step[0]) or not rest.startswith(taken):
            return chosen + len(session.tokenize_continuation(rest[len(taken):].decode("utf-8", "replace")))
        rest = rest[len(taken):]
    return chosen


class Budget:
    """Room kept, at every token, for what closes the answer (``tasks/closing.py``): a token is taken only if the
    shortest valid ending after it still fits in the tokens left. When the model's token would not leave that
    room, the ending's own next token is taken instead (the value being written is cut short, and ``cut`` says
    where; between two calls, no further call is begun); when it would make an ending impossible (a call past the
    answer's cap), the best token that keeps one possible is taken. Follows the answer's bytes; rebuilt from the
    tokens after a rollback.

    Two counts bound the ending: the tokens charged to ``max_tokens`` (with ``matcher`` given, the forced ones
    are free: only the ending's chosen tokens count, ``chosen_tokens``) and all tokens, within ``room``."""

    def __init__(self, session: TokenSession, make: Callable[[], Any], max_tokens: int, matcher: Any = None,
                 room: int | None = None) -> None:
        self.s, self.make, self.max_tokens, self.matcher = session, make, max_tokens, matcher
        self.room = max_tokens if room is None else room
        self.closer = make()
        self.ends: list[int] = []  # each output token's end, in bytes

    def fits(self, token: int, left: int, total_left: int | None = None) -> bool | None:
        """Whether the answer can still close after ``token`` within ``left`` charged tokens and ``total_left``
        tokens in all (the same as ``left`` unless forced tokens are free); None if it cannot close."""
        total_left = left if total_left is None else total_left
        after = self.closer.copy()
        after.feed(self.s.token_bytes(token))
        text = after.closing()
        if text is None:
            return None
        if len(text.encode()) <= min(left, total_left):  # a token holds at least one byte
            return True
        every = len(self.s.tokenize_continuation(text))  # not empty: it holds more bytes than tokens left
        if every > total_left:
            return False
        if self.matcher is None:
            return every <= left
        m = self.matcher.deep_copy()
        if not m.consume_token(token):
            return False
        return chosen_tokens(self.s, m, text) <= left

    def choose(self, token: int, used: int, total: int, allowed: np.ndarray | None,
               logits: np.ndarray) -> tuple[int, bool]:
        """The token to take (``used`` tokens charged so far, ``total`` written): the model's when the answer
        stays closable, else one that keeps it so; and whether the answer is being cut short for the budget."""
        if token in self.s.eog_tokens:
            return token, False
        left, total_left = self.max_tokens - used - 1, self.room - total - 1
        fit = self.fits(token, left, total_left)
        if fit:
            return token, False
        ending = self.closer.closing()
        first = (self.s.tokenize_continuation(ending)[:1] + self.s.tokenize_continuation(ending[:1])[:1]) \
            if ending else []
        pool = allowed if allowed is not None else np.arange(logits.shape[0])
        ranked = pool[np.argsort(-logits[pool])[:32]].tolist()
        for t in first + ranked:
            if t != token and _has(pool, t) and self.fits(t, left, total_left):  # declining a call cuts nothing
                return int(t), fit is False and not self.closer.between_items()
        return token, False  # nothing keeps it closable: it may end cut, its unfinished call left out

    def feed(self, token: int) -> None:
        data = self.s.token_bytes(token)
        self.closer.feed(data)
        self.ends.append((self.ends[-1] if self.ends else 0) + len(data))

    def rebuild(self, out: list[int], cap: int | None = None) -> None:
        self.closer, self.ends = self.make(), []
        if cap is not None:
            self.closer.cap = cap
        for t in out:
            self.feed(t)

    def repeated(self) -> int | None:
        """When the last item repeats an earlier one (a call made twice): the output token where it began."""
        at = self.closer.repeat_from
        if at is None:
            return None
        return next(i for i, end in enumerate(self.ends) if end > at)


def _has(sorted_ids: np.ndarray, token: int) -> bool:
    i = int(np.searchsorted(sorted_ids, token))
    return i < sorted_ids.shape[0] and int(sorted_ids[i]) == token


def log_softmax(values: np.ndarray) -> np.ndarray:
    x = values.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def token_logprob(logits: np.ndarray, allowed: np.ndarray | None, token: int, k: int) -> TokenLogprob:
    """The chosen token's log-probability and the top ``k``, over ``allowed`` (None: every token)."""
    if allowed is None:
        lp = log_softmax(logits)
        ids = None
    else:
        lp_allowed = log_softmax(logits[allowed])
        lp = np.full(logits.shape[0], -np.inf)
        lp[allowed] = lp_allowed
        ids = allowed
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        pool = np.arange(lp.shape[0]) if ids is None else ids
        k = min(k, pool.size)
        best = pool[np.argpartition(-lp[pool], k - 1)[:k]]
        best = best[np.argsort(-lp[best])]
        top = tuple((int(t), float(lp[t])) for t in best)
    return TokenLogprob(token=token, logprob=float(lp[token]), top=top)


def chosen_logprob(logits: np.ndarray, allowed: np.ndarray | None, token: int) -> float:
    """The log-probability of ``token`` over ``allowed`` (None: every token): ``token_logprob`` without the
    alternatives, in one pass over the row."""
    x = logits if allowed is None else logits[allowed]
    top = float(np.max(x))
    return float(logits[token]) - top - float(np.log(np.sum(np.exp(x - top, dtype=np.float32), dtype=np.float64)))


def adjust(logits: np.ndarray, sampling: Sampling, counts: dict[int, int]) -> np.ndarray:
    """The logits with the request's bias and penalties applied (a copy; the same logits when there are none)."""
    if not sampling.adjusts:
        return logits
    out = logits.astype(np.float32, copy=True)
    for t, bias in sampling.logit_bias.items():
        if 0 <= t < out.shape[0]:
            out[t] += bias
    if counts and (sampling.frequency_penalty or sampling.presence_penalty):
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float32)
        out[ids] -= n * sampling.frequency_penalty + sampling.presence_penalty
    return out


def _pick(logits: np.ndarray, allowed: np.ndarray | None, temperature: float, top_p: float,
          rng: np.random.Generator | None) -> int:
    """Greedy at temperature 0; else a sample from the (nucleus-cut) softmax, over the allowed tokens."""
    if allowed is None and (temperature <= 0 or rng is None):
        return int(np.argmax(logits))
    ids = allowed if allowed is not None else np.arange(logits.shape[0])
    values = logits[ids].astype(np.float64)
    if temperature <= 0 or rng is None:
        return int(ids[np.argmax(values)])
    probs = np.exp((values - values.max()) / temperature)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs)
        keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)]
        ids, probs = ids[keep], probs[keep] / probs[keep].sum()
    return int(rng.choice(ids, p=probs))


def _resume(session: TokenSession, prompt: list[int], out: list[int]) -> np.ndarray:
    """The logits after ``prompt + out`` once the sequence was longer (a rollback), or shorter (forced tokens not
    yet evaluated): the session keeps the common prefix and reads the rest."""
    return session.prefill(prompt + out)


def decode(session: TokenSession, prompt: list[int], matcher: Any, max_tokens: int, timing: dict,
           check: Callable[[int], None], clock: Callable[[], float], sampling: Sampling = GREEDY,
           on_token: Callable[[list[int]], None] | None = None, fresh: bool = False,
           after_prefill: Callable[[], None] | None = None, closing: Callable[[], Any] | None = None, *,
           fast_forward: bool, draft_tokens: int, room: int | None = None, value_logprobs: bool = False) -> Decoded:
    """Generate after ``prompt`` under ``matcher``'s token mask when there is one (then with the guards).
    ``check(n)`` is asked before each token (it raises to stop). ``fresh``: evaluate the whole prompt again
    rather than reuse cells the session holds (the same request then gets the same answer whatever ran
    before). ``closing``: makes the follower of the answer's format (``tasks/closing.py``): the answer then keeps
    room to close within ``max_tokens`` (``Budget``), and an item that repeats an earlier one (a call made twice)
    is taken back and no further one begun. ``fast_forward``: the grammar's forced tokens go into the sampled
    token's step, free of ``max_tokens`` (``room``, the context's, bounds every token); ``draft_tokens``: the
    longest draft from the input a step carries, 0 for none (see the module's notes). ``value_logprobs``: each
    token the model chose gets its log-probability (``Decoded.token_logprobs``; one pass over the row, without
    the alternatives ``top_logprobs`` asks for). Returns the tokens, why it ended, which were forced, and their
    log-probabilities when asked for."""
    import llguidance.numpy as llnp

    s = session
    t0 = clock()
    if fresh:
        s.truncate(0)
    logits = s.prefill(prompt)
    t1 = clock()
    timing["prompt_s"] = timing.get("prompt_s", 0.0) + t1 - t0
    if after_prefill is not None:
        after_prefill()
    mask = llnp.allocate_token_bitmask(1, s.n_vocab) if matcher is not None else None
    rng = sampling.rng()
    out: list[int] = []
    counts: dict[int, int] = {}
    logprobs: list[TokenLogprob] = []
    tail = JsonTail()  # fed token by token: the output is not re-read at every step
    banned: dict[int, set[int]] = {}  # output position -> tokens that led to a duplicate key there
    key_retries = 0
    finish = "length"
    ahead: np.ndarray | None = None  # the next token's grammar mask, computed while the model decodes
    cut: str | None = None
    fast = fast_forward and matcher is not None and sampling.top_logprobs is None  # forced tokens taken as such
    total = max(max_tokens, room or 0) if fast else max_tokens  # every token; max_tokens bounds the chosen ones
    free: list[bool] = []  # each output token: forced by the grammar, so not charged
    lps: list[float | None] = []  # each output token's log-probability as chosen (``value_logprobs``)
    chosen_lp: float | None = None  # the last chosen token's
    budget = Budget(s, closing, max_tokens, matcher if fast else None, total) \
        if closing is not None and matcher is not None else None
    forced: list[int] = []  # the grammar's forced tokens still to take, in order
    unread: list[int] = []  # tokens taken since the model's last step: evaluated together at the next
    n_forced = steps = 0
    draft_log: list[tuple[int, int]] = []
    drafts = InputDrafts(s, s.detokenize(prompt)) if (
        draft_tokens > 0 and matcher is not None and sampling.temperature <= 0 and not sampling.adjusts
        and sampling.top_logprobs is None and hasattr(s, "eval_draft")) else None
    accepted: list[int] = []  # drafted tokens the model agreed with, in the cells already: taken in order

    def take_back(start: int) -> np.ndarray:
        """The output back to its first ``start`` tokens (the matcher, the counts, the log-probabilities, the JSON
        tail; nothing forced or unread stands), and the logits after what is left of it."""
        nonlocal steps, tail
        matcher.rollback(len(out) - start)
        for t in out[start:]:
            counts[t] -= 1
        del out[start:]
        del free[start:]
        del lps[start:]
        del logprobs[start:]
        tail = JsonTail()
        for i, t in enumerate(out):
            tail.feed(s.detokenize([t]), i)
        forced.clear()
        unread.clear()
        accepted.clear()
        steps += 1
        return _resume(s, prompt, out)

    def short_of_banned(tokens: list[int]) -> list[int]:
        """``tokens``, to be taken from the next position on, up to the first position a rollback steered away
        from: that one is the model's to choose again."""
        for i in range(len(tokens)):
            if len(out) + i in banned:
                return tokens[:i]
        return tokens

    def propose() -> list[int]:
        """A draft from the input for the string value being written: within the tokens left (one kept for the
        model's own next token), short of a position a rollback steered away from, cut where the grammar would
        reject it."""
        assert drafts is not None and tail.value is not None
        draft = short_of_banned(drafts.propose("".join(tail.value[-MAX_MATCH_CHARS:]),
                                               min(draft_tokens, max_tokens - charged() - 1,
                                                   total - len(out) - 1)))
        return draft[:matcher.validate_tokens(draft)] if draft else []

    def grammar_mask() -> np.ndarray:
        llnp.fill_next_token_bitmask(matcher, mask)
        return np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: s.n_vocab])

    def choose(logits: np.ndarray) -> tuple[int, np.ndarray]:
        """The model's next token, under the mask and the guards (and the budget's say); consumed by the matcher."""
        nonlocal ahead, cut, chosen_lp
        logits = adjust(logits, sampling, counts)
        if matcher is not None:
            allowed = ahead if ahead is not None else grammar_mask()
            ahead = None
            if allowed.size == 0:
                raise TaskFailed("decoder_error", matcher.get_error() or "no token can continue the object", True)
            grammar_allowed = allowed
            loop = cycle_token(out)
            if loop is not None and allowed.size > 1:
                allowed = allowed[allowed != loop]
            if len(out) in banned and allowed.size > 1:
                keep = allowed[~np.isin(allowed, list(banned[len(out)]))]
                allowed = keep if keep.size else allowed
            if not tail.in_string and tail.number_chars >= MAX_NUMBER_CHARS:
                for t in allowed[np.argsort(-logits[allowed])]:  # the best token that ends the number
                    if s.detokenize([int(t)])[:1] not in NUMBER_CHARS:
                        allowed = np.array([t])
                        break
        else:
            allowed = grammar_allowed = None
        token = _pick(logits, allowed, sampling.temperature, sampling.top_p, rng)
        if budget is not None:
            token, cutting = budget.choose(token, charged(), len(out), allowed, logits)
            if cutting and cut is None:
                cut = budget.closer.path()
        if sampling.top_logprobs is not None:
            logprobs.append(token_logprob(logits, grammar_allowed, token, sampling.top_logprobs))
        if value_logprobs:  # the same number as the log-probabilities' own, when they are asked for too
            chosen_lp = logprobs[-1].logprob if sampling.top_logprobs is not None else \
                chosen_logprob(logits, grammar_allowed, token)
        if matcher is not None and not matcher.consume_token(token):
            raise TaskFailed("decoder_error", matcher.get_error() or "the decoder refused its own token", True)
        return token, logits

    def refused(token: int) -> bool:
        """Whether a guard would keep greedy decoding from this token here (the model's best under the mask)."""
        if cycle_token(out) == token or token in banned.get(len(out), ()):
            return True
        if not tail.in_string and tail.number_chars >= MAX_NUMBER_CHARS:
            return True
        return budget is not None and not budget.fits(token, max_tokens - charged() - 1, total - len(out) - 1)

    def charged() -> int:
        """The tokens counted against ``max_tokens``: every one but those the grammar forced."""
        return len(out) - sum(free)

    if fast:  # what the grammar forces before the first choice (a tool call's envelope) is taken as such
        forced = matcher.compute_ff_tokens()[:total]
    while len(out) < total and (charged() < max_tokens or forced):
        check(len(out))
        drafted = was_forced = False
        chosen_lp = None
        if forced:  # the grammar allows this token only: no model step, no choice
            token = forced.pop(0)
            was_forced = True
            n_forced += 1
            if not matcher.consume_token(token):
                raise TaskFailed("decoder_error", matcher.get_error() or "the decoder refused a forced token", True)
        elif accepted:  # the model's best here, evaluated already
            token = accepted[0]
            if refused(token):  # the draft ends here; the logits before it are read again
                accepted.clear()
                s.truncate(len(prompt) + len(out) - 1)
                logits = s.eval(out[-1:])
                steps += 1
                continue
            del accepted[0]
            drafted = True
            if not matcher.consume_token(token):
                raise TaskFailed("decoder_error", matcher.get_error() or "the decoder refused a drafted token", True)
        else:
            token, logits = choose(logits)
        if token in s.eog_tokens:
            finish = "stop"
            if logprobs:
                logprobs.pop()  # the end of generation is not a token of the answer
            break
        out.append(token)
        free.append(was_forced)
        lps.append(chosen_lp)
        counts[token] = counts.get(token, 0) + 1
        if budget is not None:
            budget.feed(token)
            start = budget.repeated()
            if start is not None:  # the same call again: taken back, and the answer may hold no further one
                cap = len(budget.closer.items) - 1
                logits = take_back(start)
                budget.rebuild(out, cap=cap)
                continue
        if matcher is not None:
            tail.feed(s.detokenize([token]), len(out) - 1)
            if tail.duplicate is not None:  # steer away: back to where the key's text began, not that way again
                key_retries += 1
                if key_retries > MAX_KEY_RETRIES:
                    raise TaskFailed("duplicate_key", f"the object kept writing the key {tail.duplicate!r} it "
                                                      "already has; no partial result is returned", True)
                start = tail.key_at
                assert start is not None
                banned.setdefault(start, set()).add(out[start])
                logits = take_back(start)
                if budget is not None:
                    budget.rebuild(out, budget.closer.cap)
                continue  # the mask is computed afresh for the rolled-back matcher
        if on_token is not None:
            on_token(out)
        if matcher is not None and matcher.is_stopped():
            finish = "stop"
            break
        if sampling.stop and any(t in s.detokenize(out[-16:]) for t in sampling.stop):
            finish = "stop"
            break
        if len(out) >= total:
            break
        if accepted:  # the draft's next token is checked before anything else is asked of the grammar
            continue
        if not drafted:
            unread.append(token)
        if fast and not forced:
            forced = short_of_banned(matcher.compute_ff_tokens()[:total - len(out)])
        if forced:
            continue
        if charged() >= max_tokens:  # nothing forced follows: the answer's budget is spent
            break
        if not unread:  # a draft's tokens were all taken: the logits after them are at hand
            continue
        draft = propose() if drafts is not None and tail.value is not None else []
        if draft:
            kept, logits = s.eval_draft(unread, draft)
            unread = []
            steps += 1
            draft_log.append((len(draft), kept))
            accepted = draft[:kept]
            continue
        pending = eval_later(s, unread)
        unread = []
        steps += 1
        if matcher is not None:  # the mask depends on the grammar's state only: compute it while the model decodes
            ahead = grammar_mask()
        logits = pending()
    timing["generation_s"] = timing.get("generation_s", 0.0) + clock() - t1
    return Decoded(tokens=out, finish=finish, logprobs=logprobs, masked=matcher is not None, cut=cut,
                   forced=n_forced, steps=steps, drafts=draft_log, chosen=charged(),
                   token_logprobs=lps if value_logprobs else [])
