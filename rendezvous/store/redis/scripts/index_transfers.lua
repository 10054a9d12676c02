-- One step of bringing the id indexes of ListTransfers (page_transfers.lua) up to date with the `transfers` set,
-- `count` ids a call, so that Redis is never held for long: with `cursor`, an SSCAN step over the set whose ids
-- are added to `transfer_ids`, and to `live_ids` when their transfer is live; then, with `after` (cursor "" ends
-- the first pass), a step over `transfer_ids` whose ids the set no longer holds are dropped from both.
-- Transfers written meanwhile are indexed by commit_transfers.lua; an id is added only while the set holds it.
-- Reply: the next cursor ("0": the pass is over) | the last id looked at ("" : the pass is over).
local all_ids, live_ids = P .. 'transfer_ids', P .. 'live_ids'
local n = tonumber(count)
if cursor ~= '' then
  local step = redis.call('SSCAN', P .. 'transfers', cursor, 'COUNT', n)
  for _, tid in ipairs(step[2]) do
    redis.call('ZADD', all_ids, 0, tid)
    local s = redis.call('HGET', P .. 't:' .. tid, 's')
    if s and s ~= '5' and s ~= '6' then
      redis.call('ZADD', live_ids, 0, tid)
    end
  end
  return step[1]
end
local start = '-'
if after ~= '' then
  start = '(' .. after
end
local ids = redis.call('ZRANGEBYLEX', all_ids, start, '+', 'LIMIT', 0, n)
for _, tid in ipairs(ids) do
  if redis.call('SISMEMBER', P .. 'transfers', tid) == 0 then
    redis.call('ZREM', all_ids, tid)
    redis.call('ZREM', live_ids, tid)
  end
end
if #ids < n then
  return ''
end
return ids[n]
