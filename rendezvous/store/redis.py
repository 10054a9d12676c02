"""The Redis store: state shared by any number of server replicas, surviving their restarts.

Layout (rendezvous.store._scripts has the key schema): records are hashes with a version (the
global revision of the write that stored them), transitions are compare-and-set Lua scripts that
write a record, its indexes and its events at once, and each engine's events live in a Redis
Stream whose entry ids are the engine's revisions ("<revision>-0").

update_transfer is optimistic. It keeps the versions of the records it last saw; a transition is
computed on them (or, for an id it never saw, on "absent") and sent with one EVALSHA that checks
the transfer's and its engines' versions before writing. On a conflict the script answers the
current state, and the transition is computed again, so the common case costs one round trip.
A transition that fails, or changes nothing, on a state not read in this call is recomputed on a
fresh read before its answer counts. Engine records are checked the same way, so a transition
sees the transfer and its engines as of one instant, as in the memory store.

The epoch lives in Redis (SET NX once). If Redis loses its data, the epoch key is gone: the next
write or health check makes a new one and clients see the epoch change. If Redis goes back in time
with its epoch (a restart from an older AOF or RDB, a failover to a lagging replica), a replica
that saw a later revision notices (every write carries it) and starts a new epoch too.

Commands that concurrent requests issue in one event-loop iteration go out as one pipeline, and
the coordinator applies a batch's items concurrently (Store.concurrent), so a batch of transitions
costs about one round trip.

URL forms: redis://[user:password@]host:port[/db], rediss://..., unix:///path/to/socket[?db=N],
redis+sentinel://[user:password@]host:port[,host:port...]/service[/db]. Query options of this
store: prefix (key namespace, default "rdv"), cluster (true: the address is a Redis Cluster node),
cache_size, max_watch_connections, retries, op_timeout, ping_timeout, sentinel_password (Sentinel
only); anything else goes to redis-py (socket_timeout, socket_connect_timeout, max_connections,
ssl_* ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import random
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar, cast
from urllib.parse import parse_qsl, unquote, urlsplit

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from rendezvous.core.model import Addressed, Engine, State, Transfer
from rendezvous.core.transfers import Transition
from rendezvous.store._scripts import SCRIPTS, Script
from rendezvous.store.base import EngineFn, EventPage, Store, StoreCounts, StoreUnavailableError, TransferFn
from rendezvous.store.codec import (
    decode_engine,
    decode_event,
    decode_transfer,
    encode_engine,
    encode_event,
    encode_transfer,
)

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_ABSENT = b"0"
_SCAN_COUNT = 1000
_TOMBSTONE_STATES = frozenset(s for s in State if s.terminal)
_PEER_CACHE = 256
_APPEND_MEMORY_S = 300
# How long a due transfer handed to one sweeper is hidden from the others.
_SWEEP_HOLD_S = 5.0
# Longest single XREAD BLOCK: waits longer than this are several blocks, so close() is prompt.
_MAX_BLOCK_S = 1.0
# Response errors that mean "not now" rather than "wrong": loading, failover, full memory, busy.
_UNAVAILABLE_PREFIXES = (
    "LOADING",
    "MISCONF",
    "READONLY",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "OOM",
    "BUSY",
    "NOREPLICAS",
)
_UNAVAILABLE_ERRORS = (rex.ConnectionError, rex.TimeoutError, rex.ClusterError, rex.SlotNotCoveredError, OSError)


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

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in "{} "):
            raise ValueError(f"prefix {self.prefix!r} must be non-empty, without braces or spaces")
        if self.cache_size < 0 or self.max_watch_connections < 1 or self.retries < 0:
            raise ValueError("cache_size >= 0, max_watch_connections >= 1 and retries >= 0 are required")
        if self.op_timeout <= 0 or self.ping_timeout <= 0:
            raise ValueError("op_timeout and ping_timeout must be positive")


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
}

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


def parse_url(url: str) -> RedisTarget:
    """Split a store URL into redis-py's part and this store's options; ValueError when malformed."""
    split = urlsplit(url)
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
        else:
            theirs.append((key, value))
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


def _unavailable(err: Exception) -> bool:
    if isinstance(err, _UNAVAILABLE_ERRORS):
        return True
    return isinstance(err, rex.ResponseError) and str(err).startswith(_UNAVAILABLE_PREFIXES)


@contextlib.contextmanager
def _store_errors(limit: float) -> Iterator[None]:
    """Report an unreachable or unwilling Redis, or a call past its time limit, as StoreUnavailableError."""
    try:
        yield
    except TimeoutError as err:
        raise StoreUnavailableError(f"Redis did not answer within {limit:g} s") from err
    except (rex.RedisError, OSError) as err:
        if _unavailable(err):
            raise StoreUnavailableError(f"Redis is unavailable: {err}") from err
        raise


def _guarded(
    method: Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]]:
    """Bound a store call by op_timeout and map Redis failures (see _store_errors)."""

    @functools.wraps(method)
    async def guarded(self: RedisStore, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._redis is None:
            raise StoreUnavailableError("the Redis store is not open")
        limit = self.options.op_timeout
        with _store_errors(limit):
            async with asyncio.timeout(limit):
                return await method(self, *args, **kwargs)

    return cast("Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, R]]", guarded)


class _EngineEntry:
    """An engine record as last seen, with its version and (lazily) its encoded form."""

    __slots__ = ("encoded", "engine", "version")

    def __init__(self, version: bytes, engine: Engine | None) -> None:
        self.version = version
        self.engine = engine
        self.encoded: str | None = None


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A transfer record as last seen; engines is set when the engines it names were read with it."""

    version: bytes
    transfer: Transfer | None
    engines: Mapping[str, _EngineEntry] | None = None


