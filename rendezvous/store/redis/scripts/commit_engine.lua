-- Write or delete an engine record and its lease indexes, or only verify it, if it is still at the
-- version the caller computed the update on. op: w write | d delete | n verify only.
-- Reply: OK rev | N | C version record | E epoch | R rev epoch | B budget scope limit have adding (a budget the
-- write would pass: rendezvous.core.budget).
local bad = guard_failed(guard)
if bad then
  return bad
end
local ek = P .. 'e:' .. engine_id
local cur = redis.call('HMGET', ek, 'v', 'd')
if (cur[1] or '0') ~= version then
  return {'C', cur[1] or '0', cur[2] or ''}
end
if op == 'n' then
  return {'N'}
end
-- What the record charged the budget (o owner, n engines, m metadata bytes) goes; the new record's comes,
-- unless it would pass a budget (B: refused, nothing written).
local charged = redis.call('HMGET', ek, 'o', 'n', 'm')
if op == 'w' then
  local limits = {max_engines, max_metadata_bytes, max_engines_per_identity, max_metadata_bytes_per_identity}
  local refusal = budget_refusal(charged, owner, engines, metadata_bytes, limits)
  if refusal then
    return refusal
  end
end
local rev = redis.call('INCR', P .. 'rev')
budget_add(charged[1], 'e', -(tonumber(charged[2]) or 0))
budget_add(charged[1], 'm', -(tonumber(charged[3]) or 0))
if op == 'w' then
  budget_add(owner, 'e', engines)
  budget_add(owner, 'm', metadata_bytes)
  -- An engine rewritten for another owner: its event stream's bytes move to the new owner's tally.
  local moved = (charged[1] or '') ~= owner
  if moved then
    unlist_events(engine_id, charged[1] or '')
  end
  redis.call('HSET', ek, 'v', rev, 'd', record, 'o', owner, 'n', engines, 'm', metadata_bytes)
  if moved then
    list_events(engine_id, owner)
  end
  redis.call('SADD', P .. 'engines', engine_id)
  redis.call('ZADD', P .. 'engine_ids', 0, engine_id)
  if ended == '1' then
    redis.call('ZREM', P .. 'leases', engine_id)
    redis.call('ZADD', P .. 'ended', ended_at, engine_id)
  else
    redis.call('ZADD', P .. 'leases', lease_expires_at, engine_id)
    redis.call('ZREM', P .. 'ended', engine_id)
  end
else
  unlist_events(engine_id, charged[1] or '')
  redis.call('DEL', ek, P .. 's:' .. engine_id)
  redis.call('SREM', P .. 'engines', engine_id)
  redis.call('ZREM', P .. 'engine_ids', engine_id)
  redis.call('ZREM', P .. 'leases', engine_id)
  redis.call('ZREM', P .. 'ended', engine_id)
end
return {'OK', rev}
