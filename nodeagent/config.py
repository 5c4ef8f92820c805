"""One configuration resolver with provenance, and the typed ``NodeConfig`` it produces.

Precedence: command-line flag > environment variable > config file > default.
Every ``NODEAGENT_*`` variable is declared once in ``SETTINGS``; ``nodeagent
--help`` and ``nodeagent config show`` list them. A flag, a variable and a
config key with the same name mean the same thing.

The device profile's defaults (context per task, KV types, slots, threads) take
one road: the planner applies them to whatever the user left unset. Here such a
setting resolves to ``None`` ("the planner decides from the profile"), so no
profile value reaches the planner twice.

``resolve()`` is pure: the caller passes the flags, the environment and the
parsed config file, so tests need no monkeypatching.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from pydantic import Field, model_validator

from nodeagent.errors import ConfigError
from nodeagent.kv_types import KV_TYPES, KvType
from nodeagent.private import ExposedSecret, exposed_secret, warn_exposed
from nodeagent.tomlfile import parse_toml
from nodeagent.units import MIB
from nodeagent.values import Frozen

LogLevel = Literal["debug", "info", "warning", "error"]


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(str(text).strip())
        if value < low or (high is not None and value > high):
            raise ValueError(f"expected an integer >= {low}" + (f" and <= {high}" if high else "") + f", got {text!r}")
        return value

    parse.low, parse.high = low, high  # type: ignore[attr-defined]  (the flag generated from it checks the same)
    return parse


def _positive_float(text: str) -> float:
    value = float(str(text).strip())
    if not value > 0:
        raise ValueError(f"expected a positive number, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(str(text).strip())
    if not value >= 0:
        raise ValueError(f"expected a number of at least 0, got {text!r}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = str(text).strip().lower()
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {text!r}")
        return value

    parse.choices = options  # type: ignore[attr-defined]
    return parse


def _path(text: str) -> Path:
    return Path(os.path.expanduser(text))


def _home() -> Path:
    return Path(os.path.expanduser("~"))


def _xdg(env_name: str, fallback: str) -> Callable[[Mapping[str, Any]], Path]:
    def default(env: Mapping[str, Any]) -> Path:
        base = env.get(env_name)
        return Path(base) if base else _home() / fallback

    return default


MAX_DRAFT_TOKENS = 16  # the longest draft from the input a step verifies (bench measures steps up to one more)


def _draft_tokens(text: str) -> int | None:
    """``draft_tokens``: auto (None: the measured choice) or a count."""
    if str(text).strip().lower() == "auto":
        return None
    return _int_at_least(0, MAX_DRAFT_TOKENS)(text)


def _none(env: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class Setting:
    name: str
    env: str
    description: str
    parse: Callable[[str], Any]
    default: Callable[[Mapping[str, Any]], Any]
    plan: str | None = None  # the planner requirement it fixes; unset (None), the planner decides from the profile
    flag: str | None = None  # the command-line flag commands take for it (cli/common.py generates it from here)


_POSITIVE = _int_at_least(1)
SETTINGS: tuple[Setting, ...] = (
    Setting("config_file", "NODEAGENT_CONFIG", "Path of the TOML config file.",
            _path, lambda env: _xdg("XDG_CONFIG_HOME", ".config")(env) / "nodeagent" / "config.toml"),
    Setting("state_dir", "NODEAGENT_HOME", "Directory for nodeagent's state (queue, node id, header cache).",
            _path, lambda env: _xdg("XDG_DATA_HOME", ".local/share")(env) / "nodeagent"),
    Setting("model_dir", "NODEAGENT_MODEL_DIR", "Directory where pulled models are stored.",
            _path, lambda env: _xdg("XDG_DATA_HOME", ".local/share")(env) / "nodeagent" / "models"),
    Setting("test_models_dir", "NODEAGENT_TEST_MODELS_DIR",
            "Cache of the test models fetched from the package index.",
            _path, lambda env: _xdg("XDG_CACHE_HOME", ".cache")(env) / "nodeagent" / "test-models"),
    Setting("cache_dir", "NODEAGENT_CACHE_DIR", "Cache of model headers read over the network and of model files' "
            "sha256.",
            _path, lambda env: _xdg("XDG_CACHE_HOME", ".cache")(env) / "nodeagent"),
    Setting("prefix_dir", "NODEAGENT_PREFIX_DIR", "Where prompt prefixes' KV state is kept on disk, read back "
            "after a restart or a swap instead of read again (docs/slots.md); processes on one machine may share it.",
            _path, lambda env: _xdg("XDG_CACHE_HOME", ".cache")(env) / "nodeagent" / "prefixes"),
    Setting("prefix_cache_bytes", "NODEAGENT_PREFIX_CACHE_BYTES", "Most bytes of prefix state kept in "
            "NODEAGENT_PREFIX_DIR; past it the least recently used go first. 0: no prefix is kept on disk.",
            _int_at_least(0), lambda env: 2 * 1024 * MIB),
    Setting("profile", "NODEAGENT_PROFILE", "Device profile to plan for instead of the matched one: its RAM, GPU "
            "budget, threads, slots and KV defaults.", str, _none),
    Setting("offline", "NODEAGENT_OFFLINE", "Never contact a model hub (HF_HUB_OFFLINE is honoured too).",
            parse_bool, lambda env: parse_bool(str(env.get("HF_HUB_OFFLINE", "0")))),
    Setting("hardware_fixture", "NODEAGENT_HARDWARE_FIXTURE",
            "Probe a recorded machine (a JSON fixture) instead of this one: for tests and support.", _path, _none),
    Setting("max_input_bytes", "NODEAGENT_MAX_INPUT_BYTES", "Largest task input accepted (bytes of UTF-8), "
            "checked before it is tokenized.", _POSITIVE, lambda env: MIB),
    # the fleet (docs/fleet.md): the queue, the worker's timers, the guard
    Setting("broker", "NODEAGENT_BROKER", "The queue: sqlite:///path (default: queue.db in NODEAGENT_HOME), "
            "redis://host:port/db for a fleet (rediss:// for TLS), or redis+sentinel://host:port[,host:port...]/"
            "service[/db] for a primary its Sentinels fail over.", str, _none, flag="--broker"),
    Setting("broker_retry_s", "NODEAGENT_BROKER_RETRY_S", "How long a Redis operation is retried through a "
            "dropped connection or a failover (the primary found again through the Sentinels) before its caller "
            "sees the error, where retrying cannot do harm (docs/fleet.md).", _non_negative_float,
            lambda env: 30.0),
    Setting("redis_min_replicas", "NODEAGENT_REDIS_MIN_REPLICAS", "Replicas that must confirm every write the fleet "
            "reports as done (an enqueue, a finish, a dead letter, a batch), by WAIT; 0: the primary's word.",
            _int_at_least(0), lambda env: 0),
    Setting("redis_wait_timeout_s", "NODEAGENT_REDIS_WAIT_TIMEOUT_S", "How long a write waits for its replicas "
            "(NODEAGENT_REDIS_MIN_REPLICAS) before it is an error.", _positive_float, lambda env: 1.0),
    Setting("types", "NODEAGENT_TYPES", "Task types a worker serves, e.g. classify,extract (default: what the "
            "catalog says its model suits).", str, _none, flag="--types"),
    Setting("lease_s", "NODEAGENT_LEASE_S", "A claimed task's lease in seconds, renewed every third of it.",
            _positive_float, lambda env: 60.0, flag="--lease"),
    Setting("heartbeat_s", "NODEAGENT_HEARTBEAT_S", "Seconds between a worker's heartbeats (lost after 3).",
            _positive_float, lambda env: 10.0, flag="--heartbeat"),
    Setting("max_attempts", "NODEAGENT_MAX_ATTEMPTS", "Attempts per task: the first and the retries.",
            _POSITIVE, lambda env: 4, flag="--max-attempts"),
    Setting("task_timeout_s", "NODEAGENT_TASK_TIMEOUT_S", "A task's time limit in seconds, or per type: "
            "600 or classify=60,extract=600.", str, lambda env: "600", flag="--task-timeout"),
    Setting("retry_base_s", "NODEAGENT_RETRY_BASE_S", "Retries wait a random time up to this base doubled per "
            "attempt (full jitter).", _positive_float, lambda env: 1.0),
    Setting("retry_cap_s", "NODEAGENT_RETRY_CAP_S", "The longest a retry waits.", _positive_float, lambda env: 300.0),
    Setting("result_retention_s", "NODEAGENT_RESULT_RETENTION_S", "How long finished tasks and their results are "
            "kept (7 days).", _positive_float, lambda env: 7 * 24 * 3600.0),
    Setting("answered_keep_s", "NODEAGENT_ANSWERED_KEEP_S", "How long a gateway's request's task and result are "
            "kept once its answer is delivered (for `tasks show` and the page; one an idempotency key names is kept "
            "NODEAGENT_RESULT_RETENTION_S, for the key).", _non_negative_float, lambda env: 60.0),
    Setting("labelled_set_refresh_s", "NODEAGENT_LABELLED_SET_REFRESH_S", "How long a node or a gateway keeps a "
            "label set's registered labelled set (or its absence) before it reads the broker again: a registration, "
            "a replacement or a deletion reaches the fleet within this long.", _positive_float, lambda env: 30.0),
    Setting("batch_takeover_s", "NODEAGENT_BATCH_TAKEOVER_S", "A batch whose expansion (its lines queued) has not "
            "been heard from for this long is taken over by the next server that looks (its own died).",
            _positive_float, lambda env: 15.0),
    Setting("keep_alive_s", "NODEAGENT_KEEP_ALIVE_S", "A node with several models: how long a model stays loaded "
            "after its last task (pinned models stay).", _positive_float, lambda env: 300.0, flag="--keep-alive"),
    Setting("model_wait_s", "NODEAGENT_MODEL_WAIT_S", "A node with several models: how long a task waits for "
            "room to load its model before it fails, retryably (model_unavailable).", _positive_float,
            lambda env: 30.0),
    # the central scheduler (fleet/scheduler.py) and the nodes that follow it
    Setting("allow_pull", "NODEAGENT_ALLOW_PULL", "A following node may download a model the scheduler assigns it "
            "(otherwise only models already on its disk).", parse_bool, lambda env: False, flag="--allow-pull"),
    Setting("schedule_s", "NODEAGENT_SCHEDULE_S", "Seconds between the scheduler's placement rounds (and a "
            "following node's looks at its assignment).", _positive_float, lambda env: 5.0),
    Setting("scheduler_lease_s", "NODEAGENT_SCHEDULER_LEASE_S", "The scheduler's leader lease: a standby takes "
            "over this long after the leader stops renewing it.", _positive_float, lambda env: 15.0),
    Setting("min_residency_s", "NODEAGENT_MIN_RESIDENCY_S", "A model the scheduler placed stays at least this "
            "long (unless its node is lost).", _non_negative_float, lambda env: 300.0),
    Setting("prefer_warm_s", "NODEAGENT_PREFER_WARM_S", "How long a task may wait for a node that holds its "
            "prompt's prefix warm: another node that claims it meanwhile gives it back for that one (docs/fleet.md); "
            "about the prefill a warm prefix saves on the fleet's devices pays best; 0: no preference.",
            _non_negative_float, lambda env: 5.0),
    Setting("drain_s", "NODEAGENT_DRAIN_S", "On SIGTERM, how long the running task may take to finish before it "
            "is given back.", _positive_float, lambda env: 30.0),
    Setting("drain_handoff", "NODEAGENT_DRAIN_HANDOFF", "On SIGTERM (or a hold), a stream the node is running is "
            "given back at once for another node to continue from what was sent, instead of finishing here within "
            "the drain.", parse_bool, lambda env: False),
    Setting("guard_memory_pct", "NODEAGENT_GUARD_MEMORY_PCT", "Stop claiming above this host memory use (%).",
            _positive_float, lambda env: 85.0),
    Setting("guard_cpu_pct", "NODEAGENT_GUARD_CPU_PCT", "Stop claiming above this CPU use by other processes (%).",
            _positive_float, lambda env: 90.0),
    Setting("guard_error_rate", "NODEAGENT_GUARD_ERROR_RATE", "Unhealthy above this error rate over the window "
            "(0-1).", _positive_float, lambda env: 0.15),
    # the guard and the device's health (fleet/guard.py, hardware/health.py)
    Setting("guard_temp_c", "NODEAGENT_GUARD_TEMP_C", "Stop claiming at or above this CPU temperature (degrees C); "
            "a Pi's soft temperature limit or throttle flag, or macOS thermal pressure at "
            "NODEAGENT_GUARD_THERMAL_PRESSURE, pause it too.", _positive_float, lambda env: 85.0),
    Setting("guard_cool_c", "NODEAGENT_GUARD_COOL_C", "After a pause for heat, claim again only once the "
            "temperature is this many degrees under NODEAGENT_GUARD_TEMP_C and the throttle flags are clear.",
            _non_negative_float, lambda env: 10.0),
    Setting("guard_heat_pause_s", "NODEAGENT_GUARD_HEAT_PAUSE_S", "A pause for heat lasts at least this long "
            "(seconds).", _non_negative_float, lambda env: 60.0),
    Setting("guard_thermal_pressure", "NODEAGENT_GUARD_THERMAL_PRESSURE", "macOS: stop claiming at this thermal "
            "pressure or above (moderate, heavy, trapping).", _choice(("moderate", "heavy", "trapping")),
            lambda env: "heavy"),
    Setting("on_battery", "NODEAGENT_ON_BATTERY", "On battery power: serve (as on mains), pause (claim nothing "
            "below NODEAGENT_BATTERY_MIN_PCT) or drain (claim nothing at any charge; the tasks in hand finish).",
            _choice(("serve", "pause", "drain")), lambda env: "pause"),
    Setting("battery_min_pct", "NODEAGENT_BATTERY_MIN_PCT", "With NODEAGENT_ON_BATTERY=pause: the charge (%) below "
            "which a node on battery claims nothing.", _non_negative_float, lambda env: 30.0),
    Setting("guard_psi_some_pct", "NODEAGENT_GUARD_PSI_SOME_PCT", "Linux: memory pressure is 'warn' (no further "
            "model loaded, idle ones unloaded) when some task waited for memory this share (%) of the last 10 s.",
            _positive_float, lambda env: 20.0),
    Setting("guard_psi_full_pct", "NODEAGENT_GUARD_PSI_FULL_PCT", "Linux: memory pressure is 'critical' (claim "
            "nothing) when every task waited for memory this share (%) of the last 10 s.", _positive_float,
            lambda env: 10.0),
    Setting("clock_warn_s", "NODEAGENT_CLOCK_WARN_S", "Alert when a node's wall clock is further than this many "
            "seconds off the broker's (measured at its heartbeats; the queue never depends on it).", _positive_float,
            lambda env: 5.0),
    Setting("alert_webhook", "NODEAGENT_ALERT_WEBHOOK", "POST alerts (3 consecutive failures) here as JSON.",
            str, _none),
    # the gateway (the fleet as one OpenAI endpoint, through the queue)
    Setting("gateway_timeout_s", "NODEAGENT_GATEWAY_TIMEOUT_S", "A gateway request's time limit in seconds, when the "
            "client does not say its own (the openai package's X-Stainless-Timeout): it becomes the task's deadline.",
            _positive_float, lambda env: 600.0),
    Setting("gateway_max_wait_s", "NODEAGENT_GATEWAY_MAX_WAIT_S", "A gateway answers 429 (with Retry-After) when the "
            "fleet could not start a request within this many seconds, by the queue and the nodes' measured rate.",
            _positive_float, lambda env: 30.0),
    Setting("gateway_placement_wait_s", "NODEAGENT_GATEWAY_PLACEMENT_WAIT_S", "How long a gateway request for a model "
            "no node holds waits for the scheduler to place it; then 503 with Retry-After.", _positive_float,
            lambda env: 120.0),
    # the HTTP server
    Setting("host", "NODEAGENT_HOST", "Address `serve` binds (any but loopback needs a token or --insecure).",
            str, lambda env: "127.0.0.1", flag="--host"),
    Setting("port", "NODEAGENT_PORT", "Port `serve` listens on.", _int_at_least(1, 65535), lambda env: 8400,
            flag="--port"),
    Setting("token", "NODEAGENT_TOKEN", "Bearer token clients must send to `serve` (compared in constant time).",
            str, _none, flag="--token"),
    Setting("token_file", "NODEAGENT_TOKEN_FILE", "A file holding the bearer token (its first line), read at start "
            "when no token is given: keeps it off the command line, out of the environment and out of service files "
            "(`service install` writes one, 0600).", _path, _none, flag="--token-file"),
    Setting("broker_password_file", "NODEAGENT_BROKER_PASSWORD_FILE", "A file holding the Redis password (its first "
            "line), for a broker URL that has none: keeps it off the command line and out of service files.", _path,
            _none, flag="--broker-password-file"),
    Setting("broker_sentinel_password_file", "NODEAGENT_BROKER_SENTINEL_PASSWORD_FILE", "A file holding the "
            "Sentinels' own password (its first line), for a redis+sentinel:// URL without sentinel_password: keeps it "
            "off the command line and out of service files.", _path, _none, flag="--broker-sentinel-password-file"),
    Setting("allowed_hosts", "NODEAGENT_ALLOWED_HOSTS", "Host names (comma-separated) the server answers besides "
            "its loopback names, for a name clients reach it by (a proxy's, a LAN name); '*' answers any. A server on "
            "loopback answers only its loopback names (a rebound DNS name gets 421); one on another address, any.",
            str, _none),
    Setting("max_connections", "NODEAGENT_MAX_CONNECTIONS", "Most connections (and requests) the server holds at "
            "once; past it, 503.", _POSITIVE, lambda env: 4096),
    Setting("max_client_connections", "NODEAGENT_MAX_CLIENT_CONNECTIONS", "Most connections one client address holds "
            "at once (a trusted proxy's are not counted); past it, a new one is answered 503 and closed, so one client "
            "cannot fill NODEAGENT_MAX_CONNECTIONS.", _POSITIVE, lambda env: 64),
    Setting("trusted_proxies", "NODEAGENT_TRUSTED_PROXIES", "Addresses or networks (comma-separated, e.g. "
            "127.0.0.1,10.0.0.0/8) whose X-Forwarded-For and X-Forwarded-Proto are believed: the client address the "
            "throttles, the body budget and the audit log use. None by default: every client is its connection's "
            "address.", str, _none),
    Setting("max_body_bytes", "NODEAGENT_MAX_BODY_BYTES", "Largest HTTP request body accepted.",
            _POSITIVE, lambda env: 4 * MIB),
    Setting("max_batch_bytes", "NODEAGENT_MAX_BATCH_BYTES", "Largest batch input file /v1/files and `nodeagent "
            "batch create` accept (a JSONL of requests).", _POSITIVE, lambda env: 200 * MIB),
    Setting("max_tokens", "NODEAGENT_MAX_TOKENS", "Largest max_tokens a chat completion may ask for.",
            _POSITIVE, lambda env: 4096),
    Setting("max_n", "NODEAGENT_MAX_N", "Most choices (n, or best_of) one completion may ask for; past the slots "
            "they decode in turn.", _POSITIVE, lambda env: 16),
    Setting("client_timeout_s", "NODEAGENT_CLIENT_TIMEOUT_S", "Seconds an HTTP client may take to send a "
            "request's body before the connection is closed.", _positive_float, lambda env: 20.0),
    Setting("header_timeout_s", "NODEAGENT_HEADER_TIMEOUT_S", "Seconds a client may take to send a request's "
            "headers once it has begun (or once it connected) before the connection is closed: shorter than the idle "
            "time, so a client that drips its headers does not hold a connection.", _positive_float,
            lambda env: 10.0),
    Setting("idle_timeout_s", "NODEAGENT_IDLE_TIMEOUT_S", "Seconds a kept-alive connection may wait for its next "
            "request before it is closed.", _positive_float, lambda env: 30.0),
    Setting("server_queue", "NODEAGENT_SERVER_QUEUE", "HTTP requests that may wait for the model; past them, 429.",
            _int_at_least(0), lambda env: 16),
    # the operator's page (/ui on serve and on the gateway) and the fleet's history behind it
    Setting("ui", "NODEAGENT_UI", "Serve the operator's page at /ui (read-only unless --ui-admin).", parse_bool,
            lambda env: True),
    Setting("ui_admin", "NODEAGENT_UI_ADMIN", "The page's controls: hold or resume a node, pause or resume a queue, "
            "replay dead letters, cancel a task or a batch (each logged with who).", parse_bool, lambda env: False,
            flag="--ui-admin"),
    Setting("responses_keep_s", "NODEAGENT_RESPONSES_KEEP_S", "How long a stored /v1/responses answer is kept in "
            "the broker for GET and previous_response_id (seconds; store is on by default only where there is a "
            "broker).", _positive_float, lambda env: 30 * 86400.0),
    Setting("responses_max_count", "NODEAGENT_RESPONSES_MAX_COUNT", "Most stored /v1/responses answers the broker "
            "keeps; past it the oldest go first.", _POSITIVE, lambda env: 10_000),
    Setting("responses_max_bytes", "NODEAGENT_RESPONSES_MAX_BYTES", "Most bytes of stored /v1/responses answers the "
            "broker keeps (each response with its conversation); past it the oldest go first. One larger than it is "
            "answered but not stored.", _POSITIVE, lambda env: 128 * MIB),
    Setting("ui_session_s", "NODEAGENT_UI_SESSION_S", "How long a sign-in to the page lasts (seconds); signing out, "
            "or a new token, ends it sooner.", _positive_float, lambda env: 12 * 3600.0),
    Setting("ui_refresh_s", "NODEAGENT_UI_REFRESH_S", "How often the page's shared snapshot of the fleet is read "
            "again (seconds); open pages refresh when it changes.", _positive_float, lambda env: 2.0),
    Setting("ui_streams", "NODEAGENT_UI_STREAMS", "Most live pages open at once (each holds one event stream); "
            "past it, 503 with Retry-After.", _int_at_least(1), lambda env: 32),
    Setting("ui_input_chars", "NODEAGENT_UI_INPUT_CHARS", "A task's input and output on the page are cut at this "
            "many characters (0: not shown).", _int_at_least(0), lambda env: 4000),
    Setting("ui_redact", "NODEAGENT_UI_REDACT", "Comma-separated key patterns (shell-style, any case) whose values "
            "the page hides in a task's input and output.", str,
            lambda env: "*key*,*token*,*secret*,*password*,*passwd*,*pwd*,*passphrase*,authorization,*cookie*,"
                        "*credential*,*bearer*,*session*,*private*"),
    Setting("history_days", "NODEAGENT_HISTORY_DAYS", "Days the fleet's per-minute history (depths, throughput, "
            "failures, wait and run times) is kept in the broker.", _positive_float, lambda env: 7.0),
    Setting("log_format", "NODEAGENT_LOG_FORMAT", "Logs on stderr: json, text, or auto (JSON lines when stderr "
            "is not a terminal or a service manager started nodeagent).", _choice(("auto", "json", "text")),
            lambda env: "auto"),
    Setting("max_string_chars", "NODEAGENT_MAX_STRING_CHARS", "Extraction: strings a schema leaves without "
            "maxLength are bounded at this many characters by the decoder.", _POSITIVE, lambda env: 1000),
    Setting("max_array_items", "NODEAGENT_MAX_ARRAY_ITEMS", "Extraction: arrays a schema leaves without maxItems "
            "are bounded at this many items by the decoder.", _POSITIVE, lambda env: 64),
    Setting("deterministic", "NODEAGENT_DETERMINISTIC", "The same request gets the same answer whatever ran "
            "before: every prompt read afresh (no cells of an earlier task reused), one task decoded at a time "
            "(slots 1) and the thread count held (NODEAGENT_THREADS_ADAPT off).", parse_bool, lambda env: False),
    Setting("fast_forward", "NODEAGENT_FAST_FORWARD", "Under a grammar, the tokens it forces (a key's rest, "
            "quotes, separators, closing brackets) go into the sampled token's model step instead of a step each "
            "(off for comparisons; off by itself when log-probabilities are asked for).", parse_bool,
            lambda env: True),
    Setting("draft_tokens", "NODEAGENT_DRAFT_TOKENS", "Extraction: the longest draft from the input (the text "
            "after a value's tail) a model step verifies; auto: what `nodeagent bench` measured pays on this device "
            f"for the model (none until it has), 0: none, 1-{MAX_DRAFT_TOKENS}: that many.", _draft_tokens, _none),
    Setting("access_log", "NODEAGENT_ACCESS_LOG", "`serve` logs one line a request: method, route, status, "
            "duration, tokens and the task's error code.", parse_bool, lambda env: True),
    Setting("log_level", "NODEAGENT_LOG_LEVEL", "Log level on stderr (debug, info, warning, error).",
            _choice(("debug", "info", "warning", "error")), lambda env: "warning"),
    Setting("debug", "NODEAGENT_DEBUG", "Show tracebacks for errors.", parse_bool, lambda env: False),
    # planner requirements: unset, the planner takes the device profile's value for the task
    Setting("ctx_tokens", "NODEAGENT_CTX", "Context length in tokens, fixed exactly (default: the profile's "
            "for the task, shortened to fit).", _POSITIVE, _none, plan="ctx_tokens", flag="--ctx"),
    Setting("min_ctx_tokens", "NODEAGENT_MIN_CTX", "Shortest acceptable context; a longer one is used when it fits.",
            _POSITIVE, _none, plan="min_ctx_tokens", flag="--min-ctx"),
    Setting("slots", "NODEAGENT_SLOTS", "Parallel tasks served at once (default: the profile's).",
            _POSITIVE, _none, plan="slots", flag="--slots"),
    Setting("threads", "NODEAGENT_THREADS", "CPU threads for inference (default: the profile's, or the "
            "device's performance cores).", _POSITIVE, _none, plan="n_threads", flag="--threads"),
    Setting("threads_adapt", "NODEAGENT_THREADS_ADAPT", "Use a thread fewer for each core other processes "
            "hold, while they hold it (llama.cpp's threads wait for the slowest); not when --threads is fixed or "
            "NODEAGENT_DETERMINISTIC is on.",
            parse_bool, lambda env: True),
    Setting("type_k", "NODEAGENT_TYPE_K", f"K cache type, fixed ({', '.join(KV_TYPES)}).",
            _choice(KV_TYPES), _none, plan="type_k", flag="--type-k"),
    Setting("type_v", "NODEAGENT_TYPE_V", "V cache type, fixed (a quantized one needs flash attention).",
            _choice(KV_TYPES), _none, plan="type_v", flag="--type-v"),
    Setting("flash_attn", "NODEAGENT_FLASH_ATTN", "Flash attention on or off, fixed.", parse_bool, _none, plan="flash_attn", flag="--flash-attn"),
    Setting("batch", "NODEAGENT_BATCH", "Batch size (tokens per llama_decode call), fixed.",
            _POSITIVE, _none, plan="n_batch", flag="--batch"),
    Setting("ubatch", "NODEAGENT_UBATCH", "Micro-batch size, fixed (at most the batch).",
            _POSITIVE, _none, plan="n_ubatch", flag="--ubatch"),
    Setting("mmap", "NODEAGENT_MMAP", "Memory-map the weights, fixed.", parse_bool, _none, plan="use_mmap", flag="--mmap"),
    Setting("gpu_layers", "NODEAGENT_GPU_LAYERS", "Layers on the GPU, fixed (-1: all; needs GPU offload).",
            _int_at_least(-1), _none, plan="n_gpu_layers", flag="--gpu-layers"),
)

SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}
PLAN_SETTINGS = {s.name: s.plan for s in SETTINGS if s.plan}  # setting -> the Requirements field it fixes


class NodeConfig(Frozen):
    """Every setting, typed, resolved once per process, with where each value came from. No field has a default
    of its own: ``resolve()`` gives every one (``SETTINGS`` holds the defaults)."""

    config_file: Path
    state_dir: Path
    model_dir: Path
    test_models_dir: Path
    cache_dir: Path
    prefix_dir: Path
    prefix_cache_bytes: int
    profile: str | None
    offline: bool
    hardware_fixture: Path | None
    max_input_bytes: int = Field(gt=0)
    broker: str | None
    broker_password_file: Path | None
    broker_sentinel_password_file: Path | None
    broker_retry_s: float
    redis_min_replicas: int
    redis_wait_timeout_s: float
    types: str | None
    lease_s: float
    heartbeat_s: float
    max_attempts: int
    task_timeout_s: str
    retry_base_s: float
    answered_keep_s: float
    labelled_set_refresh_s: float
    batch_takeover_s: float
    keep_alive_s: float
    model_wait_s: float
    allow_pull: bool
    schedule_s: float
    scheduler_lease_s: float
    min_residency_s: float
    retry_cap_s: float
    result_retention_s: float
    prefer_warm_s: float
    drain_s: float
    drain_handoff: bool
    guard_memory_pct: float
    guard_cpu_pct: float
    guard_error_rate: float
    guard_temp_c: float
    guard_cool_c: float
    guard_heat_pause_s: float
    guard_thermal_pressure: Literal["moderate", "heavy", "trapping"]
    on_battery: Literal["serve", "pause", "drain"]
    battery_min_pct: float
    guard_psi_some_pct: float
    guard_psi_full_pct: float
    clock_warn_s: float
    alert_webhook: str | None
    gateway_timeout_s: float
    gateway_max_wait_s: float
    gateway_placement_wait_s: float
    host: str
    port: int
    token: str | None
    token_file: Path | None
    allowed_hosts: str | None
    max_connections: int
    max_client_connections: int
    trusted_proxies: str | None
    max_body_bytes: int
    max_batch_bytes: int
    max_tokens: int
    max_n: int
    client_timeout_s: float
    header_timeout_s: float
    idle_timeout_s: float
    server_queue: int
    ui: bool
    ui_admin: bool
    responses_keep_s: float
    responses_max_count: int
    responses_max_bytes: int
    ui_session_s: float
    ui_refresh_s: float
    ui_streams: int
    ui_input_chars: int
    ui_redact: str
    history_days: float
    log_format: Literal["auto", "json", "text"]
    max_string_chars: int
    max_array_items: int
    deterministic: bool
    fast_forward: bool
    draft_tokens: int | None
    access_log: bool
    log_level: LogLevel
    debug: bool
    ctx_tokens: int | None
    min_ctx_tokens: int | None
    slots: int | None
    threads: int | None
    threads_adapt: bool
    type_k: KvType | None
    type_v: KvType | None
    flash_attn: bool | None
    batch: int | None
    ubatch: int | None
    mmap: bool | None
    gpu_layers: int | None
    sources: dict[str, str] = Field(default_factory=dict, description="setting -> 'flag', 'env NODEAGENT_X', "
                                                                      "'config <path>' or 'default'")

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    @model_validator(mode="before")
    @classmethod
    def _token_from_file(cls, data: Any) -> Any:
        """A token given by file (NODEAGENT_TOKEN_FILE) is read here, once, when none is given itself."""
        if isinstance(data, dict) and data.get("token") is None and data.get("token_file"):
            path = Path(data["token_file"])
            data = {**data, "token": read_secret(path, "NODEAGENT_TOKEN_FILE"),
                    "sources": {**data.get("sources", {}), "token": f"file {path}"}}
        return data

    @model_validator(mode="after")
    def _secrets_on_argv(self) -> "NodeConfig":
        """A secret given as a flag is in the process's command line, which every local user may read (``ps``):
        said once per process, with where to keep it instead. A broker URL that a raw '/', '?' or '#' in its password
        cuts short is refused here, wherever it was given (``urls.raw_secret``: redis-py would read it as another
        host, and no mask would find its password)."""
        from nodeagent.urls import UrlParts

        broker_secret = bool(self.broker and "://" in self.broker and UrlParts.of(self.broker).secrets())
        for name, given in (("token", self.token), ("broker", broker_secret)):
            if given and self.sources.get(name) == "flag" and name not in _ARGV_SAID:
                _ARGV_SAID.add(name)
                import logging

                logging.getLogger(__name__).warning(
                    "the %s was given on the command line, where every user of this machine can read it (ps): "
                    "keep it in a file instead (%s)", "bearer token" if name == "token" else "Redis password",
                    "--token-file / NODEAGENT_TOKEN_FILE" if name == "token"
                    else "--broker-password-file / NODEAGENT_BROKER_PASSWORD_FILE, and "
                         "NODEAGENT_BROKER_SENTINEL_PASSWORD_FILE for the Sentinels'")
        return self

    def source(self, name: str) -> str:
        return self.sources[name]

    def plan_settings(self) -> dict[str, Any]:
        """The planner requirements the user fixed (flag, variable or config file), by Requirements field."""
        return {field: getattr(self, name) for name, field in PLAN_SETTINGS.items() if getattr(self, name) is not None}

    def with_flags(self, flags: Mapping[str, Any]) -> "NodeConfig":
        """This config with more flags on top (a subcommand's own options), converted and checked alike."""
        given = {k: v for k, v in flags.items() if v is not None}
        if not given:
            return self
        values = {name: getattr(self, name) for name in SETTINGS_BY_NAME}
        sources = dict(self.sources)
        for name, raw in given.items():
            value = _convert(SETTINGS_BY_NAME[name], raw, "flag")
            if value != values[name] or name not in sources:  # the same value handed on keeps where it came from
                sources[name] = "flag"
            values[name] = value
        return NodeConfig(**values, sources=sources)

    def task_timeouts(self) -> tuple[float, dict[str, float]]:
        """(default, per task type as written: a kind or a type name) from task_timeout_s: ``600`` or
        ``classify=60,extract=600``."""
        default, per = 600.0, {}
        for item in filter(None, (x.strip() for x in self.task_timeout_s.split(","))):
            name, sep, value = item.rpartition("=")
            try:
                seconds = _positive_float(value)
            except ValueError:
                raise ConfigError(f"bad task_timeout_s {self.task_timeout_s!r}",
                                  hint="write 600, or classify=60,extract=600") from None
            if sep:
                per[name] = seconds
            else:
                default = seconds
        return default, per

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """Every setting with its value as it may be shown: the token as ***, a broker URL's passwords masked."""
        from nodeagent.urls import shown

        def value(name: str) -> Any:
            if name == "token" and self.token:
                return "***"
            return shown(self.broker) if name == "broker" and self.broker else _show(getattr(self, name))

        return {s.name: {"value": value(s.name), "source": self.sources[s.name], "env": s.env,
                         "description": s.description} for s in SETTINGS}


_ARGV_SAID: set[str] = set()  # the secrets on the command line already warned of, in this process


def read_secret(path: Path, setting: str) -> str:
    """The first line of a file that holds a secret (a token, a password); ConfigError when it cannot be read or is
    blank. One that other users may read is used, with a warning (nodeagent doctor fails it)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {setting} {path}: {getattr(exc, 'strerror', None) or exc}",
                          hint=f"check the file, or unset {setting}") from None
    secret = (text.splitlines() or [""])[0].strip()
    if not secret:
        raise ConfigError(f"{setting} {path} is empty", hint="write the secret on its first line")
    warn_exposed(exposed_secret(path, f"a secret ({setting})"))
    return secret


# the secrets a config file may hold, by setting: what each is, in words, and the setting of a file of its own
_FILE_FOR = {"the bearer token": "token_file", "the Redis password": "broker_password_file",
             "the Sentinels' password": "broker_sentinel_password_file"}


def config_secrets(values: Mapping[str, Any]) -> list[str]:
    """The secrets a config file's values hold (at the top and in a ``[[models]]`` entry), in words with their key:
    the bearer token (``token``), and a broker URL's Redis password, the Sentinels' and any other secret option
    (``broker``; one a raw '/', '?' or '#' cuts short holds its password too)."""
    from nodeagent.urls import secret_names

    found: list[str] = []
    for entry in [values, *values.get("models", [])]:
        if not isinstance(entry, Mapping):
            continue
        if entry.get("token"):
            found.append("the bearer token (token)")
        broker = entry.get("broker")
        if isinstance(broker, str) and "://" in broker and not broker.startswith("sqlite:"):
            try:
                kinds = set(secret_names(broker))
            except ValueError:
                kinds = set()
            found += [f"{what} (broker)" for kind, what in (("broker-password", "the Redis password"),
                                                             ("broker-sentinel-password", "the Sentinels' password"))
                      if kind in kinds]
            if kinds - {"broker-password", "broker-sentinel-password"}:
                found.append("a secret option of the broker URL (broker)")
    return list(dict.fromkeys(found))


def config_file_exposed(path: Path, values: Mapping[str, Any] | None = None) -> ExposedSecret | None:
    """The config file as an ``ExposedSecret`` (``private.py``) when it holds a secret (``config_secrets``) and users
    other than its owner may read it, else None: the fix says chmod 600, or where each secret may be kept instead."""
    try:
        held = config_secrets(load_config_file(path) if values is None else values)
    except ConfigError:
        return None
    if not held:
        return None
    files = [_FILE_FOR[what] for what in _FILE_FOR if any(h.startswith(what) for h in held)]
    instead = None
    if len(files) == 1:
        kind = "a token file" if files[0] == "token_file" else "a password file"
        instead = f"move it to {kind} ({files[0]} = PATH, 0600)"
    elif files:
        instead = f"move them to files of their own ({', '.join(files)}: each a PATH, 0600)"
    words = held[0] if len(held) == 1 else f"{', '.join(held[:-1])} and {held[-1]}"
    return exposed_secret(path, words, instead)


def _show(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _convert(setting: Setting, raw: Any, where: str) -> Any:
    if raw is None:
        return None
    text = str(raw).lower() if isinstance(raw, bool) else str(raw)  # flags and TOML give typed values
    try:
        return setting.parse(text)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: bad value for {setting.name}: {exc}",
                          hint=f"fix {setting.env} or '{setting.name}' in the config file") from None


def load_config_file(path: Path) -> dict[str, Any]:
    """Read the TOML config file; a missing file is an empty config."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    parsed = parse_toml(data, f"config file {path}", hint="fix the file or point NODEAGENT_CONFIG elsewhere")
    unknown = sorted(set(parsed) - set(SETTINGS_BY_NAME) - {"models"})
    if unknown:
        raise ConfigError(f"config file {path} has unknown keys: {', '.join(unknown)}",
                          hint=f"known keys: {', '.join(SETTINGS_BY_NAME)}, and [[models]]")
    for i, entry in enumerate(parsed.get("models", [])):
        model_entry(entry, f"config file {path}, models[{i}]")
    return parsed


MODEL_KEYS = {"model", "pin", "aliases"}


def model_entry(entry: Any, where: str) -> dict[str, Any]:
    """A ``[[models]]`` entry of the config file: ``model``, optionally ``pin``, ``aliases`` and any setting
    for that model alone (``ctx_tokens``, ``slots``, ``type_k``, ...); ConfigError naming what is wrong."""
    if not isinstance(entry, dict) or not isinstance(entry.get("model"), str) or not entry["model"]:
        raise ConfigError(f"{where} needs model = \"<catalog name or file>\"")
    unknown = sorted(set(entry) - MODEL_KEYS - set(SETTINGS_BY_NAME))
    if unknown:
        raise ConfigError(f"{where} has unknown keys: {', '.join(unknown)}",
                          hint="a model entry takes model, pin, aliases and settings")
    if not isinstance(entry.get("pin", False), bool) or not all(isinstance(a, str) for a in entry.get("aliases", [])):
        raise ConfigError(f"{where}: pin is true or false, aliases a list of names")
    for key in set(entry) - MODEL_KEYS:
        _convert(SETTINGS_BY_NAME[key], entry[key], where)
    return entry


def resolve(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            file_values: Mapping[str, Any] | None = None, file_path: Path | None = None) -> NodeConfig:
    """Resolve every setting, remembering where each value came from."""
    flags = flags or {}
    env = env if env is not None else {}
    file_values = file_values or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        if flags.get(s.name) is not None:
            values[s.name], sources[s.name] = _convert(s, flags[s.name], "flag"), "flag"
        elif env.get(s.env) not in (None, ""):
            values[s.name], sources[s.name] = _convert(s, env[s.env], s.env), f"env {s.env}"
        elif s.name in file_values:
            where = f"config {file_path}"
            values[s.name], sources[s.name] = _convert(s, file_values[s.name], where), where
        else:
            values[s.name], sources[s.name] = s.default(env), "default"
    return NodeConfig(**values, sources=sources)


def load(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> NodeConfig:
    """flags > environment > the config file they point to > defaults: what a process resolves once."""
    env = dict(os.environ) if env is None else env
    path = resolve(flags, env).config_file
    values = load_config_file(path)
    warn_exposed(config_file_exposed(path, values))  # a token or a password others may read: said, as a token file's
    return resolve(flags, env, values, path)


def apply_setting(path: Path, name: str, value: Any, model: str | None = None,
                  model_file: str | None = None) -> str:
    """Write one setting into the config file (made if missing), keeping its comments and layout: into the
    ``[[models]]`` entry of this model where the file has one, else at the top. Where it was written, in words."""
    import tomlkit

    SETTINGS_BY_NAME[name]  # a known setting, or KeyError
    try:
        doc = tomlkit.parse(path.read_text(encoding="utf-8")) if path.exists() else tomlkit.document()
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.ParseError) as exc:
        raise ConfigError(f"cannot update the config file {path}: {exc}", hint="fix the file, then run again") from None
    names = {n for n in (model, model_file, Path(model_file).name if model_file else None) if n}
    entry = next((e for e in doc.get("models", []) if e.get("model") in names), None)
    (entry if entry is not None else doc)[name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(doc), encoding="utf-8")
    return f"{path} ([[models]] {entry['model']})" if entry is not None else str(path)


def default_of(name: str) -> Any:
    """A setting's default, from its one declaration (for values built without a resolved config: the
    worker's, guard's and server's own configs in tests, a broker opened by hand)."""
    return SETTINGS_BY_NAME[name].default({})


def env_rows() -> list[tuple[str, str]]:
    """(variable, description) for every setting, for --help."""
    return [(s.env, s.description) for s in SETTINGS]
