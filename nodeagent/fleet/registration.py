"""Putting a node on the fleet: its persistent id, its registration record, the task types it serves, and the
worker built from the settings. The CLI's ``worker`` and ``serve --broker`` call this."""

from __future__ import annotations

import logging
import platform
import socket
import uuid
from pathlib import Path
from typing import Any

from nodeagent import __version__
from nodeagent.broker.base import CONTRACT, Broker, NodeRecord
from nodeagent.config import NodeConfig
from nodeagent.errors import NodeAgentError, UsageError
from nodeagent.fleet.guard import guard_for
from nodeagent.fleet.labelled_sets import LabelledSets
from nodeagent.fleet.worker import Worker, WorkerConfig
from nodeagent.model_kinds import ModelKind
from nodeagent.node import Node
from nodeagent.tasks import registry

log = logging.getLogger(__name__)


_IDS: dict[Path, str] = {}


def node_id(state_dir: Path) -> str:
    """This process's node id: the host's persistent id, kept in the state directory (made on first use), and
    for each further worker process sharing that directory a number of its own (``<id>-1``, ``<id>-2``, ...),
    held by a lock on a file for as long as the process lives (a killed process frees it), so every live
    worker has a distinct, stable id."""
    import fcntl
    import os

    state_dir = Path(state_dir)
    if state_dir in _IDS:
        return _IDS[state_dir]
    path = state_dir / "node-id"
    try:
        base = path.read_text().strip()
    except FileNotFoundError:
        from nodeagent.private import private_dir, private_text

        private_dir(path.parent)
        base = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        private_text(path, base + "\n")
    locks = state_dir / "worker-locks"
    locks.mkdir(mode=0o700, parents=True, exist_ok=True)
    for n in range(1024):
        fd = os.open(locks / f"{n}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        _IDS[state_dir] = ident = base if n == 0 else f"{base}-{n}"
        return ident  # the descriptor stays open: the lock lasts as long as this process
    raise UsageError(f"over 1024 workers share {state_dir}", hint="give them state directories of their own")


def parse_types(text: str | None) -> list[str] | None:
    """``classify,extract`` (kinds or type names) -> the task types' names, or None for none given."""
    if not text:
        return None
    return [registry.get(item).name for item in filter(None, (t.strip() for t in text.split(",")))]


def suited_types(model: str | None, kind: ModelKind = ModelKind.GENERATE) -> list[str]:
    """The task types of the roles the catalog says a model suits (its family's ``roles``); a model outside the
    catalog serves every type its kind can (``kind``, its plan's: an embedding model embeds and classifies, a
    generator does the rest)."""
    from nodeagent.store.catalog import load_catalog

    entry = load_catalog().get((model or "").lower())
    return registry.for_roles(list(entry.roles)) if entry is not None else registry.for_model_kind(kind)


def model_kinds(nodes: list[tuple[Node, list[str]]]) -> dict[str, Any]:
    """What a node record says of its models' kinds: each name a task may bind to and its model's kind
    (``model_kinds``, contract 1.7), and for readers of contract 1.6 the names of the embedding models
    (``embedders``). ``nodes``: each model's node and its names."""
    kinds = {name: node.kind.value for node, names in nodes for name in names}
    return {"model_kinds": kinds, "embedders": sorted(n for n, k in kinds.items() if ModelKind(k).embeds)}


def routing_names(node: Node) -> list[str]:
    """The names a task may use to bind itself to this node's model: the spec, the file name, the sha256
    recorded for catalog files, and the catalog id."""
    names = {node.model or ""}
    p = node.plan
    names.add(Path(p.model).name)
    names.add(Path(p.model).stem)  # the id /v1/models shows, which OpenAI bodies name
    from nodeagent.store.catalog import load_catalog

    for m in load_catalog().values():
        for f in m.files:
            if f.file_name == Path(p.model).name:
                names.add(m.id)
                if f.sha256:
                    names.add(f.sha256)
    return sorted(n for n in names if n)


def _machine(ident: str, hw: Any) -> dict[str, Any]:
    """The record's fields that describe the machine (its probe), the same for every node record."""
    from nodeagent.tasks import registry

    return dict(id=ident, hostname=socket.gethostname(), agent_version=__version__, contract=CONTRACT,
                knows=registry.names(), os=hw.os, arch=hw.arch,
                chip=(hw.apple.chip if hw.apple else hw.raspberry_pi.model if hw.raspberry_pi else hw.cpu_model),
                unified_memory=hw.apple is not None, ram_total_bytes=hw.ram_total_bytes,
                ram_available_bytes=hw.ram_available_bytes, hardware=hw.model_dump(mode="json"))


def record_for(node: Node, ident: str, types: list[str]) -> NodeRecord:
    hw, p = node.device.hardware, node.plan
    s = p.settings
    try:
        backend_version = __import__("llama_cpp").__version__ if p.backend == "llamacpp" else None
    except ImportError:
        backend_version = None
    return NodeRecord(
        **_machine(ident, hw), gpu_budget_bytes=p.budget.gpu_limit_bytes, backend=p.backend, backend_version=backend_version, model=node.model, model_file=p.model, quant=p.quant,
        models=routing_names(node), ctx_tokens=s.ctx_per_slot, type_k=s.type_k, type_v=s.type_v,
        gpu_layers=s.n_gpu_layers, mmap=s.use_mmap, planned_bytes=p.memory.total_bytes, task_types=types, slots=s.slots,
        labels={"profile": p.profile, "python": platform.python_version()}, plan=p.model_dump(mode="json"),
        **model_kinds([(node, routing_names(node))]))


def build_worker(node: Node, broker: Broker, config: NodeConfig, types: list[str] | None = None,
                 burst: bool = False) -> Worker:
    """Plan and load the node's model, then a worker for the types it serves, registered under its id."""
    served = types or parse_types(config.types) or suited_types(node.model, node.kind)
    node.load()
    ident = node_id(config.state_dir)
    wconf = WorkerConfig.from_config(config, ident, served, node.timeout_s, models=routing_names(node), burst=burst,
                                     slots=node.slots_total)
    guard = guard_for(config, ident)
    return Worker(broker, node, wconf, record=record_for(node, ident, served), guard=guard,
                  beat_fields=lambda: {"prefixes": node_prefixes(node)})


def node_prefixes(node: Node) -> dict[str, dict[str, Any]]:
    """A one-model node's warm prefixes for its record (``NodeRecord.prefixes``), by its model's name."""
    usage = node.prefix_usage()
    return {str(node.model): usage} if usage else {}


def model_set(nodes: list[Node], pinned: set[str], config: NodeConfig,
              aliases: dict[str, list[str]] | None = None) -> Any:
    """The nodes as one model set under the plan's budget (``modelset.py``), each answering to its routing
    names and its aliases (the config file's); UsageError for a --pin that names none of them, or a model over
    the budget alone."""
    from nodeagent.modelset import Member, ModelSet

    aliases = aliases or {}
    members = [Member(name=str(n.model), node=n, pinned=str(n.model) in pinned,
                      names=set(routing_names(n)) | set(aliases.get(str(n.model), []))) for n in nodes]
    unknown = pinned - {m.name for m in members}
    if unknown:
        raise UsageError(f"--pin {sorted(unknown)[0]!r} is not one of the --model values")
    try:
        return ModelSet(members, keep_alive_s=config.keep_alive_s, wait_s=config.model_wait_s)
    except ValueError as exc:
        raise UsageError(str(exc), hint="drop or shrink a model (--ctx, --quant), or free memory") from None


def build_set_worker(nodes: list[Node], pinned: set[str], broker: Broker, config: NodeConfig,
                     types: list[str] | None = None, burst: bool = False, models: Any = None) -> tuple[Worker, Any]:
    """A worker over several models under one budget: the pinned ones loaded now, the others at their first
    task; it claims tasks bound to any of them (or to none). The worker and its model set (``models``: one the
    server shares)."""
    mset = models if models is not None else model_set(nodes, pinned, config)
    members = mset.members
    order = registry.names()
    served = types or parse_types(config.types) or sorted(set().union(*(suited_types(n.model, n.kind)
                                                                        for n in nodes)),
                                                          key=order.index)
    mset.start()
    ident = node_id(config.state_dir)
    names = sorted(set().union(*(m.names for m in members)))
    wconf = WorkerConfig.from_config(config, ident, served, nodes[0].timeout_s, models=names, burst=burst,
                                     slots=max(n.plan.settings.slots for n in nodes))
    guard = guard_for(config, ident)
    mset.hold = guard.hold_models  # memory pressure: no further model loads, the idle ones are unloaded
    # the fleet's labelled sets, to measure a classify's routes on
    mset.registered = LabelledSets(broker, config.labelled_set_refresh_s).lookup
    base = record_for(nodes[0], ident, served)
    record = base.model_copy(update={"models": names, "labels": {**base.labels,
                                                                 "model_set": ",".join(m.name for m in members)},
                                     **model_kinds([(m.node, sorted(m.names)) for m in members])})
    return Worker(broker, mset, wconf, record=record, guard=guard,
                  beat_fields=lambda: {"prefixes": mset.prefix_usage()}), mset


# -- a node that follows the scheduler (fleet/follow.py) ---------------------------------------------------------
def file_names(file_name: str) -> set[str]:
    """The names a task may bind a model file by: the file name, its stem, and the catalog ids with that file."""
    from nodeagent.store.catalog import load_catalog

    names = {file_name, Path(file_name).stem}
    names |= {m.id for m in load_catalog().values() if any(f.file_name == file_name for f in m.files)}
    return names


def models_on_disk(config: NodeConfig) -> list[str]:
    """Catalog models and GGUF files this node has on disk (`nodeagent models` sees them): the scheduler prefers
    nodes that need no download."""
    from nodeagent.store.local import StoreDirs, scan

    try:
        found = scan(StoreDirs.from_config(config))
    except (OSError, NodeAgentError) as exc:
        log.warning("cannot list the models on disk: %s", exc)
        return []
    return sorted(set().union(*(file_names(Path(m.path).name) for m in found if not m.error)))


def bench_throughput(state_dir: Path) -> dict[str, float]:
    """Tasks/s per model name that `nodeagent bench` measured on this node (the best slot count's mean of
    extraction and classification), under every name a task may bind the model by."""
    from nodeagent.store.measured import throughputs

    return {name: rate for file, rate in throughputs(state_dir).items() for name in file_names(file)}


def record_for_device(device: Any, ident: str, types: list[str], config: NodeConfig) -> NodeRecord:
    """The record of a node that holds no model yet (a following node at start)."""
    hw = device.hardware
    from nodeagent.planner.budget import budget_for

    return NodeRecord(
        **_machine(ident, hw), gpu_budget_bytes=budget_for(hw, device.profile).gpu_limit_bytes, backend="none", task_types=types, follow=True, allow_pull=config.allow_pull,
        on_disk=models_on_disk(config), throughput=bench_throughput(config.state_dir),
        labels={"profile": device.profile.id, "python": platform.python_version(),
                "host": host_label(device, config)})


def host_label(device: Any, config: NodeConfig) -> str:
    """Nodes with one host label share its memory: this machine's name; a recorded machine (a hardware fixture)
    or a profile's nominal device planned here is a machine of its own."""
    host = socket.gethostname()
    if config.hardware_fixture:
        return f"{host}/{Path(config.hardware_fixture).stem}"
    return host if device.here else f"{host}/{device.profile.id}"


def build_follow_worker(device: Any, make_node: Any, broker: Broker, config: NodeConfig,
                        nodes: list[Node] | None = None, pinned: set[str] | None = None,
                        types: list[str] | None = None, burst: bool = False, models: Any = None) -> tuple[Worker, Any]:
    """A worker that holds what the scheduler assigns it (and ``nodes``, the --model values, to begin with):
    it looks at its assignment every ``schedule_s``; on the embedded SQLite queue it also runs the scheduler's
    rounds while no other process holds the leader lease."""
    from nodeagent.fleet.follow import AssignmentFollower
    from nodeagent.fleet.scheduler import Scheduler
    from nodeagent.modelset import ModelSet
    from nodeagent.node import measured_overhead_bytes
    from nodeagent.planner.budget import budget_for
    from nodeagent.store.local import StoreDirs, pull

    if models is None:
        models = (model_set(nodes, pinned or set(), config) if nodes else
                  ModelSet([], budget_bytes=budget_for(device.hardware, device.profile).host_limit_bytes,
                           overhead_bytes=device.overhead_bytes or measured_overhead_bytes("llamacpp"),
                           keep_alive_s=config.keep_alive_s, wait_s=config.model_wait_s))
    served = types or parse_types(config.types) or registry.names()
    for m in models.members:  # what it is given to begin with it holds now, and says so: the scheduler keeps it
        m.pinned = True       # where it has no reason to move it
    models.start()
    models.registered = LabelledSets(broker, config.labelled_set_refresh_s).lookup  # (the fleet's labelled sets)
    ident = node_id(config.state_dir)
    follower = AssignmentFollower(broker, ident, models, make_node, lambda n: set(routing_names(n)),
                                  config.allow_pull,
                                  pull=lambda name, quant: pull(name, StoreDirs.from_config(config), config.offline,
                                                                quant))
    duties: list[tuple[float, Any]] = [(config.schedule_s, follower.check)]
    if broker.url.startswith("sqlite"):
        scheduler = Scheduler(broker, config, owner=ident)
        duties.append((config.schedule_s, scheduler.step))
    limit = Node(None, config=config, device=device).timeout_s  # the task types' time limits (no model needed)
    wconf = WorkerConfig.from_config(config, ident, served, limit, models=[], burst=burst,
                                     slots=max([n.plan.settings.slots for n in nodes or []] or [1]))
    guard = guard_for(config, ident)
    models.hold = guard.hold_models  # memory pressure: no further model loads, the idle ones are unloaded
    record = record_for_device(device, ident, served, config)

    def beat() -> dict[str, Any]:
        held = [(m.node, sorted(m.names)) for m in list(models.members) if not m.retired]
        return {"models": models.routing_names(), "model_set": models.state(), "following": follower.status(),
                "prefixes": models.prefix_usage(), **model_kinds(held)}

    return Worker(broker, models, wconf, record=record.model_copy(update=beat()), guard=guard, duties=duties,
                  beat_fields=beat), models
