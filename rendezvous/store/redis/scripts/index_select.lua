-- MatchPrefixes' first step, a slice of engines at a time (rendezvous/store/redis/cache_index.py): which of
-- engine_ids have an entry of one of pools (none: any) and of role ("0": any), and a lease that is live at now (its
-- expiry in `leases` past now; ended engines are not there; now "": any). Reply: {record, record, ...}, in the
-- order of engine_ids.
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
local out = {}
for _, id in ipairs(engine_ids) do
  local entry = redis.call('HMGET', P .. 'ix:' .. id, 'd', 'p', 'r')
  if entry[1] and (#pools == 0 or wanted[entry[2]]) and (role == '0' or entry[3] == role) and live(id) then
    out[#out + 1] = entry[1]
  end
end
return out
