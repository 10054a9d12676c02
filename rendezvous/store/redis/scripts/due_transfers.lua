-- Due transfers are pushed to hold_until so that concurrent sweepers of other replicas skip them
-- meanwhile; the transition that expires one rewrites its deadline, and one left unswept comes due
-- again at hold_until. Entries of vanished records go. Reply: transfer ids.
local dk = P .. 'deadlines'
local out = {}
for _, tid in ipairs(redis.call('ZRANGEBYSCORE', dk, '-inf', now, 'LIMIT', 0, tonumber(limit))) do
  if redis.call('EXISTS', P .. 't:' .. tid) == 1 then
    redis.call('ZADD', dk, 'XX', hold_until, tid)
    out[#out + 1] = tid
  else
    redis.call('ZREM', dk, tid)
  end
end
return out
