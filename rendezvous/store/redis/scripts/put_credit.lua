-- Write a credit reservation if its engine's ledger is still at the version the caller decided on, and the
-- transfer id's reservation is still the one it saw (holder, "" for none); a holder on another engine
-- leaves that engine's ledger. Reply: OK version | C (changed: read again) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local vk = P .. 'crv:' .. engine_id
if (redis.call('GET', vk) or '0') ~= version then
  return {'C'}
end
if (redis.call('HGET', P .. 'crt', transfer_id) or '') ~= holder then
  return {'C'}
end
if holder_engine ~= '' then
  if redis.call('HDEL', P .. 'cr:' .. holder_engine, transfer_id) == 1 and holder_engine ~= engine_id then
    redis.call('INCR', P .. 'crv:' .. holder_engine)
  end
end
redis.call('HSET', P .. 'cr:' .. engine_id, transfer_id, record)
redis.call('HSET', P .. 'crt', transfer_id, record)
redis.call('ZADD', P .. 'crd', expires_at, transfer_id)
return {'OK', redis.call('INCR', vk)}
