-- A batch RPC's caller as of one instant (Store.caller): its engine record (v version, d record, o owner),
-- then, if live is 1, the size of its unsettled-transfer index (else -1), then, if usage is 1, the budget's
-- tallies as usage.lua answers them for the record's owner.
local rec = redis.call('HMGET', P .. 'e:' .. engine_id, 'v', 'd', 'o')
local owner = rec[3] or ''
local out = {rec[1], rec[2], owner, -1}
if live == '1' then
  out[4] = redis.call('SCARD', P .. 'el:' .. engine_id)
end
if usage == '1' then
  local tallies = budget_tallies(owner)
  for i = 1, #tallies do
    out[4 + i] = tallies[i]
  end
end
return out
