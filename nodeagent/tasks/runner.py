"""Run a task on a TokenSession: constrained extraction, classification by label scoring, and rerank by the
model's yes/no answer.

Extraction decodes greedily under a token mask from llguidance's JSON-Schema
compiler, so every step can only continue a schema-valid object; the result is
then validated with a JSON Schema validator before it is returned.

Classification does not chat: the prompt is processed once, then every label's
token sequence is scored from the logits: P(label) is the probability of its
tokens as the start of the answer. The labels form a trie: a shared prefix is
evaluated once, and a label that is a prefix of another ("sports" and "sports
news") gets the mass of its tokens less what continues into the longer labels,
so the two never count the same answer twice. Only the trie's inner nodes need
logits; they go to the session as one tree that continues the prompt (on
llama.cpp, parallel sequences in the same batch as the prompt's new tokens), so
the labels take no decode step of their own. Probabilities are normalised over
the labels.

Rerank asks, for each document, whether it meets the query (Qwen3-Reranker's prompt,
``prompts.rerank_messages``) and reads the answer from the logits after the prompt:
the relevance is P(yes) against P(no), a logistic of their logits' difference. The
query comes before the document, so a task's documents share their prompt up to the
document and the slot reads that part once.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Callable

import numpy as np

from nodeagent.backends.session import TokenSession, common_prefix, log_softmax, prefill_tree
from nodeagent.config import default_of
from nodeagent.errors import BackendError, TaskFailed, TemplateError
from nodeagent.model_kinds import ModelKind
from nodeagent.tasks import copying, registry
from nodeagent.tasks.contracts import (
    ClassifyOutput,
    ClassifyTask,
    ErrorInfo,
    ExtractTask,
    RerankOutput,
    RerankTask,
    Result,
    Timings,
    TokenCounts,
)
from nodeagent.tasks.decoding.decoder import Decoded, DecodeSpec, decode
from nodeagent.tasks.field_logprobs import per_field
from nodeagent.tasks.prompts import (
    ANSWER_PREFIX,
    NEUTRAL_INPUTS,
    RERANK_ANSWERS,
    classify_messages,
    extract_messages,
    render_prompt,
    rerank_messages,
)
from nodeagent.tasks.schema import PreparedSchema, ValidationTimeout, prepare, validate_output

# An extraction whose output fails the final validation (what the decoder could not enforce) is repaired once
REPAIR_PROMPT = ("That JSON object breaks the JSON Schema at {problem}. Reply with the corrected JSON object only, "
                 "using only facts stated in the text.")


@dataclass
class _Trie:
    children: dict[int, "_Trie"] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # labels whose sequence ends here


class Runner:
    """What runs a task to its Result on one slot, whatever the model: the deadline, the time limit, ``stop``
    asked between steps, and the Result around the output. Each task type reaches its code through its hook
    (``registry.TaskTypeSpec.hook``), one public method here per kind of work: ``extract``, ``classify``,
    ``complete`` (a queued chat or text completion), ``embed``, ``rerank``. Each refuses by default, naming the
    model's kind; the runner of a kind overrides what it runs (``TaskRunner`` on a model that generates,
    ``tasks/embedding.py``'s ``EmbedRunner`` on one that embeds and ``RerankRunner`` on a reranker). A task field the kind does not read is said in the Result's notes
    (``TaskTypeSpec.unread``)."""

    kind = ModelKind.GENERATE  # the model's kind (ModelInfo.kind): which task types it runs

    def __init__(self, model: str | None = None, quant: str | None = None, backend: str | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.model, self.quant, self.backend = model, quant, backend
        self.clock, self.now = clock, now
        self._stop: Callable[[], ErrorInfo | None] | None = None
        self._limit: tuple[float, float] | None = None  # (deadline on self.clock, the limit in seconds)
        self._progress: Callable[[dict[str, Any]], None] | None = None
        self._field_logprobs: dict[str, float] | None = None  # the last extraction's (``tasks/field_logprobs.py``)

    def run(self, task: Any, queue_wait_s: float = 0.0, attempt: int = 1,
            stop: Callable[[], ErrorInfo | None] | None = None, timeout_s: float | None = None,
            progress: Callable[[dict[str, Any]], None] | None = None) -> Result:
        """Run one task. ``stop`` is asked between tokens (and before the labels are scored): an ErrorInfo it
        returns ends the task with that error (a cancelled task, a lost lease, a drain); no partial output.
        ``timeout_s``: the task's time limit, checked between tokens and bounding the final validation
        (``timeout``). ``progress``: told how a queued OpenAI request goes, piece by piece (a gateway streams it)."""
        started = self.clock()
        self.limits(stop, timeout_s)
        self._progress = progress
        notes: list[str] = []
        timing = {"prompt_s": 0.0, "generation_s": 0.0}
        counts = {"prompt": 0, "generated": 0}
        self._field_logprobs = None
        try:
            if task.deadline is not None and self.now() >= task.deadline:
                raise TaskFailed("deadline_exceeded", "the deadline passed before the task started", False)
            spec = registry.of(task)
            if not registry.runs(task.type, self.kind):
                raise self.refusal(task.type)
            output = spec.hook(self, task, notes, timing, counts)
            notes += [f"{name}: {why}" for name, why in spec.unread.get(self.kind, {}).items()
                      if getattr(task, name) not in (None, type(task).model_fields[name].default)]
            status, error = "ok", None
        except TaskFailed as exc:
            output, status, error = None, "error", exc.info
        except BackendError as exc:  # the model failed under the task: another attempt may succeed
            output, status, error = None, "error", ErrorInfo(code="backend_error", message=str(exc), retryable=True)
        return Result(task_id=task.id, type=task.type, status=status, output=output, error=error,
                      model=self.model, quant=self.quant, backend=self.backend,
                      timings=Timings(queue_wait_s=queue_wait_s, total_s=self.clock() - started, **timing),
                      tokens=TokenCounts(**counts), attempts=attempt, notes=notes,
                      field_logprobs=self._field_logprobs if status == "ok" else None)

    def refusal(self, task_type: str) -> TaskFailed:
        """Why this model cannot run a task of ``task_type``: its kind does not do that work."""
        return wrong_kind(self.model, self.kind, task_type)

    # -- the hooks: each refuses unless the runner of the model's kind runs that work -------------------------
    def extract(self, task: Any, notes: list[str], timing: dict, counts: dict) -> Any:
        raise self.refusal(task.type)

    def classify(self, task: Any, notes: list[str], timing: dict, counts: dict) -> Any:
        raise self.refusal(task.type)

    def complete(self, kind: str, task: Any, notes: list[str], timing: dict, counts: dict) -> Any:
        """A queued OpenAI request (``kind``: chat or completion)."""
        raise self.refusal(task.type)

    def embed(self, task: Any, notes: list[str], timing: dict, counts: dict) -> Any:
        raise self.refusal(task.type)

    def rerank(self, task: Any, notes: list[str], timing: dict, counts: dict) -> Any:
        raise self.refusal(task.type)

    def limits(self, stop: Callable[[], ErrorInfo | None] | None, timeout_s: float | None) -> None:
        """What stops the work that follows: ``stop`` asked between tokens, and the time limit (validation
        included)."""
        self._stop = stop
        self._limit = (self.clock() + timeout_s, timeout_s) if timeout_s is not None else None

    def check_stop(self, task: Any, where: str) -> None:
        if task is not None and task.deadline is not None and self.now() >= task.deadline:
            raise TaskFailed("deadline_exceeded", f"the deadline passed {where}; no partial result is returned",
                             False)
        why = self._stop() if self._stop is not None else None
        if why is not None:
            raise TaskFailed(why.code, f"{why.message} ({where})", why.retryable)
        if self._limit is not None and self.clock() > self._limit[0]:
            raise TaskFailed("timeout", f"the task ran past its {self._limit[1]:g} s limit ({where})", False)


def wrong_kind(model: str | None, kind: ModelKind | str, task_type: str) -> TaskFailed:
    """A task a model of this kind does not do: an embedding model asked to generate, a generator to embed; the
    kinds that do it are the task type's (``registry``)."""
    name, kind = model or "this model", ModelKind(kind)
    spec = registry.BY_NAME.get(task_type)
    kinds = spec.kinds if spec is not None else frozenset({ModelKind.GENERATE})
    needs = " or ".join(what for k, what in (
        (ModelKind.EMBED, "an embedding model (a sentence-embedding GGUF, e.g. all-minilm-l6-v2)"),
        (ModelKind.RERANK, "a reranker (a cross-encoder GGUF, pooling rank)"),
        (ModelKind.GENERATE, "a model that generates")) if k in kinds)
    if kind.generates:
        return TaskFailed("wrong_model_kind", f"{name} generates text and embeds nothing: {task_type} needs {needs}",
                          False)
    return TaskFailed("wrong_model_kind", f"{name} {kind.described}; {task_type} needs {needs}", False)


