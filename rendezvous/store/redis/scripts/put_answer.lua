-- Keep an idempotent request's answer (AIP-155) for ttl_ms, bounded in bytes over the namespace
-- (max_bytes) and per owner (max_owner_bytes; none for owner ""). An answer costs `cost` (its key and
-- value bytes and an overhead, rendezvous.store._answers.answer_cost). Expired answers are forgotten first,
-- then, past a bound, the owner's oldest, then the oldest of all; an answer larger than a bound is not kept.
-- Keys: r:<key> the answer (PX ttl); ra zset key by expiry (ms, Redis time), ra:<owner> the same per owner;
-- rc hash key -> cost, ro hash key -> owner; rt hash t -> total cost, o:<owner> -> the owner's.
-- Under the epoch guard, as every write: an answer to a write made in an epoch that has ended (Redis lost the
-- write, and the answer would tell a retry of a record that no longer exists) is not kept.
-- Reply: 1 kept | 0 not kept (too large) | E epoch | R rev epoch (the guard refused: not kept).
local bad = guard_failed(guard)
if bad then
  return bad
end
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)

local function forget(member)
  local charged = redis.call('HGET', P .. 'rc', member)
  if not charged then
    return
  end
  local cost_of = tonumber(charged)
  local who = redis.call('HGET', P .. 'ro', member) or ''
  redis.call('HDEL', P .. 'rc', member)
  redis.call('HDEL', P .. 'ro', member)
  redis.call('ZREM', P .. 'ra', member)
  redis.call('DEL', P .. 'r:' .. member)
  redis.call('HINCRBY', P .. 'rt', 't', -cost_of)
  if who ~= '' then
    redis.call('ZREM', P .. 'ra:' .. who, member)
    if redis.call('HINCRBY', P .. 'rt', 'o:' .. who, -cost_of) <= 0 then
      redis.call('HDEL', P .. 'rt', 'o:' .. who)
    end
  end
end

for _, member in ipairs(redis.call('ZRANGEBYSCORE', P .. 'ra', '-inf', now, 'LIMIT', 0, 128)) do
  forget(member)
end
forget(key)
local c, most, most_owned = tonumber(cost), tonumber(max_bytes), tonumber(max_owner_bytes)
if c > most or (owner ~= '' and c > most_owned) then
  return 0
end
if owner ~= '' then
  while tonumber(redis.call('HGET', P .. 'rt', 'o:' .. owner) or '0') + c > most_owned do
    local oldest = redis.call('ZRANGE', P .. 'ra:' .. owner, 0, 0)[1]
    if not oldest then
      break
    end
    forget(oldest)
  end
end
while tonumber(redis.call('HGET', P .. 'rt', 't') or '0') + c > most do
  local oldest = redis.call('ZRANGE', P .. 'ra', 0, 0)[1]
  if not oldest then
    break
  end
  forget(oldest)
end
local expires = now + tonumber(ttl_ms)
redis.call('SET', P .. 'r:' .. key, value, 'PX', ttl_ms)
redis.call('ZADD', P .. 'ra', expires, key)
redis.call('HSET', P .. 'rc', key, c)
redis.call('HSET', P .. 'ro', key, owner)
redis.call('HINCRBY', P .. 'rt', 't', c)
if owner ~= '' then
  redis.call('ZADD', P .. 'ra:' .. owner, expires, key)
  redis.call('HINCRBY', P .. 'rt', 'o:' .. owner, c)
end
return 1
