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
local wanted = wanted_pools(pools)
local left = tonumber(budget)
local out = {1}
for _, id in ipairs(ids) do
  local record = selected_entry(id, wanted, role, now)
  if record then
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
    out[#out + 1] = record
    out[#out + 1] = n
  end
end
return out
