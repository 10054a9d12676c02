-- Write an engine's KV index entry if it is still at the version the caller decided on (expected; "" for none):
-- the record, pool, role and incarnation, the block set (emptied first when reset is 1, then adds added and
-- removes removed) and the server's block total `ixt`, which must stay within max_total when the set grows.
-- count: the set's size after (the caller's decision, exact since the set changes only with the version).
-- Reply: OK | C (changed: read again) | B total adding (the server's bound) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local k = P .. 'ix:' .. engine_id
local bk = P .. 'ixb:' .. engine_id
if (redis.call('HGET', k, 'v') or '') ~= expected then
  return {'C'}
end
local before = redis.call('SCARD', bk)
local after = tonumber(count)
local total = tonumber(redis.call('GET', P .. 'ixt') or '0')
if after > before and total + after - before > tonumber(max_total) then
  return {'B', total, after - before}
end
if reset == '1' then
  redis.call('DEL', bk)
end
-- In slices: unpack is bounded by Lua's stack.
for first = 1, #adds, 1000 do
  redis.call('SADD', bk, unpack(adds, first, math.min(first + 999, #adds)))
end
for first = 1, #removes, 1000 do
  redis.call('SREM', bk, unpack(removes, first, math.min(first + 999, #removes)))
end
redis.call('HSET', k, 'v', version, 'd', record, 'p', pool, 'r', role, 'i', incarnation)
redis.call('SADD', P .. 'ixe', engine_id)
redis.call('INCRBY', P .. 'ixt', after - before)
return {'OK'}
