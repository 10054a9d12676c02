"""The Lua scripts of the Redis store: every multi-key step is one script, so it is atomic.

Each script gets the namespace's rev key as KEYS[1] (it routes the call in Redis Cluster) and the
key prefix `{namespace}:` as ARGV[1]; it builds the other key names from the prefix. Every key of
a namespace carries the same hash tag, so each script touches a single slot. Key schema (see
docs/operations.md):

    epoch            string  the store's lifetime id (SET NX once)
    rev              string  global revision, INCR per write; also the version of what a write stores
    t:<transfer>     hash    v version, d record, c consumer id, p producer id, s state, l unsettled (1|0)
    transfers        set     every transfer id
    states           hash    state -> number of transfers
    deadlines        zset    transfer id by deadline (swept by any replica)
    el:<engine>      set     unsettled transfer ids of an engine (live, or awaiting a revocation)
    et:<engine>      set     every transfer id (live or tombstone) of an engine
    e:<engine>       hash    v version, d record, r latest event revision
    engines          set     every engine id
    leases           zset    live engine id by lease expiry
    ended            zset    ended engine id (tombstone) by end time
    s:<engine>       stream  events; entry id "<revision>-0", fields e (event), p (peer engine, if any)
    r:<key>          string  idempotent response, with a TTL
    op:<id>          string  marks an applied append_events call (retries apply once), with a TTL

Replies use short status words: OK (applied, with the new version), N (no change, version
verified), C (conflict: the current state follows), E (epoch mismatch: the current epoch follows),
R (Redis went back in time: its revision and the epoch follow).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

_PRELUDE = """
local P = ARGV[1]
"""

_GUARD = """
-- A write's guard is "<epoch>:<revision>": the store's lifetime the writer knows, and the highest
-- revision it has seen. A lower revision now means Redis lost writes (a restart from an older
-- AOF or RDB, a failover to a lagging replica): the writer must start a new epoch.
local function guard_failed(guard)
  local epoch, seen = string.match(guard, '^(%d+):(%d+)$')
  local now = redis.call('MGET', P .. 'epoch', P .. 'rev')
  if now[1] ~= epoch then
    return {'E', now[1] or ''}
  end
  local rev = tonumber(now[2] or '0')
  if rev < tonumber(seen) then
    return {'R', rev, epoch}
  end
  return nil
