"""An embedding model on llama.cpp: one thread owns the context and runs every caller's inputs in shared forward
batches (``EmbeddingSession``, ``backends/session.py``).

A caller's inputs wait in a queue; the thread takes everything waiting, packs the inputs into batches of up to
``n_seq_max`` sequences and ``n_batch`` tokens (each input whole, alone in its sequence, as an encoder needs),
decodes each batch once and reads one pooled vector per sequence (``llama_get_embeddings_seq``). So the inputs of
many tasks, from several worker slots or HTTP requests at once, share a forward pass, as llama-server's slots do:
the decode is the same as llama-cpp-python's own ``Llama.embed`` (its batch, its decode, its pooled output), with
the packing done across callers.

A reranker (pooling rank: a cross-encoder with a classification head) runs the same way: its input is a query and
a document as one sequence (``pairs``), and what it pools is the head's output (one relevance logit a pair) in place
of a vector.

One caller never fails the others: an input is checked before it joins the queue (1 to ``n_ctx`` tokens, every id in
the vocabulary), and when a shared batch fails all the same, the context is reset (its memory cleared, the batch
emptied) and each caller's inputs are decoded again alone, so only the caller whose inputs fail gets the failure.
A reset that fails leaves the embedder ``broken`` (the node reloads it before its next use, and ``/readyz`` says
so meanwhile); a batch is emptied whatever happens, so nothing one decode left behind reaches the next.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from nodeagent.backends.session import foreign_token, log_softmax
from nodeagent.errors import BackendError

log = logging.getLogger(__name__)
RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"
_PLACEHOLDER = re.compile(r"\{query\}|\{document\}")
# the architectures whose rank pooling llama.cpp's graph ends with a softmax over the head's outputs
# (llama-graph.cpp, build_pooling: Qwen3's rerankers, their "yes" and "no")
SOFTMAXED_RANK = frozenset({"qwen3", "qwen3vl"})
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}  # llama.cpp's enum llama_pooling_type


class LlamaEmbedder:
    """The shared forward batches of one embedding model (a llama-cpp-python ``Llama`` made with
    ``embedding=True``)."""

    def __init__(self, llama: Any, pooling: str) -> None:
        import llama_cpp

        self.llama, self.pooling = llama, pooling
        # what a sequence pools to: a vector, or a reranker's head's outputs (llama_model_n_cls_out: one logit)
        self.n_embd = int(llama_cpp.llama_model_n_cls_out(llama._model.model) if pooling == "rank" else
                          llama.n_embd())
        self.n_vocab = int(llama.n_vocab())
        vocab = llama_cpp.llama_model_get_vocab(llama._model.model)  # how its tokenizer marks a text (``pairs``)
        self._bos = int(llama_cpp.llama_vocab_bos(vocab))
        self._add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self._add_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))
        self.architecture = str((llama.metadata or {}).get("general.architecture", ""))
        # a reranker's own framing of a pair, where its GGUF has one (Qwen3-Reranker: a chat prompt asking yes or no)
        self.rerank_template: str | None = (llama.metadata or {}).get(RERANK_TEMPLATE_KEY) if pooling == "rank" \
            else None
        self.n_batch = int(llama.n_batch)
        self.n_ctx = min(int(llama.n_ctx()), self.n_batch)  # the longest input: whole, in one batch
        self.n_seq_max = int(llama.context_params.n_seq_max)
        self.batches = 0  # forward batches decoded
        self.inputs = 0  # inputs embedded
        self.resets = 0  # the context reset after a failed batch
        self.broken: str | None = None  # why the context could not be reset (the model must be loaded again)
        self._waiting: queue.Queue[tuple[list[list[int]], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="embed-batches", daemon=True)
        self._thread.start()

    def tokenize(self, text: str) -> list[int]:
        return list(self.llama.tokenize(text.encode("utf-8")))  # as Llama.embed tokenizes (its markers added)

    def pairs(self, query: str, documents: list[str]) -> list[list[int]]:
        """A query and each document as one input of a cross-encoder. Where the GGUF has a rerank template
        (``tokenizer.chat_template.rerank``, which llama.cpp's converter writes for Qwen3-Reranker), the template with
        ``{query}`` and ``{document}`` put in, its special tokens read as such and nothing added, as llama-server
        frames it. Otherwise as the model's tokenizer frames a pair: the query's tokens with its markers, then the
        document's without its leading one, a separator doubled where the vocabulary closes a text with its end token
        (BERT: [CLS] q [SEP] d [SEP]; XLM-R: <s> q </s></s> d </s>, as Hugging Face's tokenizers build pairs); the
        query tokenized once."""
        if self.rerank_template is not None:  # (each placeholder of the template filled once: a query holding
            # "{document}" stays the query's text)
            return [list(self.llama.tokenize(_PLACEHOLDER.sub(lambda m: query if m[0] == "{query}" else document,
                                                              self.rerank_template).encode("utf-8"),
                                             add_bos=False, special=True)) for document in documents]
        first = self.tokenize(query)
        out = []
        for document in documents:
            second = self.tokenize(document)
            if second and self._add_bos and second[0] == self._bos:
                second = second[1:]
            if self._add_eos and first:
                second = [first[-1], *second]
            out.append(first + second)
        return out

    def relevance(self, pooled: np.ndarray) -> np.ndarray:
        """Each pair's relevance from its head's outputs: a logistic of a single logit (a BERT or XLM-R
        cross-encoder); the first label's probability of several (Qwen3-Reranker's yes and no, which llama.cpp's
        graph has already put through a softmax for the architectures in SOFTMAXED_RANK, and a softmax here for
        any other)."""
        out = np.asarray(pooled, dtype=np.float64)
        if out.shape[1] == 1:
            return 1.0 / (1.0 + np.exp(-out[:, 0]))
        if self.architecture not in SOFTMAXED_RANK:
            out = np.exp(np.apply_along_axis(log_softmax, 1, out))
        return out[:, 0]

    def embed(self, inputs: list[list[int]]) -> np.ndarray:
        if not inputs:
            return np.zeros((0, self.n_embd), dtype=np.float32)
        if self.broken is not None:
            raise BackendError(f"the model is broken ({self.broken}): it must be loaded again")
        for tokens in inputs:  # (the task runner checks these first, saying which input: this is the last guard)
            if not tokens or len(tokens) > self.n_ctx:
                raise ValueError(f"an input of {len(tokens)} tokens cannot be embedded: each holds 1 to "
                                 f"{self.n_ctx} tokens")
            if (bad := foreign_token(tokens, self.n_vocab)) is not None:
                raise ValueError(f"token {bad} is not in the model's vocabulary (0-{self.n_vocab - 1})")
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
            except Exception as exc:  # noqa: BLE001  (reset, then each caller alone: only the one that fails fails)
                self._reset(exc)
                for inputs, done in work:
                    self._alone(inputs, done, exc if len(work) == 1 else None)
                continue
            at = 0
            for inputs, done in work:
                done.set_result(vectors[at:at + len(inputs)])
                at += len(inputs)

    def _alone(self, inputs: list[list[int]], done: Future, failed: Exception | None) -> None:
        """One caller's inputs decoded in batches of their own (``failed``: they already failed so, alone)."""
        if failed is None and self.broken is None:
            try:
                done.set_result(self._embed_all(inputs))
                return
            except Exception as exc:  # noqa: BLE001
                self._reset(exc)
                failed = exc
        done.set_exception(BackendError(f"llama.cpp failed to embed: {failed or self.broken}"))

    def _reset(self, why: Exception) -> None:
        """The context as it was loaded: its memory cleared and the batch emptied; ``broken`` when that fails."""
        log.warning("an embedding batch failed (%s): the context is reset", why)
        self.resets += 1
        try:
            self.llama._ctx.kv_cache_clear()
            self.llama._batch.reset()
        except Exception as exc:  # noqa: BLE001
            self.broken = f"its reset after a failed batch failed: {exc}"
            log.error("the embedding model is broken: %s", self.broken)

    def _embed_all(self, inputs: list[list[int]]) -> np.ndarray:
        import llama_cpp

        out = np.empty((len(inputs), self.n_embd), dtype=np.float32)
        batch, ctx = self.llama._batch, self.llama._ctx
        start = tokens_in = 0
        batch.reset()
        try:
            for i, tokens in enumerate(inputs + [[]]):
                full = i - start >= self.n_seq_max or tokens_in + len(tokens) > self.n_batch
                if i > start and (full or i == len(inputs)):
                    ctx.kv_cache_clear()
                    ctx.decode(batch)
                    for seq in range(i - start):
                        ptr = llama_cpp.llama_get_embeddings_seq(ctx.ctx, seq)
                        if not ptr:
                            raise BackendError(f"llama.cpp pooled no vector for sequence {seq}")
                        out[start + seq] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
                    batch.reset()
                    self.batches += 1
                    start, tokens_in = i, 0
                if i < len(inputs):
                    batch.add_sequence(tokens, i - start, True)
                    tokens_in += len(tokens)
        finally:
            batch.reset()  # a batch that failed half-filled never reaches the next decode
        self.inputs += len(inputs)
        return out
