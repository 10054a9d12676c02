"""The Lua scripts of the Redis store, called by named arguments: every multi-key step is one script.

Each script is a `.lua` file of this package. `SIGNATURES` below is the one table of their arguments:
from it, a header is generated in front of each script that binds every argument to a Lua local of
the same name, and a Python function `Script.argv` that takes the same names as keyword arguments and
lays them out in the same order, so neither side counts ARGV positions. A script also gets the shared
helpers it names (`_guard.lua`, `_snapshot.lua`, `_append.lua`, `_records.lua`, `_budget.lua`,
`_ixselect.lua`), after the header and before its own body.

Calling convention (one EVALSHA, as before): KEYS[1] is the namespace's rev key (it routes the call
in Redis Cluster); ARGV[1] is the key prefix `{namespace}:`, bound to `P`, from which a script builds
every key name. Every key of a namespace carries the same hash tag, so each script touches a single
slot. Then come the scalar arguments in table order, then the item count of each group, then the
groups' items. A group is a list of items of one or more fields: in Lua, a table of the items, each a
table of its named fields (or the value itself for a one-field group).

Key schema (docs/operations.md has it for operators):

    epoch            string  the store's lifetime id (SET NX once)
    page-key         string  the key that signs page tokens (SET NX once; rendezvous.core.paging)
    rev              string  global revision, INCR per write; also the version of what a write stores
    t:<transfer>     hash    v version, d record, c consumer id, p producer id, s state, l unsettled (1|0),
                             bc, bs block ids charged to the budget, to owners oc (consumer's), os (producer's)
    transfers        set     every transfer id
    transfer_ids     zset    every transfer id, score 0 (ordered by id: ListTransfers pages, page_transfers.lua)
    live_ids         zset    the ids of transfers in a live state, score 0 (the default ListTransfers listing)
    states           hash    state -> number of transfers
    deadlines        zset    transfer id by deadline (swept by any replica)
    el:<engine>      set     unsettled transfer ids of an engine (live, or awaiting a revocation)
    et:<engine>      set     every transfer id (live or tombstone) of an engine
    e:<engine>       hash    v version, d record, r latest event sequence, o owner (auth identity), n engines
                             and m agent metadata bytes charged to the budget, b the event stream's bytes
    budget           hash    the memory budget's tallies: e engines, b live block ids, m agent metadata
                             bytes; `<kind>:<owner>` the same per owner
    engines          set     every engine id
    engine_ids       zset    every engine id, score 0 (ordered by id: ListEngines pages)
    leases           zset    live engine id by lease expiry
    ended            zset    ended engine id (tombstone) by end time
    s:<engine>       stream  events; entry id "<sequence>-0", fields e (event), p (peer engine or ""), g (the
                             event's number from es: its age); the e: hash's b is the bytes it is counted as
                             (_append.lua)
    es               string  the last event number given (INCR per event appended)
    eb               hash    t: the bytes counted of all streams, o:<owner>: of an owner's engines' streams
    eo, eo:<owner>   zset    engine id by the number of its stream's oldest event (non-empty streams), in all and
                             per owner: which event the identity's and the server's event bounds trim first
    r:<key>          string  idempotent response, with a TTL
    ra, ra:<owner>   zset    kept responses' keys by expiry, in all and per owner (put_answer.lua)
    rc, ro           hash    kept response key -> its cost in bytes, -> its owner
    rt               hash    t: the kept responses' cost; o:<owner>: an owner's
    op:<id>          string  marks an applied append_events call (retries apply once), with a TTL
    cr:<engine>      hash    credit reservations on a consumer: transfer id -> reservation
    crv:<engine>     string  the version of that ledger, INCR per change (compare-and-set of put_credit)
    crt              hash    transfer id -> its reservation (which engine holds it)
    crd              zset    transfer id by reservation expiry (swept by any replica)
    ix:<engine>      hash    the engine's KV index entry: v "<incarnation>:<sequence>", w the number of the write
                             that wrote it (from ixw; v and w together are its version), d record, p pool, r role,
                             i incarnation, o owner (the identity its blocks are charged to)
    ixb:<engine>     set     its blocks: group (4 bytes big-endian) + hash
    ixe              set     every engine id with an entry
    ixt              string  the blocks of all entries (max_index_blocks_total)
    ixo              hash    owner -> the blocks of its engines' entries (max_index_blocks_per_identity)
    ixw              string  the last KV index write's number (INCR per write: an entry's w)

Replies use short status words: OK (applied, with the new version), N (no change, version
verified), C (conflict: the current state follows), E (epoch mismatch: the current epoch follows),
R (Redis went back in time: its revision and the epoch follow), B (a budget the write would pass: refused).
"""