class TaskRunner(Runner):
    """Tasks on a model that generates (a ``TokenSession``): extraction under a grammar, classification by label
    scoring, queued chat and text completions."""

    def __init__(self, session: TokenSession, model: str | None = None, quant: str | None = None,
                 backend: str | None = None, clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 max_string_chars: int | None = default_of("max_string_chars"),
                 max_array_items: int | None = default_of("max_array_items"),
                 decoding: DecodeSpec | None = None) -> None:
        """``decoding``: how this runner decodes (``DecodeSpec``'s ``fast_forward``, ``draft_tokens``, ``fresh``:
        a deterministic runner reads every prompt afresh, no cells of an earlier task reused); each decode adds
        its own budget and options (``spec``)."""
        super().__init__(model, quant, backend, clock, now)
        self.session = session
        self.max_string_chars, self.max_array_items = max_string_chars, max_array_items
        self.decoding = decoding or DecodeSpec(fast_forward=default_of("fast_forward"))
        self.drafts: deque[tuple[int, int]] = deque(maxlen=4096)  # the latest drafts: (their tokens, kept)
        self.steps = 0  # model steps after the prompts, all decodes together
        self._neutral: dict[tuple, dict[str, float]] = {}

    def prompt_tokens(self, messages: list[dict[str, Any]], notes: list[str],
                       extra: dict[str, Any] | None = None, suffix: str = "") -> list[int]:
        """The rendered prompt's tokens (``suffix``: the start of the answer, after the generation prompt)."""
        try:
            rendered = render_prompt(self.session, messages, extra)
        except TemplateError as exc:
            raise TaskFailed("template_error", str(exc), False) from None
        if rendered.fallback and rendered.fallback.note not in notes:
            notes.append(rendered.fallback.note)
        return self.session.tokenize(rendered.text + suffix)

    def _check_fits(self, n_prompt: int, reserve: int) -> None:
        ctx = self.session.ctx_per_slot
        if n_prompt + reserve > ctx:
            raise TaskFailed("input_too_long", f"the prompt is {n_prompt} tokens and the answer needs at least "
                                               f"{reserve} more, but the context holds {ctx}", False)

    def validate(self, schema: dict[str, Any], value: Any) -> str | None:
        """The final validation, bounded by what is left of the task's limit."""
        left = None if self._limit is None else self._limit[0] - self.clock()
        try:
            return validate_output(schema, value, left)
        except ValidationTimeout as exc:
            limit = f"its {self._limit[1]:g} s limit" if self._limit is not None else "the validation's bound"
            raise TaskFailed("timeout", f"the task ran past {limit} validating its output: {exc}", False) from None

    # -- extraction -------------------------------------------------------------------------------
    def extract(self, task: ExtractTask, notes: list[str], timing: dict, counts: dict) -> dict:
        messages = extract_messages(task)
        prepared = prepare(task.json_schema, self.max_string_chars, self.max_array_items)
        notes.extend(n for n in prepared.relaxations if n not in notes)  # what the decoder left to the validator
        copies = copying.choose(task.json_schema, task.copy_mode or copying.DEFAULT, asked=task.copy_mode is not None)
        if copies.note and copies.note not in notes:
            notes.append(copies.note)
        grammar = None
        if copies.fields:
            grammar, why = copying.grammar(prepared.decoder_schema, copies, task.input)
            notes.extend(n for n in why if n not in notes)
        text = self._decode_object(task, messages, prepared, notes, timing, counts, grammar)
        value, problem = self.checked(text, task.json_schema)
        if problem is None:
            return value
        # one repair: the model reads its own output and the validator's objection, and writes the object again
        # under the same grammar (what the decoder enforces cannot break; what it left to the validator may)
        repair = [*messages, {"role": "assistant", "content": text},
                  {"role": "user", "content": REPAIR_PROMPT.format(problem=problem)}]
        fixed, again = self.checked(self._decode_object(task, repair, prepared, notes, timing, counts, grammar),
                                     task.json_schema)
        if again is not None:
            raise TaskFailed("invalid_output", f"the output breaks the schema at {again} (the first output at "
                                               f"{problem}, then one repair); nothing is returned", False)
        notes.append(f"repaired once: the first output broke the schema at {problem}")
        return fixed

    def _decode_object(self, task: ExtractTask, messages: list[dict[str, str]], prepared: PreparedSchema,
                       notes: list[str], timing: dict, counts: dict, grammar: str | None = None) -> str:
        """One constrained decode of the object: its text (``grammar``: one with copied fields in place of the
        schema's own)."""
        prompt = self.prompt_tokens(messages, notes)
        counts["prompt"] = len(prompt)
        self._check_fits(len(prompt), 2)
        try:
            matcher = self.matcher(grammar or prepared.grammar())
        except TaskFailed:
            loose = prepared.loose_grammar()
            if loose is None:
                raise
            matcher = self.matcher(loose)  # a pattern the length bound could not be intersected with
            if prepared.loose_note and prepared.loose_note not in notes:
                notes.append(prepared.loose_note)
        spec = self.spec(self.session.ctx_per_slot - len(prompt), value_logprobs=True)
        decoded = self.decode(prompt, matcher, spec, timing, lambda n: self.check_stop(task, f"after {n} generated "
                                                                                            "tokens"))
        out = decoded.tokens
        counts["generated"] = counts.get("generated", 0) + len(out)
        if decoded.finish == "length":
            ending = self.session.detokenize(out[-16:])
            raise TaskFailed("output_truncated", f"the object did not close within the {len(out)} tokens left "
                                                 f"in the context of {self.session.ctx_per_slot} (it ended with "
                                                 f"{ending!r})", False)
        self._field_logprobs = per_field([self.session.token_bytes(t) for t in out], decoded.token_logprobs)
        return self.session.detokenize(out)

    def checked(self, text: str, schema: dict[str, Any]) -> tuple[Any, str | None]:
        """The output's value, and where it breaks the schema (None: it matches; text that is not JSON breaks
        it at the root). Every output of a schema goes through here: extraction's and chat's alike."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"(root): not JSON ({exc.msg})"
        return value, self.validate(schema, value)

    def matcher(self, grammar: str) -> Any:
        import llguidance

        matcher = llguidance.LLMatcher(self.session.lltokenizer(), grammar)
        if matcher.is_error():
            raise TaskFailed("schema_unsupported", matcher.get_error(), False)
        return matcher

    def spec(self, max_tokens: int, **options: Any) -> DecodeSpec:
        """A decode's options: this runner's (``decoding``) with the caller's budget and options (``DecodeSpec``'s
        fields)."""
        return replace(self.decoding, max_tokens=max_tokens, **options)

    def decode(self, prompt: list[int], matcher: Any, spec: DecodeSpec, timing: dict, check: Callable[[int], None],
               on_token: Callable[[list[int]], None] | None = None,
               after_prefill: Callable[[], None] | None = None) -> Decoded:
        """Generate on this runner's session (``tasks/decoding/``), counting its drafts and model steps."""
        d = decode(self.session, prompt, matcher, spec, timing, check, self.clock, on_token, after_prefill)
        self.drafts.extend(d.drafts)
        self.steps += d.steps
        return d

    # -- OpenAI's requests, queued (chat.v1, completion.v1) ---------------------------------------
    def complete(self, kind: str, task: Any, notes: list[str], timing: dict, counts: dict) -> dict[str, Any]:
        """A queued chat or text completion (chat.v1, completion.v1): the request as the door's ``CompletionSpec``
        (its budget, when it gives none, what the context leaves up to NODEAGENT_MAX_TOKENS: the door checked its
        limits), its ``n`` choices in turn on this slot; the body the route answers. The progress (``Progress``:
        the task's log) gets each event on the wire as it comes, and says what earlier attempts of a stream
        sent."""
        from nodeagent.tasks import events
        from nodeagent.tasks.openai.bodies import model_id
        from nodeagent.tasks.openai.engine import complete
        from nodeagent.tasks.openai.requests import queued_request
        from nodeagent.tasks.openai.spec import CompletionSpec, Limits

        started = self.clock()
        try:
            spec = CompletionSpec.of(kind, queued_request(kind, task.request), Limits(default_of("max_tokens")))
        except ValueError as exc:
            raise TaskFailed("invalid_request", str(exc), False) from None
        progress = self._progress
        sink = None if progress is None else lambda e: progress(e.to_wire())
        resume = progress.resume if isinstance(progress, events.Progress) else None
        finished = complete([self], spec, sink, model_id(str(self.model or "")), resume)
        notes += [n for n in finished.notes if n not in notes]
        usage = finished.body["usage"]
        counts["prompt"], counts["generated"] = usage["prompt_tokens"], usage["completion_tokens"]
        timing["generation_s"] = self.clock() - started
        return finished.body

    # -- rerank ---------------------------------------------------------------------------------------
    def rerank(self, task: RerankTask, notes: list[str], timing: dict, counts: dict) -> RerankOutput:
        """Each document's P(yes) that it meets the query, from the logits after its prompt (``rerank_messages``).
        The prompt up to the document (the head: the same for every document of the query) is read once, afresh,
        and each document's rest in a batch of its own after it: a document's score depends on the query and the
        document alone, never on what the slot read before nor on the documents' order (llama.cpp's logits move
        with how a prompt is split into batches: one SmolLM2 prompt split five ways gave P(yes) 0.74 to 0.79)."""
        s = self.session
        yes, no = (s.tokenize_continuation(word)[0] for word in RERANK_ANSWERS)
        head, prompts = self.rerank_prompts(task, notes)
        ctx = s.ctx_per_slot
        for i, prompt in enumerate(prompts):
            if len(prompt) >= ctx:
                raise TaskFailed("input_too_long", f"document {i}'s prompt is {len(prompt)} tokens, and the context "
                                                   f"holds {ctx} with the answer: shorten it or split it", False)
        self.check_stop(task, "before reading the query")
        t0 = self.clock()
        s.truncate(0)
        s.eval(head)
        scores = []
        for i, prompt in enumerate(prompts):
            self.check_stop(task, f"before document {i}")
            cut = min(common_prefix(head, prompt), len(prompt) - 1)
            s.truncate(cut)
            after = s.eval(prompt[cut:])
            scores.append(yes_probability(float(after[yes]), float(after[no])))
        timing["prompt_s"] = timing.get("prompt_s", 0.0) + self.clock() - t0
        counts["prompt"] = sum(map(len, prompts))
        notes.append("ranked by the model's answer: each document's P(yes) against P(no) that it meets the query "
                     "(Qwen3-Reranker's prompt)")
        return RerankOutput.ranked(scores, task.top_n)

    def rerank_prompts(self, task: RerankTask, notes: list[str]) -> tuple[list[int], list[list[int]]]:
        """The head (the tokens every document's prompt of this query starts with: where prompts of an empty and of
        two one-character documents part, so it does not depend on the task's documents) and each document's
        prompt."""
        probes = [self.prompt_tokens(rerank_messages(task, d), notes) for d in ("", "a", "1")]
        head = probes[0][:min(common_prefix(probes[0], p) for p in probes[1:])]
        return head, [self.prompt_tokens(rerank_messages(task, d), notes) for d in task.documents]

    # -- classification ---------------------------------------------------------------------------
    def classify(self, task: ClassifyTask, notes: list[str], timing: dict, counts: dict) -> ClassifyOutput:
        names = [lb.name for lb in task.labels]
        probs = _probabilities(self._label_scores(task, task.input, notes, timing, counts), task.length_norm)
        if calibrates(task):
            probs = calibrated(probs, self._neutral_probs(task, notes))
        own = dict(zip(names, map(float, probs)))
        top = names[int(np.argmax(probs))]
        if not task.multi_label:
            return ClassifyOutput(label=top, probabilities=own)
        # multi-label: every label whose probability reaches the threshold. The probabilities are single-label's
        # (calibrated the same way): they share the answer, so a text's labels split it and above a threshold of
        # a half at most one passes. Per-label forms that do not sum to 1 were measured against them
        # (docs/typed-tasks.md, Classification): calibrated no better (worse on Gemma 3), they passed more wrong
        # labels than right ones.
        at = threshold(task)
        return ClassifyOutput(label=top, labels=[n for n in names if own[n] >= at], probabilities=own)

    def _neutral_probs(self, task: ClassifyTask, notes: list[str]) -> np.ndarray:
        """The labels' probabilities for content-free inputs under the task's prompt, averaged over
        ``NEUTRAL_INPUTS`` (cached per prompt: the labels, the instructions, the examples, the answer form)."""
        key = task.model_dump_json(include={"labels", "instructions", "examples", "answer", "length_norm"})
        if key not in self._neutral:
            self._neutral[key] = np.mean([_probabilities(self._label_scores(task, text, notes, {}, {}),
                                                         task.length_norm) for text in NEUTRAL_INPUTS], axis=0)
        return self._neutral[key]

    def _label_scores(self, task: ClassifyTask, text: str, notes: list[str], timing: dict,
                      counts: dict) -> dict[str, tuple[float, int]]:
        """For every label, log P(the answer is that label) given ``text`` under the task's prompt, and the
        number of token choices it took. A bare answer is the label; a JSON answer continues the prefix the
        JSON route writes with the label as JSON string content (escaped). Either ends where the label does
        (see _Trie): a closing quote would cost every label one more level of the tree, and the trie already
        keeps a label apart from the longer labels it begins."""
        s = self.session
        json_answer = task.answer == "json"
        prompt = self.prompt_tokens(classify_messages(task, text), notes, suffix=ANSWER_PREFIX if json_answer else "")
        counts["prompt"] = len(prompt)
        seqs = {lb.name: s.tokenize_continuation(json.dumps(lb.name, ensure_ascii=False)[1:-1] if json_answer
                                                 else lb.name) for lb in task.labels}
        self._check_fits(len(prompt), max(len(v) for v in seqs.values()))
        root = _Trie()
        for name, seq in seqs.items():
            node = root
            for tok in seq:
                node = node.children.setdefault(tok, _Trie())
            node.labels.append(name)
        # the nodes whose logits are needed (every trie node with children), parents before children
        parents: list[int] = []
        tokens: list[int] = []
        index: dict[int, int] = {}

        def collect(node: _Trie, parent: int) -> None:
            for tok, child in node.children.items():
                if child.children:
                    index[id(child)] = len(tokens)
                    parents.append(parent)
                    tokens.append(tok)
                    collect(child, len(tokens) - 1)

        collect(root, -1)
        self.check_stop(task, "before scoring labels")
        t0 = self.clock()
        if self.decoding.fresh:
            s.truncate(0)
        # the prompt and the inner nodes together (on llama.cpp one batch: the labels take no step of their own),
        # so the prompt's time holds the labels' evaluation; the generation's is what reads their scores
        after, inner = prefill_tree(s, prompt, parents, tokens)
        t1 = self.clock()
        timing["prompt_s"] = timing.get("prompt_s", 0.0) + t1 - t0
        first = log_softmax(after)
        branch = [log_softmax(x) for x in inner]
        scores: dict[str, tuple[float, int]] = {}

        def walk(node: _Trie, logp: np.ndarray, acc: float, depth: int) -> None:
            for tok, child in node.children.items():
                total = acc + float(logp[tok])
                if child.children:
                    child_logp = branch[index[id(child)]]
                    # a label that is a prefix of others ends here: the answer stops being any longer label
                    onward = float(np.exp(child_logp[list(child.children)]).sum())
                    for name in child.labels:
                        scores[name] = (total + float(np.log(max(1.0 - onward, 1e-30))), depth + 2)
                    walk(child, child_logp, total, depth + 1)
                else:
                    for name in child.labels:
                        scores[name] = (total, depth + 1)

        walk(root, first, 0.0, 0)
        timing["generation_s"] = timing.get("generation_s", 0.0) + self.clock() - t1
        counts["generated"] = counts.get("generated", 0) + len(tokens)
        return {name: scores[name] for name in seqs}


