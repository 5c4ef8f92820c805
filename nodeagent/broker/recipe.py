"""The queue host's set-up, as `nodeagent broker setup` prints it: Redis reachable from the fleet's network, only
through a user limited to nodeagent's keys, persistent (the append-only file) and never evicting, behind a firewall
line, and the settings each node then gives its broker. Pure: the caller reads or makes the password, and decides
what to do with the text.

The ACL user may run what nodeagent runs (streams, hashes, sorted sets, its Lua scripts, WAIT, TIME, SCAN over its
own keys) and INFO and CONFIG GET for `nodeagent doctor`, on keys that start with ``nodeagent:`` only; not the
dangerous commands (FLUSHALL, CONFIG SET, SHUTDOWN, DEBUG, KEYS, ...). The default user is off, so nothing reaches
Redis without the password. The password is stored hashed (SHA-256) in the ACL file.
"""

from __future__ import annotations

import hashlib
import ipaddress

from pydantic import Field

from nodeagent.values import Frozen

CONF_PATH = "/etc/redis/nodeagent.conf"
ACL_PATH = "/etc/redis/nodeagent.acl"
KEYS = "~nodeagent:*"
COMMANDS = "+@all -@dangerous +info +config|get"


class Recipe(Frozen):
    """What the queue host is given, and what each node is told."""

    redis_conf: str = Field(description="Lines for redis.conf (a file of their own, included from it)")
    acl: str = Field(description="The ACL file: the default user off, nodeagent's user limited to its keys")
    firewall: list[str] = Field(default_factory=list, description="Commands that let only the fleet's network in")
    steps: list[str] = Field(description="The commands to run on the queue host, in order")
    node_env: dict[str, str] = Field(description="What each node, gateway and orchestrator sets")
    url: str = Field(description="The broker URL they are given (its password in a file, not in it)")


def acl_line(user: str, password: str) -> str:
    return f"user {user} on #{hashlib.sha256(password.encode()).hexdigest()} {KEYS} &* {COMMANDS}"


def recipe(host: str, password: str, user: str = "nodeagent", bind: str = "0.0.0.0", port: int = 6379,
           network: str | None = None, password_file: str = "~/.config/nodeagent/broker.password",
           conf_path: str = CONF_PATH, acl_path: str = ACL_PATH) -> Recipe:
    """The set-up for a queue host named ``host`` (as the nodes reach it), listening on ``bind``:``port``, its user
    ``user`` with ``password``; ``network`` (a CIDR) is what the firewall lets in."""
    if network is not None:
        ipaddress.ip_network(network, strict=False)  # ValueError for one that is not a network
    conf = "\n".join([
        "# nodeagent's queue (nodeagent broker setup): reachable from the fleet, durable, never evicting",
        f"bind {bind}", f"port {port}", "protected-mode yes",
        "appendonly yes", "appendfsync everysec", "maxmemory-policy noeviction",
        "# what the fleet keeps levels off at its rate: `nodeagent doctor` says where (broker memory)",
        "maxmemory 1gb",
        f"aclfile {acl_path}", ""])
    acl = "\n".join(["user default off", acl_line(user, password), ""])
    firewall = []
    if network:
        firewall = [f"sudo ufw allow from {network} to any port {port} proto tcp",
                    f"sudo ufw deny {port}/tcp"]
    steps = ["sudo apt-get install -y redis-server",
             f"sudo tee {conf_path} >/dev/null <<'EOF'\n{conf}EOF",
             f"sudo tee {acl_path} >/dev/null <<'EOF'\n{acl}EOF",
             f"sudo chown redis:redis {acl_path} && sudo chmod 600 {acl_path}",
             f"grep -qx 'include {conf_path}' /etc/redis/redis.conf || "
             f"echo 'include {conf_path}' | sudo tee -a /etc/redis/redis.conf >/dev/null",
             "sudo systemctl restart redis-server", *firewall]
    url = f"redis://{user}@{host}:{port}/0"
    return Recipe(redis_conf=conf, acl=acl, firewall=firewall, steps=steps, url=url,
                  node_env={"NODEAGENT_BROKER": url, "NODEAGENT_BROKER_PASSWORD_FILE": password_file})