from __future__ import annotations

import hashlib
import keyword
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex

from rendezvous.store.base import StoreUnavailableError
from rendezvous.store.redis.pipeliner import Pipeliner


@dataclass(frozen=True)
class Group:
    """A variable-length argument: a list of items, each of these fields."""

    name: str
    fields: tuple[str, ...]


@dataclass(frozen=True)
class Signature:
    """A script's arguments (scalars, then groups) and the shared helpers it uses."""

    args: tuple[str, ...] = ()
    groups: tuple[Group, ...] = ()
    helpers: tuple[str, ...] = ()


_EVENTS = Group("events", ("engine_id", "event", "peer"))
"""Events to append: the addressed engine, the encoded event, the encoded peer engine or ""."""

SIGNATURES: Mapping[str, Signature] = {
    "read_transfer": Signature(("transfer_id",), helpers=("snapshot",)),
    # items: JSON, one array per transition (the fields are in commit_transfers.lua). Per item, version is
    # the transfer's version the transition was computed on ("0": absent), checks its engines' versions;
    # op: w write | d delete | n verify only; unsettled: 1 | 0 (the core's Transfer.unsettled).
    # max_blocks, max_blocks_per_identity: the live-block budgets a write must keep to.
    "commit_transfers": Signature(
        (
            "guard",
            "max_events",
            "max_event_bytes",
            "max_owner_event_bytes",
            "max_total_event_bytes",
            "max_blocks",
            "max_blocks_per_identity",
            "items",
        ),
        helpers=("guard", "snapshot", "append", "budget"),
    ),
    # op: w write | d delete | n verify only; ended: 1 | 0. owner, engines, metadata_bytes: what the record
    # charges the memory budget (rendezvous.core.budget.engine_usage); max_*: the budgets a write must keep to.
    "commit_engine": Signature(
        (
            "guard",
            "engine_id",
            "version",
            "op",
            "record",
            "ended",
            "lease_expires_at",
            "ended_at",
            "owner",
            "engines",
            "metadata_bytes",
            "max_engines",
            "max_engines_per_identity",
            "max_metadata_bytes",
            "max_metadata_bytes_per_identity",
        ),
        helpers=("guard", "budget", "append"),
    ),
    # operation: a fresh id per call, remembered remember_s seconds.
    "append_events": Signature(
        (
            "guard",
            "operation",
            "remember_s",
            "max_events",
            "max_event_bytes",
            "max_owner_event_bytes",
            "max_total_event_bytes",
        ),
        (_EVENTS,),
        ("guard", "append"),
    ),
    "read_events": Signature(("engine_id", "start_sequence", "limit")),
    "lapse_candidates": Signature(("now", "tombstone_cutoff")),
    "due_transfers": Signature(("now", "limit", "hold_until")),
    "read_engines": Signature(groups=(Group("ids", ("engine_id",)),), helpers=("records",)),
    "page_engines": Signature(("after", "count"), helpers=("records",)),
    "page_transfers": Signature(("check", "live", "states", "after", "limit", "count"), helpers=("records",)),
    "index_transfers": Signature(("cursor", "after", "count")),
    "scan_transfers": Signature(("cursor", "count"), helpers=("records",)),
    "select_transfers": Signature(("states", "limit"), (Group("ids", ("transfer_id",)),), helpers=("records",)),
    "replace_epoch": Signature(("lost_epoch", "new_epoch")),
    "counts": Signature(),
    "usage": Signature(("owner",), helpers=("budget",)),
    # live, usage: 1 | 0, whether to read the caller's unsettled-transfer count and the budget's tallies.
    "read_caller": Signature(("engine_id", "live", "usage"), helpers=("budget",)),
    # Credit reservations (rendezvous/store/redis/credits.py). holder: the transfer id's reservation as read
    # ("" for none); holder_engine: its engine ("" for none).
    "put_credit": Signature(
        ("guard", "engine_id", "version", "transfer_id", "record", "holder", "holder_engine", "expires_at"),
        helpers=("guard",),
    ),
    # expected: the reservation as the caller read it (encoded), dropped only if still held; "" for whichever.
    "drop_credit": Signature(("guard", "transfer_id", "expected"), helpers=("guard",)),
    "read_credits": Signature(("engine_id",)),
    # The KV index (rendezvous/store/redis/cache_index.py): members are a block's group (4 bytes) and hash;
    # expected: the version of the entry decided on, as index_read answered it ("" for none); version:
    # "<incarnation>:<sequence>" of the one written (index_write.lua adds the write's number); the record written is
    # record_head, the block count, record_tail; cut: 1 | 0, whether a bound cuts adds rather than refusing them.
    "index_read": Signature(("engine_id",), (Group("members", ("member",)),)),
    "index_write": Signature(
        (
            "guard",
            "engine_id",
            "expected",
            "version",
            "record_head",
            "record_tail",
            "pool",
            "role",
            "incarnation",
            "owner",
            "reset",
            "cut",
            "count",
            "max_total",
            "max_owner",
        ),
        (Group("adds", ("member",)), Group("removes", ("member",))),
        ("guard",),
    ),
    # now: the coordinator's clock ("" skips the lease check): an engine whose lease expired by then is left out.
    "index_select": Signature(
        ("role", "now"), (Group("pools", ("pool",)), Group("engine_ids", ("engine_id",))), helpers=("ixselect",)
    ),
    "index_match": Signature(groups=(Group("members", ("member",)), Group("engine_ids", ("engine_id",)))),
    "index_match_small": Signature(
        ("role", "most", "budget", "now"),
        (Group("pools", ("pool",)), Group("engine_ids", ("engine_id",)), Group("members", ("member",))),
        helpers=("ixselect",),
    ),
    "index_drop": Signature(("guard", "engine_id", "incarnation"), helpers=("guard",)),
    # Kept answers of idempotent requests (put_answer.lua has their keys and bounds).
    # guard: as every write's. An answer put after its request's write, under an epoch that has ended since (Redis
    # lost the write), is not kept: a retry must run again in the new epoch, not be told of a record now gone.
    "put_answer": Signature(
        ("guard", "key", "value", "ttl_ms", "owner", "cost", "max_bytes", "max_owner_bytes"), helpers=("guard",)
    ),
}


