-- MatchPrefixes in one step: for each engine of engine_ids (none: every indexed engine, `ixe`) that has an
-- entry of one of pools (none: any) and of role ("0": any), how many leading members of the chain its block set
-- holds; engines holding fewer than min_matched are left out. Reply: {record, matched, record, matched, ...}.
local ids = engine_ids
if #ids == 0 then
  ids = redis.call('SMEMBERS', P .. 'ixe')
end
local least = tonumber(min_matched)
local wanted = {}
for _, pool in ipairs(pools) do
  wanted[pool] = true
end
local out = {}
for _, id in ipairs(ids) do
  local entry = redis.call('HMGET', P .. 'ix:' .. id, 'd', 'p', 'r')
  if entry[1] and (#pools == 0 or wanted[entry[2]]) and (role == '0' or entry[3] == role) then
    local bk = P .. 'ixb:' .. id
    local n = 0
    for i = 1, #members do
      if redis.call('SISMEMBER', bk, members[i]) == 0 then
        break
      end
      n = i
    end
    if n >= least then
      out[#out + 1] = entry[1]
      out[#out + 1] = n
    end
  end
end
return out
