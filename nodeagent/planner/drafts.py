"""Whether drafts from the input pay on a device, and how long they may be: from two measurements of
`nodeagent bench` (``bench/phase.py``), a pure choice.

- **The cost of a step by its tokens**: one sequence after a 200-token prompt, a step carrying 1 + k tokens
  with logits for each (a draft of k tokens, verified), in seconds. On a GPU or an Apple chip a step of a few
  tokens costs about what one does; on a small CPU it can cost nearly in proportion.
- **What the model keeps of its drafts**: extractions decoded with drafts of the longest length, each draft's
  tokens and how many of them the model kept. A draft of length k would have kept ``min(kept, k)`` of them.

- **The node's own time a step**: what a decode step costs beyond llama.cpp's evaluation (the grammar's mask, the
  guards, the hand-over to the engine's thread), from the same extractions without drafts.

A drafting step writes ``1 + kept`` tokens (the kept ones and the model's own next) for the cost of a step of
``1 + drafted`` tokens plus the node's own time, where a step of one token writes one. So each length k is scored
by the drafts' tokens written over their steps' cost in one-token steps; the best k is chosen if it beats 1 by
``PAYS``.
"""

from __future__ import annotations

from dataclasses import dataclass

PAYS = 1.05  # drafts are on where they write at least 5 % more tokens for the same model time


@dataclass(frozen=True)
class DraftChoice:
    draft_tokens: int  # 0: drafts off
    gain: float  # the drafting steps' tokens per one-token step's time, at that length (1.0 when off)
    kept_share: float  # the share of drafted tokens the model kept, at the longest length measured
    reason: str


def step_cost(costs_s: dict[int, float], tokens: float) -> float:
    """A step of ``tokens`` tokens in seconds, linear between the measured sizes (and past the largest)."""
    sizes = sorted(costs_s)
    if tokens in costs_s:
        return costs_s[tokens]
    lo = max((n for n in sizes if n < tokens), default=sizes[0])
    hi = min((n for n in sizes if n > tokens), default=None)
    if hi is None:
        below = max((n for n in sizes if n < lo), default=None)
        slope = (costs_s[lo] - costs_s[below]) / (lo - below) if below is not None else 0.0
        return costs_s[lo] + slope * (tokens - lo)
    return costs_s[lo] + (costs_s[hi] - costs_s[lo]) * (tokens - lo) / (hi - lo)


def gain_at(k: int, costs_s: dict[int, float], drafts: list[tuple[int, int]], overhead_s: float = 0.0) -> float:
    """Tokens written by the drafting steps over their cost in one-token steps, had the drafts been ``k`` long;
    ``overhead_s``: the node's own time a step."""
    one = step_cost(costs_s, 1) + overhead_s
    written = sum(1 + min(kept, k) for _, kept in drafts)
    cost = sum((step_cost(costs_s, 1 + min(n, k)) + overhead_s) / one for n, _ in drafts)
    return written / cost if cost else 1.0


def choose_draft(costs_s: dict[int, float], drafts: list[tuple[int, int]], max_tokens: int,
                 overhead_s: float = 0.0) -> DraftChoice:
    """``costs_s``: seconds per step by the tokens it carries (1 and more); ``drafts``: (drafted, kept) of each
    draft of up to ``max_tokens`` tokens; ``overhead_s``: the node's own time a step."""
    drafted = sum(n for n, _ in drafts)
    kept_share = sum(k for _, k in drafts) / drafted if drafted else 0.0
    if not drafts or 1 not in costs_s:
        return DraftChoice(0, 1.0, kept_share, "drafts from the input: off (the extractions measured made none)")
    gains = {k: gain_at(k, costs_s, drafts, overhead_s) for k in range(1, max_tokens + 1)}
    best = max(gains, key=lambda k: (round(gains[k], 3), -k))
    one = step_cost(costs_s, 1)
    rel = (step_cost(costs_s, 1 + best) + overhead_s) / (one + overhead_s)
    said = (f"a step of {1 + best} tokens costs x{rel:.2f} one of 1, the node's {overhead_s * 1000:.1f} ms a step "
            f"included; the model kept {kept_share:.0%} of the drafted tokens")
    if gains[best] < PAYS:
        return DraftChoice(0, 1.0, kept_share, f"drafts from the input: off, they do not pay on this device ({said}: "
                                               f"x{gains[best]:.2f} tokens per step's time at best)")
    return DraftChoice(best, gains[best], kept_share, f"drafts from the input: up to {best} tokens a step ({said}: "
                                                      f"x{gains[best]:.2f} tokens per step's time where one is made)")