def _read(name: str) -> str:
    return resources.files(__name__).joinpath(name + ".lua").read_text(encoding="utf-8")


def _header(signature: Signature) -> str:
    """Lua that binds ARGV to the signature's names (see the module docstring for the layout)."""
    lines = ["local P = ARGV[1]"]
    position = 2
    for name in signature.args:
        lines.append(f"local {name} = ARGV[{position}]")
        position += 1
    if signature.groups:
        counts = position
        position += len(signature.groups)
        lines.append(
            f"local {', '.join(g.name for g in signature.groups)} = {', '.join('{}' for _ in signature.groups)}"
        )
        lines.append("do")
        lines.append(f"  local i = {position}")
        for k, group in enumerate(signature.groups):
            width = len(group.fields)
            slots = ["ARGV[i]"] + [f"ARGV[i + {j}]" for j in range(1, width)]
            fields = ", ".join(f"{f} = {a}" for f, a in zip(group.fields, slots, strict=True))
            item = slots[0] if width == 1 else "{" + fields + "}"
            lines.append(f"  for j = 1, tonumber(ARGV[{counts + k}]) do")
            lines.append(f"    {group.name}[j] = {item}")
            lines.append(f"    i = i + {width}")
            lines.append("  end")
        lines.append("end")
    return "\n".join(lines) + "\n"


