"""A real Redis primary, a replica and three Sentinels on loopback (Debian's `redis-server`, and `redis-server
--sentinel`), for the tests of a broker whose host fails: the primary is killed with SIGKILL, the Sentinels promote
the replica, and the old primary, started again as its service manager would, comes back as a replica."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

SERVICE = "mymaster"


def make_certs(folder: Path) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 and localhost (openssl), for TLS on loopback."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
        "-subj", "/CN=nodeagent-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (folder / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"cert": str(folder / "server.crt"), "key": str(folder / "server.key"), "ca": str(folder / "ca.crt")}


def tls_args(tls: dict[str, str] | None, port: int) -> list[str]:
    """A server's listening options: plain on ``port``, or TLS only on it (and TLS to the primary it replicates)."""
    if not tls:
        return ["--port", str(port)]
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls["cert"], "--tls-key-file", tls["key"],
            "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no", "--tls-replication", "yes"]


def client(port: int, tls: dict[str, str] | None = None, **kw) -> redis.Redis:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    extra = {"ssl": True, "ssl_ca_certs": tls["ca"]} if tls else {}
    return redis.Redis(port=port, retry=Retry(NoBackoff(), 0), **extra, **kw)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DataNode:
    """One redis-server (the primary or a replica), AOF on as docs/operations.md asks."""

    def __init__(self, folder: Path, replica_of: int | None = None, extra: tuple[str, ...] = (),
                 tls: dict[str, str] | None = None, engine: str = "redis") -> None:
        from conftest import server_binary

        self.folder, self.port, self.tls = folder, _free_port(), tls
        folder.mkdir(parents=True, exist_ok=True)
        self.args = [server_binary(engine), *tls_args(tls, self.port), "--bind", "127.0.0.1",
                     "--dir", str(folder), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
                     "--maxmemory-policy", "noeviction", "--maxmemory", "1gb", "--daemonize", "no",
                     "--protected-mode", "yes", *extra]
        if replica_of is not None:
            self.args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DataNode":
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = client(self.port, self.tls)
        for _ in range(400):
            try:
                probe.ping()
                return self
            except redis.AuthenticationError:  # up, behind a password
                return self
            except (redis.ConnectionError, redis.exceptions.BusyLoadingError):
                time.sleep(0.025)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def role(self) -> str:
        return client(self.port, self.tls, decode_responses=True).info("replication")["role"]


class SentinelFleet:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels (quorum 2) on free loopback ports, with a failover
    that starts 1 s after the primary stops answering."""

    def __init__(self, folder: Path, replicas: int = 1, sentinels: int = 3, down_after_ms: int = 1000,
                 tls: dict[str, str] | None = None) -> None:
        from tcpproxy import LaggingProxy

        self.folder, self.tls = folder, tls
        self.primary = DataNode(folder / "primary", tls=tls)
        # each replica follows the primary through a proxy that can make it fall behind (``lag``)
        self.links = [LaggingProxy(self.primary.port) for _ in range(replicas)]
        self.replicas = [DataNode(folder / f"replica{i}", replica_of=link.port, tls=tls)
                         for i, link in enumerate(self.links)]
        self.sentinel_ports = [_free_port() for _ in range(sentinels)]
        self.down_after_ms = down_after_ms
        self.sentinel_procs: list[subprocess.Popen] = []

    @property
    def data_nodes(self) -> list[DataNode]:
        return [self.primary, *self.replicas]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        if self.tls:
            return f"rediss+sentinel://{hosts}/{SERVICE}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> "SentinelFleet":
        self.primary.start()
        for r in self.replicas:
            r.start()
        for i, port in enumerate(self.sentinel_ports):
            conf = self.folder / f"sentinel{i}.conf"
            listen = (f"port 0\ntls-port {port}\ntls-cert-file {self.tls['cert']}\ntls-key-file {self.tls['key']}\n"
                      f"tls-ca-cert-file {self.tls['ca']}\ntls-auth-clients no\ntls-replication yes\n"
                      if self.tls else f"port {port}\n")
            conf.write_text(f"{listen}bind 127.0.0.1\ndir {self.folder}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary.port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
                            f"sentinel failover-timeout {SERVICE} 10000\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            self.sentinel_procs.append(subprocess.Popen([shutil.which("redis-server") or "redis-server", str(conf),
                                                         "--sentinel"], stdout=subprocess.DEVNULL,
                                                        stderr=subprocess.DEVNULL))
        self.wait_until(lambda: self.primary_port() == self.primary.port and self._synced(), 30, "the topology")
        return self

    def _synced(self) -> bool:
        info = client(self.primary.port, self.tls, decode_responses=True).info("replication")
        seen = [client(p, self.tls, decode_responses=True).sentinel_master(SERVICE) for p in self.sentinel_ports]
        online = sum(1 for i in range(int(info["connected_slaves"])) if info[f"slave{i}"]["state"] == "online")
        return (online == len(self.replicas)
                and all(int(m["num-other-sentinels"]) == len(self.sentinel_ports) - 1 for m in seen)
                and all(int(m["num-slaves"]) == len(self.replicas) for m in seen))

    def primary_port(self) -> int | None:
        """The primary's port as the first Sentinel that answers names it."""
        for p in self.sentinel_ports:
            try:
                addr = client(p, self.tls, decode_responses=True, socket_timeout=1).sentinel_get_master_addr_by_name(
                    SERVICE)
                if addr:
                    return int(addr[1])
            except redis.RedisError:
                continue
        return None

    def current_primary(self) -> DataNode:
        port = self.primary_port()
        return next(n for n in self.data_nodes if n.port == port)

    def lag(self) -> None:
        """The replicas stop receiving the primary's writes (their links hold them back), while the primary goes on
        acknowledging: what it acknowledges now is on no replica."""
        for link in self.links:
            link.hold()

    def kill_primary(self) -> DataNode:
        """SIGKILL the primary the Sentinels name now; returns it (start it again with ``.start()``)."""
        node = self.current_primary()
        node.kill()
        return node

    def wait_failover(self, old: DataNode, timeout_s: float = 30) -> DataNode:
        self.wait_until(lambda: self.primary_port() not in (None, old.port), timeout_s, "a failover")
        return self.current_primary()

    @staticmethod
    def wait_until(test, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if test():
                    return
            except (redis.RedisError, StopIteration):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{what} did not happen within {timeout_s} s")

    def stop(self) -> None:
        for p in self.sentinel_procs:
            if p.poll() is None:
                p.terminate()
                p.wait(10)
        for n in self.data_nodes:
            n.stop()
        for link in self.links:
            link.close()
