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

A password written raw with a ``/``, ``?`` or ``#`` in it (as ``openssl rand -base64`` makes them) cuts the URL short:
urllib, and so redis-py, end the authority at the first of them, so ``redis://:ab/cd@host:6379/0`` is the host ``''``
on the port ``ab`` (redis-py: "Port could not be cast to integer") and ``redis://u:12/cd@host/0`` the host ``u`` on
port 12, without a password. No client reads such a URL as it was meant, so it is refused (``raw_secret``), with a
one-line error that names percent-encoding and the password file; until then it is shown with everything up to the
``@`` that ends its userinfo masked, so that no part of the password reaches a message.
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
# an option named for a secret, its value to the option's end (a raw '#' in it too)
_SECRET_VALUE = re.compile(r"([?&;][^=&;?]*(?:password|secret|token)[^=&;]*=)[^&;]*", re.IGNORECASE)
_SECRET_NAME = re.compile(r"password|secret|token", re.IGNORECASE)  # a query option that holds a secret
# the options whose value may hold an '@' (a name, a path, a secret): anywhere else past the authority, an '@' ends a
# userinfo that a raw '/', '?' or '#' cut short
_AT_OPTIONS = frozenset({*SENTINEL_OPTIONS, "username", "password", "client_name"})
RAW_SECRET_HINT = ("percent-encode it in the URL (/ as %2F, ? as %3F, # as %23, @ as %40, % as %25), or keep the "
                   "password in a file: --broker-password-file / NODEAGENT_BROKER_PASSWORD_FILE")


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
        if raw_secret(url):  # refused before redis-py reads it as another host
            raise cut_short(url)
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
        """The URL's parts; ConfigError for one that a raw ``/``, ``?`` or ``#`` in a secret cuts short
        (``raw_secret``): redis-py would read part of the password as the host or the port, and send none."""
        if raw_secret(url):
            raise cut_short(url)
        return cls._read(url)

    @classmethod
    def _read(cls, url: str) -> "UrlParts":
        """The parts as ``urlsplit`` reads them, whatever the URL holds (a DSN on the page, a URL cut short's tail)."""
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


def _authority_end(rest: str) -> int:
    """Where the authority of a URL's text after ``://`` ends, as urllib reads it: at its first '/', '?' or '#'."""
    return next((i for i, c in enumerate(rest) if c in "/?#"), len(rest))


def _hosts_read(authority: str) -> bool:
    """Whether an authority without a userinfo reads as ``host[:port][,host[:port]...]``, each port all digits."""
    for entry in authority.split(","):
        if entry.startswith("["):  # [::1]:6379
            if not re.fullmatch(r"\[[0-9A-Za-z:.%]*\](?::\d+)?", entry):
                return False
            continue
        host, colon, port = entry.rpartition(":") if ":" in entry else (entry, "", "")
        if (colon and not host) or (colon and not port.isdigit()):
            return False
    return True


def _misplaced_at(kind: str, authority: str, after: str) -> bool:
    """Whether an '@' past a URL's authority (``after``: its path and query) can only end a userinfo that a raw '/'
    or '?' cut short: one in the path (a database number, a Sentinel service name; only a unix socket's path, with no
    authority before it, may hold one), in an option's name, in the value of an option that holds no name, path or
    secret, or in any option's value while the authority reads as no host (``:ab`` is a password's first part)."""
    path, _, query = after.partition("?")
    if "@" in path and not (kind == "unix" and not authority):
        return True
    for pair in query.split("&"):
        key, _, value = pair.partition("=")
        if "@" in key:
            return True
        if "@" in value and ((key not in _AT_OPTIONS and not _SECRET_NAME.search(key)) or
                             (kind != "unix" and "@" not in authority and not _hosts_read(authority))):
            return True
    return False


def raw_secret(url: str) -> bool:
    """Whether a broker URL holds a raw '/', '?' or '#' in a secret, which cuts it short (urllib and redis-py end the
    authority at the first of them): an '@' past the authority where none may stand (``_misplaced_at``), or a '#'
    anywhere (no broker URL has a fragment, and one cuts a ``sentinel_password`` short too). A ``sqlite:`` URL is a
    path, and holds no secret."""
    if "://" not in url or url.startswith("sqlite:"):
        return False
    kind, rest = url.split("://", 1)
    if "#" in rest:
        return True
    end = _authority_end(rest)
    return _misplaced_at(kind.lower(), rest[:end], rest[end:])


def cut_short(url: str) -> ConfigError:
    """The error for a broker URL that a raw '/', '?' or '#' in a secret cuts short: the URL masked, the fix named."""
    return ConfigError(f"the broker URL {shown(url)} holds a raw '/', '?' or '#' in a password, which ends the URL's "
                       "host part early: redis-py would read the rest of the password as the host, the port or the "
                       "database", hint=RAW_SECRET_HINT)


