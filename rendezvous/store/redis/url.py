"""Store URLs: where Redis is, how to talk to it, and this store's own options.

URL forms: redis://[user:password@]host:port[/db], rediss://..., unix:///path/to/socket[?db=N],
redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]. Query options of this
store: prefix (key namespace, default "rdv"), cluster (true: the address is a Redis Cluster node),
cache_size, max_watch_connections, retries, op_timeout, ping_timeout, wait_replicas and wait_timeout
(WAIT after each pipeline: see RedisOptions), sentinel_password (Sentinel only); redis-py's own go
to redis-py (socket_timeout, socket_connect_timeout, max_connections, client_name, ssl_* over TLS ...);
any other name is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS, SSLConnection


@dataclass(frozen=True)
class RedisOptions:
    """Settings of the store itself (the URL's query options; see the module docstring)."""

    prefix: str = "rdv"
    cache_size: int = 16_384
    max_watch_connections: int = 256
    retries: int = 2
    op_timeout: float = 5.0
    ping_timeout: float = 1.0
    cluster: bool = False
    wait_replicas: int = 0
    """After each pipeline, WAIT until this many replicas have its writes (0: do not wait); a pipeline that
    reaches fewer within wait_timeout fails with StoreUnavailableError (its writes are on the master, not
    acknowledged). Bounds what a failover loses, at a round trip to the replicas per pipeline."""
    wait_timeout: float = 0.5
    """Seconds; keep it below socket_timeout (default 1 s), which bounds the WAIT reply too."""

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{} "):
            raise ValueError(f"prefix {self.prefix!r} must be non-empty, without braces or spaces")
        if self.cache_size < 0 or self.max_watch_connections < 1 or self.retries < 0:
            raise ValueError("cache_size >= 0, max_watch_connections >= 1 and retries >= 0 are required")
        if self.op_timeout <= 0 or self.ping_timeout <= 0:
            raise ValueError("op_timeout and ping_timeout must be positive")
        if self.wait_replicas < 0 or self.wait_timeout <= 0:
            raise ValueError("wait_replicas >= 0 and a positive wait_timeout are required")
        if self.wait_replicas and self.cluster:
            raise ValueError("wait_replicas is not supported on Redis Cluster")


def _boolean(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(value)


_OPTION_TYPES: Mapping[str, Callable[[str], Any]] = {
    "prefix": str,
    "cache_size": int,
    "max_watch_connections": int,
    "retries": int,
    "op_timeout": float,
    "ping_timeout": float,
    "cluster": _boolean,
    "wait_replicas": int,
    "wait_timeout": float,
}


# The query options passed on to redis-py: those it parses from a URL itself (timeouts, db, protocol, ...) and
# a few of its connections' string settings, plus, over TLS, its SSL connection's (ssl_certfile, ssl_ca_certs,
# ...). Anything else would reach a connection's constructor unchecked: an unknown name as a TypeError at the
# store's start, `decode_responses` as replies this store cannot read.
_REDIS_PY_OPTIONS = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {"max_connections", "client_name", "username", "password"}
_SSL_OPTIONS = frozenset(p for p in inspect.signature(SSLConnection).parameters if p.startswith("ssl_"))

# Connection defaults; the URL's query overrides them.
_CONNECTION_DEFAULTS: Mapping[str, Any] = {
    "socket_connect_timeout": 1.0,
    "socket_timeout": 1.0,
    "max_connections": 64,
}


@dataclass(frozen=True)
class RedisTarget:
    """A parsed store URL: where Redis is and how to talk to it."""

    url: str
    """The URL for redis-py (redis://, rediss://, unix://) with this store's options removed; "" for Sentinel."""
    options: RedisOptions
    connection: Mapping[str, Any] = field(default_factory=dict)
    """Connection settings: the defaults, then the URL's query (for Sentinel, also username/password/db)."""
    sentinels: tuple[tuple[str, int], ...] = ()
    service: str = ""
    sentinel_password: str | None = None


_PORT_RANGE = "port out of range 1-65535"


def parse_url(url: str) -> RedisTarget:
    """Split a store URL into redis-py's part and this store's options; ValueError when malformed."""
    try:
        split = urlsplit(url)
        # One host (a sentinel URL: host:port each, below): a port that is not a number, or past 65535, is refused
        # here, not at the first connection.
        if split.scheme in ("redis", "rediss") and split.port == 0:
            raise ValueError(_PORT_RANGE)
    except ValueError as err:  # "Invalid IPv6 URL", "Port could not be cast to integer value", "Port out of range"
        reason = _PORT_RANGE if "out of range" in str(err) else err  # Python's says 0-65535, but 0 is refused too
        raise ValueError(f"store URL {url!r}: {reason}") from None
    ours: dict[str, Any] = {}
    theirs: list[tuple[str, str]] = []
    sentinel_password = None
    for key, value in parse_qsl(split.query, keep_blank_values=True):
        if key in _OPTION_TYPES:
            try:
                ours[key] = _OPTION_TYPES[key](value)
            except ValueError:
                raise ValueError(
                    f"store URL option {key}={value!r} is not a valid {_OPTION_TYPES[key].__name__}"
                ) from None
        elif key == "sentinel_password":
            sentinel_password = value
        elif key in _REDIS_PY_OPTIONS or (split.scheme == "rediss" and key in _SSL_OPTIONS):
            theirs.append((key, value))
        else:
            raise ValueError(f"store URL {url!r}: unknown option {key!r} (neither this store's nor redis-py's)")
    options = RedisOptions(**ours)
    connection: dict[str, Any] = dict(_CONNECTION_DEFAULTS)
    for key, value in theirs:
        parser = URL_QUERY_ARGUMENT_PARSERS.get(key)
        connection[key] = parser(value) if parser else value
    if split.scheme in ("redis", "rediss", "unix"):
        if split.scheme != "unix" and not split.hostname:
            raise ValueError(f"store URL {url!r} names no host")
        if split.scheme == "unix" and not split.path:
            raise ValueError(f"store URL {url!r} names no socket path")
        if options.cluster and (split.scheme == "unix" or split.path.strip("/") not in ("", "0")):
            raise ValueError(f"store URL {url!r}: Redis Cluster takes a TCP address and database 0")
        return RedisTarget(url.partition("?")[0].partition("#")[0], options, connection)
    if split.scheme == "redis+sentinel":
        if options.cluster:
            raise ValueError(f"store URL {url!r}: Sentinel and Cluster do not mix")
        userinfo, _, hosts = split.netloc.rpartition("@")
        sentinels = []
        for host_port in hosts.split(","):
            host, _, port = host_port.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"sentinel address {host_port!r} in {url!r} is not host:port")
            if not 1 <= int(port) <= 65535:
                raise ValueError(f"sentinel address {host_port!r} in {url!r}: {_PORT_RANGE}")
            sentinels.append((host.strip("[]"), int(port)))
        parts = [unquote(p) for p in split.path.split("/") if p]
        if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"store URL {url!r} must end in /service_name or /service_name/db")
        if userinfo:
            username, has_password, password = userinfo.partition(":")
            if username:
                connection["username"] = unquote(username)
            if has_password:
                connection["password"] = unquote(password)
        if len(parts) == 2:
            connection["db"] = int(parts[1])
        return RedisTarget("", options, connection, tuple(sentinels), parts[0], sentinel_password)
    raise ValueError(f"store URL {url!r}: use redis://, rediss://, unix:// or redis+sentinel://")


__all__ = ["RedisOptions", "RedisTarget", "parse_url"]
