"""Putting a node on the fleet: its persistent id, its registration record, the task types it serves, and the
worker built from the settings. The CLI's ``worker`` and ``serve --broker`` call this."""

from __future__ import annotations

import logging
import platform
import socket
import uuid
from pathlib import Path

from nodeagent import __version__
from nodeagent.broker.base import Broker, NodeRecord
from nodeagent.config import NodeConfig
from nodeagent.errors import UsageError
from nodeagent.fleet.guard import Guard, GuardConfig
from nodeagent.fleet.worker import Worker, WorkerConfig
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
        path.parent.mkdir(parents=True, exist_ok=True)
        base = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        path.write_text(base + "\n")
    locks = state_dir / "worker-locks"
    locks.mkdir(parents=True, exist_ok=True)
    for n in range(1024):
        fd = os.open(locks / f"{n}.lock", os.O_CREAT | os.O_RDWR, 0o644)
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


def suited_types(model: str | None) -> list[str]:
    """The task types of the roles the catalog says a model suits (its family's ``roles``); a model outside
    the catalog serves every type."""
    from nodeagent.store.catalog import load_catalog

    entry = load_catalog().get((model or "").lower())
    return registry.for_kinds(list(entry.roles)) if entry is not None else registry.names()


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


def record_for(node: Node, ident: str, types: list[str]) -> NodeRecord:
    hw, p = node.device.hardware, node.plan
    s = p.settings
    try:
        backend_version = __import__("llama_cpp").__version__ if p.backend == "llamacpp" else None
    except ImportError:
        backend_version = None
    return NodeRecord(
        id=ident, hostname=socket.gethostname(), agent_version=__version__, os=hw.os, arch=hw.arch,
        chip=(hw.apple.chip if hw.apple else hw.raspberry_pi.model if hw.raspberry_pi else hw.cpu_model),
        unified_memory=hw.apple is not None, ram_total_bytes=hw.ram_total_bytes,
        ram_available_bytes=hw.ram_available_bytes, gpu_budget_bytes=p.budget.gpu_limit_bytes,
        backend=p.backend, backend_version=backend_version, model=node.model, model_file=p.model, quant=p.quant,
        models=routing_names(node), ctx_tokens=s.ctx_per_slot, type_k=s.type_k, type_v=s.type_v,
        gpu_layers=s.n_gpu_layers, mmap=s.use_mmap, planned_bytes=p.memory.total_bytes, task_types=types, slots=s.slots,
        labels={"profile": p.profile, "python": platform.python_version()},
        hardware=hw.model_dump(mode="json"), plan=p.model_dump(mode="json"))


def build_worker(node: Node, broker: Broker, config: NodeConfig, types: list[str] | None = None,
                 burst: bool = False) -> Worker:
    """Plan and load the node's model, then a worker for the types it serves, registered under its id."""
    served = types or parse_types(config.types) or suited_types(node.model)
    node.load()
    ident = node_id(config.state_dir)
    wconf = WorkerConfig.from_config(config, ident, served, node.timeout_s, models=routing_names(node), burst=burst,
                                     slots=node.slots_total)
    guard = Guard(GuardConfig.from_config(config), node_id=ident)
    return Worker(broker, node, wconf, record=record_for(node, ident, served), guard=guard)
