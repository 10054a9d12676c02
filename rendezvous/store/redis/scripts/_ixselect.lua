-- MatchPrefixes' selection of engines. `wanted_pools(pools)`: the pools as a set, nil when the list is empty (any);
-- `selected_entry(id, wanted, role, now)`: the index entry's record of engine `id` when it is of one of the
-- `wanted` pools (nil: any), of `role` ("0": any) and has a lease live at `now` (its expiry in `leases` past now;
-- ended engines are not there; now "": any); else nil.
local function wanted_pools(pools)
  if #pools == 0 then
    return nil
  end
  local wanted = {}
  for _, pool in ipairs(pools) do
    wanted[pool] = true
  end
  return wanted
end

local function selected_entry(id, wanted, role, now)
  local entry = redis.call('HMGET', P .. 'ix:' .. id, 'd', 'p', 'r')
  if not entry[1] or (wanted and not wanted[entry[2]]) or (role ~= '0' and entry[3] ~= role) then
    return nil
  end
  if now ~= '' then
    local expiry = redis.call('ZSCORE', P .. 'leases', id)
    if expiry == false or tonumber(expiry) <= tonumber(now) then
      return nil
    end
  end
  return entry[1]
end