def yes_probability(yes_logit: float, no_logit: float) -> float:
    """P(yes) of the two answers alone: a logistic of their logits' difference (softmax over the pair)."""
    d = yes_logit - no_logit
    return float(1.0 / (1.0 + np.exp(-d)) if d >= 0 else np.exp(d) / (1.0 + np.exp(d)))


def calibrates(task: ClassifyTask) -> bool:
    """Whether the task's probabilities are calibrated against content-free inputs (``auto`` resolved).
    ``auto`` is calibrated, as benchmarks/tasks.py measured (docs/typed-tasks.md, Classification): with the JSON answer,
    calibration gained accuracy on 5 of 6 model/set pairs (2, 3 and 5 labels) and lost 0.9 points, within one
    standard error, on the sixth, and it at least halved the top label's calibration error on all 6. ``auto``
    stays a value of its own so that a later measurement can narrow it without changing what ``true`` means."""
    return True if task.calibrate == "auto" else task.calibrate


def threshold(task: ClassifyTask) -> float:
    """The probability at which multi-label chooses a label (``auto`` resolved): 1 / K of K labels, the share
    each gets when the prompt favours none, so a label is chosen when the text gives it at least that. The
    probabilities share the answer (they sum to 1), so a fixed threshold of a half would pass one label at
    most; on texts of one and of two labels among 5 (docs/typed-tasks.md, Classification) 1 / K found both labels of a
    two-label text about a quarter of the time, a half never."""
    return 1.0 / len(task.labels) if task.threshold == "auto" else task.threshold


def calibrated(probs: np.ndarray, neutral: np.ndarray) -> np.ndarray:
    """Contextual calibration: each probability divided by the label's probability for content-free inputs,
    renormalised (a label the prompt favours whatever the text loses exactly that favour)."""
    ratio = probs / np.maximum(neutral, 1e-30)
    return ratio / ratio.sum()


def _probabilities(scores: dict[str, tuple[float, int]], length_norm: bool) -> np.ndarray:
    """The labels' probabilities, normalised over the labels, from their log-probabilities (``length_norm``:
    divided by their token counts first, a mean per token)."""
    return _normalised({name: logp / n if length_norm else logp for name, (logp, n) in scores.items()})


def _normalised(raw: dict[str, float]) -> np.ndarray:
    values = np.array(list(raw.values()))
    probs = np.exp(values - values.max())
    return probs / probs.sum()
