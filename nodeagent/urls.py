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
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit

from nodeagent.errors import ConfigError
from nodeagent.values import Frozen

SENTINEL_PORT = 26379
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
REDIS_SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES)
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password", *TLS_OPTIONS)
FORM = "redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db]"
_SECRET_QUERY = re.compile(r"((?:^|[?&;])[^=&;]*(?:password|secret|token)[^=&;]*=)[^&;#]*", re.IGNORECASE)
_SECRET_NAME = re.compile(r"password|secret|token", re.IGNORECASE)  # a query option that holds a secret


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

    try:
        url_parts = UrlParts.of(url)
    except ValueError as exc:
        raise bad(str(exc)) from None
    kind, username, password = url_parts.scheme, url_parts.user, url_parts.password
    path = url_parts.path.lstrip("/")
    sentinels = tuple(_host_port(h.strip(), bad) for h in url_parts.hosts.split(",") if h.strip())
    if not sentinels:
        raise bad("no Sentinel host:port is given")
    parts = [p for p in path.split("/") if p]
    if not parts:
        raise bad("no service name (the name the Sentinels monitor the primary under, e.g. mymaster)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise bad(f"the path /{path} is not /service_name or /service_name/db")
    options: dict[str, str] = {}
    for key, value in url_parts.query:
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


class UrlParts(Frozen):
    """A broker URL read as redis-py reads it (``urllib.parse.urlsplit``): the userinfo is everything before the
    authority's last ``@``, the password what follows its first ``:``, both percent-decoded."""

    scheme: str
    user: str | None = None
    password: str | None = None
    hosts: str = ""
    path: str = ""
    query: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, url: str) -> "UrlParts":
        parts = urlsplit(url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        user = password = None
        if at:
            name, colon, secret = userinfo.partition(":")
            user, password = unquote(name) or None, (unquote(secret) if colon else None)
        return cls(scheme=parts.scheme, user=user, password=password, hosts=hosts, path=parts.path,
                   query=tuple(parse_qsl(parts.query, keep_blank_values=True)))

    def url(self, password: str | None = None, secret_options: bool = True) -> str:
        """The URL again, its password ``password`` (None: none), without the options that hold a secret unless
        ``secret_options``."""
        userinfo = quote(self.user or "", safe="") + (f":{quote(password, safe='')}" if password is not None else "")
        options = [(k, v) for k, v in self.query if secret_options or not _SECRET_NAME.search(k)]
        return (f"{self.scheme}://{userinfo + '@' if userinfo else ''}{self.hosts}{self.path}"
                + (f"?{urlencode(options, safe='/,:')}" if options else ""))

    def secrets(self) -> dict[str, str]:
        """Every secret the URL carries, by the name of the file a service keeps it in: ``broker-password`` (the
        data nodes'), ``broker-sentinel-password`` (the Sentinels'), and any other query option that holds one."""
        found = {"broker-password": self.password} if self.password else {}
        for key, value in self.query:
            if _SECRET_NAME.search(key) and value:
                found["broker-sentinel-password" if key == "sentinel_password" else f"broker-{key}"] = value
        return found


def password_of(url: str) -> str | None:
    """The password a Redis URL carries in its userinfo, if any (percent-decoded; everything up to the last ``@``
    of the authority, as redis-py reads it)."""
    return UrlParts.of(url).password or None


def with_secrets(url: str, password: str | None = None, sentinel_password: str | None = None) -> str:
    """A Redis URL given the secrets a service keeps in files: ``password`` in its userinfo, ``sentinel_password``
    as its query option (what the URL carries already is kept as it is)."""
    parts = UrlParts.of(url)
    if password is not None and parts.password is None:
        url = parts.url(password)
        parts = UrlParts.of(url)
    if sentinel_password is not None and not dict(parts.query).get("sentinel_password"):
        sep = "&" if parts.query else "?"
        url = f"{url}{sep}sentinel_password={quote(sentinel_password, safe='')}"
    return url


def without_secrets(url: str) -> str:
    """A Redis URL with every secret taken out (the user kept), for a unit, a plist or a command line: the password
    and the Sentinels' go into files the service reads (``UrlParts.secrets``)."""
    if "://" not in url or url.startswith("sqlite:"):
        return url
    parts = UrlParts.of(url)
    return parts.url(None, secret_options=False)


def shown(url: str | None) -> str:
    """A broker URL as it may be printed: every password in it (the userinfo's, a query option's) as ***."""
    if not url:
        return ""
    if "://" in url and not url.startswith("sqlite:"):
        try:
            parts = UrlParts.of(url)
        except ValueError:  # not a URL urlsplit reads: masked by its patterns below
            parts = None
        if parts is not None:
            return _shown_any(parts)
    text = re.sub(r"(://[^/?#]*?:)[^/?#]*@", r"\1***@", url)
    return _SECRET_QUERY.sub(r"\1***", text)


def masked(text: str, url: str | None) -> str:
    """``text`` (an error message, a log line) with the URL's secrets masked wherever it quotes them."""
    if not url:
        return text
    text = text.replace(url, shown(url))
    for secret in _secrets(url):
        text = text.replace(secret, "***")
    return text


_ANY_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]+")
_BEARER = re.compile(r"\b(Bearer|Basic|Token)\s+[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)


def masked_text(text: str) -> str:
    """Free text with the secrets it quotes masked: a password in any URL's userinfo (a DSN, read as ``UrlParts``
    reads it: up to the authority's last ``@``), a query option named for a secret, an Authorization scheme's
    credentials (``Bearer ...``)."""
    def url(m: re.Match[str]) -> str:
        found = m.group(0)
        try:
            parts = UrlParts.of(found)
        except ValueError:
            return found
        if not parts.password and not any(_SECRET_NAME.search(k) for k, _ in parts.query):
            return found
        return shown(found) if found.startswith(("redis", "unix")) else _shown_any(parts)

    return _BEARER.sub(lambda m: f"{m.group(1)} ***", _ANY_URL.sub(url, text))


def _shown_any(parts: UrlParts) -> str:
    options = tuple((k, "***" if _SECRET_NAME.search(k) and v else v) for k, v in parts.query)
    return parts.model_copy(update={"query": options}).url("***" if parts.password else None).replace("%2A%2A%2A",
                                                                                                      "***")


def _secrets(url: str) -> list[str]:
    try:
        found = list(UrlParts.of(url).secrets().values()) if "://" in url else []
    except ValueError:
        found = []
    found += [m.group(0).split("=", 1)[1] for m in _SECRET_QUERY.finditer(url)]
    secrets = [s for s in found if len(s) >= 3]
    return sorted({*secrets, *(quote(s, safe="") for s in secrets), *(unquote(s) for s in secrets)}, key=len,
                  reverse=True)
