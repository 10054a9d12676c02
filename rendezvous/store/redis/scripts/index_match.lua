-- One step of MatchPrefixes (rendezvous.store.cache_index.leading_counts): for each of engine_ids, how many of
-- members (a window of the query's chain) its block set holds in a row from the first. The caller keeps a step to
-- MATCH_STEP lookups (engines x members), so no one call holds Redis for long. Reply: {count, count, ...}, in the
-- order of engine_ids.
local out = {}
for j, id in ipairs(engine_ids) do
  local bk = P .. 'ixb:' .. id
  local n = 0
  for i = 1, #members do
    if redis.call('SISMEMBER', bk, members[i]) == 0 then
      break
    end
    n = i
  end
  out[j] = n
end
return out
