-- Write an engine's KV index entry if it is still at the version the caller decided on (expected, as index_read
-- answered it; "" for none): the record, pool, role, incarnation and owner, the block set (emptied first when reset
-- is 1, then adds added and removes removed), the server's block total `ixt` and the owners' totals `ixo`. A growth
-- must keep the server's total within max_total and, for an owner (not ""), the owner's within max_owner (its
-- blocks so far, less this entry's if they were charged to it). count: the set's size after (the caller's
-- decision, exact since the set changes only with the version). cut "1" (a snapshot: reset, adds distinct and in the
-- order to keep): where a bound has no room for count blocks, keep the leading adds that fit instead of refusing,
-- never fewer than the entry held (rendezvous.store.cache_index.most_after), and answer which bound cut it. The
-- record is record_head, the count kept, record_tail.
-- The version is "<v>/<w>": v is "<incarnation>:<sequence>" (the caller's `version`, what 0.1.0's replicas compare
-- alone), w the write's number (INCR `ixw`), new at every write: a snapshot at the entry's own sequence replaces
-- the set without moving v, and w tells a report decided on the set before it that it changed.
-- Reply: OK count cut_by ("server", "identity" or "") | C (changed: read again) | B scope have adding (a bound) | E epoch | R rev epoch.
local bad = guard_failed(guard)
if bad then
  return bad
end
local k = P .. 'ix:' .. engine_id
local bk = P .. 'ixb:' .. engine_id
local current = redis.call('HMGET', k, 'v', 'o', 'w')
local now = ''
if current[1] then
  now = current[1] .. '/' .. (current[3] or '')
end
if now ~= expected then
  return {'C'}
end
local charged = current[2] or ''
local before = redis.call('SCARD', bk)
local after = tonumber(count)
local total = tonumber(redis.call('GET', P .. 'ixt') or '0')
local have = 0
if owner ~= '' then
  have = tonumber(redis.call('HGET', P .. 'ixo', owner) or '0')
end
local n = #adds
local cut_by = ''
if cut == '1' then
  local most = math.max(before, tonumber(max_total) - total + before)
  local bound = 'server'
  if owner ~= '' then
    local mine = 0
    if charged == owner then
      mine = before
    end
    local mine_most = math.max(mine, tonumber(max_owner) - have + mine)
    if mine_most < most then
      most = mine_most
      bound = 'identity'
    end
  end
  if after > most then
    n = most  -- adds are distinct: the first most of them
    after = most
    cut_by = bound
  end
end
if after > before and total + after - before > tonumber(max_total) then
  return {'B', 'server', total, after - before}
end
if owner ~= '' then
  local mine = after
  if charged == owner then
    mine = after - before
  end
  if mine > 0 and have + mine > tonumber(max_owner) then
    return {'B', 'identity', have, mine}
  end
end
if reset == '1' then
  redis.call('UNLINK', bk)  -- freed off Redis's main thread (DEL of 1,000,000 blocks held it ~330 ms)
end
-- In slices: unpack is bounded by Lua's stack.
for first = 1, n, 1000 do
  redis.call('SADD', bk, unpack(adds, first, math.min(first + 999, n)))
end
for first = 1, #removes, 1000 do
  redis.call('SREM', bk, unpack(removes, first, math.min(first + 999, #removes)))
end
local w = redis.call('INCR', P .. 'ixw')
redis.call('HSET', k, 'v', version, 'w', w, 'd', record_head .. after .. record_tail, 'p', pool, 'r', role, 'i', incarnation, 'o', owner)
redis.call('SADD', P .. 'ixe', engine_id)
redis.call('INCRBY', P .. 'ixt', after - before)
if charged ~= '' and before > 0 and redis.call('HINCRBY', P .. 'ixo', charged, -before) <= 0 then
  redis.call('HDEL', P .. 'ixo', charged)
end
if owner ~= '' and after > 0 then
  redis.call('HINCRBY', P .. 'ixo', owner, after)
end
return {'OK', after, cut_by}
