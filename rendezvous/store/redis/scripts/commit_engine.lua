-- Write or delete an engine record and its lease indexes, or only verify it, if it is still at the
-- version the caller computed the update on. op: w write | d delete | n verify only.
-- Reply: OK rev | N | C version record | E epoch | R rev epoch.
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
local rev = redis.call('INCR', P .. 'rev')
if op == 'w' then
  redis.call('HSET', ek, 'v', rev, 'd', record)
  redis.call('SADD', P .. 'engines', engine_id)
  if ended == '1' then
    redis.call('ZREM', P .. 'leases', engine_id)
    redis.call('ZADD', P .. 'ended', ended_at, engine_id)
  else
    redis.call('ZADD', P .. 'leases', lease_expires_at, engine_id)
    redis.call('ZREM', P .. 'ended', engine_id)
  end
else
  redis.call('DEL', ek, P .. 's:' .. engine_id)
  redis.call('SREM', P .. 'engines', engine_id)
  redis.call('ZREM', P .. 'leases', engine_id)
  redis.call('ZREM', P .. 'ended', engine_id)
end
return {'OK', rev}
