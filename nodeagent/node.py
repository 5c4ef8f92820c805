"""The node core: one road from settings to a Result, which every door (CLI, worker, server, benchmarks) takes.

    settings (NodeConfig) -> device (hardware + profile) -> plan -> backend.load(plan) -> run(task) -> Result

It is also the Python API for orchestrators that embed a node in-process::

    from nodeagent import Node

    with Node(model="smollm2-135m-instruct") as node:
        print(node.plan.settings.n_ctx)
        print(node.classify("The food was cold.", ["positive", "negative"]).output.label)
        print(node.extract("Alice is 34.", {"type": "object", "properties": {"age": {"type": "integer"}}}).output)

A Node loads its model on first use and frees it on ``close()`` (or leaving the ``with`` block).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from pydantic import ValidationError

from nodeagent import config as cfgmod
from nodeagent.backends.base import Backend, LoadedModel, backend_for, backend_name_for, planner_for, reader_for
from nodeagent.backends.prefix_store import PrefixTally
from nodeagent.config import NodeConfig
from nodeagent.errors import InputError, NotFoundError, UsageError, validation_message
from nodeagent.hardware import HardwareInfo, probe
from nodeagent.hardware.system import RecordedSystem, SystemSource
from nodeagent.model_kinds import ModelKind
from nodeagent.planner.types import Plan, Requirements, TaskType
from nodeagent.procmem import process_memory
from nodeagent.profiles import DeviceProfile, ProfileMatch, check_match, get_profile, match_profile
from nodeagent.tasks import registry
from nodeagent.tasks.contracts import AnyTask, ClassifyTask, ErrorInfo, Result
from nodeagent.units import format_bytes
from nodeagent.values import Frozen

if TYPE_CHECKING:
    from nodeagent.tasks.events import Event, Finished
    from nodeagent.tasks.openai.spec import CompletionSpec

log = logging.getLogger(__name__)



class Device(Frozen):
    """The machine a plan is made for: this one, or a freshly booted device of a named profile."""

    hardware: HardwareInfo
    profile: DeviceProfile
    match: ProfileMatch
    here: bool  # the machine nodeagent runs on (False: a profile's nominal device)
    overhead_bytes: int | None = None  # the process before any model; None: measured here when planning
    note: str | None = None


def resolve_device(config: NodeConfig, system: SystemSource | None = None) -> Device:
    """The device of this configuration. ``--profile P`` plans for P: this machine when it is a P, else a
    freshly booted P (its RAM, GPU budget, threads and process overhead, not this host's)."""
    fixture = config.hardware_fixture
    if system is None and fixture:
        system = RecordedSystem.load(fixture)
    hw = probe(system, disk_path=str(config.model_dir), state_dir=config.state_dir)
    if not config.profile:
        match = match_profile(hw)
        return _ledgered(Device(hardware=hw, profile=get_profile(match.profile_id), match=match, here=True), config)
    profile = get_profile(config.profile)
    ok, why = check_match(profile, hw)
    match = ProfileMatch(profile_id=profile.id, reasons=["chosen with --profile/NODEAGENT_PROFILE", *why], score=0)
    if ok:
        return _ledgered(Device(hardware=hw, profile=profile, match=match, here=True), config)
    nominal = profile.nominal_hardware()
    return Device(hardware=nominal, profile=profile, match=match, here=False,
                  overhead_bytes=profile.nominal_overhead_bytes(),
                  note=f"planned for a freshly booted {profile.id} ({format_bytes(nominal.ram_total_bytes)} of RAM, "
                       f"all of it available), not for this machine")


def _ledgered(device: Device, config: NodeConfig) -> Device:
    """This machine less what the host's other nodeagent processes reserved (``ledger.py``): the memory their
    loaded models' plans promised is not this one's to plan with, resident yet or not."""
    from nodeagent.ledger import Ledger

    if config.hardware_fixture:  # a recorded machine: no process of it is here
        return device
    host, _ = Ledger(config.state_dir).others()
    if not host:
        return device
    hw = device.hardware
    left = max(0, min(hw.ram_available_bytes, hw.ram_total_bytes - host))
    return device.model_copy(update={
        "hardware": hw.model_copy(update={"ram_available_bytes": left}),
        "note": f"{format_bytes(host)} reserved by other nodeagent processes on this host (the ledger): planned "
                f"against the {format_bytes(left)} left"})


def measured_overhead_bytes(kind: str) -> int:
    """This process's memory with the backend's runtime imported: what serving costs before any model."""
    if kind != "fake":
        backend_for(kind).available()  # importing loads the native libraries we want counted
    return process_memory().rss_bytes


def plan_for(spec: str, device: Device, config: NodeConfig, task: TaskType | None = None, quant: str | None = None,
             overhead: Callable[[str], int] = measured_overhead_bytes, **extra: Any) -> Plan:
    """Plan model ``spec`` for ``device`` with the settings the user fixed in ``config`` (and ``extra``
    planner requirements: swa_full, allow_ctx_over_trained, allow_ctx_over_profile), through the backend
    registry: the backend that claims the spec reads what its planner needs, and its pure planner plans."""
    kind = backend_name_for(spec)
    fixed = config.plan_settings()
    deterministic = config.deterministic and "slots" not in fixed
    if deterministic:  # each task decoded alone: batch shapes that vary with other tasks change the numbers
        fixed["slots"] = 1
    req = Requirements(task=task, **fixed, **{k: v for k, v in extra.items() if v is not None})
    info, notes = reader_for(kind)(spec, config, quant)
    overhead_bytes = device.overhead_bytes if device.overhead_bytes is not None else overhead(kind)
    result = planner_for(kind)(info, device.hardware, device.profile, req, overhead_bytes)
    drafts, said_drafts = draft_length(config, device, kind, Path(result.model).name) \
        if result.settings.pooling is None else (0, None)  # an embedding model decodes nothing: no drafts
    if drafts and result.settings.n_outputs_max < (drafts + 1) * result.settings.slots:  # a logits row per token
        req = req.model_copy(update={"n_outputs_max": (drafts + 1) * result.settings.slots})
        result = planner_for(kind)(info, device.hardware, device.profile, req, overhead_bytes)
    result = result.model_copy(update={"draft_tokens": drafts})
    fell_back = [f"profile {device.profile.id}: {device.match.fell_back}"] if device.match.fell_back else []
    reasons = fell_back + ([device.note] if device.note else []) + notes + \
        (["slots 1: NODEAGENT_DETERMINISTIC (each task decoded alone, every prompt read afresh)"] if deterministic
         else [])
    if device.here and "slots" in fixed:  # a slot count `nodeagent bench --apply` chose here: its measurement
        from nodeagent.store.measured import measured_reason

        said = measured_reason(config.state_dir, result.model, result.settings.slots)
        reasons += [said] if said else []
    if said_drafts and task != "classify":
        reasons.append(said_drafts)
    if device.here:  # what bench measured of the model here: an embedding model's rate, a warm prefix's restore
        from nodeagent.store.measured import measured_embeddings, measured_prefix

        said = (measured_embeddings if result.settings.pooling is not None else measured_prefix)(config.state_dir,
                                                                                                 result.model)
        reasons += [said] if said else []
    if task is not None:  # what the project measured of the task's default on this model file, if it did
        from nodeagent.tasks.measured_defaults import plan_reason

        said = plan_reason(Path(result.model).name, task)
        reasons += [said] if said else []
    return result.model_copy(update={"reasons": [*reasons, *result.reasons]}) if reasons else result


def draft_length(config: NodeConfig, device: Device, kind: str, model_file: str) -> tuple[int, str | None]:
    """The longest draft from the input a step verifies, and the plan's reason: the setting where it is set, else
    what `nodeagent bench` measured pays on this device for the model file (``store/measured.py``), else none.
    llama.cpp's slots verify drafts; the other backends' sessions do not."""
    if kind != "llamacpp":
        return 0, None
    if config.draft_tokens is not None:
        return config.draft_tokens, (f"drafts from the input: up to {config.draft_tokens} tokens a step "
                                     "(NODEAGENT_DRAFT_TOKENS)" if config.draft_tokens else
                                     "drafts from the input: off (NODEAGENT_DRAFT_TOKENS=0)")
    if device.here:
        from nodeagent.store.measured import measured_drafts

        measured = measured_drafts(config.state_dir, model_file)
        if measured is not None:
            return measured
    return 0, ("drafts from the input: off until `nodeagent bench` measures whether they pay on this device for "
               "this model")


def output_budget_tokens(task: AnyTask, max_string_chars: int) -> int:
    """What a task's answer may take, for sizing a one-shot context: a label's few tokens, or for an object
    16 tokens a schema node plus a quarter token a character of its strings' bounds, within 256-4096."""
    if isinstance(task, ClassifyTask):
        return 16
    from nodeagent.tasks.schema import subschemas

    nodes = list(subschemas(task.json_schema))
    chars = sum(min(sub.get("maxLength", max_string_chars), max_string_chars) for sub, _ in nodes
                if sub.get("type") == "string")
    return max(256, min(4096, 16 * len(nodes) + chars // 4))


def prompt_tokens(plan: Plan, task: AnyTask) -> int | None:
    """The task's prompt in tokens through the model's template, without loading the weights (None where the
    plan's backend cannot tell)."""
    from nodeagent.tasks.prompts import render_prompt

    messages = registry.of(task).messages(task)
    return backend_for(plan.backend).prompt_tokens(
        plan.model, lambda session: len(session.tokenize(render_prompt(session, messages).text)))


def make_task(kind: str, **fields: Any) -> AnyTask:
    """A task of this type (a kind or a type name) from its fields; an invalid one is a one-line UsageError
    naming the field."""
    try:
        return registry.make(kind, **fields)
    except ValidationError as exc:
        raise UsageError(f"invalid task: {validation_message(exc)}") from None


@dataclass(frozen=True)
class ChatAnswer:
    text: str
    finish: str
    prompt_tokens: int
    completion_tokens: int


class Node:
    """A model on this device: planned from the settings, loaded on first use, running typed tasks.

    ``model``: a catalog name, a .gguf file, a hub repository, an mlx-lm directory, or ``fake[:options]``.
    ``profile``: plan for this device profile (see ``nodeagent profiles``) instead of the matched one.
    ``task``: the task type the plan is sized for (its context; label branches batched for classify).
    ``settings``: any setting of ``nodeagent config show`` (ctx_tokens, type_k, slots, threads, ...), meaning
    what the flag or variable of the same name means. ``device``: a Device already resolved for this config.
    """

    def __init__(self, model: str | None = None, *, profile: str | None = None, task: TaskType | None = None,
                 quant: str | None = None, config: NodeConfig | None = None, env: Mapping[str, str] | None = None,
                 system: SystemSource | None = None, backend: Backend | None = None, device: Device | None = None,
                 allow_ctx_over_trained: bool = False, allow_ctx_over_profile: bool = False,
                 swa_full: bool | None = None, note: str | None = None, **settings: Any) -> None:
        unknown = sorted(set(settings) - set(cfgmod.SETTINGS_BY_NAME))
        if unknown:
            raise UsageError(f"unknown setting {', '.join(unknown)}",
                             hint=f"known: {', '.join(cfgmod.SETTINGS_BY_NAME)}")
        base = config if config is not None else cfgmod.load(env=env)
        self.config = base.with_flags({"profile": profile, **settings})
        self.model, self.task_type, self.quant = model, task, quant
        self._system, self._backend = system, backend
        self._extra = {"allow_ctx_over_trained": allow_ctx_over_trained or None,
                       "allow_ctx_over_profile": allow_ctx_over_profile or None, "swa_full": swa_full}
        self._note = note  # said first in the plan's reasons (why a setting was chosen for this run)
        self._loaded: LoadedModel | None = None
        self._prefix_tally = PrefixTally()  # what its warm prefixes did, across its loads
        self._runners: list[Any] = []  # a TaskRunner per slot
        self._free: queue.LifoQueue[Any] = queue.LifoQueue()  # the runners no task holds
        self._lock = threading.RLock()  # loading and closing
        self._taking = threading.Lock()  # taking several slots at once
        if device is not None:  # already resolved by the caller (a door that probed once)
            self.__dict__["device"] = device

    # -- the road -----------------------------------------------------------------------------------
    @functools.cached_property
    def device(self) -> Device:
        return resolve_device(self.config, self._system)

    @functools.cached_property
    def plan(self) -> Plan:
        if not self.model:
            raise UsageError("no model given", hint="pass a model: a catalog name, a .gguf file or an mlx-lm "
                                                     "directory")
        p = plan_for(self.model, self.device, self.config, self.task_type, self.quant, **self._extra)
        return p.model_copy(update={"reasons": [self._note, *p.reasons]}) if self._note else p

    def sized_for(self, task: AnyTask) -> "Node | None":
        """A one-shot run's node: planned for this task's prompt and its answer's budget, when the planned
        context cannot hold them, the user fixed no context, and the model is a local file whose prompt can be
        counted without its weights; None when this node serves it as it is. The plan's reasons say so."""
        config = self.config
        if config.ctx_tokens or config.min_ctx_tokens or "://" in self.plan.model or not self.kind.generates:
            return None  # (an embedding model reads each input whole: its context is the longest it reads)
        prompt = prompt_tokens(self.plan, task)
        if prompt is None:
            return None
        need = prompt + output_budget_tokens(task, config.max_string_chars)
        if need <= min(self.device.profile.ctx_for_task(self.task_type), self.plan.settings.ctx_per_slot):
            return None  # the planned context holds it
        from nodeagent.modelfile import inspect_file

        trained = inspect_file(self.plan.model).context_length
        floor = min(need, trained) if trained else need
        return Node(self.model, config=config.with_flags({"min_ctx_tokens": floor}), device=self.device,
                    task=self.task_type, quant=self.quant,
                    note=f"context sized for this task: {need} tokens (its prompt and the answer's budget)"
                         + (f", held to the trained {trained}" if trained and need > trained else ""))

    def load(self) -> LoadedModel:
        """Load the plan (once); refuse one that does not fit, is not on this machine, or is for another device."""
        with self._lock:
            return self._load()

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    @property
    def fault(self) -> str | None:
        """Why the loaded model cannot serve as it is (a failure it could not be reset from), or None. It is loaded
        again before its next task; ``/readyz`` says so meanwhile."""
        loaded = self._loaded
        return None if loaded is None else loaded.fault()

    def prefix_store(self, wait_s: float = 0.0) -> Any:
        """The loaded model's prefixes kept on disk (``backends/prefix_store.PrefixStore``), or None: not loaded,
        not kept (NODEAGENT_PREFIX_CACHE_BYTES 0, a backend that cannot), or its key still being read (``wait_s``:
        how long to wait for it)."""
        deadline = time.monotonic() + wait_s
        while True:
            loaded = self._loaded
            store = None if loaded is None else loaded.prefix_store()
            if store is not None or time.monotonic() >= deadline:
                return store
            time.sleep(0.02)

    def prefix_usage(self) -> dict[str, Any] | None:
        """What the model's warm prefixes hold and did since this node started (``PrefixStore.usage``: held on
        disk, restores, the prefill seconds they saved), across its loads; None where none are kept (deterministic
        mode, NODEAGENT_PREFIX_CACHE_BYTES 0, a backend or a model kind that keeps none) or none was yet."""
        store = self.prefix_store()
        if store is not None:
            return store.usage()
        tally = self._prefix_tally.as_dict()
        return {"prefixes": None, "state_bytes": None, **tally, "top": []} if tally["restored"] or tally["written"] \
            else None  # (not loaded: what is on disk is not read)

    def _mend(self) -> None:
        """A model at fault loaded again, once the tasks on it end, before the next task runs on it."""
        if self.fault is None:
            return
        with self._lock:
            why = self.fault
            if why is not None:
                log.warning("%s cannot serve as it is (%s): loading it again", self.model or self.plan.model, why)
                self.close()
                self._ensure_runners()

    def _load(self) -> LoadedModel:
        if self._loaded is not None:
            return self._loaded
        self.check_loadable()
        p = self.plan
        backend = self._backend or backend_for(p.backend)
        self._loaded = backend.load(p)
        if not self.config.deterministic:  # (a state read back depends on what ran before: never so there)
            self._loaded.keep_prefixes(self.config.prefix_dir, self.config.prefix_cache_bytes, self.config.cache_dir,
                                       self._prefix_tally)
        self._ledger("reserve")
        return self._loaded

    def check_loadable(self) -> None:
        """Refuse a plan this machine cannot load (one for another device's profile, one that does not fit, a
        a model not on this machine), with the one-line error ``load`` raises for it, without loading
        anything: a door holding several models checks each at start, as it loads one model at start."""
        p = self.plan
        if not self.device.here:
            raise UsageError(f"the plan is for profile {p.profile}, not this machine, so it cannot be loaded here",
                             hint="drop --profile to plan for this machine")
        if not p.fits:
            raise UsageError(f"{self.model} does not fit this machine: {p.reasons[-1]}",
                             hint=f"see 'nodeagent plan {self.model}'")
        if "://" in p.model:  # hf:// or pypi://: planned from a header or the recorded facts
            raise NotFoundError(f"{self.model} is not on this machine", hint=f"run 'nodeagent pull {self.model}'")

    def _ledger(self, what: str) -> None:
        """The host's ledger of planned memory: reserve this model's plan while it is loaded, release it after."""
        from nodeagent.ledger import Ledger

        if self.config.hardware_fixture:
            return
        key, m = str(self.model or self.plan.model), self.plan.memory
        try:
            ledger = Ledger(self.config.state_dir)
            ledger.reserve(key, m.host_bytes, m.gpu_bytes) if what == "reserve" else ledger.release(key)
        except OSError as exc:  # a state directory it cannot write: the node still serves, unledgered
            log.warning("the memory ledger could not %s %s: %s", what, key, exc)

    def run(self, task: AnyTask, *, queue_wait_s: float = 0.0, attempt: int = 1,
            stop: Callable[[], ErrorInfo | None] | None = None, timeout_s: float | None = None,
            model: str | None = None, progress: Callable[[dict[str, Any]], None] | None = None) -> Result:
        """Run one task on the loaded model; failures are error Results, never exceptions. ``stop`` is asked
        between tokens: an ErrorInfo it returns ends the task with that error. ``timeout_s``: the task's time
        limit (default: NODEAGENT_TASK_TIMEOUT_S for its type), validation included. ``model``: the model the
        task was bound to (a node of one model was only given tasks for it; a ModelSet picks its member)."""
        problem = oversized(task, self.config.max_input_bytes)
        if problem is not None:
            return Result(task_id=task.id, type=task.type, status="error", attempts=attempt,
                          error=ErrorInfo(code="input_too_large", retryable=False, message=problem))
        limit = self.timeout_s(task.type) if timeout_s is None else timeout_s
        self._mend()
        with self.slot() as runner:
            return runner.run(task, queue_wait_s=queue_wait_s, attempt=attempt, stop=stop, timeout_s=limit,
                              progress=progress)

    def completion(self, spec: "CompletionSpec", sink: "Callable[[Event], None] | None" = None, *,
                   timeout_s: float | None = None, stop: Callable[[], ErrorInfo | None] | None = None) -> "Finished":
        """A chat or text completion (``tasks/openai/spec.py``'s ``CompletionSpec``) on as many slots as the node
        has up to its choices, held together (past them, the choices decode in turn on the same slots, which keep
        the prompt's cells): ``sink`` gets its events (``tasks/events.py``: Prepared, each Piece) as they come;
        the answer (``Finished``, OpenAI's body naming this node's model) is returned. Under the chat time limit
        unless ``timeout_s`` is given, every choice within it; ``stop`` is asked between tokens. Raises
        TaskFailed (before any event, for a request that cannot be served), or UsageError past NODEAGENT_MAX_N
        choices."""
        from nodeagent.tasks.openai.bodies import model_id
        from nodeagent.tasks.openai.engine import complete
        from nodeagent.tasks.runner import wrong_kind

        if not registry.runs(registry.get("chat").name, self.kind):
            raise wrong_kind(Path(self.plan.model).name, self.kind, "a chat or text completion")
        if spec.choices > self.config.max_n:
            raise UsageError(f"{spec.choices} choices are more than this node gives one request "
                             f"({self.config.max_n}, NODEAGENT_MAX_N)", hint="ask for fewer choices, or raise "
                                                                              "NODEAGENT_MAX_N")
        limit = self.timeout_s("chat") if timeout_s is None else timeout_s
        self._mend()
        with self.slots(min(spec.choices, self.slots_total)) as runners:
            for r in runners:
                r.limits(stop, limit)
            return complete(runners, spec, sink, model_id(str(self.model or self.plan.model)))

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 256, **sampling: Any) -> Any:
        """One greedy (or sampled) chat answer, for callers in Python and the benchmarks: its choice, with
        ``text``, ``finish`` and the token counts. Raises TaskFailed."""
        from nodeagent.tasks.decoding.sampling import Sampling
        from nodeagent.tasks.openai.spec import CompletionSpec

        done = self.completion(CompletionSpec("chat", max_tokens, Sampling(**sampling), messages=tuple(messages)))
        c, usage = done.body["choices"][0], done.body["usage"]
        return ChatAnswer(text=c["message"]["content"] or "", finish=c["finish_reason"],
                          prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"])

    def timeout_s(self, task_type: str) -> float:
        """The time limit of a task type, by its name or its kind (NODEAGENT_TASK_TIMEOUT_S: one for all, or
        per type, written either way)."""
        default, per_type = self.config.task_timeouts()
        spec = registry.BY_NAME.get(task_type)
        keys = [task_type, spec.role] if spec is not None else [task_type]
        own = spec.timeout_s if spec is not None and spec.timeout_s is not None else default
        return next((per_type[k] for k in keys if k in per_type), own)

    @property
    def adapt_threads(self) -> bool:
        """Whether decoding gives threads up while other processes hold cores: NODEAGENT_THREADS_ADAPT, unless
        the user fixed the threads (a fixed setting is honoured exactly) or asked for deterministic answers (a
        sum split over another number of threads rounds differently: measured, 1 of 6 extractions differed
        between 1 and 2 threads on SmolLM2)."""
        return self.config.threads_adapt and self.config.threads is None and not self.config.deterministic

    @property
    def slots_total(self) -> int:
        """Tasks this node runs at once: the loaded model's slots (the plan's, or 1 where the backend serves
        one at a time)."""
        return len(self._ensure_runners())

    @contextlib.contextmanager
    def slot(self) -> Iterator[Any]:
        """A free slot's TaskRunner, held for one task: waits while every slot is busy. Tasks on different slots
        run at once (llama.cpp decodes them in one batch)."""
        with self.slots(1) as runners:
            yield runners[0]

    @contextlib.contextmanager
    def slots(self, n: int) -> Iterator[list[Any]]:
        """``n`` free slots' TaskRunners held together (the choices of one completion); at most the node's."""
        if n > self.slots_total:
            raise UsageError(f"{n} choices need {n} slots at once, and this node has {self.slots_total}",
                             hint="ask for fewer, or plan more slots (--slots)")
        with self._taking:  # several at once, one such request at a time: two cannot each hold half
            runners = [self._free.get() for _ in range(n)]
        try:
            with contextlib.ExitStack() as held:
                for runner in runners:
                    hold = getattr(runner.session, "hold", None)
                    if hold is not None:
                        held.enter_context(hold())
                yield runners
        finally:
            for runner in runners:
                self._free.put(runner)

    def runner(self) -> Any:
        """The first slot's TaskRunner (for one caller at a time; ``slot()`` shares the slots)."""
        return self._ensure_runners()[0]

    @property
    def kind(self) -> ModelKind:
        """What the planned model does (``model_kinds.py``): generate, embed (an embedding model: embed.v1,
        classify.v1) or rerank (a reranker's GGUF, pooling rank: rerank.v1), from the pooling its
        header says (the plan carries it)."""
        return ModelKind.of_pooling(self.plan.settings.pooling)

    def _ensure_runners(self) -> list[Any]:
        with self._lock:
            if not self._runners:
                from nodeagent.tasks.decoding.decoder import DecodeSpec
                from nodeagent.tasks.runner import TaskRunner

                loaded = self.load()
                p = self.plan
                if not self.kind.generates:
                    self._runners = self._embed_runners(loaded)
                    for runner in reversed(self._runners):
                        self._free.put(runner)
                    return self._runners
                self._runners = [TaskRunner(session, model=Path(p.model).name, quant=p.quant, backend=loaded.name,
                                            max_string_chars=self.config.max_string_chars,
                                            max_array_items=self.config.max_array_items,
                                            decoding=DecodeSpec(fast_forward=self.config.fast_forward,
                                                                draft_tokens=p.draft_tokens,
                                                                fresh=self.config.deterministic))
                                 for session in loaded.sessions(adapt_threads=self.adapt_threads)]
                for runner in reversed(self._runners):
                    self._free.put(runner)
            return self._runners

    def _embed_runners(self, loaded: LoadedModel) -> list[Any]:
        """An embedding model's slots: tasks in flight sharing its forward batches, with the catalog's prefixes and
        Matryoshka sizes for the model (a reranker's: its pairs sharing them)."""
        from nodeagent.store.catalog import entry_for_file
        from nodeagent.tasks.embedding import EmbedRunner, RerankRunner

        p = self.plan
        if self.kind.ranks:
            return [RerankRunner(loaded.embedder(), model=Path(p.model).name, quant=p.quant, backend=loaded.name)
                    for _ in range(p.settings.slots)]
        entry = entry_for_file(Path(p.model).name) or entry_for_file(str(self.model or ""))
        prefixes = (entry.query_prefix, entry.document_prefix) if entry else ("", "")
        dims = tuple(entry.matryoshka_dims) if entry else ()
        embedder = loaded.embedder()
        return [EmbedRunner(embedder, model=Path(p.model).name, quant=p.quant, backend=loaded.name,
                            prefixes=prefixes, dims=dims) for _ in range(p.settings.slots)]

    def embed(self, texts: list[str] | str, *, dimensions: int | None = None, normalize: bool = True) -> Result:
        """A vector per text (``embed.v1`` on an embedding model): the Result's output is an EmbedOutput (its
        ``vectors()`` the floats)."""
        return self.run(make_task("embed", input=texts, dimensions=dimensions, normalize=normalize))

    def rerank(self, query: str, documents: list[str], *, top_n: int | None = None,
               instruction: str | None = None) -> Result:
        """The documents scored against the query, most relevant first (``rerank.v1`` on a reranker or a model that
        generates): the Result's output is a RerankOutput."""
        return self.run(make_task("rerank", query=query, documents=documents, top_n=top_n, instruction=instruction))

    def classify(self, text: str, labels: list[Any], *, multi_label: bool = False,
                 instructions: str | None = None, **options: Any) -> Result:
        """``options``: the task's other fields (threshold, examples, calibrate, answer, length_norm), each the
        task's default when left out."""
        return self.run(make_task("classify", input=text, labels=labels, multi_label=multi_label,
                                  instructions=instructions, **options))

    def extract(self, text: str, schema: dict[str, Any], *, instructions: str | None = None,
                examples: list[dict[str, Any]] | None = None) -> Result:
        return self.run(make_task("extract", input=text, schema=schema, instructions=instructions,
                                  examples=examples))

    def close(self) -> None:
        """Free the model (idempotent)."""
        with self._lock:
            for _ in self._runners:  # wait for the tasks running to finish
                self._free.get()
            self._runners = []
            if self._loaded is not None:
                self._loaded.close()
                self._loaded = None
                self._ledger("release")

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def oversized(task: AnyTask, limit_bytes: int) -> str | None:
    """Why a task is too large (each of its fields is bounded by NODEAGENT_MAX_INPUT_BYTES: the input, the
    instructions, the labels, the examples, the schema, a queued request), or None."""
    import json

    for name, value in task.model_dump(mode="json", by_alias=True, exclude=_BOOKKEEPING).items():
        size = len((value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)).encode("utf-8"))
        if size > limit_bytes:
            return f"the {name} is {size} bytes, over the limit of {limit_bytes} (NODEAGENT_MAX_INPUT_BYTES)"
    return None


_BOOKKEEPING = {"id", "type", "deadline", "idempotency_key", "created_at"}


def read_input(text: str | None, data: bytes | None, where: str, max_bytes: int) -> str:
    """Task input from a string, or bytes read from a file or stdin (bounded before it is decoded)."""
    if text is None:
        assert data is not None
        if len(data) > max_bytes:
            raise InputError(f"{where} is larger than {max_bytes} bytes", hint="raise NODEAGENT_MAX_INPUT_BYTES, "
                                                                              "or split the input")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InputError(f"{where} is not valid UTF-8 (byte {exc.start}: {exc.reason})",
                             hint="convert the text to UTF-8 first") from None
    elif len(text.encode("utf-8")) > max_bytes:
        raise InputError(f"the input is larger than {max_bytes} bytes", hint="raise NODEAGENT_MAX_INPUT_BYTES")
    if not text.strip():
        raise InputError(f"the input from {where} is empty", hint="give the text to work on")
    return text


__all__ = ["Device", "Node", "make_task", "plan_for", "read_input", "resolve_device"]
