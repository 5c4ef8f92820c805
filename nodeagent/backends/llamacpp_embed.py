"""An embedding model on llama.cpp: one thread owns the context and runs every caller's inputs in shared forward
batches (``EmbeddingSession``, ``backends/session.py``).

A caller's inputs wait in a queue; the thread takes everything waiting, packs the inputs into batches of up to
``n_seq_max`` sequences and ``n_batch`` tokens (each input whole, alone in its sequence, as an encoder needs),
decodes each batch once and reads one pooled vector per sequence (``llama_get_embeddings_seq``). So the inputs of
many tasks, from several worker slots or HTTP requests at once, share a forward pass, as llama-server's slots do:
the decode is the same as llama-cpp-python's own ``Llama.embed`` (its batch, its decode, its pooled output), with
the packing done across callers.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from nodeagent.errors import BackendError

log = logging.getLogger(__name__)
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}  # llama.cpp's enum llama_pooling_type


class LlamaEmbedder:
    """The shared forward batches of one embedding model (a llama-cpp-python ``Llama`` made with
    ``embedding=True``)."""

    def __init__(self, llama: Any, pooling: str) -> None:
        self.llama, self.pooling = llama, pooling
        self.n_embd = int(llama.n_embd())
        self.n_batch = int(llama.n_batch)
        self.n_ctx = min(int(llama.n_ctx()), self.n_batch)  # the longest input: whole, in one batch
        self.n_seq_max = int(llama.context_params.n_seq_max)
        self.batches = 0  # forward batches decoded
        self.inputs = 0  # inputs embedded
        self._waiting: queue.Queue[tuple[list[list[int]], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="embed-batches", daemon=True)
        self._thread.start()

    def tokenize(self, text: str) -> list[int]:
        return list(self.llama.tokenize(text.encode("utf-8")))  # as Llama.embed tokenizes (its markers added)

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if not inputs:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        for tokens in inputs:
            if not tokens or len(tokens) > self.n_ctx:
                raise BackendError(f"an input of {len(tokens)} tokens cannot be embedded: each holds 1 to "
                                   f"{self.n_ctx} tokens")
        done: Future = Future()
        self._waiting.put((inputs, done))
        return done.result()

    def close(self) -> None:
        self._waiting.put(None)
        self._thread.join(30)

    # -- the batching thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            first = self._waiting.get()
            if first is None:
                return
            work = [first]
            while True:  # everything waiting now shares the batches
                try:
                    more = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._waiting.put(None)
                    break
                work.append(more)
            try:
                vectors = self._embed_all([tokens for inputs, _ in work for tokens in inputs])
            except Exception as exc:  # noqa: BLE001  (each caller gets the failure)
                for _, done in work:
                    done.set_exception(BackendError(f"llama.cpp failed to embed: {exc}"))
                continue
            at = 0
            for inputs, done in work:
                done.set_result(vectors[at:at + len(inputs)])
                at += len(inputs)

    def _embed_all(self, inputs: list[list[int]]) -> np.ndarray:
        import llama_cpp

        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        batch, ctx = self.llama._batch, self.llama._ctx
        start = tokens_in = 0
        for i, tokens in enumerate(inputs + [[]]):
            full = i - start >= self.n_seq_max or tokens_in + len(tokens) > self.n_batch
            if i > start and (full or i == len(inputs)):
                ctx.kv_cache_clear()
                ctx.decode(batch)
                for seq in range(i - start):
                    ptr = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq)
                    out[start + seq] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
                batch.reset()
                self.batches += 1
                start, tokens_in = i, 0
            if i < len(inputs):
                batch.add_sequence(tokens, i - start, True)
                tokens_in += len(tokens)
        self.inputs += len(inputs)
        return out
