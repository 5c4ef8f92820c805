"""Slots: up to ``slots`` tasks decoded together as parallel sequences of one llama.cpp context.

Decoding on a CPU or Apple Silicon is bound by memory bandwidth: a step that carries a token from each of
four sequences reads the weights once, as a step for one does. So each slot is a ``TokenSession`` of its
own (``SlotSession``: its own sequence, its own tokens, its own grammar state in the task that runs on it)
and one ``BatchEngine`` thread owns the context: it waits until every slot that holds a task has asked for
its next evaluation, then makes one ``llama_decode`` of all of them (continuous batching). A new task's
prompt joins as chunks of the same batches, so the slots already decoding keep going while it is read.

The sequences share one unified KV cache of ``slots * ctx`` cells (the planner charges for every one); slot
``k`` owns sequence ids ``k * B .. k * B + B - 1``: its own, and ``B - 1`` for label branches, which share
the slot's prompt cells (``seq_cp`` in a unified cache copies no data).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from nodeagent.backends.llamacpp_vocab import LlamaCppVocab
from nodeagent.backends.prefix_store import PrefixStore, WarmPrefixes
from nodeagent.backends.session import common_prefix, eval_tree_sequential, tree_paths
from nodeagent.errors import BackendError
from nodeagent.planner.types import ctx_per_slot

log = logging.getLogger(__name__)

# a slot busy with something other than evaluation (rendering a prompt, validating an output) holds the others
# back at most this long before a step goes without it
MAX_WAIT_S = 0.02
# a slot takes another slot's cells for a prompt prefix when that saves reading at least this many tokens
MIN_BORROW_TOKENS = 16


@dataclass
class _Entry:
    token: int
    pos: int
    seqs: tuple[int, ...]
    logits: bool


@dataclass
class _Request:
    entries: list[_Entry]
    done: int = 0  # entries already decoded
    out: list[np.ndarray] = field(default_factory=list)  # logits of the entries that asked, in order
    ready: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    # a draft to verify (``SlotSession.eval_draft``): row r of the logits asked for predicts draft[r]; only the
    # first row whose best token is not the draft's is copied out, and ``agreed`` says which
    draft: list[int] | None = None
    rows: int = 0  # the rows of the draft's request read so far
    agreed: int | None = None


class BatchEngine:
    """One llama.cpp context shared by ``slots`` SlotSessions; a thread makes one llama_decode per step."""

    def __init__(self, root: LlamaCppVocab, slots: int, seqs_per_slot: int,
                 threads: Callable[[], int] | None = None,
                 prefixes: Callable[[], PrefixStore | None] | None = None) -> None:
        import llama_cpp

        self.lib, self.root = llama_cpp, root
        self.ctx = root.llama.ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab, self.n_batch = root.n_vocab, root.n_batch
        self.seqs_per_slot = seqs_per_slot
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, seqs_per_slot)
        self.ctx_lock = threading.Lock()  # llama_decode and the KV cache's sequence edits
        self.cond = threading.Condition()
        self.pending: dict[int, _Request] = {}  # slot -> its request
        self.active: set[int] = set()  # slots holding a task
        self.closed = False
        self.steps = 0
        self.stepped_tokens = 0
        self.borrowed_tokens = 0  # prompt tokens a slot took from another slot's cells instead of reading them
        self.threads = threads  # the threads for each step (ThreadGovernor), or None: the context's own
        # the prefixes kept on disk (``prefix_store``), once the store can be opened (None: not kept, or not yet)
        self.prefixes = prefixes if prefixes is not None else (lambda: None)
        self.n_threads = int(root.llama.context_params.n_threads)
        self.sessions = [SlotSession(self, k, ctx_per_slot(root.n_ctx, slots)) for k in range(slots)]
        self.thread = threading.Thread(target=self._loop, name="llama-batch", daemon=True)
        self.thread.start()

    # -- the slots' side --------------------------------------------------------------------------------
    def submit(self, slot: int, entries: list[_Entry]) -> list[np.ndarray]:
        return self.collect(self.post(slot, entries))

    def post(self, slot: int, entries: list[_Entry], draft: list[int] | None = None) -> _Request:
        """Ask for ``entries`` to be decoded in the next steps; ``collect`` waits for their logits (with a
        ``draft``: the one row ``_read`` keeps)."""
        request = _Request(entries, draft=draft)
        with self.cond:
            if self.closed:
                raise BackendError("the model is closed")
            self.pending[slot] = request
            self.cond.notify_all()
        return request

    @staticmethod
    def collect(request: _Request) -> list[np.ndarray]:
        request.ready.wait()
        if request.error is not None:
            raise BackendError(request.error, hint="run with --log-level debug to see llama.cpp's log")
        return request.out

    @contextlib.contextmanager
    def hold(self, slot: int) -> Iterator[None]:
        """A task runs on ``slot``: steps wait for its requests (up to MAX_WAIT_S)."""
        with self.cond:
            self.active.add(slot)
        try:
            yield
        finally:
            with self.cond:
                self.active.discard(slot)
                self.cond.notify_all()

    def seq_rm(self, seq: int, start: int, end: int = -1) -> None:
        with self.ctx_lock:
            self.lib.llama_memory_seq_rm(self.mem, seq, start, end)

    def seq_cp(self, src: int, dst: int, start: int, end: int) -> None:
        with self.ctx_lock:
            self.lib.llama_memory_seq_cp(self.mem, src, dst, start, end)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            for request in self.pending.values():
                request.error = "the model is closed"
                request.ready.set()
            self.pending.clear()
            self.cond.notify_all()
        self.thread.join(10)
        self.lib.llama_batch_free(self.batch)

    # -- the engine's side -------------------------------------------------------------------------------
    def _ready(self, since: float | None) -> bool:
        if not self.pending:
            return False
        if self.active <= set(self.pending):  # every slot with a task is waiting on the model
            return True
        return since is not None and time.monotonic() - since >= MAX_WAIT_S

    def _loop(self) -> None:
        while True:
            with self.cond:
                since: float | None = None
                while not self.closed and not self._ready(since):
                    if self.pending and since is None:
                        since = time.monotonic()
                    self.cond.wait(MAX_WAIT_S / 4 if self.pending else None)
                if self.closed:
                    return
                work = dict(self.pending)
            self._step(work)

    def _step(self, work: dict[int, _Request]) -> None:
        """One llama_decode: the next token of every decoding slot first, then prompt chunks in the room left."""
        lib, batch = self.lib, self.batch
        taken: list[tuple[int, _Request, int]] = []  # slot, request, entries taken
        room = self.n_batch
        for slot, request in sorted(work.items(), key=lambda kv: len(kv[1].entries) - kv[1].done):
            n = min(len(request.entries) - request.done, room)
            if n <= 0:
                continue
            taken.append((slot, request, n))
            room -= n
        j = 0
        rows: list[tuple[_Request, int]] = []
        for _, request, n in taken:
            for e in request.entries[request.done: request.done + n]:
                batch.token[j] = e.token
                batch.pos[j] = e.pos
                batch.n_seq_id[j] = len(e.seqs)
                for m, seq in enumerate(e.seqs):
                    batch.seq_id[j][m] = seq
                batch.logits[j] = e.logits
                if e.logits:
                    rows.append((request, j))
                j += 1
        batch.n_tokens = j
        if self.threads is not None and (n := self.threads()) != self.n_threads:
            log.info("decoding with %d threads (was %d): %s", n, self.n_threads,
                     f"other processes hold {self.threads.busy_cores:.1f} cores" if n < self.n_threads else "the cores are free again")
            lib.llama_set_n_threads(self.ctx, n, n)
            self.n_threads = n
        with self.ctx_lock:
            rc = lib.llama_decode(self.ctx, batch)
            error = None if rc == 0 else f"llama_decode returned {rc} for a batch of {j} tokens over {len(taken)} slots"
            if error is None:
                for request, row in rows:
                    self._read(request, row)
        self.steps += 1
        self.stepped_tokens += j
        with self.cond:
            for slot, request, n in taken:
                request.done += n
                if error is not None:
                    request.error = error
                if error is not None or request.done == len(request.entries):
                    del self.pending[slot]
                    request.ready.set()


    def _read(self, request: _Request, row: int) -> None:
        """A logits row for its request, copied out of llama.cpp's buffer (which the next step overwrites). A draft's
        rows are read in place: while the model's best token is the draft's, nothing is copied; the first row where
        it is not (or the one after the whole draft) is the only one kept."""
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        view = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
        draft = request.draft
        if draft is None:
            request.out.append(view.copy())
            return
        if request.agreed is not None:
            return
        r = request.rows
        request.rows += 1
        if r < len(draft) and int(np.argmax(view)) == draft[r]:
            return
        request.agreed = r
        request.out.append(view.copy())


class SlotSession(WarmPrefixes):
    """One slot of a BatchEngine as a TokenSession: its own sequence in the shared context; its prompts' prefixes
    kept, borrowed from another slot (``_borrow``) or read back from the disk (``WarmPrefixes``)."""

    def __init__(self, engine: BatchEngine, slot: int, ctx_per_slot: int) -> None:
        root = engine.root
        self.engine, self.slot, self.ctx_per_slot = engine, slot, ctx_per_slot
        self.seq = slot * engine.seqs_per_slot
        self.n_seq_max, self.n_batch = engine.seqs_per_slot, engine.n_batch  # this slot's sequences (branches)
        self.n_vocab, self.chat_template = root.n_vocab, root.chat_template
        self.bos_text, self.eos_text, self.eog_tokens = root.bos_text, root.eos_text, root.eog_tokens
        self.tokenize, self.tokenize_continuation = root.tokenize, root.tokenize_continuation
        self.has_token, self.detokenize, self.lltokenizer = root.has_token, root.detokenize, root.lltokenizer
        self.token_bytes = root.token_bytes
        self._tokens: list[int] = []

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return self.engine.hold(self.slot)

    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    def reset(self) -> None:
        self.truncate(0)

    def truncate(self, n_tokens: int) -> None:
        with self.engine.ctx_lock:  # the cells and the tokens they hold change together (see _borrow)
            self.engine.lib.llama_memory_seq_rm(self.engine.mem, self.seq, n_tokens, -1)
            del self._tokens[n_tokens:]

    def _prefixes(self) -> PrefixStore | None:
        return self.engine.prefixes()

    def _load_state(self, data: bytes, n_tokens: int, tokens: list[int]) -> bool:
        """The stored state ``data`` into this slot's sequence, cut to its first ``n_tokens`` (a prefix of
        ``tokens``); False (the slot left empty) where llama.cpp refuses it."""
        engine, buf = self.engine, (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        with engine.ctx_lock:
            engine.lib.llama_memory_seq_rm(engine.mem, self.seq, 0, -1)
            self._tokens = []
            if engine.lib.llama_state_seq_set_data(engine.ctx, buf, len(data), self.seq) == 0:
                return False
            engine.lib.llama_memory_seq_rm(engine.mem, self.seq, n_tokens, -1)
            self._tokens = list(tokens[:n_tokens])
        return True

    def state(self, tokens: list[int]) -> bytes | None:
        """A copy of the KV state of this slot's sequence (llama.cpp's, for ``llama_state_seq_set_data``), taken
        under the context lock while it holds exactly ``tokens``; None when it holds other tokens."""
        engine = self.engine
        with engine.ctx_lock:
            if self._tokens != tokens:
                return None
            size = engine.lib.llama_state_seq_get_size(engine.ctx, self.seq)
            buf = (ctypes.c_uint8 * size)()
            wrote = engine.lib.llama_state_seq_get_data(engine.ctx, buf, size, self.seq)
        return ctypes.string_at(buf, wrote) if wrote else None

    def _borrow(self, tokens: list[int]) -> bool:
        """Start from another slot's cells where it holds a longer prefix of ``tokens`` (the same system prompt
        and schema, another input): in a unified cache, seq_cp shares the cells, nothing is copied or read
        again. Under the context lock, so the other slot's tokens are what its cells hold."""
        engine = self.engine
        with engine.ctx_lock:
            own = common_prefix(self._tokens, tokens)
            best, n = None, own + MIN_BORROW_TOKENS
            for other in engine.sessions:
                if other is not self and (k := common_prefix(other._tokens, tokens)) > n:
                    best, n = other, k
            if best is None:
                return False
            engine.lib.llama_memory_seq_rm(engine.mem, self.seq, 0, -1)
            engine.lib.llama_memory_seq_cp(engine.mem, best.seq, self.seq, 0, n)
            self._tokens = tokens[:n]
            engine.borrowed_tokens += n
            return True

    def eval(self, tokens: list[int]) -> np.ndarray:
        return self.eval_later(tokens)()

    def eval_later(self, tokens: list[int]) -> Callable[[], np.ndarray]:
        """Post the tokens for the next step now; the returned function waits for the logits after the last one.
        The step need not wait for this slot's next request (``MAX_WAIT_S``): it is already there, and what the
        task does meanwhile (its next grammar mask) overlaps the decode."""
        base = len(self._tokens)
        if base + len(tokens) > self.ctx_per_slot:
            raise BackendError(f"the slot's context of {self.ctx_per_slot} tokens is full")
        last = len(tokens) - 1
        entries = [_Entry(t, base + i, (self.seq,), i == last) for i, t in enumerate(tokens)]
        request = self.engine.post(self.slot, entries)

        def logits() -> np.ndarray:
            out = self.engine.collect(request)
            if len(self._tokens) == base:  # the sequence now holds them (once, however often this is asked)
                self._tokens.extend(tokens)
            return out[-1]
        return logits

    def eval_draft(self, tokens: list[int], draft: list[int]) -> tuple[int, np.ndarray]:
        """Append ``tokens`` and a guessed continuation ``draft`` in one step, with logits after the last token and
        after each drafted one; keep the draft's longest prefix whose every token is the model's best after what
        precedes it (greedy decoding's choice, read in the engine without copying the rows), remove the cells of
        the rest. Returns how many drafted tokens were kept and the logits after them."""
        base = len(self._tokens)
        draft = draft[:max(0, self.ctx_per_slot - base - len(tokens))]
        if base + len(tokens) > self.ctx_per_slot:
            raise BackendError(f"the slot's context of {self.ctx_per_slot} tokens is full")
        last = len(tokens) - 1
        entries = [_Entry(t, base + i, (self.seq,), i == last) for i, t in enumerate(tokens)]
        entries += [_Entry(t, base + len(tokens) + i, (self.seq,), True) for i, t in enumerate(draft)]
        request = self.engine.post(self.slot, entries, draft=draft)
        out = self.engine.collect(request)
        kept = request.agreed
        assert kept is not None
        with self.engine.ctx_lock:  # the cells and the tokens they hold change together
            if kept < len(draft):
                self.engine.lib.llama_memory_seq_rm(self.engine.mem, self.seq, base + len(tokens) + kept, -1)
            self._tokens.extend(tokens + draft[:kept])
        return kept, out[0]

    def eval_all(self, tokens: list[int]) -> list[np.ndarray]:
        """The logits after each token, at most the slot's reserved rows (its sequences) a step: what the plan
        holds for the output buffer."""
        out: list[np.ndarray] = []
        rows = max(1, self.n_seq_max)
        for i in range(0, len(tokens), rows):
            chunk = tokens[i:i + rows]
            base = len(self._tokens)
            if base + len(chunk) > self.ctx_per_slot:
                raise BackendError(f"the slot's context of {self.ctx_per_slot} tokens is full")
            entries = [_Entry(t, base + j, (self.seq,), True) for j, t in enumerate(chunk)]
            out.extend(self.engine.submit(self.slot, entries))
            self._tokens.extend(chunk)
        return out

    def eval_tree(self, parents: list[int], tokens: list[int]) -> list[np.ndarray]:
        """Label branches as sequences of this slot sharing its prompt's cells, batched with the other slots'
        steps; at most seqs_per_slot - 1 branches and seqs_per_slot nodes at once (the logits rows the plan
        reserved for the slot), within the slot's context."""
        n_branch = self.engine.seqs_per_slot - 1
        cap = min(self.engine.seqs_per_slot, self.ctx_per_slot - len(self._tokens))
        if n_branch < 1 or len(tokens) <= 1 or cap < 2:
            return eval_tree_sequential(self, parents, tokens)
        paths = tree_paths(parents)
        inner = set(parents)
        leaves = [i for i in range(len(tokens)) if i not in inner]
        out: dict[int, np.ndarray] = {}
        chunk: list[int] = []
        for leaf in leaves + [-1]:  # -1 flushes the last chunk
            nodes = {n for lf in chunk + ([leaf] if leaf >= 0 else []) for n in paths[lf]}
            if leaf >= 0 and len(chunk) < n_branch and len(nodes) <= cap:
                chunk.append(leaf)
                continue
            if chunk:
                out.update(self._branches(chunk, paths, tokens))
            chunk = [leaf] if leaf >= 0 else []
            if leaf >= 0 and len(paths[leaf]) > cap:  # a branch longer than the room left: one node at a time
                sub = paths[leaf]
                logits = eval_tree_sequential(self, [-1] + list(range(len(sub) - 1)), [tokens[n] for n in sub])
                out.update(zip(sub, logits))
                chunk = []
        return [out[i] for i in range(len(tokens))]

    def prefill_tree(self, tokens: list[int], parents: list[int],
                     tree: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``prefill(tokens)`` and ``eval_tree(parents, tree)`` as one request: the prompt's new tokens join the
        branches' batch (``_branches``). A decode step reads every weight whatever it carries, so on a CPU a step
        of one token costs about as much as several prompt tokens: the labels then take no step of their own.
        Within the slot's reserved logits rows (the prompt's last token and every node) and branches; a larger
        tree goes as prefill, then eval_tree."""
        paths, inner = tree_paths(parents), set(parents)
        leaves = [i for i in range(len(tree)) if i not in inner]
        if (not tree or len(leaves) > self.engine.seqs_per_slot - 1 or 1 + len(tree) > self.engine.seqs_per_slot
                or len(tokens) + len(tree) > self.ctx_per_slot):
            first = self.prefill(tokens)
            return first, self.eval_tree(parents, tree) if tree else []
        keep = self._reuse(tokens)
        out = self._branches(leaves, paths, tree, tokens[keep:])
        return out.pop(-1), [out[n] for n in range(len(tree))]

    def _branches(self, leaves: list[int], paths: list[list[int]], tokens: list[int],
                  prompt: Sequence[int] = ()) -> dict[int, np.ndarray]:
        """The nodes on the paths to ``leaves``, one sequence per leaf over the slot's cells, in one request; the
        logits after each node. ``prompt``: new tokens of the slot's own sequence that go first in the same
        request, in every branch's sequence too (the nodes then follow them), their last logits under -1."""
        base = len(self._tokens)
        branches = [self.seq + 1 + k for k in range(len(leaves))]
        seqs_of: dict[int, list[int]] = {}
        for seq, leaf in zip(branches, leaves):
            for node in paths[leaf]:
                seqs_of.setdefault(node, []).append(seq)
        nodes = sorted(seqs_of)
        for seq in branches:  # the cells already there join every branch
            self.engine.seq_rm(seq, 0)
            self.engine.seq_cp(self.seq, seq, 0, base)
        shared = (self.seq, *branches)
        entries = [_Entry(t, base + i, shared, i == len(prompt) - 1) for i, t in enumerate(prompt)]
        start = base + len(prompt)
        entries += [_Entry(tokens[n], start + len(paths[n]) - 1, tuple(seqs_of[n]), True) for n in nodes]
        try:
            out = self.engine.submit(self.slot, entries)
        except BaseException:
            self.engine.seq_rm(self.seq, base)  # what was written of the prompt is not the sequence
            raise
        finally:
            for seq in branches:
                self.engine.seq_rm(seq, 0)
        self._tokens.extend(prompt)
        return dict(zip(([-1] if prompt else []) + nodes, out))