end
"""

_SNAPSHOT = """
-- A transfer (version, record) and the engines it names (id, version, record).
local function snapshot(tid)
  local t = redis.call('HMGET', P .. 't:' .. tid, 'v', 'd', 'c', 'p')
  local out = {t[1] or '0', t[2] or ''}
  for k = 3, 4 do
    local e = t[k]
    if e and e ~= '' then
      local en = redis.call('HMGET', P .. 'e:' .. e, 'v', 'd')
      out[#out + 1] = e
      out[#out + 1] = en[1] or '0'
      out[#out + 1] = en[2] or ''
    end
  end
  return out
end
"""

_APPEND = """
-- Append one event to an engine's stream; the stream id is the engine's next revision. The peer
-- engine an event carries is its own field, so readers decode each distinct peer once.
local function append(eid, payload, peer, maxlen)
  local ek = P .. 'e:' .. eid
  if redis.call('EXISTS', ek) == 0 then
    return
  end
  local sk = P .. 's:' .. eid
  local r = redis.call('HINCRBY', ek, 'r', 1)
  local fields = {'e', payload}
  if peer ~= '' then
    fields[3] = 'p'
    fields[4] = peer
  end
  local added = redis.pcall('XADD', sk, 'MAXLEN', '~', maxlen, r .. '-0', unpack(fields))
  if type(added) == 'table' and added.err then
    -- The stream is ahead of the counter (the hash was replaced by hand): continue after the stream.
    local last = redis.call('XREVRANGE', sk, '+', '-', 'COUNT', 1)
    r = tonumber(string.match(last[1][1], '^(%d+)')) + 1
    redis.call('HSET', ek, 'r', r)
    redis.call('XADD', sk, 'MAXLEN', '~', maxlen, r .. '-0', unpack(fields))
  end
end
"""

READ_TRANSFER = (
    _PRELUDE
    + _SNAPSHOT
    + """
return snapshot(ARGV[2])
"""
)

# ARGV: prefix, guard, transfer id, expected version, n, n x (engine id, expected version),
#       op (w write | d delete | n verify only), record, consumer, producer, state, unsettled (1 | 0), deadline,
#       max events per engine, m, m x (engine id, event, peer engine or "").
COMMIT_TRANSFER = (
    _PRELUDE
    + _GUARD
    + _SNAPSHOT
    + _APPEND
    + """
local bad = guard_failed(ARGV[2])
if bad then
  return bad
end
local tid = ARGV[3]
local tk = P .. 't:' .. tid
local old = redis.call('HMGET', tk, 'v', 'c', 'p', 's', 'l')
local conflict = (old[1] or '0') ~= ARGV[4]
local i = 6
for _ = 1, tonumber(ARGV[5]) do
  if not conflict and (redis.call('HGET', P .. 'e:' .. ARGV[i], 'v') or '0') ~= ARGV[i + 1] then
    conflict = true
  end
  i = i + 2
end
if conflict then
  local snap = snapshot(tid)
  table.insert(snap, 1, 'C')
  return snap
end
local op = ARGV[i]
if op == 'n' then
  return {'N'}
end
local record, c, p, s, l = ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4], ARGV[i + 5]
local deadline, maxlen = ARGV[i + 6], ARGV[i + 7]
local nev = tonumber(ARGV[i + 8])
i = i + 9
local rev = redis.call('INCR', P .. 'rev')

local existed = old[1] ~= false
local write = op == 'w'
local function members(a, b)
  local m = {}
  if a and a ~= '' then m[a] = true end
  if b and b ~= '' then m[b] = true end
  return m
end
-- Unsettled transfers (the core decides: live, or awaiting a revocation) are indexed per engine.
local function unsettled(flag, state)
  if flag then return flag == '1' end
  return state ~= '5' and state ~= '6'
end
local before = existed and members(old[2], old[3]) or {}
local after = write and members(c, p) or {}
local before_live = (existed and unsettled(old[5], old[4])) and before or {}
local after_live = (write and l == '1') and after or {}
for e in pairs(before) do
  if not after[e] then redis.call('SREM', P .. 'et:' .. e, tid) end
end
for e in pairs(after) do
  if not before[e] then redis.call('SADD', P .. 'et:' .. e, tid) end
end
for e in pairs(before_live) do
  if not after_live[e] then redis.call('SREM', P .. 'el:' .. e, tid) end
end
for e in pairs(after_live) do
  if not before_live[e] then redis.call('SADD', P .. 'el:' .. e, tid) end
end
if existed then
  redis.call('HINCRBY', P .. 'states', old[4], -1)
end
if write then
  redis.call('HSET', tk, 'v', rev, 'd', record, 'c', c, 'p', p, 's', s, 'l', l)
  redis.call('ZADD', P .. 'deadlines', deadline, tid)
  redis.call('HINCRBY', P .. 'states', s, 1)
  if not existed then redis.call('SADD', P .. 'transfers', tid) end
elseif existed then
  redis.call('DEL', tk)
  redis.call('ZREM', P .. 'deadlines', tid)
  redis.call('SREM', P .. 'transfers', tid)
end
for _ = 1, nev do
  append(ARGV[i], ARGV[i + 1], ARGV[i + 2], maxlen)
  i = i + 3
end
return {'OK', rev}
"""
)

# ARGV: prefix, guard, engine id, expected version, op (w | d | n), record, ended (0 | 1),
#       lease expiry, end time.
COMMIT_ENGINE = (
    _PRELUDE
    + _GUARD
    + """
local bad = guard_failed(ARGV[2])
if bad then
  return bad
end
local eid = ARGV[3]
local ek = P .. 'e:' .. eid
local cur = redis.call('HMGET', ek, 'v', 'd')
if (cur[1] or '0') ~= ARGV[4] then
  return {'C', cur[1] or '0', cur[2] or ''}
end
local op = ARGV[5]
if op == 'n' then
  return {'N'}
end
local rev = redis.call('INCR', P .. 'rev')
if op == 'w' then
  redis.call('HSET', ek, 'v', rev, 'd', ARGV[6])
  redis.call('SADD', P .. 'engines', eid)
  if ARGV[7] == '1' then
    redis.call('ZREM', P .. 'leases', eid)
    redis.call('ZADD', P .. 'ended', ARGV[9], eid)
  else
    redis.call('ZADD', P .. 'leases', ARGV[8], eid)
    redis.call('ZREM', P .. 'ended', eid)
  end
else
  redis.call('DEL', ek, P .. 's:' .. eid)
  redis.call('SREM', P .. 'engines', eid)
  redis.call('ZREM', P .. 'leases', eid)
  redis.call('ZREM', P .. 'ended', eid)
end
return {'OK', rev}
"""
)

# ARGV: prefix, guard, operation id, seconds to remember it, max events per engine, n,
#       n x (engine id, event, peer engine or "").
APPEND_EVENTS = (
    _PRELUDE
    + _GUARD
    + _APPEND
    + """
local bad = guard_failed(ARGV[2])
if bad then
  return bad
end
if not redis.call('SET', P .. 'op:' .. ARGV[3], '1', 'NX', 'EX', ARGV[4]) then
  return {'N'}
end
local rev = redis.call('INCR', P .. 'rev')
local i = 7
for _ = 1, tonumber(ARGV[6]) do
  append(ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[5])
  i = i + 3
end
return {'OK', rev}
"""
)

# ARGV: prefix, engine id, start revision, limit.
# Reply: {last revision} for an unknown engine's empty log, {last, 1} when start was trimmed (resync),
#        {last, 0, flat (entry id, event, peer or "")...} otherwise.
READ_EVENTS = (
    _PRELUDE
    + """
local ek = P .. 'e:' .. ARGV[2]
if redis.call('EXISTS', ek) == 0 then
  return {0}
end
local last = tonumber(redis.call('HGET', ek, 'r') or '0')
local sk = P .. 's:' .. ARGV[2]
local first = last + 1
local head = redis.call('XRANGE', sk, '-', '+', 'COUNT', 1)
if head[1] then
  first = tonumber(string.match(head[1][1], '^(%d+)'))
end
local start = tonumber(ARGV[3])
if start < first then
  return {last, 1}
end
local limit = tonumber(ARGV[4])
local out = {last, 0}
if limit <= 0 or start > last then
  return out
end
for _, entry in ipairs(redis.call('XRANGE', sk, start .. '-0', '+', 'COUNT', limit)) do
  local fields = entry[2]
  out[#out + 1] = entry[1]
  out[#out + 1] = fields[2]
  out[#out + 1] = fields[4] or ''
end
return out
"""
)

# ARGV: prefix, now, tombstone cutoff. Reply: flat (engine id, version, record) of lapsed candidates.
LAPSED_ENGINES = (
    _PRELUDE
    + """
local out = {}
local function add(ids)
  for _, eid in ipairs(ids) do
    local en = redis.call('HMGET', P .. 'e:' .. eid, 'v', 'd')
    if en[1] then
      out[#out + 1] = eid
      out[#out + 1] = en[1]
      out[#out + 1] = en[2]
    end
  end
end
add(redis.call('ZRANGEBYSCORE', P .. 'leases', '-inf', ARGV[2]))
add(redis.call('ZRANGEBYSCORE', P .. 'ended', '-inf', ARGV[3]))
return out
"""
)

# ARGV: prefix, now, limit, hold-until. Due transfers are pushed to hold-until so that concurrent
# sweepers of other replicas skip them meanwhile; the transition that expires one rewrites its
# deadline, and one left unswept comes due again at hold-until. Entries of vanished records go.
DUE_TRANSFERS = (
    _PRELUDE
    + """
local dk = P .. 'deadlines'
local out = {}
for _, tid in ipairs(redis.call('ZRANGEBYSCORE', dk, '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  if redis.call('EXISTS', P .. 't:' .. tid) == 1 then
    redis.call('ZADD', dk, 'XX', ARGV[4], tid)
    out[#out + 1] = tid
  else
    redis.call('ZREM', dk, tid)
  end
end
return out
"""
)

# ARGV: prefix. Reply: flat (engine id, version, record) of every engine.
LIST_ENGINES = (
    _PRELUDE
    + """
local out = {}
for _, eid in ipairs(redis.call('SMEMBERS', P .. 'engines')) do
  local en = redis.call('HMGET', P .. 'e:' .. eid, 'v', 'd')
  if en[1] then
    out[#out + 1] = eid
    out[#out + 1] = en[1]
    out[#out + 1] = en[2]
  end
end
return out
"""
)

# ARGV: prefix, engine id. Reply: flat (version, record) of the engine's transfers.
ENGINE_TRANSFERS = (
    _PRELUDE
    + """
local out = {}
for _, tid in ipairs(redis.call('SMEMBERS', P .. 'et:' .. ARGV[2])) do
  local t = redis.call('HMGET', P .. 't:' .. tid, 'v', 'd')
  if t[1] then
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
  end
end
return out
"""
)

# ARGV: prefix, cursor, count. Reply: {next cursor, flat (version, record)...}.
SCAN_TRANSFERS = (
    _PRELUDE
    + """
local page = redis.call('SSCAN', P .. 'transfers', ARGV[2], 'COUNT', tonumber(ARGV[3]))
local out = {page[1]}
for _, tid in ipairs(page[2]) do
  local t = redis.call('HMGET', P .. 't:' .. tid, 'v', 'd')
  if t[1] then
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
  end
end
return out
"""
)

# ARGV: prefix, wanted states ("1,2,..."), limit, transfer ids... Reply: flat (version, record) of the
# first `limit` of those transfers (in the order given) that exist and are in a wanted state; the others'
# records are not read.
SELECT_TRANSFERS = (
    _PRELUDE
    + """
local wanted = {}
for s in string.gmatch(ARGV[2], '%d+') do
  wanted[s] = true
end
local left = tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV do
  if left <= 0 then
    break
  end
  local tk = P .. 't:' .. ARGV[i]
  local s = redis.call('HGET', tk, 's')
  if s and wanted[s] then
    local t = redis.call('HMGET', tk, 'v', 'd')
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
    left = left - 1
  end
end
return out
"""
)

# ARGV: prefix, epoch the caller saw lose writes, new epoch. Reply: the epoch now (the caller's new
# one, or the one another replica put in place first).
REPLACE_EPOCH = (
    _PRELUDE
    + """
if redis.call('GET', P .. 'epoch') == ARGV[2] then
  redis.call('SET', P .. 'epoch', ARGV[3])
end
return redis.call('GET', P .. 'epoch')
"""
)

# ARGV: prefix. Reply: {live engines, flat (state, count)...}.
COUNTS = (
    _PRELUDE
    + """
local out = {redis.call('ZCARD', P .. 'leases')}
for _, v in ipairs(redis.call('HGETALL', P .. 'states')) do
  out[#out + 1] = v
end
return out
"""
)


@dataclass(frozen=True)
class Script:
    """A script's source and its SHA1, the name EVALSHA calls it by."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


SCRIPTS = {
    s.name: s
    for s in (
        Script("read_transfer", READ_TRANSFER),
        Script("commit_transfer", COMMIT_TRANSFER),
        Script("commit_engine", COMMIT_ENGINE),
        Script("append_events", APPEND_EVENTS),
        Script("read_events", READ_EVENTS),
        Script("lapsed_engines", LAPSED_ENGINES),
        Script("due_transfers", DUE_TRANSFERS),
        Script("list_engines", LIST_ENGINES),
        Script("engine_transfers", ENGINE_TRANSFERS),
        Script("scan_transfers", SCAN_TRANSFERS),
        Script("select_transfers", SELECT_TRANSFERS),
        Script("counts", COUNTS),
        Script("replace_epoch", REPLACE_EPOCH),
    )
}
