"""Prometheus metrics (prometheus_client, a registry of the node's own): requests, tokens and latency, task
outcomes by type and error code, queue depth and guard state, host memory against the plan, and the plan's
facts as an info metric."""

from __future__ import annotations

import time
from typing import Any

from nodeagent.node import Node
from nodeagent.tasks.contracts import Result

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, node: Node | None, guard: Any = None, broker: Any = None, models: Any = None) -> None:
        """``node``: None for a gateway (it holds no model: no plan to describe)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

        self.started = time.time()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("nodeagent_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.latency = Histogram("nodeagent_http_request_seconds", "HTTP request latency", ["route"],
                                 buckets=LATENCY_BUCKETS_S, registry=r)
        self.token_count = Counter("nodeagent_tokens", "Tokens processed", ["kind"], registry=r)
        self.tasks = Counter("nodeagent_tasks", "Task outcomes by type, status and error code",
                             ["type", "status", "code"], registry=r)
        planned = Gauge("nodeagent_memory_bytes", "Host memory: planned by the plan, and used by this process",
                        ["kind"], registry=r)
        if node is not None:
            plan = node.plan
            info = Info("nodeagent_plan", "The plan this node serves", registry=r)
            s = plan.settings
            info.info({"model": str(node.model or plan.model), "quant": str(plan.quant), "backend": plan.backend,
                       "ctx_tokens": str(s.ctx_per_slot), "type_k": s.type_k, "type_v": s.type_v,
                       "gpu_layers": str(s.n_gpu_layers), "profile": plan.profile})
            planned.labels("planned").set(plan.memory.total_bytes)
        planned.labels("rss").set_function(_rss)
        planned.labels("host_available").set_function(_available)
        if node is not None:  # the device's health: the guard's last reading, or a reading at each scrape
            from nodeagent.server.health_metrics import HealthCollector

            r.register(HealthCollector(guard) if guard is not None else
                       HealthCollector(read=_health_reader(node.config)))
        if guard is not None:
            state = Gauge("nodeagent_guard_state", "1 for the guard's current state", ["state"], registry=r)
            for name in ("ok", "paused", "unhealthy"):
                state.labels(name).set_function(lambda name=name: 1.0 if guard.state == name else 0.0)
        if broker is not None:
            r.register(_QueueCollector(broker))
        if models is not None:
            r.register(_ModelSetCollector(models))
        if models is not None or node is not None:
            from nodeagent.fleet.registration import node_prefixes

            r.register(_PrefixCollector(models.prefix_usage if models is not None else lambda: node_prefixes(node)))

    def request(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def tokens(self, prompt: int, generated: int) -> None:
        self.token_count.labels("prompt").inc(prompt)
        self.token_count.labels("generated").inc(generated)

    def task(self, result: Result) -> None:
        self.tasks.labels(result.type, result.status, result.error.code if result.error else "").inc()
        self.tokens(result.tokens.prompt, result.tokens.generated)

    def chat_error(self, code: str) -> None:
        self.tasks.labels("chat", "error", code).inc()

    def render(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


class _QueueCollector:
    """Queue depth by queue and state, read from the broker at scrape time."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker

    def collect(self):  # type: ignore[no-untyped-def]
        from prometheus_client.core import GaugeMetricFamily

        g = GaugeMetricFamily("nodeagent_queue_tasks", "Tasks in the queue by state", labels=["queue", "state"])
        try:
            for s in self.broker.stats():
                for state in ("ready", "leased", "delayed", "dead"):
                    g.add_metric([s.queue, state], getattr(s, state))
        except Exception:  # noqa: BLE001  (a broker that cannot be read must not break the scrape)
            pass
        yield g


def _health_reader(config: Any) -> Any:
    from nodeagent.hardware.health import reader_for

    return reader_for(config.hardware_fixture).read


def _rss() -> float:
    from nodeagent.procmem import process_memory

    return float(process_memory().rss_bytes)


def _available() -> float:
    import psutil

    return float(psutil.virtual_memory().available)


class _ModelSetCollector:
    """A model set's members: loaded or not, and their loads and unloads since start."""

    def __init__(self, models: Any) -> None:
        self.models = models

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        loaded = GaugeMetricFamily("nodeagent_model_loaded", "1 while the model is loaded", labels=["model"])
        loads = CounterMetricFamily("nodeagent_model_loads", "Loads of the model", labels=["model"])
        unloads = CounterMetricFamily("nodeagent_model_unloads", "Unloads of the model (keep-alive or room)",
                                      labels=["model"])
        for m in self.models.state():
            loaded.add_metric([m["model"]], 1.0 if m["loaded"] else 0.0)
            loads.add_metric([m["model"]], m["loads"])
            unloads.add_metric([m["model"]], m["unloads"])
        yield from (loaded, loads, unloads)


class _PrefixCollector:
    """Each model's warm prefixes (``Node.prefix_usage``): held on disk, restored, prefill seconds saved."""

    def __init__(self, usage: Any) -> None:
        self.usage = usage

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        held = GaugeMetricFamily("nodeagent_prefixes", "Warm prefixes of the model held on disk", labels=["model"])
        held_bytes = GaugeMetricFamily("nodeagent_prefix_bytes", "Bytes of the model's warm prefixes on disk",
                                       labels=["model"])
        restores = CounterMetricFamily("nodeagent_prefix_restores", "Prefixes read back in place of a prefill",
                                       labels=["model"])
        tokens = CounterMetricFamily("nodeagent_prefix_restored_tokens", "Tokens read back in place of a prefill",
                                     labels=["model"])
        saved = GaugeMetricFamily("nodeagent_prefix_saved_seconds", "Prefill seconds the restores saved, at the "
                                  "model's prefill rate measured here, less the time they took", labels=["model"])
        for model, p in self.usage().items():
            if p["prefixes"] is not None:
                held.add_metric([model], p["prefixes"])
                held_bytes.add_metric([model], p["state_bytes"])
            restores.add_metric([model], p["restored"])
            tokens.add_metric([model], p["restored_tokens"])
            if p["saved_s"] is not None:
                saved.add_metric([model], p["saved_s"])
        yield from (held, held_bytes, restores, tokens, saved)