def _cut_userinfo(url: str) -> tuple[str, str] | None:
    """A URL cut short by a raw '/', '?' or '#' in its userinfo, split as its writer meant it: (userinfo, the rest)
    at the first '@' after which the rest reads as a URL of its own (hosts, no '@' out of place, no '#' but in a
    secret option's value, masked); None when no '@' gives one."""
    kind, rest = url.split("://", 1)
    for i, c in enumerate(rest):
        if c != "@":
            continue
        tail = _SECRET_VALUE.sub(r"\1***", rest[i + 1:])
        end = _authority_end(tail)
        if "#" in tail or "@" in tail[:end] or _misplaced_at(kind.lower(), tail[:end], tail[end:]):
            continue
        if kind.lower() != "unix" and not _hosts_read(tail[:end]):
            continue
        return rest[:i], tail
    return None


def _shown_cut(url: str) -> str:
    """A URL cut short (``raw_secret``) as it may be printed: its userinfo's password (all of it, when it names no
    user) and every secret option's value as ***; where no '@' reads as the userinfo's end, all but the scheme."""
    kind = url.split("://", 1)[0]
    split = _cut_userinfo(url)
    if split is not None:
        userinfo, tail = split
        name, colon, _ = userinfo.partition(":")
        try:
            parts = UrlParts._read(f"{kind}://{tail}")
        except ValueError:  # a host urlsplit refuses: nothing but the scheme
            return f"{kind}://***"
        return _shown_any(parts.model_copy(update={"user": (unquote(name) or None) if colon else None,
                                                   "password": "***"}))
    if "@" not in url:  # a '#' alone: in a secret option's value, masked to the option's end
        return _SECRET_VALUE.sub(r"\1***", url)
    return f"{kind}://***"


def _cut_secrets(url: str) -> list[str]:
    """The secrets of a URL cut short, as written and in the pieces its raw '/', '?' and '#' make of them (what an
    error quoting the URL's parts could echo)."""
    rest = url.split("://", 1)[1]
    split = _cut_userinfo(url)
    userinfo = split[0] if split is not None else rest.rpartition("@")[0]
    password = userinfo.partition(":")[2] if ":" in userinfo else userinfo
    found = [password, *re.split(r"[/?#@:]", password)] if password else []
    found += [m.group(0).split("=", 1)[1] for m in _SECRET_VALUE.finditer(url)]
    return found


def secret_names(url: str) -> list[str]:
    """The names of the secrets a broker URL carries (``UrlParts.secrets``' keys), one cut short (``raw_secret``) too:
    its password, when it has a userinfo, and each option named for a secret."""
    if not raw_secret(url):
        return list(UrlParts.of(url).secrets())
    rest, split = url.split("://", 1)[1], _cut_userinfo(url)
    names = ["broker-password"] if "@" in rest else []
    for m in _SECRET_VALUE.finditer(split[1] if split is not None else rest if "@" not in rest else ""):
        key = m.group(1)[1:-1]
        names.append("broker-sentinel-password" if key == "sentinel_password" else f"broker-{key}")
    return list(dict.fromkeys(names))


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
    if raw_secret(url):
        return _shown_cut(url)
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
        broker = found.split("://", 1)[0].lower() in REDIS_SCHEMES
        if raw_secret(found) if broker else _cut_dsn(found):
            return _shown_cut(found)
        try:
            parts = UrlParts._read(found)
        except ValueError:
            return found
        if not parts.password and not any(_SECRET_NAME.search(k) for k, _ in parts.query):
            return found
        return shown(found) if found.startswith(("redis", "unix")) else _shown_any(parts)

    return _BEARER.sub(lambda m: f"{m.group(1)} ***", _ANY_URL.sub(url, text))


def _cut_dsn(url: str) -> bool:
    """Whether any URL (a DSN in a task's text) reads as one a raw '/', '?' or '#' in its password cut short: an
    authority of ``user:first part`` that reads as no host and port, with an '@' after it."""
    rest = url.split("://", 1)[1]
    end = _authority_end(rest)
    authority = rest[:end]
    return "@" not in authority and ":" in authority and "@" in rest[end:] and not _hosts_read(authority)


def _shown_any(parts: UrlParts) -> str:
    options = tuple((k, "***" if _SECRET_NAME.search(k) and v else v) for k, v in parts.query)
    return parts.model_copy(update={"query": options}).url("***" if parts.password else None).replace("%2A%2A%2A",
                                                                                                      "***")


def _secrets(url: str) -> list[str]:
    try:
        found = _cut_secrets(url) if raw_secret(url) else \
            list(UrlParts.of(url).secrets().values()) if "://" in url else []
    except ValueError:
        found = []
    found += [m.group(0).split("=", 1)[1] for m in _SECRET_QUERY.finditer(url)]
    secrets = [s for s in found if len(s) >= 3]
    return sorted({*secrets, *(quote(s, safe="") for s in secrets), *(unquote(s) for s in secrets)}, key=len,
                  reverse=True)
