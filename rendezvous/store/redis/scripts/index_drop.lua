-- Drop an engine's KV index entry and block set if they belong to incarnation or an older one, and take its
-- blocks off the server's total. Reply: OK | N (none, or a newer incarnation's) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local k = P .. 'ix:' .. engine_id
local held = redis.call('HGET', k, 'i')
if not held or tonumber(held) > tonumber(incarnation) then
  return {'N'}
end
local bk = P .. 'ixb:' .. engine_id
redis.call('DECRBY', P .. 'ixt', redis.call('SCARD', bk))
redis.call('DEL', k, bk)
redis.call('SREM', P .. 'ixe', engine_id)
return {'OK'}
