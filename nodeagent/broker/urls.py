"""Broker URLs: what each form names, parsed once, and shown with its passwords masked.

- ``sqlite:///path/queue.db`` (or nothing: ``queue.db`` in NODEAGENT_HOME);
- ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) and ``unix:///path.sock``, as redis-py reads
  them;
- ``redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db][?options]`` and
  ``rediss+sentinel://...`` (TLS to the Sentinels and to the data nodes): the primary of ``service_name`` is found
  through the Sentinels, again after every failover. ``user:password`` are the data nodes' credentials; the
  Sentinels' own are ``sentinel_username`` and ``sentinel_password`` in the query. A host without a port is on
  Sentinel's 26379. The TLS options are redis-py's own: ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
  ``ssl_cert_reqs`` (``required``, ``optional``, ``none``) and ``ssl_check_hostname``.

Pure: nothing here connects. ``shown`` is the one way a broker URL is printed (logs, errors, pages, ``config
show``): a password anywhere in it is replaced by ``***``.
"""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import parse_qsl, quote, unquote

from nodeagent.errors import ConfigError
from nodeagent.values import Frozen

SENTINEL_PORT = 26379
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
REDIS_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES)
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", *TLS_OPTIONS)
FORM = "redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]"
_SECRET_QUERY = re.compile(r"((?:^|[?&;])[^=&;]*(?:password|secret|token)[^=&;]*=)[^&;#]*", re.IGNORECASE)


class SentinelTarget(Frozen):
    """A ``redis+sentinel://`` URL, parsed."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_username: str | None = None
    sentinel_password: str | None = None
    tls: bool = False
    tls_options: dict[str, str | bool] = {}


def scheme(url: str | None) -> Literal["sqlite", "redis"]:
    """Which engine a URL names (nothing: the embedded SQLite queue); ConfigError for anything else."""
    if not url or url.startswith("sqlite:"):
        return "sqlite"
    if url.split("://", 1)[0].lower() in REDIS_SCHEMES and "://" in url:
        return "redis"
    raise ConfigError(f"unknown broker URL {shown(url)!r}",
                      hint=f"use sqlite:///path/queue.db, redis://host:6379/0, rediss://... (TLS) or {FORM}")


def is_sentinel(url: str | None) -> bool:
    return bool(url) and url.split("://", 1)[0].lower() in SENTINEL_SCHEMES  # type: ignore[union-attr]


def parse_sentinel(url: str) -> SentinelTarget:
    """A Sentinel URL's parts; ConfigError with the expected form for one that does not parse."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"bad Sentinel broker URL {shown(url)!r}: {why}", hint=f"write {FORM}")

    kind, _, rest = url.partition("://")
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = unquote(user) or None, (unquote(secret) if colon else None)
    sentinels = tuple(_host_port(h.strip(), bad) for h in hosts.split(",") if h.strip())
    if not sentinels:
        raise bad("no Sentinel host:port is given")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise bad("no service name (the name the Sentinels monitor the primary under, e.g. mymaster)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise bad(f"the path /{path} is not /service_name or /service_name/db")
    options: dict[str, str] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in SENTINEL_OPTIONS:
            raise bad(f"unknown option {key!r} (known: {', '.join(SENTINEL_OPTIONS)})")
        options[key] = value
    tls_options: dict[str, str | bool] = {k: v for k, v in options.items() if k in TLS_OPTIONS}
    if "ssl_check_hostname" in tls_options:
        tls_options["ssl_check_hostname"] = str(tls_options["ssl_check_hostname"]).lower() in ("1", "true", "yes")
    if tls_options and kind.lower() != "rediss+sentinel":
        raise bad(f"{', '.join(tls_options)} need TLS: write rediss+sentinel://")
    return SentinelTarget(sentinels=sentinels, service=unquote(parts[0]), db=int(parts[1]) if len(parts) == 2 else 0,
                          username=username, password=password,
                          sentinel_username=options.get("sentinel_username") or None,
                          sentinel_password=options.get("sentinel_password") or None,
                          tls=kind.lower() == "rediss+sentinel", tls_options=tls_options)


def _host_port(text: str, bad) -> tuple[str, int]:  # type: ignore[no-untyped-def]
    if text.startswith("["):  # [::1]:26379
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise bad(f"{text!r} is not host:port")
    try:
        number = int(port) if port else SENTINEL_PORT
    except ValueError:
        raise bad(f"{text!r} has no port number") from None
    if not 0 < number < 65536:
        raise bad(f"{text!r}: the port is not between 1 and 65535")
    return host, number


def password_of(url: str) -> str | None:
    """The password a Redis URL carries in its userinfo, if any (percent-decoded)."""
    found = re.match(r"[^:/]+://([^/@?#]*)@", url)
    if not found or ":" not in found.group(1):
        return None
    return unquote(found.group(1).split(":", 1)[1]) or None


def with_password(url: str, password: str) -> str:
    """A Redis URL with ``password`` in its userinfo (a URL that has one already is returned as it is)."""
    if password_of(url) is not None:
        return url
    kind, _, rest = url.partition("://")
    user, at, hosts = rest.partition("@") if "@" in rest.split("/", 1)[0] else ("", "", rest)
    return f"{kind}://{user}:{quote(password, safe='')}@{hosts}"


def without_password(url: str) -> str:
    """A Redis URL with the password taken out of its userinfo (the user kept), for a service file."""
    found = re.match(r"^([^:/]+://)([^/@?#]*)@(.*)$", url)
    if not found:
        return url
    user = found.group(2).split(":", 1)[0]
    return f"{found.group(1)}{user + '@' if user else ''}{found.group(3)}"


def shown(url: str | None) -> str:
    """A broker URL as it may be printed: every password in it (the userinfo's, a query option's) as ***."""
    if not url:
        return ""
    text = re.sub(r"(://[^/@?#]*?:)[^/@?#]*@", r"\1***@", url)
    return _SECRET_QUERY.sub(r"\1***", text)


def masked(text: str, url: str | None) -> str:
    """``text`` (an error message, a log line) with the URL's secrets masked wherever it quotes them."""
    if not url:
        return text
    text = text.replace(url, shown(url))
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


def _secrets(url: str) -> list[str]:
    found = []
    userinfo = re.search(r"://([^/@?#]*)@", url)
    if userinfo and ":" in userinfo.group(1):
        found.append(userinfo.group(1).split(":", 1)[1])
    found += [m.group(0).split("=", 1)[1] for m in _SECRET_QUERY.finditer(url)]
    secrets = [s for s in found if len(s) >= 3]
    return sorted({*secrets, *(unquote(s) for s in secrets)}, key=len, reverse=True)
