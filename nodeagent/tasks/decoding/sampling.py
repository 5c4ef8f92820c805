"""How the decoder picks a token from the model's logits: greedy or sampled (temperature, nucleus, a seeded
generator), OpenAI's logit adjustments (``logit_bias``, ``frequency_penalty``, ``presence_penalty``), and the
log-probabilities of what was picked, over every token or over those a grammar allowed. Pure: numpy over a
logits row, no session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nodeagent.backends.session import log_softmax


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


def pick(logits: np.ndarray, allowed: np.ndarray | None, temperature: float, top_p: float,
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
