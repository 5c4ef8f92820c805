"""Tasks on a model that pools (an ``EmbeddingSession``, ``backends/session.py``): on an embedding model
``embed.v1``, and ``classify.v1`` by embeddings, with the same contract and the same Result as label scoring; on a
reranker (a cross-encoder, pooling rank) ``rerank.v1``.

**embed.v1**: each input (a text, or its token ids) read whole and pooled into one vector, in order; an input over
the model's context is refused naming the limit, never cut. A vector is normalised to length 1 unless the task
says otherwise; ``dimensions`` cuts it to a Matryoshka size the model declares (the catalog's
``matryoshka_dims``), normalised again, and is refused for any other size. The inputs of every task in flight
share the model's forward batches.

**classify.v1**, zero-shot: the text against each label, a label embedded as ``LABEL_TEMPLATE`` says (its name,
with its description where it has one); few-shot (the task's ``examples``): each label's centroid, the mean of
its examples' vectors and its own, normalised. Probabilities are a softmax of the cosine similarities at
``TEMPERATURE``; multi-label gives each label its own probability of applying (``applying``: not a softmax, whose
labels share the answer) and keeps those at or above the task's threshold (a half by default). A model's own prefixes go before a text and before a label (the catalog's ``query_prefix``,
``document_prefix``). The labels' vectors are kept per label set and examples (``LABEL_CACHE`` sets), so a
stream of tasks with the same labels embeds one text each. The template and the temperature are what
benchmarks/embed_classify.py measured (docs/typed-tasks.md, Classification by embeddings).

**rerank.v1** on a reranker: the query and each document as one input (``EmbeddingSession.pairs``), its pooled
output the head's relevance logit, and the relevance a logistic of it (a probability, as the generator's P(yes) is);
the pairs of every task in flight share the forward batches.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Iterator

import numpy as np

from nodeagent.backends.session import EmbeddingSession
from nodeagent.errors import TaskFailed
from nodeagent.model_kinds import ModelKind
from nodeagent.tasks.contracts import ClassifyOutput, ClassifyTask, EmbedOutput, EmbedTask, RerankOutput, RerankTask
from nodeagent.tasks.runner import Runner, threshold
from nodeagent.tasks.tokens import token_ids

LABEL_TEMPLATE = "A text about {name}: {description}."  # a label with a description; a bare name alone
TEMPERATURE = 0.03  # the softmax's over cosine similarities
LABEL_CACHE = 64  # label sets whose vectors are kept
# multi-label: a label applies with the probability of a logistic of its similarity above the labels' mean, at this
# center and scale, chosen at APPLIES_AT (``auto``). Fitted by log-loss on half of benchmarks/task_inputs.py's
# multi-label BBC News items (pairs of two topics and single items, 5 labels) and read on the other half:
# F1 0.768 against the softmax's 0.747 at 1 / K, per-label ECE 0.039 against 0.109 (docs/typed-tasks.md)
APPLIES_CENTER, APPLIES_SCALE, APPLIES_AT = 0.04, 0.03, 0.5


class PooledRunner(Runner):
    """What a model that pools runs on: its shared forward batches (``session``), an input's tokens checked against
    its context, and the inputs handed over a forward batch at a time."""

    def __init__(self, session: EmbeddingSession, model: str | None = None, quant: str | None = None,
                 backend: str | None = None, **clocks: Any) -> None:
        super().__init__(model, quant, backend, **clocks)
        self.session = session

    def _tokens(self, x: str | list[int], i: int) -> list[int]:
        """An input's tokens, checked against the model's context."""
        tokens = self.session.tokenize(x) if isinstance(x, str) else token_ids(x, self.session.n_vocab, f"input {i}")
        limit = self.session.n_ctx
        if len(tokens) > limit:
            raise TaskFailed("input_too_long", f"input {i} is {len(tokens)} tokens and {self.model or 'the model'} "
                                               f"reads at most {limit} at once: split it", False)
        return tokens

    def _vectors(self, tokens: list[list[int]], timing: dict) -> np.ndarray:
        """The inputs' vectors, handed to the model a forward batch's worth at a time, the task's stop and time
        limit asked between them: a task given up (its client gone) or past its limit ends at the next batch, not
        after all its inputs, and other tasks' inputs share the batches in between."""
        started = self.clock()
        parts = []
        for i, batch in enumerate(forward_batches(tokens, self.session.n_seq_max, self.session.n_batch)):
            if i:
                self.check_stop(None, "between forward batches")
            parts.append(np.asarray(self.session.embed(batch), dtype=np.float32))
        out = np.concatenate(parts) if parts else np.zeros((0, self.session.n_embd), dtype=np.float32)
        timing["prompt_s"] = timing.get("prompt_s", 0.0) + self.clock() - started
        return out


