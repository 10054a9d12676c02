-- One step of a ListTransfers page that names no engine: up to `limit` transfers in one of `states` ("1,2,..."),
-- with ids above `after`, in id order, read from an id index (a zset of score 0, so ordered by id):
-- `live_ids` (the transfers in a live state) when `live` is "1", else `transfer_ids` (every transfer). At most
-- `count` ids are looked at, so a call costs about a page whatever the namespace holds; the caller goes on from
-- the last id looked at while its page is not full.
-- The indexes are kept by commit_transfers.lua. A namespace written before they existed, or transfers made or
-- deleted by an older replica during a rolling upgrade, leave `transfer_ids` a different size than the
-- `transfers` set, or `live_ids` smaller than the live states' count: when `check` is "1", the reply is then
-- {"I"}, and the caller brings them up to date (index_transfers.lua, a chunk a call) before it lists. An id of
-- `live_ids` whose transfer is gone or no longer live is dropped from it when a listing comes by.
-- Reply: {the last id looked at, "" when the index holds none after it; then flat (version, record) of each}.
local all_ids, live_ids = P .. 'transfer_ids', P .. 'live_ids'
if check == '1' then
  if redis.call('ZCARD', all_ids) ~= redis.call('SCARD', P .. 'transfers') then
    return {'I'}
  end
  if live == '1' then
    local n = 0
    for _, c in ipairs(redis.call('HMGET', P .. 'states', '1', '2', '3', '4')) do
      n = n + (tonumber(c) or 0)
    end
    if redis.call('ZCARD', live_ids) < n then
      return {'I'}
    end
  end
end
local start = '-'
if after ~= '' then
  start = '(' .. after
end
local n = tonumber(count)
local index = all_ids
if live == '1' then
  index = live_ids
end
local ids = redis.call('ZRANGEBYLEX', index, start, '+', 'LIMIT', 0, n)
local out = {''}
if #ids == n then
  out[1] = ids[n]
end
local function passed(tid, s)
  if live == '1' and (not s or s == '5' or s == '6') then -- gone, or ended (by an older replica): not live
    redis.call('ZREM', live_ids, tid)
  end
end
return add_selected(out, ids, states, limit, passed)
