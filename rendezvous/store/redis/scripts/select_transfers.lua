-- Reply: flat (version, record) of the first `limit` of the given transfers (in the order given) that
-- exist and are in one of `states` ("1,2,..."); the others' records are not read.
local wanted = {}
for s in string.gmatch(states, '%d+') do
  wanted[s] = true
end
local left = tonumber(limit)
local out = {}
for _, tid in ipairs(ids) do
  if left <= 0 then
    break
  end
  local tk = P .. 't:' .. tid
  local s = redis.call('HGET', tk, 's')
  if s and wanted[s] then
    local t = redis.call('HMGET', tk, 'v', 'd')
    out[#out + 1] = t[1]
    out[#out + 1] = t[2]
    left = left - 1
  end
end
return out
