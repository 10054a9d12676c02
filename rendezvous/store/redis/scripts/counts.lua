-- Reply: {live engines, flat (state, count)...}.
local out = {redis.call('ZCARD', P .. 'leases')}
for _, v in ipairs(redis.call('HGETALL', P .. 'states')) do
  out[#out + 1] = v
end
return out
