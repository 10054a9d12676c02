-- Reply: the store's revision (the `rev` key: at least that of every event read here), then {last sequence}
-- for an unknown engine's empty log, {last, 1} when start was trimmed (resync), {last, 0, flat (entry id,
-- event, peer or "")...} otherwise.
local rev = tonumber(redis.call('GET', P .. 'rev') or '0')
local ek = P .. 'e:' .. engine_id
if redis.call('EXISTS', ek) == 0 then
  return {rev, 0}
end
local last = tonumber(redis.call('HGET', ek, 'r') or '0')
local sk = P .. 's:' .. engine_id
local first = last + 1
local head = redis.call('XRANGE', sk, '-', '+', 'COUNT', 1)
if head[1] then
  first = tonumber(string.match(head[1][1], '^(%d+)'))
end
local start = tonumber(start_sequence)
if start < first then
  return {rev, last, 1}
end
local n = tonumber(limit)
local out = {rev, last, 0}
if n <= 0 or start > last then
  return out
end
for _, entry in ipairs(redis.call('XRANGE', sk, start .. '-0', '+', 'COUNT', n)) do
  local fields = entry[2]
  out[#out + 1] = entry[1]
  out[#out + 1] = fields[2]
  out[#out + 1] = fields[4] or ''
end
return out