_NEVER_SEEN = _Snapshot(_ABSENT, None, None)


class _KeyLocks:
    """Queues this process's updates of one key, so they wait here instead of conflicting in Redis.

    Conflicts then only come from other replicas; the lock of a key lives while someone holds or awaits it.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]


class _Batcher:
    """Sends the commands that tasks issue in one loop iteration as one pipeline: one write, one round trip.

    With many requests in flight this saves most of the client's per-command cost (syscalls, pool
    checkout, timeouts) and Redis's; a lone command goes out as a plain one. Replies are parsed as
    the client's own methods parse them.
    """

    def __init__(self, client: aioredis.Redis, max_in_flight: int) -> None:
        self._client = client
        self._queue: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        # Batches beyond this wait here (the pool itself would refuse them).
        self._slots = asyncio.Semaphore(max_in_flight)

    async def call(self, *args: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((args, future))
        if len(self._queue) == 1:
            task = asyncio.create_task(self._send())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        return await future

    async def _send(self) -> None:
        async with self._slots:
            await self._send_batch()

    async def _send_batch(self) -> None:
        batch, self._queue = self._queue, []
        try:
            if len(batch) == 1:
                results = [await self._single(batch[0][0])]
            else:
                pipe = self._client.pipeline(transaction=False)
                for args, _ in batch:
                    pipe.execute_command(*args)
                results = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as err:  # the connection failed: every caller of the batch gets the error
            for _, future in batch:
                if not future.done():
                    future.set_exception(err)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def close(self) -> None:
        """Cancel what is queued or being sent."""
        for _, future in self._queue:
            future.cancel()
        self._queue = []
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)

    async def _single(self, args: tuple[Any, ...]) -> Any:
        try:
            return await self._client.execute_command(*args)  # type: ignore[no-untyped-call]
        except rex.ResponseError as err:
            return err


async def _after_conflict(attempt: int) -> None:
    """Back off a little (with jitter) once a record keeps changing under us; the first retries are immediate."""
    if attempt >= 2:
        await asyncio.sleep(random.uniform(0, min(0.05, 0.0005 * 2**attempt)))


class RedisStore(Store):
    """The Store interface over Redis (standalone, Sentinel, or one Cluster slot per namespace)."""

    name = "redis"
    concurrent = True

    def __init__(self, url: str, max_events_per_engine: int = 100_000) -> None:
        self.target = parse_url(url)
        self.options = self.target.options
        self._max_events = max_events_per_engine
        self._prefix = "{" + self.options.prefix + "}:"
        self._rev_key = self._prefix + "rev"
        self._epoch_key = self._prefix + "epoch"
        self._epoch = 0
        self._high_rev = 0
        self._redis: aioredis.Redis | None = None
        self._batcher: _Batcher | None = None
        self._health: aioredis.Redis | None = None
        self._watch: aioredis.Redis | None = None
        self._sentinels: list[Sentinel] = []
        self._watch_slots = asyncio.Semaphore(self.options.max_watch_connections)
        self._transfers: dict[str, _Snapshot] = {}
        self._engines: dict[str, _EngineEntry] = {}
        self._peers: dict[bytes, Engine] = {}
        self._transfer_locks = _KeyLocks()
        self._engine_locks = _KeyLocks()

    # Connections

    def _client(self, max_connections: int, retries: int, socket_timeout: float | None = None) -> aioredis.Redis:
        kwargs = dict(self.target.connection)
        kwargs["max_connections"] = max_connections
        kwargs["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), retries)
        if socket_timeout is not None:
            kwargs["socket_timeout"] = socket_timeout
        if self.options.cluster:
            # Every key of the namespace is in one slot: the client routes each call to its node.
            return RedisCluster.from_url(self.target.url, **kwargs)  # type: ignore[return-value]
        if not self.target.sentinels:
            pool = aioredis.ConnectionPool.from_url(self.target.url, **kwargs)
            return aioredis.Redis.from_pool(pool)
        sentinel_kwargs = {k: v for k, v in kwargs.items() if k.startswith("socket_")}
        if self.target.sentinel_password is not None:
            sentinel_kwargs["password"] = self.target.sentinel_password
        sentinel = Sentinel(list(self.target.sentinels), sentinel_kwargs=sentinel_kwargs, **kwargs)  # type: ignore[no-untyped-call]
        self._sentinels.append(sentinel)
        master: aioredis.Redis = sentinel.master_for(self.target.service, redis_class=aioredis.Redis)
        return master

    async def open(self) -> None:
        if self._redis is not None:
            return
        base_timeout = float(self.target.connection.get("socket_timeout") or 1.0)
        max_connections = int(self.target.connection["max_connections"])
        # A few connections more than batches may use, for the odd direct command (loading scripts).
        self._redis = self._client(max_connections + 4, self.options.retries)
        self._batcher = _Batcher(self._redis, max_connections)
        self._health = self._client(2, 0)
        self._watch = self._client(self.options.max_watch_connections, 1, _MAX_BLOCK_S + base_timeout)
        try:
            async with asyncio.timeout(self.options.op_timeout):
                for script in SCRIPTS.values():
                    await self._redis.script_load(script.source)
                await self._check_epoch(self._redis)
        except Exception as err:
            await self.close()
            if isinstance(err, TimeoutError) or _unavailable(err):
                raise StoreUnavailableError(f"cannot reach Redis: {err}") from err
            raise

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        clients = [c for c in (self._redis, self._health, self._watch) if c is not None]
        self._redis = self._health = self._watch = None
        for client in clients:
            await client.aclose()
        for sentinel in self._sentinels:
            for s in sentinel.sentinels:
                await s.aclose()
        self._sentinels.clear()

    async def ping(self) -> bool:
        if self._health is None:
            return False
        try:
            async with asyncio.timeout(self.options.ping_timeout):
                await self._check_epoch(self._health)
        except Exception:
            return False
        return True

    # Epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def _guard(self) -> str:
        """What a write expects of Redis: this epoch, and no revision below one already seen."""
        return f"{self._epoch}:{self._high_rev}"

    async def _check_epoch(self, client: aioredis.Redis) -> None:
        """Read the epoch, or make one if Redis has none (first start, or its data was lost)."""
        stored_epoch, stored_rev = await client.mget(self._epoch_key, self._rev_key)
        if stored_epoch is None:
            await client.set(self._epoch_key, secrets.randbits(63) or 1, nx=True)
            stored_epoch, stored_rev = await client.mget(self._epoch_key, self._rev_key)
            assert stored_epoch is not None
        epoch, rev = int(stored_epoch), int(stored_rev or 0)
        if epoch != self._epoch:
            self._adopt_epoch(epoch, rev)
        elif rev < self._high_rev:
            await self._regressed(rev, epoch)
        else:
            self._high_rev = rev

    def _adopt_epoch(self, epoch: int, rev: int) -> None:
        if epoch != self._epoch:
            # Versions restart with the data, so what was seen under another epoch means nothing.
            self._epoch = epoch
            self._transfers.clear()
            self._engines.clear()
        self._high_rev = rev

    async def _epoch_changed(self, current: bytes) -> None:
        """A write found another epoch (another replica moved on) or none (the data is gone)."""
        assert self._redis is not None
        if current:
            self._adopt_epoch(int(current), 0)
        else:
            await self._check_epoch(self._redis)

    async def _regressed(self, rev: int, epoch: int) -> None:
        """Redis lost writes this process saw (it restarted from an older AOF or RDB, or failed over to a
        lagging replica) but kept its epoch. Engines may have acted on what was lost and the logs would
        reuse revisions, so start a new epoch: clients re-register and re-assert what they still want."""
        if epoch != self._epoch:
            return  # handled already
        log.warning(
            "Redis went back in time (revision %d, this replica saw %d): starting a new epoch", rev, self._high_rev
        )
        current = await self._eval(SCRIPTS["replace_epoch"], epoch, secrets.randbits(63) or 1)
        self._adopt_epoch(int(current), rev)

    async def _refused(self, reply: Sequence[Any]) -> None:
        """Act on a write's E or R reply."""
        if reply[0] == b"E":
            await self._epoch_changed(reply[1])
        else:
            await self._regressed(int(reply[1]), int(reply[2]))

    # Scripts and caches

    async def _command(self, *args: Any) -> Any:
        assert self._batcher is not None
        return await self._batcher.call(*args)

    async def _eval(self, script: Script, *args: Any) -> Any:
        assert self._redis is not None and self._batcher is not None
        try:
            return await self._batcher.call("EVALSHA", script.sha, 1, self._rev_key, self._prefix, *args)
        except rex.NoScriptError:
            # Redis restarted (or SCRIPT FLUSH): load it again.
            await self._redis.script_load(script.source)
            return await self._redis.evalsha(script.sha, 1, self._rev_key, self._prefix, *args)

    def _remember_transfer(self, transfer_id: str, snapshot: _Snapshot) -> None:
        cache = self._transfers
        cache.pop(transfer_id, None)
        cache[transfer_id] = _Snapshot(snapshot.version, snapshot.transfer) if snapshot.engines else snapshot
        if len(cache) > self.options.cache_size:
            del cache[next(iter(cache))]

    def _remember_engine(self, engine_id: str, entry: _EngineEntry) -> _EngineEntry:
        cache = self._engines
        cache.pop(engine_id, None)
        cache[engine_id] = entry
        if len(cache) > self.options.cache_size:
            del cache[next(iter(cache))]
        return entry

    def _seen_engine(self, engine_id: str, version: bytes, data: bytes) -> _EngineEntry:
        """The engine of a reply, decoded unless the cache holds that version already."""
        entry = self._engines.get(engine_id)
        if entry is not None and entry.version == version:
            return entry
        return self._remember_engine(engine_id, _EngineEntry(version, decode_engine(data) if data else None))

    def _snapshot(self, transfer_id: str, reply: Sequence[Any], offset: int) -> _Snapshot:
        """The (transfer, engines) snapshot in a read_transfer or conflict reply."""
        version, data = reply[offset], reply[offset + 1]
        engines = {}
        for i in range(offset + 2, len(reply), 3):
            engine_id = reply[i].decode()
            engines[engine_id] = self._seen_engine(engine_id, reply[i + 1], reply[i + 2])
        snapshot = _Snapshot(version, decode_transfer(data) if data else None, engines)
        self._remember_transfer(transfer_id, snapshot)
        return snapshot

    async def _read_transfer(self, transfer_id: str) -> _Snapshot:
        return self._snapshot(transfer_id, await self._eval(SCRIPTS["read_transfer"], transfer_id), 0)

    def _engines_of(self, snapshot: _Snapshot) -> Mapping[str, _EngineEntry] | None:
        """The engines a snapshot's transfer names, as last seen; None when one was never seen."""
        if snapshot.engines is not None or snapshot.transfer is None:
            return snapshot.engines or {}
        entries = {}
        for engine_id in snapshot.transfer.participants():
            entry = self._engines.get(engine_id)
            if entry is None:
                return None
            entries[engine_id] = entry
        return entries

    def _peer_json(self, peer: Engine | None) -> str:
        if peer is None:
            return ""
        entry = self._engines.get(peer.engine_id)
        if entry is None or entry.engine is not peer:
            return encode_engine(peer)
        if entry.encoded is None:
            entry.encoded = encode_engine(peer)
        return entry.encoded

    def _encode_events(
        self, events: Sequence[Addressed], record: Transfer | None, record_json: str | None
    ) -> list[Any]:
        args: list[Any] = [len(events)]
        for addressed in events:
            event = addressed.event
            same = record_json is not None and event.transfer is record
            args += [
                addressed.engine_id,
                encode_event(event, record_json if same else None),
                self._peer_json(event.peer),
            ]
        return args

    def _peer(self, data: bytes) -> Engine:
        """The engine of an event's peer field, decoded once per distinct record."""
        peer = self._peers.get(data)
        if peer is None:
            peer = self._peers[data] = decode_engine(data)
            if len(self._peers) > _PEER_CACHE:
                del self._peers[next(iter(self._peers))]
        return peer

    # Engines

    @_guarded
    async def revision(self) -> int:
        assert self._redis is not None
        rev = int(await self._command("GET", self._rev_key) or 0)
        self._high_rev = max(self._high_rev, rev)
        return rev

    async def _read_engine(self, engine_id: str) -> _EngineEntry:
        assert self._redis is not None
        version, data = await self._command("HMGET", self._prefix + "e:" + engine_id, "v", "d")
        return self._seen_engine(engine_id, version or _ABSENT, data or b"")

    @_guarded
    async def get_engine(self, engine_id: str) -> Engine | None:
        return (await self._read_engine(engine_id)).engine

    def _engines_in(self, reply: Sequence[Any]) -> list[Engine]:
        """The engines of a listing reply; a record that cannot be decoded is logged and left out, so
        one bad record cannot stop listings and sweeps for every other engine."""
        engines = []
        for i in range(0, len(reply), 3):
            engine_id = reply[i].decode(errors="replace")
            try:
                engine = self._seen_engine(engine_id, reply[i + 1], reply[i + 2]).engine
            except Exception:
                log.exception("undecodable engine record", extra={"engine_id": engine_id})
                continue
            if engine is not None:
                engines.append(engine)
        return engines

    @_guarded
    async def list_engines(self) -> list[Engine]:
        return self._engines_in(await self._eval(SCRIPTS["list_engines"]))

    @_guarded
    async def update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        async with self._engine_locks.hold(engine_id):
            return await self._update_engine(engine_id, fn)

    async def _update_engine(self, engine_id: str, fn: EngineFn) -> Engine | None:
        entry = self._engines.get(engine_id)
        fresh = entry is None
        if entry is None:
            entry = await self._read_engine(engine_id)
        for attempt in itertools.count():
            cur = entry.engine
            try:
                new = fn(cur)
            except Exception:
                if fresh:
                    raise
                entry, fresh = await self._read_engine(engine_id), True
                continue
            if new is cur and fresh:
                return new
            op = "n" if new is cur else ("d" if new is None else "w")
            record = encode_engine(new) if op == "w" and new is not None else ""
            reply = await self._eval(
                SCRIPTS["commit_engine"],
                self._guard,
                engine_id,
                entry.version,
                op,
                record,
                1 if new is not None and new.ended_at else 0,
                new.lease_expires_at if new is not None else 0,
                new.ended_at if new is not None else 0,
            )
            status = reply[0]
            if status == b"OK":
                self._high_rev = max(self._high_rev, reply[1])
                written = _EngineEntry(b"%d" % reply[1] if new is not None else _ABSENT, new)
                written.encoded = record or None
                self._remember_engine(engine_id, written)
                return new
            if status == b"N":
                return new
            if status in (b"E", b"R"):
                await self._refused(reply)
                entry, fresh = await self._read_engine(engine_id), True
                continue
            entry, fresh = self._seen_engine(engine_id, reply[1], reply[2]), True
            await _after_conflict(attempt)
        raise AssertionError("unreachable")

    @_guarded
    async def lapsed_engines(self, now: float, tombstone_ttl: float) -> list[Engine]:
        # Fetch with a little slack and decide exactly here, as the memory store does.
        reply = await self._eval(SCRIPTS["lapsed_engines"], now, now - tombstone_ttl + 1e-3)
        return [
            e
            for e in self._engines_in(reply)
            if (not e.ended_at and e.lease_expires_at <= now) or (e.ended_at and e.ended_at + tombstone_ttl <= now)
        ]

    # Transfers

    @_guarded
    async def get_transfer(self, transfer_id: str) -> Transfer | None:
        assert self._redis is not None
        version, data = await self._command("HMGET", self._prefix + "t:" + transfer_id, "v", "d")
        transfer = decode_transfer(data) if data else None
        self._remember_transfer(transfer_id, _Snapshot(version or _ABSENT, transfer))
        return transfer

    @_guarded
    async def update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        async with self._transfer_locks.hold(transfer_id):
            return await self._update_transfer(transfer_id, fn)

    async def _update_transfer(self, transfer_id: str, fn: TransferFn) -> Transition:
        snapshot = self._transfers.get(transfer_id, _NEVER_SEEN)
        fresh = False
        for attempt in itertools.count():
            entries = self._engines_of(snapshot)
            if entries is None:
                snapshot, fresh = await self._read_transfer(transfer_id), True
                continue
            cur = snapshot.transfer
            engines = {e: entry.engine for e, entry in entries.items() if entry.engine is not None}
            try:
                transition = fn(cur, engines)
            except Exception:
                if fresh:
                    raise
                snapshot, fresh = await self._read_transfer(transfer_id), True
                continue
            new = transition.transfer
            unchanged = new is cur and not transition.events
            if unchanged and fresh:
                return transition
            checks: list[Any] = [len(entries)]
            for engine_id, entry in entries.items():
                checks += [engine_id, entry.version]
            if unchanged:
                tail: list[Any] = ["n"]
            else:
                record = encode_transfer(new) if new is not None else None
                tail = [
                    "w" if new is not None else "d",
                    record or "",
                    new.consumer_engine_id if new else "",
                    new.producer_engine_id if new else "",
                    int(new.state) if new else 0,
                    1 if new is not None and new.unsettled else 0,
                    new.deadline if new else 0,
                    self._max_events,
                    *self._encode_events(transition.events, new, record),
                ]
            reply = await self._eval(
                SCRIPTS["commit_transfer"], self._guard, transfer_id, snapshot.version, *checks, *tail
            )
            status = reply[0]
            if status == b"OK":
                self._high_rev = max(self._high_rev, reply[1])
                self._remember_transfer(transfer_id, _Snapshot(b"%d" % reply[1] if new is not None else _ABSENT, new))
                return transition
            if status == b"N":
                return transition
            if status in (b"E", b"R"):
                await self._refused(reply)
                snapshot, fresh = await self._read_transfer(transfer_id), True
                continue
            snapshot, fresh = self._snapshot(transfer_id, reply, 1), True
            await _after_conflict(attempt)
        raise AssertionError("unreachable")

    def _transfers_in(self, reply: Sequence[Any], offset: int = 0) -> list[Transfer]:
        transfers = []
        for i in range(offset, len(reply), 2):
            transfer = decode_transfer(reply[i + 1])
            self._remember_transfer(transfer.transfer_id, _Snapshot(reply[i], transfer))
            transfers.append(transfer)
        return transfers

    @_guarded
    async def list_transfers(self, engine_id: str | None = None) -> list[Transfer]:
        if engine_id is not None:
            return self._transfers_in(await self._eval(SCRIPTS["engine_transfers"], engine_id))
        # SSCAN in pages, so a large namespace never blocks Redis for long; a set may repeat ids.
        found: dict[str, Transfer] = {}
        cursor: bytes | int = 0
        while True:
            reply = await self._eval(SCRIPTS["scan_transfers"], cursor, _SCAN_COUNT)
            for t in self._transfers_in(reply, 1):
                found[t.transfer_id] = t
            cursor = reply[0]
            if cursor in (b"0", 0):
                return list(found.values())

    @_guarded
    async def live_transfer_ids(self, engine_id: str) -> list[str]:
        assert self._redis is not None
        return [m.decode() for m in await self._command("SMEMBERS", self._prefix + "el:" + engine_id)]

    @_guarded
    async def live_transfer_counts(self, engine_ids: Sequence[str]) -> dict[str, int]:
        # Issued together, the SCARDs go out as one pipeline: one round trip for every engine.
        sizes = await asyncio.gather(*(self._command("SCARD", self._prefix + "el:" + e) for e in engine_ids))
        return {engine_id: int(n) for engine_id, n in zip(engine_ids, sizes, strict=True)}

    async def _set_members(self, key: str) -> list[str]:
        """A set's members, read in SSCAN pages so that a large set never blocks Redis for long."""
        members: set[str] = set()  # SSCAN may repeat a member
        cursor: Any = 0
        while True:
            cursor, page = await self._command("SSCAN", key, cursor, "COUNT", _SCAN_COUNT)
            members.update(m.decode() for m in page)
            if int(cursor) == 0:
                return list(members)

    @_guarded
    async def page_transfers(
        self, engine_id: str | None, states: AbstractSet[State], after: str, limit: int
    ) -> list[Transfer]:
        # Ids only (no records) of the smallest set that holds every candidate, sorted here; then the
        # records of the first candidates, chunk by chunk, until the page is full: a script skips the
        # ones in other states by their `s` field, so only the page's records are sent and decoded.
        if limit <= 0 or not states:
            return []
        if engine_id is None:
            key = "transfers"
        elif states.isdisjoint(_TOMBSTONE_STATES):
            key = "el:" + engine_id
        else:
            key = "et:" + engine_id
        ids = sorted(tid for tid in await self._set_members(self._prefix + key) if tid > after)
        wanted = ",".join(str(int(s)) for s in sorted(states))
        chunk = min(max(2 * limit, 256), 4096)
        page: list[Transfer] = []
        for start in range(0, len(ids), chunk):
            reply = await self._eval(
                SCRIPTS["select_transfers"], wanted, limit - len(page), *ids[start : start + chunk]
            )
            page += self._transfers_in(reply)
            if len(page) >= limit:
                break
        return page

    @_guarded
    async def due_transfers(self, now: float, limit: int) -> list[str]:
        if limit <= 0:
            return []
        reply = await self._eval(SCRIPTS["due_transfers"], now, limit, now + _SWEEP_HOLD_S)
        return [tid.decode() for tid in reply]

    # Events

    @_guarded
    async def append_events(self, events: Sequence[Addressed]) -> None:
        # The operation id makes a retried call (reply lost) apply once.
        operation = secrets.token_hex(12)
        for _ in range(3):
            reply = await self._eval(
                SCRIPTS["append_events"],
                self._guard,
                operation,
                _APPEND_MEMORY_S,
                self._max_events,
                *self._encode_events(events, None, None),
            )
            if reply[0] == b"OK":
                self._high_rev = max(self._high_rev, reply[1])
            if reply[0] not in (b"E", b"R"):
                return
            await self._refused(reply)
        raise StoreUnavailableError("the store epoch keeps changing")

    @_guarded
    async def read_events(self, engine_id: str, start_revision: int, limit: int) -> EventPage:
        reply = await self._eval(SCRIPTS["read_events"], engine_id, start_revision, limit)
        last = int(reply[0])
        if len(reply) == 1:
            return EventPage((), last)
        if reply[1] == 1:
            return EventPage((), last, resync_revision=last + 1)
        events = [
            decode_event(
                reply[i + 1], int(reply[i].partition(b"-")[0]), self._peer(reply[i + 2]) if reply[i + 2] else None
            )
            for i in range(2, len(reply), 3)
        ]
        return EventPage(events, last)

    async def wait_events(self, engine_id: str, after_revision: int, timeout: float) -> None:
        # Not _guarded: its time limit is the wait's own plus op_timeout.
        watch = self._watch
        if watch is None:
            raise StoreUnavailableError("the Redis store is not open")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        stream: dict[Any, Any] = {self._prefix + "s:" + engine_id: f"{max(after_revision, 0)}-0"}
        limit = max(timeout, 0) + self.options.op_timeout
        with _store_errors(limit):
            async with asyncio.timeout(limit):
                while (left := deadline - loop.time()) > 0:
                    if self._watch_slots.locked():
                        # Every watch connection is busy: poll instead of opening more.
                        await asyncio.sleep(min(left, 0.05))
                        return
                    async with self._watch_slots:
                        block_ms = max(1, int(min(left, _MAX_BLOCK_S) * 1000))
                        if await watch.xread(stream, count=1, block=block_ms):
                            return

    @_guarded
    async def last_event_revision(self, engine_id: str) -> int:
        assert self._redis is not None
        return int(await self._command("HGET", self._prefix + "e:" + engine_id, "r") or 0)

    # Responses and counts

    @_guarded
    async def get_response(self, key: str) -> bytes | None:
        assert self._redis is not None
        value: bytes | None = await self._command("GET", self._prefix + "r:" + key)
        return value

    @_guarded
    async def put_response(self, key: str, value: bytes, ttl: float) -> None:
        assert self._redis is not None
        await self._command("SET", self._prefix + "r:" + key, value, "PX", max(1, int(ttl * 1000)))

    @_guarded
    async def counts(self) -> StoreCounts:
        reply = await self._eval(SCRIPTS["counts"])
        by_state: Counter[State] = Counter()
        for i in range(1, len(reply), 2):
            n, state = int(reply[i + 1]), State(int(reply[i]))
            if n > 0 and not state.terminal:  # tombstones are counted in Redis, but are not live
                by_state[state] = n
        return StoreCounts(int(reply[0]), by_state)


__all__ = ["RedisOptions", "RedisStore", "RedisTarget", "parse_url"]
