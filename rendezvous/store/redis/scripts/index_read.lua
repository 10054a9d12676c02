-- An engine's KV index entry (rendezvous/store/redis/cache_index.py) and whether its block set holds each of
-- members. Reply: {version or "", record or "", 1|0 per member}.
local k = P .. 'ix:' .. engine_id
local bk = P .. 'ixb:' .. engine_id
local entry = redis.call('HMGET', k, 'v', 'd')
local out = {entry[1] or '', entry[2] or ''}
-- In slices: unpack is bounded by Lua's stack.
for first = 1, #members, 1000 do
  local held = redis.call('SMISMEMBER', bk, unpack(members, first, math.min(first + 999, #members)))
  for i = 1, #held do
    out[#out + 1] = held[i]
  end
end
return out
