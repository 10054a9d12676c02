-- An engine's KV index entry (rendezvous/store/redis/cache_index.py) and whether its block set holds each of
-- members. Reply: {version or "", record or "", 1|0 per member}; the version is "<v>/<w>" (index_write.lua).
local k = P .. 'ix:' .. engine_id
local bk = P .. 'ixb:' .. engine_id
local entry = redis.call('HMGET', k, 'v', 'd', 'w')
local version = ''
if entry[1] then
  version = entry[1] .. '/' .. (entry[3] or '')
end
local out = {version, entry[2] or ''}
-- In slices: unpack is bounded by Lua's stack.
for first = 1, #members, 1000 do
  local held = redis.call('SMISMEMBER', bk, unpack(members, first, math.min(first + 999, #members)))
  for i = 1, #held do
    out[#out + 1] = held[i]
  end
end
return out
