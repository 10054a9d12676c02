-- MatchPrefixes' first step, a slice of engines at a time (rendezvous/store/redis/cache_index.py): which of
-- engine_ids have an entry of one of pools (none: any) and of role ("0": any), and a lease that is live at now (its
-- expiry in `leases` past now; ended engines are not there; now "": any). Reply: {record, record, ...}, in the
-- order of engine_ids.
local wanted = wanted_pools(pools)
local out = {}
for _, id in ipairs(engine_ids) do
  local record = selected_entry(id, wanted, role, now)
  if record then
    out[#out + 1] = record
  end
end
return out
