"""The token-level view of a loaded model that tasks run on. Each backend provides one."""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import numpy as np


class TokenSession(Protocol):
    """Prompt once, read logits, extend or cut the sequence. The KV cache is reused across calls."""

    ctx_per_slot: int  # the tokens this session's sequence may hold (llama.cpp's n_ctx is every slot's together)
    n_vocab: int
    chat_template: str | None
    bos_text: str
    eos_text: str
    eog_tokens: frozenset[int]

    def tokenize(self, text: str) -> list[int]:
        """Tokens of a rendered prompt (special tokens parsed; a BOS added only if the model wants one
        and the text does not start with it)."""

    def tokenize_continuation(self, text: str) -> list[int]:
        """Tokens of text that follows other text (no BOS)."""

    def has_token(self, text: str) -> bool:
        """Whether the vocabulary has ``text`` (special tokens included) as one token."""

    def detokenize(self, tokens: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (not always UTF-8 on its own: a piece of a character)."""

    def eval_all(self, tokens: list[int]) -> list[np.ndarray]:
        """Append tokens; return the logits after each of them (for the log-probabilities of a prompt)."""

    def reset(self) -> None: ...

    def prefill(self, tokens: list[int]) -> np.ndarray:
        """Make the sequence exactly ``tokens`` and return the logits after the last one, evaluating
        only what differs from the sequence already in the KV cache (a shared system prompt is reused)."""

    def truncate(self, n_tokens: int) -> None:
        """Keep the first n_tokens of the sequence; the next eval continues from there."""

    @property
    def n_tokens(self) -> int:
        """Length of the sequence the KV cache holds."""

    def eval(self, tokens: list[int]) -> np.ndarray:
        """Append tokens; return the logits (float32, n_vocab) after the last one."""

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        """Evaluate a tree of tokens that continues the sequence: node i holds tokens[i] and follows node
        parents[i] (-1: the sequence's end); a parent comes before its children. Returns the logits after
        each node. The sequence is the same afterwards."""

    def lltokenizer(self) -> Any:
        """The vocabulary as an llguidance tokenizer (cached), for constrained decoding."""

    # optional: prefill_tree(tokens, parents, tree) -> (logits after the prompt, logits after each tree node),
    # the two in one evaluation; ``prefill_tree`` below falls back to prefill, then eval_tree


class EmbeddingSession(Protocol):
    """An embedding model's forward batches: token sequences in, one vector each out. Callers on many threads
    share it: their inputs go into the same forward batches (up to ``n_seq_max`` inputs and ``n_batch`` tokens a
    batch). Each input is read whole, alone in its sequence, so it holds at most ``n_ctx`` tokens."""

    n_ctx: int  # the longest input, in tokens
    n_embd: int  # a vector's size (a reranker's: its head's outputs, one relevance logit)
    n_vocab: int  # the token ids it reads are 0 to n_vocab - 1
    n_seq_max: int  # the most inputs a forward batch holds
    n_batch: int  # the most tokens a forward batch holds
    pooling: str  # mean | cls | last | rank (a reranker)

    def tokenize(self, text: str) -> list[int]:
        """The input's tokens, with the model's own markers (BERT's [CLS] and [SEP])."""

    def pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        """A reranker's inputs: the query and each document as one sequence, framed as its tokenizer frames a pair."""

    def embed(self, inputs: list[list[int]]) -> Any:
        """One vector per input (a float32 array of shape (len(inputs), n_embd), as the model pools it, not
        normalised); BackendError when the model fails."""

    def relevance(self, pooled: Any) -> Any:
        """A reranker's pooled outputs (``embed`` of its ``pairs``) as each pair's relevance, 0 to 1."""


def foreign_token(tokens: list[int], n_vocab: int) -> int | None:
    """The first of ``tokens`` that is not an id of a vocabulary of ``n_vocab`` tokens (None: every one is). The
    one check of a client's token ids before llama.cpp reads them: an id past the vocabulary fails a whole shared
    batch there, and one at or past 2**32 would wrap into another token's id."""
    return next((t for t in tokens if not 0 <= t < n_vocab), None)


def eval_later(session: TokenSession, tokens: list[int]) -> Callable[[], np.ndarray]:
    """Start ``session.eval(tokens)`` and return what waits for its logits: a session that decodes on a thread of
    its own (the slots engine) starts the step now, so the caller's work meanwhile (the next token's grammar mask)
    overlaps the model's; any other evaluates now."""
    start = getattr(session, "eval_later", None)
    if start is not None:
        return start(tokens)
    logits = session.eval(tokens)
    return lambda: logits


def prefill_tree(session: TokenSession, tokens: list[int], parents: list[int],
                 tree: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """``session.prefill(tokens)``, then ``session.eval_tree(parents, tree)`` over it: the logits after the
    prompt and after each tree node. A session that can evaluates both as one batch (llama.cpp: the prompt's new
    tokens and the label branches in one llama_decode, so the branches cost no step of their own); any other
    makes the two calls."""
    both = getattr(session, "prefill_tree", None)
    if both is not None:
        return both(tokens, parents, tree)
    first = session.prefill(tokens)
    return first, session.eval_tree(parents, tree) if tree else []


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


def eval_each(session: TokenSession, tokens: list[int]) -> list[np.ndarray]:
    """eval_all one token at a time, on any session."""
    return [session.eval([t]) for t in tokens]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tree_paths(parents: list[int]) -> list[list[int]]:
    """For each node of a tree given by parent indices (-1: root), the node indices from the root down."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"node {i}: its parent {parent} must come before it")
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    return paths


def eval_tree_sequential(session: TokenSession, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
    """eval_tree one branch at a time on any session: re-evaluates only where a node's path leaves the
    previous one (a depth-first order costs one eval per node)."""
    base = session.n_tokens
    current: list[int] = []  # node indices evaluated after base
    out: list[np.ndarray] = []
    try:
        for path in tree_paths(parents):
            keep = common_prefix(current, path[:-1])
            session.truncate(base + keep)
            out.append(session.eval([tokens[i] for i in path[keep:]]))
            current = path
    finally:
        session.truncate(base)
    return out


def exact_tokens(session: TokenSession, text: str) -> list[int] | None:
    """Tokens that detokenize to exactly ``text`` as the continuation of an answer (no BOS), or None when none
    are found. A stream continued on another node must go on from exactly the characters its client has, and a
    vocabulary's own tokenizing does not always give them back: SentencePiece vocabularies with a space prefix
    (Llama 2, Mistral 7B v0.x, Phi-3) put a space before the text's first word. Tried in turn: the text's own
    tokens; those of the text less the one space such a tokenizer adds back; then the longest pieces of the
    vocabulary that spell it byte by byte (every vocabulary here has a token for each byte)."""
    if not text:
        return []
    tokens = session.tokenize_continuation(text)
    if session.detokenize(tokens) == text:
        return tokens
    if text.startswith(" "):
        tokens = session.tokenize_continuation(text[1:])
        if session.detokenize(tokens) == text:
            return tokens
    tokens = _spelled(session, text.encode("utf-8"))
    return tokens if tokens is not None and session.detokenize(tokens) == text else None


def _spelled(session: TokenSession, data: bytes) -> list[int] | None:
    """``data`` as the longest vocabulary pieces that match it from left to right (None where no piece does)."""
    pieces: dict[bytes, int] | None = getattr(session, "_pieces", None)
    if pieces is None:
        pieces = {}
        for token in range(session.n_vocab - 1, -1, -1):  # the lower id where two tokens spell the same bytes
            piece = session.token_bytes(token)
            if piece and token not in session.eog_tokens:
                pieces[piece] = token
        try:
            session._pieces = pieces  # type: ignore[attr-defined]  (built once a session: a pass over the vocabulary)
        except AttributeError:
            pass
    longest = max(map(len, pieces), default=0)
    out: list[int] = []
    i = 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            token = pieces.get(data[i:i + n])
            if token is not None:
                out.append(token)
                i += n
                break
        else:
            return None
    return out
