"""The queue host as `nodeagent broker setup` prints it: a real redis-server started with the configuration and the
ACL file it prints (on loopback, in a folder of the test's), and a fleet that connects as its user, with the
password in a file: a task submitted and served, `nodeagent doctor` clean, and nothing else allowed."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess

import pytest
import redis
from conftest import cli, free_port


@pytest.fixture
def queue_host(tmp_path, isolated_env):
    """The printed set-up applied to a redis-server of the test's own; yields (recipe, the nodes' environment)."""
    port = free_port()
    password_file = tmp_path / "secrets" / "broker.password"
    out = cli(["broker", "setup", "--host", "127.0.0.1", "--bind", "127.0.0.1", "--port", str(port),
               "--network", "127.0.0.0/8", "--password-file", str(password_file), "--json"], isolated_env)
    recipe = json.loads(out.stdout)
    acl = tmp_path / "nodeagent.acl"
    acl.write_text(recipe["acl"])
    conf = tmp_path / "redis.conf"
    conf.write_text(recipe["redis_conf"].replace("aclfile /etc/redis/nodeagent.acl", f"aclfile {acl}")
                    + f"dir {tmp_path}\n")
    server = subprocess.Popen([shutil.which("redis-server") or "redis-server", str(conf)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    probe = redis.Redis(port=port)
    for _ in range(200):
        try:
            probe.ping()
        except redis.AuthenticationError:
            break  # up, and refusing the default user
        except redis.ConnectionError:
            import time

            time.sleep(0.025)
    env = {**isolated_env, **recipe["node_env"], "NODEAGENT_BROKER_PASSWORD_FILE": str(password_file)}
    yield recipe, env, port
    server.terminate()
    server.wait(10)


def test_the_printed_set_up_serves_a_fleet_through_its_limited_user(queue_host, tmp_path):
    recipe, env, port = queue_host
    password_file = tmp_path / "secrets" / "broker.password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    password = password_file.read_text().strip()
    assert password not in recipe["acl"] and password not in json.dumps(recipe["steps"])  # hashed in the ACL
    assert recipe["url"] == f"redis://nodeagent@127.0.0.1:{port}/0"
    assert recipe["firewall"][0] == f"sudo ufw allow from 127.0.0.0/8 to any port {port} proto tcp"
    submitted = json.loads(cli(["submit", "classify", "--labels", "bug,question", "--text", "it crashes", "--json"],
                               env).stdout)
    worker = cli(["worker", "--model", "fake", "--burst"], env)
    assert "1 completed, 0 failed" in worker.stderr and password not in worker.stderr
    shown = json.loads(cli(["tasks", "show", submitted["task_id"], "--json"], env).stdout)
    assert shown["result"]["status"] == "ok"
    checks = {c["name"]: c for c in json.loads(cli(["doctor", "--json"], {**env, "NODEAGENT_OFFLINE": "1"},
                                                   check=False).stdout)["checks"]}
    assert {n: c["status"] for n, c in checks.items() if n.startswith("broker")} == {
        "broker": "ok", "broker server": "ok", "broker eviction": "ok", "broker memory": "ok",
        "broker persistence": "ok", "broker replicas": "ok"}
    assert password not in json.dumps(checks)
    # nothing else gets in: the default user is off, and the fleet's user reaches only nodeagent's keys
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port).ping()
    user = redis.Redis(port=port, username="nodeagent", password=password)
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.set("somebody-elses:key", "x")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.flushall()


def test_the_printed_steps_read_as_a_person_runs_them(isolated_env, tmp_path):
    out = cli(["broker", "setup", "--host", "queue-host", "--password-file", str(tmp_path / "pw")], isolated_env)
    lines = out.stdout.splitlines()
    assert lines[0] == "# On the queue host:" and "sudo apt-get install -y redis-server" in lines
    assert "export NODEAGENT_BROKER=redis://nodeagent@queue-host:6379/0" in lines
    assert f"export NODEAGENT_BROKER_PASSWORD_FILE={tmp_path / 'pw'}" in lines
    assert "give --network CIDR" in out.stdout and "made a password" in out.stderr
    again = cli(["broker", "setup", "--password-file", str(tmp_path / "pw")], isolated_env)
    assert "made a password" not in again.stderr  # the same password: it was there
    bad = cli(["broker", "setup", "--network", "192.168.1.300/24", "--password-file", str(tmp_path / "pw")],
              isolated_env, check=False)
    assert bad.returncode == 2 and "is not a network" in bad.stderr and "Traceback" not in bad.stderr