def _packer(name: str, signature: Signature) -> Callable[..., list[Any]]:
    """The Python side of the header: a function of the prefix and the named (keyword-only) arguments that
    lays them out as the header reads them. Generated from the same table, as dataclasses generate __init__,
    so a call costs what a positional one does and a missing or unknown argument is a TypeError."""
    names = [*signature.args, *(g.name for g in signature.groups)]
    for arg in names:
        # (A Lua reserved word fails when Redis loads the script.)
        if not arg.isidentifier() or keyword.iskeyword(arg) or arg in ("P", "prefix"):
            raise ValueError(f"script {name}: {arg!r} cannot be an argument name")
    params = ", ".join(["prefix", "*", *names]) if names else "prefix"
    items = ["prefix", *signature.args, *(f"len({g.name})" for g in signature.groups)]
    lines = [f"def {name}({params}):", f"    out = [{', '.join(items)}]"]
    for group in signature.groups:
        if len(group.fields) == 1:
            lines.append(f"    out += {group.name}")
        else:
            lines += [f"    for item in {group.name}:", "        out += item"]
    lines.append("    return out")
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # the source is built above from checked identifiers only
    packer: Callable[..., list[Any]] = namespace[name]
    return packer


@dataclass(frozen=True)
class Script:
    """A script's full source (header, helpers, body), its SHA1 (the name EVALSHA calls it by) and signature."""

    name: str
    signature: Signature
    source: str
    sha: str = field(init=False)
    argv: Callable[..., list[Any]] = field(init=False, repr=False, compare=False)
    """argv(prefix, **named arguments): ARGV for a call, each argument where the header expects it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())
        object.__setattr__(self, "argv", _packer(self.name, self.signature))

    @classmethod
    def load(cls, name: str, signature: Signature) -> Script:
        parts = [_header(signature)]
        parts += [_read("_" + helper) for helper in signature.helpers]
        parts.append(_read(name))
        return cls(name, signature, "".join(parts))


SCRIPTS: Mapping[str, Script] = {name: Script.load(name, sig) for name, sig in SIGNATURES.items()}


class Scripts:
    """Runs the scripts of one namespace: one EVALSHA each, through the pipeliner, once bound."""

    def __init__(self, rev_key: str, prefix: str) -> None:
        self._rev_key = rev_key
        self._prefix = prefix
        self._client: aioredis.Redis | None = None
        self._pipeliner: Pipeliner | None = None

    def bind(self, client: aioredis.Redis, pipeliner: Pipeliner) -> None:
        """Run scripts on this connection (the store opened)."""
        self._client, self._pipeliner = client, pipeliner

    def unbind(self) -> None:
        """Stop running scripts (the store closed)."""
        self._client = self._pipeliner = None

    @property
    def client(self) -> aioredis.Redis:
        if self._client is None:
            raise StoreUnavailableError("the Redis store is not open")
        return self._client

    async def load(self) -> None:
        """Load every script (EVALSHA then finds them)."""
        for script in SCRIPTS.values():
            await self.client.script_load(script.source)

    async def run(self, name: str, /, **args: Any) -> Any:
        """Call a script by name with its named arguments (SIGNATURES); returns its reply."""
        script = SCRIPTS[name]
        argv = script.argv(self._prefix, **args)
        if self._pipeliner is None:
            raise StoreUnavailableError("the Redis store is not open")
        call = ("EVALSHA", script.sha, 1, self._rev_key, *argv)
        try:
            return await self._pipeliner.call(*call)
        except rex.NoScriptError:
            # Redis restarted (or SCRIPT FLUSH, or failed over to a node that never loaded it): load it again, and
            # call it through the pipeliner again, which WAITs for replicas after it as after any write.
            await self.client.script_load(script.source)
            return await self._pipeliner.call(*call)


__all__ = ["SCRIPTS", "SIGNATURES", "Group", "Script", "Scripts", "Signature"]
