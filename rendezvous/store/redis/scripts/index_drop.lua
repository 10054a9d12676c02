-- Drop an engine's KV index entry and block set if they belong to incarnation or an older one, and take its
-- blocks off the server's total and its owner's. Reply: OK | N (none, or a newer incarnation's) | E epoch |
-- R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local k = P .. 'ix:' .. engine_id
local entry = redis.call('HMGET', k, 'i', 'o')
if not entry[1] or tonumber(entry[1]) > tonumber(incarnation) then
  return {'N'}
end
local bk = P .. 'ixb:' .. engine_id
local held = redis.call('SCARD', bk)
redis.call('DECRBY', P .. 'ixt', held)
local owner = entry[2] or ''
if owner ~= '' and held > 0 and redis.call('HINCRBY', P .. 'ixo', owner, -held) <= 0 then
  redis.call('HDEL', P .. 'ixo', owner)
end
redis.call('UNLINK', k, bk)  -- a set of up to a million blocks: freed off Redis's main thread
redis.call('SREM', P .. 'ixe', engine_id)
return {'OK'}
