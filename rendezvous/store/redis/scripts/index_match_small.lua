-- MatchPrefixes of a small query in one script (rendezvous/store/redis/cache_index.py): index_select, then
-- index_match over the whole chain, for engine_ids (none: every indexed engine, `ixe`, when there are at most
-- `most`), answered only if all the counts take at most `budget` lookups together (an engine's count: one lookup per
-- leading member it holds, and one for the first it lacks), so no count is cut and no call runs long. An engine
-- whose lease is not live at now (as index_select judges it; now "": any) is left out. Reply:
-- {1, record, count, record, count, ...}, or {0} when the query is larger (the caller then goes the paced way).
local ids = engine_ids
if #ids == 0 then
  if redis.call('SCARD', P .. 'ixe') > tonumber(most) then
    return {0}
  end
  ids = redis.call('SMEMBERS', P .. 'ixe')
end
local wanted = {}
for _, pool in ipairs(pools) do
  wanted[pool] = true
end
local function live(id)
  if now == '' then
    return true
  end
  local expiry = redis.call('ZSCORE', P .. 'leases', id)
  return expiry ~= false and tonumber(expiry) > tonumber(now)
end
local left = tonumber(budget)
local out = {1}
for _, id in ipairs(ids) do
  local entry = redis.call('HMGET', P .. 'ix:' .. id, 'd', 'p', 'r')
  if entry[1] and (#pools == 0 or wanted[entry[2]]) and (role == '0' or entry[3] == role) and live(id) then
    local bk = P .. 'ixb:' .. id
    local n = 0
    for i = 1, #members do
      left = left - 1
      if left < 0 then
        return {0}
      end
      if redis.call('SISMEMBER', bk, members[i]) == 0 then
        break
      end
      n = i
    end
    out[#out + 1] = entry[1]
    out[#out + 1] = n
  end
end
return out