class RerankRunner(PooledRunner):
    """rerank.v1 on a reranker (a cross-encoder GGUF, llama.cpp's rank pooling)."""

    kind = ModelKind.RERANK

    def rerank(self, task: RerankTask, notes: list[str], timing: dict, counts: dict) -> RerankOutput:
        pairs = self.session.pairs(task.query, task.documents)
        for i, tokens in enumerate(pairs):
            if len(tokens) > self.session.n_ctx:
                raise TaskFailed("input_too_long", f"the query and document {i} are {len(tokens)} tokens and "
                                                   f"{self.model or 'the model'} reads at most {self.session.n_ctx} "
                                                   "at once: shorten the document or split it", False)
        self.check_stop(task, "before scoring")
        relevance = self.session.relevance(self._vectors(pairs, timing))
        counts["prompt"] = sum(map(len, pairs))
        notes.append("ranked by a reranker: each query and document read together, the relevance its head's "
                     + ("logit through a logistic" if self.session.n_embd == 1 else "probability of its first label"))
        return RerankOutput.ranked([float(x) for x in relevance], task.top_n)


class EmbedRunner(PooledRunner):
    """Tasks on one embedding model: its shared forward batches (``session``), its prefixes and Matryoshka
    sizes (``prefixes``: query, document; ``dims``)."""

    kind = ModelKind.EMBED

    def __init__(self, session: EmbeddingSession, model: str | None = None, quant: str | None = None,
                 backend: str | None = None, prefixes: tuple[str, str] = ("", ""), dims: tuple[int, ...] = (),
                 **clocks: Any) -> None:
        super().__init__(session, model, quant, backend, **clocks)
        self.prefixes, self.dims = prefixes, dims
        self._labels: OrderedDict[str, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    # -- embed.v1 -----------------------------------------------------------------------------------------
    def embed(self, task: EmbedTask, notes: list[str], timing: dict, counts: dict) -> EmbedOutput:
        if task.dimensions is not None and task.dimensions not in self.dims:
            sizes = ", ".join(map(str, self.dims)) if self.dims else "none"
            raise TaskFailed("dimensions_unsupported", f"dimensions {task.dimensions}: {self.model or 'this model'}"
                                                       f" declares no Matryoshka size of it (its sizes: {sizes}); "
                                                       "leave dimensions out for the full vector", False)
        tokens = [self._tokens(x, i) for i, x in enumerate(task.input)]
        self.check_stop(task, "before embedding")
        vectors = self._vectors(tokens, timing)
        if task.dimensions is not None and task.dimensions < vectors.shape[1]:
            vectors = vectors[:, :task.dimensions]
            notes.append(f"dimensions {task.dimensions}: each vector cut to a Matryoshka size and normalised again")
        if task.normalize or task.dimensions is not None:
            vectors = unit(vectors)
        counts["prompt"] = sum(map(len, tokens))
        return EmbedOutput(embeddings=[base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in vectors],
                           dimensions=int(vectors.shape[1]), tokens=[len(t) for t in tokens],
                           encoding_format=task.encoding_format)

    # -- classify.v1 --------------------------------------------------------------------------------------
    def classify(self, task: ClassifyTask, notes: list[str], timing: dict, counts: dict) -> ClassifyOutput:
        query, _ = self.prefixes
        text = self._tokens(query + task.input, 0)
        self.check_stop(task, "before embedding")
        labels = self._label_vectors(task, timing)
        [vector] = unit(self._vectors([text], timing))
        counts["prompt"] = len(text)
        similarity = labels @ vector
        probs = softmax(similarity / TEMPERATURE)
        names = [lb.name for lb in task.labels]
        own = dict(zip(names, map(float, probs)))
        top = names[int(np.argmax(probs))]
        how = (f"few-shot: {len(task.examples)} examples, nearest centroid" if task.examples else
               "zero-shot: the text against each label" + (" and its description" if any(
                   lb.description for lb in task.labels) else ""))
        notes.append(f"classified by embeddings ({how})")
        if not task.multi_label:
            return ClassifyOutput(label=top, probabilities=own)
        applies = applying(similarity)  # each label's own probability: several may apply, none must
        at = APPLIES_AT if task.threshold == "auto" else threshold(task)
        notes.append(f"multi-label: each label's own probability of applying (its similarity above the labels' mean,"
                     f" a logistic at {APPLIES_CENTER} and {APPLIES_SCALE}), chosen at {at:g}")
        return ClassifyOutput(label=top, labels=[n for n, p in zip(names, applies) if p >= at],
                              probabilities=dict(zip(names, map(float, applies))))

    def _label_vectors(self, task: ClassifyTask, timing: dict) -> np.ndarray:
        """Each label's vector (zero-shot) or centroid (few-shot), normalised; kept per label set and examples."""
        key = hashlib.sha256(json.dumps([task.model_dump(mode="json", include={"labels", "examples"}),
                                         self.prefixes], sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self._labels:
                self._labels.move_to_end(key)
                return self._labels[key]
        query, document = self.prefixes
        texts = [document + label_text(lb.name, lb.description) for lb in task.labels]
        examples = [query + ex.text for ex in task.examples]
        vectors = unit(self._vectors([self._tokens(t, i) for i, t in enumerate(texts + examples)], timing))
        own, shown = vectors[:len(texts)], vectors[len(texts):]
        index = {lb.name: i for i, lb in enumerate(task.labels)}
        sums, counts = own.copy(), np.ones(len(texts))
        for ex, v in zip(task.examples, shown):
            sums[index[ex.label]] += v
            counts[index[ex.label]] += 1
        centroids = unit(sums / counts[:, None])
        with self._lock:
            self._labels[key] = centroids
            while len(self._labels) > LABEL_CACHE:
                self._labels.popitem(last=False)
        return centroids


def forward_batches(inputs: list[list[int]], most: int, room: int) -> Iterator[list[list[int]]]:
    """The inputs as an embedder packs them (``backends/llamacpp_embed.py``): up to ``most`` inputs and ``room``
    tokens a forward batch, in order."""
    batch: list[list[int]] = []
    tokens = 0
    for x in inputs:
        if batch and (len(batch) >= most or tokens + len(x) > room):
            yield batch
            batch, tokens = [], 0
        batch.append(x)
        tokens += len(x)
    if batch:
        yield batch


def applying(similarity: np.ndarray) -> np.ndarray:
    """Multi-label: the probability that each label applies, on its own (they do not share the answer, as a softmax's
    do: a text about food and service and price can have all three): a logistic of its similarity above the labels'
    mean (``APPLIES_CENTER``, ``APPLIES_SCALE``)."""
    return 1.0 / (1.0 + np.exp(-(similarity - similarity.mean() - APPLIES_CENTER) / APPLIES_SCALE))


def label_text(name: str, description: str | None) -> str:
    """A label as it is embedded (``LABEL_TEMPLATE``)."""
    return LABEL_TEMPLATE.format(name=name, description=description) if description else name


def unit(x: np.ndarray) -> np.ndarray:
    """Each row scaled to length 1 (a zero row stays zero)."""
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
